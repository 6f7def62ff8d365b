"""Service checks: which stage dominates each model's latency and whether it changed against the
last hour, models whose inputs arrive in many shapes, crash loops and wedged workers, canaries,
evictions thrashing, starved clients.

Owns: the judgement of each, from the instance's arena (``shmserve.inspection``'s
snapshot: live or dead) and a live server's answers (``info`` with its
``history`` windows and each worker's ``signatures``, ``repository`` with its
canaries and lifecycle events).

Must not: ask the server anything (``context`` did), or write anything.
"""

from __future__ import annotations

import time

from shmserve import inspection, workerlink
from shmserve.doctor.checks_host import Skip
from shmserve.doctor.context import Context
from shmserve.doctor.findings import CRITICAL, INFO, WARNING, Finding

STAGES = ("queue", "copy_in", "compute", "copy_out")  # then "hand-off": total less these
STAGE_WORDS = {"queue": "queue (waiting for a worker)", "copy_in": "copy in", "compute": "compute",
               "copy_out": "copy out", "handoff": "hand-off (admission, publication and wake-ups)"}
MATTERS_US = 1000.0  # a stage other than compute must take this long on average before it is a problem
DOMINANT_SHARE = 0.5
SLOWER = 2.0  # the recent mean this many times the baseline's: the model got slower
MIN_SAMPLES = 20  # requests in a window before its mean counts
NEW_SHAPES_SHARE = 0.1  # a tenth of requests bringing an input signature the worker had not seen
MIN_NEW_SHAPES = 32
THRASH_EVICTIONS = 3  # evictions of one version within the hour
THRASH_WINDOW_S = 3600.0
STARVED_SHARE = 0.01
MIN_STARVED = 10
STARVED_CODES = ("overloaded", "timeout")


# -- which stage dominates, and against the last hour ------------------------------------------

def breakdown(stages: dict) -> dict[str, float] | None:
    """Mean microseconds per stage (and "handoff": total less the four) from ``{stage: {"count",
    "mean_us"}}``; None without requests."""
    total = stages.get("total") or {}
    if not total.get("count") or total.get("mean_us") is None:
        return None
    means = {s: float((stages.get(s) or {}).get("mean_us") or 0.0) for s in STAGES}
    means["handoff"] = max(0.0, float(total["mean_us"]) - sum(means.values()))
    means["total"] = float(total["mean_us"])
    return means


def _window_stages(window: dict) -> dict:
    return {s: {"count": c, "mean_us": (u / c if c else None)} for s, (c, u) in (window.get("stages") or {}).items()}


def stages(ctx: Context) -> list[Finding]:
    latency = (ctx.service.snapshot or {}).get("latency_us")
    if not latency:
        raise Skip("no instance to read (its arena holds each model's stage histograms)")
    history = ((ctx.service.info or {}).get("history") or {}).get("models", {})
    found = []
    for model, cumulative in sorted(latency.items()):
        means = breakdown(cumulative)
        if means is None:
            continue
        windows = history.get(model) or {}
        recent, baseline = windows.get("recent"), windows.get("baseline")
        now_means = breakdown(_window_stages(recent)) if recent and _count(recent) >= MIN_SAMPLES else None
        base_means = breakdown(_window_stages(baseline)) if baseline and _count(baseline) >= MIN_SAMPLES else None
        use = now_means or means
        over = f"the last {recent['seconds']:.0f} s" if now_means else "every request since the workers started"
        dominant = max(("handoff", *STAGES), key=lambda s: use[s])
        share = use[dominant] / use["total"] if use["total"] else 0.0
        split = ", ".join(f"{STAGE_WORDS[s].split(' (')[0]} {use[s]:.0f}" for s in ("queue", "copy_in", "compute",
                                                                                     "copy_out", "handoff"))
        evidence = f"mean {use['total']:.0f} us over {over}: {split} us (arena histograms)"
        data = {"model": model, "dominant": dominant, "share": round(share, 3),
                "means_us": {k: round(v, 1) for k, v in use.items()}}
        if base_means is not None and now_means is not None and now_means["total"] > SLOWER * base_means["total"]:
            grew = max(("handoff", *STAGES), key=lambda s: now_means[s] - base_means[s])
            found.append(Finding(
                "service.stages", WARNING, f"model {model} got {now_means['total'] / base_means['total']:.1f}x "
                f"slower than its baseline; {STAGE_WORDS[grew].split(' (')[0]} grew most", f"model {model}",
                f"mean {now_means['total']:.0f} us over the last {recent['seconds']:.0f} s "
                f"(p99 {recent.get('p99_us')} us) against {base_means['total']:.0f} us over the "
                f"{baseline['seconds']:.0f} s before (p99 {baseline.get('p99_us')} us); "
                f"{STAGE_WORDS[grew].split(' (')[0]}: {base_means[grew]:.0f} -> {now_means[grew]:.0f} us",
                f"within {SLOWER:g}x of the baseline", _why_stage(grew), _fix_stage(grew, model),
                {**data, "grew": grew, "baseline_us": {k: round(v, 1) for k, v in base_means.items()}}))
        tail = ("" if base_means is not None else
                "; no baseline yet (the server keeps one sample a minute for an hour)" if ctx.service.live else
                "; no baseline (a live server keeps one; this arena's front-end is gone)")
        if dominant != "compute" and share > DOMINANT_SHARE and use[dominant] >= MATTERS_US:
            found.append(Finding(
                "service.stages", WARNING, f"model {model}: {STAGE_WORDS[dominant]} takes {share:.0%} of its "
                f"latency", f"model {model}", evidence + tail,
                f"compute dominating; other stages under {MATTERS_US:.0f} us", _why_stage(dominant),
                _fix_stage(dominant, model), data))
        else:
            found.append(Finding(
                "service.stages", INFO, f"model {model}: {STAGE_WORDS[dominant].split(' (')[0]} dominates "
                f"({share:.0%} of {use['total']:.0f} us)", f"model {model}", evidence + tail,
                "compute dominating", "Where the time goes tells which fix can help.", "", data))
    if not found:
        raise Skip("no model has served a request yet")
    return found


