"""Door processes (docs/doors.md) through real servers with ``doors = 2``: the native socket served
by two processes beside the main one, each serving lane-able INFERs itself and relaying the rest."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from shmserve import AsyncClient, Client, protocol
from shmserve.errors import ConnectionClosed, ErrorCode, ShmserveError
from shmserve.protocol import Kind

from helpers import raw_frames
from helpers.other_user import NOBODY, as_nobody, server_nobody_can_reach
from helpers.server import serving, standard_models, wait_for
from test_operations import scrape
from test_model_lifecycle import FLAKY, PLAN, TERMINAL, add_version, repo_server_section, served_version

DOORS = "doors = 2\n"


def door_of(srv) -> tuple[Client, int]:
    """A new connection (lanes off: every call over the socket) and the door process serving it."""
    c = srv.client(lanes=False)
    return c, c.info()["door_process"]


def one_per_door(srv, n_doors: int = 2) -> dict[int, Client]:
    """A connection on each door (bounded: the kernel picks which door accepts)."""
    found: dict[int, Client] = {}
    for _ in range(400):
        c, door = door_of(srv)
        if door in found:
            c.close()
        else:
            found[door] = c
        if len(found) == n_doors:
            return found
    for c in found.values():
        c.close()
    raise AssertionError(f"only doors {sorted(found)} were reached in 400 connections")


def door_lanes(srv) -> dict[int, list[int]]:
    """The lane regions recorded under each door process's pid (the arena's region table)."""
    pids = {d["pid"]: d["index"] for d in srv.info()["doors"]}
    out: dict[int, list[int]] = {}
    for rid, r in srv.recorded_regions().items():
        if r["owner_pid"] in pids:
            out.setdefault(pids[r["owner_pid"]], []).append(rid)
    return out


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("doors")
    with serving(workdir, standard_models(), server_section=DOORS,
                 extra_args=["--metrics", str(workdir / "metrics.sock")]) as s:
        s.metrics = str(workdir / "metrics.sock")
        wait_for(lambda: os.path.exists(s.metrics), "the metrics socket")  # bound just after the doors answer
        yield s


def test_metrics_show_the_doors_and_count_what_they_answer_themselves(srv):
    key = ("shmserve_requests_total", (("model", "identity"), ("outcome", "ok"), ("version", "1")))
    before = scrape(srv.metrics).get(key, 0)
    conns = one_per_door(srv)
    try:
        for c in conns.values():
            for _ in range(7):
                c.infer("identity", {"x": np.ones(10, np.uint8)})
    finally:
        for c in conns.values():
            c.close()
    m = wait_for(lambda: (lambda m: m if m.get(key, 0) >= before + 14 else None)(scrape(srv.metrics)),
                 "the doors' answers counted")
    for door in ("0", "1"):
        assert m[("shmserve_door_up", (("door", door),))] == 1
        assert m[("shmserve_door_restarts_total", (("door", door),))] == 0


def test_both_doors_are_reached_and_serve_through_lanes_of_their_own(srv):
    conns = one_per_door(srv)
    try:
        x = np.arange(4096, dtype=np.uint8)
        for door, c in conns.items():
            for _ in range(20):
                np.testing.assert_array_equal(c.infer("identity", {"x": x})["y"], x)
        doors = {d["index"]: d for d in srv.info()["doors"]}
        assert set(doors) == {0, 1} and all(d["up"] and d["pid"] for d in doors.values())
        lanes = wait_for(lambda: (lambda found: found if set(found) == {0, 1} else None)(door_lanes(srv)),
                         "a lane recorded under each door's pid")
        mapped = srv.mapped_regions()
        for door, regions in lanes.items():
            assert set(regions) <= mapped[doors[door]["pid"]]  # the door maps its own lanes
    finally:
        for c in conns.values():
            c.close()


def test_every_frame_kind_works_through_a_door(srv):
    with srv.client(lanes=True) as c:  # lanes on: regions and zero-copy calls too
        assert c.info()["door_process"] in (0, 1)
        assert c.health()["status"] in ("ok", "degraded")
        assert "identity" in {m["name"] for m in c.models()}
        assert any(m["name"] == "identity" for m in c.repository()["models"])
        x = np.arange(300, dtype=np.uint8)
        np.testing.assert_array_equal(c.infer("identity", {"x": x})["y"], x)  # Client.infer: its own lane
        with c.zero_copy("identity", {"x": ((300,), np.uint8)}) as call:  # a region and INFER_REGION
            call.inputs["x"][:] = x
            np.testing.assert_array_equal(call.run()["y"], x)
        assert c.scale("identity", 2)["workers"] == 2  # a control call (our own uid is an admin)
        with pytest.raises(ShmserveError) as err:
            c.infer("no_such_model", {"x": x})
        assert err.value.code is ErrorCode.UNKNOWN_MODEL
        with pytest.raises(ShmserveError) as err:
            c.infer("identity", {"x": x.astype(np.float32)})
        assert err.value.code is ErrorCode.BAD_DTYPE and "must be uint8" in err.value.message


def test_lane_and_relayed_infers_are_answered_in_the_order_they_were_sent(srv):
    """Pipelined on one connection: lane calls (identity), relayed ones (a dtype the model refuses,
    an unknown model, a named version main resolves) and a slow lane call first: the answers come
    in the order of the requests."""
    s = raw_frames.connect(srv.socket)
    try:
        frames, ids = [], []
        slow = {"id": 1, "model": "slow", "inputs": [{"name": "x", "dtype": "float32", "shape": [1]}]}
        frames.append(protocol.encode_frame(Kind.INFER, slow, 4) + np.float32(0.3).tobytes())
        ids.append(1)
        for i in range(2, 40):
            if i % 3 == 0:
                meta = {"id": i, "model": "identity", "inputs": [{"name": "x", "dtype": "float32", "shape": [4]}]}
                frames.append(protocol.encode_frame(Kind.INFER, meta, 16) + bytes(16))
            elif i % 3 == 1:
                frames.append(protocol.encode_frame(Kind.INFER, {"id": i, "model": "nope", "inputs": []}))
            else:
                frames.append(raw_frames.infer_frame(i, 100 + i))
            ids.append(i)
        s.sendall(b"".join(frames))
        answers = raw_frames.read_frames(s, len(ids))
        assert [a.meta["id"] for a in answers] == ids
        kinds = {a.meta["id"]: a.kind for a in answers}
        assert kinds[1] == Kind.RESULT and kinds[3] == Kind.ERROR and kinds[4] == Kind.ERROR
        assert kinds[5] == Kind.RESULT
    finally:
        s.close()


@pytest.mark.parametrize("data, kind, code", [
    (protocol.encode_frame(Kind.HEALTH, {"id": 3}), Kind.REPLY, None),  # relayed, answered by main
    (b"GET / HTTP/1.1\r\n\r\n", Kind.ERROR, "bad_frame"),  # refused by the door's parser
])
def test_a_client_that_shuts_its_side_at_once_is_answered_as_main_answers_it(srv, data, kind, code):
    """Bytes and the client's EOF arrive together, before main has admitted the connection: what
    was sent is still answered, then the connection closes (main's door does the same)."""
    for _ in range(5):
        s = raw_frames.connect(srv.socket, timeout=20)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            answers = raw_frames.read_to_end(s)
        finally:
            s.close()
        assert [a.kind for a in answers] == [kind] and answers[0].meta.get("code") == code, answers


def test_async_client_pipelining_mixes_lane_and_relayed_calls(srv):
    async def run():
        async with AsyncClient(srv.socket, lanes=False) as c:
            x = np.arange(64, dtype=np.uint8)
            calls = [c.infer("identity", {"x": x + i}) if i % 2 else c.info() for i in range(40)]
            answers = await asyncio.gather(*calls)
            for i, a in enumerate(answers):
                if i % 2:
                    np.testing.assert_array_equal(a["y"], x + i)
                else:
                    assert a["door_process"] in (0, 1)

    asyncio.run(run())


def test_a_killed_door_is_restarted_and_only_its_connections_notice(tmp_path):
    with serving(tmp_path, standard_models(), server_section=DOORS) as srv:
        conns = one_per_door(srv)
        try:
            x = np.arange(1000, dtype=np.uint8)
            for c in conns.values():
                c.infer("identity", {"x": x})
            before = {d["index"]: d for d in srv.info()["doors"]}
            lanes = wait_for(lambda: (lambda f: f if set(f) == {0, 1} else None)(door_lanes(srv)), "lanes")
            first = conns[0]._core.session
            os.kill(before[0]["pid"], signal.SIGKILL)
            # Its connection ends: a call waiting on it when it goes raises ConnectionClosed, or, if the client
            # finds it closed between calls (it looks every so often while its lane calls are answered by the
            # worker itself), its next call is made on a new connection (a new session).  Bounded in time.
            ended, deadline = None, time.monotonic() + 60
            while ended is None and time.monotonic() < deadline:
                try:
                    conns[0].infer("identity", {"x": x})
                except ConnectionClosed:
                    ended = "raised"
                else:
                    ended = "reconnected" if conns[0]._core.session is not first else None
            assert ended, "door 0's connection did not end in 60 s of calls"
            np.testing.assert_array_equal(conns[1].infer("identity", {"x": x})["y"], x)  # the other goes on
            after = wait_for(lambda: (lambda d: d if d[0]["up"] and d[0]["pid"] != before[0]["pid"] else None)(
                {d["index"]: d for d in srv.info()["doors"]}), "door 0 restarted")
            assert after[0]["restarts"] == 1 and after[1]["restarts"] == 0 and after[1]["pid"] == before[1]["pid"]
            recorded = srv.recorded_regions()
            assert not set(lanes[0]) & set(recorded)  # the dead door's lanes are released
            assert set(lanes[1]) <= set(recorded)
            c, door = door_of(srv)  # a new connection is served (by either door)
            with c:
                np.testing.assert_array_equal(c.infer("identity", {"x": x})["y"], x)
        finally:
            for c in conns.values():
                c.close()
        assert "door 0" in srv.log() and "restarting it" in srv.log()


def test_a_swap_under_traffic_through_the_doors_drops_nothing(tmp_path):
    repo = tmp_path / "repo"
    for v in (1, 2):
        add_version(repo, "m", v)
    with serving(tmp_path, "", server_section=repo_server_section(repo, "max_workers = 8\n" + DOORS)) as srv:
        stop, failures, seen = threading.Event(), [], []

        def traffic():
            with srv.client(lanes=False) as c:
                x = np.ones(4, np.float32)
                while not stop.is_set():
                    try:
                        seen.append(served_version(x, c.infer("m", {"x": x})["y"]))
                    except Exception as exc:  # noqa: BLE001 - every failure is the test's
                        failures.append(exc)
                        return

        threads = [threading.Thread(target=traffic) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(seen) > 50, "traffic before the swap")
            with srv.client() as c:
                assert c.load("m", version=1)["version"] == 1
                n = len(seen)
                wait_for(lambda: len(seen) > n + 50, "traffic after the swap")
                assert c.load("m", version=2)["version"] == 2
                n = len(seen)
                wait_for(lambda: len(seen) > n + 50, "traffic after the second swap")
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not failures, failures
        assert seen[-1] == 2 and 1 in seen
        info = srv.info()
        pids = {d["pid"] for d in info["doors"]}
        with srv.client() as c:
            default = versions_of(c, "m")
        assert default == 2
        # no lane of a door serves version 1 any more: every door lane is attached to a worker of version 2
        v2_workers = {w["index"] for w in info["workers"] if w["model"] == "m" and w["version"] == 2}
        door_regions = [r for r in srv.recorded_regions().values() if r["owner_pid"] in pids]
        assert door_regions and all(r["worker"] in v2_workers for r in door_regions), door_regions


def versions_of(c, model: str) -> int:
    return next(v["version"] for v in c.repository()["models"] if v["name"] == model and v.get("default"))


def test_a_canary_through_the_doors_rolls_back(tmp_path):
    """Traffic only through the doors: the canary's split is main's (the doors relay its model's
    requests while it runs), and its outcomes reach the rollout."""
    repo = tmp_path / "repo"
    add_version(repo, "m", 1)
    with serving(tmp_path, "", server_section=repo_server_section(repo, DOORS)) as srv:
        add_version(repo, "m", 2, FLAKY)
        with srv.client(lanes=False) as c:
            assert c.canary("m", "start", version=2, plan=PLAN)["state"] not in TERMINAL
            rng = np.random.default_rng(12)
            seen, errors = {}, 0
            for i in range(20000):
                x = rng.uniform(0, 1, 2).astype(np.float32)
                try:
                    v = served_version(x, c.infer("m", {"x": x})["y"])
                    seen[v] = seen.get(v, 0) + 1
                except ShmserveError:
                    errors += 1
                if i % 50 == 0 and c.canary("m", "status")["state"] in TERMINAL:
                    break
            status = c.canary("m", "status")
            assert status["state"] == "rolled_back", status
            assert errors > 0 and seen.get(2, 0) > 0
            x = np.zeros(2, np.float32) + 0.5
            assert served_version(x, c.infer("m", {"x": x})["y"]) == 1


def test_shutdown_answers_calls_in_flight_through_the_doors(tmp_path):
    with serving(tmp_path, standard_models(), server_section=DOORS) as srv:
        conns = one_per_door(srv)
        results, errors = [], []

        def slow_call(c):
            try:
                results.append(c.infer("slow", {"x": np.array([1.0], np.float32)})["y"])
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=slow_call, args=(c,)) for c in conns.values()]
        for t in threads:
            t.start()
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        for c in conns.values():
            c.close()
        assert not errors, errors
        assert [float(r[0]) for r in results] == [2.0, 2.0]


def test_a_door_passes_the_real_clients_uid(tmp_path):
    """The door serves as the client it reads with SO_PEERCRED, not as itself: nobody sees the
    pids hidden (a root client would see them), and a uid not allowed is refused."""
    with server_nobody_can_reach(tmp_path, f"allow_uids = [{NOBODY}]\n{DOORS}") as srv:
        def ask():
            with Client(srv.socket, timeout=20, lanes=False) as c:
                assert c.infer("identity", {"x": np.ones(3, np.uint8)})["y"].sum() == 3
                return json.dumps(c.info())

        theirs = json.loads(as_nobody(ask))
        assert theirs["door_process"] in (0, 1)
        assert theirs["pid"] is None and all(d["pid"] is None for d in theirs["doors"])
        mine = srv.info()
        assert mine["pid"] == srv.proc.pid and all(d["pid"] for d in mine["doors"])
    with server_nobody_can_reach(tmp_path, DOORS) as srv:
        def refused():
            try:
                with Client(srv.socket, timeout=20, lanes=False) as c:
                    c.health()
            except ShmserveError as exc:
                return exc.code.wire
            return "served"

        assert as_nobody(refused) == "permission_denied"
