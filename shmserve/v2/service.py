"""The KServe v2 operations, shared by the HTTP and gRPC front doors.

Owns: what each v2 operation answers (health, server and model metadata,
model readiness and configuration, inference, the system and CUDA
shared-memory extensions, the repository extension, statistics), what each
caller holds across both doors (``Ledger``: requests in flight and request
bytes buffered, per identity), what a door may be reading at once
(``ReadPool``: all callers together, and each one's share), each infer
request's charge to the rate limits that hold its caller (``check_rate``;
the buckets are the Unix door's), and the dispatcher ``Door`` of a v2
connection: it copies a request's input bytes (from the message, or read
from a registered region) into the arena space the dispatcher gives it, and
takes each answer's outputs out before the space is released.  Who a caller
is and what it may do is ``shmserve.v2.auth`` (``V2Service.auth``); the
doors ask it before they read a body, and the operations that need more than
inference check again.

What the models are, as callers see them (metadata, readiness,
configuration, the repository index, statistics), is the read-only
``Catalog`` (``shmserve.v2.catalog``, ``V2Service.catalog``): this module
checks who asks and hands those calls to it.

Every call takes a ``Caller`` (who: an ``auth.Identity``; and which
connection: its ``V2Door``, whose requests the per-connection limits count).
Errors are ``messages.V2Error`` with a shmserve code; the doors map them to
HTTP and gRPC status codes.

Must not: parse HTTP or protobuf, touch a socket, or block the loop.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable

from shmserve import __version__, protocol
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.dispatcher import Answer, Dispatcher, Failure, Outputs, new_caller
from shmserve.frontend.models import ModelState, Models
from shmserve.frontend.ratelimit import Caller as RateCaller, RateLimiter
from shmserve.frontend.requests import Request
from shmserve.v2 import classify
from shmserve.v2.auth import ADMIN, Authenticator, Identity
from shmserve.v2.catalog import EXTENSIONS, Catalog, version_number
from shmserve.v2.messages import (DATATYPES, ITEMSIZE, V2_NAMES, Incoming, InferRequest, InferResult, OutputTensor,
                                  RateLimited, ShmRef, V2Error)
from shmserve.v2.sysshm import SystemShm
from shmserve.v2.wording import byte_size_mismatch, check_inputs, triton_unavailable, unexpected_output

log = logging.getLogger("shmserve.v2")



@dataclass(eq=False, slots=True)
class Caller:
    """Who makes a request (``identity``: ``auth.Authenticator`` made it) and through which
    connection (``door``: an HTTP connection's, or a gRPC peer's).  The HTTP door over a Unix
    socket keeps one per connection; over TCP, and on the gRPC door, there is one per request (a
    connection may carry several callers' requests: a proxy's does)."""

    identity: Identity
    door: "V2Door" = field(repr=False)

    @property
    def key(self) -> str:
        """What this caller's limits and registered regions are kept under."""
        return self.identity.key


