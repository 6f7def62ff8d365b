"""The wire protocol, sans I/O: bytes in, events out; events to bytes.

Owns: frame format, message kinds, limits, the receiving connection's state
machine, and the schema of every message's metadata.  Client and server both
use it; neither the socket code nor the front-end parses bytes themselves.

Must not: touch a socket, the arena or the clock.  Everything here is a pure
function or a state machine over bytes (after h11), so it can be fuzzed
without a server.

Frame (little-endian)::

    +-------+---------+------+----------+----------+--------------+-----------+
    | "SV"  | version | kind | meta_len | data_len | meta (orjson)| data      |
    | 2 B   | u8      | u8   | u32      | u64      | meta_len B   | data_len B|
    +-------+---------+------+----------+----------+--------------+-----------+

``meta`` is a JSON object; ``data`` is raw tensor bytes, back to back in the
order the metadata lists them (no per-tensor padding; a bytes tensor's are its
serialized elements, ``shmserve.layout``'s "Bytes tensors", and its descriptor
says how many: ``nbytes``).  The receiver decides
where ``data`` goes *before* it arrives (``accept_payload`` with destination
buffers, e.g. views of the arena), so the socket layer can ``recv_into`` the
final place: the only copy is the kernel's.

Rules (receiving side)
----------------------
==============  ========================  ==============
state           on                        next state
==============  ========================  ==============
HEADER          16 header bytes, valid    META
META            meta_len bytes, no data   HEADER (emit Frame)
META            meta_len bytes, data > 0  AWAIT (emit Frame)
AWAIT           accept_payload(sinks)     PAYLOAD
AWAIT           discard_payload()         DISCARD
PAYLOAD         data_len bytes stored     HEADER (emit PayloadDone)
DISCARD         data_len bytes skipped    HEADER (emit PayloadDone)
any             invalid input             ERROR (emit ProtocolError)
any             close()                   ERROR
==============  ========================  ==============

In ERROR the connection accepts nothing more: the owner answers with an
error frame and closes.
"""

from __future__ import annotations

import enum
import functools
import math
import struct
from dataclasses import dataclass
from typing import Sequence

import orjson

from shmserve import layout
from shmserve.errors import ErrorCode

PROTOCOL_VERSION = 1
MAGIC = b"SV"
FRAME_HEADER = struct.Struct("<2sBBIQ")
HEADER_SIZE = FRAME_HEADER.size  # 16

MAX_META = 1 << 20  # 1 MiB of JSON is far more than any request's descriptors need
MAX_DATA = 1 << 40  # protocol ceiling; servers enforce their own, lower limit
MAX_TENSORS_PER_MESSAGE = 16  # the arena's MAX_TENSORS: a slot holds inputs and outputs
MAX_NAME = 256
MAX_DIMS = 8
MAX_REQUEST_ID = 2**63 - 1
MAX_TIMEOUT_S = 86400  # a request's timeout_s: a day is longer than any inference should wait
MAX_VERSION = 2**31 - 1  # a model version: a positive integer
MAX_PRIORITY = 2**32 - 1  # a request's priority: a slot's u32 (levels above the model's are its default level)
MAX_INSTANCES = 64  # workers of one model version (config's bound on instances)
REGION_SLACK = 1 << 20  # a region may hold one largest request (server.max_request_bytes) plus this much
SUPPORTED_DTYPES = tuple(layout.DTYPE_CODES)  # bool, ints, floats, bfloat16, bytes (docs/protocol.md)
BYTES = layout.BYTES  # its tensors carry their size: a descriptor's "nbytes" (the arena's encoding)


