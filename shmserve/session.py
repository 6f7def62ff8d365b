"""The client side of the wire protocol, sans I/O: requests to frames; bytes and descriptors to answers.

Owns: request ids and what each outstanding one expects; the frames of every
request kind; turning the server's frames into typed events, after checking
them (the server's bytes are untrusted too: anything malformed ends the
connection with ``ConnectionFailed``, never an exception from the wrong
place); the descriptors the server passed until an event hands one out; and
whether the connection is still usable.  ``Client`` and ``AsyncClient``
(``shmserve.client``) only pump bytes and descriptors through a
``ClientSession`` — after h11, as the front-end does with ``protocol.Connection``.

Who may serve: before a pump sends anything it asks the kernel who listens
(``SO_PEERCRED``) and ``check_server`` refuses anyone but the uids the client
trusts (its own, root, and the one it was told: ``config.trusted_server_uids``):
whoever serves the socket receives the client's tensors and writes its results.

Must not: touch a socket, a clock, an event loop or shared memory.  Framing is
``shmserve.protocol``'s; this module speaks it from the client's side.

Rules (answers)
---------------
==============  =====================  ==============================================
request         answered by            event
==============  =====================  ==============================================
INFER           RESULT + payload       InferResult: the payload lands in new arrays
                                       (bytes outputs: unpacked into object arrays)
INFER_REGION    RESULT_REGION          RegionResult: placements in the output area
OPEN_REGION     REGION + descriptor    RegionGranted: carries the next descriptor
CLOSE_REGION    REPLY                  Reply: the answer less its id
MODELS          REPLY                  Reply: the list of models
HEALTH, INFO    REPLY                  Reply: the answer less its id
any of these    ERROR with its id      RequestFailed: the server's code and message
                                       (and its retry_after, if any: a rate limit)
CANCEL          (nothing)              the INFER or INFER_REGION it names stays
                                       outstanding: its one answer (ERROR
                                       ``cancelled``, or what it had already)
                                       comes and is discarded
(none)          ERROR with id null     ConnectionFailed: the server's code and message
(none)          anything else          ConnectionFailed: ConnectionClosed
==============  =====================  ==============================================

The table is ``_RULES`` below.  "Anything else": a frame ``protocol.Connection``
refuses, an answer to an id that is not outstanding or of a kind its request
is not answered by, a result whose payload size does not match its outputs,
unreadable metadata.  A result that places an output outside the output area
its request named is a ``RequestFailed`` (INTERNAL), and so are a REGION answer
without a descriptor and a bytes output whose elements do not take exactly its
size: the connection itself is still in step.  A zero-copy result with a bytes
output is a ``RequestFailed`` (BAD_DTYPE): zero-copy calls carry fixed-size
tensors only.

Descriptors: the server passes a region's descriptor with the REGION frame's
bytes, and the kernel delivers it with the read that holds that frame's
first bytes, so it is there when the frame completes; each REGION answer
takes the oldest descriptor not yet taken.

After ``ConnectionFailed`` the session is done: ``next_event`` returns the same
event again, requests raise ``ConnectionClosed`` and descriptors still held or
passed later are closed.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from shmserve import layout, protocol
from shmserve.config import SERVER_UID_ENV
from shmserve.errors import BadArgument, ConnectionClosed, ErrorCode, ShmserveError
from shmserve.protocol import NEED_DATA, Frame, Kind, PayloadDone, TensorMeta

__all__ = ["NEED_DATA", "ClientSession", "ConnectionFailed", "InferResult", "Placement", "RegionGranted",
           "RegionResult", "Reply", "RequestFailed", "check_server", "check_tensor", "check_timeout"]

READ_BUFFER = 256 * 1024  # scratch for frame headers and metadata; a result's payload goes to its arrays

_DTYPES = dict(layout.NUMPY_DTYPES)
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}  # dtype.name is slow
_BYTES_DTYPE = layout.BYTES_DTYPE
FIXED_DTYPES = frozenset(d for d in _DTYPE_NAMES if d is not _BYTES_DTYPE)  # what a view of shared memory holds
BYTES_HINT = "a bytes tensor is a numpy object array of bytes or str"
NOT_SENT = "server answered a request this client did not send"


# -- the caller's arguments, checked before anything is sent -------------------------------

def check_timeout(timeout_s) -> float:
    """``timeout_s`` if it is a number of seconds the server accepts, in (0, MAX_TIMEOUT_S].

    Raises BadArgument (BAD_ARGUMENT), naming the value."""
    if type(timeout_s) not in (int, float) or not 0 < timeout_s <= protocol.MAX_TIMEOUT_S:
        raise BadArgument(ErrorCode.BAD_ARGUMENT, f"timeout must be a number of seconds in "
                                                  f"(0, {protocol.MAX_TIMEOUT_S}], not {timeout_s!r}")
    return timeout_s


def check_routing(version, key) -> dict:
    """A request's ``version`` and ``key`` as metadata fields (those given); BadArgument
    (BAD_ARGUMENT) for a version that is not an integer in [1, 2**31) or a key that is not a
    printable string of 1-256 characters."""
    extra = {}
    if version is not None:
        if type(version) is not int or not 1 <= version <= protocol.MAX_VERSION:
            raise BadArgument(ErrorCode.BAD_ARGUMENT, f"version must be a positive integer, got {version!r}")
        extra["version"] = version
    if key is not None:
        if not isinstance(key, str) or not 0 < len(key) <= protocol.MAX_NAME or not key.isprintable():
            raise BadArgument(ErrorCode.BAD_ARGUMENT, f"key must be a printable string of 1-{protocol.MAX_NAME} "
                                                      f"characters, got {key!r}")
        extra["key"] = key
    return extra


PRIORITY_MAX = 2**32 - 1  # a slot's priority field is a u32 (layout); above the model's levels: its default


def check_priority(priority) -> int:
    """A request's ``priority`` (0: the model's default level; 1 is served first: docs/config.md,
    "Priorities and queue policy"); BadArgument (BAD_ARGUMENT, a ValueError) for one that is not
    an int in [0, 2**32)."""
    if type(priority) is not int or not 0 <= priority <= PRIORITY_MAX:
        raise BadArgument(ErrorCode.BAD_ARGUMENT, f"priority must be an integer from 0 (the model's default level) "
                                                  f"to {PRIORITY_MAX}, 1 served first; got {priority!r}")
    return priority


def check_tensor(name: str, shape, dtype) -> tuple[tuple[int, ...], np.dtype]:
    """A zero-copy input's ``(shape, dtype)`` as (tuple of ints, supported numpy dtype).

    Raises BadArgument: BAD_DTYPE for a dtype the protocol does not carry or a bytes tensor
    (its size is not known before it is written: ``infer`` carries it), BAD_SHAPE for a shape
    that is not a sequence of at most MAX_DIMS non-negative integers."""
    try:
        dt = np.dtype(dtype) if dtype != protocol.BYTES else _BYTES_DTYPE
    except (TypeError, ValueError):
        dt = None
    if dt is _BYTES_DTYPE:
        raise BadArgument(ErrorCode.BAD_DTYPE, f"input {name!r} is bytes: {layout.NO_ZERO_COPY_BYTES}")
    if dt not in _DTYPE_NAMES:
        raise BadArgument(ErrorCode.BAD_DTYPE, f"input {name!r}: dtype {dtype!r} is not supported (supported: "
                                               f"{', '.join(protocol.SUPPORTED_DTYPES)})")
    try:
        dims = tuple(int(d) if isinstance(d, (int, np.integer)) else None for d in shape)
    except TypeError:
        dims = (None,)
    if len(dims) > protocol.MAX_DIMS or any(d is None or d < 0 for d in dims):
        raise BadArgument(ErrorCode.BAD_SHAPE, f"input {name!r}: shape must be at most {protocol.MAX_DIMS} "
                                               f"non-negative integers, not {shape!r}")
    return dims, dt


# -- who may serve --------------------------------------------------------------------------

def check_server(path: str, pid: int, uid: int, trusted: frozenset[int]) -> None:
    """ShmserveError PERMISSION_DENIED unless the process serving ``path`` (``pid`` and ``uid`` as
    SO_PEERCRED reports them) runs as one of the ``trusted`` uids; the message says whom it found
    and how to trust it.  Called before the client sends anything."""
    if uid in trusted:
        return
    import pwd

    try:
        who = f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        who = f"uid {uid}"
    raise ShmserveError(ErrorCode.PERMISSION_DENIED,
                        f"{path} is served by {who}, pid {pid}, not by a uid this client trusts "
                        f"({', '.join(map(str, sorted(trusted)))}); nothing was sent.  If that is your server, "
                        f"pass server_uid={uid} or set {SERVER_UID_ENV}={uid}")


# -- events (read-only by contract; not frozen, which would cost each one a few hundred ns) -

@dataclass(slots=True)
class InferResult:
    """An INFER's outputs, name -> a new array holding what the server sent."""

    request_id: int
    outputs: dict[str, np.ndarray]


