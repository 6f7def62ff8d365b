"""`shmserve inspect`: a read-only look inside a live or dead instance.

Owns: turning an arena (mapped read-only, decoded only through
``shmserve.layout``) into a snapshot (header, owner liveness, workers, slots by
state, stuck slots, per-model stage latencies, queues by priority level,
occupancy, leftover arenas),
its health verdict for ``--check``, and its rendering as a rich table or JSON.

Must not: write to the arena, or trust it: a corrupt or foreign segment is
refused with the layout error; values are read as they are (a live arena
changes while it is read, so counts are a moment's approximation).
"""

from __future__ import annotations

import os
import time

from shmserve import layout, placement, stale, workerlink
from shmserve.arena import Arena
from shmserve.slotstate import SlotState, state_name

STUCK_AFTER_S = 30.0
WORKER_SILENT_S = 10.0
_SLOT_AGE_FIELD = {SlotState.WRITING: "t_acquired", SlotState.READY: "t_ready", SlotState.RUNNING: "t_claimed",
                   SlotState.DONE: "t_done", SlotState.ERROR: "t_done"}


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _percentile(counts: list[int], q: float) -> float | None:
    bound = layout.hist_quantile(counts, q)
    return None if bound is None else float(bound)  # in microseconds


def snapshot(instance: str, *, stuck_after_s: float = STUCK_AFTER_S) -> dict:
    """Everything ``inspect`` shows about one instance.  Raises ArenaNotFound, ArenaSquatted if
    the name is held by anything but a regular file with a mode shmserve makes (never opened, so
    a FIFO cannot block), ArenaError for a segment that cannot be read or decoded."""
    arena = Arena.attach(instance, read_only=True, prefault=False)
    try:
        return _read(arena, stuck_after_s)
    finally:
        arena.close()


def _read(arena: Arena, stuck_after_s: float) -> dict:
    buf, g, info = arena.buf, arena.geometry, arena.info
    now_mono, now_wall = time.monotonic_ns(), time.time_ns()
    records = stale.list_arenas(arena.instance)
    owner_alive = bool(records) and records[0].owner_alive
    heartbeat = arena.heartbeat_ns()
    out = {
        "instance": arena.instance, "arena": arena.name, "size": g.total_size, "layout_version": layout.LAYOUT_VERSION,
        "state": layout.ARENA_STATE_NAMES.get(arena.state(), str(arena.state())),
        "owner_pid": info.owner_pid, "owner_alive": owner_alive, "owner_uid": arena.owner_uid,
        "socket": info.socket_path,
        "created_unix": info.created_unix_ns / 1e9, "uptime_s": round((now_wall - info.created_unix_ns) / 1e9, 1),
        "owner_heartbeat_age_s": round((now_mono - heartbeat) / 1e9, 3) if heartbeat else None,
    }
    workers = []
    names: dict[int, str] = {}
    for i in range(g.max_workers):
        w = layout.WORKER.read(buf, g.worker_off(i))
        if w.state == layout.WORKER_EMPTY:
            continue
        name = w.name.rstrip(b"\0").decode("utf-8", "replace")
        names[i] = name
        cpus, unseen = layout.decode_cpu_mask(w.cpu_count, w.cpu_mask)
        workers.append({
            "index": i, "model": name, "version": w.version, "device": w.device.rstrip(b"\0").decode("utf-8", "replace"), "pid": w.pid,
            "state": layout.WORKER_STATE_NAMES.get(w.state, str(w.state)), "alive": _pid_alive(w.pid),
            "heartbeat_age_s": round((now_mono - w.heartbeat_ns) / 1e9, 3) if w.heartbeat_ns else None,
            "requests": w.requests, "errors": w.errors, "restarts": w.restarts, "crash_streak": w.crash_streak,
            "restart_in_s": (round(max(0.0, (w.restart_at_ns - now_mono) / 1e9), 3)
                             if w.restart_at_ns and w.state == layout.WORKER_DEAD else None),
            # the CPUs it was pinned to (None: not pinned); CPUs from 1024 on are only counted
            "cpus": None if cpus is None else placement.format_cpulist(cpus) + (f" +{unseen} more" if unseen else ""),
        })
    out["workers"] = workers
    counts: dict[str, int] = {s.name: 0 for s in SlotState}
    oldest: dict[str, float] = {}
    stuck = []
    for i in range(g.slot_count):
        _, state = arena.slot_status(i)
        sname = state_name(state)
        counts[sname] = counts.get(sname, 0) + 1
        field = _SLOT_AGE_FIELD.get(state) if state in SlotState._value2member_map_ else None
        if field is None:
            continue
        slot = layout.SLOT.read(buf, g.slot_off(i))
        stamp = getattr(slot, field)
        if not stamp:
            continue
        age = (now_mono - stamp) / 1e9
        oldest[sname] = round(max(oldest.get(sname, 0.0), age), 3)
        if state == SlotState.RUNNING and age > stuck_after_s:
            stuck.append({"slot": i, "request_id": slot.request_id, "worker": slot.worker,
                          "model": names.get(slot.worker, "?"), "running_s": round(age, 1)})
    out["slots"] = {"total": g.slot_count, "by_state": counts, "oldest_age_s": oldest}
    out["stuck"] = stuck
    latency: dict[str, dict] = {}
    for model in sorted(set(names.values())):
        per_stage = {}
        for stage in layout.HIST_STAGES:  # stage times in us; "batch_size" in requests per run
            buckets, total_us = layout.read_histograms(buf, g, [i for i, name in names.items() if name == model],
                                                       stage)
            n = sum(buckets)
            per_stage[stage] = {"count": n, "mean_us": round(total_us / n, 1) if n else None,
                                "p50_us": _percentile(buckets, 0.5), "p90_us": _percentile(buckets, 0.9),
                                "p99_us": _percentile(buckets, 0.99)}
        latency[model] = per_stage
    out["latency_us"] = latency
    out["queues"] = queues(buf, g, workers)
    out["occupancy"] = {"slots_in_use": arena.stat("slots_in_use"), "slots": g.slot_count,
                        "bytes_in_use": arena.stat("extent_bytes_in_use"), "data_bytes": g.data_size}
    out["stats"] = {name: arena.stat(name) for name in layout.STAT_NAMES}
    out["regions"] = [{
        "id": r.id, "kind": layout.REGION_KIND_NAMES[r.kind], "size": r.size, "owner_pid": r.owner_pid,
        "owner_uid": None if r.owner_uid == layout.NO_UID else r.owner_uid, "worker": None if r.worker == layout.NO_WORKER else r.worker,
        "model": names.get(r.worker, f"#{r.model_id}") if r.kind == layout.REGION_LANE else None,
        "age_s": round((now_wall - r.created_unix_ns) / 1e9, 1)} for r in layout.read_regions(buf, g)]
    out["problems"] = problems(out)
    return out


