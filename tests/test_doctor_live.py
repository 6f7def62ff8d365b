"""`shmserve doctor` through the real command against real servers: models that give themselves away
(thread pools oversubscribing the CPU they are pinned to, inputs whose shape changes on every
call) found, the well-behaved ones beside them not; a dead instance's arena; no server at all,
with a fake machine under --root and a fake nvidia-smi on the PATH; what the server now tells
(limits, thread pools, input signatures, the last hour's windows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shmserve import placement

from conftest import new_instance, shm_names
from helpers.fake_host import GOOD_ROW, FakeHost, fake_nvidia_smi
from helpers.server import DEMO_PATH, TESTS_DIR, ServerProcess, serving, wait_for

ALLOWED = placement.allowed_cpus()
needs_two_cpus = pytest.mark.skipif(not {0, 1} <= ALLOWED, reason="needs CPUs 0 and 1 allowed to this process")

GIVE_AWAY = textwrap.dedent(f"""
    [[models]]
    name = "crowded"
    backend = "onnxruntime"
    path = "{DEMO_PATH}"
    instances = 2
    cpus = "0"
    [models.options]
    intra_op_threads = 4

    [[models]]
    name = "roomy"
    backend = "onnxruntime"
    path = "{DEMO_PATH}"
    cpus = "1"
    [models.options]
    intra_op_threads = 1

    [[models]]
    name = "shifting"
    backend = "python"
    path = "shmserve.models:identity"

    [[models]]
    name = "steady"
    backend = "python"
    path = "shmserve.models:identity"
