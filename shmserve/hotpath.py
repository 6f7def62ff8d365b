"""The per-call work of a lane round trip, twice: the reference in Python and ``shmserve._hotpath`` in C.

Owns: the functions every lane call runs through, on both sides, as plain functions over a
buffer (no objects, so both implementations take the same arguments and leave the same bytes),
and the choice of implementation: ``SHMSERVE_HOTPATH`` = ``c`` (the default) or ``python``, read
once at import into ``IMPL``; ``active`` is the chosen one, ``PYTHON`` and ``C`` are both (the
tests run the same calls through each and compare the bytes: ``tests/test_hotpath.py``).

==============  =========================================================================
client (lane)   ``submit`` (FREE -> WRITING, descriptors, request, stage times, WRITING ->
                READY, push, wake the worker), ``wait_slice``, ``finished``, ``read`` (the
                outputs checked against the output area; DONE | ERROR -> FREE)
worker          ``claim`` (READY -> RUNNING, t_claimed), ``claim_checked`` (the same after the
                request's deadline and queue timeout are checked, counted as claimed with its
                wait; the default policy's every request: ``workers.worker``), ``decode_lane`` (a lane slot's
                request and input descriptors, validated as untrusted), ``encode_outputs``,
                ``publish`` (error, n_outputs, t_done, RUNNING -> DONE | ERROR, counters,
                stage histograms, a lane call's outcome, push, wake the lane's client)
==============  =========================================================================

The worker's functions serve the arena's slot table too (``geometry``: ``layout.LANE`` or the
arena's), except ``decode_lane``: an arena slot's regions are mapped on demand by the worker
(``workers.step.Step.decode``), a lane names only its own.

Must not: keep state between calls, or decide what ``shmserve.lanes`` and ``workers.step``
decide (free lists, timeouts, which slot to run, what a failure means).  No offsets of its own:
every one comes from ``shmserve.layout``, and the C module is handed them here, at import
(``layout.hotpath_constants``).
"""

from __future__ import annotations

import os
import time
import types

from shmserve import _atomics as atomics
from shmserve import _hotpath, layout
from shmserve.arena import SlotConflict, transition_slot
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.rings import WAKE_ALL, FutexDoorbell, Ring
from shmserve.slotstate import FINISHED, Actor, SlotState, check_transition, state_name

IMPLS = ("c", "python")
IMPL = os.environ.get("SHMSERVE_HOTPATH", "c").strip().lower() or "c"  # read once, here
if IMPL not in IMPLS:
    raise ImportError(f"SHMSERVE_HOTPATH={IMPL!r}: use one of {', '.join(IMPLS)}, or leave it unset",
                      name=__name__)  # the name: the CLI tells this refusal from a broken install

LANE = layout.LANE
# ``publish``'s ``lane``: whose slot table it is and who wakes the collector.  ARENA: the arena's (the
# caller rings the front-end's eventfd; a conflict raises); LANE_FUTEX: a lane whose client sleeps on its
# futex doorbell (rung here); LANE_EVENTFD: a door process's lane (``shmserve.doors``), whose eventfd the
# caller rings (``rings.EventfdDoorbell``: only when the door armed it).  True and False are LANE_FUTEX and ARENA.
ARENA, LANE_FUTEX, LANE_EVENTFD = 0, 1, 2
_FREE, _WRITING, _READY, _RUNNING, _DONE, _ERROR = SlotState
_CLIENT, _WORKER = Actor.CLIENT, Actor.WORKER
_BYTES = layout.BYTES_DTYPE

# The edges the C functions take, by actor: the table must allow each (it has no table of its own).
C_EDGES = ((_FREE, _WRITING, _CLIENT), (_WRITING, _READY, _CLIENT), (_WRITING, _FREE, _CLIENT),
           (_DONE, _FREE, _CLIENT), (_ERROR, _FREE, _CLIENT), (_READY, _RUNNING, _WORKER),
           (_RUNNING, _DONE, _WORKER), (_RUNNING, _ERROR, _WORKER))
for _edge in C_EDGES:
    check_transition(*_edge)


def outside_message(region: int, floor: int, what: str) -> str:
    """Why a lane tensor (``what``) is refused: it lies outside the lane's own data space."""
    return f"{what} must lie in this lane's region {region} at offset {floor} or above"


