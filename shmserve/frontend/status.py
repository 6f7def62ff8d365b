"""What the front-end reports about itself: the one read-only view that ``info``, health and metrics read.

Owns: the shapes of the model listing (with each model's route for lane
clients, ``route_of``), the health answer and the ``info``
answer (with the limits and the last hour's windows ``shmserve doctor``
reads), ``snapshot()`` (typed values for metrics) and ``sample()`` (what the
server's ``History`` keeps a minute of), and the sum of a model's workers'
scheduling counters by priority level (``queue_status``, which ``inspect``
also reads from a dead arena).  Everything is read
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

import collections
import os
import time
from dataclasses import dataclass
from typing import Callable

from shmserve import __version__, layout, protocol, routing
from shmserve.arena import Arena
from shmserve.config import ServerConfig
from shmserve.frontend.dispatcher import CANCEL_STAGES, Dispatcher
from shmserve.frontend.history import STAGES as HISTORY_STAGES
from shmserve.frontend.history import History, Sample, WorkerSample
from shmserve.frontend.models import MODEL_READY, SERVING, ModelState, Models
from shmserve.frontend.ratelimit import ALL_MODELS, RateLimiter
from shmserve.frontend.regions import RegionTable
from shmserve.supervisor import READY, STARTING, WorkerHandle


GPU_ADDRESSES = ("arena_host", "arena_device")  # keys of a GPU worker's registration that are addresses


@dataclass(frozen=True)
class WorkerStatus:
    index: int
    model: str
    version: int
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
    cpus: str | None = None  # the CPUs it may run on: as it reported when ready, else as it was pinned (None: any)
    cpus_from: str | None = None  # why those: "cpus = 0-3", "local to cuda:0 (PCI …)", "inherited[: why]"
    threads: dict | None = None  # its runtime's thread pools and OMP/MKL/OpenBLAS variables, as it reported when ready
    signatures: dict | None = None  # {"new": requests that brought an input signature it had not met, "distinct"}


@dataclass(frozen=True)
class ModelStatus:
    """One version of a model."""

    name: str
    version: int
    phase: str  # its lifecycle phase (loading, ready, draining, unavailable, evicted, unloaded)
    default: bool  # requests naming no version go to it
    state: str
    queued: int  # waiting for arena space or not yet claimed by a worker
    inflight: int  # handed to workers and not yet finished
    workers: tuple[WorkerStatus, ...]
    histograms: dict[str, tuple[tuple[int, ...], int]]  # stage -> (bucket counts, sum) over its workers
    memory_bytes: int | None = None  # measured after its load
    queue: "QueueStatus | None" = None  # its workers' queues by priority level (``queue_status``)


@dataclass(frozen=True)
class QueueLevel:
    """One priority level of a model's queue, summed over its workers' scheduling counters
    (``layout.read_sched_counters``)."""

    level: int  # 1 (claimed first) .. the model's priority_levels
    queued: int  # held by its workers, unclaimed, now (a gauge)
    claimed: int  # claimed since each worker entry was taken (a total)
    wait_us: int  # the claimed requests' ready-to-claim waits, summed (microseconds)

    @property
    def mean_wait_us(self) -> float | None:
        return round(self.wait_us / self.claimed, 1) if self.claimed else None

    def to_dict(self) -> dict:
        return {"level": self.level, "queued": self.queued, "claimed": self.claimed, "wait_us": self.wait_us,
                "mean_wait_us": self.mean_wait_us}


@dataclass(frozen=True)
class QueueStatus:
    """A model version's queue by priority level, and its requests not run as asked."""

    levels: tuple[QueueLevel, ...]  # level 1 first
    expired: int  # answered TIMEOUT unrun: their deadline passed before a claim
    demoted: int  # queue timeout passed under timeout_action = "delay": moved behind every other

    def to_dict(self) -> dict:
        return {"levels": [lv.to_dict() for lv in self.levels], "expired": self.expired, "demoted": self.demoted}


# A u64 counter at or above this is no count (a gauge taken below zero, or bytes that are not
# counters: a foreign or torn arena): it is read as 0.
SANE_COUNT = 1 << 62


