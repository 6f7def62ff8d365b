"""KServe v2 over HTTP/1.1, sans I/O: routes, and the JSON and binary forms of tensors.

Owns: the REST routes of the v2 protocol and its extensions (``route``:
method and path in, the operation and its path parameters out); the infer
request's JSON header and its binary tensor data extension
(``Inference-Header-Content-Length``, ``binary_data_size``; the raw-binary
single-input form), turned into ``messages.InferRequest``
(``parse_infer``); JSON tensor data to raw bytes and back
(``json_to_bytes``, ``bytes_to_json``); the infer response
(``ResultBody``: the JSON header, in pieces, and the list of binary parts
that follow it); the error body (``{"error": ...}``); and every limit on
what a body may hold (``Limits``).

Work on tensor data is cut into pieces of at most ``JSON_PIECE`` elements
(a few milliseconds each, each one call that holds Python's lock): JSON data
is turned into an array a piece at a time, and a large JSON answer is made a
piece at a time as its client reads it (``ResultBody.pieces``), so whoever
runs this on a thread, or on the event loop, lets the loop run between two.

Every value here comes from a client: each field is type-checked and bounded
before use, and a refusal is a ``V2Error`` with a stable code whose message
never holds more than a short prefix of what the client sent.

Must not: touch a socket, know what a model is (``shmserve.v2.service``), or
decide what an HTTP connection does next (``shmserve.v2.http``).
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from urllib.parse import unquote

import numpy as np
import orjson

from shmserve import protocol
from shmserve.errors import ErrorCode
from shmserve.v2.messages import (DATATYPES, ITEMSIZE, Incoming, InferRequest, InferResult, InputTensor,
                                  RequestedOutput, ShmRef, V2Error)

JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
_LEN = struct.Struct("<I")
# Tensor elements turned from or into JSON in one call (see the module header): 64 Ki floats take
# ~1 ms to encode (~0.7 MB of text), ~2 ms to turn from lists into an array, on a 2-vCPU VM.
JSON_PIECE = 1 << 16


@dataclass(frozen=True)
class Limits:
    """What one HTTP request may hold.  ``max_body_bytes``: the body (the server sets it from
    ``server.max_request_bytes``: binary inputs plus their JSON header); ``max_json_bytes``: a
    JSON header or a JSON-only body."""

    max_body_bytes: int
    max_json_bytes: int


def _bad(message: str, code: ErrorCode = ErrorCode.BAD_INPUT) -> V2Error:
    return V2Error(code, message)


def _show(value) -> str:
    """A client's value in a message: short, printable."""
    text = repr(value)
    return text if len(text) <= 48 else text[:45] + "..."


# -- routes ---------------------------------------------------------------------------------------

# (method, pattern, operation).  Path parameters: m (model), v (version), r (region).  A model
# name is any one path segment (percent-decoded); a version is digits.
_M, _V, _R = r"(?P<m>[^/]+)", r"(?:/versions/(?P<v>[^/]*))?", r"(?:/region/(?P<r>[^/]+))?"
ROUTES: tuple[tuple[str, re.Pattern, str], ...] = tuple((method, re.compile(pattern + r"/?\Z"), op) for method, pattern, op in (
    ("POST", rf"/v2/models/{_M}{_V}/infer", "infer"),  # first: the one the hot path asks for
    ("GET", r"/v2/health/live", "live"),
    ("GET", r"/v2/health/ready", "ready"),
    ("GET", r"/v2", "server_metadata"),
    ("GET", r"/v2/models/stats", "statistics"),
    ("GET", rf"/v2/models/{_M}{_V}/stats", "statistics"),
    ("GET", rf"/v2/models/{_M}{_V}/ready", "model_ready"),
    ("GET", rf"/v2/models/{_M}{_V}/config", "model_config"),
    ("GET", rf"/v2/models/{_M}{_V}", "model_metadata"),
    ("POST", r"/v2/repository/index", "repository_index"),
    ("POST", rf"/v2/repository/models/{_M}/load", "repository_load"),
    ("POST", rf"/v2/repository/models/{_M}/unload", "repository_unload"),
    ("GET", rf"/v2/systemsharedmemory{_R}/status", "shm_status"),
    ("POST", rf"/v2/systemsharedmemory{_R}/register", "shm_register"),
    ("POST", rf"/v2/systemsharedmemory{_R}/unregister", "shm_unregister"),
    ("GET", rf"/v2/cudasharedmemory{_R}/status", "cuda_shm_status"),
    ("POST", rf"/v2/cudasharedmemory{_R}/register", "cuda_shm_register"),
    ("POST", rf"/v2/cudasharedmemory{_R}/unregister", "cuda_shm_unregister"),
))


