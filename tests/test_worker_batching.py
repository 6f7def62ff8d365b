"""A worker's batches in one process, with real parts: an arena, the step, the batcher and torch on CPU.

The front-end's side is played here with the real allocators and slot
transitions (``FrontEnd``); the worker's side is the real
``workers.worker.Worker`` put together from its parts the way
``open_worker`` does, around a backend object the test holds.  A batch must
give each request the outputs it gets alone, in its own output area; a
backend that accepts row splits must get them and no scratch array is made
(numpy's allocations are traced by tracemalloc, torch's are not); and after
load the worker never asks the backend what it has.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
import tracemalloc
from typing import NamedTuple

import numpy as np
import pytest

from shmserve import hotpath, layout, reservations, workerlink
from shmserve.allocator import ExtentAllocator, SlotPool
from shmserve.arena import Arena
from shmserve.config import ModelConfig
from shmserve.errors import ErrorCode
from shmserve.rings import Ring
from shmserve.slotstate import Actor, SlotState
from shmserve.spec import TensorSpec
from workers.adapter import BackendAdapter
from workers.backends import RowSplit
from workers.backends.python import PythonBackend
from workers.regions import RegionCache
from workers.step import Step
from workers.worker import Worker

torch = pytest.importorskip("torch")

from workers.backends.torch import TorchBackend  # noqa: E402

WIDE = 32  # the second output is WIDE times the input: a scratch copy of it is easy to see


class Call(NamedTuple):
    index: int
    generation: int
    extents: tuple
    out_offset: int
    out_capacity: int


class FrontEnd:
    """The front-end's part for worker 0: slots and extents from the real allocators, requests
    written, published and pushed as the dispatcher does, answers read and slots freed."""

    def __init__(self, arena: Arena, spec):
        self.arena, self.spec, self.buf, self.g = arena, spec, arena.buf, arena.geometry
        self.slots, self.extents = SlotPool(self.g.slot_count), ExtentAllocator(self.g)
        self.ring = Ring.of_worker(arena, 0, completion=False)
        self.next_id = 1

    def submit(self, x: np.ndarray, out_capacity: int | None = None, **sched) -> Call:
        """``sched``: the slot's priority, caller, deadline_ns and flags (``layout.encode_slot_request``)."""
        index = self.slots.acquire()
        generation, _ = self.arena.slot_status(index)
        generation = self.arena.transition(index, generation, SlotState.FREE, SlotState.WRITING, Actor.FRONTEND)
        extent = self.extents.allocate(x.nbytes)
        np.ndarray(x.shape, x.dtype, buffer=self.buf, offset=extent.offset)[...] = x
        layout.encode_tensor(self.buf, self.g, index, 0, role=layout.ROLE_INPUT, name_index=0, dtype=x.dtype,
                             shape=x.shape, offset=extent.offset)
        out = self.extents.allocate(65536)
        capacity = out.size if out_capacity is None else out_capacity
        np.ndarray(capacity, np.uint8, buffer=self.buf, offset=out.offset)[...] = 0xFF  # poisoned: NaN as float32
        layout.encode_slot_request(self.buf, self.g, index, request_id=self.next_id, model_id=0, worker=0,
                                   n_inputs=1, out_region=0, out_off=out.offset, out_capacity=capacity, **sched)
        self.next_id += 1
        now = time.monotonic_ns()
        layout.reset_stages(self.buf, self.g, index, now, now)
        self.arena.transition(index, generation, SlotState.WRITING, SlotState.READY, Actor.FRONTEND)
        self.ring.push(layout.slot_entry(index, generation))
        return Call(index, generation, (extent, out), out.offset, capacity)

    def answer(self, call: Call):
        """The outputs by name (copies), each checked to lie in the call's own output area; or
        (code, message) of its error.  Frees the slot and its extents."""
        generation, state = self.arena.slot_status(call.index)
        assert generation == call.generation and state in (SlotState.DONE, SlotState.ERROR), state
        try:
            if state == SlotState.ERROR:
                code, message = layout.decode_error(self.buf, self.g, call.index)
                return ErrorCode.from_number(code), message
            slot = layout.decode_slot_request(self.buf, self.g, call.index)
            outputs = {}
            for t in range(slot.n_inputs, slot.n_inputs + slot.n_outputs):
                d = layout.decode_tensor(self.buf, self.g, call.index, t)
                assert call.out_offset <= d.offset and d.offset + d.nbytes <= call.out_offset + call.out_capacity
                outputs[self.spec.outputs[d.name_index].name] = np.ndarray(d.shape, d.dtype, buffer=self.buf,
                                                                           offset=d.offset).copy()
            return outputs
        finally:
            self.arena.transition(call.index, generation, SlotState(state), SlotState.FREE, Actor.FRONTEND)
            self.slots.release(call.index)
            for extent in call.extents:
                self.extents.free(extent)


