"""`shmserve bench`: request latency and throughput next to floors measured in the same run.

Owns: the benchmark.  For each payload size, mode and client count (a sweep:
``--clients 1,2,4,8``) it runs that many client processes against a server
(its own with ``--spawn-server``, else the one at ``--socket``, measuring a
model it lists) and reports p50/p90/p99/max latency, requests/s and GB/s,
with the ratio to the floor measured in the same run on the same machine.
Clients send back to back (closed loop), or at a fixed total rate
(``--rate N``, open loop, like perf_analyzer's request-rate mode: each
request is due at its time whether or not the last one is back, and its
latency counts from when it was due, so a server that falls behind shows it).
``--plot`` draws the latency percentiles of every case (matplotlib, the
``plot`` extra).  The floors:

* the floor for a round trip: a uvloop Unix-socket echo of the same payload
  (a server process echoing, a client sending and reading it back);
* for payloads of 1 MiB and more, also one memcpy of the payload into POSIX
  shared memory (the unavoidable copy of the inline path), added to the echo.

GB/s counts request payload bytes (the same amount comes back).  Machines here
are shared and noisy: compare ratios within one run, not numbers across runs.

``--during-swap [N]`` measures something else, in one run with the same client
processes and payload: the steady state for ``--duration`` seconds, then the
same while a control client moves the model's default version N times back and
forth (``Client.load``, each waiting for its load to return).  It reports both
phases' p50/p99/max and requests/s, their ratio, the failed requests (any is a
failure of the run: exit 1) and the swap durations.  ``--spawn-server`` serves
a temporary model repository holding ``swap`` (uint8 in, ``x + version`` out,
versions 1 and 2), and the clients also count answers by version (one that is
no version's fails the run too); against a running server ``--model`` names a
model with at least two versions.

``--during-canary [PERCENT]`` is the same with a split canary instead of swaps:
the steady state, then the same while the model's other version is a canary
candidate taking PERCENT % (default 30) of the traffic, held there (a plan
that never steps or decides), then aborted (the candidate is unloaded).  With
lanes, the clients' calls go through the lane of the version the split picks
(docs/models.md, "Canaries and lanes"): the table's "during / steady" p50 is
the cost of a canary to lane traffic.  The answers by version show the split.

``--priority-mix LEVEL:CLIENTS[,...]`` (e.g. ``1:2,9:6``) measures priorities
(issue 29): client processes at each level (``Client.infer(..., priority=)``)
against one model, each level's clients alone for ``--duration`` seconds (the
others idle: that level's floor, in the same run), then every client together.
Per level it reports both phases' req/s, p50 and p99, the p99 together over
alone, its share of the req/s and the req/s it lost, beside the share the
levels above it took, and what the server counted meanwhile (its ``info``:
each level's queue, claims and mean wait; expired, demoted, cancelled and
rate-limited requests).  ``--spawn-server`` serves ``sleepy`` (one worker that
sleeps ``--model-us`` a request: saturated by a few clients, the CPUs left to
them) with the levels named; against a running server ``--model`` names a
model with ``priority_levels``.  ``--mix`` reports every client's req/s too:
the least and most served, and their ratio.

Must not: start anything it does not own (``--spawn-server`` starts and stops
its own server on a temporary socket), or leave segments in /dev/shm.  Every
process it starts runs in a session of its own and is stopped by it (its
``finally`` blocks): Ctrl-C reaches bench alone, never a child still importing
(which would print a KeyboardInterrupt traceback).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from shmserve import bench_v2
from shmserve.bench_v2 import MODES

MODEL = "identity"  # uint8 vector in, the same vector out (shmserve.models:identity)
# For a model whose rows are larger than the payload asked for (the demo's image is 12 KiB a row)
# one row is sent: the table's "tensor" column says what really went, and GB/s counts that.
UNITS = {"": 1, "B": 1, "KIB": 1024, "KB": 1000, "MIB": 1 << 20, "MB": 1000 ** 2, "GIB": 1 << 30}

RUN_ID = uuid.uuid4().hex[:8]  # names this run's server instance and segments (its JSON says it)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    num = text.rstrip("KMGIB")
    unit = text[len(num):]
    try:
        size = int(float(num) * UNITS[unit])
    except (KeyError, ValueError, OverflowError):
        size = 0
    if size <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 64, 4KiB, 16MiB)")
    return size


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


# -- client processes -------------------------------------------------------------------------

def make_input(spec: dict, size: int, rng) -> tuple[str, np.ndarray]:
    """An input for a model with one input: its dynamic leading dimension sized so the tensor is
    about ``size`` bytes (at least one row); other dynamic dimensions are 1."""
    (tensor,) = spec["inputs"]
    dtype = np.dtype(tensor["dtype"])
    rest = [d if isinstance(d, int) and d >= 0 else 1 for d in tensor["shape"][1:]]
    row = dtype.itemsize * int(np.prod(rest, dtype=np.int64))
    first = tensor["shape"][0] if tensor["shape"] else None
    rows = first if isinstance(first, int) and first >= 0 else max(1, size // max(row, 1))
    shape = ([rows] if tensor["shape"] else []) + rest
    if dtype.kind == "f":
        x = rng.standard_normal(shape).astype(dtype)
    else:
        x = rng.integers(0, 100, shape).astype(dtype)
    return tensor["name"], x


WARMUP = 20  # requests per client before it reports ready


def prepare(c, mode: str, size: int, model: str, protocol: str = "unix", priority: int = 0):
    """(run, call, x): one request of ``model`` on client ``c`` as a callable (``call``: what to
    release or close at the end, None inline; ``x``: the input), after ``WARMUP`` of them; then
    says "ready" on stdout.  ``protocol`` http or grpc: the request goes through that v2 door of
    the same server (its address from ``info``), ``mode`` inline or shm.  ``priority``: the
    level of each native call (``Client.infer(..., priority=)``; 0: none named)."""
    asked = {"priority": priority} if priority else {}
    spec = next(m for m in c.models() if m["name"] == model)
    name, x = make_input(spec, size, np.random.default_rng(os.getpid()))
    if protocol != "unix":
        from shmserve.bench_v2 import v2_call

        address = c.info()["v2"].get(protocol)
        if not address:
            raise SystemExit(f"the server does not serve {protocol} (serve --{protocol} ADDR)")
        call = run = v2_call(protocol, address, model, spec, name, x, mode)
    elif mode in ("inline", "socket"):  # the client was made with lanes=False for socket
        run = lambda: c.infer(model, {name: x}, **asked)  # noqa: E731
        call = None
    else:
        call = c.zero_copy(model, {name: (x.shape, x.dtype)}, **asked)
        call.inputs[name][...] = x
        run = call.run
    for _ in range(WARMUP):
        run()
    print("ready", flush=True)
    return run, call, x


def client_main(path: str, mode: str, size: int, requests: int, duration: float, model: str,
                rate: float = 0.0, protocol: str = "unix") -> None:
    """One benchmark client (a child process): connects and warms up, says "ready", waits for
    "go" on stdin (so that every client measures the same window, not its neighbours' start-up),
    then prints its latencies in microseconds and its measuring window as JSON.  With ``rate``
    (requests/s of this client) request i is due at start + i / rate, and its latency counts
    from then."""
    from shmserve import Client

    samples = []
    with Client(path, timeout=120, lanes=mode != "socket") as c:
        run, call, x = prepare(c, mode, size, model, protocol)
        sys.stdin.readline()
        start = time.monotonic()
        deadline = start + duration if duration else None
        t_start = time.perf_counter_ns()
        interval_ns = int(1e9 / rate) if rate else 0
        for i in range(requests):
            t0 = time.perf_counter_ns()
            if interval_ns:
                due = t_start + i * interval_ns
                if due > t0:
                    time.sleep((due - t0) / 1e9)
                t0 = due
            run()
            samples.append((time.perf_counter_ns() - t0) / 1e3)
            if deadline and time.monotonic() > deadline and i >= 10:
                break
        end = time.monotonic()
        if call is not None:
            call.release() if protocol == "unix" else call.close()
    print(json.dumps({"samples": samples, "nbytes": int(x.nbytes), "start": start, "end": end}), flush=True)


def run_case(path: str, mode: str, size: int, clients: int, requests: int, duration: float,
             model: str, rate: float = 0.0, protocol: str = "unix") -> dict:
    """Run ``clients`` client processes over one common window; requests/s counts that window only.
    ``rate``: requests/s of all of them together (0: each sends back to back)."""
    reports = run_clients(path, [mode] * clients, size, requests, duration, model, rate / clients if rate else 0.0,
                          protocol)
    samples = [s for r in reports for s in r["samples"]]
    wall = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    result = summarize(samples, wall, reports[0]["nbytes"])
    result["tensor_bytes"] = reports[0]["nbytes"]
    return result


def run_mix(path: str, mix: list[tuple[str, int]], size: int, duration: float, model: str) -> dict:
    """Clients of several modes at once (``mix``: (mode, count)), back to back for ``duration`` s:
    per mode its latencies and each of its clients' requests/s; ``fairness``, the most requests/s
    any client got over the fewest (1.0: every client the same share)."""
    modes = [mode for mode, n in mix for _ in range(n)]
    reports = run_clients(path, [MIX_V2.get(m, m) for m in modes], size, 1 << 62, duration, model, 0.0,
                          [m if m in MIX_V2 else "unix" for m in modes])
    rows, shares = [], []
    for mode, _ in mix:
        mine = [r for m, r in zip(modes, reports) if m == mode]
        rates = [len(r["samples"]) / (r["end"] - r["start"]) for r in mine]
        shares += rates
        arr = np.asarray([s for r in mine for s in r["samples"]])
        rows.append({"mode": mode, "clients": len(mine), "p50_us": round(float(np.percentile(arr, 50)), 1),
                     "p99_us": round(float(np.percentile(arr, 99)), 1),
                     "client_rps_min": round(min(rates), 1), "client_rps_max": round(max(rates), 1),
                     "rps": round(sum(rates), 1)})
    return {"payload": size, "duration_s": duration, "modes": rows,
            "client_rps_min": round(min(shares), 1), "client_rps_max": round(max(shares), 1),
            "fairness": round(max(shares) / max(min(shares), 1e-9), 2)}


def run_clients(path: str, modes: list[str], size: int, requests: int, duration: float, model: str,
                rate_each: float, protocol: str | list[str]) -> list[dict]:
    """One client process per entry of ``modes``, released together; their reports (client_main).
    ``protocol``: every client's, or a list of one per client."""
    protocols = protocol if isinstance(protocol, list) else [protocol] * len(modes)
    procs = [subprocess.Popen([sys.executable, "-P", "-m", "shmserve.bench", "--client", path, mode, str(size),
                               str(requests if not duration else 1 << 62), str(duration), model,
                               str(rate_each), proto],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
             for mode, proto in zip(modes, protocols)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a benchmark client failed to start (exit {p.wait()})")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = []
        for p in procs:
            out, _ = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"a benchmark client failed (exit {p.returncode})")
            reports.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return reports


# -- --priority-mix ----------------------------------------------------------------------------

def priority_client_main(path: str, mode: str, size: int, model: str, level: int) -> None:
    """One client of ``--priority-mix`` (a child process): connects and warms up at priority
    ``level``, says "ready" (or "failed: why", exit 1); then for each "go SECONDS" line on stdin
    sends back to back for that long and prints its JSON (latencies in µs, its window, failed
    requests by error code and the first one's message); any other line, or the end, ends it."""
    from shmserve import Client
    from shmserve.errors import ShmserveError

    with Client(path, timeout=120, lanes=mode != "socket") as c:
        try:
            run, call, x = prepare(c, mode, size, model, priority=level)
        except ShmserveError as exc:
            print(f"failed: {exc.code.name}: {exc}", flush=True)
            sys.exit(1)
        for line in sys.stdin:
            word, _, seconds = line.partition(" ")
            if word != "go":
                break
            samples, errors, first_error = [], {}, None
            start = time.monotonic()
            deadline = start + float(seconds)
            while time.monotonic() < deadline:
                t0 = time.perf_counter_ns()
                try:
                    run()
                    samples.append((time.perf_counter_ns() - t0) / 1e3)
                except ShmserveError as exc:
                    errors[exc.code.name] = errors.get(exc.code.name, 0) + 1
                    first_error = first_error or f"{exc.code.name}: {exc}"
            print(json.dumps({"samples": samples, "errors": errors, "first_error": first_error,
                              "nbytes": int(x.nbytes), "start": start, "end": time.monotonic()}), flush=True)
        if call is not None:
            call.release()


def tell(procs: list[subprocess.Popen], line: str) -> None:
    """Say ``line`` to each client process on its stdin."""
    for p in procs:
        p.stdin.write(line + "\n")
        p.stdin.flush()


def read_reports(procs: list[subprocess.Popen]) -> list[dict]:
    """The next JSON line of each client process; RuntimeError (its exit status) if one ended."""
    reports = []
    for p in procs:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"a benchmark client failed (exit {p.wait()})")
        reports.append(json.loads(line))
    return reports


def level_summary(reports: list[dict]) -> dict:
    """One level's clients' reports of one phase: requests, req/s over their common window, p50
    and p99 µs, the least and most req/s of one client, failed requests."""
    samples = [s for r in reports for s in r["samples"]]
    wall = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    rates = [len(r["samples"]) / max(r["end"] - r["start"], 1e-9) for r in reports]
    arr = np.asarray(samples or [0.0])
    return {"n": len(samples), "rps": round(len(samples) / wall, 1) if wall else 0.0,
            "p50_us": round(float(np.percentile(arr, 50)), 1), "p99_us": round(float(np.percentile(arr, 99)), 1),
            "client_rps_min": round(min(rates), 1), "client_rps_max": round(max(rates), 1),
            "failed": sum(n for r in reports for n in r["errors"].values())}


class ServerCounts:
    """What the server at ``path`` counts of ``model`` while a phase runs (its ``info``, over a
    control connection of its own): per priority level the requests its workers claimed and their
    mean wait, and the queue held at each level sampled every ``every`` seconds (mean and max);
    its expired, demoted and cancelled requests, and those its rate limits refused (``model``'s
    limits and the global ones).  A server without ``queues`` in ``info`` (older than issue 29's)
    gives None."""

    def __init__(self, path: str, model: str, every: float = 0.25):
        from shmserve import Client

        self.model, self.every = model, every
        self.client = Client(path, timeout=30, lanes=False)

    def close(self) -> None:
        self.client.close()

    def take(self) -> dict | None:
        """The counts now: {"levels": {level: (queued, claimed, wait_us)}, "expired", "demoted",
        "cancelled", "rate_limited"}, summed over the model's versions; None if the server has no
        ``queues``."""
        info = self.client.info()
        if "queues" not in info:
            return None
        levels: dict[int, tuple[int, int, int]] = {}
        out = {"expired": 0, "demoted": 0}
        for q in info["queues"]:
            if q["model"] == self.model:
                out["expired"] += q["expired"]
                out["demoted"] += q["demoted"]
                for lv in q["levels"]:
                    old = levels.get(lv["level"], (0, 0, 0))
                    levels[lv["level"]] = (old[0] + lv["queued"], old[1] + lv["claimed"], old[2] + lv["wait_us"])
        out["levels"] = levels
        out["cancelled"] = sum(c.get(stage, 0) for c in info.get("cancelled", []) if c["model"] == self.model
                               for stage in ("queued", "running", "answered"))
        out["rate_limited"] = sum(r.get("refused", 0) for r in info.get("rate_limits", [])
                                  if r.get("model") in (self.model, "*"))
        return out

    def during(self, run):
        """(``run()``'s result, what the server counted while it ran: per level ``claimed``,
        ``mean_wait_us``, ``queued_mean`` and ``queued_max``; and the run's ``expired``, ``demoted``,
        ``cancelled``, ``rate_limited``), or (result, None) for a server without ``queues``."""
        import threading

        before = self.take()
        if before is None:
            return run(), None
        samples: list[dict] = []
        stop = threading.Event()

        def sample() -> None:
            from shmserve.errors import ShmserveError

            while not stop.wait(self.every):
                try:
                    samples.append(self.take()["levels"])
                except (ShmserveError, OSError):  # the server is gone: the phase's clients say so
                    return

        sampler = threading.Thread(target=sample, name="bench-info", daemon=True)
        sampler.start()
        try:
            result = run()
        finally:
            stop.set()
            sampler.join()
        after = self.take()
        levels = {}
        for level, (_, claimed, waited) in after["levels"].items():
            claimed -= before["levels"].get(level, (0, 0, 0))[1]
            waited -= before["levels"].get(level, (0, 0, 0))[2]
            depths = [s.get(level, (0,))[0] for s in samples] or [after["levels"][level][0]]
            levels[level] = {"claimed": claimed, "mean_wait_us": round(waited / claimed, 1) if claimed > 0 else None,
                             "queued_mean": round(sum(depths) / len(depths), 1), "queued_max": max(depths)}
        return result, {"levels": levels, **{k: after[k] - before[k] for k in
                                             ("expired", "demoted", "cancelled", "rate_limited")}}


def run_priority_mix(path: str, mode: str, size: int, mix: list[tuple[int, int]], duration: float, model: str,
                     progress: "Progress") -> dict:
    """``--priority-mix``: one client process per (level, count) of ``mix``, all started and
    warmed at once; then each level's clients alone for ``duration`` s (the others idle: that
    level's floor, measured in the same run on the same server), then every client together for
    ``duration`` s.  Per level (1, the highest, first): both phases' req/s, p50 and p99; the
    p99 together over alone; its share of the req/s together; the req/s it lost (1 - together /
    alone); and the share the levels above it took (the target of issue 29: a level loses no
    more than that).  Beside each, what the server counted (``ServerCounts``: its queue at each
    level, the claims and their mean wait; the run's expired, demoted, cancelled and rate-limited
    requests).  RuntimeError if a client fails, with its reason if it said one."""
    from shmserve.inspection import plural

    procs = [(level, subprocess.Popen([sys.executable, "-P", "-m", "shmserve.bench", "--priority-client", path, mode,
                                       str(size), model, str(level)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      start_new_session=True))
             for level, n in mix for _ in range(n)]

    def phase(members: list[subprocess.Popen]) -> tuple[list[dict], dict | None]:
        tell(members, f"go {duration}")
        return counts.during(lambda: read_reports(members))

    counts = ServerCounts(path, model)
    seen = {}  # phase ("together" or a level) -> what the server counted during it
    try:
        for level, p in procs:
            said = p.stdout.readline().strip()
            if said != "ready":
                why = said.removeprefix("failed: ") if said.startswith("failed: ") else f"exit {p.wait()}"
                raise RuntimeError(f"a benchmark client at priority {level} failed to start: {why}")
        alone = {}
        for level, n in mix:
            progress.step(f"priority {level} alone ({plural(n, 'client')}, {duration:g} s)")
            alone[level], seen[level] = phase([p for lv, p in procs if lv == level])
        progress.step(f"every level together ({plural(len(procs), 'client')}, {duration:g} s)")
        together, seen["together"] = phase([p for _, p in procs])
        tell([p for _, p in procs], "end")
        for _, p in procs:
            if p.wait(60) != 0:
                raise RuntimeError(f"a benchmark client failed (exit {p.returncode})")
    finally:
        counts.close()
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    by_level = {level: [r for (lv, _), r in zip(procs, together) if lv == level] for level, _ in mix}
    rows = []
    for level, n in sorted(mix):
        rows.append({"level": level, "clients": n, "alone": level_summary(alone[level]),
                     "together": level_summary(by_level[level]),
                     "server": None if seen["together"] is None else {
                         "alone": seen[level]["levels"].get(level), "together": seen["together"]["levels"].get(level)}})
    total = sum(r["together"]["rps"] for r in rows)
    for i, r in enumerate(rows):
        a, t = r["alone"], r["together"]
        r["p99_ratio"] = round(t["p99_us"] / a["p99_us"], 2) if a["p99_us"] else None
        r["share"] = round(t["rps"] / total, 3) if total else None
        r["lost"] = round(1 - t["rps"] / a["rps"], 3) if a["rps"] else None
        r["share_above"] = round(sum(x["together"]["rps"] for x in rows[:i]) / total, 3) if total else None
    errors: dict[str, int] = {}
    everyone = [*together, *(r for rs in alone.values() for r in rs)]
    for r in everyone:
        for code, n in r["errors"].items():
            errors[code] = errors.get(code, 0) + n
    first = next((r["first_error"] for r in everyone if r["first_error"]), None)
    server = None
    if seen["together"] is not None:
        server = {k: sum(seen[ph][k] for ph in seen) for k in ("expired", "demoted", "cancelled", "rate_limited")}
    return {"payload": size, "tensor_bytes": together[0]["nbytes"], "mode": mode, "duration_s": duration,
            "mix": [list(m) for m in mix], "levels": rows, "rps": round(total, 1),
            "failed": sum(errors.values()), "errors": errors, "first_error": first, "server": server}


def summarize(samples: list[float], wall: float, size: int) -> dict:
    arr = np.asarray(samples)
    rps = len(samples) / wall if wall else 0.0
    return {"n": len(samples), "p50_us": round(float(np.percentile(arr, 50)), 1),
            "p90_us": round(float(np.percentile(arr, 90)), 1), "p99_us": round(float(np.percentile(arr, 99)), 1),
            "max_us": round(float(arr.max()), 1), "rps": round(rps, 1), "GBps": round(rps * size / 1e9, 3)}


def swap_client_main(path: str, mode: str, size: int, duration: float, model: str, check: bool) -> None:
    """One client of ``--during-swap`` (a child process): connects and warms up, says "ready";
    on each "go" line on stdin it measures a phase and prints its JSON (latencies in µs, its
    window, its failed requests by error code): the first phase lasts ``duration`` seconds, the
    second until a "stop" line arrives.  A failed request is counted, never fatal.  With
    ``check`` (the spawned ``swap`` model: ``x + version`` back) it also counts the answers by
    the version that gave them, and the wrong ones (no version's)."""
    import select

    from shmserve import Client
    from shmserve.errors import ShmserveError

    with Client(path, timeout=120) as c:
        run, call, x = prepare(c, mode, size, model)
        for phase in ("steady", "during"):
            sys.stdin.readline()
            samples, errors, first_error, answers = [], {}, None, {}
            start = time.monotonic()
            while True:
                t0 = time.perf_counter_ns()
                try:
                    out = run()
                    samples.append((time.perf_counter_ns() - t0) / 1e3)
                    if check:
                        y = out["y"]
                        version = (int(y[0]) - int(x[0])) % 256 if y.shape == x.shape and y.size else 0
                        version = version if np.array_equal(y, x + version) and version else "wrong"
                        answers[str(version)] = answers.get(str(version), 0) + 1
                except ShmserveError as exc:
                    errors[exc.code.name] = errors.get(exc.code.name, 0) + 1
                    first_error = first_error or f"{exc.code.name}: {exc}"
                if phase == "steady":
                    if time.monotonic() - start >= duration:
                        break
                elif select.select([sys.stdin], [], [], 0)[0]:
                    sys.stdin.readline()
                    break
            end = time.monotonic()
            print(json.dumps({"samples": samples, "errors": errors, "first_error": first_error,
                              "answers": answers, "nbytes": int(x.nbytes), "start": start, "end": end}), flush=True)
        if call is not None:
            call.release()


def run_swap(path: str, mode: str, size: int, clients: int, duration: float, model: str,
             versions: tuple[int, int], swaps: int, check: bool = False, canary: float | None = None) -> dict:
    """``--during-swap``: the same ``clients`` client processes measure the steady state for
    ``duration`` seconds, then again while a control client makes ``versions[0]`` and
    ``versions[1]`` the default in turn, ``swaps`` times (each ``Client.load`` waits for the new
    version to be warm and the default moved; the old one drains and is unloaded).  A swap that
    fails ends the swapping; the result says why (``swap_error``).  ``check``: the model is the
    spawned ``swap``; each phase also counts its answers by version, and the wrong ones.

    ``canary`` (``--during-canary``): instead of swaps, ``versions[0]`` is started as a split
    canary taking ``canary`` % of the traffic (held: its plan never steps nor decides), the
    second phase lasts ``duration`` seconds too, and the canary is aborted after it (a canary
    that fails to start is ``swap_error``)."""
    from shmserve import Client
    from shmserve.errors import ShmserveError

    procs = [subprocess.Popen([sys.executable, "-P", "-m", "shmserve.bench", "--swap-client", path, mode, str(size),
                               str(duration), model, "check" if check else "-"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
             for _ in range(clients)]

    def phase() -> list[dict]:
        return read_reports(procs)

    swap_seconds, swap_error = [], None
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a benchmark client failed to start (exit {p.wait()})")
        tell(procs, "go")
        steady = phase()
        if canary is not None:
            with Client(path, timeout=120) as control:
                try:
                    t0 = time.monotonic()
                    control.canary(model, "start", version=versions[0], plan=held_canary(canary))
                    swap_seconds.append(time.monotonic() - t0)
                except ShmserveError as exc:
                    swap_error = f"the canary of version {versions[0]} did not start: {exc}"
                tell(procs, "go")
                time.sleep(duration)
                tell(procs, "stop")
                during = phase()
                if not swap_error:
                    control.canary(model, "abort")
        else:
            tell(procs, "go")
            try:
                with Client(path, timeout=120) as control:
                    for i in range(swaps):
                        t0 = time.monotonic()
                        control.load(model, version=versions[i % 2])
                        swap_seconds.append(time.monotonic() - t0)
            except ShmserveError as exc:
                swap_error = f"swap {len(swap_seconds) + 1} to version {versions[len(swap_seconds) % 2]}: {exc}"
            tell(procs, "stop")
            during = phase()
        for p in procs:
            if p.wait(60) != 0:
                raise RuntimeError(f"a benchmark client failed (exit {p.returncode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    result = {"tensor_bytes": steady[0]["nbytes"], "swaps": 0 if canary is not None else swaps,
              "canary_percent": canary, "versions": list(versions),
              "swap_seconds": [round(t, 3) for t in swap_seconds], "swap_error": swap_error}
    for name, reports in (("steady", steady), ("during", during)):
        samples = [s for r in reports for s in r["samples"]]
        wall = max(r["end"] for r in reports) - min(r["start"] for r in reports)
        errors, answers = {}, {}
        for r in reports:
            for total, counts in ((errors, r["errors"]), (answers, r["answers"])):
                for key, n in counts.items():
                    total[key] = total.get(key, 0) + n
        result[name] = summarize(samples or [0.0], wall, steady[0]["nbytes"]) | {
            "n": len(samples), "seconds": round(wall, 2), "failed": sum(errors.values()), "errors": errors,
            "first_error": next((r["first_error"] for r in reports if r["first_error"]), None),
            "answers": dict(sorted(answers.items())), "wrong": answers.get("wrong", 0)}
    result["failed"] = result["steady"]["failed"] + result["during"]["failed"]
    result["wrong"] = result["steady"]["wrong"] + result["during"]["wrong"]
    result["ratio"] = {key: round(result["during"][key] / result["steady"][key], 2) if result["steady"][key] else None
                       for key in ("p50_us", "p99_us", "max_us", "rps")}
    result["swap_median_s"] = round(statistics.median(swap_seconds), 3) if swap_seconds else None
    result["swap_max_s"] = round(max(swap_seconds), 3) if swap_seconds else None
    return result


# -- floors -----------------------------------------------------------------------------------

ECHO_SERVER = """
import asyncio, signal, sys, uvloop
signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it quietly
class Echo(asyncio.Protocol):
    def connection_made(self, t): self.t = t
    def data_received(self, d): self.t.write(d)
async def main():
    server = await asyncio.get_running_loop().create_unix_server(Echo, sys.argv[1])
    print("ready", flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""


def echo_floor(size: int, reps: int) -> float:
    """p50 microseconds of a uvloop Unix-socket echo of ``size`` bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "echo.sock")
        server = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, path], stdout=subprocess.PIPE, text=True,
                                  start_new_session=True)
        try:
            server.stdout.readline()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)
            data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
            back = bytearray(size)
            view = memoryview(back)
            samples = []
            for i in range(reps + 10):
                t0 = time.perf_counter_ns()
                sock.sendall(data)
                got = 0
                while got < size:
                    got += sock.recv_into(view[got:])
                if i >= 10:
                    samples.append((time.perf_counter_ns() - t0) / 1e3)
            sock.close()
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(10)
    return float(statistics.median(samples))


