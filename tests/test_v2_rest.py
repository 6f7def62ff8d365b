"""The sans-I/O KServe v2 REST codec (shmserve.v2.rest), without a server: routes, the JSON body
rules, every field of an infer request, JSON tensor data of each datatype to bytes and back, the
BYTES binary form, the raw-binary form and the infer response.

Every value here stands for what a client wrote, so besides the cases, hypothesis throws arbitrary
JSON objects, near-valid requests, paths and bytes at it: nothing may come out but a ``V2Error``
(or the answer), and round trips must be exact.
"""

from __future__ import annotations

import json
import math
import struct

import ml_dtypes
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmserve.errors import ErrorCode
from shmserve.spec import TensorSpec
from shmserve.v2 import rest
from shmserve.v2.messages import DATATYPES, ITEMSIZE, Incoming, InferResult, OutputTensor, ShmRef, V2Error

from helpers.v2_server import json_values

LIMITS = rest.Limits(max_body_bytes=1 << 20, max_json_bytes=64 * 1024)
INT_TYPES = ["INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"]
FLOAT_TYPES = ["FP16", "BF16", "FP32", "FP64"]
NUMPY = {"FP16": np.float16, "BF16": ml_dtypes.bfloat16, "FP32": np.float32, "FP64": np.float64}


def refused(code: ErrorCode, call, *args, **kwargs) -> str:
    """``call`` raises V2Error ``code``; its message."""
    with pytest.raises(V2Error) as info:
        call(*args, **kwargs)
    assert info.value.code == code, info.value.message
    return info.value.message


def x_input(**changes) -> dict:
    return {"name": "x", "datatype": "UINT8", "shape": [3], "data": [1, 2, 3]} | changes


def request(**changes) -> dict:
    return {"inputs": [x_input()]} | changes


# -- routes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method, target, op, params", [
    ("GET", "/v2/health/live", "live", {}),
    ("GET", "/v2/health/ready/", "ready", {}),
    ("GET", "/v2", "server_metadata", {}),
    ("GET", "/v2/models/stats", "statistics", {}),
    ("GET", "/v2/models/m/stats", "statistics", {"m": "m", "v": None}),
    ("GET", "/v2/models/m/versions/3/stats", "statistics", {"m": "m", "v": "3"}),
    ("GET", "/v2/models/m/ready", "model_ready", {"m": "m", "v": None}),
    ("GET", "/v2/models/m/versions/2/config", "model_config", {"m": "m", "v": "2"}),
    ("POST", "/v2/models/m/infer", "infer", {"m": "m", "v": None}),
    ("POST", "/v2/models/m/versions//infer", "infer", {"m": "m", "v": ""}),
    ("POST", "/v2/models/m/versions/12/infer?x=1", "infer", {"m": "m", "v": "12"}),
    ("GET", "/v2/models/m", "model_metadata", {"m": "m", "v": None}),
    ("GET", "/v2/models/m/versions/1", "model_metadata", {"m": "m", "v": "1"}),
    ("POST", "/v2/repository/index", "repository_index", {}),
    ("POST", "/v2/repository/models/m/load", "repository_load", {"m": "m"}),
    ("POST", "/v2/repository/models/m/unload", "repository_unload", {"m": "m"}),
    ("GET", "/v2/systemsharedmemory/status", "shm_status", {"r": None}),
    ("GET", "/v2/systemsharedmemory/region/r1/status", "shm_status", {"r": "r1"}),
    ("POST", "/v2/systemsharedmemory/region/r1/register", "shm_register", {"r": "r1"}),
    ("POST", "/v2/systemsharedmemory/unregister", "shm_unregister", {"r": None}),
    ("GET", "/v2/cudasharedmemory/status", "cuda_shm_status", {"r": None}),
    ("POST", "/v2/cudasharedmemory/region/c/register", "cuda_shm_register", {"r": "c"}),
    ("POST", "/v2/cudasharedmemory/region/c/unregister", "cuda_shm_unregister", {"r": "c"}),
])
def test_routes(method, target, op, params):
    got, got_params, _ = rest.route(method, target)
    assert (got, got_params) == (op, params)


@pytest.mark.parametrize("target, name", [
    ("/v2/models/my%20model/infer", "my model"), ("/v2/models/a%2Fb/infer", "a/b"), ("/v2/models/%C3%A9/infer", "é"),
    ("/v2/models/ident%69ty/infer", "identity"), ("/v2/models/a+b/infer", "a+b"), ("/v2/models/100%/infer", "100%"),
    ("/v2/models/%00/infer", "\0"), ("/v2/models/%2e%2e/infer", ".."),
])
def test_path_parameters_are_percent_decoded_once(target, name):
    assert rest.route("POST", target)[1]["m"] == name


def test_a_path_that_is_not_percent_encoded_utf8_raises_unicode_decode_error():
    """The door turns it into bad_frame (the one error route lets through besides NoRoute)."""
    for target in ("/v2/models/%ff/infer", "/v2/models/%C3/infer", "/v2/models/m/versions/%80/infer"):
        with pytest.raises(UnicodeDecodeError):
            rest.route("POST", target)


def test_the_query_string_is_split_off():
    assert rest.route("GET", "/v2/health/live?verbose=1&x=%20") == ("live", {}, "verbose=1&x=%20")


@pytest.mark.parametrize("target", ["", "/", "/v2//", "/v1/models/m/infer", "/v2/models/m/infer/x", "/v2/models/",
                                    "/v2/models//infer", "/v2/models/a/b", "/v2//health/live", "//v2/health/live",
                                    "/v2/models/m/versions/1/2/infer", "/v2/systemsharedmemory/region//status",
                                    "/V2/health/live", "/v2/health/live\n"])
def test_unknown_paths_are_404(target):
    with pytest.raises(rest.NoRoute) as info:
        rest.route("GET", target)
    assert info.value.http_status == 404 and info.value.allow == () and info.value.code == ErrorCode.NOT_FOUND


@pytest.mark.parametrize("method, target, allow", [
    ("GET", "/v2/models/m/infer", ("POST",)), ("POST", "/v2/health/live", ("GET",)), ("DELETE", "/v2", ("GET",)),
    ("POST", "/v2/models/m", ("GET",)), ("GET", "/v2/repository/models/m/load", ("POST",)),
    ("PUT", "/v2/systemsharedmemory/status", ("GET",)), ("get", "/v2/health/live", ("GET",)),
])
def test_the_wrong_method_is_405_with_the_allowed_ones(method, target, allow):
    with pytest.raises(rest.NoRoute) as info:
        rest.route(method, target)
    assert info.value.http_status == 405 and info.value.allow == allow
    assert f"{method} is not allowed" in info.value.message