class Placement(NamedTuple):
    """Where the server put one output of a zero-copy call: inside the request's output area."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


@dataclass(slots=True)
class RegionResult:
    """An INFER_REGION's outputs: where each lies in the request's region."""

    request_id: int
    outputs: tuple[Placement, ...]


@dataclass(slots=True)
class Reply:
    """A control answer: MODELS the list of models, otherwise the answer's fields but ``id``."""

    request_id: int
    value: object


@dataclass(slots=True)
class RegionGranted:
    """An OPEN_REGION's answer.  ``fd`` is now the receiver's: it maps it and closes it
    (``ClientSession.discard`` closes it for an answer nobody waits for any more).
    ``lane``: for a lane region, ``{model, data_offset, slots}``; else None."""

    request_id: int
    region: int
    size: int
    lane: dict | None
    fd: int


@dataclass(slots=True)
class RequestFailed:
    """The server refused or failed one request; the connection goes on."""

    request_id: int
    error: ShmserveError


@dataclass(slots=True)
class ConnectionFailed:
    """The connection is over: every outstanding request fails with ``error``.

    ``code`` is the server's when it said why (its error with id null), the
    pump's when it gave up for a reason of its own (e.g. TIMEOUT), else None:
    the error is then ``ConnectionClosed``.
    """

    message: str
    code: ErrorCode | None = None
    request_id = None  # answers no request

    @property
    def error(self) -> ShmserveError:
        """A new exception each time (one per caller that raises it)."""
        return ConnectionClosed(self.message) if self.code is None else ShmserveError(self.code, self.message)


