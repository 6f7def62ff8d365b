"""Canaries without leaving the lanes (issue 24): lane clients reach the version a rollout picks through its lane.

Through real server and worker processes: while a split canary ramps, ``Client.infer`` and
``Client.zero_copy`` calls with or without a routing key go through the lane of the version the
server's rule picks (``shmserve.routing``) — none crosses the socket (the front-end's request
counter stays put while the workers' counts grow) —, in the rollout's share, sticky keys on the
version the socket would give them; the rollout's windows count every lane call (the workers'
lane outcomes, read on the heartbeat); a candidate failing through lanes is rolled back by them,
after which lane clients reach only the stable version; promote and abort move lane clients at
once.  ``zero_copy`` takes ``version`` and ``key``.
"""

from __future__ import annotations

import numpy as np
import pytest

from shmserve import ErrorCode, ShmserveError

from helpers.server import serving, wait_for
from test_model_lifecycle import FLAKY, TERMINAL, add_version, repo_server_section, served_version

HOLD = {"hold_s": 1e6, "min_samples": 100000, "max_p99_ratio": None}  # a step that stays: nothing decides


def socket_requests(c) -> int:
    """Requests the front-end has seen (the socket's and the v2 doors'; never a lane call)."""
    return c.info()["stats"]["requests_total"]


def lane_calls(c) -> int:
    """Calls the model's workers have run (lane calls and socket requests alike)."""
    return sum(w["requests"] for w in c.info()["workers"] if w["model"] == "m")


def windows(c) -> int:
    status = c.canary("m", "status")
    return status["stable"]["requests"] + status["candidate"]["requests"]


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    add_version(repo, "m", 1)
    return repo


def test_a_split_canary_carries_its_share_of_lane_calls_on_lanes_and_counts_each_in_its_windows(tmp_path, repo):
    n = 1000
    with serving(tmp_path, "", server_section=repo_server_section(repo)) as srv:
        add_version(repo, "m", 2)
        x = np.ones(2, np.float32)
        with srv.client() as c:
            c.infer("m", {"x": x})
            c.canary("m", "start", version=2, plan={"steps": [30, 100], **HOLD})
            socket_before, workers_before = socket_requests(c), lane_calls(c)
            seen = {1: 0, 2: 0}
            for _ in range(n):
                seen[served_version(x, c.infer("m", {"x": x})["y"])] += 1
            assert socket_requests(c) == socket_before  # not one crossed the socket
            assert lane_calls(c) - workers_before == n
            # 30 % of 1000: sd 14.5; five of them either way (a false failure once in 3.5 million runs)
            assert 300 - 73 <= seen[2] <= 300 + 73, seen
            wait_for(lambda: windows(c) == n, "every lane call in the rollout's windows", timeout=10)
            status = c.canary("m", "status")
            assert status["stable"]["requests"] == seen[1] and status["candidate"]["requests"] == seen[2], status
            assert status["stable"]["p50_ms"] is not None and status["candidate"]["errors"] == 0


def test_sticky_keys_stay_on_the_version_the_socket_gives_them_through_lanes(tmp_path, repo):
    with serving(tmp_path, "", server_section=repo_server_section(repo)) as srv:
        add_version(repo, "m", 2)
        x = np.ones(2, np.float32)
        with srv.client() as c, srv.client(lanes=False) as socket_client:
            c.canary("m", "start", version=2, plan={"steps": [50, 100], **HOLD})
            keys = [f"key-{k}" for k in range(24)]
            by_socket = {k: served_version(x, socket_client.infer("m", {"x": x}, key=k)["y"]) for k in keys}
            before = socket_requests(c)
            by_lane = {k: {served_version(x, c.infer("m", {"x": x}, key=k)["y"]) for _ in range(8)} for k in keys}
            assert socket_requests(c) == before  # through lanes
            assert by_lane == {k: {v} for k, v in by_socket.items()}  # one version each: the server's
            assert set(by_socket.values()) == {1, 2}  # (24 keys at 50 %: both versions serve some)


