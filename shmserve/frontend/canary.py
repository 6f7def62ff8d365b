"""Canary releases: the decisions of one model's rollout from a stable version to a candidate.

Owns: ``CanaryPlan`` (a rollout's settings, validated, and their wire form),
``Rollout`` (which version a request goes to, the windows of outcomes each
version had, the ramp, and every decision with its reason) and the rule by
which a shadow copy's outputs match the stable version's (``outputs_match``).

Must not: do I/O, read a clock, draw random numbers or touch asyncio.  Time
comes in as ``now`` (seconds, monotonic, never decreasing: a smaller ``now``
is taken as the latest one seen) and randomness as ``draw`` (a float in
[0, 1) per call), so every decision is a function of its inputs and tests
replay them exactly.  Its callers: ``Models.resolve`` calls ``route`` for a
request that names no version, ``shmserve.frontend.shadow`` calls ``shadow``
and ``record_shadow``, and the lifecycle ``record`` for each request a
worker finished, DONE or ERROR (the dispatcher's ``observe``; a request that
timed out, or was refused before a worker took it, is no outcome of a version)
and ``record_lane_calls`` for the lane calls the workers counted (each
heartbeat),
``tick`` periodically, and acts on what a rollout's state says (on COMPLETE
the candidate becomes the default; on ROLLED_BACK or ABORTED the candidate is
unloaded; on any of them the rollout is dropped, its last snapshot kept).

Split mode: the candidate answers a share of the traffic that follows the
plan's ``steps`` (percent).  A step is promoted to the next when it has been
held ``hold_s``, both versions have ``min_samples`` outcomes in the window
and no threshold is crossed; the last step held so completes the rollout (at
100 % the stable version gets no traffic: its *baseline* stands in, its
window the last time ``tick`` saw ``min_samples`` in it).  A threshold
crossed at any time, once the candidate has ``min_samples`` in the window,
rolls it back.  The candidate's window is compared with the stable window,
or while that holds fewer than ``min_samples`` with the baseline:

- error rate: candidate minus stable above ``max_error_rate_increase``
  (before there is any baseline: against the stable window however small,
  empty counting as no errors);
- p99 latency: candidate over stable above ``max_p99_ratio`` (not checked
  before there is a baseline; never with ``max_p99_ratio`` None).

Latency is compared only where it means something (issue 24 item 5: a
candidate rolled back at 0 % on its own cold start):

- Cold requests: each version's first ``cold_requests`` outcomes in the
  rollout count for its error rate but not for its latency.  A candidate
  loaded for the canary has been warmed up (its warm-up runs never reach
  the rollout), but its first requests still pay for what warm-up does not
  touch (lazy initialisation, caches, allocators growing): measured x27 the
  stable p99 on a busy host.
- A p99 needs ``P99_MIN_SAMPLES`` (100) timed outcomes on each side: the
  nearest-rank p99 of fewer is their slowest one, so one cold request or
  one scheduling stall decides.  A plan that judges latency with
  ``min_samples`` below that is refused (``max_p99_ratio`` None judges errors
  only); a step is promoted only once the candidate's latency can be
  judged, and the baseline is a stable window with that many.

With ``window_s`` longer than ``hold_s`` a step's decision also sees the
previous step's outcomes still in the window.

Shadow mode: every request is answered by the stable version; a share
(``shadow_percent``) is copied to the candidate and the two outputs compared
(``outputs_match``; a candidate error is a mismatch).  There is no ramp.
Mismatches above ``max_mismatch_rate`` over at least ``min_samples``
comparisons in the window roll it back (so do the split-mode thresholds,
over the copies' outcomes, if they are recorded); after ``hold_s`` with
``min_samples`` comparisons and none of that, the rollout is VERIFIED: still
shadowing, still able to roll back, and made the default only by a manual
``promote``.

Memory: each version keeps at most ``max_samples`` outcomes (default
``MAX_SAMPLES``) and the shadow comparisons as many; past that the oldest go
first, so under more than ``max_samples / window_s`` requests a second the
statistics cover the latest ``max_samples`` outcomes, not all of the window
(``snapshot`` says ``capped``).  Percentiles are nearest-rank over the window.

A rollout's life is one transition table (``RolloutState``); the column
"by" is the decision kind that takes the edge:

Rules
-----
===========  ===========  ========  ==========================================
from         to           by        when
===========  ===========  ========  ==========================================
RAMPING      RAMPING      step      a step held hold_s with min_samples on
                                    both versions and no threshold crossed
RAMPING      COMPLETE     complete  the same at the last step (100 %)
                          promote   an operator promoted it
SHADOWING    VERIFIED     verified  held hold_s, min_samples compared, no
                                    threshold crossed
SHADOWING    COMPLETE     promote   an operator promoted it
VERIFIED     COMPLETE     promote
RAMPING      ROLLED_BACK  rollback  a threshold crossed
SHADOWING    ROLLED_BACK
VERIFIED     ROLLED_BACK
RAMPING      ABORTED      abort     an operator aborted it
SHADOWING    ABORTED
VERIFIED     ABORTED
===========  ===========  ========  ==========================================

COMPLETE, ROLLED_BACK and ABORTED are terminal: COMPLETE routes every
request to the candidate, the other two to the stable version.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np

from shmserve import layout, routing

_BF16 = layout.numpy_dtype("bfloat16")  # numbers, though numpy's kind for them is "V"
# Per version, the outcomes kept: 1 666 requests a second over the default 60 s window (about 7 MB when full;
# a tick then takes about 7 ms a version, measured on the development host).
MAX_SAMPLES = 100_000
MAX_STEPS = 100  # a plan's steps (a wire value: bounded); a rollout decides at most max(len(steps), 2) times
# The fewest timed outcomes a p99 is taken over: the nearest-rank p99 of fewer is their maximum.
P99_MIN_SAMPLES = 100


class RolloutState(enum.StrEnum):
    RAMPING = "ramping"
    SHADOWING = "shadowing"
    VERIFIED = "verified"
    COMPLETE = "complete"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"


class Kind(enum.StrEnum):
    """What a decision was (``Decision.kind``); also the "by" column of the table."""
    STEP = "step"
    COMPLETE = "complete"
    VERIFIED = "verified"
    ROLLBACK = "rollback"
    PROMOTE = "promote"
    ABORT = "abort"


class IllegalTransition(RuntimeError):
    """A rollout state change the table does not allow: a bug in the caller (promote or abort of a finished rollout)."""


R, K = RolloutState, Kind
TRANSITIONS: dict[tuple[RolloutState, RolloutState], frozenset[Kind]] = {
    (R.RAMPING, R.RAMPING): frozenset({K.STEP}),
    (R.RAMPING, R.COMPLETE): frozenset({K.COMPLETE, K.PROMOTE}),
    (R.SHADOWING, R.VERIFIED): frozenset({K.VERIFIED}),
    (R.SHADOWING, R.COMPLETE): frozenset({K.PROMOTE}),
    (R.VERIFIED, R.COMPLETE): frozenset({K.PROMOTE}),
    **{(state, R.ROLLED_BACK): frozenset({K.ROLLBACK}) for state in (R.RAMPING, R.SHADOWING, R.VERIFIED)},
    **{(state, R.ABORTED): frozenset({K.ABORT}) for state in (R.RAMPING, R.SHADOWING, R.VERIFIED)},
}
del R, K

TERMINAL = frozenset({RolloutState.COMPLETE, RolloutState.ROLLED_BACK, RolloutState.ABORTED})
SPLIT, SHADOW = "split", "shadow"


class Decision(NamedTuple):
    time: float  # the ``now`` it was taken at
    kind: Kind
    percent: float  # the candidate's share of the traffic after it (0 in shadow mode and after a rollback)
    reason: str


class WindowStats(NamedTuple):
    """One version's outcomes over the window: counts, error rate, and nearest-rank latency
    percentiles over its ``timed`` outcomes (those past its cold requests; None if there are none)."""
    requests: int
    errors: int
    error_rate: float
    p50_s: float | None
    p99_s: float | None
    timed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "error_rate": self.error_rate,
                "p50_ms": None if self.p50_s is None else self.p50_s * 1e3,
                "p99_ms": None if self.p99_s is None else self.p99_s * 1e3, "timed": self.timed}


# -- the plan ---------------------------------------------------------------------------------


def _number(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    """``value`` as a float within [low, high] (or (low, high]), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"canary plan: {name} must be a number, not {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"canary plan: {name} must be in {bounds}, not {value!r}")
    return value


