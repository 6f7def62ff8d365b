"""The KServe v2 doors through Triton's own clients (``tritonclient.http``, ``tritonclient.grpc``,
``tritonclient.utils.shared_memory``) against a real server: health, metadata, configuration,
inference with every datatype in JSON and binary form, requested outputs, system shared memory,
repository load and unload, statistics; every answer equals the same request over the Unix socket."""

from __future__ import annotations

import http.client
import json
import os
import socket
import textwrap
import uuid

import numpy as np
import pytest

tritonhttp = pytest.importorskip("tritonclient.http")
tritongrpc = pytest.importorskip("tritonclient.grpc")
import ml_dtypes  # noqa: E402  (tritonclient's BF16 type)
import tritonclient.utils.shared_memory as triton_shm  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from helpers.server import serving, wait_for  # noqa: E402
from helpers.v2_server import authed, triton_client, write_tokens  # noqa: E402

# v2 datatype -> numpy dtype of the values a test sends
DATATYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
             "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
             "BF16": ml_dtypes.bfloat16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_}
NATIVE = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
          "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64", "FP16": "float16",
          "BF16": "bfloat16", "FP32": "float32", "FP64": "float64", "BYTES": "bytes"}
JSON_TYPES = [t for t in DATATYPES if t != "BF16"]  # tritonclient sends BF16 in binary form only


def typed_models() -> str:
    return "".join(textwrap.dedent(f"""
        [[models]]
        name = "id_{t.lower()}"
        backend = "python"
        path = "shmserve.models:typed_identity"
        options = {{factory = true, dtype = "{NATIVE[t]}"}}
        """) for t in DATATYPES) + textwrap.dedent("""
        [[models]]
        name = "reverse"
        backend = "python"
        path = "shmserve.models:bytes_reverse"
        """)


MODELS = typed_models() + textwrap.dedent("""
    [[models]]
    name = "identity"
    backend = "python"
    path = "shmserve.models:identity"
    instances = 2

    [[models]]
    name = "f32"
    backend = "python"
    path = "shmserve.models:identity_f32"
    max_batch_size = 8

    [[models]]
    name = "two_outputs"
    backend = "python"
    path = "serving_models:two_outputs"

    [[models]]
    name = "two_inputs"
    backend = "python"
    path = "serving_models:two_inputs"
    """)
# TCP callers are anonymous unless they present a token: these clients present the test tokens
# (helpers.v2_server), as a Triton user's would (a plugin, or headers=).
V2_SERVER = 'http = "127.0.0.1:0"\ngrpc = "127.0.0.1:0"\nv2_system_shared_memory = true\nv2_tokens = "tokens.toml"\n'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("v2")
    write_tokens(workdir)
    with serving(workdir, MODELS, server_section=V2_SERVER) as srv:
        v2 = srv.info()["v2"]
        srv.http, srv.grpc = v2["http"], v2["grpc"]
        yield srv


@pytest.fixture(scope="module")
def hc(server):
    with triton_client(tritonhttp, server.http, "client") as client:
        yield client


@pytest.fixture(scope="module")
def gc(server):
    with triton_client(tritongrpc, server.grpc, "client") as client:
        yield client


