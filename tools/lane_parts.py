#!/usr/bin/env python3
"""One lane client's round trip in parts, from the stamps in each call's lane slot (issue 29's
lane regression: which part of a call grew between two trees).

Starts ``shmserve bench``'s own server (``bench.spawn_server``: identity, two workers), then
``Client.infer`` of a 4 KiB uint8 tensor ``--calls`` times back to back on one client, reading each
call's slot stamps just before the client frees it.  Prints the p50 (µs) of:

  prepare   t_acquired -> t_ready: the client fills its slot and submits
  claim     t_ready -> t_claimed: the worker's wait and wake-up, its gather and claim
  decode    t_claimed -> t_compute_start
  compute   the model's call with its output copies
  finish    t_compute_end -> t_done: the answer written, DONE published
  wake      t_done -> the client's read: its wait and wake-up
  call      the whole ``Client.infer`` as the caller sees it

Runs against whatever ``shmserve`` is imported (``PYTHONPATH=TREE``), so two trees compare part by
part.  usage: python tools/lane_parts.py [--calls 20000] [--json]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PARTS = ("prepare", "claim", "decode", "compute", "finish", "wake", "call")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls measured (default 20000, after 2000 warm-up)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a line of text")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (timeout(1)): the server it starts is stopped

    from shmserve import Client, bench, lanes, layout

    stamps: list = []
    read = lanes.ClientLane.read

    def stamped_read(lane, index, generation, *rest):
        stamps.append((layout.read_stages(lane.buf, layout.LANE.slot_off(index)), time.monotonic_ns()))
        return read(lane, index, generation, *rest)

    x = np.arange(4096, dtype=np.uint8)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lane-parts-") as tmp:
        proc, sock = bench.spawn_server(Path(tmp))
        try:
            with Client(sock, timeout=60) as c:
                for _ in range(2000):
                    c.infer("identity", {"x": x})
                lanes.ClientLane.read = stamped_read
                try:
                    for _ in range(args.calls):
                        t0 = time.monotonic_ns()
                        c.infer("identity", {"x": x})
                        t1 = time.monotonic_ns()
                        (acq, ready, claimed, start, end, done), now = stamps.pop()
                        rows.append((ready - acq, claimed - ready, start - claimed, end - start, done - end,
                                     now - done, t1 - t0))
                finally:
                    lanes.ClientLane.read = read
        finally:
            proc.terminate()
            proc.wait(30)
    p50 = {part: statistics.median(r[i] for r in rows) / 1e3 for i, part in enumerate(PARTS)}
    if args.json:
        print(json.dumps(p50))
    else:
        print(" ".join(f"{k} {v:6.2f}" for k, v in p50.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
