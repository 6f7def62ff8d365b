"""GPU placement on a real GPU: cuda:N found in /proc and /sys is the device torch calls cuda:N, a
GPU model's workers are pinned to the CPUs local to their GPU by default, and (two GPUs) a model
spread over both runs each worker on its own device with its own GPU's CPUs.

Runs where torch sees a CUDA GPU and cuda-python is installed; skips with the reason anywhere
else.  On a machine with two GPUs: ``python -m pytest -q tests/test_gpu_placement.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
from helpers.gpu import require_gpu  # noqa: E402

torch = require_gpu()

from helpers.server import serving  # noqa: E402
from shmserve import placement  # noqa: E402

SCALE_SPEC = 'inputs = [{name = "x", dtype = "float32", shape = ["n"]}]\n' \
             'outputs = [{name = "y", dtype = "float32", shape = ["n"]}]'


def torch_bus_id(index: int) -> str:
    """cuda:<index>'s PCI address as CUDA itself reports it (through torch)."""
    props = torch.cuda.get_device_properties(index)
    if not hasattr(props, "pci_bus_id"):
        pytest.skip("this torch does not report PCI bus ids")
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def expected_cpus(index: int) -> frozenset[int]:
    """The CPUs local to cuda:<index> (sysfs, at torch's bus id) that this process may use."""
    local = placement.pci_local_cpus(torch_bus_id(index))
    assert local, f"no local_cpulist for {torch_bus_id(index)}"
    return (local & placement.allowed_cpus()) or placement.allowed_cpus()


def allowed_list(pid: int) -> frozenset[int]:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("Cpus_allowed_list:"))
    return placement.parse_cpulist(line.partition(":")[2])


@pytest.fixture(scope="module")
def scale_path(tmp_path_factory):
    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2

    path = tmp_path_factory.mktemp("gpu_placement") / "scale.pt"
    torch.jit.script(Scale()).save(str(path))
    return str(path)


def test_cuda_ordinals_found_without_cuda_are_the_devices_cuda_numbers():
    gpus = placement.nvidia_gpus()
    for index in range(torch.cuda.device_count()):
        gpu, why = placement.cuda_gpu(index, gpus, os.environ)
        assert gpu is not None, why
        assert gpu.bus_id == torch_bus_id(index), (index, gpus)


def test_a_gpu_models_workers_run_on_its_local_cpus_by_default(tmp_path, scale_path):
    with serving(tmp_path, f"""
        [[models]]
        name = "scale"
        backend = "torch"
        path = "{scale_path}"
        device = "cuda:0"
        instances = 2
        {SCALE_SPEC}
    """, ) as srv:
        x = np.arange(1000, dtype=np.float32)
        with srv.client() as c:
            assert np.array_equal(c.infer("scale", {"x": x})["y"], x * 2)
            workers = [w for w in c.info()["workers"] if w["model"] == "scale"]
        want = expected_cpus(0)
        live = {w["pid"]: w for w in json.loads(subprocess.run(
            [sys.executable, "-m", "shmserve.cli", "inspect", "--instance", srv.instance, "--json"],
            capture_output=True, text=True, check=True).stdout)["workers"]}
        for w in workers:
            assert allowed_list(w["pid"]) == want
            assert w["cpus"] == placement.format_cpulist(want) and w["device"] == "cuda:0"
            assert w["cpus_from"].startswith(f"local to cuda:0 (PCI {torch_bus_id(0)})"), w["cpus_from"]
            assert live[w["pid"]]["cpus"] == placement.format_cpulist(want)
            assert w["gpu"]["device"] == 0


def test_a_model_spread_over_two_gpus_runs_each_worker_on_its_own_with_its_cpus(tmp_path, scale_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with serving(tmp_path, f"""
        [[models]]
        name = "spread"
        backend = "torch"
        path = "{scale_path}"
        device = ["cuda:0", "cuda:1"]
        instances = 4
        {SCALE_SPEC}
    """) as srv:
        x = np.arange(4096, dtype=np.float32)
        with srv.client() as c:
            for _ in range(16):
                assert np.array_equal(c.infer("spread", {"x": x})["y"], x * 2)
            workers = sorted((w for w in c.info()["workers"] if w["model"] == "spread"), key=lambda w: w["index"])
        assert [w["device"] for w in workers] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
        for w in workers:
            index = int(w["device"].partition(":")[2])
            assert w["gpu"]["device"] == index  # the worker's own report of the device it registered on
            assert allowed_list(w["pid"]) == expected_cpus(index)
            assert w["cpus"] == placement.format_cpulist(expected_cpus(index))
