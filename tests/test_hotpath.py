"""The compiled hot path against its reference: the same calls, the same results, the same bytes.

Every function of ``shmserve.hotpath`` runs twice, on two fresh lanes (and two
small arenas for the worker's counters): the Python reference on one, the C
module on the other.  After each call the results (or the exceptions: type,
message, error code) must be equal, and so must every byte of both lanes and
both arenas.  Hypothesis draws the calls, and between them scribbles the same
hostile bytes over both lanes where a client or a worker could write them:
both implementations must accept and refuse the same things, in the same
words.  Then: the C module holds exactly layout's constants and refuses
inconsistent ones, refuses buffers and arguments it cannot use safely, and
``SHMSERVE_HOTPATH`` picks the implementation.

The real-process lane tests (``test_lanes.py`` and the lane tests of
``test_dispatcher.py``, ``test_worker_batching.py``) run on the default (C);
``make test-hotpath-python`` runs them on the reference.  ``make test-hotpath-asan``
runs this module against an AddressSanitizer + UBSan build of the C module
(``tools/hotpath_asan.py``).
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from collections import namedtuple

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from shmserve import _hotpath, hotpath, lanes, layout
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.scheduling import Policy, Scheduler
from shmserve.rings import Ring
from shmserve.slotstate import SlotState

REGION = 7
LANE_SIZE = layout.LANE_BYTES + 64 * 1024
ARENA_SIZE = 64 + layout.HIST_WORKER_SIZE
REQUESTS_OFF, ERRORS_OFF, HIST_OFF = 0, 8, 64
NOW = 1_000_000_000  # stage times passed in, so that both lanes get the same ones
FLOOR = lanes.DATA_FLOOR
View = namedtuple("View", "dtype shape")  # what submit reads of an input view (numpy refuses negative dims)
PY, C = hotpath.PYTHON, hotpath.C


class Twin:
    """The same lane twice: ``bufs[PY]`` served by the reference, ``bufs[C]`` by the C module."""

    def __init__(self):
        # heap buffers (malloc'd: 16-byte aligned), so that a sanitizer build of the C module would see
        # a read or write past their ends; the real lanes are mappings
        self.bufs = {impl.name: bytearray(LANE_SIZE) for impl in (PY, C)}
        self.arenas = {impl.name: bytearray(ARENA_SIZE) for impl in (PY, C)}
        self.free = {impl.name: [] for impl in (PY, C)}
        for buf in self.bufs.values():
            lanes.init_header(buf, 0)

    def close(self):
        self.bufs.clear()
        self.arenas.clear()

    def call(self, name: str, *args):
        """``name`` through both implementations; ``buf``, ``arena``, ``ring`` and ``free`` in
        ``args`` stand for each one's own.  The (equal) outcome."""
        outcomes = []
        for impl in (PY, C):
            buf = self.bufs[impl.name]
            own = {"buf": buf, "arena": self.arenas[impl.name], "free": self.free[impl.name],
                   "ring": Ring(buf, layout.LANE.completion_off, layout.LANE.ring_capacity)}
            real = [own[a] if isinstance(a, str) and a in own else a for a in args]
            outcomes.append(outcome(getattr(impl, name), real))
        assert outcomes[0] == outcomes[1], f"{name}: reference {outcomes[0]} != compiled {outcomes[1]}"
        assert self.bufs["python"][:] == self.bufs["c"][:], f"{name}: the lanes differ at {self.first_difference()}"
        assert self.arenas["python"][:] == self.arenas["c"][:], f"{name}: the arenas' counters differ"
        assert self.free["python"] == self.free["c"]
        return outcomes[0]

    def scribble(self, writes):
        """The same (offset, bytes) writes into both lanes: a hostile client, or a buggy worker."""
        for offset, data in writes:
            for buf in self.bufs.values():
                buf[offset:offset + len(data)] = data

    def first_difference(self) -> int:
        a, b = self.bufs["python"][:], self.bufs["c"][:]
        return next(i for i in range(len(a)) if a[i] != b[i])


def outcome(fn, args):
    try:
        return "returned", fn(*args)
    except Exception as exc:  # both must raise the same, in the same words
        return "raised", type(exc).__name__, str(exc), getattr(exc, "code", None)


@pytest.fixture
def twin():
    t = Twin()
    yield t
    t.close()


def fresh(test):
    """A hypothesis test given a new Twin for each example (state must not carry over)."""
    def run(data):
        t = Twin()
        try:
            test(t, data)
        finally:
            t.close()
    run.__name__, run.__doc__ = test.__name__, test.__doc__
    return run


# -- what hypothesis draws ---------------------------------------------------------------------

