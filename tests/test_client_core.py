"""The client's logic without a server: ``ClientCore``, ``InferOperation`` and ``ZeroCopyOperation``, step by step.

Each operation is written once as steps (``shmserve.client.steps``) that both
faces pump; here a scripted pump drives them: a request step is read back as
the server reads the frame it builds and answered with the event a server
sends (or its error, thrown in), a lane call is answered by a worker played
in this process over the real lane bytes (``shmserve.hotpath``'s worker
functions), and the core's clock is a fake one.  What the pumps themselves do
(sockets, reconnects, futures) is tested through real servers and scripted
peers in test_client.py, test_infer_lanes.py and test_zero_copy_swaps.py.
"""

from __future__ import annotations

import mmap
import os
from types import GeneratorType

import numpy as np
import pytest

from shmserve import hotpath, lanes, layout, reservations, routing
from shmserve.client.core import ClientCore
from shmserve.client.infer import LANE_RETRY_S, InferOperation
from shmserve.client.planning import DEFAULT_REGION_BYTES, needed_bytes, region_limit
from shmserve.client.steps import CONNECT, Exchange
from shmserve.client.zerocopy import ZeroCopyOperation
from shmserve.errors import ConnectionClosed, ErrorCode, ShmserveError
from shmserve.protocol import Kind
from shmserve.session import InferResult, Placement, RegionGranted, RegionResult, Reply

from test_session import decode_request

LANE_SIZE = layout.LANE_BYTES + (1 << 20)
SPEC = {"name": "m", "backend": "python", "version": 1,
        "inputs": [{"name": "x", "dtype": "uint8", "shape": ["n"]}],
        "outputs": [{"name": "y", "dtype": "uint8", "shape": ["n"]}]}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def core():
    made = ClientCore("/nonexistent/shmserve-test.sock", 10.0, "test", True, None, Clock())
    yield made
    made.close()


def request(core: ClientCore, step) -> tuple[Kind, dict]:
    """The request a step sends, as the server reads it: (kind, metadata)."""
    assert type(step) is Exchange, step
    _, parts = step.build(core.session)
    header, meta, _ = decode_request(parts)
    return Kind(header[2]), meta


def drive(steps, answer) -> tuple[object, list]:
    """Run ``steps`` as a pump does, ``answer(step)`` standing in for its I/O (what it raises is
    thrown in); returns (what the steps return, every step)."""
    send, value, seen = steps.send, None, []
    while True:
        try:
            step = send(value)
        except StopIteration as done:
            return done.value, seen
        seen.append(step)
        send = steps.send
        try:
            value = answer(step)
        except BaseException as exc:  # noqa: B036  (as the pumps: the steps decide)
            value, send = exc, steps.throw


def lane_grant(rid: int, region: int, *, served: bool, serves: int = 0, epoch: int = 0) -> RegionGranted:
    """A lane region as the server grants it: its header written (the version it ``serves``, its
    model's routing ``epoch``), a worker assigned if ``served``."""
    fd = os.memfd_create("shmserve-test-lane")
    os.ftruncate(fd, LANE_SIZE)
    with mmap.mmap(fd, LANE_SIZE) as buf:
        lanes.init_header(buf, 0, serves, epoch)
        if served:
            lanes.assign_worker(buf, 0)
    return RegionGranted(rid, region, LANE_SIZE, {"model": "m", "data_offset": layout.LANE_BYTES, "slots": 16}, fd)


def plain_grant(rid: int, region: int, size: int) -> RegionGranted:
    fd = os.memfd_create("shmserve-test-region")
    os.ftruncate(fd, size)
    return RegionGranted(rid, region, size, None, fd)


