"""``Client.infer`` and ``AsyncClient.infer`` through lanes (their default) and their fallbacks.

Through real server and worker processes: the call leaves the front-end out of the data path
(it is stopped while calls run), returns arrays the caller owns, gives the same answers and
the same error codes as the socket path, falls back to the socket whenever a lane cannot take
the call (lanes off, a version it has no spec of, bytes tensors, all slots busy; a canary keeps
them on lanes: test_canary_lanes.py), keeps
the space of a timed-out call until its worker is done, reuses each signature's space, and
leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import numpy as np
import pytest

from shmserve import AsyncClient, Client, ErrorCode, ShmserveError

from conftest import shm_names
from helpers.server import SLOW_MODEL, ServerProcess, serving, wait_for
from test_model_lifecycle import add_version, repo_server_section, served_version

CONFIG = """
[[models]]
name = "identity"
backend = "python"
path = "shmserve.models:identity"

[[models]]
name = "bytes_reverse"
backend = "python"
path = "shmserve.models:bytes_reverse"

[[models]]
name = "grow"
backend = "python"
path = "serving_models:grow"
max_output_bytes = 4096

[[models]]
name = "fails"
backend = "python"
path = "serving_models:fails"
""" + SLOW_MODEL


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("infer-lanes"), CONFIG, server_section="request_timeout_s = 20") as srv:
        yield srv


def lanes_of(srv, model: str) -> int:
    """The lanes clients opened to ``model``'s workers: a door process's own lanes (recorded under
    its pid: docs/doors.md) are not counted."""
    info = srv.info()
    lanes = sum(w["lanes"] for w in info["workers"] if w["model"] == model)
    doors = {d["pid"] for d in info.get("doors") or ()}
    if doors:
        lanes -= sum(r["kind"] == "lane" and r["model"] == model and r["owner_pid"] in doors
                     for r in srv.recorded_regions().values())
    return lanes


def test_infer_goes_through_a_lane_and_returns_arrays_the_caller_owns(server):
    x = np.arange(4096, dtype=np.uint8)
    with server.client() as c:
        y = c.infer("identity", {"x": x})["y"]
        np.testing.assert_array_equal(y, x)
        assert lanes_of(server, "identity") == 1  # opened by the first call, kept for the next
        os.kill(server.proc.pid, signal.SIGSTOP)  # the front-end is not on the data path
        try:
            answers = [c.infer("identity", {"x": (x + i).astype(np.uint8)})["y"] for i in range(50)]
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        for i, answer in enumerate(answers):
            np.testing.assert_array_equal(answer, (x + i).astype(np.uint8))
        # Each answer is its own array: writable, and not a view of the lane (the next call reuses it).
        assert all(a.flags.writeable and a.flags.owndata for a in answers)
        answers[0][:] = 0
        np.testing.assert_array_equal(answers[1], (x + 1).astype(np.uint8))
        assert lanes_of(server, "identity") == 1  # one lane per model, not one per call
    np.testing.assert_array_equal(answers[2], (x + 2).astype(np.uint8))  # valid after the client closed
    wait_for(lambda: lanes_of(server, "identity") == 0, "the lane to close with its client")


def test_non_contiguous_and_zero_size_inputs_come_back_equal(server):
    x = np.arange(300, dtype=np.uint8)[::3]  # a strided view: copied into the lane as the socket would send it
    with server.client() as c:
        np.testing.assert_array_equal(c.infer("identity", {"x": x})["y"], x)
        assert c.infer("identity", {"x": np.zeros(0, np.uint8)})["y"].shape == (0,)
        np.testing.assert_array_equal(c.infer("slow", {"x": np.array([0.0, 1.5], np.float32)[:1]})["y"], [0.0])


@pytest.mark.parametrize("model, inputs", [
    ("nope", {"x": np.zeros(4, np.uint8)}),  # unknown model: the socket answers
    ("identity", {"x": np.zeros(4, np.float32)}),  # wrong dtype: the worker checks the lane's inputs
    ("identity", {"x": np.zeros((2, 2), np.uint8)}),  # wrong rank
    ("identity", {"z": np.zeros(4, np.uint8)}),  # an input the model does not have: the socket answers
    ("identity", {}),  # missing input
    ("fails", {"x": np.full(4, -1, np.float32)}),  # the model raises
    ("grow", {"x": np.ones(64, np.float32)}),  # more output than the server reserves
    ("identity", {"x": np.zeros((1,) * 9, np.uint8)}),  # more dimensions than a descriptor holds
], ids=["unknown-model", "dtype", "rank", "unknown-input", "missing-input", "model-error", "output-too-large",
        "nine-dims"])
def test_errors_through_a_lane_have_the_socket_paths_codes(server, model, inputs):
    codes = []
    for lanes in (False, True):
        with Client(server.socket, lanes=lanes) as c:
            with pytest.raises(ShmserveError) as info:
                c.infer(model, inputs)
            codes.append(info.value.code)
            assert c.infer("identity", {"x": np.ones(3, np.uint8)})["y"].tolist() == [1, 1, 1]  # serves on
    assert codes[0] is codes[1], codes
    assert codes[0] is not ErrorCode.INTERNAL


def test_calls_a_lane_cannot_take_go_over_the_socket(server):
    x = np.arange(10, dtype=np.uint8)
    with Client(server.socket, lanes=False) as c:
        np.testing.assert_array_equal(c.infer("identity", {"x": x})["y"], x)
        assert lanes_of(server, "identity") == 0
    with server.client() as c:
        with pytest.raises(ShmserveError) as info:  # a version the client has no spec of: the socket says
            c.infer("identity", {"x": x}, version=9)
        assert info.value.code is ErrorCode.UNKNOWN_MODEL
        assert lanes_of(server, "identity") == 0
        np.testing.assert_array_equal(c.infer("identity", {"x": x}, key="user-7")["y"], x)  # no canary: the lane
        assert lanes_of(server, "identity") == 1
        words = np.array([b"abc", b"", b"xy"], dtype=object)  # bytes tensors: serialized over the socket
        assert c.infer("bytes_reverse", {"x": words})["y"].tolist() == [b"cba", b"", b"yx"]
        assert lanes_of(server, "bytes_reverse") == 0


def test_a_timed_out_call_keeps_its_space_until_the_worker_is_done(server):
    with server.client() as c:
        with pytest.raises(ShmserveError) as info:
            c.infer("slow", {"x": np.array([1.0], np.float32)}, timeout=0.2)
        assert info.value.code is ErrorCode.TIMEOUT
        (region,) = c._core.infer_lanes.values()
        assert len(region.abandoned) == 1  # the worker may still write its outputs there
        (held,) = region.seats.values()
        assert held.busy
        # The next call (another signature: a space of its own) waits behind the slow one (one
        # worker), and its answer is its own; then the timed-out call's space is free again.
        assert c.infer("slow", {"x": np.array([0.0, 2.0], np.float32)})["y"].tolist() == [0.0, 4.0]
        assert c.infer("slow", {"x": np.array([0.0], np.float32)})["y"].tolist() == [0.0]
        assert not region.abandoned and not held.busy  # reclaimed by the call after the slow one ended
        assert region.seats[next(k for k, v in region.seats.items() if v is held)] is held  # reused
        assert not any(seat.busy for seat in region.seats.values())


def test_async_infer_runs_many_calls_at_once_through_a_lane_and_the_socket(server):
    async def main():
        async with AsyncClient(server.socket, timeout=30) as c:
            xs = [np.full(1000 + i, i, np.uint8) for i in range(40)]  # more than a lane's 16 slots
            answers = await asyncio.gather(*(c.infer("identity", {"x": x}) for x in xs))
            for x, answer in zip(xs, answers):
                np.testing.assert_array_equal(answer["y"], x)
            assert lanes_of(server, "identity") == 1
            with pytest.raises(ShmserveError) as info:
                await c.infer("slow", {"x": np.array([1.0], np.float32)}, timeout=0.2)
            assert info.value.code is ErrorCode.TIMEOUT
            assert (await c.infer("identity", {"x": xs[3]}))["y"].tolist() == xs[3].tolist()

    asyncio.run(main())


def test_many_threads_each_with_a_client_get_their_own_answers(server):
    errors: list = []

    def run(seed: int):
        rng = np.random.default_rng(seed)
        try:
            with server.client() as c:
                for _ in range(100):
                    x = rng.integers(0, 255, int(rng.integers(1, 20000)), dtype=np.uint8)
                    y = c.infer("identity", {"x": x})["y"]
                    if not np.array_equal(x, y):
                        errors.append(seed)
        except Exception as exc:  # reported below with its seed
            errors.append((seed, exc))

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors


def test_infer_lanes_leave_nothing_behind(tmp_path):
    before = shm_names()
    srv = ServerProcess(tmp_path, CONFIG).start()
    try:
        fds = len(os.listdir(f"/proc/{srv.proc.pid}/fd"))
        for _ in range(20):
            with srv.client() as c:
                c.infer("identity", {"x": np.ones(100, np.uint8)})
        wait_for(lambda: not srv.recorded_regions() and not any(srv.mapped_regions().values()),
                 "every lane region to be released")
        assert len(os.listdir(f"/proc/{srv.proc.pid}/fd")) <= fds
    finally:
        assert srv.stop() == 0, srv.log()
    assert shm_names() == before


def test_many_signatures_share_the_lane_without_running_out_of_space(server):
    """More input signatures than seats are kept (and larger ones than fit beside them): every call
    is answered, through the lane, whose kept space never outgrows it."""
    with server.client() as c:
        for n in list(range(1, 40)) + [8 << 20, 3, 20 << 20, 5]:
            x = np.full(n, n % 251, np.uint8)
            np.testing.assert_array_equal(c.infer("identity", {"x": x})["y"], x)
        (region,) = c._core.infer_lanes.values()
        assert 0 < len(region.seats) <= 8 and not any(seat.busy for seat in region.seats.values())
        assert lanes_of(server, "identity") == 1


SUM_DIFF = """\
def model(inputs):
    return {{"d": inputs["a"] - inputs["b"], "s": inputs["a"] + inputs["b"]}}
