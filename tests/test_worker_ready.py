"""A real worker process's ready message: what it measured of its memory, and what its warm-up ran.

The worker is spawned the way the supervisor spawns it (``workerlink.worker_argv``,
its control socket and completion eventfd inherited) on a real arena, and stopped
with a STOP entry on its ring.
"""

from __future__ import annotations

import os
import socket
import subprocess

from shmserve import layout, workerlink
from shmserve.arena import Arena
from shmserve.config import ModelConfig
from shmserve.rings import FutexDoorbell, Ring
from workers.memory import host_bytes, measured

from helpers.server import TESTS_DIR


def test_a_cpu_workers_ready_message_tells_its_own_resident_memory_and_its_warm_up(instance_name):
    instance = instance_name("ready")
    config = ModelConfig(name="double", backend="python", path="serving_models:double_rows", max_batch_size=4,
                         warmup_requests=3)  # batch sizes 1 and 4, three runs each
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    with Arena.create(instance, slot_count=4, max_workers=1, size_classes=[(4096, 4)], prefault=False) as arena:
        front, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        completion_fd = os.eventfd(0)
        argv = workerlink.worker_argv(instance=instance, index=0, model_json=workerlink.encode(config.to_dict()),
                                      control_fd=child.fileno(), completion_fd=completion_fd, spin_us=0)
        proc = subprocess.Popen(argv, pass_fds=(child.fileno(), completion_fd), stdin=subprocess.DEVNULL, env=env)
        child.close()
        try:
            front.settimeout(60)
            message = workerlink.decode(front.recv(workerlink.CONTROL_MAX))
            now = host_bytes(f"/proc/{proc.pid}/status")  # read from outside, while it waits for work
        finally:
            submissions = Ring.of_worker(arena, 0, completion=False)
            submissions.push(layout.STOP_ENTRY)
            FutexDoorbell(submissions).notify()
            try:
                proc.wait(30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                front.close()
                os.close(completion_fd)
    assert proc.returncode == workerlink.EXIT_OK
    assert message["event"] == "ready" and message["gpu"] is None
    memory = message["memory"]
    assert memory["device_bytes"] == 0  # a CPU worker
    assert memory["host_bytes"] > 1 << 20 and 0.5 < memory["host_bytes"] / now < 2  # measured, as /proc sees it
    assert message["warmup"]["runs"] == 6 and message["warmup"]["seconds"] >= 0


def test_host_bytes_counts_anonymous_and_file_pages_but_not_shared_memory(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmRSS:\t  900 kB\nRssAnon:\t  300 kB\nRssFile:\t  100 kB\nRssShmem:\t  500 kB\n")
    assert host_bytes(str(status)) == 400 * 1024
    status.write_text("VmRSS:\t  900 kB\n")  # a kernel without the split
    assert host_bytes(str(status)) == 900 * 1024
    assert host_bytes(str(tmp_path / "missing")) == 0


def test_device_bytes_are_the_backends_statement_else_the_devices_growth_around_the_load():
    assert measured(7, 100, 900)["device_bytes"] == 7  # torch: its allocator's reserved bytes
    assert measured(None, 100, 900)["device_bytes"] == 800
    assert measured(None, 900, 100)["device_bytes"] == 0  # another process freed memory meanwhile
    assert measured(None, None, None)["device_bytes"] == 0  # a CPU worker