def queue_status(buf, geometry: layout.Geometry, workers, levels: int | None = None) -> QueueStatus:
    """The scheduling counters of ``workers`` (pairs: worker table index, whether its process
    holds a queue now: a gone worker's ``queued`` gauge is its last word, counted 0), summed.

    ``levels``: the levels shown, 1..``levels`` (a model's ``max(priority_levels, 1)``: a worker
    counts a model without levels at level 1); None (a dead arena's reader, who has no config):
    1 up to the highest level with any count.  The arena is untrusted: a worker index out of
    range is LayoutError, a count of ``SANE_COUNT`` or more reads as 0."""
    def sane(n: int) -> int:
        return n if n < SANE_COUNT else 0

    queued = [0] * layout.SCHED_LEVELS
    claimed = [0] * layout.SCHED_LEVELS
    waited = [0] * layout.SCHED_LEVELS
    expired = demoted = 0
    for index, live in workers:
        c = layout.read_sched_counters(buf, geometry, index)
        expired += sane(c.expired)
        demoted += sane(c.demoted)
        for i, lv in enumerate(c.levels):
            queued[i] += sane(lv.queued) if live else 0
            claimed[i] += sane(lv.claimed)
            waited[i] += sane(lv.wait_us)
    if levels is None:
        levels = max([i + 1 for i in range(layout.SCHED_LEVELS) if queued[i] or claimed[i] or waited[i]] or [1])
    levels = min(max(levels, 1), layout.SCHED_LEVELS)
    return QueueStatus(tuple(QueueLevel(i + 1, queued[i], claimed[i], waited[i]) for i in range(levels)),
                       expired, demoted)


@dataclass(frozen=True)
class Snapshot:
    models: tuple[ModelStatus, ...]
    outcomes: dict[tuple[str, int | str, str], int]  # (model, version, "ok" | code) -> requests answered
    lifecycle: dict  # counts and seconds of loads, failures, evictions; canaries
    stats: dict[str, int]  # the arena's statistics counters
    lanes: int
    slots: int
    data_bytes: int
    batch_items: dict = None  # (model, version) -> batch items beyond one per request (Status.batch_items)
    lane_calls: dict = None  # (model, version) -> (ok, error) lane calls its live workers finished (the lifecycle's)
    doors: tuple = ()  # each door process's state (``DoorHouse.describe``)
    cancelled: dict = None  # (model, version, stage) -> requests whose caller gave up (``Dispatcher.cancelled``)
    rate_limited: dict = None  # (limit, model label) -> requests a rate limit refused (configured labels only)


@dataclass(frozen=True)
class TritonCounts:
    """One version's requests as Triton counts them (its statistics extension and its ``nv_*``
    metrics), from one snapshot."""

    success: int  # answered ok by its workers: socket and lane calls alike (the workers' own counters)
    failure: int  # answered with an error: through the dispatcher, and lane calls (a heartbeat late)
    items: int  # success, with a batch of N counted N where a v2 door saw it (Triton's inference_count)
    executions: int  # model runs: a dynamic batch is one (Triton's execution_count)


def triton_counts(snap: Snapshot, m: ModelStatus) -> TritonCounts:
    """``m``'s ``TritonCounts`` in ``snap``.  The workers' counters are per worker entry: a
    worker that is retired (scaled down, its version unloaded) takes its counts with it."""
    success = sum(w.requests - w.errors for w in m.workers)
    failure = sum(n for (model, version, code), n in snap.outcomes.items()
                  if model == m.name and version == m.version and code != "ok")
    failure += (snap.lane_calls or {}).get((m.name, m.version), (0, 0))[1]
    items = success + (snap.batch_items or {}).get((m.name, m.version), 0)
    return TritonCounts(success, failure, items, sum(m.histograms["batch_size"][0]))


