"""The v2 doors behave as Triton's server does, where Triton's clients, tools and QA suites look
(issue 27): through ``tritonclient.http``, ``tritonclient.grpc`` and raw HTTP against a real
server.  Each fact was read in Triton's own sources (server ``src/http_server.cc``,
``src/shared_memory_manager.cc``, ``qa/L0_http``, ``qa/L0_shared_memory``, ``qa/L0_lifecycle``;
core ``src/infer_request.cc``, ``src/model.cc``, ``src/model_repository_manager``), never copied:

- a raw binary body (``Inference-Header-Content-Length: 0``) to a model with ``max_batch_size`` > 0
  is a batch of one;
- a shared-memory input whose ``shared_memory_byte_size`` is not its tensor's size is refused;
- refusals in Triton's words and statuses, shmserve's code beside them, never in front;
- JSON ``data`` nested deeper than its shape (or flat) is read in row-major order;
- ``binary_data_output`` is the form of the outputs a request does not list; a listed output is
  binary only if its own ``binary_data`` says so;
- the model configuration's platform; statistics counting batch items and executions;
- ``/metrics`` on the v2 door: a 404 that names ``--metrics``;
- what is advertised: no CUDA shared memory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from importlib import resources

import numpy as np
import pytest

tritonhttp = pytest.importorskip("tritonclient.http")
tritongrpc = pytest.importorskip("tritonclient.grpc")
import tritonclient.utils.shared_memory as triton_shm  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import new_instance  # noqa: E402
from helpers import raw_http  # noqa: E402
from helpers.raw_http import one  # noqa: E402
from helpers.server import scrape_text, wait_for  # noqa: E402
from helpers.v2_server import auth, python_model, triton_client, v2_serving  # noqa: E402

DEMO = str(resources.files("shmserve.models") / "demo.onnx")
MODELS = "".join([
    python_model("f32", "shmserve.models:identity_f32", max_batch_size=8),
    python_model("two_inputs", "serving_models:two_inputs"),
    python_model("fails", "serving_models:fails"),
    textwrap.dedent(f"""
        [[models]]
        name = "demo"
        backend = "onnxruntime"
        path = "{DEMO}"
        """),
])


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("v2triton")
    (workdir / "labels.txt").write_text("cat\ndog\nbird\n")  # beside the python models' configuration
    with v2_serving(workdir, models=MODELS, deadlines=30, extra_args=["--metrics", str(workdir / "m.sock")]) as s:
        s.metrics = str(workdir / "m.sock")
        yield s


def sample(text: str, name: str, **labels) -> float:
    """The value of the sample ``name`` with ``labels`` (in any order) in a scrape's text, by its
    exact name (Triton's counters have no ``_total``); 0 when it is not there."""
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "{") and dict(re.findall(r'(\w+)="([^"]*)"', head)) == labels:
            return float(value)
    return 0.0


@pytest.fixture(scope="module")
def hc(srv):
    with triton_client(tritonhttp, srv.http) as client:
        yield client


@pytest.fixture(scope="module")
def gc(srv):
    with triton_client(tritongrpc, srv.grpc) as client:
        yield client


