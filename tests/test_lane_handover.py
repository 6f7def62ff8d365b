"""Lanes handed from worker to worker, in-process (issue 23, item 9): the real region table, lanes
and rings, with fake workers (``helpers.fake_frontend``) that die at every point of a call.

* A storm, seeded: lane clients (one call in flight, like ``infer``, or many, like an asyncio
  client; heeding the header's worker, or not, like zero-copy calls) interleaved at random with
  workers taking entries off the rings, claiming, finishing (with or without pushing the
  completion), dying at any of those points, and restarting.  Every call must end: its result,
  or WORKER_CRASHED if a dead worker had claimed it; none is claimed twice.
* The lanes' watchdog (``RegionTable.watch_lanes``): a lane left without a worker when none could
  take it is attached once one can; a call left READY with no ring entry pointing at it is served
  once its worker is told to look at the lane's queue again.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import numpy as np
import pytest

from shmserve import _atomics as atomics
from shmserve import lanes, layout
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.regions import LANE_NUDGE_S
from shmserve.slotstate import SlotState

from helpers.fake_frontend import LaneClient, frontend_factory, no_children_left, no_processes  # noqa: F401
from test_dispatcher import ADD, ADD2, floats


@pytest.fixture
def make(instance_name, request):
    yield from frontend_factory(instance_name, request)


def submit(lane: LaneClient, x: np.ndarray, place: int) -> tuple[int, int]:
    """A call whose input and output lie at their own ``place`` in the lane (several may be queued)."""
    offset = lanes.DATA_FLOOR + place * 128
    lane.buf[offset:offset + x.nbytes] = x.tobytes()
    view = np.ndarray(x.shape, x.dtype, buffer=lane.buf, offset=offset)
    try:
        return lane.lane.submit(1, 0, [(0, offset, view)], offset + 64, 64)
    finally:
        del view


def read(lane: LaneClient, index: int, generation: int, place: int) -> np.ndarray:
    offset = lanes.DATA_FLOOR + place * 128
    placed = lane.lane.read(index, generation, offset + 64, 64)
    dtype, shape, at = placed[0]
    return np.frombuffer(lane.buf, dtype, int(np.prod(shape)), at).copy()


def state_of(lane: LaneClient, index: int) -> tuple[int, SlotState]:
    generation, state = layout.unpack_status(atomics.load64(lane.buf, layout.LANE.slot_off(index)))
    return generation, SlotState(state)


@pytest.mark.parametrize("seed", range(int(os.environ.get("SHMSERVE_STORM_SEEDS", 60))))
def test_every_lane_call_ends_through_a_storm_of_worker_deaths(make, seed):
    rng = random.Random(seed)
    fe = make(models=(dataclasses.replace(ADD, instances=rng.choice((1, 2, 3))),), slot_count=8)
    clients = [LaneClient(fe.regions, f"c{i}", "add", size=16384) for i in range(rng.choice((1, 3, 6)))]
    zero_copy = {i: rng.random() < 0.5 for i in range(len(clients))}  # ignores the header's worker
    depth = rng.choice((1, 1, 3, 8))  # calls a client keeps in flight (infer: one; an asyncio client: many)
    outstanding: dict[int, list] = {i: [] for i in range(len(clients))}
    held: dict[int, list] = {w.index: [] for w in fe.workers}  # claimed, not finished
    claimed: dict[tuple, int] = {}  # (client, slot, generation) -> claims (never twice)
    submitted = finished = crashed = 0
    try:
        for step in range(600):
            op = rng.random()
            live = [w for w in fe.workers if not w.dead]
            if op < 0.3:
                i = rng.randrange(len(clients))
                lane = clients[i]
                routable = zero_copy[i] or lane.lane.routable()
                places = set(range(8)) - {call[3] for call in outstanding[i]}
                if len(outstanding[i]) < depth and routable and lane.lane.has_free_slot():
                    place = min(places)
                    outstanding[i].append(submit(lane, floats(4, start=step), place) + (step, place))
                    submitted += 1
            elif op < 0.5 and live:
                w = rng.choice(live)
                w.read_commands()  # entries off the rings, unclaimed
            elif op < 0.65 and live:
                w = rng.choice(live)
                for job in w.claim():
                    owner = next(i for i, c in enumerate(clients) if c.region.id == job.lane)
                    key = (owner, job.index, job.generation)
                    claimed[key] = claimed.get(key, 0) + 1
                    held[w.index].append(job)
            elif op < 0.8 and live:
                w = rng.choice(live)
                jobs, held[w.index] = held[w.index], []
                for job in jobs:
                    w.complete(job, push=rng.random() < 0.8)
            elif op < 0.86 and live:
                w = rng.choice(live)
                held[w.index] = []
                fe.kill(w)
            elif op < 0.95:
                dead = [w for w in fe.workers if w.dead]
                if dead:
                    fe.restart(rng.choice(dead))
            else:
                fe.clock.advance(0.01)
            for i, lane in enumerate(clients):
                for call in list(outstanding[i]):
                    index, generation, at, place = call
                    if lane.lane.finished(index, generation):
                        outstanding[i].remove(call)
                        try:
                            np.testing.assert_array_equal(read(lane, index, generation, place), floats(4, start=at) + 1)
                            finished += 1
                        except ShmserveError as exc:
                            assert exc.code is ErrorCode.WORKER_CRASHED, exc
                            assert (i, index, generation) in claimed, f"seed {seed}: a call never claimed crashed"
                            crashed += 1
        # The storm ends: every worker comes back and runs what it is given, until nothing moves.
        for w in fe.workers:
            if w.dead:
                fe.restart(w)
        for _ in range(20):
            fe.clock.advance(0.01)
            for w in fe.workers:
                for job in held[w.index]:
                    w.complete(job)
                held[w.index] = []
                w.step()
        lost = []
        for i, lane in enumerate(clients):
            for index, generation, at, place in outstanding[i]:
                if lane.lane.finished(index, generation):
                    try:
                        read(lane, index, generation, place)
                    except ShmserveError:
                        pass
                else:
                    lost.append((i, index, generation, state_of(lane, index), lane.header().worker,
                                 [w.index for w in fe.workers if lane.region.id in w.lanes]))
        assert not lost, f"seed {seed}: calls never answered: {lost}"
        assert all(n == 1 for n in claimed.values()), f"seed {seed}: a call claimed twice"
        assert submitted > 0
    finally:
        for lane in clients:
            lane.close()
        fe.regions.close_all()


# -- the lanes' watchdog -------------------------------------------------------------------------

def test_a_call_left_ready_with_no_ring_entry_is_served_once_its_worker_is_told_to_look(make):
    """The entry of a READY call is gone from the ring (taken and lost: what took it does not
    matter): the worker never sees it.  Once it has waited LANE_NUDGE_S the watchdog tells the
    worker to serve the lane's queue again, once per LANE_NUDGE_S, and the call runs."""
    fe = make()
    w = fe.workers[0]
    lane = LaneClient(fe.regions, "c", "add")
    try:
        w.read_commands()  # the attach
        call = lane.submit(floats(4))
        w.read_commands()
        w._backlog = []  # its entry, taken off the ring, lost
        assert w.step() == [] and not lane.lane.finished(*call)
        assert fe.regions.watch_lanes(100.0) == 0  # first seen waiting
        assert fe.regions.watch_lanes(100.0 + LANE_NUDGE_S / 2) == 0
        assert w.step() == []
        assert fe.regions.watch_lanes(100.0 + LANE_NUDGE_S) == 1
        assert fe.regions.watch_lanes(100.0 + LANE_NUDGE_S + 0.1) == 0  # not again so soon
        [job] = w.step()
        assert (job.index, job.generation) == call
        np.testing.assert_array_equal(lane.read(*call)[0], floats(4) + 1)
        assert fe.regions.watch_lanes(100.0 + 3 * LANE_NUDGE_S) == 0  # nothing waits now
        assert w.commands.count((layout.CMD_ATTACH_LANE, lane.region.id)) == 2
    finally:
        lane.close()
        fe.regions.close_all()