def memcpy_floor(size: int, reps: int) -> float:
    """p50 microseconds of one copy of ``size`` bytes into POSIX shared memory (already touched)."""
    import posix_ipc

    name = f"/shmserve-bench-{RUN_ID}-{uuid.uuid4().hex[:8]}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
    try:
        buf = mmap.mmap(shm.fd, size)
        shm.close_fd()
        dst = np.frombuffer(buf, np.uint8)
        src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        dst[:] = 0
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            np.copyto(dst, src)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
        del dst
        buf.close()
    finally:
        posix_ipc.unlink_shared_memory(name)
    return float(statistics.median(samples))


# -- the server it may own ---------------------------------------------------------------------

SWAP_MODEL = "swap"  # --during-swap --spawn-server: versions 1 and 2 of it, in a temporary repository
SWAP_MODULE = """def f(inputs):
    return {{"y": inputs["x"] + {version}}}  # each version answers differently


f.inputs = [{{"name": "x", "dtype": "uint8", "shape": ["n"]}}]
f.outputs = [{{"name": "y", "dtype": "uint8", "shape": ["n"]}}]
"""


def swap_repository(workdir: Path) -> Path:
    """A model repository holding ``swap`` (python, two workers like ``identity``; uint8 ``x`` in,
    ``x + version`` out), versions 1 and 2, both served at start (version 2 the default)."""
    root = workdir / "repository"
    (root / SWAP_MODEL).mkdir(parents=True)
    (root / SWAP_MODEL / "config.toml").write_text('backend = "python"\npath = "swapmodel:f"\n'
                                                   'version_policy = "all"\ninstances = 2\n')
    for version in (1, 2):
        (root / SWAP_MODEL / str(version)).mkdir()
        (root / SWAP_MODEL / str(version) / "swapmodel.py").write_text(SWAP_MODULE.format(version=version))
    return root