class NoRoute(V2Error):
    """No operation at this path (404), or not with this method (405: ``allow`` lists those
    that are)."""

    def __init__(self, message: str, allow: tuple[str, ...] = ()):
        super().__init__(ErrorCode.NOT_FOUND if not allow else ErrorCode.BAD_FRAME, message)
        self.allow = allow

    @property
    def http_status(self) -> int:
        return 405 if self.allow else 404


def route(method: str, target: str) -> tuple[str, dict[str, str | None], str]:
    """The operation for ``method`` and ``target`` (the request line's path, with any query):
    (operation, path parameters percent-decoded, query string).  NoRoute if there is none."""
    path, _, query = target.partition("?")
    allow = []
    for m, pattern, op in ROUTES:
        match = pattern.match(path)
        if match is None:
            continue
        if m != method:
            allow.append(m)
            continue
        params = {k: (unquote(v, errors="strict") if v is not None else None) for k, v in match.groupdict().items()}
        return op, params, query
    if allow:
        raise NoRoute(f"{method} is not allowed on {_show(path)} (use {', '.join(sorted(set(allow)))})",
                      tuple(sorted(set(allow))))
    if path.rstrip("/") == "/metrics":
        raise NoRoute(METRICS_ELSEWHERE)
    raise NoRoute(f"no v2 route {_show(path)} (see GET /v2 and docs/v2.md)")


# Triton serves /metrics on a port of its own (8002); so does shmserve, when asked.
METRICS_ELSEWHERE = ("metrics are not served on the v2 door: start the server with --metrics 127.0.0.1:8002 "
                     "(Triton's metrics port) and scrape http://127.0.0.1:8002/metrics (docs/v2.md, \"Metrics\")")


# -- JSON bodies -----------------------------------------------------------------------------------

def loads(body, limits: Limits, what: str = "the request body") -> dict:
    """A JSON object from a client.  V2Error BAD_FRAME if it is not one (not JSON, not an
    object; orjson refuses nesting deeper than 1024), TOO_LARGE past ``limits.max_json_bytes``.
    Tensor data nested deeper than a tensor's rank is refused where it is read (``json_to_bytes``)."""
    if len(body) > limits.max_json_bytes:
        raise V2Error(ErrorCode.TOO_LARGE, f"{what} is {len(body)} bytes of JSON, more than "
                                           f"{limits.max_json_bytes}; send tensors as binary data")
    if not body:
        return {}
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"{what} is not JSON: {str(exc)[:120]}", ErrorCode.BAD_FRAME) from None
    if not isinstance(value, dict):
        raise _bad(f"{what} must be a JSON object", ErrorCode.BAD_FRAME)
    return value


def dumps(value) -> bytes:
    return orjson.dumps(value, option=JSON_OPTIONS)


def error_body(error: V2Error) -> bytes:
    """KServe's error body: ``error.text`` (Triton's wording as it is, else shmserve's stable code
    in front of the message), and the code beside it."""
    return orjson.dumps({"error": error.text, "code": error.code.wire})


def parameters_of(obj: dict, what: str, allowed: frozenset[str]) -> dict:
    """``obj["parameters"]`` checked: an object whose keys are all ``allowed``."""
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise _bad(f"{what}: 'parameters' must be an object")
    unknown = [k for k in params if k not in allowed]
    if unknown:
        raise _bad(f"{what}: unknown parameter {_show(unknown[0])} (shmserve takes "
                   f"{', '.join(sorted(allowed)) or 'none'})")
    return params


