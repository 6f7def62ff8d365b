"""Which loaded versions to evict so that another one fits its device's memory budget.

Owns: the eviction policy of ``server.memory_budget`` (issue 12 item 5):
which versions may be evicted at all, in what order, how many, and the
words of a refusal; and ``RateMeter``, the recent request rate the order is
weighted by.  The front-end describes each loaded version as
a ``Resident`` (its measured bytes, when it was last used, its rate, and
whether it is busy, pinned or loaded at startup) and asks ``victims``.

Rules
-----
* Only an idle ``on_demand`` version that is not ``pinned`` may be evicted:
  a busy one (requests in flight or queued), a pinned one and one loaded at
  startup never are.
* Evictable versions are taken least valuable first, by ``idleness``:
  seconds since last use, less ``RATE_WEIGHT_S`` seconds for each request
  per second of recent rate.  So a version used a minute ago at 10
  requests/s stays ahead of one used once just now, and a version whose
  burst ended an hour ago (its rate decayed to nothing) goes first.
* Taken in that order until the new version fits, then every victim the
  others make unnecessary is given back (the most valuable first): no
  version is evicted whose memory is not needed.
* If even evicting every evictable version would not make room, nothing is
  evicted and the load is refused with the reason (``Victims.refused``).

Must not: read a clock (``now`` is passed in), touch workers, or do I/O.
It is pure logic: ``tests/test_residency.py`` runs it alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# How long a burst of requests keeps a version valuable: its rate halves every RATE_HALF_LIFE_S
# without requests.  A minute: a model that served a burst a few minutes ago outranks a one-off
# request; one idle for an hour counts only by its last use.
RATE_HALF_LIFE_S = 60.0
# The exchange rate between recency and rate: one request/s of recent rate is worth having been
# used RATE_WEIGHT_S seconds more recently (ten minutes).
RATE_WEIGHT_S = 600.0


class RateMeter:
    """A request rate that decays exponentially (half-life ``half_life_s``) between requests.

    ``hit(now)`` counts a request at ``now`` (seconds, any monotonic clock);
    ``rate(now)`` is the recent rate in requests per second: a steady
    stream of r per second reads r once it has run for a few half-lives,
    and the reading halves for every ``half_life_s`` without requests.
    ``now`` must not go backwards (ValueError).
    """

    __slots__ = ("_decay", "_level", "_at")

    def __init__(self, half_life_s: float = RATE_HALF_LIFE_S):
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s!r}")
        self._decay = math.log(2) / half_life_s  # per second
        self._level = 0.0  # the rate as of self._at
        self._at: float | None = None

    def _level_at(self, now: float) -> float:
        if self._at is None:
            return 0.0
        if now < self._at:
            raise ValueError(f"the clock went backwards: {now} < {self._at}")
        return self._level * math.exp(-self._decay * (now - self._at))

    def hit(self, now: float, count: int = 1) -> None:
        """Count ``count`` requests at ``now``."""
        self._level = self._level_at(now) + self._decay * count
        self._at = now

    def rate(self, now: float) -> float:
        """Requests per second, recently, as of ``now``."""
        return self._level_at(now)


@dataclass(frozen=True)
class Resident:
    """A loaded version of a model on one device, as the eviction policy sees it."""

    key: str  # "name:version"
    device: str  # "cpu", "cuda:0", ... (a ``server.memory_budget`` key)
    bytes: int  # measured after load and warm-up (all its workers)
    last_used: float  # when its last request arrived (the caller's clock; load time if none yet)
    rate: float  # recent requests per second (``RateMeter.rate``)
    busy: bool  # requests in flight or queued
    pinned: bool
    on_demand: bool  # load = "on_demand" (else loaded at startup: never evicted)

    @property
    def evictable(self) -> bool:
        return self.on_demand and not self.pinned and not self.busy

    def idleness(self, now: float) -> float:
        """How little it is worth keeping: seconds since last use less RATE_WEIGHT_S per request/s."""
        return (now - self.last_used) - RATE_WEIGHT_S * self.rate

    def why_kept(self) -> str:
        """Why it cannot be evicted (only for one that is not ``evictable``)."""
        return "busy" if self.busy else "pinned" if self.pinned else "loaded at startup"


@dataclass(frozen=True)
class Victims:
    """``victims``'s answer: the keys to evict, least valuable first (empty if it fits as it is),
    or ``refused``, why it cannot fit (then ``keys`` is empty and nothing may be evicted)."""

    keys: tuple[str, ...] = ()
    refused: str | None = None


def victims(device: str, budget: int | None, resident: list[Resident], need: int, now: float) -> Victims:
    """The versions to evict so that ``need`` more bytes fit ``device``'s ``budget``.

    ``resident``: the versions loaded (or loading), those of other devices
    ignored; ``budget``: ``device``'s ``server.memory_budget`` entry in
    bytes, None for no budget (nothing is ever evicted); ``need``: the bytes
    of the version to
    load; ``now``: the same clock as ``Resident.last_used``.  The module's
    Rules say which versions are taken and in what order; the answer is
    such that the bytes left plus ``need`` are at most ``budget``, or it is
    refused with a reason that names the budget's config key and what holds
    the memory.

    Raises ValueError for a negative size.
    """
    resident = [r for r in resident if r.device == device]
    if need < 0 or any(r.bytes < 0 for r in resident):
        raise ValueError("sizes cannot be negative")
    used = sum(r.bytes for r in resident)
    if budget is None or used + need <= budget:
        return Victims()
    where = f'server.memory_budget."{device}" = {budget} bytes'
    if need > budget:
        return Victims(refused=f"it needs {need} bytes, more than the whole budget ({where})")
    candidates = sorted((r for r in resident if r.evictable), key=lambda r: (-r.idleness(now), r.key))
    over = used + need - budget  # bytes that must be freed
    chosen: list[Resident] = []
    freed = 0
    for r in candidates:
        if freed >= over:
            break
        chosen.append(r)
        freed += r.bytes
    if freed < over:
        kept = [r for r in resident if not r.evictable]
        held = ", ".join(f"{r.key} ({r.bytes} bytes, {r.why_kept()})" for r in sorted(kept, key=lambda r: r.key))
        return Victims(refused=f"it needs {need} bytes and {used} of {where} are in use; evicting every idle "
                               f"on_demand version would free only {freed}"
                               + (f"; held by {held}" if held else ""))
    for r in reversed(list(chosen)):  # give back the victims the others make unnecessary
        if freed - r.bytes >= over:
            chosen.remove(r)
            freed -= r.bytes
    return Victims(keys=tuple(r.key for r in chosen))