def play_worker(call: tuple, failure: tuple[ErrorCode, str] | None = None, times: int = 1) -> None:
    """Serve the lane call ``call`` (region, slot, generation, ...) as a worker of ``identity``
    does: its one input copied to its output area (``times`` over: a vector), or ``failure``
    published; outputs larger than the area: the worker's short answer (``shmserve.reservations``)."""
    region, index, generation = call[0], call[1], call[2]
    buf, hot, entry = region.buf, hotpath.active, layout.slot_entry(call[1], call[2])
    assert hot.claim(buf, layout.LANE, entry) == index
    slot, descs, _, refused = hot.decode_lane(buf, index, region.id, lanes.DATA_FLOOR, 1)
    assert refused is None
    outputs = []
    if failure is None:
        (_, dtype, shape, offset, nbytes), = descs
        data = bytes(buf[offset:offset + nbytes]) * times
        if len(data) > slot.out_capacity:
            failure = (ErrorCode.OUTPUT_TOO_LARGE, reservations.short_message(len(data), slot.out_capacity))
        else:
            buf[slot.out_off:slot.out_off + len(data)] = data
            outputs = [(slot.out_off, shape if times == 1 else (len(data),), dtype, len(data))]
            hot.encode_outputs(buf, layout.LANE, index, slot.n_inputs, region.id, outputs)
    arena = bytearray(64 + layout.HIST_WORKER_SIZE)
    _, completions, _ = lanes.worker_rings(buf)
    assert hot.publish(buf, layout.LANE, index, entry, len(outputs), failure, completions, True, arena, 0, 8, 64)


class Server:
    """Answers the requests of one script: MODELS with ``listing``, OPEN_REGION from
    ``regions`` (in turn: a grant maker, or an error to throw in), INFO with ``info``, INFER
    with its input back as ``y``; every request is recorded as (kind, metadata)."""

    def __init__(self, core: ClientCore, listing=(SPEC,), regions=(), info=None):
        self.core, self.listing, self.regions, self.info = core, list(listing), list(regions), info
        self.requests: list[tuple[Kind, dict]] = []
        self.lane_calls: list[tuple] = []
        self.times = 1  # its lane worker's output: the input this many times over
        self.next_region = 1

    def __call__(self, step):
        if step is CONNECT:
            return None
        if type(step) is tuple:  # a lane call: served by a worker here
            self.lane_calls.append(step)
            play_worker(step, times=self.times)
            return None
        kind, meta = request(self.core, step)
        self.requests.append((kind, meta))
        rid = meta["id"]
        if kind is Kind.MODELS:
            return Reply(rid, self.listing)
        if kind is Kind.INFO:
            return Reply(rid, self.info)
        if kind is Kind.OPEN_REGION:
            made = self.regions.pop(0)
            if isinstance(made, ShmserveError):
                raise made
            self.next_region += 1
            return made(rid, self.next_region, meta)
        if kind is Kind.INFER:
            (tensor,) = meta["inputs"]
            return InferResult(rid, {"y": np.full(tensor["shape"], 7, np.uint8)})
        if kind is Kind.INFER_REGION:
            (tensor,) = meta["inputs"]
            placed = Placement("y", np.dtype(np.uint8), tuple(tensor["shape"]), meta["output_offset"])
            return RegionResult(rid, (placed,))
        raise AssertionError(f"unexpected request {kind}")

    def kinds(self) -> list[Kind]:
        return [kind for kind, _ in self.requests]


def served_lane(rid, region, meta):
    return lane_grant(rid, region, served=True)


def unserved_lane(rid, region, meta):
    return lane_grant(rid, region, served=False)


def perform(op, server: Server, *args):
    """Carry out the operation ``op`` as a pump does: its common case (``begin``, the lane call
    served by the worker here, ``answer``), the one request that ends it, or its steps."""
    call = op.begin(args)
    if type(call) is tuple:
        server.lane_calls.append(call)
        play_worker(call, times=server.times)
        call = op.answer(call, None)
    if type(call) is Exchange:
        return op.answered(server(call))
    if type(call) is GeneratorType:
        return drive(call, server)[0]
    return call


def infer(op: InferOperation, server: Server, x: np.ndarray, **routing):
    return perform(op, server, "m", {"x": x}, None, routing.get("version"), routing.get("key"), 0)


# -- infer ----------------------------------------------------------------------------------

def test_infer_reads_the_spec_opens_its_lane_once_and_then_runs_without_steps(core):
    op, server = InferOperation(core), Server(core, regions=[served_lane])
    x = np.arange(100, dtype=np.uint8)
    assert infer(op, server, x)["y"].tolist() == x.tolist()
    assert server.kinds() == [Kind.MODELS, Kind.OPEN_REGION]
    assert server.requests[1][1]["size"] == DEFAULT_REGION_BYTES and server.requests[1][1]["lane"] == "m"
    began = op.begin(("m", {"x": x[::-1]}, None, None, None, 0))
    assert type(began) is tuple, "the common case submits the lane call itself"
    play_worker(began)
    out = op.answer(began, None)
    assert out["y"].tolist() == x[::-1].tolist() and server.kinds() == [Kind.MODELS, Kind.OPEN_REGION]