MAX_RETRY_AFTER_S = 86400.0  # a server's retry_after beyond a day is not believed


def _retry_after(meta: dict) -> float | None:
    """An error's ``retry_after`` (seconds, a rate limit's refusal), or None when the server said
    none or said something that is not a number of seconds in [0, MAX_RETRY_AFTER_S]."""
    value = meta.get("retry_after")
    if type(value) not in (int, float) or not 0 <= value <= MAX_RETRY_AFTER_S:
        return None
    return float(value)


class _Unreadable(Exception):
    """An answer's metadata breaks its schema (becomes a ConnectionFailed)."""


# -- the session --------------------------------------------------------------------------

class ClientSession:
    """The client's end of one connection.

    Sending: each request method returns ``(request_id, parts)``; the pump sends
    ``parts`` (bytes-like, one vectored send) as they are and in order, then
    waits for the event whose ``request_id`` is that id.  Input arrays given to
    ``infer`` are sent from their own memory: keep them unchanged until sent.

    Receiving: read from the socket into ``read_buffer()`` and report with
    ``read_done(n)`` (or feed bytes with ``receive_data``); hand descriptors
    that came with a read to ``receive_fds`` before asking for events; take
    events with ``next_event()`` until it returns ``NEED_DATA``.  End of
    stream, a socket error or a deadline are the pump's to notice: ``fail``.

    Not thread-safe: one pump drives it.
    """

    def __init__(self) -> None:
        self._conn = protocol.Connection(protocol.Role.CLIENT)
        self._next_id = 1
        self._outstanding: dict[int, tuple[_Rule, tuple[int, int] | None]] = {}  # id -> (its rule, output area)
        self._fds: deque[int] = deque()
        self._filling: InferResult | None = None  # its arrays are receiving the current payload
        self._packed: list | None = None  # its bytes outputs, (name, shape, raw): unpacked once it is in
        self._failure: ConnectionFailed | None = None
        self._scratch = memoryview(bytearray(READ_BUFFER))
        self._into_payload = False  # whether read_buffer() last returned a payload view

    # -- requests ---------------------------------------------------------------------

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], timeout_s: float, version: int | None = None,
              key: str | None = None, priority: int = 0) -> tuple[int, list]:
        """An inline request: its frame header, then each input's bytes from the array itself.
        ``version``: the model version (None: its default); ``key``: a routing key (a canary
        sends one key to one version).  A bytes input (an object array of bytes or str) is
        serialized here (``layout.encode_bytes``).  BadArgument (before an id is taken):
        BAD_DTYPE for an unsupported dtype or a bytes input's element that is neither,
        BAD_ARGUMENT for a timeout out of range (``check_timeout``), a version that is not a
        positive integer or a key that is not a printable string of 1-256 characters, a
        ``priority`` ``check_priority`` refuses (sent as the meta's "priority" only when nonzero);
        ConnectionClosed if failed."""
        check_timeout(timeout_s)
        extra = check_routing(version, key)
        if check_priority(priority):
            extra["priority"] = priority
        metas, parts, total = [], [b""], 0
        for name, value in inputs.items():
            a = np.ascontiguousarray(value)
            dtype = _DTYPE_NAMES.get(a.dtype)
            if dtype is None:
                raise BadArgument(ErrorCode.BAD_DTYPE, f"input {name!r}: dtype {a.dtype} is not supported "
                                                       f"({BYTES_HINT})")
            if dtype == protocol.BYTES:
                try:
                    data = layout.encode_bytes(a)
                except layout.LayoutError as exc:
                    raise BadArgument(ErrorCode.BAD_DTYPE, f"input {name!r}: {exc} ({BYTES_HINT})") from None
                metas.append(protocol.tensor_wire(name, dtype, a.shape, len(data)))
                if data:
                    parts.append(data)
                    total += len(data)
                continue
            metas.append({"name": name, "dtype": dtype, "shape": a.shape})
            if a.nbytes:
                parts.append(_raw(a))
                total += a.nbytes
        rid = self._expect(_INFER)
        parts[0] = protocol.encode_frame(_INFER.request, {"id": rid, "model": model, "inputs": metas,
                                                          "timeout_s": timeout_s, **extra}, total)
        return rid, parts

    def infer_region(self, model: str, inputs: Sequence[TensorMeta], region: int, output_offset: int,
                     output_capacity: int, timeout_s: float, version: int | None = None,
                     key: str | None = None, priority: int = 0) -> tuple[int, list]:
        """A zero-copy request: ``inputs`` (with offsets) already lie in ``region``; outputs
        go to [output_offset, output_offset + output_capacity) of it; ``version``, ``key`` and
        ``priority`` as ``infer``'s.  BadArgument for a timeout out of range (``check_timeout``), a
        version or key ``check_routing`` refuses, a priority ``check_priority`` refuses;
        ConnectionClosed if failed."""
        check_timeout(timeout_s)
        extra = check_routing(version, key)
        if check_priority(priority):
            extra["priority"] = priority
        rid = self._expect(_INFER_REGION, (output_offset, output_offset + output_capacity))
        return rid, [protocol.encode_frame(_INFER_REGION.request, {
            "id": rid, "model": model, "inputs": [t.to_wire() for t in inputs], "region": region,
            "output_offset": output_offset, "output_capacity": output_capacity, "timeout_s": timeout_s, **extra})]

    def open_region(self, size: int, lane: str | None = None, version: int | None = None) -> tuple[int, list]:
        """Ask for ``size`` bytes of shared memory (with a queue to a worker of model ``lane``: of its
        ``version`` if given, else of its default)."""
        meta = {"size": size} if lane is None else {"size": size, "lane": lane}
        if lane is not None and version is not None:
            meta["version"] = version
        return self._control(Kind.OPEN_REGION, meta)

    def close_region(self, region: int) -> tuple[int, list]:
        return self._control(Kind.CLOSE_REGION, {"region": region})

    def models(self) -> tuple[int, list]:
        return self._control(Kind.MODELS, {})

    def health(self) -> tuple[int, list]:
        return self._control(Kind.HEALTH, {})

    def info(self) -> tuple[int, list]:
        return self._control(Kind.INFO, {})

    def repository(self) -> tuple[int, list]:
        return self._control(Kind.REPOSITORY, {})

    def lifecycle(self, kind: Kind, model: str, **fields) -> tuple[int, list]:
        """A LOAD, UNLOAD, SCALE or CANARY call on ``model`` with ``fields`` (None values left out)."""
        return self._control(kind, {"model": model, **{k: v for k, v in fields.items() if v is not None}})

    def cancel(self, request_id: int) -> bytes | None:
        """The CANCEL frame that tells the server its caller gave up on inference request
        ``request_id`` (timed out, interrupted, its task cancelled), or None if that is no
        outstanding INFER or INFER_REGION (a control call runs to its end: nothing to tell) or the
        connection is over.  The request stays outstanding: its one answer still comes, and the
        pump discards it (``discard``).  The pump sends the frame whole, between other frames."""
        expected = self._outstanding.get(request_id) if self._failure is None else None
        if expected is None or expected[0].request not in _INFERS:
            return None
        return protocol.encode_frame(Kind.CANCEL, {"id": request_id})

    def reserve_id(self) -> int:
        """An id for a call that never crosses the socket (a lane call): ids stay unique on a
        connection, so a slot in an arena or lane can be told apart by its request id."""
        rid = self._next_id
        self._next_id += 1
        return rid

    @property
    def last_request_id(self) -> int:
        """The id most recently given out (0: none yet)."""
        return self._next_id - 1

    # -- bytes and descriptors in -----------------------------------------------------

    def read_buffer(self) -> memoryview:
        """Where the next read from the socket should land: while a result's payload is due, a
        view of its array (received in place, no copy of ours); otherwise a scratch buffer."""
        target = self._conn.payload_buffer()
        self._into_payload = target is not None
        return target if target is not None else self._scratch

    def read_done(self, n: int) -> None:
        """``n`` bytes (n > 0) were read into the buffer ``read_buffer()`` returned last."""
        if self._failure is not None:
            return
        if self._into_payload:
            self._conn.payload_received(n)
        else:
            self._conn.receive_data(self._scratch[:n])

    def receive_data(self, data) -> None:
        """Feed received bytes (any bytes-like object; copied where they are not a payload's)."""
        if self._failure is None:
            self._conn.receive_data(data)

    def receive_fds(self, fds: Iterable[int]) -> None:
        """Descriptors the server passed (SCM_RIGHTS) with the bytes of a read.  The session owns
        them until a RegionGranted hands one out; each REGION answer takes the oldest."""
        if self._failure is not None:
            _close_all(fds)
        else:
            self._fds.extend(fds)

    # -- events out -------------------------------------------------------------------

    def next_event(self):
        """The next answer: InferResult, RegionResult, Reply, RegionGranted, RequestFailed,
        ConnectionFailed (then always that), or NEED_DATA.  Never raises for what the server sent."""
        if self._failure is not None:
            return self._failure
        conn = self._conn
        while True:
            event = conn.next_event()
            if event is NEED_DATA:
                return NEED_DATA
            kind = type(event)
            if kind is Frame:
                answer = self._answer(event)
                if answer is not None:
                    return answer
            elif kind is PayloadDone:
                answer, self._filling = self._filling, None
                if self._packed is not None:
                    answer = self._unpack(answer)
                return answer
            else:  # ProtocolError
                return self.fail(f"unreadable answer from the server: {event.message}")

    def discard(self, event) -> None:
        """An answer nobody waits for any more (its call timed out or was given up): release
        what it holds (a RegionGranted's descriptor)."""
        if type(event) is RegionGranted:
            os.close(event.fd)

    def fail(self, message: str, code: ErrorCode | None = None) -> ConnectionFailed:
        """End the connection (the pump saw it close, break or miss a deadline; or an answer was
        malformed).  The first failure stands: returns it.  Closes the descriptors still held."""
        if self._failure is None:
            self._failure = ConnectionFailed(message, code)
            self._outstanding.clear()
            self._filling = self._packed = None
            _close_all(self._fds)
            self._fds.clear()
        return self._failure

    @property
    def failure(self) -> ConnectionFailed | None:
        """Why the connection is over, or None while it is usable."""
        return self._failure

    def ensure_open(self) -> None:
        """ConnectionClosed (with the first failure's message) if the connection is over."""
        if self._failure is not None:
            raise ConnectionClosed(self._failure.message)

    def close(self) -> None:
        """The pump is done: fail the connection ("client closed") unless it already failed, and
        close every descriptor not handed out.  Idempotent."""
        self.fail("client closed")

    # -- internals --------------------------------------------------------------------

    def _expect(self, rule: _Rule, output_area: tuple[int, int] | None = None) -> int:
        self.ensure_open()
        rid = self._next_id
        self._next_id += 1
        self._outstanding[rid] = (rule, output_area)
        return rid

    def _control(self, kind: Kind, meta: dict) -> tuple[int, list]:
        rid = self._expect(_RULES[kind])
        return rid, [protocol.encode_frame(kind, {"id": rid, **meta})]

    def _answer(self, frame: Frame):
        """The event a complete frame makes; None when its payload is still to come."""
        meta, kind = frame.meta, frame.kind
        rid = meta.get("id")
        if kind is _ERROR and rid is None:
            return self.fail(str(meta.get("message")), ErrorCode.from_wire(str(meta.get("code"))))
        expected = self._outstanding.pop(rid, None) if type(rid) is int else None
        if expected is None:
            return self.fail(NOT_SENT)
        rule, output_area = expected
        if kind is _ERROR:
            return RequestFailed(rid, ShmserveError(ErrorCode.from_wire(str(meta.get("code"))),
                                                    str(meta.get("message")), _retry_after(meta)))
        if kind is not rule.answer:
            return self.fail(f"server answered {rule.request.name} with {kind.name}")
        try:
            return rule.decode(self, rid, meta, frame.data_len, output_area)
        except _Unreadable as exc:
            return self.fail(f"unreadable answer from the server: {exc}")

    def _result(self, rid: int, meta: dict, data_len: int, _area) -> InferResult | ConnectionFailed | None:
        tensors, total = _tensors(meta, with_offset=False)
        if total != data_len:
            return self.fail("server sent a result whose payload does not match its outputs")
        outputs, sinks, packed = {}, [], None
        try:
            for name, dtype, shape, nbytes, _ in tensors:
                if dtype is _BYTES_DTYPE:  # its serialized form lands here, then becomes its array
                    outputs[name] = raw = bytearray(nbytes)
                    packed = packed or []
                    packed.append((name, shape, raw))
                    if nbytes:
                        sinks.append(raw)
                    continue
                outputs[name] = a = np.empty(shape, dtype)
                if nbytes:
                    sinks.append(_raw(a))
        except MemoryError:
            return self.fail(f"no memory for a result of {data_len} bytes")
        result = InferResult(rid, outputs)
        self._packed = packed
        if not data_len:
            return result if packed is None else self._unpack(result)
        self._conn.accept_payload(sinks)
        self._filling = result
        return None

    def _unpack(self, result: InferResult) -> InferResult | RequestFailed:
        """``result`` with its bytes outputs turned into object arrays; RequestFailed (INTERNAL)
        if one is malformed (the connection is still in step: its payload was the size it said)."""
        packed, self._packed = self._packed, None
        for name, shape, raw in packed:
            try:
                result.outputs[name] = layout.decode_bytes(raw, shape)
            except layout.LayoutError as exc:
                return RequestFailed(result.request_id, ShmserveError(
                    ErrorCode.INTERNAL, f"the server sent a malformed bytes output {name!r}: {exc}"))
        return result

    def _region_result(self, rid: int, meta: dict, _data_len, output_area: tuple[int, int]) -> RegionResult | RequestFailed:
        lo, hi = output_area
        placements = []
        for name, dtype, shape, nbytes, offset in _tensors(meta, with_offset=True)[0]:
            if dtype is _BYTES_DTYPE:
                return RequestFailed(rid, ShmserveError(ErrorCode.BAD_DTYPE, f"output {name!r} is bytes: "
                                                                             f"{layout.NO_ZERO_COPY_BYTES}"))
            if not (lo <= offset and offset + nbytes <= hi):
                return RequestFailed(rid, ShmserveError(ErrorCode.INTERNAL,
                                                        "server placed an output outside the output area"))
            placements.append(Placement(name, dtype, shape, offset))
        return RegionResult(rid, tuple(placements))

    def _region_granted(self, rid: int, meta: dict, *_) -> RegionGranted | RequestFailed:
        region, size, lane = meta.get("region"), meta.get("size"), meta.get("lane")
        if type(region) is not int or not 0 < region < 2**32 or type(size) is not int or size <= 0:
            raise _Unreadable("a region answer needs a positive integer 'region' and 'size'")
        if lane is not None and not (type(lane) is dict and type(lane.get("model")) is str
                                     and size >= layout.LANE_BYTES):
            raise _Unreadable("a lane region's 'lane' must name its model, and the region must hold a lane")
        if not self._fds:
            return RequestFailed(rid, ShmserveError(ErrorCode.INTERNAL,
                                                    "the server's region answer carried no descriptor"))
        return RegionGranted(rid, region, size, lane, self._fds.popleft())

    def _models(self, rid: int, meta: dict, *_) -> Reply:
        models = meta.get("models")
        if type(models) is not list or not all(type(m) is dict and type(m.get("name")) is str for m in models):
            raise _Unreadable("'models' must be a list of objects with a 'name'")
        return Reply(rid, models)

    def _reply(self, rid: int, meta: dict, *_) -> Reply:
        return Reply(rid, {k: v for k, v in meta.items() if k != "id"})