PRIORITY_MODEL = "sleepy"  # --priority-mix --spawn-server: one worker of shmserve.models:sleepy
MODEL_US = 1000  # its time a request (--model-us), so that a few clients saturate it


def priority_model(levels: int, model_us: int) -> str:
    """The ``[[models]]`` table of ``--priority-mix --spawn-server``: ``PRIORITY_MODEL``, one worker
    taking ``model_us`` µs a request (sleeping: the clients keep the CPUs), ``levels`` priority
    levels, no batching (each request its own run: a level's turn is one request)."""
    return f"""[[models]]
name = "{PRIORITY_MODEL}"
backend = "python"
path = "shmserve.models:sleepy"
options = {{factory = true, sleep_us = {model_us}}}
instances = 1
priority_levels = {levels}
"""


def spawn_server(workdir: Path, swap: bool = False, doors: int | str | None = None,
                 models: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start a server of its own on a socket in ``workdir``: the benchmark models, or with
    ``swap`` only the model repository of ``swap_repository``, or ``models`` (``[[models]]``
    tables) alone; ``doors``: its ``[server] doors`` (None: the default)."""
    import secrets

    from shmserve.bench_v2 import TOKEN_ENV
    from shmserve.v2.auth import token_entry

    instance = f"bench-{RUN_ID}"
    sock = str(workdir / "bench.sock")
    cfg = workdir / "bench.toml"
    token = secrets.token_urlsafe(32)  # its v2 clients' (they inherit the environment): shared memory is theirs
    fd = os.open(workdir / "tokens.toml", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token_entry("bench", token, "client", os.getuid()))
    os.environ[TOKEN_ENV] = token
    server = f"""[server]
instance = "{instance}"
max_request_bytes = {200 << 20}
max_grpc_read_bytes = {7 * (401 << 20)}
http = "127.0.0.1:0"
grpc = "127.0.0.1:0"
v2_system_shared_memory = true
v2_tokens = "tokens.toml"
""" + (f"doors = {json.dumps(doors)}\n" if doors is not None else "")
    cfg.write_text(server + f"model_repository = {json.dumps(str(swap_repository(workdir)))}\n" if swap else
                   server + models if models else server + f"""[[models]]
name = "identity"
backend = "python"
path = "shmserve.models:identity"
instances = 2
[[models]]
name = "identity_batched"
backend = "python"
path = "shmserve.models:identity"
instances = 1
max_batch_size = 64
max_queue_delay_us = 50
[[models]]
name = "demo"
backend = "onnxruntime"
path = "{_demo_path()}"
""")
    return serve_config(cfg, sock), sock


def interleaved(cases: dict, rounds: int, per_round: int, seed: int, warm: int = 3,
                cpus: dict | None = None) -> dict[str, list[float]]:
    """Seconds per call of each of ``cases`` (name -> callable): each warmed ``warm`` times, then
    ``rounds`` rounds, each running every case ``per_round`` times in a shuffled order, so the
    machine's noise falls on all alike (``tools/bench_backend_io.py``, ``tools/bench_cuda_graphs.py``).

    ``cpus`` (name -> CPU number) pins this process to a case's CPU for its calls (the affinity
    is put back after): on a VM whose vCPUs run at different speeds, a bare model measured on
    the CPU its worker is pinned to is the fair floor (``tools/bench_glue.py --pin``)."""
    import random

    mine = os.sched_getaffinity(0) if cpus else None

    def place(key):
        if cpus and key in cpus:
            os.sched_setaffinity(0, {cpus[key]})
        elif mine is not None:
            os.sched_setaffinity(0, mine)

    try:
        for key, f in cases.items():
            place(key)
            for _ in range(warm):
                f()
        samples: dict[str, list[float]] = {k: [] for k in cases}
        order, rng = list(cases), random.Random(seed)
        for _ in range(rounds):
            rng.shuffle(order)
            for key in order:
                place(key)
                f, out = cases[key], samples[key]
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    f()
                    out.append(time.perf_counter() - t0)
    finally:
        if mine is not None:
            os.sched_setaffinity(0, mine)
    return samples


def spawn_server_saying(workdir: Path, swap: bool = False, doors: int | str | None = None,
                        models: str | None = None) -> tuple[subprocess.Popen, str]:
    """``spawn_server``, saying so while it waits (its models load and warm up: seconds, more on a
    busy host) as a step of its own (``Progress``)."""
    progress = Progress(1)
    try:
        progress.step("starting a server of its own (its workers load and warm up their models)")
        return spawn_server(workdir, swap, doors, models)
    finally:
        progress.close()


def wait_models_ready(client, timeout: float = 120.0) -> None:
    """Return once every model ``client``'s server lists is ready (loaded and warmed up), or after
    ``timeout`` seconds (the measurement then says what failed); the tools' servers load several."""
    deadline = time.monotonic() + timeout
    while not all(m.get("state") == "ready" for m in client.models()) and time.monotonic() < deadline:
        time.sleep(0.1)