def test_infer_goes_over_the_socket_while_the_lane_has_no_worker_without_asking_again(core):
    op, server = InferOperation(core), Server(core, regions=[unserved_lane])
    for _ in range(3):
        assert infer(op, server, np.ones(8, np.uint8))["y"].tolist() == [7] * 8
    assert server.kinds() == [Kind.MODELS, Kind.OPEN_REGION, Kind.INFER, Kind.INFER, Kind.INFER]
    assert not server.lane_calls


def test_a_refused_lane_sends_infer_over_the_socket_for_lane_retry_s_then_it_asks_again(core):
    op = InferOperation(core)
    server = Server(core, regions=[ShmserveError(ErrorCode.OVERLOADED, "max_regions_per_connection"), served_lane])
    x = np.ones(8, np.uint8)
    infer(op, server, x)
    assert server.kinds() == [Kind.MODELS, Kind.OPEN_REGION, Kind.INFER]
    core.clock.now += LANE_RETRY_S / 2
    infer(op, server, x)
    assert server.kinds()[3:] == [Kind.INFER]  # not even the spec is asked for
    core.clock.now += LANE_RETRY_S
    infer(op, server, x)
    assert server.kinds()[4:] == [Kind.MODELS, Kind.OPEN_REGION] and len(server.lane_calls) == 1


def test_a_lane_too_large_for_the_server_is_opened_at_its_limit_read_from_info(core):
    op = InferOperation(core)
    server = Server(core, regions=[ShmserveError(ErrorCode.TOO_LARGE, "max_request_bytes"), served_lane],
                    info={"max_request_bytes": 4 << 20})
    infer(op, server, np.ones(8, np.uint8))
    assert server.kinds() == [Kind.MODELS, Kind.OPEN_REGION, Kind.INFO, Kind.OPEN_REGION]
    assert server.requests[3][1]["size"] == region_limit({"max_request_bytes": 4 << 20}) == core.region_limit


def test_a_lane_call_refused_for_its_version_goes_over_the_socket_and_the_next_reads_the_spec_again(core):
    op, server = InferOperation(core), Server(core, regions=[served_lane])
    x = np.ones(8, np.uint8)
    infer(op, server, x)
    began = op.begin(("m", {"x": x}, None, None, None, 0))
    play_worker(began, (ErrorCode.MODEL_UNAVAILABLE, f"{lanes.VERSION_MOVED} 2 of the model now"))
    rest = op.answer(began, None)
    assert type(rest) is Exchange and op.answered(server(rest))["y"].tolist() == [7] * 8  # the socket's answer
    assert server.kinds()[2:] == [Kind.INFER] and "m" not in core.specs
    infer(op, server, x)
    assert server.kinds()[3:] == [Kind.MODELS]  # read again; the lane is still open


GROWN = {**SPEC, "max_output_bytes": 4096,  # the guess for an output no input sizes: 4 KiB
         "outputs": [{"name": "y", "dtype": "uint8", "shape": ["count"]}]}


def test_a_short_answer_runs_the_lane_call_again_once_and_its_signature_keeps_the_size(core):
    op, server = InferOperation(core), Server(core, listing=(GROWN,), regions=[served_lane])
    x = np.arange(3000, dtype=np.uint8)
    server.times = 3  # 9000 bytes: more than the 4 KiB guess
    assert infer(op, server, x)["y"].tolist() == np.tile(x, 3).tolist()
    assert len(server.lane_calls) == 2 and server.kinds() == [Kind.MODELS, Kind.OPEN_REGION]  # no socket
    (form,) = core.lane_forms.values()
    assert form.output_capacity == 9000
    assert infer(op, server, x)["y"].tolist() == np.tile(x, 3).tolist()
    assert len(server.lane_calls) == 3  # the next call of its signature: run once
    server.times = 5  # data-dependent: larger than all before, run again once more, learned
    assert infer(op, server, x)["y"].tolist() == np.tile(x, 5).tolist()
    assert len(server.lane_calls) == 5 and next(iter(core.lane_forms.values())).output_capacity == 15000
    began = op.begin(("m", {"x": x}, None, None, None, 0))
    play_worker(began, times=6)  # short ...
    again = op.answer(began, None)
    assert type(again) is GeneratorType
    with pytest.raises(ShmserveError) as raised:  # ... and short again on its second run: the error
        drive(again, lambda step: play_worker(step, times=7))
    assert raised.value.code is ErrorCode.OUTPUT_TOO_LARGE and reservations.needed(raised.value.code,
                                                                                    raised.value.message) == 21000
    assert server.kinds() == [Kind.MODELS, Kind.OPEN_REGION]