def test_a_lane_no_worker_could_take_is_attached_once_one_can(make, monkeypatch):
    """Its worker died when the other worker's ring had no room for a command: the lane is left
    without a worker, its queued call waiting.  The watchdog attaches it once the other can take
    it (before: only a worker becoming ready did), and the call runs there."""
    fe = make(models=(ADD2,))
    w0, w1 = fe.workers
    lane = LaneClient(fe.regions, "c", "add")
    try:
        assert lane.header().worker == 0
        w0.read_commands()
        queued = lane.submit(floats(4))
        monkeypatch.setattr(fe.regions, "ring_has_room", lambda w: False)
        fe.kill(w0)
        assert lane.header().worker == layout.NO_WORKER
        assert fe.regions.watch_lanes(100.0) == 0  # still no room
        monkeypatch.undo()
        assert fe.regions.watch_lanes(100.5) == 1 and lane.header().worker == 1
        [job] = w1.step()
        assert (job.index, job.generation) == queued
        np.testing.assert_array_equal(lane.read(*queued)[0], floats(4) + 1)
    finally:
        lane.close()
        fe.regions.close_all()


def test_a_lane_call_answered_as_the_server_goes_is_read_not_failed(make):
    """A shutdown fails the lane calls left, then closes the connections: a client that notices
    the close while it waits must still read the answer its call got (the status word is the
    answer), not report the connection lost."""
    from shmserve import ConnectionClosed

    fe = make()
    w = fe.workers[0]
    lane = LaneClient(fe.regions, "c", "add")
    try:
        w.read_commands()
        call = lane.submit(floats(4))
        [job] = w.claim()

        def server_goes():  # the call is answered, then the connection closes
            w.complete(job)
            raise ConnectionClosed("the server closed the connection")

        lane.lane.wait(*call, time.monotonic() + 10, 0.0, server_goes)
        np.testing.assert_array_equal(lane.read(*call)[0], floats(4) + 1)
        second = lane.submit(floats(4))
        with pytest.raises(ConnectionClosed):  # not answered: the close is the answer
            lane.lane.wait(*second, time.monotonic() + 10, 0.0, lambda: (_ for _ in ()).throw(ConnectionClosed("x")))
        w.step()
        lane.read(*second)
    finally:
        lane.close()
        fe.regions.close_all()
