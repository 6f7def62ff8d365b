"""Worker processes: spawn, readiness, death, restart with back-off, ordered stop.

Owns: the worker processes of one front-end and their entries in the
arena's worker table.  Learns of a worker's death through a pidfd watched by
the event loop (no SIGCHLD handler, no polling), decodes its exit status,
and restarts it with exponential back-off unless its exit code says a restart
cannot help (``workerlink.NO_RESTART``: the model cannot be loaded).

Workers are spawned as fresh interpreters (``python -m workers.main``), never
forked: a fork of a process that touched CUDA is unusable.

Must not: touch requests or slots; the front-end is told of every death
(``on_exit``) and fails or recovers that worker's requests itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

from shmserve import _atomics as atomics
from shmserve import layout, workerlink
from shmserve.arena import Arena
from shmserve.config import ModelConfig, ServerConfig
from shmserve.rings import EventfdDoorbell, FutexDoorbell, Ring
from shmserve.spec import ModelSpec

log = logging.getLogger("shmserve.supervisor")

STARTING, READY, RESTARTING, FAILED, STOPPED = "starting", "ready", "restarting", "failed", "stopped"


@dataclass(eq=False)
class WorkerHandle:
    index: int  # its entry in the arena's worker table and its rings
    model: ModelConfig
    submissions: Ring
    completions: Ring
    doorbell: FutexDoorbell
    completion_bell: EventfdDoorbell
    state: str = STARTING
    proc: subprocess.Popen | None = None
    pidfd: int | None = None
    control: socket.socket | None = None
    spec: ModelSpec | None = None
    error: str | None = None
    restarts: int = 0
    inflight: set[int] = field(default_factory=set)  # slot indices handed to it
    started_at: float = 0.0
    gpu: dict | None = None  # what a GPU worker registered (device, arena addresses)
    replacing: bool = False  # stopped on purpose to come back with a new config (reload)
    ready_future: asyncio.Future | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


class Supervisor:
    def __init__(self, arena: Arena, config: ServerConfig, completion_fd: int,
                 on_ready: Callable[[WorkerHandle], None], on_exit: Callable[[WorkerHandle, str], None]):
        self.arena, self.config, self.completion_fd = arena, config, completion_fd
        self.on_ready, self.on_exit = on_ready, on_exit
        self.loop = asyncio.get_running_loop()
        self.workers: list[WorkerHandle] = []
        self.stopping = False
        for model in config.models:
            for _ in range(model.instances):
                i = len(self.workers)
                sub, comp = Ring.of_worker(arena, i, False), Ring.of_worker(arena, i, True)
                self.workers.append(WorkerHandle(i, model, sub, comp, FutexDoorbell(sub),
                                                 EventfdDoorbell(comp, completion_fd)))

    async def start_all(self, timeout: float) -> None:
        """Spawn every worker and wait until each is ready or has failed (or ``timeout``)."""
        for w in self.workers:
            self._spawn(w)
        futures = [w.ready_future for w in self.workers]
        done, pending = await asyncio.wait(futures, timeout=timeout)
        for w in self.workers:
            if w.ready_future in pending:
                log.error("worker %d (%s) not ready after %.0f s; stopping it", w.index, w.model.name, timeout)
                w.error = f"not ready after {timeout:.0f} s"
                self._kill(w)

    # -- spawning -------------------------------------------------------------------------

    def _spawn(self, w: WorkerHandle) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = workerlink.worker_argv(instance=self.arena.instance, index=w.index,
                                      model_json=workerlink.encode(w.model.to_dict()),
                                      control_fd=child.fileno(), completion_fd=self.completion_fd,
                                      spin_us=self.config.effective_spin_us())
        base = self.arena.geometry.worker_off(w.index)
        # A worker that died inside FutexDoorbell.wait left its waiter count raised: reset it so
        # the new one does not cost every push a futex_wake.  Nobody else touches it now.
        atomics.store32(self.arena.buf, w.submissions.waiters_offset, 0)
        layout.WORKER.write(self.arena.buf, base, pid=0, state=layout.WORKER_STARTING, restarts=w.restarts,
                            heartbeat_ns=time.monotonic_ns(), device=w.model.device.encode()[:16],
                            name=w.model.name.encode()[:48])
        try:
            w.proc = subprocess.Popen(argv, pass_fds=(child.fileno(), self.completion_fd),
                                      stdin=subprocess.DEVNULL)
        finally:
            child.close()
        layout.WORKER.write(self.arena.buf, base, pid=w.proc.pid)
        atomics.fetch_add32(self.arena.buf, base + layout.WORKER.offset("incarnation"), 1)
        w.control = parent
        w.state = STARTING if w.restarts == 0 else RESTARTING
        w.started_at = time.monotonic()
        w.ready_future = self.loop.create_future()
        w.pidfd = os.pidfd_open(w.proc.pid)
        self.loop.add_reader(w.pidfd, self._on_process_exit, w)
        self.loop.add_reader(parent.fileno(), self._on_control, w)
        log.info("worker %d (%s on %s) started, pid %d", w.index, w.model.name, w.model.device, w.proc.pid)

    def _on_control(self, w: WorkerHandle) -> None:
        try:
            data = w.control.recv(workerlink.CONTROL_MAX)
        except OSError:
            data = b""
        if not data:
            self.loop.remove_reader(w.control.fileno())
            return
        try:
            message = workerlink.decode(data)
        except ValueError:
            log.warning("worker %d sent an unreadable control message", w.index)
            return
        if message["event"] == "ready":
            w.spec = ModelSpec.from_dict(message["spec"])
            w.gpu = message.get("gpu")
            w.state, w.error = READY, None
            log.info("worker %d (%s) ready in %.2f s", w.index, w.model.name, time.monotonic() - w.started_at)
            self.on_ready(w)
            if not w.ready_future.done():
                w.ready_future.set_result(True)
        elif message["event"] == "failed":
            w.error = str(message.get("error"))
            log.error("worker %d (%s): %s", w.index, w.model.name, w.error)

    # -- death ----------------------------------------------------------------------------

    def _on_process_exit(self, w: WorkerHandle) -> None:
        self.loop.remove_reader(w.pidfd)
        os.close(w.pidfd)
        w.pidfd = None
        if w.control is not None:
            self._on_control_drain(w)
        code = w.proc.wait()
        status = (-code) if code < 0 else (code << 8)
        how = workerlink.describe_exit(status)
        layout.WORKER.write(self.arena.buf, self.arena.geometry.worker_off(w.index), state=layout.WORKER_DEAD)
        was_ready = w.state == READY
        if w.replacing and not self.stopping:
            w.replacing = False
            w.state = RESTARTING
            log.info("worker %d (%s) stopped for reload; starting it with the new settings", w.index, w.model.name)
            self.on_exit(w, how)
            if not w.ready_future.done():
                w.ready_future.set_result(False)
            self.loop.call_soon(self._respawn, w)
            return
        if self.stopping:
            w.state = STOPPED
        elif code in workerlink.NO_RESTART:
            w.state = FAILED
        else:
            w.state = RESTARTING
        log.log(logging.INFO if self.stopping else logging.ERROR, "worker %d (%s) pid %d %s",
                w.index, w.model.name, w.proc.pid, how)
        self.on_exit(w, how)
        if not w.ready_future.done():
            w.ready_future.set_result(False)
        if w.state == RESTARTING:
            first, longest = self.config.restart_backoff_s
            delay = min(longest, first * 2 ** min(w.restarts, 16))
            if was_ready and time.monotonic() - w.started_at > 60:
                delay = first  # it ran fine for a while: not a crash loop
            w.restarts += 1
            log.info("restarting worker %d in %.1f s (restart %d)", w.index, delay, w.restarts)
            self.loop.call_later(delay, self._respawn, w)
        elif w.state == FAILED:
            log.error("worker %d (%s) will not be restarted: %s", w.index, w.model.name, w.error or how)

    def _on_control_drain(self, w: WorkerHandle) -> None:
        """Read any last control message (e.g. 'failed'), then close the control socket."""
        w.control.setblocking(False)
        try:
            while True:
                data = w.control.recv(workerlink.CONTROL_MAX)
                if not data:
                    break
                message = workerlink.decode(data)
                if message.get("event") == "failed":
                    w.error = str(message.get("error"))
        except (BlockingIOError, ValueError, OSError):
            pass
        try:
            self.loop.remove_reader(w.control.fileno())
        except (ValueError, OSError):
            pass
        w.control.close()
        w.control = None

    def _respawn(self, w: WorkerHandle) -> None:
        if not self.stopping and w.state == RESTARTING:
            self._spawn(w)

    def replace_model(self, model: ModelConfig) -> None:
        """Restart ``model``'s workers with new settings: each finishes what it has queued first."""
        for w in self.workers:
            if w.model.name != model.name:
                continue
            w.model = model
            if w.proc is not None and w.proc.poll() is None:
                w.replacing = True
                w.submissions.push(layout.STOP_ENTRY)
                w.doorbell.notify()

    def kill(self, w: WorkerHandle) -> None:
        """SIGKILL a worker (wedged); its exit is handled like any other death."""
        self._kill(w, signal.SIGKILL)

    def _kill(self, w: WorkerHandle, sig: int = signal.SIGKILL) -> None:
        if w.proc is not None and w.proc.poll() is None:
            try:
                w.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    # -- stopping -------------------------------------------------------------------------

    async def stop_all(self, timeout: float = 5.0) -> None:
        """Ask every worker to stop (STOP entry), then TERM, then KILL; reap them all."""
        self.stopping = True
        alive = [w for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for w in alive:
            w.submissions.push(layout.STOP_ENTRY)
            w.doorbell.notify()
        for sig, wait in ((None, timeout), (signal.SIGKILL, 5.0)):  # workers ignore SIGTERM
            alive = [w for w in alive if w.proc.poll() is None]
            if not alive:
                break
            if sig is not None:
                for w in alive:
                    self._kill(w, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(w.proc.poll() is None for w in alive):
                await asyncio.sleep(0.02)
        for w in self.workers:
            if w.pidfd is not None:
                self.loop.remove_reader(w.pidfd)
                os.close(w.pidfd)
                w.pidfd = None
            if w.control is not None:
                self.loop.remove_reader(w.control.fileno())
                w.control.close()
                w.control = None
            if w.proc is not None:
                w.proc.wait()
            w.state = STOPPED
