"""The models a front-end serves, their versions, and which workers can take work.

Owns: ``Model`` — a name clients call: its versions, which one is the
default, and its canary rollout if one runs; ``ModelState`` — one version of
a model: its configuration, its workers, its spec (as its workers reported
it), its lifecycle phase (``Phase``: the one transition table below, whose
events ``shmserve.frontend.lifecycle`` applies), the choice of worker for a
request, and its availability derived from its workers' states; ``Models`` —
every model by name, and the resolution of a request's model, version and
routing key to the version that serves it (the one routing rule: the
dispatcher asks it again for a request whose version went away).

Phases
------
===========  =======  ===========  ==============================================
from         event    to           when
===========  =======  ===========  ==============================================
UNLOADED     LOAD     LOADING      a load (start-up, control call, reload, on
                                   demand, canary)
EVICTED      LOAD     LOADING      the same
FAILED_LOAD  LOAD     LOADING      the same, after a failed one
SERVING      LOAD     LOADING      a load of a version all of whose workers
                                   failed for good (they are replaced)
LOADING      READY    SERVING      its workers are ready (at start-up: once they
                                   were waited for, ready or not; their states
                                   say the rest)
LOADING      FAIL     FAILED_LOAD  a worker could not load it, or no room was
                                   left for it (worker entries, memory budget);
                                   the version serving before stays
LOADING      NO_ROOM  UNLOADED     a load on demand found no room under the
                                   memory budget, and no request waits for it
                                   any more (the next request tries again)
SERVING      DRAIN    DRAINING     replaced, unloaded, evicted, or a canary
                                   rolled back
DRAINING     UNLOAD   UNLOADED     its workers are gone
DRAINING     EVICT    EVICTED      its workers are gone, after an eviction
                                   (loaded again on demand)
FAILED_LOAD  RESET    UNLOADED     a reload, for an on_demand version (its next
                                   request tries again)
===========  =======  ===========  ==============================================

Only a SERVING version takes requests that name no version (``Models.resolve``);
an on_demand one UNLOADED or EVICTED is loaded by its next request, and one
DRAINING because it is evicted takes requests too: they wait for the drain to
end, and then load it again.

Must not: start or stop workers (``shmserve.supervisor``), decide a phase
change (``shmserve.frontend.lifecycle``) or hold requests
(``shmserve.frontend.dispatcher``).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from shmserve.config import ModelConfig
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.residency import RateMeter
from shmserve.reservations import Learned
from shmserve.spec import ModelSpec
from shmserve.supervisor import FAILED, READY, WorkerHandle

# A version's availability, derived from its workers (``ModelState.state``).
MODEL_READY, MODEL_RESTARTING, MODEL_UNAVAILABLE = "ready", "restarting", "unavailable"


class Phase(enum.StrEnum):
    """A version's lifecycle phase, as the repository index shows it (the values)."""
    LOADING = "loading"
    SERVING = "ready"
    DRAINING = "draining"
    FAILED_LOAD = "unavailable"
    EVICTED = "evicted"
    UNLOADED = "unloaded"


class PhaseEvent(enum.StrEnum):
    LOAD = "load"
    READY = "ready"
    FAIL = "fail"
    NO_ROOM = "no room"
    DRAIN = "drain"
    UNLOAD = "unload"
    EVICT = "evict"
    RESET = "reset"


class IllegalPhase(RuntimeError):
    """A phase event the table does not allow in a version's phase: a bug in the lifecycle."""


P, E = Phase, PhaseEvent
TRANSITIONS: dict[tuple[Phase, PhaseEvent], Phase] = {
    (P.UNLOADED, E.LOAD): P.LOADING,
    (P.EVICTED, E.LOAD): P.LOADING,
    (P.FAILED_LOAD, E.LOAD): P.LOADING,
    (P.SERVING, E.LOAD): P.LOADING,
    (P.LOADING, E.READY): P.SERVING,
    (P.LOADING, E.FAIL): P.FAILED_LOAD,
    (P.LOADING, E.NO_ROOM): P.UNLOADED,
    (P.SERVING, E.DRAIN): P.DRAINING,
    (P.DRAINING, E.UNLOAD): P.UNLOADED,
    (P.DRAINING, E.EVICT): P.EVICTED,
    (P.FAILED_LOAD, E.RESET): P.UNLOADED,
}
del P, E

LOADING, SERVING, DRAINING, FAILED_LOAD, EVICTED, UNLOADED = Phase  # the names other modules use


def next_phase(phase: Phase, event: PhaseEvent) -> Phase:
    """The phase ``event`` leads to from ``phase``; IllegalPhase if the table has no such edge."""
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise IllegalPhase(f"phase event {event.name} is not allowed in phase {phase.name}") from None


