"""Every datatype end to end through a real server: bfloat16 and bytes beside the fixed-size ones.

A python model per dtype (``shmserve.models:typed_identity``) answers its input bit for bit through
``Client.infer``, ``AsyncClient`` and zero-copy calls (fixed-size dtypes; bytes are refused there
with the fix named); bytes tensors that a hostile client serialized wrongly fail alone with stable
codes; ONNX Runtime serves string and bfloat16 tensors.
"""

from __future__ import annotations

import asyncio
import struct
import time

import numpy as np
import pytest

from shmserve import AsyncClient, BadArgument, ErrorCode, ShmserveError, hotpath, inspection, lanes, layout, protocol
from shmserve.protocol import Kind

from helpers.raw_frames import connect, read_frames
from helpers.server import concurrent_infer, serving

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

DTYPES = protocol.SUPPORTED_DTYPES
FIXED = [d for d in DTYPES if d != "bytes"]
U32 = struct.Struct("<I")


def _python(name: str, path: str, extra: str = "") -> str:
    return f'\n[[models]]\nname = "{name}"\nbackend = "python"\npath = "{path}"\n{extra}\n'


def _onnx_models(directory):
    """``upper``: a string vector upper-cased (StringNormalizer; the C locale, which every host has),
    ``bf16``: a bfloat16 vector as it is and as float32."""
    def save(name, nodes, inputs, outputs):
        model = helper.make_model(helper.make_graph(nodes, name, inputs, outputs),
                                  opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        onnx.checker.check_model(model)
        onnx.save(model, str(directory / f"{name}.onnx"))
        return directory / f"{name}.onnx"

    vector = helper.make_tensor_value_info
    upper = save("upper", [helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action="UPPER",
                                            locale="C")],
                 [vector("x", TensorProto.STRING, ["n"])], [vector("y", TensorProto.STRING, ["n"])])
    bf16 = save("bf16", [helper.make_node("Identity", ["x"], ["y"]),
                         helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT)],
                [vector("x", TensorProto.BFLOAT16, ["n"])],
                [vector("y", TensorProto.BFLOAT16, ["n"]), vector("f", TensorProto.FLOAT, ["n"])])
    return upper, bf16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("dtypes")
    upper, bf16 = _onnx_models(workdir)
    config = "".join(_python(f"id_{d}", "shmserve.models:typed_identity",
                             f'[models.options]\nfactory = true\ndtype = "{d}"') for d in DTYPES)
    config += "".join(_python(f"batched_{d}", "shmserve.models:typed_identity",
                              f'max_batch_size = 8\nmax_queue_delay_us = 200000\n'
                              f'[models.options]\nfactory = true\ndtype = "{d}"') for d in ("bfloat16", "bytes"))
    config += (_python("reverse", "shmserve.models:bytes_reverse")
               + _python("ints_as_bytes", "serving_models:bytes_of_ints")
               + _python("bytes_grow", "serving_models:bytes_grow", "max_output_bytes = 4096")
               + _python("digits", "serving_models:digits")
               + f'\n[[models]]\nname = "upper"\nbackend = "onnxruntime"\npath = "{upper}"\n'
               + f'\n[[models]]\nname = "bf16"\nbackend = "onnxruntime"\npath = "{bf16}"\n')
    with serving(workdir, config, server_section="request_timeout_s = 20") as srv:
        yield srv


def sample(dtype: str, n: int, seed: int = 0) -> np.ndarray:
    """``n`` elements of ``dtype``: random bits for numbers (NaNs, infinities and subnormals among
    them), random bools, bytes elements of 0-8 random bytes (empty ones among them)."""
    rng = np.random.default_rng(seed)
    if dtype == "bytes":
        return np.fromiter((rng.bytes(int(k)) for k in rng.integers(0, 9, n)), dtype=object, count=n)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    dt = layout.numpy_dtype(dtype)
    return np.frombuffer(rng.bytes(n * dt.itemsize), dt).copy()


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit: dtype, shape and every element (bytes elements as bytes)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == object:
        assert all(type(e) is bytes for e in got.flat)
        assert got.tolist() == want.tolist()
    else:
        assert got.tobytes() == want.tobytes()


