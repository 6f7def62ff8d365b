"""CPU placement with real processes: workers pinned by ``cpus`` (every thread of them), an unpinned
model inheriting the front-end's CPUs, ``cpus_per_worker`` splitting a set, the front-end left
unpinned, all of it in ``info`` and in ``inspect`` (live and after the front-end was killed), a bad
``cpus`` refused by ``serve`` in one line, and a worker whose CPUs the kernel refuses failing
with its named exit code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from shmserve import placement, workerlink
from shmserve.config import ModelConfig

from conftest import shm_names
from helpers.server import TESTS_DIR, ServerProcess

ALLOWED = placement.allowed_cpus()
pytestmark = pytest.mark.skipif(not {0, 1} <= ALLOWED, reason="needs CPUs 0 and 1 allowed to this process")

CONFIG = """
[[models]]
name = "pinned"
backend = "python"
path = "shmserve.models:identity"
cpus = "0"

[[models]]
name = "free"
backend = "python"
path = "shmserve.models:identity"

[[models]]
name = "split"
backend = "python"
path = "shmserve.models:identity"
instances = 2
cpus = "0-1"
cpus_per_worker = 1
"""


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "shmserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def allowed_list(pid: int, task: int | None = None) -> frozenset[int]:
    """A process's (or one of its threads') Cpus_allowed_list, as the kernel says."""
    path = f"/proc/{pid}/status" if task is None else f"/proc/{pid}/task/{task}/status"
    with open(path) as f:
        line = next(line for line in f if line.startswith("Cpus_allowed_list:"))
    return placement.parse_cpulist(line.partition(":")[2])


def test_workers_are_pinned_as_configured_and_info_and_inspect_say_so(tmp_path):
    before = shm_names()
    srv = ServerProcess(tmp_path, CONFIG).start()
    try:
        with srv.client() as c:
            x = np.arange(10, dtype=np.uint8)
            for name in ("pinned", "free", "split", "split"):
                assert np.array_equal(c.infer(name, {"x": x})["y"], x)
            workers = {}
            for w in c.info()["workers"]:
                workers.setdefault(w["model"], []).append(w)
        (pinned,), (free,) = workers["pinned"], workers["free"]
        assert allowed_list(pinned["pid"]) == {0}
        threads = os.listdir(f"/proc/{pinned['pid']}/task")
        assert len(threads) > 1 and all(allowed_list(pinned["pid"], int(t)) == {0} for t in threads)
        assert (pinned["cpus"], pinned["cpus_from"], pinned["device"]) == ("0", "cpus = 0", "cpu")
        assert allowed_list(free["pid"]) == ALLOWED == allowed_list(srv.proc.pid)  # inherits; the front-end is free
        assert free["cpus"] == placement.format_cpulist(ALLOWED) and free["cpus_from"] == "inherited"
        split = sorted(workers["split"], key=lambda w: w["cpus"])
        assert [w["cpus"] for w in split] == ["0", "1"]
        assert [allowed_list(w["pid"]) for w in split] == [{0}, {1}]
        assert split[1]["cpus_from"] == "cpus = 0-1, chunk 1 of 1"
        info_table = cli("info", "--socket", srv.socket)
        assert info_table.returncode == 0 and "cpus" in info_table.stdout, info_table.stderr

        r = cli("inspect", "--instance", srv.instance, "--json")
        assert r.returncode == 0, r.stderr
        live = {w["pid"]: w for w in json.loads(r.stdout)["workers"]}
        assert live[pinned["pid"]]["cpus"] == "0" and live[free["pid"]]["cpus"] is None
        assert [live[w["pid"]]["cpus"] for w in split] == ["0", "1"]
        table = cli("inspect", "--instance", srv.instance)
        assert table.returncode == 0 and "cpus" in table.stdout
    finally:
        srv.kill()  # SIGKILL the front-end: what the worker table keeps after a crash
    dead = json.loads(cli("inspect", "--instance", srv.instance, "--json").stdout)
    assert dead["owner_alive"] is False
    assert sorted((w["model"], w["cpus"]) for w in dead["workers"]) == [
        ("free", None), ("pinned", "0"), ("split", "0"), ("split", "1")]
    assert cli("cleanup", "--instance", srv.instance).returncode == 0
    assert shm_names() == before


@pytest.mark.parametrize("cpus, words", [
    ("4096", "models[0].cpus: CPU 4096 not on this machine"), ("1-0", "models[0].cpus: range '1-0' ends before")])
def test_serve_refuses_bad_cpus_in_one_line(tmp_path, cpus, words):
    config = tmp_path / "bad.toml"
    config.write_text(f'[[models]]\nname = "m"\nbackend = "python"\npath = "shmserve.models:identity"\n'
                      f'cpus = "{cpus}"\n')
    r = cli("serve", "--config", str(config), "--socket", str(tmp_path / "s.sock"))
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_worker_whose_cpus_the_kernel_refuses_fails_with_its_named_exit_code():
    """Past the configuration's checks (a CPU taken offline, a cpuset narrowed after the load)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    config = ModelConfig(name="m", backend="python", path="shmserve.models:identity")
    front, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    completion_fd = os.eventfd(0)
    try:
        argv = workerlink.worker_argv(instance="never-attached", index=0, model_json=workerlink.encode(config.to_dict()),
                                      control_fd=child.fileno(), completion_fd=completion_fd, spin_us=0,
                                      cpus=str(max(placement.online_cpus()) + 1))
        proc = subprocess.run(argv, pass_fds=(child.fileno(), completion_fd), stdin=subprocess.DEVNULL, env=env,
                              timeout=60)
        front.settimeout(5)
        message = workerlink.decode(front.recv(workerlink.CONTROL_MAX))
    finally:
        child.close()
        front.close()
        os.close(completion_fd)
    assert proc.returncode == workerlink.EXIT_PLACEMENT_FAILED and workerlink.EXIT_PLACEMENT_FAILED in workerlink.NO_RESTART
    assert message["event"] == "failed" and "cannot pin to CPUs" in message["error"], message
    assert "change the model's cpus" in message["error"]