@dataclass(eq=False)
class ModelState:
    """One version of a model and its workers."""

    index: int  # the model's id written into slots and lane headers (one per name, shared by its versions)
    name: str
    config: ModelConfig
    workers: list[WorkerHandle] = field(default_factory=list)
    phase: Phase = Phase.LOADING  # moved only by ``advance`` (the table above)
    reason: str = ""  # why it is in its phase (a failed load's error, "unloaded by uid 1000", ...)
    explicit: bool = False  # loaded by a control call naming this version (kept when the default moves)
    degraded: bool = False  # serving since start-up without all its workers ready (``reason`` says why)
    last_used: float = 0.0  # the clock's time of its last use: a request submitted, lane calls seen, its load (residency)
    memory: dict = field(default_factory=dict)  # measured after load: {"host_bytes": n, "device_bytes": n}
    load_seconds: float | None = None  # how long its last load (start to all workers ready) took
    drain_failure: tuple | None = None  # (ErrorCode, message) its unfinished requests get once the drain timed out
    meter: RateMeter = field(default_factory=RateMeter)  # its recent request rate (residency)
    uses: int = 0  # requests counted as its use (residency): socket requests and lane calls, each once
    progress_at: float = float("-inf")  # the lifecycle clock's time its workers were last seen finishing requests
    learned: Learned = field(default_factory=Learned)  # output bytes its calls needed, per input signature
    evicting: bool = False  # DRAINING because it was evicted: an on_demand one still takes requests (they wait)

    @property
    def version(self) -> int:
        return self.config.version

    def advance(self, event: PhaseEvent, reason: str = "") -> Phase:
        """Take phase ``event`` (the table above), now for ``reason``; returns the new phase.
        IllegalPhase if the table forbids it: nothing changes then."""
        self.phase = phase = next_phase(self.phase, event)
        self.reason = reason
        return phase

    @property
    def key(self) -> str:
        """``name:version``."""
        return self.config.key

    @property
    def taking(self) -> bool:
        """Whether it accepts new requests: it is serving or loading, or is loaded on demand
        (a request for it loads it; one that comes while it is being evicted waits for the
        eviction to end, and then loads it again)."""
        return self.phase in (SERVING, LOADING) or (self.config.load == "on_demand" and (
            self.phase in (EVICTED, UNLOADED) or self.phase == DRAINING and self.evicting))

    @property
    def waitable(self) -> bool:
        """Whether a request may wait for one of its workers: it is loading, or it still has
        workers that are restarting (not all failed for good), or it is being evicted and takes
        requests (``taking``: they wait for it to be loaded again)."""
        if self.phase == LOADING or self.phase == DRAINING and self.evicting and self.taking:
            return True
        return self.phase in (SERVING, DRAINING) and self.state != MODEL_UNAVAILABLE

    def same_interface(self, other: "ModelState") -> bool:
        """Whether ``other`` takes and returns the same tensors (a request checked against one may
        run on the other)."""
        a, b = self.spec, other.spec
        return a is not None and b is not None and a.inputs == b.inputs and a.outputs == b.outputs

    @property
    def spec(self) -> ModelSpec | None:
        """What the model takes and returns, as its workers reported it (None before any was ready)."""
        for w in self.workers:
            if w.spec is not None:
                return w.spec
        return None

    def pick_worker(self) -> WorkerHandle | None:
        """The ready worker with the fewest requests in flight, or None if none is ready (a worker
        being retired takes nothing new)."""
        best = None
        for w in self.workers:
            if w.state == READY and not w.retiring and (best is None or len(w.inflight) < len(best.inflight)):
                best = w
        return best

    @property
    def state(self) -> str:
        """MODEL_READY while any worker is ready, MODEL_UNAVAILABLE once all failed for good (or
        it has none: unloaded, evicted, not loaded yet), MODEL_RESTARTING otherwise."""
        if any(w.state == READY and not w.retiring for w in self.workers):
            return MODEL_READY
        if all(w.state == FAILED for w in self.workers):
            return MODEL_UNAVAILABLE
        return MODEL_RESTARTING

    @property
    def crash_looping(self) -> bool:
        """Whether a worker of the model is in a crash loop (``WorkerHandle.crash_looping``)."""
        return any(w.crash_looping for w in self.workers)

    def unavailable_reason(self) -> str:
        """Why the model has no ready worker: what its workers said when they failed for good, or
        what each one not ready is doing (how it last died, whether it crash-loops, when it starts
        again)."""
        if self.phase not in (SERVING, LOADING) or (not self.workers and self.reason):
            return f"version {self.version} of model {self.name!r} is {self.phase}" + \
                (f": {self.reason}" if self.reason else "")
        if self.state == MODEL_UNAVAILABLE:
            errors = sorted({w.error for w in self.workers if w.error})
            return f"model {self.name!r} is unavailable: {'; '.join(errors) or 'its workers failed'}"
        now = time.monotonic()
        parts = []
        for w in self.workers:
            if w.state == READY:
                continue
            part = f"worker {w.index} {w.state}"
            if w.last_exit:
                part += f" after it was {w.last_exit}" if w.last_exit.startswith("killed") else f" after {w.last_exit}"
            if w.crash_looping:
                part += f", crash-looping ({w.crash_streak} deaths in a row)"
            wait = w.restart_in(now)
            if wait is not None:
                part += f", next start in {wait:.1f} s"
            parts.append(part)
        what = "has not loaded yet" if self.spec is None else "has no ready worker"
        return f"model {self.name!r} {what} ({'; '.join(parts)})"


