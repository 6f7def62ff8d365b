"""The model lifecycle without processes: the real lifecycle over the real dispatcher, arena, rings,
region table, shadowing and model repository, with a fake supervisor and in-process fake workers
that become ready, fail, hang or die on command, and a fake clock (``helpers.fake_lifecycle``).
Each test runs in milliseconds; ``test_model_lifecycle.py`` runs the same steps with processes.

Use counting for residency (issue 24 item 2): a socket request and a lane call each count once as
their version's use, whatever order the workers, the dispatcher and the looks at the workers'
counters come in; and eviction follows exactly the documented order over any order of use.
Then each lifecycle step: swap, drain timeout, failed load, scale, SIGHUP apply, on-demand load
and eviction, canary start, promote, abort and rollback, control operations whose callers leave.
After every test the front-end is quiet (``make``): no slot, extent, request or timer held.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmserve.config import ServerConfig
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.dispatcher import Failure
from shmserve.frontend.lifecycle import Lifecycle
from shmserve.frontend.models import DRAINING, EVICTED, FAILED_LOAD, LOADING, SERVING, UNLOADED

from helpers.fake_frontend import LaneClient, build
from helpers.fake_frontend import make_fixture, no_children_left, no_processes  # noqa: F401 (fixtures)
from helpers.fake_lifecycle import World, add_version


def lifecycle_of(fe) -> Lifecycle:
    """The lifecycle over ``fe``'s parts, counting lane calls from the arena's worker table as the
    server does (``Frontend._finished_by``)."""
    life = Lifecycle(fe.models, None, fe.dispatcher, fe.regions, lambda: ServerConfig(models=()), clock=fe.clock,
                     startup_timeout=1.0, finished=lambda w: fe.arena.worker_counter(w.index, "requests"))
    fe.dispatcher.observe = life.observe
    return life


def test_a_request_the_worker_finished_before_the_dispatcher_saw_it_counts_once(make):
    """The worker has published and counted a socket request; the lifecycle looks at its counter
    before the dispatcher collects the answer: it is counted once (was: as a lane call there, and
    again by the dispatcher)."""
    fe = make()
    life = lifecycle_of(fe)
    version = fe.models.get("add").current
    door, w = fe.door(), fe.workers[0]
    req = door.infer("add", {"x": np.ones(4, np.float32)})
    [job] = w.claim()
    w.complete(job)
    life.note_lane_use()
    assert version.uses == 0  # in flight as far as the dispatcher knows: not a lane call
    assert fe.deliver()
    door.write(req)
    life.note_lane_use()
    assert version.uses == 1


OPS = st.lists(st.sampled_from(["socket", "run", "collect", "lane", "note"]), max_size=40)


@given(ops=OPS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_request_counts_once_whatever_the_order(instance_name, ops):  # a new name per example
    """Socket requests submitted, run by the worker, collected by the dispatcher, lane calls run,
    and looks at the counters, in any order: the uses counted never exceed the requests run, and
    once everything is collected and looked at, equal them."""
    fe = build(instance_name("lc"))
    lane = None
    try:
        life = lifecycle_of(fe)
        version = fe.models.get("add").current
        door, w = fe.door(write_now=True), fe.workers[0]
        lane = LaneClient(fe.regions, door, "add")
        w.read_commands()  # the lane attached
        ran = 0
        for op in ops:
            if op == "socket" and door.in_flight() < fe.arena.geometry.slot_count - 1:
                door.infer("add", {"x": np.ones(4, np.float32)})
            elif op == "run":
                ran += len(w.step())
            elif op == "collect":
                fe.deliver()
            elif op == "lane":
                index, generation = lane.submit(np.ones(4, np.float32))
                ran += len(w.step())
                lane.read(index, generation)
            elif op == "note":
                life.note_lane_use()
            assert version.uses <= ran, (op, version.uses, ran)
        ran += sum(len(w.step()) for _ in range(2))
        fe.settle()
        life.note_lane_use()
        assert version.uses == ran
        assert not fe.problems(), fe.problems()
    finally:
        if lane is not None:
            lane.close()
        fe.close()


# -- the lifecycle's steps ---------------------------------------------------------------------

ONES = np.ones(4, np.float32)


def served_by(door, req) -> int:
    """The version that answered ``req`` (its outputs are x + 1000 * version)."""
    y = door.result(req)["y"]
    return int(round(float(y[0] - 1.0) / 1000))


@pytest.fixture
def world(make, tmp_path):
    """A World over a fresh fake front-end and an empty repository (``world.repo``); models are
    added to the repository by the test, then ``world.lifecycle.start()``."""
    def new(**server) -> World:
        fe = make(models=(), max_workers=12, slot_count=8)
        server.setdefault("version_drain_timeout_s", 5.0)
        return World.make(fe, tmp_path / "repo", **server)
    (tmp_path / "repo").mkdir()
    return new


def test_a_swap_moves_the_default_in_one_step_and_drains_the_old_version(world):
    """load of version 2 beside 1: the default moves once 2 is ready; a request on 1 finishes
    there, new ones go to 2; 1 drains (its worker told to stop behind its queue) and is unloaded."""
    async def main():
        w = world()
        add_version(w.repo, "m", 1)
        await w.lifecycle.start()
        v1 = w.version("m", 1)
        assert v1.phase == SERVING and w.fe.models.get("m").default == 1
        door = w.fe.door()
        old = door.infer("m", {"x": ONES})
        [job] = w.supervisor.fake(v1.workers[0]).claim()
        add_version(w.repo, "m", 2)
        load = asyncio.ensure_future(w.lifecycle.load("m", 2, by="test"))
        await w.until(lambda: w.fe.models.get("m").default == 2, "version 2 the default")
        assert v1.phase == DRAINING and w.version("m", 2).phase == SERVING
        new = door.infer("m", {"x": ONES})
        await w.until(lambda: door.answer_of(new), "the new request answered")
        assert served_by(door, new) == 2 and not load.done()  # 1 still drains: its request runs
        w.supervisor.fake(v1.workers[0]).complete(job)
        assert (await w.done(load)).version == 2
        assert served_by(door, old) == 1 and v1.phase == UNLOADED and not v1.workers
        assert [e["event"] for e in w.lifecycle.events if e["version"] == 1][-2:] == ["drain", "unloaded"]
        await w.stop()

    asyncio.run(main())


def test_a_drain_that_times_out_fails_what_the_old_version_still_runs(world):
    """Version 1's worker is stuck with a socket request and a lane call: when
    version_drain_timeout_s passes after the swap it is terminated, and both fail
    MODEL_UNAVAILABLE naming the key (issue 24 item 4: the lane call got worker_crashed)."""
    async def main():
        w = world(version_drain_timeout_s=3.0)  # within the requests' 5 s (fake_frontend.DEFAULT_LIMITS)
        add_version(w.repo, "m", 1)
        await w.lifecycle.start()
        door = w.fe.door()
        lane = LaneClient(w.fe.regions, door, "m")
        try:
            v1 = w.version("m", 1)
            fake = w.supervisor.fake(v1.workers[0])
            await w.until(lambda: w.fe.regions.lanes_of(v1.workers[0]) == 1 and fake.lanes, "the lane attached")
            req = door.infer("m", {"x": ONES})
            call = lane.submit(ONES)
            assert len(fake.claim()) == 2
            w.supervisor.stuck.add(v1.workers[0])
            add_version(w.repo, "m", 2)
            load = asyncio.ensure_future(w.lifecycle.load("m", 2))
            await w.until(lambda: v1.phase == DRAINING, "version 1 draining")
            await w.advance(2.9)
            assert not load.done() and door.answer_of(req) is None
            await w.advance(0.2)
            assert (await w.done(load)).version == 2
            assert door.failure(req).code is ErrorCode.MODEL_UNAVAILABLE
            assert "did not finish within server.version_drain_timeout_s = 3 s" in door.failure(req).message
            with pytest.raises(ShmserveError) as err:
                lane.read(*call)
            assert err.value.code is ErrorCode.MODEL_UNAVAILABLE, err.value
            assert "version 1 of model 'm' was replaced by version 2" in err.value.message
            call = lane.submit(ONES)  # the lane goes on, on version 2
            await w.until(lambda: lane.lane.finished(*call), "a lane call on version 2")
            assert lane.read(*call)[0][0] == 2001
        finally:
            lane.close()
            w.fe.regions.close(door, lane.region.id)
        await w.stop()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["fail", "hang"])
def test_a_failed_load_leaves_the_serving_version_as_it_was(world, how):
    """Version 2's worker cannot load it (or never says it is ready: killed at the start-up
    timeout): load raises MODEL_UNAVAILABLE with why, version 2 is FAILED_LOAD with no worker left,
    version 1 stays the default and serves."""
    async def main():
        w = world()
        add_version(w.repo, "m", 1)
        await w.lifecycle.start()
        add_version(w.repo, "m", 2)
        w.supervisor.behaviour["m:2"] = how
        load = asyncio.ensure_future(w.lifecycle.load("m", 2))
        if how == "hang":
            await w.settle()
            await w.advance(30.0)
        with pytest.raises(ShmserveError) as err:
            await w.done(load)
        assert err.value.code is ErrorCode.MODEL_UNAVAILABLE
        why = "version 2 is broken" if how == "fail" else "not ready after 30 s"
        assert why in err.value.message and "version 1 still serves" in err.value.message
        v2 = w.version("m", 2)
        assert v2.phase == FAILED_LOAD and why in v2.reason and not v2.workers
        assert w.fe.models.get("m").default == 1 and len(w.supervisor.workers) == 1
        door = w.fe.door()
        req = door.infer("m", {"x": ONES})
        await w.until(lambda: door.answer_of(req))
        assert served_by(door, req) == 1
        await w.stop()

    asyncio.run(main())


def test_scale_up_warms_new_workers_first_and_scale_down_retires_the_least_busy(world):
    async def main():
        w = world()
        add_version(w.repo, "m", 1)
        await w.lifecycle.start()
        v1 = w.version("m", 1)
        assert (await w.done(asyncio.ensure_future(w.lifecycle.scale("m", 3)))).workers == v1.workers
        assert len(v1.workers) == 3 and all(x.state == "ready" for x in v1.workers)
        assert v1.memory["measured_bytes"] == 3 << 20  # measured again: three workers of 1 MiB
        busy = v1.workers[0]
        door = w.fe.door()
        req = door.infer("m", {"x": ONES})
        assert req.worker is busy  # the least loaded (all idle): the first
        w.supervisor.stuck.add(busy)
        await w.done(asyncio.ensure_future(w.lifecycle.scale("m", 1)))
        assert v1.workers == [busy] and v1.config.instances == 1
        w.supervisor.stuck.discard(busy)
        await w.until(lambda: door.answer_of(req))
        assert served_by(door, req) == 1
        with pytest.raises(ShmserveError) as err:
            await w.lifecycle.scale("m", 0)
        assert err.value.code is ErrorCode.BAD_ARGUMENT
        await w.stop()

    asyncio.run(main())


def test_sighup_apply_loads_added_versions_unloads_removed_ones_and_retries_a_fixed_one(world):
    """apply brings what is loaded to the repository: a new version selected (its policy: the
    newest) is loaded and made the default, the old one unloaded; a version whose workers all
    failed for good is tried again (issue 24 item 3: and says so); a removed model is unloaded."""
    import shutil

    async def main():
        w = world()
        add_version(w.repo, "m", 1)
        add_version(w.repo, "n", 1)
        w.supervisor.behaviour["n:1"] = "fail"
        await w.lifecycle.start()
        n1 = w.version("n", 1)
        assert n1.phase == SERVING and n1.state == "unavailable" and "version 1 is broken" in n1.reason
        add_version(w.repo, "m", 2)
        del w.supervisor.behaviour["n:1"]  # "fixed"
        done = await w.done(asyncio.ensure_future(w.lifecycle.apply()))
        assert set(done) == {"loaded m:2", "unloaded m:1", "replaced the workers of n:1 (new settings)"}, done
        assert w.fe.models.get("m").default == 2 and w.version("m", 1).phase == UNLOADED
        assert n1.state == "ready" and n1.reason.startswith("loaded in ") and n1.memory["measured_bytes"] == 1 << 20
        shutil.rmtree(w.repo / "n")
        assert await w.done(asyncio.ensure_future(w.lifecycle.apply())) == ["unloaded n:1"]
        assert n1.phase == UNLOADED
        await w.stop()

    asyncio.run(main())


def test_on_demand_versions_load_on_their_first_request_and_the_least_recently_used_is_evicted(world):
    async def main():
        w = world(memory_budget={"cpu": 25 << 20})
        for name in "abc":
            add_version(w.repo, name, 1, 'load = "on_demand"\n')
            w.supervisor.memory[name] = 10 << 20  # two fit the budget, three do not
        await w.lifecycle.start()
        assert {w.version(n, 1).phase for n in "abc"} == {UNLOADED} and not w.supervisor.workers
        door = w.fe.door()
        for name in "abca":
            w.fe.clock.advance(10.0)
            req = door.infer(name, {"x": ONES})
            await w.until(lambda: door.answer_of(req), f"{name} answered")
            assert served_by(door, req) == 1
            await w.until(lambda: not w.lifecycle.tasks, "its load (and the evictions after it) done")
        assert [w.version(n, 1).phase for n in "abc"] == [SERVING, EVICTED, SERVING]
        events = [(e["model"], e["event"]) for e in w.lifecycle.events if e["event"] == "evict"]
        assert events == [("a", "evict"), ("b", "evict")]  # a for c, then b (least recently used) for a
        await w.stop()

    asyncio.run(main())


def test_an_on_demand_model_unloaded_by_a_call_is_registered_again_by_a_reload(world):
    """``unload`` of an on-demand model clears its default: a request naming no version is refused
    (docs/models.md).  A reload brings it back to what its configuration says, as at start-up:
    registered, loaded by its next request.  (It stayed refused until a ``load`` call, while a
    model loaded at start-up was loaded again by the same reload.)"""
    async def main():
        w = world()
        add_version(w.repo, "a", 1, 'load = "on_demand"\n')
        await w.lifecycle.start()
        door = w.fe.door()
        req = door.infer("a", {"x": ONES})
        await w.until(lambda: door.answer_of(req), "a answered")
        assert served_by(door, req) == 1
        await w.until(lambda: not w.lifecycle.tasks, "its load done")
        assert await w.done(asyncio.ensure_future(w.lifecycle.unload("a"))) == [1]
        with pytest.raises(ShmserveError) as refused:
            door.infer("a", {"x": ONES})
        assert refused.value.code is ErrorCode.MODEL_UNAVAILABLE and "unloaded" in refused.value.message
        await w.done(asyncio.ensure_future(w.lifecycle.apply()))
        assert w.fe.models.get("a").default == 1 and w.version("a", 1).phase == UNLOADED
        req = door.infer("a", {"x": ONES})
        await w.until(lambda: door.answer_of(req), "a answered after the reload")
        assert served_by(door, req) == 1
        await w.until(lambda: not w.lifecycle.tasks, "its load done")
        await w.stop()

    asyncio.run(main())


def test_a_load_on_demand_without_room_waits_for_it_and_loads_when_it_appears(world):
    """Issue 23 item 6, in process: b needs a's memory while a runs a request (busy): b's request
    waits (its load is tried again every ROOM_RETRY_S), and b loads as soon as a is idle; a request
    that times out meanwhile says it waited for room, and with none waiting b goes back to
    UNLOADED (the next request tries again) instead of being unavailable for good."""
    from shmserve.frontend.lifecycle import ROOM_RETRY_S

    async def main():
        w = world(memory_budget={"cpu": 15 << 20})
        for name in "ab":
            add_version(w.repo, name, 1, 'load = "on_demand"\n')
            w.supervisor.memory[name] = 10 << 20
        await w.lifecycle.start()
        door = w.fe.door()
        for name in "ba":  # b measured, then evicted for a
            req = door.infer(name, {"x": ONES})
            await w.until(lambda: door.answer_of(req) and not w.lifecycle.tasks, f"{name} loaded and answered")
        b, a = w.version("b", 1), w.version("a", 1)
        assert b.phase == EVICTED and a.phase == SERVING
        busy = door.infer("a", {"x": ONES})
        w.supervisor.stuck.add(a.workers[0])
        await w.settle()
        lost = door.infer("b", {"x": ONES}, timeout_s=2.0)
        await w.settle()
        assert b.phase == LOADING and b.reason.startswith("waiting for room") and "a:1" in b.reason
        await w.advance(2.0)
        failure = door.failure(lost)
        assert failure.code is ErrorCode.TIMEOUT and "waiting for room" in failure.message
        await w.advance(ROOM_RETRY_S)
        assert b.phase == UNLOADED and "no room to load it on demand" in b.reason  # nobody waits now
        req = door.infer("b", {"x": ONES}, timeout_s=30.0)
        await w.advance(ROOM_RETRY_S)
        assert b.phase == LOADING and door.answer_of(req) is None
        w.supervisor.stuck.discard(a.workers[0])
        await w.until(lambda: door.answer_of(busy), "a's request answered")
        await w.advance(ROOM_RETRY_S)
        await w.until(lambda: door.answer_of(req), "b's request answered")
        assert served_by(door, req) == 1 and a.phase == EVICTED and b.phase == SERVING
        await w.stop()

    asyncio.run(main())


def test_a_request_for_a_version_being_evicted_waits_and_loads_it_again(world):
    """Found by the lifecycle soak: a request for an on-demand version that comes while the version
    drains for an eviction waits for the drain to end and loads it again (it was refused
    ``model_unavailable ... is draining``).  a's worker is stuck, so its drain lasts
    version_drain_timeout_s."""
    async def main():
        w = world(memory_budget={"cpu": 15 << 20}, version_drain_timeout_s=2.0)
        for name in "ab":
            add_version(w.repo, name, 1, 'load = "on_demand"\n')
            w.supervisor.memory[name] = 10 << 20  # one fits, two do not
        await w.lifecycle.start()
        door = w.fe.door()
        first = door.infer("a", {"x": ONES})
        await w.until(lambda: door.answer_of(first) and not w.lifecycle.tasks, "a loaded and answered")
        a = w.version("a", 1)
        w.supervisor.stuck.add(a.workers[0])
        for_b = door.infer("b", {"x": ONES}, timeout_s=120.0)
        await w.until(lambda: a.phase == DRAINING, "a evicted for b")
        during = door.infer("a", {"x": ONES}, timeout_s=120.0)
        await w.settle()
        assert door.answer_of(during) is None and a.phase == DRAINING
        await w.advance(w.config.version_drain_timeout_s)
        await w.until(lambda: door.answer_of(during) and door.answer_of(for_b), "both answered")
        assert served_by(door, during) == 1 and served_by(door, for_b) == 1
        await w.until(lambda: not w.lifecycle.tasks, "the loads (and the evictions after them) done")
        assert [(e["model"], e["event"]) for e in w.lifecycle.events if e["event"] in ("evicted", "load")][:3] == \
            [("a", "load"), ("b", "load"), ("a", "evicted")], w.lifecycle.events
        await w.stop()

    asyncio.run(main())


SPLIT = {"steps": [50, 100], "hold_s": 1.0, "window_s": 60.0, "min_samples": 10, "max_p99_ratio": None}


async def traffic(w: World, door, n: int) -> list[int]:
    """``n`` requests naming no version, one after the other; the version that answered each."""
    served = []
    for _ in range(n):
        req = door.infer("m", {"x": ONES})
        await w.until(lambda: door.answer_of(req), "an answer")
        answer = door.answer_of(req)
        served.append(0 if isinstance(answer, Failure) else served_by(door, req))
    return served


async def canary_world(world, *versions: int) -> World:
    w = world()
    add_version(w.repo, "m", 1)
    await w.lifecycle.start()
    for v in versions:
        add_version(w.repo, "m", v)
    return w


def test_a_canary_that_fails_is_rolled_back_on_its_own(world):
    """A split canary whose candidate fails every request: its traffic share gets errors, the
    next analysis (every CANARY_TICK_S) rolls it back, the candidate drains and is unloaded, and
    every request goes to the stable version again."""
    from shmserve.frontend.lifecycle import CANARY_TICK_S

    async def main():
        w = await canary_world(world, 2)
        w.supervisor.failing.add("m:2")
        start = asyncio.ensure_future(w.lifecycle.canary("m", "start", 2, SPLIT))
        assert (await w.done(start))["state"] == "ramping"
        door = w.fe.door()
        served = await traffic(w, door, 60)
        assert served.count(0) > 10 and served.count(1) > 10  # 50 %: the candidate's are errors
        await w.advance(CANARY_TICK_S)
        await w.until(lambda: w.version("m", 2).phase == UNLOADED, "the candidate unloaded")
        status = w.lifecycle.canary_status("m")
        assert status["state"] == "rolled_back" and "max_error_rate_increase" in status["decisions"][-1]["reason"]
        assert set(await traffic(w, door, 20)) == {1} and w.fe.models.get("m").default == 1
        await w.stop()

    asyncio.run(main())


def test_a_canary_promoted_or_completed_becomes_the_default_and_an_aborted_one_goes(world):
    """abort: the candidate drains and is unloaded, the stable version keeps serving; a good
    candidate ramps 50 % -> 100 % on its own (hold_s, min_samples) and completes: it is the
    default, the stable version drains; promote completes one at once."""
    from shmserve.frontend.lifecycle import CANARY_TICK_S

    async def main():
        w = await canary_world(world, 2, 3, 4)
        life, door = w.lifecycle, w.fe.door()
        await w.done(asyncio.ensure_future(life.canary("m", "start", 2, SPLIT)))
        aborted = await w.done(asyncio.ensure_future(life.canary("m", "abort", by="uid 7")))
        assert aborted["state"] == "aborted" and aborted["decisions"][-1]["reason"] == "aborted by uid 7"
        await w.until(lambda: w.version("m", 2).phase == UNLOADED, "the aborted candidate unloaded")
        await w.done(asyncio.ensure_future(life.canary("m", "start", 3, SPLIT)))
        for _ in range(3):  # 50 % held a second with 10 outcomes each, then 100 %, then complete
            await traffic(w, door, 40)
            await w.advance(1.0 + CANARY_TICK_S)
        await w.until(lambda: w.version("m", 1).phase == UNLOADED, "the stable version unloaded")
        assert life.canary_status("m")["state"] == "complete" and w.fe.models.get("m").default == 3
        assert set(await traffic(w, door, 10)) == {3}
        await w.done(asyncio.ensure_future(life.canary("m", "start", 4, SPLIT)))
        promoted = await w.done(asyncio.ensure_future(life.canary("m", "promote", by="uid 7")))
        assert promoted["state"] == "complete"
        await w.until(lambda: w.version("m", 3).phase == UNLOADED, "the old default unloaded")
        assert set(await traffic(w, door, 10)) == {4}
        with pytest.raises(ShmserveError) as err:
            await life.canary("m", "abort")
        assert err.value.code is ErrorCode.BAD_ARGUMENT and "no canary running" in err.value.message
        await w.stop()

    asyncio.run(main())


def test_a_shadow_canary_answers_from_stable_and_rolls_back_on_mismatches(world):
    """Shadow mode (``shmserve.frontend.shadow``): every client gets the stable version's answer;
    copies go to the candidate, whose different outputs are mismatches, and it rolls back."""
    from shmserve.frontend.lifecycle import CANARY_TICK_S

    async def main():
        w = await canary_world(world, 2)  # version 2 answers x + 2000: never what version 1 does
        plan = {"mode": "shadow", "hold_s": 1.0, "min_samples": 10, "max_p99_ratio": None}
        await w.done(asyncio.ensure_future(w.lifecycle.canary("m", "start", 2, plan)))
        assert set(await traffic(w, w.fe.door(), 30)) == {1}
        await w.advance(CANARY_TICK_S)
        status = w.lifecycle.canary_status("m")
        assert status["state"] == "rolled_back" and status["shadow"]["mismatches"] >= 10, status
        await w.until(lambda: w.version("m", 2).phase == UNLOADED, "the candidate unloaded")
        await w.stop()

    asyncio.run(main())


def test_a_control_operation_runs_to_its_end_when_its_caller_leaves_and_joins_its_twin(world):
    """Issue 23 item 5, in process: the caller of an unload is cancelled while the version drains
    (its worker still runs a request): the unload goes on, the version is unloaded once the request
    is done, and a load then works.  The same call while one runs joins it."""
    async def main():
        w = world()
        add_version(w.repo, "m", 1)
        await w.lifecycle.start()
        v1 = w.version("m", 1)
        door = w.fe.door()
        req = door.infer("m", {"x": ONES})
        [job] = w.supervisor.fake(v1.workers[0]).claim()
        caller = asyncio.ensure_future(w.lifecycle.unload("m"))
        twin = asyncio.ensure_future(w.lifecycle.unload("m"))
        await w.until(lambda: v1.phase == DRAINING, "version 1 draining")
        assert len(w.lifecycle.operations) == 1
        caller.cancel()
        await w.settle()
        assert caller.cancelled() and v1.phase == DRAINING
        w.supervisor.fake(v1.workers[0]).complete(job)
        assert await w.done(twin) == [1]  # the twin got the operation's answer
        assert v1.phase == UNLOADED and served_by(door, req) == 1
        assert await w.done(asyncio.ensure_future(w.lifecycle.unload("m"))) == []  # nothing more to do
        loaded = await w.done(asyncio.ensure_future(w.lifecycle.load("m")))
        assert loaded is v1 and v1.phase == SERVING
        await w.stop()

    asyncio.run(main())


SIZES_MIB = {"a": 10, "b": 10, "c": 12, "d": 6}  # two or three fit the budget, never all four
BUDGET = 28 << 20


@given(touches=st.lists(st.tuples(st.sampled_from(sorted(SIZES_MIB)), st.floats(0.0, 300.0)), min_size=1,
                        max_size=20))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_eviction_follows_the_documented_order_over_any_order_of_use(instance_name, tmp_path_factory, touches):
    """Issue 24 item 2: four on-demand models under a budget, touched in any order at any times.
    Each load evicts exactly what ``residency.victims`` picks from an independent account of every
    version's last use and rate (each request counted once, at its time), and nothing else."""
    from shmserve.frontend import residency

    async def main():
        fe = build(instance_name("lru"), models=(), max_workers=len(touches) + 1, slot_count=8)
        try:
            repo = tmp_path_factory.mktemp("repo")
            w = World.make(fe, repo, memory_budget={"cpu": BUDGET})
            for name, mib in SIZES_MIB.items():
                add_version(repo, name, 1, 'load = "on_demand"\n')
                w.supervisor.memory[name] = mib << 20
            await w.lifecycle.start()
            door = fe.door()
            last, meters = {}, {name: residency.RateMeter() for name in SIZES_MIB}
            for name, gap in touches:
                fe.clock.advance(gap)
                now = fe.clock.monotonic()
                loaded = {n for n in SIZES_MIB if w.version(n, 1).phase == SERVING}
                expected = ()
                if name not in loaded:
                    resident = [residency.Resident(f"{n}:1", "cpu", SIZES_MIB[n] << 20, last[n], meters[n].rate(now),
                                                   False, False, True) for n in sorted(loaded)]
                    expected = residency.victims("cpu", BUDGET, resident, SIZES_MIB[name] << 20, now).keys
                req = door.infer(name, {"x": ONES})
                await w.until(lambda: door.answer_of(req) and not w.lifecycle.tasks, f"{name} answered")
                assert served_by(door, req) == 1
                evicted = {f"{n}:1" for n in loaded if w.version(n, 1).phase == EVICTED}
                assert evicted == set(expected), (name, now, evicted, expected)
                last[name] = now
                meters[name].hit(now)
            await w.stop()
            assert not fe.problems(), fe.problems()
        finally:
            fe.close()

    asyncio.run(main())


