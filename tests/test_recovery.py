"""Recovery through real processes: workers killed from outside while clients send, the restart
back-off that starts over after a healthy run, and a crash loop that still backs off and is reported.

A request for a model whose workers are all restarting waits for the restart (within its timeout)
instead of failing; only the request a worker was running when it died fails (WORKER_CRASHED).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from shmserve import ErrorCode, ShmserveError

from helpers.server import serving, wait_for

IDENTITY = """
[[models]]
name = "identity"
backend = "python"
path = "shmserve.models:identity"
"""

CRASH_LOOP = """
[[models]]
name = "crashy"
backend = "python"
path = "serving_models:dies_soon_after_load"
[models.options]
factory = true"""


def worker_of(srv, model: str) -> dict:
    (worker,) = [w for w in srv.info()["workers"] if w["model"] == model]
    return worker


def ready_worker(srv, model: str, not_pid: int | None = None) -> dict:
    """The model's worker once it is ready (and, with ``not_pid``, a new process)."""
    return wait_for(lambda: (w := worker_of(srv, model))["state"] == "ready" and w["pid"] != not_pid and w,
                    f"a ready worker of {model}")


def restart_delays(log: str) -> list[float]:
    """The restart delays the server logged, in order."""
    return [float(d) for d in re.findall(r"restarting (?:worker \d+|it) in ([\d.]+) s", log)]


def kill_and_see_it_restarting(srv, model: str) -> dict:
    """SIGKILL the model's worker from outside; returns its entry once the server knows it died."""
    victim = worker_of(srv, model)["pid"]
    os.kill(victim, signal.SIGKILL)
    return wait_for(lambda: (w := worker_of(srv, model))["state"] == "restarting" and w, "the death")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("recovery"), IDENTITY,
                 server_section="request_timeout_s = 30\nrestart_healthy_s = 1.5") as srv:
        yield srv


def test_requests_sent_while_the_worker_restarts_wait_and_run_on_the_restarted_worker(server):
    """Killed from outside: requests sent while the model has no ready worker are not refused;
    they wait and are answered by the new process, and the restart is counted once."""
    before = ready_worker(server, "identity")
    time.sleep(1.6)  # served restart_healthy_s: this death is restarted after the first delay
    logged = len(server.log())
    dead = kill_and_see_it_restarting(server, "identity")
    assert dead["last_exit"] == "killed by SIGKILL" and dead["crash_streak"] == 1
    assert dead["restart_in_s"] is None or dead["restart_in_s"] <= 0.5  # None: started again already
    results, errors = [], []

    def call(i):
        try:
            with server.client() as c:
                results.append(c.infer("identity", {"x": np.full(64, i, np.uint8)})["y"].tolist() == [i] * 64)
        except ShmserveError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and results == [True] * 8
    after = ready_worker(server, "identity")
    assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"] + 1
    assert restart_delays(server.log()[logged:]) == [0.5]
    with server.client() as c:
        assert c.health()["models"]["identity"]["crash_loop"] is False


def test_a_burst_of_kills_backs_off_and_a_healthy_run_starts_the_back_off_over(server):
    """Killed as soon as it is ready, again and again: each restart waits twice as long (a crash
    streak).  Once it has served restart_healthy_s the streak is over: the next kill is restarted
    after the first delay again.  A client sending all along is never refused: every answer is
    right, or WORKER_CRASHED for a request the worker was running when it died."""
    stop, outcomes = threading.Event(), []

    def client():
        with server.client() as c:
            i = 0
            while not stop.is_set():
                i = (i + 1) % 250
                try:
                    outcomes.append(c.infer("identity", {"x": np.full(16, i, np.uint8)})["y"].tolist() == [i] * 16)
                except ShmserveError as exc:
                    outcomes.append(exc.code)

    sender = threading.Thread(target=client)
    sender.start()
    try:
        pid = ready_worker(server, "identity")["pid"]
        time.sleep(1.6)  # a healthy run first: the streak starts from nothing
        logged, streaks = len(server.log()), []
        for _ in range(3):
            streaks.append(kill_and_see_it_restarting(server, "identity")["crash_streak"])
            pid = ready_worker(server, "identity", not_pid=pid)["pid"]
        assert streaks == [1, 2, 3] and restart_delays(server.log()[logged:]) == [0.5, 1.0, 2.0]
        with server.client() as c:
            assert c.health()["models"]["identity"]["crash_loop"] is True  # three quick deaths
        wait_for(lambda: worker_of(server, "identity")["crash_streak"] == 0, "the streak to end")
        with server.client() as c:
            assert c.health()["models"]["identity"]["crash_loop"] is False
        logged = len(server.log())
        assert kill_and_see_it_restarting(server, "identity")["crash_streak"] == 1
        ready_worker(server, "identity", not_pid=pid)
        assert restart_delays(server.log()[logged:]) == [0.5]
    finally:
        stop.set()
        sender.join(60)
    assert outcomes.count(True) > 0
    assert set(outcomes) <= {True, ErrorCode.WORKER_CRASHED}, set(outcomes)
    assert outcomes.count(ErrorCode.WORKER_CRASHED) <= 4  # at most the one running at each kill
    assert "back-off reset" in server.log()


def test_a_crash_loop_still_backs_off_and_is_reported(tmp_path):
    """A model whose worker dies right after loading, every time: restarted with a growing delay,
    shown as a crash loop by health, info (how it died) and inspect, and a request for it is
    answered in time with the reason (MODEL_UNAVAILABLE is only for a model that cannot be loaded:
    test_serving's "broken")."""
    with serving(tmp_path, CRASH_LOOP, server_section="request_timeout_s = 30") as srv:
        wait_for(lambda: worker_of(srv, "crashy")["crash_streak"] >= 3, "three deaths", timeout=60)
        worker = worker_of(srv, "crashy")
        assert worker["last_exit"] == "exit 1 (error)" and worker["restarts"] >= 3
        with srv.client() as c:
            health = c.health()
            assert health["status"] == "degraded" and health["models"]["crashy"]["crash_loop"] is True
            t0 = time.monotonic()
            try:  # it may catch the worker in one of its short lives
                c.infer("crashy", {"x": np.ones(2, np.float32)}, timeout=0.5)
            except ShmserveError as exc:
                assert exc.code in (ErrorCode.TIMEOUT, ErrorCode.MODEL_UNAVAILABLE, ErrorCode.WORKER_CRASHED), exc
                assert exc.code is ErrorCode.WORKER_CRASHED or "crash-looping" in exc.message, exc.message
            assert time.monotonic() - t0 < 10
        snap = json.loads(subprocess.run([sys.executable, "-m", "shmserve.cli", "inspect", "--instance", srv.instance,
                                          "--json"], capture_output=True, text=True, timeout=60).stdout)
        (entry,) = [w for w in snap["workers"] if w["model"] == "crashy"]
        assert entry["crash_streak"] >= 3
        assert any("crash-looping" in p and "crashy" in p for p in snap["problems"]), snap["problems"]
        log = srv.log()
        assert "is crash-looping" in log
        delays = restart_delays(log)
        assert delays[:3] == [0.5, 1.0, 2.0] and all(b == min(2 * a, 30.0) for a, b in zip(delays, delays[1:])), log
