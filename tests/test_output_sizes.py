"""Outputs of any size, without configuration (issue 26, part 1; ``shmserve.reservations``).

Through a real server, real workers and real clients — ``Client.infer`` through its lane and
over the socket, ``zero_copy`` through a lane and over the socket, and Triton's HTTP client on
the v2 door: an exported ONNX model whose output dimensions no input names (so its outputs'
sizes are a guess) answers a 1.2 MB output; a data-dependent model whose output grows call by
call answers every call; an output larger than the server can deliver fails naming the limit
and its fix; and a second call of a shape runs the model once (a stateful model's own count
shows it).  The reservation logic itself is tested in-process at the end.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shmserve import AsyncClient, Client, ErrorCode, ShmserveError, reservations
from shmserve.spec import ModelSpec, TensorSpec

from helpers.server import wait_for
from helpers.v2_server import authed, python_model, v2_serving

tritonhttp = pytest.importorskip("tritonclient.http")
tritongrpc = pytest.importorskip("tritonclient.grpc")
onnx = pytest.importorskip("onnx")

MAX_REQUEST = 24 << 20  # max_request_bytes of this server: inputs plus outputs of one request
BIG = (1, 1, 640, 480)  # a text detector's map at 640x480: 1.2 MB of float32, more than the 1 MiB guess


def relu_onnx(path) -> str:
    """An ONNX Relu whose dimensions are all dynamic, named per tensor as exporters name them
    (torch's ``x_dynamic_axes_*``, tf2onnx's ``unk__*``): no output dimension is named by an input."""
    from onnx import TensorProto, helper

    dims = lambda prefix: [f"{prefix}_{i}" for i in range(4)]  # noqa: E731
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims("x_dynamic_axes"))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims("unk_"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("outputs")
    models = (f'[[models]]\nname = "relu"\nbackend = "onnxruntime"\npath = "{relu_onnx(workdir / "relu.onnx")}"\n\n'
              + python_model("counted", "serving_models:counted")
              + python_model("stateful", "serving_models:counted_stateful")
              + python_model("stateful_v2", "serving_models:counted_stateful"))
    with v2_serving(workdir, models=models, deadlines=60, extra=f"max_request_bytes = {MAX_REQUEST}\n") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    client = authed(tritonhttp.InferenceServerClient(server.http), "client")
    yield client
    client.close()


def v2_infer(http, model: str, name: str, value: np.ndarray, datatype: str, output: str) -> np.ndarray:
    given = tritonhttp.InferInput(name, list(value.shape), datatype)
    given.set_data_from_numpy(value, binary_data=True)
    answer = http.infer(model, [given], outputs=[tritonhttp.InferRequestedOutput(output, binary_data=True)])
    return answer.as_numpy(output)


def zero_copy(c: Client, model: str, name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """One zero-copy call of ``value`` (copies of its outputs, its space released)."""
    with c.zero_copy(model, {name: (value.shape, value.dtype)}) as call:
        call.inputs[name][...] = value
        return {k: v.copy() for k, v in call.run().items()}


def short_answers(server, model: str) -> int:
    return sum((w.get("signatures") or {}).get("short", 0) for w in server.info()["workers"] if w["model"] == model)


def worker_counts(server, model: str) -> tuple[int, int]:
    """(requests, errors) the model's workers counted."""
    workers = [w for w in server.info()["workers"] if w["model"] == model]
    return sum(w["requests"] for w in workers), sum(w["errors"] for w in workers)


# -- through the real server --------------------------------------------------------------------

def test_an_exported_onnx_models_1_2_mb_output_answers_on_every_path(server, http):
    """The guess is 1 MiB per output no input sizes; the 1.2 MB map is run again with its own
    size on the first call of its shape, on every path (the native client's lane and socket,
    zero-copy both ways, Triton's HTTP and gRPC clients), and answers correctly."""
    x = np.random.default_rng(0).standard_normal(BIG).astype(np.float32)
    want = np.maximum(x, 0)
    with server.client() as c, server.client(lanes=False) as s:
        np.testing.assert_array_equal(c.infer("relu", {"x": x})["y"], want)  # through a lane
        np.testing.assert_array_equal(s.infer("relu", {"x": x})["y"], want)  # over the socket
        np.testing.assert_array_equal(zero_copy(c, "relu", "x", x)["y"], want)
        np.testing.assert_array_equal(zero_copy(s, "relu", "x", x)["y"], want)
    np.testing.assert_array_equal(v2_infer(http, "relu", "x", x, "FP32", "y"), want)
    grpc = authed(tritongrpc.InferenceServerClient(server.grpc), "client")
    try:  # (its messages hold 2 x max_request_bytes + 1 MiB)
        given = tritongrpc.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        np.testing.assert_array_equal(grpc.infer("relu", [given]).as_numpy("y"), want)
    finally:
        grpc.close()
    assert short_answers(server, "relu") >= 1
    server.wait_idle()


