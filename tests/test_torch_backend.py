"""The torch backend on CPU through a real server: TorchScript and torch.export programs.

(Its CUDA paths, mapped and copy, are in test_gpu.py and tools/gpu_check.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shmserve import ErrorCode, ShmserveError  # noqa: E402

from conftest import shm_names  # noqa: E402
from helpers.server import ServerProcess, concurrent_infer  # noqa: E402
from helpers.torch_models import save_models  # noqa: E402


@pytest.fixture(scope="module")
def torch_server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("torch")
    paths = save_models(workdir)
    paths["halve"] = str(workdir / "halve.pt")
    torch.jit.script(Halve()).save(paths["halve"])
    before = shm_names()
    srv = ServerProcess(workdir, f"""
        [[models]]
        name = "convnet_ts"
        backend = "torch"
        path = "{paths['torchscript']}"
        inputs = [{{name = "image", dtype = "float32", shape = ["batch", 3, 32, 32]}}]
        outputs = [{{name = "scores", dtype = "float32", shape = ["batch", 10]}}]

        [[models]]
        name = "convnet_batched"
        backend = "torch"
        path = "{paths['torchscript']}"
        max_batch_size = 16
        max_queue_delay_us = 200000
        inputs = [{{name = "image", dtype = "float32", shape = ["batch", 3, 32, 32]}}]
        outputs = [{{name = "scores", dtype = "float32", shape = ["batch", 10]}}]

        [[models]]
        name = "convnet_pt2"
        backend = "torch"
        path = "{paths['export']}"

        [[models]]
        name = "halve_bf16"
        backend = "torch"
        path = "{paths['halve']}"
        max_batch_size = 8
        max_queue_delay_us = 200000
        inputs = [{{name = "x", dtype = "bfloat16", shape = ["batch", 4]}}]
        outputs = [{{name = "half", dtype = "bfloat16", shape = ["batch", 4]}},
                   {{name = "wide", dtype = "float32", shape = ["batch", 4]}}]

        [[models]]
        name = "halve_bytes"
        backend = "torch"
        path = "{paths['halve']}"
        inputs = [{{name = "x", dtype = "bytes", shape = ["batch", 4]}}]
        outputs = [{{name = "half", dtype = "bfloat16", shape = ["batch", 4]}},
                   {{name = "wide", dtype = "float32", shape = ["batch", 4]}}]

        [[models]]
        name = "on_gpu"
        backend = "torch"
        path = "{paths['torchscript']}"
        device = "cuda:0"
        inputs = [{{name = "image", dtype = "float32", shape = ["batch", 3, 32, 32]}}]
        outputs = [{{name = "scores", dtype = "float32", shape = ["batch", 10]}}]
    """).start()
    yield srv, paths
    assert srv.stop() == 0, srv.log()
    assert shm_names() == before


class Halve(torch.nn.Module):
    """bfloat16 in; x / 2 in bfloat16 and x widened to float32 out."""

    def forward(self, x):
        return x / 2, x.float()


def bf16_sample(shape, seed):
    import ml_dtypes

    return np.random.default_rng(seed).standard_normal(shape).astype(ml_dtypes.bfloat16)


def reference(path, x):
    module = torch.jit.load(path)
    with torch.inference_mode():
        return module(torch.from_numpy(x)).numpy()


def test_torchscript_and_export_match_torch_run_directly(torch_server):
    srv, paths = torch_server
    rng = np.random.default_rng(7)
    with srv.client() as c:
        models = {m["name"]: m for m in c.models()}
        exported = models["convnet_pt2"]  # a .pt2 program reports its own specs
        assert exported["inputs"][0]["dtype"] == "float32" and exported["inputs"][0]["shape"][1:] == [3, 32, 32]
        assert exported["outputs"][0]["shape"][1:] == [10]
        for batch in (1, 5):
            x = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
            ref = reference(paths["torchscript"], x)
            # Same weights and ops, but the worker may use other thread counts: allow rounding.
            out = c.infer("convnet_ts", {"image": x})["scores"]
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
            out = c.infer("convnet_pt2", {exported["inputs"][0]["name"]: x})[exported["outputs"][0]["name"]]
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
            with c.zero_copy("convnet_ts", {"image": (x.shape, np.float32)}) as call:
                call.inputs["image"][...] = x
                np.testing.assert_allclose(call.run()["scores"], ref, rtol=1e-5, atol=1e-6)


def test_a_gpu_model_without_a_gpu_fails_clearly_and_others_keep_serving(torch_server):
    srv, _ = torch_server
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: test_gpu.py covers it")
    with srv.client() as c:
        listing = {m["name"]: m for m in c.models()}
        assert listing["on_gpu"]["state"] == "unavailable"
        assert "cuda:0" in listing["on_gpu"]["error"]
        with pytest.raises(ShmserveError) as info:
            c.infer("on_gpu", {"image": np.zeros((1, 3, 32, 32), np.float32)})
        assert info.value.code is ErrorCode.MODEL_UNAVAILABLE
        assert c.infer("convnet_ts", {"image": np.zeros((1, 3, 32, 32), np.float32)})["scores"].shape == (1, 10)


def test_batching_through_the_torch_backend(torch_server):
    srv, paths = torch_server
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((1 + i % 3, 3, 32, 32), dtype=np.float32) for i in range(6)]
    results = concurrent_infer(srv, "convnet_batched", "image", "scores", inputs)
    for x, y in zip(inputs, results):
        np.testing.assert_allclose(y, reference(paths["torchscript"], x), rtol=1e-5, atol=1e-6)
    info = srv.info()
    (worker,) = [w for w in info["workers"] if w["model"] == "convnet_batched"]
    assert worker["requests"] == len(inputs)


def test_bfloat16_tensors_are_torch_bfloat16_over_the_same_bytes(torch_server):
    srv, paths = torch_server
    module = torch.jit.load(paths["halve"])
    with srv.client() as c:
        for rows in (1, 3):
            x = bf16_sample((rows, 4), rows)
            half, wide = module(torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16))
            out = c.infer("halve_bf16", {"x": x})
            assert out["half"].dtype == x.dtype and out["wide"].dtype == np.float32
            assert out["half"].view(np.uint16).tolist() == half.view(torch.uint16).numpy().tolist()  # bit for bit
            np.testing.assert_array_equal(out["wide"], wide.numpy())
            with c.zero_copy("halve_bf16", {"x": (x.shape, x.dtype)}) as call:
                call.inputs["x"][...] = x
                np.testing.assert_array_equal(np.array(call.run()["half"]), out["half"])
    inputs = [bf16_sample((1 + i % 3, 4), 10 + i) for i in range(5)]  # batched: rows written in place
    for x, y in zip(inputs, concurrent_infer(srv, "halve_bf16", "x", "half", inputs)):
        np.testing.assert_array_equal(y, (x.astype(np.float32) / 2).astype(x.dtype))


def test_a_torch_model_with_bytes_tensors_does_not_load(torch_server):
    srv, _ = torch_server
    with srv.client() as c:
        listing = {m["name"]: m for m in c.models()}
        assert listing["halve_bytes"]["state"] == "unavailable"
        assert "'x' are declared bytes" in listing["halve_bytes"]["error"]
        assert "python or onnxruntime" in listing["halve_bytes"]["error"]


TORCHVISION_STUB = '''"""A stand-in for torchvision in this test's server only: importing it registers an operator in
torchvision's namespace, as importing torchvision registers torchvision::nms."""
import torch