def queues(buf, g, workers: list[dict]) -> list[dict]:
    """Each model version's queue by priority level, from its workers' scheduling counters
    (``status.queue_status``): levels 1 up to the highest with any count (the arena does not say a
    model's priority_levels); a worker that is not starting or ready, or whose pid is gone, holds
    no queue (its gauge is its last word)."""
    from shmserve.frontend.status import queue_status

    groups: dict[tuple[str, int], list[tuple[int, bool]]] = {}
    for w in workers:
        live = w["state"] in ("starting", "ready") and w["alive"]
        groups.setdefault((w["model"], w["version"]), []).append((w["index"], live))
    return [{"model": model, "version": version, **queue_status(buf, g, members).to_dict()}
            for (model, version), members in sorted(groups.items())]


def problems(snap: dict) -> list[str]:
    """Why an instance is unhealthy (empty if it is healthy): its front-end gone; it is stopping;
    a model with no ready worker (unavailable: every worker failed for good; else restarting or
    still loading); a worker gone, silent, failed, waiting to restart or crash-looping; a stuck slot.
    A model is judged only while the front-end lives (a dead one's table is history)."""
    found = []
    if not snap["owner_alive"]:
        found.append(f"front-end pid {snap['owner_pid']} is gone (run 'shmserve cleanup')")
    elif snap["state"] == "stopping":
        found.append("the instance is shutting down")
    elif snap["state"] == "live":
        for model, workers in _by_model(snap["workers"]).items():
            if any(w["state"] == "ready" and w["alive"] for w in workers):
                continue
            if all(_failed(w) for w in workers):
                found.append(f"model {model} is unavailable: all {plural(len(workers), 'worker')} failed and "
                             f"will not be restarted (the server's log says why)")
            else:
                found.append(f"model {model} has no ready worker (0 of {len(workers)} ready)")
    for w in snap["workers"]:
        who = f"worker {w['index']} ({w['model']})"
        if w["state"] == "ready" and not w["alive"]:
            found.append(f"{who} pid {w['pid']} is gone")
        elif w["state"] == "ready" and (w["heartbeat_age_s"] or 0) > WORKER_SILENT_S:
            found.append(f"{who} silent for {w['heartbeat_age_s']:.0f} s")
        elif snap["owner_alive"] and snap["state"] == "live" and _failed(w):
            found.append(f"{who} failed and will not be restarted")
        elif w["restart_in_s"] is not None:
            found.append(f"{who} died and restarts in {w['restart_in_s']:.1f} s "
                         f"({plural(w['restarts'], 'restart')} so far)")
        if w["crash_streak"] >= workerlink.CRASH_LOOP_DEATHS:
            found.append(f"{who} is crash-looping: {w['crash_streak']} deaths in a row, "
                         f"each before it served restart_healthy_s")
    for s in snap["stuck"]:
        found.append(f"slot {s['slot']} (request {s['request_id']}, model {s['model']}) running for {s['running_s']} s")
    return found


