"""A real worker process's ready message: what it measured of its memory, and what its warm-up ran.

The worker is spawned the way the supervisor spawns it (``workerlink.worker_argv``,
its control socket and completion eventfd inherited) on a real arena, and stopped
with a STOP entry on its ring.  The GPU cases run where torch sees a CUDA GPU and
cuda-python is installed (the H200 of docs/gpu.md) and skip with the reason anywhere else.
"""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from shmserve import layout, workerlink
from shmserve.arena import Arena
from shmserve.config import ModelConfig
from shmserve.rings import FutexDoorbell, Ring
from shmserve.spec import TensorSpec
from workers.memory import host_bytes, measured

from helpers.server import TESTS_DIR


def ready_message(instance: str, config: ModelConfig) -> tuple[dict, int]:
    """Spawn a worker for ``config`` on a new arena ``instance``, as the supervisor does; its first
    control message, and its own resident bytes read from outside while it waits for work.  It is
    stopped with a STOP entry and must exit 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    with Arena.create(instance, slot_count=4, max_workers=1, size_classes=[(4096, 4)], prefault=False) as arena:
        front, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        completion_fd = os.eventfd(0)
        argv = workerlink.worker_argv(instance=instance, index=0, model_json=workerlink.encode(config.to_dict()),
                                      control_fd=child.fileno(), completion_fd=completion_fd, spin_us=0)
        proc = subprocess.Popen(argv, pass_fds=(child.fileno(), completion_fd), stdin=subprocess.DEVNULL, env=env)
        child.close()
        try:
            front.settimeout(120)
            message = workerlink.decode(front.recv(workerlink.CONTROL_MAX))
            now = host_bytes(f"/proc/{proc.pid}/status")
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
    assert proc.returncode == workerlink.EXIT_OK, message
    return message, now


def test_a_cpu_workers_ready_message_tells_its_own_resident_memory_and_its_warm_up(instance_name):
    config = ModelConfig(name="double", backend="python", path="serving_models:double_rows", max_batch_size=4,
                         warmup_requests=3)  # batch sizes 1 and 4, three runs each
    message, now = ready_message(instance_name("ready"), config)
    assert message["event"] == "ready" and message["gpu"] is None
    memory = message["memory"]
    assert memory["device_bytes"] == 0  # a CPU worker
    assert memory["host_bytes"] > 1 << 20 and 0.5 < memory["host_bytes"] / now < 2  # measured, as /proc sees it
    assert message["warmup"]["runs"] == 6 and message["warmup"]["seconds"] >= 0


def needs_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    from workers import cuda

    if cuda.available() is not None:
        pytest.skip(cuda.available())


@pytest.mark.gpu
def test_a_gpu_workers_device_bytes_are_what_its_torch_model_reserved(instance_name, tmp_path):
    needs_gpu()
    from shmserve.models.torchnets import save_models

    config = ModelConfig(
        name="conv", backend="torch", path=save_models(tmp_path)["torchscript"], device="cuda:0", max_batch_size=8,
        inputs=(TensorSpec("image", "float32", ("batch", 3, 32, 32)),),
        outputs=(TensorSpec("scores", "float32", ("batch", 10)),))
    message, _ = ready_message(instance_name("gpuready"), config)
    assert message["event"] == "ready" and message["gpu"]["device"] == 0, message
    assert 0 < message["memory"]["device_bytes"] < 1 << 30  # the caching allocator's reserve: weights, activations
    assert message["warmup"]["runs"] == 2  # batch sizes 1 and 8


@pytest.mark.gpu
def test_a_gpu_workers_device_bytes_are_the_devices_growth_around_a_load_that_cannot_tell(instance_name):
    needs_gpu()
    config = ModelConfig(name="holder", backend="python", path="serving_models:holds_device_memory",
                         device="cuda:0", options={"factory": True, "bytes": 256 << 20})
    message, _ = ready_message(instance_name("gpuhold"), config)
    assert message["event"] == "ready", message
    assert 256 << 20 <= message["memory"]["device_bytes"] < 2 << 30  # its 256 MiB, and what torch set up


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
