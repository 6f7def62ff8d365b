"""``shmserve.scheduling`` in-process, with a fake clock: the order a worker takes what it holds.

Ordering by level (Triton's: 1 first), fairness between callers within a level, the starvation
bound (stated in the module, proved here by brute force over random arrivals), hard deadlines,
queue timeouts (reject, delay), ``max_queue_size`` refusals, and slot fields a hostile lane client
wrote.
"""

from __future__ import annotations

import random

import pytest

import types

from shmserve import hotpath, layout
from shmserve.config import ModelConfig
from shmserve.scheduling import EXPIRED, REFUSED, TAKEN, Policy, Scheduler, effective_level

MS = 1_000_000


class Clock:
    def __init__(self, now: int = 1_000 * MS):
        self.now = now

    def __call__(self) -> int:
        return self.now


def scheduler(**policy) -> tuple[Scheduler, Clock]:
    clock = Clock()
    return Scheduler(Policy(model="m", **policy), clock), clock


def drain(s: Scheduler) -> list:
    out = []
    while (t := s.take()) is not None:
        assert t.state == TAKEN
        out.append(t.item)
    return out


# -- the level of a request --------------------------------------------------------------------

def test_effective_level_follows_tritons_rule():
    assert effective_level(5, 0, 0) == 1  # no levels: one
    assert effective_level(0, 0, 0) == 1
    assert effective_level(1, 4, 0) == 1
    assert effective_level(4, 4, 0) == 4
    assert effective_level(0, 4, 0) == 4  # none named, no default: the lowest
    assert effective_level(0, 4, 2) == 2
    assert effective_level(5, 4, 2) == 2  # above the levels: the default
    assert effective_level(2**32 - 1, 4, 0) == 4
    assert effective_level(-3, 4, 3) == 3


def test_the_policy_of_a_model_config():
    config = ModelConfig(name="m", backend="python", path="x:y", priority_levels=3, default_priority_level=2,
                         priority_starvation_limit=5, fairness="arrival", max_queue_size=7, default_timeout_us=9,
                         timeout_action="delay", allow_timeout_override=False)
    assert Policy.of(config) == Policy(3, 2, 5, "arrival", 7, 9, "delay", False, "m")


# -- order ----------------------------------------------------------------------------------------

def test_higher_levels_first_then_arrival_within_a_level():
    s, _ = scheduler(levels=3)
    for item, priority in [("a3", 3), ("b2", 2), ("c3", 3), ("d1", 1), ("e0", 0), ("f2", 2)]:
        assert s.hold(item, priority) == []
    assert len(s) == 6
    assert drain(s) == ["d1", "b2", "f2", "a3", "c3", "e0"]  # 0: the default, the lowest
    assert len(s) == 0 and s.take() is None


def test_the_default_level_takes_unnamed_and_out_of_range_priorities():
    s, _ = scheduler(levels=3, default_level=1)
    s.hold("low", 3)
    s.hold("unnamed", 0)
    s.hold("huge", 2**32 - 1)
    assert drain(s) == ["unnamed", "huge", "low"]


def test_callers_take_turns_within_a_level():
    """One caller floods, two others ask once each: they do not wait behind the flood."""
    s, _ = scheduler()
    for i in range(5):
        s.hold(f"a{i}", caller=1)
    s.hold("b0", caller=2)
    s.hold("c0", caller=3)
    s.hold("b1", caller=2)
    assert drain(s) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]


def test_arrival_fairness_is_first_come_first_served():
    s, _ = scheduler(fairness="arrival")
    for i in range(3):
        s.hold(f"a{i}", caller=1)
    s.hold("b0", caller=2)
    assert drain(s) == ["a0", "a1", "a2", "b0"]


def test_new_arrivals_between_takes_are_ordered_too():
    s, _ = scheduler(levels=2)
    for i in range(3):
        s.hold(f"low{i}", 2)
    assert s.take().item == "low0"
    s.hold("high", 1)
    assert drain(s) == ["high", "low1", "low2"]


# -- the starvation bound -------------------------------------------------------------------------

def test_a_low_request_passed_over_the_limit_is_taken_next():
    s, _ = scheduler(levels=2, starvation_limit=3)
    s.hold("low", 2)
    taken = []
    for i in range(8):
        s.hold(f"high{i}", 1)
        taken.append(s.take().item)
    assert taken[:4] == ["high0", "high1", "high2", "low"]


def test_starved_requests_of_several_levels_go_lowest_level_first():
    """Taking the lowest starved level first is what keeps the bound exact: the level-2 request
    is not passed over a second time by the starved level-3 one."""
    s, _ = scheduler(levels=3, starvation_limit=1)
    for item, priority in [("c", 3), ("b", 2), ("a1", 1), ("a2", 1), ("a3", 1)]:
        s.hold(item, priority)
    taken = []
    while (t := s.take()) is not None:
        assert s.passed_over(t) <= 1
        taken.append(t.item)
    assert taken == ["a1", "c", "b", "a2", "a3"]


