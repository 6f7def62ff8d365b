#!/usr/bin/env python3
"""Cross-process slot hand-off round trip, next to a raw Unix-socket echo measured in the same run.

One round trip: the front acquires a slot (FREE -> WRITING), writes a 64-byte
payload, publishes READY, pushes the slot on the worker's submission ring and
rings its doorbell; the worker process wakes, claims it (RUNNING), publishes
DONE and pushes it on its completion ring; the front wakes, checks it and
frees it.  Cases:

  unix-socket echo         64 B over a socketpair to an echo process (the floor)
  futex, sleep             both sides sleep in futex_wait when idle
  eventfd, sleep           both sides sleep in select() on an eventfd
  futex, spin 50 µs        both sides spin up to 50 µs, then sleep in futex_wait
  futex, spin              both sides spin on the ring (no syscalls at all)

usage: python tools/bench_handoff.py [--rounds N] [--json-out FILE]
Prints a Markdown table of p50/p99/mean in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid

from shmserve import layout
from shmserve.arena import Arena
from shmserve.rings import EventfdDoorbell, FutexDoorbell, Ring, new_eventfd
from shmserve.slotstate import Actor, SlotState

STOP = layout.STOP_ENTRY
PAYLOAD = bytes(range(64))
SPIN_FOREVER = 3600.0


def _bells(arena: Arena, kind: str, efd_in: int, efd_out: int):
    sub, comp = Ring.of_worker(arena, 0, False), Ring.of_worker(arena, 0, True)
    if kind == "eventfd":
        return sub, comp, EventfdDoorbell(sub, efd_in), EventfdDoorbell(comp, efd_out)
    return sub, comp, FutexDoorbell(sub), FutexDoorbell(comp)


def peer_main(instance: str, kind: str, spin: float, efd_in: int, efd_out: int) -> None:
    arena = Arena.attach(instance)
    sub, comp, inbox, outbox = _bells(arena, kind, efd_in, efd_out)
    while True:
        inbox.wait(timeout=30, spin=spin)
        entry = sub.pop()
        if entry is None:
            continue
        if entry == STOP:
            return
        index, generation = layout.split_entry(entry)
        arena.transition(index, generation, SlotState.READY, SlotState.RUNNING, Actor.WORKER)
        arena.transition(index, generation, SlotState.RUNNING, SlotState.DONE, Actor.WORKER)
        comp.push(entry)
        outbox.notify()


def echo_main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    while True:
        data = sock.recv(65536)
        if not data:
            return
        sock.sendall(data)


def bench_socket(rounds: int, warmup: int) -> list[float]:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, __file__, "--echo", str(child.fileno())], pass_fds=(child.fileno(),))
    child.close()
    samples = []
    try:
        for i in range(warmup + rounds):
            t0 = time.perf_counter_ns()
            parent.sendall(PAYLOAD)
            got = 0
            while got < len(PAYLOAD):
                got += len(parent.recv(65536))
            if i >= warmup:
                samples.append((time.perf_counter_ns() - t0) / 1000)
    finally:
        parent.close()
        proc.wait(timeout=30)
    return samples


def bench_handoff(kind: str, spin: float, rounds: int, warmup: int) -> list[float]:
    instance = f"bench-{uuid.uuid4().hex[:8]}"
    efd_in, efd_out = new_eventfd(), new_eventfd()
    with Arena.create(instance, slot_count=4, max_workers=1, size_classes=[(4096, 4)]) as arena:
        sub, comp, to_peer, from_peer = _bells(arena, kind, efd_in, efd_out)
        proc = subprocess.Popen([sys.executable, __file__, "--peer", instance, kind, str(spin), str(efd_in),
                                 str(efd_out)], pass_fds=(efd_in, efd_out))
        buf, g = arena.buf, arena.geometry
        data_off = g.classes[0].offset
        generation, samples = 0, []
        try:
            for i in range(warmup + rounds):
                t0 = time.perf_counter_ns()
                generation = arena.transition(0, generation, SlotState.FREE, SlotState.WRITING, Actor.FRONTEND)
                buf[data_off:data_off + len(PAYLOAD)] = PAYLOAD
                arena.transition(0, generation, SlotState.WRITING, SlotState.READY, Actor.FRONTEND)
                sub.push(layout.slot_entry(0, generation))
                to_peer.notify()
                entry = None
                while entry is None:
                    if not from_peer.wait(timeout=30, spin=spin):
                        raise RuntimeError("peer stopped answering")
                    entry = comp.pop()
                arena.transition(0, generation, SlotState.DONE, SlotState.FREE, Actor.FRONTEND)
                if i >= warmup:
                    samples.append((time.perf_counter_ns() - t0) / 1000)
        finally:
            sub.push(STOP)
            to_peer.notify()
            proc.wait(timeout=30)
            del sub, comp, to_peer, from_peer
    os.close(efd_in)
    os.close(efd_out)
    return samples


def summarize(samples: list[float]) -> dict:
    qs = statistics.quantiles(samples, n=100)
    return {"p50_us": round(statistics.median(samples), 1), "p99_us": round(qs[98], 1),
            "mean_us": round(statistics.fmean(samples), 1), "n": len(samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--json-out", metavar="FILE", help="also write the results as JSON here")
    args = parser.parse_args()
    warmup = max(100, args.rounds // 20)
    cases = [
        ("unix-socket echo (floor)", lambda: bench_socket(args.rounds, warmup)),
        ("slot hand-off, futex, sleep", lambda: bench_handoff("futex", 0.0, args.rounds, warmup)),
        ("slot hand-off, eventfd, sleep", lambda: bench_handoff("eventfd", 0.0, args.rounds, warmup)),
        ("slot hand-off, futex, spin 50 µs then sleep", lambda: bench_handoff("futex", 50e-6, args.rounds, warmup)),
        ("slot hand-off, futex, spin", lambda: bench_handoff("futex", SPIN_FOREVER, args.rounds, warmup)),
    ]
    results = {}
    for i, (name, run) in enumerate(cases, 1):  # each case says it begins: one takes seconds, more on a busy host
        print(f"  [{i}/{len(cases)}] measuring {name} ({args.rounds} round trips)", file=sys.stderr, flush=True)
        results[name] = summarize(run())
    floor = results[cases[0][0]]["p50_us"]
    print(f"\n{args.rounds} round trips each, 64 B payload, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| case | p50 µs | p99 µs | mean µs | p50 / socket echo |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        print(f"| {name} | {r['p50_us']} | {r['p99_us']} | {r['mean_us']} | {r['p50_us'] / floor:.2f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "results": results}, f, indent=2)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        peer_main(sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--echo":
        echo_main(int(sys.argv[2]))
    else:
        main()
