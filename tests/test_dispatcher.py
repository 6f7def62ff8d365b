"""The front-end's logic without processes: the real dispatcher, arena, rings, allocator and region
table, driven through a fake front door, a fake clock and in-process fake workers
(``helpers.fake_frontend``).

Admission, refusals, waiting for space, deadlines, the one answer per request, worker errors and
death, lost connections, shutdown, completion polling, worker choice, and lanes.  After every
test the fixture checks that nothing is held: no slot, extent, request or timer, and every request
its door got is DONE.  Nothing here spawns a process (it is refused); the process-level tests
(``test_serving``, ``test_lanes``, ``test_lifecycle``) stay for kills, leaks and stress.
"""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import os
import random
import time

import numpy as np
import pytest

from shmserve import _atomics as atomics
from shmserve import layout, reservations, workerlink
from shmserve.config import spin_default_us
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.dispatcher import Failure, LoopClock, Outputs
from shmserve.frontend.regions import REGION_SLACK, Region, RegionLimits, check_request
from shmserve.frontend.requests import HOLDING, UNANSWERED, IllegalTransition
from shmserve.frontend.requests import RequestState as RS
from shmserve.protocol import TensorMeta
from shmserve.rings import new_eventfd
from shmserve.slotstate import SlotState
from shmserve.supervisor import FAILED, RESTARTING, STOPPED

from helpers.fake_frontend import ADD, PAIR, TAIL, FakeDoor, LaneClient
from helpers.fake_frontend import make_fixture, no_children_left, no_processes  # noqa: F401 (fixtures)

ADD2 = dataclasses.replace(ADD, instances=2)


@pytest.fixture
def fe(make):
    return make()


def floats(n: int = 16, start: float = 0.0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.float32)


def slot_state(fe, index: int) -> SlotState:
    return SlotState(fe.arena.slot_status(index)[1])


def held(fe) -> tuple[int, int]:
    """(slots, extent bytes) in use, as the arena's counters say; checked against the allocators."""
    slots, extent_bytes = fe.arena.stat("slots_in_use"), fe.arena.stat("extent_bytes_in_use")
    assert (slots, extent_bytes) == (fe.dispatcher.slots.in_use, fe.dispatcher.extents.bytes_in_use)
    return slots, extent_bytes


def parked(fe, name: str):
    """The requests parked for ``name``'s current (default) version."""
    return fe.dispatcher.parked[fe.models.get(name).current]


def fill_slots(fe, door, count: int = 4) -> list:
    """``count`` requests that each take a slot and stay queued (no worker runs them yet)."""
    reqs = [door.infer("add", {"x": floats(start=100 * i)}) for i in range(count)]
    assert all(r.state is RS.QUEUED for r in reqs)
    return reqs


def open_region(fe, owner, size: int = 8192) -> tuple[Region, mmap.mmap]:
    region = fe.regions.open(owner, size)
    return region, mmap.mmap(region.fd, region.size)


def recorded(fe) -> dict[int, tuple]:
    """The arena's region records in use: id -> (kind, size, worker)."""
    return {r.id: (layout.REGION_KIND_NAMES[r.kind], r.size, r.worker)
            for r in layout.read_regions(fe.arena.buf, fe.arena.geometry)}


# -- admission and the data path --------------------------------------------------------------

def test_inline_request_lands_in_the_arena_and_is_answered_with_views_of_it(fe):
    """An inline payload is received straight into the request's extent, the worker is rung, and
    the answer's outputs are views of the arena holding the worker's bytes; slot and extent stay
    held (slot DONE) until the door says the views are written, then both are free."""
    door, w = fe.door(receive_now=False), fe.workers[0]
    x = floats()
    req = door.infer("add", {"x": x})
    assert req.state is RS.ADMITTED and door.calls_of(req) == ["admitted"]
    assert [len(s) for s in door.sinks[req]] == [x.nbytes]
    assert held(fe) == (1, 4096) and slot_state(fe, req.slot) is SlotState.WRITING
    rung = w.bell_count()
    door.receive(req)
    extent = req.extent
    assert fe.arena.buf[extent.offset:extent.offset + x.nbytes] == x.tobytes()
    assert req.state is RS.QUEUED and slot_state(fe, req.slot) is SlotState.READY and w.bell_count() == rung + 1
    [job] = w.claim()
    np.testing.assert_array_equal(w.inputs(job)["x"], x)
    w.complete(job)
    assert fe.deliver(), "the completion did not ring the front-end's eventfd"
    answer = door.answer_of(req)
    assert isinstance(answer, Outputs) and answer.in_arena
    [out] = answer.outputs
    assert (out.name, out.dtype, out.shape, out.nbytes) == ("y", "float32", (16,), x.nbytes)
    assert bytes(out.view) == (x + 1).tobytes() == fe.arena.buf[out.offset:out.offset + out.nbytes]
    assert extent.offset <= out.offset and out.offset + out.nbytes <= extent.offset + extent.size
    slot = req.slot
    assert req.state is RS.FLUSHING and held(fe) == (1, 4096) and slot_state(fe, slot) is SlotState.DONE
    door.write(req)
    assert req.state is RS.DONE and held(fe) == (0, 0) and slot_state(fe, slot) is SlotState.FREE
    np.testing.assert_array_equal(door.results[req]["y"], x + 1)
    assert fe.dispatcher.outcomes[("add", 1, "ok")] == 1 and fe.arena.stat("requests_total") == 1
    assert fe.arena.stat("bytes_in") == fe.arena.stat("bytes_out") == x.nbytes


def test_inputs_are_matched_by_name_and_outputs_come_in_the_models_order(make):
    """A client may list inputs in any order: each payload part lands in its own tensor, the
    worker finds each under its model name, and outputs are named as the model declares them."""
    fe = make(models=(PAIR,))
    door, w = fe.door(), fe.workers[0]
    a, b = np.arange(6, dtype=np.int32).reshape(2, 3), np.full((2, 3), 10, np.int32)
    req = door.infer("pair", {"b": b, "a": a})
    [job] = w.claim()
    got = w.inputs(job)
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], b)
    w.complete(job)
    assert fe.deliver()
    assert [o.name for o in door.answer_of(req).outputs] == ["sum", "diff"]
    result = door.result(req)
    np.testing.assert_array_equal(result["sum"], a + b)
    np.testing.assert_array_equal(result["diff"], a - b)


def test_a_request_with_only_empty_inputs_is_published_at_admission(fe):
    """No payload to receive: admitted without sinks, already queued for a worker."""
    door = fe.door(receive_now=False)
    req = door.infer("add", {"x": floats(0)})
    assert req.state is RS.QUEUED and door.calls_of(req) == ["admitted"] and req not in door.sinks
    fe.settle()
    assert door.results[req]["y"].shape == (0,)


def test_zero_copy_request_uses_the_clients_region_and_holds_nothing_once_answered(fe):
    """Inputs are read from and outputs written to the client's region; the request takes a slot
    but no extent, and is freed as it is answered (nothing of the arena to write back)."""
    door, w = fe.door(), fe.workers[0]
    region, buf = open_region(fe, door)
    try:
        x = floats(32)
        buf[0:x.nbytes] = x.tobytes()
        req = door.infer_region(fe.regions, region.id, "add", {"x": (0, "float32", (32,))}, 4096, 4096)
        assert req.state is RS.QUEUED and req.extent is None and held(fe) == (1, 0)
        assert door.calls_of(req) == ["admitted"]
        w.step()
        assert fe.deliver()
        answer = door.answer_of(req)
        assert isinstance(answer, Outputs) and not answer.in_arena
        [out] = answer.outputs
        assert (out.name, out.offset, out.nbytes, out.view) == ("y", 4096, x.nbytes, None)
        assert buf[4096:4096 + x.nbytes] == (x + 1).tobytes()
        assert req.state is RS.DONE and held(fe) == (0, 0)
        assert fe.arena.stat("bytes_out") == 0  # nothing came back through the arena
    finally:
        buf.close()
        fe.regions.close(door, region.id)


ZERO_COPY_BOUNDS = {
    "unaligned input": ({"x": (8, "float32", (16,))}, 4096, 64),
    "input past the end": ({"x": (8192 - 64, "float32", (32,))}, 4096, 64),
    "output area past the end": ({"x": (0, "float32", (16,))}, 4096, 8192),
    "unaligned output area": ({"x": (0, "float32", (16,))}, 4100, 64),
}


@pytest.mark.parametrize("case", list(ZERO_COPY_BOUNDS))
def test_zero_copy_bounds_are_checked_before_anything_is_held(fe, case):
    """An input or output area that is unaligned or leaves the region is BAD_REGION at submission."""
    inputs, out_offset, out_capacity = ZERO_COPY_BOUNDS[case]
    door = fe.door()
    region, buf = open_region(fe, door)
    buf.close()
    with pytest.raises(ShmserveError) as info:
        door.infer_region(fe.regions, region.id, "add", inputs, out_offset, out_capacity)
    assert info.value.code is ErrorCode.BAD_REGION
    assert held(fe) == (0, 0) and not door.requests
    assert fe.dispatcher.outcomes[("add", "", "bad_region")] == 1
    fe.regions.close(door, region.id)


def test_a_zero_copy_request_may_only_name_its_own_doors_region(fe):
    """Another connection's region, or one never opened, is BAD_REGION: regions are per owner."""
    mine, other = fe.door(), fe.door()
    region, buf = open_region(fe, other)
    buf.close()
    for region_id in (region.id, region.id + 100):
        with pytest.raises(ShmserveError, match="not open on this connection") as info:
            mine.infer_region(fe.regions, region_id, "add", {"x": (0, "float32", (16,))}, 4096, 64)
        assert info.value.code is ErrorCode.BAD_REGION
    assert fe.dispatcher.outcomes[("add", "", "bad_region")] == 2
    fe.regions.close(other, region.id)


# -- refusals -------------------------------------------------------------------------------

def _refuse_unknown_model(fe, door):
    door.infer("nope", {"x": floats()})


def _refuse_failed(fe, door):
    w = fe.workers[1].handle
    w.error = "cannot load model 'pair': no such file"
    w.set_state(FAILED)
    door.infer("pair", {"a": np.zeros((2, 1), np.int32), "b": np.zeros((2, 1), np.int32)})


def _refuse_shape(fe, door):
    door.infer("pair", {"a": np.zeros((3, 1), np.int32), "b": np.zeros((3, 1), np.int32)})


def _refuse_symbol(fe, door):
    door.infer("pair", {"a": np.zeros((2, 1), np.int32), "b": np.zeros((2, 2), np.int32)})


def _refuse_dtype(fe, door):
    door.infer("add", {"x": np.zeros(4, np.int32)})


def _refuse_name(fe, door):
    door.infer("add", {"z": floats()})


def _refuse_payload(fe, door):
    door.infer("add", {"x": floats()}, payload=b"\0" * 60)


def _refuse_too_large(fe, door):
    door.infer("add", {"x": floats(9000)})


def _refuse_door_limit(fe, door):
    door.infer("add", {"x": floats()})
    door.infer("add", {"x": floats()})
    door.infer("add", {"x": floats()})


def _refuse_shutting_down(fe, door):
    fe.dispatcher.stop_admitting()
    door.infer("add", {"x": floats()})


