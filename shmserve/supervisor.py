"""Worker processes: spawn, readiness, health, death, restart with back-off, ordered stop.

Owns: the worker processes of one front-end, their entries in the arena's
worker table, their health, and the order of commands on their submission
rings.  Learns of a worker's death through a pidfd watched by the event loop
(no SIGCHLD handler, no polling), decodes its exit status, and restarts it
with exponential back-off unless its exit code says a restart cannot help
(``workerlink.NO_RESTART``: the model cannot be loaded).  A ready worker
whose heartbeat (a thread in every worker) stops for ``worker_timeout_s`` is
*wedged*, and terminated then and so restarted: SIGKILL at once if the
kernel says it is stopped (SIGSTOP: it could not act on SIGTERM), else
SIGTERM and SIGKILL ``TERM_GRACE_S`` later.  Its replacement starts after the
restart delay, as for any other death.

Back-off: the delay before a restart doubles with the worker's *crash
streak* — its deaths in a row, each before it had served
``restart_healthy_s`` — from the first delay of ``restart_backoff_s`` to the
longest.  A worker that has served ``restart_healthy_s`` is healthy: its
streak is 0 again, so a kill from outside costs one short delay, however
many came before.  A streak of ``workerlink.CRASH_LOOP_DEATHS`` is a crash loop: logged,
and shown by health, info and inspect (the worker table carries the streak
and the time of the next start).

Workers are spawned as fresh interpreters (``python -m workers.main``), never
forked: a fork of a process that touched CUDA is unusable.

Placement (``shmserve.placement``): a worker's device (a model's workers go
round-robin over its devices) and the CPUs it pins itself to are decided once,
when its handle is made, and kept across its restarts; the worker table
records both, the worker reports them back when ready.  The front-end itself
is never pinned.

Workers come and go while serving (``add_worker``, ``retire``): each takes a
free entry of the arena's worker table (``max_workers``) and gives it back
once it has exited and the front-end has been told.  A retired worker gets a
STOP entry behind whatever it has queued (it finishes that first); if it has
not exited within its drain time it is terminated.

A worker's life is one transition table (``WorkerState``):

Rules
-----
==========  ==========  ===============================================
from        to          when
==========  ==========  ===============================================
STARTING    READY       it reported its model loaded and warmed
RESTARTING  READY       the same, after a restart
STARTING    RESTARTING  it died before it was ready (restart after back-off)
READY       RESTARTING  it died or was terminated as wedged
RESTARTING  RESTARTING  it died again before it was ready
STARTING    FAILED      its exit code says a restart cannot help
READY       FAILED      (NO_RESTART): the model cannot be loaded, or the
RESTARTING  FAILED      arena cannot be used
any         STOPPED     the supervisor stopped it (shutdown), or it was
                        retired (scaled down, its version unloaded)
==========  ==========  ===============================================

Must not: touch requests or slots; the front-end is told of every death
(``on_exit``) and fails or recovers that worker's requests itself.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from shmserve import _atomics as atomics
from shmserve import layout, placement, workerlink
from shmserve.arena import Arena
from shmserve.config import ModelConfig, ServerConfig
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.rings import EventfdDoorbell, FutexDoorbell, Ring
from shmserve.spec import ModelSpec

log = logging.getLogger("shmserve.supervisor")

MAX_BACKOFF_DOUBLINGS = 16  # restart delay = first * 2**restarts, capped by the longest delay anyway
HEALTH_CHECK_S = 0.25  # how often heartbeats are read (a fraction of any sensible worker_timeout_s)
TERM_GRACE_S = 2.0  # after SIGTERM, how long a worker may take before SIGKILL
COMMAND_RETRY_S = 0.001  # a full submission ring: try the command again this much later


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


class IllegalTransition(RuntimeError):
    """A worker state change the table does not allow: a bug in the supervisor."""


W = WorkerState
TRANSITIONS: frozenset[tuple[WorkerState, WorkerState]] = frozenset({
    (W.STARTING, W.READY), (W.RESTARTING, W.READY),
    (W.STARTING, W.RESTARTING), (W.READY, W.RESTARTING), (W.RESTARTING, W.RESTARTING),
    (W.STARTING, W.FAILED), (W.READY, W.FAILED), (W.RESTARTING, W.FAILED),
    *((state, W.STOPPED) for state in W),
})
del W

# The names other modules use for the states (``w.state == READY``).
STARTING, READY, RESTARTING, FAILED, STOPPED = (WorkerState.STARTING, WorkerState.READY, WorkerState.RESTARTING,
                                                WorkerState.FAILED, WorkerState.STOPPED)


@dataclass(eq=False)
class WorkerHandle:
    index: int  # its entry in the arena's worker table and its rings
    model: ModelConfig
    submissions: Ring
    completions: Ring
    doorbell: FutexDoorbell
    completion_bell: EventfdDoorbell
    state: WorkerState = WorkerState.STARTING
    proc: subprocess.Popen | None = None
    pidfd: int | None = None
    control: socket.socket | None = None
    spec: ModelSpec | None = None
    error: str | None = None
    restarts: int = 0
    crash_streak: int = 0  # deaths in a row, each before it had served restart_healthy_s (the back-off exponent)
    last_exit: str | None = None  # how its last process ended ("killed by SIGKILL", "exit 1 (error)")
    restart_at: float | None = None  # time.monotonic() of its scheduled restart; None when none is scheduled
    inflight: set[int] = field(default_factory=set)  # the dispatcher's: arena slots handed to it
    started_at: float = 0.0
    gpu: dict | None = None  # what a GPU worker registered (device, arena addresses)
    memory: dict | None = None  # what it uses once loaded and warmed: {"host_bytes": n, "device_bytes": n}
    warmup: dict | None = None  # its warm-up: {"runs": n, "seconds": s}
    retiring: bool = False  # being stopped for good (scale down, unload): takes nothing new
    stopped_future: asyncio.Future | None = None  # done once it has exited and its entry is free again
    terminating: bool = False  # TERM sent (wedged or stopping); KILL follows unless it exits
    ready_future: asyncio.Future | None = None
    placement: placement.Placement | None = None  # its device and CPUs, decided when the handle was made
    reported: dict | None = None  # where its process said it runs when ready: {"device": …, "cpus": "0-3", "threads": …}
    signatures: dict | None = None  # input signatures its process met: {"new", "distinct"} (doctor), and
    # "short": its runs whose outputs outgrew the space reserved for them (each run again: shmserve.reservations)

    @property
    def device(self) -> str:
        """The one device this worker runs its model on."""
        return self.placement.device if self.placement is not None else self.model.device

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def crash_looping(self) -> bool:
        """Died ``workerlink.CRASH_LOOP_DEATHS`` times in a row without serving healthily in between."""
        return self.crash_streak >= workerlink.CRASH_LOOP_DEATHS

    def restart_in(self, now: float) -> float | None:
        """Seconds until its scheduled restart (``now``: time.monotonic()); None if none is scheduled."""
        return None if self.restart_at is None else max(0.0, self.restart_at - now)

    def set_state(self, state: WorkerState) -> None:
        """Move to ``state``; IllegalTransition if the table forbids it (staying put is allowed)."""
        if state != self.state and (self.state, state) not in TRANSITIONS:
            raise IllegalTransition(f"worker {self.index}: {self.state.name} -> {state.name} is not allowed")
        self.state = state


def process_stopped(pid: int | None) -> bool:
    """Whether the kernel says process ``pid`` is stopped (state T: SIGSTOP, SIGTSTP) or traced
    (t); False if it cannot tell (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (OSError, TypeError):
        return False
    return stat[stat.rfind(b")") + 2:][:1] in (b"T", b"t")  # the state follows the (comm) field


class Supervisor:
    def __init__(self, arena: Arena, config: ServerConfig, completion_fd: int,
                 on_ready: Callable[[WorkerHandle], None], on_exit: Callable[[WorkerHandle, str], None]):
        self.arena, self.config, self.completion_fd = arena, config, completion_fd
        self.on_ready, self.on_exit = on_ready, on_exit
        self.on_dropped: Callable[[WorkerHandle, object], None] = lambda w, region: None  # RegionTable.worker_dropped
        self.on_lane_failed: Callable[[WorkerHandle, object, str], None] = lambda w, region, why: None
        self.loop = asyncio.get_running_loop()
        self.workers: list[WorkerHandle] = []  # every worker with an entry in the table, in entry order
        self.free_entries = list(range(arena.geometry.max_workers - 1, -1, -1))
        self.stopping = False
        self.local_cpus: Callable[[str], tuple] = placement.gpu_local_cpus  # a GPU's local CPUs (sysfs)
        self.stopped: Callable[[int | None], bool] = process_stopped  # whether a pid is stopped (/proc)
        self._local: dict[str, tuple] = {}  # device -> local_cpus(device), looked up once

    # -- coming and going -----------------------------------------------------------------

    def add_worker(self, model: ModelConfig) -> WorkerHandle:
        """Start a worker for ``model`` in a free entry of the worker table; its ``ready_future``
        says whether it became ready.  OVERLOADED (naming ``max_workers``) when the table is full."""
        w = self.new_handle(model)
        self._spawn(w)
        return w

    def new_handle(self, model: ModelConfig) -> WorkerHandle:
        """The handle of a worker for ``model`` in a free entry of the worker table (its rings,
        counters and histograms emptied), not started yet.  OVERLOADED when the table is full."""
        if not self.free_entries:
            raise ShmserveError(ErrorCode.OVERLOADED, f"all {self.arena.geometry.max_workers} worker entries are in "
                                                      f"use (server.max_workers); stop a model or raise it")
        i = self.free_entries.pop()
        sub, comp = Ring.of_worker(self.arena, i, False), Ring.of_worker(self.arena, i, True)
        sub.discard()  # a predecessor's leftovers: nobody else touches these rings now
        comp.discard()
        self.arena.geometry.clear_worker_histograms(self.arena.buf, i)
        layout.WORKER.write(self.arena.buf, self.arena.geometry.worker_off(i), requests=0, errors=0, restarts=0,
                            crash_streak=0)
        w = WorkerHandle(i, model, sub, comp, FutexDoorbell(sub), EventfdDoorbell(comp, self.completion_fd))
        w.placement = self.place(model)
        w.stopped_future = self.loop.create_future()
        self.workers.append(w)
        self.workers.sort(key=lambda h: h.index)
        w.completion_bell.arm()  # its first completion must wake the loop
        return w

    def place(self, model: ModelConfig) -> placement.Placement:
        """Where a new worker of ``model`` goes, given where its live siblings are: the workers of
        the same version with the same placement settings (a scale changes ``instances`` in the
        version's config, not in its running workers')."""
        mine = (model.key, model.placement_devices, model.cpus, model.cpus_per_worker)
        siblings = [h.placement for h in self.workers if not h.retiring and h.placement is not None
                    and (h.model.key, h.model.placement_devices, h.model.cpus, h.model.cpus_per_worker) == mine]
        return placement.place(model.placement_devices, model.cpus, model.cpus_per_worker, siblings,
                               self._local_cpus, placement.allowed_cpus())

    def _local_cpus(self, device: str) -> tuple:
        if device not in self._local:
            self._local[device] = found = self.local_cpus(device)
            if found[0] is None:
                log.warning("%s: its workers are not pinned (no cpus set, and its local CPUs are unknown: %s)",
                            device, found[1])
        return self._local[device]

    async def wait_ready(self, workers: list[WorkerHandle], timeout: float) -> bool:
        """Wait until each of ``workers`` is ready or has failed (a worker not ready after
        ``timeout`` is killed); whether all are ready."""
        futures = [w.ready_future for w in workers if w.ready_future is not None]
        if futures:
            _, pending = await asyncio.wait(futures, timeout=timeout)
            for w in workers:
                if w.ready_future in pending:
                    log.error("worker %d (%s) not ready after %.0f s; stopping it", w.index, w.model.key, timeout)
                    w.error = f"not ready after {timeout:.0f} s"
                    self._signal(w, signal.SIGKILL)
        return all(w.state == READY for w in workers)

    def retire(self, w: WorkerHandle, drain_s: float, before: Callable[[], object] = lambda: None) -> asyncio.Future:
        """Stop ``w`` for good: it takes nothing new, finishes what it has queued (a STOP entry
        behind it, after the commands ``before`` pushes once it is marked retiring), and is
        terminated if it has not exited within ``drain_s``.  The future is done once it has
        exited, the front-end has been told, and its entry is free."""
        if not w.retiring:
            w.retiring = True
            before()
            if w.alive:
                self.command(w, layout.STOP_ENTRY)
                self.loop.call_later(drain_s, self._retire_overdue, w, w.proc)
            else:  # failed, or waiting to be restarted: nothing runs
                self.loop.call_soon(self._free, w)
        return w.stopped_future

    def _retire_overdue(self, w: WorkerHandle, proc: subprocess.Popen) -> None:
        if w.proc is proc and proc.poll() is None:
            log.warning("worker %d (%s) did not finish its queue within its drain time; terminating it",
                        w.index, w.model.key)
            self.terminate(w)

    def _free(self, w: WorkerHandle) -> None:
        """``w`` was retired and has exited: give its entry back."""
        if w in self.workers:
            w.set_state(STOPPED)
            self.workers.remove(w)
            layout.WORKER.write(self.arena.buf, self.arena.geometry.worker_off(w.index), state=layout.WORKER_EMPTY,
                                pid=0)
            self.free_entries.append(w.index)
        if not w.stopped_future.done():
            w.stopped_future.set_result(True)

    # -- commands -------------------------------------------------------------------------

    def command(self, w: WorkerHandle, entry: int) -> None:
        """Push a command entry (``layout.command_entry``) on a worker's submission ring and ring it;
        retried shortly if the ring is full.  Dropped for a worker that is not running: a dead
        worker's ring is discarded and its successor starts with no lanes."""
        if w.state not in (STARTING, READY, RESTARTING) or not w.alive or w.pidfd is None:
            return
        if w.submissions.push(entry):
            w.doorbell.notify()
        else:
            self.loop.call_later(COMMAND_RETRY_S, self.command, w, entry)

    # -- spawning -------------------------------------------------------------------------

    def _spawn(self, w: WorkerHandle) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        where = w.placement
        argv = workerlink.worker_argv(instance=self.arena.instance, index=w.index,
                                      model_json=workerlink.encode(replace(w.model, device=where.device,
                                                                           devices=()).to_dict()),
                                      control_fd=child.fileno(), completion_fd=self.completion_fd,
                                      spin_us=self.config.effective_spin_us(), cpus=where.cpulist)
        cpu_count, cpu_mask = layout.encode_cpu_mask(where.cpus)
        base = self.arena.geometry.worker_off(w.index)
        # A worker that died inside FutexDoorbell.wait left its waiter count raised: reset it so
        # the new one does not cost every push a futex_wake.  Nobody else touches it now.
        atomics.store32(self.arena.buf, w.submissions.waiters_offset, 0)
        w.restart_at = None
        w.signatures = None  # the new process counts its own
        layout.WORKER.write(self.arena.buf, base, pid=0, state=layout.WORKER_STARTING, restarts=w.restarts,
                            heartbeat_ns=time.monotonic_ns(), device=where.device.encode()[:16],
                            name=w.model.name.encode()[:48], crash_streak=w.crash_streak, restart_at_ns=0,
                            version=w.model.version, cpu_count=cpu_count, cpu_mask=cpu_mask)
        try:
            w.proc = subprocess.Popen(argv, pass_fds=(child.fileno(), self.completion_fd),
                                      stdin=subprocess.DEVNULL)
        finally:
            child.close()
        layout.WORKER.write(self.arena.buf, base, pid=w.proc.pid)
        atomics.fetch_add32(self.arena.buf, base + layout.WORKER.offset("incarnation"), 1)
        w.control = parent
        w.terminating = False
        # A first start is STARTING; a restart (after a death or for new settings) stays RESTARTING.
        w.started_at = time.monotonic()
        w.ready_future = self.loop.create_future()
        w.pidfd = os.pidfd_open(w.proc.pid)
        self.loop.add_reader(w.pidfd, self._on_process_exit, w)
        self.loop.add_reader(parent.fileno(), self._on_control, w)
        log.info("worker %d (%s on %s, CPUs %s: %s) started, pid %d", w.index, w.model.name, where.device,
                 where.cpulist or "any", where.source, w.proc.pid)

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
            w.memory = message.get("memory") if isinstance(message.get("memory"), dict) else None
            w.warmup = message.get("warmup") if isinstance(message.get("warmup"), dict) else None
            w.reported = message.get("placement") if isinstance(message.get("placement"), dict) else None
            w.set_state(READY)
            w.error = None
            log.info("worker %d (%s) ready in %.2f s", w.index, w.model.name, time.monotonic() - w.started_at)
            self.loop.call_later(self.config.restart_healthy_s, self._served_healthily, w, w.proc)
            self.on_ready(w)
            if not w.ready_future.done():
                w.ready_future.set_result(True)
        elif message["event"] == "failed":
            w.error = str(message.get("error"))
            log.error("worker %d (%s): %s", w.index, w.model.name, w.error)
        elif message["event"] == "dropped":
            self.on_dropped(w, message.get("region"))
        elif message["event"] == "lane_failed":
            self.on_lane_failed(w, message.get("region"), str(message.get("error")))
        elif message["event"] == "signatures":
            counts = {k: message.get(k, 0) for k in ("new", "distinct", "short")}
            if all(type(v) is int and v >= 0 for v in counts.values()):
                w.signatures = counts

    def _served_healthily(self, w: WorkerHandle, proc: subprocess.Popen) -> None:
        """``restart_healthy_s`` after ``proc`` reported ready: if it is still the ready one, the worker
        is healthy and its crash streak ends (its next death is restarted after the first delay)."""
        if w.proc is proc and w.state == READY and w.crash_streak:
            log.info("worker %d (%s) served %.0f s: restart back-off reset", w.index, w.model.name,
                     self.config.restart_healthy_s)
            w.crash_streak = 0
            layout.WORKER.write(self.arena.buf, self.arena.geometry.worker_off(w.index), crash_streak=0)

    # -- health ---------------------------------------------------------------------------

    def silent_for(self, w: WorkerHandle) -> float:
        """Seconds since worker ``w`` last beat (its heartbeat thread beats every 0.5 s)."""
        beat = layout.WORKER.read(self.arena.buf, self.arena.geometry.worker_off(w.index)).heartbeat_ns
        return (time.monotonic_ns() - beat) / 1e9

    def wedged(self) -> list[WorkerHandle]:
        """Ready workers silent for longer than worker_timeout_s: stopped (SIGSTOP), hung in the
        kernel, or dead without an exit yet."""
        return [w for w in self.workers if w.state == READY and self.silent_for(w) > self.config.worker_timeout_s]

    async def watch_health(self) -> None:
        """Run until cancelled: terminate workers wedged (silent for worker_timeout_s); their exits
        are handled like any other death, so they are restarted."""
        while True:
            await asyncio.sleep(min(HEALTH_CHECK_S, self.config.worker_timeout_s / 4))
            self.check_health()

    def check_health(self) -> None:
        """Terminate every wedged worker not being terminated already."""
        for w in self.wedged():
            if not w.terminating:
                log.error("worker %d (%s, pid %s) silent for %.1f s (worker_timeout_s = %g): terminating it",
                          w.index, w.model.name, w.pid, self.silent_for(w), self.config.worker_timeout_s)
                self.terminate(w)

    def terminate(self, w: WorkerHandle) -> None:
        """SIGTERM now and SIGKILL after TERM_GRACE_S unless it has exited (a hung process may not
        act on TERM); SIGKILL at once to a stopped process (it cannot act on TERM until it is
        continued).  Its exit is then handled like any other death."""
        if not w.alive:
            return
        w.terminating = True
        if self.stopped(w.pid):
            log.error("worker %d (pid %d) is stopped (SIGSTOP?): killing it", w.index, w.pid)
            self._signal(w, signal.SIGKILL)
            return
        self._send_term(w)
        proc = w.proc
        self.loop.call_later(TERM_GRACE_S, self._kill_if_still, w, proc)

    def _kill_if_still(self, w: WorkerHandle, proc: subprocess.Popen) -> None:
        if w.proc is proc and proc.poll() is None:
            log.error("worker %d (pid %d) did not exit on SIGTERM; killing it", w.index, proc.pid)
            self._signal(w, signal.SIGKILL)

    # -- death ----------------------------------------------------------------------------

    def _on_process_exit(self, w: WorkerHandle) -> None:
        self.loop.remove_reader(w.pidfd)
        os.close(w.pidfd)
        w.pidfd = None
        if w.control is not None:
            self._on_control_drain(w)
        code = w.proc.wait()
        status = (-code) if code < 0 else (code << 8)
        how = w.last_exit = workerlink.describe_exit(status)
        base = self.arena.geometry.worker_off(w.index)
        layout.WORKER.write(self.arena.buf, base, state=layout.WORKER_DEAD)
        w.terminating = False
        if w.retiring and not self.stopping:
            log.info("worker %d (%s) pid %d stopped (retired): %s", w.index, w.model.key, w.proc.pid, how)
            w.set_state(STOPPED)
            self._tell_exit(w, how)
            if not w.ready_future.done():
                w.ready_future.set_result(False)
            self._free(w)
            return
        if self.stopping:
            w.set_state(STOPPED)
        elif code in workerlink.NO_RESTART:
            w.set_state(FAILED)
        else:
            w.set_state(RESTARTING)
        log.log(logging.INFO if self.stopping else logging.ERROR, "worker %d (%s) pid %d %s",
                w.index, w.model.name, w.proc.pid, how)
        delay = None
        if w.state == RESTARTING:  # scheduled before the front-end is told, so that it can say when
            delay = self.restart_delay(w)
            w.restarts += 1
            w.crash_streak += 1
            w.restart_at = time.monotonic() + delay
            layout.WORKER.write(self.arena.buf, base, crash_streak=w.crash_streak,
                                restart_at_ns=int(w.restart_at * 1e9))
        self._tell_exit(w, how)
        if not w.ready_future.done():
            w.ready_future.set_result(False)
        if delay is not None:
            if w.crash_looping:
                log.error("worker %d (%s) is crash-looping: died %d times in a row, none after serving "
                          "restart_healthy_s = %g s (last: %s); restarting it in %.1f s", w.index,
                          w.model.name, w.crash_streak, self.config.restart_healthy_s, how, delay)
            else:
                log.info("restarting worker %d in %.1f s (restart %d)", w.index, delay, w.restarts)
            self.loop.call_later(delay, self._respawn, w)
        elif w.state == FAILED:
            log.error("worker %d (%s) will not be restarted: %s", w.index, w.model.name, w.error or how)

    def _tell_exit(self, w: WorkerHandle, how: str) -> None:
        """Tell the front-end (it fails or recovers what the worker held).  Its failure is logged,
        never allowed to skip what follows: the restart."""
        try:
            self.on_exit(w, how)
        except Exception:
            log.exception("recovering what worker %d held failed; restarting it anyway", w.index)

    def restart_delay(self, w: WorkerHandle) -> float:
        """The delay before restarting ``w`` now: the first of ``restart_backoff_s``, doubled for each
        death of its crash streak, capped by the longest."""
        first, longest = self.config.restart_backoff_s
        return min(longest, first * 2 ** min(w.crash_streak, MAX_BACKOFF_DOUBLINGS))

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
        if not self.stopping and w.state == RESTARTING and not w.retiring:
            self._spawn(w)

    def _send_term(self, w: WorkerHandle) -> None:
        """SIGTERM, marked as ours: the worker-table entry says STOPPING first (a worker ignores a
        TERM without that mark, which a shell's kill of the process group would be)."""
        atomics.store32(self.arena.buf, self.arena.geometry.worker_off(w.index) + layout.WORKER.offset("state"),
                        layout.WORKER_STOPPING)
        self._signal(w, signal.SIGTERM)

    def _signal(self, w: WorkerHandle, sig: int) -> None:
        if w.alive:
            try:
                w.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    # -- stopping -------------------------------------------------------------------------

    async def stop_all(self, timeout: float = 5.0) -> None:
        """Stop every worker in order and reap them all: a STOP entry (finish what you have, then
        exit); after ``timeout`` SIGTERM; after TERM_GRACE_S more, SIGKILL."""
        self.stopping = True
        alive = [w for w in self.workers if w.alive]
        for w in alive:
            w.submissions.push(layout.STOP_ENTRY)
            w.doorbell.notify()
        for sig, wait in ((None, timeout), (signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 5.0)):
            alive = [w for w in alive if w.alive]
            if not alive:
                break
            if sig is not None:
                log.warning("%d worker(s) still running; sending %s", len(alive), signal.Signals(sig).name)
                for w in alive:
                    if sig == signal.SIGTERM:
                        self._send_term(w)
                    else:
                        self._signal(w, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(w.alive for w in alive):
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
            w.set_state(STOPPED)
            if w.stopped_future is not None and not w.stopped_future.done():
                w.stopped_future.set_result(True)