class _Rule(NamedTuple):
    request: Kind
    answer: Kind  # the one kind besides ERROR that may answer it
    decode: Callable  # (session, id, meta, data_len, output area) -> the event; None while its payload is due


_RULES = {rule.request: rule for rule in (  # the module docstring's table
    _Rule(Kind.INFER, Kind.RESULT, ClientSession._result),
    _Rule(Kind.INFER_REGION, Kind.RESULT_REGION, ClientSession._region_result),
    _Rule(Kind.OPEN_REGION, Kind.REGION, ClientSession._region_granted),
    _Rule(Kind.CLOSE_REGION, Kind.REPLY, ClientSession._reply),
    _Rule(Kind.MODELS, Kind.REPLY, ClientSession._models),
    _Rule(Kind.HEALTH, Kind.REPLY, ClientSession._reply),
    _Rule(Kind.INFO, Kind.REPLY, ClientSession._reply),
    *(_Rule(kind, Kind.REPLY, ClientSession._reply)
      for kind in (Kind.REPOSITORY, Kind.LOAD, Kind.UNLOAD, Kind.SCALE, Kind.CANARY)),
)}
_INFER, _INFER_REGION, _ERROR = _RULES[Kind.INFER], _RULES[Kind.INFER_REGION], Kind.ERROR  # Kind.X costs ~0.2 us
_INFERS = (Kind.INFER, Kind.INFER_REGION)  # what a CANCEL may name


