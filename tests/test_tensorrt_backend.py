"""The TensorRT backend: what runs without TensorRT's builder or a GPU, and engine execution where both exist.

Here and on the H200 used for docs/gpu.md only the lean runtime
(tensorrt-lean-cu13) is installable: it imports and creates a runtime, but
cannot build engines, and without a GPU it cannot initialize CUDA.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from shmserve.config import ModelConfig
from workers.backends import find
from workers.backends.tensorrt import TensorRTBackend, import_tensorrt


def cfg(tmp_path, device="cuda:0", data=b"definitely not an engine", io_mode="copy"):
    path = tmp_path / "model.engine"
    path.write_bytes(data)
    return ModelConfig(name="trt", backend="tensorrt", path=str(path), device=device, io_mode=io_mode)


def test_found_by_name():
    assert find("tensorrt").__module__ == "workers.backends.tensorrt"


def test_refuses_a_cpu_device(tmp_path):
    with pytest.raises(ValueError, match="run on a GPU"):
        TensorRTBackend(cfg(tmp_path, device="cpu"))


def test_says_how_to_install_when_missing():
    code = ("import sys\nfor m in ('tensorrt', 'tensorrt_lean', 'tensorrt_lean_bindings'):\n    sys.modules[m] = None\n"
            "from workers.backends.tensorrt import import_tensorrt\n"
            "try:\n    import_tensorrt()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "TensorRT is not installed" in out and "pip install" in out


def test_lean_runtime_imports_and_reports_why_it_cannot_run(tmp_path):
    try:
        trt = import_tensorrt()
    except ImportError as exc:
        pytest.skip(f"neither tensorrt nor tensorrt_lean is installed: {exc}")
    assert hasattr(trt, "Runtime") and hasattr(trt, "ILogger")
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    # In a child process: a runtime whose CUDA start failed crashes TensorRT 11.4 lean when it
    # is destroyed at exit, which the worker avoids (os._exit) and this test must not inherit.
    config = cfg(tmp_path)
    code = ("import sys\nfrom shmserve.config import ModelConfig\nfrom workers.backends.tensorrt import TensorRTBackend\n"
            f"c = ModelConfig(name='trt', backend='tensorrt', path={config.path!r}, device='cuda:0')\n"
            "try:\n    TensorRTBackend(c)\nexcept Exception as e:\n    print(type(e).__name__, e, flush=True)\n"
            "import os\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    if has_gpu:
        assert "not a TensorRT engine" in out or "cuda-python" in out, out
    else:
        assert out.startswith("RuntimeError") and "cannot start" in out and "CUDA" in out, out


def _full_tensorrt_and_gpu():
    try:
        import tensorrt as trt  # the full package, with the builder
        import torch
    except ImportError:
        return None, "the full TensorRT package (with its builder) is not installed"
    if not torch.cuda.is_available():
        return None, "no CUDA GPU"
    return trt, ""


@pytest.mark.gpu
@pytest.mark.parametrize("io_mode", ["mapped", "copy"])
def test_engine_runs_through_the_server(tmp_path, io_mode):
    trt, why = _full_tensorrt_and_gpu()
    if trt is None:
        pytest.skip(why)
    from helpers.server import ServerProcess

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    x = network.add_input("x", trt.float32, (-1, 16))
    relu = network.add_activation(x, trt.ActivationType.RELU)
    relu.get_output(0).name = "y"
    network.mark_output(relu.get_output(0))
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 16), (8, 16), (64, 16))
    config.add_optimization_profile(profile)
    engine = tmp_path / "relu.engine"
    engine.write_bytes(bytes(builder.build_serialized_network(network, config)))
    srv = ServerProcess(tmp_path, f"""
        [[models]]
        name = "relu"
        backend = "tensorrt"
        path = "{engine}"
        device = "cuda:0"
        io_mode = "{io_mode}"
    """).start()
    try:
        with srv.client() as c:
            data = np.random.default_rng(0).standard_normal((5, 16), dtype=np.float32)
            np.testing.assert_array_equal(c.infer("relu", {"x": data})["y"], np.maximum(data, 0))
            from shmserve import ErrorCode, ShmserveError
            with pytest.raises(ShmserveError) as info:
                c.infer("relu", {"x": np.zeros((65, 16), np.float32)})  # outside the profile
            assert info.value.code is ErrorCode.MODEL_ERROR and "profile" in info.value.message
    finally:
        assert srv.stop() == 0, srv.log()
