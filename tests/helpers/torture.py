"""Cross-process slot hand-off torture: a front (the caller) and N worker processes.

The front fills a slot's input extent with a random payload, writes the
payload's CRC into the input descriptor, store-releases READY (the CAS) and
rings the worker.  The worker load-acquires the status, checks generation and
state against the ring entry, checks the CRC, writes the reversed payload and
its CRC as the output, and publishes DONE.  The front checks status, the
output bytes and the CRC, then frees the slot for reuse.  Any torn or stale
read shows up as a mismatch; nothing is retried.

As a script: ``torture.py INSTANCE WORKER SPIN`` runs one worker and prints
"ok ROUNDS" or the first mismatch, exiting 0 only if every round was clean.
"""

from __future__ import annotations

import os
import random
import select
import subprocess
import sys
import zlib
from dataclasses import dataclass, field

import numpy as np

from shmserve import layout
from shmserve.allocator import ExtentAllocator, SlotPool
from shmserve.arena import Arena
from shmserve.rings import EventfdDoorbell, FutexDoorbell, Ring, drain_eventfd, new_eventfd
from shmserve.slotstate import Actor, SlotState

STOP = 2**64 - 1
ALIGN = layout.TENSOR_ALIGN


# The input's CRC travels in the slot's request_id, the output's in its flags.
def _crc_field(arena: Arena, slot: int, tensor: int) -> int:
    return layout.SLOT.read_field(arena.buf, arena.geometry.slot_off(slot), "flags" if tensor else "request_id")


def worker_main(instance: str, worker: int, spin: float) -> int:
    arena = Arena.attach(instance)
    buf, g = arena.buf, arena.geometry
    inbox_ring, outbox_ring = Ring.of_worker(arena, worker, False), Ring.of_worker(arena, worker, True)
    inbox = FutexDoorbell(inbox_ring)
    outbox = EventfdDoorbell(outbox_ring, int(os.environ["TORTURE_EVENTFD"]))
    rounds = 0
    while True:
        if not inbox.wait(timeout=60, spin=spin):
            print("worker: no work for 60 s", flush=True)
            return 1
        for entry in inbox_ring.pop_all():
            if entry == STOP:
                print(f"ok {rounds}", flush=True)
                return 0
            index, generation = layout.split_entry(entry)
            status = arena.slot_status(index)  # load-acquire before reading anything
            if status != (generation, SlotState.READY):
                print(f"stale: slot {index} entry gen {generation}, status {status}", flush=True)
                return 1
            arena.transition(index, generation, SlotState.READY, SlotState.RUNNING, Actor.WORKER)
            src = layout.decode_tensor(buf, g, index, 0)
            dst = layout.decode_tensor(buf, g, index, 1)
            payload = buf[src.offset:src.offset + src.nbytes]
            if zlib.crc32(payload) != _crc_field(arena, index, 0):
                print(f"torn: slot {index} gen {generation} payload CRC mismatch", flush=True)
                return 1
            out = payload[::-1]
            buf[dst.offset:dst.offset + dst.nbytes] = out
            layout.SLOT.write(buf, g.slot_off(index), flags=zlib.crc32(out))
            # Order matters here: output and CRC are written before DONE is published.
            arena.transition(index, generation, SlotState.RUNNING, SlotState.DONE, Actor.WORKER)
            outbox_ring.push(entry)
            rounds += 1
        outbox.notify()


@dataclass
class Result:
    rounds: int = 0
    mismatches: list[str] = field(default_factory=list)
    worker_reports: list[str] = field(default_factory=list)