class Ledger:
    """What each caller (an identity's ``key``) holds across both v2 doors: requests in flight
    (``max_inflight_per_uid``) and request bytes the doors hold in memory outside the arena
    (``max_buffered_bytes_per_uid``: HTTP bodies being parsed, gRPC messages read).  Counts only;
    whoever takes gives back, exactly once (a door's ``finally``)."""

    def __init__(self, max_requests: Callable[[], int], max_bytes: Callable[[], int]):
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.requests: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.waiting: dict[str, collections.deque] = {}  # key -> [nbytes, future] waiting for room, in order

    def take_request(self, identity: Identity) -> None:
        """Count one more request of ``identity``.  V2Error OVERLOADED at the limit."""
        key = identity.key
        if self.requests[key] >= self.max_requests():
            raise V2Error(ErrorCode.OVERLOADED, f"{identity.who} has {self.requests[key]} v2 requests in flight "
                                                "(server.max_inflight_per_uid)")
        self.requests[key] += 1

    def give_request(self, identity: Identity) -> None:
        _uncount(self.requests, identity.key, 1)

    def bytes_fit(self, identity: Identity, nbytes: int, mine: int = 0) -> bool:
        """Whether ``identity`` may hold ``nbytes`` more, for a body or message that holds
        ``mine`` of its bytes already: always, if that one holds all of them (one at a time fits,
        whatever its size)."""
        held = self.bytes[identity.key]
        return held == mine or held + nbytes <= self.max_bytes()

    def take_bytes(self, identity: Identity, nbytes: int, mine: int = 0) -> None:
        """Count ``nbytes`` more buffered for ``identity`` (``mine``: as ``bytes_fit``).  V2Error
        OVERLOADED if they do not fit: nothing is counted then."""
        if not self.bytes_fit(identity, nbytes, mine):
            raise V2Error(ErrorCode.OVERLOADED, f"{identity.who} has {self.bytes[identity.key]} bytes of v2 requests "
                                                f"held in memory; {nbytes} more would pass "
                                                "server.max_buffered_bytes_per_uid")
        self.bytes[identity.key] += nbytes

    async def reserve_bytes(self, identity: Identity, nbytes: int, timeout: float) -> None:
        """Take ``nbytes`` for ``identity`` once they fit (``bytes_fit``), after its earlier
        waiters, waiting at most ``timeout`` seconds.  V2Error OVERLOADED if they did not fit in
        time (nothing is taken then); cancelling the wait takes nothing either."""
        key = identity.key
        if key not in self.waiting and self.bytes_fit(identity, nbytes):
            self.bytes[key] += nbytes
            return
        entry = [nbytes, asyncio.get_running_loop().create_future()]
        self.waiting.setdefault(key, collections.deque()).append(entry)

        def leave() -> None:
            queue = self.waiting.get(key)
            if queue is not None and entry in queue:
                queue.remove(entry)
                if not queue:
                    del self.waiting[key]
                self._wake(key)  # it may have held up smaller ones behind it

        if not await _granted(entry[1], timeout, lambda: self.give_bytes(identity, nbytes), leave):
            raise V2Error(ErrorCode.OVERLOADED, f"{identity.who} had {self.bytes[key]} bytes of v2 requests "
                                                f"held in memory for {timeout:g} s; {nbytes} more would pass "
                                                "server.max_buffered_bytes_per_uid")

    def give_bytes(self, identity: Identity, nbytes: int) -> None:
        _uncount(self.bytes, identity.key, nbytes)
        if identity.key in self.waiting:
            self._wake(identity.key)

    def _wake(self, key: str) -> None:
        """Grant the waiters of ``key`` that fit now, in order."""
        queue, limit = self.waiting.get(key), self.max_bytes()
        while queue:
            nbytes, granted = queue[0]
            held = self.bytes[key]
            if held and held + nbytes > limit:
                break
            queue.popleft()
            if not granted.done():
                self.bytes[key] += nbytes
                granted.set_result(None)
        if queue is not None and not queue:
            del self.waiting[key]


class ReadPool:
    """The bytes one door may be reading at once for all its callers together, and each caller's
    share of them (the gRPC door's: grpc tells no message size before a read, so a read counts
    as the largest message until it is read; then the message's own size moves to the caller's
    ``Ledger`` budget and its read is given back here).

    A read fits when the pool has room for it (``capacity()``, read on every use) and its caller's
    reads stay within half of it, so no caller holds the whole pool; whatever its size, a read
    fits the pool when nothing is being read, and its caller's share when that caller reads
    nothing (so a pool smaller than two reads still serves one at a time).  Waiters are
    granted in order, except that one held back only by its own caller's share does not hold up
    other callers' (one caller's queue cannot starve the others; a read is bounded in time by its
    door, so a waiter's turn comes).  ``what``: the configuration key named in refusals.  Counts
    only; whoever takes gives back, exactly once."""

    def __init__(self, capacity: Callable[[], int], what: str):
        self.capacity, self.what = capacity, what
        self.total = 0
        self.held: collections.Counter[str] = collections.Counter()  # key -> bytes of its reads
        self.waiting: collections.deque = collections.deque()  # [key, nbytes, future], in order

    def _room(self, nbytes: int) -> bool:
        return self.total == 0 or self.total + nbytes <= self.capacity()

    def _within_share(self, key: str, nbytes: int) -> bool:
        mine = self.held[key]
        return mine == 0 or mine + nbytes <= self.capacity() // 2

    async def take(self, identity: Identity, nbytes: int, timeout: float) -> None:
        """Take ``nbytes`` of the pool for one read of ``identity`` once it fits (see the class),
        waiting at most ``timeout`` seconds.  V2Error OVERLOADED naming ``what`` if it did not fit
        in time (nothing is taken then); cancelling the wait takes nothing either."""
        key = identity.key
        entry = [key, nbytes, asyncio.get_running_loop().create_future()]
        self.waiting.append(entry)
        self._wake()
        if entry[2].done():
            return

        def leave() -> None:
            if entry in self.waiting:
                self.waiting.remove(entry)
                self._wake()  # it may have held up others behind it

        if not await _granted(entry[2], timeout, lambda: self.give(identity, nbytes), leave):
            raise V2Error(ErrorCode.OVERLOADED, f"{identity.who} waited {timeout:g} s for room to read a message: "
                                                f"{self.total} bytes are being read, {self.held[key]} of them "
                                                f"for {identity.who}; each read counts as the largest message "
                                                f"({nbytes} bytes), all callers' within {self.what}, one "
                                                "caller's within half of it")

    def give(self, identity: Identity, nbytes: int) -> None:
        """Give back ``nbytes`` that ``take`` took for ``identity``; grant the waiters that fit now."""
        self.total -= nbytes
        _uncount(self.held, identity.key, nbytes)
        self._wake()

    def _wake(self) -> None:
        """Grant the waiters that fit, in order: one held back by its caller's share is passed
        over; one the pool has no room for stops the rest (they wait their turn behind it)."""
        for entry in list(self.waiting):
            key, nbytes, granted = entry
            if granted.done():  # given up (its waiter removes it)
                continue
            if not self._within_share(key, nbytes):
                continue
            if not self._room(nbytes):
                break
            self.waiting.remove(entry)
            self.total += nbytes
            self.held[key] += nbytes
            granted.set_result(None)


