"""What a new user's first real models hit, through a real server (issue 15, bugs 1, 5 and 6).

* ONNX models as exporters write them: unknown dimensions named ``?`` or
  ``None``, one name (``DynamicDimension.0``) on dimensions of different
  inputs that the runtime does not hold equal.  The server runs whatever
  onnxruntime itself runs, with the same results; named dimensions are held
  equal only where the model's ``check_dims`` asks.
* A backend name no loader answers to, or a python path that is not
  ``module:callable``, stops ``serve`` at start with the key and the
  backends that exist, before any worker or arena.
* A python model next to the config file is found when the server runs
  from another directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shmserve import ErrorCode, ShmserveError

from conftest import new_instance, shm_names
from helpers.server import serving

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

SAME_NAME = "DynamicDimension.0"  # on both inputs and the output; the sizes need not agree


def _save(path, nodes, inputs, outputs):
    graph = helper.make_graph(nodes, path.stem, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _float(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny exported-style models: ``concat`` (two inputs whose leading dimensions share a
    name, joined along it) and ``placeholders`` (dimensions named ``?`` and ``None``, broadcast)."""
    d = tmp_path_factory.mktemp("first_hour_models")
    concat = _save(d / "concat.onnx", [helper.make_node("Concat", ["a", "b"], ["y"], axis=0)],
                   [_float("a", [SAME_NAME, 3]), _float("b", [SAME_NAME, 3])], [_float("y", [SAME_NAME, 3])])
    placeholders = _save(d / "placeholders.onnx", [helper.make_node("Add", ["x", "v"], ["y"])],
                         [_float("x", ["?", "?"]), _float("v", ["None"])], [_float("y", ["?", "None"])])
    return d, concat, placeholders


def _reference(path, inputs):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)[0]


def _config(name, path, extra=""):
    return f'\n[[models]]\nname = "{name}"\nbackend = "onnxruntime"\npath = "{path}"\n{extra}\n'


def test_exported_models_run_whatever_onnxruntime_runs(models):
    d, concat, placeholders = models
    rng = np.random.default_rng(15)
    config = (_config("concat", concat) + _config("placeholders", placeholders)
              + _config("concat_batched", concat, "max_batch_size = 8\nmax_queue_delay_us = 1000")
              + _config("concat_checked", concat, f'check_dims = ["{SAME_NAME}"]')
              + _config("concat_typo", concat, 'check_dims = ["batch"]'))
    cases = [
        ("concat", {"a": rng.standard_normal((192, 3), dtype=np.float32),
                    "b": rng.standard_normal((48, 3), dtype=np.float32)}, concat),
        ("concat", {"a": rng.standard_normal((2, 3), dtype=np.float32),
                    "b": rng.standard_normal((2, 3), dtype=np.float32)}, concat),
        ("concat_batched", {"a": rng.standard_normal((5, 3), dtype=np.float32),
                            "b": rng.standard_normal((1, 3), dtype=np.float32)}, concat),
        ("concat_checked", {"a": rng.standard_normal((4, 3), dtype=np.float32),
                            "b": rng.standard_normal((4, 3), dtype=np.float32)}, concat),
        ("placeholders", {"x": rng.standard_normal((48, 192), dtype=np.float32),
                          "v": rng.standard_normal(192, dtype=np.float32)}, placeholders),
        ("placeholders", {"x": rng.standard_normal((3, 5), dtype=np.float32),
                          "v": rng.standard_normal(1, dtype=np.float32)}, placeholders),
    ]
    with serving(d, config) as srv:
        with srv.client() as c:
            listing = {m["name"]: m for m in c.models()}
            assert listing["placeholders"]["inputs"][0]["shape"] == [None, None]  # '?' and 'None': unnamed
            for model, inputs, path in cases:
                got = c.infer(model, inputs)["y"]
                np.testing.assert_array_equal(got, _reference(path, inputs), err_msg=model)
            with pytest.raises(ShmserveError) as info:  # only where the config asks for it
                c.infer("concat_checked", {k: v for k, v in cases[0][1].items()})
            assert info.value.code is ErrorCode.BAD_SHAPE
            assert "check_dims" in info.value.message and SAME_NAME in info.value.message
            assert listing["concat_typo"]["state"] == "unavailable"
            assert "check_dims names 'batch', which no input" in listing["concat_typo"]["error"]
        srv.wait_idle()


@pytest.mark.parametrize("model,why", [
    ('backend = "onnx"\npath = "m.onnx"', "models[0].backend: no backend 'onnx' (available: "),
    ('backend = "python"\npath = "mymodels.make"', "models[0].path: a python model is 'module:callable'"),
    ('backend = "python"\npath = "no_such_module_i15:make"', "models[0].path: no module 'no_such_module_i15'"),
])
def test_serve_refuses_a_bad_backend_or_python_path_at_start(tmp_path, model, why):
    instance = new_instance("cfg")
    config = tmp_path / "bad.toml"
    config.write_text(f'[server]\ninstance = "{instance}"\n[[models]]\nname = "m"\n{model}\n')
    (tmp_path / "m.onnx").write_bytes(b"")
    before = shm_names()
    done = subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", "--config", str(config),
                           "--socket", str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"configuration error: {why}" in done.stderr
    if "backend" in why:
        assert all(name in done.stderr for name in ("onnxruntime", "python", "torch", "tensorrt"))
    assert "Traceback" not in done.stderr
    assert shm_names() == before and not any(instance in n for n in os.listdir("/dev/shm"))


def test_a_python_model_next_to_the_config_is_served_from_another_directory(tmp_path):
    """The server runs in the test's directory; the module is only beside the config file."""
    (tmp_path / "first_hour_near_config.py").write_text(textwrap.dedent("""
        import numpy as np

        def make(inputs):
            return {"y": inputs["x"] + 1}

        make.inputs = [{"name": "x", "dtype": "float32", "shape": ["n"]}]
        make.outputs = [{"name": "y", "dtype": "float32", "shape": ["n"]}]
    """))
    assert not os.path.exists("first_hour_near_config.py")
    config = '\n[[models]]\nname = "near"\nbackend = "python"\npath = "first_hour_near_config:make"\n'
    with serving(tmp_path, config) as srv:
        with srv.client() as c:
            x = np.arange(5, dtype=np.float32)
            np.testing.assert_array_equal(c.infer("near", {"x": x})["y"], x + 1)
