"""What the front-end reports about itself: the one read-only view that ``info``, health and metrics read.

Owns: the shapes of the model listing, the health answer and the ``info``
answer, and ``snapshot()`` (typed values for metrics).  Everything is read
at the moment it is asked for, from the parts that own it: models and their
workers, the dispatcher's queues and outcome counts, the region table's
lanes, and the arena's counters and worker table.

Who sees what: ``info`` shows process ids, paths and addresses (the
server's pid and socket, worker pids, a GPU worker's arena addresses) only to
a client of the server's own uid or root; any other allowed uid gets them as
null (``info(peer_uid)``).

Must not: change anything, or reach into a part's private state: it reads
only what each part offers for this (properties and ``queue_depths``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from shmserve import __version__, layout, protocol
from shmserve.arena import Arena
from shmserve.config import ServerConfig
from shmserve.frontend.dispatcher import Dispatcher
from shmserve.frontend.models import MODEL_READY, ModelState
from shmserve.frontend.regions import RegionTable
from shmserve.supervisor import READY, WorkerHandle


GPU_ADDRESSES = ("arena_host", "arena_device")  # keys of a GPU worker's registration that are addresses


@dataclass(frozen=True)
class WorkerStatus:
    index: int
    model: str
    device: str
    pid: int | None
    state: str
    restarts: int
    crash_streak: int  # deaths in a row, each before a healthy run (the restart back-off's exponent)
    last_exit: str | None  # how its last process ended
    restart_in_s: float | None  # seconds until its scheduled restart; None when none is scheduled
    inflight: int
    requests: int  # finished by the worker (socket and lane calls), from the arena's worker table
    errors: int
    lanes: int
    io_mode: str | None
    gpu: dict | None


@dataclass(frozen=True)
class ModelStatus:
    name: str
    state: str
    queued: int  # waiting for arena space or not yet claimed by a worker
    inflight: int  # handed to workers and not yet finished
    workers: tuple[WorkerStatus, ...]
    histograms: dict[str, tuple[tuple[int, ...], int]]  # stage -> (bucket counts, sum) over its workers


@dataclass(frozen=True)
class Snapshot:
    models: tuple[ModelStatus, ...]
    outcomes: dict[tuple[str, str], int]  # (model, "ok" | error code) -> requests answered through doors
    stats: dict[str, int]  # the arena's statistics counters
    lanes: int
    slots: int
    data_bytes: int


class Status:
    """The front-end as others see it.  ``config`` is read each time (a reload replaces it)."""

    def __init__(self, *, config: Callable[[], ServerConfig], arena: Arena, models: dict[str, ModelState],
                 workers: list[WorkerHandle], dispatcher: Dispatcher, regions: RegionTable, socket_path: str):
        self._config = config  # returns the configuration in force now
        self.arena, self.models, self.workers = arena, models, workers
        self.dispatcher, self.regions, self.socket_path = dispatcher, regions, socket_path
        self.started = time.monotonic()

    @property
    def config(self) -> ServerConfig:
        return self._config()

    # -- typed ----------------------------------------------------------------------------

    def worker(self, w: WorkerHandle) -> WorkerStatus:
        entry = layout.WORKER.read(self.arena.buf, self.arena.geometry.worker_off(w.index))
        restart_in = w.restart_in(time.monotonic())
        return WorkerStatus(w.index, w.model.name, w.model.device, w.pid, str(w.state), w.restarts, w.crash_streak,
                            w.last_exit, None if restart_in is None else round(restart_in, 3), len(w.inflight),
                            entry.requests, entry.errors, self.regions.lanes_of(w),
                            w.model.io_mode if w.model.device != "cpu" else None, w.gpu)

    def snapshot(self) -> Snapshot:
        depths = self.dispatcher.queue_depths()
        g = self.arena.geometry
        models = tuple(ModelStatus(name, m.state, *depths[name], tuple(self.worker(w) for w in m.workers),
                                   {stage: layout.read_histograms(self.arena.buf, g, [w.index for w in m.workers], stage)
                                    for stage in layout.HIST_STAGES})
                       for name, m in self.models.items())
        return Snapshot(models, dict(self.dispatcher.outcomes), {n: self.arena.stat(n) for n in layout.STAT_NAMES},
                        self.regions.lane_count, g.slot_count, g.data_size)

    # -- the control answers --------------------------------------------------------------

    def model_listing(self) -> list[dict]:
        out = []
        for m in self.models.values():
            spec, cfg = m.spec, m.config
            entry = {"name": m.name, "backend": cfg.backend, "path": cfg.path, "device": cfg.device,
                     "instances": cfg.instances, "state": m.state, "max_batch_size": cfg.max_batch_size,
                     "inputs": [t.to_dict() for t in spec.inputs] if spec else [],
                     "outputs": [t.to_dict() for t in spec.outputs] if spec else []}
            if m.state != MODEL_READY:
                entry["error"] = m.unavailable_reason()
            out.append(entry)
        return out

    def health(self) -> dict:
        states = {m.name: m.state for m in self.models.values()}
        if self.dispatcher.stopping:
            status = "shutting_down"
        else:
            status = "ok" if all(s == MODEL_READY for s in states.values()) else "degraded"
        return {"status": status, "models": {
            m.name: {"state": m.state, "workers": len(m.workers),
                     "workers_ready": sum(w.state == READY for w in m.workers),
                     "restarts": sum(w.restarts for w in m.workers),
                     "crash_loop": m.crash_looping} for m in self.models.values()}}

    def info(self, peer_uid: int) -> dict:
        """The ``info`` answer for a client of ``peer_uid``: process ids, paths and addresses are
        null unless it is the server's own uid or root."""
        g, config = self.arena.geometry, self.config
        private = peer_uid in (os.getuid(), 0)
        workers = []
        for w in self.workers:
            s = self.worker(w)
            gpu = s.gpu if private or s.gpu is None else {k: v for k, v in s.gpu.items() if k not in GPU_ADDRESSES}
            workers.append({"requests": s.requests, "errors": s.errors, "lanes": s.lanes, "index": s.index,
                            "model": s.model, "device": s.device, "pid": s.pid if private else None, "state": s.state,
                            "restarts": s.restarts, "crash_streak": s.crash_streak, "last_exit": s.last_exit,
                            "restart_in_s": s.restart_in_s, "inflight": s.inflight, "io_mode": s.io_mode,
                            "gpu": gpu})
        return {"version": __version__, "protocol": protocol.PROTOCOL_VERSION, "instance": config.instance,
                "pid": os.getpid() if private else None, "socket": self.socket_path if private else None,
                "uptime_s": round(time.monotonic() - self.started, 3),
                "arena": {"name": self.arena.name, "size": g.total_size, "slots": g.slot_count,
                          "largest_extent": self.dispatcher.extents.largest},
                "max_request_bytes": self.dispatcher.max_request, "request_timeout_s": config.request_timeout_s,
                "stats": {name: self.arena.stat(name) for name in layout.STAT_NAMES},
                "lanes": self.regions.lane_count, "workers": workers}