@contextlib.contextmanager
def serving(instance: str, config: ModelConfig, backend):
    """(FrontEnd, Worker) over a new arena, the worker made of its real parts around ``backend``."""
    with Arena.create(instance, slot_count=32, max_workers=1, size_classes=[(4096, 64), (65536, 64)],
                      prefault=False) as arena, contextlib.ExitStack() as stack:
        adapter = stack.enter_context(BackendAdapter(backend))
        spec = adapter.prepare(config)
        control, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stack.callback(control.close)
        stack.callback(worker_end.close)
        regions = stack.enter_context(RegionCache(functools.partial(workerlink.receive_regions, worker_end)))
        completion_fd = os.eventfd(0)
        stack.callback(os.close, completion_fd)
        worker = Worker(arena, 0, config, completion_fd, 0.0, Step(arena, 0, regions, adapter, spec))
        front = FrontEnd(arena, spec)
        front.control = control  # the front-end's end of the worker's control socket: regions go here
        yield front, worker


def one_by_one(front: FrontEnd, worker: Worker, xs, **submit) -> list:
    answers = []
    for x in xs:
        call = front.submit(x, **submit)
        work, stop = worker.gather()
        assert len(work) == 1 and not stop
        worker.step.serve(*work[0])
        answers.append(front.answer(call))
    return answers


def as_one_batch(front: FrontEnd, worker: Worker, xs, capacities=None) -> list:
    calls = [front.submit(x, out_capacity=None if capacities is None else capacities[i]) for i, x in enumerate(xs)]
    work, stop = worker.gather()
    assert len(work) == len(xs) and not stop
    assert worker.batcher.run(work, worker) is False and worker.held() == []
    return [front.answer(c) for c in calls]


def batch_runs(front: FrontEnd) -> tuple[int, int]:
    """(backend runs, requests in them) from worker 0's batch-size histogram."""
    buckets, total = layout.read_histogram(front.buf, front.g, 0, "batch_size")
    return sum(buckets), total


# -- models -------------------------------------------------------------------------------------

class Rows(torch.nn.Module):
    def forward(self, x):
        return x * 2, (x + 1).repeat(1, WIDE)


class Pooled(torch.nn.Module):
    def forward(self, x):
        return x.sum(dim=0, keepdim=True), x.repeat(1, WIDE)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """TorchScript files of the models above (traced: every op works row by row or on the whole)."""
    directory = tmp_path_factory.mktemp("models")
    paths = {}
    for module in (Rows, Pooled):
        paths[module] = directory / f"{module.__name__}.pt"
        torch.jit.trace(module(), torch.zeros(2, 16)).save(str(paths[module]))
    return paths


def torch_config(models, module=Rows) -> ModelConfig:
    return ModelConfig(name="rows", backend="torch", path=str(models[module]), max_batch_size=8,
                       inputs=(TensorSpec("x", "float32", ("batch", 16)),),
                       outputs=(TensorSpec("y", "float32", ("batch", 16)),
                                TensorSpec("z", "float32", ("batch", 16 * WIDE))))


class RecordingTorch(TorchBackend):
    """The real torch backend, noting what kind of destination each output was given."""

    def __init__(self, config):
        super().__init__(config)
        self.destinations: list[str] = []

    def run_into(self, inputs, allocate):
        def noted(name, shape, dtype):
            dst = allocate(name, shape, dtype)
            self.destinations.append(type(dst).__name__)
            return dst

        super().run_into(inputs, noted)


