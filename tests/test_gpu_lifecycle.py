"""The model lifecycle on a GPU: versions swapped under load on cuda:0, device memory measured after
load, and on-demand versions evicted under a device memory budget.

Runs where torch sees a CUDA GPU and cuda-python is installed (the H200 used for docs/gpu.md);
skips with the reason anywhere else.
"""

from __future__ import annotations

import textwrap
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from helpers.gpu import require_gpu  # noqa: E402

torch = require_gpu()

from helpers.server import serving, wait_for  # noqa: E402

MiB = 1 << 20
HELD = 512 * MiB  # what each version holds on the device while loaded

MODULE = textwrap.dedent("""
    import torch

    VERSION = {version}


    def make(config):
        held = torch.empty(config.options["bytes"], dtype=torch.uint8, device=config.device)

        def model(inputs):
            x = torch.from_numpy(inputs["x"]).to(config.device)
            return {{"y": (x + VERSION * 1000).cpu().numpy()}}

        model.held = held
        model.inputs = [{{"name": "x", "dtype": "float32", "shape": ["n"]}}]
        model.outputs = [{{"name": "y", "dtype": "float32", "shape": ["n"]}}]
        return model
""")


def gpu_repository(root, models: dict[str, tuple[int, ...]], *, load: str = "startup"):
    """A repository of GPU python models, each version answering x + 1000 * version and holding HELD bytes."""
    for name, versions in models.items():
        (root / name).mkdir(parents=True)
        (root / name / "config.toml").write_text(
            f'backend = "python"\npath = "gmodel:make"\ndevice = "cuda:0"\nload = "{load}"\n'
            f'options = {{factory = true, bytes = {HELD}}}\n')
        for v in versions:
            (root / name / str(v)).mkdir()
            (root / name / str(v) / "gmodel.py").write_text(MODULE.format(version=v))
    return root


def versions(c, name: str) -> dict[int, dict]:
    return {m["version"]: m for m in c.repository()["models"] if m["name"] == name}


def test_a_gpu_model_is_swapped_under_load_with_every_answer_right_and_its_device_memory_measured(tmp_path):
    repo = gpu_repository(tmp_path / "repo", {"g": (1, 2)})
    with serving(tmp_path, "", server_section=f'model_repository = "{repo}"') as srv:
        with srv.client() as c:
            assert versions(c, "g")[2]["state"] == "ready"
            assert versions(c, "g")[2]["memory_bytes"] >= HELD  # measured on the device, not guessed
            stop, failures, answers = threading.Event(), [], []

            def client():
                with srv.client() as mine:
                    x = np.arange(4, dtype=np.float32)
                    while not stop.is_set():
                        try:
                            y = mine.infer("g", {"x": x})["y"]
                        except Exception as exc:  # any failure is the test's failure
                            failures.append(repr(exc))
                            continue
                        answers.append(int(round(float(y[0]))))
                        assert np.array_equal(y - y[0], x)

            threads = [threading.Thread(target=client) for _ in range(4)]
            for t in threads:
                t.start()
            try:
                for i in range(6):
                    c.load("g", version=1 + i % 2)
            finally:
                stop.set()
                for t in threads:
                    t.join(60)
            assert not failures
            assert set(answers) <= {1000, 2000} and len(set(answers)) == 2
            wait_for(lambda: versions(c, "g")[1]["state"] == "unloaded", "version 1 unloaded")


def test_on_demand_gpu_versions_are_evicted_under_the_device_budget(tmp_path):
    repo = gpu_repository(tmp_path / "repo", {"a": (1,), "b": (1,), "c": (1,)}, load="on_demand")
    budget = 2 * HELD + HELD // 2  # room for two, not three
    with serving(tmp_path, "", server_section=f'model_repository = "{repo}"\n'
                                              f'memory_budget = {{"cuda:0" = {budget}}}') as srv:
        with srv.client() as c:
            x = {"x": np.zeros(2, np.float32)}
            for name in ("a", "b", "c"):
                assert c.infer(name, x, timeout=120)["y"][0] == 1000
            # c's size is measured once it is loaded: then the least recently used (a) is evicted
            wait_for(lambda: versions(c, "a")[1]["state"] == "evicted", "a evicted", timeout=60)
            states = {name: versions(c, name)[1]["state"] for name in ("a", "b", "c")}
            assert states == {"a": "evicted", "b": "ready", "c": "ready"}, states
            assert c.infer("a", x, timeout=120)["y"][0] == 1000  # loaded again, evicting the least recent (b)
            states = {name: versions(c, name)[1]["state"] for name in ("a", "b", "c")}
            assert states == {"a": "ready", "b": "evicted", "c": "ready"}, states
