"""Priorities and queue policies (issue 29 parts 1 and 4) through a real server, on lanes.

One server; each model is ``serving_models.gated`` with one worker and its own record file and
gates: every run appends its tag to the record (the order the worker ran them), and a run with
``hold`` waits until the test opens its gate.  Each test holds the worker with one call, queues
lane calls behind it (their clients' lanes, their slots READY), opens the gate, and reads the
order the worker ran the rest in: completion order, never durations.  Priorities order the calls
(level 1 first), the starvation bound lets a low call through after ``priority_starvation_limit``
higher ones, a lane call whose deadline passes while queued is answered TIMEOUT unrun, a queue
timeout rejects (``reject``) or demotes (``delay``), ``max_queue_size`` refuses the newest
lowest calls OVERLOADED, and a caller with one call gets its turn beside one with many.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time

import numpy as np
import pytest

from shmserve import AsyncClient, layout
from shmserve.arena import Arena
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.layout import LANE_SLOTS
from shmserve.lanes import DATA_FLOOR
from shmserve.scheduling import DEADLINE_PASSED

from helpers.server import held_call, serving, wait_for
from helpers.v2_server import python_model

GATED = "serving_models:gated"
MODELS = {
    "prio": {"priority_levels": 3, "priority_starvation_limit": 1000},
    "starve": {"priority_levels": 2, "priority_starvation_limit": 2},
    "reject": {"default_queue_policy": {"default_timeout_microseconds": 300_000, "timeout_action": "reject"}},
    # (the fresh call of the delay test must not time out between its submission and the gate opening)
    "delay": {"default_queue_policy": {"default_timeout_microseconds": 1_500_000, "timeout_action": "delay"}},
    "limit": {"default_queue_policy": {"max_queue_size": 2}},
    "fair": {},
    "batched": {"priority_levels": 2, "max_batch_size": 2, "max_queue_delay_us": 0},
}
ROWS = {"batched"}  # models of serving_models.gated_rows: x is [[tag, hold]], a run's tags one line
tags = itertools.count(1)  # every call of this module its own tag
WARM = 100_000  # warm-up calls' tags are above this


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    work = tmp_path_factory.mktemp("sched")
    text = ""
    for name, keys in MODELS.items():
        (work / f"gates-{name}").mkdir()
        (work / f"record-{name}").touch()
        text += python_model(name, "serving_models:gated_rows" if name in ROWS else GATED, options={"factory": True, "record": str(work / f"record-{name}"),
                                                   "gates": str(work / f"gates-{name}")}, **keys)
    with serving(work, text) as s:
        s.work = work
        yield s


def x(tag: int, hold: bool = False, model: str = "") -> np.ndarray:
    """The input of a call of ``tag`` (``hold``: wait for its gate) to ``model``."""
    row = np.array([tag, 1.0 if hold else 0.0], np.float32)
    return row[None] if model in ROWS else row


def tag_of(y: np.ndarray) -> int:
    return int(y.reshape(-1)[0]) // 2


def runs(srv, model: str) -> list[list[int]]:
    """The tags of each run of ``model``'s worker, in order (warm-ups left out)."""
    lines = (srv.work / f"record-{model}").read_text().splitlines()
    return [[int(t) for t in line.split()] for line in lines if line and int(line.split()[0]) < WARM]


def ran(srv, model: str) -> list[int]:
    """The tags ``model``'s worker ran, in order (warm-ups left out)."""
    return [int(line) for line in (srv.work / f"record-{model}").read_text().split() if int(line) < WARM]


def counters(srv, model: str) -> layout.SchedCounters:
    """The scheduling counters of ``model``'s worker, read from the arena."""
    [index] = [w["index"] for w in srv.info()["workers"] if w["model"] == model]
    with Arena.attach(srv.instance, read_only=True, prefault=False) as arena:
        return layout.read_sched_counters(arena.buf, arena.geometry, index)


def in_flight(client, model: str) -> int:
    """Calls of ``client`` (Client or AsyncClient) submitted in its infer lane of ``model`` and not read."""
    return LANE_SLOTS - client._core.infer_lanes[model].lane.free_slots()


@contextlib.contextmanager
def held(srv, model: str):
    """``model``'s one worker busy with a held call (over the socket) until the block ends."""
    tag = next(tags)
    with held_call(srv, model, x(tag, True, model), lambda: tag in ran(srv, model),
                   srv.work / f"gates-{model}" / str(tag)):
        yield tag


