"""Third-party backends, found through the ``shmserve.backends`` entry point, in a real server.

A package is installed the way pip leaves one (a module and its
``.dist-info`` with ``entry_points.txt``) in a directory on the server's
PYTHONPATH.  A backend with only ``run_into`` or only ``run`` (no close, no
synchronize, no row splits) serves alone and in batches; an object with
neither fails to load with a clear error, and is not restarted.
"""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest

from shmserve import ErrorCode, ShmserveError

from helpers.server import concurrent_infer, serving
from test_batching import batch_stats

PACKAGE = '''
"""Backends of a third-party package, as the Backend protocol describes them."""

import numpy as np

from shmserve.spec import TensorSpec

SPECS = (TensorSpec("x", "float32", ("batch", None)),), (TensorSpec("y", "float32", ("batch", None)),)


class RowsInto:
    inputs, outputs = SPECS

    def run_into(self, inputs, allocate):
        x = inputs["x"]
        np.multiply(x, 2, out=allocate("y", x.shape, x.dtype))


class RowsRun:
    inputs, outputs = SPECS

    def run(self, inputs):
        return {"y": inputs["x"] * 2}


class Nothing:
    inputs, outputs = SPECS


def rows_into(config):
    return RowsInto()


def rows_run(config):
    return RowsRun()


def nothing(config):
    return Nothing()
'''

CONFIG = """
[[models]]
name = "{backend}{suffix}"
backend = "{backend}"
path = "weights.bin"
max_batch_size = {batch}
max_queue_delay_us = 300000
"""


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The package installed in a directory on the PYTHONPATH the server inherits."""
    site = tmp_path / "site"
    dist = site / "thirdparty_backends-1.0.dist-info"
    dist.mkdir(parents=True)
    (site / "thirdparty_backends.py").write_text(PACKAGE)
    (tmp_path / "weights.bin").write_bytes(b"")  # what the config names; these backends read nothing
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-backends\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""
        [shmserve.backends]
        rows_into = thirdparty_backends:rows_into
        rows_run = thirdparty_backends:rows_run
        nothing = thirdparty_backends:nothing
    """))
    monkeypatch.setenv("PYTHONPATH", f"{site}:{os.environ.get('PYTHONPATH', '')}")
    return tmp_path


def test_backends_with_only_run_or_only_run_into_serve_alone_and_in_batches(installed):
    config = "".join(CONFIG.format(backend=b, suffix=s, batch=n) for b in ("rows_into", "rows_run")
                     for s, n in (("", 0), ("_batched", 8)))
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal((1 + i % 3, 4), dtype=np.float32) for i in range(6)]
    with serving(installed, config) as srv:
        for model in ("rows_into", "rows_run"):
            with srv.client() as c:
                np.testing.assert_array_equal(c.infer(model, {"x": inputs[1]})["y"], inputs[1] * 2)
            for x, y in zip(inputs, concurrent_infer(srv, f"{model}_batched", "x", "y", inputs)):
                np.testing.assert_array_equal(y, x * 2)
            runs, requests = batch_stats(srv, f"{model}_batched")
            assert requests == len(inputs) and runs < len(inputs)  # some of them shared a run


def test_an_object_with_neither_run_nor_run_into_fails_to_load_and_is_not_restarted(installed):
    with serving(installed, CONFIG.format(backend="nothing", suffix="", batch=0)) as srv:
        with srv.client() as c:
            (listing,) = c.models()
            assert listing["state"] == "unavailable"
            assert "Nothing is not a backend: it has neither run nor run_into" in listing["error"]
            with pytest.raises(ShmserveError) as info:
                c.infer("nothing", {"x": np.zeros((1, 4), np.float32)})
            assert info.value.code is ErrorCode.MODEL_UNAVAILABLE
        (worker,) = srv.info()["workers"]
        assert worker["restarts"] == 0