class Kind(enum.IntEnum):
    # client -> server
    INFER = 1  # inline request: input bytes follow
    INFER_REGION = 2  # zero-copy request: inputs already in the client's region
    OPEN_REGION = 3  # ask for a region of shared memory (its fd comes with the REGION answer)
    CLOSE_REGION = 4
    MODELS = 5
    HEALTH = 6
    INFO = 7
    # the model lifecycle (docs/models.md); all but REPOSITORY need an admin peer
    REPOSITORY = 8  # the repository index: every model and version with its state and reason
    LOAD = 9
    UNLOAD = 10
    SCALE = 11
    CANARY = 12
    CANCEL = 13  # the client gave up on request ``id``: drop it (answered CANCELLED, or as it already was)
    # server -> client
    RESULT = 64  # inline result: output bytes follow
    RESULT_REGION = 65  # zero-copy result: outputs are in the client's region
    REPLY = 66  # answer to a control message
    REGION = 67  # answer to OPEN_REGION, with the region's fd as SCM_RIGHTS ancillary data
    ERROR = 68


CLIENT_KINDS = frozenset({Kind.INFER, Kind.INFER_REGION, Kind.OPEN_REGION, Kind.CLOSE_REGION, Kind.MODELS,
                          Kind.HEALTH, Kind.INFO, Kind.REPOSITORY, Kind.LOAD, Kind.UNLOAD, Kind.SCALE, Kind.CANARY,
                          Kind.CANCEL})
CONTROL_KINDS = frozenset({Kind.LOAD, Kind.UNLOAD, Kind.SCALE, Kind.CANARY})  # admin only
SERVER_KINDS = frozenset({Kind.RESULT, Kind.RESULT_REGION, Kind.REPLY, Kind.REGION, Kind.ERROR})
KINDS_WITH_DATA = frozenset({Kind.INFER, Kind.RESULT})


class Role(enum.Enum):
    """Which side the Connection receives for: SERVER accepts client kinds, CLIENT server kinds."""

    SERVER = "server"
    CLIENT = "client"


class State(enum.Enum):
    HEADER = "header"
    META = "meta"
    AWAIT = "await"
    PAYLOAD = "payload"
    DISCARD = "discard"
    ERROR = "error"


# -- events -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Frame:
    kind: Kind
    meta: dict
    data_len: int


@dataclass(frozen=True)
class PayloadDone:
    """The data of the last Frame has been stored in the sinks (or skipped)."""


@dataclass(frozen=True)
class ProtocolError:
    code: ErrorCode
    message: str


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()


