"""Single-producer single-consumer rings in the arena, and the doorbells that wake their consumers.

Owns: the ring protocol (head/tail words, entries, ordering) and the two
ways a consumer sleeps: a shared futex on the ring's doorbell word (for
worker threads), or an eventfd the asyncio loop watches (for the front-end).

Ring protocol.  ``tail`` is written only by the producer, ``head`` only by
the consumer, each on its own cache line.  Push: write the entry, then
store-release ``tail``.  Pop: load-acquire ``tail``, read the entry, then
store-release ``head`` (the producer may reuse that entry only after seeing
the new head).  Entries are ``layout.slot_entry`` (or, on a worker's own
ring, ``layout.command_entry``); consumers treat them as untrusted and
validate the index.  Indices are u64 that wrap: every difference is taken
modulo 2**64, so indices a lane's client scribbled over make a ring look
full or corrupt (``pop_all`` raises RuntimeError), never raise on a push.

Doorbell protocol (no lost wake-ups, no syscall while the consumer is awake).
The doorbell line holds ``seq`` (u32, the futex word) and ``waiters`` (u32):

    producer: push; seq += 1 (RMW); if RMW-read(waiters) != 0: wake
    consumer: s = seq; if ring non-empty: done
              waiters += 1 (RMW); if ring non-empty: done
              futex_wait(seq, s)   # returns at once if seq moved after we read it
              waiters -= 1

All the doorbell operations are sequentially consistent read-modify-writes,
so either the producer sees the waiter and wakes it, or the consumer's second
check sees the entry.  With an eventfd the ``waiters`` word is an "armed"
flag instead: the consumer arms it before its final check, and the producer
swaps it back to 0 and writes the eventfd only if it was armed, so a burst of
completions costs one write(2) and one loop wake-up.

A worker consumes its own ring and the rings of the lanes attached to it
(client regions with a private queue, ``layout.LANE``): ``wait_any`` runs the
same protocol on all of them and sleeps in one futex_waitv(2).

Why futex for workers and eventfd for the front-end: measured by
``tools/bench_handoff.py`` (docs/performance.md).  A futex wait is one
syscall on a word already in the arena, needs no descriptor passing, and was
the faster of the two; the asyncio loop, however, can only wait on file
descriptors, so the front-end's completion doorbell is an eventfd.

Must not: know what a slot holds or allocate anything per operation.
"""

from __future__ import annotations

import errno
import os
import select
import time

from shmserve import _atomics as atomics
from shmserve import layout

WAKE_ALL = 0x7FFFFFFF
_U64 = (1 << 64) - 1  # indices are u64 and wrap; a lane's client may have written any value into them