def _int_param(params: dict, key: str, what: str, hi: int = protocol.MAX_DATA) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= hi:
        raise _bad(f"{what}: parameter {key!r} must be an integer in [0, {hi}], got {_show(value)}")
    return value


def _bool_param(params: dict, key: str, what: str) -> bool | None:
    value = params.get(key)
    if value is not None and type(value) is not bool:
        raise _bad(f"{what}: parameter {key!r} must be true or false, got {_show(value)}")
    return value


def _str_param(params: dict, key: str, what: str) -> str | None:
    value = params.get(key)
    if value is not None and not (isinstance(value, str) and 0 < len(value) <= protocol.MAX_NAME):
        raise _bad(f"{what}: parameter {key!r} must be a string of 1 to {protocol.MAX_NAME} characters")
    return value


def _shm_ref(params: dict, what: str) -> ShmRef | None:
    region = _str_param(params, "shared_memory_region", what)
    size = _int_param(params, "shared_memory_byte_size", what)
    offset = _int_param(params, "shared_memory_offset", what)
    if region is None:
        if size is not None or offset is not None:
            raise _bad(f"{what}: shared_memory_byte_size and shared_memory_offset need shared_memory_region",
                       ErrorCode.BAD_REGION)
        return None
    if size is None:
        raise _bad(f"{what}: shared_memory_region needs shared_memory_byte_size", ErrorCode.BAD_REGION)
    return ShmRef(region, size, offset or 0)


# -- infer requests --------------------------------------------------------------------------------

MAX_V2_PRIORITY = 2**64 - 1  # Triton's priority is a uint64; a level above the model's is its default level
REQUEST_KEYS = frozenset({"id", "parameters", "inputs", "outputs", "model_name", "model_version"})
REQUEST_PARAMETERS = frozenset({"binary_data_output", "timeout", "routing_key", "priority", "sequence_id",
                                "sequence_start", "sequence_end"})
INPUT_KEYS = frozenset({"name", "shape", "datatype", "parameters", "data"})
INPUT_PARAMETERS = frozenset({"binary_data_size", "shared_memory_region", "shared_memory_byte_size",
                              "shared_memory_offset"})
OUTPUT_KEYS = frozenset({"name", "parameters"})
OUTPUT_PARAMETERS = frozenset({"binary_data", "shared_memory_region", "shared_memory_byte_size",
                               "shared_memory_offset", "classification"})