def test_a_long_path_is_not_repeated_in_full():
    with pytest.raises(rest.NoRoute) as info:
        rest.route("GET", "/v3/" + "a" * 10_000)
    assert len(info.value.message) < 200


@settings(max_examples=300)
@given(st.sampled_from(["GET", "POST", "PUT", "", "OPTIONS"]), st.text(max_size=80))
def test_any_path_gives_a_route_or_no_route(method, path):
    try:
        op, params, _ = rest.route(method, path)
    except (rest.NoRoute, UnicodeDecodeError):
        return
    assert op and all(v is None or isinstance(v, str) for v in params.values())


# -- JSON bodies -----------------------------------------------------------------------------------

def test_loads_takes_a_json_object_within_its_limits():
    assert rest.loads(b'{"a": [1, {"b": 2}]}', LIMITS) == {"a": [1, {"b": 2}]}
    assert rest.loads(b"", LIMITS) == {}
    assert rest.loads(memoryview(b'{"x": 1}'), LIMITS) == {"x": 1}
    nested = {"inputs": [x_input(shape=[1] * 8, data=[[[[[[[[1]]]]]]]])]}
    assert rest.loads(json.dumps(nested).encode(), LIMITS) == nested  # the deepest tensor a request can hold
    deep = b'{"a": ' * 1000 + b"1" + b"}" * 1000  # within orjson's limit: the fields that hold it are checked
    assert rest.loads(deep, LIMITS)["a"]["a"]


@pytest.mark.parametrize("body, code, words", [
    (b"x" * (64 * 1024 + 1), ErrorCode.TOO_LARGE, ["65537 bytes of JSON", "binary data"]),
    (b"{", ErrorCode.BAD_FRAME, ["not JSON"]), (b"[1, 2]", ErrorCode.BAD_FRAME, ["a JSON object"]),
    (b'"text"', ErrorCode.BAD_FRAME, ["a JSON object"]), (b"null", ErrorCode.BAD_FRAME, ["a JSON object"]),
    (b'{"a": NaN}', ErrorCode.BAD_FRAME, ["not JSON"]), (b'{"a": Infinity}', ErrorCode.BAD_FRAME, ["not JSON"]),
    (b'{"a": 1e999}', ErrorCode.BAD_FRAME, ["not JSON"]), (b'{"a": 1} x', ErrorCode.BAD_FRAME, ["not JSON"]),
    (b'{"a": "\xff"}', ErrorCode.BAD_FRAME, ["not JSON"]), (b'\xef\xbb\xbf{}', ErrorCode.BAD_FRAME, ["not JSON"]),
    (b'{"a": ' * 1100 + b"1" + b"}" * 1100, ErrorCode.BAD_FRAME, ["not JSON"]),  # orjson's limit: 1024
    (b'{"a": ' + b"[" * 1100 + b"]" * 1100 + b"}", ErrorCode.BAD_FRAME, ["not JSON"]),
    (b'{"a": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", ErrorCode.BAD_FRAME, []),
])
def test_loads_refuses_what_is_not_a_small_shallow_json_object(body, code, words):
    message = refused(code, rest.loads, body, LIMITS)
    assert all(w in message for w in words), message
    assert len(message) < 300


def test_loads_names_what_it_read():
    assert "the JSON header" in refused(ErrorCode.BAD_FRAME, rest.loads, b"{", LIMITS, "the JSON header")


JSON = json_values(st.text(max_size=8), max_leaves=25)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()))
def test_loads_of_any_bytes_is_an_object_or_a_v2_error(body):
    try:
        value = rest.loads(body, LIMITS)
    except V2Error as exc:
        assert exc.code in (ErrorCode.BAD_FRAME, ErrorCode.TOO_LARGE)
        return
    assert isinstance(value, dict)


def test_error_body_is_kserves_with_the_stable_code():
    body = json.loads(rest.error_body(V2Error(ErrorCode.BAD_SHAPE, "input 'x': rank 2, the model takes 1")))
    assert body == {"error": "[bad_shape] input 'x': rank 2, the model takes 1", "code": "bad_shape"}


# -- parse_infer: every field ----------------------------------------------------------------------

def test_a_full_request_is_read_into_the_neutral_form():
    header = {"id": "r1", "model_name": "m", "model_version": "2",
              "parameters": {"timeout": 2_500_000, "routing_key": "user-7", "binary_data_output": True,
                             "sequence_id": 0, "priority": 0},
              "inputs": [x_input(),
                         {"name": "b", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
                         {"name": "s", "datatype": "INT64", "shape": [1, 2], "parameters": {
                             "shared_memory_region": "reg", "shared_memory_byte_size": 16,
                             "shared_memory_offset": 64}}],
              "outputs": [{"name": "y"}, {"name": "z", "parameters": {"binary_data": False}},
                          {"name": "w", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 32}}]}
    data = memoryview(np.array([1.5, -2], np.float32).tobytes())
    req = rest.parse_infer("m", "2", header, binary=data)
    assert (req.model, req.version, req.id, req.timeout_s, req.key, req.binary_outputs) == \
        ("m", "2", "r1", 2.5, "user-7", True)
    x, b, s = req.inputs
    assert (x.name, x.datatype, x.shape, x.data) == ("x", "UINT8", (3,), b"\x01\x02\x03")
    assert bytes(b.data) == data.tobytes() and b.shm is None
    assert s.shm == ShmRef("reg", 16, 64) and s.data is None
    y, z, w = req.outputs
    assert (y.binary, z.binary, w.shm) == (None, False, ShmRef("out", 32, 0))


def test_binary_inputs_take_their_bytes_in_order_from_the_body_the_pieces_or_the_socket():
    header = {"inputs": [{"name": n, "datatype": "UINT8", "shape": [k], "parameters": {"binary_data_size": k}}
                         for n, k in (("a", 2), ("b", 0), ("c", 3))]}
    req = rest.parse_infer("m", None, header, binary=memoryview(b"xxyyy"))
    assert [bytes(t.data) for t in req.inputs] == [b"xx", b"", b"yyy"]
    req = rest.parse_infer("m", None, header, binary=[b"xx", b"", b"yyy"])
    assert [bytes(t.data) for t in req.inputs] == [b"xx", b"", b"yyy"]
    req = rest.parse_infer("m", None, header, streamed=5)
    assert [type(t.data) for t in req.inputs] == [Incoming] * 3 and [len(t.data) for t in req.inputs] == [2, 0, 3]
    assert req.outputs is None and req.timeout_s is None and not req.binary_outputs