class Ring:
    """One SPSC ring at ``offset`` in ``buf`` with ``capacity`` u64 entries (a power of two)."""

    def __init__(self, buf, offset: int, capacity: int):
        if capacity < 1 or capacity & (capacity - 1):
            raise ValueError("ring capacity must be a power of two")
        self.buf, self.offset = buf, offset
        self.capacity = capacity
        self._mask = capacity - 1
        self._tail = offset + layout.RING_TAIL
        self._head = offset + layout.RING_HEAD
        self.seq_offset = offset + layout.RING_SEQ
        self.waiters_offset = offset + layout.RING_WAITERS
        self._entries = offset + layout.RING_ENTRIES_OFFSET

    @classmethod
    def of_worker(cls, arena, worker: int, completion: bool) -> "Ring":
        """The submission (``completion=False``) or completion ring of a worker in ``arena``."""
        geometry = arena.geometry
        return cls(arena.buf, geometry.ring_off(worker, completion), geometry.ring_capacity)

    # -- producer ---------------------------------------------------------------------------

    def push(self, value: int) -> bool:
        """Append ``value`` (u64); False if the ring is full (or its indices are corrupt: a lane's
        client can write them).  Producer only."""
        buf = self.buf
        tail = atomics.load64(buf, self._tail)
        if (tail - atomics.load64(buf, self._head)) & _U64 >= self.capacity:
            return False
        atomics.store64(buf, self._entries + 8 * (tail & self._mask), value)
        # Order matters here: the entry is written before tail publishes it.
        atomics.store64(buf, self._tail, (tail + 1) & _U64)
        return True

    # -- consumer ---------------------------------------------------------------------------

    def pop(self) -> int | None:
        """Remove and return the oldest entry, or None if empty.  Consumer only."""
        buf = self.buf
        head = atomics.load64(buf, self._head)
        if head == atomics.load64(buf, self._tail):
            return None
        value = atomics.load64(buf, self._entries + 8 * (head & self._mask))
        atomics.store64(buf, self._head, (head + 1) & _U64)
        return value

    def pop_all(self) -> list[int]:
        """Remove and return every entry present now (one head update).  Consumer only."""
        buf = self.buf
        head = atomics.load64(buf, self._head)
        tail = atomics.load64(buf, self._tail)
        count = (tail - head) & _U64
        if count == 0:
            return []
        if not 0 < count <= self.capacity:
            raise RuntimeError(f"ring indices corrupt: head {head}, tail {tail}")
        values = [atomics.load64(buf, self._entries + 8 * ((head + i) & self._mask)) for i in range(count)]
        atomics.store64(buf, self._head, tail)
        return values

    def __len__(self) -> int:
        return (atomics.load64(self.buf, self._tail) - atomics.load64(self.buf, self._head)) & _U64

    def empty(self) -> bool:
        return atomics.load64(self.buf, self._head) == atomics.load64(self.buf, self._tail)

    def discard(self) -> int:
        """Drop every entry (the producer may call this once the consumer is known dead); returns the count."""
        tail = atomics.load64(self.buf, self._tail)
        dropped = (tail - atomics.load64(self.buf, self._head)) & _U64
        atomics.store64(self.buf, self._head, tail)
        return dropped


class FutexDoorbell:
    """Wake a consumer sleeping in a shared futex on the ring's doorbell word."""

    def __init__(self, ring: Ring):
        self.ring = ring

    def notify(self) -> None:
        """Producer: call after ``push``.  A syscall only if the consumer sleeps."""
        buf = self.ring.buf
        atomics.fetch_add32(buf, self.ring.seq_offset, 1)
        if atomics.fetch_add32(buf, self.ring.waiters_offset, 0):
            atomics.futex_wake(buf, self.ring.seq_offset, WAKE_ALL)

    def wait(self, timeout: float | None = None, spin: float = 0.0) -> bool:
        """Consumer: block until the ring is non-empty or ``timeout`` seconds pass.

        Spins (checking the ring) for up to ``spin`` seconds before sleeping.
        Returns True if the ring is non-empty.
        """
        ring, buf = self.ring, self.ring.buf
        if not ring.empty():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if spin > 0 and _spin_until_nonempty(ring, min(spin, timeout) if timeout is not None else spin):
            return True
        while True:
            seq = atomics.load32(buf, ring.seq_offset)
            if not ring.empty():
                return True
            atomics.fetch_add32(buf, ring.waiters_offset, 1)
            try:
                if not ring.empty():
                    return True
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                atomics.futex_wait(buf, ring.seq_offset, seq, remaining)
            finally:
                atomics.fetch_add32(buf, ring.waiters_offset, -1)
            if not ring.empty():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False