FIXED = [d for d in layout.NUMPY_DTYPES.values() if d is not layout.BYTES_DTYPE]
dtypes = st.one_of(st.sampled_from(FIXED), st.just(layout.BYTES_DTYPE),
                   st.sampled_from([np.dtype("complex64"), np.dtype(">f4"), np.dtype("<U3")]))
dims = st.one_of(st.integers(0, 6), st.integers(-3, -1))
shapes = st.lists(dims, max_size=layout.MAX_DIMS + 1).map(tuple)
sane_shapes = st.lists(st.integers(0, 6), max_size=layout.MAX_DIMS).map(tuple)
offsets = st.one_of(st.integers(FLOOR, LANE_SIZE).map(layout.align_tensor), st.integers(0, 2**48))
inputs = st.lists(st.tuples(st.integers(0, 255), offsets, st.builds(View, dtypes, shapes)), max_size=layout.MAX_TENSORS + 1)
good_inputs = st.lists(st.tuples(st.integers(0, 3), st.integers(FLOOR, FLOOR + 4096).map(layout.align_tensor),
                                 st.builds(View, st.sampled_from(FIXED), st.lists(st.integers(0, 4), max_size=3).map(tuple))),
                       min_size=1, max_size=4)


def slot_writes(index: int):
    """Hostile writes into lane slot ``index``: its request, tensor descriptors, error, times."""
    base = layout.LANE.slot_off(index)
    fields = st.one_of(
        st.tuples(st.integers(8, layout.SLOT_SIZE - 8), st.binary(min_size=1, max_size=8)),  # anywhere past status
        st.tuples(st.sampled_from([layout.SLOT.offset(f) for f in ("n_inputs", "n_outputs")]),
                  st.integers(0, 20).map(lambda n: n.to_bytes(2, "little"))),
        st.tuples(st.integers(0, layout.MAX_TENSORS - 1).map(lambda t: layout.TENSORS_OFFSET + t * layout.TENSOR_SIZE),
                  st.binary(min_size=layout.TENSOR_SIZE, max_size=layout.TENSOR_SIZE)),
        st.tuples(st.integers(0, layout.MAX_TENSORS - 1).map(
            lambda t: layout.TENSORS_OFFSET + t * layout.TENSOR_SIZE + layout.TENSOR.offset("shape")),
                  st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=8).map(
                      lambda ds: b"".join(d.to_bytes(8, "little", signed=True) for d in ds))),
        st.tuples(st.integers(0, layout.MAX_TENSORS - 1).map(
            lambda t: layout.TENSORS_OFFSET + t * layout.TENSOR_SIZE + layout.TENSOR.offset("region")),
                  st.sampled_from([REGION, 0, REGION + 1]).map(lambda r: r.to_bytes(4, "little"))),
    )
    return st.lists(fields.map(lambda w: (base + w[0], w[1])), max_size=4)


outputs = st.lists(st.tuples(st.integers(FLOOR, LANE_SIZE).map(layout.align_tensor), shapes,
                             st.one_of(st.sampled_from(FIXED), st.just(layout.BYTES_DTYPE)),
                             st.one_of(st.none(), st.integers(0, 2**20), st.integers(-1, 0))), max_size=4)
messages = st.one_of(st.text(max_size=40), st.text(min_size=150, max_size=260),
                     st.just("é" * 100), st.just("x" * 191 + "€"))
failures = st.one_of(st.none(), st.tuples(st.sampled_from(list(ErrorCode)), messages))
HYPOTHESIS = settings(max_examples=250, deadline=None)
# submit's scheduling fields: (), or priority, deadline_ns, flags, caller (any prefix), in range or not
unsigned = st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1), st.integers(-2, 2**65), st.just("1"))
schedules = st.lists(unsigned, max_size=4).map(tuple)


# -- a whole call, through both ---------------------------------------------------------------

