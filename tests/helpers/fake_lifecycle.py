"""The model lifecycle in one process: the real lifecycle, dispatcher, arena, rings, region table,
shadowing and model repository (real files), with a fake supervisor whose workers become ready,
fail to load, hang or die when a test says so, and the fake clock (``helpers.fake_frontend``).

Owns: ``FakeSupervisor`` (what the lifecycle asks of ``shmserve.supervisor.Supervisor``:
``add_worker``, ``wait_ready``, ``retire``; each new worker's behaviour by model version, and its
measured memory), ``World`` (the parts wired as ``shmserve.server`` wires them; ``run`` lets the
workers serve what they were given and carry out their commands, ``until`` waits for a condition
while doing so, ``advance`` moves the clock) and ``add_version`` (a repository version on disk).
Each fake worker answers ``y = x + 1000 * version``, so a test can tell which version served.

Must not: spawn a process or sleep: time is the fake clock's, and the event loop only runs what
is ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import textwrap
from pathlib import Path

import numpy as np

from shmserve import layout
from shmserve.config import ServerConfig
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.lifecycle import Lifecycle
from shmserve.frontend.shadow import Shadowing
from shmserve.spec import TensorSpec
from shmserve.supervisor import FAILED, READY, RESTARTING, STOPPED, WorkerHandle

from helpers.fake_frontend import FakeFrontend, FakeModel, FakeWorker

X = (TensorSpec("x", "float32", ("n",)),)
Y = (TensorSpec("y", "float32", ("n",)),)
MIB = 1 << 20


def add_version(repo: Path, model: str, version: int, config: str = "") -> None:
    """``repo/<model>/<version>/`` with a (never imported) module, and the model's config.toml (python
    backend, ``x`` float32 [n] -> ``y``, plus ``config``) if it has none."""
    d = repo / model / str(version)
    d.mkdir(parents=True, exist_ok=True)
    (d / "vmodel.py").write_text("# served by the fake supervisor's workers\n")
    cfg = repo / model / "config.toml"
    if not cfg.exists():
        cfg.write_text('backend = "python"\npath = "vmodel:model"\n'
                       'inputs = [{name = "x", dtype = "float32", shape = ["n"]}]\n'
                       'outputs = [{name = "y", dtype = "float32", shape = ["n"]}]\n' + textwrap.dedent(config))


def answer_of(version: int):
    return lambda t: {"y": t["x"] + np.float32(1000 * version)}


class FakeSupervisor:
    """The lifecycle's supervisor.  A worker added for a model version does what ``behaviour``
    says for its key (``"name:version"``): ``"ready"`` (the default; it measures ``memory[name]``
    host bytes, 1 MiB unless set), ``"fail"`` (cannot load it) or ``"hang"`` (never ready: killed
    at the start-up timeout); a key in ``failing`` fails every request its workers run; a worker in