def sample(datatype: str, n: int = 7, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if datatype == "BOOL":
        return rng.integers(0, 2, n).astype(bool)
    if datatype == "BYTES":
        return np.array([bytes(rng.integers(0, 256, i, dtype=np.uint8)) if datatype else b"" for i in range(n)],
                        dtype=np.object_)
    dtype = np.dtype(DATATYPES[datatype])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    return (rng.standard_normal(n) * 100).astype(dtype)


def text_sample(n: int = 5) -> np.ndarray:
    """BYTES elements that are UTF-8 text (what JSON can carry)."""
    return np.array([f"é{i}-{'x' * i}".encode() for i in range(n)], dtype=np.object_)


def native_answer(server, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    with server.client() as c:
        return c.infer(model, inputs)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit (NaNs and signed zeros included); BYTES element by element."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == object or b.dtype == object:  # JSON gives BYTES back as text
        def raw(v):
            return v.encode() if isinstance(v, str) else bytes(v)
        return a.shape == b.shape and all(raw(x) == raw(y) for x, y in zip(a.ravel(), b.ravel()))
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# -- health and metadata ------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["http", "grpc"])
def test_health_and_server_metadata(which, hc, gc):
    client = hc if which == "http" else gc
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("identity") and client.is_model_ready("identity", "1")
    assert not client.is_model_ready("no_such_model")
    meta = client.get_server_metadata(as_json=True) if which == "grpc" else client.get_server_metadata()
    assert meta["name"] == "shmserve"
    assert {"binary_tensor_data", "system_shared_memory", "model_repository", "statistics"} <= set(meta["extensions"])


@pytest.mark.parametrize("which", ["http", "grpc"])
def test_model_metadata_and_config(which, hc, gc):
    client = hc if which == "http" else gc
    kw = {"as_json": True} if which == "grpc" else {}
    meta = client.get_model_metadata("f32", **kw)
    assert meta["name"] == "f32" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "-1"] if which == "grpc" else [-1, -1]}]
    assert client.get_model_metadata("f32", "1", **kw)["outputs"][0]["name"] == "y"
    config = client.get_model_config("f32", **kw)
    config = config.get("config", config)
    assert config["name"] == "f32" and int(config["max_batch_size"]) == 8
    assert config["input"][0]["dims"] in ([-1], ["-1"])  # the batch dimension left out, as Triton does
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'no_such_model' is not found"):
        client.get_model_metadata("no_such_model")
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'f32' version 7 is not found"):
        client.get_model_metadata("f32", "7")


# -- inference: every datatype ----------------------------------------------------------------------

