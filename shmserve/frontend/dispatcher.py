"""The dispatcher: every inference request from admission to release, whichever front door it came by.

Owns: the arena's slots and data extents (``SlotPool``, ``ExtentAllocator``),
admission (space now, or a bounded wait for it), the input descriptors and
publication of a request to the least-loaded ready worker of its model,
waiting for a worker while all of a model's workers restart (*parked*
requests), a request run again once with the output space its worker's
short answer said it needs (``shmserve.reservations``; counted in
``reruns``), completions (an eventfd wake-up, then bounded polling while requests are in
flight), deadlines, the one answer every request gets, and what an answer
holds until its front door is done with it.  A request's life follows the
table in ``shmserve.frontend.requests``.

Front doors (the Unix socket's native protocol today; KServe v2 over HTTP and
gRPC next) plug in through one small interface: per connection, an object
with the ``Door`` methods, and six calls into the dispatcher — ``submit``
(check), ``admit`` (take space), ``received`` (payload landed), ``release``
(an answer's views written), ``drop`` (the connection is gone) and ``cancel`` (its caller gave
up; the connection stays: it is answered CANCELLED).  Both count where the request was
(``cancelled``, CANCEL_STAGES): one taken back before a worker claimed it never runs.  The
dispatcher knows nothing of sockets or wire formats: answers are typed values (``Outputs`` or
``Failure``).  Whatever a door does, the dispatcher releases what a request holds: a door method that raises has its connection
ended (``Door.abort``) and the request dropped, and a completion whose collection raises is
answered INTERNAL, the rest of its drain collected as usual.

Recovery: a request for a model whose workers are all restarting waits for
one (parked, per model, in arrival order; its deadline runs): before
admission it holds nothing and, with those waiting for space, counts against
``max_waiting``; after admission (its payload in) it holds its slot and
extent.  A worker's death fails only what it had claimed (RUNNING): what
still lay unclaimed on its ring (READY: nothing of it ran) goes to another
ready worker of the model, or is parked too.  A model whose workers failed
for good (they cannot load it) answers MODEL_UNAVAILABLE, parked requests
included.

Scheduling (issue 29): every request's slot carries what its worker orders
it by (``shmserve.scheduling``): its priority level (the client's, 0 or one
above its model's ``priority_levels`` written as 0: the model's default
level), a caller key its door assigned (``Door.caller_key``: per connection,
never chosen by a client; 0: unknown) and its deadline on CLOCK_MONOTONIC ns
(a worker never starts a request past it), flagged SLOT_FLAG_OWN_TIMEOUT
when the client set its own timeout.  A model version's
``max_queue_size`` bounds its requests waiting for its workers (published
and not yet claimed, and parked): one more is refused OVERLOADED at
``submit``, before its payload is received.

Data path (the copies are the product): an inline request's inputs are
received by its door straight into arena space (``Door.admitted`` hands it
views of the extent), and its outputs are answered as views of the arena
(``Outputs.in_arena``) that the door writes out before it calls ``release``.

Must not: touch a socket or parse bytes, block the loop (timers and polling go
through a ``Clock``), compute an offset (``shmserve.layout``), or decide
anything about lanes (``shmserve.frontend.regions``).
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import time
import traceback
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

from shmserve import layout, reservations
from shmserve.allocator import ExtentAllocator, SlotPool
from shmserve.arena import Arena, SlotConflict
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.models import EVICTED, SERVING, UNLOADED, ModelState, Models
from shmserve.frontend.regions import Region, check_request
from shmserve.frontend.requests import Event, Request, RequestState
from shmserve.protocol import InferRequest
from shmserve.slotstate import FINISHED, Actor, SlotState
from shmserve.spec import bind_inputs
from shmserve.supervisor import WorkerHandle

log = logging.getLogger("shmserve.dispatcher")

_READY = int(SlotState.READY)
_ERROR = int(SlotState.ERROR)
_FREE = int(SlotState.FREE)

# Where a request was when its caller gave up (``Dispatcher.cancelled``): before a worker claimed it
# (waiting, receiving, parked, or READY and taken back: no worker runs it), while a worker ran it
# (answered at once, its slot freed when the worker finishes, its outputs never read), or once its
# answer was ready (being written to its door: nothing to save).
CANCEL_STAGES = ("queued", "running", "answered")


def _size(nbytes: int) -> str:
    """Bytes as people read them in a refusal: '64 MiB', '1.50 MiB', '9000 bytes'."""
    if nbytes >= 1 << 20:
        return f"{nbytes >> 20} MiB" if nbytes % (1 << 20) == 0 else f"{nbytes / (1 << 20):.2f} MiB"
    return f"{nbytes} bytes"


# -- what front doors see -------------------------------------------------------------------

# Answers are tuples (NamedTuple): one or two are made per request, so they must be cheap.

class Output(NamedTuple):
    """One output tensor of a result.  ``offset``: where it lies in the request's region
    (zero-copy) or the arena (inline); ``view``: inline only, the bytes, a view of the arena."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    view: memoryview | None = None


class Outputs(NamedTuple):
    """A request's result.  ``in_arena``: the outputs are views of the arena, held until the door
    calls ``Dispatcher.release``; otherwise they lie in the client's own region."""

    outputs: tuple[Output, ...]
    in_arena: bool


class Failure(NamedTuple):
    """A request's error: a stable code and a message for people."""

    code: ErrorCode
    message: str


Answer = Outputs | Failure


class Door(Protocol):
    """What a front door provides for each request it submits (one object per connection).

    The dispatcher calls, for every request: at most one ``waiting``, at most one
    ``admitted``, and exactly one ``answer`` (unless the door told it, with ``drop``, that
    nobody is left to answer).

    A method that raises is a broken door: the dispatcher calls its ``abort`` and drops the
    request, whatever state it was in (``Dispatcher._door_raised``), so no exception of a door
    can leak a slot, an extent or a place in a queue, nor reach the completion loop.

    ``caller_key``: the key its requests are scheduled under for fairness between callers of one
    model (``new_caller``: one per connection, or per peer), never chosen by a client; a door
    without one is caller 0 (unknown).  (Not ``caller``: the Unix door's ``caller()`` is who its
    peer is for rate limits.)
    """

    caller_key: int

    def in_flight(self) -> int:
        """Requests submitted through this door and not yet written back (the per-door limit)."""

    def waiting(self, req: Request) -> None:
        """No arena space yet, or no ready worker of its model: stop reading (the request's payload
        stays in the socket) until ``admitted`` or ``answer``."""

    def admitted(self, req: Request, sinks: list | None) -> None:
        """Arena space is held for ``req``.  With ``sinks`` (inline, with input bytes): receive its
        payload into them, in order, then call ``Dispatcher.received``.  Without (zero-copy, or
        empty inputs): it needs nothing more from the door (published, or parked for a worker).
        The door may read again either way."""

    def answer(self, req: Request, answer: Answer) -> None:
        """``req``'s one answer.  If it is ``Outputs`` with ``in_arena``, call
        ``Dispatcher.release(req)`` once its views are written (or never will be).  If ``req``'s
        payload was never received, the door skips it."""

    def abort(self, exc: Exception) -> None:
        """One of this door's methods raised ``exc``: end its connection now.  Once this returns,
        nothing of the door reads or writes arena space it was given (sinks, answer views: a
        transport aborted drops what it had not sent); its requests are dropped as when the
        connection is lost (now or later), and a caller it can still answer is answered.  The
        dispatcher then drops the request the raise was about.  Must not raise."""


