"""CUDA graphs for torch GPU models through the real server and the real adapter (issue 14 part 3).

The same TorchScript convnet on ``cuda:0`` in copy mode, once with CUDA
graphs (the default) and once with ``cuda_graphs = false``: identical
outputs, bit for bit, at the buckets' batch sizes (captured at warm-up) and
at one outside them (eager); in the adapter, which path each ran
(``runs``), and that the captures' pools are in the model's device bytes
(one process: both adapters share its caching allocator);
through the server, that the graphs model's measured footprint is larger by
them.  Runs where torch sees a CUDA GPU and cuda-python is installed; skips
with the reason anywhere else.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from helpers.gpu import require_gpu  # noqa: E402

torch = require_gpu()

from conftest import shm_names  # noqa: E402
from helpers.server import ServerProcess  # noqa: E402
from shmserve.config import ModelConfig  # noqa: E402
from shmserve.models.torchnets import save_models  # noqa: E402
from shmserve.spec import TensorSpec  # noqa: E402
from workers.adapter import BackendAdapter  # noqa: E402

IMAGE = TensorSpec("image", "float32", ("batch", 3, 32, 32))
SCORES = TensorSpec("scores", "float32", ("batch", 10))
SPEC = 'inputs = [{name = "image", dtype = "float32", shape = ["batch", 3, 32, 32]}]\n' \
       'outputs = [{name = "scores", dtype = "float32", shape = ["batch", 10]}]'


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("gpu_graphs"))


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    before = shm_names()
    models = "".join(f"""
        [[models]]
        name = "{name}"
        backend = "torch"
        path = "{paths['torchscript']}"
        device = "cuda:0"
        io_mode = "copy"
        max_batch_size = 8
        preferred_batch_sizes = [4]
        {SPEC}
        [models.options]
        cuda_graphs = {flag}
        """ for name, flag in (("graphs", "true"), ("eager", "false")))
    srv = ServerProcess(tmp_path_factory.mktemp("gpu_graphs_srv"), models).start(timeout=180)
    yield srv
    assert srv.stop() == 0, srv.log()
    assert shm_names() == before


def _adapter(path, **options):
    config = ModelConfig(name="m", backend="torch", path=path, device="cuda:0", io_mode="copy", max_batch_size=8,
                         preferred_batch_sizes=(4,), inputs=(IMAGE,), outputs=(SCORES,), options=options)
    adapter = BackendAdapter.load(config)
    adapter.warm_up(config, adapter.prepare(config))
    return adapter


def _run(adapter, image):
    out = {}
    adapter.run_into({"image": image}, lambda name, shape, dtype: out.setdefault(name, np.empty(shape, dtype)))
    adapter.synchronize()
    return out["scores"]


def test_graph_and_eager_paths_agree_bit_for_bit_in_the_adapter(paths):
    graphs, eager = _adapter(paths["torchscript"]), _adapter(paths["torchscript"], cuda_graphs=False)
    g = graphs.backend
    assert g.graphs_off is None and g.runs == {"graph": 3, "eager": 0}  # warmed (and captured) at 1, 4, 8
    assert eager.backend.graphs_off == "cuda_graphs = false"
    rng = np.random.default_rng(14)
    for batch in (1, 4, 8, 3, 8, 1):
        image = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
        before = dict(g.runs)
        got, want = _run(graphs, image), _run(eager, image)
        assert got.tobytes() == want.tobytes(), batch
        assert g.runs["graph" if batch in (1, 4, 8) else "eager"] == before["graph" if batch in (1, 4, 8)
                                                                           else "eager"] + 1
    assert g.graph_pool_bytes > 0 and g.device_bytes() >= g.graph_pool_bytes  # the pools are in the footprint
    graphs.close()
    eager.close()


def test_graph_and_eager_models_agree_through_the_server_and_the_footprint_counts_the_pools(server):
    rng = np.random.default_rng(15)
    with server.client() as c:
        for batch in (1, 4, 8, 3, 5):  # 3 and 5 are outside the buckets: eager on both
            image = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
            got = c.infer("graphs", {"image": image})["scores"]
            assert got.tobytes() == c.infer("eager", {"image": image})["scores"].tobytes(), batch
            with c.zero_copy("graphs", {"image": (image.shape, np.float32)}) as call:
                call.inputs["image"][...] = image
                assert call.run()["scores"].tobytes() == got.tobytes(), batch
        memory = {m["name"]: m["memory_bytes"] for m in c.repository()["models"]}
    assert memory["graphs"] > memory["eager"] > 0, memory