def serve_config(cfg: Path, sock: str) -> subprocess.Popen:
    """Start ``shmserve serve --config cfg --socket sock`` (its log beside the config, server.log) and
    return it once it answers; SystemExit if it exits or does not answer in 120 s."""
    from shmserve import Client
    from shmserve.errors import ConnectionClosed

    workdir = cfg.parent
    log = open(workdir / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-P", "-m", "shmserve.cli", "serve", "--config", str(cfg), "--socket", sock],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"shmserve bench: the server exited ({proc.returncode}); log: {workdir / 'server.log'}")
        try:
            with Client(sock) as c:
                c.health()
            return proc
        except ConnectionClosed:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("shmserve bench: the server did not start in 120 s")


def _demo_path() -> str:
    from shmserve.config import demo_config

    return demo_config().models[0].path


class Progress:
    """Where a run is: a progress bar with the case in hand on a terminal (rich, on stderr), else
    one ``[step/total] case`` line per case (logs and pipes stay readable)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.bar = None
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           console=Console(file=self.stream), transient=True)
            self.task = self.bar.add_task("starting", total=total)
            self.bar.start()

    def step(self, what: str) -> None:
        """The next case begins (the one before is done)."""
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, description=what)
        else:
            print(f"[{self.done + 1}/{self.total}] {what}", file=self.stream, flush=True)
        self.done += 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)
            self.bar.stop()
            self.bar = None


def parse_protocols(text: str) -> list[str]:
    protocols = [p.strip() for p in text.split(",")]
    if not protocols or any(p not in MODES for p in protocols) or len(set(protocols)) != len(protocols):
        raise argparse.ArgumentTypeError(f"bad protocols {text!r} (use unix, http, grpc or a list: unix,http,grpc)")
    return protocols


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"bad client counts {text!r} (use e.g. 1 or 1,2,4,8)")
    return counts


# --mix's modes beyond the unix ones: the v2 doors' binary inline calls (the mode their clients run)
MIX_V2 = {"http": "inline", "grpc": "inline"}


def parse_mix(text: str) -> list[tuple[str, int]]:
    """``inline:4,zero-copy:4,http:2`` as [(mode, count)]: unix modes or a v2 door (``MIX_V2``),
    counts of 1 or more, each mode once."""
    mix = []
    known = (*MODES["unix"], *MIX_V2)
    for part in text.split(","):
        mode, _, count = part.partition(":")
        if mode not in known or not count.isascii() or not count.isdigit() or int(count) < 1 \
                or mode in dict(mix):
            raise argparse.ArgumentTypeError(f"bad mix {text!r} (use e.g. inline:4,zero-copy:4,socket:2,http:2; "
                                             f"modes: {', '.join(known)})")
        mix.append((mode, int(count)))
    return mix


def parse_priority_mix(text: str) -> list[tuple[int, int]]:
    """``1:2,9:6`` as [(level, clients)]: levels 1 (the highest) to ``layout.SCHED_LEVELS``, each
    once, two of them or more; client counts of 1 or more."""
    from shmserve.layout import SCHED_LEVELS

    mix = []
    for part in text.split(","):
        level, _, count = part.strip().partition(":")
        if not (level.isascii() and level.isdigit() and count.isascii() and count.isdigit()) \
                or not 1 <= int(level) <= SCHED_LEVELS or int(count) < 1 or int(level) in dict(mix):
            mix = None
            break
        mix.append((int(level), int(count)))
    if not mix or len(mix) < 2:
        raise argparse.ArgumentTypeError(
            f"bad priority mix {text!r}: use LEVEL:CLIENTS[,LEVEL:CLIENTS...] with two levels or more, e.g. 1:2,9:6 "
            f"(2 clients at level 1, the highest, and 6 at level 9; levels 1-{SCHED_LEVELS}, each once)")
    return mix


def priority_support(mode: str) -> str | None:
    """Why this shmserve's client cannot send ``--priority-mix``'s calls in ``mode``, or None."""
    import inspect

    from shmserve.client import Client

    method = Client.zero_copy if mode == "zero-copy" else Client.infer
    if "priority" not in inspect.signature(method).parameters:
        return (f"--priority-mix needs Client.{method.__name__}(..., priority=), which this shmserve's client "
                "lacks (issue 29's priorities)")
    return None


def pick_model(path: str, wanted: str | None) -> tuple[str | None, tuple[int, str] | None]:
    """(model, None): ``wanted``, or a model the server at ``path`` lists that bench can drive
    (``identity`` if it has one, else its first one-input model); or (None, (exit code, why))."""
    from shmserve.console import EXIT_FAILURE, EXIT_NO_SERVER
    from shmserve.client import Client
    from shmserve.errors import ConnectionClosed, ShmserveError

    try:
        with Client(path, timeout=30) as client:
            listing = client.models()
    except ConnectionClosed as exc:
        return None, (EXIT_NO_SERVER, f"{exc.message} (start one, or give --spawn-server)")
    except ShmserveError as exc:
        return None, (EXIT_FAILURE, str(exc))
    names = [m["name"] for m in listing if len(m.get("inputs") or ()) == 1]
    if wanted is not None and wanted not in names:
        return None, (EXIT_FAILURE, f"the server has no one-input model {wanted!r} "
                                    f"(it has: {', '.join(names) or 'none'}); give --model")
    if wanted is None and not names:
        return None, (EXIT_FAILURE, "the server lists no model with a single input; give --spawn-server")
    return wanted or (MODEL if MODEL in names else names[0]), None


def missing_doors(path: str, protocols: list[str]) -> tuple[int, str] | None:
    """(exit code, why) if the server at ``path`` does not serve one of the v2 ``protocols``."""
    from shmserve.console import EXIT_FAILURE
    from shmserve.client import Client

    wanted = [p for p in protocols if p != "unix"]
    if not wanted:
        return None
    with Client(path, timeout=30) as client:
        served = client.info().get("v2") or {}
    missing = [p for p in wanted if p not in served]
    if missing:
        return EXIT_FAILURE, (f"the server does not serve {' or '.join(missing)} (start it with "
                              f"{' '.join(f'--{p} 127.0.0.1:PORT' for p in missing)}, or give --spawn-server)")
    return None


def swap_versions(path: str, model: str) -> tuple[tuple[int, int] | None, tuple[int, str] | None]:
    """((other, default), None): the versions ``--during-swap`` alternates for ``model`` at
    ``path`` — its default and its newest other version; or (None, (exit code, why))."""
    from shmserve.console import EXIT_FAILURE
    from shmserve.client import Client
    from shmserve.errors import ShmserveError

    try:
        with Client(path, timeout=30) as client:
            entry = next((m for m in client.models() if m["name"] == model), None)
    except ShmserveError as exc:
        return None, (EXIT_FAILURE, str(exc))
    versions = sorted(entry.get("versions") or ()) if entry else []
    others = [v for v in versions if v != entry["version"]] if entry else []
    if not others:
        return None, (EXIT_FAILURE, f"--during-swap needs a model with at least two versions; {model!r} has "
                                    f"{', '.join(map(str, versions)) or 'none'} (serve a model repository with "
                                    "two versions of it and give --model, or give --spawn-server)")
    return (others[-1], entry["version"]), None


def held_canary(percent: float) -> dict:
    """The plan of ``--during-canary``: the candidate takes ``percent`` % and stays there (a hold no
    run reaches, more samples than a run has, latency not judged: nothing decides but the abort)."""
    return {"steps": [percent, 100.0] if percent < 100 else [100.0], "hold_s": 1e9, "min_samples": 100_000,
            "max_error_rate_increase": 1.0, "max_p99_ratio": None}


def print_swap(r: dict, model: str, mode: str) -> None:
    """The ``--during-swap`` (or ``--during-canary``) table: both phases, their ratio, the swaps."""
    from shmserve.inspection import plural

    canary = r.get("canary_percent")
    what = f"--during-canary {canary:g}, model {model} (version {r['versions'][0]} a canary of version " \
           f"{r['versions'][1]})" if canary is not None else \
        f"--during-swap {r['swaps']}, model {model} (versions {r['versions'][0]} and {r['versions'][1]} in turn)"
    print(f"\nshmserve bench {what}, {human(r['tensor_bytes'])} {mode}, {plural(r['clients'], 'client')} "
          f"back to back, {plural(os.cpu_count(), 'CPU')}, {time.strftime('%Y-%m-%d')}\n")
    print("| phase | seconds | requests | failed | p50 µs | p99 µs | max µs | req/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    during = f"during a {canary:g} % canary" if canary is not None else f"during {plural(r['swaps'], 'swap')}"
    for name, label in (("steady", "steady state"), ("during", during)):
        ph = r[name]
        print(f"| {label} | {ph['seconds']} | {ph['n']} | {ph['failed']} | {ph['p50_us']} | {ph['p99_us']} | "
              f"{ph['max_us']} | {ph['rps']} |")
    ratio = r["ratio"]
    print(f"| during / steady | | | | {ratio['p50_us']} | {ratio['p99_us']} | {ratio['max_us']} | {ratio['rps']} |")
    if r["steady"]["answers"] or r["during"]["answers"]:
        print("\nanswers by version: " + "; ".join(
            f"{name} " + ", ".join(f"{'v' if v != 'wrong' else ''}{v} {n}" for v, n in r[name]["answers"].items())
            for name in ("steady", "during")) + f" (wrong: {r['wrong']})")
    if canary is not None:
        print(f"\np50 steady {r['steady']['p50_us']} µs, during the canary {r['during']['p50_us']} µs: "
              f"x{r['ratio']['p50_us']}")
    elif r["swap_seconds"]:
        print(f"\nswaps: {len(r['swap_seconds'])}, median {r['swap_median_s']} s, max {r['swap_max_s']} s "
              "(each: the other version loaded and warmed, the default moved, the old one drained)")


def plot(results: list[dict], path: str, title: str) -> None:
    """Latency percentiles (p50, p90, p99) of every case, one group of bars per case."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("shmserve bench: --plot needs matplotlib: pip install 'shmserve[plot]'") from None
    labels = [f"{human(r['payload'])}\n{r.get('protocol', 'unix')} {r['mode']}\n{r['clients']} cl." for r in results]
    x = np.arange(len(results))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(results)), 4.5))
    for i, (key, name) in enumerate((("p50_us", "p50"), ("p90_us", "p90"), ("p99_us", "p99"))):
        ax.bar(x + (i - 1) * 0.27, [r[key] for r in results], 0.27, label=name)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("latency, µs (log)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from shmserve.console import EXIT_CODES, HelpFormatter, instance_name
    from shmserve.inspection import plural

    p = argparse.ArgumentParser(prog="shmserve bench", description="Latency and throughput against floors "
                                                                   "measured in the same run.",
                                formatter_class=HelpFormatter,
                                epilog="examples:\n  shmserve bench --spawn-server\n"
                                       "  shmserve bench --payload 4KiB,1MiB --json-out results.json\n"
                                       "  shmserve bench --payload 4KiB --clients 1,2,4,8 --plot latency.png\n"
                                       "  shmserve bench --payload 4KiB --clients 4 --rate 2000\n"
                                       "  shmserve bench --spawn-server --during-swap 20 --clients 2\n"
                                       "  shmserve bench --spawn-server --during-canary 30 --json-out canary.json\n"
                                       "  shmserve bench --spawn-server --priority-mix 1:2,9:6 --duration 10\n\n"
                                       + EXIT_CODES)
    p.add_argument("--socket", help="server to measure (default: $SHMSERVE_SOCKET, else the --instance's socket "
                                    "in $XDG_RUNTIME_DIR/shmserve/ or /tmp/shmserve-<uid>/)")
    p.add_argument("--instance", type=instance_name, default="default", help="instance whose default socket to measure")
    p.add_argument("--spawn-server", action="store_true", help="start and stop a server of its own")
    p.add_argument("--token", default=None, help="the v2 bearer token the http and grpc clients present (needed "
                                                 "for --mode shm: a TCP caller without one is anonymous; default: "
                                                 "$SHMSERVE_V2_TOKEN; --spawn-server makes its own)")
    p.add_argument("--model", help="a model with one input; its leading dimension is sized to the payload "
                                   "(default: identity, or the running server's first one-input model; "
                                   "--spawn-server has identity, identity_batched, demo)")
    p.add_argument("--payload", help="comma-separated sizes (default: 64,4KiB,1MiB,16MiB; --during-swap, --mix: 4KiB)")
    p.add_argument("--mode", choices=("inline", "socket", "zero-copy", "shm", "both"),
                   help="how requests travel: unix inline (Client.infer: through a lane), socket "
                        "(Client.infer with lanes=False: through the front-end) or zero-copy (Client.zero_copy), "
                        "http/grpc inline (binary tensors) or shm (system shared memory); both: each of the "
                        "protocol's (default: both; --during-swap: inline)")
    p.add_argument("--protocol", type=parse_protocols, default=["unix"], metavar="P[,P...]",
                   help="unix (the native socket), http, grpc (the KServe v2 doors of the same server; "
                        "--spawn-server serves both), or a list")
    p.add_argument("--clients", type=parse_counts, default=[1], metavar="N[,N...]",
                   help="client processes per case; a list sweeps them (1,2,4,8)")
    p.add_argument("--requests", type=int, default=500, help="requests per client per case (after 20 warm-up)")
    p.add_argument("--duration", type=float, default=0.0, help="or: stop each client after this many seconds "
                                                                "(--during-swap: the steady phase's, default 10)")
    p.add_argument("--rate", type=float, default=0.0, metavar="N",
                   help="requests/s of all clients together, each due at its time (open loop); 0: back to back")
    p.add_argument("--during-swap", type=int, nargs="?", const=20, metavar="N",
                   help="steady state, then the same while the model's default version is swapped N times "
                        "(default 20) back and forth; one payload, mode and client count; --spawn-server serves "
                        f"model {SWAP_MODEL!r} with versions 1 and 2, else --model names one with two versions")
    p.add_argument("--during-canary", type=float, nargs="?", const=30.0, metavar="PERCENT",
                   help="steady state, then the same while the model's other version is a split canary taking "
                        "PERCENT %% (default 30) of the traffic (aborted after: the candidate is unloaded); "
                        "prints both p50s and their ratio; options as --during-swap's")
    p.add_argument("--mix", type=parse_mix, metavar="MODE:N[,MODE:N...]",
                   help="one run with clients of several modes at once (e.g. inline:4,zero-copy:4,socket:2,http:2: "
                        "unix modes, or http/grpc for the v2 doors' binary calls), each back to back for --duration "
                        "s (default 10): every client's share of requests/s and the fairness, the most any client "
                        "got over the fewest")
    p.add_argument("--priority-mix", type=parse_priority_mix, metavar="LEVEL:CLIENTS[,LEVEL:CLIENTS...]",
                   help="clients at several priority levels against one model (e.g. 1:2,9:6: 2 at level 1, the "
                        "highest, and 6 at level 9): each level alone, then all together, --duration s each "
                        "(default 5); per level req/s, p50, p99, p99 together over alone, its share and the req/s "
                        f"it lost; --spawn-server serves model {PRIORITY_MODEL!r} (one worker, --model-us a "
                        "request, the levels named), else --model names one with priority_levels")
    p.add_argument("--model-us", type=int, metavar="US",
                   help=f"--priority-mix or --mix with --spawn-server: the spawned model's time a request in µs "
                        f"(it sleeps, leaving the CPUs to the clients; --priority-mix's default {MODEL_US}): slow "
                        f"enough that the clients saturate it; --mix then measures {PRIORITY_MODEL!r} instead of "
                        "identity")
    p.add_argument("--doors", metavar="N|auto", help="--spawn-server: its door processes ([server] doors; "
                                                      "docs/doors.md; default: the server's default)")
    p.add_argument("--json", action="store_true", help="print the results as one line of JSON instead of the table")
    p.add_argument("--json-out", metavar="FILE", help="write the results here too, as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw every case's latency percentiles (needs matplotlib)")
    args = p.parse_args(argv)
    if args.token:
        from shmserve.bench_v2 import TOKEN_ENV

        os.environ[TOKEN_ENV] = args.token  # the client processes inherit it
    if args.rate < 0:
        p.error("--rate must be 0 or more")
    if args.doors is not None:
        from shmserve.config import MAX_DOORS

        if not args.spawn_server:
            p.error("--doors is for --spawn-server (a running server has its own: [server] doors)")
        if args.doors != "auto":
            if not args.doors.isascii() or not args.doors.isdigit() or int(args.doors) > MAX_DOORS:
                p.error(f"--doors: expected a number in [0, {MAX_DOORS}] or 'auto', got {args.doors!r}")
            args.doors = int(args.doors)
    if args.during_canary is not None:
        if args.during_swap is not None:
            p.error("give --during-swap or --during-canary, not both")
        if not 0 < args.during_canary <= 100:
            p.error(f"--during-canary: the candidate's percent must be in (0, 100], not {args.during_canary:g}")
    swapping = args.during_swap is not None or args.during_canary is not None
    flag = "--during-swap" if args.during_swap is not None else "--during-canary"
    if swapping:
        if args.during_swap is not None and args.during_swap < 1:
            p.error("--during-swap: the number of swaps must be 1 or more")
        for option, given in (("--rate", args.rate), ("--plot", args.plot), ("--mode both", args.mode == "both"),
                              ("a list of --clients", len(args.clients) > 1)):
            if given:
                p.error(f"{flag} takes no {option} (one payload, mode and client count, back to back)")
        if args.duration < 0:
            p.error("--duration must be 0 or more")
    if args.priority_mix:
        for option, given in (("--during-swap or --during-canary", swapping), ("--mix", args.mix),
                              ("--rate", args.rate), ("--plot", args.plot),
                              ("a list of --clients", len(args.clients) > 1), ("--protocol", args.protocol != ["unix"]),
                              ("--mode both or shm", args.mode in ("both", "shm")),
                              ("--model with --spawn-server (it serves its own)", args.spawn_server and args.model)):
            if given:
                p.error(f"--priority-mix takes no {option} (one payload and unix mode; clients per level in the mix)")
        if args.duration < 0:
            p.error("--duration must be 0 or more")
    if args.model_us is not None:
        if not ((args.priority_mix or args.mix) and args.spawn_server):
            p.error("--model-us is for --priority-mix or --mix with --spawn-server (the model bench spawns)")
        if not 0 <= args.model_us <= 10_000_000:
            p.error(f"--model-us: expected microseconds in [0, 10000000], got {args.model_us}")
    args.payload = args.payload or ("4KiB" if swapping or args.mix or args.priority_mix else "64,4KiB,1MiB,16MiB")
    args.mode = args.mode or ("inline" if swapping or args.priority_mix else "both")
    try:
        sizes = [parse_size(s) for s in args.payload.split(",")]
    except argparse.ArgumentTypeError as exc:
        p.error(f"--payload: {exc}")
    if swapping and len(sizes) > 1:
        p.error(f"{flag} takes one --payload size")
    for option, target in (("--json-out", args.json_out), ("--plot", args.plot)):
        if target:
            try:
                open(target, "a").close()  # refused now, not after the run
            except OSError as exc:
                p.error(f"{option}: cannot write {target}: {exc.strerror or exc}")
    if swapping and args.protocol != ["unix"]:
        p.error(f"{flag} measures the native socket only (no --protocol)")
    cases = []  # (protocol, mode)
    for protocol in args.protocol:
        # each protocol's variant without tensor bytes on it; the v2 doors' inline is their socket path
        no_socket = {"zero-copy": "shm", "shm": "zero-copy", "socket": "inline"}
        modes = MODES[protocol] if args.mode == "both" else \
            [args.mode if args.mode in MODES[protocol] else no_socket[args.mode]]
        cases += [(protocol, mode) for mode in modes]
    if swapping:
        return main_swap(args, sizes[0])
    if args.mix:
        if len(sizes) > 1 or args.protocol != ["unix"] or args.rate:
            p.error("--mix takes one --payload size, the unix protocol and no --rate")
    if args.priority_mix:
        if len(sizes) > 1:
            p.error("--priority-mix takes one --payload size")
        unsupported = priority_support(args.mode)
        if unsupported:
            from shmserve.console import EXIT_FAILURE

            print(f"shmserve bench: {unsupported}", file=sys.stderr)
            return EXIT_FAILURE
    tmp = tempfile.TemporaryDirectory(prefix="shmserve-bench-")
    proc = None
    if args.spawn_server:
        levels = max(level for level, _ in args.priority_mix) if args.priority_mix else 0
        slow = bool(levels) or (args.mix is not None and args.model_us is not None)  # the sleepy model
        proc, path = spawn_server_saying(Path(tmp.name), doors=args.doors, models=priority_model(
            levels, MODEL_US if args.model_us is None else args.model_us) if slow else None)
        model = args.model or (PRIORITY_MODEL if slow else MODEL)
        if levels:
            args.model_us = MODEL_US if args.model_us is None else args.model_us
    else:
        from shmserve.config import resolve_socket

        path = resolve_socket(args.socket, None, args.instance)
        model, problem = pick_model(path, args.model)
        if problem is None:
            problem = missing_doors(path, args.protocol)
        if problem:
            print(f"shmserve bench: {problem[1]}", file=sys.stderr)
            return problem[0]
    if args.mix:
        try:
            return main_mix(args, sizes[0], path, model)
        finally:
            _stop(proc, tmp)
    if args.priority_mix:
        try:
            return main_priority(args, sizes[0], path, model)
        finally:
            _stop(proc, tmp)
    results = []
    progress = Progress(len(sizes) * (len(cases) * len(args.clients) + len(args.protocol)))
    try:
        for size in sizes:
            reps = max(20, min(2000, (256 << 20) // max(size, 1)))
            copy = memcpy_floor(size, min(reps, 50)) if size >= (1 << 20) else 0.0
            floors = {}
            for protocol in args.protocol:
                progress.step(f"{protocol} floor for {human(size)}")
                floors[protocol] = echo_floor(size, reps) if protocol == "unix" else \
                    bench_v2.echo_floor(protocol, size, reps)
            for protocol, mode in cases:
                floor = floors[protocol]
                for clients in args.clients:
                    progress.step(f"{protocol} {mode} {human(size)} x {plural(clients, 'client')}")
                    r = run_case(path, mode, size, clients, args.requests, args.duration, model, args.rate,
                                 protocol)
                    r.update(payload=size, protocol=protocol, mode=mode, clients=clients, rate=args.rate,
                             echo_floor_p50_us=round(floor, 1), memcpy_p50_us=round(copy, 1),
                             ratio_to_floor=round(r["p50_us"] / (floor + copy), 2))
                    results.append(r)
    finally:
        progress.close()
        _stop(proc, tmp)
    pacing = f"at {args.rate:g} req/s in all (latency from each request's due time)" if args.rate else "back to back"
    report = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "model": model, "run_id": RUN_ID,
              "rate": args.rate, "results": results}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(results, args.plot, f"shmserve bench, model {model}, {pacing}, {time.strftime('%Y-%m-%d')}")
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"\nshmserve bench, model {model}, clients {pacing}, {plural(os.cpu_count(), 'CPU')}, "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| payload | tensor | protocol | mode | clients | p50 µs | p90 µs | p99 µs | max µs | req/s | GB/s "
          "| floor p50 µs | p50 / floor |")
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        floor = r["echo_floor_p50_us"] + r["memcpy_p50_us"]
        print(f"| {human(r['payload'])} | {human(r['tensor_bytes'])} | {r['protocol']} | {r['mode']} | "
              f"{r['clients']} | {r['p50_us']} | "
              f"{r['p90_us']} | {r['p99_us']} | {r['max_us']} | {r['rps']} | {r['GBps']} | {floor:.1f} | "
              f"{r['ratio_to_floor']} |")
    print("\nfloor = an echo of the same payload over the same stack: unix, a uvloop Unix-socket echo; http, an "
          "httptools/uvloop HTTP echo; grpc, a grpc.aio echo (+ one memcpy into shared memory from 1 MiB up)")
    return 0


def _stop(proc, tmp) -> None:
    """Stop the server bench spawned (if it did) and remove its directory."""
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    tmp.cleanup()


def _report(args: argparse.Namespace, model: str, **results) -> bool:
    """The run's JSON report (date, CPUs, model, run id and ``results``) to --json-out if given,
    and to stdout with --json; whether it went to stdout (then no table is printed)."""
    report = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "model": model, "run_id": RUN_ID,
              **results}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    return args.json