_callers = itertools.count(1)


def new_caller() -> int:
    """A caller key for a new connection (``Door.caller_key``): nonzero, fits a slot's u32, and
    reused only after 2**32 - 1 others."""
    return next(_callers) % 0xFFFF_FFFF + 1


class Clock(Protocol):
    """Time and timers (the event loop in the server; a fake in tests)."""

    def monotonic(self) -> float: ...

    def call_later(self, delay: float, callback: Callable, *args): ...  # returns a handle with cancel()

    def call_soon(self, callback: Callable, *args): ...


class LoopClock:
    """A ``Clock`` over an asyncio loop."""

    def __init__(self, loop):
        self.loop = loop
        self.monotonic = time.monotonic  # deadlines are turned into delays, so any monotonic clock does
        self.call_later, self.call_soon = loop.call_later, loop.call_soon


@dataclass
class Limits:
    """What the dispatcher enforces; the server replaces it on reload."""

    request_timeout_s: float  # the longest a request may take, whatever the client asks
    max_waiting: int  # requests waiting for arena space or for a worker before 'overloaded'
    max_request_bytes: int  # arena bytes one inline request may take (inputs and outputs)
    max_inflight_per_door: int  # requests one front-door connection may have in flight
    spin_s: float = 0.0  # poll completion rings this long after the last completion before sleeping


def output_array(output: Output):
    """A copy of an inline output as a numpy array (a bytes output: an object array of bytes).
    LayoutError if its bytes do not make one."""
    return layout.array_from_bytes(output.view if output.nbytes else b"", output.dtype, output.shape)


# -- the dispatcher -------------------------------------------------------------------------

