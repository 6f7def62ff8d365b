"""The order in which a worker takes the requests it holds: priorities, fairness, deadlines and the queue policy.

Owns: ``Policy`` (a model's scheduling keys, from its ``ModelConfig``),
``effective_level`` (the level a request's ``priority`` field stands for), the caller keys of
lanes (``lane_caller``), ``in_turn`` (the default policy's order of what one look brought), and
``Scheduler``: the requests a worker has taken off its rings (its own and its
lanes') and not yet claimed, and which one it takes next.  Pure logic: no
shared memory, no rings, and the clock injected (``clock()``: CLOCK_MONOTONIC
nanoseconds), so it is tested with a fake clock in milliseconds
(``tests/test_scheduling.py``).

The rule, in the order it is applied (Triton's: level 1 first)::

    1. expired      a request whose hard deadline (``deadline_ns``) has passed, or whose queue
                    timeout has passed under timeout_action "reject", is never run: it is
                    handed back through ``expired()`` (the worker answers TIMEOUT)
    2. starved      a request passed over ``starvation_limit`` times by picks of a higher
                    level while it waited is taken next (several: the one of the lowest
                    level first, then the earliest held)
    3. by level     else the highest level waiting (1 before 2 ...), and within it:
                    fairness "callers": one request of each waiting caller in turn
                    (round-robin, each caller's own in arrival order);
                    fairness "arrival": first held, first taken
    4. delayed      requests whose queue timeout passed under timeout_action "delay" come
                    after every other, in the order they were delayed

The starvation bound: a request is passed over at most ``starvation_limit``
times by picks of levels above its own, exactly.  Proof: once it has been
passed over ``starvation_limit`` times, every pick until its own is of a starved
request of its level or a lower one (rule 2 takes the lowest level first), and
such a pick passes nothing of its level over.  Its wait then ends after the
starved requests of its own level held before it and those of lower levels
(finite: while it waits no pick above its level happens, so no request of its
level or above becomes starved anew).  Picks of its own level (other callers'
turns) are not counted: within a level, round-robin bounds the wait by the
number of callers ahead of it.

The queue timeout of a request is ``t_ready + default_timeout_us`` (none if
``default_timeout_us`` is 0), unless its slot's flags carry
``layout.SLOT_FLAG_OWN_TIMEOUT`` and the policy allows the override: then its
own deadline governs alone.  ``max_queue_size`` (0: none) bounds the requests
held: one more, and the newest request of the lowest level held (delayed
requests are below every level) is refused: ``hold`` returns it and the worker
answers OVERLOADED (``refusal_message``).

Every field of a request is untrusted (a lane's client writes its own slot):
any ``priority`` maps to a level (``effective_level``), ``deadline_ns`` 2**64-1
is "never", ``t_ready`` is clamped to the clock's now (a request cannot make
itself look younger than it is), and ``caller`` is only a key.

Must not: read or write shared memory, claim or answer requests (the worker
does: ``workers.worker``), or keep requests other than those it was handed.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from shmserve import layout

WAITING, TAKEN, EXPIRED, REFUSED = 0, 1, 2, 3  # a Ticket's state
DEADLINE_PASSED = "the request's deadline passed before a worker could start it (it did not run)"  # TIMEOUT's


@dataclass(frozen=True)
class Policy:
    """A model's scheduling keys (``config.ModelConfig``'s of the same names; docs/config.md,
    "Priorities and queue policy").  ``levels`` 0: one level."""

    levels: int = 0
    default_level: int = 0
    starvation_limit: int = 32
    fairness: str = "callers"
    max_queue_size: int = 0
    default_timeout_us: int = 0
    timeout_action: str = "reject"
    allow_timeout_override: bool = True
    model: str = ""

    @classmethod
    def of(cls, config) -> "Policy":
        """The policy of a ``ModelConfig``."""
        return cls(config.priority_levels, config.default_priority_level, config.priority_starvation_limit,
                   config.fairness, config.max_queue_size, config.default_timeout_us, config.timeout_action,
                   config.allow_timeout_override, config.name)


# Caller keys (fairness "callers"): an arena slot's caller field as the front-end wrote it (a u32);
# a lane's keys lie above every u32, apart from each other (``lane_caller``).
LANE_CALLERS = 1 << 32


def lane_caller(region: int, connection: int | None = None) -> int:
    """The caller key of a lane's calls: a client's lane is one caller, its region; a door
    process's lane (``connection``: the u32 its door wrote) one caller per connection."""
    if connection is None:
        return LANE_CALLERS + region
    return LANE_CALLERS + region + ((connection + 1) << 33)