def test_data_dependent_outputs_larger_than_any_before_answer_on_every_path(server, http):
    """``counted`` returns n[0] floats: each call's output is larger than every earlier one (past
    the server's 1 MiB guess and the 16 MiB extent a request of it gets, and past the client's
    16 MiB zero-copy guess), on every path."""
    with server.client() as c, server.client(lanes=False) as s:
        for n in (10, 300_000, 400_000):
            np.testing.assert_array_equal(c.infer("counted", {"n": np.array([n])})["y"], np.arange(n, dtype=np.float32))
        for n in (4_300_000, 4_400_000):  # 17.2 MB: more than the arena's 16 MiB class the guess fits in
            np.testing.assert_array_equal(s.infer("counted", {"n": np.array([n])})["y"], np.arange(n, dtype=np.float32))
        for n in (4_450_000, 4_500_000):
            got = v2_infer(http, "counted", "n", np.array([n]), "INT64", "y")
            np.testing.assert_array_equal(got, np.arange(n, dtype=np.float32))
        for client, n in ((c, 4_550_000), (s, 4_600_000)):  # 18 MB: more than a zero-copy call's 16 MiB guess
            np.testing.assert_array_equal(zero_copy(client, "counted", "n", np.array([n]))["y"],
                                          np.arange(n, dtype=np.float32))
        # One zero-copy call run again and again keeps the area it grew to.
        with c.zero_copy("counted", {"n": ((1,), np.int64)}) as call:
            for n in (5, 4_700_000, 4_700_000, 3):
                call.inputs["n"][0] = n
                np.testing.assert_array_equal(call.run()["y"], np.arange(n, dtype=np.float32))
            assert call.out_capacity >= 4 * 4_700_000
    server.wait_idle()


@pytest.mark.parametrize("lanes", [True, False])
def test_async_clients_get_the_same_outputs_of_any_size(server, lanes):
    """``AsyncClient``'s faces (its own ``zero_copy`` call object) take the same steps."""
    x = np.random.default_rng(1).standard_normal((1, 1, 640, 484)).astype(np.float32)

    async def calls():
        async with AsyncClient(server.socket, timeout=30, lanes=lanes) as c:
            y = (await c.infer("relu", {"x": x}))["y"]
            n = 4_800_000 + lanes  # 19.2 MB: more than the zero-copy call's 16 MiB guess
            async with await c.zero_copy("counted", {"n": ((1,), np.int64)}) as call:
                call.inputs["n"][0] = n
                counted = (await call.run())["y"].copy()
            return y, n, counted

    y, n, counted = asyncio.run(calls())
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    np.testing.assert_array_equal(counted, np.arange(n, dtype=np.float32))


@pytest.mark.parametrize("lanes", [True, False])
def test_an_output_larger_than_the_server_delivers_fails_naming_the_limit(server, http, lanes):
    n = (MAX_REQUEST + (2 << 20)) // 4  # more floats than max_request_bytes, or a region (1 MiB more), holds
    with server.client(lanes=lanes) as c:
        with pytest.raises(ShmserveError) as info:
            c.infer("counted", {"n": np.array([n])})
        assert info.value.code is ErrorCode.OUTPUT_TOO_LARGE
        assert "max_request_bytes" in info.value.message and "raise" in info.value.message, info.value.message
        with pytest.raises(ShmserveError) as info:
            zero_copy(c, "counted", "n", np.array([n]))
        assert info.value.code in (ErrorCode.OUTPUT_TOO_LARGE, ErrorCode.TOO_LARGE)
        assert "output_capacity" in info.value.message or "max_request_bytes" in info.value.message
        np.testing.assert_array_equal(c.infer("counted", {"n": np.array([7])})["y"], np.arange(7, dtype=np.float32))
    with pytest.raises(Exception, match="max_request_bytes"):
        v2_infer(http, "counted", "n", np.array([n]), "INT64", "y")
    server.wait_idle()