@HYPOTHESIS
@given(data=st.data())
@fresh
def test_a_whole_lane_call_leaves_the_same_bytes_through_both(twin, data):
    """submit, claim, decode, outputs, publish, wait, read: the client's calls drawn (also ones a
    descriptor cannot hold), the worker's inputs scribbled over as a hostile client would, the
    client's view of the answer scribbled over as a buggy worker would."""
    index = data.draw(st.integers(0, layout.LANE_SLOTS - 1))
    call = data.draw(st.one_of(good_inputs, inputs))
    out_offset = data.draw(st.integers(FLOOR, FLOOR + 8192).map(layout.align_tensor))
    out_capacity = data.draw(st.one_of(st.just(LANE_SIZE - out_offset), st.integers(0, 65536)))
    submitted = twin.call("submit", "buf", index, REGION, data.draw(st.integers(0, 2**64 - 1)),
                          data.draw(st.integers(0, 2**32 - 1)), call, out_offset, out_capacity, NOW,
                          *data.draw(schedules))
    if submitted[0] == "raised":
        assert twin.call("finished", "buf", index, 1) == ("returned", False)
        event(f"submit refused: {submitted[1]}")
        return  # refused by both, in the same words; the slot is FREE again in both (same bytes)
    generation = submitted[1]
    twin.call("finished", "buf", index, generation)
    twin.call("wait_slice", "buf", index, generation, 0.0, 0.0)
    twin.scribble(data.draw(slot_writes(index)))
    entry = data.draw(st.one_of(st.just(layout.slot_entry(index, generation)), st.integers(0, 2**64 - 1)))
    claimed = twin.call("claim", "buf", layout.LANE, entry, NOW + 1)
    if claimed[1] is None:
        entry = layout.slot_entry(index, generation)
        claimed = twin.call("claim", "buf", layout.LANE, entry, NOW + 1)
    n_names = data.draw(st.integers(1, 4))
    decoded = twin.call("decode_lane", "buf", index, data.draw(st.sampled_from([REGION, REGION + 1])),
                        FLOOR, n_names)
    event(f"decode: {decoded[0]} {decoded[1][3][0].name if decoded[0] == 'returned' and decoded[1][3] else 'ok'}")
    first = decoded[1][0].n_inputs if decoded[0] == "returned" else 0
    in_area = st.lists(st.tuples(st.integers(out_offset, out_offset + 4096).map(layout.align_tensor), sane_shapes,
                                 st.sampled_from(FIXED), st.none()), max_size=4)
    outs = data.draw(st.one_of(in_area, in_area, outputs))
    twin.call("encode_outputs", "buf", layout.LANE, index, data.draw(st.one_of(st.just(first), st.integers(0, 17))),
              REGION, outs)
    n_outputs = data.draw(st.one_of(st.just(len(outs)), st.integers(0, 20)))
    twin.call("publish", "buf", layout.LANE, index, entry, n_outputs, data.draw(st.one_of(st.none(), failures)),
              "ring", True, "arena", REQUESTS_OFF, ERRORS_OFF, HIST_OFF, NOW + data.draw(st.integers(0, 10**10)))
    twin.scribble(data.draw(slot_writes(index)))
    twin.call("wait_slice", "buf", index, generation, 0.0, 0.0)
    read = twin.call("read", "buf", "free", index, data.draw(st.one_of(st.just(generation), st.integers(0, 2**32))),
                     REGION, out_offset, out_capacity)
    event(f"read: {read[0]} {read[3] if read[0] == 'raised' else len(read[1])}")


@HYPOTHESIS
@given(data=st.data())
@fresh
def test_a_slot_of_random_bytes_is_decoded_and_read_alike(twin, data):
    """A whole slot of the client's (or worker's) choosing, states included."""
    index = data.draw(st.integers(0, layout.LANE_SLOTS - 1))
    raw = bytearray(data.draw(st.binary(min_size=layout.SLOT_SIZE, max_size=layout.SLOT_SIZE)))
    state = data.draw(st.sampled_from(list(SlotState) + [99]))
    raw[0:8] = layout.pack_status(data.draw(st.integers(0, 3)), int(state)).to_bytes(8, "little")
    twin.scribble([(layout.LANE.slot_off(index), bytes(raw))])
    twin.call("claim", "buf", layout.LANE, layout.slot_entry(index, data.draw(st.integers(0, 3))), NOW)
    twin.call("decode_lane", "buf", index, REGION, FLOOR, data.draw(st.integers(1, 16)))
    twin.call("finished", "buf", index, data.draw(st.integers(0, 3)))
    twin.call("read", "buf", "free", index, data.draw(st.integers(0, 3)), REGION, FLOOR, LANE_SIZE - FLOOR)


@HYPOTHESIS
@given(data=st.data())
@fresh
def test_well_formed_calls_return_the_same_outputs_through_both(twin, data):
    """Several calls in turn on one lane, every one well formed: the same outputs come back."""
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, layout.LANE_SLOTS - 1))
        call = data.draw(good_inputs)
        out_offset, out_capacity = FLOOR + 8192, 16384
        _, generation = twin.call("submit", "buf", index, REGION, 1, 0, call, out_offset, out_capacity, NOW)
        entry = layout.slot_entry(index, generation)
        assert twin.call("claim", "buf", layout.LANE, entry, NOW + 1) == ("returned", index)
        _, (slot, descs, signature, failure) = twin.call("decode_lane", "buf", index, REGION, FLOOR, 4)
        assert failure is None and len(descs) == len(call)
        outs = data.draw(st.lists(st.tuples(st.integers(out_offset, out_offset + 8192).map(layout.align_tensor),
                                            st.lists(st.integers(0, 8), max_size=3).map(tuple), st.sampled_from(FIXED),
                                            st.none()), min_size=1, max_size=3))
        twin.call("encode_outputs", "buf", layout.LANE, index, slot.n_inputs, REGION, outs)
        twin.call("publish", "buf", layout.LANE, index, entry, len(outs), None, "ring", True, "arena", REQUESTS_OFF,
                  ERRORS_OFF, HIST_OFF, NOW + data.draw(st.integers(0, 10**12)))
        kind, got = twin.call("read", "buf", "free", index, generation, REGION, out_offset, out_capacity)
        assert kind == "returned" and got == {i: (dtype, shape, offset) for i, (offset, shape, dtype, _) in enumerate(outs)}