model.inputs = [{inputs}]
model.outputs = [{outputs}]
"""
A, B = '{{"name": "a", "dtype": "float32", "shape": ["n"]}}', '{{"name": "b", "dtype": "float32", "shape": ["n"]}}'
D, S = '{{"name": "d", "dtype": "float32", "shape": ["n"]}}', '{{"name": "s", "dtype": "float32", "shape": ["n"]}}'


def test_a_new_version_with_its_tensors_in_another_order_is_not_read_by_the_old_spec(tmp_path):
    """The lane follows the model's default version; a client that planned its calls from the old
    version's spec (input and output indices) is refused by the new version's worker, answered over
    the socket, and plans from the new spec after that: the answers are right throughout."""
    repo = tmp_path / "repo"
    add_version(repo, "m", 1, SUM_DIFF.replace("{inputs}", f"{A}, {B}").replace("{outputs}", f"{D}, {S}"))
    with serving(tmp_path, "", server_section=repo_server_section(repo)) as srv:
        a, b = np.array([10, 20], np.float32), np.array([1, 2], np.float32)
        with srv.client() as c:
            def right():
                y = c.infer("m", {"a": a, "b": b})
                return y["d"].tolist() == [9, 18] and y["s"].tolist() == [11, 22]
            assert right()
            add_version(repo, "m", 2, SUM_DIFF.replace("{inputs}", f"{B}, {A}").replace("{outputs}", f"{S}, {D}"))
            assert c.load("m", version=2)["version"] == 2
            assert all(right() for _ in range(5))
            wait_for(lambda: right() and c._core.specs.get("m") is not None and c._core.specs["m"].extra["version"] == 2,
                     "the client to plan from version 2's spec", timeout=10)
            assert right() and lanes_of(srv, "m") == 1


def test_cancelled_async_calls_give_their_slot_and_space_back_only_once_the_worker_is_done(server):
    """asyncio.wait_for cancelling lane calls (more than a lane's 16 slots) while the worker runs
    them: the lane stays usable, and no later call's data is overwritten by a cancelled one's."""
    async def main():
        async with AsyncClient(server.socket, timeout=30) as c:
            for i in range(20):  # each sleeps 0.2 s: a loop a busy machine stalls past 50 ms still times it out
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(c.infer("slow", {"x": np.full(4096, 0.2, np.float32)}), 0.01)
            for n in (20000, 4096, 50000):
                x = np.arange(n, dtype=np.float32)
                y = (await c.infer("slow", {"x": np.concatenate([[0], x[1:]]).astype(np.float32)}))["y"]
                np.testing.assert_array_equal(y, 2 * np.concatenate([[0], x[1:]]))
            (region,) = c._core.infer_lanes.values()
            lane = region.lane
            wait_for(lambda: (lane._reclaim(), region.reclaim(), len(lane.free) == 16 and not region.abandoned)[2],
                     "the cancelled calls' slots and space to come back", timeout=20)

    asyncio.run(main())
