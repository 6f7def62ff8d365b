"""The model lifecycle without processes: the real lifecycle over the real dispatcher, arena, rings
and region table, with in-process fake workers (``helpers.fake_frontend``).

Use counting for residency (issue 24 item 2): a socket request and a lane call each count once as
their version's use, whatever order the workers, the dispatcher and the looks at the workers'
counters come in.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmserve.config import ServerConfig
from shmserve.frontend.lifecycle import Lifecycle

from helpers.fake_frontend import LaneClient, build
from helpers.fake_frontend import make_fixture, no_children_left, no_processes  # noqa: F401 (fixtures)


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