# -- the client's part (the reference) --------------------------------------------------------

def submit(buf, index: int, region: int, request_id: int, model_id: int, inputs, out_offset: int,
           out_capacity: int, now: int = 0, priority: int = 0, deadline_ns: int = 0, flags: int = 0,
           caller: int = 0) -> int:
    """Publish one call in free slot ``index`` of the lane in ``buf`` (region ``region``);
    ``inputs``: (input index, offset in the region, view); ``now``: the stage time (0: the clock);
    how to schedule it (``shmserve.scheduling``): ``priority`` (u32, 0: the model's default level),
    ``deadline_ns`` (CLOCK_MONOTONIC, 0: none), ``flags`` (``layout.SLOT_FLAG_*``, u32) and
    ``caller`` (u32; a worker heeds it only in a door process's lane, keying a client's lane's
    calls by its region).
    Returns the slot's new generation.  ShmserveError(INTERNAL) if the slot is not free;
    LayoutError for an input no descriptor can hold (the slot is FREE again then); TypeError or
    OverflowError for a scheduling field that is no int of its width."""
    for value, most in ((priority, 0xFFFFFFFF), (deadline_ns, 2**64 - 1), (flags, 0xFFFFFFFF), (caller, 0xFFFFFFFF)):
        _unsigned(value, most)
    generation, _ = layout.unpack_status(atomics.load64(buf, LANE.slot_off(index)))
    try:
        generation = transition_slot(buf, LANE, index, generation, _FREE, _WRITING, _CLIENT)
    except SlotConflict:  # only this client writes a free slot: its lane was overwritten
        raise ShmserveError(ErrorCode.INTERNAL, f"lane slot {index} is not free") from None
    try:
        for t, (name_index, offset, view) in enumerate(inputs):
            layout.encode_tensor(buf, LANE, index, t, role=layout.ROLE_INPUT, name_index=name_index,
                                 dtype=view.dtype, shape=view.shape, offset=offset, region=region)
    except layout.LayoutError:
        transition_slot(buf, LANE, index, generation, _WRITING, _FREE, _CLIENT)
        raise
    layout.encode_slot_request(buf, LANE, index, request_id=request_id, model_id=model_id, worker=0,
                               n_inputs=len(inputs), out_region=region, out_off=out_offset,
                               out_capacity=out_capacity, priority=priority, caller=caller, deadline_ns=deadline_ns,
                               flags=flags)
    now = now or time.monotonic_ns()
    layout.reset_stages(buf, LANE, index, now, now)
    # Order matters here: descriptors (and the caller's input bytes) are complete before READY.
    transition_slot(buf, LANE, index, generation, _WRITING, _READY, _CLIENT)
    submissions = Ring(buf, LANE.submission_off, LANE.ring_capacity)
    submissions.push(layout.slot_entry(index, generation))  # never full: one entry per slot
    FutexDoorbell(submissions).notify()  # a syscall only if the worker sleeps
    return generation


def _unsigned(value, most: int) -> None:
    """The C module's check of an unsigned argument, in its words."""
    if not isinstance(value, int):
        raise TypeError(f"an int is required, not {type(value).__name__}")
    if value < 0:
        raise OverflowError("can't convert negative int to unsigned")
    if value > 2**64 - 1:
        raise OverflowError("int too big to convert")
    if value > most:
        raise OverflowError(f"{value} is out of range (at most {most})")


def finished(buf, index: int, generation: int) -> bool:
    """Whether lane slot ``index`` of ``generation`` is DONE or ERROR (load-acquire)."""
    got_generation, state = layout.unpack_status(atomics.load64(buf, LANE.slot_off(index)))
    return got_generation == generation and state in FINISHED


def wait_slice(buf, index: int, generation: int, timeout: float, spin: float) -> bool:
    """Wait up to ``timeout`` seconds (spinning ``spin`` of them first) for lane slot ``index`` of
    ``generation`` to finish; whether it did.  Completion entries are only wake-ups: they are
    dropped, the status word decides."""
    completions = Ring(buf, LANE.completion_off, LANE.ring_capacity)
    inbox = FutexDoorbell(completions)
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        completions.discard()
        if finished(buf, index, generation):
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        inbox.wait(timeout=remaining, spin=spin)
        spin = 0.0


