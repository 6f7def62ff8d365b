"""What a new user's first real models hit, through a real server (issue 15, bugs 5 and 6).

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

from conftest import new_instance, shm_names
from helpers.server import serving

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
