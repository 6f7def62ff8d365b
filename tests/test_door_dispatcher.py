"""A door process's parts in process, in milliseconds: which requests it serves itself (the lane
dispatcher's ``carries`` over a real ``Directory`` fed a models message), how it routes, and the
main<->door link over a real socketpair (messages, large data, descriptors).  The door process
itself, through real servers: tests/test_doors.py."""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import time

import pytest

from shmserve import lanes, layout, protocol
from shmserve.doors.directory import Directory
from shmserve.doors.dispatcher import LaneDispatcher
from shmserve.doors.lanepool import LanePool
from shmserve.doors.link import Link
from shmserve.protocol import Kind

SPEC = {"name": "m", "backend": "python", "inputs": [{"name": "x", "dtype": "float32", "shape": ["n"]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["n"]}]}
BYTES_OUT = {**SPEC, "outputs": [{"name": "y", "dtype": "bytes", "shape": ["n"]}]}


def models_message(**over) -> dict:
    version = {"id": 0, "serving": True, "workers": 2, "max_output_bytes": 1 << 20, "spec": SPEC}
    models = {"m": {"default": 1, "rollout": False, "versions": {"1": version, "2": {**version, "serving": False}}},
              "b": {"default": 1, "rollout": False, "versions": {"1": {**version, "id": 1, "spec": BYTES_OUT}}}}
    message = {"op": "models", "stopping": False, "max_request_bytes": 1 << 20, "models": models}
    message.update(over)
    return message


def dispatcher(message: dict | None = None) -> LaneDispatcher:
    directory = Directory()
    directory.update(message or models_message())
    return LaneDispatcher(directory, pool=None, count=lambda *a: None, limits=lambda: (30.0, 1 << 20))


def infer(model="m", n=4, dtype="float32", **extra):
    meta = {"id": 7, "model": model, "inputs": [{"name": "x", "dtype": dtype, "shape": [n]}], **extra}
    if dtype == "bytes":
        meta["inputs"][0]["nbytes"] = 8 * n
    return protocol.parse_infer(meta, zero_copy=False)


def test_a_plain_infer_of_a_serving_version_is_carried():
    plan = dispatcher().carries(infer(), 16)
    assert plan is not None and plan.view.version == 1 and plan.out_capacity >= 16 and plan.offsets == (0,)


@pytest.mark.parametrize("why, parsed, payload, kind", [
    ("a bytes input", infer(dtype="bytes", n=2), 16, Kind.INFER),
    ("a bytes output", infer(model="b"), 16, Kind.INFER),
    ("an input the model does not take", infer(dtype="int32"), 16, Kind.INFER),
    ("a payload that is not its inputs' bytes", infer(), 15, Kind.INFER),
    ("an unknown model", infer(model="nope"), 16, Kind.INFER),
    ("a version not serving", infer(version=2), 16, Kind.INFER),
    ("a version not loaded", infer(version=3), 16, Kind.INFER),
    ("larger than max_request_bytes", infer(n=1 << 18), 1 << 20, Kind.INFER),
    ("a zero-copy call", infer(), 16, Kind.INFER_REGION),
])
def test_what_main_would_answer_otherwise_is_relayed(why, parsed, payload, kind):
    assert dispatcher().carries(parsed, payload, kind) is None, why


def test_a_rollout_or_a_stopping_server_relays_everything():
    message = models_message()
    message["models"]["m"]["rollout"] = True
    assert dispatcher(message).carries(infer(), 16) is None  # the split and sticky keys are main's
    assert dispatcher(models_message(stopping=True)).carries(infer(), 16) is None


def test_a_routing_key_without_a_rollout_routes_as_main_does():
    assert dispatcher().carries(infer(key="k"), 16).view.version == 1  # Models.resolve ignores it then


def test_a_version_that_stops_serving_is_reported_gone():
    directory = Directory()
    directory.update(models_message())
    message = models_message()
    message["models"]["m"]["versions"]["1"]["serving"] = False
    assert directory.update(message) == {("m", 1)}


def test_the_link_carries_messages_data_and_descriptors_in_order():
    async def run():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        got, closed = [], asyncio.Event()
        left = Link(a, loop, lambda *m: None, lambda: None)
        right = Link(b, loop, lambda meta, data, fds: got.append((meta, data, fds)), closed.set)
        r, w = os.pipe()
        big = os.urandom(5 << 20)
        try:
            left.send({"op": "one"})
            left.send({"op": "fd"}, b"xy", [w])
            left.send({"op": "big"}, big)
            left.send({"op": "after"}, b"z")
            for _ in range(2000):
                if len(got) == 4:
                    break
                await asyncio.sleep(0.005)
            assert [m["op"] for m, _, _ in got] == ["one", "fd", "big", "after"]
            assert got[1][1] == b"xy" and len(got[1][2]) == 1 and got[2][1] == big and got[3][1] == b"z"
            os.write(got[1][2][0], b"!")  # the passed descriptor is the pipe's write end
            assert os.read(r, 1) == b"!"
            os.close(got[1][2][0])
            left.close()
            await asyncio.wait_for(closed.wait(), 10)
            assert right.closed
        finally:
            for fd in (r, w):
                os.close(fd)
            left.close()
            right.close()

    asyncio.run(run())