def http(srv, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> raw_http.Response:
    return one(srv.http, raw_http.request(method, path, body, {**auth("admin"), **(headers or {})}))


def json_infer(srv, model: str, body: dict) -> raw_http.Response:
    return one(srv.http, raw_http.json_infer(model, body, auth("admin")))


def f32_input(module, shape, data=None, datatype="FP32", name="x"):
    t = module.InferInput(name, list(shape), datatype)
    if data is not None:
        t.set_data_from_numpy(data)
    return t


def refused(client, call, message: str, status: str | None = None) -> InferenceServerException:
    """``call(client)`` is refused with Triton's ``message`` at the start of its text (no code in
    front) and, over HTTP, Triton's ``status``."""
    with pytest.raises(InferenceServerException) as info:
        call(client)
    text = info.value.message()
    assert text.startswith(message), text
    if status is not None and isinstance(client, tritonhttp.InferenceServerClient):
        assert info.value.status() == status, (info.value.status(), text)
    return info.value


# -- raw binary ---------------------------------------------------------------------------------------

def test_a_raw_binary_body_to_a_batching_model_is_a_batch_of_one(srv):
    """f32 takes [batch, features] with max_batch_size 8: Triton's config dims are [-1], so the
    body is one row of as many features as it holds (it was refused: two dimensions not fixed)."""
    x = np.arange(6, dtype=np.float32)
    r = http(srv, "POST", "/v2/models/f32/infer", x.tobytes(), {"Inference-Header-Content-Length": "0"})
    assert r.status == 200, r
    (out,) = r.json()["outputs"]
    assert out["shape"] == [1, 6] and r.binary == x.tobytes()


def test_a_raw_binary_body_to_a_model_of_two_inputs_is_refused_in_triton_words(srv):
    r = http(srv, "POST", "/v2/models/two_inputs/infer", bytes(12), {"Inference-Header-Content-Length": "0"})
    assert r.status == 400 and r.code == "bad_input", r
    assert "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'two_inputs'" in r.error


# -- shared memory: byte sizes and Triton's words ------------------------------------------------------

@pytest.fixture
def region(hc):
    """A /dev/shm object of 256 bytes made with tritonclient's own utility, registered as "r"."""
    key = "/" + new_instance("v2triton")
    handle = triton_shm.create_shared_memory_region("r", key, 256)
    try:
        hc.register_system_shared_memory("r", key, 256)
        yield handle, key
    finally:
        hc.unregister_system_shared_memory()
        triton_shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("which", ["http", "grpc"])
def test_a_shared_memory_input_whose_byte_size_is_not_the_tensors_is_refused(hc, gc, region, which):
    """Triton's qa test_too_big_shm: 128 bytes named for a 64-byte tensor is a mismatch (it was
    accepted, and the first 64 read)."""
    client, module = (hc, tritonhttp) if which == "http" else (gc, tritongrpc)
    handle, _ = region
    triton_shm.set_shared_memory_region(handle, [np.arange(32, dtype=np.float32)])
    x = f32_input(module, [1, 16])
    x.set_shared_memory("r", 128)
    refused(client, lambda c: c.infer("f32", [x]),
            "[request id: <id_unknown>] input byte size mismatch for input 'x' for model 'f32'. Expected 64, got 128",
            "400")
    x.set_shared_memory("r", 64)  # exactly the tensor's bytes: served
    assert np.array_equal(client.infer("f32", [x]).as_numpy("y"), np.arange(16, dtype=np.float32).reshape(1, 16))


@pytest.mark.parametrize("which", ["http", "grpc"])
def test_shared_memory_refusals_are_in_triton_words(hc, gc, region, which):
    client, module = (hc, tritonhttp) if which == "http" else (gc, tritongrpc)
    _, key = region
    refused(client, lambda c: c.register_system_shared_memory("r", key, 256),
            "shared memory region 'r' already in manager", "400")
    refused(client, lambda c: c.register_system_shared_memory("big", key, 257),
            "failed to register shared memory region 'big': invalid args", "400")
    refused(client, lambda c: c.get_system_shared_memory_status("nope"),
            "Unable to find system shared memory region: 'nope'", "404")
    x = f32_input(module, [1, 4])
    x.set_shared_memory("nope", 16)
    refused(client, lambda c: c.infer("f32", [x]), "Unable to find shared memory region: 'nope'", "404")
    x.set_shared_memory("r", 16, offset=256)
    refused(client, lambda c: c.infer("f32", [x]), "Invalid offset for shared memory region: 'r'", "400")
    x.set_shared_memory("r", 16, offset=248)
    refused(client, lambda c: c.infer("f32", [x]), "Invalid offset + byte size for shared memory region: 'r'", "400")
    refused(client, lambda c: c.register_system_shared_memory("k", "///", 8),
            "cannot register shared memory region 'k' - invalid shm key", "400")


# -- models, versions, inputs and outputs in Triton's words ---------------------------------------------

@pytest.mark.parametrize("which", ["http", "grpc"])
def test_unknown_models_versions_inputs_and_outputs_are_refused_in_triton_words(hc, gc, which):
    client, module = (hc, tritonhttp) if which == "http" else (gc, tritongrpc)
    x = f32_input(module, [1, 4], np.ones((1, 4), np.float32))
    refused(client, lambda c: c.infer("nope", [x]), "Request for unknown model: 'nope' is not found", "400")
    refused(client, lambda c: c.infer("f32", [x], model_version="7"),
            "Request for unknown model: 'f32' version 7 is not found", "404")
    refused(client, lambda c: c.get_model_metadata("nope"), "Request for unknown model: 'nope' is not found", "400")
    refused(client, lambda c: c.get_model_config("f32", "7"),
            "Request for unknown model: 'f32' version 7 is not found", "404")
    refused(client, lambda c: c.infer("f32", [f32_input(module, [1, 4], np.ones((1, 4), np.float32), name="z")]),
            "unexpected inference input 'z' for model 'f32'", "400")
    refused(client, lambda c: c.infer("f32", [x], outputs=[module.InferRequestedOutput("q")]),
            "unexpected inference output 'q' for model 'f32'", "400")
    refused(client, lambda c: c.infer("f32", [f32_input(module, [1, 4], np.ones((1, 4)), "FP64")]),
            "[request id: <id_unknown>] inference input 'x' data-type is 'FP64', but model 'f32' expects 'FP32'",
            "400")
    refused(client, lambda c: c.infer("f32", [f32_input(module, [4], np.ones(4, np.float32))]),
            "[request id: <id_unknown>] unexpected shape for input 'x' for model 'f32'. Expected [-1,-1], got [4]. "
            "NOTE: Setting a non-zero max_batch_size", "400")
    a = f32_input(module, [3], np.ones(3, np.int32), "INT32", name="a")
    refused(client, lambda c: c.infer("two_inputs", [a], request_id="7"),
            "[request id: 7] expected 2 inputs but got 1 inputs for model 'two_inputs'. Got input(s) ['a'], but "
            "missing required input(s) ['b']. Please provide all required input(s).", "400")


def test_a_model_without_a_ready_version_has_no_available_versions(srv, hc, gc):
    """Triton's qa L0_lifecycle: an unloaded model is still known, with no available version."""
    x = f32_input(tritonhttp, [1, 4], np.ones((1, 4), np.float32))
    hc.unload_model("two_inputs")
    try:
        a = f32_input(tritonhttp, [3], np.ones(3, np.int32), "INT32", name="a")
        b = f32_input(tritonhttp, [3], np.ones(3, np.int32), "INT32", name="b")
        refused(hc, lambda c: c.infer("two_inputs", [a, b]),
                "Request for unknown model: 'two_inputs' has no available versions", "404")
    finally:
        hc.load_model("two_inputs")
    assert hc.infer("f32", [x]).as_numpy("y").shape == (1, 4)


def test_no_error_text_begins_with_the_code_where_triton_has_words_for_it(srv):
    r = json_infer(srv, "nope", {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1]}]})
    assert r.status == 400 and json.loads(bytes(r.body)) == {
        "error": "Request for unknown model: 'nope' is not found", "code": "unknown_model"}