def main_mix(args: argparse.Namespace, size: int, path: str, model: str) -> int:
    """``shmserve bench --mix``: one run of clients of several modes at once on the server at
    ``path``; exit 0."""
    from shmserve.inspection import plural

    result = run_mix(path, args.mix, size, args.duration or 10.0, model)
    if _report(args, model, mix=result):
        return 0
    print(f"\nshmserve bench --mix, model {model}, {human(size)}, {result['duration_s']:g} s, "
          f"{plural(os.cpu_count(), 'CPU')}, {time.strftime('%Y-%m-%d')}\n")
    print("| mode | clients | p50 µs | p99 µs | req/s | per client req/s (min – max) |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in result["modes"]:
        print(f"| {r['mode']} | {r['clients']} | {r['p50_us']} | {r['p99_us']} | {r['rps']} | "
              f"{r['client_rps_min']} – {r['client_rps_max']} |")
    print(f"\nper client: {result['client_rps_min']} req/s the least served, {result['client_rps_max']} req/s the "
          f"busiest; fairness: the busiest client got {result['fairness']}× the requests/s of the least served")
    return 0


def main_priority(args: argparse.Namespace, size: int, path: str, model: str) -> int:
    """``shmserve bench --priority-mix``: each level alone, then all together, on the server at
    ``path``; exit 0, or 1 when a request failed (said loudly)."""
    from shmserve.console import EXIT_FAILURE
    from shmserve.inspection import plural

    duration = args.duration or 5.0
    progress = Progress(len(args.priority_mix) + 1)
    try:
        r = run_priority_mix(path, args.mode, size, args.priority_mix, duration, model, progress)
    except RuntimeError as exc:
        print(f"shmserve bench: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        progress.close()
    r["model_us"] = args.model_us if args.spawn_server else None
    if not _report(args, model, priority_mix=r):
        mix = ",".join(f"{level}:{n}" for level, n in args.priority_mix)
        slow = f" ({r['model_us']} µs a request)" if r["model_us"] is not None else ""
        print(f"\nshmserve bench --priority-mix {mix}, model {model}{slow}, {human(r['tensor_bytes'])} {r['mode']}, "
              f"{duration:g} s a phase, {plural(os.cpu_count(), 'CPU')}, {time.strftime('%Y-%m-%d')}\n")
        print("| priority | clients | alone req/s | alone p50 µs | alone p99 µs | together req/s | together p50 µs "
              "| together p99 µs | p99 together / alone | share of req/s | req/s lost | share of the levels above |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in r["levels"]:
            a, t = row["alone"], row["together"]
            print(f"| {row['level']} | {row['clients']} | {a['rps']} | {a['p50_us']} | {a['p99_us']} | {t['rps']} | "
                  f"{t['p50_us']} | {t['p99_us']} | {row['p99_ratio']} | {_percent(row['share'])} | "
                  f"{_percent(row['lost'])} | {_percent(row['share_above'])} |")
        top, rest = r["levels"][0], r["levels"][1:]
        print(f"\npriority {top['level']} (the highest here): p99 {top['together']['p99_us']} µs among every level, "
              f"{top['alone']['p99_us']} µs alone: x{top['p99_ratio']}")
        for row in rest:
            print(f"priority {row['level']}: lost {_percent(row['lost'])} of its req/s alone; the levels above "
                  f"took {_percent(row['share_above'])} of the req/s together")
        print("\nalone: that level's clients only (the others idle), the floor measured in the same run; "
              "together: every client at once")
        if r["server"] is not None:
            print("\nas the server counted (info's queues): requests its workers claimed, their mean wait ready to "
                  "claimed, the queue held at that level (sampled every 0.25 s)\n")
            print("| priority | claimed alone | mean wait alone µs | claimed together | mean wait together µs "
                  "| queued together, mean | queued together, max |")
            print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
            for row in r["levels"]:
                a, t = (row["server"][ph] or {} for ph in ("alone", "together"))
                print(f"| {row['level']} | {a.get('claimed', '-')} | {_or_dash(a.get('mean_wait_us'))} | "
                      f"{t.get('claimed', '-')} | {_or_dash(t.get('mean_wait_us'))} | {t.get('queued_mean', '-')} | "
                      f"{t.get('queued_max', '-')} |")
            sv = r["server"]
            print(f"\nduring the run: {sv['expired']} expired (deadline passed unclaimed), {sv['demoted']} demoted, "
                  f"{sv['cancelled']} cancelled, {sv['rate_limited']} refused by rate limits")
    if r["failed"]:
        errors = ", ".join(f"{code} {n}" for code, n in r["errors"].items())
        print(f"shmserve bench: FAILED: {r['failed']} requests failed ({errors}); first: {r['first_error']}",
              file=sys.stderr)
        return EXIT_FAILURE
    return 0


def _or_dash(x) -> str:
    return "-" if x is None else str(x)


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def main_swap(args: argparse.Namespace, size: int) -> int:
    """``shmserve bench --during-swap`` or ``--during-canary``: exit 0, or 1 when a request or a swap
    (the canary's start) failed (said loudly)."""
    from shmserve.console import EXIT_FAILURE

    tmp = tempfile.TemporaryDirectory(prefix="shmserve-bench-")
    proc = None
    try:
        if args.spawn_server:
            proc, path = spawn_server_saying(Path(tmp.name), swap=True)
            model, problem = args.model or SWAP_MODEL, None
        else:
            from shmserve.config import resolve_socket

            path = resolve_socket(args.socket, None, args.instance)
            model, problem = pick_model(path, args.model)
        if not problem:
            versions, problem = swap_versions(path, model)
        if problem:
            print(f"shmserve bench: {problem[1]}", file=sys.stderr)
            return problem[0]
        progress = Progress(1)
        try:
            canary = args.during_canary
            progress.step(f"steady, then {args.during_swap} swaps of {model}" if canary is None else
                          f"steady, then a {canary:g} % canary of {model}")
            r = run_swap(path, args.mode, size, args.clients[0], args.duration or 10.0, model, versions,
                         args.during_swap or 0, check=bool(args.spawn_server) and model == SWAP_MODEL, canary=canary)
        finally:
            progress.close()
    finally:
        _stop(proc, tmp)
    r.update(payload=size, mode=args.mode, clients=args.clients[0])
    if not _report(args, model, **({"during_canary": r} if args.during_canary is not None else {"during_swap": r})):
        print_swap(r, model, args.mode)
    failed = r["failed"] or r["wrong"] or r["swap_error"]
    if r["failed"]:
        errors = ", ".join(f"{phase} {code} {n}" for phase in ("steady", "during")
                           for code, n in r[phase]["errors"].items())
        first = r["during"]["first_error"] or r["steady"]["first_error"]
        print(f"shmserve bench: FAILED: {r['failed']} requests failed ({errors}); first: {first}", file=sys.stderr)
    if r["wrong"]:
        print(f"shmserve bench: FAILED: {r['wrong']} answers came from no version", file=sys.stderr)
    if r["swap_error"]:
        print(f"shmserve bench: FAILED: {r['swap_error']}", file=sys.stderr)
    return EXIT_FAILURE if failed else 0


if __name__ == "__main__":
    try:
        if len(sys.argv) > 1 and sys.argv[1] == "--client":
            client_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]),
                        sys.argv[7], float(sys.argv[8]), sys.argv[9])
        elif len(sys.argv) > 1 and sys.argv[1] == "--priority-client":
            priority_client_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
        elif len(sys.argv) > 1 and sys.argv[1] == "--swap-client":
            swap_client_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), sys.argv[6],
                             sys.argv[7] == "check")
        else:
            sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: each client leaves quietly
        sys.exit(130)