async def _granted(granted: asyncio.Future, timeout: float, undo: Callable[[], None],
                   leave: Callable[[], None]) -> bool:
    """Wait at most ``timeout`` seconds for a waiter's ``granted``: True once granted, False if the
    time ran out.  If the wait ends otherwise (cancelled, or out of time): ``undo()`` gives back
    a grant that came just as it ended, else ``leave()`` takes the waiter out of its queue; a
    cancellation is raised on."""
    try:
        await asyncio.wait_for(asyncio.shield(granted), timeout)
        return True
    except BaseException as exc:
        if granted.done() and not granted.cancelled():
            undo()
        else:
            granted.cancel()
            leave()
        if isinstance(exc, asyncio.TimeoutError):
            return False
        raise


def _uncount(counter: collections.Counter, key: str, n: int) -> None:
    counter[key] -= n
    if counter[key] <= 0:
        del counter[key]


def _error(exc: ShmserveError) -> V2Error:
    return V2Error(exc.code, exc.message)


class V2Door:
    """The dispatcher's door for one v2 caller: its requests' inputs in, their answers out.

    A request's inputs come from three sources (its ``InferCall.sources``, one per input with
    bytes, in input order): bytes of the message (copied into the arena), a registered region
    (``(region, ref, what)``: read into it, on a thread when it is ``OFFLOAD_BYTES`` or more so
    the loop serves others meanwhile), or ``Incoming`` (received into it by the request's
    ``body``, straight from the socket; the request is published once all have landed).

    While a thread reads into a request's space (``copying``), nothing frees that space: a drop
    then waits for the read to end.

    A method of it that raises (``Door.abort``): the connection's own end first (``on_abort``,
    which the HTTP door sets: its transport aborted, its calls cancelled), then every call still
    pending is answered INTERNAL (a gRPC caller's: its replies hold no view of the arena)."""

    def __init__(self, service: "V2Service"):
        self.service = service
        self.dispatcher = service.dispatcher
        self.pending: dict[Request, InferCall] = {}
        self.receiving: set[Request] = set()  # admitted; their Incoming bytes are being received
        self.copying: dict[Request, asyncio.Future] = {}  # a thread reads regions into their space
        self.dropped: set[Request] = set()  # dropped while copying: freed when the copy ends
        self.ids = itertools.count(1)
        self.on_abort: Callable[[Exception], None] | None = None  # the connection's end (HTTP)
        self.caller_key = new_caller()  # its requests' key for fairness between callers (Door.caller_key)

    def in_flight(self) -> int:
        return len(self.pending)

    def waiting(self, req: Request) -> None:
        pass

    def admitted(self, req: Request, sinks: list | None) -> None:
        call = self.pending.get(req)
        if call is None or sinks is None:
            return
        incoming, reads = [], []
        for sink, source in zip(sinks, call.sources):
            if isinstance(source, Incoming):
                incoming.append(sink)
            elif isinstance(source, tuple):
                reads.append((sink, source))
            else:
                sink[:] = source
        call.sources = ()
        if sum(len(sink) for sink, _ in reads) >= OFFLOAD_BYTES:
            copy = asyncio.get_running_loop().run_in_executor(None, _read_regions, reads)
            self.copying[req] = copy
            copy.add_done_callback(lambda f: self._copied(req, f, incoming))
            return
        try:
            _read_regions(reads)
        except Exception as exc:
            self._fail(req, _internal(exc, "reading a region"))
            return
        self._inputs_read(req, incoming)

    def _copied(self, req: Request, copy: asyncio.Future, incoming: list) -> None:
        del self.copying[req]
        if req in self.dropped:
            self.dropped.discard(req)
            self.dispatcher.drop(req)
            return
        exc = copy.exception()
        if exc is not None:
            self._fail(req, _internal(exc, "reading a region"))
        else:
            self._inputs_read(req, incoming)

    def _inputs_read(self, req: Request, incoming: list) -> None:
        """The message's and the regions' bytes are in: the socket's next, or publish."""
        if not incoming:
            self.dispatcher.received(req)
            return
        self.receiving.add(req)
        self.pending[req].request.body.fill(incoming, lambda: self._received(req))

    def _received(self, req: Request) -> None:
        if req in self.receiving:
            self.receiving.discard(req)
            self.dispatcher.received(req)

    def drop(self, req: Request) -> None:
        """Nobody is left to answer ``req``: free what it holds (once a read into it has ended)."""
        self._stop_receiving(req)
        if req in self.copying:
            self.dropped.add(req)
        else:
            self.dispatcher.drop(req)

    def _fail(self, req: Request, exc: V2Error) -> None:
        """Fail a request this door holds (its inputs could not be read) and free its space."""
        call = self.pending[req]
        self.drop(req)
        del self.pending[req]
        call.failed(exc)

    def _stop_receiving(self, req: Request) -> None:
        if req in self.receiving:
            self.receiving.discard(req)
            call = self.pending.get(req)
            if call is not None and call.request.body is not None:
                call.request.body.abort()

    def answer(self, req: Request, answer: Answer) -> None:
        if req in self.receiving:  # answered before its body was all in: no byte more lands in its space
            self._stop_receiving(req)
        call = self.pending.pop(req, None)
        if call is None:  # its caller gave up (cancelled) meanwhile
            if isinstance(answer, Outputs) and answer.in_arena:
                self.dispatcher.release(req)
            return
        call.answered(answer)

    def cancel(self, req: Request) -> None:
        """``req``'s caller gives up on it (its connection is gone, its RPC cancelled)."""
        if self.pending.pop(req, None) is not None:
            self.drop(req)

    def close(self) -> None:
        for call in list(self.pending.values()):
            call.cancel()
        self.receiving.clear()

    def abort(self, exc: Exception) -> None:
        """``Door.abort``: see the class docstring."""
        if self.on_abort is not None:
            self.on_abort(exc)
        for req in list(self.pending):
            if req in self.pending:
                self._fail(req, V2Error(ErrorCode.INTERNAL, f"internal server error ({type(exc).__name__}): "
                                                            f"see the server's log"))