# -- answers' metadata --------------------------------------------------------------------

def _tensors(meta: dict, *, with_offset: bool) -> tuple[list[tuple[str, np.dtype, tuple, int, int]], int]:
    """An answer's ``outputs`` as (name, dtype, shape, nbytes, offset) each, and their total bytes;
    _Unreadable if malformed.  (protocol.parse_tensor_list checks requests the same way, at
    several times the cost.)"""
    items = meta.get("outputs")
    if type(items) is not list or len(items) > protocol.MAX_TENSORS_PER_MESSAGE:
        raise _Unreadable(f"'outputs' must be a list of at most {protocol.MAX_TENSORS_PER_MESSAGE} tensors")
    out, names, total = [], set(), 0
    for item in items:
        if type(item) is not dict:
            raise _Unreadable("each output must be an object")
        name, dtype, shape = item.get("name"), item.get("dtype"), item.get("shape")
        if type(name) is not str or name in names:
            raise _Unreadable(f"output name {name!r} is not a string or appears twice")
        names.add(name)
        dtype = _DTYPES.get(dtype) if type(dtype) is str else None
        if dtype is None:
            raise _Unreadable(f"output {name!r}: dtype {item.get('dtype')!r} is not supported")
        if type(shape) is not list or len(shape) > protocol.MAX_DIMS:
            raise _Unreadable(f"output {name!r}: shape must be a list of at most {protocol.MAX_DIMS} sizes")
        for d in shape:
            if type(d) is not int or d < 0:
                raise _Unreadable(f"output {name!r}: shape must hold non-negative integers")
        offset = 0
        if with_offset:
            offset = item.get("offset")
            if type(offset) is not int or offset < 0:
                raise _Unreadable(f"output {name!r}: 'offset' must be a non-negative integer")
        shape = tuple(shape)
        if dtype is _BYTES_DTYPE:  # its size is its data's: the answer says it
            nbytes = item.get("nbytes")
            floor = layout.BYTES_LENGTH.size * math.prod(shape)
            if type(nbytes) is not int or not floor <= nbytes <= protocol.MAX_DATA:
                raise _Unreadable(f"bytes output {name!r}: 'nbytes' must be an integer, at least 4 per element")
        else:
            nbytes = dtype.itemsize * math.prod(shape)
        out.append((name, dtype, shape, nbytes, offset))
        total += nbytes
    return out, total


def _raw(a: np.ndarray) -> memoryview:
    """The bytes of a non-empty C-contiguous array: a flat byte view of its own memory."""
    try:
        return a.data.cast("B")
    except ValueError:  # a dtype the buffer protocol cannot name (ml_dtypes' bfloat16): through uint8
        return a.reshape(-1).view(np.uint8).data


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
