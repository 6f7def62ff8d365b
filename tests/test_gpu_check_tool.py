"""tools/gpu_check.py --multi-gpu, the parts that need no GPU: the remote-CPU choice, the plan, the
configuration it writes (parsed by shmserve's own parser), the placement verdict on an ``info``
answer, and its client drivers (8 concurrent clients inline and through lanes; a pinned timing
thread) against a real server whose torch model runs on the CPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from shmserve import placement
from shmserve.config import parse

from helpers.server import serving

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

F = frozenset


def test_remote_cpus_are_another_gpus_local_ones_else_the_rest_else_none():
    assert gpu_check.remote_cpus(F(range(8)), F(range(16)), [F(range(8, 16))]) == F(range(8, 16))
    assert gpu_check.remote_cpus(F(range(8)), F(range(12)), [F(range(8, 16))]) == F(range(8, 12))  # allowed only
    assert gpu_check.remote_cpus(F(range(8)), F(range(16)), [F(range(8))]) == F(range(8, 16))  # both GPUs on one node
    assert gpu_check.remote_cpus(F(range(16)), F(range(16)), [F(range(16))]) is None  # one node: nothing is remote


def test_the_plan_says_why_where_nothing_is_remote_or_local_is_unknown():
    local = {"cuda:0": (F(range(8)), "local to cuda:0"), "cuda:1": (F(range(8, 16)), "local to cuda:1")}
    plan = gpu_check.placement_plan(2, F(range(16)), local.get)
    assert plan[0]["local"] == "0-7" and plan[0]["remote"] == "8-15" and plan[1]["remote"] == "0-7"
    plan = gpu_check.placement_plan(2, F(range(16)), lambda d: (None, "no sysfs"))
    assert plan[0]["local"] is None and plan[0]["remote"] is None and "unknown" in plan[0]["remote_why"]
    plan = gpu_check.placement_plan(2, F(range(4)), lambda d: (F(range(4)), "all local"))
    assert plan[1]["remote"] is None and "every CPU" in plan[1]["remote_why"]


def test_the_multi_gpu_config_is_one_shmserve_accepts(tmp_path):
    paths = {"torchscript": str(tmp_path / "conv.pt"), "scale": str(tmp_path / "scale.pt")}
    for p in paths.values():
        Path(p).write_bytes(b"")
    plan = {0: {"local": "0", "remote": "1"}, 1: {"local": "1", "remote": None}}
    config = parse(tomllib.loads(gpu_check.multi_gpu_config("multi", paths, plan)), base_dir=tmp_path)
    models = {m.name: m for m in config.models}
    assert sorted(models) == ["conv0", "conv1", "scale_local_0", "scale_local_1", "scale_remote_0", "spread"]
    assert models["conv0"].device == "cuda:0" and models["conv1"].device == "cuda:1"
    assert models["spread"].placement_devices == ("cuda:0", "cuda:1") and models["spread"].instances == 4
    assert models["scale_remote_0"].cpus == "1" and models["scale_local_0"].cpus == placement.AUTO
    assert models["conv0"].inputs[0].name == "image" and models["spread"].outputs[0].name == "y"


def row(index, model, device, cpus, kernel=None, registered="same", requests=1):
    return {"index": index, "model": model, "device": device, "cpus": cpus, "kernel_cpus": kernel or cpus,
            "registered_device": int(device[5:]) if registered == "same" else registered, "cpus_from": "",
            "requests": requests, "pid": 1}


PLAN = {0: {"local": "0-7", "remote": "8-15"}, 1: {"local": "8-15", "remote": "0-7"}}
GOOD = [row(0, "conv0", "cuda:0", "0-7"), row(1, "conv1", "cuda:1", "8-15"),
        row(2, "spread", "cuda:0", "0-7"), row(3, "spread", "cuda:1", "8-15"), row(4, "spread", "cuda:0", "0-7"),
        row(5, "spread", "cuda:1", "8-15"), row(6, "scale_local_0", "cuda:0", "0-7"),
        row(7, "scale_remote_0", "cuda:0", "8-15")]


def test_the_placement_verdict():
    assert gpu_check.placement_problems(GOOD, PLAN) == []
    bad = list(GOOD)
    bad[1] = row(1, "conv1", "cuda:0", "0-7")  # conv1 on the wrong GPU
    bad[3] = row(3, "spread", "cuda:1", "8-15", kernel="0-15")  # info and the kernel disagree
    bad[4] = row(4, "spread", "cuda:0", "0-7", registered=1)  # registered on another device
    bad[5] = row(5, "spread", "cuda:0", "0-7")  # three of the spread model's four on cuda:0
    bad[7] = row(7, "scale_remote_0", "cuda:0", "0-7")  # not remote after all
    problems = "\n".join(gpu_check.placement_problems(bad, PLAN))
    assert "conv1: workers on ['cuda:0']" in problems and "spread: workers on" in problems
    assert "info says CPUs 8-15, the kernel 0-15" in problems and "registered on device 1" in problems
    assert "scale_remote_0 on cuda:0): CPUs 0-7, expected 8-15" in problems


@pytest.fixture(scope="module")
def cpu_scale_server(tmp_path_factory):
    torch = pytest.importorskip("torch")
    workdir = tmp_path_factory.mktemp("gpu_check_tool")

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2

    path = str(workdir / "scale.pt")
    torch.jit.script(Scale()).save(path)
    with serving(workdir, gpu_check.model_block("scale", path, "cpu", gpu_check.SCALE_SPEC, cpus="0",
                                                instances=2)) as srv:
        yield srv


def test_eight_clients_inline_and_through_lanes_against_the_reference(cpu_scale_server):
    cases = [("scale", "x", "y", lambda x: x * 2, lambda r: (1000 * r + 1,))]
    result = gpu_check.concurrent_clients(cpu_scale_server.socket, cases, clients=8, rounds=2)
    assert result["ok"] and result["checks"] == 32 and not result["failures"], result
    wrong = [("scale", "x", "y", lambda x: x * 3, lambda r: (10,))]
    result = gpu_check.concurrent_clients(cpu_scale_server.socket, wrong, clients=2, rounds=1)
    assert not result["ok"] and len(result["failures"]) == 2 and "client 0 scale round 0" in result["failures"][0]


def test_workers_and_a_timing_from_a_pinned_thread(cpu_scale_server):
    with cpu_scale_server.client() as c:
        rows = gpu_check.worker_rows(c.info())
    assert [(r["model"], r["cpus"], r["kernel_cpus"]) for r in rows] == [("scale", "0", "0")] * 2
    timing = gpu_check.measure_pinned(cpu_scale_server.socket, "scale", "0", n=30, reps=2)
    assert timing["client_cpus"] == "0"
    assert {"4KiB inline p50_us", "4KiB lane p99_us", "16MiB inline GBps", "16MiB lane GBps"} <= set(timing)
    assert all(v > 0 for k, v in timing.items() if k not in ("model", "client_cpus"))


def test_without_torch_it_says_what_it_needs_in_one_line():
    """The issue 28 run-through: after ``make serve`` (no torch in .venv) ``tools/gpu_check.py``
    ended in ModuleNotFoundError's traceback.  It says what it needs and exits 2 (torch hidden
    from the real tool, run as a script)."""
    r = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.modules['torch'] = None; "
                        "sys.argv = ['gpu_check.py', '--quick']; "
                        f"runpy.run_path({str(ROOT / 'tools' / 'gpu_check.py')!r}, run_name='__main__')"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "it needs torch with CUDA" in r.stderr and "pip install" in r.stderr, r.stderr