def test_a_short_answer_the_lane_cannot_hold_goes_over_the_socket(core):
    op, server = InferOperation(core), Server(core, listing=(GROWN,), regions=[served_lane])
    x = np.arange(3000, dtype=np.uint8)
    server.times = 400  # 1.2 MB: more than this 1 MiB lane holds
    assert infer(op, server, x)["y"].tolist() == [7] * 3000  # the socket's answer (its server sizes it)
    assert len(server.lane_calls) == 1 and server.kinds() == [Kind.MODELS, Kind.OPEN_REGION, Kind.INFER]
    assert next(iter(core.lane_forms.values())).output_capacity < 1 << 20  # not learned: it never fits


def test_a_zero_copy_call_short_of_space_moves_its_output_area_and_its_client_remembers(core):
    server = Server(core, listing=(GROWN,), regions=[served_lane])
    op = drive(core.zero_copy("m", {"x": ((100,), np.uint8)}, 1000), server)[0]
    assert op.grow(ShmserveError(ErrorCode.OUTPUT_TOO_LARGE, reservations.short_message(5000, 1000)))
    assert op.out_capacity == 5000
    limit = ShmserveError(ErrorCode.OUTPUT_TOO_LARGE, "output 'y' is 9000 bytes, more than the model's max_output_bytes")
    assert not op.grow(limit) and not op.grow(ShmserveError(ErrorCode.MODEL_ERROR, "outputs need 9000 bytes"))
    again = drive(core.zero_copy("m", {"x": ((100,), np.uint8)}, None), server)[0]
    assert again.out_capacity == 5000  # its client's next call of these inputs reserves it at once
    with pytest.raises(ShmserveError) as raised:
        op.grow(ShmserveError(ErrorCode.OUTPUT_TOO_LARGE, reservations.short_message(2 * LANE_SIZE, 5000)))
    assert raised.value.code is ErrorCode.OUTPUT_TOO_LARGE and f"output_capacity={2 * LANE_SIZE}" in raised.value.message
    assert reservations.needed(raised.value.code, raised.value.message) is None  # never grown from again
    assert op.out_capacity == 5000
    op.release(), again.release()
    assert op.region.allocator.free == [(layout.LANE_BYTES, LANE_SIZE - layout.LANE_BYTES)]  # nothing leaked


def claim_only(call: tuple) -> None:
    """A worker claims the lane call ``call`` (READY -> RUNNING) and has not finished it."""
    region, index, generation = call[0], call[1], call[2]
    assert hotpath.active.claim(region.buf, layout.LANE, layout.slot_entry(index, generation)) == index


def test_a_lane_call_that_timed_out_keeps_its_space_until_the_worker_is_done(core):
    """Claimed by a worker when it timed out: its space and slot wait until the worker is done."""
    op, server = InferOperation(core), Server(core, regions=[served_lane])
    x = np.ones(8, np.uint8)
    infer(op, server, x)
    began = op.begin(("m", {"x": x}, None, None, None, 0))
    region, seat = began[0], began[4]
    claim_only(began)
    timeout = ShmserveError(ErrorCode.TIMEOUT, "no answer from the worker in time")
    with pytest.raises(ShmserveError) as raised:
        op.answer(began, timeout)
    assert raised.value is timeout and seat.busy and region.abandoned
    region, index, generation = began[:3]
    buf, entry = region.buf, layout.slot_entry(index, generation)
    arena = bytearray(64 + layout.HIST_WORKER_SIZE)  # the worker finishes it later
    _, completions, _ = lanes.worker_rings(buf)
    assert hotpath.active.publish(buf, layout.LANE, index, entry, 0, (ErrorCode.MODEL_ERROR, "late"), completions,
                                  True, arena, 0, 8, 64)
    assert infer(op, server, x)["y"].tolist() == [1] * 8
    assert not region.abandoned and not seat.busy


