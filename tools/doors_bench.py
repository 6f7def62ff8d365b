#!/usr/bin/env python3
"""Issue 25's socket-door sweep: the native socket with 0, 2, 4 and 8 door processes, next to its floors.

For each door count it runs ``shmserve bench --spawn-server --doors N`` (a
server of its own each time, the ``identity`` model's 2 workers) over the
same payload (4 KiB by default) and client counts, and reads its JSON:

* ``socket``: ``Client.infer`` with ``lanes=False``, every call over the
  Unix socket: through the main process alone (doors 0) or through a door
  process (a lane-able call served by the door through its own lane);
* ``inline``, in the same run and server: ``Client.infer`` through the
  client's own lane, the fastest call there is: the floor a door is held to
  (issue 25: "every door as fast as the lanes");
* the echo floor: ``shmserve bench``'s uvloop Unix-socket echo of the same
  payload, measured in the same run.

It prints one Markdown table (p50 and req/s of both modes, the echo floor,
socket p50 over lane p50 and socket req/s over lane req/s) and, with
``--json-out``, every row ``shmserve bench`` gave.  Meant for the 16-core
device (docs/doors.md, "Measuring"); on a 2-vCPU machine the doors, the
workers and the clients share two cores and the numbers say little.

usage: python tools/doors_bench.py [--doors 0,2,4,8] [--clients 1,4,8,16] [--payload 4KiB]
                                   [--requests 2000] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def run_bench(doors: int, clients: str, payload: str, requests: int) -> list[dict]:
    """``shmserve bench``'s rows for ``doors`` door processes (socket and inline modes)."""
    argv = [sys.executable, "-m", "shmserve.cli", "bench", "--spawn-server", "--doors", str(doors), "--mode", "both",
            "--payload", payload, "--clients", clients, "--requests", str(requests), "--json"]
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"doors_bench: {' '.join(argv[2:])} failed (exit {done.returncode})")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])["results"]


def table(rows: list[dict]) -> str:
    """The Markdown table of ``rows`` (each tagged with its ``doors``)."""
    out = ["| doors | clients | socket p50 µs | socket req/s | lane p50 µs | lane req/s | echo floor p50 µs "
           "| socket / lane p50 | socket / lane req/s |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by = {(r["doors"], r["mode"], r["clients"]): r for r in rows}
    for doors, clients in sorted({(r["doors"], r["clients"]) for r in rows}):
        sock, lane = by.get((doors, "socket", clients)), by.get((doors, "inline", clients))
        if sock is None or lane is None:
            continue
        out.append(f"| {doors} | {clients} | {sock['p50_us']:,.1f} | {sock['rps']:,.0f} | {lane['p50_us']:,.1f} | "
                   f"{lane['rps']:,.0f} | {sock['echo_floor_p50_us']:,.1f} | {sock['p50_us'] / lane['p50_us']:.2f} | "
                   f"{sock['rps'] / lane['rps']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--doors", default="0,2,4,8", help="door counts, comma-separated (default 0,2,4,8)")
    p.add_argument("--clients", default="1,4,8,16", help="client processes, comma-separated (default 1,4,8,16)")
    p.add_argument("--payload", default="4KiB", help="request payload (default 4KiB)")
    p.add_argument("--requests", type=int, default=2000, help="requests per client per case (default 2000)")
    p.add_argument("--json-out", help="write every row here too, as JSON")
    args = p.parse_args(argv)
    try:
        counts = [int(n) for n in args.doors.split(",")]
    except ValueError:
        p.error(f"--doors: expected numbers separated by commas, got {args.doors!r}")
    rows = []
    for doors in counts:
        print(f"doors_bench: doors = {doors} ...", file=sys.stderr, flush=True)
        for r in run_bench(doors, args.clients, args.payload, args.requests):
            rows.append({**r, "doors": doors})
    head = (f"doors_bench, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, payload {args.payload}, "
            f"{args.requests} requests per client")
    print(f"\n{head}\n\n{table(rows)}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"title": head, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
