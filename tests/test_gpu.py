"""GPU workers through the real server: the arena page-locked, mapped and copy I/O, two workers on one GPU.

Runs where torch sees a CUDA GPU and cuda-python is installed (the H200 used
for docs/gpu.md); skips with the reason anywhere else.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from helpers.gpu import require_gpu  # noqa: E402

torch = require_gpu()

from conftest import shm_names  # noqa: E402
from helpers.server import ServerProcess, concurrent_infer  # noqa: E402
from shmserve.models.torchnets import convnet, save_models  # noqa: E402
from test_batching import batch_stats  # noqa: E402

TOLERANCE = dict(rtol=2e-3, atol=2e-4)  # GPU convolutions may use TF32; the CPU reference does not


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gpu")
    paths = save_models(workdir)
    before = shm_names()
    spec = 'inputs = [{name = "image", dtype = "float32", shape = ["batch", 3, 32, 32]}]\n' \
           'outputs = [{name = "scores", dtype = "float32", shape = ["batch", 10]}]'
    srv = ServerProcess(workdir, f"""
        [[models]]
        name = "mapped"
        backend = "torch"
        path = "{paths['torchscript']}"
        device = "cuda:0"
        io_mode = "mapped"
        instances = 2
        {spec}

        [[models]]
        name = "batched"
        backend = "torch"
        path = "{paths['torchscript']}"
        device = "cuda:0"
        io_mode = "mapped"
        max_batch_size = 16
        max_queue_delay_us = 200000
        {spec}

        [[models]]
        name = "batched_copy"
        backend = "torch"
        path = "{paths['torchscript']}"
        device = "cuda:0"
        io_mode = "copy"
        max_batch_size = 16
        max_queue_delay_us = 200000
        {spec}

        [[models]]
        name = "copy"
        backend = "torch"
        path = "{paths['torchscript']}"
        device = "cuda:0"
        io_mode = "copy"
        {spec}
    """).start(timeout=180)
    yield srv
    assert srv.stop() == 0, srv.log()
    assert shm_names() == before


@pytest.mark.parametrize("model", ["mapped", "copy", "batched"])
def test_outputs_match_the_cpu_reference(gpu_server, model):
    rng = np.random.default_rng()
    net = convnet()
    with gpu_server.client() as c:
        for batch in (1, 7, 64):
            x = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
            with torch.inference_mode():
                ref = net(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(c.infer(model, {"image": x})["scores"], ref, **TOLERANCE)
            with c.zero_copy(model, {"image": (x.shape, np.float32)}) as call:
                call.inputs["image"][...] = x
                out_area = np.ndarray(call.out_capacity // 4, np.float32, buffer=call.region.buf,
                                      offset=call.out_offset)
                out_area[...] = np.nan  # poisoned: a result must overwrite it
                np.testing.assert_allclose(call.run()["scores"], ref, **TOLERANCE)


def test_two_workers_on_one_gpu_registered_the_arena_and_both_serve(gpu_server):
    info = gpu_server.info()
    workers = [w for w in info["workers"] if w["model"] == "mapped"]
    assert len(workers) == 2
    for w in workers:
        assert w["gpu"]["device"] == 0 and w["gpu"]["arena_bytes"] == info["arena"]["size"]
        assert w["io_mode"] == "mapped"
    x = np.zeros((4, 3, 32, 32), np.float32)

    def hammer():
        with gpu_server.client() as c:
            for _ in range(20):
                c.infer("mapped", {"image": x})

    threads = [threading.Thread(target=hammer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    counts = [w["requests"] for w in gpu_server.info()["workers"] if w["model"] == "mapped"]
    assert sum(counts) >= 120 and all(n > 0 for n in counts), counts


@pytest.mark.parametrize("model", ["batched", "batched_copy"])
def test_batching_on_the_gpu_path(gpu_server, model):
    """Each request's rows go from the device straight into its own output area (mapped: through
    the mapping; copy: one DMA per request), and batches really formed."""
    rng = np.random.default_rng()
    net = convnet()
    inputs = [rng.standard_normal((1 + i % 4, 3, 32, 32), dtype=np.float32) for i in range(8)]
    runs0, requests0 = batch_stats(gpu_server, model)
    results = concurrent_infer(gpu_server, model, "image", "scores", inputs)
    for x, y in zip(inputs, results):
        with torch.inference_mode():
            ref = net(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(y, ref, **TOLERANCE)
    runs, requests = batch_stats(gpu_server, model)
    assert requests - requests0 == len(inputs) and runs - runs0 < len(inputs)