# -- JSON data, binary_data_output ---------------------------------------------------------------------

def test_json_data_nested_deeper_than_its_shape_or_flat_is_read_in_row_major_order(srv):
    for data in ([[[1, 2]], [[3, 4]]], [1, 2, 3, 4], [[1, [2]], [3, 4]]):
        r = json_infer(srv, "f32", {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": data}]})
        assert r.status == 200, r
        assert r.json()["outputs"][0]["data"] == [1, 2, 3, 4]
    r = json_infer(srv, "f32", {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3]]}]})
    assert r.status == 400 and r.error.startswith("Failed to parse 'data' field: shape does not match true shape"), r


def test_binary_data_output_is_the_form_of_the_outputs_a_request_does_not_list(srv):
    """Triton's qa L0_http (test.sh, binary_data_output): with the outputs listed, each is binary
    only if its own binary_data says so; without a list, every output is binary."""
    x = {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}
    everything = json_infer(srv, "f32", {"inputs": [x], "parameters": {"binary_data_output": True}})
    assert everything.status == 200 and everything.header_length is not None, everything
    assert everything.binary == np.array([1, 2], np.float32).tobytes()
    listed = json_infer(srv, "f32", {"inputs": [x], "parameters": {"binary_data_output": True},
                                     "outputs": [{"name": "y"}]})
    assert listed.status == 200 and listed.header_length is None, listed
    assert listed.json()["outputs"][0]["data"] == [1, 2]
    asked = json_infer(srv, "f32", {"inputs": [x], "outputs": [{"name": "y", "parameters": {"binary_data": True}}]})
    assert asked.status == 200 and asked.binary == np.array([1, 2], np.float32).tobytes(), asked