``stuck`` runs nothing more (what it claimed stays running).  ``on_ready(w)`` / ``on_exit(w, how)``
are the server's hooks."""

    def __init__(self, fe: FakeFrontend, on_ready, on_exit):
        self.fe, self.on_ready, self.on_exit = fe, on_ready, on_exit
        self.workers: list[WorkerHandle] = fe.dispatcher.workers  # the supervisor's list is the dispatcher's
        self.behaviour: dict[str, str] = {}
        self.memory: dict[str, int] = {}
        self.ready: dict[WorkerHandle, asyncio.Future] = {}
        self.stopped: dict[WorkerHandle, asyncio.Future] = {}
        self.stuck: set[WorkerHandle] = set()  # workers that run nothing more: what they claimed stays running
        self.timers: dict[WorkerHandle, object] = {}  # a retired worker's drain deadline
        self.failing: set[str] = set()  # keys ("name:version") whose workers fail every request they run

    def fake(self, w: WorkerHandle) -> FakeWorker:
        return self.fe.workers[w.index]

    # -- what the lifecycle calls ------------------------------------------------------------

    def add_worker(self, cfg) -> WorkerHandle:
        index = len(self.fe.workers)  # entries are never reused here: each worker has its own
        if index >= self.fe.arena.geometry.max_workers:
            raise ShmserveError(ErrorCode.OVERLOADED, f"all {index} worker entries are in use (server.max_workers)")
        fake = FakeWorker(self.fe.arena, index, FakeModel(cfg.name, X, Y, answer_of(cfg.version)), self.fe.efd,
                          ready=False)
        w = fake.handle
        w.model = cfg
        fake.tell_dropped = lambda region: self.fe.regions.worker_dropped(w, region)
        w.completion_bell.arm()
        self.fe.workers.append(fake)
        self.workers.append(w)
        loop = asyncio.get_running_loop()
        self.ready[w], self.stopped[w] = loop.create_future(), loop.create_future()
        behaviour = self.behaviour.get(cfg.key, "ready")
        if behaviour == "ready":
            loop.call_soon(self.become_ready, w)
        elif behaviour == "fail":
            loop.call_soon(self.fail, w, f"cannot load model {cfg.name!r} (fake): version {cfg.version} is broken")
        return w

    async def wait_ready(self, workers: list[WorkerHandle], timeout: float) -> bool:
        def expire():
            for w in workers:
                if not self.ready[w].done():
                    w.error = f"not ready after {timeout:.0f} s"
                    self.exit(w, "killed by SIGKILL", RESTARTING)
                    self.ready[w].set_result(False)

        timer = self.fe.clock.call_later(timeout, expire)
        await asyncio.gather(*(self.ready[w] for w in workers))
        timer.cancel()
        return all(w.state == READY for w in workers)

    def retire(self, w: WorkerHandle, drain_s: float, before=lambda: None) -> asyncio.Future:
        if not w.retiring:
            w.retiring = True
            before()
            if self.fake(w).dead:
                asyncio.get_running_loop().call_soon(self.free, w)
            else:
                self.fe.command(w, layout.STOP_ENTRY)
                self.timers[w] = self.fe.clock.call_later(drain_s, self.overdue, w)
        return self.stopped[w]

    # -- what its workers do -------------------------------------------------------------------

    def become_ready(self, w: WorkerHandle) -> None:
        if self.ready[w].done():
            return
        self.fake(w).report_ready()
        w.memory = {"host_bytes": self.memory.get(w.model.name, MIB)}
        self.ready[w].set_result(True)
        self.on_ready(w)

    def fail(self, w: WorkerHandle, why: str) -> None:
        w.error = why
        self.exit(w, "exit 3 (cannot load the model)", FAILED)
        self.ready[w].set_result(False)

    def exit(self, w: WorkerHandle, how: str, state) -> None:
        """The worker's process is gone (``how``); it is ``state`` now."""
        self.fake(w).die()
        w.last_exit = how
        w.set_state(state)
        self.on_exit(w, how)

    def overdue(self, w: WorkerHandle) -> None:
        if not self.stopped[w].done() and not self.fake(w).dead:
            self.exit(w, "exit 6 (terminated)", STOPPED)
            self.free(w)

    def free(self, w: WorkerHandle) -> None:
        timer = self.timers.pop(w, None)
        if timer is not None:
            timer.cancel()
        if w in self.workers:
            self.workers.remove(w)
        if w.state != STOPPED:
            w.set_state(STOPPED)
        if not self.stopped[w].done():
            self.stopped[w].set_result(True)

    def run(self) -> bool:
        """Each live worker that is not stuck serves what it was given and carries out its commands;
        one told to stop (retired) exits once it has finished what it had.  Whether anything moved."""
        moved = False
        for fake in list(self.fe.workers):
            w = fake.handle
            if fake.dead or w in self.stuck or w not in self.workers:
                continue
            seen = len(fake.commands)
            if w.model.key in self.failing:
                jobs = fake.claim()
                for job in jobs:
                    fake.fail(job, ErrorCode.INTERNAL, f"{w.model.key} is broken (fake)")
            else:
                jobs = fake.step()
            moved |= bool(jobs) or len(fake.commands) != seen
            if any(op == layout.CMD_STOP for op, _ in fake.commands) and not w.inflight:  # its queue done
                self.exit(w, "exit 0 (retired)", STOPPED)
                self.free(w)
                moved = True
        return moved