@pytest.mark.parametrize("binary, streamed, words", [
    (memoryview(b"xxyy"), None, ["input 'c'", "goes past the end"]),
    (memoryview(b"xxyyyz"), None, ["add up to 5 bytes, but 6 follow"]),
    (memoryview(b""), None, ["goes past the end"]),
    (None, 4, ["goes past the end", "4 bytes of binary data"]),
    (None, 9, ["add up to 5 bytes, but 9 follow"]),
    (None, None, ["goes past the end"]),
    ([b"xx"], None, ["no raw contents of 3 bytes"]),
    ([b"xx", b"yy"], None, ["no raw contents of 3 bytes"]),
    ([b"xx", b"yyy", b"z"], None, ["3 raw_input_contents for 2 inputs"]),
])
def test_binary_sizes_must_add_up_to_what_follows_the_header(binary, streamed, words):
    header = {"inputs": [{"name": n, "datatype": "UINT8", "shape": [k], "parameters": {"binary_data_size": k}}
                         for n, k in (("a", 2), ("c", 3))]}
    message = refused(ErrorCode.BAD_INPUT, rest.parse_infer, "m", None, header, binary=binary, streamed=streamed)
    assert all(w in message for w in words), message


def test_bytes_after_the_header_with_no_binary_input_are_refused():
    message = refused(ErrorCode.BAD_INPUT, rest.parse_infer, "m", None, request(), binary=memoryview(b"abc"))
    assert "add up to 0 bytes, but 3 follow" in message