# -- the classification extension -----------------------------------------------------------------------

@pytest.mark.parametrize("which", ["http", "grpc"])
def test_classification_answers_the_top_k_as_value_index_label(hc, gc, which):
    """Triton's classification extension: the top k of each batch item, highest first, as
    "value:index:label" (labels.txt beside the model; indices past its lines have none)."""
    client, module = (hc, tritonhttp) if which == "http" else (gc, tritongrpc)
    x = np.array([[0.1, 0.8, 0.3, 0.9], [5, 1, 2, 0]], np.float32)
    out = module.InferRequestedOutput("y", class_count=2)
    y = client.infer("f32", [f32_input(module, x.shape, x)], outputs=[out]).as_numpy("y")
    assert y.shape == (2, 2)
    assert [[v.decode() for v in row] for row in y] == [["0.900000:3", "0.800000:1:dog"],
                                                         ["5.000000:0:cat", "2.000000:2:bird"]]
    every = client.infer("f32", [f32_input(module, [1, 4], x[:1])],
                         outputs=[module.InferRequestedOutput("y", class_count=10)]).as_numpy("y")
    assert every.shape == (1, 4)  # k past the classes: all of them


def test_classification_and_a_shared_memory_output_exclude_each_other(srv):
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}],
            "outputs": [{"name": "y", "parameters": {"classification": 1, "shared_memory_region": "r",
                                                     "shared_memory_byte_size": 8}}]}
    r = json_infer(srv, "f32", body)
    assert r.status == 400 and r.error.startswith("Output can't set both 'shared_memory_region' and 'classification'")


# -- configuration, statistics, metrics, metadata ------------------------------------------------------

def test_model_configuration_names_tritons_platform_and_backend(hc, gc):
    demo = hc.get_model_config("demo")
    assert (demo["platform"], demo["backend"]) == ("onnxruntime_onnx", "onnxruntime")
    assert gc.get_model_config("demo", as_json=True)["config"]["platform"] == "onnxruntime_onnx"
    assert hc.get_model_metadata("demo")["platform"] == "onnxruntime_onnx"
    f32 = hc.get_model_config("f32")
    assert (f32["platform"], f32["backend"]) == ("python", "python")


def test_statistics_count_batch_items_executions_and_lane_calls(srv, hc):
    """Triton's inference_count counts a request of batch 4 as 4 and execution_count the runs;
    success counts lane calls too (they never pass the dispatcher)."""
    def stats():
        return hc.get_inference_statistics("f32")["model_stats"][0]

    before = stats()
    hc.infer("f32", [f32_input(tritonhttp, [4, 3], np.ones((4, 3), np.float32))])
    after = stats()
    assert after["inference_count"] == before["inference_count"] + 4
    assert after["execution_count"] == before["execution_count"] + 1
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
    with srv.client() as c:
        for _ in range(3):
            c.infer("f32", {"x": np.ones((1, 3), np.float32)})
    # a worker counts a call just after publishing its answer: wait (bounded) for the last one
    def counted(s):
        return s["execution_count"] >= after["execution_count"] + 3 and \
            s["inference_stats"]["success"]["count"] >= after["inference_stats"]["success"]["count"] + 3

    lanes = wait_for(lambda: (lambda s: s if counted(s) else None)(stats()), what="the lane calls in the statistics")
    assert lanes["inference_stats"]["success"]["count"] == after["inference_stats"]["success"]["count"] + 3
    assert lanes["execution_count"] == after["execution_count"] + 3


def test_metrics_on_the_v2_door_is_a_404_that_names_the_metrics_flag(srv):
    r = http(srv, "GET", "/metrics")
    assert r.status == 404 and r.code == "not_found", r
    assert "--metrics" in r.error and "8002" in r.error