_lib = torch.library.Library("torchvision", "FRAGMENT")
_lib.define("shmserve_test_twice(Tensor x) -> Tensor")
_lib.impl("shmserve_test_twice", lambda x: x * 2, "CompositeExplicitAutograd")
'''


class CallsTorchvisionOp(torch.nn.Module):
    def forward(self, x):
        return torch.ops.torchvision.shmserve_test_twice(x)


def test_a_torchscript_file_that_calls_torchvision_ops_loads_with_them_registered(tmp_path):
    """A TorchScript file whose code calls an operator of torchvision's namespace (a detector's
    torchvision::nms) loads only if torchvision was imported first: the backend imports it when
    the file's code names it.  Here ``torchvision`` is a package on the server's PYTHONPATH that
    registers such an operator when imported (the real one is not installable beside this CPU
    torch; tests/test_zoo.py serves the real detector where it is)."""
    import os

    from helpers.server import TESTS_DIR, serving

    if not hasattr(torch.ops.torchvision, "shmserve_test_twice"):
        exec(compile(TORCHVISION_STUB, "torchvision stub", "exec"), {})  # to script the model in this process
    path = tmp_path / "calls_torchvision.pt"
    torch.jit.script(CallsTorchvisionOp()).save(str(path))
    stub = tmp_path / "site" / "torchvision"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(TORCHVISION_STUB)
    pythonpath = os.pathsep.join([str(tmp_path / "site"), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])
    with serving(tmp_path, f"""
        [[models]]
        name = "twice"
        backend = "torch"
        path = "{path}"
        inputs = [{{name = "x", dtype = "float32", shape = ["n"]}}]
        outputs = [{{name = "y", dtype = "float32", shape = ["n"]}}]
    """, env={"PYTHONPATH": pythonpath}) as srv:
        with srv.client() as c:
            listing = {m["name"]: m for m in c.models()}
            assert listing["twice"]["state"] == "ready", listing["twice"]
            x = np.arange(5, dtype=np.float32)
            np.testing.assert_array_equal(c.infer("twice", {"x": x})["y"], x * 2)