@pytest.mark.parametrize("header, code, words", [
    (request(extra=1), ErrorCode.BAD_INPUT, ["unknown field 'extra'"]),
    (request(id=7), ErrorCode.BAD_INPUT, ["'id'"]),
    (request(id="i" * 257), ErrorCode.BAD_INPUT, ["'id'"]),
    (request(parameters=[1]), ErrorCode.BAD_INPUT, ["'parameters' must be an object"]),
    (request(parameters={"shape": 1}), ErrorCode.BAD_INPUT, ["unknown parameter 'shape'"]),
    (request(parameters={"sequence_id": 5}), ErrorCode.BAD_INPUT, ["sequence_id", "no sequence batching"]),
    (request(parameters={"sequence_id": "corr-1"}), ErrorCode.BAD_INPUT, ["sequence_id"]),
    (request(parameters={"sequence_start": True}), ErrorCode.BAD_INPUT, ["sequence_start"]),
    (request(parameters={"sequence_end": 1}), ErrorCode.BAD_INPUT, ["sequence_end"]),
    (request(parameters={"priority": -1}), ErrorCode.BAD_INPUT, ["'priority'"]),
    (request(parameters={"priority": 1.0}), ErrorCode.BAD_INPUT, ["'priority'"]),
    (request(parameters={"priority": "1"}), ErrorCode.BAD_INPUT, ["'priority'"]),
    (request(parameters={"priority": True}), ErrorCode.BAD_INPUT, ["'priority'"]),
    (request(parameters={"priority": 2**64}), ErrorCode.BAD_INPUT, ["'priority'"]),
    (request(parameters={"timeout": -1}), ErrorCode.BAD_INPUT, ["'timeout'", "[0, 86400000000]"]),
    (request(parameters={"timeout": 86_400_000_001}), ErrorCode.BAD_INPUT, ["'timeout'"]),
    (request(parameters={"timeout": 2**64}), ErrorCode.BAD_INPUT, ["'timeout'"]),
    (request(parameters={"timeout": 1.0}), ErrorCode.BAD_INPUT, ["'timeout'"]),
    (request(parameters={"timeout": True}), ErrorCode.BAD_INPUT, ["'timeout'"]),
    (request(parameters={"timeout": "100"}), ErrorCode.BAD_INPUT, ["'timeout'"]),
    (request(parameters={"routing_key": 5}), ErrorCode.BAD_INPUT, ["'routing_key'"]),
    (request(parameters={"routing_key": "k" * 257}), ErrorCode.BAD_INPUT, ["'routing_key'"]),
    (request(parameters={"binary_data_output": 1}), ErrorCode.BAD_INPUT, ["'binary_data_output'"]),
    ({}, ErrorCode.BAD_INPUT, ["'inputs' must be a non-empty list"]),
    (request(inputs=[]), ErrorCode.BAD_INPUT, ["'inputs'"]),
    (request(inputs={"name": "x"}), ErrorCode.BAD_INPUT, ["'inputs'"]),
    (request(inputs=[x_input(name=f"x{i}") for i in range(17)]), ErrorCode.BAD_INPUT, ["17 inputs: at most 16"]),
    (request(inputs=[[1]]), ErrorCode.BAD_INPUT, ["inputs[0] must be an object"]),
    (request(inputs=[x_input(contents=[1])]), ErrorCode.BAD_INPUT, ["unknown field 'contents'"]),
    (request(inputs=[x_input(name="")]), ErrorCode.BAD_INPUT, ["'name'"]),
    (request(inputs=[x_input(name="n" * 257)]), ErrorCode.BAD_INPUT, ["'name'"]),
    (request(inputs=[x_input(name=None)]), ErrorCode.BAD_INPUT, ["'name'"]),
    (request(inputs=[{"datatype": "UINT8", "shape": [1], "data": [1]}]), ErrorCode.BAD_INPUT, ["'name'"]),
    (request(inputs=[x_input(datatype="uint8")]), ErrorCode.BAD_DTYPE, ["unknown datatype 'uint8'"]),
    (request(inputs=[x_input(datatype="STRING")]), ErrorCode.BAD_DTYPE, ["STRING"]),
    (request(inputs=[x_input(datatype=None)]), ErrorCode.BAD_DTYPE, []),
    (request(inputs=[x_input(datatype=["UINT8"])]), ErrorCode.BAD_DTYPE, []),
    (request(inputs=[x_input(shape=3)]), ErrorCode.BAD_SHAPE, ["'shape'"]),
    (request(inputs=[x_input(shape=[-1])]), ErrorCode.BAD_SHAPE, ["'shape'"]),
    (request(inputs=[x_input(shape=[3.0])]), ErrorCode.BAD_SHAPE, ["'shape'"]),
    (request(inputs=[x_input(shape=[True, 3])]), ErrorCode.BAD_SHAPE, ["'shape'"]),
    (request(inputs=[x_input(shape=["3"])]), ErrorCode.BAD_SHAPE, ["'shape'"]),
    (request(inputs=[x_input(shape=[2**40])]), ErrorCode.BAD_SHAPE, ["'shape'"]),
    (request(inputs=[x_input(shape=[2**4, 2**60 + 2])]), ErrorCode.BAD_SHAPE, ["'shape'"]),
    (request(inputs=[x_input(shape=[1] * 9, data=[1])]), ErrorCode.BAD_SHAPE, ["at most 8"]),
    (request(inputs=[x_input(parameters=[])]), ErrorCode.BAD_INPUT, ["'parameters' must be an object"]),
    (request(inputs=[x_input(parameters={"binary_data": True})]), ErrorCode.BAD_INPUT, ["unknown parameter"]),
    (request(inputs=[x_input(parameters={"binary_data_size": 3})]), ErrorCode.BAD_INPUT, ["exactly one of", "has 2"]),
    (request(inputs=[{"name": "x", "datatype": "UINT8", "shape": [3]}]), ErrorCode.BAD_INPUT,
     ["exactly one of", "has 0"]),
    (request(inputs=[x_input(parameters={"binary_data_size": -3})]), ErrorCode.BAD_INPUT, ["binary_data_size"]),
    (request(inputs=[x_input(parameters={"binary_data_size": "3"})]), ErrorCode.BAD_INPUT, ["binary_data_size"]),
    (request(inputs=[x_input(parameters={"binary_data_size": 2**41})]), ErrorCode.BAD_INPUT, ["binary_data_size"]),
    (request(inputs=[x_input(parameters={"shared_memory_region": "r"})]), ErrorCode.BAD_REGION,
     ["needs shared_memory_byte_size"]),
    (request(inputs=[x_input(parameters={"shared_memory_byte_size": 3})]), ErrorCode.BAD_REGION,
     ["need shared_memory_region"]),
    (request(inputs=[x_input(parameters={"shared_memory_offset": 0})]), ErrorCode.BAD_REGION, []),
    (request(inputs=[x_input(parameters={"shared_memory_region": "r", "shared_memory_byte_size": 3})]),
     ErrorCode.BAD_INPUT, ["exactly one of"]),
    (request(inputs=[x_input(parameters={"shared_memory_region": "", "shared_memory_byte_size": 3})]),
     ErrorCode.BAD_INPUT, ["shared_memory_region"]),
    (request(inputs=[x_input(parameters={"shared_memory_region": 7, "shared_memory_byte_size": 3})]),
     ErrorCode.BAD_INPUT, ["shared_memory_region"]),
    (request(inputs=[x_input(data=None, parameters={"shared_memory_region": "r", "shared_memory_byte_size": 3,
                                                    "shared_memory_offset": -1})]), ErrorCode.BAD_INPUT,
     ["shared_memory_offset"]),
    (request(inputs=[x_input(data=None, parameters={"shared_memory_region": "r", "shared_memory_byte_size": 3,
                                                    "shared_memory_offset": 2**64 - 32})]), ErrorCode.BAD_INPUT,
     ["shared_memory_offset"]),
    (request(outputs={"name": "y"}), ErrorCode.BAD_INPUT, ["'outputs' must be a list"]),
    (request(outputs=[{"name": f"y{i}"} for i in range(17)]), ErrorCode.BAD_INPUT, ["'outputs'"]),
    (request(outputs=["y"]), ErrorCode.BAD_INPUT, ["outputs[0] must be an object"]),
    (request(outputs=[{"name": "y", "datatype": "FP32"}]), ErrorCode.BAD_INPUT, ["unknown field 'datatype'"]),
    (request(outputs=[{}]), ErrorCode.BAD_INPUT, ["'name'"]),
    (request(outputs=[{"name": "y", "parameters": 1}]), ErrorCode.BAD_INPUT, ["'parameters'"]),
    (request(outputs=[{"name": "y", "parameters": {"binary_data_size": 1}}]), ErrorCode.BAD_INPUT,
     ["unknown parameter 'binary_data_size'"]),
    (request(outputs=[{"name": "y", "parameters": {"classification": -2}}]), ErrorCode.BAD_INPUT, ["classification"]),
    (request(outputs=[{"name": "y", "parameters": {"classification": 2, "shared_memory_region": "r",
                                                   "shared_memory_byte_size": 8}}]), ErrorCode.BAD_INPUT,
     ["Output can't set both 'shared_memory_region' and 'classification'"]),
    (request(outputs=[{"name": "y", "parameters": {"binary_data": "true"}}]), ErrorCode.BAD_INPUT, ["'binary_data'"]),
    (request(outputs=[{"name": "y", "parameters": {"binary_data": True, "shared_memory_region": "r",
                                                   "shared_memory_byte_size": 4}}]), ErrorCode.BAD_INPUT,
     ["exclude each other"]),
    (request(outputs=[{"name": "y", "parameters": {"shared_memory_region": "r"}}]), ErrorCode.BAD_REGION, []),
])
def test_every_field_is_checked(header, code, words):
    message = refused(code, rest.parse_infer, "m", None, header)
    assert all(w in message for w in words), message
    assert len(message) < 400 and "n" * 100 not in message and "i" * 100 not in message


def test_priority_is_taken_as_triton_takes_it():
    """Triton's ``priority`` is a uint64: a level (1 first), or 0 (or left out) for the model's
    default; one that no slot's u32 holds is above every model's levels: the default level too."""
    for given, level in ((None, 0), (0, 0), (1, 1), (3, 3), (2**32 - 1, 2**32 - 1), (2**32, 0), (2**64 - 1, 0)):
        params = {} if given is None else {"priority": given}
        assert rest.parse_infer("m", None, request(parameters=params)).priority == level, given


def test_zero_and_absent_optional_parameters_are_taken():
    for params in ({}, {"sequence_id": 0}, {"sequence_id": ""}, {"sequence_start": False}, {"sequence_end": 0},
                   {"priority": 0}, {"timeout": 0}, {"timeout": None}, {"routing_key": None}):
        req = rest.parse_infer("m", None, request(parameters=params))
        assert req.timeout_s is None and req.key is None
    assert rest.parse_infer("m", None, request(parameters={"timeout": 1})).timeout_s == 1e-6
    assert rest.parse_infer("m", None, request(outputs=[])).outputs == []
    out = rest.parse_infer("m", None, request(outputs=[{"name": "y", "parameters": {"classification": 0}}]))
    assert out.outputs[0].name == "y" and out.outputs[0].classification == 0
    out = rest.parse_infer("m", None, request(outputs=[{"name": "y", "parameters": {"classification": 3}}]))
    assert out.outputs[0].classification == 3