def test_tritons_metric_families_beside_shmserves_count_lane_calls(srv, hc):
    """Triton's nv_inference_* families, with its names (no _total), types and labels; requests
    count lane calls at once, shmserve_requests_total once the front-end has read the workers'
    counters (it read 0 after lane calls)."""
    def settled():  # every ok call the workers ran is in the request totals (lane calls a heartbeat late)
        text = scrape_text(srv.metrics)
        ok = sample(text, "shmserve_requests_total", model="f32", version="1", outcome="ok")
        return text if ok == sample(text, "nv_inference_request_success", model="f32", version="1") else None

    before = wait_for(settled, what="the lane calls before the test in shmserve_requests_total")
    for name in ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
                 "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                 "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                 "nv_inference_compute_output_duration_us"):
        assert f"# TYPE {name} counter\n" in before and f'{name}{{model="f32",version="1"}} ' in before, name
    hc.infer("f32", [f32_input(tritonhttp, [4, 3], np.ones((4, 3), np.float32))])
    with srv.client() as c:
        for _ in range(5):
            c.infer("f32", {"x": np.ones((1, 3), np.float32)})
    def grew(name, text, **extra):
        labels = {"model": "f32", "version": "1", **extra}
        return sample(text, name, **labels) - sample(before, name, **labels)

    # a worker counts a call just after publishing its answer: wait (bounded) for the last one
    after = wait_for(lambda: (lambda t: t if grew("nv_inference_exec_count", t) >= 6 and
                              grew("nv_inference_request_success", t) >= 6 else None)(scrape_text(srv.metrics)),
                     what="the calls in Triton's families")

    assert grew("nv_inference_request_success", after) == 6 and grew("nv_inference_exec_count", after) == 6
    assert grew("nv_inference_count", after) == 9  # the batch of 4 counts 4
    assert grew("nv_inference_request_duration_us", after) > 0
    assert grew("shmserve_requests_total", wait_for(settled, what="the lane calls in shmserve_requests_total"),
                outcome="ok") == 6


def test_lane_calls_that_fail_are_counted_as_failures(srv, hc):
    """A lane call never passes the dispatcher: its failure is seen in the worker's counters, and
    counted in Triton's failure counter, the statistics and shmserve_requests_total."""
    def counts():
        text = scrape_text(srv.metrics)
        stats = hc.get_inference_statistics("fails")["model_stats"][0]["inference_stats"]
        return (sample(text, "nv_inference_request_failure", model="fails", version="1"),
                sample(text, "shmserve_requests_total", model="fails", version="1", outcome="error"),
                stats["fail"]["count"], stats["success"]["count"])

    before = counts()
    with srv.client() as c:
        assert np.array_equal(c.infer("fails", {"x": np.ones(3, np.float32)})["y"], np.ones(3, np.float32))
        for _ in range(2):
            with pytest.raises(Exception, match="negative input"):
                c.infer("fails", {"x": -np.ones(3, np.float32)})
    after = wait_for(lambda: (lambda now: now if now[0] == before[0] + 2 else None)(counts()),
                     what="the failed lane calls in the failure counts")
    assert after == (before[0] + 2, before[1] + 2, before[2] + 2, before[3] + 1)


def test_cuda_shared_memory_is_not_advertised_and_classification_is(hc, gc):
    for extensions in (hc.get_server_metadata()["extensions"], gc.get_server_metadata(as_json=True)["extensions"]):
        assert "cuda_shared_memory" not in extensions and "classification" in extensions


# -- install -------------------------------------------------------------------------------------------

def test_serve_grpc_without_the_v2_extra_names_the_one_command(tmp_path):
    """grpc hidden from the import system: ``serve --grpc`` stops before anything starts, naming
    the command README.md and docs/v2.md give."""
    code = ("import sys; sys.modules['grpc'] = None; from shmserve.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    config = tmp_path / "shmserve.toml"
    config.write_text('[server]\ngrpc = "127.0.0.1:0"\n' + python_model("m", "shmserve.models:identity"))
    run = subprocess.run([sys.executable, "-c", code, "serve", "--config", str(config), "--instance",
                          new_instance("v2grpc"), "--socket", str(tmp_path / "s.sock")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "pip install -e '.[v2]'" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for doc in ("README.md", "docs/v2.md"):
        with open(os.path.join(root, doc)) as f:
            assert "pip install -e '.[v2]'" in f.read(), doc