REFUSALS = {
    "unknown model": (_refuse_unknown_model, ErrorCode.UNKNOWN_MODEL, "_unknown", "no model 'nope'"),
    "model failed": (_refuse_failed, ErrorCode.MODEL_UNAVAILABLE, "pair", "no such file"),
    "fixed dimension": (_refuse_shape, ErrorCode.BAD_SHAPE, "pair", "dimension 0 must be 2"),
    "symbolic dimension": (_refuse_symbol, ErrorCode.BAD_SHAPE, "pair", "another input has 'k'"),
    "dtype": (_refuse_dtype, ErrorCode.BAD_DTYPE, "add", "must be float32"),
    "input name": (_refuse_name, ErrorCode.BAD_INPUT, "add", "missing"),
    "payload size": (_refuse_payload, ErrorCode.BAD_FRAME, "add", "payload is 60 bytes"),
    "too large": (_refuse_too_large, ErrorCode.TOO_LARGE, "add",
                  r"> max_request_bytes \(65536 bytes\): raise \[server\] max_request_bytes"),
    "door limit": (_refuse_door_limit, ErrorCode.OVERLOADED, "add", "in flight on this connection"),
    "shutting down": (_refuse_shutting_down, ErrorCode.SHUTTING_DOWN, "add", "shutting down"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_carry_their_stable_code_hold_nothing_and_are_counted(make, case):
    """``submit`` refuses with the code a client can act on, before anything is held; the door
    gets no answer (it answers the refusal itself) and the outcome is counted once, under the
    model's name only for a model that exists."""
    act, code, label, message = REFUSALS[case]
    fe = make(models=(ADD, PAIR), max_inflight_per_door=2)
    door = fe.door()
    with pytest.raises(ShmserveError, match=message) as info:
        act(fe, door)
    assert info.value.code is code
    assert fe.dispatcher.outcomes[(label, "", code.wire)] == 1
    assert sum(fe.dispatcher.outcomes.values()) == 1
    assert not door.answers
    assert held(fe) == ((2, 8192) if case == "door limit" else (0, 0))
    if case == "door limit":
        fe.settle()
        door.infer("add", {"x": floats()})  # written back: the connection may send again
        fe.settle()


# -- waiting for space ------------------------------------------------------------------------

def test_requests_wait_for_a_slot_and_are_admitted_in_arrival_order(fe):
    """With every slot taken, requests wait (their door told to stop reading); each slot freed —
    only once its answer is written — admits the oldest waiter, whose payload then lands intact."""
    door, w = fe.door(), fe.workers[0]
    first = fill_slots(fe, door)
    later = [door.infer("add", {"x": floats(start=1000 * (i + 1))}) for i in range(3)]
    assert all(r.state is RS.WAITING and door.calls_of(r) == ["waiting"] for r in later)
    assert list(fe.dispatcher.waiting) == later and held(fe) == (4, 4 * 4096)
    jobs = w.claim()
    for i in (3, 1, 0):  # completed in any order, each frees a slot for the oldest waiter
        w.complete(jobs[i])
        assert fe.deliver()
        assert first[i].state is RS.FLUSHING and held(fe)[0] == 4
        before = [r.state for r in later]
        door.write(first[i])  # only now is the slot free
        admitted = sum(r.state is RS.QUEUED for r in later)
        assert [r.state for r in later] == [RS.QUEUED] * admitted + [RS.WAITING] * (3 - admitted)
        assert admitted == before.count(RS.QUEUED) + 1
    w.complete(jobs[2])
    fe.settle()
    for i, req in enumerate(later):
        np.testing.assert_array_equal(door.results[req]["y"], floats(start=1000 * (i + 1)) + 1)
        assert door.calls_of(req) == ["waiting", "admitted", "answer"]


def test_a_door_hears_admitted_only_before_the_answer(fe):
    """A zero-copy request waits for a slot; its model's only worker fails for good meanwhile
    (cannot load it): when a slot frees it is answered MODEL_UNAVAILABLE, and its door must not
    then hear that it was admitted."""
    door, w = fe.door(), fe.workers[0]
    first = fill_slots(fe, door)
    region, buf = open_region(fe, door)
    buf.close()
    waiter = door.infer_region(fe.regions, region.id, "add", {"x": (0, "float32", (16,))}, 4096, 64)
    jobs = w.claim()
    w.complete(jobs[0])
    assert fe.deliver()
    w.handle.set_state(FAILED)  # it died; the supervisor moves it on before telling anyone
    door.write(first[0])
    assert door.failure(waiter).code is ErrorCode.MODEL_UNAVAILABLE
    assert door.calls_of(waiter) == ["waiting", "answer"]
    fe.kill(w, "exit 3 (model failed to load)", state=FAILED)  # then the server hears of the death
    fe.settle()


def test_past_max_waiting_a_request_is_answered_overloaded(make):
    """The wait for space is bounded: one request more is answered OVERLOADED at once."""
    fe = make(max_waiting=1)
    door = fe.door()
    fill_slots(fe, door)
    waiter = door.infer("add", {"x": floats()})
    refused = door.infer("add", {"x": floats()})
    assert waiter.state is RS.WAITING
    assert refused.state is RS.DONE and door.failure(refused).code is ErrorCode.OVERLOADED
    assert door.calls_of(refused) == ["answer"]
    assert fe.dispatcher.outcomes[("add", 1, "overloaded")] == 1
    fe.settle()


def test_requests_wait_for_data_space_too_and_keep_their_order(make):
    """Slots to spare but no extent large enough: a large request waits, and a small one behind
    it waits too (first come, first admitted), until the large one's space is freed."""
    fe = make(slot_count=8)
    door, w = fe.door(), fe.workers[0]
    big = [door.infer("add", {"x": floats(4000, start=i)}) for i in range(3)]
    assert [r.state for r in big] == [RS.QUEUED, RS.QUEUED, RS.WAITING] and held(fe) == (2, 2 * 65536)
    small = door.infer("add", {"x": floats()})
    assert small.state is RS.WAITING and list(fe.dispatcher.waiting) == [big[2], small]
    jobs = w.claim()
    w.complete(jobs[0])
    assert fe.deliver()
    assert big[2].state is RS.WAITING  # answered, but its extent is held until written
    door.write(big[0])
    assert big[2].state is RS.QUEUED and small.state is RS.QUEUED
    w.complete(jobs[1])
    fe.settle()
    np.testing.assert_array_equal(door.results[big[2]]["y"], floats(4000, start=2) + 1)


@pytest.mark.parametrize("leaves", ["timeout", "drop"])
def test_when_the_head_of_the_queue_leaves_the_next_waiter_is_admitted(make, leaves):
    """A large request waits for a large extent, a small one waits behind it; when the large one
    times out or its door goes, the small one fits at once and is admitted at once."""
    fe = make(slot_count=8)
    door, other = fe.door(), fe.door()
    running = [door.infer("add", {"x": floats(4000)}) for _ in range(2)]
    head = other.infer("add", {"x": floats(4000)}, timeout_s=1)
    small = door.infer("add", {"x": floats()})
    assert head.state is RS.WAITING and small.state is RS.WAITING
    if leaves == "timeout":
        fe.clock.advance(1)
        assert other.failure(head).code is ErrorCode.TIMEOUT
    else:
        other.drop(head)
    assert all(r.state is RS.QUEUED for r in running)
    assert small.state is RS.QUEUED, "the small request still waits although its space is free"
    fe.settle()


# -- deadlines --------------------------------------------------------------------------------

def test_a_request_times_out_while_waiting_for_space(fe):
    """Answered TIMEOUT at its deadline, out of the queue, never admitted, holding nothing."""
    door = fe.door()
    fill_slots(fe, door)
    late = door.infer("add", {"x": floats()}, timeout_s=1)
    fe.clock.advance(0.999)
    assert late.state is RS.WAITING
    fe.clock.advance(0.001)
    failure = door.failure(late)
    assert failure.code is ErrorCode.TIMEOUT and "no arena space within 1 s" in failure.message
    assert late.state is RS.DONE and late.slot is None and not fe.dispatcher.waiting
    assert door.calls_of(late) == ["waiting", "answer"] and held(fe) == (4, 4 * 4096)
    fe.settle()


def test_a_queued_request_times_out_and_its_slot_is_taken_back_at_once(fe):
    """Not yet claimed at its deadline: answered TIMEOUT, the slot moved READY -> ERROR -> FREE
    now; the worker later finds the stale entry and cannot claim it; the slot's next use has a
    new generation."""
    door, w = fe.door(), fe.workers[0]
    req = door.infer("add", {"x": floats()}, timeout_s=2)
    slot, generation = req.slot, req.generation
    fe.clock.advance(2)
    failure = door.failure(req)
    assert failure.code is ErrorCode.TIMEOUT and "no result within 2 s" in failure.message
    assert req.state is RS.DONE and held(fe) == (0, 0) and slot_state(fe, slot) is SlotState.FREE
    assert not fe.dispatcher.pending and not w.handle.inflight
    assert w.claim() == [] and w.skipped == [(slot, generation)]
    assert not fe.deliver()
    again = door.infer("add", {"x": floats()})
    assert (again.slot, again.generation) == (slot, generation + 1)
    fe.settle()
    assert fe.dispatcher.outcomes[("add", 1, "timeout")] == 1 and fe.dispatcher.outcomes[("add", 1, "ok")] == 1


def test_a_running_request_times_out_but_its_slot_waits_for_the_worker(fe):
    """Claimed at its deadline: answered TIMEOUT now, but the slot stays RUNNING and held — never
    handed to another request — until the worker finishes; its result is then absorbed."""
    door, w = fe.door(), fe.workers[0]
    req = door.infer("add", {"x": floats()}, timeout_s=2)
    [job] = w.claim()
    fe.clock.advance(2)
    assert door.failure(req).code is ErrorCode.TIMEOUT and req.state is RS.ABANDONED
    assert held(fe) == (1, 4096) and slot_state(fe, job.index) is SlotState.RUNNING
    others = [door.infer("add", {"x": floats()}) for _ in range(3)]
    assert job.index not in {r.slot for r in others}
    waiter = door.infer("add", {"x": floats()})
    assert waiter.state is RS.WAITING
    w.complete(job)
    assert fe.deliver()
    assert req.state is RS.DONE and door.calls_of(req) == ["admitted", "answer"]
    assert waiter.state is RS.QUEUED and waiter.slot == job.index
    fe.settle()


def test_time_spent_waiting_counts_against_the_deadline(fe):
    """The deadline runs from admission, not from when space was found."""
    door, w = fe.door(), fe.workers[0]
    first = fill_slots(fe, door)
    late = door.infer("add", {"x": floats()}, timeout_s=3)
    fe.clock.advance(2)
    jobs = w.claim()
    w.complete(jobs[0])
    assert fe.deliver()
    door.write(first[0])
    assert late.state is RS.QUEUED
    fe.clock.advance(1)
    assert door.failure(late).code is ErrorCode.TIMEOUT
    for job in jobs[1:]:
        w.complete(job)
    fe.settle()


def test_a_deadline_that_passes_during_the_upload_is_not_extended(fe):
    """A request whose deadline passed while its payload was arriving is answered TIMEOUT by the
    front-end when its payload is in, not a whole timeout later, and no worker ever sees it (a
    worker would answer it too, in other words: which came first was a race)."""
    door, slow = fe.door(), fe.door(receive_now=False)
    first = fill_slots(fe, door)
    late = slow.infer("add", {"x": floats()}, timeout_s=3)
    fe.clock.advance(2)
    jobs = fe.workers[0].claim()
    fe.workers[0].complete(jobs[0])
    assert fe.deliver()
    door.write(first[0])
    assert late.state is RS.ADMITTED
    fe.clock.advance(2)  # the deadline (t=3) passes while the payload arrives
    slow.receive(late)
    failure = slow.failure(late)
    assert late.answered and failure.code is ErrorCode.TIMEOUT and "no result within 3 s" in failure.message
    assert late.slot not in {job.index for job in fe.workers[0].claim()}  # never published to a worker
    for job in jobs[1:]:
        fe.workers[0].complete(job)
    fe.settle()


# -- one answer per request, in completion order ------------------------------------------------

def test_answers_follow_completions_and_each_request_gets_exactly_one(fe):
    """Requests are answered as their workers finish them, in any order, each once, each with
    its own result."""
    door, w = fe.door(), fe.workers[0]
    reqs = [door.infer("add", {"x": floats(start=10 * i)}) for i in range(4)]
    jobs = w.claim()
    for i in (2, 0):
        w.complete(jobs[i])
        assert fe.deliver()
    w.complete(jobs[3])
    w.complete(jobs[1])
    assert fe.deliver()  # two completions, one wake-up
    assert door.answer_order == [reqs[2], reqs[0], reqs[3], reqs[1]]
    door.write_all()
    for i, req in enumerate(reqs):
        assert door.calls_of(req) == ["admitted", "answer"]
        np.testing.assert_array_equal(door.results[req]["y"], floats(start=10 * i) + 1)


def test_a_second_answer_is_an_illegal_transition(fe):
    """Once answered — results held for writing (FLUSHING), timed out while running (ABANDONED),
    or done — a request cannot be answered again: the table refuses, and its door hears nothing."""
    door, w = fe.door(), fe.workers[0]
    flushing = door.infer("add", {"x": floats()})
    abandoned = door.infer("add", {"x": floats()}, timeout_s=1)
    done = door.infer("add", {"x": floats()}, timeout_s=1)
    jobs = w.claim()
    w.complete(jobs[0])
    assert fe.deliver()
    w.fail(jobs[2], ErrorCode.MODEL_ERROR, "no")
    assert fe.deliver()
    fe.clock.advance(1)
    assert [r.state for r in (flushing, abandoned, done)] == [RS.FLUSHING, RS.ABANDONED, RS.DONE]
    for req in (flushing, abandoned, done):
        state = req.state
        with pytest.raises(IllegalTransition):
            fe.dispatcher._end(req, Failure(ErrorCode.INTERNAL, "a second answer"))
        with pytest.raises(IllegalTransition):
            fe.dispatcher._abandon(req, Failure(ErrorCode.INTERNAL, "a second answer"))
        assert req.state is state and door.calls_of(req).count("answer") == 1
    w.complete(jobs[1])
    fe.settle()


# -- what workers report ----------------------------------------------------------------------

@pytest.mark.parametrize("code,expected", [(ErrorCode.MODEL_ERROR, ErrorCode.MODEL_ERROR),
                                           (ErrorCode.BAD_REGION, ErrorCode.BAD_REGION),
                                           (999, ErrorCode.INTERNAL)])
def test_a_worker_error_reaches_the_door_with_its_code_and_message(fe, code, expected):
    """ERROR from the worker: its code (INTERNAL for a number that names none) and message are
    the answer; the slot is freed at once and the error counted."""
    door, w = fe.door(), fe.workers[0]
    req = door.infer("add", {"x": floats()})
    [job] = w.claim()
    w.fail(job, code, "ValueError: bad weights — ünïcode")
    assert fe.deliver()
    failure = door.failure(req)
    assert (failure.code, failure.message) == (expected, "ValueError: bad weights — ünïcode")
    assert req.state is RS.DONE and held(fe) == (0, 0)
    assert fe.arena.stat("errors_total") == 1 and fe.dispatcher.outcomes[("add", 1, expected.wire)] == 1


def test_outputs_larger_than_the_guess_are_run_again_once_with_what_they_need(make):
    """An output whose size no input binds gets a guess; the worker's short answer has the request
    run again, once, with an output area of what the outputs took (beside its inputs' extent), and
    its version learns it: the next request of that signature reserves it at once."""
    fe = make(models=(TAIL,))
    door = fe.door()
    fits = door.infer("tail", {"x": np.arange(200, dtype=np.uint8)})
    x = np.arange(3000, dtype=np.uint8)
    grown = door.infer("tail", {"x": x})
    fe.settle()
    np.testing.assert_array_equal(door.results[fits]["y"], np.arange(200, dtype=np.uint8)[::-1])
    np.testing.assert_array_equal(door.results[grown]["y"], x[::-1])
    assert fe.dispatcher.reruns == {"tail:1": 1} and fe.arena.stat("errors_total") == 0
    assert fe.arena.stat("requests_total") == 2  # the short run is no answer: its second run is counted
    again = door.infer("tail", {"x": x + 1})  # the same signature: reserved as learned, run once
    fe.settle()
    np.testing.assert_array_equal(door.results[again]["y"], (x + 1)[::-1])
    assert fe.dispatcher.reruns == {"tail:1": 1}
    assert fe.models.get("tail").current.learned.get((("x", "uint8", (3000,)),)) == 3000
    assert held(fe) == (0, 0) and grown.state is again.state is RS.DONE


def test_a_request_short_twice_or_beyond_max_request_bytes_is_answered_output_too_large(make):
    fe = make(models=(TAIL,))
    door = fe.door()
    w = fe.workers[0]
    req = door.infer("tail", {"x": np.zeros(3000, np.uint8)})
    fe.pump_doors()
    [job] = w.claim()
    w.complete(job, {"y": np.zeros(3000, np.uint8)})  # short: run again with 3000 bytes
    assert fe.deliver() and req.state is RS.QUEUED and fe.dispatcher.reruns == {"tail:1": 1}
    [job] = w.claim()
    w.complete(job, {"y": np.zeros(5000, np.uint8)})  # data-dependent: larger still on the second run
    assert fe.deliver()
    failure = door.failure(req)
    assert failure.code is ErrorCode.OUTPUT_TOO_LARGE and reservations.needed(*failure) == 5000
    assert fe.dispatcher.reruns == {"tail:1": 1} and held(fe) == (0, 0)
    big = door.infer("tail", {"x": np.zeros(100, np.uint8)})  # its output: more than max_request_bytes (64 KiB)
    fe.pump_doors()
    [job] = w.claim()
    w.complete(job, {"y": np.zeros(70_000, np.uint8)})
    assert fe.deliver()
    failure = door.failure(big)
    assert failure.code is ErrorCode.OUTPUT_TOO_LARGE and reservations.needed(*failure) is None
    assert "max_request_bytes" in failure.message and "raise" in failure.message, failure.message
    assert fe.models.get("tail").current.learned.get((("x", "uint8", (100,)),)) == 0  # never learned
    assert held(fe) == (0, 0)


def _tensor(**fields):
    def tamper(buf, g, index, first):
        layout.TENSOR.write(buf, g.tensor_off(index, first), **fields)
    return tamper


def _outside_data(buf, g, index, first):
    layout.TENSOR.write(buf, g.tensor_off(index, first), offset=g.data_off + g.data_size)


def _unaligned(buf, g, index, first):
    offset = layout.TENSOR.read_field(buf, g.tensor_off(index, first), "offset")
    layout.TENSOR.write(buf, g.tensor_off(index, first), offset=offset + 8)


def _too_many(buf, g, index, first):
    layout.set_n_outputs(buf, g, index, layout.MAX_TENSORS)


TAMPERS = {
    "input role": _tensor(role=layout.ROLE_INPUT),
    "unknown output": _tensor(name_index=5),
    "unknown dtype": _tensor(dtype=200),
    "size disagrees with shape": _tensor(nbytes=3),
    "in a client region": _tensor(region=7),
    "outside the data region": _outside_data,
    "unaligned": _unaligned,
    "more outputs than a slot holds": _too_many,
}


@pytest.mark.parametrize("case", list(TAMPERS))
def test_invalid_output_descriptors_are_answered_internal(fe, case):
    """DONE with descriptors that do not describe outputs of this model inside the arena: INTERNAL,
    no view of the arena handed out, the slot freed."""
    door, w = fe.door(), fe.workers[0]
    req = door.infer("add", {"x": floats()})
    [job] = w.claim()
    w.complete(job, tamper=TAMPERS[case])
    assert fe.deliver()
    failure = door.failure(req)
    assert failure.code is ErrorCode.INTERNAL and failure.message.startswith("worker wrote invalid outputs")
    assert req.state is RS.DONE and held(fe) == (0, 0)
    assert fe.dispatcher.outcomes[("add", 1, "internal")] == 1 and not fe.dispatcher.outcomes[("add", 1, "ok")]


def test_a_zero_copy_output_outside_the_clients_region_is_answered_internal(fe):
    """A zero-copy request's outputs must lie in its own region, not the arena."""
    door, w = fe.door(), fe.workers[0]
    region, buf = open_region(fe, door)
    buf.close()
    req = door.infer_region(fe.regions, region.id, "add", {"x": (0, "float32", (16,))}, 4096, 4096)
    [job] = w.claim()
    w.complete(job, tamper=_tensor(region=0, offset=fe.arena.geometry.data_off))
    assert fe.deliver()
    assert door.failure(req).code is ErrorCode.INTERNAL
    fe.regions.close(door, region.id)


def test_an_output_outside_the_requests_own_output_area_is_refused(fe):
    """A descriptor pointing at another request's extent (aligned, inside the arena, the right
    size) must not be answered with that request's bytes."""
    door, other = fe.door(), fe.door()
    mine = door.infer("add", {"x": floats()})
    secret = other.infer("add", {"x": floats(start=4242)})
    victim = secret.extent.offset
    jobs = fe.workers[0].claim()
    fe.workers[0].complete(jobs[0], tamper=_tensor(offset=victim))
    assert fe.deliver()
    answer = door.answer_of(mine)
    assert isinstance(answer, Failure) and answer.code is ErrorCode.INTERNAL, \
        f"answered with another request's input: {np.frombuffer(bytes(answer.outputs[0].view), np.float32)}"
    fe.workers[0].complete(jobs[1])
    fe.settle()


def test_stray_completion_entries_are_ignored(make):
    """Entries on a completion ring for a slot this worker does not hold, an old generation, a slot
    not finished yet, or another worker's slot change nothing; the real completion still lands."""
    fe = make(models=(ADD2,))
    door, (w0, w1) = fe.door(), fe.workers
    req = door.infer("add", {"x": floats()})
    [job] = w0.claim()
    strays = {w0: [layout.slot_entry(3, 1), layout.slot_entry(999, 1), layout.slot_entry(job.index, job.generation + 1),
                   job.entry],  # the last: still RUNNING
              w1: [job.entry]}
    for w, entries in strays.items():
        for entry in entries:
            assert w.main.completions.push(entry)
        w.main.outbox.notify()
    assert fe.deliver()
    assert req.state is RS.QUEUED and not door.answers and fe.dispatcher.pending[job.index] is req
    w0.complete(job)
    assert fe.deliver()
    np.testing.assert_array_equal(door.result(req)["y"], floats() + 1)


# -- worker death ---------------------------------------------------------------------------

def test_worker_death_fails_what_it_was_running_and_the_rest_runs_on_its_restart(fe):
    """A dead worker's RUNNING slot is failed WORKER_CRASHED (naming the worker and how it died)
    and freed; its ring is discarded.  What lay unclaimed on it (READY: nothing of it ran) keeps
    its slot and waits, parked, for the restarted worker, which runs it."""
    door, w = fe.door(), fe.workers[0]
    running = door.infer("add", {"x": floats()})
    w.claim()
    queued = door.infer("add", {"x": floats(start=7)})
    assert slot_state(fe, running.slot) is SlotState.RUNNING and slot_state(fe, queued.slot) is SlotState.READY
    fe.kill(w)
    failure = door.failure(running)
    assert failure.code is ErrorCode.WORKER_CRASHED and running.state is RS.DONE
    assert failure.message == "worker 0 for model 'add' killed by SIGKILL while running this request"
    assert queued.state is RS.QUEUED and door.calls_of(queued) == ["admitted"]
    assert slot_state(fe, queued.slot) is SlotState.READY and list(parked(fe, "add")) == [queued]
    assert held(fe) == (1, 4096) and not w.handle.inflight and w.handle.submissions.empty()
    fe.restart(w)
    assert w.handle.inflight == {queued.slot} and not parked(fe, "add")
    fe.settle()
    np.testing.assert_array_equal(door.results[queued]["y"], floats(start=7) + 1)


def test_worker_death_delivers_what_it_finished_but_did_not_hand_back(fe):
    """A result published DONE before the worker died — completion pushed but not yet collected,
    or not even pushed — is delivered, not failed."""
    door, w = fe.door(), fe.workers[0]
    unpushed = door.infer("add", {"x": floats(start=1)})
    uncollected = door.infer("add", {"x": floats(start=2)})
    lost = door.infer("add", {"x": floats(start=3)})
    jobs = w.claim()
    w.complete(jobs[0], push=False)
    w.complete(jobs[1])
    fe.kill(w)
    assert [type(door.answer_of(r)) for r in (unpushed, uncollected, lost)] == [Outputs, Outputs, Failure]
    door.write_all()
    np.testing.assert_array_equal(door.results[unpushed]["y"], floats(start=1) + 1)
    np.testing.assert_array_equal(door.results[uncollected]["y"], floats(start=2) + 1)
    assert door.failure(lost).code is ErrorCode.WORKER_CRASHED
    fe.deliver()
    assert fe.dispatcher.outcomes[("add", 1, "ok")] == 2


# -- waiting for a restarting worker ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["inline", "zero-copy"])
def test_a_request_for_a_restarting_model_waits_and_runs_on_the_restarted_worker(fe, kind):
    """All of the model's workers restarting: the request is not refused but waits (its door stops
    reading), holding nothing, counted as queued; once a worker reports ready it is admitted and
    runs there."""
    door, w = fe.door(), fe.workers[0]
    fe.kill(w)
    if kind == "inline":
        req = door.infer("add", {"x": floats()})
    else:
        region, buf = open_region(fe, door)
        buf[0:64] = floats().tobytes()
        buf.close()
        req = door.infer_region(fe.regions, region.id, "add", {"x": (0, "float32", (16,))}, 4096, 64)
    assert req.state is RS.WAITING and door.calls_of(req) == ["waiting"] and held(fe) == (0, 0)
    assert fe.dispatcher.queue_depths() == {"add:1": (1, 0)}
    fe.clock.advance(4)  # the restart takes a while: within its timeout (5 s)
    fe.restart(w)
    assert door.calls_of(req)[:2] == ["waiting", "admitted"] and req.worker is w.handle
    fe.settle()
    if kind == "inline":
        np.testing.assert_array_equal(door.results[req]["y"], floats() + 1)
    else:
        assert isinstance(door.answer_of(req), Outputs)
        fe.regions.close_all()


@pytest.mark.parametrize("good", [True, False], ids=["good inputs", "bad dtype"])
def test_a_request_for_a_never_loaded_model_waits_and_is_checked_once_it_loads(fe, good):
    """No worker of the model was ever ready (its inputs cannot be checked yet): the request is
    not refused but waits, holding nothing; once a worker reports ready it is checked — and runs,
    or is answered with the refusal's code, holding nothing."""
    door, w = fe.door(), fe.workers[0]
    fe.kill(w)
    w.handle.spec = None
    x = floats() if good else floats().astype(np.float64)
    req = door.infer("add", {"x": x})
    assert req.state is RS.WAITING and door.calls_of(req) == ["waiting"] and held(fe) == (0, 0)
    fe.restart(w)
    fe.settle()
    if good:
        np.testing.assert_array_equal(door.results[req]["y"], floats() + 1)
    else:
        failure = door.failure(req)
        assert failure.code is ErrorCode.BAD_DTYPE and "must be float32" in failure.message
    assert held(fe) == (0, 0) and not fe.dispatcher.pending


def test_a_queued_request_whose_region_closed_before_its_worker_came_back_is_taken_back(fe):
    """A zero-copy request queued on a worker that dies; its client closes the region meanwhile;
    republished to the restarted worker, it cannot be given the region: answered BAD_REGION, its
    slot taken back, nothing left pending (the metrics' queue depths and the drain read it)."""
    door, w = fe.door(), fe.workers[0]
    region, buf = open_region(fe, door)
    buf[0:64] = floats().tobytes()
    buf.close()
    req = door.infer_region(fe.regions, region.id, "add", {"x": (0, "float32", (16,))}, 4096, 64)
    assert req.state is RS.QUEUED
    fe.kill(w)  # it never claimed it: the request waits for the restart
    fe.regions.close(door, region.id)
    fe.restart(w)
    failure = door.failure(req)
    assert failure.code is ErrorCode.BAD_REGION and "closed" in failure.message
    assert not fe.dispatcher.pending and fe.dispatcher.in_flight == 0 and held(fe) == (0, 0)
    assert fe.dispatcher.queue_depths() == {"add:1": (0, 0)}


def test_a_request_waiting_for_a_worker_times_out_with_the_reason(fe):
    """No worker back within its timeout: TIMEOUT, saying it had no ready worker and why."""
    door, w = fe.door(), fe.workers[0]
    fe.kill(w)
    req = door.infer("add", {"x": floats()}, timeout_s=1)
    fe.clock.advance(1)
    failure = door.failure(req)
    assert failure.code is ErrorCode.TIMEOUT and req.state is RS.DONE
    assert "no ready worker within 1 s" in failure.message and "worker 0 restarting" in failure.message
    assert not parked(fe, "add") and door.calls_of(req) == ["waiting", "answer"]
    fe.restart(w)


def test_waiting_for_a_worker_counts_against_max_waiting(make):
    """Requests waiting for a worker before admission and those waiting for space share
    max_waiting; one more is answered OVERLOADED naming the key."""
    fe = make(models=(ADD, PAIR), max_waiting=2)
    door, add = fe.door(), fe.workers[0]
    fe.kill(add)
    waiting = [door.infer("add", {"x": floats()}) for _ in range(2)]
    refused = door.infer("add", {"x": floats()})
    failure = door.failure(refused)
    assert failure.code is ErrorCode.OVERLOADED and "server.max_waiting = 2" in failure.message
    assert "model 'add' is restarting" in failure.message
    pair = door.infer("pair", {"a": np.zeros((2, 1), np.int32), "b": np.zeros((2, 1), np.int32)})
    assert pair.state is RS.QUEUED  # another model's worker is ready: it does not wait at all
    fe.restart(add)
    fe.settle()
    assert all(isinstance(door.answer_of(r), Outputs) for r in (*waiting, pair))


def test_a_request_whose_workers_died_during_its_upload_keeps_its_space_and_runs_after_restart(fe):
    """Admitted (payload arriving) when its model's only worker dies: once received it is parked
    holding its slot and extent, then published to the restarted worker."""
    door, w = fe.door(receive_now=False), fe.workers[0]
    req = door.infer("add", {"x": floats(start=3)})
    fe.kill(w)
    door.receive(req)
    assert req.state is RS.ADMITTED and slot_state(fe, req.slot) is SlotState.WRITING
    assert list(parked(fe, "add")) == [req] and held(fe) == (1, 4096)
    fe.restart(w)
    assert req.state is RS.QUEUED and slot_state(fe, req.slot) is SlotState.READY
    fe.settle()
    np.testing.assert_array_equal(door.results[req]["y"], floats(start=3) + 1)


def test_a_space_waiter_whose_model_died_waits_for_a_worker_without_blocking_others(make):
    """At the head of the queue for space when its model's workers are all restarting: it leaves
    that queue (holding nothing) to wait for a worker, and the request behind it gets the space."""
    fe = make(models=(ADD, PAIR))
    door, add, pair = fe.door(), fe.workers[0], fe.workers[1]
    pairs = [door.infer("pair", {"a": np.zeros((2, 1), np.int32), "b": np.zeros((2, 1), np.int32)})
             for _ in range(4)]
    add_waiter = door.infer("add", {"x": floats()})
    pair_waiter = door.infer("pair", {"a": np.ones((2, 1), np.int32), "b": np.ones((2, 1), np.int32)})
    assert list(fe.dispatcher.waiting) == [add_waiter, pair_waiter]
    fe.kill(add)
    jobs = pair.claim()
    pair.complete(jobs[0])
    assert fe.deliver()
    door.write(pairs[0])
    assert add_waiter.state is RS.WAITING and list(parked(fe, "add")) == [add_waiter]
    assert pair_waiter.state is RS.QUEUED and not fe.dispatcher.waiting
    assert door.calls_of(add_waiter) == ["waiting"]
    fe.restart(add)  # no space free yet: back in the queue for space
    assert add_waiter.state is RS.WAITING and list(fe.dispatcher.waiting) == [add_waiter]
    for job in jobs[1:]:
        pair.complete(job)
    fe.settle()
    np.testing.assert_array_equal(door.results[add_waiter]["y"], floats() + 1)


def test_requests_waiting_for_a_worker_fail_model_unavailable_once_it_cannot_be_loaded(fe):
    """The restarted worker cannot load the model (its exit code says so: FAILED): every request
    parked for it is answered MODEL_UNAVAILABLE with its workers' reason and freed — waiting,
    admitted, and taken back from the dead worker's ring — and new ones are refused."""
    door, w = fe.door(receive_now=False), fe.workers[0]
    uploading = door.infer("add", {"x": floats()})
    queued = door.infer("add", {"x": floats()})
    door.receive(queued)
    fe.kill(w)
    door.receive(uploading)
    waiting = door.infer("add", {"x": floats()})
    assert [r.state for r in (uploading, queued, waiting)] == [RS.ADMITTED, RS.QUEUED, RS.WAITING]
    w.handle.error = "cannot load model 'add': no such file"
    fe.kill(w, "exit 3 (model failed to load)", state=FAILED)
    for req in (uploading, queued, waiting):
        failure = door.failure(req)
        assert failure.code is ErrorCode.MODEL_UNAVAILABLE and "no such file" in failure.message
    assert held(fe) == (0, 0) and not parked(fe, "add")
    with pytest.raises(ShmserveError) as info:
        door.infer("add", {"x": floats()})
    assert info.value.code is ErrorCode.MODEL_UNAVAILABLE


def test_requests_waiting_for_a_worker_are_answered_shutting_down_or_freed_when_dropped(fe):
    """At shutdown every parked request is answered SHUTTING_DOWN; a parked request whose door
    goes is freed, whatever it holds."""
    door, other, w = fe.door(receive_now=False), fe.door(receive_now=False), fe.workers[0]
    reqs = {}
    for d in (door, other):
        uploading = d.infer("add", {"x": floats()})
        queued = d.infer("add", {"x": floats()})
        d.receive(queued)
        reqs[d] = [uploading, queued]
    fe.kill(w)
    for d in (door, other):
        d.receive(reqs[d][0])
        reqs[d].append(d.infer("add", {"x": floats()}))
    assert sum(map(len, fe.dispatcher.parked.values())) == 6 and held(fe) == (4, 4 * 4096)
    other.close()
    assert held(fe) == (2, 2 * 4096) and all(r.state is RS.DONE for r in reqs[other]) and not other.answers
    fe.dispatcher.stop_admitting()
    assert [door.failure(r).code for r in reqs[door]] == [ErrorCode.SHUTTING_DOWN] * 3
    assert held(fe) == (0, 0) and not parked(fe, "add")


def test_a_timed_out_request_of_a_dead_worker_is_freed(fe):
    """ABANDONED (timed out while running) and then its worker dies: freed, not answered again."""
    door, w = fe.door(), fe.workers[0]
    req = door.infer("add", {"x": floats()}, timeout_s=1)
    w.claim()
    fe.clock.advance(1)
    assert req.state is RS.ABANDONED
    fe.kill(w)
    assert req.state is RS.DONE and held(fe) == (0, 0) and door.calls_of(req) == ["admitted", "answer"]


def test_requests_go_to_the_ready_worker_with_the_fewest_in_flight(make):
    """Ties go to the first worker; a worker that is not ready gets nothing; a worker back after
    a death takes its share again."""
    fe = make(models=(ADD2,))
    door = fe.door()
    w0, w1 = fe.workers
    reqs = [door.infer("add", {"x": floats()}) for _ in range(3)]
    assert [r.worker for r in reqs] == [w0.handle, w1.handle, w0.handle]
    w1.step()
    assert fe.deliver()
    assert door.infer("add", {"x": floats()}).worker is w1.handle  # w0: 2 in flight, w1: 0
    door.write_all()
    fe.kill(w0)  # what it had not claimed goes to the other worker
    assert [r.worker for r in (reqs[0], reqs[2])] == [w1.handle] * 2 and not door.answers.keys() & {reqs[0], reqs[2]}
    w1.step()
    assert fe.deliver()
    door.write_all()
    assert door.infer("add", {"x": floats()}).worker is w1.handle
    fe.restart(w0)
    assert door.infer("add", {"x": floats()}).worker is w0.handle
    fe.settle()


def test_queue_depths_count_waiting_and_unclaimed_requests_as_queued(make):
    """Per model: (waiting for space or not claimed yet, handed to a worker and unfinished)."""
    fe = make(models=(ADD, PAIR))
    door = fe.door()
    adds = [door.infer("add", {"x": floats()}) for _ in range(3)]
    door.infer("pair", {"a": np.zeros((2, 1), np.int32), "b": np.zeros((2, 1), np.int32)})
    door.infer("add", {"x": floats()})
    assert fe.dispatcher.queue_depths() == {"add:1": (4, 3), "pair:1": (1, 1)}
    jobs = fe.workers[0].claim()
    assert fe.dispatcher.queue_depths() == {"add:1": (1, 3), "pair:1": (1, 1)}
    for job in jobs:
        fe.workers[0].complete(job)
    fe.settle()
    assert all(door.results[r]["y"].shape == (16,) for r in adds)
    assert fe.dispatcher.queue_depths() == {"add:1": (0, 0), "pair:1": (0, 0)}


# -- lost connections -------------------------------------------------------------------------

def _drop_waiting(fe, door, jobs):
    fill_slots(fe, fe.door())
    req = door.infer("add", {"x": floats()})
    assert req.state is RS.WAITING
    return req


def _drop_admitted(fe, door, jobs):
    return door.infer("add", {"x": floats()})


def _drop_queued(fe, door, jobs):
    req = door.infer("add", {"x": floats()})
    door.receive(req)
    return req


def _drop_running(fe, door, jobs):
    req = _drop_queued(fe, door, jobs)
    jobs += fe.workers[0].claim()
    return req


def _drop_flushing(fe, door, jobs):
    req = _drop_queued(fe, door, jobs)
    fe.workers[0].step()
    assert fe.deliver()
    return req


DROPS = {
    # the state it is dropped in: (how to get it there, its state after the drop, slots held then)
    "waiting": (_drop_waiting, RS.DONE, 4),
    "admitted mid-upload": (_drop_admitted, RS.DONE, 0),
    "queued, not claimed": (_drop_queued, RS.DONE, 0),  # taken back from the worker's queue
    "running": (_drop_running, RS.ABANDONED, 1),
    "flushing": (_drop_flushing, RS.DONE, 0),
}


@pytest.mark.parametrize("case", list(DROPS))
def test_a_dropped_request_is_freed_and_never_answered(fe, case):
    """Its door gone, a request is freed now if no worker can touch its slot, else when its
    worker finishes (the late completion is absorbed); it gets no answer after the drop."""
    make_it, after, slots = DROPS[case]
    door, jobs = fe.door(receive_now=False), []
    req = make_it(fe, door, jobs)
    calls = door.calls_of(req)
    door.drop(req)
    assert req.state is after and held(fe)[0] == slots
    fe.settle()
    for job in jobs:
        fe.workers[0].complete(job)
    fe.settle()
    assert req.state is RS.DONE and door.calls_of(req) == calls


def test_a_lost_connection_drops_all_its_requests_and_leaves_others_alone(make):
    """Requests of one door in every state, dropped together; another door's requests go on."""
    fe = make(slot_count=6, max_waiting=4)
    door, bystander, w = fe.door(receive_now=False), fe.door(), fe.workers[0]
    mine = [door.infer("add", {"x": floats()}) for _ in range(4)]
    for req in mine[1:]:
        door.receive(req)
    jobs = w.claim()
    w.complete(jobs[0])
    assert fe.deliver()
    theirs = [bystander.infer("add", {"x": floats(start=7)}) for _ in range(3)]
    assert [r.state for r in mine] == [RS.ADMITTED, RS.FLUSHING, RS.QUEUED, RS.QUEUED]
    assert [r.state for r in theirs] == [RS.QUEUED, RS.QUEUED, RS.WAITING]
    door.close()
    assert theirs[2].state is RS.QUEUED  # space freed by the lost connection
    assert [r.state for r in mine] == [RS.DONE, RS.DONE, RS.ABANDONED, RS.ABANDONED]
    for job in jobs[1:]:
        w.complete(job)
    fe.settle()
    assert all(r.state is RS.DONE for r in mine) and len(door.answers) == 1
    for req in theirs:
        np.testing.assert_array_equal(bystander.results[req]["y"], floats(start=7) + 1)


# -- cancellation (issue 29): a caller that gives up frees the work it asked for --------------

DROP_STAGES = {"waiting": "queued", "admitted mid-upload": "queued", "queued, not claimed": "queued",
               "running": "running", "flushing": "answered"}


def cancelled(fe) -> dict:
    return {stage: n for (model, version, stage), n in fe.dispatcher.cancelled.items() if n}


@pytest.mark.parametrize("case", list(DROPS))
def test_a_dropped_request_is_counted_as_cancelled_where_it_was(fe, case):
    """A lost connection is a caller that gave up: each request it drops is counted once, by where
    it was; the worker never claims one taken back before it did."""
    make_it, _, _ = DROPS[case]
    door, jobs = fe.door(receive_now=False), []
    req = make_it(fe, door, jobs)
    door.drop(req)
    assert cancelled(fe) == {DROP_STAGES[case]: 1}
    assert all(k[:2] == ("add", 1) for k in fe.dispatcher.cancelled)
    skipped = list(fe.workers[0].skipped)
    fe.settle()
    for job in jobs:
        fe.workers[0].complete(job)
    fe.settle()
    assert req.state is RS.DONE and held(fe)[0] == 0
    if case == "queued, not claimed":  # its entry was still on the ring: the worker's claim failed
        assert fe.workers[0].skipped == skipped + [(req.slot if req.slot is not None else
                                                    fe.workers[0].skipped[-1][0], req.generation)]
    assert cancelled(fe) == {DROP_STAGES[case]: 1}  # (counted once: the late completion is not a second)


def _cancel_queued(fe, door, jobs):
    return _drop_queued(fe, door, jobs)


def _cancel_parked(fe, door, jobs):
    fe.kill(fe.workers[0])
    req = door.infer("add", {"x": floats()})
    assert req in parked(fe, "add")
    return req


CANCELS = {
    # where it is: (how to get it there, its state right after the cancel, the stage counted)
    "waiting for space": (_drop_waiting, RS.DONE, "queued"),
    "parked for a worker": (_cancel_parked, RS.DONE, "queued"),
    "queued, not claimed": (_cancel_queued, RS.DONE, "queued"),
    "running": (_drop_running, RS.ABANDONED, "running"),
    "flushing": (_drop_flushing, RS.FLUSHING, "answered"),
}


@pytest.mark.parametrize("case", list(CANCELS))
def test_a_cancelled_request_is_answered_cancelled_at_once_and_counted(fe, case):
    """A CANCEL (the door stays): a request no worker claimed is answered CANCELLED and freed now
    (a worker's claim of its entry fails: it never runs); one a worker runs is answered CANCELLED
    at once, its slot freed when the worker finishes and its outputs never read; one whose
    answer is ready keeps it.  Each is counted once, by where it was."""
    make_it, after, stage = CANCELS[case]
    door, jobs = fe.door(receive_now=False), []
    req = make_it(fe, door, jobs)
    bytes_out = fe.arena.stat("bytes_out")
    fe.dispatcher.cancel(req)
    assert req.state is after
    if stage == "answered":
        assert isinstance(door.answer_of(req), Outputs)  # the answer stands
    else:
        assert door.failure(req).code is ErrorCode.CANCELLED
    assert cancelled(fe) == {stage: 1}
    fe.dispatcher.cancel(req)  # a second CANCEL of the same request changes nothing
    if case == "parked for a worker":
        fe.restart(fe.workers[0])
    fe.settle()
    for job in jobs:
        fe.workers[0].complete(job)
    fe.settle()
    door.write_all()
    assert req.state is RS.DONE and held(fe) == (0, 0)
    if stage == "running":
        assert fe.arena.stat("bytes_out") == bytes_out  # its result was discarded, never copied
    assert cancelled(fe) == {stage: 1 + (stage == "answered")}  # (flushing: each CANCEL is counted)
    assert fe.dispatcher.outcomes[("add", 1, "cancelled")] == (stage != "answered")


def test_a_request_cancelled_before_claim_is_never_run_and_its_neighbours_are(make):
    """Of eight queued requests, the odd ones cancelled before any worker looked: the worker runs
    exactly the even ones (its claims of the others fail), and only those are answered with outputs."""
    fe = make(slot_count=12)
    door, w = fe.door(), fe.workers[0]
    reqs = [door.infer("add", {"x": floats(start=i)}) for i in range(8)]
    for req in reqs[1::2]:
        fe.dispatcher.cancel(req)
    ran = w.claim()
    assert len(ran) == 4 and len(w.skipped) == 4
    for job in ran:
        w.complete(job)
    fe.settle()
    door.write_all()
    assert [isinstance(door.answer_of(r), Outputs) for r in reqs] == [True, False] * 4
    assert cancelled(fe) == {"queued": 4} and held(fe) == (0, 0)


def test_what_the_server_ends_itself_is_not_counted_as_cancelled(fe):
    """A request that timed out, then had its connection dropped, was not given up by its caller
    a second time; nor is a request of a door that raised (the server's fault)."""
    door = fe.door()
    late = door.infer("add", {"x": floats()}, timeout_s=1)
    fe.clock.advance(1)
    assert door.failure(late).code is ErrorCode.TIMEOUT
    door.drop(late)
    other = fe.door()
    req = other.infer("add", {"x": floats()})
    other.dropped.add(req)  # (as ``FakeDoor.drop``, with the server's reason)
    fe.dispatcher.drop(req, cancelled=False)
    fe.settle()
    assert cancelled(fe) == {} and held(fe) == (0, 0)


# -- a door that raises ---------------------------------------------------------------------


class DoorBug(Exception):
    """What a faulty door raises (a bug in it, or a fault beneath it such as ENOSPC)."""


class FaultyDoor(FakeDoor):
    """A door whose ``where`` method raises once, on its ``nth`` call, before doing anything (so
    the door never learns what the dispatcher told it)."""

    def __init__(self, dispatcher, where: str, nth: int = 1, **kw):
        super().__init__(dispatcher, **kw)
        self.where, self.left = where, nth

    def _maybe_raise(self, what: str, req) -> None:
        if what == self.where:
            self.left -= 1
            if self.left == 0:
                raise DoorBug(f"injected in {what} of request {req.id}")

    def waiting(self, req) -> None:
        self._maybe_raise("waiting", req)
        super().waiting(req)

    def admitted(self, req, sinks) -> None:
        self._maybe_raise("admitted", req)
        super().admitted(req, sinks)

    def answer(self, req, answer) -> None:
        self._maybe_raise("answer", req)
        super().answer(req, answer)


def faulty_door(fe, where: str, nth: int = 1, **kw) -> FaultyDoor:
    door = FaultyDoor(fe.dispatcher, where, nth, **kw)
    fe.doors.append(door)
    return door


def _raise_waiting(fe, door, jobs):
    fill_slots(fe, fe.door())
    return door.infer("add", {"x": floats()})


def _raise_admitted_inline(fe, door, jobs):
    return door.infer("add", {"x": floats()})


def _raise_admitted_zero_copy(fe, door, jobs):
    region, buf = open_region(fe, door)
    buf.close()
    jobs.append(lambda: fe.regions.close(door, region.id))
    return door.infer_region(fe.regions, region.id, "add", {"x": (0, "float32", (16,))}, 4096, 4096)


def _raise_answer_outputs(fe, door, jobs):
    req = door.infer("add", {"x": floats()})
    fe.workers[0].step()
    assert fe.deliver()
    return req


def _raise_answer_failure(fe, door, jobs):
    req = door.infer("add", {"x": floats()})
    [job] = fe.workers[0].claim()
    fe.workers[0].fail(job, ErrorCode.MODEL_ERROR, "the backend raised")
    assert fe.deliver()
    return req


def _raise_answer_while_running(fe, door, jobs):
    req = door.infer("add", {"x": floats()}, timeout_s=1)
    claimed = fe.workers[0].claim()
    jobs.append(lambda: [fe.workers[0].complete(job) for job in claimed])
    fe.clock.advance(1)  # answered TIMEOUT while its worker runs it (ABANDON)
    return req


RAISES = {
    # the door method that raises: (how to get there, its state once the door raised, slots held then)
    "waiting": ("waiting", _raise_waiting, RS.DONE, 4),
    "admitted, receiving its payload": ("admitted", _raise_admitted_inline, RS.DONE, 0),
    "admitted, zero-copy (published)": ("admitted", _raise_admitted_zero_copy, RS.DONE, 0),
    "answer with views of the arena": ("answer", _raise_answer_outputs, RS.DONE, 0),
    "answer with a worker's error": ("answer", _raise_answer_failure, RS.DONE, 0),
    "answer while its worker runs it": ("answer", _raise_answer_while_running, RS.ABANDONED, 1),
}


@pytest.mark.parametrize("case", list(RAISES))
def test_a_door_that_raises_is_aborted_and_its_request_gives_up_what_it_holds(fe, case):
    """Whatever the door's method and the request's state: the exception stays in the dispatcher,
    the door is told to end its connection (``abort``, with that exception), and the request
    holds nothing more (a slot a worker still runs, until the worker finishes).  The dispatcher
    then serves on: a second door is answered, and so is the first one's next request."""
    where, make_it, after, slots = RAISES[case]
    door, jobs = faulty_door(fe, where), []
    req = make_it(fe, door, jobs)
    assert [type(e) for e in door.aborts] == [DoorBug] and fe.dispatcher.door_faults == 1
    assert req.state is after and held(fe)[0] == slots and req not in fe.dispatcher.waiting
    door.close()  # the connection's end, noticed later (as a transport's is)
    for finish in jobs:
        finish()
    fe.settle()
    assert req.state is RS.DONE
    other = fe.door()
    reqs = [other.infer("add", {"x": floats(start=i)}) for i in range(3)]
    fe.settle()
    for i, r in enumerate(reqs):
        np.testing.assert_array_equal(other.results[r]["y"], floats(start=i) + 1)


def test_an_abort_that_drops_the_doors_requests_at_once_is_taken_too(fe):
    """A door whose ``abort`` drops its requests there and then (the v2 door does): the request
    the raise was about is dropped once, its space freed once."""
    door = faulty_door(fe, "answer")
    door.abort = lambda exc: (door.aborts.append(exc), door.close())
    req = door.infer("add", {"x": floats()})
    fe.workers[0].step()
    assert fe.deliver()
    assert req.state is RS.DONE and req in door.dropped and held(fe) == (0, 0)
    fe.settle()


@pytest.mark.parametrize("spin", [False, True], ids=["eventfd", "polling"])
def test_a_door_raising_in_a_drain_costs_nobody_else_their_answer(make, spin):
    """Four completions collected in one drain, the second one's door raising: the three others
    are answered in that same drain, and the completion doorbells are armed again (the next
    completion wakes the loop; with polling, polling starts again)."""
    fe = make(spin_s=0.001 if spin else 0.0)
    doors = [fe.door(), faulty_door(fe, "answer"), fe.door(), fe.door()]
    reqs = [d.infer("add", {"x": floats(start=10 * i)}) for i, d in enumerate(doors)]
    assert fe.workers[0].step()
    if spin:
        fe.clock.run_soon(limit=1)
    else:
        assert fe.deliver()
    for i in (0, 2, 3):
        np.testing.assert_array_equal(doors[i].result(reqs[i])["y"], floats(start=10 * i) + 1)
    assert reqs[1].state is RS.DONE and doors[1].aborts and held(fe) == (0, 0)
    doors[1].close()
    fe.clock.run_soon()
    fe.deliver()  # whatever wake-up is left over
    again = doors[0].infer("add", {"x": floats()})
    fe.workers[0].step()
    if spin:
        fe.clock.run_soon(limit=1)
    else:
        assert fe.deliver(), "the completion doorbell was not armed again"
    assert isinstance(doors[0].answer_of(again), Outputs)
    fe.settle()


def test_a_completion_whose_collection_raises_is_answered_internal_and_the_drain_goes_on(fe):
    """Not a door: the canary's ``observe`` hook raises for one request.  That request is answered
    INTERNAL and freed; the others collected in the same drain get their results."""
    door = fe.door()
    reqs = [door.infer("add", {"x": floats(start=i)}) for i in range(3)]
    seen = []

    def observe(req, ok):
        seen.append(req)
        if req is reqs[1]:
            raise DoorBug("injected in observe")

    fe.dispatcher.observe = observe
    fe.workers[0].step()
    assert fe.deliver()
    assert seen == reqs
    failure = door.failure(reqs[1])
    assert failure.code is ErrorCode.INTERNAL and "DoorBug" in failure.message
    for i in (0, 2):
        np.testing.assert_array_equal(door.result(reqs[i])["y"], floats(start=i) + 1)
    fe.settle()


# -- shutdown ---------------------------------------------------------------------------------

def test_stop_admitting_answers_the_waiting_and_refuses_the_new(fe):
    """Waiting requests are answered SHUTTING_DOWN; new ones refused; those in flight finish,
    and the slots they free admit nobody."""
    door = fe.door()
    running = fill_slots(fe, door)
    waiting = [door.infer("add", {"x": floats()}) for _ in range(2)]
    fe.dispatcher.stop_admitting()
    assert [door.failure(r).code for r in waiting] == [ErrorCode.SHUTTING_DOWN] * 2
    with pytest.raises(ShmserveError) as info:
        door.infer("add", {"x": floats()})
    assert info.value.code is ErrorCode.SHUTTING_DOWN
    assert fe.dispatcher.in_flight == 4
    fe.settle()
    assert all(isinstance(door.answer_of(r), Outputs) for r in running) and fe.dispatcher.in_flight == 0


def test_a_request_still_uploading_at_shutdown_is_answered_shutting_down(fe):
    """Admitted before the stop, received after it: never published."""
    door, w = fe.door(receive_now=False), fe.workers[0]
    req = door.infer("add", {"x": floats()})
    fe.dispatcher.stop_admitting()
    door.receive(req)
    assert door.failure(req).code is ErrorCode.SHUTTING_DOWN and held(fe) == (0, 0)
    assert w.claim() == []


def test_fail_in_flight_answers_now_and_frees_as_the_workers_stop(fe):
    """After the drain timeout: queued and running requests are answered SHUTTING_DOWN at once;
    their slots stay held until their worker has stopped, then are freed; no second answer."""
    door, w = fe.door(), fe.workers[0]
    running = door.infer("add", {"x": floats()})
    w.claim()
    queued = door.infer("add", {"x": floats()})
    fe.dispatcher.stop_admitting()
    fe.dispatcher.fail_in_flight()
    for req in (running, queued):
        assert door.failure(req).code is ErrorCode.SHUTTING_DOWN and req.state is RS.ABANDONED
    assert held(fe) == (2, 2 * 4096) and fe.dispatcher.in_flight == 2
    fe.kill(w, "exit 0 (stopped)", state=STOPPED)
    assert held(fe) == (0, 0) and fe.dispatcher.in_flight == 0
    assert all(door.calls_of(r) == ["admitted", "answer"] for r in (running, queued))


# -- completion polling -----------------------------------------------------------------------

def test_completions_are_polled_from_the_loop_while_requests_are_in_flight(make):
    """With spin_s > 0 a publication starts polling the completion rings through call_soon: a
    completion is collected without an eventfd wake-up; polling stops spin_s after the last
    completion (or once nothing is in flight) and the eventfd takes over again."""
    fe = make(spin_s=0.001)
    door, w = fe.door(), fe.workers[0]
    req = door.infer("add", {"x": floats()})
    assert fe.clock.soon_pending == 1
    assert fe.clock.run_soon(limit=5) == 5 and fe.clock.soon_pending == 1  # nothing yet: still polling
    w.step()
    fe.clock.run_soon(limit=1)
    assert isinstance(door.answer_of(req), Outputs)
    door.write(req)
    fe.clock.run_soon(limit=5)
    assert fe.clock.soon_pending == 0  # nothing in flight: back to the eventfd
    fe.deliver()  # the wake-up the first completion left behind
    second = door.infer("add", {"x": floats()})
    fe.clock.advance(0.002)
    fe.clock.run_soon(limit=5)
    assert fe.clock.soon_pending == 0  # spin_s passed with no completion: back to the eventfd
    w.step()
    assert fe.clock.soon_pending == 0 and second.state is RS.QUEUED
    assert fe.deliver()
    assert isinstance(door.answer_of(second), Outputs)
    door.write_all()


def test_without_spin_nothing_is_polled(fe):
    """With spin_s = 0 nothing is scheduled on the loop: completions come only through the eventfd."""
    door = fe.door()
    door.infer("add", {"x": floats()})
    assert fe.clock.soon_pending == 0
    fe.settle()


# -- lanes ------------------------------------------------------------------------------------

def test_a_lane_goes_to_the_ready_worker_with_the_fewest_lanes(make):
    """Each new lane: its descriptor passed to the least-loaded ready worker, an attach command on
    its ring, the lane header and the arena's record naming it; closing one sends that worker a
    drop and removes the region and its record."""
    fe = make(models=(ADD2,))
    w0, w1 = fe.workers
    owner = object()
    clients = [LaneClient(fe.regions, owner, "add") for _ in range(3)]
    try:
        ids = [c.region.id for c in clients]
        assert [c.header().worker for c in clients] == [0, 1, 0]
        assert [c.header().model_id for c in clients] == [0, 0, 0]
        assert w0.read_commands() == [(layout.CMD_ATTACH_LANE, ids[0]), (layout.CMD_ATTACH_LANE, ids[2])]
        assert w1.read_commands() == [(layout.CMD_ATTACH_LANE, ids[1])]
        assert (fe.regions.lanes_of(w0.handle), fe.regions.lanes_of(w1.handle)) == (2, 1)
        size = clients[0].region.size
        assert recorded(fe) == {ids[0]: ("lane", size, 0), ids[1]: ("lane", size, 1), ids[2]: ("lane", size, 0)}
        assert set(w0.maps) == {ids[0], ids[2]}  # the worker mapped what it was given
        fe.regions.close(owner, ids[0])
        assert w0.read_commands()[-1] == (layout.CMD_DROP_REGION, ids[0]) and ids[0] not in w0.maps
        assert clients[0].region.closed and ids[0] not in recorded(fe)
        assert fe.regions.lane_count == 2
        fourth = LaneClient(fe.regions, owner, "add")  # a tie again: the first worker
        clients.append(fourth)
        assert fourth.header().worker == 0
    finally:
        for c in clients:
            c.close()
        fe.regions.drop_owner(owner)
    assert fe.regions.lane_count == 0 and all(c.region.closed for c in clients)
    assert len(recorded(fe)) == 3  # closed, but released only once their workers have dropped them
    for w in fe.workers:
        w.read_commands()
    assert not recorded(fe) and not fe.regions.closing and not fe.regions.bytes_of_uid


def test_lane_calls_run_on_the_worker_it_is_attached_to(fe):
    """A call published by ``ClientLane`` is claimed and finished by the lane's worker through the
    lane's own rings; the client reads the result from its region."""
    w = fe.workers[0]
    lane = LaneClient(fe.regions, object(), "add")
    try:
        index, generation = lane.submit(floats(8))
        [job] = w.step()
        assert job.lane == lane.region.id
        assert lane.lane.finished(index, generation)
        np.testing.assert_array_equal(lane.read(index, generation)[0], floats(8) + 1)
        assert not fe.deliver()  # the front-end is not on a lane's data path
    finally:
        lane.close()
        fe.regions.close_all()


def test_a_lane_its_worker_cannot_serve_fails_its_calls_and_has_no_worker(fe):
    """Review L3: a worker told to attach a lane it cannot map or page-lock says so; the front-end
    fails the calls queued in it (INTERNAL, saying why) and takes the worker off its header, where
    it was silently left attached, its client's calls timing out."""
    w = fe.workers[0]
    lane = LaneClient(fe.regions, object(), "add")
    try:
        index, generation = lane.submit(floats(4))
        fe.regions.lane_failed(w.handle, lane.region.id, "cannot page-lock region 1: memlock")
        assert lane.lane.finished(index, generation)
        with pytest.raises(ShmserveError) as info:
            lane.read(index, generation)
        assert info.value.code is ErrorCode.INTERNAL and "memlock" in info.value.message
        assert lane.header().worker == layout.NO_WORKER and fe.regions.lanes_of(w.handle) == 0
        assert recorded(fe)[lane.region.id][2] == layout.NO_WORKER
        fe.regions.lane_failed(w.handle, 999, "no such lane")  # ignored
    finally:
        lane.close()
        fe.regions.close_all()


def test_a_lane_waits_for_a_ready_worker_and_attaches_when_one_is_ready(fe):
    """No ready worker: the lane is created unattached (header: no worker) and calls queue in it;
    once a worker reports ready it is attached and runs them."""
    w = fe.workers[0]
    w.handle.set_state(RESTARTING)
    lane = LaneClient(fe.regions, object(), "add")
    try:
        assert lane.header().worker == layout.NO_WORKER and w.read_commands() == []
        index, generation = lane.submit(floats(4))
        fe.restart(w)
        assert w.read_commands() == [(layout.CMD_ATTACH_LANE, lane.region.id)] and lane.header().worker == 0
        w.step()
        np.testing.assert_array_equal(lane.read(index, generation)[0], floats(4) + 1)
    finally:
        lane.close()
        fe.regions.close_all()


def test_a_dead_workers_lane_calls_fail_and_the_lane_moves_to_another_worker(make):
    """Worker death: the lane's running (RUNNING) call is failed WORKER_CRASHED, which the client
    reads back; the lane is attached to the other worker, which serves the call still queued
    (READY: the dead worker had taken its entry off the ring) and new calls."""
    fe = make(models=(ADD2,))
    w0, w1 = fe.workers
    lane = LaneClient(fe.regions, object(), "add", size=16384)
    try:
        assert lane.header().worker == 0
        running = lane.submit(floats(4), request_id=1)
        assert len(w0.claim()) == 1
        queued = lane.submit(floats(4), request_id=2)
        w0.read_commands()  # the dead worker took the queued call's entry off the ring, unclaimed
        fe.kill(w0)
        with pytest.raises(ShmserveError) as info:
            lane.read(*running)
        assert info.value.code is ErrorCode.WORKER_CRASHED
        assert info.value.message == "worker 0 for model 'add' killed by SIGKILL while running this request"
        assert not lane.lane.finished(*queued)  # still queued, for the next worker
        assert lane.header().worker == 1
        assert w1.read_commands() == [(layout.CMD_ATTACH_LANE, lane.region.id)]
        [job] = w1.step()
        assert (job.index, job.generation) == queued and not w1.skipped
        np.testing.assert_array_equal(lane.read(*queued)[0], floats(4) + 1)
        fresh = lane.submit(floats(4, start=5), request_id=3)  # (the fake client reuses the input's place)
        [job] = w1.step()
        assert (job.index, job.generation) == fresh
        np.testing.assert_array_equal(lane.read(*fresh)[0], floats(4, start=5) + 1)
    finally:
        lane.close()
        fe.regions.close_all()


def test_lane_clients_are_told_to_spin_only_while_lanes_are_few(fe):
    """Every lane header carries the spin hint: spin while there are at most half as many lanes as
    CPUs (2 here), not at all beyond that, and again once lanes are closed."""
    spin = spin_default_us(client=True)
    first = LaneClient(fe.regions, "a", "add")
    second = None
    try:
        assert spin > 0 and first.header().spin_us == spin
        second = LaneClient(fe.regions, "b", "add")
        assert first.header().spin_us == second.header().spin_us == 0
        fe.regions.close("b", second.region.id)
        assert first.header().spin_us == spin
    finally:
        for lane in (first, second):
            if lane is not None:
                lane.close()
        fe.regions.close_all()


def test_a_lane_whose_only_worker_died_says_it_has_no_worker(fe):
    """A lane left without a worker (its only worker died) says so in its header: NO_WORKER."""
    lane = LaneClient(fe.regions, object(), "add")
    try:
        assert lane.header().worker == 0
        fe.kill(fe.workers[0])
        assert lane.header().worker == layout.NO_WORKER
    finally:
        lane.close()
        fe.regions.close_all()


def test_a_lane_whose_client_scribbled_its_completion_ring_still_fails_cleanly(fe):
    """The client set its lane's completion-ring indices to 2**64 - 1: when the lane's worker dies,
    the front-end fails the call in flight and moves on without an exception (which would skip
    the worker's restart)."""
    lane = LaneClient(fe.regions, object(), "add")
    try:
        index, generation = lane.submit(np.ones(16, np.float32))
        assert len(fe.workers[0].claim()) == 1  # in flight when its worker dies
        for field in (layout.RING_TAIL, layout.RING_HEAD):
            atomics.store64(lane.buf, layout.LANE.completion_off + field, 2**64 - 1)
        fe.kill(fe.workers[0])
        assert lane.lane.finished(index, generation)
        with pytest.raises(ShmserveError) as info:
            lane.read(index, generation)
        assert info.value.code is ErrorCode.WORKER_CRASHED
    finally:
        lane.close()
        fe.regions.close_all()


def test_a_slot_entry_is_not_lost_when_a_command_shares_the_ring(fe):
    """With a lane command pending on a worker's ring and every slot queued to that worker, every
    request still reaches the worker and is answered."""
    w = fe.workers[0]
    lane = LaneClient(fe.regions, object(), "add")  # its attach command waits on the ring
    try:
        door = fe.door()
        reqs = fill_slots(fe, door)
        for _ in range(3):
            w.step()
            fe.deliver()
        assert all(r.answered for r in reqs), [r.state.name for r in reqs]
        fe.settle()
    finally:
        lane.close()
        fe.regions.close_all()


def test_region_table_limits_and_ownership(make, monkeypatch):
    """Sizes, unknown lane models, the per-connection count and byte limits, the per-uid byte
    limit, the server-wide count (the arena's region table), the per-model lane limit, and that a
    region is reachable and closable only by its owner; every refusal names its config key and
    leaves nothing behind: no record, no descriptor."""
    fe = make(slot_count=8)  # room on the worker's ring for two attach and two drop commands
    regions = fe.regions
    fds_before = len(os.listdir("/proc/self/fd"))
    limit = fe.dispatcher.limits.max_request_bytes + REGION_SLACK
    for size, code in ((0, ErrorCode.BAD_FRAME), (-1, ErrorCode.BAD_FRAME), ("8", ErrorCode.BAD_FRAME),
                       (limit + 1, ErrorCode.TOO_LARGE)):
        with pytest.raises(ShmserveError) as info:
            regions.open("a", size)
        assert info.value.code is code
    with pytest.raises(ShmserveError) as info:
        regions.open("a", 4096, "nope")
    assert info.value.code is ErrorCode.UNKNOWN_MODEL

    def refused(owner, size, key, uid=-1):
        with pytest.raises(ShmserveError) as info:
            regions.open(owner, size, uid=uid)
        assert info.value.code is ErrorCode.OVERLOADED and f"(server.{key})" in info.value.message, info.value.message

    per_connection = RegionLimits().max_regions_per_connection
    for _ in range(per_connection):
        regions.open("a", 4096)
    refused("a", 4096, "max_regions_per_connection")
    region = regions.open("b", limit)
    assert regions.get("b", region.id) is region and regions.get("a", region.id) is None
    assert regions.get("b", str(region.id)) is None
    with pytest.raises(ShmserveError) as info:
        regions.close("a", region.id)
    assert info.value.code is ErrorCode.BAD_REGION
    regions.limits = RegionLimits(max_region_bytes_per_connection=3 * 4096, max_region_bytes_per_uid=5 * 4096)
    regions.open("d", 2 * 4096, uid=7)
    refused("d", 2 * 4096, "max_region_bytes_per_connection", uid=7)
    regions.open("e", 2 * 4096, uid=7)
    refused("f", 2 * 4096, "max_region_bytes_per_uid", uid=7)
    regions.open("f", 4096, uid=8)  # another uid has its own budget
    regions.drop_owner("d")
    regions.open("f", 2 * 4096, uid=7)  # what a closed connection held counts no more
    refused("g7", 2 * 4096, "max_region_bytes_per_uid", uid=7)  # uid 7 holds 4 of its 5 pages
    bell = new_eventfd()
    regions.open("door", 4 * 4096, uid=7, bell=bell)  # a door process's: the server's own, in no uid's budget
    refused("g7", 2 * 4096, "max_region_bytes_per_uid", uid=7)
    regions.open("g7", 4096, uid=7)
    for owner in ("door", "g7"):
        regions.drop_owner(owner)
    os.close(bell)
    regions.limits = RegionLimits(max_regions_per_uid=2)
    regions.open("u1", 4096, uid=9)
    regions.open("u2", 4096, uid=9)
    refused("u3", 4096, "max_regions_per_uid", uid=9)
    for owner in ("u1", "u2"):
        regions.drop_owner(owner)
    regions.limits = RegionLimits(max_regions_per_uid=1 << 16)
    table = fe.arena.geometry.max_regions
    held = len(regions.regions)
    for i in range(table - held):
        regions.open(("g", i // per_connection), 4096)
    refused("h", 4096, "max_regions")
    for i in range(table - held):
        regions.drop_owner(("g", i // per_connection))
    monkeypatch.setattr(workerlink, "MAX_LANES", 2)
    lanes = [LaneClient(regions, "c", "add") for _ in range(2)]
    with pytest.raises(ShmserveError) as info:
        regions.open("c", 4096, "add")
    assert info.value.code is ErrorCode.OVERLOADED
    for lane in lanes:
        lane.close()
    assert len(recorded(fe)) == per_connection + 6
    for owner in ("a", "b", "c", "e", "f"):
        regions.drop_owner(owner)
    for w in fe.workers:  # the lanes' worker drops them: then they are released
        w.read_commands()
    assert not regions.regions and not recorded(fe) and not regions.bytes_of_uid
    assert len(os.listdir("/proc/self/fd")) == fds_before


@pytest.mark.parametrize("inputs,out,ok", [
    ([(0, 64)], (4096, 4096), True),
    ([(8192 - 64, 64)], (0, 64), True),
    ([(32, 64)], (4096, 64), False),
    ([(8192 - 64, 128)], (0, 64), False),
    ([(0, 64)], (4096, 4097), False),
    ([(0, 64)], (100, 64), False),
    ([(0, 64), (64, 8192)], (0, 0), False),
])
def test_check_request_keeps_a_zero_copy_request_aligned_inside_its_region(inputs, out, ok):
    """Inputs and the output area must start aligned and end inside the region; anything else is
    BAD_REGION."""
    region = Region(1, -1, 8192, "owner", uid=0, record=0)
    metas = tuple(TensorMeta(f"t{i}", "uint8", (nbytes,), offset) for i, (offset, nbytes) in enumerate(inputs))
    if ok:
        check_request(region, metas, *out)
    else:
        with pytest.raises(ShmserveError) as info:
            check_request(region, metas, *out)
        assert info.value.code is ErrorCode.BAD_REGION


# -- everything at once ---------------------------------------------------------------------

OPS = {"submit": 6, "receive": 3, "claim": 3, "finish": 5, "deliver": 3, "advance": 1, "poll": 1, "write": 3,
       "drop": 1, "kill": 0.3, "restart": 2}  # op -> weight
SEEDS = [1, 2, 3, int(os.environ.get("SHMSERVE_SEED", random.randrange(2**32)))]


@pytest.mark.parametrize("seed", SEEDS, ids=["seed1", "seed2", "seed3", "fresh"])
def test_random_operations_keep_every_invariant(make, seed):
    """A seeded random mix of what doors, workers, the clock and the supervisor do: after each
    step the dispatcher's bookkeeping agrees with the arena and with every request's state, no
    request is answered twice (the fake door checks), and at the end it all settles to nothing
    held.  Replay a seed with SHMSERVE_SEED=<seed> (the "fresh" case)."""
    print(f"dispatcher random walk seed={seed}")
    rng = random.Random(seed)
    # One worker or two: with one, every death leaves requests waiting for its restart.
    fe = make(models=(rng.choice([ADD, ADD2]),), slot_count=6, max_waiting=4, spin_s=rng.choice([0.0, 0.001]))
    doors = [fe.door(receive_now=False), fe.door(receive_now=True, write_now=True)]
    jobs = {w.index: [] for w in fe.workers}
    submitted = []
    ops, weights = zip(*OPS.items())
    for step in range(600):
        op = rng.choices(ops, weights)[0]
        live = [w for w in fe.workers if not w.dead]
        if op == "submit":
            door = rng.choice(doors)
            try:
                submitted.append(door.infer("add", {"x": floats(rng.choice([0, 16, 1000, 4000]))},
                                            timeout_s=rng.choice([None, 0.5, 2.0])))
            except ShmserveError as exc:
                assert exc.code in (ErrorCode.MODEL_UNAVAILABLE, ErrorCode.OVERLOADED), exc
        elif op == "receive":
            uploading = [(d, r) for d in doors for r in d.sinks]
            if uploading:
                door, req = rng.choice(uploading)
                door.receive(req)
        elif op == "claim" and live:
            w = rng.choice(live)
            jobs[w.index] += w.claim()
        elif op == "finish":
            claimed = [(i, j) for i, js in jobs.items() for j in js]
            if claimed:
                i, job = rng.choice(claimed)
                jobs[i].remove(job)
                w, push = fe.workers[i], rng.random() < 0.97
                if rng.random() < 0.15:
                    w.fail(job, ErrorCode.MODEL_ERROR, "boom", push=push)
                else:
                    w.complete(job, push=push)
                if not push:  # it died between publishing and pushing
                    jobs[i] = []
                    fe.kill(w)
        elif op == "deliver":
            fe.deliver()
        elif op == "advance":
            fe.clock.advance(rng.choice([0.1, 0.6, 2.5]))
        elif op == "poll":
            fe.clock.run_soon(limit=3)
        elif op == "write":
            door = rng.choice(doors)
            holding = [r for r in door.answers if door.holds_views(r)]
            if holding:
                door.write(rng.choice(holding))
        elif op == "drop":
            door = rng.choice(doors)
            unfinished = [r for r in door.requests if not door.finished(r)]
            if unfinished:
                door.drop(rng.choice(unfinished))
        elif op == "kill" and live:
            w = rng.choice(live)
            jobs[w.index] = []
            fe.kill(w)
        elif op == "restart":
            dead = [w for w in fe.workers if w.dead]
            if dead:
                fe.restart(rng.choice(dead))
        _check_bookkeeping(fe, doors, submitted, f"seed {seed} step {step} ({op})")
    for w in fe.workers:
        if w.dead:
            fe.restart(w)
        for job in jobs[w.index]:
            w.complete(job)
    for _ in range(10):
        fe.settle()
        fe.clock.advance(5)
    _check_bookkeeping(fe, doors, submitted, f"seed {seed} at the end")
    print("outcomes", dict(fe.dispatcher.outcomes), "submitted", len(submitted), "dropped",
          sum(len(d.dropped) for d in doors))
    assert not fe.problems(), (seed, fe.problems())


def _check_bookkeeping(fe, doors, submitted, where: str) -> None:
    """The dispatcher's books against the arena and every request's state."""
    d = fe.dispatcher
    holding = [r for r in submitted if r.state in HOLDING]
    assert held(fe) == (len(holding), sum(r.extent.size for r in holding if r.extent)), where
    assert len({r.slot for r in holding}) == len(holding), where
    assert set(d.pending.values()) == {r for r in submitted if r.state in (RS.QUEUED, RS.ABANDONED)}, where
    assert all(d.pending[r.slot] is r for r in d.pending.values()), where
    parked = [r for queue in d.parked.values() for r in queue]
    waiting = [*d.waiting, *(r for r in parked if r.state is RS.WAITING)]
    assert len(set(waiting)) == len(waiting), where
    assert set(waiting) == {r for r in submitted if r.state is RS.WAITING}, where
    assert all(r.state in (RS.WAITING, RS.ADMITTED, RS.QUEUED) for r in parked), where
    for version, queue in d.parked.items():  # nothing waits for a worker while one is ready
        assert not queue or version.pick_worker() is None, where
    for r in holding:
        state = slot_state(fe, r.slot)
        expected = {RS.ADMITTED: {SlotState.WRITING}, RS.FLUSHING: {SlotState.DONE}}.get(
            r.state, {SlotState.READY, SlotState.RUNNING, SlotState.DONE, SlotState.ERROR})
        assert state in expected, (where, r.id, r.state, state)
    for door in doors:
        for r in door.requests:
            if r not in door.dropped:
                assert (r in door.answers) == (r.state not in UNANSWERED), (where, r.id, r.state)


def test_a_lane_no_ready_worker_can_take_now_is_refused_and_holds_nothing(fe):
    """A ready worker whose control socket is full (busy: it takes descriptors only when it meets
    a region it lacks) cannot be given a lane: the open is refused 'overloaded' (the client then
    uses a region without a lane) rather than left unattached with nobody to retry it."""
    w = fe.workers[0]
    filler = os.memfd_create("filler")
    try:
        sent = 0
        while workerlink.send_region(w.handle.control, 1_000_000 + sent, 4096, filler):
            sent += 1
        assert sent > 10
        with pytest.raises(ShmserveError) as info:
            fe.regions.open("owner", 4096, "add")
        assert info.value.code is ErrorCode.OVERLOADED and "can take a new lane" in info.value.message
        assert not recorded(fe) and not fe.regions.regions and not fe.regions.closing
        region = fe.regions.open("owner", 4096)  # a plain region is still fine
        fe.regions.close("owner", region.id)
        assert not recorded(fe)
    finally:
        os.close(filler)


def test_lane_churn_on_a_busy_worker_cannot_crowd_requests_off_its_ring(make):
    """Review M3: each lane open and close puts a command on its worker's ring.  A client cycling
    lanes while the worker is busy (it reads nothing) is refused once region commands fill the half
    of the ring the slots never need; every slot's request still finds room there."""
    fe = make(slot_count=4)
    w = fe.workers[0]
    ring = w.handle.submissions
    refused = 0
    for _ in range(3 * ring.capacity):
        try:
            lane = LaneClient(fe.regions, "churn", "add")
        except ShmserveError as exc:
            assert exc.code is ErrorCode.OVERLOADED
            refused += 1
            continue
        lane.close()
        fe.regions.close("churn", lane.region.id)
    assert refused and len(ring) <= ring.capacity - fe.arena.geometry.slot_count + 1
    door = fe.door()
    reqs = [door.infer("add", {"x": floats(start=i)}) for i in range(4)]  # every slot
    assert all(r.state is RS.QUEUED for r in reqs), [door.calls_of(r) for r in reqs]
    fe.settle()
    for i, r in enumerate(reqs):
        np.testing.assert_array_equal(door.results[r]["y"], floats(start=i) + 1)
    w.read_commands()
    assert not recorded(fe) and not fe.regions.closing


# -- scheduling: what a slot carries, max_queue_size (issue 29) --------------------------------

def configure(fe, name: str = "add", **changes):
    """Change ``name``'s current version's config (``priority_levels``, ``max_queue_size``...)."""
    version = fe.models.get(name).current
    version.config = dataclasses.replace(version.config, **changes)
    return version


def sched_of(fe, req) -> tuple[layout.SlotSched, int]:
    """(priority, caller, deadline_ns) and flags, as ``req``'s slot holds them."""
    g = fe.arena.geometry
    return layout.decode_slot_sched(fe.arena.buf, g, req.slot), layout.decode_slot_request(fe.arena.buf, g,
                                                                                           req.slot).flags


def test_a_slot_carries_its_priority_its_caller_and_its_deadline_on_clock_monotonic(fe):
    """Each published slot holds the client's level (0, and one above the model's priority_levels,
    written as 0: the model's default, Triton's rule), its door's caller key, and its deadline
    converted from the dispatcher's clock (a fake one here) to CLOCK_MONOTONIC ns, flagged
    SLOT_FLAG_OWN_TIMEOUT only when the client set its own timeout."""
    configure(fe, priority_levels=3)
    door, other = fe.door(), fe.door()
    door.caller_key, other.caller_key = 7, 8
    before = time.monotonic_ns()
    high = door.infer("add", {"x": floats()}, priority=1, timeout_s=2)
    low = other.infer("add", {"x": floats()}, priority=3)
    default = door.infer("add", {"x": floats()})
    above = door.infer("add", {"x": floats()}, priority=4, timeout_s=0.5)
    after = time.monotonic_ns()
    cap = fe.dispatcher.limits.request_timeout_s
    expected = [(high, 1, 7, 2.0, layout.SLOT_FLAG_OWN_TIMEOUT), (low, 3, 8, cap, 0), (default, 0, 7, cap, 0),
                (above, 0, 7, 0.5, layout.SLOT_FLAG_OWN_TIMEOUT)]
    for req, level, caller, timeout, flags in expected:
        sched, slot_flags = sched_of(fe, req)
        assert (sched.priority, sched.caller, slot_flags) == (level, caller, flags)
        assert before + timeout * 1e9 <= sched.deadline_ns <= after + timeout * 1e9
    fe.settle()
    assert all(isinstance(door.answer_of(r) if r in door.answers else other.answer_of(r), Outputs)
               for r, *_ in expected)


def test_without_priority_levels_every_request_is_the_default_level(fe):
    """A model of one level (priority_levels 0): whatever a client asks, its slot says 0."""
    door = fe.door()
    req = door.infer("add", {"x": floats()}, priority=2)
    assert sched_of(fe, req)[0].priority == 0 and sched_of(fe, req)[0].caller == 0  # a door without a key
    fe.settle()


def test_a_request_republished_after_its_worker_died_keeps_its_priority_caller_and_deadline(fe):
    """Unclaimed on a dead worker's ring, it goes to the restarted one with the same level, caller
    and deadline: the deadline on CLOCK_MONOTONIC is the one set at submission, the time the
    restart took gone from it."""
    configure(fe, priority_levels=2)
    door, w = fe.door(), fe.workers[0]
    door.caller_key = 42
    before = time.monotonic_ns()
    req = door.infer("add", {"x": floats()}, priority=2, timeout_s=3)
    fe.kill(w)
    assert list(parked(fe, "add")) == [req]
    fe.clock.advance(1)
    fe.restart(w)
    after = time.monotonic_ns()
    sched, flags = sched_of(fe, req)
    assert (sched.priority, sched.caller, flags) == (2, 42, layout.SLOT_FLAG_OWN_TIMEOUT)
    assert before + 2e9 <= sched.deadline_ns <= after + 2e9
    fe.settle()
    np.testing.assert_array_equal(door.results[req]["y"], floats() + 1)


def test_max_queue_size_refuses_past_the_requests_waiting_for_the_models_workers(fe):
    """Published and unclaimed requests count; one claimed (RUNNING) does not.  One past the limit
    is refused OVERLOADED at submission, naming the model and max_queue_size, holding nothing; the
    door never receives its payload."""
    configure(fe, max_queue_size=2)
    door, w = fe.door(), fe.workers[0]
    first, second = door.infer("add", {"x": floats()}), door.infer("add", {"x": floats(start=1)})
    assert fe.dispatcher.queued_for_workers(fe.models.get("add").current) == 2
    with pytest.raises(ShmserveError) as refused:
        door.infer("add", {"x": floats(start=2)})
    assert refused.value.code is ErrorCode.OVERLOADED
    assert "'add'" in refused.value.message and "max_queue_size (2)" in refused.value.message
    assert held(fe) == (2, 2 * 4096) and len(door.requests) == 2
    jobs = w.claim()  # both RUNNING: nothing waits for a worker now
    third = door.infer("add", {"x": floats(start=3)})
    assert third.state is RS.QUEUED
    for job in jobs:
        w.complete(job)
    fe.settle()
    for i, r in enumerate((first, second, third)):
        np.testing.assert_array_equal(door.results[r]["y"], floats(start=(0, 1, 3)[i]) + 1)


def test_max_queue_size_counts_requests_parked_while_the_workers_restart(fe):
    """Parked requests wait for the model's workers too: they count against max_queue_size."""
    configure(fe, max_queue_size=1)
    door, w = fe.door(), fe.workers[0]
    fe.kill(w)
    parked_req = door.infer("add", {"x": floats()})
    assert parked_req.state is RS.WAITING
    with pytest.raises(ShmserveError) as refused:
        door.infer("add", {"x": floats()})
    assert refused.value.code is ErrorCode.OVERLOADED and "max_queue_size" in refused.value.message
    fe.restart(w)
    fe.settle()
    np.testing.assert_array_equal(door.results[parked_req]["y"], floats() + 1)


def test_no_max_queue_size_no_limit_of_its_own(fe):
    """max_queue_size 0 (the default): only the arena and server.max_waiting bound the queue."""
    door = fe.door()
    reqs = fill_slots(fe, door)
    assert fe.dispatcher.queued_for_workers(fe.models.get("add").current) == len(reqs)
    fe.settle()


def test_on_the_servers_clock_a_deadline_is_written_as_it_is_kept(fe):
    """The server's ``LoopClock`` reads time.monotonic (CLOCK_MONOTONIC): a request's deadline is
    written in ns as the dispatcher keeps it, with no conversion."""
    loop = asyncio.new_event_loop()
    try:
        assert LoopClock(loop).monotonic is time.monotonic
    finally:
        loop.close()
    fe.clock.now = time.monotonic()
    fe.dispatcher._monotonic_clock = True  # as a Dispatcher over a LoopClock finds
    door = fe.door()
    req = door.infer("add", {"x": floats()}, timeout_s=2)
    assert sched_of(fe, req)[0].deadline_ns == int(req.deadline * 1e9)
    assert req.deadline == fe.clock.now + 2
    fe.settle()