def test_duplicate_outputs_and_inputs_are_passed_on_for_the_service_to_refuse():
    """The codec reads each tensor on its own; the service refuses duplicates (one owner: the
    native protocol's tensor-list rules), which the HTTP edge tests check through a server."""
    req = rest.parse_infer("m", None, request(inputs=[x_input(), x_input()], outputs=[{"name": "y"}, {"name": "y"}]))
    assert len(req.inputs) == 2 and len(req.outputs) == 2


VALID = request(id="a", parameters={"binary_data_output": True},
                outputs=[{"name": "y", "parameters": {"binary_data": True}}])


def mutated(base: dict):
    """Near-valid requests: a field of ``base`` (at any depth) replaced by an arbitrary value, or
    an arbitrary key added."""
    def mutate(value, path, new, add):
        if not path:
            return new
        key, rest_path = path[0], path[1:]
        if isinstance(value, dict):
            copy = dict(value)
            if add and not rest_path:
                copy[str(key)] = new
            else:
                k = list(copy)[key % len(copy)] if copy else str(key)
                copy[k] = mutate(copy.get(k), rest_path, new, add)
            return copy
        if isinstance(value, list) and value:
            copy = list(value)
            copy[key % len(copy)] = mutate(copy[key % len(copy)], rest_path, new, add)
            return copy
        return new

    return st.builds(lambda path, new, add: mutate(base, path, new, add),
                     st.lists(st.integers(0, 6), min_size=1, max_size=5), JSON, st.booleans())


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=10), JSON, max_size=5) | mutated(VALID) | mutated(
    {"inputs": [{"name": "b", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}]}),
    st.sampled_from([None, memoryview(bytes(8)), [bytes(8)], "streamed"]))
def test_any_json_object_gives_a_request_or_a_v2_error(header, binary):
    streamed = 8 if binary == "streamed" else None
    try:
        req = rest.parse_infer("m", None, header, binary=None if streamed else binary, streamed=streamed)
    except V2Error as exc:
        assert exc.code in (ErrorCode.BAD_INPUT, ErrorCode.BAD_DTYPE, ErrorCode.BAD_SHAPE, ErrorCode.BAD_REGION)
        assert len(exc.message) < 600
        return
    assert req.inputs and all(t.datatype in DATATYPES for t in req.inputs)
    for t in req.inputs:
        assert (t.data is None) != (t.shm is None)


# -- JSON tensor data ------------------------------------------------------------------------------

@pytest.mark.parametrize("datatype", INT_TYPES)
def test_integers_at_the_edges_of_their_range_round_trip_and_one_past_is_refused(datatype):
    info = np.iinfo(DATATYPES[datatype])
    edges = [int(info.min), int(info.min) + 1, 0, int(info.max) - 1, int(info.max)]
    raw = rest.json_to_bytes(datatype, (5,), edges, "x")
    assert raw == np.array(edges, np.dtype(DATATYPES[datatype]).newbyteorder("<")).tobytes()
    assert rest.bytes_to_json(datatype, (5,), raw, "x").tolist() == edges
    for outside in (int(info.min) - 1, int(info.max) + 1):
        refused(ErrorCode.BAD_INPUT, rest.json_to_bytes, datatype, (2,), [0, outside], "x")
        refused(ErrorCode.BAD_INPUT, rest.json_to_bytes, datatype, (1,), [outside], "x")


def test_uint64_data_past_int64_among_small_values_is_exact():
    values = [0, 2**63, 2**64 - 1, 7]
    raw = rest.json_to_bytes("UINT64", (4,), values, "x")
    assert rest.bytes_to_json("UINT64", (4,), raw, "x").tolist() == values
    assert rest.json_to_bytes("UINT64", (2, 1), [[1], [2**63]], "x") == np.array([1, 2**63], "<u8").tobytes()
    for data in ([-1, 2**63], [0.5, 2**63], [0, 2**64], ["1", 2**63]):
        refused(ErrorCode.BAD_INPUT, rest.json_to_bytes, "UINT64", (2,), data, "x")
    refused(ErrorCode.BAD_INPUT, rest.json_to_bytes, "INT64", (2,), [0, 2**63], "x")


@settings(max_examples=60)
@given(st.sampled_from(INT_TYPES), st.data())
def test_integer_data_round_trips(datatype, data):
    info = np.iinfo(DATATYPES[datatype])
    values = data.draw(st.lists(st.integers(int(info.min), int(info.max)), max_size=20))
    shape = (len(values),) if data.draw(st.booleans()) or len(values) != 6 else (2, 3)
    nested = values if len(shape) == 1 else [values[:3], values[3:]]
    raw = rest.json_to_bytes(datatype, shape, nested, "x")
    assert len(raw) == len(values) * ITEMSIZE[datatype]
    assert rest.bytes_to_json(datatype, shape, raw, "x").tolist() == values


@settings(max_examples=60)
@given(st.sampled_from(FLOAT_TYPES), st.data())
def test_float_data_round_trips_exactly_where_the_type_can_hold_it(datatype, data):
    if datatype == "BF16":
        bits = data.draw(st.lists(st.integers(0, 0xFFFF).filter(lambda b: (b >> 7) & 0xFF != 0xFF), max_size=12))
        values = [float(v) for v in np.array(bits, np.uint16).view(ml_dtypes.bfloat16)]
    else:
        width = {"FP16": 16, "FP32": 32, "FP64": 64}[datatype]
        values = data.draw(st.lists(st.floats(width=width, allow_nan=False, allow_infinity=False), max_size=12))
    raw = rest.json_to_bytes(datatype, (len(values),), values, "x")
    back = rest.bytes_to_json(datatype, (len(values),), raw, "x")
    assert [float(v) for v in back] == values
    sent = json.loads(rest.dumps({"d": back}))["d"]  # the response's JSON: the shortest text of each value
    assert np.array(sent, NUMPY[datatype]).tobytes() == raw


@pytest.mark.parametrize("datatype, value", [("FP16", 65520.0), ("FP16", -1e5), ("FP32", 3.5e38), ("FP32", -1e39),
                                             ("BF16", 3.4e38), ("BF16", 1e39), ("FP16", 10**6)])