def test_a_lane_call_given_up_before_a_worker_claimed_it_is_taken_back_at_once(core):
    """Timed out (or interrupted, or its task cancelled) before a worker claimed it: the client takes
    its slot back (READY -> ERROR -> FREE), so the worker's claim fails and it never runs; its slot
    and space are free at once (issue 29)."""
    op, server = InferOperation(core), Server(core, regions=[served_lane])
    x = np.ones(8, np.uint8)
    infer(op, server, x)
    began = op.begin(("m", {"x": x}, None, None, None, 0))
    region, seat = began[0], began[4]
    lane = region.lane
    for failure in (ShmserveError(ErrorCode.TIMEOUT, "no answer"), KeyboardInterrupt()):
        with pytest.raises(type(failure)):
            op.answer(began, failure)  # (the second time: already taken back, nothing more)
    assert not seat.busy and not region.abandoned and not lane.abandoned
    assert lane.taken_back == lane.given_up == 1 and lane.free_slots() == layout.LANE_SLOTS
    assert hotpath.active.claim(region.buf, layout.LANE, layout.slot_entry(began[1], began[2])) is None
    assert hotpath.PYTHON.claim(region.buf, layout.LANE, layout.slot_entry(began[1], began[2])) is None
    assert infer(op, server, x)["y"].tolist() == [1] * 8  # the next call takes a slot, and is served


def test_a_version_without_a_spec_goes_over_the_socket_a_key_through_the_lane_and_timeouts_are_checked_first(core):
    op, server = InferOperation(core), Server(core, regions=[served_lane])
    infer(op, server, np.ones(4, np.uint8), version=7)  # (no spec of version 7: the socket)
    infer(op, server, np.ones(4, np.uint8), key="k")  # (no canary: the default's lane)
    infer(op, server, np.ones(4, np.uint8), version=1)  # (the default, named: its lane)
    assert server.kinds() == [Kind.MODELS, Kind.INFER, Kind.OPEN_REGION] and len(server.lane_calls) == 2
    assert server.requests[1][1]["version"] == 7
    with pytest.raises(ShmserveError) as raised:
        op.begin(("m", {"x": np.ones(4, np.uint8)}, -1, None, None, 0))
    assert raised.value.code is ErrorCode.BAD_ARGUMENT and len(server.requests) == 3


def test_the_socket_gets_what_the_lane_left_of_the_timeout(core):
    op, server = InferOperation(core), Server(core, regions=[served_lane])
    x = np.ones(8, np.uint8)
    for waited, left in ((2.0, 3.0), (6.0, None)):
        infer(op, server, x)  # (the spec is read again after the version went away)
        began = op.begin(("m", {"x": x}, 5.0, None, None, 0))
        play_worker(began, (ErrorCode.MODEL_UNAVAILABLE, f"{lanes.VERSION_MOVED} 2 of the model now"))
        core.clock.now += waited
        if left is None:
            with pytest.raises(ShmserveError) as raised:
                op.answer(began, None)
            assert raised.value.code is ErrorCode.TIMEOUT
        else:
            step = op.answer(began, None)
            assert request(core, step)[1]["timeout_s"] == pytest.approx(left) and step.timeout == pytest.approx(left)


# -- the connection -------------------------------------------------------------------------

def test_a_connection_that_is_over_is_made_again_first_and_a_closed_client_makes_none(core):
    op = InferOperation(core)
    core.session.fail("the server went away")
    steps = op.begin(("m", {"x": np.ones(4, np.uint8)}, None, None, None, 0))
    assert next(steps) is CONNECT
    assert core.connection_over()
    core.forget_connection()
    assert not core.connection_over()
    core.close()
    with pytest.raises(ConnectionClosed) as raised:
        core.connection_over()
    assert raised.value.message == "client closed"