class ScratchTorch(RecordingTorch):
    """The same, not declaring row splits: what a third-party ``run_into`` backend gets."""

    accepts_row_splits = False


def reference(x):
    return {"y": x * 2, "z": np.concatenate([x + 1] * WIDE, axis=1)}


def inputs(rows, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, 16), dtype=np.float32) for n in rows]


# -- tests --------------------------------------------------------------------------------------

def test_a_torch_batch_is_written_in_place_and_equals_its_requests_run_one_by_one(instance_name, models):
    backend = RecordingTorch(torch_config(models))
    xs = inputs([1, 3, 2, 5])
    with serving(instance_name(), torch_config(models), backend) as (front, worker):
        alone = one_by_one(front, worker, xs)
        assert set(backend.destinations) == {"ndarray"}
        backend.destinations.clear()
        runs0, requests0 = batch_runs(front)
        together = as_one_batch(front, worker, xs)
        assert backend.destinations == ["RowSplit", "RowSplit"]  # each output straight into the 4 areas
        assert batch_runs(front) == (runs0 + 1, requests0 + 4)
    for x, a, b in zip(xs, alone, together):
        for name, want in reference(x).items():
            np.testing.assert_array_equal(a[name], want)
            np.testing.assert_array_equal(b[name], want)  # the poisoned area was overwritten, exactly


@pytest.mark.parametrize("backend_class, scratch", [(RecordingTorch, False), (ScratchTorch, True)])
def test_a_backend_that_takes_row_splits_needs_no_scratch_copy(instance_name, models, backend_class, scratch):
    xs = inputs([16, 16, 16, 16], seed=1)
    output_bytes = sum(x.nbytes * (1 + WIDE) for x in xs)
    backend = backend_class(torch_config(models))
    with serving(instance_name(), torch_config(models), backend) as (front, worker):
        as_one_batch(front, worker, xs[:2])  # warm: first-run allocations are not the batch's
        calls = [front.submit(x) for x in xs]
        work, _ = worker.gather()
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            worker.batcher.run(work, worker)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        answers = [front.answer(c) for c in calls]
    for x, got in zip(xs, answers):
        for name, want in reference(x).items():
            np.testing.assert_array_equal(got[name], want)
    # numpy allocated the concatenated inputs (1/33 of the outputs) and, without row splits, the outputs
    if scratch:
        assert peak >= output_bytes, (peak, output_bytes)
    else:
        assert peak < output_bytes / 4, (peak, output_bytes)


def test_a_request_whose_area_is_too_small_fails_alone_and_its_batch_is_answered(instance_name, models):
    backend = RecordingTorch(torch_config(models))
    xs = inputs([2, 4, 3], seed=2)
    with serving(instance_name(), torch_config(models), backend) as (front, worker):
        backend.destinations.clear()  # the warm-up's
        answers = as_one_batch(front, worker, xs, capacities=[None, 1024, None])
    assert backend.destinations == ["RowSplit", "RowSplit"]
    code, message = answers[1]
    assert reservations.needed(code, message) > 1024  # the short answer: what its outputs took (run it again)
    for i in (0, 2):
        for name, want in reference(xs[i]).items():
            np.testing.assert_array_equal(answers[i][name], want)


def summed(inputs):
    """A `run` model whose first output pools the rows: fine alone, not batchable."""
    x = inputs["x"]
    return {"y": x.sum(axis=0, keepdims=True), "z": np.concatenate([x] * WIDE, axis=1)}