def parse_infer(model: str, version: str | None, header: dict, *, binary=None,
                streamed: int | None = None) -> InferRequest:
    """An infer request from its JSON header (``loads``d; the gRPC door builds the same form from
    its message).  Inputs with ``binary_data_size`` take their bytes, in order, from ``binary``:
    the body after the header (a memoryview), or one buffer per such input (a list: gRPC's
    ``raw_input_contents``); or, with ``streamed`` (how many bytes follow the header, still in
    the socket), they are ``Incoming``.

    ``priority`` (Triton's: a uint64; 0, left out, or a level above the model's
    ``priority_levels``: its default level) is checked here; which level it means is the
    dispatcher's.

    V2Error: BAD_INPUT (a field of the wrong type, an unknown key or parameter, a timeout or a
    priority out of range or not an integer, data and binary_data_size both or neither, binary
    sizes that do not add up to the bytes after the header), BAD_DTYPE, BAD_SHAPE, BAD_REGION (a
    shared-memory reference that is incomplete)."""
    unknown = [k for k in header if k not in REQUEST_KEYS]
    if unknown:
        raise _bad(f"the request has unknown field {_show(unknown[0])} (it takes {', '.join(sorted(REQUEST_KEYS))})")
    rid = header.get("id")
    if rid is not None and not (isinstance(rid, str) and len(rid) <= protocol.MAX_NAME):
        raise _bad(f"'id' must be a string of at most {protocol.MAX_NAME} characters")
    params = parameters_of(header, "the request", REQUEST_PARAMETERS)
    for key in ("sequence_id", "sequence_start", "sequence_end"):
        if params.get(key) not in (None, 0, "", False):
            raise _bad(f"parameter {key!r}: shmserve has no sequence batching (stateful models are not served)")
    priority = _int_param(params, "priority", "the request", MAX_V2_PRIORITY) or 0
    if priority > protocol.MAX_PRIORITY:  # above every model's levels: its default level, as Triton does
        priority = 0
    timeout_us = _int_param(params, "timeout", "the request", protocol.MAX_TIMEOUT_S * 1_000_000)
    key = _str_param(params, "routing_key", "the request")
    binary_out = bool(_bool_param(params, "binary_data_output", "the request"))
    raw = header.get("inputs")
    if not isinstance(raw, list) or not raw:
        raise _bad("'inputs' must be a non-empty list of tensors")
    if len(raw) > protocol.MAX_TENSORS_PER_MESSAGE:
        raise _bad(f"{len(raw)} inputs: at most {protocol.MAX_TENSORS_PER_MESSAGE}")
    pieces = binary if isinstance(binary, list) else None
    inputs, pos, used = [], 0, 0
    available = len(binary) if isinstance(binary, memoryview) else streamed or 0
    for i, item in enumerate(raw):
        t, size = _parse_input(i, item)
        if size is not None:
            if pieces is not None:
                if used == len(pieces) or len(pieces[used]) != size:
                    raise _bad(f"input {t.name!r}: no raw contents of {size} bytes for it "
                               f"({len(pieces)} raw_input_contents for the inputs without data or region)")
                t.data = pieces[used]
                used += 1
                inputs.append(t)
                continue
            if pos + size > available:
                raise _bad(f"input {t.name!r}: binary_data_size {size} goes past the end of the body "
                           f"({available} bytes of binary data after the JSON header)")
            t.data = binary[pos:pos + size] if binary is not None else Incoming(size)
            pos += size
        inputs.append(t)
    if pieces is not None and used != len(pieces):
        raise _bad(f"{len(pieces)} raw_input_contents for {used} inputs without data or region")
    if pieces is None and pos != available:
        raise _bad(f"the inputs' binary_data_size add up to {pos} bytes, but {available} follow the JSON header")
    outputs = None
    if "outputs" in header:
        raw_out = header["outputs"]
        if not isinstance(raw_out, list) or len(raw_out) > protocol.MAX_TENSORS_PER_MESSAGE:
            raise _bad(f"'outputs' must be a list of at most {protocol.MAX_TENSORS_PER_MESSAGE} tensors")
        outputs = [_parse_output(i, item) for i, item in enumerate(raw_out)]
    return InferRequest(model, version, rid, inputs, outputs, binary_out,
                        timeout_us / 1e6 if timeout_us else None, key, priority=priority)


def _tensor_object(item, where: str, keys: frozenset[str], kind: str) -> tuple[str, str]:
    """(name, how messages name it) of an input or output object ``item`` (``where``: its place,
    like ``inputs[0]``).  V2Error BAD_INPUT if it is not an object of ``keys`` with a name."""
    if not isinstance(item, dict):
        raise _bad(f"{where} must be an object")
    unknown = [k for k in item if k not in keys]
    if unknown:
        raise _bad(f"{where} has unknown field {_show(unknown[0])}")
    name = item.get("name")
    if not (isinstance(name, str) and 0 < len(name) <= protocol.MAX_NAME):
        raise _bad(f"{where}: 'name' must be a string of 1 to {protocol.MAX_NAME} characters")
    return name, f"{kind} {name!r}"


