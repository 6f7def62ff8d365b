#!/usr/bin/env python3
"""Per-call cost of each part of a lane round trip, client and worker, in one process (no IPC).

A lane in a bytearray, the real ``ClientLane`` and the real ``workers.step.Step`` (a 1,024-float
identity on a stand-in backend, a small arena for the counters) called in turn: submit, the
worker's ring pop, claim, decode, place, run, descriptors + publish, the client's wait and read.
Prints microseconds per call for each part.  Run it with ``SHMSERVE_HOTPATH=python`` and
without to compare the reference with the compiled hot path (docs/performance.md, "The
compiled lane hot path").

usage: python tools/profile_lane.py [CALLS]      (default 20000)
"""

from __future__ import annotations

import sys
import time
import types
import uuid

import numpy as np

from shmserve import hotpath, lanes, layout
from shmserve.arena import Arena
from shmserve.spec import ModelSpec, TensorSpec
from workers.step import Space, Step

REGION = 7
PARTS = ("submit", "pop", "claim", "decode", "place", "run", "finish", "wait", "read")


def main(calls: int) -> None:
    buf = bytearray(layout.LANE_BYTES + (1 << 20))
    lanes.init_header(buf, 0)
    spec = ModelSpec("identity", "python", (TensorSpec("x", "float32", (None,)),),
                     (TensorSpec("y", "float32", (None,)),))
    with Arena.create("profile" + uuid.uuid4().hex[:8], slot_count=4, max_workers=1, size_classes=[(4096, 4)],
                      prefault=False) as arena:
        regions = types.SimpleNamespace(maps={REGION: buf}, sizes={REGION: len(buf)}, ensure=lambda region: None)
        adapter = types.SimpleNamespace(run_into=None, run=lambda inputs: {"y": inputs["x"]}, synchronize=lambda: None)
        step = Step(arena, 0, regions, adapter, spec)
        submissions, completions, bell = lanes.worker_rings(buf)
        space = Space(buf, layout.LANE, submissions, completions, bell, region=REGION, data_floor=lanes.DATA_FLOOR)
        client = lanes.ClientLane(buf, REGION, "identity")
        x = np.frombuffer(buf, np.float32, 1024, lanes.DATA_FLOOR)
        out_offset, out_capacity = lanes.DATA_FLOOR + 8192, 65536
        spent = dict.fromkeys(PARTS, 0)
        clock = time.perf_counter_ns
        for i in range(calls):
            t0 = clock()
            index, generation = client.submit(i, 0, [(0, lanes.DATA_FLOOR, x)], out_offset, out_capacity)
            t1 = clock()
            [entry] = submissions.pop_all()
            t2 = clock()
            claimed = step.claim(space, entry)
            t3 = clock()
            slot, inputs = step.decode(space, claimed)
            t4 = clock()
            placer = step.place(space, claimed, slot)
            t5 = clock()
            placer.put("y", adapter.run(inputs)["y"])
            t6 = clock()
            step.finish(space, entry, claimed, placer.finish())
            step.record_batch(1)
            t7 = clock()
            client.wait(index, generation, time.monotonic() + 1, 0.0, lambda: None)
            t8 = clock()
            client.read(index, generation, out_offset, out_capacity)
            t9 = clock()
            for part, (a, b) in zip(PARTS, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6), (t6, t7),
                                            (t7, t8), (t8, t9))):
                spent[part] += b - a
    print(f"hot path: {hotpath.IMPL}, {calls} calls, us per call")
    for part, ns in spent.items():
        print(f"{part:8s} {ns / calls / 1000:6.2f}")
    print(f"{'total':8s} {sum(spent.values()) / calls / 1000:6.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000)