def in_turn(keyed: list[tuple], last_served: dict[int, int]) -> list[tuple]:
    """``keyed`` (what one look brought, each a tuple whose first item is its caller key, in the
    order gathered) with its callers in turn: the caller served longest ago first (``last_served``:
    key -> when it was last served, in any increasing count; a caller never served, first of all,
    in the order the callers first appear), its first request, then the next caller's...; then each
    one's second, and so on.  Round after round that is round-robin: a caller's turn does not depend
    on where its last request fell in a look.  The default policy's order (``workers.worker``
    serves what one look brings in it, holding nothing)."""
    callers = {item[0] for item in keyed}
    if len(callers) == 1:
        return keyed
    served = last_served.get
    if len(callers) == len(keyed):  # one request each (the usual look): by when each was served, stable
        return sorted(keyed, key=lambda item: served(item[0], -1))
    queues: dict[int, list] = {}
    for item in keyed:
        queue = queues.get(item[0])
        if queue is None:
            queues[item[0]] = [item]
        else:
            queue.append(item)
    lists = sorted(queues.values(), key=lambda q: served(q[0][0], -1))
    ordered = []
    for i in range(max(map(len, lists))):
        ordered.extend(q[i] for q in lists if i < len(q))
    return ordered


def effective_level(priority: int, levels: int, default: int) -> int:
    """The level (1 first .. max(levels, 1)) a request's ``priority`` field stands for: ``levels``
    0: everything is level 1; ``priority`` 0 or above ``levels``: ``default``, whose 0 is the lowest
    level (``levels``).  Any integer is accepted (a hostile slot's u32 included)."""
    if levels <= 0:
        return 1
    if 0 < priority <= levels:
        return priority
    return default if 0 < default <= levels else levels


class Ticket:
    """One request held: ``item`` (the caller's: the worker's (space, entry)), its ``level``,
    ``caller`` key, times (ns) and ``state``.  ``why`` says why it expired ("deadline" or
    "queue timeout").  Its life, every other move impossible::

        state    event                                      next
        WAITING  take                                       TAKEN
        WAITING  deadline passed (delayed or not)           EXPIRED
        WAITING  queue timeout passed, "reject"             EXPIRED
        WAITING  queue timeout passed, "delay"              WAITING, delayed (once)
        WAITING  one more than max_queue_size, the newest   REFUSED
                 of the lowest level
    """

    __slots__ = ("item", "level", "caller", "seq", "t_ready", "deadline", "timeout_at", "snap", "state",
                 "delayed", "why")

    def __init__(self, item, level: int, caller, seq: int, t_ready: int, deadline: int, timeout_at: int, snap: int):
        self.item, self.level, self.caller, self.seq = item, level, caller, seq
        self.t_ready, self.deadline, self.timeout_at, self.snap = t_ready, deadline, timeout_at, snap
        self.state, self.delayed, self.why = WAITING, False, ""

    def __repr__(self) -> str:
        return f"Ticket({self.item!r}, level={self.level}, caller={self.caller}, seq={self.seq}, state={self.state})"


class _Level:
    """The requests of one level: by caller (a dict in round-robin order: the first key is next;
    unused under fairness "arrival") and in arrival order (for "arrival", the starvation check
    and refusals).  Both may hold tickets that left already (taken, expired, refused, delayed):
    skipped when met, and dropped from the ends as they are met."""

    __slots__ = ("callers", "arrivals", "count")

    def __init__(self):
        self.callers: dict[Any, deque] = {}
        self.arrivals: deque = deque()
        self.count = 0

    def oldest(self) -> Ticket:
        arrivals = self.arrivals
        while not _live(arrivals[0]):
            arrivals.popleft()
        return arrivals[0]

    def newest(self) -> Ticket:
        arrivals = self.arrivals
        while not _live(arrivals[-1]):
            arrivals.pop()
        return arrivals[-1]

    def tidy(self) -> None:
        """Drop the tickets that left from the front of the arrival order."""
        arrivals = self.arrivals
        while arrivals and not _live(arrivals[0]):
            arrivals.popleft()

    def next_of_callers(self) -> Ticket:
        callers = self.callers
        while True:
            caller = next(iter(callers))
            queue = callers.pop(caller)
            while queue and not _live(queue[0]):
                queue.popleft()
            if not queue:
                continue
            ticket = queue.popleft()
            while queue and not _live(queue[0]):
                queue.popleft()
            if queue:
                callers[caller] = queue  # to the end of the turn
            return ticket


def _live(ticket: Ticket) -> bool:
    return ticket.state == WAITING and not ticket.delayed


