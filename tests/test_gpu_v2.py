"""The KServe v2 doors in front of GPU workers: Triton's own clients call a torch model on cuda:0
(mapped and copy I/O) over HTTP, gRPC and system shared memory; every answer equals the model run
on the CPU.  Nothing GPU-specific is in the doors: this proves the path end to end on the GPU.

Runs where torch sees a CUDA GPU and cuda-python is installed (the H200 of docs/gpu.md); skips with
the reason anywhere else.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from helpers.gpu import require_gpu  # noqa: E402

torch = require_gpu()

tritonhttp = pytest.importorskip("tritonclient.http")
tritongrpc = pytest.importorskip("tritonclient.grpc")
import tritonclient.utils.shared_memory as triton_shm  # noqa: E402

from helpers.server import serving  # noqa: E402
from helpers.v2_server import authed, write_tokens  # noqa: E402
from shmserve.models.torchnets import convnet, save_models  # noqa: E402

TOLERANCE = dict(rtol=2e-3, atol=2e-4)  # GPU convolutions may use TF32; the CPU reference does not
SPEC = ('inputs = [{name = "image", dtype = "float32", shape = ["batch", 3, 32, 32]}]\n'
        'outputs = [{name = "scores", dtype = "float32", shape = ["batch", 10]}]')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gpu_v2")
    path = save_models(workdir)["torchscript"]
    models = "".join(f"""
[[models]]
name = "{mode}"
backend = "torch"
path = "{path}"
device = "cuda:0"
io_mode = "{mode}"
{SPEC}
""" for mode in ("mapped", "copy"))
    write_tokens(workdir)  # shared memory needs a caller the server can name: the test token
    with serving(workdir, models, server_section='http = "127.0.0.1:0"\ngrpc = "127.0.0.1:0"\n'
                                                 'v2_system_shared_memory = true\nv2_tokens = "tokens.toml"\n') as srv:
        v2 = srv.info()["v2"]
        srv.http, srv.grpc = v2["http"], v2["grpc"]
        yield srv


def reference(x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return convnet()(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("model", ["mapped", "copy"])
@pytest.mark.parametrize("door", ["http", "grpc"])
def test_triton_clients_get_the_cpu_reference_from_a_cuda_model(server, model, door):
    mod = tritonhttp if door == "http" else tritongrpc
    client = mod.InferenceServerClient(server.http if door == "http" else server.grpc)
    try:
        meta = client.get_model_metadata(model, **({"as_json": True} if door == "grpc" else {}))
        assert meta["inputs"][0]["name"] == "image"
        for batch in (1, 8, 64):
            x = np.random.default_rng(batch).standard_normal((batch, 3, 32, 32)).astype(np.float32)
            inp = mod.InferInput("image", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            got = client.infer(model, [inp]).as_numpy("scores")
            np.testing.assert_allclose(got, reference(x), **TOLERANCE)
            with server.client() as native:
                assert np.array_equal(got, native.infer(model, {"image": x})["scores"])
    finally:
        client.close()


def test_system_shared_memory_in_and_out_of_a_cuda_model(server):
    x = np.random.default_rng(7).standard_normal((16, 3, 32, 32)).astype(np.float32)
    out_bytes = 16 * 10 * 4
    keys = [f"/gpuv2-{os.getpid()}-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    handles = [triton_shm.create_shared_memory_region("in", keys[0], x.nbytes),
               triton_shm.create_shared_memory_region("out", keys[1], out_bytes)]
    client = authed(tritonhttp.InferenceServerClient(server.http), "client")
    try:
        triton_shm.set_shared_memory_region(handles[0], [x])
        client.register_system_shared_memory("in", keys[0], x.nbytes)
        client.register_system_shared_memory("out", keys[1], out_bytes)
        inp = tritonhttp.InferInput("image", list(x.shape), "FP32")
        inp.set_shared_memory("in", x.nbytes)
        out = tritonhttp.InferRequestedOutput("scores")
        out.set_shared_memory("out", out_bytes)
        client.infer("mapped", [inp], outputs=[out])
        got = triton_shm.get_contents_as_numpy(handles[1], np.float32, [16, 10])
        np.testing.assert_allclose(got, reference(x), **TOLERANCE)
        client.unregister_system_shared_memory()
    finally:
        client.close()
        for handle in handles:
            triton_shm.destroy_shared_memory_region(handle)
    server.wait_idle()
