"""Lanes: zero-copy calls that go from the client's region straight to a worker and back.

Through real server and worker processes: results, the front-end off the data
path (it is stopped while lane calls run), hostile and corrupt lanes, worker
death, timeouts, batching across lanes, and nothing left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from shmserve import Client, ConnectionClosed, ErrorCode, ShmserveError, layout
from shmserve import _atomics as atomics
from shmserve.slotstate import SlotState

from conftest import shm_names
from helpers.server import DOUBLE_BATCHED, SLOW_MODEL, ServerProcess, serving, wait_for

CONFIG = """
[[models]]
name = "identity"
backend = "python"
path = "shmserve.models:identity"
""" + SLOW_MODEL + DOUBLE_BATCHED


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("lanes"), CONFIG, server_section="request_timeout_s = 20") as srv:
        yield srv


def lane_regions(srv) -> set[int]:
    """Regions the server still holds: recorded in its arena, or mapped by any of its processes."""
    return set(srv.recorded_regions()).union(*srv.mapped_regions().values())


def submit_raw(call, *, offset=None, view=None, out_offset=None, out_capacity=None, name_index=0):
    """Publish one lane request the way ``ClientLane.submit`` does, with any field overridden
    (a misbehaving client); returns what the worker answered (outputs or the ShmserveError)."""
    lane = call.region.lane
    off, good_view = next(iter(call._op.inputs.values()))
    index, generation = lane.submit(1, 0, [(name_index, off if offset is None else offset,
                                            good_view if view is None else view)],
                                    call.out_offset if out_offset is None else out_offset,
                                    call.out_capacity if out_capacity is None else out_capacity)
    lane.wait(index, generation, time.monotonic() + 20, 0.0, call.client._pump.check_alive)
    try:
        return lane.read(index, generation, call.out_offset if out_offset is None else out_offset,
                         call.out_capacity if out_capacity is None else out_capacity)
    except ShmserveError as exc:
        return exc


# -- results and the data path ------------------------------------------------------------------

def test_lane_calls_return_the_model_results_without_the_front_end(server):
    x = np.arange(4096, dtype=np.uint8)
    with server.client() as c:
        with c.zero_copy("identity", {"x": (x.shape, x.dtype)}) as call:
            assert call.region.lane is not None
            call.inputs["x"][...] = x
            np.testing.assert_array_equal(call.run()["y"], x)
            info = c.info()
            assert info["lanes"] == 1 and sum(w["lanes"] for w in info["workers"]) == 1
            requests_before = sum(w["requests"] for w in info["workers"] if w["model"] == "identity")
            # Stop the front-end: lane calls do not need it.
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                for i in range(50):
                    call.inputs["x"][...] = (x + i).astype(np.uint8)
                    np.testing.assert_array_equal(call.run()["y"], (x + i).astype(np.uint8))
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            info = c.info()
            assert sum(w["requests"] for w in info["workers"] if w["model"] == "identity") == requests_before + 50
            assert c.infer("identity", {"x": x})["y"].tolist() == x.tolist()  # the socket path still works


def test_lanes_off_sends_zero_copy_calls_over_the_socket(server):
    x = np.arange(100, dtype=np.uint8)
    with Client(server.socket, lanes=False) as c:
        with c.zero_copy("identity", {"x": (x.shape, x.dtype)}) as call:
            assert call.region.lane is None
            call.inputs["x"][...] = x
            np.testing.assert_array_equal(call.run()["y"], x)
        assert c.info()["lanes"] == 0


def test_lane_calls_of_several_clients_run_as_batches(server):
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal((1 + i % 3, 3), dtype=np.float32) for i in range(8)]
    clients = [server.client() for _ in inputs]
    calls = [c.zero_copy("double", {"x": (x.shape, x.dtype)}) for c, x in zip(clients, inputs)]
    for call, x in zip(calls, inputs):
        call.inputs["x"][...] = x
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def run(i):
        barrier.wait()
        results[i] = calls[i].run()["y"].copy()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for x, y in zip(inputs, results):
            np.testing.assert_array_equal(y, x * 2)
        out = subprocess.run([sys.executable, "-m", "shmserve.cli", "inspect", "--instance", server.instance,
                              "--json"], capture_output=True, text=True, timeout=60)
        batch = json.loads(out.stdout)["latency_us"]["double"]["batch_size"]
        assert batch["count"] < 8  # at least two lanes' requests shared a run
    finally:
        for call, c in zip(calls, clients):
            call.release()
            c.close()


# -- a client that does not play by the rules ---------------------------------------------------

def test_a_lane_cannot_reach_outside_its_own_data_space(server):
    with server.client() as a, server.client() as b:
        other = b.zero_copy("identity", {"x": ((64,), np.uint8)})
        call = a.zero_copy("identity", {"x": ((64,), np.uint8)})
        region = call.region
        in_header = np.ndarray((64,), np.uint8, buffer=region.buf, offset=0)
        past_end = np.ndarray((64,), np.uint8, buffer=region.buf, offset=region.size - 64)
        cases = {
            "input in the lane's queue": dict(offset=0, view=in_header),
            "input past the end": dict(offset=region.size - 64 + 64, view=past_end),
            "output area in the lane's queue": dict(out_offset=0, out_capacity=4096),
            "output area past the end": dict(out_offset=region.size - 64, out_capacity=4096),
        }
        for what, patch in cases.items():
            got = submit_raw(call, **patch)
            assert isinstance(got, ShmserveError) and got.code is ErrorCode.BAD_REGION, (what, got)
        # Another client's region, named by id.
        real_id = region.lane.region_id
        region.lane.region_id = other.region.id
        try:
            got = submit_raw(call)
        finally:
            region.lane.region_id = real_id
        assert isinstance(got, ShmserveError) and got.code is ErrorCode.BAD_REGION, got
        # Inputs the model does not take.
        wrong = np.ndarray((16,), np.float32, buffer=region.buf, offset=next(iter(call._op.inputs.values()))[0])
        got = submit_raw(call, view=wrong)
        assert isinstance(got, ShmserveError) and got.code is ErrorCode.BAD_DTYPE, got
        got = submit_raw(call, name_index=5)
        assert isinstance(got, ShmserveError) and got.code is ErrorCode.BAD_INPUT, got
        # Junk on the submission ring is ignored.
        lane = region.lane
        for junk in (999, 2**64 - 2, (7 << 32) | 3):
            lane.submissions.push(junk)
        lane.bell.notify()
        call.inputs["x"][...] = 7
        assert call.run()["y"].tolist() == [7] * 64
        other.release()
        call.release()


def test_a_lane_scribbled_over_does_not_disturb_the_server(server):
    seed = random.randrange(2**32)
    print(f"lane fuzz seed={seed}")
    rng = random.Random(seed)
    x = np.arange(256, dtype=np.uint8)
    with server.client() as victim, server.client() as bystander:
        for _ in range(20):
            call = victim.zero_copy("identity", {"x": (x.shape, x.dtype)})
            buf = call.region.buf
            for _ in range(rng.randrange(1, 50)):  # random words anywhere in the queue
                off = rng.randrange(0, layout.LANE_BYTES // 8) * 8
                buf[off:off + 8] = rng.randbytes(8)
            lane = call.region.lane
            lane.submissions.push(rng.getrandbits(64))
            lane.bell.notify()
            call.release()
            with bystander.zero_copy("identity", {"x": (x.shape, x.dtype)}) as good:
                good.inputs["x"][...] = x
                assert good.run()["y"].tolist() == x.tolist(), f"seed {seed}"
            assert bystander.infer("identity", {"x": x})["y"].tolist() == x.tolist()
            victim.close()
            victim = server.client()
        victim.close()
    with server.client() as c:
        assert all(w["state"] == "ready" for w in c.info()["workers"]), f"seed {seed}"


# -- failures ------------------------------------------------------------------------------------

def test_a_lane_call_that_times_out_leaves_the_lane_usable(server):
    with server.client() as c:
        call = c.zero_copy("slow", {"x": ((1,), np.float32)})
        call.inputs["x"][...] = 1.0
        with pytest.raises(ShmserveError) as info:
            call.run(timeout=0.2)
        assert info.value.code is ErrorCode.TIMEOUT
        call.inputs["x"][...] = 0.0
        lane = call.region.lane
        assert lane.abandoned
        wait_for(lambda: call.run()["y"].tolist() == [0.0] and (lane._reclaim() or not lane.abandoned)
                 and len(lane.free) == layout.LANE_SLOTS, "the timed-out slot to come back", timeout=10)
        call.release()


def test_a_lane_whose_calls_take_long_naps_before_spinning_and_still_answers_every_call(server):
    """After RECENT_CALLS calls that each took far longer than the spin, a wait sleeps until shortly
    before the next call is due and spins only then (``ClientLane.nap``); a call that finishes
    early still wakes it, and a deadline inside the nap still times the call out."""
    from shmserve import lanes

    with Client(server.socket, spin_us=500) as c:
        call = c.zero_copy("slow", {"x": ((1,), np.float32)})
        lane = call.region.lane
        call.inputs["x"][...] = 0.0
        assert call.run()["y"].tolist() == [0.0]
        assert lane.nap(0.0005) == 0.0  # short calls: spin first
        call.inputs["x"][...] = 0.02
        for _ in range(lanes.RECENT_CALLS):
            assert call.run()["y"][0] == np.float32(0.02) * 2
        assert 0.015 < lane.nap(0.0005) < 1.0  # the shortest recent wait, less half a spin
        assert lane.nap(0.0) == 0.0  # no spin asked: nothing to place
        call.inputs["x"][...] = 0.0
        assert call.run()["y"].tolist() == [0.0]  # finished during the nap: woken by the worker
        call.inputs["x"][...] = 0.02
        for _ in range(lanes.RECENT_CALLS):
            call.run()
        call.inputs["x"][...] = 1.0
        with pytest.raises(ShmserveError) as info:
            call.run(timeout=0.005)  # the deadline falls inside the nap
        assert info.value.code is ErrorCode.TIMEOUT
        call.inputs["x"][...] = 0.0
        wait_for(lambda: call.run()["y"].tolist() == [0.0] and (lane._reclaim() or not lane.abandoned),
                 "the timed-out slot to come back", timeout=10)
        call.release()


def test_a_worker_killed_under_a_lane_call_fails_it_and_the_lane_moves_on(server):
    with server.client() as c:
        call = c.zero_copy("slow", {"x": ((1,), np.float32)})
        call.inputs["x"][...] = 5.0
        (victim,) = [w["pid"] for w in c.info()["workers"] if w["model"] == "slow"]
        outcome: list = []

        def run():
            t0 = time.monotonic()
            try:
                outcome.append(call.run())
            except ShmserveError as exc:
                outcome.append((exc.code, exc.message, time.monotonic() - t0))

        t = threading.Thread(target=run)
        t.start()
        running = int(SlotState.RUNNING)
        wait_for(lambda: any(atomics.load64(call.region.buf, layout.LANE.slot_off(i)) & 0xFFFFFFFF == running
                             for i in range(layout.LANE_SLOTS)), "the worker to claim the lane call")
        os.kill(victim, signal.SIGKILL)
        t.join(30)
        code, message, elapsed = outcome[0]
        assert code is ErrorCode.WORKER_CRASHED and "SIGKILL" in message and elapsed < 5
        wait_for(lambda: [w for w in c.info()["workers"] if w["model"] == "slow" and w["state"] == "ready"
                          and w["pid"] != victim and w["lanes"] == 1], "the restarted worker to take the lane")
        call.inputs["x"][...] = 0.0
        assert call.run()["y"].tolist() == [0.0]
        call.release()


def test_a_closed_lane_is_removed_and_unmapped_everywhere(server):
    # Earlier tests' clients are gone, but the server may still be dropping their regions.
    wait_for(lambda: server.info()["lanes"] == 0, "earlier lanes to be dropped")
    before = lane_regions(server)
    c = server.client()
    call = c.zero_copy("identity", {"x": ((10,), np.uint8)})
    call.inputs["x"][...] = 1
    call.run()
    assert len(lane_regions(server) - before) == 1
    call.release()
    c.close()
    wait_for(lambda: lane_regions(server) == before, "the lane to be unmapped by the front-end and its worker")
    wait_for(lambda: all(w["lanes"] == 0 for w in server.info()["workers"]), "the worker to drop the lane")
    # A client process killed outright: the same.
    script = ("import numpy as np, sys, time\nfrom shmserve import Client\n"
              f"c = Client({server.socket!r})\n"
              "call = c.zero_copy('identity', {'x': ((10,), np.uint8)})\ncall.run()\n"
              "print('ok', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ok"
        assert len(lane_regions(server) - before) == 1
    finally:
        p.kill()
        p.wait()
    wait_for(lambda: lane_regions(server) == before, "the killed client's lane to be unlinked")


def test_a_lane_call_ends_when_the_server_dies(tmp_path):
    before = shm_names()
    srv = ServerProcess(tmp_path, CONFIG).start()
    try:
        with srv.client() as c:
            call = c.zero_copy("slow", {"x": ((1,), np.float32)})
            call.inputs["x"][...] = 30.0
            outcome: list = []

            def run():
                t0 = time.monotonic()
                try:
                    call.run()
                except (ConnectionClosed, ShmserveError) as exc:
                    outcome.append((type(exc), time.monotonic() - t0))

            t = threading.Thread(target=run)
            t.start()
            time.sleep(0.5)
            srv.kill()  # SIGKILL the front-end; its workers follow (PDEATHSIG)
            t.join(20)
            assert outcome and outcome[0][0] is ConnectionClosed and outcome[0][1] < 10, outcome
            call.release()
    finally:
        srv.kill()
        subprocess.run([sys.executable, "-m", "shmserve.cli", "cleanup", "--instance", srv.instance],
                       capture_output=True, timeout=60)
    assert shm_names() == before


def test_a_worker_serves_at_most_max_lanes_then_calls_use_the_socket(server):
    from shmserve import workerlink

    clients = [server.client() for _ in range(workerlink.MAX_LANES // 16 + 1)]
    try:
        lanes = []
        for c in clients:
            while len(lanes) < workerlink.MAX_LANES and len(c._core.regions) < 16:
                lanes.append(c.open_region(4096, lane="identity"))
        assert len(lanes) == workerlink.MAX_LANES
        with pytest.raises(ShmserveError) as info:
            clients[-1].open_region(4096, lane="identity")
        assert info.value.code is ErrorCode.OVERLOADED
        wait_for(lambda: [w["lanes"] for w in server.info()["workers"] if w["model"] == "identity"]
                 == [workerlink.MAX_LANES], "every lane to be attached")
        x = np.arange(100, dtype=np.uint8)
        with server.client() as late:  # no lane to be had: zero-copy calls go over the socket
            with late.zero_copy("identity", {"x": (x.shape, x.dtype)}) as call:
                assert call.region.lane is None
                call.inputs["x"][...] = x
                assert call.run()["y"].tolist() == x.tolist()
        owner = next(c for c in clients if lanes[-1] in c._core.regions)  # the last lane still answers
        with owner.zero_copy("identity", {"x": (x.shape, x.dtype)}) as call:
            assert call.region.lane is not None
            call.inputs["x"][...] = x
            assert call.run()["y"].tolist() == x.tolist()
    finally:
        for c in clients:
            c.close()
    wait_for(lambda: all(w["lanes"] == 0 for w in server.info()["workers"]), "the lanes to be dropped")


# -- asyncio --------------------------------------------------------------------------------------

def test_async_lane_calls_run_concurrently_and_fall_back_to_the_socket_when_slots_run_out(server):
    from shmserve import AsyncClient

    async def main():
        async with AsyncClient(server.socket, timeout=30) as c:
            calls = []
            for i in range(3 * layout.LANE_SLOTS):  # more calls in flight than a lane has slots
                call = await c.zero_copy("identity", {"x": ((100,), np.uint8)})
                call.inputs["x"][...] = i
                calls.append(call)
            assert {call.region.lane is not None for call in calls} == {True}
            for _ in range(3):
                results = await asyncio.gather(*(call.run() for call in calls))
                assert [r["y"][0] for r in results] == [i for i in range(len(calls))]
            assert (await c.info())["lanes"] == 1
            for call in calls:
                call.release()
            slow = await c.zero_copy("slow", {"x": ((1,), np.float32)})
            slow.inputs["x"][...] = 1.0
            with pytest.raises(ShmserveError) as info:
                await slow.run(timeout=0.2)
            assert info.value.code is ErrorCode.TIMEOUT
            slow.inputs["x"][...] = 0.0
            assert (await slow.run())["y"].tolist() == [0.0]
            slow.release()

    asyncio.run(main())
    assert not [t for t in threading.enumerate() if t.name.startswith("shmserve-lane-")]


def test_an_async_lane_call_ends_when_the_server_dies(tmp_path):
    from shmserve import AsyncClient

    before = shm_names()
    srv = ServerProcess(tmp_path, CONFIG).start()

    async def main():
        async with AsyncClient(srv.socket, timeout=60) as c:
            call = await c.zero_copy("slow", {"x": ((1,), np.float32)})
            call.inputs["x"][...] = 30.0
            task = asyncio.ensure_future(call.run())
            await asyncio.sleep(0.5)
            srv.kill()
            t0 = time.monotonic()
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(task, 20)
            assert time.monotonic() - t0 < 10
            call.release()

    try:
        asyncio.run(main())
    finally:
        srv.kill()
        subprocess.run([sys.executable, "-m", "shmserve.cli", "cleanup", "--instance", srv.instance],
                       capture_output=True, timeout=60)
    assert shm_names() == before


def test_a_busy_batching_worker_unmaps_a_closed_lane_without_waiting_to_be_idle(server):
    """Finding 6: a worker used to unmap closed regions only after 0.5 s idle, so under steady load
    it kept every closed lane mapped.  Now the drop takes effect after the batch in hand."""
    stop, served = threading.Event(), []

    def load():  # keeps the batching worker busy the whole time (a batch gathers for up to 300 ms)
        with server.client() as c:
            while not stop.is_set():
                c.infer("double", {"x": np.ones((1, 4), np.float32)})
                served.append(time.monotonic())

    thread = threading.Thread(target=load)
    thread.start()
    try:
        wait_for(lambda: len(served) >= 3, "the load to run")
        with server.client() as c:
            call = c.zero_copy("double", {"x": ((1, 4), np.float32)})
            call.inputs["x"][...] = 2
            assert call.run()["y"].tolist() == [[4.0] * 4]
            lane = call.region.id
            assert any(lane in ids for ids in server.mapped_regions().values())
            call.release()
        wait_for(lambda: not any(lane in ids for ids in server.mapped_regions().values()),
                 "the closed lane to be unmapped by the busy worker", timeout=10)
        assert thread.is_alive() and time.monotonic() - served[-1] < 1.0, "the worker was idle meanwhile"
    finally:
        stop.set()
        thread.join(30)