def read(buf, free: list, index: int, generation: int, region: int, out_offset: int,
         out_capacity: int) -> dict:
    """The finished lane slot's outputs as output index -> (dtype, shape, offset in the region),
    each checked to lie in the output area; ShmserveError with the slot's error, INTERNAL for a
    slot not finished in ``generation`` or a bad output descriptor, BAD_DTYPE for a bytes output.
    A finished slot is freed either way (FINISHED -> FREE, its index appended to ``free``)."""
    got_generation, state = layout.unpack_status(atomics.load64(buf, LANE.slot_off(index)))
    try:
        if got_generation != generation or state not in FINISHED:
            raise ShmserveError(ErrorCode.INTERNAL, f"lane slot {index} finished in state {state_name(state)}")
        if state == _ERROR:
            code, message = layout.decode_error(buf, LANE, index)
            raise ShmserveError(ErrorCode.from_number(code), message)
        slot = layout.decode_slot_request(buf, LANE, index)
        outputs, sizes = {}, {region: len(buf)}
        try:
            for t in range(slot.n_inputs, slot.n_inputs + slot.n_outputs):
                d = layout.decode_tensor(buf, LANE, index, t, sizes)
                if d.region != region or not (out_offset <= d.offset and
                                              d.offset + d.nbytes <= out_offset + out_capacity):
                    raise layout.LayoutError("an output lies outside the output area")
                if d.dtype is _BYTES:  # no view of the region can hold one
                    raise ShmserveError(ErrorCode.BAD_DTYPE, f"output {d.name_index} is bytes: "
                                                             f"{layout.NO_ZERO_COPY_BYTES}")
                outputs[d.name_index] = (d.dtype, d.shape, d.offset)
        except layout.LayoutError as exc:
            raise ShmserveError(ErrorCode.INTERNAL, f"the worker wrote a bad output descriptor: {exc}") from None
        return outputs
    finally:
        if state in FINISHED:
            transition_slot(buf, LANE, index, got_generation, SlotState(state), _FREE, _CLIENT)
            free.append(index)


# -- the worker's part (the reference) --------------------------------------------------------

def claim(buf, geometry, entry: int, now: int = 0) -> int | None:
    """READY -> RUNNING for a ring ``entry`` of the slot table ``geometry`` in ``buf``, and its
    t_claimed; the slot index, or None if it is not ours to run (a bad index, or not READY in
    that generation: failed or reused meanwhile)."""
    index, generation = layout.split_entry(entry)
    if not 0 <= index < geometry.slot_count:
        return None  # hostile or corrupt entry: nothing to answer
    try:
        transition_slot(buf, geometry, index, generation, _READY, _RUNNING, _WORKER)
    except SlotConflict:
        return None
    layout.stamp(buf, geometry, index, "t_claimed", now or time.monotonic_ns())
    return index


EXPIRED_DEADLINE, EXPIRED_QUEUE = -1, -2  # claim_checked: a request it left unclaimed, and why
_U64_MAX, _SSIZE_MAX = 2**64 - 1, 2**63 - 1