def test_an_arena_slot_is_claimed_and_published_alike(twin):
    """The worker's claim and publish serve the arena's slot table too (here: a lane's buffer
    taken as a table of 16 slots), where a conflict raises instead of passing quietly."""
    for index in (0, 5):
        entry = layout.slot_entry(index, 3)
        twin.scribble([(layout.LANE.slot_off(index), layout.pack_status(3, SlotState.READY).to_bytes(8, "little"))])
        assert twin.call("claim", "buf", layout.LANE, entry, NOW) == ("returned", index)
        twin.call("publish", "buf", layout.LANE, index, entry, 1, None, "ring", False, "arena", REQUESTS_OFF,
                  ERRORS_OFF, HIST_OFF, NOW + 5000)
        raised = twin.call("publish", "buf", layout.LANE, index, entry, 1, None, "ring", False, "arena", REQUESTS_OFF,
                           ERRORS_OFF, HIST_OFF, NOW + 5000)
        assert raised[:2] == ("raised", "SlotConflict")


CLAIMED_OFF, WAIT_OFF = 16, 24  # claim_checked's counters in the twin's arena


def status_of(buf, index: int) -> tuple[int, int]:
    """(generation, state) of lane slot ``index``."""
    off = layout.LANE.slot_off(index) + layout.SLOT.offset("status")
    return layout.unpack_status(int.from_bytes(buf[off:off + 8], "little"))
times = st.one_of(st.integers(0, 3 * NOW), st.integers(0, 2**64 - 1), st.just(0))