@pytest.mark.parametrize("datatype", list(DATATYPES))
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_http_infer_every_datatype(server, hc, datatype, binary):
    if not binary and datatype not in JSON_TYPES:
        pytest.skip("tritonclient sends BF16 in binary form only")
    x = text_sample() if datatype == "BYTES" and not binary else sample(datatype)
    model = f"id_{datatype.lower()}"
    inp = tritonhttp.InferInput("x", list(x.shape), datatype)
    inp.set_data_from_numpy(x, binary_data=binary)
    out = tritonhttp.InferRequestedOutput("y", binary_data=binary)
    result = hc.infer(model, [inp], outputs=[out])
    got = result.as_numpy("y")
    assert same(got, x)
    assert result.get_output("y")["datatype"] == datatype
    assert same(got, native_answer(server, model, {"x": x})["y"])


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_grpc_infer_every_datatype(server, gc, datatype):
    x = sample(datatype, seed=1)
    model = f"id_{datatype.lower()}"
    inp = tritongrpc.InferInput("x", list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    result = gc.infer(model, [inp])
    assert same(result.as_numpy("y"), x)
    assert same(result.as_numpy("y"), native_answer(server, model, {"x": x})["y"])


def test_bytes_model_runs_and_empty_tensors(server, hc, gc):
    words = np.array([b"abc", b"", b"\x00\xff", "ünï".encode()], dtype=np.object_)
    want = np.array([w[::-1] for w in words], dtype=np.object_)
    for mod, client in ((tritonhttp, hc), (tritongrpc, gc)):
        inp = mod.InferInput("x", [4], "BYTES")
        inp.set_data_from_numpy(words)
        assert same(client.infer("reverse", [inp]).as_numpy("y"), want)
        empty = mod.InferInput("x", [0], "FP32")
        empty.set_data_from_numpy(np.zeros(0, np.float32))
        assert client.infer("id_fp32", [empty]).as_numpy("y").shape == (0,)


def test_a_rank_2_batch_and_json_data_back(hc, gc):
    x = np.arange(24, dtype=np.float32).reshape(3, 8) / 7
    for mod, client in ((tritonhttp, hc), (tritongrpc, gc)):
        inp = mod.InferInput("x", [3, 8], "FP32")
        inp.set_data_from_numpy(x)
        assert same(client.infer("f32", [inp]).as_numpy("y"), x)
    inp = tritonhttp.InferInput("x", [3, 8], "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    result = hc.infer("f32", [inp], outputs=[tritonhttp.InferRequestedOutput("y", binary_data=False)])
    data = result.get_output("y")["data"]  # flat, row-major, as KServe says
    assert same(np.array(data, np.float32), x.ravel())


def test_large_tensors_stream_into_the_arena(server, hc, gc, regions):
    """8 MiB each way: over HTTP the body arrives after its JSON header and is received straight
    into arena space; through system shared memory the region copies run on a thread."""
    x = np.random.default_rng(5).integers(0, 256, 8 << 20, dtype=np.uint8)
    for mod, client in ((tritonhttp, hc), (tritongrpc, gc)):
        inp = mod.InferInput("x", [x.size], "UINT8")
        inp.set_data_from_numpy(x)
        assert same(client.infer("identity", [inp]).as_numpy("y"), x)
    key, handle = regions(x.nbytes)
    out_key, out_handle = regions(x.nbytes)
    triton_shm.set_shared_memory_region(handle, [x])
    hc.register_system_shared_memory("big_in", key, x.nbytes)
    hc.register_system_shared_memory("big_out", out_key, x.nbytes)
    try:
        inp = tritonhttp.InferInput("x", [x.size], "UINT8")
        inp.set_shared_memory("big_in", x.nbytes)
        out = tritonhttp.InferRequestedOutput("y")
        out.set_shared_memory("big_out", x.nbytes)
        hc.infer("identity", [inp], outputs=[out])
        assert same(triton_shm.get_contents_as_numpy(out_handle, np.uint8, [x.size]), x)
    finally:
        hc.unregister_system_shared_memory("big_in")
        hc.unregister_system_shared_memory("big_out")
    server.wait_idle()


# -- requested outputs, several inputs ---------------------------------------------------------------

def test_requested_output_subsets(server, hc, gc):
    x = np.linspace(-1, 1, 9, dtype=np.float32)
    for mod, client in ((tritonhttp, hc), (tritongrpc, gc)):
        inp = mod.InferInput("x", [9], "FP32")
        inp.set_data_from_numpy(x)
        only_z = client.infer("two_outputs", [inp], outputs=[mod.InferRequestedOutput("z")])
        assert same(only_z.as_numpy("z"), x * 2) and only_z.as_numpy("y") is None
        both = client.infer("two_outputs", [inp], outputs=[mod.InferRequestedOutput("z"),
                                                             mod.InferRequestedOutput("y")])
        assert [o["name"] for o in (both.get_response()["outputs"] if mod is tritonhttp else
                                    both.get_response(as_json=True)["outputs"])] == ["z", "y"]
        every = client.infer("two_outputs", [inp])
        assert same(every.as_numpy("y"), x) and same(every.as_numpy("z"), x * 2)
        with pytest.raises(InferenceServerException, match="unexpected inference output 'w' for model 'two_outputs'"):
            client.infer("two_outputs", [inp], outputs=[mod.InferRequestedOutput("w")])
    native = native_answer(server, "two_outputs", {"x": x})
    assert same(native["z"], x * 2)


def test_mixed_json_and_binary_inputs(hc):
    a, b = np.arange(5, dtype=np.int32), np.arange(5, dtype=np.int32) * 10
    ia, ib = tritonhttp.InferInput("a", [5], "INT32"), tritonhttp.InferInput("b", [5], "INT32")
    ia.set_data_from_numpy(a, binary_data=False)
    ib.set_data_from_numpy(b, binary_data=True)
    assert same(hc.infer("two_inputs", [ia, ib]).as_numpy("sum"), a + b)


def test_request_id_and_compressed_bodies(hc):
    x = np.arange(1000, dtype=np.uint8)
    for algorithm in (None, "gzip", "deflate"):
        inp = tritonhttp.InferInput("x", [1000], "UINT8")
        inp.set_data_from_numpy(x)
        result = hc.infer("identity", [inp], request_id=f"r-{algorithm}", request_compression_algorithm=algorithm)
        assert same(result.as_numpy("y"), x) and result.get_response()["id"] == f"r-{algorithm}"


# -- errors through the clients -------------------------------------------------------------------

def test_errors_carry_tritons_words_and_statuses(hc, gc):
    """Where Triton has words for a refusal, its clients see them (shmserve's code is beside them:
    tests/test_v2_triton.py); elsewhere the stable code leads the text."""
    x = np.zeros(4, np.float32)
    for mod, client, status in ((tritonhttp, hc, "400"), (tritongrpc, gc, "StatusCode.INVALID_ARGUMENT")):
        inp = mod.InferInput("x", [4], "FP32")
        inp.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException) as e:
            client.infer("identity", [inp])  # identity takes uint8
        assert "inference input 'x' data-type is 'FP32', but model 'identity' expects 'UINT8'" in str(e.value)
        assert e.value.status() == status
        missing = mod.InferInput("x", [4], "FP32")
        missing.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'no_such_model'") as e:
            client.infer("no_such_model", [missing])
        assert e.value.status() == status
        good = mod.InferInput("x", [4], "UINT8")  # a priority is taken (a level above the model's: its default)
        good.set_data_from_numpy(np.arange(4, dtype=np.uint8))
        assert (client.infer("identity", [good], priority=3).as_numpy("y") == np.arange(4, dtype=np.uint8)).all()


# -- system shared memory ----------------------------------------------------------------------------

@pytest.fixture
def regions():
    """System shared-memory regions made with tritonclient's own utility; destroyed after the test."""
    made = []

    def make(size: int):
        key = f"/v2test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        handle = triton_shm.create_shared_memory_region(f"r{len(made)}", key, size)
        made.append(handle)
        return key, handle

    yield make
    for handle in made:
        triton_shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("which", ["http", "grpc"])
def test_system_shared_memory_inputs_and_outputs(which, server, hc, gc, regions):
    client, mod = (hc, tritonhttp) if which == "http" else (gc, tritongrpc)
    x = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    in_key, in_handle = regions(x.nbytes + 64)
    out_key, out_handle = regions(x.nbytes * 2)
    triton_shm.set_shared_memory_region(in_handle, [x], offset=64)
    client.register_system_shared_memory("in", in_key, x.nbytes + 64)
    client.register_system_shared_memory("out", out_key, x.nbytes * 2)
    try:
        status = client.get_system_shared_memory_status(**({"as_json": True} if which == "grpc" else {}))
        names = {r["name"] for r in (status if which == "http" else status["regions"].values())}
        assert names == {"in", "out"}
        inp = mod.InferInput("x", [4, 6], "FP32")
        inp.set_shared_memory("in", x.nbytes, offset=64)
        out = mod.InferRequestedOutput("y")
        out.set_shared_memory("out", x.nbytes * 2, offset=0)
        result = client.infer("f32", [inp], outputs=[out])
        got = triton_shm.get_contents_as_numpy(out_handle, np.float32, [4, 6], offset=0)
        assert same(got, x) and same(got, native_answer(server, "f32", {"x": x})["y"])
        response = result.get_response() if which == "http" else result.get_response(as_json=True)
        assert response["outputs"][0]["name"] == "y"
        # an input by region, an output in the answer; and offset + size past the region: refused
        plain = client.infer("f32", [inp])
        assert same(plain.as_numpy("y"), x)
        bad = mod.InferInput("x", [4, 6], "FP32")
        bad.set_shared_memory("in", x.nbytes, offset=128)
        with pytest.raises(InferenceServerException, match=r"Invalid offset \+ byte size for shared memory region"):
            client.infer("f32", [bad])
    finally:
        client.unregister_system_shared_memory()
    status = client.get_system_shared_memory_status(**({"as_json": True} if which == "grpc" else {}))
    assert not (status if which == "http" else status.get("regions"))
    server.wait_idle()


def test_cuda_shared_memory_is_refused_cleanly(hc, gc):
    for client in (hc, gc):
        client.unregister_cuda_shared_memory()  # nothing registered: succeeds
        with pytest.raises(InferenceServerException, match="not supported"):
            client.register_cuda_shared_memory("c", b"\0" * 64, 0, 1024)


# -- statistics ---------------------------------------------------------------------------------------

def test_statistics_count_requests(hc, gc):
    before = hc.get_inference_statistics("two_inputs")["model_stats"][0]
    a = tritonhttp.InferInput("a", [3], "INT32")
    b = tritonhttp.InferInput("b", [3], "INT32")
    a.set_data_from_numpy(np.ones(3, np.int32))
    b.set_data_from_numpy(np.ones(3, np.int32))
    for _ in range(3):
        hc.infer("two_inputs", [a, b])
    after = hc.get_inference_statistics("two_inputs")["model_stats"][0]
    assert after["inference_count"] == before["inference_count"] + 3
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 3
    assert after["last_inference"] > 0
    grpc_stats = gc.get_inference_statistics("two_inputs", as_json=True)["model_stats"][0]
    assert int(grpc_stats["inference_count"]) == after["inference_count"]
    every = hc.get_inference_statistics()["model_stats"]
    assert {"identity", "two_inputs", "f32"} <= {s["name"] for s in every}
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'no_such_model' is not found"):
        hc.get_inference_statistics("no_such_model")


# -- HTTP on a Unix socket, raw binary -----------------------------------------------------------------

class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=30)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self.path)