class Caller(threading.Thread):
    """One AsyncClient (one lane: one caller) that warms its lane up, then, on ``go``, puts
    ``calls`` (tags) in flight at once with ``priority`` and gathers their answers (outputs or
    exceptions) in ``results``."""

    def __init__(self, srv, model: str, calls: list[int], priority: int = 0, **infer):
        super().__init__()
        self.srv, self.model, self.calls, self.priority, self.infer = srv, model, calls, priority, infer
        self.ready, self.go = threading.Event(), threading.Event()
        self.client = None
        self.results: list = []

    def run(self):
        asyncio.run(self.main())

    async def main(self):
        async with AsyncClient(self.srv.socket, timeout=60) as c:
            await c.infer(self.model, {"x": x(WARM + next(tags), model=self.model)})  # its lane open
            self.client = c
            self.ready.set()
            await asyncio.to_thread(self.go.wait, 60)
            self.results = await asyncio.gather(
                *(c.infer(self.model, {"x": x(tag, model=self.model)}, priority=self.priority, **self.infer)
                  for tag in self.calls),
                return_exceptions=True)

    def start_queued(self):
        """Put its calls in flight and wait until every one is READY in its lane."""
        self.go.set()
        wait_for(lambda: in_flight(self.client, self.model) == len(self.calls), "the calls in the lane")

    def answers(self) -> list:
        self.join(60)
        return [r if isinstance(r, BaseException) else tag_of(r["y"]) for r in self.results]


def queued_behind_a_held_call(srv, model: str, *made: Caller, pause: float = 0.0) -> list[int]:
    """Start the callers (their lanes open), hold ``model``'s worker, queue each one's calls in
    turn (``pause`` seconds after the first's), let the held call go: the tags the worker ran
    after it, in order, once all answered."""
    for c in made:
        c.start()
    for c in made:
        assert c.ready.wait(60), "a caller's lane did not open"
    with held(srv, model) as hold:
        for i, c in enumerate(made):
            c.start_queued()
            if i == 0 and pause:
                until = time.monotonic() + pause
                wait_for(lambda: time.monotonic() > until, "the first caller's calls to wait")
    for c in made:
        c.join(60)
    after = ran(srv, model)
    return after[after.index(hold) + 1:]


def test_a_high_priority_lane_call_runs_before_the_low_ones_queued_before_it(srv):
    lows, high = [next(tags) for _ in range(6)], next(tags)
    low_caller, high_caller = Caller(srv, "prio", lows, priority=3), Caller(srv, "prio", [high], priority=1)
    assert queued_behind_a_held_call(srv, "prio", low_caller, high_caller) == [high, *lows]
    assert low_caller.answers() == lows and high_caller.answers() == [high]
    levels = counters(srv, "prio").levels
    assert levels[0].claimed >= 1 and levels[2].claimed >= len(lows)  # (warm-ups too: level 3)
    assert [level.queued for level in levels] == [0] * layout.SCHED_LEVELS  # none held now


def test_unnamed_priority_is_the_lowest_level_and_level_two_goes_between(srv):
    low, mid, top = next(tags), next(tags), next(tags)
    made = [Caller(srv, "prio", [low]), Caller(srv, "prio", [mid], priority=2), Caller(srv, "prio", [top], priority=1)]
    assert queued_behind_a_held_call(srv, "prio", *made) == [top, mid, low]
    assert [c.answers() for c in made] == [[low], [mid], [top]]


def test_the_starvation_bound_lets_a_low_call_through_after_the_limit(srv):
    """priority_starvation_limit = 2: the low call queued with five high ones runs third."""
    low, highs = next(tags), [next(tags) for _ in range(5)]
    low_caller, high_caller = Caller(srv, "starve", [low], priority=2), Caller(srv, "starve", highs, priority=1)
    after = queued_behind_a_held_call(srv, "starve", low_caller, high_caller)
    assert low_caller.answers() == [low] and high_caller.answers() == highs
    assert after[2] == low and sorted(after[:2] + after[3:]) == sorted(highs)


def test_a_batch_is_filled_highest_level_first(srv):
    """max_batch_size 2: of three low calls and two high ones queued, the first batch is the two
    high ones, then the lows in turn."""
    lows, highs = [next(tags) for _ in range(3)], [next(tags) for _ in range(2)]
    low_caller, high_caller = Caller(srv, "batched", lows, priority=2), Caller(srv, "batched", highs, priority=1)
    queued_behind_a_held_call(srv, "batched", low_caller, high_caller)
    assert low_caller.answers() == lows and high_caller.answers() == highs
    batches = runs(srv, "batched")
    assert batches[-3:] == [highs, lows[:2], lows[2:]]


