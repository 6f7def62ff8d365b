"""Model lifecycle: load, swap, scale, drain and unload model versions while serving.

Owns: what moves every version's *phase* (the events of the table in
``shmserve.frontend.models``) and the operations that do it — start-up,
``load`` (a version's workers are started and warmed *beside* the serving
one, by the one bring-up, ``_bring_up``; only once all are ready does the
model's default move to it, in one step), ``unload``, ``scale``, a reload's
differences (``apply``), loading on demand and eviction under the memory
budget (each request counted once as use: ``observe``, ``note_lane_use``),
canaries (start, promote, abort, the analysis every CANARY_TICK_S, acting on
a rollout's end; the lane calls' outcomes fed into its windows,
``note_lane_outcomes``; a new routing epoch on each change, ``_route_changed``), and the log of every decision (``events``) with the
counters metrics export.  One operation per model at a time (a lock per
model name); the others wait.  Time and timers come from an injected
``Clock`` (the event loop's in the server, a fake in tests), and the
server wires the hooks other parts call (the dispatcher's ``load_on_demand``
and ``observe``, the supervisor's ``worker_ready``), so the whole lifecycle
runs in one process against a fake supervisor (``tests/test_lifecycle_fast.py``).

Operations: a control call (load, unload, scale, canary start, promote,
abort) runs as a task the lifecycle owns; its caller awaits a shielded
result.  So a caller that leaves half-way (its connection closed, its RPC
cancelled, its deadline passed) cancels only its own wait: the operation
runs to its end, and no version is left half-drained.  Each is idempotent:
an identical call while one runs joins it (and gets its answer), and
repeated after it ended it changes nothing (a version already serving is
not loaded again; unloading what is not loaded unloads nothing).

Draining a version (replaced, unloaded, evicted, scaled down): its workers
take nothing new (``WorkerHandle.retiring``); its lanes are handed to the
model's new default version (the old worker drops each one after the calls in
hand, then the next one serves the lane's queue on from there: nothing
fails); requests parked for it that named no version move to the default; what
its workers have queued or running finishes — a STOP entry behind it — within
``server.version_drain_timeout_s``, after which they are terminated and what
they still held fails MODEL_UNAVAILABLE, saying so.  Then the version's memory
is released with its processes.

Phases: a version's phase moves only by the events of the table in
``shmserve.frontend.models`` (``Phase``, ``PhaseEvent``, ``TRANSITIONS``);
this module decides which event happens when.

Must not: touch requests, slots or sockets (the dispatcher moves parked
requests: ``Dispatcher.settle``), start processes itself (the supervisor
does), copy requests for a shadow canary (``shmserve.frontend.shadow``), or
read the system clock for a decision.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from typing import Awaitable, Callable, Coroutine

from shmserve import layout, protocol, repository
from shmserve.config import ModelConfig, ServerConfig
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend import canary
from shmserve.frontend.models import (DRAINING, EVICTED, FAILED_LOAD, LOADING, MODEL_UNAVAILABLE, SERVING, UNLOADED,
                                      Model, ModelState, Models, PhaseEvent)
from shmserve.supervisor import READY, WorkerHandle

log = logging.getLogger("shmserve.lifecycle")

EVENTS_KEPT = 500  # the decision log ``inspect`` and ``repository`` show
CANARY_TICK_S = 0.5  # how often running canaries are analysed
ROLLOUTS_KEPT = 10  # finished canaries kept per model (their snapshots)
ROOM_RETRY_S = 0.5  # a load on demand that found no room tries again this often while requests wait for it


@dataclasses.dataclass
class _Tally:
    """One worker's requests, as the lifecycle counts them for residency (``note_lane_use``)."""

    finished: int = 0  # its own counter (the arena's worker table) at the last look: every call it ran
    observed: int = 0  # of those, the ones the dispatcher saw end (socket requests: ``observe``)
    lanes: int = 0  # lane calls counted as use so far
    observed_errors: int = 0  # of ``observed``, those the worker answered with an error
    lane_errors: int = 0  # of ``lanes``, those the worker answered with an error (as far as known: below)


async def _nothing() -> None:
    pass


def _announced(method):
    """A lifecycle entry whose caller hears its outcome only once every door process routes by it
    (``Lifecycle.announce``), whether it succeeded or raised."""
    @functools.wraps(method)
    async def announced(self, *args, **kwargs):
        try:
            return await method(self, *args, **kwargs)
        finally:
            await self.announce()
    return announced


