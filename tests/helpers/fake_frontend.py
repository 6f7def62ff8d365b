"""The front-end's logic in one process: the real dispatcher, arena, rings and region table, with
fakes only for what is not under test (the front door, the clock, the worker processes).

Owns: ``FakeClock`` (a ``dispatcher.Clock`` whose time moves only when a test says so),
``FakeDoor`` (a ``dispatcher.Door`` that records every call, receives inline payloads into the
sinks it is given and writes answers when told), ``FakeWorker`` (a real ``WorkerHandle`` over
the arena's real rings, and an in-process stand-in for ``workers.main`` that claims, runs and
completes slots through them, arena and lane alike, counting each in the worker table), ``LaneClient`` (a lane region driven
through ``lanes.ClientLane``) and ``build``, which wires them together the way
``shmserve.server`` does and takes them apart again.  For test modules: the fixtures ``make``
(import ``make_fixture``), ``no_processes`` and ``no_children_left`` (autouse where imported).

Must not: spawn a process, sleep, or reach into the dispatcher's private state (tests may; the
helpers use only what a door, a worker or the server uses).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
import mmap
import os
import select
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from shmserve import _atomics as atomics
from shmserve import lanes, layout, protocol, reservations, workerlink
from shmserve.arena import Arena, SlotConflict, transition_slot
from shmserve.config import ModelConfig
from shmserve.errors import ErrorCode
from shmserve.frontend.dispatcher import Dispatcher, Failure, Limits, Outputs
from shmserve.frontend.models import SERVING, ModelState, Models
from shmserve.frontend.regions import RegionTable
from shmserve.frontend.requests import Request, RequestState
from shmserve.rings import EventfdDoorbell, FutexDoorbell, Ring, drain_eventfd, new_eventfd
from shmserve.slotstate import Actor, SlotState
from shmserve.spec import ModelSpec, TensorSpec
from shmserve.supervisor import COMMAND_RETRY_S, READY, RESTARTING, STARTING, WorkerHandle, WorkerState

# -- no processes ---------------------------------------------------------------------------


def child_pids() -> set[int]:
    """The pids of this process's children, from /proc."""
    pids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return pids


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    """Any attempt to start a process fails the test (this layer runs none).  Autouse where imported."""
    def refuse(*args, **kwargs):
        raise AssertionError("the fast front-end tests must not start a process")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "execv", "execve"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)


@pytest.fixture(scope="module", autouse=True)
def no_children_left():
    """No child process is left after the module's tests.  Autouse where imported."""
    before = child_pids()
    yield
    assert child_pids() <= before, "a test of the fast layer left a child process behind"


@pytest.fixture(name="make")
def make_fixture(instance_name, request):
    """The fixture ``make``, ``make(**build_kw)``: fake front-ends, checked quiet after the test
    and taken apart (``frontend_factory``)."""
    yield from frontend_factory(instance_name, request)


def reachable(start, edges) -> set:
    """The states a transition table reaches from ``start``; ``edges``: (from, to) pairs."""
    edges, seen = list(edges), {start}
    while more := {to for frm, to in edges if frm in seen} - seen:
        seen |= more
    return seen


# -- the clock ------------------------------------------------------------------------------