@HYPOTHESIS
@given(data=st.data())
@fresh
def test_claim_checked_is_scheduler_alones_rule_then_claim_alike(twin, data):
    """``claim_checked`` on a slot whose scheduling fields a client wrote (any u64 deadline and
    t_ready, any flags): both implementations leave the same bytes and counters, and what they
    decide is ``Scheduler.alone``'s verdict under a rejecting policy of the same queue timeout:
    expired (deadline or queue timeout: left READY, nothing counted), else claimed (RUNNING at
    ``now``, counted with its wait) if it is READY in that generation, else None."""
    t_ready, deadline, now = data.draw(times), data.draw(times), data.draw(st.integers(1, 3 * NOW))
    flags, own_wins = data.draw(st.integers(0, 2**32 - 1)), data.draw(st.booleans())
    timeout_us = data.draw(st.one_of(st.just(0), st.integers(0, 2 * NOW // 1000), st.just(2**44)))
    generation, ready = data.draw(st.integers(0, 4)), data.draw(st.booleans())
    index = 3
    off = layout.LANE.slot_off(index)
    state = SlotState.READY if ready else SlotState.DONE
    twin.scribble([(off, layout.pack_status(generation, state).to_bytes(8, "little")),
                   (off + layout.SLOT.offset("flags"), flags.to_bytes(4, "little")),
                   (off + layout.SLOT.offset("deadline_ns"), deadline.to_bytes(8, "little")),
                   (off + layout.SLOT.offset("t_ready"), t_ready.to_bytes(8, "little"))])
    exempt = layout.SLOT_FLAG_OWN_TIMEOUT if own_wins else 0
    kind, got = twin.call("claim_checked", "buf", layout.LANE, layout.slot_entry(index, 2), now, timeout_us * 1000,
                          exempt, "arena", CLAIMED_OFF, WAIT_OFF)
    assert kind == "returned"
    policy = Policy(default_timeout_us=timeout_us, allow_timeout_override=own_wins)
    _, why = Scheduler(policy, clock=lambda: now).alone(0, deadline, flags, t_ready)
    counters = twin.arenas["c"]
    claimed, waited = (int.from_bytes(counters[o:o + 8], "little") for o in (CLAIMED_OFF, WAIT_OFF))
    if why:
        assert got == {"deadline": hotpath.EXPIRED_DEADLINE, "queue timeout": hotpath.EXPIRED_QUEUE}[why]
        assert status_of(twin.bufs["c"], index) == (generation, state)
        assert (claimed, waited) == (0, 0)
    elif ready and generation == 2:
        assert got == index and status_of(twin.bufs["c"], index) == (2, SlotState.RUNNING)
        assert layout.read_stages(twin.bufs["c"], off)[2] == now  # t_claimed
        assert (claimed, waited) == (1, (now - t_ready) // 1000 if 0 < t_ready < now else 0)
    else:
        assert got is None and (claimed, waited) == (0, 0)


@pytest.mark.parametrize("args", [
    (NOW, 0, 0, ARENA_SIZE - 4, 0), (NOW, 0, 0, 0, ARENA_SIZE), (NOW, 0, 0, 4, 8), (NOW, 0, 0, 2**63, 0),
    (NOW, -1, 0, 0, 8), (NOW, 0, 2**32, 0, 8), (-1, 0, 0, 0, 8), (NOW, "1", 0, 0, 8)])
def test_claim_checked_refuses_arguments_alike_and_claims_nothing(twin, args):
    """Counters outside the buffer or unaligned, an argument out of its width: both implementations
    raise the same, before the slot is claimed (an expired one too: nothing is decided)."""
    off = layout.LANE.slot_off(0)
    twin.scribble([(off, layout.pack_status(1, SlotState.READY).to_bytes(8, "little"))])
    now, timeout_ns, exempt, claimed_off, wait_off = args
    kind, *_ = twin.call("claim_checked", "buf", layout.LANE, layout.slot_entry(0, 1), now, timeout_ns, exempt,
                         "arena", claimed_off, wait_off)
    assert kind == "raised"
    assert status_of(twin.bufs["c"], 0) == (1, SlotState.READY)
    twin.scribble([(off + layout.SLOT.offset("deadline_ns"), (1).to_bytes(8, "little"))])  # expired: still refused
    assert twin.call("claim_checked", "buf", layout.LANE, layout.slot_entry(0, 1), now, timeout_ns, exempt,
                     "arena", claimed_off, wait_off)[0] == "raised"


def test_claim_checked_refuses_read_only_counters_in_either():
    """Read-only counters (bytes): BufferError, the slot left READY, in both implementations."""
    for impl in (PY, C):
        lane = bytearray(LANE_SIZE)
        lanes.init_header(lane, 0)
        off = layout.LANE.slot_off(0)
        lane[off:off + 8] = layout.pack_status(1, SlotState.READY).to_bytes(8, "little")
        with pytest.raises(BufferError):
            impl.claim_checked(lane, layout.LANE, layout.slot_entry(0, 1), NOW, 0, 0, bytes(ARENA_SIZE), 0, 8)
        assert status_of(lane, 0) == (1, SlotState.READY)
        assert impl.claim_checked(lane, layout.LANE, layout.slot_entry(0, 1), NOW, 0, 0, bytearray(64), 0, 8) == 0


@pytest.mark.parametrize("wake, rung", [(hotpath.LANE_FUTEX, 1), (True, 1), (hotpath.LANE_EVENTFD, 0)])
def test_publish_wakes_a_lanes_futex_only_when_told_to(twin, wake, rung):
    """``lane``: LANE_FUTEX (True) rings the client's futex doorbell (its ring's sequence word
    moves); LANE_EVENTFD (a door process's lane) leaves the waking to the caller, and a slot its
    client rewrote is passed over quietly, as for any lane.  Anything else is refused alike."""
    ring = Ring(twin.bufs["c"], layout.LANE.completion_off, layout.LANE.ring_capacity)
    seq_before = int.from_bytes(twin.bufs["c"][ring.seq_offset:ring.seq_offset + 4], "little")
    entry = layout.slot_entry(1, 4)
    twin.scribble([(layout.LANE.slot_off(1), layout.pack_status(4, SlotState.READY).to_bytes(8, "little"))])
    assert twin.call("claim", "buf", layout.LANE, entry, NOW) == ("returned", 1)
    assert twin.call("publish", "buf", layout.LANE, 1, entry, 0, None, "ring", wake, "arena", REQUESTS_OFF,
                     ERRORS_OFF, HIST_OFF, NOW + 10) == ("returned", True)
    seq = int.from_bytes(twin.bufs["c"][ring.seq_offset:ring.seq_offset + 4], "little")
    assert seq == seq_before + rung
    assert twin.call("publish", "buf", layout.LANE, 1, entry, 0, None, "ring", wake, "arena", REQUESTS_OFF,
                     ERRORS_OFF, HIST_OFF, NOW + 10) == ("returned", False)  # not RUNNING any more
    for bad in (3, -1):
        kind, name, _, _ = twin.call("publish", "buf", layout.LANE, 1, entry, 0, None, "ring", bad, "arena",
                                     REQUESTS_OFF, ERRORS_OFF, HIST_OFF, NOW)
        assert (kind, name) == ("raised", "ValueError")


def test_a_real_round_trip_returns_the_outputs_and_frees_the_slot(twin):
    """The ordinary call, spelled out: what read returns, and that the slot is FREE in a new
    generation with its index back in the free list."""
    x = np.zeros(4, np.float32)
    _, generation = twin.call("submit", "buf", 2, REGION, 9, 0, [(0, FLOOR, x)], FLOOR + 4096, 4096, NOW)
    entry = layout.slot_entry(2, generation)
    assert twin.call("claim", "buf", layout.LANE, entry, NOW + 1) == ("returned", 2)
    _, (slot, descs, signature, failure) = twin.call("decode_lane", "buf", 2, REGION, FLOOR, 1)
    assert (slot.n_inputs, slot.out_off, failure) == (1, FLOOR + 4096, None)
    assert descs == [(0, x.dtype, (4,), FLOOR, 16)] and signature == ((0, x.dtype, (4,)),)
    twin.call("encode_outputs", "buf", layout.LANE, 2, 1, REGION, [(FLOOR + 4096, (2, 2), x.dtype, 16)])
    assert twin.call("publish", "buf", layout.LANE, 2, entry, 1, None, "ring", True, "arena", REQUESTS_OFF,
                     ERRORS_OFF, HIST_OFF, NOW + 3000) == ("returned", True)
    assert twin.call("wait_slice", "buf", 2, generation, 1.0, 0.0) == ("returned", True)
    assert twin.call("read", "buf", "free", 2, generation, REGION, FLOOR + 4096, 4096) == \
        ("returned", {0: (x.dtype, (2, 2), FLOOR + 4096)})
    assert twin.free["c"] == [2]
    assert layout.unpack_status(int.from_bytes(twin.bufs["c"][layout.LANE.slot_off(2):][:8], "little")) == \
        (generation, SlotState.FREE)


def test_an_error_is_read_back_with_its_code_and_the_slot_freed(twin):
    x = np.zeros(1, np.int8)
    _, generation = twin.call("submit", "buf", 0, REGION, 1, 0, [(0, FLOOR, x)], FLOOR, 64, NOW)
    entry = layout.slot_entry(0, generation)
    twin.call("claim", "buf", layout.LANE, entry, NOW)
    twin.call("publish", "buf", layout.LANE, 0, entry, 3, (ErrorCode.MODEL_ERROR, "ö" * 120), "ring", True,
              "arena", REQUESTS_OFF, ERRORS_OFF, HIST_OFF, NOW)
    kind, name, message, code = twin.call("read", "buf", "free", 0, generation, REGION, FLOOR, 64)
    assert (kind, name, code) == ("raised", "ShmserveError", ErrorCode.MODEL_ERROR)
    assert message == "[model_error] " + "ö" * 96  # 192 bytes of UTF-8, cut on a character
    assert twin.free["c"] == [0]


def test_submit_writes_the_scheduling_fields(twin):
    """priority, deadline_ns, flags and caller land in the slot as layout encodes them, whatever
    was there (the caller 0 when not given)."""
    x = np.zeros(4, np.float32)
    twin.scribble([(layout.LANE.slot_off(i) + layout.SLOT.offset("caller"), b"\xff" * 4) for i in (0, 1)])
    _, generation = twin.call("submit", "buf", 1, REGION, 5, 0, [(0, FLOOR, x)], FLOOR + 4096, 4096, NOW,
                              3, 2**64 - 1, layout.SLOT_FLAG_OWN_TIMEOUT)
    buf = twin.bufs["c"]
    assert layout.decode_slot_sched(buf, layout.LANE, 1) == (3, 0, 2**64 - 1)
    assert layout.read_slot_schedule(buf, layout.LANE, 1) == (NOW, 3, 0, 2**64 - 1, layout.SLOT_FLAG_OWN_TIMEOUT)
    twin.call("submit", "buf", 0, REGION, 6, 0, [(0, FLOOR, x)], FLOOR + 4096, 4096, NOW, 0, 0, 0, 2**32 - 1)
    assert layout.decode_slot_sched(buf, layout.LANE, 0) == (0, 2**32 - 1, 0)
    for bad in (-1, 2**32, "3"):
        assert twin.call("submit", "buf", 2, REGION, 6, 0, [(0, FLOOR, x)], FLOOR + 4096, 4096, NOW, bad)[0] == \
            "raised"
    assert twin.call("finished", "buf", 2, 1) == ("returned", False)


@pytest.mark.parametrize("impl", [PY, C], ids=["python", "c"])
def test_a_refused_submit_leaves_its_slot_free_and_in_the_free_list(impl, monkeypatch):
    """Before, an input no descriptor can hold left its slot WRITING and out of the free list for good."""
    monkeypatch.setattr(lanes, "_HOT", impl)
    lane = lanes.ClientLane(bytearray(LANE_SIZE), REGION, "m")
    lanes.init_header(lane.buf, 0)
    free = list(lane.free)
    with pytest.raises(layout.LayoutError, match="rank 9 exceeds"):
        lane.submit(1, 0, [(0, FLOOR, View(np.dtype("f4"), (1,) * 9))], FLOOR, 64)
    assert lane.free == free
    index, generation = lane.submit(2, 0, [(0, FLOOR, np.zeros(2, np.float32))], FLOOR, 64)
    assert index == free[-1] and generation == 2  # the refused call took generation 1
    with pytest.raises(ShmserveError, match="not free") as refused:  # its slot taken meanwhile: not ours now
        taken = layout.LANE.slot_off(free[-2])
        lane.buf[taken:taken + 8] = layout.pack_status(0, SlotState.READY).to_bytes(8, "little")
        lane.submit(3, 0, [], FLOOR, 64)
    assert refused.value.code is ErrorCode.INTERNAL and free[-2] not in lane.free


@pytest.mark.parametrize("impl", [PY, C], ids=["python", "c"])
def test_a_call_given_up_before_its_claim_is_taken_back_and_never_overfills_the_ring(impl, monkeypatch):
    """Issue 29: ``abandon`` takes an unclaimed call back (the worker's claim of its entry then fails)
    and its slot is free at once; a claimed one waits for its worker.  A taken-back call's entry
    still lies on the submission ring: a client that gives up on every call and submits again
    must not push more entries than the ring holds (a taken-back slot is used again only while
    the ring has room for it; it says no free slot until the worker has read the stale entries)."""
    monkeypatch.setattr(lanes, "_HOT", impl)
    lane = lanes.ClientLane(bytearray(LANE_SIZE), REGION, "m")
    lanes.init_header(lane.buf, 0)
    submissions, _, _ = lanes.worker_rings(lane.buf)
    x = np.zeros(2, np.float32)
    calls = [lane.submit(i, 0, [(0, FLOOR, x)], FLOOR, 64) for i in range(layout.LANE_SLOTS)]
    claimed = impl.claim(lane.buf, layout.LANE, submissions.pop())  # the worker takes the first
    assert claimed == calls[0][0]
    assert lane.abandon(*calls[0]) is False and lane.abandoned == {calls[0][0]: calls[0][1]}
    assert all(lane.abandon(*call) for call in calls[1:])  # the rest: taken back
    assert lane.abandon(*calls[1]) is True and lane.taken_back == layout.LANE_SLOTS - 1  # (idempotent)
    assert lane.free_slots() == layout.LANE_SLOTS - 1 and lane.given_up == layout.LANE_SLOTS
    assert len(submissions) == layout.LANE_SLOTS - 1  # their stale entries
    assert lane.has_free_slot()  # one place left on the ring
    again = lane.submit(99, 0, [(0, FLOOR, x)], FLOOR, 64)
    assert not lane.has_free_slot()  # the ring is full of entries: no more until the worker reads them
    with pytest.raises(ShmserveError) as busy:
        lane.submit(100, 0, [(0, FLOOR, x)], FLOOR, 64)
    assert busy.value.code is ErrorCode.OVERLOADED
    runs = [impl.claim(lane.buf, layout.LANE, entry) for entry in submissions.pop_all()]
    assert runs == [None] * (layout.LANE_SLOTS - 1) + [again[0]]  # only the new call is claimed
    assert lane.has_free_slot() and len(lane.free) == layout.LANE_SLOTS - 2  # (again's slot and the claimed one)
    for i in range(layout.LANE_SLOTS - 2):  # every slot no call holds takes a call; the ring holds them all
        lane.submit(200 + i, 0, [(0, FLOOR, x)], FLOOR, 64)
    assert len(submissions) == layout.LANE_SLOTS - 2 and not lane.has_free_slot()


# -- the C module's own guards ----------------------------------------------------------------

def test_the_compiled_module_holds_exactly_layouts_constants():
    assert _hotpath.constants() == layout.hotpath_constants()


@pytest.mark.parametrize("key, value", [("tensor_size", 4096), ("lane_slots", 10**6), ("status_off", 3),
                                        ("ring_entries", 4), ("t_shape_off", 90), ("lane_ring_capacity", 12),
                                        ("stage_done", 6), ("hist_pairs", ((0, 0, 9),)), ("hist_sum_off", 12),
                                        ("code_of_dtype", {np.dtype("f4"): 99})])
def test_inconsistent_constants_are_refused(key, value):
    """A layout the C code cannot rely on is refused before anything runs on it (and the module is
    configured again from layout, as shmserve.hotpath did)."""
    bad = dict(layout.hotpath_constants(), **{key: value})
    try:
        with pytest.raises(ValueError):
            hotpath._hotpath.configure(bad, **_factories())
        with pytest.raises(RuntimeError, match="not configured"):
            _hotpath.finished(mmap.mmap(-1, LANE_SIZE), 0, 0)
    finally:
        _hotpath.configure(layout.hotpath_constants(), **_factories())
    assert _hotpath.constants() == layout.hotpath_constants()


def _factories():
    """What shmserve.hotpath hands configure besides the constants (read back from its source
    would be brittle: these are the same objects)."""
    from shmserve.arena import SlotConflict
    from shmserve.rings import WAKE_ALL
    from shmserve.slotstate import state_name
    return dict(states=tuple(int(s) for s in SlotState), state_names=tuple(state_name(s) for s in range(6)),
                wake_all=WAKE_ALL, layout_error=layout.LayoutError, slot_conflict=SlotConflict,
                slot_request=layout.SlotRequest, dtype_code=layout.dtype_code, state_name=state_name,
                error=lambda code, message: ShmserveError(ErrorCode.from_number(code), message), error_code=ErrorCode)


def test_buffers_and_arguments_it_cannot_use_are_refused():
    small = mmap.mmap(-1, layout.LANE_BYTES - 8)
    lane = mmap.mmap(-1, LANE_SIZE)
    lanes.init_header(lane, 0)
    with pytest.raises(ValueError, match="cannot hold"):
        _hotpath.finished(small, 0, 0)
    with pytest.raises(layout.LayoutError, match="slot index 16 out of range"):
        _hotpath.finished(lane, layout.LANE_SLOTS, 0)
    with pytest.raises(BufferError):
        _hotpath.submit(bytes(LANE_SIZE), 0, REGION, 1, 0, [], FLOOR, 0)  # read-only
    with pytest.raises(ValueError, match="cannot hold"):
        _hotpath.claim(lane, type("Huge", (), {"slot_table_off": 0, "slot_count": 10**6})(), 0)
    with pytest.raises(ValueError, match="out of range"):
        _hotpath.claim(lane, type("Absurd", (), {"slot_table_off": 8, "slot_count": 2**62})(), 0)
    ring = Ring(lane, layout.LANE.completion_off, layout.LANE.ring_capacity)
    arena = mmap.mmap(-1, ARENA_SIZE)
    with pytest.raises(ValueError, match="out of range"):  # counters outside the arena
        _hotpath.publish(lane, layout.LANE, 0, 0, 0, None, ring, True, arena, ARENA_SIZE, 0, HIST_OFF)
    with pytest.raises(ValueError, match="must lie in the slots' buffer"):
        _hotpath.publish(lane, layout.LANE, 0, 0, 0, None, Ring(arena, 0, 2), True, arena, 0, 8, HIST_OFF)
    with pytest.raises(OverflowError):
        _hotpath.submit(lane, 0, 2**32, 1, 0, [], FLOOR, 0)
    with pytest.raises(TypeError):
        _hotpath.read(lane, (), 0, 0, REGION, 0, 0)  # free must be a list
    for m in (small, lane, arena):
        m.close()


def test_a_lane_mapping_cannot_be_closed_under_a_wait():
    """wait_slice holds the buffer while it sleeps with the GIL released: a close meanwhile is
    refused (BufferError), never a read of unmapped memory."""
    import threading
    lane = mmap.mmap(-1, LANE_SIZE)
    lanes.init_header(lane, 0)
    t = threading.Thread(target=_hotpath.wait_slice, args=(lane, 0, 1, 0.3, 0.0))
    t.start()
    try:
        for _ in range(100):
            try:
                lane.close()
            except BufferError:
                break
            else:
                pytest.fail("closed while a wait held it")  # the thread had not started yet: never here
    finally:
        t.join()
    lane.close()


def test_the_implementation_is_chosen_once_by_the_environment():
    def run(value):
        env = dict(os.environ)
        env.pop("SHMSERVE_HOTPATH", None)
        if value is not None:
            env["SHMSERVE_HOTPATH"] = value
        return subprocess.run([sys.executable, "-c", "from shmserve import hotpath, lanes; "
                               "print(hotpath.IMPL, hotpath.active.name, lanes._HOT.name)"],
                              env=env, capture_output=True, text=True)

    assert run(None).stdout.split() == ["c", "c", "c"]
    assert run("python").stdout.split() == ["python", "python", "python"]
    assert run(" C ").stdout.split() == ["c", "c", "c"]
    refused = run("rust")
    assert refused.returncode != 0 and "SHMSERVE_HOTPATH='rust'" in refused.stderr
