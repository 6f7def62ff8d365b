"""The KServe v2 (Open Inference Protocol) messages, independent of HTTP and gRPC.

Owns: the v2 datatype names and what each is in shmserve (the dtype the
dispatcher and workers use, its element size), the neutral form of an infer
request and its result that both front doors convert to and from
(``InferRequest``, ``InferResult``), the v2 error (``V2Error``) and the one
mapping of shmserve's error codes onto HTTP and gRPC status codes.

Tensor data here is always raw little-endian bytes in row-major order (BYTES:
each element a 4-byte little-endian length and then its bytes, the v2 binary
form); turning JSON lists into bytes and back is the HTTP codec's job, turning
``raw_input_contents`` into them the gRPC door's.

Must not: do I/O, parse HTTP or protobuf, or know how a request is served
(``shmserve.v2.service``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from shmserve.errors import ErrorCode

# v2 datatype -> shmserve dtype name (shmserve.protocol.SUPPORTED_DTYPES)
DATATYPES: dict[str, str] = {
    "BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
    "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "FP16": "float16", "FP32": "float32", "FP64": "float64", "BF16": "bfloat16", "BYTES": "bytes",
}
V2_NAMES: dict[str, str] = {v: k for k, v in DATATYPES.items()}  # shmserve dtype -> v2 datatype
# Bytes per element of the fixed-size datatypes (BYTES has none: its size is its data's).
ITEMSIZE: dict[str, int] = {k: (2 if v == "bfloat16" else np.dtype(v).itemsize)
                            for k, v in DATATYPES.items() if v != "bytes"}


def fixed_nbytes(datatype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a fixed-size tensor (not BYTES)."""
    n = ITEMSIZE[datatype]
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class ShmRef:
    """A tensor in a registered system shared-memory region: ``region`` is the name the client
    registered it under; ``offset`` and ``byte_size`` are within the registered range."""

    region: str
    byte_size: int
    offset: int = 0


class Incoming:
    """Input bytes that are still on their way from the caller's connection (an HTTP body being
    received): ``size`` of them, received straight into the request's arena space by the
    request's ``InferRequest.body`` once the dispatcher has given it that space."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size


class BodyReceiver(Protocol):
    """The door that will receive a request's ``Incoming`` inputs (in order)."""

    def fill(self, sinks: list[memoryview], done: Callable[[], None]) -> None:
        """Receive the inputs' bytes into ``sinks`` (views of arena space, in input order), then
        call ``done``.  If the connection ends first, ``done`` is never called (the service
        drops the request)."""

    def abort(self) -> None:
        """The request was answered before its bytes were all received: write no more into the
        sinks (skip what is left of the body)."""


@dataclass
class InputTensor:
    """One input.  Exactly one of ``data`` (raw bytes, see the module header, or ``Incoming``)
    and ``shm``."""

    name: str
    datatype: str  # a key of DATATYPES (checked by the door that parsed it)
    shape: tuple[int, ...]
    data: bytes | memoryview | Incoming | None = None
    shm: ShmRef | None = None


@dataclass
class RequestedOutput:
    """An output the client asked for.  ``binary``: HTTP only, answer it in binary form (None: the
    request's default).  ``shm``: write it into that region instead of answering its bytes.
    ``classification``: answer its top k classes instead."""

    name: str
    binary: bool | None = None
    shm: ShmRef | None = None
    classification: int = 0  # k > 0: answer its top k classes (the classification extension: v2/classify.py)


@dataclass
class InferRequest:
    model: str
    version: str | None  # as the URL or message gave it ("" or None: the model's default)
    id: str | None
    inputs: list[InputTensor]
    outputs: list[RequestedOutput] | None = None  # None: every output of the model
    binary_outputs: bool = False  # HTTP: the request's parameters.binary_data_output
    timeout_s: float | None = None  # parameters.timeout (microseconds on the wire); None: the server's
    key: str | None = None  # parameters.routing_key: a canary sends the same key to the same version
    priority: int = 0  # parameters.priority: 1 is served first; 0 (or above the model's levels): its default level
    body: BodyReceiver | None = None  # receives the inputs whose data is ``Incoming``