class Lifecycle:
    """The model lifecycle of one front-end (module docstring).

    ``config()`` returns the configuration in force; ``supervisor``, ``dispatcher`` and
    ``regions`` are the parts it moves (the supervisor starts and retires workers:
    ``add_worker``, ``wait_ready``, ``retire``); ``clock`` its time and timers (the
    dispatcher's ``Clock``: the event loop's in the server, a fake in tests);
    ``startup_timeout`` bounds one load; ``finished(w)`` how many requests worker ``w`` has
    finished (socket and lane calls: ``note_lane_use``); ``lane_counts(w)`` its lane calls'
    outcomes as the canary windows take them (``note_lane_outcomes``).  The server wires the hooks other
    parts call: the dispatcher's ``load_on_demand`` and ``observe``, the supervisor's
    ``worker_ready``; canary shadowing is ``shmserve.frontend.shadow``'s.
    """

    def __init__(self, models: Models, supervisor, dispatcher, regions, config: Callable[[], ServerConfig], *,
                 clock, startup_timeout: float, finished: Callable[[object], int] | None = None,
                 failed: Callable[[object], int] | None = None,
                 lane_counts: Callable[[object], tuple[int, tuple[int, ...]]] | None = None):
        self.models, self.supervisor, self.dispatcher, self.regions = models, supervisor, dispatcher, regions
        self.clock = clock
        # How many requests a worker has finished (the arena's worker table): lane calls are seen only there;
        # and how many of them it answered with an error (``failed``: the lane calls' outcomes, for metrics).
        self.finished, self.failed = finished, failed
        self.tallies: dict[WorkerHandle, _Tally] = {}  # per worker: what counted as use so far
        # A worker's lane outcomes (faults, buckets: the arena's, ``note_lane_outcomes``), and the last look's.
        self.lane_counts = lane_counts
        self.lane_seen: dict[WorkerHandle, tuple[int, tuple[int, ...]]] = {}
        self.config = config
        self.startup_timeout = startup_timeout
        self.locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.events: collections.deque[dict] = collections.deque(maxlen=EVENTS_KEPT)
        self.counts: collections.Counter = collections.Counter()  # (what, model) -> n: loads, failures, evictions
        self.seconds: collections.Counter = collections.Counter()  # (what, model) -> total s: load, warmup
        self.tasks: set[asyncio.Task] = set()
        self.operations: dict[tuple, asyncio.Task] = {}  # control operations running, by what they do
        self.draining: dict[ModelState, asyncio.Future] = {}  # versions being drained: done once they are
        self.stopping = False
        self._ticker = None  # the clock's handle of the next canary analysis
        # The door processes (frontend/doorhouse.py): ``on_change`` after every recorded step (a models
        # message goes to every door), ``announce`` awaited before a control call or apply answers, so
        # every door routes by the new state before the caller hears of it.  No doors: no-ops.
        self.on_change: Callable[[], None] = lambda: None
        self.announce: Callable[[], Awaitable] = _nothing

    # -- the control calls (the doors' entry) ---------------------------------------------------

    @_announced
    async def control(self, call: protocol.ControlCall, by: str = "") -> dict:
        """Carry out a checked control call; the reply's body, once every door process routes by
        its outcome (``announce``).  Raises ShmserveError as the operation does."""
        if self.stopping:
            raise ShmserveError(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        K = protocol.Kind
        if call.kind is K.LOAD:
            v = await self.load(call.model, call.version, call.instances, keep=call.keep, by=by)
            return {"model": v.name, "version": v.version, "state": v.phase, "workers": len(self._live(v)),
                    "load_seconds": None if v.load_seconds is None else round(v.load_seconds, 3)}
        if call.kind is K.UNLOAD:
            return {"model": call.model, "unloaded": await self.unload(call.model, call.version, by=by)}
        if call.kind is K.SCALE:
            v = await self.scale(call.model, call.instances, call.version, by=by)
            return {"model": v.name, "version": v.version, "workers": len(self._live(v))}
        return await self.canary(call.model, call.action, call.version, call.plan or {}, by=by)

    # -- where versions come from -----------------------------------------------------------

    def file_models(self) -> dict[str, ModelConfig]:
        return {m.name: m for m in self.config().models}

    def repository(self) -> dict[str, repository.RepoModel]:
        root = self.config().model_repository
        return repository.scan(root) if root else {}

    def config_for(self, name: str, version: int | None = None) -> ModelConfig:
        """The configuration of ``name``'s ``version`` (None: the newest its policy selects).

        Raises ShmserveError: UNKNOWN_MODEL (no such model or version), PERMISSION_DENIED (a
        path leaves the repository), BAD_ARGUMENT (its config.toml is written wrong, the key
        named), MODEL_UNAVAILABLE (its files are not there to use)."""
        file_model = self.file_models().get(name)
        if file_model is not None:
            if version not in (None, file_model.version):
                raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"model {name!r} comes from the config file and has "
                                                             f"only version {file_model.version}")
            return file_model
        root = self.config().model_repository
        if not root:
            raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r} in the config file, and no "
                                                         f"model repository (server.model_repository)")
        return repository.version_config(root, name, version)

    def desired(self) -> dict[str, dict[int, ModelConfig]]:
        """What the configuration and the repository say should be loaded now: per model, the
        versions (the config file's models are version 1; a repository model's, those its
        version policy selects).  Broken repository models are logged and left out."""
        out: dict[str, dict[int, ModelConfig]] = {m.name: {m.version: m} for m in self.config().models}
        for name, entry in self.repository().items():
            if name in out:
                log.warning("model %r is both in the config file and in the repository; the config file's is "
                            "served", name)
                continue
            if entry.error:
                log.error("repository: model %r: %s", name, entry.error)
                continue
            versions = {}
            for v in entry.versions:
                if v.version in entry.selected and v.config is not None:
                    versions[v.version] = v.config
                elif v.version in entry.selected:
                    log.error("repository: model %r version %d: %s", name, v.version, v.error)
            if versions:
                out[name] = versions
        return out

    # -- start-up ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load every version the configuration and repository select (``load = "on_demand"``
        ones only on their first request), all at once, and wait for them (ready or not: the
        workers of one that cannot load are reported as the supervisor says)."""
        loads = []
        for name, versions in sorted(self.desired().items()):
            model = self.models.model(name)
            for number, cfg in sorted(versions.items()):
                version = model.versions[number] = ModelState(model.index, name, cfg, phase=UNLOADED)
                if cfg.load == "on_demand":
                    model.on_demand = True
                    version.reason = "loaded on its first request (load = \"on_demand\")"
                    continue
                loads.append(self._start_version(version, give_up=False))
            self._default_newest(model)
        await asyncio.gather(*loads)
        for model in self.models.by_name.values():
            self._default_newest(model)

    # -- control calls ----------------------------------------------------------------------

    def _operation(self, key: tuple, start: Callable[[], Coroutine]) -> Awaitable:
        """Run the control operation ``start()`` as a task the lifecycle owns and return a shielded
        wait for its result (module docstring: operations).  A caller cancelled while it waits
        cancels only its wait.  An identical operation (the same ``key``) already running is
        joined instead of started again."""
        task = self.operations.get(key)
        if task is None:
            task = self.operations[key] = self._spawn_task(start())
            task.add_done_callback(functools.partial(self._operation_done, key))
        return asyncio.shield(task)

    def _operation_done(self, key: tuple, task: asyncio.Task) -> None:
        if self.operations.get(key) is task:
            del self.operations[key]

    async def load(self, name: str, version: int | None = None, instances: int | None = None, *,
                   keep: bool = False, by: str = "") -> ModelState:
        """Load ``version`` of ``name`` (None: the newest its policy selects) with ``instances``
        workers (None: its config's), warm it, and make it the default in one step; the version
        serving before drains and is unloaded unless ``keep``.  An already serving version is
        only scaled to ``instances`` and made the default.  Runs to its end even if the caller
        leaves (``_operation``).

        Raises ShmserveError: UNKNOWN_MODEL, PERMISSION_DENIED (``config_for``), OVERLOADED (no
        free worker entries, or the memory budget cannot be met), MODEL_UNAVAILABLE (its
        workers could not load it: the reason; what served before still does)."""
        return await self._operation(("load", name, version, instances, keep),
                                     lambda: self._load(name, version, instances, keep, by))

    async def _load(self, name: str, version: int | None, instances: int | None, keep: bool,
                    by: str) -> ModelState:
        async with self.locks[name]:
            cfg = self.config_for(name, version)
            if instances is not None:
                cfg = dataclasses.replace(cfg, instances=instances)
            model = self.models.model(name)
            current = model.versions.get(cfg.version)
            if current is not None and current.phase == SERVING and current.state == MODEL_UNAVAILABLE:
                await asyncio.gather(*(self.supervisor.retire(w, 0) for w in current.workers))  # all failed
                current.workers.clear()
            elif current is not None and current.phase == SERVING:
                if instances is not None:
                    await self._scale(current, instances, by)
                await self._make_default(model, current, keep, by)
                return current
            if current is None:
                current = model.versions[cfg.version] = ModelState(model.index, name, cfg, phase=UNLOADED)
            else:
                current.config = cfg
            model.on_demand = model.on_demand or cfg.load == "on_demand"
            if not await self._start_version(current, give_up=True, by=by):
                still = model.current
                serves = still is not None and still is not current and still.phase == SERVING
                raise ShmserveError(ErrorCode.MODEL_UNAVAILABLE, f"version {cfg.version} of model {name!r} did not "
                                                                 f"load: {current.reason}" +
                                    (f"; version {still.version} still serves" if serves else ""))
            current.explicit = True
            await self._make_default(model, current, keep, by)
            return current

    async def unload(self, name: str, version: int | None = None, *, by: str = "") -> list[int]:
        """Drain and unload ``version`` of ``name`` (None: every version); the versions this call
        unloaded (none if none was loaded: nothing to do).  If the default goes, the newest other
        serving version becomes it.  Runs to its end even if the caller leaves.  UNKNOWN_MODEL if
        there is no such model or version."""
        return await self._operation(("unload", name, version), lambda: self._unload(name, version, by))

    async def _unload(self, name: str, version: int | None, by: str) -> list[int]:
        async with self.locks[name]:
            model = self.models.get(name)
            if model is None or not model.versions:
                raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r}")
            if version is not None and version not in model.versions:
                raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"model {name!r} has no version {version}")
            targets = [v for v in model.versions.values() if v.phase in (SERVING, LOADING)
                       and (version is None or v.version == version)]
            if not targets:
                return []  # not loaded (unloaded by an earlier call, evicted, or it failed to load)
            why = f"unloaded{' by ' + by if by else ''}"
            await asyncio.gather(*(self._drain(v, UNLOADED, why) for v in targets))
            return [v.version for v in targets]

    async def scale(self, name: str, instances: int, version: int | None = None, *, by: str = "") -> ModelState:
        """Run ``instances`` workers for ``version`` of ``name`` (None: its default): new ones are
        started and warmed before they take work; removed ones finish what they have queued
        first, their lanes handed to the others.  UNKNOWN_MODEL, BAD_ARGUMENT, OVERLOADED,
        MODEL_UNAVAILABLE (a new worker could not load it; the others keep serving)."""
        if type(instances) is not int or not 1 <= instances <= 64:
            raise ShmserveError(ErrorCode.BAD_ARGUMENT, f"instances must be an integer in [1, 64], got {instances!r}")
        return await self._operation(("scale", name, instances, version),
                                     lambda: self._scale_model(name, instances, version, by))

    async def _scale_model(self, name: str, instances: int, version: int | None, by: str) -> ModelState:
        async with self.locks[name]:
            model = self.models.get(name)
            target = None
            if model is not None:
                target = model.current if version is None else model.versions.get(version)
            if target is None or target.phase != SERVING:
                raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"model {name!r} has no serving version"
                                    + (f" {version}" if version is not None else ""))
            await self._scale(target, instances, by)
            return target

    # -- canary releases ----------------------------------------------------------------------

    async def canary(self, name: str, action: str, version: int | None = None, plan: dict | None = None, *,
                     by: str = "") -> dict:
        """``start`` a canary of ``version`` against ``name``'s default under ``plan`` (the
        candidate is loaded beside it if it is not serving), ``promote`` or ``abort`` the running
        one, or report its ``status``; the rollout's snapshot.  A start, promote or abort runs to
        its end even if the caller leaves.  UNKNOWN_MODEL, BAD_ARGUMENT (a bad plan, a canary
        already running or none running), and what ``load`` raises."""
        if action == "status":
            return self.canary_status(name)
        return await self._operation(("canary", name, action, version, repr(plan)),
                                     lambda: self._canary_action(name, action, version, plan, by))

    def canary_status(self, name: str) -> dict:
        model = self.models.get(name)
        if model is None:
            raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r}")
        if model.rollout is not None:
            return model.rollout.snapshot(self.clock.monotonic())
        if model.rollouts:
            return model.rollouts[-1]
        raise ShmserveError(ErrorCode.BAD_ARGUMENT, f"model {name!r} has had no canary")

    async def _canary_action(self, name: str, action: str, version: int | None, plan: dict | None,
                             by: str) -> dict:
        model = self.models.get(name)
        if model is None:
            raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r}")
        now = self.clock.monotonic()
        if action in ("promote", "abort"):
            rollout = model.rollout
            if rollout is None:
                raise ShmserveError(ErrorCode.BAD_ARGUMENT, f"model {name!r} has no canary running")
            try:
                decision = rollout.promote(now, by or "operator") if action == "promote" else \
                    rollout.abort(now, f"aborted{' by ' + by if by else ''}")
            except canary.IllegalTransition as exc:
                raise ShmserveError(ErrorCode.BAD_ARGUMENT, str(exc)) from None
            await self._rollout_decided(model, [decision])
            return model.rollouts[-1] if model.rollouts else rollout.snapshot(now)
        try:
            checked = canary.CanaryPlan.from_dict(plan or {})
        except ValueError as exc:
            raise ShmserveError(ErrorCode.BAD_ARGUMENT, str(exc)) from None  # it names the plan and the field
        async with self.locks[name]:
            if model.rollout is not None:
                raise ShmserveError(ErrorCode.BAD_ARGUMENT, f"model {name!r} already has a canary running "
                                                            f"(version {model.rollout.candidate}); promote or "
                                                            f"abort it first")
            stable = model.current
            if stable is None or stable.phase != SERVING:
                raise ShmserveError(ErrorCode.MODEL_UNAVAILABLE, f"model {name!r} has no serving version to "
                                                                 f"compare a canary with")
            if version == stable.version:
                raise ShmserveError(ErrorCode.BAD_ARGUMENT, f"version {version} is already the default of "
                                                            f"{name!r}")
            cfg = self.config_for(name, version)
            candidate = model.versions.get(cfg.version)
            if candidate is None:
                candidate = model.versions[cfg.version] = ModelState(model.index, name, cfg, phase=UNLOADED)
            if candidate.phase != SERVING:
                candidate.config = cfg
                if not await self._start_version(candidate, give_up=True, by=f"canary{' by ' + by if by else ''}"):
                    raise ShmserveError(ErrorCode.MODEL_UNAVAILABLE, f"canary version {cfg.version} of {name!r} "
                                                                     f"did not load: {candidate.reason}")
            self.note_lane_outcomes()  # the lane calls before it are none of its outcomes
            model.rollout = canary.Rollout(name, stable.version, candidate.version, checked, self.clock.monotonic())
            self._route_changed(model)  # lane clients route by the rollout from their next call
            self._event(candidate, "canary", f"started against version {stable.version} ({checked.mode}, steps "
                                             f"{list(checked.steps)}%)" + (f" by {by}" if by else ""))
            self._tick_soon()
            return model.rollout.snapshot(self.clock.monotonic())

    def observe(self, req, ok: bool) -> None:
        """The dispatcher's report of a request that ran (``ok``: it succeeded): canary analysis
        and the version's request rate."""
        version = req.model
        now = self.clock.monotonic()
        version.meter.hit(now)
        version.uses += 1
        if req.worker is not None:
            tally = self.tallies.setdefault(req.worker, _Tally())
            tally.observed += 1
            tally.observed_errors += not ok
        model = self.models.by_name.get(version.name)
        if model is not None and model.rollout is not None:
            model.rollout.record(version.version, ok, max(0.0, now - req.started), now)

    def note_lane_use(self) -> None:
        """Count the lane calls each version's workers finished since the last look as its use
        (residency's last use and rate; the v2 statistics' last inference), each exactly once.
        Lane calls never pass the dispatcher, so only a worker's own counter sees them, and it
        counts socket requests too: those the dispatcher saw end (``observe`` counted them), and
        those it has not collected yet, which are among the worker's in-flight slots.  So what
        the counter holds beyond the two is at most the lane calls it ran, and exactly that once
        it has no socket request in flight; what it reaches above the lane calls already counted
        is counted now.  (A socket request a dead worker held is failed by the front-end, so
        observed without the worker counting it: that worker's next lane calls as many go
        uncounted, never one twice.)  The lane calls that failed are bounded the same way from the
        worker's error counter (``failed``) and the dispatcher's errors (``observe``), for the
        request totals metrics export (``lane_outcomes``).  The server calls this with its
        heartbeat; also each look at the lanes that says how long one has had a call pending.
        Nothing without ``finished``."""
        if self.finished is None:
            return
        now = self.clock.monotonic()
        for version in self.models.versions():
            calls = 0
            for w in version.workers:
                tally = self.tallies.setdefault(w, _Tally())
                count = self.finished(w)
                if count > tally.finished:
                    version.progress_at = now
                tally.finished = count
                lanes = count - tally.observed - len(w.inflight)
                if lanes > tally.lanes:
                    calls += lanes - tally.lanes
                    tally.lanes = lanes
                if self.failed is not None:  # at least this many of its lane calls failed: the same bound
                    tally.lane_errors = max(tally.lane_errors, min(tally.lanes, self.failed(w) - tally.observed_errors
                                                                   - len(w.inflight)))
            if version.phase == SERVING:  # each look at its lanes (residency: how long one is pending)
                self.regions.lane_pending_since(version, now)
            if calls:
                version.meter.hit(now, calls)
                version.uses += calls
                version.last_used = max(version.last_used, now)
        live = {w for v in self.models.versions() for w in v.workers}
        self.tallies = {w: t for w, t in self.tallies.items() if w in live}

    def lane_outcomes(self) -> dict[tuple[str, int], tuple[int, int]]:
        """``(model, version) -> (ok, error)``: the lane calls its live workers finished, as
        counted at the last look (``note_lane_use``)."""
        out: dict[tuple[str, int], tuple[int, int]] = {}
        for w, tally in self.tallies.items():
            key = (w.model.name, w.model.version)
            ok, err = out.get(key, (0, 0))
            out[key] = (ok + tally.lanes - tally.lane_errors, err + tally.lane_errors)
        return out

    def note_lane_outcomes(self) -> None:
        """Feed the lane calls each rollout's versions' workers counted since the last look into
        its windows (``canary.Rollout.record_lane_calls``): lane calls never pass the dispatcher,
        so only a worker's own count of them (``lane_counts(w)``: its faults and its bucketed
        claim-to-publish times, ``layout.read_lane_outcomes``) sees them.  Every worker's counts
        are kept at each look, so a rollout counts only what came after its start; a count that
        went down (a new worker in a reused entry) starts again from zero.  The server calls this
        with its heartbeat.  Nothing without ``lane_counts``."""
        if self.lane_counts is None:
            return
        now = self.clock.monotonic()
        seen: dict[WorkerHandle, tuple[int, tuple[int, ...]]] = {}
        for model in self.models.by_name.values():
            for version in model.versions.values():
                for w in version.workers:
                    faults, buckets = seen[w] = self.lane_counts(w)
                    before = self.lane_seen.get(w)
                    if model.rollout is None or before is None:
                        continue
                    if faults < before[0] or any(b < a for a, b in zip(before[1], buckets)):
                        before = (0, (0,) * len(buckets))
                    calls = [(layout.lane_bucket_seconds(i), n - m)
                             for i, (m, n) in enumerate(zip(before[1], buckets)) if n > m]
                    if calls:
                        model.rollout.record_lane_calls(version.version, calls, faults - before[0], now)
        self.lane_seen = seen

    def _route_changed(self, model: Model) -> None:
        """``model``'s routing changed (its rollout started, took a decision, ended): a new epoch,
        written into its lanes (``RegionTable.route_changed``), so that each lane client asks for
        the route again before its next call."""
        model.route_epoch = (model.route_epoch + 1) & 0xFFFFFFFF
        self.regions.route_changed(model.name, model.route_epoch)

    def _tick_soon(self) -> None:
        if self._ticker is None and not self.stopping:
            self._ticker = self.clock.call_later(CANARY_TICK_S, self._tick)

    def _tick(self) -> None:
        self._ticker = None
        self.note_lane_outcomes()  # the lane calls since the last look: the analysis sees them too
        now = self.clock.monotonic()
        running = False
        for model in list(self.models.by_name.values()):
            if model.rollout is None:
                continue
            decisions = model.rollout.tick(now)
            if decisions:
                self._spawn_task(self._rollout_decided(model, decisions))
            running = True
        if running:
            self._tick_soon()

    async def _rollout_decided(self, model: Model, decisions: list) -> None:
        """Log ``decisions`` and act on a rollout that ended: COMPLETE makes the candidate the
        default (the stable version drains); ROLLED_BACK and ABORTED unload the candidate."""
        rollout = model.rollout
        if rollout is None:
            return
        candidate = model.versions.get(rollout.candidate)
        for d in decisions:
            self.counts[(f"canary_{d.kind}", model.name)] += 1
            if candidate is not None:
                self._event(candidate, f"canary {d.kind}", f"{d.percent:g}%: {d.reason}")
        if rollout.state not in canary.TERMINAL:
            self._route_changed(model)
            return
        model.rollout = None
        self._route_changed(model)  # off the candidate at once (a rollback): its lanes move to the stable below
        model.rollouts.append(rollout.snapshot(self.clock.monotonic()))
        del model.rollouts[:-ROLLOUTS_KEPT]
        async with self.locks[model.name]:
            if candidate is None or candidate.phase != SERVING:
                return
            if rollout.state == canary.RolloutState.COMPLETE:
                await self._make_default(model, candidate, keep=False, by="canary complete")
            else:
                stable = model.versions.get(rollout.stable)
                if stable is not None and stable.phase == SERVING:
                    model.default = stable.version
                for w in list(candidate.workers):
                    self.regions.move_lanes(w, stable)
                self.dispatcher.settle(candidate)
                await self._drain(candidate, UNLOADED, f"canary {rollout.state.value.replace('_', ' ')}")

    # -- reload -----------------------------------------------------------------------------

    @_announced
    async def apply(self) -> list[str]:
        """Bring what is loaded to what the configuration and repository say now (SIGHUP): new
        models and versions are loaded, versions no longer selected are drained and unloaded, a
        changed version's workers are replaced by new ones (started and warmed first), a changed
        instance count is scaled; each model's newest serving version is its default.  What it
        did, one line per change (failures logged; the rest goes on)."""
        desired = self.desired()
        done: list[str] = []

        async def one(name: str) -> None:
            async with self.locks[name]:
                model = self.models.model(name)
                want = desired.get(name, {})
                for number, cfg in sorted(want.items()):
                    version = model.versions.get(number)
                    if version is None or version.phase in (UNLOADED, EVICTED, FAILED_LOAD):
                        if version is None:
                            version = model.versions[number] = ModelState(model.index, name, cfg, phase=UNLOADED)
                        version.config = cfg
                        if cfg.load == "on_demand":
                            model.on_demand = True
                            if version.phase == FAILED_LOAD:
                                version.advance(PhaseEvent.RESET, "loaded on its next request (reload)")
                            continue
                        if await self._start_version(version, give_up=True, by="reload"):
                            done.append(f"loaded {version.key}")
                        continue
                    if version.phase != SERVING:
                        continue
                    if dataclasses.replace(version.config, instances=cfg.instances) != cfg \
                            or version.state == MODEL_UNAVAILABLE:
                        if await self._replace_workers(version, cfg):
                            done.append(f"replaced the workers of {version.key} (new settings)")
                    elif cfg.instances != len(self._live(version)):
                        try:
                            await self._scale(version, cfg.instances, "reload")
                            done.append(f"scaled {version.key} to {cfg.instances}")
                        except ShmserveError as exc:
                            log.error("reload: %s: %s", version.key, exc.message)
                    version.config = dataclasses.replace(version.config, instances=cfg.instances) \
                        if version.config != cfg else version.config
                gone = [v for v in model.versions.values() if v.phase in (SERVING, LOADING)
                        and v.version not in want and not v.explicit]
                newest = max((v for v in model.versions.values() if v.phase == SERVING and v not in gone),
                             key=lambda v: v.version, default=None)
                if newest is not None and model.default != newest.version and model.rollout is None:
                    await self._make_default(model, newest, keep=True, by="reload")
                elif newest is None and model.default is None:  # an on_demand one unloaded by a call:
                    registered = [n for n, cfg in want.items() if cfg.load == "on_demand"]  # as at start-up
                    model.default = max(registered, default=None)
                for v in gone:
                    await self._drain(v, UNLOADED, "no longer in the configuration (reload)")
                    done.append(f"unloaded {v.key}")
                if not want and not model.serving():
                    model.on_demand = False

        await asyncio.gather(*(one(name) for name in sorted(set(desired) | set(self.models.by_name))))
        return done

    # -- on demand and the memory budget ------------------------------------------------------

    def load_on_demand(self, version: ModelState) -> None:
        """A request asked for ``version``, which is loaded on demand and not loaded: load it now
        (the request waits for it, within its timeout).  Its phase is LOADING from this call on."""
        if version.phase not in (UNLOADED, EVICTED) or self.stopping:
            return
        version.advance(PhaseEvent.LOAD, "loading on demand")
        self._spawn_task(self._load_on_demand(version))

    async def _load_on_demand(self, version: ModelState) -> None:
        """Load ``version`` for the requests waiting for it.  If the memory budget has no room for
        it now (what holds the memory is busy, or pinned), it is tried again every ROOM_RETRY_S
        while requests still wait; once none does, it is UNLOADED again (NO_ROOM) with the
        reason, and the next request tries again."""
        while True:
            async with self.locks[version.name]:
                if version.phase != LOADING:  # unloaded or loaded meanwhile by a control call
                    return
                try:
                    await self._make_room(version)
                except ShmserveError as exc:
                    refused = exc.message
                else:
                    ok = await self._start_version(version, give_up=True, by="on demand", room_made=True)
                    model = self.models.by_name[version.name]
                    if ok and (model.current is None or model.current.phase != SERVING):
                        model.default = version.version
                    self.dispatcher.settle(version)
                    return
                budget = self.budget(version.config.device)
                fits_ever = budget is not None and version.memory.get("measured_bytes", 0) <= budget
                if not (fits_ever and self._wanted(version)) or self.stopping:
                    version.advance(PhaseEvent.NO_ROOM, f"no room to load it on demand: {refused}")
                    self.counts[("load_failed", version.name)] += 1
                    self._event(version, "load failed", version.reason)
                    self.dispatcher.settle(version)  # those waiting are answered with the reason
                    return
                if not version.reason.startswith("waiting for room"):
                    self._event(version, "waiting for room", refused)
                version.reason = f"waiting for room: {refused}"
            await self._sleep(ROOM_RETRY_S)

    def footprint(self, version: ModelState) -> int:
        """The bytes ``version`` uses on its device, as measured when its workers were ready: host
        memory (RSS) for a CPU model, device memory for a GPU model."""
        key = "host_bytes" if version.config.device == "cpu" else "device_bytes"
        return sum(int((w.memory or {}).get(key) or 0) for w in version.workers if w.state == READY)

    def budget(self, device: str) -> int | None:
        return dict(self.config().memory_budget).get(device)

    async def _make_room(self, version: ModelState) -> None:
        """Evict idle on-demand versions on ``version``'s device until it fits the budget (its
        size as last measured; 0 before its first load, checked again once measured).
        OVERLOADED if it cannot fit without evicting a busy, pinned or startup-loaded version."""
        from shmserve.frontend import residency

        device = version.config.device
        budget = self.budget(device)
        if budget is None:
            return
        self.note_lane_use()  # lane calls since the last heartbeat count too
        now = self.clock.monotonic()
        resident = [residency.Resident(v.key, device, self.footprint(v), v.last_used, self.rate(v),
                                       self.dispatcher.busy(v) or self.lane_busy(v, now),
                                       v.config.pinned, v.config.load == "on_demand")
                    for v in self.models.versions() if v.phase == SERVING and v is not version
                    and v.config.device == device]
        need = version.memory.get("measured_bytes", 0)
        choice = residency.victims(device, budget, resident, need, now)
        if choice.refused is not None:
            raise ShmserveError(ErrorCode.OVERLOADED, f"cannot load {version.key} ({need} bytes as last measured): "
                                                      f"{choice.refused}")
        by_key = {v.key: v for v in self.models.versions()}
        for key in choice.keys:
            victim = by_key[key]
            self.counts[("eviction", victim.name)] += 1
            self._event(victim, "evict", f"to make room for {version.key} on {device} "
                                         f"(server.memory_budget.{device} = {budget})")
            started = self.clock.monotonic()
            await self._drain(victim, EVICTED, f"evicted to make room for {version.key}")
            self.seconds[("eviction", victim.name)] += self.clock.monotonic() - started

    def _wanted(self, version: ModelState) -> bool:
        """Whether a request waits for ``version`` (parked), or a lane of it holds a call that is
        believable (pending for less than ``server.request_timeout_s``, every call's deadline)."""
        if self.dispatcher.busy(version):
            return True
        now = self.clock.monotonic()
        since = self.regions.lane_pending_since(version, now)
        return since is not None and now - since <= self.config().request_timeout_s

    def load_for_lanes(self) -> None:
        """Load again each evicted on_demand version that is its model's default and has a lane
        call pending (a lane call never passes the dispatcher, so the server's heartbeat looks:
        its calls wait in the lane, and the version's new worker takes the lane)."""
        for version in self.models.versions():
            if version.phase == EVICTED and version.config.load == "on_demand" and not self.stopping \
                    and self.models.by_name[version.name].default == version.version and self._wanted(version):
                self.load_on_demand(version)

    def lane_busy(self, version: ModelState, now: float) -> bool:
        """Whether ``version``'s lanes keep it from being evicted: one holds a call queued or running,
        and that is believable.  What a lane says is the client's to write, so a lane pending for
        longer than ``server.request_timeout_s`` (every call's deadline) counts only while the
        version's workers are still finishing calls (they finished one within that time): a client
        that leaves a READY word nobody claims, rewrites it, or has left, pins nothing past its
        deadline (issue 23 item 6)."""
        since = self.regions.lane_pending_since(version, now)
        if since is None:
            return False
        stale_s = self.config().request_timeout_s
        return now - since <= stale_s or now - version.progress_at <= stale_s

    def rate(self, version: ModelState) -> float:
        return version.meter.rate(self.clock.monotonic())

    # -- the steps ------------------------------------------------------------------------

    async def _start_version(self, version: ModelState, *, give_up: bool, by: str = "",
                             room_made: bool = False) -> bool:
        """Start and warm ``version``'s workers; whether all became ready.  ``give_up``: a failed
        load stops its workers and leaves the version FAILED_LOAD (a control call, a reload, on
        demand); otherwise (start-up) the workers that failed stay as the supervisor left them
        (restarting with back-off, or failed) and the version is SERVING regardless.
        ``room_made``: the caller has made room under the memory budget already."""
        if version.phase == LOADING:  # on demand: it is from the request on
            version.reason = f"loading{' (' + by + ')' if by else ''}"
        else:
            version.advance(PhaseEvent.LOAD, f"loading{' (' + by + ')' if by else ''}")
        version.drain_failure = None
        self._event(version, "load", by or "start-up")
        started = self.clock.monotonic()
        try:
            if give_up and not room_made:
                await self._make_room(version)
            workers = await self._bring_up(version, version.config, version.config.instances, keep_failed=not give_up)
        except ShmserveError as exc:
            version.advance(PhaseEvent.FAIL, exc.message)
            self.counts[("load_failed", version.name)] += 1
            self._event(version, "load failed", exc.message)
            self.dispatcher.settle(version)
            return False
        unready = sorted({w.error or w.last_exit or "not ready" for w in workers if w.state != READY})
        if unready:  # start-up: it serves with what is ready; its workers' states say the rest
            self.counts[("load_failed", version.name)] += 1
            version.load_seconds = self.clock.monotonic() - started
            version.degraded = True
            version.advance(PhaseEvent.READY, "; ".join(unready))
            self._event(version, "not ready", version.reason)
        else:
            version.advance(PhaseEvent.READY)
            self._loaded(version, workers, started, by)
        version.memory = {"measured_bytes": self.footprint(version)}
        version.last_used = max(version.last_used, self.clock.monotonic())  # loaded counts as used (residency)
        if give_up and self.budget(version.config.device) is not None:
            await self._make_room_after(version)
        return True

    async def _bring_up(self, version: ModelState, cfg: ModelConfig, count: int, *,
                        keep_failed: bool = False) -> list[WorkerHandle]:
        """Start ``count`` workers of ``cfg`` for ``version`` and wait until each is ready or has
        failed; the new workers.  Ready ones take work at once (lanes waiting attached, parked
        requests served).  Unless ``keep_failed`` (start-up: the supervisor restarts them), a
        worker that did not become ready stops them all again.  Raises ShmserveError: OVERLOADED
        (no free worker entry: none is started), MODEL_UNAVAILABLE (why they did not load)."""
        new: list[WorkerHandle] = []
        try:
            for _ in range(count):
                new.append(self.supervisor.add_worker(cfg))
        except ShmserveError:
            await asyncio.gather(*(self.supervisor.retire(w, 0) for w in new))
            raise
        version.workers.extend(new)
        if not await self.supervisor.wait_ready(new, self.startup_timeout) and not keep_failed:
            errors = sorted({w.error or w.last_exit or "not ready" for w in new if w.state != READY})
            await asyncio.gather(*(self.supervisor.retire(w, 0) for w in new))
            version.workers = [w for w in version.workers if w not in new]
            raise ShmserveError(ErrorCode.MODEL_UNAVAILABLE, "; ".join(errors))
        self.regions.attach_waiting(version)
        self.dispatcher.settle(version)
        return new

    def _loaded(self, version: ModelState, workers: list[WorkerHandle], started: float, by: str) -> None:
        """``workers`` of ``version``, started at ``started``, are all ready: what it uses now
        (measured), how long its load took, and why it serves."""
        seconds = self.clock.monotonic() - started
        version.load_seconds = seconds
        version.degraded = False
        self.counts[("load", version.name)] += 1
        self.seconds[("load", version.name)] += seconds
        self.seconds[("warmup", version.name)] += max((float((w.warmup or {}).get("seconds") or 0)
                                                       for w in workers), default=0.0)
        version.memory = {"measured_bytes": self.footprint(version)}
        version.reason = f"loaded in {seconds:.2f} s" + (f" ({by})" if by else "")
        self._event(version, "ready", version.reason)

    def worker_ready(self, w: WorkerHandle) -> None:
        """The supervisor's report that worker ``w`` is ready (a restart included; the server wires
        it): its version's memory is measured again, and a version that served without all its
        workers since start-up says so no more once they all are."""
        version = self.models.version_of(w)
        if version is None or version.phase != SERVING or w.retiring:
            return
        version.memory = {"measured_bytes": self.footprint(version)}
        if version.degraded and all(x.state == READY for x in self._live(version)):
            version.degraded = False
            version.reason = "ready: its workers were ready after start-up"
            self._event(version, "ready", version.reason)

    async def _make_room_after(self, version: ModelState) -> None:
        """Now that ``version``'s size is measured: evict others if the device is over budget."""
        try:
            await self._make_room(version)
        except ShmserveError as exc:
            log.warning("%s", exc.message)

    async def _make_default(self, model: Model, version: ModelState, keep: bool, by: str) -> None:
        """Make ``version`` the default of ``model`` in one step; the one before drains and is
        unloaded unless ``keep``."""
        old = model.current
        model.default = version.version
        self.regions.adopt_lanes(version)
        if old is None or old is version:
            return
        self._event(version, "default", f"was version {old.version}" + (f" ({by})" if by else ""))
        for w in list(old.workers):  # lanes follow the default now
            self.regions.move_lanes(w, version)
        self._route_changed(model)  # (lane clients read the new default's spec before their next call)
        self.dispatcher.settle(old)
        if not keep:
            await self._drain(old, UNLOADED, f"replaced by version {version.version}")

    async def _drain(self, version: ModelState, to: str, why: str) -> None:
        """Stop ``version`` serving (module docstring: draining) and wait until its workers are
        gone; then it is ``to`` (UNLOADED or EVICTED).  A version another operation drains already
        (an eviction, an unload) is waited for; one loading finishes first, and one not loaded has
        nothing to drain."""
        if version.phase == DRAINING and version in self.draining:
            await asyncio.shield(self.draining[version])
            return
        if version.phase != SERVING:
            return
        done = self.draining[version] = asyncio.get_running_loop().create_future()
        try:
            await self._drain_now(version, PhaseEvent.EVICT if to == EVICTED else PhaseEvent.UNLOAD, why)
        finally:
            del self.draining[version]
            done.set_result(None)

    async def _drain_now(self, version: ModelState, end: PhaseEvent, why: str) -> None:
        version.advance(PhaseEvent.DRAIN, why)
        version.evicting = end is PhaseEvent.EVICT  # an on_demand one: requests for it wait meanwhile
        self._event(version, "drain", why)
        model = self.models.by_name[version.name]
        if model.default == version.version:
            newest = max((v for v in model.serving() if v is not version), key=lambda v: v.version, default=None)
            if newest is not None:
                model.default = newest.version
                self.regions.adopt_lanes(newest)
            elif end is not PhaseEvent.EVICT:  # an evicted default stays the default: a request for it loads it again
                model.default = None
        target = model.current if model.current is not version else None
        timeout = self.config().version_drain_timeout_s
        version.drain_failure = (ErrorCode.MODEL_UNAVAILABLE,
                                 f"version {version.version} of model {version.name!r} was {why}, and this request "
                                 f"did not finish within server.version_drain_timeout_s = {timeout:g} s")
        self.dispatcher.settle(version)
        await asyncio.gather(*(self._retire(w, target, timeout) for w in list(version.workers)))
        version.workers.clear()
        version.evicting = False
        version.advance(end, why)
        self._event(version, version.phase.value, why)
        if end is PhaseEvent.EVICT and self._wanted(version):
            self.load_on_demand(version)  # asked for while it was evicted: loaded again, the requests wait
        self.dispatcher.settle(version)
        if target is None and end is not PhaseEvent.EVICT:  # an evicted one's lane calls load it again
            self.regions.fail_lanes(version, f"model {version.name!r} has no version serving now ({why})")

    def _retire(self, w: WorkerHandle, to: ModelState | None, drain_s: float) -> asyncio.Future:
        """Retire worker ``w`` after handing its lanes to ``to`` (or its own version's others)."""
        return self.supervisor.retire(w, drain_s, before=lambda: self.regions.move_lanes(w, to))

    def _live(self, version: ModelState) -> list[WorkerHandle]:
        return [w for w in version.workers if not w.retiring]

    async def _scale(self, version: ModelState, instances: int, by: str) -> None:
        live = self._live(version)
        if instances > len(live):
            try:
                await self._bring_up(version, version.config, instances - len(live))
            except ShmserveError as exc:
                if exc.code is not ErrorCode.MODEL_UNAVAILABLE:
                    raise
                raise ShmserveError(ErrorCode.MODEL_UNAVAILABLE, f"{version.key}: a new worker did not load: "
                                                                 f"{exc.message}") from None
        elif instances < len(live):
            # Those not ready first, then the least busy.
            victims = sorted(live, key=lambda w: (w.state == READY, len(w.inflight)))[:len(live) - instances]
            timeout = self.config().version_drain_timeout_s
            await asyncio.gather(*(self._retire(w, None, timeout) for w in victims))
            version.workers = [w for w in version.workers if w not in victims]
        version.config = dataclasses.replace(version.config, instances=instances)
        version.memory = {"measured_bytes": self.footprint(version)}
        self._event(version, "scale", f"{len(live)} -> {instances} workers" + (f" ({by})" if by else ""))

    async def _replace_workers(self, version: ModelState, cfg: ModelConfig) -> bool:
        """New settings for a serving version (or the same for one whose workers all failed for
        good: tried again): start its workers anew with ``cfg``, warm them, then retire the old
        ones (their lanes handed to the new ones); the version then says what it uses, how long
        the load took and why it serves (``_loaded``: no failure of the old workers stays).  False
        (logged) if the new workers did not load: the old ones keep serving with the old settings."""
        old = self._live(version)
        started = self.clock.monotonic()
        try:
            new = await self._bring_up(version, cfg, cfg.instances)
        except ShmserveError as exc:
            log.error("reload: %s: the new settings did not load (%s); the old ones still serve", version.key,
                      exc.message)
            self._event(version, "reload failed", exc.message)
            return False
        version.config = cfg
        timeout = self.config().version_drain_timeout_s
        await asyncio.gather(*(self._retire(w, None, timeout) for w in old))
        version.workers = [w for w in version.workers if w not in old]
        self._event(version, "settings", "workers replaced with the new settings (reload)")
        self._loaded(version, new, started, "reload")
        return True

    def _default_newest(self, model: Model) -> None:
        if model.default is None or model.default not in model.versions:
            serving = [v for v in model.versions.values() if v.phase in (SERVING, LOADING)]
            if serving:
                model.default = max(serving, key=lambda v: v.version).version
            elif model.versions:  # on demand: its newest is loaded by the first request
                model.default = max(model.versions)

    # -- the log ----------------------------------------------------------------------------

    def _event(self, version: ModelState, what: str, reason: str) -> None:
        log.info("model %s: %s%s", version.key, what, f": {reason}" if reason else "")
        self.events.append({"time_unix": round(time.time(), 3), "model": version.name, "version": version.version,
                            "event": what, "reason": reason})
        self.on_change()

    def _sleep(self, seconds: float) -> asyncio.Future:
        """A future done ``seconds`` from now on the lifecycle's clock."""
        done = asyncio.get_running_loop().create_future()
        self.clock.call_later(seconds, lambda: done.done() or done.set_result(None))
        return done

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        exc = None if task.cancelled() else task.exception()  # retrieved: its caller may have left
        if isinstance(exc, ShmserveError):  # an operation's refusal: its caller's answer
            log.info("model lifecycle: [%s] %s", exc.code.wire, exc.message)
        elif exc is not None:
            log.error("model lifecycle task failed: %r", exc)

    async def stop(self) -> None:
        self.stopping = True
        if self._ticker is not None:
            self._ticker.cancel()
        for task in list(self.tasks):
            task.cancel()