def test_a_lane_call_whose_deadline_passes_while_queued_is_answered_timeout_unrun(srv):
    """Its slot's deadline_ns passes behind the held call: the worker answers TIMEOUT and never
    runs it (a call submitted straight into a lane, its client waiting well past the deadline)."""
    tag, later = next(tags), next(tags)
    expired = counters(srv, "fair").expired
    with srv.client(timeout=60) as c:
        region = c.open_region(DATA_FLOOR + 65536, lane="fair")
        lane = region.lane
        view = np.ndarray((2,), np.float32, buffer=region.buf, offset=DATA_FLOOR)
        view[...] = x(tag)
        out = DATA_FLOOR + 4096
        with held(srv, "fair"):
            deadline = time.monotonic_ns() + 50_000_000
            index, generation = lane.submit(1, 0, [(0, DATA_FLOOR, view)], out, 4096, 0, deadline)
            wait_for(lambda: time.monotonic_ns() > deadline, "the deadline to pass")
        lane.wait(index, generation, time.monotonic() + 60, 0.0, lambda: None)
        with pytest.raises(ShmserveError) as caught:
            lane.read(index, generation, out, 4096)
        assert caught.value.code is ErrorCode.TIMEOUT and DEADLINE_PASSED in str(caught.value)
        del view
        assert c.infer("fair", {"x": x(later)})["y"].tolist() == [2 * later, 0]
    assert tag not in ran(srv, "fair") and later in ran(srv, "fair")
    assert counters(srv, "fair").expired == expired + 1


def test_queue_timeout_reject_answers_timeout_unrun(srv):
    tag = next(tags)
    caller = Caller(srv, "reject", [tag])
    assert queued_behind_a_held_call(srv, "reject", caller, pause=0.5) == []
    (answer,) = caller.answers()
    assert isinstance(answer, ShmserveError) and answer.code is ErrorCode.TIMEOUT
    assert "'reject'" in str(answer) and "default_timeout_microseconds = 300000" in str(answer)
    assert tag not in ran(srv, "reject")


def test_queue_timeout_delay_serves_the_late_call_after_a_fresh_one(srv):
    late, fresh = next(tags), next(tags)
    late_caller, fresh_caller = Caller(srv, "delay", [late]), Caller(srv, "delay", [fresh])
    assert queued_behind_a_held_call(srv, "delay", late_caller, fresh_caller, pause=1.7) == [fresh, late]
    assert late_caller.answers() == [late] and fresh_caller.answers() == [fresh]
    assert counters(srv, "delay").demoted >= 1


def test_max_queue_size_refuses_the_newest_lane_calls_overloaded(srv):
    calls = [next(tags) for _ in range(4)]
    caller = Caller(srv, "limit", calls)
    assert queued_behind_a_held_call(srv, "limit", caller) == calls[:2]
    answers = caller.answers()
    assert answers[:2] == calls[:2]
    for refused in answers[2:]:
        assert isinstance(refused, ShmserveError) and refused.code is ErrorCode.OVERLOADED
        assert "'limit'" in str(refused) and "max_queue_size (2)" in str(refused)


def test_a_caller_with_one_call_gets_its_turn_beside_a_flood(srv):
    """Two lane clients at one level: one with twelve calls in flight, one with one; the one
    call runs second, not thirteenth (round-robin across callers)."""
    flood, single = [next(tags) for _ in range(12)], next(tags)
    flooder, loner = Caller(srv, "fair", flood), Caller(srv, "fair", [single])
    after = queued_behind_a_held_call(srv, "fair", flooder, loner)
    assert flooder.answers() == flood and loner.answers() == [single]
    assert after.index(single) <= 1 and [t for t in after if t != single] == flood


def test_a_negative_or_non_int_priority_is_refused_in_the_client(srv):
    with srv.client() as c:
        for bad in (-1, 1.5, "1", True, 2**32):
            with pytest.raises(ValueError):
                c.infer("fair", {"x": x(next(tags))}, priority=bad)
        with pytest.raises(ValueError):
            c.zero_copy("fair", {"x": ((2,), np.float32)}, priority=-1)