def _parse_input(i: int, item) -> tuple[InputTensor, int | None]:
    name, what = _tensor_object(item, f"inputs[{i}]", INPUT_KEYS, "input")
    datatype = item.get("datatype")
    if not isinstance(datatype, str) or datatype not in DATATYPES:  # a list or object is not hashable
        raise _bad(f"{what}: unknown datatype {_show(datatype)} (one of {', '.join(DATATYPES)})", ErrorCode.BAD_DTYPE)
    shape = item.get("shape")
    if not (isinstance(shape, list) and len(shape) <= protocol.MAX_DIMS
            and all(type(d) is int and 0 <= d < 2**40 for d in shape)):
        raise _bad(f"{what}: 'shape' must be a list of at most {protocol.MAX_DIMS} integers >= 0 "
                   f"(got {_show(shape)})", ErrorCode.BAD_SHAPE)
    params = parameters_of(item, what, INPUT_PARAMETERS)
    size = _int_param(params, "binary_data_size", what)
    shm = _shm_ref(params, what)
    given = [x for x in (size is not None, shm is not None, "data" in item) if x]
    if len(given) != 1:
        raise _bad(f"{what} needs exactly one of 'data', parameter binary_data_size, or "
                   f"shared_memory_region (it has {len(given)})")
    t = InputTensor(name, datatype, tuple(shape), shm=shm)
    if "data" in item:
        t.data = json_to_bytes(datatype, t.shape, item["data"], what)
    return t, size


def _parse_output(i: int, item) -> RequestedOutput:
    name, what = _tensor_object(item, f"outputs[{i}]", OUTPUT_KEYS, "output")
    params = parameters_of(item, what, OUTPUT_PARAMETERS)
    classes = _int_param(params, "classification", what, MAX_CLASSIFICATION) or 0
    shm = _shm_ref(params, what)
    if shm is not None and classes:
        raise V2Error(ErrorCode.BAD_INPUT, f"Output can't set both 'shared_memory_region' and 'classification' "
                                           f"({what})", "INVALID_ARG")
    binary = _bool_param(params, "binary_data", what)
    if shm is not None and binary:
        raise _bad(f"{what}: binary_data and shared_memory_region exclude each other")
    return RequestedOutput(name, binary, shm, classes)


MAX_CLASSIFICATION = 1 << 20  # classes asked for (Triton takes a uint32; more than an output has are all of them)


def raw_binary_request(model: str, version: str | None, spec_input, size: int, data) -> InferRequest:
    """The raw-binary form (``Inference-Header-Content-Length: 0``): the whole body is the data of
    the model's one input ``spec_input`` (a ``TensorSpec``, as ``V2Service.raw_input`` gives it:
    a batched model's batch dimension is 1); its shape is the spec's with the one dimension that
    is not fixed set to fit ``size`` bytes (BYTES: one element, every dimension 1).  Every output
    is answered in binary.  V2Error BAD_INPUT if the size does not fit the spec (Triton's words
    where it has them)."""
    from shmserve.v2.messages import V2_NAMES

    datatype = V2_NAMES.get(spec_input.dtype)
    if datatype is None:
        raise _bad(f"input {spec_input.name!r}: its dtype {spec_input.dtype} has no v2 datatype")
    what = f"the raw binary body for input {spec_input.name!r}"
    if datatype == "BYTES":
        if any(isinstance(d, int) and d != 1 for d in spec_input.shape):
            raise V2Error(ErrorCode.BAD_INPUT, f"[request id: <id_unknown>] For BYTE datatype raw input "
                                               f"'{spec_input.name}', the model must have input shape [1]",
                          "INVALID_ARG")
        shape = tuple(1 for _ in spec_input.shape) or (1,)
    else:
        fixed = [d for d in spec_input.shape if isinstance(d, int)]
        free = [i for i, d in enumerate(spec_input.shape) if not isinstance(d, int)]
        per = ITEMSIZE[datatype] * math.prod(fixed)
        if len(free) > 1:
            raise V2Error(ErrorCode.BAD_INPUT, f"[request id: <id_unknown>] The shape of the raw input "
                                               f"'{spec_input.name}' can not be deduced because there are more than "
                                               "one variable-sized dimension", "INVALID_ARG")
        if per == 0 or size % per:
            raise _bad(f"{what}: {size} bytes are not a whole number of {per}-byte rows")
        shape = list(spec_input.shape)
        if free:
            shape[free[0]] = size // per
        elif size != per:
            raise _bad(f"{what}: {size} bytes, the input's fixed shape needs {per}")
        shape = tuple(shape)
    return InferRequest(model, version, None, [InputTensor(spec_input.name, datatype, shape, data=data)],
                        None, True)