def _failed(worker: dict) -> bool:
    """Dead with no restart scheduled: the supervisor gave up on it (``restart_at_ns`` is set for
    every restart it schedules and cleared when it spawns)."""
    return worker["state"] == "dead" and worker["restart_in_s"] is None


def _by_model(workers: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for w in workers:
        out.setdefault(w["model"], []).append(w)
    return out


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 worker', '2 workers' ('2 processes' with ``many="processes"``)."""
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def leftovers() -> list[dict]:
    """Arenas of instances whose owner is gone, and entries under our names that a cleanup by this
    user leaves alone (``refused`` says why and what to do; empty for a removable leftover)."""
    return [{"name": r.name, "instance": r.instance, "size": r.size, "owner_pid": r.owner_pid, "reason": r.reason,
             "uid": r.uid, "refused": r.refused}
            for r in stale.list_arenas() if r.stale or (r.refused and not r.owner_alive)]


def _batch_range(upper: int) -> str:
    """The batch sizes of the histogram bucket whose exclusive upper bound is ``upper``:
    ``[upper / 2, upper)`` ("4-7"), and just 1 for the lowest."""
    low, high = max(1, upper // 2), upper - 1
    return str(low) if low == high else f"{low}-{high}"


def render_lifecycle(lifecycle: dict):
    """A rich renderable of a live server's model lifecycle (its ``repository`` answer): versions
    (with their cancelled requests: taken back before a worker claimed them / while one ran them /
    once answered), canaries, the latest decisions, and the rate limits with their refusals."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    versions = Table(title="model versions", title_justify="left")
    for col in ("model", "version", "state", "default", "cancelled q/r/a", "reason"):
        versions.add_column(col)
    for m in lifecycle.get("models", []):
        c = m.get("cancelled") or {}
        versions.add_row(Text(m["name"]), str(m.get("version") or "-"), m["state"], "yes" if m.get("default") else "",
                         "/".join(str(c.get(stage, 0)) for stage in ("queued", "running", "answered")) if c else "",
                         Text(m.get("reason") or ""))
    parts = [versions]
    for name, c in sorted(lifecycle.get("canaries", {}).items()):
        parts.append(Text(f"canary {name}: version {c['candidate']['version']} vs {c['stable']['version']}: "
                          f"{c['state']}, {c['percent']:g}% ({c['mode']})"))
    events = Table(title="lifecycle decisions (latest last)", title_justify="left")
    for col in ("time", "model", "version", "event", "reason"):
        events.add_column(col)
    for e in lifecycle.get("events", [])[-EVENTS_SHOWN:]:
        events.add_row(time.strftime("%H:%M:%S", time.localtime(e["time_unix"])), Text(e["model"]),
                       str(e["version"]), e["event"], Text(e["reason"]))
    parts.append(events)
    if lifecycle.get("rate_limits"):
        limits = Table(title="rate limits (\\[rate_limits]): refusals since start", title_justify="left")
        for col in ("limit", "model", "requests/s", "burst", "bytes/s", "burst bytes", "callers", "refused"):
            limits.add_column(col, justify="left" if col in ("limit", "model") else "right")
        for r in lifecycle["rate_limits"]:
            limits.add_row(Text(r["limit"]), Text(r["model"]), *("-" if r[k] is None else f"{r[k]:g}" for k in (
                "requests_per_s", "burst", "bytes_per_s", "burst_bytes")), str(r["callers"]), str(r["refused"]))
        parts.append(limits)
    return Group(*parts)


EVENTS_SHOWN = 20


def render_queues(queues: list[dict], title: str = "queues by priority level (1 is claimed first): held "
                                                      "unclaimed now, claimed so far, their mean wait"):
    """A rich table of ``queues`` (``inspect``'s and ``info``'s): a row per model version and level,
    the version's expired and demoted requests on its first row."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left")
    for col in ("model", "priority", "queued", "claimed", "mean wait", "expired", "demoted"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for q in queues:
        for i, lv in enumerate(q["levels"]):
            wait = "-" if lv["mean_wait_us"] is None else f"{lv['mean_wait_us']:.0f} µs"
            table.add_row(Text(f"{q['model']}:{q['version']}") if i == 0 else "", str(lv["level"]), str(lv["queued"]),
                          str(lv["claimed"]), wait, *((str(q["expired"]), str(q["demoted"])) if i == 0 else ("", "")))
    return table


def render(snap: dict):
    """A rich renderable of one snapshot."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    alive = "[green]alive[/]" if snap["owner_alive"] else "[red]DEAD[/]"
    head = Text.from_markup(  # instance and socket come from the header: text, never markup
        f"[bold]{escape(snap['instance'])}[/]  {escape(snap['arena'])}  {snap['size'] >> 20} MiB  "
        f"state {snap['state']}  owner pid {snap['owner_pid']} {alive} uid {snap['owner_uid']}  "
        f"up {snap['uptime_s']:.0f} s  socket {escape(snap['socket'] or '?')}")
    workers = Table(title="workers", title_justify="left")
    for col in ("#", "model", "device", "cpus", "pid", "state", "heartbeat", "requests", "errors", "restarts"):
        workers.add_column(col, justify="right" if col in ("#", "pid", "requests", "errors", "restarts") else "left")
    for w in snap["workers"]:
        age = "-" if w["heartbeat_age_s"] is None else f"{w['heartbeat_age_s']:.1f} s ago"
        state = w["state"] if w["alive"] or w["state"] == "dead" else f"{w['state']} (gone)"
        if w["restart_in_s"] is not None:
            state += f", restart in {w['restart_in_s']:.1f} s"
        model = f"{w['model']}:{w['version']}" if w.get("version") else w["model"]
        workers.add_row(str(w["index"]), Text(model), Text(w["device"]), w.get("cpus") or "any", str(w["pid"]), state,
                        age, str(w["requests"]),
                        str(w["errors"]), str(w["restarts"]))
    slots = Table(title="slots", title_justify="left")
    slots.add_column("state")
    slots.add_column("count", justify="right")
    slots.add_column("oldest", justify="right")
    for state, n in snap["slots"]["by_state"].items():
        age = snap["slots"]["oldest_age_s"].get(state)
        slots.add_row(state, str(n), "-" if age is None else f"{age:.2f} s")
    lat = Table(title="latency per stage (p50, p90, p99: histogram bucket upper bounds); batch size in requests "
                      "per run (p50, p90, p99: the bucket's range)", title_justify="left")
    for col in ("model", "what", "samples", "mean", "p50", "p90", "p99"):
        lat.add_column(col, justify="left" if col in ("model", "what") else "right")
    for model, stages in snap["latency_us"].items():
        for stage, v in stages.items():
            if not v["count"]:
                continue
            quantiles = [v[k] for k in ("p50_us", "p90_us", "p99_us")]
            if stage == "batch_size":
                lat.add_row(Text(model), "batch size (requests per run)", plural(v["count"], "run"),
                            f"{v['mean_us']:.1f}", *(_batch_range(int(q)) for q in quantiles))
            else:
                lat.add_row(Text(model), f"{stage} time", plural(v["count"], "request"), f"{v['mean_us']:.0f} µs",
                            *(f"{q:.0f} µs" for q in quantiles))
    occ = snap["occupancy"]
    parts = [head, workers, slots, lat]
    if snap.get("queues"):
        parts.append(render_queues(snap["queues"]))
    parts += [
             Text(f"arena occupancy: {occ['slots_in_use']} of {plural(occ['slots'], 'slot')} in use, "
                  f"{occ['bytes_in_use'] >> 20} of {occ['data_bytes'] >> 20} MiB of data")]
    if snap["regions"]:
        regions = Table(title="client regions and lanes (sealed memfds, the front-end's records)",
                        title_justify="left")
        for col in ("id", "kind", "size", "owner pid", "uid", "worker", "model", "age"):
            regions.add_column(col, justify="left" if col in ("kind", "model") else "right")
        for r in snap["regions"]:
            regions.add_row(str(r["id"]), r["kind"], f"{r['size']:,}", str(r["owner_pid"]), str(r["owner_uid"]),
                            "-" if r["worker"] is None else str(r["worker"]), r["model"] or "-", f"{r['age_s']:.0f} s")
        parts.append(regions)
    if snap["stuck"]:
        stuck = Table(title="stuck slots", title_justify="left")
        for col in ("slot", "request", "model", "worker", "running"):
            stuck.add_column(col)
        for s in snap["stuck"]:
            stuck.add_row(str(s["slot"]), str(s["request_id"]), s["model"], str(s["worker"]), f"{s['running_s']} s")
        parts.append(stuck)
    for p in snap["problems"]:
        parts.append(Text.from_markup(f"[red]problem:[/] {p}"))
    return Group(*parts)