def test_floats_that_would_be_infinite_are_refused(datatype, value):
    message = refused(ErrorCode.BAD_INPUT, rest.json_to_bytes, datatype, (2,), [1.0, value], "input 'x'")
    assert "outside the range of " + datatype in message and message.startswith("input 'x'")
    assert rest.json_to_bytes("FP64", (1,), [1.7e308], "x") == np.array([1.7e308]).tobytes()
    assert rest.json_to_bytes("FP16", (1,), [65504], "x") == np.array([65504], np.float16).tobytes()


def test_bool_data_is_booleans_only():
    assert rest.json_to_bytes("BOOL", (3,), [True, False, True], "x") == b"\x01\x00\x01"
    assert rest.bytes_to_json("BOOL", (3,), b"\x01\x00\x01", "x").tolist() == [True, False, True]
    for data in ([1, 0], [1.0], ["true"], [None]):
        refused(ErrorCode.BAD_INPUT, rest.json_to_bytes, "BOOL", (len(data),), data, "x")


@pytest.mark.parametrize("datatype, shape, data, words", [
    ("INT32", (3,), [1, 2], ["2 elements", "needs 3"]),
    ("INT32", (2,), [1, 2, 3], ["3 elements"]),
    ("INT32", (2, 2), [[1, 2], [3]], ["Failed to parse 'data' field: shape does not match true shape"]),
    ("INT32", (2,), [1.5, 2], ["integers"]),
    ("UINT64", (2,), [-1, 2**64 - 1], ["outside the range"]),  # no 64-bit type holds both: never wrapped
    ("INT64", (2,), [-1, 2**63], ["outside the range"]),
    ("INT8", (1,), ["1"], ["numbers"]),
    ("INT8", (1,), [None], ["numbers"]),
    ("FP32", (1,), [{"v": 1}], ["numbers"]),
    ("FP32", (1,), [True], ["numbers"]),
    ("FP32", (1,), "1.0", ["numbers"]),
])
def test_json_data_of_the_wrong_count_kind_or_form_is_refused(datatype, shape, data, words):
    message = refused(ErrorCode.BAD_INPUT, rest.json_to_bytes, datatype, shape, data, "input 'x'")
    assert all(w in message for w in words), message


@pytest.mark.parametrize("datatype, shape, data, flat", [
    ("UINT8", (1,), [[1]], [1]), ("FP32", (2,), [[1.0], [2.0]], [1.0, 2.0]),
    ("INT32", (2, 2), [[[1, 2]], [[3, 4]]], [1, 2, 3, 4]), ("INT32", (2,), [1, [2]], [1, 2]),
    ("INT32", (2, 2), [[1, [2, [3]]], 4], [1, 2, 3, 4]),
    ("BOOL", (1,), [[[[[[[[[[True]]]]]]]]]], [True]), ("BYTES", (2,), [["a"], ["b"]], ["a", "b"]),
    ("BYTES", (1, 1), [[["a"]]], ["a"]), ("BYTES", (), [["a"]], ["a"]),
    ("FP32", (1,), json.loads("[" * 70 + "1" + "]" * 70), [1.0]),  # deeper than numpy's 64 dimensions
])
def test_json_data_nested_deeper_than_its_shape_or_unevenly_is_read_in_row_major_order(datatype, shape, data, flat):
    """As Triton's server: every value in order, however the lists nest."""
    assert rest.json_to_bytes(datatype, shape, data, "x") == rest.json_to_bytes(datatype, shape, flat, "x")


def test_json_data_may_be_nested_flat_or_a_lone_scalar():
    flat = rest.json_to_bytes("INT16", (2, 2), [1, 2, 3, 4], "x")
    assert flat == rest.json_to_bytes("INT16", (2, 2), [[1, 2], [3, 4]], "x") == np.arange(1, 5, dtype="<i2").tobytes()
    assert rest.json_to_bytes("FP32", (), 2.5, "x") == rest.json_to_bytes("FP32", (1,), [2.5], "x")
    nested = rest.json_to_bytes("BYTES", (2, 1), [["a"], ["b"]], "x")
    assert nested == rest.json_to_bytes("BYTES", (2,), ["a", "b"], "x")
    assert rest.json_to_bytes("UINT8", (0,), [], "x") == b"" and rest.json_to_bytes("FP32", (2, 0), [], "x") == b""


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(list(DATATYPES)), st.lists(st.integers(0, 4), max_size=3), JSON)
def test_json_to_bytes_of_anything_is_bytes_of_the_right_size_or_a_v2_error(datatype, shape, data):
    try:
        raw = rest.json_to_bytes(datatype, tuple(shape), data, "x")
    except V2Error as exc:
        assert exc.code == ErrorCode.BAD_INPUT
        return
    if datatype != "BYTES":
        assert len(raw) == math.prod(shape) * ITEMSIZE[datatype]


# -- BYTES -----------------------------------------------------------------------------------------

@settings(max_examples=150)
@given(st.lists(st.binary(max_size=40), max_size=10))
def test_bytes_elements_round_trip_through_the_binary_form(elements):
    raw = rest.serialize_bytes(elements)
    assert len(raw) == sum(4 + len(e) for e in elements)
    assert rest.deserialize_bytes(raw, len(elements), "x") == elements
    assert rest.deserialize_bytes(memoryview(raw), len(elements), "x") == elements


@settings(max_examples=150)
@given(st.lists(st.text(max_size=20), min_size=1, max_size=8))
def test_bytes_json_strings_round_trip(strings):
    raw = rest.json_to_bytes("BYTES", (len(strings),), strings, "x")
    assert raw == rest.serialize_bytes([s.encode() for s in strings])
    assert rest.bytes_to_json("BYTES", (len(strings),), raw, "x") == strings
    if len(strings) % 2 == 0:
        half = len(strings) // 2
        nested = [strings[:half], strings[half:]]
        assert rest.json_to_bytes("BYTES", (2, half), nested, "x") == raw


@pytest.mark.parametrize("raw, count, words", [
    (b"\x05\x00\x00\x00abc", 1, ["runs past the end"]),
    (b"\xff\xff\xff\xffabc", 1, ["runs past the end"]),
    (b"\x01\x00", 1, ["inside an element's length"]),
    (b"", 1, ["inside an element's length"]),
    (b"\x01\x00\x00\x00ab", 1, ["1 bytes after the last"]),
    (b"\x00\x00\x00\x00", 2, ["inside an element's length"]),
    (b"\x00\x00\x00\x00\x00", 1, ["1 bytes after"]),
    (b"junk", 0, ["4 bytes after"]),
])
def test_hostile_bytes_lengths_are_refused(raw, count, words):
    message = refused(ErrorCode.BAD_INPUT, rest.deserialize_bytes, raw, count, "input 'x'")
    assert all(w in message for w in words) and message.startswith("input 'x'")


