"""Lanes: a client region whose first ``layout.LANE_BYTES`` are a private queue to one worker.

Owns: the lane protocol, for all three parties that touch a lane.

* The client (``ClientLane``): take a free slot, write descriptors, publish
  READY, push and ring; wait for the slot's status word; read the outputs
  and free the slot; recycle the slots of calls that timed out once they
  finish.  The client plays the ``client`` actor of ``shmserve.slotstate``.
* The front-end (``init_header``, ``assign_worker``, ``set_serves``,
  ``set_route_epoch``, ``set_spin_hint``, ``set_divert``, ``pending``, ``has_pending``,
  ``fail_lane``): write the header, tell the lane which worker and which
  model version serve it, its model's routing epoch (``shmserve.routing``: a
  client routes its calls by the route of that epoch), hint whether to spin,
  say whether ``Client.infer`` should come over the socket instead (the
  server is shutting down), and fail whatever a dead worker left queued or
  running (it is then the completion ring's only producer).
* The worker (``worker_rings``, ``queued_entries``, ``DATA_FLOOR``): the
  lane's rings and the doorbell that wakes its client, and the calls queued
  before it took the lane over; a lane's tensors may only lie in its own
  region at ``DATA_FLOOR`` or above.

A call (docs/protocol.md, "Lanes")::

    client: FREE -> WRITING (new generation); descriptors, request, stage times;
            WRITING -> READY; push slot_entry on the submission ring; ring the worker
    worker: READY -> RUNNING; run; outputs and descriptors; RUNNING -> DONE | ERROR;
            push the entry on the completion ring; ring the client
    client: the status word says DONE | ERROR (the entry is only a wake-up);
            read; DONE | ERROR -> FREE

A call its client gives up on (timed out, interrupted, its task cancelled:
``ClientLane.abandon``) is taken back if no worker has claimed it: READY ->
ERROR -> FREE by the client (as the front-end takes back an arena slot), so
the worker's claim of its entry fails and nothing of it runs; its slot is
free at once.  One a worker has claimed runs to its end
and its slot is freed once it has finished (its outputs are never read).  A
taken-back call's entry may still lie on the submission ring: its slot is
used again once the free ones are taken and the ring has room for it (never
more entries than the ring holds; nothing on a call's own path changes).

The status word, not a completion entry, says that a call finished: a
worker that dies between publishing DONE and pushing its entry loses
nothing, and a client that never drains its completion ring only costs
itself wake-ups.  The client writes every byte of its lane, so the worker and
front-end trust none of it (every index, generation and descriptor is
checked where it is used).

Each call's own work on the lane's bytes (submit, wait, read; the worker's
claim, decode and publish) is ``shmserve.hotpath``'s: compiled by default, the
Python reference with ``SHMSERVE_HOTPATH=python``.  ``ClientLane`` keeps the
client's state around it (free slots, abandoned calls, the deadline).

Must not: decide which worker serves a lane (the front-end's regions module
does), run models, or touch a socket.  Offsets come from ``layout.LANE``.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from shmserve import _atomics as atomics
from shmserve import hotpath, layout
from shmserve.arena import SlotConflict, transition_slot
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.rings import FutexDoorbell, Ring
from shmserve.slotstate import FINISHED, Actor, SlotState

LANE = layout.LANE
DATA_FLOOR = layout.LANE.data_off  # a lane's tensors lie at this offset of its region or above
# How a worker's refusal of a call planned from another version's spec begins (MODEL_UNAVAILABLE,
# before anything ran: a swap handed the lane over).  Only such a refusal may be planned again and
# sent again by a client: a call that failed MODEL_UNAVAILABLE otherwise (a drain timed out) ran.
VERSION_MOVED = "this lane serves version"


def version_moved(exc) -> bool:
    """Whether ``exc`` (a ShmserveError) is a worker's refusal of a call planned from another
    version's spec (``VERSION_MOVED``): nothing of it ran."""
    return exc.code is ErrorCode.MODEL_UNAVAILABLE and exc.message.startswith(VERSION_MOVED)
WAIT_SLICE_S = 0.05  # a waiting client asks whether the server is still there this often
RECENT_CALLS = 8  # the calls whose waits decide whether a lane's next wait naps before spinning (ClientLane.nap)

_FREE, _READY, _RUNNING = int(SlotState.FREE), int(SlotState.READY), int(SlotState.RUNNING)
_HOT = hotpath.active  # the client's per-call work: compiled, or the reference (SHMSERVE_HOTPATH)


def _rings(buf) -> tuple[Ring, Ring]:
    return (Ring(buf, LANE.submission_off, LANE.ring_capacity),
            Ring(buf, LANE.completion_off, LANE.ring_capacity))


# -- the front-end's part -----------------------------------------------------------------