# -- JSON tensor data ------------------------------------------------------------------------------

_KINDS = {"BOOL": "b", "FP16": "fiu", "BF16": "fiu", "FP32": "fiu", "FP64": "fiu"}


def _count_mismatch(what: str, got: int, shape: tuple[int, ...], n: int) -> V2Error:
    return V2Error(ErrorCode.BAD_INPUT, f"Failed to parse 'data' field: shape does not match true shape ({what}: "
                                        f"{got} elements of data, shape {list(shape)} needs {n})", "INVALID_ARG")


def json_to_bytes(datatype: str, shape: tuple[int, ...], data, what: str) -> bytes:
    """The raw little-endian bytes of JSON tensor data: its values in row-major order, however the
    lists nest (flat, as deep as the shape, deeper, or unevenly: Triton reads every value in
    order), within orjson's nesting limit; BYTES elements are strings, sent as UTF-8.  V2Error
    BAD_INPUT if the values are not ``prod(shape)`` of ``datatype`` (a wrong count — Triton's
    words —, a value of the wrong kind or out of range)."""
    n = math.prod(shape)
    if datatype == "BYTES":
        flat = _leaves(data if isinstance(data, list) else [data], n)
        if not all(isinstance(x, str) for x in flat):
            raise _bad(f"{what}: BYTES data must be strings")
        if len(flat) != n:
            raise _count_mismatch(what, len(flat), shape, n)
        return serialize_bytes([x.encode() for x in flat])
    if not isinstance(data, list):
        data = [data]
    try:
        arr = _as_array(data)
        if arr.dtype == object:
            raise ValueError("not numbers")
    except (ValueError, OverflowError, TypeError):  # uneven, deeper than numpy's 64 dimensions, or not numbers
        data = _leaves(data, n)
        try:
            arr = np.asarray(data)
        except (ValueError, OverflowError, TypeError):
            raise _bad(f"{what}: 'data' is not a list of numbers") from None
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise _bad(f"{what}: 'data' must be a list of {'booleans' if datatype == 'BOOL' else 'numbers'}")
    if arr.size != n:
        raise _count_mismatch(what, arr.size, shape, n)
    kinds = _KINDS.get(datatype, "iu")
    if kinds == "iu" and arr.dtype.kind == "f":  # integers past int64's range make numpy choose float64
        arr = _exact_integers(data, arr.shape, what)
    if arr.size and arr.dtype.kind not in kinds:
        raise _bad(f"{what}: {datatype} data must be {'booleans' if datatype == 'BOOL' else 'numbers'} "
                   f"({'integers' if kinds == 'iu' else ''}), got {arr.dtype.kind!r} values".replace(" ()", ""))
    if datatype == "BF16":
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        dtype = np.dtype(DATATYPES[datatype]).newbyteorder("<")
    if kinds == "iu" and arr.size:
        info = np.iinfo(dtype)
        if int(arr.min()) < info.min or int(arr.max()) > info.max:
            raise _bad(f"{what}: values outside the range of {datatype} [{info.min}, {info.max}]")
    with np.errstate(over="ignore"):
        out = arr.astype(dtype)
    if kinds == "fiu" and not np.isfinite(out).all():  # JSON numbers are finite: these overflowed
        raise _bad(f"{what}: values outside the range of {datatype} (they would be infinite)")
    return out.tobytes()


def _elements(item) -> int:
    """Elements of one item of nested lists, counted down its first elements."""
    n = 1
    while isinstance(item, list):
        n *= len(item)
        item = item[0] if item else None
    return n


