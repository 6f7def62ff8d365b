"""SPSC rings and both doorbells, in one process and across real processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmserve.arena import Arena
from shmserve import rings
from shmserve.rings import EventfdDoorbell, FutexDoorbell, Ring, drain_eventfd, new_eventfd, wait_any

PEER = str(Path(__file__).parent / "helpers" / "ring_peer.py")
ARENA = dict(slot_count=16, max_workers=1, size_classes=[(4096, 1)], ring_capacity=16)


@pytest.fixture
def arena(instance_name):
    with Arena.create(instance_name(), **ARENA) as a:
        yield a


def test_push_pop_order_full_and_empty(arena):
    ring = Ring.of_worker(arena, 0, completion=False)
    assert ring.capacity == 16 and ring.empty() and ring.pop() is None
    for i in range(16):
        assert ring.push(i + 100)
    assert not ring.push(999) and len(ring) == 16
    assert [ring.pop() for _ in range(3)] == [100, 101, 102]
    assert ring.push(2**64 - 1)  # wraps around the entry array
    assert ring.pop_all() == list(range(103, 116)) + [2**64 - 1]
    assert ring.empty() and ring.pop_all() == []
    for _ in range(40):  # indices keep growing across many wraps
        ring.push(1)
        assert ring.pop() == 1


def test_discard_drops_pending_entries(arena):
    ring = Ring.of_worker(arena, 0, completion=True)
    for i in range(5):
        ring.push(i)
    assert ring.discard() == 5 and ring.empty()


def test_rings_of_different_workers_do_not_overlap(instance_name):
    with Arena.create(instance_name(), slot_count=4, max_workers=3, size_classes=[(4096, 1)]) as a:
        rings = [Ring.of_worker(a, w, c) for w in range(3) for c in (False, True)]
        for i, ring in enumerate(rings):
            ring.push(i)
        assert [ring.pop() for ring in rings] == list(range(6))


def test_waits_time_out_and_return_at_once_when_non_empty(arena):
    ring = Ring.of_worker(arena, 0, completion=False)
    for bell in (FutexDoorbell(ring), EventfdDoorbell(ring, new_eventfd())):
        t0 = time.monotonic()
        assert bell.wait(timeout=0.05) is False
        assert bell.wait(timeout=0.02, spin=0.01) is False
        assert time.monotonic() - t0 >= 0.06
        ring.push(1)
        assert bell.wait(timeout=5) is True
        ring.pop()
        if isinstance(bell, EventfdDoorbell):
            os.close(bell.fd)


@contextlib.contextmanager
def running_peer(arena, kind, fd=None, spin=0.0):
    """The ring peer process (it answers entry i with i + 1); told to stop with entry 0 and
    reaped when the block ends, killed if it fails."""
    args = [sys.executable, PEER, arena.instance, kind, str(fd if fd is not None else -1), str(spin)]
    peer = subprocess.Popen(args, pass_fds=() if fd is None else (fd,))
    submissions = Ring.of_worker(arena, 0, completion=False)
    try:
        yield peer
        submissions.push(0)
        FutexDoorbell(submissions).notify()
        assert peer.wait(timeout=30) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


@pytest.mark.parametrize("spin", [0.0, 0.0005])
def test_futex_round_trips_across_processes(arena, spin):
    submissions = Ring.of_worker(arena, 0, completion=False)
    completions = Ring.of_worker(arena, 0, completion=True)
    to_peer, from_peer = FutexDoorbell(submissions), FutexDoorbell(completions)
    with running_peer(arena, "futex", spin=spin):
        for i in range(1, 2001):
            assert submissions.push(i)
            to_peer.notify()
            assert from_peer.wait(timeout=10, spin=spin), f"lost wake-up at round {i}"
            assert completions.pop() == i + 1


@pytest.mark.parametrize("waitv", [True, False], ids=["futex_waitv", "fallback"])
def test_wait_any_wakes_for_whichever_ring_gets_an_entry(arena, monkeypatch, waitv):
    """A worker waits on its own ring and its lanes' at once; here the peer answers on the second
    of two rings, 500 times, with no lost wake-up (futex_waitv, and the pre-5.16 fallback)."""
    monkeypatch.setattr(rings, "_HAVE_WAITV", waitv)
    submissions = Ring.of_worker(arena, 0, completion=False)
    completions = Ring.of_worker(arena, 0, completion=True)
    idle = Ring(bytearray(4096), 0, 16)  # a second ring nobody writes to
    t0 = time.monotonic()
    assert wait_any([idle, completions], timeout=0.05) is False
    assert time.monotonic() - t0 >= 0.04
    with running_peer(arena, "futex"):
        for i in range(1, 501):
            assert submissions.push(i)
            FutexDoorbell(submissions).notify()
            assert wait_any([idle, completions], timeout=10), f"lost wake-up at round {i}"
            assert completions.pop() == i + 1


def test_eventfd_completions_wake_an_asyncio_loop(arena):
    submissions = Ring.of_worker(arena, 0, completion=False)
    completions = Ring.of_worker(arena, 0, completion=True)
    fd = new_eventfd()
    bell = EventfdDoorbell(completions, fd)
    received: list[int] = []

    async def main():
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def on_readable():
            drain_eventfd(fd)
            wake.set()

        loop.add_reader(fd, on_readable)
        try:
            for i in range(1, 501):
                submissions.push(i)
                FutexDoorbell(submissions).notify()
                while True:
                    got = completions.pop_all()
                    if got:
                        received.extend(got)
                        break
                    if bell.arm():  # something arrived between drain and arm
                        continue
                    wake.clear()
                    await asyncio.wait_for(wake.wait(), timeout=10)
        finally:
            loop.remove_reader(fd)

    try:
        with running_peer(arena, "eventfd", fd=fd):
            asyncio.run(main())
    finally:
        os.close(fd)
    assert received == [i + 1 for i in range(1, 501)]


def test_wait_any_past_the_futex_waitv_limit_polls_the_rest():
    many = [Ring(bytearray(1024), 0, 16) for _ in range(rings.WAITV_MAX + 2)]
    assert wait_any(many, timeout=0.01) is False
    import threading

    late = threading.Timer(0.05, many[-1].push, args=(5,))  # no doorbell rung: found by polling
    late.start()
    t0 = time.monotonic()
    assert wait_any(many, timeout=5) is True
    assert time.monotonic() - t0 < 4
    late.join()


def test_indices_a_client_scribbled_over_never_make_a_push_or_pop_raise(arena):
    """A lane's client can write any value into its ring's indices: the producer sees a full (or
    corrupt) ring and carries on; 64-bit indices wrap instead of overflowing."""
    ring = Ring.of_worker(arena, 0, completion=True)
    buf = arena.buf
    from shmserve import _atomics as atomics
    from shmserve import layout

    base = arena.geometry.ring_off(0, True)
    atomics.store64(buf, base + layout.RING_TAIL, 2**64 - 1)
    atomics.store64(buf, base + layout.RING_HEAD, 2**64 - 1)
    assert ring.empty() and ring.push(7) and len(ring) == 1  # tail wraps to 0
    assert atomics.load64(buf, base + layout.RING_TAIL) == 0
    assert ring.pop_all() == [7] and ring.empty()
    atomics.store64(buf, base + layout.RING_HEAD, 12345)  # head ahead of tail: "full" or corrupt
    assert not ring.push(8)
    with pytest.raises(RuntimeError, match="corrupt"):
        ring.pop_all()
    assert ring.discard() >= 0 and ring.empty() and ring.push(9) and ring.pop() == 9