class Status:
    """The front-end as others see it.  ``config`` is read each time (a reload replaces it)."""

    def __init__(self, *, config: Callable[[], ServerConfig], arena: Arena, models: Models,
                 workers: list[WorkerHandle], dispatcher: Dispatcher, regions: RegionTable, socket_path: str,
                 lifecycle=None, history: History | None = None):
        self._config = config  # returns the configuration in force now
        self.arena, self.models, self.workers = arena, models, workers
        self.lifecycle = lifecycle
        self.history = history  # the server samples into it (``sample``); ``info`` shows its windows
        self.dispatcher, self.regions, self.socket_path = dispatcher, regions, socket_path
        self.started = time.monotonic()
        self.front_doors: dict[str, str] = {}  # "http"/"grpc" -> the address it listens on (the server sets it)
        # (model, version) -> batch items beyond one per request answered ok, as the v2 doors count them
        # (Triton's inference_count counts a batch of 4 as 4); the v2 service adds to it, metrics read it.
        self.batch_items: collections.Counter = collections.Counter()
        self.doors = lambda: []  # the door processes' state (frontend/doorhouse.py DoorHouse.describe), if any
        self.door_outcomes = lambda: {}  # what the doors answered themselves: (model, version, outcome) -> n
        self.door_cancelled = lambda: {}  # the doors' own lane calls given up on: (model, version, stage) -> n
        self.rate = RateLimiter()  # the rate limits every door keeps (the server sets the one it shares)

    @property
    def config(self) -> ServerConfig:
        return self._config()

    # -- typed ----------------------------------------------------------------------------

    def worker(self, w: WorkerHandle) -> WorkerStatus:
        entry = layout.WORKER.read(self.arena.buf, self.arena.geometry.worker_off(w.index))
        restart_in = w.restart_in(time.monotonic())
        where = w.placement
        cpus = (w.reported or {}).get("cpus") or (where.cpulist if where is not None else None)
        return WorkerStatus(w.index, w.model.name, w.model.version, w.device, w.pid, str(w.state), w.restarts, w.crash_streak,
                            w.last_exit, None if restart_in is None else round(restart_in, 3), len(w.inflight),
                            entry.requests, entry.errors, self.regions.lanes_of(w),
                            w.model.io_mode if w.device != "cpu" else None, w.gpu,
                            str(cpus) if cpus is not None else None, where.source if where is not None else None,
                            (w.reported or {}).get("threads"), w.signatures)

    def snapshot(self) -> Snapshot:
        depths = self.dispatcher.queue_depths()
        g = self.arena.geometry
        models = tuple(ModelStatus(v.name, v.version, v.phase, self._is_default(v), v.state,
                                   *depths.get(v.key, (0, 0)), tuple(self.worker(w) for w in v.workers),
                                   {stage: layout.read_histograms(self.arena.buf, g, [w.index for w in v.workers], stage)
                                    for stage in layout.HIST_STAGES}, v.memory.get("measured_bytes"),
                                   self.queue_of(v))
                       for v in self.models.versions())
        lifecycle = {"counts": dict(self.lifecycle.counts), "seconds": dict(self.lifecycle.seconds),
                     "canaries": self.canaries()} if self.lifecycle is not None else {}
        lane_calls = self.lifecycle.lane_outcomes() if hasattr(self.lifecycle, "lane_outcomes") else {}
        outcomes = dict(self.dispatcher.outcomes)
        for key, n in self.door_outcomes().items():  # a door's own answers count as the socket's
            outcomes[key] = outcomes.get(key, 0) + n
        return Snapshot(models=models, outcomes=outcomes, lifecycle=lifecycle,
                        stats={n: self.arena.stat(n) for n in layout.STAT_NAMES}, lanes=self.regions.lane_count,
                        slots=g.slot_count, data_bytes=g.data_size, batch_items=dict(self.batch_items),
                        lane_calls=lane_calls, doors=tuple(self.doors()), rate_limited=self.rate_refusals(),
                        cancelled=self.cancelled())

    def queue_of(self, v: ModelState) -> QueueStatus:
        """Version ``v``'s queue by priority level (1..``max(priority_levels, 1)``), summed over
        its workers; a worker not starting or ready (gone, waiting to restart, stopped) holds no
        queue.  A worker entry taken anew starts from zero (``Supervisor.new_handle`` clears it);
        a retired worker takes its counts with it."""
        return queue_status(self.arena.buf, self.arena.geometry,
                            [(w.index, w.state in (STARTING, READY)) for w in v.workers],
                            max(v.config.priority_levels, 1))

    def queues(self) -> list[dict]:
        """``info``'s ``queues``: each model version's queue by priority level (``QueueStatus``)."""
        return [{"model": v.name, "version": v.version, "priority_levels": v.config.priority_levels,
                 **self.queue_of(v).to_dict()} for v in self.models.versions()]

    def rate_refusals(self) -> dict[tuple[str, str], int]:
        """(limit, model label) -> refusals: every configured limit (0 until it refuses), and any
        a reload removed that had refused."""
        return {**{(lim.key, lim.model or ALL_MODELS): 0 for lim in self.rate.limits}, **self.rate.refused}

    def sample(self, now: float) -> Sample:
        """Every worker's cumulative stage histograms and the answers so far, for ``History``."""
        buf, g = self.arena.buf, self.arena.geometry
        workers = {}
        for w in self.workers:
            stages = tuple((sum(counts), total_us) for counts, total_us in
                           (layout.read_histogram(buf, g, w.index, stage) for stage in HISTORY_STAGES))
            workers[w] = WorkerSample(w.model.name, stages, layout.read_histogram(buf, g, w.index, "total")[0])
        outcomes: dict[tuple[str, str], int] = {}
        for (model, _version, code), n in self.dispatcher.outcomes.items():
            outcomes[(model, code)] = outcomes.get((model, code), 0) + n
        return Sample(now, workers, outcomes)

    def limits(self) -> dict:
        """The limits ``shmserve doctor`` measures the host against (``info``'s ``limits``)."""
        c = self.config
        return {"max_connections": c.max_connections, "max_regions": c.max_regions,
                "max_region_bytes_per_connection": c.max_region_bytes_per_connection,
                "max_region_bytes_per_uid": c.max_region_bytes_per_uid, "max_regions_per_uid": c.max_regions_per_uid,
                "spin_us": c.effective_spin_us(),
                "memory_budget": dict(c.memory_budget), "v2_system_shared_memory": c.v2_system_shared_memory,
                "descriptors": c.descriptor_budget()}

    def _is_default(self, v: ModelState) -> bool:
        model = self.models.get(v.name)
        return model is not None and model.default == v.version

    def canaries(self) -> dict[str, dict]:
        """Each model's running canary (or its last one), as ``canary.Rollout.snapshot`` says."""
        out = {}
        now = time.monotonic()
        for name, model in self.models.by_name.items():
            if model.rollout is not None:
                out[name] = model.rollout.snapshot(now)
            elif model.rollouts:
                out[name] = model.rollouts[-1]
        return out

    # -- the control answers --------------------------------------------------------------

    def _defaults(self) -> list[ModelState]:
        """Each model's default version (a model without one: its newest), in name order."""
        out = []
        for name in sorted(self.models.by_name):
            model = self.models.by_name[name]
            v = model.current or (model.versions[max(model.versions)] if model.versions else None)
            if v is not None:
                out.append(v)
        return out

    def model_listing(self) -> list[dict]:
        """One entry per model: its default version's settings, spec and state, and its versions."""
        out = []
        for m in self._defaults():
            spec, cfg = m.spec, m.config
            model = self.models.by_name[m.name]
            entry = {"name": m.name, "version": m.version, "backend": cfg.backend, "path": cfg.path,
                     "device": cfg.device, "devices": list(cfg.placement_devices), "instances": cfg.instances,
                     "state": self.state_of(m), "max_batch_size": cfg.max_batch_size,
                     "max_output_bytes": cfg.max_output_bytes, "load": cfg.load,
                     "versions": sorted(v.version for v in model.versions.values() if v.phase == SERVING),
                     "inputs": [t.to_dict() for t in spec.inputs] if spec else [],
                     "outputs": [t.to_dict() for t in spec.outputs] if spec else []}
            if entry["state"] not in (MODEL_READY, "evicted", "unloaded"):
                entry["error"] = m.unavailable_reason()
            entry["route"] = self.route_of(model)
            out.append(entry)
        return out

    @staticmethod
    def route_of(model) -> dict:
        """How a lane client routes ``model``'s calls that name no version (``routing.Route``'s wire
        form, valid for the epoch its lanes say): while a split canary ramps, its versions and share,
        and the candidate's spec (``candidate_spec``, a listing entry's fields: the client plans its
        calls to the candidate from it)."""
        rollout = model.rollout
        route = rollout.lane_route(model.route_epoch) if rollout is not None else routing.Route(model.route_epoch)
        d = route.to_dict()
        candidate = model.versions.get(route.candidate) if route.candidate is not None else None
        if candidate is not None and candidate.spec is not None:
            spec = candidate.spec
            d["candidate_spec"] = {"name": model.name, "version": candidate.version, "backend": candidate.config.backend,
                                   "max_output_bytes": candidate.config.max_output_bytes,
                                   "inputs": [t.to_dict() for t in spec.inputs],
                                   "outputs": [t.to_dict() for t in spec.outputs]}
        return d

    @staticmethod
    def state_of(v: ModelState) -> str:
        """A version's state for people: its phase, or, while it serves, its workers' state."""
        return v.state if v.phase == SERVING else v.phase

    def health(self) -> dict:
        defaults = self._defaults()
        if self.dispatcher.stopping:
            status = "shutting_down"
        else:
            status = "ok" if all(self.state_of(m) == MODEL_READY or (m.config.load == "on_demand" and m.taking)
                                 for m in defaults) else "degraded"
        return {"status": status, "models": {
            m.name: {"state": self.state_of(m), "version": m.version, "workers": len(m.workers),
                     "workers_ready": sum(w.state == READY for w in m.workers),
                     "restarts": sum(w.restarts for w in m.workers),
                     "crash_loop": m.crash_looping} for m in defaults}}

    def repository_index(self, private: bool = False) -> dict:
        """The ``repository`` answer: every model and version with its state and reason, the
        default, workers, measured memory and load time, the requests counted as its use and the
        seconds since its last use (residency's order); canaries; the recent lifecycle events.
        Repository versions not loaded are listed as ``unloaded`` (or with why they cannot be)."""
        entries, seen = [], set()
        now = time.monotonic()
        for v in self.models.versions():
            seen.add((v.name, v.version))
            entry = {"name": v.name, "version": v.version, "state": self.state_of(v), "reason": v.reason,
                     "default": self._is_default(v), "workers": sum(not w.retiring for w in v.workers),
                     "workers_ready": sum(w.state == READY and not w.retiring for w in v.workers),
                     "load": v.config.load, "pinned": v.config.pinned, "device": v.config.device,
                     "memory_bytes": v.memory.get("measured_bytes"), "load_seconds":
                         None if v.load_seconds is None else round(v.load_seconds, 3),
                     "uses": v.uses, "idle_s": round(now - v.last_used, 3) if v.last_used else None,
                     "cancelled": self.cancelled_of(v.name, v.version)}
            if v.state != MODEL_READY and v.phase == SERVING:
                entry["reason"] = v.unavailable_reason()
            if private:
                entry["path"] = v.config.path
            entries.append(entry)
        if self.lifecycle is not None:
            for name, model in sorted(self.lifecycle.repository().items()):
                if model.error:
                    entries.append({"name": name, "version": None, "state": "unavailable", "reason": model.error})
                for ver in model.versions:
                    if (name, ver.version) not in seen:
                        entries.append({"name": name, "version": ver.version,
                                        "state": "unavailable" if ver.error else "unloaded",
                                        "reason": ver.error or ("not selected by its version_policy"
                                                                if ver.version not in model.selected else "")})
        entries.sort(key=lambda e: (e["name"], e["version"] or 0))
        return {"models": entries, "canaries": self.canaries(),
                "events": list(self.lifecycle.events) if self.lifecycle is not None else [],
                "rate_limits": self.rate.describe()}

    def cancelled(self) -> dict[tuple, int]:
        """(model, version, stage) -> requests whose caller gave up: the dispatcher's and the door
        processes' own lane calls (``dispatcher.CANCEL_STAGES``: before a worker claimed them, while
        one ran them, once their answer was ready)."""
        counts = dict(self.dispatcher.cancelled)
        for key, n in self.door_cancelled().items():
            counts[key] = counts.get(key, 0) + n
        return counts

    def cancelled_of(self, model: str, version: int) -> dict[str, int]:
        """``cancelled`` of ``model`` ``version``, by stage."""
        counts = self.cancelled()
        return {stage: counts.get((model, version, stage), 0) for stage in CANCEL_STAGES}

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
                            "model": s.model, "version": s.version, "device": s.device, "pid": s.pid if private else None, "state": s.state,
                            "restarts": s.restarts, "crash_streak": s.crash_streak, "last_exit": s.last_exit,
                            "restart_in_s": s.restart_in_s, "inflight": s.inflight, "io_mode": s.io_mode,
                            "gpu": gpu, "cpus": s.cpus, "cpus_from": s.cpus_from, "threads": s.threads,
                            "signatures": s.signatures})
        return {"version": __version__, "protocol": protocol.PROTOCOL_VERSION, "instance": config.instance,
                "pid": os.getpid() if private else None, "socket": self.socket_path if private else None,
                "uptime_s": round(time.monotonic() - self.started, 3),
                "arena": {"name": self.arena.name, "size": g.total_size, "slots": g.slot_count,
                          "largest_extent": self.dispatcher.extents.largest},
                "max_request_bytes": self.dispatcher.max_request, "request_timeout_s": config.request_timeout_s,
                "stats": {name: self.arena.stat(name) for name in layout.STAT_NAMES},
                "lanes": self.regions.lane_count, "workers": workers, "v2": dict(self.front_doors),
                "doors": [d if private else {**d, "pid": None} for d in self.doors()],
                "limits": self.limits(),
                "cancelled": [{"model": v.name, "version": v.version, **self.cancelled_of(v.name, v.version)}
                              for v in self.models.versions()],
                "queues": self.queues(),
                "rate_limits": self.rate.describe(),
                "history": None if self.history is None else self.history.windows(self.sample(time.monotonic()))}