def _as_array(data: list) -> np.ndarray:
    """``np.asarray(data)``, made from pieces of at most about ``JSON_PIECE`` elements: groups of
    items, or an item at a time when one item is larger (ValueError if the pieces do not agree on
    their shape: ragged data)."""
    per = _elements(data[0]) if data else 0
    if per * len(data) <= JSON_PIECE:
        return np.asarray(data)
    if per <= JSON_PIECE:
        step = max(1, JSON_PIECE // max(per, 1))
        parts = [np.asarray(data[i:i + step]) for i in range(0, len(data), step)]
    else:
        parts = [_as_array(item)[np.newaxis] if isinstance(item, list) else np.asarray([item]) for item in data]
    if len({p.shape[1:] for p in parts}) != 1:
        raise ValueError("ragged")
    return np.concatenate(parts)


def _exact_integers(data, shape: tuple, what: str) -> np.ndarray:
    """``data`` as Python integers, exactly (an object array), or V2Error BAD_INPUT if one of them
    is not an integer."""
    flat = np.array(data, dtype=object).reshape(-1)
    if not all(type(v) is int for v in flat):
        raise _bad(f"{what}: integer data must be integers")
    if flat.size and (min(flat) < -(1 << 63) or max(flat) >= 1 << 64):
        raise _bad(f"{what}: values outside 64 bits")
    if flat.size and min(flat) < 0 and max(flat) >= 1 << 63:  # neither int64 nor uint64 holds both
        raise _bad(f"{what}: values outside the range of every integer datatype (negative ones and 2**63 or more)")
    if flat.size and min(flat) < 0:
        return np.array(flat.tolist(), dtype=np.int64).reshape(shape)
    return np.array(flat.tolist(), dtype=np.uint64).reshape(shape)


def _leaves(data: list, limit: int) -> list:
    """The values of nested lists ``data`` that are not lists, in row-major order (at most
    ``limit`` + 1 of them: past that, the count is wrong whatever follows).  No recursion: orjson
    lets lists nest 1024 deep."""
    out, stack = [], [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            out.append(x)
            if len(out) > limit:
                return out
        else:
            stack.pop()
    return out


def serialize_bytes(elements) -> bytes:
    """Elements (bytes) in the v2 binary form: each a 4-byte little-endian length, then its bytes."""
    return b"".join(_LEN.pack(len(e)) + e for e in elements)


def deserialize_bytes(data, count: int, what: str) -> list[bytes]:
    """The ``count`` elements of BYTES data in the binary form.  V2Error BAD_INPUT if a length
    runs past the end, or bytes are left over."""
    return list(_bytes_elements(data, count, what))


def _bytes_elements(data, count: int, what: str):
    """``deserialize_bytes``, an element at a time (the check for bytes left over comes last)."""
    view, pos = memoryview(data), 0
    end = len(view)
    for _ in range(count):
        if pos + 4 > end:
            raise _bad(f"{what}: BYTES data ends inside an element's length")
        (n,) = _LEN.unpack_from(view, pos)
        pos += 4
        if n > end - pos:
            raise _bad(f"{what}: a BYTES element of {n} bytes runs past the end of the data")
        yield bytes(view[pos:pos + n])
        pos += n
    if pos != end:
        raise _bad(f"{what}: {end - pos} bytes after the last BYTES element")


def bytes_to_json(datatype: str, shape: tuple[int, ...], data, what: str):
    """JSON-serializable data (flat, row-major) of raw tensor bytes.  V2Error BAD_INPUT for BYTES
    elements that are not UTF-8 (they can be asked for with binary_data)."""
    return _json_values(datatype, math.prod(shape), data, 0, math.prod(shape), what)


def _json_values(datatype: str, n: int, data, start: int, stop: int, what: str, elements=None):
    """Elements ``start`` to ``stop`` of the ``n`` in raw tensor bytes ``data``, JSON-serializable
    (BYTES: read on from ``elements``, an iterator of ``_bytes_elements`` when given)."""
    if datatype == "BYTES":
        if elements is None:
            elements = _bytes_elements(data, n, what)
        try:
            out = [next(elements).decode() for _ in range(stop - start)]
        except UnicodeDecodeError:
            raise _bad(f"{what} holds bytes that are not UTF-8 text: ask for it with parameter "
                       "binary_data = true") from None
        if stop == n:
            for _ in elements:  # the check for bytes after the last element
                pass
        return out
    if datatype == "BF16":
        import ml_dtypes

        return np.frombuffer(data, ml_dtypes.bfloat16, stop - start, start * 2).astype(np.float32)
    dtype = np.dtype(DATATYPES[datatype]).newbyteorder("<")
    return np.frombuffer(data, dtype, stop - start, start * dtype.itemsize)


# -- infer responses -------------------------------------------------------------------------------

class ResultBody:
    """The response body of ``result``: its JSON header (``pieces()``), then ``parts`` (the binary
    outputs' bytes, views of the arena until the result is released).  An output is binary if it
    asked so (``binary``), else by ``default_binary`` (``binary_data_output``); shared-memory
    outputs carry only their metadata.  ``binary``: binary parts follow, and the header's length is
    sent as ``Inference-Header-Content-Length``.  ``small``: the JSON data of all outputs together
    has at most ``JSON_PIECE`` elements (the header is one piece's work)."""

    def __init__(self, result: InferResult, default_binary: bool):
        self.result, self.default_binary = result, default_binary
        self.parts, self.binary, json_elements = [], False, 0
        for o in result.outputs:
            if o.shm is not None:
                continue
            if self._is_binary(o):
                self.binary = True
                if len(o.data):
                    self.parts.append(o.data)
            else:
                json_elements += math.prod(o.shape)
        self.small = json_elements <= JSON_PIECE

    def _is_binary(self, o) -> bool:
        return o.binary if o.binary is not None else self.default_binary

    def header(self) -> bytes:
        """The whole JSON header.  V2Error BAD_INPUT: a BYTES output that is not UTF-8 text."""
        return b"".join(self.pieces())

    def pieces(self):
        """The JSON header in pieces: each output's data at most ``JSON_PIECE`` elements a piece.  A
        new call starts again and yields the same bytes.  V2Error as ``header``."""
        result = self.result
        yield b'{"model_name":%s,"model_version":%s,"outputs":[' % (dumps(result.model_name),
                                                                      dumps(result.model_version))
        for i, o in enumerate(result.outputs):
            entry = {"name": o.name, "datatype": o.datatype, "shape": list(o.shape)}
            comma = b"," if i else b""
            if o.shm is not None:
                entry["parameters"] = {"shared_memory_region": o.shm.region,
                                       "shared_memory_byte_size": o.shm.byte_size}
                if o.shm.offset:
                    entry["parameters"]["shared_memory_offset"] = o.shm.offset
            elif self._is_binary(o):
                entry["parameters"] = {"binary_data_size": len(o.data)}
            else:
                yield comma + dumps(entry)[:-1] + b',"data":['
                n, what = math.prod(o.shape), f"output {o.name!r}"
                elements = _bytes_elements(o.data, n, what) if o.datatype == "BYTES" else None
                for start in range(0, n, JSON_PIECE):
                    stop = min(n, start + JSON_PIECE)
                    text = dumps(_json_values(o.datatype, n, o.data, start, stop, what, elements))[1:-1]
                    yield (b"," if start else b"") + text
                if not n and elements is not None:
                    _json_values(o.datatype, 0, o.data, 0, 0, what, elements)  # no bytes may be left over
                yield b"]}"
                continue
            yield comma + dumps(entry)
        yield b"]" + (b',"id":' + dumps(result.id) if result.id is not None else b"") + b"}"


def encode_result(result: InferResult, default_binary: bool) -> tuple[bytes, list, int | None]:
    """``ResultBody`` all at once: (JSON header, binary parts to send after it, header length for
    ``Inference-Header-Content-Length`` or None when nothing binary follows)."""
    body = ResultBody(result, default_binary)
    header = body.header()
    return header, body.parts, (len(header) if body.binary else None)