def wait_any(rings: list[Ring], timeout: float, spin: float = 0.0) -> bool:
    """Consumer of several rings with futex doorbells (a worker's own ring and its lanes'): block
    until any is non-empty or ``timeout`` seconds pass; True if one is non-empty.

    The FutexDoorbell protocol on every ring at once, sleeping in one futex_waitv(2).
    A lane's doorbell lies in its client's memory: a client that scribbles on it can only
    cost wake-ups on its own lane or a spurious wake-up here, never a lost one elsewhere.
    On kernels without futex_waitv (before 5.16), or past WAITV_MAX rings, this sleeps on
    the first ring only, in slices of ``FALLBACK_SLICE_S``, and polls the others between slices.
    """
    if len(rings) == 1:
        return FutexDoorbell(rings[0]).wait(timeout, spin)
    if _any_nonempty(rings):
        return True
    if spin > 0 and _spin_until(rings, min(spin, timeout)):
        return True
    deadline = time.monotonic() + timeout
    while True:
        words = [(r.buf, r.seq_offset, atomics.load32(r.buf, r.seq_offset)) for r in rings]
        if _any_nonempty(rings):
            return True
        for r in rings:
            atomics.fetch_add32(r.buf, r.waiters_offset, 1)
        try:
            if _any_nonempty(rings):
                return True
            remaining = max(0.0, deadline - time.monotonic())
            if _HAVE_WAITV and len(words) <= WAITV_MAX:
                _waitv(words, remaining)
            else:
                atomics.futex_wait(*words[0], min(remaining, FALLBACK_SLICE_S))
        finally:
            for r in rings:
                atomics.fetch_add32(r.buf, r.waiters_offset, -1)
        if _any_nonempty(rings):
            return True
        if time.monotonic() >= deadline:
            return False


FALLBACK_SLICE_S = 0.001
WAITV_MAX = 128  # the kernel's limit on words per futex_waitv
_HAVE_WAITV = True


def _waitv(words, timeout: float) -> None:
    global _HAVE_WAITV
    try:
        atomics.futex_waitv(words, timeout)
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        _HAVE_WAITV = False


def _any_nonempty(rings: list[Ring]) -> bool:
    for r in rings:
        if not r.empty():
            return True
    return False


def _spin_until(rings: list[Ring], seconds: float) -> bool:
    deadline = time.perf_counter() + seconds
    while True:
        for _ in range(16):
            if _any_nonempty(rings):
                return True
        if time.perf_counter() >= deadline:
            return False


class EventfdDoorbell:
    """Wake a consumer waiting on an eventfd, e.g. an asyncio loop (``loop.add_reader(fd, …)``).

    Several rings may share one eventfd: the consumer drains them all on each
    wake-up, then ``arm``s each and re-checks before it sleeps again.
    """

    def __init__(self, ring: Ring, fd: int):
        self.ring = ring
        self.fd = fd

    def notify(self) -> None:
        """Producer: call after ``push``.  Writes the eventfd only if the consumer armed it."""
        if atomics.exchange32(self.ring.buf, self.ring.waiters_offset, 0):
            os.eventfd_write(self.fd, 1)

    def arm(self) -> bool:
        """Consumer: ask for a wake-up on the next push.  Returns True if the ring is already
        non-empty (drain again instead of sleeping)."""
        atomics.exchange32(self.ring.buf, self.ring.waiters_offset, 1)
        return not self.ring.empty()

    def wait(self, timeout: float | None = None, spin: float = 0.0) -> bool:
        """Blocking consumer wait (for threads and benchmarks; asyncio uses ``arm`` + add_reader)."""
        ring = self.ring
        if not ring.empty():
            return True
        if spin > 0 and _spin_until_nonempty(ring, min(spin, timeout) if timeout is not None else spin):
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.arm():
                return True
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if ready:
                drain_eventfd(self.fd)
            if not ring.empty():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False


def new_eventfd() -> int:
    """A non-blocking, close-on-exec eventfd for a completion doorbell (pass it to workers explicitly)."""
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def drain_eventfd(fd: int) -> None:
    """Reset a non-blocking eventfd's counter (ignores 'nothing to read')."""
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


def _spin_until_nonempty(ring: Ring, seconds: float) -> bool:
    deadline = time.perf_counter() + seconds
    while True:
        for _ in range(64):
            if not ring.empty():
                return True
        if time.perf_counter() >= deadline:
            return False