def _count(window: dict) -> int:
    return int(((window.get("stages") or {}).get("total") or (0, 0))[0])


def _why_stage(stage: str) -> str:
    return {
        "queue": "Requests wait between being queued and a worker claiming them: the workers are busy with "
                 "earlier requests, or asleep and slow to wake (a CPU shared with other work, a throttled cgroup).",
        "copy_in": "Inputs are copied into the worker's view (or to the GPU) before the model runs.",
        "copy_out": "Outputs are copied out of the model's buffers (or back from the GPU) after it ran.",
        "handoff": "Time between the request being admitted and a worker claiming it, and between DONE and the "
                   "answer: scheduling, wake-ups and CPU contention, not the model.",
        "compute": "The model itself takes longer: its runtime, its threads or its device slowed down.",
    }[stage]


def _fix_stage(stage: str, model: str) -> str:
    return {
        "queue": f"if its workers are busy ('shmserve info': in flight): more workers (shmserve scale {model} N) "
                 f"or dynamic batching (max_batch_size, max_queue_delay_us); if they idle: CPUs of their own "
                 f"(cpus, host.cgroup_cpu and placement.frontend above) and spin_us",
        "copy_in": "zero-copy calls (Client.zero_copy: the inputs written in shared memory once); on a GPU, "
                   "io_mode = \"mapped\" for inputs read once",
        "copy_out": "zero-copy calls (outputs read in place); on a GPU, io_mode = \"mapped\"",
        "handoff": "check host.cgroup_cpu, placement.frontend and host.smt above; CPUs of its own for the "
                   "front-end; spin_us where cores are free",
        "compute": "check placement.threads, host.cgroup_cpu, host.cpufreq and gpu.clocks above; a new model "
                   "version (shmserve repository) or input shapes (service.shapes)",
    }[stage]


# -- models whose inputs arrive in many shapes --------------------------------------------------

def shapes(ctx: Context) -> list[Finding]:
    if not ctx.service.live:
        raise Skip("needs a live instance: workers report the input signatures they met to it")
    per_model: dict[str, list] = {}
    for w in ctx.service.workers():
        if isinstance(w.signatures, dict):
            per_model.setdefault(w.model, []).append(w)
    if not per_model:
        raise Skip("no worker reports input signatures (a server older than doctor)")
    found = []
    for model, workers in sorted(per_model.items()):
        new = sum(int(w.signatures.get("new") or 0) for w in workers)
        calls = sum(w.requests for w in workers)
        distinct = max(int(w.signatures.get("distinct") or 0) for w in workers)
        if new < MIN_NEW_SHAPES or not calls or new / calls < NEW_SHAPES_SHARE:
            continue
        found.append(Finding(
            "service.shapes", WARNING, f"model {model}: inputs arrive in many shapes", f"model {model}",
            f"{new} of {calls} requests brought an input signature their worker had not met before; up to "
            f"{distinct} distinct per worker (info: workers[].signatures; requests: the worker table)",
            f"a few signatures: under {NEW_SHAPES_SHARE:.0%} of requests new",
            "Runtimes plan (and compile) per input shape: ONNX Runtime re-plans its memory and copies outputs "
            "whose shapes it has not checked, torch runs eager instead of a captured CUDA graph, torch.compile "
            "recompiles, TensorRT re-runs shape inference, caches keyed by shape miss.",
            "pad inputs to a few fixed sizes at the client (buckets of the dynamic dimensions), and warm those "
            "(warmup.batch_sizes, warmup.inputs); with batching, preferred_batch_sizes",
            {"model": model, "new": new, "calls": calls, "distinct": distinct}))
    return found