@dataclasses.dataclass(eq=False)
class World:
    """The lifecycle over a fake front-end, wired as ``shmserve.server.Frontend._build`` wires it."""

    fe: FakeFrontend
    repo: Path
    config: ServerConfig
    supervisor: FakeSupervisor = None
    lifecycle: Lifecycle = None

    @classmethod
    def make(cls, fe: FakeFrontend, repo: Path, **server) -> "World":
        """``server``: ServerConfig fields (``memory_budget={"cpu": n}`` a dict)."""
        if "memory_budget" in server:
            server["memory_budget"] = tuple(server["memory_budget"].items())
        world = cls(fe, repo, ServerConfig(models=(), model_repository=str(repo), **server))
        d, regions = fe.dispatcher, fe.regions
        world.supervisor = FakeSupervisor(fe, world._worker_ready, world._worker_exited)
        world.lifecycle = life = Lifecycle(fe.models, world.supervisor, d, regions, lambda: world.config,
                                           clock=fe.clock, startup_timeout=30.0,
                                           finished=lambda w: fe.arena.worker_counter(w.index, "requests"),
                                           lane_counts=lambda w: layout.read_lane_outcomes(fe.arena.buf,
                                                                                             fe.arena.geometry,
                                                                                             w.index))
        d.load_on_demand, d.observe = life.load_on_demand, life.observe
        d.offer_shadow = Shadowing(d, fe.models, fe.clock.monotonic).offer
        return world

    def _worker_ready(self, w: WorkerHandle) -> None:
        version = self.fe.models.version_of(w)
        if version is not None:
            self.fe.regions.attach_waiting(version)
        self.fe.dispatcher.worker_ready(w)
        self.lifecycle.worker_ready(w)

    def _worker_exited(self, w: WorkerHandle, how: str) -> None:
        try:
            self.fe.dispatcher.worker_exited(w, how)
        finally:
            self.fe.regions.worker_lost(w, how)

    def version(self, name: str, number: int):
        return self.fe.models.get(name).versions[number]

    def run(self) -> bool:
        """Let what can move move once: payloads received, workers serving and obeying, completions
        collected, answers written.  Whether anything moved."""
        moved = self.supervisor.run()
        moved |= self.fe.pump_doors()
        self.fe.collect()
        return moved

    async def until(self, predicate, what: str = "the condition", turns: int = 2000):
        """Run the world and the event loop (no time passes) until ``predicate()`` is true; its value.
        AssertionError naming ``what`` if it is not within ``turns`` turns."""
        for _ in range(turns):
            value = predicate()
            if value:
                return value
            self.run()
            await asyncio.sleep(0)
        raise AssertionError(f"never: {what}")

    async def settle(self, turns: int = 50) -> None:
        """Run the world and the event loop ``turns`` times (no time passes)."""
        for _ in range(turns):
            self.run()
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass on the clock (its timers run), then settle."""
        self.fe.clock.advance(seconds)
        await self.settle()

    async def done(self, task: asyncio.Task, what: str = "the operation", turns: int = 2000):
        """Run the world until ``task`` is done; its result (or its exception, raised)."""
        await self.until(task.done, what, turns)
        return task.result()

    async def stop(self) -> None:
        """The server's shutdown, as far as the lifecycle goes: its tasks stopped, every worker
        retired and gone."""
        await self.lifecycle.stop()
        for w in list(self.supervisor.workers):
            self.supervisor.retire(w, 0.0)
        await self.until(lambda: not self.supervisor.workers, "every worker gone")