def test_a_second_call_of_a_shape_runs_the_model_once_on_every_path(server, http):
    """``stateful`` counts its runs in its answer: the first call whose output outgrows what is
    reserved runs twice (the documented cost of a guess), the next call of its size once."""
    def through_lane(n):
        with server.client() as c:
            return c.infer("stateful", {"n": np.array([n])})

    def over_socket(n):
        with server.client(lanes=False) as s:
            return s.infer("stateful", {"n": np.array([n])})

    def over_http(n):  # (a model of its own: the socket's calls taught "stateful" what they need)
        return {"calls": v2_infer(http, "stateful_v2", "n", np.array([n]), "INT64", "calls")}

    short_before, (requests_before, errors_before) = short_answers(server, "stateful"), worker_counts(server, "stateful")
    with server.client() as c:  # one client: its lane learns what the first call needed
        small = int(c.infer("stateful", {"n": np.array([1])})["calls"][0])
        first = c.infer("stateful", {"n": np.array([300_000])})
        second = c.infer("stateful", {"n": np.array([300_000])})
    np.testing.assert_array_equal(second["y"], np.arange(300_000, dtype=np.float32))
    assert (int(first["calls"][0]), int(second["calls"][0])) == (small + 2, small + 3)
    wait_for(lambda: short_answers(server, "stateful") == short_before + 1, "the worker to count its short answer")
    # three calls answered, no error: the short run is counted as neither (metrics read these counters)
    assert worker_counts(server, "stateful") == (requests_before + 3, errors_before)
    for call, n in ((over_socket, 4_300_000), (over_http, 4_300_000)):  # the server learns, for every client
        before = int(call(1)["calls"][0])
        assert [int(call(n)["calls"][0]) for _ in range(3)] == [before + 2, before + 3, before + 4], call.__name__
    with server.client() as c:  # one client: it learns what its zero-copy calls of these inputs need
        before = int(zero_copy(c, "stateful", "n", np.array([1]))["calls"][0])
        runs = [int(zero_copy(c, "stateful", "n", np.array([4_500_000]))["calls"][0]) for _ in range(2)]
        assert runs == [before + 2, before + 3]  # 18 MB: more than a zero-copy call's 16 MiB guess, once
    assert int(through_lane(2)["calls"][0]) == before + 4
    server.wait_idle()


# -- the reservation logic, in-process ----------------------------------------------------------

def _spec(*outputs: TensorSpec) -> ModelSpec:
    return ModelSpec("m", "python", (TensorSpec("x", "float32", ("n", 4)),), outputs)


def test_a_reservation_is_exact_where_the_inputs_fix_every_output_and_a_guess_elsewhere():
    exact = _spec(TensorSpec("a", "float32", ("n", 4)), TensorSpec("b", "uint8", (3,)))
    assert reservations.reserve(exact, {"n": 5}) == (128 + 3, True)  # each output on a cache line
    assert reservations.reserve(exact, {"n": 5}, learned=1 << 30) == (131, True)  # nothing learned is needed
    guessed = _spec(TensorSpec("a", "float32", ("count",)), TensorSpec("b", "uint8", (3,)))
    assert reservations.reserve(guessed, {"n": 5}) == (reservations.GUESS_BYTES + 3, False)
    assert reservations.reserve(guessed, {"n": 5}, limit=100) == (128 + 3, False)  # the limit caps the guess
    assert reservations.reserve(guessed, {"n": 5}, learned=5 << 20) == (5 << 20, False)


def test_a_short_answer_says_what_it_needed_and_nothing_else_reads_as_one():
    message = reservations.short_message(1228864, 1048640)
    assert reservations.needed(ErrorCode.OUTPUT_TOO_LARGE, message) == 1228864
    assert reservations.needed(ErrorCode.MODEL_ERROR, message) is None  # only the worker's code carries it
    for other in ("", "outputs need", "outputs need  bytes", "outputs need -5 bytes", "outputs need 1e9 bytes",
                  "outputs need 9999999999999999999 bytes", "output 'y' is 5 bytes, more than max_output_bytes"):
        assert reservations.needed(ErrorCode.OUTPUT_TOO_LARGE, other) is None, other


def test_what_a_version_learned_only_grows_and_is_bounded():
    learned = reservations.Learned(limit=3)
    assert learned.get("a") == 0
    assert learned.learn("a", 100) == 100
    assert learned.learn("a", 50) == 100  # data-dependent outputs: the most seen
    assert learned.learn("a", 200) == 200
    learned.learn("b", 1), learned.learn("c", 1)
    assert len(learned) == 3
    learned.learn("d", 7)  # past the bound: everything forgotten at once, then d
    assert (len(learned), learned.get("a"), learned.get("d")) == (1, 0, 7)