# -- crash loops, wedged workers, restarts ------------------------------------------------------

def workers(ctx: Context) -> list[Finding]:
    snap = ctx.service.snapshot
    if snap is None:
        raise Skip("no instance to read")
    found = []
    if not snap.get("owner_alive"):
        found.append(Finding(
            "service.workers", CRITICAL, "the instance's front-end is gone", f"instance {snap['instance']}",
            f"front-end pid {snap.get('owner_pid')} is not running; its arena {snap.get('arena')} is left",
            "a live front-end", "Nothing serves this instance's clients; its arena holds what it was doing when "
            "it died (shmserve inspect).", "journalctl -u shmserve (why it died), then systemctl restart shmserve "
            "(the start removes the dead arena; 'shmserve cleanup' does it by hand)",
            {"owner_pid": snap.get("owner_pid")}))
        return found  # a dead front-end's worker table is history
    for w in ctx.service.workers():
        if w.crash_streak >= workerlink.CRASH_LOOP_DEATHS:
            found.append(Finding(
                "service.workers", CRITICAL, f"model {w.model}: a worker is crash-looping", w.who,
                f"{w.crash_streak} deaths in a row, each before it served restart_healthy_s"
                + (f"; last exit: {w.last_exit}" if w.last_exit else ""), "0 or 1 deaths in a row",
                "A crash-looping worker serves almost nothing, and each restart waits longer (up to 30 s).",
                "journalctl -u shmserve | grep 'worker' (why it dies: out of memory, a segfault in the runtime); "
                "'shmserve health' shows the model's state", {"worker": w.index, "crash_streak": w.crash_streak}))
        elif w.state == "ready" and w.alive and (w.heartbeat_age_s or 0) > inspection.WORKER_SILENT_S:
            found.append(Finding(
                "service.workers", CRITICAL, f"model {w.model}: a worker is wedged", w.who,
                f"its heartbeat is {w.heartbeat_age_s:.0f} s old (the arena's worker table)",
                f"a heartbeat every 0.5 s; silent over {inspection.WORKER_SILENT_S:.0f} s is wedged",
                "A wedged worker holds its requests: they wait until the supervisor terminates it at twice "
                "worker_timeout_s, and systemd's watchdog is not fed meanwhile.",
                f"py-spy dump --pid {w.pid} (where it hangs); a model call that holds the GIL longer than "
                f"worker_timeout_s needs a larger worker_timeout_s", {"worker": w.index}))
        elif w.state == "dead" and w.restarts == 0 and w.crash_streak == 0 and not w.alive:
            continue  # never started (failed to load): the repository says why (service.models)
        elif w.restarts:
            found.append(Finding(
                "service.workers", WARNING, f"model {w.model}: a worker was restarted", w.who,
                f"{w.restarts} restart(s)" + (f"; last exit: {w.last_exit}" if w.last_exit else ""),
                "no restarts", "Each death fails the request it was running (worker_crashed) and leaves its model "
                "a worker short until the restart.", "journalctl -u shmserve (what ended it: the exit code or "
                "signal above)", {"worker": w.index, "restarts": w.restarts}))
    for s in snap.get("stuck", []):
        found.append(Finding(
            "service.workers", WARNING, f"model {s['model']}: a request has been running for {s['running_s']} s",
            f"slot {s['slot']} (request {s['request_id']}, worker {s['worker']})",
            f"RUNNING for {s['running_s']} s (the arena's slot table)", f"under {inspection.STUCK_AFTER_S:.0f} s",
            "One request holding its worker this long blocks everything queued behind it.",
            "shmserve inspect (which worker), py-spy dump --pid <its pid>", dict(s)))
    for m in (ctx.service.repository or {}).get("models", []):
        if m.get("state") == "unavailable":
            found.append(Finding(
                "service.workers", CRITICAL, f"model {m['name']} is unavailable", f"model {m['name']} v{m.get('version')}",
                str(m.get("reason") or "?"), "ready", "Its requests fail model_unavailable.",
                "fix what the reason says, then shmserve load " + m["name"], {"model": m["name"]}))
    return found


