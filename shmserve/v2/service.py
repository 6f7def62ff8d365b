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
``Catalog`` (``shmserve.v2.catalog``, ``V2Service.catalog``); a request
on its way, the dispatcher ``Door`` of a v2 connection and its input and
output copies are ``Inference`` (``shmserve.v2.inference``,
``V2Service.inference``, with ``V2Door`` and ``InferCall``): this module
checks who asks and hands those calls to them.

Every call takes a ``Caller`` (who: an ``auth.Identity``; and which
connection: its ``V2Door``, whose requests the per-connection limits count).
Errors are ``messages.V2Error`` with a shmserve code; the doors map them to
HTTP and gRPC status codes.

Must not: parse HTTP or protobuf, touch a socket, or block the loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import Callable

from shmserve import __version__, protocol
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.dispatcher import Dispatcher
from shmserve.frontend.models import Models
from shmserve.frontend.ratelimit import Caller as RateCaller, RateLimiter
from shmserve.v2.auth import ADMIN, Authenticator, Identity
from shmserve.v2.catalog import EXTENSIONS, Catalog, version_number
from shmserve.v2.inference import InferCall, Inference, V2Door, v2_error  # V2Door, InferCall: the doors' names
from shmserve.v2.messages import InferRequest, InferResult, RateLimited, V2Error
from shmserve.v2.sysshm import SystemShm

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
        self.inference = Inference(dispatcher=dispatcher, models=models, status=status, shm=shm, ledger=self.ledger,
                                   catalog=self.catalog)  # infer requests on their way
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
        door = V2Door(self.inference)
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

    # -- inference (``Inference``'s, once the caller may) ------------------------------------

    def start(self, caller: Caller, request: InferRequest, done) -> InferCall:
        """``Inference.start``, for a caller that may infer.  V2Error PERMISSION_DENIED, and as
        ``Inference.start`` says."""
        self._need(caller, "infer")
        return self.inference.start(caller, request, done)

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
            raise v2_error(exc) from None

    async def repository_unload(self, caller: Caller, name: str, parameters: dict | None = None) -> None:
        """Unload every loaded version of ``name`` (or ``parameters["version"]``).  V2Error
        PERMISSION_DENIED, UNKNOWN_MODEL."""
        self._need(caller, "repository_unload")
        self._check_name(name)
        version = self._control_version(name, parameters)
        try:
            await self.lifecycle.unload(name, version, by=f"{caller.identity.who} (v2)")
        except ShmserveError as exc:
            raise v2_error(exc) from None

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