# -- every dtype, every client --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_comes_back_bit_for_bit_through_infer(server, dtype):
    with server.client() as c:
        for n in (0, 1, 7, 1000):
            x = sample(dtype, n, seed=n)
            assert_same(c.infer(f"id_{dtype}", {"x": x})["y"], x)


def test_every_dtype_at_once_through_the_async_client(server):
    async def main():
        async with AsyncClient(server.socket, timeout=30) as c:
            inputs = {d: sample(d, 333, seed=i) for i, d in enumerate(DTYPES)}
            answers = await asyncio.gather(*(c.infer(f"id_{d}", {"x": x}) for d, x in inputs.items()))
            for (d, x), out in zip(inputs.items(), answers):
                assert_same(out["y"], x)

    asyncio.run(main())


@pytest.mark.parametrize("dtype", ["bfloat16", "bytes"])
def test_batches_of_the_new_dtypes_give_each_request_its_own_rows(server, dtype):
    inputs = [sample(dtype, 1 + i % 4, seed=20 + i) for i in range(6)]
    for x, y in zip(inputs, concurrent_infer(server, f"batched_{dtype}", "x", "y", inputs)):
        assert_same(y, x)
    runs = inspection.snapshot(server.instance)["latency_us"][f"batched_{dtype}"]["batch_size"]["count"]
    assert runs < len(inputs)  # at least two requests shared a run


@pytest.mark.parametrize("lanes", [True, False], ids=["lane", "region"])
def test_fixed_size_dtypes_through_zero_copy(server, lanes):
    with server.client() as c:
        c.lanes = lanes
        for dtype in FIXED:
            x = sample(dtype, 100, seed=3)
            with c.zero_copy(f"id_{dtype}", {"x": (x.shape, x.dtype)}) as call:
                call.inputs["x"][...] = x
                assert_same(np.array(call.run()["y"]), x)


def test_async_zero_copy_of_bfloat16(server):
    async def main():
        async with AsyncClient(server.socket, timeout=30) as c:
            x = sample("bfloat16", 64, seed=4)
            async with await c.zero_copy("id_bfloat16", {"x": (x.shape, x.dtype)}) as call:
                call.inputs["x"][...] = x
                assert_same(np.array((await call.run())["y"]), x)

    asyncio.run(main())


def test_zero_copy_refuses_bytes_tensors_and_names_the_fix(server):
    with server.client() as c:
        for dtype in (object, "bytes"):
            with pytest.raises(BadArgument) as info:
                c.zero_copy("id_bytes", {"x": ((3,), dtype)})
            assert info.value.code is ErrorCode.BAD_DTYPE and "infer()" in info.value.message
        with pytest.raises(BadArgument) as info:  # a fixed-size input, a bytes output
            c.zero_copy("digits", {"x": ((3,), np.int64)})
        assert info.value.code is ErrorCode.BAD_DTYPE and "'y'" in info.value.message
        assert c.infer("digits", {"x": np.array([7, -12, 0])})["y"].tolist() == [b"7", b"-12", b"0"]


def test_the_listing_names_the_new_dtypes(server):
    with server.client() as c:
        models = {m["name"]: m for m in c.models()}
    assert models["id_bfloat16"]["inputs"] == [{"name": "x", "dtype": "bfloat16", "shape": ["n"]}]
    assert models["reverse"]["outputs"] == [{"name": "y", "dtype": "bytes", "shape": ["n"]}]
    assert [t["dtype"] for t in models["bf16"]["outputs"]] == ["bfloat16", "float32"]
    assert models["upper"]["inputs"][0]["dtype"] == "bytes"


# -- bytes: edges, hostile serializations, model errors -----------------------------------

def test_bytes_edges_empty_elements_no_elements_str_and_large_ones(server):
    with server.client() as c:
        for x in (np.array([b"", b"", b""], dtype=object), np.empty(0, dtype=object),
                  np.array([b"\x00" * 5, b"\xff", bytes(range(256))], dtype=object),
                  np.array([b"z" * (1 << 20), b"a"], dtype=object)):
            assert_same(c.infer("id_bytes", {"x": x})["y"], x)
            assert c.infer("reverse", {"x": x})["y"].tolist() == [e[::-1] for e in x]
        out = c.infer("id_bytes", {"x": np.array(["é", b"b"], dtype=object)})["y"]  # str goes as its UTF-8
        assert out.tolist() == ["é".encode(), b"b"]
        with pytest.raises(BadArgument) as info:
            c.infer("id_bytes", {"x": np.array([b"a", 3], dtype=object)})
        assert info.value.code is ErrorCode.BAD_DTYPE and "element 1" in info.value.message
        with pytest.raises(BadArgument) as info:  # numpy's fixed-width bytes are not a bytes tensor
            c.infer("id_bytes", {"x": np.array([b"a", b"bc"])})
        assert info.value.code is ErrorCode.BAD_DTYPE and "object array" in info.value.message