class ProtocolViolation(Exception):
    """Metadata that breaks the message schema; carries the stable code to answer with."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# -- sending ------------------------------------------------------------------------------

def encode_frame(kind: Kind, meta: dict, data_len: int = 0) -> bytes:
    """Header and metadata of one frame; the caller sends ``data_len`` data bytes after it."""
    body = orjson.dumps(meta)
    return FRAME_HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, len(body), data_len) + body


def error_frame(request_id: int | None, code: ErrorCode, message: str, retry_after: float | None = None) -> bytes:
    """An ERROR frame; ``retry_after`` (seconds, a rate limit's refusal) travels as its own field."""
    meta = {"id": request_id, "code": code.wire, "message": message}
    if retry_after is not None:
        meta["retry_after"] = round(retry_after, 6)
    return encode_frame(Kind.ERROR, meta)


# -- receiving ----------------------------------------------------------------------------

class Connection:
    """The receiving half of one connection.

    Feed bytes with ``receive_data``; take events with ``next_event`` until it
    returns NEED_DATA.  After a Frame with ``data_len > 0`` call either
    ``accept_payload(sinks)`` (writable buffers whose sizes add up to
    ``data_len``) or ``discard_payload()``.  While a payload is being
    received, ``payload_buffer()`` names where the next bytes should be
    received directly; report them with ``payload_received(n)``.
    """

    def __init__(self, role: Role, *, max_meta: int = MAX_META, max_data: int = MAX_DATA):
        self.role = role
        self._allowed = CLIENT_KINDS if role is Role.SERVER else SERVER_KINDS
        self.max_meta, self.max_data = max_meta, max_data
        self.state = State.HEADER
        self._buf = bytearray()
        self._kind: Kind | None = None
        self._meta_len = 0
        self._data_len = 0
        self._remaining = 0
        self._sinks: list[memoryview] = []
        self._sink_index = 0
        self._sink_pos = 0

    # bytes in

    def receive_data(self, data) -> None:
        """Feed received bytes (any bytes-like object; it is not kept)."""
        if self.state is State.ERROR or not data:
            return
        if self.state in (State.PAYLOAD, State.DISCARD) and not self._buf:
            data = self._consume_payload(memoryview(data).cast("B"))
        if data is not None and len(data):
            self._buf += data

    def payload_buffer(self) -> memoryview | None:
        """Where the next payload bytes should land (a view of the current sink), or None
        when the caller should use its own read buffer and ``receive_data``."""
        if self.state is not State.PAYLOAD or self._buf:
            return None
        sink = self._sinks[self._sink_index]
        return sink[self._sink_pos:]

    def payload_received(self, n: int) -> None:
        """``n`` bytes were written into the view ``payload_buffer()`` returned."""
        if self.state is not State.PAYLOAD or n < 0 or n > len(self._sinks[self._sink_index]) - self._sink_pos:
            raise RuntimeError("payload_received without a matching payload_buffer")
        self._advance(n)

    def accept_payload(self, sinks: Sequence) -> None:
        """Store the pending payload into ``sinks`` (writable buffers, total == data_len)."""
        if self.state is not State.AWAIT:
            raise RuntimeError(f"accept_payload in state {self.state.name}")
        views = [memoryview(s).cast("B") for s in sinks]
        if sum(len(v) for v in views) != self._data_len:
            raise ValueError("sinks do not add up to the frame's data length")
        self._sinks = [v for v in views if len(v)]
        self._sink_index = self._sink_pos = 0
        self._remaining = self._data_len
        self.state = State.PAYLOAD
        self._drain_buffer_into_payload()

    def discard_payload(self) -> None:
        """Skip the pending payload (the request was refused before its data arrived)."""
        if self.state is not State.AWAIT:
            raise RuntimeError(f"discard_payload in state {self.state.name}")
        self._sinks = []
        self._remaining = self._data_len
        self.state = State.DISCARD
        self._drain_buffer_into_payload()

    def close(self) -> None:
        """Accept nothing more (the connection is ending): like an error, without an event, so the
        payload sinks are forgotten and no byte more is put into them."""
        self.state = State.ERROR
        self._buf.clear()
        self._sinks = []

    @property
    def mid_frame(self) -> bool:
        """Whether bytes of a frame's header or metadata are buffered (after ``next_event`` said
        NEED_DATA: a frame has begun and its header or metadata is not complete)."""
        return self.state is State.META or (self.state is State.HEADER and bool(self._buf))

    @property
    def payload_remaining(self) -> int:
        return self._remaining if self.state in (State.PAYLOAD, State.DISCARD) else 0

    def next_event(self):
        """The next event: Frame, PayloadDone, ProtocolError, or NEED_DATA."""
        state = self.state
        if state is State.ERROR:
            return NEED_DATA
        if state is State.AWAIT:
            raise RuntimeError("accept_payload or discard_payload must follow a Frame with data")
        if state in (State.PAYLOAD, State.DISCARD):
            if self._remaining:
                return NEED_DATA
            self.state = State.HEADER
            self._sinks = []
            return PayloadDone()
        if state is State.HEADER:
            if len(self._buf) < HEADER_SIZE:
                return NEED_DATA
            magic, version, kind, meta_len, data_len = FRAME_HEADER.unpack_from(self._buf)
            if magic != MAGIC:
                return self._fail(ErrorCode.BAD_FRAME, "bad frame magic: not a shmserve peer")
            if version != PROTOCOL_VERSION:
                return self._fail(ErrorCode.VERSION_MISMATCH,
                                  f"protocol version {version}; this side speaks {PROTOCOL_VERSION}")
            if kind not in self._allowed:
                return self._fail(ErrorCode.BAD_FRAME, f"message kind {kind} is not valid here")
            if meta_len > self.max_meta:
                return self._fail(ErrorCode.FRAME_TOO_LARGE, f"metadata of {meta_len} bytes exceeds {self.max_meta}")
            if data_len > self.max_data:
                return self._fail(ErrorCode.FRAME_TOO_LARGE, f"payload of {data_len} bytes exceeds {self.max_data}")
            if data_len and kind not in KINDS_WITH_DATA:
                return self._fail(ErrorCode.BAD_FRAME, f"{Kind(kind).name} carries no payload")
            del self._buf[:HEADER_SIZE]
            self._kind, self._meta_len, self._data_len = Kind(kind), meta_len, data_len
            self.state = state = State.META
        if state is State.META:
            if len(self._buf) < self._meta_len:
                return NEED_DATA
            raw = bytes(self._buf[:self._meta_len])
            del self._buf[:self._meta_len]
            try:
                meta = orjson.loads(raw) if raw else {}
            except orjson.JSONDecodeError as exc:
                return self._fail(ErrorCode.BAD_FRAME, f"metadata is not valid JSON: {exc}")
            if not isinstance(meta, dict):
                return self._fail(ErrorCode.BAD_FRAME, "metadata must be a JSON object")
            self.state = State.AWAIT if self._data_len else State.HEADER
            return Frame(self._kind, meta, self._data_len)
        raise AssertionError(state)

    # internals

    def _fail(self, code: ErrorCode, message: str) -> ProtocolError:
        self.close()
        return ProtocolError(code, message)

    def _drain_buffer_into_payload(self) -> None:
        if self._buf:
            pending = bytes(self._buf)
            self._buf.clear()
            rest = self._consume_payload(memoryview(pending))
            if rest is not None and len(rest):
                self._buf += rest

    def _consume_payload(self, data: memoryview) -> memoryview | None:
        """Copy (PAYLOAD) or skip (DISCARD) bytes of ``data``; return what follows the payload."""
        take = min(len(data), self._remaining)
        if self.state is State.DISCARD:
            self._remaining -= take
        else:
            pos = 0
            while pos < take:
                sink = self._sinks[self._sink_index]
                n = min(take - pos, len(sink) - self._sink_pos)
                sink[self._sink_pos:self._sink_pos + n] = data[pos:pos + n]
                pos += n
                self._advance(n)
        return data[take:] if take < len(data) else None

    def _advance(self, n: int) -> None:
        self._remaining -= n
        self._sink_pos += n
        while self._sink_index < len(self._sinks) and self._sink_pos == len(self._sinks[self._sink_index]):
            self._sink_index += 1
            self._sink_pos = 0


# -- message schemas ----------------------------------------------------------------------

@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int | None = None  # zero-copy only: where it lies in the client's region
    byte_size: int | None = None  # bytes tensors only: their serialized size (the wire's "nbytes")

    @functools.cached_property
    def nbytes(self) -> int:
        return self.byte_size if self.byte_size is not None else tensor_nbytes(self.dtype, self.shape)

    def to_wire(self) -> dict:
        return tensor_wire(self.name, self.dtype, self.shape, self.byte_size, self.offset)


def tensor_wire(name: str, dtype: str, shape, nbytes: int | None = None, offset: int | None = None) -> dict:
    """One tensor's descriptor as the wire carries it: ``{name, dtype, shape}``, with ``nbytes``
    for a bytes tensor (only: a fixed-size tensor's follows from its shape) and ``offset`` for a
    zero-copy one."""
    out = {"name": name, "dtype": dtype, "shape": list(shape)}
    if dtype == BYTES:
        out["nbytes"] = nbytes
    if offset is not None:
        out["offset"] = offset
    return out


@dataclass(frozen=True)
class InferRequest:
    id: int
    model: str
    inputs: tuple[TensorMeta, ...]
    timeout_s: float | None
    region: int | None = None  # zero-copy: the client's region id
    output_offset: int | None = None  # zero-copy: where outputs go in that region
    output_capacity: int | None = None
    version: int | None = None  # the model version asked for (None: the model's default)
    key: str | None = None  # a routing key: a canary sends the same key to the same version
    priority: int = 0  # its priority level: 1 is served first; 0 (or above the model's levels): the model's default


_ITEMSIZE = layout.ITEMSIZES


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of fixed-size ``dtype`` (a name) and ``shape``.  ValueError for bytes
    (its size is its data's, ``TensorMeta.byte_size``) or a name that is no dtype."""
    n = _ITEMSIZE.get(dtype)
    if n is None:
        raise ValueError(f"a {dtype} tensor's size does not follow from its shape" if dtype == BYTES
                         else f"dtype {dtype!r} is not supported")
    for d in shape:
        n *= d
    return n


def _require(cond: bool, message: str, code: ErrorCode = ErrorCode.BAD_FRAME) -> None:
    if not cond:
        raise ProtocolViolation(code, message)


def _int(meta: dict, key: str, lo: int, hi: int, code: ErrorCode = ErrorCode.BAD_FRAME) -> int:
    value = meta.get(key)
    _require(type(value) is int and lo <= value <= hi, f"'{key}' must be an integer in [{lo}, {hi}]", code)
    return value


def request_id(meta: dict) -> int | None:
    """The request id of a message if it has a valid one (to address an error answer), else None."""
    value = meta.get("id")
    return value if type(value) is int and 0 <= value <= MAX_REQUEST_ID else None


def parse_cancel(meta: dict) -> int:
    """The request id a CANCEL names.  ProtocolViolation (BAD_FRAME) unless ``id`` is an integer in
    [0, MAX_REQUEST_ID].  Whether that id is a request of the connection, still unanswered, is the
    receiver's to look up: a CANCEL for an id it does not hold (answered already, never sent) is
    ignored, and a CANCEL itself is never answered."""
    return _int(meta, "id", 0, MAX_REQUEST_ID)


def parse_name(value, what: str) -> str:
    _require(isinstance(value, str) and 0 < len(value) <= MAX_NAME and value.isprintable(),
             f"{what} must be a printable string of 1-{MAX_NAME} characters")
    return value


def parse_tensor_list(items, what: str, *, with_offset: bool) -> tuple[TensorMeta, ...]:
    """Validate a list of tensor descriptors: name, dtype, shape, ``nbytes`` for a bytes tensor
    (required, and only there: at least 4 bytes per element, ``layout.BYTES_LENGTH``), and
    ``offset`` when ``with_offset``.  ProtocolViolation: BAD_FRAME (the schema), BAD_INPUT (a
    name twice, a bytes tensor's nbytes too small for its shape), BAD_DTYPE, BAD_SHAPE,
    BAD_REGION (an offset)."""
    _require(isinstance(items, list) and len(items) <= MAX_TENSORS_PER_MESSAGE,
             f"'{what}' must be a list of at most {MAX_TENSORS_PER_MESSAGE} tensors")
    out, names = [], set()
    for i, item in enumerate(items):
        _require(isinstance(item, dict), f"{what}[{i}] must be an object")
        name = parse_name(item.get("name"), f"{what}[{i}].name")
        _require(name not in names, f"{what}: tensor {name!r} appears twice", ErrorCode.BAD_INPUT)
        names.add(name)
        dtype = item.get("dtype")
        _require(dtype in SUPPORTED_DTYPES, f"{what}[{i}].dtype {dtype!r} is not one of {', '.join(SUPPORTED_DTYPES)}",
                 ErrorCode.BAD_DTYPE)
        shape = item.get("shape")
        _require(isinstance(shape, list) and len(shape) <= MAX_DIMS
                 and all(type(d) is int and 0 <= d < 2**40 for d in shape),
                 f"{what}[{i}].shape must be a list of at most {MAX_DIMS} non-negative integers", ErrorCode.BAD_SHAPE)
        byte_size = None
        if dtype == BYTES:
            byte_size = _int(item, "nbytes", 0, MAX_DATA)
            count = math.prod(shape)
            _require(byte_size >= layout.BYTES_LENGTH.size * count,
                     f"{what}[{i}]: {byte_size} bytes cannot hold the {count} elements of shape {shape} "
                     f"(each takes at least {layout.BYTES_LENGTH.size})", ErrorCode.BAD_INPUT)
        elif "nbytes" in item:
            raise ProtocolViolation(ErrorCode.BAD_FRAME, f"{what}[{i}].nbytes is for bytes tensors only: a {dtype} "
                                                         f"tensor's size follows from its shape")
        offset = None
        if with_offset:
            offset = _int(item, "offset", 0, MAX_DATA, ErrorCode.BAD_REGION)
        out.append(TensorMeta(name, dtype, tuple(shape), offset, byte_size))
    return tuple(out)


def parse_infer(meta: dict, *, zero_copy: bool) -> InferRequest:
    """Validate an INFER or INFER_REGION message.  Raises ProtocolViolation naming the field
    (BAD_INPUT for a ``priority`` that is not an integer in [0, MAX_PRIORITY])."""
    rid = _int(meta, "id", 0, MAX_REQUEST_ID)
    model = parse_name(meta.get("model"), "'model'")
    inputs = parse_tensor_list(meta.get("inputs"), "inputs", with_offset=zero_copy)
    timeout = meta.get("timeout_s")
    _require(timeout is None or (type(timeout) in (int, float) and 0 < timeout <= MAX_TIMEOUT_S),
             f"'timeout_s' must be a number of seconds in (0, {MAX_TIMEOUT_S}]")
    version = _int(meta, "version", 1, MAX_VERSION) if meta.get("version") is not None else None
    key = parse_name(meta["key"], "'key'") if meta.get("key") is not None else None
    priority = _int(meta, "priority", 0, MAX_PRIORITY, ErrorCode.BAD_INPUT) if "priority" in meta else 0
    if not zero_copy:
        return InferRequest(rid, model, inputs, timeout, version=version, key=key, priority=priority)
    region = _int(meta, "region", 1, 2**32 - 1, ErrorCode.BAD_REGION)
    out_off = _int(meta, "output_offset", 0, MAX_DATA, ErrorCode.BAD_REGION)
    out_cap = _int(meta, "output_capacity", 0, MAX_DATA, ErrorCode.BAD_REGION)
    return InferRequest(rid, model, inputs, timeout, region, out_off, out_cap, version, key, priority)


@dataclass(frozen=True)
class ControlCall:
    """A model-lifecycle call (LOAD, UNLOAD, SCALE, CANARY), checked."""

    kind: Kind
    model: str
    version: int | None = None
    instances: int | None = None
    keep: bool = False  # LOAD: the version serving before stays loaded
    action: str | None = None  # CANARY: start, promote, abort or status
    plan: dict | None = None  # CANARY start: the plan's fields (checked by the front-end's canary module)


CANARY_ACTIONS = ("start", "promote", "abort", "status")


def parse_control(kind: Kind, meta: dict) -> ControlCall:
    """Validate a LOAD, UNLOAD, SCALE or CANARY message.  Raises ProtocolViolation naming the
    field: BAD_ARGUMENT for a value the caller chose that is not allowed (a version, a number of
    instances, a canary action), BAD_FRAME for the rest of the schema."""
    model = parse_name(meta.get("model"), "'model'")
    version = _int(meta, "version", 1, MAX_VERSION, ErrorCode.BAD_ARGUMENT) if meta.get("version") is not None \
        else None
    instances = None
    if kind is Kind.SCALE or meta.get("instances") is not None:
        _require(kind in (Kind.LOAD, Kind.SCALE), "'instances' is for load and scale", ErrorCode.BAD_ARGUMENT)
        instances = _int(meta, "instances", 1, MAX_INSTANCES, ErrorCode.BAD_ARGUMENT)
    keep = meta.get("keep", False)
    _require(type(keep) is bool and (not keep or kind is Kind.LOAD), "'keep' must be true or false (load only)")
    action = plan = None
    if kind is Kind.CANARY:
        action = meta.get("action")
        _require(action in CANARY_ACTIONS, f"'action' must be one of {', '.join(CANARY_ACTIONS)}",
                 ErrorCode.BAD_ARGUMENT)
        plan = meta.get("plan", {})
        _require(isinstance(plan, dict), "'plan' must be an object")
        _require(action != "start" or version is not None, "starting a canary needs the candidate's 'version'",
                 ErrorCode.BAD_ARGUMENT)
    return ControlCall(kind, model, version, instances, keep, action, plan)