def test_a_request_is_sent_again_only_if_not_a_byte_of_it_went_on_a_connection_ended_without_reason(core):
    def refused(sent: bool) -> OSError:
        exc = BrokenPipeError("broken pipe")
        exc.sent = sent
        return exc

    assert core.retry_unsent(refused(False), 0)
    assert not core.retry_unsent(refused(True), 0) and not core.retry_unsent(refused(False), 1)
    core.session.fail("permission", ErrorCode.PERMISSION_DENIED)
    assert not core.retry_unsent(refused(False), 0)
    core.forget_connection()
    assert core.retry_unsent(refused(False), 0)
    core.closed = True
    assert not core.retry_unsent(refused(False), 0)


def test_a_new_connection_forgets_the_regions_specs_lanes_and_limits_of_the_old(core):
    op = InferOperation(core)
    server = Server(core, regions=[ShmserveError(ErrorCode.TOO_LARGE, "max_request_bytes"), served_lane],
                    info={"max_request_bytes": 4 << 20})
    infer(op, server, np.ones(8, np.uint8))
    (region,) = core.regions
    core.session.fail("the server went away")
    core.forget_connection()
    assert region.gone and not core.regions and not core.infer_lanes and not core.specs
    assert core.region_limit is None and not core.lane_forms and core.session.failure is None


# -- zero-copy calls ------------------------------------------------------------------------

def test_zero_copy_follows_the_servers_refusals_down_to_a_region_without_a_lane(core):
    server = Server(core, info={"max_request_bytes": 4 << 20}, regions=[
        ShmserveError(ErrorCode.TOO_LARGE, "max_request_bytes"),
        ShmserveError(ErrorCode.OVERLOADED, "max_region_bytes_per_uid"),
        ShmserveError(ErrorCode.OVERLOADED, "the lane's workers serve all they can"),
        lambda rid, region, meta: plain_grant(rid, region, meta["size"])])
    operation, steps = drive(core.zero_copy("m", {"x": ((100,), np.uint8)}, None), server)
    sizes = [(meta["size"], meta.get("lane")) for kind, meta in server.requests if kind is Kind.OPEN_REGION]
    limit = region_limit({"max_request_bytes": 4 << 20})
    assert 100 <= operation.out_capacity < 1024  # from the spec: y is as long as x
    needed = needed_bytes({"x": 100}, operation.out_capacity)
    assert steps[0] is CONNECT and sizes == [(DEFAULT_REGION_BYTES, "m"), (limit, "m"), (needed, "m"), (needed, None)]
    assert server.kinds() == [Kind.MODELS, Kind.OPEN_REGION, Kind.INFO, Kind.OPEN_REGION, Kind.OPEN_REGION,
                              Kind.OPEN_REGION]
    assert isinstance(operation, ZeroCopyOperation) and operation.region.lane is None


def test_a_zero_copy_call_without_a_lane_runs_over_the_socket_and_returns_read_only_views(core):
    server = Server(core, regions=[ShmserveError(ErrorCode.OVERLOADED, "no lane"),
                                   ShmserveError(ErrorCode.OVERLOADED, "no lane"),
                                   lambda rid, region, meta: plain_grant(rid, region, meta["size"])])
    operation, _ = drive(core.zero_copy("m", {"x": ((16,), np.uint8)}, None), server)
    assert type(operation.begin((None,))) is Exchange  # no lane: one request
    outputs = perform(operation, server, None)
    kind, meta = server.requests[-1]
    assert kind is Kind.INFER_REGION and meta["region"] == operation.region.id
    assert outputs["y"].shape == (16,) and not outputs["y"].flags.writeable


def test_a_zero_copy_call_runs_its_first_call_as_steps_and_then_without(core):
    server = Server(core, regions=[served_lane])
    operation, _ = drive(core.zero_copy("m", {"x": ((16,), np.uint8)}, None), server)
    operation.inputs["x"][1][...] = 3
    outputs, steps = drive(operation.begin((None,)), server)
    assert outputs["y"].tolist() == [3] * 16 and type(steps[-1]) is tuple
    began = operation.begin((None,))
    assert type(began) is tuple
    play_worker(began)
    assert operation.answer(began, None)["y"].tolist() == [3] * 16