class FakeHandle:
    """What ``call_later``/``call_soon`` return: ``cancel()`` stops it from running."""

    __slots__ = ("args", "callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable, args: tuple):
        self.when, self.callback, self.args, self.cancelled = when, callback, args, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A ``Clock`` whose time moves only in ``advance``; soon-callbacks run only in ``run_soon``."""

    def __init__(self, start: float = 1000.0):
        self.now = start
        self._timers: list[tuple[float, int, FakeHandle]] = []
        self._soon: collections.deque[FakeHandle] = collections.deque()
        self._seq = itertools.count()

    def monotonic(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable, *args) -> FakeHandle:
        handle = FakeHandle(self.now + delay, callback, args)
        heapq.heappush(self._timers, (handle.when, next(self._seq), handle))
        return handle

    def call_soon(self, callback: Callable, *args) -> FakeHandle:
        handle = FakeHandle(self.now, callback, args)
        self._soon.append(handle)
        return handle

    def advance(self, seconds: float) -> int:
        """Move time on by ``seconds``, running every timer that falls due, in order of its due
        time (and of scheduling, for equal times), at its due time; returns how many ran."""
        end, ran = self.now + seconds, 0
        while self._timers and self._timers[0][0] <= end:
            when, _, handle = heapq.heappop(self._timers)
            if handle.cancelled:
                continue
            self.now = max(self.now, when)
            handle.callback(*handle.args)
            ran += 1
        self.now = end
        return ran

    def run_soon(self, limit: int = 100) -> int:
        """Run queued soon-callbacks, those they queue included, up to ``limit`` of them (a polling
        loop re-queues itself for as long as time stands still); returns how many ran."""
        ran = 0
        while self._soon and ran < limit:
            handle = self._soon.popleft()
            if not handle.cancelled:
                handle.callback(*handle.args)
                ran += 1
        return ran

    @property
    def soon_pending(self) -> int:
        return sum(not h.cancelled for h in self._soon)

    @property
    def timers_pending(self) -> int:
        return sum(not h.cancelled for _, _, h in self._timers)


# -- models -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeModel:
    """A model as its workers report it, and what a fake worker computes for it."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    compute: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
    instances: int = 1
    max_output_bytes: int = 4096  # the most one output may take (and what is guessed for one no input sizes)
    check_dims: tuple[str, ...] = ()  # named dimensions its inputs must agree on

    def config(self) -> ModelConfig:
        return ModelConfig(name=self.name, backend="fake", path="fake", instances=self.instances,
                           max_output_bytes=self.max_output_bytes, check_dims=self.check_dims)

    def spec(self) -> ModelSpec:
        return ModelSpec(self.name, "fake", self.inputs, self.outputs, check_dims=self.check_dims)


ADD = FakeModel("add", (TensorSpec("x", "float32", ("n",)),), (TensorSpec("y", "float32", ("n",)),),
                lambda t: {"y": t["x"] + np.float32(1)})
PAIR = FakeModel("pair", (TensorSpec("a", "int32", (2, "k")), TensorSpec("b", "int32", (2, "k"))),
                 (TensorSpec("sum", "int32", (2, "k")), TensorSpec("diff", "int32", (2, "k"))),
                 lambda t: {"sum": t["a"] + t["b"], "diff": t["a"] - t["b"]}, check_dims=("k",))
# Its output has a dimension no input binds: the dispatcher guesses max_output_bytes for it.
TAIL = FakeModel("tail", (TensorSpec("x", "uint8", (None,)),), (TensorSpec("y", "uint8", (None,)),),
                 lambda t: {"y": t["x"][::-1].copy()}, max_output_bytes=1024)


# -- the front door ---------------------------------------------------------------------------


class FakeDoor:
    """A front door: one connection's requests, every call the dispatcher made on it, and the
    answers (outputs copied out of the arena once "written").

    ``receive_now``: receive an inline payload as soon as it is admitted (the Unix door does when
    the bytes are already buffered), else when the test calls ``receive``.  ``write_now``: write an
    ``in_arena`` answer as soon as it comes (an idle socket), else when the test calls ``write``.
    """

    def __init__(self, dispatcher: Dispatcher, *, receive_now: bool = True, write_now: bool = False):
        self.dispatcher = dispatcher
        self.receive_now, self.write_now = receive_now, write_now
        self.requests: list[Request] = []
        self.calls: list[tuple[str, Request]] = []  # ("waiting" | "admitted" | "answer", request), in order
        self.answers: dict[Request, object] = {}
        self.answer_order: list[Request] = []
        self.results: dict[Request, dict[str, np.ndarray]] = {}  # in_arena outputs, copied when written
        self.sinks: dict[Request, list[memoryview]] = {}
        self.payloads: dict[Request, bytes] = {}
        self.written: set[Request] = set()
        self.dropped: set[Request] = set()
        self.aborts: list[Exception] = []  # what ``abort`` was told, in order
        self._ids = itertools.count(1)

    # -- the dispatcher's Door ------------------------------------------------------------

    def in_flight(self) -> int:
        return sum(not self.finished(r) for r in self.requests)

    def waiting(self, req: Request) -> None:
        self._called("waiting", req)
        assert req.state is RequestState.WAITING, req.state

    def admitted(self, req: Request, sinks: list | None) -> None:
        self._called("admitted", req)
        if sinks is not None:
            assert req.state is RequestState.ADMITTED, req.state
            self.sinks[req] = sinks
            if self.receive_now:
                self.receive(req)

    def answer(self, req: Request, answer) -> None:
        assert req not in self.answers, f"request {req.id} answered twice: {self.answers[req]!r}, then {answer!r}"
        assert req not in self.dropped, f"request {req.id} answered after its door dropped it"
        assert req.answered, f"request {req.id} answered in state {req.state.name}"
        self._called("answer", req)
        self.answers[req] = answer
        self.answer_order.append(req)
        self._release_sinks(req)
        if self.write_now and self.holds_views(req):
            self.write(req)

    def abort(self, exc: Exception) -> None:
        """A method of this door raised: the connection ends.  Like a real transport, its end is
        noticed later: the test calls ``close`` (connection lost) when it chooses."""
        self.aborts.append(exc.with_traceback(None))  # its frames would keep views of the arena alive
        for req in list(self.sinks):  # an aborted transport receives nothing more
            self._release_sinks(req)

    def _called(self, what: str, req: Request) -> None:
        assert req in self.requests, f"{what} for request {req.id}, which this door did not submit"
        assert (what, req) not in self.calls, f"{what} called twice for request {req.id}"
        self.calls.append((what, req))

    # -- what a connection does -------------------------------------------------------------

    def infer(self, model: str, inputs: dict[str, np.ndarray], *, timeout_s: float | None = None,
              rid: int | None = None, payload: bytes | None = None, priority: int = 0) -> Request:
        """Submit and admit an inline request (its payload: the inputs' bytes, in order, unless
        ``payload`` says otherwise); returns it.  Raises the ShmserveError of a refusal."""
        meta = {"id": next(self._ids) if rid is None else rid, "model": model,
                "inputs": [{"name": n, "dtype": a.dtype.name, "shape": list(a.shape)} for n, a in inputs.items()]}
        if timeout_s is not None:
            meta["timeout_s"] = timeout_s
        if priority:
            meta["priority"] = priority
        parsed = protocol.parse_infer(meta, zero_copy=False)
        data = b"".join(np.ascontiguousarray(a).tobytes() for a in inputs.values()) if payload is None else payload
        req = self.dispatcher.submit(self, parsed, payload_bytes=len(data))
        self.requests.append(req)
        self.payloads[req] = data
        self.dispatcher.admit(req)
        return req

    def infer_region(self, regions: RegionTable, region_id: int, model: str, inputs: dict[str, tuple],
                     out_offset: int, out_capacity: int, *, timeout_s: float | None = None) -> Request:
        """Submit and admit a zero-copy request: ``inputs`` maps names to (offset, dtype, shape) in
        region ``region_id`` (looked up as this door's, as the Unix door does)."""
        meta = {"id": next(self._ids), "model": model, "region": region_id, "output_offset": out_offset,
                "output_capacity": out_capacity,
                "inputs": [{"name": n, "dtype": np.dtype(d).name, "shape": list(s), "offset": o}
                           for n, (o, d, s) in inputs.items()]}
        if timeout_s is not None:
            meta["timeout_s"] = timeout_s
        parsed = protocol.parse_infer(meta, zero_copy=True)
        req = self.dispatcher.submit(self, parsed, region=regions.get(self, region_id))
        self.requests.append(req)
        self.dispatcher.admit(req)
        return req

    def receive(self, req: Request) -> None:
        """The payload has arrived: copy it into the sinks, then tell the dispatcher."""
        data, pos = memoryview(self.payloads[req]), 0
        for sink in self.sinks[req]:
            sink[:] = data[pos:pos + len(sink)]
            pos += len(sink)
        assert pos == len(data), f"sinks hold {pos} bytes, the payload is {len(data)}"
        self._release_sinks(req)
        self.dispatcher.received(req)

    def write(self, req: Request) -> None:
        """The answer's views have been written out: keep a copy of them, release the request."""
        answer = self.answers[req]
        self.results[req] = {o.name: np.frombuffer(bytes(o.view), o.dtype).reshape(o.shape)
                             for o in answer.outputs}
        self._release_views(req)
        self.written.add(req)
        self.dispatcher.release(req)

    def write_all(self) -> None:
        for req in list(self.answers):
            if self.holds_views(req):
                self.write(req)

    def drop(self, req: Request) -> None:
        """The connection forgets ``req`` (as it does for each of them when it is lost)."""
        self._release_sinks(req)
        self._release_views(req)
        self.dropped.add(req)
        self.dispatcher.drop(req)

    def close(self) -> None:
        """The connection is lost: every request not yet written is dropped, in order."""
        for req in self.requests:
            if not self.finished(req):
                self.drop(req)

    # -- what tests ask -------------------------------------------------------------------

    def finished(self, req: Request) -> bool:
        """Written back (or needing no write), or dropped: no longer this door's in-flight."""
        return req in self.dropped or (req in self.answers and not self.holds_views(req))

    def holds_views(self, req: Request) -> bool:
        answer = self.answers.get(req)
        return isinstance(answer, Outputs) and answer.in_arena and req not in self.written and req not in self.dropped

    def answer_of(self, req: Request):
        return self.answers.get(req)

    def failure(self, req: Request) -> Failure:
        answer = self.answers.get(req)
        assert isinstance(answer, Failure), f"request {req.id}: expected a failure, got {answer!r}"
        return answer

    def result(self, req: Request) -> dict[str, np.ndarray]:
        """The outputs of an inline request, writing its answer first if it is not yet written."""
        answer = self.answers.get(req)
        assert isinstance(answer, Outputs), f"request {req.id}: expected outputs, got {answer!r}"
        if req not in self.results:
            self.write(req)
        return self.results[req]

    def calls_of(self, req: Request) -> list[str]:
        return [what for what, r in self.calls if r is req]

    def _release_sinks(self, req: Request) -> None:
        for view in self.sinks.pop(req, ()):
            view.release()

    def _release_views(self, req: Request) -> None:
        answer = self.answers.get(req)
        if isinstance(answer, Outputs):
            for o in answer.outputs:
                if o.view is not None:
                    o.view.release()

    def release_all_views(self) -> None:
        for req in list(self.sinks):
            self._release_sinks(req)
        for req in self.answers:
            self._release_views(req)


# -- the workers ------------------------------------------------------------------------------


@dataclass(eq=False, repr=False)
class _Space:
    """A slot table the fake worker serves: the arena's (``region`` 0) or a lane's."""

    buf: object
    geometry: object
    submissions: Ring
    completions: Ring
    outbox: object  # the doorbell that wakes whoever collects completions
    region: int = 0

    def __repr__(self) -> str:
        return "<arena>" if self.region == 0 else f"<lane {self.region}>"


@dataclass(eq=False)
class Job:
    """A slot the fake worker has claimed (RUNNING) and not finished."""

    space: _Space
    index: int
    generation: int

    @property
    def entry(self) -> int:
        return layout.slot_entry(self.index, self.generation)

    @property
    def lane(self) -> int:
        return self.space.region


class FakeWorker:
    """One worker: ``handle`` is the real ``WorkerHandle`` the dispatcher and region table use;
    the rest stands in for the worker process (``workers.main``), in-process and step by step.

    ``step`` claims and completes everything submitted; ``claim`` only claims (RUNNING) so that a
    test can ``complete`` or ``fail`` each job later, or let it time out.  Commands (lane attach,
    region drop) are carried out as they are read off the ring and kept in ``commands``.  Client
    regions arrive as the real worker's do: sealed memfds over a real control socketpair
    (``handle.control`` is the front-end's end), taken when a region id is not known yet.
    """

    def __init__(self, arena: Arena, index: int, model: FakeModel, efd: int, *, ready: bool = True):
        self.arena, self.model, self.index = arena, model, index
        sub, comp = Ring.of_worker(arena, index, False), Ring.of_worker(arena, index, True)
        self.handle = WorkerHandle(index, model.config(), sub, comp, FutexDoorbell(sub), EventfdDoorbell(comp, efd))
        # The worker process's own ends of the same rings.
        self._inbox = Ring.of_worker(arena, index, False)
        outbox_ring = Ring.of_worker(arena, index, True)
        self.main = _Space(arena.buf, arena.geometry, self._inbox, outbox_ring, EventfdDoorbell(outbox_ring, efd))
        self.lanes: dict[int, _Space] = {}
        self.maps: dict[int, mmap.mmap] = {}  # client regions, mapped on first use (RegionCache)
        self.given: dict[int, tuple[int, int]] = {}  # region -> (fd, size) received, not mapped yet
        self.handle.control, self._control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.commands: list[tuple[int, int]] = []  # (op, argument) in the order read
        self.skipped: list[tuple[int, int]] = []  # (index, generation) whose claim failed: taken back
        self._backlog: list[tuple[_Space, int]] = []
        self.dead = False
        if ready:
            self.report_ready()

    def __repr__(self) -> str:
        return f"<FakeWorker {self.index} {self.model.name} {self.handle.state}>"

    def report_ready(self) -> None:
        """What the supervisor does on a worker's "ready" message: its spec, then READY."""
        self.handle.spec = ModelSpec.from_dict(self.model.spec().to_dict())
        self.handle.set_state(READY)
        self.handle.error = None

    # -- reading the rings ----------------------------------------------------------------

    def gather(self) -> list[tuple[_Space, int]]:
        """Pop every submission (the worker's ring, then each lane's), carrying out commands as
        they come; slot entries a ``read_commands`` put aside come first."""
        assert not self.dead, "a dead worker reads nothing"
        work, self._backlog = self._backlog, []
        for entry in self._inbox.pop_all():
            if not layout.is_command(entry):
                work.append((self.main, entry))
                continue
            op, argument = layout.split_entry(entry)
            self.commands.append((op, argument))
            if op == layout.CMD_ATTACH_LANE:
                work.extend(self._attach_lane(argument))
            elif op == layout.CMD_DROP_REGION:
                self.lanes.pop(argument, None)
                self._unmap(argument)
                self.tell_dropped(argument)
        for lane in list(self.lanes.values()):
            work.extend((lane, entry) for entry in lane.submissions.pop_all())
        return work

    def read_commands(self) -> list[tuple[int, int]]:
        """Read the rings now and carry out the commands on them; slot entries wait for ``claim``.
        Returns every command read so far."""
        self._backlog = self.gather()
        return self.commands

    def _attach_lane(self, region: int) -> list[tuple[_Space, int]]:
        """Serve the lane, and the calls already queued in it (as ``workers.worker`` does)."""
        buf = self._map(region)
        if buf is None or not lanes.usable(len(buf)):
            return []
        submissions, completions, bell = lanes.worker_rings(buf)
        space = self.lanes[region] = _Space(buf, layout.LANE, submissions, completions, bell, region)
        return [(space, entry) for entry in lanes.queued_entries(buf)]

    def _map(self, region: int):
        if region == 0:
            return self.arena.buf
        if region not in self.maps:
            self._take_arrived()
            if region not in self.given:
                return None
            fd, size = self.given.pop(region)
            try:
                self.maps[region] = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        return self.maps[region]

    def _take_arrived(self) -> None:
        for region, size, fd in workerlink.receive_regions(self._control):
            self.given[region] = (fd, size)

    def _unmap(self, region: int) -> None:
        self._take_arrived()
        fd, _ = self.given.pop(region, (None, 0))
        if fd is not None:
            os.close(fd)
        m = self.maps.pop(region, None)
        if m is not None:
            m.close()

    # -- running --------------------------------------------------------------------------

    def claim(self) -> list[Job]:
        """READY -> RUNNING for every submitted slot; those taken back meanwhile go to ``skipped``."""
        jobs = []
        for space, entry in self.gather():
            index, generation = layout.split_entry(entry)
            try:
                transition_slot(space.buf, space.geometry, index, generation, SlotState.READY, SlotState.RUNNING,
                                Actor.WORKER)
            except SlotConflict:
                self.skipped.append((index, generation))
                continue
            layout.stamp(space.buf, space.geometry, index, "t_claimed", 1)
            jobs.append(Job(space, index, generation))
        return jobs

    def step(self) -> list[Job]:
        """Claim and complete everything submitted, in order; returns the jobs."""
        jobs = self.claim()
        for job in jobs:
            self.complete(job)
        return jobs

    def inputs(self, job: Job) -> dict[str, np.ndarray]:
        """Copies of a job's inputs, decoded and bounds-checked through ``layout``."""
        space, spec = job.space, self.model.spec()
        slot = layout.decode_slot_request(space.buf, space.geometry, job.index)
        out = {}
        for t in range(slot.n_inputs):
            region = layout.region_of_tensor(space.buf, space.geometry, job.index, t)
            target = self._map(region)
            sizes = {region: len(target)} if region else None
            d = layout.decode_tensor(space.buf, space.geometry, job.index, t, sizes)
            assert d.role == layout.ROLE_INPUT
            out[spec.inputs[d.name_index].name] = np.frombuffer(target, d.dtype, math.prod(d.shape),
                                                                d.offset).reshape(d.shape).copy()
        return out

    def complete(self, job: Job, outputs: dict[str, np.ndarray] | None = None, *, push: bool = True,
                 tamper: Callable | None = None) -> None:
        """Run the model on the job's inputs (or take ``outputs``), lay the outputs out in its output
        area the way ``workers.step.OutputPlacer`` does and publish DONE; if they do not fit, its
        short answer (ERROR OUTPUT_TOO_LARGE saying what they need, ``shmserve.reservations``).  ``push=False``: publish but die before pushing the completion.
        ``tamper(buf, geometry, index, first_output)`` rewrites descriptors before DONE."""
        space, spec = job.space, self.model.spec()
        slot = layout.decode_slot_request(space.buf, space.geometry, job.index)
        results = self.model.compute(self.inputs(job)) if outputs is None else outputs
        target = self._map(slot.out_region)
        placed, pos = [], 0
        arrays = [np.ascontiguousarray(results[t.name]) for t in spec.outputs]
        for arr in arrays:
            pos = layout.align_tensor(pos) + arr.nbytes
        if pos > slot.out_capacity:
            self.fail(job, ErrorCode.OUTPUT_TOO_LARGE, reservations.short_message(pos, slot.out_capacity), push=push)
            return
        pos = 0
        for i, arr in enumerate(arrays):
            pos = layout.align_tensor(pos)
            offset = slot.out_off + pos
            target[offset:offset + arr.nbytes] = arr.tobytes()
            placed.append((i, arr.dtype, arr.shape, offset))
            pos += arr.nbytes
        for i, dtype, shape, offset in placed:
            layout.encode_tensor(space.buf, space.geometry, job.index, slot.n_inputs + i, role=layout.ROLE_OUTPUT,
                                 name_index=i, dtype=dtype, shape=shape, offset=offset, region=slot.out_region)
        layout.set_n_outputs(space.buf, space.geometry, job.index, len(placed))
        if tamper is not None:
            tamper(space.buf, space.geometry, job.index, slot.n_inputs)
        self._publish(job, SlotState.DONE, push)

    def fail(self, job: Job, code: int, message: str, *, push: bool = True) -> None:
        """Publish ERROR with ``code`` and ``message`` (the backend raised)."""
        layout.encode_error(job.space.buf, job.space.geometry, job.index, code, message)
        layout.set_n_outputs(job.space.buf, job.space.geometry, job.index, 0)
        self._publish(job, SlotState.ERROR, push)

    def _publish(self, job: Job, state: SlotState, push: bool) -> None:
        space = job.space
        layout.stamp(space.buf, space.geometry, job.index, "t_done", 2)
        # Order matters here (as in the worker): outputs and descriptors before DONE.
        transition_slot(space.buf, space.geometry, job.index, job.generation, SlotState.RUNNING, state, Actor.WORKER)
        entry = self.arena.geometry.worker_off(self.index)  # counted after DONE, as the worker does
        atomics.fetch_add64(self.arena.buf, entry + layout.WORKER.offset("requests"), 1)
        if state is SlotState.ERROR:
            atomics.fetch_add64(self.arena.buf, entry + layout.WORKER.offset("errors"), 1)
        if push:
            space.completions.push(job.entry)
            space.outbox.notify()

    # -- life -----------------------------------------------------------------------------

    def die(self) -> None:
        """The process is gone: its mappings and descriptors with it, and nothing more is read or
        written.  Its control socket is a new one when it comes back (``revive``)."""
        self.dead = True
        self.lanes.clear()
        self._backlog = []
        self.close()
        self.handle.control = None

    def revive(self) -> None:
        """A new incarnation: a new control socket, nothing mapped."""
        self.dead = False
        self.handle.control, self._control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def bell_count(self) -> int:
        """How often the front-end has rung this worker's submission doorbell."""
        return atomics.load32(self.arena.buf, self.handle.submissions.seq_offset)

    def close(self) -> None:
        self.lanes.clear()
        for region in list(self.maps) + list(self.given):
            self._unmap(region)
        for sock in (self.handle.control, self._control):
            if sock is not None:
                sock.close()


# -- a lane's client --------------------------------------------------------------------------


class LaneClient:
    """A client's lane of ``model``: the region opened for ``owner`` through the region table, mapped
    as the client maps it, and its ``ClientLane``.  Calls take one input at ``lanes.DATA_FLOOR``."""

    def __init__(self, regions: RegionTable, owner, model: str, size: int = 8192):
        self.region = regions.open(owner, size, model)
        self.buf = mmap.mmap(self.region.fd, self.region.size)
        self.lane = lanes.ClientLane(self.buf, self.region.id, model)
        self.out_offset = lanes.DATA_FLOOR + size // 2
        self.out_capacity = size // 2

    def header(self):
        return layout.LANE_HEADER.read(self.buf, 0)

    def submit(self, x: np.ndarray, request_id: int = 1) -> tuple[int, int]:
        """Write ``x`` into the data space and publish a call; returns (slot, generation)."""
        data = np.ascontiguousarray(x)
        self.buf[lanes.DATA_FLOOR:lanes.DATA_FLOOR + data.nbytes] = data.tobytes()
        view = np.ndarray(data.shape, data.dtype, buffer=self.buf, offset=lanes.DATA_FLOOR)
        try:
            return self.lane.submit(request_id, 0, [(0, lanes.DATA_FLOOR, view)], self.out_offset, self.out_capacity)
        finally:
            del view

    def read(self, index: int, generation: int) -> dict[int, np.ndarray]:
        """The call's outputs, copied (raises its ShmserveError); frees its slot."""
        placed = self.lane.read(index, generation, self.out_offset, self.out_capacity)
        return {i: np.frombuffer(self.buf, dtype, math.prod(shape), offset).reshape(shape).copy()
                for i, (dtype, shape, offset) in placed.items()}

    def close(self) -> None:
        self.lane = None
        self.buf.close()


# -- the whole front-end ------------------------------------------------------------------------

SMALL_CLASSES = ((4096, 4), (65536, 2))
DEFAULT_LIMITS = Limits(request_timeout_s=5.0, max_waiting=3, max_request_bytes=65536, max_inflight_per_door=8)


@dataclass(eq=False)
class FakeFrontend:
    """The parts ``shmserve.server.Frontend`` wires together, over one real arena."""

    arena: Arena
    models: dict[str, ModelState]
    workers: list[FakeWorker]
    dispatcher: Dispatcher
    regions: RegionTable
    clock: FakeClock
    efd: int
    doors: list[FakeDoor] = field(default_factory=list)
    closed: bool = False

    def door(self, **kw) -> FakeDoor:
        door = FakeDoor(self.dispatcher, **kw)
        self.doors.append(door)
        return door

    def command(self, w: WorkerHandle, entry: int) -> None:
        """``Supervisor.command``: push on the worker's ring and ring it, or try again a moment later
        (COMMAND_RETRY_S) if the ring is full; dropped for a dead worker."""
        if self.workers[w.index].dead or w.state not in (STARTING, READY, RESTARTING):
            return
        if w.submissions.push(entry):
            w.doorbell.notify()
        else:
            self.clock.call_later(COMMAND_RETRY_S, self.command, w, entry)

    def deliver(self) -> bool:
        """What the server does when the completion eventfd is readable: drain it and collect.
        Returns whether it was readable (False: no worker rang since the last collection)."""
        readable, _, _ = select.select([self.efd], [], [], 0)
        if not readable:
            return False
        drain_eventfd(self.efd)
        self.dispatcher.on_completions()
        return True

    def kill(self, worker: FakeWorker, how: str = "killed by SIGKILL", state: WorkerState = RESTARTING) -> None:
        """A worker died: the supervisor moves it on (RESTARTING; STOPPED at shutdown), then the
        server tells the dispatcher and the region table (``Frontend._worker_exited``, in its order)."""
        worker.die()
        worker.handle.set_state(state)
        self.dispatcher.worker_exited(worker.handle, how)
        self.regions.worker_lost(worker.handle, how)

    def restart(self, worker: FakeWorker) -> None:
        """A new incarnation reports ready (``Frontend._worker_ready``)."""
        worker.revive()
        worker.report_ready()
        self.regions.attach_waiting(self.models.version_of(worker.handle))
        self.dispatcher.worker_ready(worker.handle)

    def settle(self, rounds: int = 50) -> None:
        """Let everything run its course: payloads received, submissions run, completions
        collected, answers written, until nothing moves.  Jobs a test claimed stay with it."""
        for _ in range(rounds):
            progress = self.pump_doors()
            for w in self.workers:
                if not w.dead and w.step():
                    progress = True
            answers = sum(len(door.answers) for door in self.doors)
            self.collect()
            if sum(len(door.answers) for door in self.doors) != answers:
                progress = True
            if not progress:
                return
        raise AssertionError(f"the front-end did not settle in {rounds} rounds")

    def pump_doors(self) -> bool:
        """Every door receives the payloads it was given sinks for and writes the answers whose views
        it holds; whether any did."""
        moved = False
        for door in self.doors:
            for req in list(door.sinks):
                door.receive(req)
                moved = True
            for req in list(door.answers):
                if door.holds_views(req):
                    door.write(req)
                    moved = True
        return moved

    def collect(self) -> None:
        """Collect every completion (the eventfd's wake-up, or a look if polling disarmed it)."""
        if not self.deliver():
            self.dispatcher.on_completions()

    def problems(self) -> list[str]:
        """Everything a quiet front-end must not hold: slots and extents (by the arena's counters, the
        allocators and the slot table), requests pending or waiting, live timers, worker in-flight
        sets; and every request its doors got must be DONE and answered (unless dropped)."""
        d, arena, found = self.dispatcher, self.arena, []
        checks = {
            "arena slots_in_use": arena.stat("slots_in_use"),
            "arena extent_bytes_in_use": arena.stat("extent_bytes_in_use"),
            "slot pool in use": d.slots.in_use,
            "extent bytes in use": d.extents.bytes_in_use,
            "pending requests": len(d.pending),
            "waiting requests": len(d.waiting),
            "parked requests": sum(map(len, d.parked.values())),
            "live timers": self.clock.timers_pending,
        }
        found += [f"{what}: {value}" for what, value in checks.items() if value]
        busy = [(i, layout.unpack_status(atomics.load64(arena.buf, arena.geometry.slot_off(i))))
                for i in range(arena.geometry.slot_count)]
        found += [f"slot {i} is {SlotState(s).name} (generation {g})" for i, (g, s) in busy if s != SlotState.FREE]
        found += [f"worker {w.index} has slots {sorted(w.handle.inflight)} in flight" for w in self.workers
                  if w.handle.inflight]
        for door in self.doors:
            found += [f"request {r.id} is {r.state.name}" for r in door.requests if r.state is not RequestState.DONE]
            found += [f"request {r.id} was never answered" for r in door.requests
                      if r not in door.answers and r not in door.dropped]
        return found

    def close(self) -> None:
        """Take everything apart, the server's way round; every step is tried even if one fails
        (the arena is unlinked whatever happens), then the first failure is raised: BufferError
        from the arena means a view of it is still alive somewhere.  Idempotent."""
        if self.closed:
            return
        self.closed = True
        steps = [*(door.release_all_views for door in self.doors), self.dispatcher.view.release,
                 *(w.close for w in self.workers), self.regions.close_all, lambda: os.close(self.efd),
                 self.arena.unlink, self.arena.close]
        failure = None
        for step in steps:
            try:
                step()
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure


def build(instance: str, *, models: tuple[FakeModel, ...] = (ADD,), slot_count: int = 4,
          size_classes=SMALL_CLASSES, limits: Limits = DEFAULT_LIMITS, max_workers: int = 0,
          **limit_changes) -> FakeFrontend:
    """A front-end of ``models`` (each with ``instances`` fake workers, all READY) over a small new
    arena of ``instance`` with room for ``max_workers`` workers (at least those); ``limit_changes``
    replace fields of ``limits``.  Close it when done."""
    n_workers = sum(m.instances for m in models)
    arena = Arena.create(instance, slot_count=slot_count, max_workers=max(n_workers, max_workers, 1),
                         size_classes=size_classes, prefault=False)
    efd = None
    try:
        efd = new_eventfd()
        states = Models()
        for m in models:
            model = states.model(m.name)
            model.versions[1] = ModelState(model.index, m.name, m.config(), phase=SERVING)
            model.default = 1
        workers = []
        for m in models:
            for _ in range(m.instances):
                w = FakeWorker(arena, len(workers), m, efd)
                workers.append(w)
                states.get(m.name).versions[1].workers.append(w.handle)
                w.handle.completion_bell.arm()  # the loop is idle: the first completion must wake it
        clock = FakeClock()
        limits = dataclasses.replace(limits, **limit_changes)
        fe = FakeFrontend(arena, states, workers, None, None, clock, efd)
        fe.regions = RegionTable(arena, states, fe.command, max_request_bytes=limits.max_request_bytes, cpus=2)
        for w in workers:
            w.tell_dropped = lambda region, handle=w.handle: fe.regions.worker_dropped(handle, region)
        fe.dispatcher = Dispatcher(arena, states, [w.handle for w in workers], limits, clock, fe.regions.deliver)
        return fe
    except BaseException:
        if efd is not None:
            os.close(efd)
        arena.unlink()
        arena.close()
        raise


def frontend_factory(instance_name, request):
    """The body of a pytest fixture yielding ``make(**build_kw)``: each front-end made must be quiet
    after the test (unless the test failed or is an expected failure, whose state is no evidence)
    and each is taken apart, even after a failure."""
    made = []
    failed_before = request.session.testsfailed

    def make(**kw) -> FakeFrontend:
        fe = build(instance_name("fd"), **kw)
        made.append(fe)
        return fe

    yield make
    check = request.session.testsfailed == failed_before and request.node.get_closest_marker("xfail") is None
    problems, errors = [], []
    for fe in made:
        if check:
            problems += fe.problems()
        try:
            fe.close()
        except Exception as exc:  # a view of the arena left alive: still close the others
            errors.append(exc)
    assert not problems, problems
    assert not errors, errors