@dataclass(frozen=True)
class CanaryPlan:
    """How a rollout proceeds.  Constructing one validates it: ValueError names the field at fault."""
    steps: tuple[float, ...] = (1.0, 5.0, 25.0, 100.0)  # candidate percent per step: increasing, in (0, 100], last 100
    hold_s: float = 60.0  # each step held at least this long (and until min_samples are in the window)
    window_s: float = 60.0  # the sliding window thresholds are measured over
    min_samples: int = 100  # outcomes per version in the window (comparisons in shadow mode) before any decision
    max_error_rate_increase: float = 0.01  # candidate error rate minus stable's, absolute (0.01 = 1 point)
    max_p99_ratio: float | None = 1.5  # candidate p99 / stable p99 (None: latency is not judged)
    mode: str = SPLIT  # "split": the candidate answers its share; "shadow": it only gets copies
    sticky: bool = True  # a request with a routing key: the same key always lands on the same version
    shadow_percent: float = 100.0  # shadow mode: the share of requests copied to the candidate
    shadow_rtol: float = 1e-5  # shadow mode: outputs_match tolerances (numpy.isclose)
    shadow_atol: float = 1e-6
    max_mismatch_rate: float = 0.0  # shadow mode: mismatches (candidate errors included) over comparisons
    cold_requests: int = 20  # each version's first outcomes in the rollout: counted for errors, not latency

    def __post_init__(self) -> None:
        steps = self.steps
        if not isinstance(steps, (tuple, list)) or not steps or len(steps) > MAX_STEPS:
            raise ValueError(f"canary plan: steps must be a list of 1 to {MAX_STEPS} percentages")
        steps = tuple(_number("steps", s, 0.0, 100.0, low_open=True) for s in steps)
        if any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != 100.0:
            raise ValueError(f"canary plan: steps must be strictly increasing and end at 100, not {list(steps)}")
        object.__setattr__(self, "steps", steps)
        optional = () if self.max_p99_ratio is None else (("max_p99_ratio", 1.0, 1e9, False),)
        for name, low, high, low_open in (("hold_s", 0.0, 1e9, False), ("window_s", 0.0, 1e9, True),
                                          ("max_error_rate_increase", 0.0, 1.0, False), *optional,
                                          ("shadow_percent", 0.0, 100.0, True), ("shadow_rtol", 0.0, 1e9, False),
                                          ("shadow_atol", 0.0, 1e9, False), ("max_mismatch_rate", 0.0, 1.0, False)):
            object.__setattr__(self, name, _number(name, getattr(self, name), low, high, low_open=low_open))
        if isinstance(self.min_samples, bool) or not isinstance(self.min_samples, int) \
                or not 1 <= self.min_samples <= MAX_SAMPLES:
            raise ValueError(f"canary plan: min_samples must be an integer in [1, {MAX_SAMPLES}], "
                             f"not {self.min_samples!r}")
        if isinstance(self.cold_requests, bool) or not isinstance(self.cold_requests, int) \
                or not 0 <= self.cold_requests <= MAX_SAMPLES:
            raise ValueError(f"canary plan: cold_requests must be an integer in [0, {MAX_SAMPLES}], "
                             f"not {self.cold_requests!r}")
        if self.max_p99_ratio is not None and self.min_samples < P99_MIN_SAMPLES:
            raise ValueError(f"canary plan: min_samples {self.min_samples} cannot support a p99 (the p99 of fewer "
                             f"than {P99_MIN_SAMPLES} outcomes is their slowest one): raise min_samples to "
                             f"{P99_MIN_SAMPLES}, or set max_p99_ratio to null to judge errors only")
        if self.mode not in (SPLIT, SHADOW):
            raise ValueError(f"canary plan: mode must be 'split' or 'shadow', not {self.mode!r}")
        if not isinstance(self.sticky, bool):
            raise ValueError(f"canary plan: sticky must be true or false, not {self.sticky!r}")

    @classmethod
    def from_dict(cls, d: Any) -> CanaryPlan:
        """A plan from its wire form (a JSON object; missing fields take their defaults).

        Raises ValueError naming the field for an unknown field, a wrong type or a value out of bounds."""
        if not isinstance(d, dict):
            raise ValueError(f"canary plan must be an object, not {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        for name in d:
            if name not in known:
                raise ValueError(f"canary plan: unknown field {str(name)[:64]!r}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The wire form: a JSON-able dict that ``from_dict`` turns back into an equal plan."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["steps"] = list(self.steps)
        return d


def outputs_match(stable: dict[str, np.ndarray], candidate: dict[str, np.ndarray], plan: CanaryPlan) -> bool:
    """Whether a shadow copy's outputs match the stable version's: the same names, shapes and dtypes, and
    every element within ``numpy.isclose(candidate, stable, shadow_rtol, shadow_atol)`` (NaN matches NaN);
    outputs that are not numbers (bytes, bool) must be equal."""
    if stable.keys() != candidate.keys():
        return False
    for name, want in stable.items():
        got = candidate[name]
        if want.shape != got.shape or want.dtype != got.dtype:
            return False
        if want.dtype.kind in "iufc" or want.dtype == _BF16:
            if not np.isclose(got, want, rtol=plan.shadow_rtol, atol=plan.shadow_atol, equal_nan=True).all():
                return False
        elif not np.array_equal(got, want):
            return False
    return True


# -- the rollout ------------------------------------------------------------------------------


def _rank(q: int, n: int) -> int:
    """The index of the nearest-rank ``q``-th percentile (1..100) of ``n`` sorted values (n > 0)."""
    return -(-q * n // 100) - 1


class _Window:
    """Outcomes oldest first, at most ``cap`` (the oldest go first): their times, latencies and failures, with
    a running count of failures, so that counting is O(1) and percentiles one pass in numpy."""

    __slots__ = ("cap", "times", "latencies", "failed", "errors", "cold", "untimed")

    def __init__(self, cap: int, cold: int = 0):
        self.cap, self.errors = cap, 0
        self.cold = cold  # outcomes still to come whose latency does not count (cold requests)
        self.untimed = 0  # of those in the window, how many (the oldest: they came first)
        self.times: deque[float] = deque()
        self.latencies: deque[float] = deque()
        self.failed: deque[bool] = deque()

    def add(self, t: float, ok: bool, latency: float) -> None:
        if len(self.times) == self.cap:
            self._pop()
        self.times.append(t)
        self.latencies.append(latency)
        self.failed.append(not ok)
        self.errors += not ok
        if self.cold:
            self.cold -= 1
            self.untimed += 1

    def add_many(self, t: float, ok: bool, latency: float, n: int) -> None:
        """``n`` outcomes alike (lane calls counted by their worker, a histogram bucket at a time)."""
        cold = min(self.cold, n)
        self.cold -= cold
        skipped = max(0, n - self.cap)  # the first of them would go at once (the cold ones among them)
        n, cold = n - skipped, max(0, cold - skipped)
        while len(self.times) + n > self.cap:
            self._pop()
        self.times.extend(itertools.repeat(t, n))
        self.latencies.extend(itertools.repeat(latency, n))
        self.failed.extend(itertools.repeat(not ok, n))
        self.errors += 0 if ok else n
        self.untimed += cold

    def _pop(self) -> None:
        self.times.popleft()
        self.latencies.popleft()
        self.errors -= self.failed.popleft()
        self.untimed = max(0, self.untimed - 1)

    def trim(self, oldest: float) -> None:
        """Drop the outcomes at or before ``oldest``."""
        times = self.times
        while times and times[0] <= oldest:
            self._pop()

    def stats(self) -> WindowStats:
        n = len(self.times)
        if not n:
            return WindowStats(0, 0, 0.0, None, None)
        timed = n - self.untimed
        if not timed:
            return WindowStats(n, self.errors, self.errors / n, None, None)
        i50, i99 = _rank(50, timed), _rank(99, timed)
        latencies = itertools.islice(self.latencies, self.untimed, None)
        part = np.partition(np.fromiter(latencies, dtype=np.float64, count=timed), (i50, i99))
        return WindowStats(n, self.errors, self.errors / n, float(part[i50]), float(part[i99]), timed)


def _pct(rate: float) -> str:
    return f"{rate * 100:.1f}%"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


class Rollout:
    """One model's canary from version ``stable`` to version ``candidate`` under ``plan``, started at ``now``.

    ``max_samples``: the outcomes kept per version (and shadow comparisons), see "Memory" above.
    Raises ValueError for an empty model name, versions that are not distinct positive integers, a plan
    that is not a ``CanaryPlan`` or ``max_samples`` below its ``min_samples``."""

    def __init__(self, model: str, stable: int, candidate: int, plan: CanaryPlan, now: float, *,
                 max_samples: int = MAX_SAMPLES):
        if not isinstance(model, str) or not model:
            raise ValueError("canary: the model name must be a non-empty string")
        for v in (stable, candidate):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"canary: versions are positive integers, not {v!r}")
        if stable == candidate:
            raise ValueError(f"canary: the candidate must differ from the stable version ({stable})")
        if not isinstance(plan, CanaryPlan):
            raise ValueError("canary: plan must be a CanaryPlan")
        if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < plan.min_samples:
            raise ValueError(f"canary: max_samples must be an integer >= the plan's min_samples, not {max_samples!r}")
        self.model, self.stable, self.candidate, self.plan = model, stable, candidate, plan
        self.state = RolloutState.RAMPING if plan.mode == SPLIT else RolloutState.SHADOWING
        self.step = 0  # index into plan.steps (stays 0 in shadow mode)
        self.started_at = self.step_at = self._now = float(now)
        self._windows = {stable: _Window(max_samples, plan.cold_requests),
                         candidate: _Window(max_samples, plan.cold_requests)}
        self._shadow = _Window(max_samples)  # comparisons: a mismatch counts as a failure, latency 0
        self._baseline: tuple[float, WindowStats] | None = None  # (when, stable's window) last time it was large enough
        self._decisions: list[Decision] = []  # bounded by the table: one per step, then one that ends it

    # -- routing (the hot path: no allocation beyond the hash) --

    @property
    def percent(self) -> float:
        """The candidate's share of the traffic now: the step's while ramping, 100 once complete, else 0."""
        if self.state is RolloutState.RAMPING:
            return self.plan.steps[self.step]
        return 100.0 if self.state is RolloutState.COMPLETE else 0.0

    def route(self, key: bytes | None, draw: float) -> int:
        """The version that answers a request.  ``key``: its routing key or None; ``draw``: in [0, 1).

        While ramping, ``routing.split`` decides (the rule lane clients evaluate too): a keyed request
        (sticky plan) goes to the candidate when its key's fixed point lies below the step's percent — so a
        key once on the candidate stays there as the percent grows — and any other request when ``draw``
        does.  Shadow mode, ROLLED_BACK and ABORTED: the stable version;
        COMPLETE: the candidate.  Raises ValueError for a draw outside [0, 1)."""
        if not 0.0 <= draw < 1.0:
            raise ValueError(f"canary: draw must be in [0, 1), not {draw!r}")
        if self.state is not RolloutState.RAMPING:
            return self.candidate if self.state is RolloutState.COMPLETE else self.stable
        return routing.split(self.model, self.stable, self.candidate, self.plan.steps[self.step], self.plan.sticky,
                             key, draw)

    def lane_route(self, epoch: int) -> routing.Route:
        """The routing a lane client evaluates itself (``routing.Route``, valid for ``epoch``): the
        split while ramping, every request on the candidate once complete, else none (the default,
        the stable version, answers: shadow mode, a rollback, an abort)."""
        if self.state is RolloutState.RAMPING or self.state is RolloutState.COMPLETE:
            return routing.Route(epoch, self.stable, self.candidate, self.percent, self.plan.sticky)
        return routing.Route(epoch)

    def shadow(self, draw: float) -> bool:
        """Whether to copy a request to the candidate: shadow mode, not finished, ``draw`` below
        ``shadow_percent``.  Raises ValueError for a draw outside [0, 1)."""
        if not 0.0 <= draw < 1.0:
            raise ValueError(f"canary: draw must be in [0, 1), not {draw!r}")
        return self.state in (RolloutState.SHADOWING, RolloutState.VERIFIED) and draw < self.plan.shadow_percent / 100

    # -- outcomes --

    def _clock(self, now: float) -> float:
        self._now = max(self._now, float(now))
        return self._now

    def record(self, version: int, ok: bool, latency_s: float, now: float) -> None:
        """One request's outcome on ``version`` (other versions are ignored).  Raises ValueError for a latency
        that is negative or not finite."""
        if not 0.0 <= latency_s < math.inf:
            raise ValueError(f"canary: latency_s must be finite and >= 0, not {latency_s!r}")
        window = self._windows.get(version)
        if window is not None:
            window.add(self._clock(now), bool(ok), float(latency_s))

    def record_lane_calls(self, version: int, latencies: list[tuple[float, int]], faults: int, now: float) -> None:
        """Lane calls of ``version`` its workers counted since the last look (``now``): ``latencies``
        as (seconds, how many) per histogram bucket, of which ``faults`` failed for the version's own
        fault (the rest succeeded); other versions are ignored.  Which of them failed is not known
        and does not matter: a window's error rate and percentiles do not pair the two."""
        window = self._windows.get(version)
        if window is None:
            return
        t = self._clock(now)
        for latency, n in latencies:
            if n <= 0 or not 0.0 <= latency < math.inf:
                continue
            failed = min(faults, n)
            faults -= failed
            if failed:
                window.add_many(t, False, float(latency), failed)
            if n - failed:
                window.add_many(t, True, float(latency), n - failed)

    def record_shadow(self, match: bool, now: float) -> None:
        """One shadow comparison: did the candidate's outputs match the stable version's (an error: no)."""
        self._shadow.add(self._clock(now), bool(match), 0.0)

    def _trim(self, now: float) -> None:
        oldest = now - self.plan.window_s
        for window in (*self._windows.values(), self._shadow):
            window.trim(oldest)

    def window(self, version: int, now: float) -> WindowStats:
        """``version``'s outcomes in the window ending at ``now`` (KeyError for a version not in the rollout)."""
        self._trim(self._clock(now))
        return self._windows[version].stats()

    # -- decisions --

    @property
    def decisions(self) -> tuple[Decision, ...]:
        """Every decision so far, oldest first: at most ``max(len(plan.steps), 2)`` (each step, then an end)."""
        return tuple(self._decisions)

    def _move(self, to: RolloutState, kind: Kind, now: float, reason: str) -> Decision:
        allowed = TRANSITIONS.get((self.state, to))
        if allowed is None or kind not in allowed:
            raise IllegalTransition(f"canary {self.model}: {self.state.name} -> {to.name} by {kind} is not allowed")
        self.state = to
        decision = Decision(now, kind, self.percent, reason)
        self._decisions.append(decision)
        return decision

    def _crossed(self, cand: WindowStats, stable: WindowStats, reference: WindowStats | None) -> str | None:
        """The reason a threshold is crossed by the candidate's window ``cand`` against the stable version's
        ``reference`` (its window or baseline; None before it had one: the error rate is then compared with
        its window ``stable``, and the p99 not at all), or None."""
        plan, base = self.plan, (stable if reference is None else reference)
        if cand.requests < plan.min_samples:
            return None
        increase = cand.error_rate - base.error_rate
        if increase > plan.max_error_rate_increase:
            return (f"error rate {_pct(cand.error_rate)} vs stable {_pct(base.error_rate)} "
                    f"(+{increase * 100:.1f} points > max_error_rate_increase {plan.max_error_rate_increase * 100:.1f}"
                    f" points) over {cand.requests} requests")
        if reference is not None and self._p99_judged(cand) and self._p99_judged(reference):
            ratio = cand.p99_s / reference.p99_s if reference.p99_s else (math.inf if cand.p99_s else 1.0)
            if ratio > plan.max_p99_ratio:
                return (f"p99 latency {_ms(cand.p99_s)} vs stable {_ms(reference.p99_s)} "
                        f"(x{ratio:.2f} > max_p99_ratio {plan.max_p99_ratio:g}) over {cand.requests} requests")
        return None

    def _p99_judged(self, w: WindowStats) -> bool:
        """Whether ``w`` holds enough timed outcomes for its p99 to be judged (and the plan judges it)."""
        return self.plan.max_p99_ratio is not None and w.timed >= P99_MIN_SAMPLES

    def tick(self, now: float) -> list[Decision]:
        """Evaluate the thresholds and the ramp at ``now``; returns the decisions taken (at most one).  Costs a
        pass over the outcomes in the window (see MAX_SAMPLES).

        A finished rollout takes none."""
        now = self._clock(now)
        if self.state in TERMINAL:
            return []
        plan = self.plan
        cand, stable = self.window(self.candidate, now), self.window(self.stable, now)
        if stable.requests >= plan.min_samples and (plan.max_p99_ratio is None or self._p99_judged(stable)):
            self._baseline = (now, stable)
        reference = self._baseline[1] if self._baseline else None  # stable's window, or its last large one
        if why := self._crossed(cand, stable, reference):
            return [self._move(RolloutState.ROLLED_BACK, Kind.ROLLBACK, now, why)]
        held = now - self.step_at
        if self.state is not RolloutState.RAMPING:
            compared, mismatches = len(self._shadow.times), self._shadow.errors
            if compared >= plan.min_samples and mismatches / compared > plan.max_mismatch_rate:
                return [self._move(RolloutState.ROLLED_BACK, Kind.ROLLBACK, now,
                                   f"mismatch rate {_pct(mismatches / compared)} ({mismatches} of {compared} "
                                   f"compared) > max_mismatch_rate {_pct(plan.max_mismatch_rate)}")]
            if self.state is RolloutState.SHADOWING and held >= plan.hold_s and compared >= plan.min_samples:
                return [self._move(RolloutState.VERIFIED, Kind.VERIFIED, now,
                                   f"shadowed for {held:g} s: {mismatches} mismatches in {compared} compared; "
                                   f"awaiting promote")]
            return []
        if held < plan.hold_s or cand.requests < plan.min_samples or reference is None \
                or (stable.requests < plan.min_samples and self.percent < 100.0) \
                or (plan.max_p99_ratio is not None and not self._p99_judged(cand)):
            return []
        summary = (f"held {self.percent:g}% for {held:g} s: error rate {_pct(cand.error_rate)} vs stable "
                   f"{_pct(reference.error_rate)}, p99 {_ms(cand.p99_s)} vs {_ms(reference.p99_s)} "
                   f"over {cand.requests} requests")
        if self.step + 1 == len(plan.steps):
            return [self._move(RolloutState.COMPLETE, Kind.COMPLETE, now, summary)]
        self.step += 1
        self.step_at = now
        return [self._move(RolloutState.RAMPING, Kind.STEP, now, summary)]

    def promote(self, now: float, by: str) -> Decision:
        """An operator (``by``) makes the candidate take all traffic now: COMPLETE.  Raises IllegalTransition
        once the rollout has finished."""
        return self._move(RolloutState.COMPLETE, Kind.PROMOTE, self._clock(now), f"promoted by {by}")

    def abort(self, now: float, reason: str) -> Decision:
        """An operator sends all traffic back to the stable version: ABORTED.  Raises IllegalTransition once the
        rollout has finished."""
        return self._move(RolloutState.ABORTED, Kind.ABORT, self._clock(now), reason)

    def snapshot(self, now: float) -> dict[str, Any]:
        """The rollout as ``inspect``, ``info`` and metrics show it: a JSON-able dict."""
        now = self._clock(now)
        self._trim(now)
        compared, mismatches = len(self._shadow.times), self._shadow.errors

        def version(v: int) -> dict[str, Any]:
            d = self.window(v, now).to_dict()
            d.update(version=v, capped=len(self._windows[v].times) == self._windows[v].cap)
            return d

        return {
            "model": self.model, "state": str(self.state), "mode": self.plan.mode,
            "stable": version(self.stable), "candidate": version(self.candidate),
            "percent": self.percent, "step": self.step, "steps": list(self.plan.steps),
            "time_at_step_s": now - self.step_at, "started_s_ago": now - self.started_at,
            "stable_baseline": None if self._baseline is None else
            {"age_s": now - self._baseline[0], **self._baseline[1].to_dict()},
            "shadow": {"compared": compared, "mismatches": mismatches,
                       "mismatch_rate": mismatches / compared if compared else 0.0},
            "decisions": [{"time": d.time, "ago_s": now - d.time, "kind": str(d.kind), "percent": d.percent,
                           "reason": d.reason} for d in self._decisions],
            "plan": self.plan.to_dict(),
        }