@dataclass(eq=False)
class Model:
    """A name clients call: its versions (loaded or known), its default, its canary."""

    index: int  # the id written into slots and lane headers
    name: str
    versions: dict[int, ModelState] = field(default_factory=dict)
    default: int | None = None  # the version a request naming none goes to
    rollout: object | None = None  # a running ``canary.Rollout`` (None: none)
    rollouts: list = field(default_factory=list)  # finished rollouts' snapshots, newest last (bounded)
    on_demand: bool = False  # loaded by its first request
    route_epoch: int = 0  # its routing's epoch (``shmserve.routing``): moved on by each change of its rollout

    @property
    def current(self) -> ModelState | None:
        """The default version, if there is one."""
        return self.versions.get(self.default) if self.default is not None else None

    def serving(self) -> list[ModelState]:
        return [v for v in self.versions.values() if v.phase == SERVING]


class Models:
    """Every model by name (a mapping of names to ``Model``), and request routing to versions."""

    def __init__(self) -> None:
        self.by_name: dict[str, Model] = {}
        self._ids = 0

    # -- the mapping --------------------------------------------------------------------

    def __contains__(self, name) -> bool:
        return name in self.by_name

    def __iter__(self):
        return iter(self.by_name)

    def __len__(self) -> int:
        return len(self.by_name)

    def get(self, name) -> Model | None:
        return self.by_name.get(name) if isinstance(name, str) else None

    def model(self, name: str) -> Model:
        """The model of ``name``, created (with a new id) if it is new."""
        model = self.by_name.get(name)
        if model is None:
            model = self.by_name[name] = Model(self._ids, name)
            self._ids += 1
        return model

    def versions(self) -> list[ModelState]:
        """Every version known, in name and version order."""
        return [v for name in sorted(self.by_name) for _, v in sorted(self.by_name[name].versions.items())]

    def version_of(self, w: WorkerHandle) -> ModelState | None:
        model = self.by_name.get(w.model.name)
        return model.versions.get(w.model.version) if model is not None else None

    # -- routing ------------------------------------------------------------------------

    def resolve(self, name: str, version: int | None = None, key: str | None = None,
                draw: float = 0.0) -> ModelState:
        """The version that serves a request for ``name`` (and ``version``, if it names one; a
        routing ``key`` and a uniform ``draw`` in [0, 1) for a canary split).

        Raises ShmserveError: UNKNOWN_MODEL for no such model or version (the message lists what
        there is), MODEL_UNAVAILABLE for a version that is draining, unloaded or failed to load.
        """
        model = self.by_name.get(name)
        if model is None or not model.versions:
            raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r} (models: "
                                                         f"{', '.join(sorted(self.by_name)) or 'none'})")
        if version is None:
            if model.rollout is not None:
                version = model.rollout.route(key.encode() if key is not None else None, draw)
            else:
                version = model.default
            if version is None:
                v = max(model.versions.values(), key=lambda v: v.version)
                raise ShmserveError(ErrorCode.MODEL_UNAVAILABLE, v.unavailable_reason())
        v = model.versions.get(version)
        if v is None or (v.phase == UNLOADED and not v.taking):
            loaded = sorted(v.version for v in model.versions.values() if v.phase in (SERVING, LOADING, DRAINING))
            raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"model {name!r} has no version {version} loaded "
                                                         f"(loaded: {', '.join(map(str, loaded)) or 'none'})")
        if not v.taking:
            raise ShmserveError(ErrorCode.MODEL_UNAVAILABLE, v.unavailable_reason())
        return v