def test_a_candidate_failing_through_lanes_is_rolled_back_and_lane_clients_then_reach_only_the_stable(tmp_path, repo):
    with serving(tmp_path, "", server_section=repo_server_section(repo)) as srv:
        add_version(repo, "m", 2, FLAKY)  # fails 5 % of its requests (MODEL_ERROR)
        plan = {"steps": [50, 100], "hold_s": 1e6, "window_s": 30, "min_samples": 100,
                "max_error_rate_increase": 0.01, "max_p99_ratio": None}
        rng = np.random.default_rng(5)
        with srv.client() as c:
            c.canary("m", "start", version=2, plan=plan)
            before = socket_requests(c)
            failures, status = [], None
            for i in range(20000):
                x = rng.uniform(0, 1, 2).astype(np.float32)
                try:
                    c.infer("m", {"x": x})
                except ShmserveError as exc:
                    failures.append(exc)
                if i % 50 == 0:
                    status = c.canary("m", "status")
                    if status["state"] in TERMINAL:
                        break
            assert status["state"] == "rolled_back", status
            assert any("max_error_rate_increase" in d["reason"] for d in status["decisions"]), status["decisions"]
            assert failures and all(exc.code is ErrorCode.MODEL_ERROR and "flaky candidate" in exc.message
                                    for exc in failures), failures[:3]  # the candidate's own errors only
            answers = [served_version(x, c.infer("m", {"x": x})["y"])
                       for x in rng.uniform(0, 1, (300, 2)).astype(np.float32)]
            assert set(answers) == {1}
            # The rollback, too, was seen through lanes: at most the one call queued in the candidate's lane
            # as it moved to the stable version went over the socket (refused unrun there: sent again).
            assert socket_requests(c) - before <= 1


def test_zero_copy_takes_a_version_and_a_key(tmp_path, repo):
    with serving(tmp_path, "", server_section=repo_server_section(repo)) as srv:
        add_version(repo, "m", 2)
        with srv.client() as c, srv.client(lanes=False) as socket_client:
            c.canary("m", "start", version=2, plan={"steps": [50, 100], **HOLD})
            before = socket_requests(c)
            for version in (1, 2):
                with c.zero_copy("m", {"x": ((2,), np.float32)}, version=version) as call:
                    call.inputs["x"][:] = 1.0
                    assert {served_version(np.ones(2, np.float32), call.run()["y"]) for _ in range(20)} == {version}
                    assert call.region.lane.serves() == version
            for key in ("alpha", "beta", "gamma", "delta", "epsilon", "zeta"):
                want = served_version(np.ones(2, np.float32), socket_client.infer("m", {"x": np.ones(2, np.float32)},
                                                                                  key=key)["y"])
                with c.zero_copy("m", {"x": ((2,), np.float32)}, key=key) as call:
                    call.inputs["x"][:] = 1.0
                    assert {served_version(np.ones(2, np.float32), call.run()["y"]) for _ in range(10)} == {want}
            with c.zero_copy("m", {"x": ((2,), np.float32)}) as call:  # no key: a share of its runs each way
                call.inputs["x"][:] = 1.0
                seen = [served_version(np.ones(2, np.float32), call.run()["y"]) for _ in range(200)]
                assert 100 - 40 <= seen.count(2) <= 100 + 40, seen.count(2)  # (sd 7: more than five)
            assert socket_requests(c) - before == 6  # the socket client's six, and no zero-copy run
            c.canary("m", "abort")
            with c.zero_copy("m", {"x": ((2,), np.float32)}, key="alpha") as call:
                call.inputs["x"][:] = 1.0
                assert served_version(np.ones(2, np.float32), call.run()["y"]) == 1
            with pytest.raises(ShmserveError) as gone:
                c.zero_copy("m", {"x": ((2,), np.float32)}, version=2).run()
            assert gone.value.code in (ErrorCode.UNKNOWN_MODEL, ErrorCode.MODEL_UNAVAILABLE), gone.value


def test_promote_and_abort_move_lane_clients_at_once(tmp_path, repo):
    with serving(tmp_path, "", server_section=repo_server_section(repo)) as srv:
        add_version(repo, "m", 2)
        add_version(repo, "m", 3)
        x = np.ones(2, np.float32)
        with srv.client() as c, srv.client() as admin:
            with c.zero_copy("m", {"x": ((2,), np.float32)}) as call:
                call.inputs["x"][:] = 1.0
                assert served_version(x, c.infer("m", {"x": x})["y"]) == 1
                before = socket_requests(admin)
                admin.canary("m", "start", version=2, plan={"steps": [50, 100], **HOLD})
                assert {served_version(x, c.infer("m", {"x": x})["y"]) for _ in range(60)} == {1, 2}
                assert admin.canary("m", "promote")["state"] == "complete"
                assert {served_version(x, c.infer("m", {"x": x})["y"]) for _ in range(60)} == {2}
                assert {served_version(x, call.run()["y"]) for _ in range(60)} == {2}
                admin.canary("m", "start", version=3, plan={"steps": [50, 100], **HOLD})
                assert {served_version(x, call.run()["y"]) for _ in range(60)} == {2, 3}
                assert admin.canary("m", "abort")["state"] == "aborted"
                assert {served_version(x, c.infer("m", {"x": x})["y"]) for _ in range(60)} == {2}
                assert {served_version(x, call.run()["y"]) for _ in range(60)} == {2}
            assert socket_requests(admin) == before