def lane_dispatcher() -> tuple[LaneDispatcher, LanePool, list, list]:
    """A lane dispatcher whose pool opens a lane (a memfd, a worker assigned) the first time one
    is asked for: (dispatcher, pool, views asked for, lanes made)."""
    directory = Directory()
    directory.update(models_message())
    asked = []
    pool = LanePool(asked.append, lambda region: None)
    lanes_made = []

    def ask(view):
        asked.append(view)
        size = 1 << 20
        fd = os.memfd_create("door-test", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        lane = pool.opened(view, 1, fd, size)
        lanes.init_header(lane.buf, view.model_id)
        lanes.assign_worker(lane.buf, 0)
        lanes_made.append(lane)

    pool.ask = ask
    return LaneDispatcher(directory, pool, count=lambda *a: None, limits=lambda: (30.0, 1 << 20)), pool, asked, \
        lanes_made


def test_calls_whose_payloads_arrive_at_once_get_slots_of_their_own():
    """Two connections' calls begun on one lane before either's payload has arrived: each has its
    own slot (and part of the lane); one abandoned before it was submitted gives its slot back."""
    d, pool, asked, lanes_made = lane_dispatcher()
    parsed = infer(n=8)
    plan = d.carries(parsed, 32)
    assert d.begin("conn", "entry", parsed, plan) is None and len(asked) == 1  # no lane yet: relayed, one asked
    a = d.begin("conn-a", "a", parsed, plan)
    b = d.begin("conn-b", "b", parsed, plan)
    assert a is not None and b is not None and a.slot != b.slot and a.base != b.base
    lane = lanes_made[0]
    free = len(lane.lane.free)
    d.abandon(a)
    assert len(lane.lane.free) == free + 1 and a.slot in lane.lane.free and lane.calls == {b.slot: b}
    del a, b  # their input views of the lane, before it is unmapped
    d.calls.clear()
    lane.calls.clear()
    pool.close_all()


class Relays:
    """A door connection as the lane dispatcher sees it: what it relays to main."""

    def __init__(self, cid: int = 7):
        self.frames = []
        self.cid = cid  # its id in its door: the caller its lane calls name

    def relay_call(self, call, frame: bytes) -> None:
        self.frames.append(frame)


def relayed_meta(frame: bytes) -> dict:
    conn = protocol.Connection(protocol.Role.SERVER)
    conn.receive_data(frame)
    return conn.next_event().meta


def test_a_lane_call_relayed_to_main_keeps_its_priority():
    """A call the door relays after all (its lane refused it) is sent to main with the client's
    meta: its priority too, so main schedules it as the client asked."""
    d, pool, _, _ = lane_dispatcher()
    parsed = infer(n=8, priority=2, timeout_s=3)
    plan = d.carries(parsed, 32)
    d.begin("conn", "entry", parsed, plan)  # asks for a lane
    call = d.begin(Relays(), "entry", parsed, plan)
    meta = relayed_meta(d._frame_of(call))
    assert meta["priority"] == 2 and meta["timeout_s"] == 3 and meta["id"] == 7
    assert "priority" not in relayed_meta(d._frame_of(d.begin(Relays(), "e", infer(n=8), plan)))
    del call
    d.calls.clear()
    pool.close_all()


@pytest.mark.skipif("priority" not in inspect.signature(lanes.ClientLane.submit).parameters,
                    reason="needs the worker side's ClientLane.submit(priority=, deadline_ns=) (issue 29, schedw)")
def test_a_lane_call_carries_its_priority_and_deadline_into_its_lane_slot():
    """A call the door serves through its own lane writes the client's level and its deadline on
    CLOCK_MONOTONIC into the lane slot, as main's dispatcher does into an arena slot."""
    d, pool, _, lanes_made = lane_dispatcher()
    parsed = infer(n=8, priority=2, timeout_s=3)
    plan = d.carries(parsed, 32)
    d.begin("conn", "entry", parsed, plan)  # asks for a lane
    conn = Relays()
    call = d.begin(conn, "entry", parsed, plan)
    before = time.monotonic_ns()
    d.submit(call)
    after = time.monotonic_ns()
    assert not conn.frames  # served through the lane, not relayed
    sched = layout.decode_slot_sched(lanes_made[0].buf, layout.LANE, call.slot)
    assert sched.priority == 2 and sched.caller == 8  # its connection's id + 1: the worker takes turns by it
    assert layout.decode_slot_request(lanes_made[0].buf, layout.LANE, call.slot).flags == layout.SLOT_FLAG_OWN_TIMEOUT
    assert before + 2e9 < sched.deadline_ns <= after + 3e9
    d.abandon(call)
    del call
    pool.close_all()