@pytest.mark.parametrize("seed", range(40))
def test_the_starvation_bound_holds_for_random_arrivals(seed):
    """The module's bound, by brute force: a request is passed over by higher-level picks at most
    ``starvation_limit`` times, whatever arrives when (printed seed reproduces it)."""
    rng = random.Random(seed)
    print("seed", seed)
    levels, limit = rng.randint(2, 5), rng.randint(1, 6)
    s, _ = scheduler(levels=levels, starvation_limit=limit, fairness=rng.choice(["callers", "arrival"]))
    held = {}
    for step in range(400):
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            level = rng.choice([1, 1, 1, 2, levels])  # mostly high: the low ones are pressed
            ticket_item = ("r", step, len(held))
            s.hold(ticket_item, level, caller=rng.randint(0, 3))
            held[ticket_item] = None
        ticket = s.take()
        if ticket is None:
            continue
        assert s.passed_over(ticket) <= limit, (ticket, s.passed_over(ticket), limit)
        for waiting in s.waiting():
            assert s.passed_over(waiting) <= limit, (waiting, limit)
    while (ticket := s.take()) is not None:
        assert s.passed_over(ticket) <= limit


# -- deadlines and queue timeouts ----------------------------------------------------------------

def test_a_request_whose_deadline_passed_is_expired_never_taken():
    s, clock = scheduler()
    s.hold("soon", deadline_ns=clock.now + 5 * MS)
    s.hold("later", deadline_ns=clock.now + 50 * MS)
    s.hold("never", deadline_ns=2**64 - 1)
    clock.now += 10 * MS
    assert drain(s) == ["later", "never"]
    (gone,) = s.expired()
    assert gone.item == "soon" and gone.state == EXPIRED and gone.why == "deadline"
    assert "deadline passed" in s.expiry_message(gone.why)
    assert s.expired() == [] and s.expired_count == 1


def test_queue_timeout_reject_answers_timeout():
    s, clock = scheduler(default_timeout_us=1000)
    s.hold("old", t_ready_ns=clock.now - 2 * MS)
    s.hold("fresh")
    assert drain(s) == ["fresh"]
    (gone,) = s.expired()
    assert gone.item == "old" and gone.why == "queue timeout"
    assert "max_queue_size" not in s.expiry_message(gone.why) and "default_timeout_microseconds = 1000" in \
        s.expiry_message(gone.why)


def test_queue_timeout_delay_demotes_behind_every_other():
    s, clock = scheduler(levels=2, default_timeout_us=1000, timeout_action="delay")
    s.hold("old-high", 1)
    s.hold("low", 2)
    clock.now += 2 * MS  # old-high and low time out: delayed, in the order they are found
    s.hold("new-low", 2)
    assert drain(s) == ["new-low", "old-high", "low"]
    assert s.demoted == 2 and s.expired() == []


def test_a_delayed_request_still_expires_at_its_deadline():
    s, clock = scheduler(default_timeout_us=1000, timeout_action="delay")
    s.hold("d", deadline_ns=clock.now + 5 * MS)
    clock.now += 2 * MS
    s.hold("x")
    assert s.take().item == "x"
    clock.now += 10 * MS
    assert s.take() is None and [t.item for t in s.expired()] == ["d"]


def test_an_own_timeout_replaces_the_default_when_allowed():
    for allow, expected in ((True, ["own"]), (False, [])):
        s, clock = scheduler(default_timeout_us=1000, allow_timeout_override=allow)
        s.hold("own", flags=layout.SLOT_FLAG_OWN_TIMEOUT, deadline_ns=clock.now + 60 * MS)
        clock.now += 5 * MS
        assert drain(s) == expected


def test_a_ready_time_in_the_future_is_clamped_to_now():
    s, clock = scheduler(default_timeout_us=1000)
    s.hold("liar", t_ready_ns=2**64 - 1)  # would never time out
    clock.now += 2 * MS
    assert drain(s) == [] and [t.item for t in s.expired()] == ["liar"]


def test_a_request_alone_follows_the_same_rule_without_being_held():
    s, clock = scheduler(levels=3, default_level=2, default_timeout_us=1000)
    assert s.alone(1) == (1, "") and s.alone(0) == (2, "") and s.alone(2**32 - 1) == (2, "")
    assert s.alone(1, deadline_ns=clock.now) == (1, "deadline")
    assert s.alone(3, t_ready_ns=clock.now - 2 * MS) == (3, "queue timeout")
    assert s.alone(3, t_ready_ns=clock.now - 2 * MS, flags=layout.SLOT_FLAG_OWN_TIMEOUT) == (3, "")
    assert s.alone(3, t_ready_ns=2**64 - 1) == (3, "")  # (a ready time to come is now)
    assert s.expired_count == 2 and len(s) == 0
    d, clock = scheduler(default_timeout_us=1000, timeout_action="delay")
    assert d.alone(t_ready_ns=clock.now - 2 * MS) == (1, "") and d.demoted == 1