def claim_checked(buf, geometry, entry: int, now: int, timeout_ns: int, exempt_flags: int,
                  arena_buf, claimed_off: int, wait_off: int) -> int | None:
    """``claim`` of a request that nothing else waits beside, checked first as
    ``shmserve.scheduling.Scheduler.alone`` checks one (that rule, for a policy that rejects):
    past its slot's ``deadline_ns`` it is EXPIRED_DEADLINE; waited ``timeout_ns`` (0: no queue
    timeout) since its t_ready (one in the future or 0: now) it is EXPIRED_QUEUE, unless its slot's
    flags have one of ``exempt_flags`` (``layout.SLOT_FLAG_OWN_TIMEOUT`` where the caller's own
    timeout wins); either left READY, unclaimed, for the caller to answer TIMEOUT.  Claimed, it is
    counted: 1 at ``claimed_off`` and its wait (µs from t_ready, if t_ready is in the past) at
    ``wait_off`` of ``arena_buf`` (u64s), and the slot index is returned.  None as ``claim``: a bad
    index, or not READY in that generation.  ``now``: the clock (0: read it), t_claimed's too.
    What a lane slot says is its client's: a wrong deadline only hurts its own call.  Before
    anything is read or claimed: TypeError or OverflowError for an argument that is no unsigned
    int of its width (the offsets at most 2**63 - 1); then, for an entry in range, BufferError for
    read-only counters and ValueError for an offset whose u64 lies outside them or unaligned."""
    for value, most in ((entry, _U64_MAX), (now, _U64_MAX), (timeout_ns, _U64_MAX), (exempt_flags, 0xFFFFFFFF),
                        (claimed_off, _SSIZE_MAX), (wait_off, _SSIZE_MAX)):
        _unsigned(value, most)
    index, generation = layout.split_entry(entry)
    if not 0 <= index < geometry.slot_count:
        return None  # hostile or corrupt entry: nothing to answer
    counters = memoryview(arena_buf)
    if counters.readonly:
        raise BufferError("Object is not writable.")
    size = counters.nbytes
    if size < 8 or claimed_off > size - 8 or wait_off > size - 8 or claimed_off % 8 or wait_off % 8:
        raise ValueError(f"the counters (at {claimed_off} and {wait_off}) lie outside or unaligned in a "
                         f"{size}-byte buffer")
    now = now or time.monotonic_ns()
    t_ready, _, _, deadline, flags = layout.read_slot_schedule(buf, geometry, index)
    if 0 < deadline <= now:
        return EXPIRED_DEADLINE
    if timeout_ns and not flags & exempt_flags and (t_ready if 0 < t_ready <= now else now) + timeout_ns <= now:
        return EXPIRED_QUEUE
    if claim(buf, geometry, entry, now) is None:
        return None
    atomics.fetch_add64(arena_buf, claimed_off, 1)
    if 0 < t_ready < now:
        atomics.fetch_add64(arena_buf, wait_off, (now - t_ready) // 1000)
    return index


def decode_lane(buf, index: int, region: int, floor: int, n_names: int):
    """Claimed lane slot ``index``'s request and input descriptors, every byte untrusted:
    (``layout.SlotRequest``, [(name index, dtype, shape, offset, nbytes)], signature, failure).
    Descriptors come in order up to the first that fails; ``failure`` is then (ErrorCode, message)
    and the signature None, else the signature is ((name index, dtype, shape), ...) and failure None.

    Fails BAD_INPUT for an input count outside 1..``n_names`` (or MAX_TENSORS - 1), a tensor that
    is no input (role, name index); BAD_REGION for one outside region ``region`` at ``floor`` or
    above, or a descriptor ``layout.decode_tensor`` rejects.
    """
    slot = layout.decode_slot_request(buf, LANE, index)
    n_inputs, descs = slot.n_inputs, []
    if not 0 < n_inputs <= n_names or n_inputs >= layout.MAX_TENSORS:
        return slot, descs, None, (ErrorCode.BAD_INPUT, f"slot has {n_inputs} inputs")
    sizes = {region: len(buf)}
    for t in range(n_inputs):
        if layout.region_of_tensor(buf, LANE, index, t) != region:
            return slot, descs, None, (ErrorCode.BAD_REGION, outside_message(region, floor, f"input {t}"))
        try:
            d = layout.decode_tensor(buf, LANE, index, t, sizes)
        except layout.LayoutError as exc:
            return slot, descs, None, (ErrorCode.BAD_REGION, f"input descriptor rejected: {exc}")
        if d.offset < floor:
            return slot, descs, None, (ErrorCode.BAD_REGION, outside_message(region, floor, f"input {t}"))
        if d.role != layout.ROLE_INPUT or d.name_index >= n_names:
            return slot, descs, None, (ErrorCode.BAD_INPUT, f"tensor {t} is not an input of this model")
        descs.append((d.name_index, d.dtype, d.shape, d.offset, d.nbytes))
    return slot, descs, tuple(d[:3] for d in descs), None


def encode_outputs(buf, geometry, index: int, first: int, region: int, outputs) -> None:
    """Describe slot ``index``'s outputs (``outputs``: (offset, shape, dtype, nbytes) in the spec's
    order) as tensors ``first``.. in region ``region``; LayoutError if one cannot be described."""
    for i, (offset, shape, dtype, nbytes) in enumerate(outputs):
        layout.encode_tensor(buf, geometry, index, first + i, role=layout.ROLE_OUTPUT, name_index=i, dtype=dtype,
                             shape=shape, offset=offset, region=region, nbytes=nbytes)


def publish(buf, geometry, index: int, entry: int, n_outputs: int, failure, ring: Ring, lane: int,
            arena_buf, requests_off: int, errors_off: int, hist_off: int, now: int = 0) -> bool:
    """Publish DONE (``n_outputs`` described) or ERROR (``failure``: code and message) for claimed
    slot ``index`` (ring ``entry``), count it (u64s at ``requests_off``/``errors_off`` of
    ``arena_buf``), add its stage times to the histograms at ``hist_off``, and push ``entry`` on
    ``ring``; ``lane`` (ARENA, LANE_FUTEX or LANE_EVENTFD): a LANE_FUTEX lane's client is woken
    here (its futex doorbell), the arena's collector and a LANE_EVENTFD lane's door by the caller.
    Whether it was published: a lane slot its client rewrote meanwhile is not (False); an arena
    slot raises SlotConflict.  ValueError for a ``lane`` that is none of the three."""
    if lane not in (ARENA, LANE_FUTEX, LANE_EVENTFD):
        raise ValueError("lane must be 0, 1 or 2 (hotpath.ARENA, LANE_FUTEX, LANE_EVENTFD)")
    _, generation = layout.split_entry(entry)
    if failure is not None:
        layout.encode_error(buf, geometry, index, *failure)
        n_outputs = 0
    layout.set_n_outputs(buf, geometry, index, n_outputs)
    done = now or time.monotonic_ns()
    layout.stamp(buf, geometry, index, "t_done", done)
    try:
        # Order matters here: outputs and descriptors are written before DONE is published.
        transition_slot(buf, geometry, index, generation, _RUNNING, _ERROR if failure is not None else _DONE, _WORKER)
    except SlotConflict:
        if not lane:
            raise
        return False  # the lane's client rewrote a running slot: nothing to publish
    atomics.fetch_add64(arena_buf, requests_off, 1)
    if failure is not None:
        atomics.fetch_add64(arena_buf, errors_off, 1)
    layout.record_stages_at(arena_buf, hist_off, buf, geometry.slot_off(index))
    if lane:  # its version's outcome (canary windows): DONE, or ERROR for the version's own fault
        fault = failure is not None
        if not fault or int(failure[0]) in layout.LANE_FAULT_CODES:
            claimed = layout.read_stages(buf, geometry.slot_off(index))[_CLAIMED]
            if claimed and done >= claimed:  # (the client writes the lane: nonsense is no outcome)
                layout.record_lane_outcome(arena_buf, hist_off, done - claimed, fault)
    ring.push(entry)        # a lane's ring may be full if its client does not drain it: the entry
    if lane == LANE_FUTEX:  # is only a wake-up there, the status word is the answer
        FutexDoorbell(ring).notify()
    return True


_CLAIMED = layout.STAGE_FIELDS.index("t_claimed")
assert layout.LANE_FAULT_CODES == (ErrorCode.MODEL_ERROR, ErrorCode.INTERNAL)
_NAMES = ("submit", "finished", "wait_slice", "read", "claim", "claim_checked", "decode_lane", "encode_outputs",
          "publish")
PYTHON = types.SimpleNamespace(name="python", **{name: globals()[name] for name in _NAMES})

_hotpath.configure(layout.hotpath_constants(), states=tuple(int(s) for s in SlotState),
                   state_names=tuple(state_name(s) for s in range(len(SlotState))), wake_all=WAKE_ALL,
                   layout_error=layout.LayoutError, slot_conflict=SlotConflict, slot_request=layout.SlotRequest,
                   dtype_code=layout.dtype_code, state_name=state_name,
                   error=lambda code, message: ShmserveError(ErrorCode.from_number(code), message),
                   error_code=ErrorCode)
C = types.SimpleNamespace(name="c", **{name: getattr(_hotpath, name) for name in _NAMES})
active = C if IMPL == "c" else PYTHON
