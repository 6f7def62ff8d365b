"""The KServe v2 gRPC door against requests no client library would send: Triton's own messages
(``tritonclient.grpc.service_pb2``) built field by field and sent through a bare stub.

raw_input_contents that do not match the inputs, the typed ``contents`` of every datatype that has
one (and values out of their range), messages over the limit, unknown models and versions, the
same request rules as HTTP (parameters, duplicates, datatypes, shapes), RPCs that are not served,
and callers that give up mid-request.  Every refusal carries shmserve's stable code; afterwards
the server serves and holds nothing.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from helpers.server import wait_for
from helpers.v2_server import MAX_REQUEST_BYTES, TYPED, grpc_refused, grpc_stub, server_fixture, still_serving
from helpers.v2_server import baseline, stub  # noqa: F401  (fixtures)

MAX_MESSAGE = 2 * MAX_REQUEST_BYTES + (1 << 20)
V2 = {"bool": "BOOL", "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64", "uint8": "UINT8",
      "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64", "float16": "FP16", "float32": "FP32",
      "float64": "FP64"}
FIELD = {"bool": "bool_contents", "int8": "int_contents", "int16": "int_contents", "int32": "int_contents",
         "int64": "int64_contents", "uint8": "uint_contents", "uint16": "uint_contents", "uint32": "uint_contents",
         "uint64": "uint64_contents", "float32": "fp32_contents", "float64": "fp64_contents"}  # FP16: raw only


srv = server_fixture("v2grpc")


@pytest.fixture(autouse=True)
def serving_after(srv, stub, baseline):
    yield
    assert stub.ServerLive(pb.ServerLiveRequest()).live
    still_serving(srv, baseline)


def infer(model: str, *tensors, raw=(), outputs=(), **params) -> pb.ModelInferRequest:
    """A ModelInferRequest: ``tensors`` are (name, datatype, shape) or (name, datatype, shape,
    {contents field: values}); ``params``: request parameters."""
    msg = pb.ModelInferRequest(model_name=model, raw_input_contents=list(raw))
    for t in tensors:
        name, datatype, shape = t[:3]
        tensor = msg.inputs.add(name=name, datatype=datatype, shape=list(shape))
        for field, values in (t[3] if len(t) > 3 else {}).items():
            getattr(tensor.contents, field).extend(values)
    for name in outputs:
        msg.outputs.add(name=name)
    set_params(msg.parameters, params)
    return msg


def set_params(target, values: dict) -> None:
    for key, value in values.items():
        p = target[key]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        else:
            p.string_param = value


def sample(dtype: str, n: int = 6) -> np.ndarray:
    rng = np.random.default_rng(n)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    return (rng.standard_normal(n) * 1000).astype(dtype)


# -- raw_input_contents ------------------------------------------------------------------------------

def test_raw_input_contents_must_match_the_inputs_one_to_one(stub):
    x = bytes(range(4))
    good = stub.ModelInfer(infer("identity", ("x", "UINT8", [4]), raw=[x]))
    assert good.raw_output_contents == [x] and good.outputs[0].name == "y" and list(good.outputs[0].shape) == [4]
    for raw, words in (([x, x], "2 raw_input_contents for 1 inputs"), ([], "has no data"),
                       ([x + b"!"], "input byte size mismatch for input 'x' for model 'identity'. Expected 4, got 5"),
                       ([x[:3]], "Expected 4, got 3")):
        details = grpc_refused(lambda: stub.ModelInfer(infer("identity", ("x", "UINT8", [4]), raw=raw)),
                               "INVALID_ARGUMENT", "bad_input")
        assert words in details, details
    a, b = np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32) * 5
    two = infer("two_inputs", ("a", "INT32", [3]), ("b", "INT32", [3]), raw=[a.tobytes(), b.tobytes()])
    assert np.array_equal(np.frombuffer(stub.ModelInfer(two).raw_output_contents[0], np.int32), a + b)
    swapped_sizes = infer("two_inputs", ("a", "INT32", [3]), ("b", "INT32", [3]),
                          raw=[a.tobytes()[:8], b.tobytes() + b"1234"])
    grpc_refused(lambda: stub.ModelInfer(swapped_sizes), "INVALID_ARGUMENT", "bad_input")
    one_short = infer("two_inputs", ("a", "INT32", [3]), ("b", "INT32", [3]), raw=[a.tobytes()])
    assert "input 'b' has no data" in grpc_refused(lambda: stub.ModelInfer(one_short), "INVALID_ARGUMENT", "bad_input")


@pytest.mark.parametrize("model", sorted(TYPED))
def test_typed_contents_of_every_datatype_that_has_them(stub, model):
    """One request per model, each input in its typed field (FP16 has none: its raw contents come
    in input order among the inputs that have no typed contents); the answer is raw, by output
    position, bit for bit."""
    tensors, raw, want = [], [], []
    for dtype in TYPED[model]:
        x = sample(dtype)
        want.append(x)
        if dtype in FIELD:
            values = x.tolist()
            tensors.append((dtype, V2[dtype], [len(x)], {FIELD[dtype]: values}))
        else:
            tensors.append((dtype, V2[dtype], [len(x)]))
            raw.append(x.tobytes())
    reply = stub.ModelInfer(infer(model, *tensors, raw=raw))
    assert [o.name for o in reply.outputs] == [f"out_{d}" for d in TYPED[model]]
    for x, out, data in zip(want, reply.outputs, reply.raw_output_contents):
        assert out.datatype == V2[x.dtype.name] and list(out.shape) == [len(x)]
        assert data == x.tobytes(), out.name


@pytest.mark.parametrize("dtype, values", [("int8", [127, 128]), ("int8", [-129]), ("int16", [40000]),
                                           ("uint8", [256]), ("uint16", [65536])])
def test_typed_contents_out_of_their_datatypes_range_are_refused(stub, dtype, values):
    model = next(m for m, dtypes in TYPED.items() if dtype in dtypes)
    tensors = [(d, V2[d], [len(values)], {FIELD[d]: values if d == dtype else sample(d, len(values)).tolist()})
               if d in FIELD else (d, V2[d], [len(values)]) for d in TYPED[model]]
    raw = [sample(d, len(values)).tobytes() for d in TYPED[model] if d not in FIELD]
    details = grpc_refused(lambda: stub.ModelInfer(infer(model, *tensors, raw=raw)), "INVALID_ARGUMENT", "bad_input")
    assert f"input '{dtype}'" in details and "outside the range" in details, details


def test_bytes_as_typed_or_raw_contents_and_bf16_as_raw_contents(stub):
    words = [b"abc", b"", b"\x00\xff", "é".encode()]
    serialized = b"".join(len(w).to_bytes(4, "little") + w for w in words)
    want = b"".join(len(w).to_bytes(4, "little") + w[::-1] for w in words)
    assert stub.ModelInfer(infer("reverse", ("x", "BYTES", [4], {"bytes_contents": words}))).raw_output_contents \
        == [want]
    assert stub.ModelInfer(infer("reverse", ("x", "BYTES", [4]), raw=[serialized])).raw_output_contents == [want]
    for bad in (serialized[:-1], serialized + b"\0", b"\xff\xff\xff\xff"):
        grpc_refused(lambda: stub.ModelInfer(infer("reverse", ("x", "BYTES", [4]), raw=[bad])), "INVALID_ARGUMENT",
                     "bad_input")
    x = np.array([1.0, -2.5, 3.140625], ml_dtypes.bfloat16)
    assert stub.ModelInfer(infer("bf16", ("x", "BF16", [3]), raw=[x.tobytes()])).raw_output_contents == [x.tobytes()]
    typed = infer("bf16", ("x", "BF16", [3], {"fp32_contents": [1.0, 2.0, 3.0]}))  # BF16 has no typed field
    assert "has no data" in grpc_refused(lambda: stub.ModelInfer(typed), "INVALID_ARGUMENT", "bad_input")


def test_typed_contents_in_the_wrong_field_or_beside_raw_contents_are_refused(stub):
    x = np.arange(4, dtype=np.float32)
    wrong = infer("slow", ("x", "FP32", [4], {"int_contents": [1, 2, 3, 4]}))
    assert "has no data" in grpc_refused(lambda: stub.ModelInfer(wrong), "INVALID_ARGUMENT", "bad_input")
    both = infer("slow", ("x", "FP32", [4], {"fp32_contents": x.tolist()}), raw=[x.tobytes()])
    assert "1 raw_input_contents for 0 inputs" in grpc_refused(lambda: stub.ModelInfer(both), "INVALID_ARGUMENT",
                                                                "bad_input")
    short = infer("slow", ("x", "FP32", [4], {"fp32_contents": [0.0, 1.0]}))
    assert "2 elements" in grpc_refused(lambda: stub.ModelInfer(short), "INVALID_ARGUMENT", "bad_input")
    typed = stub.ModelInfer(infer("slow", ("x", "FP32", [4], {"fp32_contents": (x / 10).tolist()})))
    assert np.frombuffer(typed.raw_output_contents[0], np.float32).tolist() == pytest.approx((x / 5).tolist())


# -- limits, unknown models, what is not served ---------------------------------------------------------

def test_a_message_over_the_limit_is_resource_exhausted_and_the_server_goes_on(srv, stub):
    big = bytes(MAX_MESSAGE + 1024)
    grpc_refused(lambda: stub.ModelInfer(infer("identity", ("x", "UINT8", [len(big)]), raw=[big])),
                 "RESOURCE_EXHAUSTED")
    fits = bytes(range(256)) * 4096  # 1 MiB
    assert stub.ModelInfer(infer("identity", ("x", "UINT8", [len(fits)]), raw=[fits])).raw_output_contents == [fits]
    over_arena = bytes(MAX_REQUEST_BYTES)  # a message that fits, a request that does not (inputs + outputs)
    details = grpc_refused(lambda: stub.ModelInfer(infer("identity", ("x", "UINT8", [len(over_arena)]),
                                                         raw=[over_arena])), "RESOURCE_EXHAUSTED", "too_large")
    assert "max_request_bytes" in details, details


def test_unknown_models_and_versions(stub):
    x = [b"\x01"]
    for name, version in (("no_such_model", ""), ("identity", "9"), ("identity", "x"), ("identity", "-1"), ("identity", "²")):  # "²".isdigit() is true
        msg = infer(name, ("x", "UINT8", [1]), raw=x)
        msg.model_version = version
        status = "INVALID_ARGUMENT" if name == "no_such_model" else "NOT_FOUND"  # Triton's statuses
        grpc_refused(lambda: stub.ModelInfer(msg), status, "unknown_model")
        grpc_refused(lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name=name, version=version)), status,
                     "unknown_model")
        assert stub.ModelReady(pb.ModelReadyRequest(name=name, version=version)).ready is False
    assert stub.ModelReady(pb.ModelReadyRequest(name="identity")).ready is True
    assert stub.ModelReady(pb.ModelReadyRequest(name="")).ready is False
    grpc_refused(lambda: stub.ModelInfer(infer("", ("x", "UINT8", [1]), raw=x)), "INVALID_ARGUMENT", "bad_frame")
    grpc_refused(lambda: stub.ModelConfig(pb.ModelConfigRequest(name="no_such_model")), "INVALID_ARGUMENT",
                 "unknown_model")
    grpc_refused(lambda: stub.ModelStatistics(pb.ModelStatisticsRequest(name="no_such_model")), "INVALID_ARGUMENT",
                 "unknown_model")


def test_what_is_not_served_is_unimplemented(stub):
    details = grpc_refused(lambda: list(stub.ModelStreamInfer(iter([infer("identity", ("x", "UINT8", [1]),
                                                                          raw=[b"\x01"])]))), "UNIMPLEMENTED")
    assert "ModelInfer" in details
    grpc_refused(lambda: stub.TraceSetting(pb.TraceSettingRequest()), "UNIMPLEMENTED")
    grpc_refused(lambda: stub.LogSettings(pb.LogSettingsRequest()), "UNIMPLEMENTED")
    details = grpc_refused(lambda: stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(
        name="c", raw_handle=b"\0" * 64, device_id=0, byte_size=64)), "INVALID_ARGUMENT", "bad_region")
    assert "not supported" in details
    stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest())


# -- the same request rules as HTTP ------------------------------------------------------------------------

X4 = ("x", "UINT8", [4])


@pytest.mark.parametrize("msg, status, code, words", [
    (infer("identity", ("x", "FP32", [1]), raw=[bytes(4)]), "INVALID_ARGUMENT", "bad_dtype", []),
    (infer("identity", ("x", "FP8", [1]), raw=[bytes(1)]), "INVALID_ARGUMENT", "bad_dtype", ["FP8"]),
    (infer("identity", ("x", "", [1]), raw=[bytes(1)]), "INVALID_ARGUMENT", "bad_dtype", []),
    (infer("identity", ("x", "UINT8", [2, 2]), raw=[bytes(4)]), "INVALID_ARGUMENT", "bad_shape", []),
    (infer("identity", ("x", "UINT8", [-4]), raw=[bytes(4)]), "INVALID_ARGUMENT", "bad_shape", []),
    (infer("identity", ("x", "UINT8", [2**62, 4]), raw=[bytes(4)]), "INVALID_ARGUMENT", "bad_shape", []),
    (infer("identity", ("x", "UINT8", [1] * 9), raw=[bytes(1)]), "INVALID_ARGUMENT", "bad_shape", []),
    (infer("identity", ("", "UINT8", [4]), raw=[bytes(4)]), "INVALID_ARGUMENT", "bad_input", ["'name'"]),
    (infer("identity", ("w", "UINT8", [4]), raw=[bytes(4)]), "INVALID_ARGUMENT", "bad_input", []),
    (infer("identity", X4, X4, raw=[bytes(4)] * 2), "INVALID_ARGUMENT", "bad_input", ["appears twice"]),
    (infer("identity", X4, raw=[bytes(4)], outputs=["y", "y"]), "INVALID_ARGUMENT", "bad_input", ["output 'y' already exists in request"]),
    (infer("identity", X4, raw=[bytes(4)], outputs=["z"]), "INVALID_ARGUMENT", "bad_input", ["unexpected inference output 'z' for model 'identity'"]),
    (infer("identity", X4, raw=[bytes(4)], sequence_id=5), "INVALID_ARGUMENT", "bad_input", ["sequence_id"]),
    (infer("identity", X4, raw=[bytes(4)], sequence_id="corr"), "INVALID_ARGUMENT", "bad_input", ["sequence_id"]),
    (infer("identity", X4, raw=[bytes(4)], sequence_start=True), "INVALID_ARGUMENT", "bad_input", []),
    (infer("identity", X4, raw=[bytes(4)], priority=-3), "INVALID_ARGUMENT", "bad_input", ["'priority'"]),
    (infer("identity", X4, raw=[bytes(4)], priority=1.5), "INVALID_ARGUMENT", "bad_input", ["'priority'"]),
    (infer("identity", X4, raw=[bytes(4)], priority="1"), "INVALID_ARGUMENT", "bad_input", ["'priority'"]),
    (infer("identity", X4, raw=[bytes(4)], timeout=-5), "INVALID_ARGUMENT", "bad_input", ["'timeout'"]),
    (infer("identity", X4, raw=[bytes(4)], timeout=10**12), "INVALID_ARGUMENT", "bad_input", ["'timeout'"]),
    (infer("identity", X4, raw=[bytes(4)], timeout=1.5), "INVALID_ARGUMENT", "bad_input", ["'timeout'"]),
    (infer("identity", X4, raw=[bytes(4)], colour="red"), "INVALID_ARGUMENT", "bad_input", ["unknown parameter"]),
    (infer("identity", X4, raw=[bytes(4)], binary_data_output="yes"), "INVALID_ARGUMENT", "bad_input", []),
    (infer("identity", X4, raw=[bytes(4)], routing_key=""), "INVALID_ARGUMENT", "bad_input", []),
    (infer("identity", *[(f"x{i}", "UINT8", [1]) for i in range(17)], raw=[b"\0"] * 17), "INVALID_ARGUMENT",
     "bad_input", ["at most 16"]),
    (infer("identity"), "INVALID_ARGUMENT", "bad_input", ["'inputs'"]),
])
def test_the_request_rules_are_the_same_as_over_http(stub, msg, status, code, words):
    details = grpc_refused(lambda: stub.ModelInfer(msg), status, code)
    assert all(w in details for w in words), details


def test_input_and_output_parameters_are_checked(stub):
    msg = infer("identity", X4, raw=[bytes(4)])
    msg.inputs[0].parameters["scale"].int64_param = 2
    assert "unknown parameter 'scale'" in grpc_refused(lambda: stub.ModelInfer(msg), "INVALID_ARGUMENT", "bad_input")
    msg = infer("identity", X4, raw=[bytes(4)], outputs=["y"])
    msg.outputs[0].parameters["classification"].int64_param = -2
    assert "classification" in grpc_refused(lambda: stub.ModelInfer(msg), "INVALID_ARGUMENT", "bad_input")
    msg = infer("identity", X4, raw=[bytes(4)])
    msg.inputs[0].parameters["shared_memory_byte_size"].int64_param = 4
    grpc_refused(lambda: stub.ModelInfer(msg), "INVALID_ARGUMENT", "bad_region")
    msg = infer("identity", X4, raw=[bytes(4)], timeout=2_000_000, routing_key="k", binary_data_output=True)
    msg.id = "req-9"
    reply = stub.ModelInfer(msg)
    assert reply.id == "req-9" and reply.model_version == "1" and reply.raw_output_contents == [bytes(4)]


def test_requested_outputs_come_back_by_position(stub):
    x = np.arange(5, dtype=np.float32)
    for names in (["z"], ["z", "y"], ["y"]):
        reply = stub.ModelInfer(infer("two_outputs", ("x", "FP32", [5]), raw=[x.tobytes()], outputs=names))
        assert [o.name for o in reply.outputs] == names
        for name, data in zip(names, reply.raw_output_contents):
            assert np.array_equal(np.frombuffer(data, np.float32), x if name == "y" else x * 2)


# -- callers that give up --------------------------------------------------------------------------------

def test_a_caller_that_cancels_or_times_out_mid_request_leaks_nothing(srv, stub):
    slow = infer("slow", ("x", "FP32", [1]), raw=[np.array([0.5], np.float32).tobytes()])
    future = stub.ModelInfer.future(slow)
    wait_for(lambda: srv.info()["stats"]["slots_in_use"] == 1, "the request to run")
    assert future.cancel()
    grpc_refused(lambda: stub.ModelInfer(slow, timeout=0.1), "DEADLINE_EXCEEDED")
    srv.wait_idle()
    with grpc_stub(srv.grpc) as other:  # a whole channel gone mid-request
        pending = other.ModelInfer.future(slow)  # noqa: F841  (kept: a call that is collected is cancelled)
        wait_for(lambda: srv.info()["stats"]["slots_in_use"] >= 1, "the request to run")
    srv.wait_idle()
    start = time.monotonic()
    assert stub.ModelInfer(slow).raw_output_contents == [np.array([1.0], np.float32).tobytes()]
    assert time.monotonic() - start >= 0.5