def _send_bytes(server, shape, data: bytes, nbytes=None, dtype="bytes", model="id_bytes"):
    """One raw INFER of a bytes tensor whose descriptor says ``nbytes`` (default: len(data)); the
    answer frame."""
    item = {"name": "x", "dtype": dtype, "shape": list(shape), "nbytes": len(data) if nbytes is None else nbytes}
    if nbytes == "leave out":
        del item["nbytes"]
    with connect(server.socket) as s:
        s.sendall(protocol.encode_frame(Kind.INFER, {"id": 9, "model": model, "inputs": [item]}, len(data)) + data)
        (answer,) = read_frames(s, 1)
    return answer


@pytest.mark.parametrize("shape,data,nbytes,code", [
    ([2], U32.pack(3) + b"abc" + U32.pack(10) + b"xy", None, ErrorCode.BAD_INPUT),  # a length past the end
    ([1], U32.pack(1) + b"a" + b"zz", None, ErrorCode.BAD_INPUT),  # trailing garbage
    ([2], U32.pack(1) + b"a" + b"\x01\x00\x00", None, ErrorCode.BAD_INPUT),  # a length cut short
    ([1], U32.pack(0xFFFFFFFF) + b"abcd", None, ErrorCode.BAD_INPUT),  # a huge length: no wrap-around
    ([2], U32.pack(0xFFFFFFFC) + U32.pack(0) + b"\0" * 4, None, ErrorCode.BAD_INPUT),  # pos + length wraps at 2**32
    ([3], bytes(8), None, ErrorCode.BAD_INPUT),  # fewer bytes than three lengths
    ([1], U32.pack(1) + b"a", 4, ErrorCode.BAD_FRAME),  # the descriptor says less than the payload has
    ([1], U32.pack(1) + b"a", "leave out", ErrorCode.BAD_FRAME),
    ([1], U32.pack(1) + b"a", -1, ErrorCode.BAD_FRAME),
    ([1], U32.pack(1) + b"a", 2**41, ErrorCode.BAD_FRAME),
])
def test_hostile_bytes_fail_alone_with_stable_codes(server, shape, data, nbytes, code):
    answer = _send_bytes(server, shape, data, nbytes)
    assert answer.kind is Kind.ERROR and answer.meta["code"] == code.wire, answer.meta
    with server.client() as c:
        assert_same(c.infer("id_bytes", {"x": sample("bytes", 5)})["y"], sample("bytes", 5))
    server.wait_idle()


def test_nbytes_on_a_fixed_size_tensor_is_refused(server):
    answer = _send_bytes(server, [4], bytes(4), dtype="uint8", model="id_uint8")
    assert answer.kind is Kind.ERROR and answer.meta["code"] == "bad_frame"
    assert "bytes tensors only" in answer.meta["message"]


def test_a_well_formed_bytes_request_on_the_wire(server):
    data = layout.encode_bytes([b"ab", b"", b"xyz"])
    answer = _send_bytes(server, [3], data, model="reverse")
    assert answer.kind is Kind.RESULT
    assert answer.meta["outputs"] == [{"name": "y", "dtype": "bytes", "shape": [3], "nbytes": len(data)}]


def test_a_model_returning_other_elements_or_too_much_fails_alone(server):
    with server.client() as c:
        with pytest.raises(ShmserveError) as info:
            c.infer("ints_as_bytes", {"x": sample("bytes", 3)})
        assert info.value.code is ErrorCode.MODEL_ERROR and "int" in info.value.message
        with pytest.raises(ShmserveError) as info:
            c.infer("bytes_grow", {"x": np.array([b"x" * 100], dtype=object)})  # 100 kB: more than its extent
        assert info.value.code is ErrorCode.OUTPUT_TOO_LARGE
        assert c.infer("bytes_grow", {"x": np.array([b"a"], dtype=object)})["y"].tolist() == [b"x" * 1000]
    server.wait_idle()