def init_header(buf, model_id: int, serves: int = 0, route_epoch: int = 0) -> None:
    """Write a new lane's header: served by no worker yet, by version ``serves`` of its model, in
    its model's routing epoch ``route_epoch``, no spinning."""
    layout.encode_lane_header(buf, model_id=model_id, worker=layout.NO_WORKER, spin_us=0, serves=serves,
                              route_epoch=route_epoch)


def set_serves(buf, version: int) -> None:
    """Record which version of its model the lane's calls run on now (a drain moves it)."""
    atomics.store32(buf, layout.LANE_SERVES_OFFSET, version)


def set_route_epoch(buf, epoch: int) -> None:
    """Record its model's routing epoch: a client whose route is of another asks for it again."""
    atomics.store32(buf, layout.LANE_EPOCH_OFFSET, epoch & 0xFFFFFFFF)


def assign_worker(buf, worker: int) -> None:
    """Record which worker serves the lane (``layout.NO_WORKER``: none); its client reads it."""
    atomics.store32(buf, layout.LANE_WORKER_OFFSET, worker)


def set_spin_hint(buf, spin_us: int) -> None:
    """How long the lane's client should spin for a completion before it sleeps."""
    atomics.store32(buf, layout.LANE_SPIN_OFFSET, spin_us)


def set_divert(buf, divert: bool) -> None:
    """Whether ``Client.infer`` should send its requests over the socket rather than through the
    lane (the server is shutting down: the socket answers SHUTTING_DOWN; or a reload put its owner
    under a rate limit, which the socket keeps)."""
    atomics.store32(buf, layout.LANE_DIVERT_OFFSET, 1 if divert else 0)


def pending(buf) -> list[int]:
    """The slot entries (index and generation) of the calls queued or running in the lane."""
    found = []
    for index in range(LANE.slot_count):
        generation, state = layout.unpack_status(atomics.load64(buf, LANE.slot_off(index)))
        if state in (_READY, _RUNNING):
            found.append(layout.slot_entry(index, generation))
    return found


def has_pending(buf) -> bool:
    """Whether a call is queued or running in the lane (a slot READY or RUNNING)."""
    return bool(pending(buf))


def fail_lane(buf, code: ErrorCode, message: str, *, running_only: bool = False) -> int:
    """Fail every call queued or running in a lane whose worker is dead: ERROR with ``code``,
    pushed on its completion ring, and wake the client (also for a call the worker finished but
    did not get to push).  ``running_only``: fail only the calls the worker had claimed (the
    lane moves on to another worker, which serves those still READY: ``queued_entries``).
    Returns how many calls were failed.

    Only the front-end calls this, once the lane's worker is known dead or has said it cannot
    attach the lane, or has stopped (a shutdown): it is then the completion ring's only producer.
    """
    _, completions = _rings(buf)
    failed = 0
    doomed = (_RUNNING,) if running_only else (_READY, _RUNNING)
    for index in range(LANE.slot_count):
        generation, state = layout.unpack_status(atomics.load64(buf, LANE.slot_off(index)))
        if state not in doomed:
            continue
        layout.encode_error(buf, LANE, index, code, message)
        try:
            transition_slot(buf, LANE, index, generation, SlotState(state), SlotState.ERROR, Actor.FRONTEND)
        except SlotConflict:
            continue  # the client rewrote it meanwhile
        completions.push(layout.slot_entry(index, generation))
        failed += 1
    FutexDoorbell(completions).notify()
    return failed


# -- the worker's part --------------------------------------------------------------------

def usable(size: int) -> bool:
    """Whether a region of ``size`` bytes can hold a lane."""
    return size >= layout.LANE_BYTES


def queued_entries(buf) -> list[int]:
    """Ring entries for the lane's READY slots, for a worker taking the lane over: the worker
    before it may have taken their entries off the submission ring and died before claiming
    them.  An entry also still on the ring is claimed once (the second claim finds it RUNNING)."""
    entries = []
    for index in range(LANE.slot_count):
        generation, state = layout.unpack_status(atomics.load64(buf, LANE.slot_off(index)))
        if state == _READY:
            entries.append(layout.slot_entry(index, generation))
    return entries


def worker_rings(buf) -> tuple[Ring, Ring, FutexDoorbell]:
    """The worker's end of a lane: (submissions to consume, completions to produce, the
    doorbell that wakes the client after a completion is pushed)."""
    submissions, completions = _rings(buf)
    return submissions, completions, FutexDoorbell(completions)


# -- the client's part --------------------------------------------------------------------