class Dispatcher:
    """Requests of every front door, from ``submit`` to release.

    ``models`` are the served models and their versions; ``workers`` are all worker handles
    (their rings and in-flight sets; the supervisor adds and removes them); ``deliver(worker, region)`` passes a zero-copy request's region to
    the worker chosen for it (``RegionTable.deliver``).  The server calls ``on_completions`` when the completion eventfd
    is readable, ``worker_ready``/``worker_exited`` from the supervisor, and the shutdown
    methods in order.
    """

    def __init__(self, arena: Arena, models: Models, workers: list[WorkerHandle], limits: Limits,
                 clock: Clock, deliver: Callable[[WorkerHandle, Region], tuple[ErrorCode, str] | None]):
        self.arena, self.models, self.workers, self.limits, self.clock = arena, models, workers, limits, clock
        self.deliver = deliver  # RegionTable.deliver: a zero-copy request's region goes to its worker first
        self.buf, self.geometry = arena.buf, arena.geometry
        self.view = memoryview(arena.buf)
        self.slots = SlotPool(self.geometry.slot_count)
        self.extents = ExtentAllocator(self.geometry)
        self.pending: dict[int, Request] = {}  # slot -> request a worker has or may still touch
        self.waiting: collections.deque[Request] = collections.deque()  # for arena space, in arrival order
        # Per version: requests waiting for a ready worker (WAITING, ADMITTED or QUEUED; see the header).
        self.parked: collections.defaultdict[ModelState, collections.deque[Request]] = \
            collections.defaultdict(collections.deque)
        # (model, version ("" before one was chosen), "ok" | error code) -> answers
        self.outcomes: collections.Counter = collections.Counter()
        # Hooks of the model lifecycle (the server wires them): a version loaded on demand is asked
        # for (``load_on_demand``), and every request that ran is reported (``observe``: canary analysis).
        self.load_on_demand: Callable[[ModelState], None] = lambda version: None
        self.observe: Callable[[Request, bool], None] | None = None
        # Canary shadow mode (``shmserve.frontend.shadow``): every inline request that finished with
        # outputs, while it still holds them, is offered for a copy to a candidate.
        self.offer_shadow: Callable[[Request, Outputs], None] = lambda req, outputs: None
        self.draw = random.random  # uniform [0, 1) for a canary's split
        self.door_faults = 0  # door methods that raised (``_door_raised``)
        self.reruns: collections.Counter = collections.Counter()  # version key -> requests run again (short answers)
        # (model, version, stage) -> requests whose caller gave up (``drop``, ``cancel``): CANCEL_STAGES
        self.cancelled: collections.Counter = collections.Counter()
        self.stopping = False
        self._monotonic_clock = clock.monotonic is time.monotonic  # its times are CLOCK_MONOTONIC seconds
        self._polling = False
        self._poll_until = 0.0

    @property
    def max_request(self) -> int:
        """The largest inline request (inputs and outputs) that is admitted."""
        return min(self.limits.max_request_bytes, self.extents.largest)

    # -- front doors ----------------------------------------------------------------------

    def submit(self, door: Door, parsed: InferRequest, *, payload_bytes: int = 0,
               region: Region | None = None) -> Request:
        """Check a request from ``door`` against its model and the limits; returns it (NEW), to be
        passed to ``admit`` once the door has noted it.

        ``payload_bytes``: the inline payload the door holds for it.  ``region``: the door's
        region named by a zero-copy request (``parsed.region``), None if it has none.  Raises
        ShmserveError — the request is refused, holds nothing, and the door answers it — with
        UNKNOWN_MODEL (no such model or loaded version), SHUTTING_DOWN, MODEL_UNAVAILABLE (its
        workers cannot load it, or the version is draining or unloaded; a version that is only
        restarting or loading is waited for — one never loaded yet, loaded on demand, is checked
        against its spec once loaded),
        BAD_INPUT/BAD_DTYPE/BAD_SHAPE, BAD_REGION, BAD_FRAME (payload size), TOO_LARGE, or
        OVERLOADED (the door's limit).
        """
        try:
            model = self.models.resolve(parsed.model, parsed.version, parsed.key, self.draw())
            return self._check(door, parsed, model, payload_bytes, region)
        except ShmserveError as exc:
            self.refused(parsed.model, exc.code, exc.message)
            raise

    def admit(self, req: Request) -> None:
        """Give a submitted request arena space now (``Door.admitted``), or queue it
        (``Door.waiting``) for space or, while all its model's workers restart, for a ready worker;
        past ``max_waiting`` waiting requests it is answered OVERLOADED."""
        if req.unchecked is not None or self._route(req) is None:
            what = "is loading" if req.model.phase != SERVING else "is restarting"
            self._wait(req, self.parked[req.model], f"model {req.model.name!r} {what}")
            return
        if not self.waiting and self._allocate(req):
            self.arena.add_stat("bytes_in", req.in_bytes)
            self._admit(req)
            return
        self._wait(req, self.waiting, "arena full")

    def _wait(self, req: Request, queue: collections.deque, why: str) -> None:
        # Those not admitted yet: what is admitted is bounded by the arena's slots.
        waiting = len(self.waiting) + sum(r.state is RequestState.WAITING for q in self.parked.values() for r in q)
        if waiting >= self.limits.max_waiting:
            self._end(req, Failure(ErrorCode.OVERLOADED, f"{why} and {waiting} requests waiting "
                                                         f"(server.max_waiting = {self.limits.max_waiting})"))
            return
        self.arena.add_stat("bytes_in", req.in_bytes)
        req.advance(Event.WAIT)
        self._arm_deadline(req)
        queue.append(req)
        try:
            req.door.waiting(req)
        except Exception as exc:
            self._door_raised(req, "waiting", exc)

    def _check(self, door: Door, parsed: InferRequest, model: ModelState, payload_bytes: int,
               region: Region | None) -> Request:
        limit = self.limits.request_timeout_s
        timeout = min(parsed.timeout_s or limit, limit)
        if self.stopping:
            raise ShmserveError(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        if door.in_flight() >= self.limits.max_inflight_per_door:
            raise ShmserveError(ErrorCode.OVERLOADED, f"{self.limits.max_inflight_per_door} requests in flight on "
                                                      f"this connection (server.max_inflight_per_connection)")
        limit = model.config.max_queue_size
        # (what its workers hold bounds it from above: each slot is looked at only near the limit)
        if limit and len(self.parked.get(model) or ()) + sum(len(w.inflight) for w in model.workers) >= limit:
            queued = self.queued_for_workers(model)
            if queued >= limit:
                raise ShmserveError(ErrorCode.OVERLOADED, f"model {model.name!r} has {queued} requests waiting for "
                                                          f"its workers, its default_queue_policy's max_queue_size "
                                                          f"({limit}): retry later, or raise max_queue_size")
        now = self.clock.monotonic()
        sched = {"priority": parsed.priority, "caller": getattr(door, "caller_key", 0),
                 "own_timeout": parsed.timeout_s is not None}
        if model.phase in (EVICTED, UNLOADED):  # loaded on demand (Models.resolve let only such through)
            self.load_on_demand(model)
        if model.spec is None or not model.waitable:
            if not model.waitable:
                raise ShmserveError(ErrorCode.MODEL_UNAVAILABLE, model.unavailable_reason())
            # Never loaded yet: its inputs are checked once it is (the door stops reading meanwhile).
            if parsed.region is not None and region is None:
                raise ShmserveError(ErrorCode.BAD_REGION, f"region {parsed.region} is not open on this connection")
            model.last_used = now
            return Request(door, parsed.id, model, parsed.inputs, timeout, deadline=now + timeout, started=now,
                           named_version=parsed.version is not None, unchecked=(parsed, payload_bytes, region),
                           **sched)
        req = Request(door, parsed.id, model, parsed.inputs, timeout, deadline=now + timeout, started=now,
                      named_version=parsed.version is not None, **sched)
        self._check_inputs(req, parsed, payload_bytes, region)
        model.last_used = now
        return req

    def queued_for_workers(self, version: ModelState) -> int:
        """``version``'s requests waiting for its workers: on their rings and not yet claimed (READY),
        and parked (waiting for a ready worker).  What ``max_queue_size`` bounds."""
        status, ready = self.arena.slot_status, _READY
        count = len(self.parked.get(version) or ())
        for w in version.workers:
            for index in w.inflight:
                count += status(index)[1] == ready
        return count

    def _check_inputs(self, req: Request, parsed: InferRequest, payload_bytes: int, region: Region | None) -> None:
        """Check ``req``'s inputs against its version's spec and its size against the limits
        (ShmserveError as ``submit`` says)."""
        model = req.model
        spec = model.spec
        symbols = bind_inputs(spec, parsed.inputs)
        if parsed.region is not None:
            if region is None:
                raise ShmserveError(ErrorCode.BAD_REGION, f"region {parsed.region} is not open on this connection")
            check_request(region, parsed.inputs, parsed.output_offset, parsed.output_capacity)
            req.region, req.out_offset, req.out_capacity = region, parsed.output_offset, parsed.output_capacity
        in_bytes = req.in_bytes = sum(t.nbytes for t in parsed.inputs)
        if parsed.region is None:
            if payload_bytes != in_bytes:
                raise ShmserveError(ErrorCode.BAD_FRAME, f"payload is {payload_bytes} bytes, inputs need {in_bytes}")
            padded = sum(layout.align_tensor(t.nbytes) for t in parsed.inputs)
            outputs, exact = reservations.reserve(spec, symbols, model.config.max_output_bytes)
            if not exact:  # a guess: at least what calls of this signature were seen to need
                req.signature = tuple((t.name, t.dtype, t.shape) for t in parsed.inputs)
                outputs = max(outputs, model.learned.get(req.signature))
            req.total_bytes = padded + outputs
            if req.total_bytes > self.max_request:
                raise ShmserveError(ErrorCode.TOO_LARGE, self._too_large(req.total_bytes, in_bytes))

    def _too_large(self, total: int, in_bytes: int) -> str:
        """Why a request of ``total`` arena bytes (``in_bytes`` of inputs) is refused, naming the
        config key that limits it: max_request_bytes, or the arena's largest size class."""
        needs = f"request needs {_size(total)}"
        detail = f"inputs {_size(in_bytes)}, the rest reserved for outputs"
        if self.limits.max_request_bytes <= self.extents.largest:
            return (f"{needs} > max_request_bytes ({_size(self.limits.max_request_bytes)}): raise [server] "
                    f"max_request_bytes (server.max_request_bytes; {detail})")
        return (f"{needs} > the arena's largest extent ({_size(self.extents.largest)}): raise the largest of "
                f"[arena] size_classes (arena.size_classes; {detail})")

    def received(self, req: Request) -> None:
        """The door has received ``req``'s payload into the sinks it was given: publish it."""
        if req.state is RequestState.ADMITTED:
            self._publish(req)

    def release(self, req: Request) -> None:
        """The door is done with the views of an ``in_arena`` answer (written, or its connection
        is gone): free its slot and extent."""
        if req.state is RequestState.FLUSHING:
            req.advance(Event.RELEASE)
            self._free(req)

    def drop(self, req: Request, *, cancelled: bool = True) -> None:
        """``req``'s door is gone: nobody is left to answer.  What it holds is freed now, or when
        its worker finishes with it.  ``cancelled``: its caller gave up (a closed connection, a
        cancelled call), counted in ``cancelled`` by where it was (CANCEL_STAGES); False when the
        server ended it (an upload past its deadline, a door that raised)."""
        stage = self._drop(req)
        if cancelled and stage is not None:
            self._count_cancel(req, stage)

    def cancel(self, req: Request) -> None:
        """``req``'s caller gave up on it, and its door is still there (a CANCEL frame): it is
        answered CANCELLED and what it holds freed now if no worker has claimed it; one a worker
        runs is answered CANCELLED at once and its slot freed when the worker finishes (its outputs
        are never read); one already answered keeps its answer.  Counted in ``cancelled``.  The
        door must not cancel a request still receiving its payload (ADMITTED, not parked): it would
        land in freed space; its deadline ends it."""
        state = req.state
        if state is RequestState.FLUSHING:
            self._count_cancel(req, "answered")
            return
        failure = Failure(ErrorCode.CANCELLED, "cancelled by the client")
        if self._unpark(req):
            self._count_cancel(req, "queued")
            self._answer_unclaimed(req, failure)
            self._admit_waiting()
        elif state is RequestState.WAITING:
            self.waiting.remove(req)
            self._count_cancel(req, "queued")
            self._end(req, failure)
            self._admit_waiting()
        elif state is RequestState.QUEUED:
            if self._take_back(req):
                self._count_cancel(req, "queued")
                self._end(req, failure)
                return
            generation, slot_state = self.arena.slot_status(req.slot)
            if generation == req.generation and slot_state in FINISHED:  # its answer is ready: it stands
                self._count_cancel(req, "answered")
                self._complete(req.worker, req.slot, generation)
                return
            self._count_cancel(req, "running")
            self._abandon(req, failure)

    def _count_cancel(self, req: Request, stage: str) -> None:
        if req.shadow is None:  # a canary's shadow copy is the server's, not a caller's
            self.cancelled[(req.model.name, req.model.version, stage)] += 1

    def _drop(self, req: Request) -> str | None:
        """``drop``'s work; the CANCEL_STAGES stage ``req`` was dropped at, None if it was
        answered already (timed out, failed) and held nothing a caller waits for."""
        self._cancel_timer(req)
        parked = self._unpark(req)
        state = req.state
        if state is RequestState.WAITING:
            if not parked:
                self.waiting.remove(req)
            req.advance(Event.END)
            self._admit_waiting()
        elif state is RequestState.ADMITTED:
            req.advance(Event.END)
            self._free(req)
        elif state is RequestState.QUEUED:
            if self._take_back(req):  # not claimed yet (always so when parked): nobody will want its result
                req.advance(Event.END)
                self._free(req)
            else:
                req.advance(Event.ABANDON)  # the worker has it: freed on completion
                return "running"
        elif state is RequestState.FLUSHING:
            self.release(req)
            return "answered"
        elif state is RequestState.NEW:
            req.advance(Event.END)
        else:
            return None
        return "queued"

    def refused(self, model_name, code: ErrorCode, message: str = "") -> None:
        """Count a request refused before it was admitted (by the door or by ``submit``), and log it
        at debug level (``serve -v``) like every other failed request."""
        label = model_name if isinstance(model_name, str) and model_name in self.models else "_unknown"
        self.outcomes[(label, "", code.wire)] += 1  # a label only for real models: clients must not mint series
        log.debug("request refused (model %r): %s: %s", model_name if isinstance(model_name, str) else "?",
                  code.wire, message)

    # -- admission ------------------------------------------------------------------------

    def _allocate(self, req: Request) -> bool:
        """Take a slot (and, inline, an extent) for ``req``; False if there is no space now."""
        index = self.slots.acquire()
        if index is None:
            return False
        extent = None
        if not req.zero_copy:
            extent = self.extents.allocate(req.total_bytes)
            if extent is None:
                self.slots.release(index)
                return False
            self.arena.add_stat("extent_bytes_in_use", extent.size)
        self.arena.add_stat("slots_in_use", 1)
        generation = self.arena.slot_status(index)[0]
        req.generation = self.arena.transition(index, generation, SlotState.FREE, SlotState.WRITING, Actor.FRONTEND)
        req.slot, req.extent = index, extent
        layout.reset_stages(self.buf, self.geometry, index, time.monotonic_ns())
        return True

    def _admit(self, req: Request) -> None:
        """``req`` holds space: write its input descriptors; inline, have its door receive the
        payload into the arena; zero-copy (or nothing to receive), publish it now."""
        req.advance(Event.ADMIT)
        buf, g, index, region = self.buf, self.geometry, req.slot, req.region
        spec = req.model.spec
        sinks, pos = [], req.extent.offset if req.extent else 0
        for i, t in enumerate(req.inputs):
            if region is not None:
                offset, region_id = t.offset, region.id
            else:
                nbytes, offset, region_id = t.nbytes, pos, 0
                pos += layout.align_tensor(nbytes)
                if nbytes:
                    sinks.append(self.view[offset:offset + nbytes])
            layout.encode_tensor(buf, g, index, i, role=layout.ROLE_INPUT, name_index=spec.input_index(t.name),
                                 dtype=t.dtype, shape=t.shape, offset=offset, region=region_id, nbytes=t.nbytes)
        if region is None:
            req.out_offset, req.out_capacity = pos, req.extent.offset + req.extent.size - pos
        if sinks:
            try:
                req.door.admitted(req, sinks)
            except Exception as exc:
                self._door_raised(req, "admitted", exc, sinks)
            return
        self._publish(req)
        if not req.answered:  # published, or parked for a worker: nothing more to receive
            try:
                req.door.admitted(req, None)
            except Exception as exc:
                self._door_raised(req, "admitted", exc)

    def _admit_waiting(self) -> None:
        while self.waiting and not self.stopping:
            req = self.waiting[0]
            if self._route(req) is None:  # its model's workers died meanwhile: wait for one, holding nothing
                self.waiting.popleft()
                self._park(req)
                continue
            if not self._allocate(req):
                return
            self.waiting.popleft()
            self._admit(req)

    def _publish(self, req: Request) -> None:
        """Hand ``req`` to the ready worker of its model with the fewest in flight: an ADMITTED
        request (its inputs complete), or a QUEUED one taken back unclaimed from a dead worker's
        ring.  No ready worker: it is parked (or answered, if the model cannot be loaded).  Its
        deadline already past (its upload outlasted it), it is answered TIMEOUT here, unpublished."""
        if self.stopping:
            self._answer_unclaimed(req, Failure(ErrorCode.SHUTTING_DOWN, "the server is shutting down"))
            return
        if req.deadline <= self.clock.monotonic():  # it passed while the inputs arrived: no worker sees it
            self._answer_unclaimed(req, Failure(ErrorCode.TIMEOUT, self._timed_out(req)))
            return
        worker = self._route(req)
        if worker is None:
            self._park(req)
            return
        if len(worker.submissions) >= worker.submissions.capacity:
            self._answer_unclaimed(req, Failure(ErrorCode.OVERLOADED, f"worker {worker.index}'s queue for model "
                                                                     f"{req.model.name!r} is full"))
            return
        if req.region is not None:
            refusal = self.deliver(worker, req.region)
            if refusal is not None:  # a QUEUED one (republished after its worker died) is taken back
                self._answer_unclaimed(req, Failure(*refusal))
                return
        buf, g, index = self.buf, self.geometry, req.slot
        priority = req.priority
        if not 0 < priority <= req.model.config.priority_levels:  # Triton's rule: the model's default level
            priority = 0
        # The deadline on CLOCK_MONOTONIC: the loop's clock is time.monotonic, which reads it; any other
        # (a test's) is converted by what is left of the request's time.
        deadline_ns = int(req.deadline * 1e9) if self._monotonic_clock else \
            time.monotonic_ns() + max(1, int((req.deadline - self.clock.monotonic()) * 1e9))
        # A QUEUED request's slot is READY on no live ring: nobody else can touch its record now.
        layout.encode_slot_request(buf, g, index, request_id=req.id, model_id=req.model.index,
                                   worker=worker.index, n_inputs=len(req.inputs),
                                   out_region=req.region.id if req.zero_copy else 0, out_off=req.out_offset,
                                   out_capacity=req.out_capacity, priority=priority, caller=req.caller,
                                   deadline_ns=deadline_ns,
                                   flags=layout.SLOT_FLAG_OWN_TIMEOUT if req.own_timeout else 0)
        if req.state is RequestState.ADMITTED:
            self.arena.stamp(index, "t_ready")
            # Order matters here: descriptors and (inline) input bytes are complete before READY.
            self.arena.transition(index, req.generation, SlotState.WRITING, SlotState.READY, Actor.FRONTEND)
            req.advance(Event.PUBLISH)
        req.worker = worker
        self.pending[index] = req
        worker.inflight.add(index)
        # Order matters here: the record (and READY) before the entry that hands the slot over.
        worker.submissions.push(layout.slot_entry(index, req.generation))  # room checked above; sole producer
        worker.doorbell.notify()
        self._start_polling()
        if req.timer is None:
            self._arm_deadline(req)

    # -- waiting for a worker -------------------------------------------------------------

    def _route(self, req: Request) -> WorkerHandle | None:
        """The worker for ``req`` now.  A request that named no version and whose version no
        longer takes requests (replaced, unloaded, evicted) moves first to the version such a
        request goes to now (``Models.resolve``: the default, or a canary's side), if that takes
        the same tensors; None if no worker is ready."""
        model = req.model
        worker = model.pick_worker()
        if worker is None and not req.named_version and not model.taking:
            try:  # where a request naming no version goes now (the one routing rule)
                current = self.models.resolve(model.name, None, None, self.draw())
            except ShmserveError:
                current = None
            if current is not None and current is not model \
                    and (req.unchecked is not None or req.state is RequestState.NEW
                         or current.same_interface(model)):
                req.model = current
                worker = current.pick_worker()
        return worker

    def _park(self, req: Request) -> None:
        """``req``'s model has no ready worker: wait for one (its deadline runs) while its workers
        restart; answer MODEL_UNAVAILABLE if they failed for good."""
        model = req.model
        if not model.waitable:
            failure = model.drain_failure or (ErrorCode.MODEL_UNAVAILABLE, model.unavailable_reason())
            self._answer_unclaimed(req, Failure(*failure))
            return
        if req.timer is None:
            self._arm_deadline(req)
        self.parked[model].append(req)

    def _unpark(self, req: Request) -> bool:
        """Take ``req`` off its model's parked queue; False if it is not parked."""
        try:
            self.parked[req.model].remove(req)
        except ValueError:
            return False
        return True

    def _serve_parked(self, model: ModelState) -> None:
        """A worker of ``model`` is ready: parked requests go on in arrival order — to arena space
        (or to wait for it) if not admitted yet, to a worker if they hold space."""
        queue = self.parked[model]
        while queue and not self.stopping and model.pick_worker() is not None:
            req = queue.popleft()
            if req.unchecked is not None:  # it waited for its version's first load: check it now
                (parsed, payload_bytes, region), req.unchecked = req.unchecked, None
                try:
                    self._check_inputs(req, parsed, payload_bytes, region)
                except ShmserveError as exc:
                    self._end(req, Failure(exc.code, exc.message))
                    continue
            if req.state is not RequestState.WAITING:
                self._publish(req)
            elif not self.waiting and self._allocate(req):
                self._admit(req)
            else:
                self.waiting.append(req)

    def _answer_unclaimed(self, req: Request, failure: Failure) -> None:
        """Answer ``req``, which no worker has: WAITING, ADMITTED, or QUEUED but not on a live ring
        (its READY slot is taken back first)."""
        if req.state is RequestState.QUEUED:
            self._take_back(req)
        self._end(req, failure)

    # -- completions ----------------------------------------------------------------------

    def on_completions(self) -> None:
        """The completion eventfd fired (the caller has drained it): collect every completion,
        then arm the doorbells again (draining once more if one was pushed meanwhile)."""
        workers = self.workers
        while True:
            for w in workers:
                self._drain(w)
            if not any(w.completion_bell.arm() for w in workers):
                return

    def _start_polling(self) -> None:
        """While requests are in flight, poll the completion rings from the loop (call_soon keeps
        socket I/O flowing between polls) for up to spin_s after the last completion, instead of
        paying a wake-up per completion.  Then fall back to the armed eventfd."""
        spin_s = self.limits.spin_s
        self._poll_until = self.clock.monotonic() + spin_s
        if not self._polling and spin_s > 0:
            self._polling = True
            self.clock.call_soon(self._poll)

    def _poll(self) -> None:
        got = False
        for w in self.workers:
            if not w.completions.empty():
                self._drain(w)
                got = True
        now = self.clock.monotonic()
        if got:
            self._poll_until = now + self.limits.spin_s
        if self.pending and now < self._poll_until and not self.stopping:
            self.clock.call_soon(self._poll)
            return
        self._polling = False
        self.on_completions()

    def _drain(self, w: WorkerHandle) -> None:
        for entry in w.completions.pop_all():
            index, generation = layout.split_entry(entry)
            if index in w.inflight:
                req = self.pending.get(index)
                try:
                    self._complete(w, index, generation)
                except Exception as exc:  # a bug on the way to its answer: the rest of this drain goes on
                    self._completion_failed(req, generation, exc)

    def _completion_failed(self, req: Request | None, generation: int, exc: Exception) -> None:
        """Collecting ``req``'s completion raised ``exc`` (not in its door: ``_door_raised`` has
        those): it is answered INTERNAL if it was not answered yet, and what it holds is freed."""
        log.error("collecting the result of request %s failed; it is answered 'internal' and freed",
                  req.id if req is not None else "?", exc_info=exc)
        traceback.clear_frames(exc.__traceback__)  # logged: its frames must not keep views of the arena
        if req is None or req.generation != generation:
            return
        if self.pending.get(req.slot) is req:
            del self.pending[req.slot]
            req.worker.inflight.discard(req.slot)
        if req.state is RequestState.QUEUED:
            self._end(req, Failure(ErrorCode.INTERNAL, f"the server failed collecting this request's result "
                                                       f"({type(exc).__name__}); see its log"))
        elif req.state is RequestState.ABANDONED:
            req.advance(Event.RELEASE)
            self._free(req)

    def _complete(self, w: WorkerHandle, index: int, generation: int) -> None:
        req = self.pending.get(index)
        if req is None or req.generation != generation:
            return
        status_gen, state = self.arena.slot_status(index)  # load-acquire before reading outputs
        if status_gen != generation or state not in FINISHED:
            log.error("slot %d completed in state %s; ignoring", index, state)
            return
        del self.pending[index]
        w.inflight.discard(index)
        self._cancel_timer(req)
        if state == _ERROR and req.state is not RequestState.ABANDONED:
            code, message = layout.decode_error(self.buf, self.geometry, index)
            code = ErrorCode.from_number(code)
            if code is ErrorCode.OUTPUT_TOO_LARGE and not req.zero_copy and not req.reran \
                    and self._run_again(req, reservations.needed(code, message)):
                return  # (counted once, when its second run is answered)
        self.arena.add_stat("requests_total", 1)
        if req.state is RequestState.ABANDONED:
            req.advance(Event.RELEASE)
            self._free(req)
            return
        if state == _ERROR:
            self.arena.add_stat("errors_total", 1)
            if self.observe is not None:
                self.observe(req, False)
            self._end(req, Failure(code, message))
            return
        try:
            outputs = self._outputs(req, index)
        except layout.LayoutError as exc:
            self._end(req, Failure(ErrorCode.INTERNAL, f"worker wrote invalid outputs: {exc}"))
            return
        if req.shadow is None:
            self.outcomes[(req.model.name, req.model.version, "ok")] += 1
        if self.observe is not None:
            self.observe(req, True)
        if not req.zero_copy and req.shadow is None:
            self.offer_shadow(req, outputs)
        if req.zero_copy:
            self._end(req, outputs)
            return
        req.advance(Event.HOLD)
        try:
            req.door.answer(req, outputs)
        except Exception as exc:
            self._door_raised(req, "answer", exc, [o.view for o in outputs.outputs if o.view is not None])

    def _run_again(self, req: Request, needed: int | None) -> bool:
        """``req``'s worker answered short (``shmserve.reservations``): its outputs took ``needed``
        bytes, more than its guess reserved.  Its model version learns that for its input signature,
        and it is run again once (RERUN) with an output area of exactly that much, beside the
        extent that holds its inputs.  False if it is not a short answer (then the error is the
        answer); answered here with OUTPUT_TOO_LARGE naming ``max_request_bytes`` if it needs more
        than the server delivers, or OVERLOADED if the arena has no room for it now."""
        if needed is None:
            return False
        model = req.model
        inputs = sum(layout.align_tensor(t.nbytes) for t in req.inputs)
        if inputs + needed > self.max_request:  # (not learned: the signature's smaller calls still fit)
            why = self._too_large(inputs + needed, inputs)
            self._end(req, Failure(ErrorCode.OUTPUT_TOO_LARGE, f"the outputs took {_size(needed)}, the inputs "
                                                               f"{_size(inputs)}: {why}"))
            return True
        if req.signature is None:  # the spec predicted shapes the model did not make (exporters do that)
            req.signature = tuple((t.name, t.dtype, t.shape) for t in req.inputs)
        model.learned.learn(req.signature, needed)
        extent = self.extents.allocate(needed)
        if extent is None:
            self._end(req, Failure(ErrorCode.OVERLOADED, f"the outputs took {_size(needed)}, more than reserved, and "
                                                         f"the arena has no room for them now: try again"))
            return True
        self.arena.add_stat("extent_bytes_in_use", extent.size)
        index = req.slot
        freed = self.arena.transition(index, req.generation, SlotState.ERROR, SlotState.FREE, Actor.FRONTEND)
        req.generation = self.arena.transition(index, freed, SlotState.FREE, SlotState.WRITING, Actor.FRONTEND)
        layout.reset_stages(self.buf, self.geometry, index, time.monotonic_ns())
        req.out_extent, req.out_offset, req.out_capacity = extent, extent.offset, extent.size
        req.reran = True
        req.advance(Event.RERUN)
        self.reruns[model.key] += 1
        self._publish(req)
        return True

    def input_views(self, req: Request) -> list[memoryview]:
        """The bytes of inline request ``req``'s non-empty inputs, in order, as views of its extent
        (valid while it holds it: until its answer's views are released)."""
        views, pos = [], req.extent.offset
        for t in req.inputs:
            if t.nbytes:
                views.append(self.view[pos:pos + t.nbytes])
            pos += layout.align_tensor(t.nbytes)
        return views

    def _outputs(self, req: Request, index: int) -> Outputs:
        """The outputs the worker wrote, validated against the space they must lie in."""
        g, buf = self.geometry, self.buf
        slot = layout.decode_slot_request(buf, g, index)
        spec = req.model.spec
        zero_copy = req.region is not None
        sizes = {req.region.id: req.region.size} if zero_copy else None
        if slot.n_outputs != len(spec.outputs):
            raise layout.LayoutError(f"{slot.n_outputs} outputs, the model has {len(spec.outputs)}")
        area_start, area_end = req.out_offset, req.out_offset + req.out_capacity
        outputs, total, seen = [], 0, set()
        for i in range(slot.n_outputs):
            d = layout.decode_tensor(buf, g, index, slot.n_inputs + i, sizes)
            if d.role != layout.ROLE_OUTPUT or d.name_index >= len(spec.outputs) or d.name_index in seen:
                raise layout.LayoutError("descriptor is not an output of this model, or repeats one")
            seen.add(d.name_index)
            if not (area_start <= d.offset and d.offset + d.nbytes <= area_end):
                raise layout.LayoutError(f"output [{d.offset}, +{d.nbytes}) lies outside the request's output area")
            if zero_copy:
                if d.region != req.region.id:
                    raise layout.LayoutError("output outside the client's region")
                view = None
            elif d.region != 0:
                raise layout.LayoutError("inline output outside the arena")
            else:
                view = self.view[d.offset:d.offset + d.nbytes]
                total += d.nbytes
            outputs.append(Output(spec.outputs[d.name_index].name, layout.dtype_name(d.dtype), d.shape, d.offset,
                                  d.nbytes, view))
        if total:
            self.arena.add_stat("bytes_out", total)
        return Outputs(tuple(outputs), not zero_copy)

    # -- answers and space ----------------------------------------------------------------

    def _end(self, req: Request, answer: Answer) -> None:
        """Answer ``req`` now and free what it holds (END)."""
        held = req.state in (RequestState.ADMITTED, RequestState.QUEUED)
        req.advance(Event.END)  # first: a second answer raises before anything else happens
        self._cancel_timer(req)
        if isinstance(answer, Failure) and req.shadow is None:
            log.debug("request %d on model %s: %s: %s", req.id, req.model.key, answer.code.wire, answer.message)
            self.outcomes[(req.model.name, req.model.version, answer.code.wire)] += 1
        if held:
            self._free(req)
        try:
            req.door.answer(req, answer)
        except Exception as exc:
            self._door_raised(req, "answer", exc)

    def _abandon(self, req: Request, failure: Failure) -> None:
        """Answer ``req`` with ``failure`` while a worker may still touch its slot (ABANDON):
        the slot is freed when the worker finishes."""
        req.advance(Event.ABANDON)  # first: a second answer raises before anything else happens
        self._cancel_timer(req)
        self.outcomes[(req.model.name, req.model.version, failure.code.wire)] += 1
        log.debug("request %d on model %s: %s: %s", req.id, req.model.key, failure.code.wire, failure.message)
        try:
            req.door.answer(req, failure)
        except Exception as exc:
            self._door_raised(req, "answer", exc)

    def _door_raised(self, req: Request, where: str, exc: Exception, views=()) -> None:
        """``Door.<where>`` raised ``exc`` for ``req``: a bug in the door or a fault beneath it, so the
        door's state is unknown.  It is told to end its connection (``Door.abort``: once that
        returns it reads and writes none of the arena space it was given), the ``views`` of the
        arena it was handed (sinks, outputs) are released (a view the door kept is dead, one it
        sliced is the door's to drop), then ``req`` gives up what it holds, as ``drop`` does
        (freed now; a request a worker runs, once it finishes).  Whoever else is served is not
        affected; a second raise (from ``abort``) is only logged."""
        self.door_faults += 1
        log.error("a front door raised in %s for request %d on model %s; its connection is ended and what the "
                  "request held is freed", where, req.id, req.model.key, exc_info=exc)
        traceback.clear_frames(exc.__traceback__)  # logged: its frames must not keep views of the arena
        try:
            req.door.abort(exc)
        except Exception:
            log.exception("the front door raised again while ending its connection")
        for view in views:
            try:
                view.release()
            except BufferError:  # exported (a transport's write in progress): abort has dropped it
                pass
        self.drop(req, cancelled=False)

    def _free(self, req: Request) -> None:
        """Return a request's slot and extent (whatever state the slot reached) and admit waiters."""
        if req.slot is None:
            return
        index, generation = req.slot, req.generation
        status_gen, state = self.arena.slot_status(index)
        if status_gen == generation and state != _FREE:
            if state == _READY:
                self.arena.transition(index, generation, SlotState.READY, SlotState.ERROR, Actor.FRONTEND)
                state = _ERROR
            self.arena.transition(index, generation, SlotState(state), SlotState.FREE, Actor.FRONTEND)
        self.slots.release(index)
        self.arena.add_stat("slots_in_use", -1)
        for extent in (req.extent, req.out_extent):
            if extent is not None:
                self.extents.free(extent)
                self.arena.add_stat("extent_bytes_in_use", -extent.size)
        req.slot = req.extent = req.out_extent = None
        self._admit_waiting()

    def _arm_deadline(self, req: Request) -> None:
        """Time ``req`` out at its deadline (set at submission: waiting, receiving and running
        all count against one ``timeout_s``)."""
        req.timer = self.clock.call_later(max(0.0, req.deadline - self.clock.monotonic()), self._on_timeout, req)

    def _cancel_timer(self, req: Request) -> None:
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None

    def _on_timeout(self, req: Request) -> None:
        req.timer = None
        if self._unpark(req):
            self._answer_unclaimed(req, Failure(ErrorCode.TIMEOUT, self._timed_out(req, "no ready worker") +
                                                f": {req.model.unavailable_reason()}"))
        elif req.state is RequestState.WAITING:
            self.waiting.remove(req)
            self._end(req, Failure(ErrorCode.TIMEOUT, self._timed_out(req, "no arena space")))
            self._admit_waiting()  # those behind it may fit the space there is
        elif req.state is RequestState.QUEUED:
            self._time_out_queued(req)

    def _take_back(self, req: Request) -> bool:
        """Fail a QUEUED request's slot (READY -> ERROR) if no worker has claimed it yet, and forget
        it on the worker's side; False if a worker has it (RUNNING) or has finished it."""
        index = req.slot
        try:
            self.arena.transition(index, req.generation, SlotState.READY, SlotState.ERROR, Actor.FRONTEND)
        except SlotConflict:
            return False
        del self.pending[index]
        req.worker.inflight.discard(index)
        return True

    def _time_out_queued(self, req: Request) -> None:
        if self._take_back(req):  # not claimed yet: take it back now rather than when the worker gets to it
            self._end(req, Failure(ErrorCode.TIMEOUT, self._timed_out(req)))
            return
        generation, state = self.arena.slot_status(req.slot)
        if generation == req.generation and state in FINISHED:  # finished, not yet collected: deliver it
            self._complete(req.worker, req.slot, generation)
            return
        self._abandon(req, Failure(ErrorCode.TIMEOUT, self._timed_out(req)))  # running

    def _timed_out(self, req: Request, what: str = "no result") -> str:
        """A timeout's message; it names the server's cap when that, not the client, set it."""
        capped = req.timeout_s >= self.limits.request_timeout_s
        return f"{what} within {req.timeout_s:g} s" + (" (server.request_timeout_s)" if capped else "")

    # -- workers --------------------------------------------------------------------------

    def worker_ready(self, w: WorkerHandle) -> None:
        """``w`` reported ready: its model's parked requests go on, then those waiting for space."""
        version = self.models.version_of(w)
        if version is not None:
            self._serve_parked(version)
        self._admit_waiting()

    def worker_exited(self, w: WorkerHandle, how: str) -> None:
        """Deliver what a dead worker finished, fail what it was running, and forget its queue;
        what it had not claimed yet is published again (to another ready worker, or parked until
        one is ready).  Once its model cannot be loaded at all, its parked requests are answered."""
        self._drain(w)
        unclaimed = []
        for index in sorted(w.inflight):
            req = self.pending.get(index)
            generation, state = self.arena.slot_status(index)
            if req is None or generation != req.generation:
                continue
            if state == _READY and req.state is RequestState.QUEUED and not self.stopping:
                unclaimed.append(req)  # nothing of it ran
                continue
            if state not in FINISHED:
                version = self.models.version_of(w)
                code, message = (version.drain_failure if version is not None and version.drain_failure else
                                 (ErrorCode.WORKER_CRASHED,
                                  f"worker {w.index} for model {w.model.name!r} {how} while running this request"))
                layout.encode_error(self.buf, self.geometry, index, code, message)
                self.arena.transition(index, generation, SlotState(state), SlotState.ERROR, Actor.FRONTEND)
            self._complete(w, index, generation)
        w.inflight.clear()
        w.submissions.discard()
        for req in unclaimed:
            self._publish(req)
        version = self.models.version_of(w)
        if version is not None:
            self.settle(version)

    def settle(self, version: ModelState) -> None:
        """``version`` changed (its workers, its phase, its model's default): what is parked for it
        goes on — to its model's default version if it named none and ``version`` takes no more, or
        is answered if it can never run (its workers failed for good, or it was unloaded)."""
        queue = self.parked.get(version)
        if not queue:
            return
        if not version.taking or not version.waitable:
            for req in list(queue):
                queue.remove(req)
                if self._route(req) is not None or req.model is not version:
                    (self._publish if req.state is not RequestState.WAITING else self._requeue)(req)
                else:
                    self._park(req)  # parked again, or answered if it cannot wait
            return
        self._serve_parked(version)

    def _requeue(self, req: Request) -> None:
        """A WAITING request moved to another version: it waits there (checked, given space and
        published as soon as that version has a ready worker)."""
        if req.timer is None:
            self._arm_deadline(req)
        self.parked[req.model].append(req)
        self._serve_parked(req.model)

    # -- shutdown -------------------------------------------------------------------------

    def stop_admitting(self) -> None:
        """Refuse new requests and answer every waiting one (for space or for a worker) with
        SHUTTING_DOWN."""
        self.stopping = True
        for queue in self.parked.values():
            while queue:
                self._answer_unclaimed(queue.popleft(), Failure(ErrorCode.SHUTTING_DOWN,
                                                                "the server is shutting down"))
        while self.waiting:
            req = self.waiting.popleft()
            self._end(req, Failure(ErrorCode.SHUTTING_DOWN, "the server is shutting down"))

    @property
    def in_flight(self) -> int:
        """Requests a worker has or may still touch."""
        return len(self.pending)

    def fail_in_flight(self) -> None:
        """Answer every request still with a worker with SHUTTING_DOWN (the drain timed out); their
        slots are freed as their workers stop."""
        for req in list(self.pending.values()):
            if req.state is RequestState.QUEUED:
                self._abandon(req, Failure(ErrorCode.SHUTTING_DOWN,
                                           "the server stopped before this request finished"))

    # -- status ---------------------------------------------------------------------------

    def queue_depths(self) -> dict[str, tuple[int, int]]:
        """Per version (``name:version``): (requests waiting for space or for a worker, or not yet claimed by a worker,
        requests handed to workers and not yet finished)."""
        depths = {v.key: [0, 0] for v in self.models.versions()}
        for req in self.pending.values():
            counts = depths.setdefault(req.model.key, [0, 0])
            counts[1] += 1
            if self.arena.slot_status(req.slot)[1] == _READY:
                counts[0] += 1
        for req in self.waiting:
            depths.setdefault(req.model.key, [0, 0])[0] += 1
        for version, queue in self.parked.items():
            # QUEUED: counted above
            depths.setdefault(version.key, [0, 0])[0] += sum(req.state is not RequestState.QUEUED for req in queue)
        return {key: (queued, inflight) for key, (queued, inflight) in depths.items()}

    def busy(self, version: ModelState) -> bool:
        """Whether ``version`` has requests queued, parked or in flight (never evicted then)."""
        return bool(self.parked.get(version)) or any(r.model is version for r in self.waiting) or \
            any(w.inflight for w in version.workers)