# -- max_queue_size -------------------------------------------------------------------------------

def test_beyond_max_queue_size_the_newest_lowest_request_is_refused():
    s, _ = scheduler(levels=2, max_queue_size=3)
    assert s.hold("low0", 2) == [] and s.hold("low1", 2) == [] and s.hold("high0", 1) == []
    (refused,) = s.hold("high1", 1)
    assert refused.item == "low1" and refused.state == REFUSED
    (refused,) = s.hold("low2", 2)
    assert refused.item == "low2"  # the new one itself: newest of the lowest
    message = s.refusal_message()
    assert "'m'" in message and "max_queue_size (3)" in message
    assert drain(s) == ["high0", "high1", "low0"] and s.refused == 2


def test_delayed_requests_are_refused_first():
    s, clock = scheduler(max_queue_size=3, default_timeout_us=1000, timeout_action="delay")
    s.hold("old")
    clock.now += 2 * MS
    s.hold("a")
    assert s.take().item == "a"  # the sweep delayed "old" first
    assert s.hold("b") == [] and s.hold("c") == []
    (refused,) = s.hold("d")
    assert refused.item == "old"  # delayed: below every level
    assert drain(s) == ["b", "c", "d"]


def test_a_lane_is_one_caller_and_a_doors_lane_one_per_connection():
    """The worker's caller keys: an arena slot's field as written; a client's lane its region
    whatever its client wrote; a door process's lane (eventfd) its region and the connection the
    door wrote; none of them equal."""
    from workers.worker import caller_key

    arena = types.SimpleNamespace(is_lane=False, region=0, wake=hotpath.ARENA)
    lane7 = types.SimpleNamespace(is_lane=True, region=7, wake=hotpath.LANE_FUTEX)
    door7 = types.SimpleNamespace(is_lane=True, region=7, wake=hotpath.LANE_EVENTFD)
    assert caller_key(arena, 5) == 5
    assert caller_key(lane7, 5) == caller_key(lane7, 2**32 - 1) == caller_key(lane7, 0)
    keys = {caller_key(arena, c) for c in (0, 7, 2**32 - 1)} | {caller_key(lane7, 0)} | \
        {caller_key(door7, c) for c in (0, 1, 2**32 - 1)} | {caller_key(types.SimpleNamespace(
            is_lane=True, region=8, wake=hotpath.LANE_FUTEX), 0)}
    assert len(keys) == 8


# -- hostile fields -------------------------------------------------------------------------------

def test_hostile_field_values_are_only_values():
    s, clock = scheduler(levels=16, default_level=0)
    s.hold("huge", 2**32 - 1, caller=0, deadline_ns=2**64 - 1, flags=2**32 - 1, t_ready_ns=2**64 - 1)
    s.hold("zero", 0, caller=0, deadline_ns=0, flags=0, t_ready_ns=0)
    s.hold("top", 1, caller=2**32 - 1)
    clock.now += 10**12
    assert drain(s) == ["top", "huge", "zero"] and s.expired() == []


def test_many_requests_leave_nothing_behind():
    """Stale bookkeeping does not pile up: the timer heap and the arrival orders empty."""
    s, clock = scheduler(levels=3, default_timeout_us=10**6)
    for round_ in range(50):
        for i in range(20):
            s.hold((round_, i), 1 + i % 3, caller=i % 4, deadline_ns=clock.now + 10**12)
        assert len(drain(s)) == 20
    assert s.take() is None and not s.timers
    assert all(not lv.count for lv in s.levels)
    assert sum(len(lv.arrivals) for lv in s.levels) <= 3


def test_in_turn_takes_each_callers_first_request_then_their_second_the_one_served_longest_ago_first():
    """The default policy's order of one look, pure: callers never served first in the order they
    appear, then by when each was last served; a caller's burst waits behind every other caller's
    first request; one caller alone keeps its order."""
    from shmserve.scheduling import in_turn

    look = [(1, "a1"), (1, "a2"), (1, "a3"), (2, "b1"), (3, "c1"), (2, "b2")]
    assert [x for _, x in in_turn(look, {})] == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert [x for _, x in in_turn(look, {1: 9, 2: 5, 3: 7})] == ["b1", "c1", "a1", "b2", "a2", "a3"]
    assert [x for _, x in in_turn([(3, "c"), (1, "a"), (2, "b")], {1: 2, 2: 1})] == ["c", "b", "a"]
    assert in_turn([(4, "x"), (4, "y")], {4: 1}) == [(4, "x"), (4, "y")]