@pytest.mark.parametrize("kind", ["row splits", "scratch", "run"])
def test_an_output_without_the_batchs_rows_fails_the_whole_batch(instance_name, models, kind):
    if kind == "run":
        spec = torch_config(models)
        config = ModelConfig(name="rows", backend="python", path="test_worker_batching:summed", max_batch_size=8,
                             inputs=spec.inputs, outputs=spec.outputs)
        backend = PythonBackend(config)
    else:
        config = torch_config(models, Pooled)
        backend = (RecordingTorch if kind == "row splits" else ScratchTorch)(config)
    xs = inputs([1, 2, 3], seed=3)
    with serving(instance_name(), config, backend) as (front, worker):
        assert not any(isinstance(a, tuple) for a in one_by_one(front, worker, xs))
        answers = as_one_batch(front, worker, xs)
        alone = one_by_one(front, worker, xs[:1])[0]  # the worker serves on
    assert alone["y"].shape == (1, 16)
    for code, message in answers:
        assert code is ErrorCode.MODEL_ERROR
        assert message == "output 'y' does not have the batch's 6 rows; this model cannot be batched"


class Counting:
    """A third-party backend that counts every attribute looked up on it (its own methods look
    nothing up on ``self``), and writes row splits itself."""

    lookups: list[str] = []
    inputs = (TensorSpec("x", "float32", ("batch", 4)),)
    outputs = (TensorSpec("y", "float32", ("batch", 4)),)
    accepts_row_splits = True

    def __getattribute__(self, name):
        Counting.lookups.append(name)
        return object.__getattribute__(self, name)

    def run_into(self, inputs, allocate):
        y = inputs["x"] * 2
        dst = allocate("y", y.shape, y.dtype)
        if isinstance(dst, RowSplit):
            for start, stop, view in dst.parts:
                view[...] = y[start:stop]
        else:
            dst[...] = y

    def synchronize(self):
        pass

    def close(self):
        pass


def test_after_load_the_worker_never_asks_the_backend_what_it_has(instance_name):
    config = ModelConfig(name="counting", backend="counting", path="-", max_batch_size=8)
    Counting.lookups.clear()
    xs = [np.full((n, 4), n, np.float32) for n in (1, 2, 3)]
    with serving(instance_name(), config, Counting()) as (front, worker):
        assert {"run_into", "synchronize", "accepts_row_splits", "declare", "inputs"} <= set(Counting.lookups)
        Counting.lookups.clear()
        alone = one_by_one(front, worker, xs)
        together = as_one_batch(front, worker, xs)
        assert Counting.lookups == []
    for x, a, b in zip(xs, alone, together):
        np.testing.assert_array_equal(a["y"], x * 2)
        np.testing.assert_array_equal(b["y"], x * 2)


def test_the_worker_serves_arena_requests_in_the_schedulers_order(instance_name, models):
    """Five arena requests held at once (max_queue_size 4, two levels): the newest low one is
    refused OVERLOADED, the one whose deadline passed answered TIMEOUT, both unrun; then level 1,
    then level 2 by caller in turn.  The completion ring says the order; the arena's scheduling
    counters what happened."""
    import dataclasses

    config = dataclasses.replace(torch_config(models), max_batch_size=1, priority_levels=2, max_queue_size=4)
    instance = instance_name()
    with serving(instance, config, RecordingTorch(config)) as (front, worker):
        xs = inputs([1] * 5, seed=5)
        asks = [dict(priority=2, caller=1), dict(priority=2, caller=1), dict(priority=2, caller=2),
                dict(priority=1, caller=3), dict(priority=1, caller=3, deadline_ns=1)]
        calls = [front.submit(x, **ask) for x, ask in zip(xs, asks)]
        work, stop = worker.gather()
        assert len(work) == 5 and not stop
        worker.hold(work)
        while worker.held():  # (it returns to the serve loop early: a signature it had not met to tell)
            assert worker.serve_held(False) is False
        done = [layout.split_entry(e)[0] for e in Ring.of_worker(front.arena, 0, completion=True).pop_all()]
        assert done == [calls[i].index for i in (2, 4, 3, 0, 1)]
        answers = [front.answer(c) for c in calls]
        assert answers[2][0] is ErrorCode.OVERLOADED and "max_queue_size (4)" in answers[2][1]
        assert answers[4][0] is ErrorCode.TIMEOUT
        for i in (0, 1, 3):
            np.testing.assert_array_equal(answers[i]["y"], xs[i] * 2)
        counters = layout.read_sched_counters(front.buf, front.g, 0)
        assert counters.expired == 1 and counters.demoted == 0
        assert [(lv.queued, lv.claimed) for lv in counters.levels[:3]] == [(0, 1), (0, 2), (0, 0)]