class ClientLane:
    """The client's end of a lane in ``buf`` (the mapping of region ``region_id``).

    ``submit`` publishes one call and returns its (slot, generation); ``wait``
    blocks until that slot finished; ``read`` returns its outputs (or raises
    its error) and frees the slot.  A call given up on is ``abandon``ed: taken
    back if no worker claimed it (its slot free at once), else its slot stays
    with the worker and is recycled once it has finished.  ``taken_back``
    counts the calls taken back, ``given_up`` every call abandoned.
    Not thread-safe (one client, one thread, or one event loop).
    """

    def __init__(self, buf, region_id: int, model: str):
        self.buf, self.region_id, self.model = buf, region_id, model
        self.size = len(buf)
        self.submissions, self.completions = _rings(buf)
        self.bell, self.inbox = FutexDoorbell(self.submissions), FutexDoorbell(self.completions)
        self.free = list(range(LANE.slot_count - 1, -1, -1))
        self.abandoned: dict[int, int] = {}  # timed out: slot -> generation, freed once finished
        self.recent = [0.0] * RECENT_CALLS  # the last calls' waits in seconds (0.0: none yet), in turn
        self.recent_at = 0
        self.retaken: list[int] = []  # slots taken back before a worker claimed them: free once the ring has room
        self.taken_back = self.given_up = 0

    def submit(self, request_id: int, model_id: int, inputs: list[tuple[int, int, np.ndarray]],
               out_offset: int, out_capacity: int, priority: int = 0, deadline_ns: int = 0,
               flags: int = 0, caller: int = 0) -> tuple[int, int]:
        """Publish one call (``inputs``: (input index, offset in the region, view)); returns
        (slot, generation).  ``priority`` (0: the model's default level), ``deadline_ns``
        (CLOCK_MONOTONIC; 0: none; past it the worker answers TIMEOUT unrun) and ``flags``
        (``layout.SLOT_FLAG_OWN_TIMEOUT``: the deadline is the caller's own timeout) tell the worker
        how to schedule it (``shmserve.scheduling``); so does ``caller`` (u32), in a door process's
        lane only: its connection, for fairness between the door's callers (a client's lane is one
        caller, whatever it writes).  OVERLOADED if every slot is busy
        (``has_free_slot`` tells first); LayoutError for an input no descriptor can hold (the slot
        stays free)."""
        if not self.free and not self.has_free_slot():
            raise ShmserveError(ErrorCode.OVERLOADED, f"all {LANE.slot_count} slots of this lane are busy "
                                                      f"(calls that timed out still run)")
        index = self.free.pop()
        try:
            return index, _HOT.submit(self.buf, index, self.region_id, request_id, model_id, inputs, out_offset,
                                      out_capacity, 0, priority, deadline_ns, flags, caller)
        except (ShmserveError, SlotConflict):  # the slot was not free, or moved under us: the lane was
            raise                             # overwritten, and the slot is not ours now
        except Exception:  # refused before READY: the slot is FREE again
            self.free.append(index)
            raise

    def routable(self) -> bool:
        """Whether ``Client.infer`` may use the lane: a worker serves it and the front-end does not
        divert its requests (a shutdown).  The lane's own header says so; a lane without a worker
        queues its calls, where the socket would start an evicted model again or fail fast."""
        buf = self.buf
        return atomics.load32(buf, layout.LANE_WORKER_OFFSET) != layout.NO_WORKER and \
            not atomics.load32(buf, layout.LANE_DIVERT_OFFSET)

    def serves(self) -> int:
        """The version of its model the lane's calls run on now, as the front-end last said (0: not said)."""
        return atomics.load32(self.buf, layout.LANE_SERVES_OFFSET)

    def route_epoch(self) -> int:
        """Its model's routing epoch, as the front-end last wrote it (``shmserve.routing``)."""
        return atomics.load32(self.buf, layout.LANE_EPOCH_OFFSET)

    def spin_hint(self) -> float:
        """Seconds the front-end suggests spinning for a completion before sleeping."""
        return atomics.load32(self.buf, layout.LANE_SPIN_OFFSET) / 1e6

    def wait(self, index: int, generation: int, deadline: float, spin_s: float | None,
             alive: Callable[[], None]) -> None:
        """Block until slot ``index`` finished, spinning ``spin_s`` first (None: the front-end's
        hint; after a nap when the lane's calls take long: ``nap``); ``alive()`` is asked every
        WAIT_SLICE_S whether the server is still there (it raises if not, unless the call has
        finished meanwhile).  TIMEOUT at ``deadline``
        (monotonic), after which the slot is abandoned."""
        if spin_s is None:
            spin_s = self.spin_hint()
        buf, wait_slice = self.buf, _HOT.wait_slice
        started = time.monotonic()
        spin_from = started + self.nap(spin_s)  # before it the wait only sleeps (a long call: see nap)
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if now < spin_from:
                done = wait_slice(buf, index, generation, min(remaining, WAIT_SLICE_S, spin_from - now), 0.0)
            else:
                done = wait_slice(buf, index, generation, min(remaining, WAIT_SLICE_S), spin_s)
                spin_s = 0.0  # one spin a call
            if done:
                self.record(time.monotonic() - started)
                return
            if remaining <= 0:
                self.abandon(index, generation)
                raise ShmserveError(ErrorCode.TIMEOUT, "no answer from the worker in time")
            try:
                alive()
            except ShmserveError:
                if _HOT.finished(buf, index, generation):
                    return  # answered just before the server went (a shutdown fails calls, then closes)
                raise

    def nap(self, spin_s: float) -> float:
        """How long a wait sleeps before it starts spinning: a call that takes longer than the spin
        would end in a futex wake-up (tens of µs on a VM, more than the spin it saves), so when the
        last RECENT_CALLS calls all took more than twice ``spin_s``, the wait sleeps until half a
        spin before the shortest of them was due, then spins ``spin_s`` as usual.  A call that
        finishes during the nap wakes it as before (the worker sees the waiter); one that outlasts
        the spin is slept for as before.  0.0: spin first (short calls, no spin, no history)."""
        shortest = min(self.recent)
        if spin_s <= 0 or shortest <= 2 * spin_s:
            return 0.0
        return shortest - spin_s / 2

    def record(self, waited: float) -> None:
        """Remember one finished call's wait (seconds), for ``nap``."""
        self.recent[self.recent_at] = waited
        self.recent_at = (self.recent_at + 1) % RECENT_CALLS

    def wait_for_wakeup(self, timeout: float) -> bool:
        """Sleep until a completion is pushed or ``timeout`` passes (for a watcher thread)."""
        if self.inbox.wait(timeout=timeout):
            self.completions.discard()
            return True
        return False

    def read(self, index: int, generation: int, out_offset: int,
             out_capacity: int) -> dict[int, tuple[np.dtype, tuple, int]]:
        """The finished slot's outputs as output index -> (dtype, shape, offset in the region);
        raises its error as ShmserveError (BAD_DTYPE for a bytes output).  Frees the slot either way."""
        return _HOT.read(self.buf, self.free, index, generation, self.region_id, out_offset, out_capacity)

    def abandon(self, index: int, generation: int) -> bool:
        """Give up on a call (timed out, interrupted, cancelled).  Not claimed by a worker yet: taken
        back (READY -> ERROR -> FREE: the worker's claim fails, nothing of it runs) and its slot is
        free at once (``retaken``: used once the free ones are taken, while the ring has room);
        True.  Claimed (or finished): its slot is recycled once the worker has finished it; False.
        Idempotent: a call already taken back (or a slot reused since) is True again."""
        status_generation, state = layout.unpack_status(atomics.load64(self.buf, LANE.slot_off(index)))
        if status_generation != generation or state == _FREE:
            return True  # taken back already (or reused since): not ours to hold
        if state == _READY:
            try:  # as the front-end takes back a request of the arena: READY -> ERROR, then free it
                transition_slot(self.buf, LANE, index, generation, SlotState.READY, SlotState.ERROR, Actor.CLIENT)
            except SlotConflict:
                pass  # the worker claimed it just now
            else:
                transition_slot(self.buf, LANE, index, generation, SlotState.ERROR, SlotState.FREE, Actor.CLIENT)
                self.retaken.append(index)
                self.taken_back += 1
                self.given_up += 1
                return True
        if self.abandoned.get(index) != generation:
            self.given_up += 1
        self.abandoned[index] = generation
        return False

    def has_free_slot(self) -> bool:
        if not self.free:
            self._reclaim()
        return bool(self.free)

    def free_slots(self) -> int:
        """Slots no call holds: free, or taken back (free as soon as the ring has room for them)."""
        return len(self.free) + len(self.retaken)

    def finished(self, index: int, generation: int) -> bool:
        """Whether slot ``index`` of ``generation`` is DONE or ERROR (load-acquire)."""
        return _HOT.finished(self.buf, index, generation)

    def _reclaim(self) -> None:
        """Free the slots of timed-out calls that have finished since, and the slots taken back for
        which the submission ring has room: a taken-back call's entry stays on the ring until the
        worker reads it, so a slot joins ``free`` only while every slot there could still be
        pushed (entries on the ring and free slots together at most its capacity)."""
        if self.retaken:
            room = LANE.ring_capacity - len(self.submissions) - len(self.free)
            while self.retaken and room > 0:
                self.free.append(self.retaken.pop())
                room -= 1
        for index, generation in list(self.abandoned.items()):
            if self.finished(index, generation):
                del self.abandoned[index]
                _, state = layout.unpack_status(atomics.load64(self.buf, LANE.slot_off(index)))
                self._free(index, generation, state)

    def _free(self, index: int, generation: int, state: int) -> None:
        if state in FINISHED:
            transition_slot(self.buf, LANE, index, generation, SlotState(state), SlotState.FREE, Actor.CLIENT)
            self.free.append(index)
