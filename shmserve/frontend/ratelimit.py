"""Per-caller rate limits: token buckets for requests/s and bytes/s, each with a burst.

Owns: who a limit holds (``Caller``: a uid from ``SO_PEERCRED``, a v2 token, or
the anonymous TCP caller — one caller for all of them), the buckets (one per
limit and caller, for requests and for bytes), whether a request may enter now
(``RateLimiter.admit``: all its limits at once, or none charged), when a refused
caller may try again, the refusals counted by limit, and which callers and models
a limit covers (``covering``: a caller under a limit of a model is given no lane
of it; ``model_limited``: door processes relay a limited model's requests to main).

Rules (``admit``):

- the limits that apply to a request are those whose callers include its caller
  (``each_caller``, its uid, one of its groups, its token, its token's role, or the
  anonymous caller) and whose model is the request's or every model;
- a bucket holds at most its burst and fills at its rate; a fresh one is full;
- a request costs 1 from each requests bucket and its bytes from each bytes bucket;
  it enters when every bucket holds ``min(cost, burst)`` (so a request larger than a
  burst of bytes enters when that bucket is full, and leaves it in debt): then every
  bucket is charged its whole cost; otherwise nothing is charged;
- a refusal names the limit that makes the caller wait longest (its configured
  name, never a client's word) and ``retry_after``: the seconds until every bucket
  holds enough, if the caller sends nothing else meanwhile.

Metrics labels come only from configuration: a refusal is counted under its
limit's name and its configured model (``*``: every model).

Must not: read a clock (``now`` is passed in), do I/O, or know doors or sockets.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from shmserve.config import RateLimit

EPSILON = 1e-9  # tokens a refill may fall short by in floating point and still count as there
MAX_BUCKETS = 4096  # past this, buckets that are full again (the same as absent) are forgotten
ALL_MODELS = "*"  # the model label of a limit of every model


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a request, as limits see it.  ``key``: its buckets' name (``uid:N``,
    ``token:NAME``, ``anonymous``); ``uid``: the kernel's uid (None for a v2 TCP caller, whose
    token's own ``uid`` is for registering shared memory, not who it is); ``gids``: its primary
    and supplementary groups; ``token``, ``role``: a v2 token holder's."""

    key: str
    uid: int | None = None
    gids: frozenset[int] = frozenset()
    token: str | None = None
    role: str | None = None

    @classmethod
    def of_uid(cls, uid: int, gids=()) -> "Caller":
        return cls(f"uid:{uid}", uid, frozenset(gids))


ANONYMOUS = Caller("anonymous")


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request may not enter now: the limit's name, and when to try again (seconds)."""

    limit: str
    retry_after: float
    message: str


class _Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, tokens: float, at: float):
        self.tokens, self.at = tokens, at

    def level(self, rate: float, burst: float, now: float) -> float:
        return min(burst, self.tokens + max(0.0, now - self.at) * rate)


def holds(limit: RateLimit, caller: Caller) -> bool:
    """Whether ``limit`` applies to ``caller`` (whatever the model)."""
    return (limit.each_caller
            or (limit.anonymous and caller.key == ANONYMOUS.key)
            or (caller.uid is not None and caller.uid in limit.uids)
            or bool(caller.gids.intersection(limit.gids))
            or (caller.token is not None and caller.token in limit.tokens)
            or (caller.role is not None and caller.role in limit.roles))


def _dimensions(limit: RateLimit):
    """(kind, rate, burst) of the limit's buckets: "requests" and/or "bytes"."""
    if limit.requests_per_s is not None:
        yield "requests", limit.requests_per_s, limit.burst
    if limit.bytes_per_s is not None:
        yield "bytes", limit.bytes_per_s, limit.burst_bytes


def describe_limit(limit: RateLimit) -> str:
    """``20 requests/s (burst 40), 1048576 bytes/s (burst 2097152)``."""
    return ", ".join(f"{rate:g} {kind}/s (burst {burst:g})" for kind, rate, burst in _dimensions(limit))


