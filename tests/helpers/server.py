"""Run a real `shmserve serve` process on a temporary socket for tests, and stop it cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from shmserve import Client
from shmserve.config import demo_config
from shmserve.errors import ConnectionClosed

TESTS_DIR = Path(__file__).resolve().parent.parent
DEMO_PATH = demo_config().models[0].path


SLOW_MODEL = """
[[models]]
name = "slow"
backend = "python"
path = "serving_models:slow"
"""  # sleeps x[0] seconds, returns 2x

DOUBLE_BATCHED = """
[[models]]
name = "double"
backend = "python"
path = "serving_models:double_rows"
max_batch_size = 8
max_queue_delay_us = 300000
"""  # concurrent requests within 300 ms share a run

BROKEN_MODEL = """
[[models]]
name = "broken"
backend = "python"
path = "serving_models:broken_factory"
[models.options]
factory = true
"""  # its factory raises: it never loads


def standard_models(identity_instances: int = 2) -> str:
    return textwrap.dedent(f"""
        [[models]]
        name = "identity"
        backend = "python"
        path = "shmserve.models:identity"
        instances = {identity_instances}

        [[models]]
        name = "demo"
        backend = "onnxruntime"
        path = "{DEMO_PATH}"

        [[models]]
        name = "slow"
        backend = "python"
        path = "serving_models:slow"

        [[models]]
        name = "nonzero"
        backend = "python"
        path = "shmserve.models:nonzero"

        [[models]]
        name = "fails"
        backend = "python"
        path = "serving_models:fails"

        [[models]]
        name = "wrong_dtype"
        backend = "python"
        path = "serving_models:wrong_dtype"

        [[models]]
        name = "grow"
        backend = "python"
        path = "serving_models:grow"
        max_output_bytes = 4096
    """) + BROKEN_MODEL


class ServerProcess:
    """A `shmserve serve` child.  ``start()`` returns once it answers health checks.

    ``$SHMSERVE_TEST_DOORS`` (a number): every server runs that many door processes unless its
    ``server_section`` says otherwise (the socket tests through the doors: docs/doors.md).
    ``module``: what ``python -m`` runs (``helpers.faults`` wraps door callbacks first);
    ``launcher``: a command the server is run under (it must exec it, so that ``proc.pid`` is the
    server's: ``unshare``); ``env``: more environment variables."""

    def __init__(self, workdir: Path, config_text: str, *, server_section: str = "", socket_dir: Path | None = None,
                 extra_args: list[str] = (), module: str = "shmserve.cli", launcher: list[str] = (),
                 env: dict | None = None):
        self.workdir = workdir
        self.extra_args = list(extra_args)
        self.module, self.launcher, self.env = module, list(launcher), dict(env or {})
        from conftest import new_instance

        self.instance = new_instance("srv")
        self.socket_dir = socket_dir or (workdir / "run")
        self.socket = str(self.socket_dir / "s.sock")
        self.config_path = workdir / f"{self.instance}.toml"
        doors = os.environ.get("SHMSERVE_TEST_DOORS")  # the suite again with door processes (docs/doors.md)
        if doors and "doors =" not in server_section:
            server_section = f"doors = {doors}\n{server_section}"
        self.config_path.write_text(f"[server]\ninstance = \"{self.instance}\"\n{server_section}\n{config_text}")
        self.log_path = workdir / f"{self.instance}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> "ServerProcess":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
               **self.env}  # a test's own PYTHONPATH replaces this one
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([*self.launcher, sys.executable, "-m", self.module, "serve", "--config",
                                      str(self.config_path), "--socket", self.socket, *self.extra_args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with Client(self.socket, timeout=10) as c:
                    c.health()
                return self
            except ConnectionClosed:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.log()}")

    def client(self, timeout: float = 30.0, lanes: bool = True) -> Client:
        return Client(self.socket, timeout=timeout, lanes=lanes)

    def info(self) -> dict:
        with self.client() as c:
            return c.info()

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Wait until no slot and no arena space is in use; returns the last info."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            stats = info["stats"]
            if stats["slots_in_use"] == 0 and stats["extent_bytes_in_use"] == 0:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {stats}")
            time.sleep(0.05)

    def pids(self) -> list[int]:
        """The front-end's pid and its workers' (its children now)."""
        pids = [self.proc.pid]
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                pids.extend(int(p) for p in f.read().split())
        return pids

    def mapped_regions(self) -> dict[int, set[int]]:
        """Which client regions each of the server's processes maps, by pid (from /proc/<pid>/maps:
        a region is a memfd named shmserve.<instance>.r<id>)."""
        marker = f"/memfd:shmserve.{self.instance}.r"
        found = {}
        for pid in self.pids():
            with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
                found[pid] = {int(line.split(marker)[1].split()[0]) for line in f if marker in line}
        return found

    def recorded_regions(self) -> dict[int, dict]:
        """The arena's region records (what ``inspect`` shows), by region id."""
        from shmserve import inspection

        return {r["id"]: r for r in inspection.snapshot(self.instance)["regions"]}

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._log.close()
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        # a SIGKILLed front-end leaves its workers to die of PDEATHSIG; give them a moment
        time.sleep(0.2)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def wait_for(predicate, what: str = "condition", timeout: float = 30.0):
    """``predicate()``'s first true value, polled every 50 ms; AssertionError naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def serving(workdir: Path, config_text: str, **options):
    """A started ServerProcess for a module's tests; on the way out it must stop with exit 0 and
    leave /dev/shm and its socket directory as they were.  It is stopped if the test fails too."""
    from conftest import shm_names

    before = shm_names()
    srv = ServerProcess(workdir, config_text, **options).start()
    try:
        yield srv
    except BaseException:
        srv.stop()  # a failed test leaves no server running (nor its arena behind)
        raise
    code = srv.stop()
    assert code == 0, srv.log()
    assert shm_names() == before, "the server left segments in /dev/shm"
    assert not os.path.exists(srv.socket_dir), "the socket directory it created is still there"


@contextlib.contextmanager
def held_call(server: ServerProcess, model: str, x, started, gate: Path):
    """A call of ``model`` on ``x`` over the socket, in a thread, that holds its worker (a model
    like ``serving_models.gated``) until the block ends: ``started()`` says it runs, ``gate`` is
    the file whose creation lets it finish.  On the way out the gate opens and the call must
    return 2x."""
    answer = {}

    def call():
        with server.client(lanes=False, timeout=60) as c:
            answer["y"] = c.infer(model, {"x": x})["y"]

    thread = threading.Thread(target=call)
    thread.start()
    try:
        wait_for(started, "the held call to run")
        yield
    finally:
        gate.touch()
        thread.join(60)
    assert answer["y"].tolist() == (x * 2).tolist()


def concurrent_infer(server: ServerProcess, model: str, input_name: str, output_name: str, inputs: list) -> list:
    """One client per input, released together by a barrier; returns each one's output."""
    barrier = threading.Barrier(len(inputs))
    results: list = [None] * len(inputs)

    def call(i):
        with server.client() as c:
            barrier.wait()
            results[i] = c.infer(model, {input_name: inputs[i]})[output_name]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def batch_stats(srv: ServerProcess, model: str) -> tuple[int, int]:
    """(runs, requests) of a model, from the arena's batch-size histogram (``shmserve inspect``)."""
    import json

    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "inspect", "--instance", srv.instance, "--json"],
                       capture_output=True, text=True, timeout=60)
    stage = json.loads(r.stdout)["latency_us"][model]["batch_size"]
    return stage["count"], round(stage["count"] * (stage["mean_us"] or 0))


def scrape_text(path: str) -> str:
    """The body of one scrape of a server's metrics endpoint (``serve --metrics PATH``, a Unix
    socket); the answer must be a 200."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return body.decode()