""")


def doctor(*args, env=None, timeout=120):
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "doctor", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=TESTS_DIR.parent, env=dict(os.environ, COLUMNS="200", **(env or {})))
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    return r


def findings(r) -> list[dict]:
    return json.loads(r.stdout)["findings"]


@needs_two_cpus
def test_doctor_finds_oversubscribed_pools_and_shifting_shapes_and_not_the_models_beside_them(tmp_path):
    with serving(tmp_path, GIVE_AWAY) as srv:
        with srv.client() as c:
            image = np.zeros((1, 3, 32, 32), np.float32)
            for _ in range(4):
                c.infer("crowded", {"image": image})
                c.infer("roomy", {"image": image})
            for n in range(1, 81):  # a new shape on every call
                c.infer("shifting", {"x": np.arange(n, dtype=np.uint8)})
                c.infer("steady", {"x": np.arange(8, dtype=np.uint8)})

            def told():  # a worker tells its counts within a second (when idle: at once)
                workers = {w["model"]: w for w in c.info()["workers"]}
                return workers if (workers["shifting"]["signatures"] or {}).get("new", 0) >= 80 else None

            workers = wait_for(told, "the workers' signature counts")
            info = c.info()
        assert workers["steady"]["signatures"] == {"new": 1, "distinct": 1, "short": 0}
        assert workers["crowded"]["threads"] == {"runtime": "onnxruntime", "intra_op": 4, "inter_op": 1, "env": {}}
        assert info["limits"]["max_connections"] == 512 and info["limits"]["spin_us"] >= 0
        assert info["history"]["models"]["shifting"]["recent"]["stages"]["total"][0] >= 80

        r = doctor("--instance", srv.instance, "--json", "--sample", "0")
        report = json.loads(r.stdout)
        assert report["server"] == "live" and report["schema"] == 1
        assert report["sources"]["settings"] == "the live server's info and models answers"
        found = report["findings"]
        (threads,) = [f for f in found if f["check"] == "placement.threads"]
        assert threads["severity"] == "warning" and threads["title"] == "8 compute threads share 1 CPU"
        assert threads["subject"].count("(crowded v1, cpu") == 2 and "roomy" not in threads["subject"]
        assert "intra_op_threads = 1" in threads["fix"]
        (shapes,) = [f for f in found if f["check"] == "service.shapes"]
        assert shapes["subject"] == "model shifting" and shapes["data"]["new"] >= 80
        assert {f["subject"] for f in found if f["check"] == "service.stages"} >= {
            "model crowded", "model roomy", "model shifting", "model steady"}
        assert not [f for f in found if f["severity"] == "critical"], found
        assert r.returncode == 0

        table = doctor("--instance", srv.instance, "--sample", "0")
        assert table.returncode == 0 and "WARNING  placement.threads  8 compute threads share 1 CPU" in table.stdout
        assert "WARNING  service.shapes  model shifting: inputs arrive in many shapes" in table.stdout
        assert "fix" in table.stdout and "checks ran" in table.stdout
        assert doctor("--instance", srv.instance, "--sample", "0", "--fail-on", "warning").returncode == 1


def test_doctor_reads_a_dead_instance_from_its_arena(tmp_path):
    before = shm_names()
    srv = ServerProcess(tmp_path, "[[models]]\nname = \"m\"\nbackend = \"python\"\npath = \"shmserve.models:identity\"\n")
    srv.start()
    try:
        with srv.client() as c:
            for _ in range(5):
                c.infer("m", {"x": np.arange(4, dtype=np.uint8)})
    finally:
        srv.kill()  # SIGKILL: the arena stays, its owner is gone
    try:
        r = doctor("--instance", srv.instance, "--json", "--sample", "0")
        assert r.returncode == 1, r.stdout
        report = json.loads(r.stdout)
        assert report["server"] == "dead" and report["summary"]["exit_status"] == 1
        (gone,) = [f for f in report["findings"] if f["check"] == "service.workers"]
        assert gone["severity"] == "critical" and gone["title"] == "the instance's front-end is gone"
        assert "cleanup" in gone["fix"]
        (stages,) = [f for f in report["findings"] if f["check"] == "service.stages"]
        assert stages["subject"] == "model m" and "no baseline (a live server keeps one" in stages["evidence"]["measured"]
        checks = {c["id"]: c for c in report["checks"]}
        assert checks["service.shapes"]["status"] == "skipped" and "live instance" in checks["service.shapes"]["why"]
    finally:
        subprocess.run([sys.executable, "-m", "shmserve.cli", "cleanup", "--instance", srv.instance],
                       capture_output=True, timeout=60)
    assert shm_names() == before


def test_doctor_without_a_server_checks_the_host_it_is_given(tmp_path):
    """A fake machine under --root (memlock too low for the GPU model the config names, huge pages
    compacting synchronously) and a fake nvidia-smi on the PATH (persistence mode off)."""
    host = FakeHost(tmp_path / "root").process(4000, memlock=(8 << 20, 8 << 20)).self_is(4000)
    host.thp(defrag="always").cgroup_v2(periods=100).gpu("0000:1b:00.0")
    fake_nvidia_smi(tmp_path / "bin", [dict(GOOD_ROW, persistence_mode="Disabled")])
    engine = tmp_path / "det.plan"
    engine.write_bytes(b"\0" * 64)
    config = tmp_path / "gpu.toml"
    config.write_text(f'[[models]]\nname = "det"\nbackend = "tensorrt"\npath = "{engine}"\ndevice = "cuda:0"\n')
    path = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    instance = new_instance("doc")

    r = doctor("--instance", instance, "--root", str(host.root), "--config", str(config), "--json", "--sample", "0",
               env=path)
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["server"] == "none" and report["root"] == str(host.root)
    assert report["sources"]["settings"] == f"the config {config}"
    got = {(f["check"], f["severity"]) for f in report["findings"]}
    assert {("host.memlock", "critical"), ("host.thp", "warning"), ("gpu.persistence", "warning"),
            ("gpu.engines", "info")} <= got, got
    assert report["sources"]["nvidia_smi"] == str(tmp_path / "bin/nvidia-smi")

    host.process(4000, memlock=("unlimited", "unlimited"))
    r = doctor("--instance", instance, "--root", str(host.root), "--config", str(config), "--sample", "0", env=path)
    assert r.returncode == 0 and "CRITICAL" not in r.stdout and "WARNING  host.thp" in r.stdout
    assert doctor("--instance", instance, "--root", str(host.root), "--config", str(config), "--sample", "0",
                  "--fail-on", "warning", env=path).returncode == 1


def test_doctor_user_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nmax_waiting = -1\n")
    r = doctor("--config", str(bad), "--sample", "0")
    assert r.returncode == 2 and r.stderr.startswith("shmserve doctor: --config: server.max_waiting")
    assert len(r.stderr.strip().splitlines()) == 1
    r = doctor("--sample", "99")
    assert r.returncode == 2 and "must be 0 to 60" in r.stderr
    r = doctor("--help")
    assert r.returncode == 0 and "examples:" in r.stdout
    assert "exit codes:" in r.stdout and "doctor: a critical finding" in r.stdout


def test_doctor_imports_no_cuda_and_no_model_runtime(tmp_path):
    """The operations layer, like the front-end, never imports CUDA or a runtime: a run of every check
    leaves none of them in sys.modules (TensorRT's version comes from package metadata)."""
    code = ("import sys\nfrom shmserve import doctor\n"
            f"doctor.run({new_instance('imp')!r}, sample_s=0)\n"
            "heavy = ('torch', 'onnxruntime', 'tensorrt', 'tensorrt_lean', 'tensorrt_lean_bindings', 'cuda', 'numba')\n"
            "print(','.join(sorted(m for m in heavy if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         cwd=tmp_path).stdout.strip()
    assert out == "", f"doctor imported {out}"