@settings(max_examples=300)
@given(st.binary(max_size=64), st.integers(0, 8))
def test_deserializing_any_bytes_gives_elements_or_a_v2_error(raw, count):
    try:
        elements = rest.deserialize_bytes(raw, count, "x")
    except V2Error as exc:
        assert exc.code == ErrorCode.BAD_INPUT
        return
    assert len(elements) == count and rest.serialize_bytes(elements) == raw


def test_bytes_json_data_must_be_strings_of_the_right_count():
    for data in (["a", 1], [None], [b"a"], [["a"], [1]], {"a": "b"}, 5):
        refused(ErrorCode.BAD_INPUT, rest.json_to_bytes, "BYTES", (2,), data, "x")
    assert "1 elements" in refused(ErrorCode.BAD_INPUT, rest.json_to_bytes, "BYTES", (2,), ["a"], "x")
    deep = "a"
    for _ in range(1000):  # orjson's limit is 1024: read without recursion
        deep = [deep]
    assert rest.json_to_bytes("BYTES", (1,), deep, "x") == b"\x01\x00\x00\x00a"
    assert rest.json_to_bytes("BYTES", (1,), "lone", "x") == b"\x04\x00\x00\x00lone"


def test_bytes_that_are_not_utf8_are_refused_as_json_but_not_as_binary():
    raw = rest.serialize_bytes([b"ok", b"\xff\xfe"])
    assert "binary_data = true" in refused(ErrorCode.BAD_INPUT, rest.bytes_to_json, "BYTES", (2,), raw, "output 'y'")
    result = InferResult("m", "1", None, [OutputTensor("y", "BYTES", (2,), raw)])
    header, parts, h = rest.encode_result(result, True)
    assert parts == [raw] and h == len(header)


# -- the raw-binary form ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec_shape, dtype, size, shape", [
    (("n",), "float32", 12, (3,)), ((None, 4), "uint8", 8, (2, 4)), ((2, "n", 3), "int16", 36, (2, 3, 3)),
    ((2, 2), "float64", 32, (2, 2)), (("n",), "uint8", 0, (0,)), ((4, None), "int32", 0, (4, 0)),
])
def test_raw_binary_requests_take_the_shape_the_size_fits(spec_shape, dtype, size, shape):
    data = memoryview(bytes(size))
    req = rest.raw_binary_request("m", "1", TensorSpec("x", dtype, spec_shape), size, data)
    (t,) = req.inputs
    assert (t.name, t.shape, t.data, req.binary_outputs, req.outputs) == ("x", shape, data, True, None)
    assert t.datatype == {"float32": "FP32", "uint8": "UINT8", "int16": "INT16", "float64": "FP64",
                          "int32": "INT32"}[dtype]


@pytest.mark.parametrize("spec_shape, dtype, size, words", [
    (("n",), "float32", 13, ["not a whole number of 4-byte rows"]),
    (("a", "b"), "float32", 16, ["The shape of the raw input 'x' can not be deduced because there are more than one "
                                 "variable-sized dimension"]),
    ((2, 2), "float64", 24, ["not a whole number of 32-byte rows"]),
    ((2, 2), "float64", 64, ["fixed shape needs 32"]),
    ((0, "n"), "uint8", 0, ["0-byte rows"]),
    ((None, 3), "uint8", 7, ["not a whole number of 3-byte rows"]),
])
def test_raw_binary_sizes_that_do_not_fit_are_refused(spec_shape, dtype, size, words):
    message = refused(ErrorCode.BAD_INPUT, rest.raw_binary_request, "m", None, TensorSpec("x", dtype, spec_shape),
                      size, Incoming(size))
    assert all(w in message for w in words), message


# -- responses -------------------------------------------------------------------------------------

def test_a_json_response():
    y = np.array([[1.5, -2], [0, 4]], np.float32)
    result = InferResult("m", "3", "req-1", [OutputTensor("y", "FP32", (2, 2), memoryview(y.tobytes())),
                                            OutputTensor("n", "INT64", (0,), b"")])
    header, parts, h = rest.encode_result(result, False)
    assert parts == [] and h is None
    assert json.loads(header) == {"model_name": "m", "model_version": "3", "id": "req-1", "outputs": [
        {"name": "y", "datatype": "FP32", "shape": [2, 2], "data": [1.5, -2.0, 0.0, 4.0]},
        {"name": "n", "datatype": "INT64", "shape": [0], "data": []}]}


def test_a_binary_response_with_per_output_choices_and_a_shared_memory_output():
    a, b = np.arange(3, dtype=np.int16).tobytes(), b"\x01\x00"
    outputs = [OutputTensor("a", "INT16", (3,), memoryview(a)),
               OutputTensor("b", "BOOL", (2,), b, binary=False),
               OutputTensor("e", "UINT8", (0,), b""),
               OutputTensor("s", "FP32", (4,), None, ShmRef("out", 16, 32)),
               OutputTensor("t", "FP32", (1,), None, ShmRef("out2", 4))]
    header, parts, h = rest.encode_result(InferResult("m", "1", None, outputs), True)
    assert h == len(header) and [bytes(p) for p in parts] == [a]  # no part for the empty one
    body = json.loads(header)
    assert "id" not in body
    a_, b_, e_, s_, t_ = body["outputs"]
    assert a_["parameters"] == {"binary_data_size": 6} and "data" not in a_
    assert b_["data"] == [True, False] and "parameters" not in b_
    assert e_["parameters"] == {"binary_data_size": 0}
    assert s_["parameters"] == {"shared_memory_region": "out", "shared_memory_byte_size": 16,
                                "shared_memory_offset": 32}
    assert t_["parameters"] == {"shared_memory_region": "out2", "shared_memory_byte_size": 4}
    only_shm = InferResult("m", "1", None, outputs[3:])
    assert rest.encode_result(only_shm, True)[2] is None  # nothing binary follows: a plain JSON answer


@settings(max_examples=60)
@given(st.lists(st.tuples(st.sampled_from(sorted(ITEMSIZE)), st.integers(0, 5), st.sampled_from([None, True, False])),
                min_size=1, max_size=5), st.booleans())