def test_under_a_one_level_policy_a_gather_is_served_its_callers_in_turn_without_the_scheduler(instance_name, models):
    """The default policy (one level, no queue limit, nothing delayed) serves what one gather
    brought with no scheduler (``Worker.serve_in_turn``): callers in turn, the first request of
    each in the order the callers came, then their second...; a request whose deadline passed is
    answered TIMEOUT unrun; nothing stays counted as queued.  ``fairness = "arrival"``: as gathered."""
    import dataclasses

    for fairness, order in (("callers", (0, 3, 4, 1, 2)), ("arrival", (0, 1, 2, 3, 4))):
        config = dataclasses.replace(torch_config(models), max_batch_size=1, fairness=fairness)
        with serving(instance_name(), config, RecordingTorch(config)) as (front, worker):
            assert worker.in_turn_will_do and not worker.sched
            xs = inputs([1] * 6, seed=7)
            callers = (1, 1, 1, 2, 3, 2)
            calls = [front.submit(x, caller=c, **({"deadline_ns": 1} if i == 5 else {}))
                     for i, (x, c) in enumerate(zip(xs, callers))]
            work, stop = worker.gather()
            assert len(work) == 6 and not stop
            worker.serve_in_turn(work)
            done = [layout.split_entry(e)[0] for e in Ring.of_worker(front.arena, 0, completion=True).pop_all()]
            ran = [i for i in (calls.index(c) for c in calls if c.index in done) if i != 5]
            assert [calls[i].index for i in order] == [d for d in done if d != calls[5].index], fairness
            assert sorted(ran) == [0, 1, 2, 3, 4]
            assert front.answer(calls[5])[0] is ErrorCode.TIMEOUT
            for i in range(5):
                np.testing.assert_array_equal(front.answer(calls[i])["y"], xs[i] * 2)
            counters = layout.read_sched_counters(front.buf, front.g, 0)
            assert counters.expired == 1 and counters.levels[0].queued == 0 and counters.levels[0].claimed == 5
            assert batch_runs(front) == (5, 5)  # five runs of one (Step's bound offsets), the expired one none
            # a gather of one (serve_alone): run, or answered TIMEOUT unrun if its deadline passed
            late = front.submit(xs[0], caller=4, deadline_ns=1)
            work, _ = worker.gather()
            assert len(work) == 1
            worker.serve_alone(*work[0])
            fine = front.submit(xs[1], caller=4)
            work, _ = worker.gather()
            assert len(work) == 1
            worker.serve_alone(*work[0])
            assert front.answer(late)[0] is ErrorCode.TIMEOUT
            np.testing.assert_array_equal(front.answer(fine)["y"], xs[1] * 2)
            counters = layout.read_sched_counters(front.buf, front.g, 0)
            assert (counters.expired, counters.levels[0].claimed, batch_runs(front)) == (2, 6, (6, 6))


def test_in_turn_is_round_robin_across_gathers_whoever_came_last():
    """``workers.worker.in_turn`` orders a gather by when each caller was last served, not by
    where its request fell: a caller whose request was the last of one round (so it is still held
    when the next gather comes, and its next request misses that gather) gets its turn first in
    the round after, instead of every other round (measured before: 2 of 8 clients at half the
    others' rate)."""
    from types import SimpleNamespace

    from workers.worker import LANE_CALLERS, in_turn

    lanes = [SimpleNamespace(is_lane=True, wake=hotpath.LANE_FUTEX, region=r) for r in (1, 2, 3)]
    last: dict[int, int] = {}
    first = in_turn([(lane, 10 + i) for i, lane in enumerate(lanes)], last)
    assert [key - LANE_CALLERS for key, _, _ in first] == [1, 2, 3]  # never served: as they came
    last.update({LANE_CALLERS + 1: 1, LANE_CALLERS + 2: 2})  # 3 is still held: it missed this gather
    again = in_turn([(lanes[0], 20), (lanes[1], 21)], last)
    assert [e for _, _, e in again] == [20, 21]
    last.update({LANE_CALLERS + 3: 3})  # 3 served, then 1 and 2 again: 3 is now the longest ago
    last.update({LANE_CALLERS + 1: 4})
    later = in_turn([(lanes[0], 30), (lanes[2], 32), (lanes[1], 31), (lanes[0], 33)], last)
    assert [e for _, _, e in later] == [31, 32, 30, 33]  # 2 (served at 2), 3 (at 3), 1 (at 4), then 1's second


