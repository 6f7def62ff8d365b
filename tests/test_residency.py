"""The eviction policy under a memory budget, and the decayed request rate it weighs (pure logic)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmserve.frontend.residency import RATE_HALF_LIFE_S, RateMeter, Resident, Victims, victims

NOW = 10_000.0
GiB = 1 << 30


def version(key: str, size: int = GiB, *, idle_s: float = 0.0, rate: float = 0.0, busy: bool = False,
            pinned: bool = False, on_demand: bool = True, device: str = "cpu") -> Resident:
    return Resident(key, device, size, NOW - idle_s, rate, busy, pinned, on_demand)


# -- the rate ---------------------------------------------------------------------------------

def test_a_steady_stream_reads_its_rate_and_halves_every_half_life_without_requests():
    meter = RateMeter()
    for i in range(int(20 * RATE_HALF_LIFE_S * 10)):  # 10 requests/s for 20 half-lives
        meter.hit(i / 10)
    end = 20 * RATE_HALF_LIFE_S
    assert meter.rate(end) == pytest.approx(10, rel=0.01)
    assert meter.rate(end + RATE_HALF_LIFE_S) == pytest.approx(5, rel=0.01)
    assert meter.rate(end + 60 * RATE_HALF_LIFE_S) < 1e-15


def test_a_new_meter_reads_zero_and_counts_a_batch_of_hits_at_once():
    one, many = RateMeter(half_life_s=10), RateMeter(half_life_s=10)
    assert one.rate(5.0) == 0.0
    for _ in range(4):
        one.hit(1.0)
    many.hit(1.0, count=4)
    assert one.rate(3.0) == pytest.approx(many.rate(3.0)) == pytest.approx(4 * math.log(2) / 10 * 2 ** -0.2)


def test_a_meter_refuses_a_clock_that_goes_backwards_and_a_half_life_that_is_not_positive():
    meter = RateMeter()
    meter.hit(5.0)
    with pytest.raises(ValueError, match="backwards"):
        meter.rate(4.0)
    with pytest.raises(ValueError, match="half_life_s"):
        RateMeter(half_life_s=0)


# -- the order --------------------------------------------------------------------------------

def test_a_version_busy_at_a_high_rate_until_two_minutes_ago_outranks_one_used_once_just_now():
    hot = RateMeter()
    for i in range(600):  # 10 requests/s for a minute, ending two minutes ago
        hot.hit(NOW - 180 + i / 10)
    once = RateMeter()
    once.hit(NOW)
    resident = [version("hot:1", idle_s=120, rate=hot.rate(NOW)), version("once:1", rate=once.rate(NOW))]
    assert victims("cpu", 2 * GiB, resident, GiB, NOW) == Victims(keys=("once:1",))


def test_a_burst_that_ended_an_hour_ago_counts_only_by_its_last_use():
    old = RateMeter()
    for i in range(6000):
        old.hit(NOW - 3600 - 600 + i / 10)  # 10 requests/s for ten minutes, an hour ago
    once = RateMeter()
    once.hit(NOW - 1)
    resident = [version("old:1", idle_s=3600, rate=old.rate(NOW)), version("once:1", idle_s=1, rate=once.rate(NOW))]
    assert victims("cpu", 2 * GiB, resident, GiB, NOW) == Victims(keys=("old:1",))


def test_equal_rates_evict_the_least_recently_used():
    resident = [version("a:1", idle_s=5), version("b:1", idle_s=50), version("c:1", idle_s=20)]
    assert victims("cpu", 3 * GiB, resident, 2 * GiB, NOW) == Victims(keys=("b:1", "c:1"))


# -- what may go ------------------------------------------------------------------------------

def test_no_budget_or_room_enough_evicts_nothing():
    resident = [version("a:1", idle_s=100)]
    assert victims("cpu", None, resident, 100 * GiB, NOW) == Victims()
    assert victims("cpu", 2 * GiB, resident, GiB, NOW) == Victims()
    assert victims("cpu", GiB, [], GiB, NOW) == Victims()


def test_busy_pinned_and_startup_versions_stay_even_when_least_recently_used():
    resident = [version("busy:1", idle_s=900, busy=True), version("pinned:1", idle_s=800, pinned=True),
                version("startup:1", idle_s=700, on_demand=False), version("idle:1", idle_s=1)]
    assert victims("cpu", 4 * GiB, resident, GiB, NOW) == Victims(keys=("idle:1",))


def test_a_load_that_cannot_fit_is_refused_with_what_holds_the_memory_and_nothing_evicted():
    resident = [version("busy:1", busy=True), version("pinned:1", pinned=True),
                version("startup:1", on_demand=False), version("idle:1", idle_s=30)]
    answer = victims("cpu", 4 * GiB, resident, 2 * GiB, NOW)
    assert answer.keys == ()
    assert answer.refused == (
        f'it needs {2 * GiB} bytes and {4 * GiB} of server.memory_budget."cpu" = {4 * GiB} bytes are in use; '
        f"evicting every idle on_demand version would free only {GiB}; held by busy:1 ({GiB} bytes, busy), "
        f"pinned:1 ({GiB} bytes, pinned), startup:1 ({GiB} bytes, loaded at startup)")


def test_a_version_larger_than_the_whole_budget_is_refused_at_once():
    answer = victims("cuda:1", GiB, [version("idle:1", idle_s=30, device="cuda:1")], 2 * GiB, NOW)
    assert answer == Victims(refused=f'it needs {2 * GiB} bytes, more than the whole budget '
                                     f'(server.memory_budget."cuda:1" = {GiB} bytes)')


def test_a_small_victim_the_large_one_makes_unnecessary_is_given_back():
    resident = [version("small:1", GiB, idle_s=100), version("large:1", 10 * GiB, idle_s=50),
                version("recent:1", GiB, idle_s=1)]
    assert victims("cpu", 12 * GiB, resident, 9 * GiB, NOW) == Victims(keys=("large:1",))


def test_only_the_devices_own_residents_count_and_negative_sizes_are_a_caller_bug():
    resident = [version("cpu:1", idle_s=9), version("gpu:1", 2 * GiB, idle_s=99, device="cuda:0")]
    assert victims("cuda:0", 2 * GiB, resident, GiB, NOW) == Victims(keys=("gpu:1",))
    assert victims("cpu", 2 * GiB, resident, GiB, NOW) == Victims()
    with pytest.raises(ValueError, match="negative"):
        victims("cpu", GiB, [version("a:1")], -1, NOW)


# -- properties -------------------------------------------------------------------------------

residents = st.lists(
    st.builds(lambda i, size, idle, rate, busy, pinned, on_demand: version(
        f"m{i}:1", size, idle_s=idle, rate=rate, busy=busy, pinned=pinned, on_demand=on_demand),
        st.integers(0, 10**6), st.integers(0, 64), st.floats(0, 7200), st.floats(0, 50),
        st.booleans(), st.booleans(), st.booleans()),
    max_size=12, unique_by=lambda r: r.key)


@settings(max_examples=400, deadline=None)
@given(residents, st.integers(0, 300), st.integers(0, 64))
def test_victims_are_evictable_fit_the_budget_whenever_possible_and_none_is_unneeded(resident, budget, need):
    answer = victims("cpu", budget, resident, need, NOW)
    by_key = {r.key: r for r in resident}
    used = sum(r.bytes for r in resident)
    evictable = sum(r.bytes for r in resident if r.evictable)
    possible = used - evictable + need <= budget
    assert (answer.refused is None) == possible
    if answer.refused is not None:
        assert answer.keys == ()
        return
    chosen = [by_key[k] for k in answer.keys]
    assert len(set(answer.keys)) == len(chosen)
    assert all(r.on_demand and not r.pinned and not r.busy for r in chosen)
    left = used - sum(r.bytes for r in chosen)
    assert left + need <= budget
    assert all(left + r.bytes + need > budget for r in chosen)  # each victim's memory was needed
    idleness = [r.idleness(NOW) for r in chosen]
    assert idleness == sorted(idleness, reverse=True)  # least valuable first