# -- ONNX Runtime: string and bfloat16 tensors ----------------------------------------------

def test_onnxruntime_string_tensors_are_bytes_as_utf8(server):
    x = np.array([b"abc", "grüße".encode(), b"", b"MiXeD 42"], dtype=object)
    with server.client() as c:
        assert c.infer("upper", {"x": x})["y"].tolist() == [b"ABC", "GRüßE".encode(), b"", b"MIXED 42"]
        with pytest.raises(ShmserveError) as info:
            c.infer("upper", {"x": np.array([b"ok", b"\xff\xfe"], dtype=object)})
        assert info.value.code is ErrorCode.BAD_INPUT and "UTF-8" in info.value.message
        assert c.infer("upper", {"x": np.array([b"still"], dtype=object)})["y"].tolist() == [b"STILL"]


def test_onnxruntime_bfloat16_in_and_out(server):
    x = sample("bfloat16", 500, seed=9)
    with server.client() as c:
        out = c.infer("bf16", {"x": x})
        assert_same(out["y"], x)
        np.testing.assert_array_equal(out["f"], x.astype(np.float32))  # every bfloat16 is a float32
        with c.zero_copy("bf16", {"x": (x.shape, x.dtype)}) as call:
            call.inputs["x"][...] = x
            assert_same(np.array(call.run()["y"]), x)


def test_a_lane_client_writing_bytes_tensors_is_checked_like_any_other(server, monkeypatch):
    """Our clients send no bytes tensor through a lane, but a lane's client writes every byte of it:
    the worker unpacks a bytes descriptor there as anywhere (a bad one fails alone, bad_input), and
    a bytes output read from a lane is refused in the client (bad_dtype)."""
    def call(region, shape, data, nbytes=None):
        view = np.ndarray((max(len(data), 1),), np.uint8, buffer=region.buf, offset=lanes.DATA_FLOOR)
        view[:len(data)] = np.frombuffer(data, np.uint8)

        def as_bytes(buf, geometry, slot, tensor, *, role, name_index, offset, region, **_):
            """The descriptor a hostile lane client writes: a bytes tensor of ``shape`` and ``nbytes``."""
            size = len(data) if nbytes is None else nbytes
            layout.TENSOR.pack(buf, geometry.tensor_off(slot, tensor), layout.BYTES_CODE, len(shape), role,
                               name_index, region, offset, size, *shape, *[0] * (layout.MAX_DIMS - len(shape)))

        with monkeypatch.context() as patched:  # the reference submit writes through layout.encode_tensor
            patched.setattr(lanes, "_HOT", hotpath.PYTHON)
            patched.setattr(layout, "encode_tensor", as_bytes)
            index, generation = region.lane.submit(1, 0, [(0, lanes.DATA_FLOOR, view)], lanes.DATA_FLOOR + 4096,
                                                   4096)
        region.lane.wait(index, generation, time.monotonic() + 20, 0.0, lambda: None)
        with pytest.raises(ShmserveError) as info:
            region.lane.read(index, generation, lanes.DATA_FLOOR + 4096, 4096)
        return info.value

    with server.client() as c:
        region = c.open_region(1 << 20, lane="id_bytes")
        ran = call(region, [2], layout.encode_bytes([b"ab", b""]))
        assert ran.code is ErrorCode.BAD_DTYPE and "infer()" in ran.message  # it ran: its output is bytes
        for shape, data, nbytes, code in [
                ([2], U32.pack(3) + b"abc" + U32.pack(10) + b"xy", None, ErrorCode.BAD_INPUT),  # past the end
                ([1], U32.pack(1) + b"a" + b"zz", None, ErrorCode.BAD_INPUT),  # trailing garbage
                ([1], U32.pack(0xFFFFFFFF), None, ErrorCode.BAD_INPUT),  # a huge length
                ([3], bytes(8), None, ErrorCode.BAD_REGION),  # the descriptor itself: too small for 3 lengths
                ([1], U32.pack(1) + b"a", 2**40, ErrorCode.BAD_REGION)]:  # past the region
            failed = call(region, shape, data, nbytes)
            assert failed.code is code, (shape, data, failed)
        assert call(region, [0], b"").code is ErrorCode.BAD_DTYPE  # and the lane serves on