def run_front(arena: Arena, *, rounds: int, workers: int, seed: int, in_flight: int = 4,
              max_payload: int = 8192, spin: float = 0.0002, timeout: float = 60.0) -> Result:
    """Drive ``rounds`` hand-offs through ``workers`` real worker processes; returns what went wrong."""
    rng = random.Random(seed)
    pool = np.random.default_rng(seed).bytes(1 << 20)
    buf, g = arena.buf, arena.geometry
    slots, extents = SlotPool(g.slot_count), ExtentAllocator(g)
    efd = new_eventfd()
    subs = [Ring.of_worker(arena, w, False) for w in range(workers)]
    comps = [Ring.of_worker(arena, w, True) for w in range(workers)]
    bells = [FutexDoorbell(r) for r in subs]
    arms = [EventfdDoorbell(r, efd) for r in comps]
    env = dict(os.environ, TORTURE_EVENTFD=str(efd))
    procs = [subprocess.Popen([sys.executable, __file__, arena.instance, str(w), str(spin)], env=env,
                              pass_fds=(efd,), stdout=subprocess.PIPE, text=True) for w in range(workers)]
    result = Result()
    pending: dict[int, tuple[int, int, bytes, object]] = {}  # slot -> (generation, worker, payload, extent)
    sent = 0
    try:
        while result.rounds < rounds and not result.mismatches:
            while sent < rounds and len(pending) < in_flight * workers:
                index = slots.acquire()
                generation = arena.transition(index, arena.slot_status(index)[0], SlotState.FREE,
                                              SlotState.WRITING, Actor.FRONTEND)
                n = rng.choice((rng.randint(1, 64), rng.randint(1, max_payload)))
                start = rng.randrange(len(pool) - n)
                payload = pool[start:start + n]
                extent = extents.allocate(2 * n + ALIGN)
                out_off = extent.offset + (n + ALIGN - 1) // ALIGN * ALIGN
                buf[extent.offset:extent.offset + n] = payload
                layout.encode_tensor(buf, g, index, 0, role=layout.ROLE_INPUT, name_index=0, dtype="uint8",
                                     shape=(n,), offset=extent.offset)
                layout.encode_tensor(buf, g, index, 1, role=layout.ROLE_OUTPUT, name_index=0, dtype="uint8",
                                     shape=(n,), offset=out_off)
                layout.SLOT.write(buf, g.slot_off(index), request_id=zlib.crc32(payload), flags=0)
                buf[out_off:out_off + n] = bytes(n)  # poison the output area
                # Order matters here: payload and descriptors are written before READY is published.
                arena.transition(index, generation, SlotState.WRITING, SlotState.READY, Actor.FRONTEND)
                worker = sent % workers
                assert subs[worker].push(layout.slot_entry(index, generation))
                bells[worker].notify()
                pending[index] = (generation, worker, payload, extent)
                sent += 1
            got = [entry for ring in comps for entry in ring.pop_all()]
            if not got:
                if any(arm.arm() for arm in arms):
                    continue
                ready, _, _ = select.select([efd], [], [], timeout)
                if not ready:
                    result.mismatches.append(f"no completion for {timeout} s")
                    break
                drain_eventfd(efd)
                continue
            for entry in got:
                index, generation = layout.split_entry(entry)
                expected_gen, _, payload, extent = pending.pop(index)
                status = arena.slot_status(index)  # load-acquire before reading outputs
                if generation != expected_gen or status != (generation, SlotState.DONE):
                    result.mismatches.append(f"round {result.rounds}: slot {index} status {status}, "
                                             f"expected ({expected_gen}, DONE)")
                    break
                out = layout.decode_tensor(buf, g, index, 1)
                data = buf[out.offset:out.offset + out.nbytes]
                if data != payload[::-1] or zlib.crc32(data) != _crc_field(arena, index, 1):
                    result.mismatches.append(f"round {result.rounds}: slot {index} output torn or stale")
                    break
                arena.transition(index, generation, SlotState.DONE, SlotState.FREE, Actor.FRONTEND)
                extents.free(extent)
                slots.release(index)
                result.rounds += 1
    finally:
        for ring, bell in zip(subs, bells):
            ring.push(STOP)
            bell.notify()
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=30)
                result.worker_reports.append(f"exit {proc.returncode}: {out.strip()}")
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                result.worker_reports.append("killed: did not stop")
        os.close(efd)
    return result


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