def test_a_worker_started_in_a_dead_ones_entry_does_not_count_what_that_one_held(instance_name, models):
    """The queue depth per level is a gauge in the worker's entry: a worker that died holding
    requests left it up, and the one restarted in the same entry (the supervisor clears an entry
    only when it is given to a new worker) starts it from zero, its counters of claims kept."""
    import dataclasses

    config = dataclasses.replace(torch_config(models), max_batch_size=1, priority_levels=2)
    instance = instance_name()
    with serving(instance, config, RecordingTorch(config)) as (front, worker):
        calls = [front.submit(x, priority=2, caller=1 + i) for i, x in enumerate(inputs([1] * 3, seed=6))]
        work, _ = worker.gather()
        worker.hold(work)  # held, unclaimed: then it "dies"
        assert layout.read_sched_counters(front.buf, front.g, 0).levels[1].queued == len(calls)
        fd = os.eventfd(0)
        try:
            Worker(front.arena, 0, config, fd, 0.0, worker.step)  # its successor in the entry
        finally:
            os.close(fd)
        counters = layout.read_sched_counters(front.buf, front.g, 0)
        assert [lv.queued for lv in counters.levels] == [0] * layout.SCHED_LEVELS


def test_a_lane_dropped_while_a_batch_gathers_keeps_its_mapping_until_its_calls_are_answered(instance_name, models):
    """The front-end drops a lane (its client closed it) while the worker gathers a batch that
    already holds a call of that lane: the call is still answered in the lane, the worker serves
    on, and the lane is unmapped once nothing of it is in hand."""
    import dataclasses
    import mmap

    from shmserve import lanes
    from shmserve.frontend.regions import sealed_memfd

    config = dataclasses.replace(torch_config(models), max_queue_delay_us=200_000)
    x = inputs([3], seed=4)[0]
    instance = instance_name()
    with serving(instance, config, RecordingTorch(config)) as (front, worker):
        region_id, size = 7, layout.LANE_BYTES + 65536
        fd = sealed_memfd("test.lane", size)
        try:
            buf = mmap.mmap(fd, size)
            assert workerlink.send_region(front.control, region_id, size, fd)
            lanes.init_header(buf, 0)
            client = lanes.ClientLane(buf, region_id, "rows")
            view = np.ndarray(x.shape, x.dtype, buffer=buf, offset=lanes.DATA_FLOOR)
            view[...] = x
            del view
            front.ring.push(layout.command_entry(layout.CMD_ATTACH_LANE, region_id))
            assert worker.gather() == ([], False) and region_id in worker.lanes
            out_offset = lanes.DATA_FLOOR + 4096
            index, generation = client.submit(1, 0, [(0, lanes.DATA_FLOOR, x)], out_offset, 32768)
            work, stop = worker.gather()
            assert len(work) == 1 and not stop
            front.ring.push(layout.command_entry(layout.CMD_DROP_REGION, region_id))  # arrives mid-gather
            assert worker.batcher.run(work, worker) is False and worker.held() == []
            assert region_id not in worker.lanes and region_id in worker.regions.maps  # detached, still mapped
            assert client.finished(index, generation)
            placed = client.read(index, generation, out_offset, 32768)
            got = {config.outputs[i].name: np.ndarray(shape, dtype, buffer=buf, offset=offset).copy()
                   for i, (dtype, shape, offset) in placed.items()}
            for output, want in reference(x).items():
                np.testing.assert_array_equal(got[output], want)
            front.ring.push(layout.STOP_ENTRY)
            assert worker.serve() == 0  # the loop's turn ends by unmapping what is no longer in hand
            assert region_id not in worker.regions.maps
            buf.close()
        finally:
            os.close(fd)