class InferCall:
    """One v2 infer request on its way (``V2Service.start``): what it holds until it ends (the
    regions its inputs and outputs name, its place in the uid's count) and whom to tell.  It ends
    exactly once: ``done(result, None)``, ``done(None, error)``, or ``cancel()`` (nobody is told).
    A region a thread still reads or writes for it stays held until the thread is done."""

    __slots__ = ("service", "caller", "request", "wanted", "req", "sources", "held", "outputs", "done", "ended",
                 "writing")

    def __init__(self, service: "V2Service", caller: Caller, request: InferRequest, done):
        self.service, self.caller, self.request, self.done = service, caller, request, done
        self.wanted = self.req = self.writing = None
        self.sources: list | tuple = []
        self.held: list = []  # every region taken for it (given back once, when it ends)
        self.outputs: dict = {}  # output name -> the region it is written into
        self.ended = False

    def answered(self, answer: Answer) -> None:
        """The dispatcher's one answer (through the door)."""
        if isinstance(answer, Failure):
            self._end(None, V2Error(answer.code, answer.message))
            return
        service, req = self.service, self.req
        service.count_items(self)
        release = (lambda: service.dispatcher.release(req)) if answer.in_arena else None
        try:
            result, writes = service._result(self, answer)
        except Exception as exc:  # a region that cannot take an output, or our bug: its answer is an error
            if release is not None:
                release()
            self._end(None, _internal(exc, "writing the answer"))
            return
        result.releaser = release
        if not writes:
            self._end(result, None)
            return
        self.writing = asyncio.get_running_loop().run_in_executor(None, _write_regions, writes)  # large: a thread
        self.writing.add_done_callback(lambda job: self._written(result, job))

    def _written(self, result: InferResult, job: asyncio.Future) -> None:
        self.writing = None
        exc = job.exception()
        if exc is None and not self.ended:
            self._end(result, None)
            return
        result.release()
        if not self.ended:
            self._end(None, _internal(exc, "writing a region"))

    def failed(self, error: V2Error) -> None:
        """Its inputs could not be read (the door has freed its space)."""
        self._end(None, error)

    def _end(self, result: InferResult | None, error: V2Error | None) -> None:
        if self.ended:
            if result is not None:
                result.release()
            return
        self.let_go()
        self.done(result, error)

    def cancel(self) -> None:
        """Nobody waits for the answer any more: let go of everything."""
        if self.ended:
            return
        busy = self.writing
        if self.req is not None:
            door = self.caller.door
            door.cancel(self.req)
            busy = door.copying.get(self.req) or busy
        if busy is not None:  # a thread uses its regions: they stay registered until it ends
            held, self.held = self.held, []
            busy.add_done_callback(lambda job: self.service._give_back(held))
        self.let_go()

    def let_go(self) -> None:
        self.ended = True
        self.service._give_back(self.held)
        self.held = []
        self.service.ledger.give_request(self.caller.identity)


OFFLOAD_BYTES = 1 << 20  # a region copy this large runs on a thread (pread and pwrite let go of the GIL)