def test_lane_calls_counted_by_the_workers_feed_the_canary_and_each_change_is_a_new_routing_epoch(world):
    """Issue 24: lane calls never pass the dispatcher; the workers count their outcomes in the arena
    (``layout.record_lane_outcome``, as ``hotpath.publish`` does) and the lifecycle feeds those counted
    after the canary started into its windows at each analysis.  A candidate whose lane calls fail is
    rolled back on them alone; every change of the routing (start, rollback) writes a new epoch into
    the model's lanes, and the candidate's lane moves to the stable version, its header saying so."""
    from shmserve import layout
    from shmserve.frontend.lifecycle import CANARY_TICK_S

    async def main():
        w = await canary_world(world, 2)
        arena, door = w.fe.arena, w.fe.door()
        stable_lane = LaneClient(w.fe.regions, door, "m")
        header = stable_lane.header()
        assert (header.serves, header.route_epoch) == (1, 0)
        stable_worker = w.version("m", 1).workers[0]
        layout.record_lane_outcome(arena.buf, arena.geometry.hist_off(stable_worker.index, "queue"), 10_000, True)
        w.lifecycle.note_lane_outcomes()  # (before the canary: none of its outcomes)
        assert (await w.done(asyncio.ensure_future(w.lifecycle.canary("m", "start", 2, SPLIT))))["state"] == "ramping"
        assert stable_lane.header().route_epoch == 1
        w.fe.regions.open(door, 8192, "m", version=2)
        candidate_lane = next(r for r in w.fe.regions.regions.values() if r.lane_model is w.version("m", 2))
        candidate_worker = w.version("m", 2).workers[0]
        for _ in range(30):
            layout.record_lane_outcome(arena.buf, arena.geometry.hist_off(stable_worker.index, "queue"), 20_000, False)
            layout.record_lane_outcome(arena.buf, arena.geometry.hist_off(candidate_worker.index, "queue"), 40_000,
                                       True)
        await w.advance(CANARY_TICK_S)
        await w.until(lambda: w.version("m", 2).phase == UNLOADED, "the candidate unloaded")
        status = w.lifecycle.canary_status("m")
        assert status["state"] == "rolled_back" and "max_error_rate_increase" in status["decisions"][-1]["reason"]
        assert (status["stable"]["requests"], status["stable"]["errors"]) == (30, 0)  # (the one before: not counted)
        assert (status["candidate"]["requests"], status["candidate"]["errors"]) == (30, 30)
        assert 0.035 <= status["stable"]["p50_ms"] * 2 <= 0.045  # 20 us, within its bucket (1/16)
        assert stable_lane.header().route_epoch == 2
        assert layout.LANE_HEADER.read(candidate_lane.lane_buf, 0).serves == 1  # moved to the stable version
        await w.stop()

    asyncio.run(main())