def test_a_zero_copy_call_refused_for_its_version_is_planned_again_from_the_spec_read_afresh(core):
    server = Server(core, regions=[served_lane])
    operation, _ = drive(core.zero_copy("m", {"x": ((16,), np.uint8)}, None), server)
    drive(operation.begin((None,)), server)
    began = operation.begin((None,))
    play_worker(began, (ErrorCode.MODEL_UNAVAILABLE, f"{lanes.VERSION_MOVED} 2 of the model now"))
    server.listing = [{**SPEC, "version": 2}]
    outputs, steps = drive(operation.answer(began, None), server)
    assert server.kinds()[-1] is Kind.MODELS and operation.plan.version == 2 and outputs["y"].shape == (16,)
    server.listing = [{**SPEC, "version": 3, "inputs": [{"name": "z", "dtype": "uint8", "shape": ["n"]}]}]
    began = operation.begin((None,))
    play_worker(began, (ErrorCode.MODEL_UNAVAILABLE, f"{lanes.VERSION_MOVED} 3 of the model now"))
    with pytest.raises(ShmserveError, match="changed from version 2 to version 3") as raised:
        drive(operation.answer(began, None), server)
    assert raised.value.code is ErrorCode.BAD_INPUT


def test_a_zero_copy_call_of_a_connection_that_ended_says_so(core):
    server = Server(core, regions=[served_lane])
    operation, _ = drive(core.zero_copy("m", {"x": ((16,), np.uint8)}, None), server)
    core.session.fail("the server went away")
    with pytest.raises(ConnectionClosed, match="that ended \\(the server went away\\); the client connects again"):
        operation.begin((None,))
    core.forget_connection()
    with pytest.raises(ConnectionClosed, match="make a new zero_copy call"):
        operation.begin((None,))
    core.close()
    with pytest.raises(ConnectionClosed) as raised:
        operation.begin((None,))
    assert raised.value.message == "client closed"


# -- a split canary's route, evaluated by the client (issue 24: canaries without leaving the lanes) --

def routed_listing(epoch: int, percent: float | None = 30.0, sticky: bool = True) -> list[dict]:
    """The ``models`` answer for ``m`` (version 1 the default) while a split canary of version 2
    takes ``percent`` % (None: no canary), valid for routing ``epoch``."""
    route = {"epoch": epoch}
    if percent is not None:
        route.update(stable=1, candidate=2, percent=percent, sticky=sticky, candidate_spec=dict(SPEC, version=2))
    return [dict(SPEC, route=route)]


def versioned_lanes(epoch: int):
    """Grants lanes as the server does: to the version the request names (else 1), in ``epoch``."""
    def grant(rid, region, meta):
        return lane_grant(rid, region, served=True, serves=meta.get("version") or 1, epoch=epoch)
    return [grant] * 8


def by_version(server: Server) -> dict[int, int]:
    counted: dict[int, int] = {}
    for call in server.lane_calls:
        version = call[0].lane.serves()
        counted[version] = counted.get(version, 0) + 1
    return counted


def test_a_split_route_sends_each_call_through_the_lane_of_the_version_it_picks(core):
    op, server = InferOperation(core), Server(core, listing=routed_listing(5), regions=versioned_lanes(5))
    x = np.ones(4, np.uint8)
    for _ in range(2000):
        assert infer(op, server, x)["y"].tolist() == [1] * 4
    assert Kind.INFER not in server.kinds() and server.kinds().count(Kind.OPEN_REGION) == 2  # a lane per version
    assert {meta.get("version") for kind, meta in server.requests if kind is Kind.OPEN_REGION} == {1, 2}
    counted = by_version(server)
    assert 600 - 103 <= counted[2] <= 600 + 103, counted  # 30 %: sd 20.5, five of them either way
    for call in server.lane_calls:
        assert call[0].lane.serves() == call[5].version  # planned from the spec of the version its lane serves


def test_a_routing_key_gets_the_servers_version_through_that_versions_lane(core):
    op, server = InferOperation(core), Server(core, listing=routed_listing(5, 50.0), regions=versioned_lanes(5))
    x = np.ones(4, np.uint8)
    for k in range(40):
        key = f"user-{k}"
        want = routing.split("m", 1, 2, 50.0, True, key.encode(), 0.0)
        before = len(server.lane_calls)
        for _ in range(3):
            infer(op, server, x, key=key)
        assert {call[0].lane.serves() for call in server.lane_calls[before:]} == {want}
    assert set(by_version(server)) == {1, 2} and Kind.INFER not in server.kinds()