class Scheduler:
    """The requests a worker holds, in the order of the module's rule.

    ``hold`` adds one (returns the tickets refused by ``max_queue_size``: maybe the new one);
    ``take`` returns the next to run (None: none waits); ``expired`` hands over, once, those
    that expired meanwhile.  ``len()`` is how many wait; ``last_level`` is the level ``hold``
    gave the request it held last.  Counters: ``demoted`` (delayed by
    their queue timeout), ``expired_count``, ``refused``.  Not thread-safe (the serve loop's).
    """

    def __init__(self, policy: Policy, clock: Callable[[], int] = time.monotonic_ns):
        self.policy, self.clock = policy, clock
        n = max(policy.levels, 1)
        self.levels = [_Level() for _ in range(n + 1)]  # [0] unused: level 1 is [1]
        self.above = [0] * (n + 2)  # above[L]: picks of levels above L so far (the starvation counts)
        self.delayed: deque = deque()  # timed out under "delay": after every other, in this order
        self.n_delayed = 0  # of them, still waiting
        self.timers: list = []  # heap of (when, seq, ticket): a deadline or a queue timeout to act on
        self._expired: list[Ticket] = []
        self.seq = 0
        self.count = 0
        self.demoted = self.expired_count = self.refused = 0
        self.last_level = 1  # the level of the request held last
        self._timeout_ns = policy.default_timeout_us * 1000
        self._own = policy.allow_timeout_override
        self._arrival = policy.fairness == "arrival"

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    # -- in ---------------------------------------------------------------------------------

    def hold(self, item, priority: int = 0, caller=0, deadline_ns: int = 0, flags: int = 0,
             t_ready_ns: int = 0) -> list[Ticket]:
        """Hold ``item`` as a request of ``priority`` (its slot's field) from ``caller`` (a key),
        ready at ``t_ready_ns`` (0 or later than now: now), with hard deadline ``deadline_ns`` (0:
        none) and slot ``flags``.  Returns the tickets ``max_queue_size`` refuses (empty, or one:
        the newest of the lowest level, maybe this one), no longer held."""
        policy = self.policy
        now = self.clock()
        if not t_ready_ns or t_ready_ns > now:
            t_ready_ns = now
        level = effective_level(priority, policy.levels, policy.default_level)
        if self._timeout_ns and not (self._own and flags & layout.SLOT_FLAG_OWN_TIMEOUT):
            timeout_at = t_ready_ns + self._timeout_ns
        else:
            timeout_at = 0
        self.last_level = level
        self.seq += 1
        ticket = Ticket(item, level, caller, self.seq, t_ready_ns, deadline_ns, timeout_at, self.above[level])
        lv = self.levels[level]
        if not self._arrival:
            queue = lv.callers.get(caller)
            if queue is None:
                lv.callers[caller] = deque((ticket,))
            else:
                queue.append(ticket)
        lv.arrivals.append(ticket)
        lv.count += 1
        self.count += 1
        if deadline_ns or timeout_at:
            when = min(t for t in (deadline_ns, timeout_at) if t)
            timers = self.timers
            if len(timers) > 2 * self.count + 64:  # mostly tickets that left: keep those still waiting
                timers[:] = [t for t in timers if t[2].state == WAITING]
                heapq.heapify(timers)
            heapq.heappush(timers, (when, ticket.seq, ticket))
        if policy.max_queue_size and self.count > policy.max_queue_size:
            return [self._refuse()]
        return []

    def alone(self, priority: int = 0, deadline_ns: int = 0, flags: int = 0, t_ready_ns: int = 0) -> tuple[int, str]:
        """``hold`` then ``take`` for a request that nothing else waits beside (nothing held): the
        same rule without holding it.  Returns (its level, why it expired: "deadline" or "queue
        timeout" under timeout_action "reject" — counted in ``expired_count`` —, or "": run it; a
        queue timeout passed under "delay" is counted in ``demoted``, and it runs, behind
        nothing)."""
        policy = self.policy
        level = effective_level(priority, policy.levels, policy.default_level)
        if not (deadline_ns or self._timeout_ns):
            return level, ""
        now = self.clock()
        if deadline_ns and deadline_ns <= now:
            self.expired_count += 1
            return level, "deadline"
        if self._timeout_ns and not (self._own and flags & layout.SLOT_FLAG_OWN_TIMEOUT):
            if (t_ready_ns if 0 < t_ready_ns <= now else now) + self._timeout_ns <= now:
                if policy.timeout_action != "delay":
                    self.expired_count += 1
                    return level, "queue timeout"
                self.demoted += 1
        return level, ""

    def _refuse(self) -> Ticket:
        """Drop the newest request of the lowest level (the delayed ones lowest of all)."""
        if self.n_delayed:
            victim = self.delayed.pop()
            while victim.state != WAITING:  # (expired meanwhile)
                victim = self.delayed.pop()
            self.n_delayed -= 1
        else:
            victim = next(lv for lv in reversed(self.levels) if lv.count).newest()
            self.levels[victim.level].count -= 1
        victim.state = REFUSED
        self.count -= 1
        self.refused += 1
        return victim

    # -- out --------------------------------------------------------------------------------

    def take(self) -> Ticket | None:
        """The next request by the rule (TAKEN), or None if none waits.  Expiries found on the way
        are kept for ``expired()``."""
        if self.timers:
            self._sweep(self.clock())
        if not self.count:
            self.timers.clear()  # (only tickets that left)
            return None
        levels = self.levels
        top = 0
        for level in range(1, len(levels)):
            if levels[level].count:
                top = level
                break
        if not top:  # only delayed requests wait
            ticket = self.delayed.popleft()
            while ticket.state != WAITING:
                ticket = self.delayed.popleft()
            ticket.state = TAKEN
            self.count -= 1
            self.n_delayed -= 1
            return ticket
        ticket = self._starved(top) if len(levels) > 2 else None
        lv = levels[top] if ticket is None else levels[ticket.level]
        if ticket is None:
            ticket = lv.oldest() if self._arrival else lv.next_of_callers()
        ticket.state = TAKEN
        lv.count -= 1
        self.count -= 1
        lv.tidy()
        above = self.above
        for level in range(ticket.level + 1, len(above)):  # every lower level was passed over once more
            above[level] += 1
        return ticket

    def _starved(self, top: int) -> Ticket | None:
        """The request passed over ``starvation_limit`` times of the lowest level below ``top``
        that has one (its earliest held: within a level, the earliest held is passed over most)."""
        limit, levels, above = self.policy.starvation_limit, self.levels, self.above
        for level in range(len(levels) - 1, top, -1):
            if levels[level].count:
                oldest = levels[level].oldest()
                if above[level] - oldest.snap >= limit:
                    return oldest
        return None

    def passed_over(self, ticket: Ticket) -> int:
        """How many times picks of higher levels passed ``ticket`` over (so far, or until taken)."""
        return self.above[ticket.level] - ticket.snap

    def _sweep(self, now: int) -> None:
        """Act on every deadline and queue timeout that has passed by ``now``."""
        timers = self.timers
        while timers and timers[0][0] <= now:
            _, _, ticket = heapq.heappop(timers)
            if ticket.state != WAITING:
                continue
            if ticket.deadline and ticket.deadline <= now:
                self._expire(ticket, "deadline")
            elif ticket.timeout_at and ticket.timeout_at <= now and not ticket.delayed:
                if self.policy.timeout_action == "delay":
                    self._delay(ticket)
                    if ticket.deadline:
                        heapq.heappush(timers, (ticket.deadline, ticket.seq, ticket))
                else:
                    self._expire(ticket, "queue timeout")

    def _expire(self, ticket: Ticket, why: str) -> None:
        if ticket.delayed:
            self.n_delayed -= 1
        else:
            self.levels[ticket.level].count -= 1
        ticket.state, ticket.why = EXPIRED, why
        self.count -= 1
        self.expired_count += 1
        self._expired.append(ticket)

    def _delay(self, ticket: Ticket) -> None:
        self.levels[ticket.level].count -= 1
        ticket.delayed = True
        self.delayed.append(ticket)
        self.n_delayed += 1
        self.demoted += 1

    def expired(self) -> list[Ticket]:
        """The tickets that expired since the last call (each handed over once), oldest first."""
        if not self._expired:
            return self._expired
        out, self._expired = self._expired, []
        return out

    def waiting(self) -> Iterator[Ticket]:
        """Every ticket still waiting (no order promised)."""
        for lv in self.levels:
            for ticket in lv.arrivals:
                if ticket.state == WAITING and not ticket.delayed:
                    yield ticket
        for ticket in self.delayed:
            if ticket.state == WAITING:
                yield ticket

    # -- words for the answers ---------------------------------------------------------------

    def refusal_message(self) -> str:
        """The OVERLOADED message of a request ``max_queue_size`` refused."""
        p = self.policy
        return (f"model {p.model!r}: more than its max_queue_size ({p.max_queue_size}) requests wait for this "
                f"worker: try again later, or raise max_queue_size in the model's default_queue_policy")

    def expiry_message(self, why: str) -> str:
        """The TIMEOUT message of a request that expired ``why`` (a Ticket's ``why``)."""
        if why == "deadline":
            return DEADLINE_PASSED
        return (f"model {self.policy.model!r}: the request waited longer than its queue timeout "
                f"(default_timeout_microseconds = {self.policy.default_timeout_us}) and did not run: "
                f"raise it, or set timeout_action = \"delay\" in the model's default_queue_policy")