def test_http_on_a_unix_socket_and_the_raw_binary_form(tmp_path):
    path = str(tmp_path / "http.sock")
    with serving(tmp_path, MODELS, server_section=f'http = "{path}"\n') as srv:
        assert srv.info()["v2"]["http"] == path
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        conn = UnixHTTPConnection(path)
        conn.request("GET", "/v2/health/ready")
        assert conn.getresponse().read() == b"" and True
        x = np.arange(10, dtype=np.uint8)
        conn.request("POST", "/v2/models/identity/infer", body=x.tobytes(),
                     headers={"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"})
        r = conn.getresponse()
        body = r.read()
        assert r.status == 200, body
        h = int(r.getheader("Inference-Header-Content-Length"))
        header = json.loads(body[:h])
        assert header["outputs"][0]["shape"] == [10] and body[h:] == x.tobytes()
        conn.close()
    assert not os.path.exists(path)


# -- repository ---------------------------------------------------------------------------------------

REPO_MODEL = '''def f(inputs):
    return {{"y": inputs["x"] + {version}}}


f.inputs = [{{"name": "x", "dtype": "uint8", "shape": ["n"]}}]
f.outputs = [{{"name": "y", "dtype": "uint8", "shape": ["n"]}}]
'''


def test_repository_index_load_and_unload(tmp_path):
    repo = tmp_path / "repo"
    for name in ("plus", "later"):
        (repo / name).mkdir(parents=True)
        load = '\nload = "on_demand"' if name == "later" else ""
        (repo / name / "config.toml").write_text(f'backend = "python"\npath = "m{name}:f"{load}\n')
        for version in (1, 2):
            (repo / name / str(version)).mkdir()
            (repo / name / str(version) / f"m{name}.py").write_text(REPO_MODEL.format(version=version))
    section = V2_SERVER + f"model_repository = {json.dumps(str(repo))}\n"
    write_tokens(tmp_path)
    with serving(tmp_path, "", server_section=section) as srv:
        v2 = srv.info()["v2"]
        hc = authed(tritonhttp.InferenceServerClient(v2["http"]))
        gc = authed(tritongrpc.InferenceServerClient(v2["grpc"]))
        try:
            index = {(m["name"], m.get("version")): m["state"] for m in hc.get_model_repository_index()}
            assert index[("plus", "2")] == "READY"
            x = np.arange(4, dtype=np.uint8)
            inp = tritonhttp.InferInput("x", [4], "UINT8")
            inp.set_data_from_numpy(x)
            assert same(hc.infer("plus", [inp]).as_numpy("y"), x + 2)
            hc.unload_model("plus")
            wait_for(lambda: not hc.is_model_ready("plus"), "plus unloaded")
            with pytest.raises(InferenceServerException):
                hc.infer("plus", [inp])
            gc.load_model("plus")
            assert gc.is_model_ready("plus")
            assert same(hc.infer("plus", [inp]).as_numpy("y"), x + 2)
            grpc_index = gc.get_model_repository_index(as_json=True)["models"]
            assert {"name": "plus", "version": "2", "state": "READY"} in \
                [{k: m.get(k) for k in ("name", "version", "state")} for m in grpc_index]
            with pytest.raises(InferenceServerException, match="not supported"):
                hc.load_model("plus", config=json.dumps({"backend": "python"}))
            with pytest.raises(InferenceServerException, match="unknown_model"):
                hc.load_model("no_such_model")
        finally:
            hc.close()
            gc.close()