def test_a_new_epoch_in_the_lane_header_makes_the_client_read_the_route_again(core):
    """A rollback (or any change of the routing): the front-end writes a new epoch into the lanes; the
    client's next call reads the route again and, the canary gone, reaches only the default's lane."""
    op, server = InferOperation(core), Server(core, listing=routed_listing(5), regions=versioned_lanes(5))
    x = np.ones(4, np.uint8)
    for _ in range(200):
        infer(op, server, x)
    assert set(by_version(server)) == {1, 2}
    models_asked = server.kinds().count(Kind.MODELS)
    server.listing = routed_listing(6, None)
    for region in core.infer_lanes.values():
        lanes.set_route_epoch(region.buf, 6)
    server.lane_calls.clear()
    for _ in range(200):
        infer(op, server, x)
    assert server.kinds().count(Kind.MODELS) == models_asked + 1  # once, on the first call of the new epoch
    assert by_version(server) == {1: 200} and Kind.INFER not in server.kinds()


def test_a_call_refused_by_a_moved_lane_is_sent_again_over_the_socket_with_its_key(core):
    """A call queued in the candidate's lane when a rollback moved the lane to the stable version:
    that worker refuses it before it runs (``lanes.VERSION_MOVED``); the call is sent again over the
    socket with its own key (the server routes it), never failed."""
    op, server = InferOperation(core), Server(core, listing=routed_listing(5, 100.0), regions=versioned_lanes(5))
    x = np.ones(4, np.uint8)
    infer(op, server, x, key="user-1")  # (the spec and route read, the candidate's lane opened)
    began = op.begin(("m", {"x": x}, None, None, "user-1", 0))
    assert type(began) is tuple and began[0].lane.serves() == 2
    play_worker(began, (ErrorCode.MODEL_UNAVAILABLE, f"{lanes.VERSION_MOVED} 1 of the model now, not version 2"))
    resend = op.answer(began, None)
    assert type(resend) is Exchange
    kind, meta = request(core, resend)
    assert kind is Kind.INFER and meta["key"] == "user-1" and "version" not in meta


def test_a_candidate_canaried_again_after_its_lane_moved_gets_a_lane_of_its_own_again(core):
    """A rollback moved the candidate's lane to the stable version (its header says so); a later canary
    of the same version opens a new lane to it rather than send its share over the socket."""
    op, server = InferOperation(core), Server(core, listing=routed_listing(5, 50.0), regions=versioned_lanes(5))
    x = np.ones(4, np.uint8)
    for _ in range(100):
        infer(op, server, x)
    moved = core.infer_lanes[("m", 2)]
    lanes.set_serves(moved.buf, 1)  # the rollback's drain moved it
    server.listing, server.regions = routed_listing(6, None), versioned_lanes(6)
    for region in core.infer_lanes.values():
        lanes.set_route_epoch(region.buf, 6)
    server.lane_calls.clear()
    for _ in range(50):
        infer(op, server, x)
    assert by_version(server) == {1: 50}
    server.listing, server.regions = routed_listing(7, 50.0), versioned_lanes(7)
    for region in core.infer_lanes.values():
        lanes.set_route_epoch(region.buf, 7)
    opened = server.kinds().count(Kind.OPEN_REGION)
    server.lane_calls.clear()
    for _ in range(100):
        infer(op, server, x)
    assert server.kinds().count(Kind.OPEN_REGION) == opened + 1 and Kind.INFER not in server.kinds()
    assert set(by_version(server)) == {1, 2} and core.infer_lanes[("m", 2)] is not moved


def test_a_call_without_a_key_the_split_sent_to_a_lane_that_cannot_take_it_is_routed_by_the_server(core):
    """The split picked the candidate for a call without a key, but its lane has no worker now (a
    rollback is moving it to the stable version): over the socket the call names no version, and the
    server routes it (the lifecycle soak caught such calls naming the candidate, which was draining:
    model_unavailable)."""
    op, server = InferOperation(core), Server(core, listing=routed_listing(5, 100.0), regions=versioned_lanes(5))
    x = np.ones(4, np.uint8)
    infer(op, server, x)  # (the spec and route read, the candidate's lane opened)
    lanes.assign_worker(core.infer_lanes[("m", 2)].buf, layout.NO_WORKER)
    sent = op.begin(("m", {"x": x}, None, None, None, 0))
    kind, meta = request(core, sent)
    assert kind is Kind.INFER and "version" not in meta and "key" not in meta
