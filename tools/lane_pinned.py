#!/usr/bin/env python3
"""The lane round trip with every process on a CPU of its own, so two trees compare on the same
CPUs (issue 29's lane regression; the H200 host's vCPUs run the same code up to 1.8x apart, so
an unpinned run measures where its processes landed as much as the code).

Starts a server of its own (``bench.serve_config``) with one model, ``identity`` (a worker on
each of ``--workers``' CPUs), then moves its main process's threads to ``--main-cpu``; then

  one client   on the first of ``--client-cpus``: ``Client.infer`` of a 4 KiB uint8 tensor ``--calls`` times, its
               p50, and the call in parts from its slot's stamps (as ``tools/lane_parts.py``)
  N clients    each in a process on a CPU of ``--client-cpus`` (taken in turn), each
               ``--calls`` calls after a shared start: the rate of all together (calls / the
               span from the first start to the last end) and the median of their p50s

Runs against whatever ``shmserve`` is imported (``PYTHONPATH=TREE``).
usage: python tools/lane_pinned.py [--calls 20000] [--clients 8] [--workers 2,3] [--main-cpu 1]
                                   [--client-cpus 4-15] [--json]
"""

from __future__ import annotations

import argparse
import json
import signal
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PARTS = ("claim", "decode", "compute", "finish", "wake")
CONFIG = """[server]
instance = "{instance}"
[[models]]
name = "identity"
backend = "python"
path = "shmserve.models:identity"
instances = {instances}
cpus = "{workers}"
cpus_per_worker = 1
"""


def timed_calls(sock: str, calls: int, stamps: bool = False) -> tuple[list[int], list[tuple]]:
    """``calls`` infer calls after 1,000 warm-up: each one's ns, and (``stamps``) its parts."""
    from shmserve import Client, lanes, layout

    x = np.arange(4096, dtype=np.uint8)
    times, parts, seen = [], [], []
    read = lanes.ClientLane.read

    def stamped_read(lane, index, generation, *rest):
        seen.append((layout.read_stages(lane.buf, layout.LANE.slot_off(index)), time.monotonic_ns()))
        return read(lane, index, generation, *rest)

    with Client(sock, timeout=60) as c:
        for _ in range(1000):
            c.infer("identity", {"x": x})
        if stamps:
            lanes.ClientLane.read = stamped_read
        try:
            for _ in range(calls):
                t0 = time.monotonic_ns()
                c.infer("identity", {"x": x})
                times.append(time.monotonic_ns() - t0)
                if stamps:
                    (_, ready, claimed, start, end, done), now = seen.pop()
                    parts.append((claimed - ready, start - claimed, end - start, done - end, now - done))
        finally:
            lanes.ClientLane.read = read
    return times, parts


def client_process(sock: str, cpu: int, calls: int, barrier, out) -> None:
    os.sched_setaffinity(0, {cpu})
    from shmserve import Client

    x = np.arange(4096, dtype=np.uint8)
    with Client(sock, timeout=60) as c:
        for _ in range(1000):
            c.infer("identity", {"x": x})
        barrier.wait(60)
        start, times = time.monotonic_ns(), []
        for _ in range(calls):
            t0 = time.monotonic_ns()
            c.infer("identity", {"x": x})
            times.append(time.monotonic_ns() - t0)
        out.put((start, time.monotonic_ns(), statistics.median(times)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls per client (default 20000)")
    ap.add_argument("--clients", type=int, default=8, help="clients of the second part (default 8)")
    ap.add_argument("--workers", default="2,3", help="the workers' CPUs, one each (default 2,3: two workers)")
    ap.add_argument("--main-cpu", type=int, default=1, help="the server's main process (default 1)")
    ap.add_argument("--client-cpus", default="4-15", help="the clients' CPUs, taken in turn (default 4-15)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a line of text")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (timeout(1)): the server it starts is stopped
    from shmserve import bench, placement

    mine = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory(prefix="lane-pinned-") as tmp:
        cfg = Path(tmp) / "server.toml"
        workers = placement.parse_cpulist(args.workers)
        clients = sorted(placement.parse_cpulist(args.client_cpus))
        cfg.write_text(CONFIG.format(instance=f"pinned-{os.getpid()}", workers=args.workers, instances=len(workers)))
        proc = bench.serve_config(cfg, str(Path(tmp) / "s.sock"))
        sock = str(Path(tmp) / "s.sock")
        try:
            for task in os.listdir(f"/proc/{proc.pid}/task"):  # the main process's threads (its workers: cpus)
                os.sched_setaffinity(int(task), {args.main_cpu})
            os.sched_setaffinity(0, {clients[0]})
            times, parts = timed_calls(sock, args.calls, stamps=True)
            os.sched_setaffinity(0, mine)
            one = {"p50_us": statistics.median(times) / 1e3,
                   **{p: statistics.median(r[i] for r in parts) / 1e3 for i, p in enumerate(PARTS)}}
            ctx = multiprocessing.get_context("fork")
            barrier, out = ctx.Barrier(args.clients), ctx.Queue()
            cpus = [clients[i % len(clients)] for i in range(args.clients)]
            procs = [ctx.Process(target=client_process, args=(sock, cpu, args.calls, barrier, out)) for cpu in cpus]
            for p in procs:
                p.start()
            got = [out.get(timeout=300) for _ in procs]
            for p in procs:
                p.join(30)
            span = max(e for _, e, _ in got) - min(s for s, _, _ in got)
            many = {"clients": args.clients, "req_s": args.clients * args.calls / (span / 1e9),
                    "p50_us": statistics.median(m for _, _, m in got) / 1e3}
        finally:
            proc.terminate()
            proc.wait(30)
    if args.json:
        print(json.dumps({"one": one, "many": many}))
    else:
        print("1 client: " + " ".join(f"{k} {v:.2f}" for k, v in one.items())
              + f" | {many['clients']} clients: {many['req_s']:.0f} req/s, p50 {many['p50_us']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