def _internal(exc: BaseException, doing: str) -> V2Error:
    """``exc`` as a request's error: a V2Error as it is; anything else is our fault, logged with its
    traceback and answered INTERNAL."""
    if isinstance(exc, V2Error):
        return exc
    log.error("v2: %s failed", doing, exc_info=exc)
    return V2Error(ErrorCode.INTERNAL, f"{doing} failed ({type(exc).__name__}): see the server's log")


def _read_regions(reads: list) -> None:
    for sink, (region, ref, what) in reads:
        SystemShm.read_into(region, ref, sink, what)


def _write_regions(writes: list) -> None:
    for region, ref, view, what in writes:
        SystemShm.write_from(region, ref, view, what)


def rate_caller(identity: Identity) -> RateCaller:
    """``identity`` as rate limits see it: a Unix-socket peer is its uid (the same caller as on the
    native socket), a token holder its token and role, the anonymous caller one caller."""
    if identity.anonymous:
        return RateCaller(identity.key)
    if identity.key.startswith("token:"):
        return RateCaller(identity.key, token=identity.key.removeprefix("token:"),
                          role="admin" if identity.scopes == ADMIN else "client")
    return RateCaller(identity.key, identity.uid, identity.gids)


class V2Service:
    """The v2 operations over one running server (see the module header).

    ``auth``: who callers are and what they may do; ``ledger``: what each holds (the server sets
    its limits: ``max_inflight_per_uid``, ``max_buffered_bytes_per_uid``, read again on every
    use, so a reload applies); ``lifecycle``: the model lifecycle (repository extension)."""

    def __init__(self, *, dispatcher: Dispatcher, models: Models, status, lifecycle, shm: SystemShm,
                 auth: Authenticator, ledger: Ledger | None = None):
        self.dispatcher, self.models, self.status, self.lifecycle, self.shm = dispatcher, models, status, lifecycle, shm
        self.auth = auth
        self.ledger = ledger if ledger is not None else Ledger(lambda: 1 << 20, lambda: 1 << 40)
        self.doors: set[V2Door] = set()
        self.catalog = Catalog(models, status)  # the read-only half: metadata, repository index, statistics
        self.started = True
        self.rate = RateLimiter()  # per-caller rate limits: the server shares the Unix door's

    # -- rate limits ---------------------------------------------------------------------

    def check_rate(self, identity: Identity, model: str, nbytes: int | None) -> None:
        """Charge an infer request of ``identity`` for ``model`` (``nbytes``: its body's or
        message's size; None: not known before its body is read) to the rate limits that hold it.
        RateLimited naming the limit and when to retry; V2Error BAD_FRAME for a body of unknown
        size under a bytes/s limit (send Content-Length)."""
        if not self.rate.limits:
            return
        caller = rate_caller(identity)
        if nbytes is None:
            if self.rate.counts_bytes(caller, model):
                raise V2Error(ErrorCode.BAD_FRAME, "a bytes/s rate limit holds this caller: send the body with "
                                                   "Content-Length, not chunked (docs/config.md, 'Rate limits')")
            nbytes = 0
        refusal = self.rate.admit(caller, model, nbytes, self.dispatcher.clock.monotonic())
        if refusal is not None:
            raise RateLimited(refusal.message, refusal.retry_after)

    # -- connections ---------------------------------------------------------------------

    def open_door(self) -> "V2Door":
        """The bookkeeping of a new connection (HTTP) or peer (gRPC): its requests in flight."""
        door = V2Door(self)
        self.doors.add(door)
        return door

    def close_door(self, door: "V2Door") -> None:
        """Its connection is gone: its requests still in flight are dropped (their space freed once
        workers let go)."""
        self.doors.discard(door)
        door.close()

    def _need(self, caller: Caller, op: str) -> None:
        """V2Error PERMISSION_DENIED unless ``caller`` may run ``op`` (``auth.SCOPE_OF``)."""
        self.auth.check(caller.identity, op)

    # -- health and metadata (the catalog's, but for health) -----------------------------

    def live(self) -> bool:
        return not self.dispatcher.stopping

    def ready(self) -> bool:
        """Started and not shutting down, and every model's default version serving."""
        return self.started and self.status.health()["status"] == "ok"

    def server_metadata(self) -> dict:
        """``{"name": "shmserve", "version": ..., "extensions": [...]}``."""
        return {"name": "shmserve", "version": __version__, "extensions": list(EXTENSIONS)}

    def model_metadata(self, name: str, version: str | None) -> dict:
        """``Catalog.model_metadata``."""
        return self.catalog.model_metadata(name, version)

    def raw_input(self, name: str, version: str | None):
        """``Catalog.raw_input``."""
        return self.catalog.raw_input(name, version)

    def model_ready(self, name: str, version: str | None) -> bool:
        """``Catalog.model_ready``."""
        return self.catalog.model_ready(name, version)

    def model_config(self, name: str, version: str | None) -> dict:
        """``Catalog.model_config``."""
        return self.catalog.model_config(name, version)

    def _refusal(self, exc: ShmserveError, request: InferRequest) -> V2Error:
        """The dispatcher's refusal of ``request`` as a V2Error: a model or version it cannot
        serve in Triton's words (``triton_unavailable``), anything else as it is."""
        if exc.code in (ErrorCode.UNKNOWN_MODEL, ErrorCode.MODEL_UNAVAILABLE):
            return triton_unavailable(self.models.get(request.model), request.model,
                                      version_number(request.model, request.version), exc)
        return _error(exc)

    # -- inference -----------------------------------------------------------------------

    def start(self, caller: Caller, request: InferRequest, done) -> InferCall:
        """Serve one request through the dispatcher; ``done(result, None)`` or ``done(None,
        error)`` is called once it is answered (maybe before this returns), unless the returned
        call is cancelled first.  Inputs with ``shm`` are read from the caller's registered
        region, inputs whose data is ``Incoming`` are received by ``request.body``; outputs asked
        for with ``shm`` are written into one (their ``OutputTensor.data`` is then None).  Other
        outputs' data are views of the arena: the door calls ``result.release()`` once it has
        sent or copied them.

        Raises V2Error (the request is refused and holds nothing): every code the dispatcher
        refuses a request with, plus OVERLOADED (``max_inflight_per_uid``), BAD_INPUT (an
        unknown or duplicate input or output, data of the wrong size), BAD_DTYPE (an unknown
        datatype), BAD_SHAPE (a negative dimension), BAD_REGION (no such region for this caller,
        offset or size outside it), TOO_LARGE.  ``done``'s error: every code a request can fail
        with, plus BAD_REGION (an output larger than its region, a region shrunk under it)."""
        self._need(caller, "infer")
        self.ledger.take_request(caller.identity)
        call = InferCall(self, caller, request, done)
        try:
            self._submit(call)
        except BaseException:
            call.let_go()
            raise
        return call

    async def infer(self, caller: Caller, request: InferRequest) -> InferResult:
        """``start``, awaited: the result, or the V2Error raised.  Cancelling the awaiting task
        cancels the request."""
        fut = asyncio.get_running_loop().create_future()

        def done(result, error):
            if fut.done():
                if result is not None:
                    result.release()
            elif error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        call = self.start(caller, request, done)
        try:
            return await fut
        except asyncio.CancelledError:
            call.cancel()
            raise

    def _submit(self, call: InferCall) -> None:
        caller, request = call.caller, call.request
        door = caller.door
        known = self._known(request)
        if known is not None:
            check_inputs(request, known)
        metas = _input_metas(request)
        for t, meta in zip(request.inputs, metas):
            what = f"input {t.name!r}"
            nbytes = meta.nbytes
            if t.shm is not None:
                if t.shm.byte_size != nbytes:  # Triton reads exactly the tensor's bytes, never a prefix
                    raise byte_size_mismatch(request, t.name, nbytes, t.shm.byte_size)
                region = self.shm.take(caller.key, t.shm, nbytes, what)
                call.held.append(region)
                if nbytes:
                    call.sources.append((region, t.shm, what))
            else:
                if t.data is None or len(t.data) != nbytes:
                    raise byte_size_mismatch(request, t.name, nbytes, 0 if t.data is None else len(t.data))
                if isinstance(t.data, Incoming) and request.body is None:
                    raise V2Error(ErrorCode.INTERNAL, f"{what}: its bytes have no receiver")
                if nbytes:
                    call.sources.append(t.data)
        call.wanted = self._wanted(request)
        for o in call.wanted or ():
            if o.shm is not None:
                call.outputs[o.name] = region = self.shm.take(caller.key, o.shm, 0, f"output {o.name!r}")
                call.held.append(region)
        parsed = protocol.InferRequest(next(door.ids), request.model, metas, request.timeout_s,
                                       version=version_number(request.model, request.version), key=request.key,
                                       priority=request.priority)
        try:
            call.req = self.dispatcher.submit(door, parsed, payload_bytes=sum(m.nbytes for m in metas))
        except ShmserveError as exc:
            raise self._refusal(exc, request) from None
        door.pending[call.req] = call
        self.dispatcher.admit(call.req)

    def count_items(self, call: InferCall) -> None:
        """Count the batch items of ``call``, answered ok, beyond its one request (Triton's
        ``inference_count`` counts a request of batch 4 as 4): its first input's first dimension
        when its version's ``max_batch_size`` > 0."""
        version = call.req.model
        shape = call.request.inputs[0].shape if call.request.inputs else ()
        if version.config.max_batch_size > 0 and shape and shape[0] > 1:
            self.status.batch_items[(version.name, version.version)] += shape[0] - 1

    def _give_back(self, regions: list) -> None:
        for region in regions:
            self.shm.give_back(region)

    def _wanted(self, request: InferRequest):
        if request.outputs is None:
            return None
        names = set()
        for o in request.outputs:
            if o.name in names:
                raise V2Error(ErrorCode.BAD_INPUT, f"output '{o.name}' already exists in request", "INVALID_ARG")
            names.add(o.name)
        v = self._known(request)
        if v is not None:
            known = {t.name for t in v.spec.outputs}
            for o in request.outputs:
                if o.name not in known:
                    raise unexpected_output(request.model, o.name)
        return request.outputs

    def _known(self, request: InferRequest) -> ModelState | None:
        """The version whose spec a request is checked against in Triton's words before the
        dispatcher sees it: the version it names, else the model's default; None when that is
        not known yet (never loaded: the dispatcher checks it once it is) or does not exist (the
        dispatcher refuses it: ``_refusal``)."""
        model = self.models.get(request.model)
        if model is None:
            return None
        try:
            number = version_number(request.model, request.version)
        except V2Error:
            return None
        v = model.versions.get(number if number is not None else model.default)
        return v if v is not None and v.spec is not None else None

    def _result(self, call: InferCall, answer: Outputs) -> tuple[InferResult, list]:
        """The result of ``answer`` in the order asked for, and the region writes of its
        shared-memory outputs still to make (done here when small; large ones are left for a
        thread: ``(region, ref, view, what)``)."""
        request, wanted = call.request, call.wanted
        by_name = {o.name: o for o in answer.outputs}
        order = [(o.name, o) for o in wanted] if wanted is not None else [(o.name, None) for o in answer.outputs]
        out, writes = [], []
        for name, asked in order:
            o = by_name.get(name)
            if o is None:
                raise unexpected_output(request.model, name)
            datatype = V2_NAMES.get(o.dtype, o.dtype.upper())
            if asked is not None and asked.shm is not None:
                what = f"output {name!r}"
                SystemShm.fits(asked.shm, o.nbytes, what)
                region = call.outputs[name]  # held by the call since it was submitted
                if o.nbytes >= OFFLOAD_BYTES:
                    writes.append((region, asked.shm, o.view, what))
                elif o.nbytes:
                    SystemShm.write_from(region, asked.shm, o.view, what)
                out.append(OutputTensor(name, datatype, tuple(o.shape), None,
                                        ShmRef(asked.shm.region, o.nbytes, asked.shm.offset), asked.binary))
            elif asked is not None and asked.classification:
                version = call.req.model
                shape, data = classify.top_k(datatype, tuple(o.shape), o.view, asked.classification,
                                             version.config.max_batch_size > 0, self.catalog.labels_of(version),
                                             f"output {name!r}")
                out.append(OutputTensor(name, "BYTES", shape, data, None, bool(asked.binary)))
            else:
                # As Triton's server: an output the request lists is binary only if its own
                # binary_data says so; binary_data_output is the form of those it does not list.
                out.append(OutputTensor(name, datatype, tuple(o.shape), o.view if o.nbytes else b"",
                                        None, bool(asked.binary) if asked is not None else None))
        return InferResult(request.model, str(call.req.model.version), request.id, out), writes

    # -- system shared memory ------------------------------------------------------------

    def shm_register(self, caller: Caller, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register ``byte_size`` bytes at ``offset`` of the POSIX shared-memory object ``key``
        under ``name`` (names are per caller).  The object must belong to the caller's uid: a
        caller with none (an anonymous one, a token without ``uid``) cannot register.  V2Error
        PERMISSION_DENIED, or as ``SystemShm.register`` says; the message never contains ``key``."""
        self._need(caller, "shm_register")
        if caller.identity.uid is None:
            raise V2Error(ErrorCode.PERMISSION_DENIED, f"{caller.identity.who} names no uid whose shared-memory "
                                                       "objects it may register (a token's entry needs uid = N)")
        identity = caller.identity
        self.shm.register(caller.key, identity.uid, name, key, offset, byte_size, exact=not identity.key.startswith("uid:"))

    async def shm_unregister(self, caller: Caller, name: str | None) -> None:
        """Unregister ``name`` (None: all of the caller's) as Triton does (``SystemShm.unregister``:
        at once; a region requests still use goes when they are done, listed until then).
        Unknown names are not an error (as Triton)."""
        self._need(caller, "shm_unregister")
        self.shm.unregister(caller.key, name)

    def shm_status(self, caller: Caller, name: str | None) -> list[dict]:
        """``[{"name", "key", "offset", "byte_size"}]`` of the caller's regions.  V2Error
        BAD_REGION for an unknown ``name``."""
        self._need(caller, "shm_status")
        return self.shm.status(caller.key, name)

    def cuda_shm_register(self, caller: Caller, name: str, raw_handle: bytes, device_id: int,
                          byte_size: int) -> None:
        """Always V2Error BAD_REGION: CUDA shared memory is not supported."""
        self._need(caller, "cuda_shm_register")
        raise V2Error(ErrorCode.BAD_REGION, "CUDA shared memory is not supported by shmserve: use system shared "
                                            "memory, or the native client's lanes for GPU models")

    def cuda_shm_status(self, caller: Caller, name: str | None) -> list[dict]:
        """Always empty; V2Error BAD_REGION for a ``name``."""
        self._need(caller, "cuda_shm_status")
        if name:
            raise V2Error(ErrorCode.BAD_REGION, f"no CUDA shared-memory region {name!r} is registered")
        return []

    # -- repository and statistics ---------------------------------------------------------

    def repository_index(self, caller: Caller, ready_only: bool = False) -> list[dict]:
        """``Catalog.repository_index``.  V2Error PERMISSION_DENIED for a caller not on the admin
        list."""
        self._need(caller, "repository_index")
        return self.catalog.repository_index(ready_only)

    def _control_version(self, name: str, parameters: dict | None) -> int | None:
        parameters = parameters or {}
        for key in parameters:
            if key == "config" or key.startswith("file:"):
                raise V2Error(ErrorCode.BAD_INPUT, f"load parameter {key!r} is not supported: shmserve loads "
                                                   "models only from its model repository")
            if key not in ("version", "unload_dependents"):
                raise V2Error(ErrorCode.BAD_INPUT, f"unknown parameter {str(key)[:40]!r} (version, "
                                                   "unload_dependents)")
        version = parameters.get("version")
        return version_number(name, str(version)) if version is not None else None

    async def repository_load(self, caller: Caller, name: str, parameters: dict | None = None) -> None:
        """Load ``name`` (its newest version, or ``parameters["version"]``) through the model
        lifecycle.  V2Error PERMISSION_DENIED, UNKNOWN_MODEL, MODEL_UNAVAILABLE (it failed to
        load; the message says why), BAD_INPUT (Triton's ``config`` or ``file:`` overrides)."""
        self._need(caller, "repository_load")
        self._check_name(name)
        version = self._control_version(name, parameters)
        try:
            await self.lifecycle.load(name, version, None, by=f"{caller.identity.who} (v2)")
        except ShmserveError as exc:
            raise _error(exc) from None

    async def repository_unload(self, caller: Caller, name: str, parameters: dict | None = None) -> None:
        """Unload every loaded version of ``name`` (or ``parameters["version"]``).  V2Error
        PERMISSION_DENIED, UNKNOWN_MODEL."""
        self._need(caller, "repository_unload")
        self._check_name(name)
        version = self._control_version(name, parameters)
        try:
            await self.lifecycle.unload(name, version, by=f"{caller.identity.who} (v2)")
        except ShmserveError as exc:
            raise _error(exc) from None

    @staticmethod
    def _check_name(name: str) -> None:
        try:
            protocol.parse_name(name, "model")
        except protocol.ProtocolViolation as exc:
            raise V2Error(ErrorCode.BAD_INPUT, exc.message) from None

    def statistics(self, caller: Caller, name: str | None, version: str | None) -> dict:
        """``Catalog.statistics``.  V2Error PERMISSION_DENIED, UNKNOWN_MODEL."""
        self._need(caller, "statistics")
        return self.catalog.statistics(name, version)


def _input_metas(request: InferRequest) -> tuple[protocol.TensorMeta, ...]:
    """The dispatcher's descriptions of a request's inputs, checked by the native protocol's own
    rules (names, counts, ranks, dimension sizes; one owner of them).  V2Error BAD_INPUT,
    BAD_DTYPE, BAD_SHAPE, BAD_FRAME (timeout, model name)."""
    items = []
    for t in request.inputs:
        dtype = DATATYPES.get(t.datatype)
        if dtype is None:
            raise V2Error(ErrorCode.BAD_DTYPE, f"input {str(t.name)[:64]!r}: unknown datatype "
                                               f"{str(t.datatype)[:20]!r} (one of {', '.join(DATATYPES)})")
        item = {"name": t.name, "dtype": dtype, "shape": list(t.shape)}
        if dtype not in FIXED_DTYPES:  # BYTES: its size is its data's
            item["nbytes"] = t.shm.byte_size if t.shm is not None else len(t.data or b"")
        items.append(item)
    timeout = request.timeout_s
    try:
        protocol.parse_name(request.model, "the model name")
        if timeout is not None and not (type(timeout) in (int, float) and 0 < timeout <= protocol.MAX_TIMEOUT_S):
            raise protocol.ProtocolViolation(ErrorCode.BAD_FRAME, f"the timeout must be in (0, "
                                                                  f"{protocol.MAX_TIMEOUT_S}] seconds")
        return protocol.parse_tensor_list(items, "inputs", with_offset=False)
    except protocol.ProtocolViolation as exc:
        raise V2Error(exc.code, exc.message) from None


FIXED_DTYPES = frozenset(dtype for datatype, dtype in DATATYPES.items() if datatype in ITEMSIZE)