# -- canaries -------------------------------------------------------------------------------

RUNNING = ("ramping", "shadowing", "verified")


def canaries(ctx: Context) -> list[Finding]:
    if not ctx.service.live:
        raise Skip("needs a live instance: canaries are the front-end's")
    found = []
    for name, c in sorted(((ctx.service.repository or {}).get("canaries") or {}).items()):
        last = (c.get("decisions") or [{}])[-1]
        versions = f"version {c['candidate']['version']} against {c['stable']['version']}"
        if c.get("state") in RUNNING:
            found.append(Finding(
                "service.canaries", INFO, f"model {name}: a canary is running", f"model {name}",
                f"{versions}: {c['state']} at {c.get('percent', 0):g}% ({c.get('mode')})",
                "", "Part of the traffic goes to the candidate: its latency and errors are in this model's "
                "numbers.", "", {"model": name, "state": c["state"]}))
        elif c.get("state") == "rolled_back" and (last.get("ago_s") or 0) < THRASH_WINDOW_S:
            found.append(Finding(
                "service.canaries", WARNING, f"model {name}: a canary was rolled back", f"model {name}",
                f"{versions}: rolled back {last.get('ago_s', 0):.0f} s ago: {last.get('reason')}",
                "a candidate that holds the thresholds", "While it ran, the share of traffic it took saw its "
                "errors or its latency.", f"shmserve canary {name} status (the decisions); fix the candidate "
                "before starting it again", {"model": name, "reason": last.get("reason")}))
    return found


# -- evictions thrashing ------------------------------------------------------------------------

def evictions(ctx: Context) -> list[Finding]:
    if not ctx.service.live:
        raise Skip("needs a live instance: the lifecycle's events are the front-end's")
    now = time.time()
    counts: dict[tuple, list] = {}
    for e in (ctx.service.repository or {}).get("events", []):
        if e.get("event") == "evict" and now - float(e.get("time_unix") or 0) <= THRASH_WINDOW_S:
            counts.setdefault((e["model"], e.get("version")), []).append(e)
    found = []
    for (model, version), events in sorted(counts.items()):
        if len(events) < THRASH_EVICTIONS:
            continue
        found.append(Finding(
            "service.evictions", WARNING, f"model {model} v{version} is loaded and evicted over and over",
            f"model {model} v{version}", f"{len(events)} evictions in the last hour (repository events); last: "
            f"{events[-1].get('reason')}", f"fewer than {THRASH_EVICTIONS} an hour",
            "Each eviction makes the next request wait for a whole load and warm-up, and evicts another "
            "version to make room: the memory budget is too small for the models in use.",
            "raise memory_budget for the device in [server], set pinned = true on the models that must stay, "
            "or serve fewer on_demand versions on this host", {"model": model, "version": version,
                                                                "evictions": len(events)}))
    return found


# -- starved clients --------------------------------------------------------------------------

def starved(ctx: Context) -> list[Finding]:
    if not ctx.service.live:
        raise Skip("needs a live instance: refusals are counted by the front-end")
    history = ((ctx.service.info or {}).get("history") or {}).get("models")
    if history is None:
        raise Skip("the server does not report its history (a server older than doctor)")
    found = []
    for model, windows in sorted(history.items()):
        recent = windows.get("recent") or {}
        outcomes = recent.get("outcomes") or {}
        answered = sum(int(n) for n in outcomes.values())
        refused = {c: int(outcomes.get(c, 0)) for c in STARVED_CODES if outcomes.get(c)}
        if not answered or sum(refused.values()) < MIN_STARVED or sum(refused.values()) / answered < STARVED_SHARE:
            continue
        found.append(Finding(
            "service.starved", WARNING, f"model {model}: clients are refused or time out", f"model {model}",
            ", ".join(f"{n} {c}" for c, n in refused.items()) + f" of {answered} requests over the socket and "
            f"v2 doors in the last {recent.get('seconds', 0):.0f} s (info: history)",
            f"under {STARVED_SHARE:.0%}", "Those clients got no answer: the arena, the model's queue or a per-uid "
            "limit was full, or their requests waited past request_timeout_s.",
            "more workers for the model (shmserve scale), a larger arena ([arena] slots, size_classes), "
            "max_waiting, or the per-uid limits (max_inflight_per_uid) where one uid crowds the others out "
            "(docs/config.md)", {"model": model, "refused": refused, "answered": answered}))
    return found
