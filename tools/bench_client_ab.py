#!/usr/bin/env python3
"""Another client library against this one: per-call time of the hot paths, A/B in one process.

A change to the client library must not make a hot path slower, and the
machines we measure on are shared and noisy: this loads a second copy of the
client library (``--old``: a ``client.py`` file, as ``git show
main:shmserve/client.py`` writes it, or a ``shmserve/client`` package
directory) beside the installed one, connects both to one server (its own,
``bench.spawn_server``'s benchmark models), and times, interleaved in
shuffled rounds so that the noise falls on both alike (``bench.interleaved``):

  infer         Client.infer of ``identity`` through its lane (the default)
  zero-copy     one Client.zero_copy call, ``run()`` again and again
  async infer   AsyncClient.infer through its lane, one call at a time
  socket        Client(lanes=False).infer: the socket path

timed by the wall clock, and the first, second and fourth again by the calling
thread's CPU time (``time.thread_time``) on clients that never spin
(``spin_us=0``): what the client itself costs, far less noisy on a busy
machine than the wall clock (a call's wait for the worker costs no CPU then),

each at ``--payload`` bytes (default 4 KiB, uint8).  Prints per case the
median of the rounds' medians, its spread (the rounds' lowest and highest
median), and the new copy's difference: the median of the rounds' own
differences (old and new share each round's noise), with its quartiles.

usage: python tools/bench_client_ab.py --old FILE_OR_DIR [--rounds N] [--per-round K] [--payload BYTES]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from shmserve import bench


def load_old(path: Path):
    """The client library at ``path`` as a module of its own (its imports of the rest of shmserve
    are the installed ones)."""
    if path.is_dir():
        spec = importlib.util.spec_from_file_location("shmserve_client_old", path / "__init__.py",
                                                      submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location("shmserve_client_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def cases_of(lib, label: str, sock: str, x: np.ndarray, loop: asyncio.AbstractEventLoop, keep: list) -> dict:
    """(case, label) -> (the call, the clock it is timed by)."""
    c = lib.Client(sock, timeout=60)
    plain = lib.Client(sock, timeout=60, lanes=False)
    ac = lib.AsyncClient(sock, timeout=60)
    loop.run_until_complete(ac.connect())
    still = lib.Client(sock, timeout=60, spin_us=0)  # never spins: its CPU time is its own work and syscalls
    still_plain = lib.Client(sock, timeout=60, spin_us=0, lanes=False)
    calls = []
    for client in (c, still):
        call = client.zero_copy("identity", {"x": (x.shape, x.dtype)})
        call.inputs["x"][...] = x
        calls.append(call)
    keep += [c, plain, ac, still, still_plain, *calls]
    inputs = {"x": x}
    wall, cpu = time.perf_counter, time.thread_time
    return {("infer", label): (lambda: c.infer("identity", inputs), wall),
            ("zero-copy", label): (calls[0].run, wall),
            ("async infer", label): (lambda: loop.run_until_complete(ac.infer("identity", inputs)), wall),
            ("socket", label): (lambda: plain.infer("identity", inputs), wall),
            ("infer, CPU", label): (lambda: still.infer("identity", inputs), cpu),
            ("zero-copy, CPU", label): (calls[1].run, cpu),
            ("socket, CPU", label): (lambda: still_plain.infer("identity", inputs), cpu)}


def interleaved(cases: dict, rounds: int, per_round: int, seed: int, warm: int) -> dict:
    """As ``bench.interleaved``, each case timed by its own clock."""
    for f, _ in cases.values():
        for _ in range(warm):
            f()
    samples: dict = {k: [] for k in cases}
    order, rng = list(cases), random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for key in order:
            (f, clock), out = cases[key], samples[key]
            for _ in range(per_round):
                t0 = clock()
                f()
                out.append(clock() - t0)
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, type=Path, help="the other client library: client.py or a package dir")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--per-round", type=int, default=200)
    p.add_argument("--payload", type=int, default=4096, help="input bytes (default 4096)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    import shmserve.client as new

    old = load_old(args.old)
    x = (np.arange(args.payload) % 251).astype(np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = bench.spawn_server(Path(tmp))
        keep: list = []
        loop = asyncio.new_event_loop()
        try:
            cases = {**cases_of(old, "old", sock, x, loop, keep), **cases_of(new, "new", sock, x, loop, keep)}
            for (case, _), (f, _) in cases.items():
                assert np.array_equal(np.asarray(f()["y"]), x), case
            samples = interleaved(cases, args.rounds, args.per_round, args.seed, warm=50)
            print(f"{args.payload} B, {args.rounds} rounds x {args.per_round} calls, us per call: the median of the "
                  f"rounds' medians [lowest, highest round]; new - old: the median of the rounds' differences "
                  f"[25th, 75th percentile] (old and new share each round's noise)")
            print("| case | old | new | new - old |\n| --- | ---: | ---: | ---: |")
            for case in dict.fromkeys(c for c, _ in cases):
                medians = {}
                for label in ("old", "new"):
                    s = samples[(case, label)]
                    medians[label] = [statistics.median(s[i:i + args.per_round]) * 1e6
                                      for i in range(0, len(s), args.per_round)]
                diffs = sorted(n - o for o, n in zip(medians["old"], medians["new"]))
                q1, q3 = (statistics.quantiles(diffs, n=4)[i] for i in (0, 2)) if len(diffs) > 1 else (diffs[0],) * 2
                cells = [f"{statistics.median(m):.1f} [{min(m):.1f}, {max(m):.1f}]" for m in medians.values()]
                print(f"| {case} | {cells[0]} | {cells[1]} | {statistics.median(diffs):+.1f} [{q1:+.1f}, {q3:+.1f}] |")
        finally:
            for obj in reversed(keep):
                try:
                    if isinstance(obj, (old.AsyncClient, new.AsyncClient)):
                        loop.run_until_complete(obj.close())
                    elif hasattr(obj, "release"):
                        obj.release()
                    else:
                        obj.close()
                except Exception:
                    pass
            loop.close()
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