@dataclass
class OutputTensor:
    """One output.  ``data``: its raw bytes (None when it was written to ``shm``)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | memoryview | None = None
    shm: ShmRef | None = None
    binary: bool | None = None  # HTTP: as RequestedOutput.binary


@dataclass
class InferResult:
    """A request's outputs.  Their ``data`` may be views of the arena: valid until ``release()``,
    which the door calls once it has sent them (or copied them); it is idempotent."""

    model_name: str
    model_version: str
    id: str | None
    outputs: list[OutputTensor] = field(default_factory=list)
    releaser: Callable[[], None] | None = None

    def release(self) -> None:
        releaser, self.releaser = self.releaser, None
        if releaser is not None:
            releaser()


class V2Error(Exception):
    """A refusal with a stable shmserve code; ``message`` is for people (it never holds a
    shared-memory key).  ``http_status``/``grpc_status`` say how the doors report it.

    ``triton``: the message is Triton's own wording of this refusal (what Triton's clients and
    tools match on: ``Request for unknown model: 'x' is not found``), and this is the class of
    Triton's status it carries (a key of ``TRITON_STATUS``: ``INVALID_ARG``, ``NOT_FOUND``...):
    the doors then answer Triton's HTTP and gRPC statuses and send the message as it is, the code
    only beside it (``text``); None: shmserve's own refusal, ``[code] message``."""

    def __init__(self, code: ErrorCode, message: str, triton: str | None = None):
        super().__init__(message)
        self.code, self.message, self.triton = code, message, triton

    @property
    def text(self) -> str:
        """What the doors send as the error's text: Triton's wording as it is, else ``[code] message``."""
        return self.message if self.triton is not None else f"[{self.code.wire}] {self.message}"

    @property
    def http_status(self) -> int:
        if self.triton is not None:
            return TRITON_STATUS[self.triton][0]
        return HTTP_STATUS.get(self.code, 400)

    @property
    def grpc_status(self) -> str:
        """The name of a ``grpc.StatusCode`` member."""
        if self.triton is not None:
            return TRITON_STATUS[self.triton][1]
        return GRPC_STATUS.get(self.code, "INVALID_ARGUMENT")


class RateLimited(V2Error):
    """A rate limit's refusal (OVERLOADED): HTTP 429 with ``Retry-After``, gRPC
    RESOURCE_EXHAUSTED with ``retry-after`` in the trailing metadata; ``retry_after`` in seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(ErrorCode.OVERLOADED, message)
        self.retry_after = retry_after

    @property
    def http_status(self) -> int:
        return 429

    @property
    def grpc_status(self) -> str:
        return "RESOURCE_EXHAUSTED"


# Triton's status classes (TRITONSERVER_Error_Code) -> (HTTP status, gRPC status) as Triton's own
# doors answer them (server src/http_server.cc HttpCodeFromError, src/grpc/grpc_utils.cc).
TRITON_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARG": (400, "INVALID_ARGUMENT"),
    "ALREADY_EXISTS": (400, "ALREADY_EXISTS"),
    "NOT_FOUND": (404, "NOT_FOUND"),
    "UNAVAILABLE": (503, "UNAVAILABLE"),
    "INTERNAL": (500, "INTERNAL"),
    "UNSUPPORTED": (501, "UNIMPLEMENTED"),
}


# shmserve error code -> HTTP status (KServe: 400 for a bad request, 404 for an unknown model).
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.UNKNOWN_MODEL: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.MODEL_UNAVAILABLE: 503,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.FRAME_TOO_LARGE: 413,
    ErrorCode.OUTPUT_TOO_LARGE: 500,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.WORKER_CRASHED: 500,
    ErrorCode.INTERNAL: 500,
    ErrorCode.MODEL_ERROR: 500,
    ErrorCode.CANCELLED: 499,  # nginx's "client closed request": nobody reads it, but a log says why
}

# shmserve error code -> grpc.StatusCode name.
GRPC_STATUS: dict[ErrorCode, str] = {
    ErrorCode.UNKNOWN_MODEL: "NOT_FOUND",
    ErrorCode.NOT_FOUND: "NOT_FOUND",
    ErrorCode.PERMISSION_DENIED: "PERMISSION_DENIED",
    ErrorCode.UNAUTHENTICATED: "UNAUTHENTICATED",
    ErrorCode.OVERLOADED: "UNAVAILABLE",
    ErrorCode.SHUTTING_DOWN: "UNAVAILABLE",
    ErrorCode.MODEL_UNAVAILABLE: "UNAVAILABLE",
    ErrorCode.TIMEOUT: "DEADLINE_EXCEEDED",
    ErrorCode.TOO_LARGE: "RESOURCE_EXHAUSTED",
    ErrorCode.FRAME_TOO_LARGE: "RESOURCE_EXHAUSTED",
    ErrorCode.OUTPUT_TOO_LARGE: "RESOURCE_EXHAUSTED",
    ErrorCode.UNAVAILABLE: "UNAVAILABLE",
    ErrorCode.WORKER_CRASHED: "INTERNAL",
    ErrorCode.INTERNAL: "INTERNAL",
    ErrorCode.MODEL_ERROR: "INTERNAL",
    ErrorCode.CANCELLED: "CANCELLED",
}