class RateLimiter:
    """The buckets of every configured limit (see the module).  ``configure`` replaces the limits
    (a reload): a limit whose name and settings are unchanged keeps its buckets."""

    def __init__(self, limits: tuple[RateLimit, ...] = ()):
        self.limits: tuple[RateLimit, ...] = ()
        self.buckets: dict[tuple[str, str, str], _Bucket] = {}  # (limit, caller key, kind) -> bucket
        self.refused: collections.Counter[tuple[str, str]] = collections.Counter()  # (limit, model label) -> n
        self.configure(limits)

    def configure(self, limits: tuple[RateLimit, ...]) -> None:
        kept = {limit.key for limit in limits if limit in self.limits}
        self.limits = tuple(limits)
        self.buckets = {k: b for k, b in self.buckets.items() if k[0] in kept}
        self._by_model: dict[str | None, tuple[RateLimit, ...]] = {}
        self._dims = {limit.key: tuple(_dimensions(limit)) for limit in limits}  # (kind, rate, burst) each

    def __bool__(self) -> bool:
        return bool(self.limits)

    def _of_model(self, model: str | None) -> tuple[RateLimit, ...]:
        found = self._by_model.get(model)
        if found is None:
            found = self._by_model[model] = tuple(lim for lim in self.limits if lim.model is None or lim.model == model)
        return found

    def covering(self, caller: Caller, model: str | None) -> RateLimit | None:
        """The first limit that holds ``caller``'s requests of ``model``, or None."""
        for limit in self._of_model(model):
            if holds(limit, caller):
                return limit
        return None

    def model_limited(self, model: str) -> bool:
        """Whether any limit covers some caller's requests of ``model``."""
        return bool(self._of_model(model))

    def counts_bytes(self, caller: Caller, model: str | None) -> bool:
        """Whether a bytes/s limit holds ``caller``'s requests of ``model``."""
        return any(lim.bytes_per_s is not None and holds(lim, caller) for lim in self._of_model(model))

    def admit(self, caller: Caller, model: str | None, nbytes: int, now: float) -> Refusal | None:
        """Charge one request of ``nbytes`` bytes by ``caller`` for ``model`` at ``now`` to every
        limit that holds it, or charge nothing and return the ``Refusal`` (see the module)."""
        if not self.limits:
            return None
        charged, worst, worst_limit = [], 0.0, None
        for limit in self._of_model(model):
            if not holds(limit, caller):
                continue
            for kind, rate, burst in self._dims[limit.key]:
                key = (limit.key, caller.key, kind)
                bucket = self.buckets.get(key)
                level = burst if bucket is None else bucket.level(rate, burst, now)
                cost = 1.0 if kind == "requests" else float(nbytes)
                need = min(cost, burst)
                if level + EPSILON < need:
                    wait = (need - level) / rate
                    if wait > worst:
                        worst, worst_limit = wait, limit
                charged.append((key, level, cost))
        if worst_limit is not None:
            self.refused[(worst_limit.key, worst_limit.model or ALL_MODELS)] += 1
            return Refusal(worst_limit.key, worst, (
                f"rate limit {worst_limit.key!r} ({describe_limit(worst_limit)}"
                f"{'' if worst_limit.model is None else f' of model {worst_limit.model!r}'}) refused this request; "
                f"retry after {retry_text(worst)} s (rate_limits.{worst_limit.key})"))
        for key, level, cost in charged:
            bucket = self.buckets.get(key)
            if bucket is None:
                bucket = self.buckets[key] = _Bucket(0.0, now)
            bucket.tokens, bucket.at = level - cost, now
        if len(self.buckets) > MAX_BUCKETS:
            self._forget_full(now)
        return None

    def _forget_full(self, now: float) -> None:
        """Forget buckets that are full again: a fresh one is the same."""
        limits = {key: {kind: (rate, burst) for kind, rate, burst in dims} for key, dims in self._dims.items()}
        for key, bucket in list(self.buckets.items()):
            rate, burst = limits[key[0]][key[2]]
            if bucket.level(rate, burst, now) >= burst:
                del self.buckets[key]

    def describe(self) -> list[dict]:
        """Each limit as configured, with its refusals so far and the callers it holds buckets of
        (for ``info``, ``inspect`` and metrics; no caller is named)."""
        out = []
        for limit in self.limits:
            callers = {k[1] for k in self.buckets if k[0] == limit.key}
            out.append({"limit": limit.key, "model": limit.model or ALL_MODELS,
                        "requests_per_s": limit.requests_per_s, "burst": limit.burst if limit.requests_per_s else None,
                        "bytes_per_s": limit.bytes_per_s, "burst_bytes": limit.burst_bytes if limit.bytes_per_s else None,
                        "callers": len(callers),
                        "refused": sum(n for (key, _), n in self.refused.items() if key == limit.key)})
        return out


def retry_text(seconds: float) -> str:
    """Seconds for a message: three significant digits, never 0 for a wait that is not."""
    return f"{max(seconds, 0.001):.3g}"