def test_a_binary_response_can_be_read_back(outs, default):
    """What a client does with the answer: the JSON header, then each binary output's bytes in order."""
    rng = np.random.default_rng(len(outs))
    outputs = [OutputTensor(f"o{i}", dt, (n,), rng.integers(0, 2 if dt == "BOOL" else 100, n * ITEMSIZE[dt], np.uint8)
                            .astype(np.uint8).tobytes() if dt != "BOOL" else rng.integers(0, 2, n, np.uint8).tobytes(),
                            binary=b) for i, (dt, n, b) in enumerate(outs)]
    header, parts, h = rest.encode_result(InferResult("m", "1", None, outputs), default)
    body = header + b"".join(bytes(p) for p in parts)
    meta = json.loads(body[:h] if h is not None else body)
    pos = h or 0
    for o, entry in zip(outputs, meta["outputs"]):
        if "data" in entry:
            dtype = NUMPY.get(o.datatype) or np.dtype(DATATYPES[o.datatype]).newbyteorder("<")
            assert np.array(entry["data"], dtype).tobytes() == o.data
        else:
            size = entry["parameters"]["binary_data_size"]
            assert body[pos:pos + size] == o.data
            pos += size
    assert pos == (len(body) if h is not None else 0)


def test_the_limits_the_codec_leans_on():
    assert struct.calcsize("<I") == 4 and orjson.loads(rest.dumps({"a": np.arange(2)})) == {"a": [0, 1]}


# -- work a piece at a time --------------------------------------------------------------------------

P = rest.JSON_PIECE


@pytest.mark.parametrize("shape", [(3 * P + 7,), (1, 2 * P + 1), (P // 2 + 3, 4), (3, 2, P // 2 + 5), (2, P + 1, 1)],
                         ids=["flat", "one long row", "many short rows", "deep", "long middle"])
def test_large_json_tensor_data_is_turned_into_bytes_in_pieces_exactly(shape):
    """More than JSON_PIECE elements, laid out every way: the bytes are those of the whole array."""
    rng = np.random.default_rng(math.prod(shape))
    x = rng.integers(-1000, 1000, shape).astype(np.int32)
    assert rest.json_to_bytes("INT32", shape, x.tolist(), "x") == x.astype("<i4").tobytes()
    f = rng.random(shape).astype(np.float32)
    assert rest.json_to_bytes("FP32", shape, f.tolist(), "x") == f.astype("<f4").tobytes()
    assert rest.json_to_bytes("FP32", shape, x.reshape(-1).tolist(), "x") == x.astype("<f4").tobytes()  # flat


@pytest.mark.parametrize("spoil", ["ragged row", "string in the last piece", "list of two where a number goes"])
def test_large_json_tensor_data_that_is_not_a_regular_array_is_refused(spoil):
    data = np.zeros((4, P), np.int32).tolist()
    if spoil == "ragged row":
        data[3].pop()
    elif spoil == "string in the last piece":
        data[3][-1] = "7"
    else:
        data[2][5] = [1, 2]  # one value more (one list in its place alone is read as its value)
    refused(ErrorCode.BAD_INPUT, rest.json_to_bytes, "INT32", (4, P), data, "input 'x'")
    flat = [0] * (2 * P) + ["7"]
    refused(ErrorCode.BAD_INPUT, rest.json_to_bytes, "INT32", (2 * P + 1,), flat, "input 'x'")


def large_result(n: int = 2 * P + 3) -> tuple[InferResult, dict]:
    rng = np.random.default_rng(n)
    f = rng.random(n).astype(np.float32)
    b = rng.random(n).astype(ml_dtypes.bfloat16)
    i = rng.integers(-(1 << 40), 1 << 40, n).astype(np.int64)
    s = [f"s{k}".encode() for k in range(n)]
    outputs = [OutputTensor("f", "FP32", (n,), memoryview(f.tobytes())),
               OutputTensor("bin", "UINT8", (3,), memoryview(b"\x01\x02\x03"), binary=True),
               OutputTensor("b", "BF16", (n,), memoryview(b.tobytes())),
               OutputTensor("i", "INT64", (n,), memoryview(i.tobytes())),
               OutputTensor("s", "BYTES", (n,), rest.serialize_bytes(s)),
               OutputTensor("empty", "FP32", (0,), b"")]
    expected = {"f": f, "b": b.astype(np.float32), "i": i, "s": [e.decode() for e in s], "empty": []}
    return InferResult("m", "2", "r", outputs), expected


def test_a_large_json_answer_is_made_in_pieces_the_same_each_time():
    """Each piece holds at most JSON_PIECE elements of one output (orjson's text of them); the
    pieces make the same JSON as the whole answer, twice over, and the binary part follows."""
    result, expected = large_result()
    body = rest.ResultBody(result, False)
    assert not body.small and body.binary and [bytes(p) for p in body.parts] == [b"\x01\x02\x03"]
    pieces = list(body.pieces())
    assert list(body.pieces()) == pieces
    assert max(piece.count(b",") for piece in pieces) <= P
    header = b"".join(pieces)
    assert header == body.header() == rest.encode_result(result, False)[0]
    answer = json.loads(header)
    assert (answer["model_name"], answer["model_version"], answer["id"]) == ("m", "2", "r")
    got = {o["name"]: o for o in answer["outputs"]}
    for name, values in expected.items():
        data = got[name]["data"]
        assert (data == values if isinstance(values, list) else
                np.array_equal(np.array(data, values.dtype), values)), name
    assert got["bin"]["parameters"] == {"binary_data_size": 3} and "data" not in got["bin"]


def test_a_small_answer_is_one_piece_of_work():
    y = np.arange(P, dtype=np.float32)
    body = rest.ResultBody(InferResult("m", "1", None, [OutputTensor("y", "FP32", (P,), memoryview(y.tobytes()))]),
                           False)
    assert body.small and not body.binary and json.loads(body.header())["outputs"][0]["data"] == y.tolist()


def test_a_bytes_output_that_is_not_text_is_refused_while_the_pieces_are_made():
    n = 2 * P
    raw = rest.serialize_bytes([b"ok"] * (n - 1) + [b"\xff"])
    body = rest.ResultBody(InferResult("m", "1", None, [OutputTensor("s", "BYTES", (n,), raw)]), False)
    pieces = body.pieces()
    next(pieces)
    with pytest.raises(V2Error) as info:
        list(pieces)
    assert info.value.code is ErrorCode.BAD_INPUT and "binary_data = true" in info.value.message
    extra = rest.serialize_bytes([b"ok"] * n) + b"\x00"  # bytes after the last element
    body = rest.ResultBody(InferResult("m", "1", None, [OutputTensor("s", "BYTES", (n,), extra)]), False)
    refused(ErrorCode.BAD_INPUT, body.header)
