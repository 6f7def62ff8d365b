"""What a lifecycle call says while it runs (shmserve/watch.py, console.Steps), in-process: views
from the server's answers, the lines for each change, the watching thread over a fake server,
and progress as plain lines with a fake clock.  The real CLI against a real server is in
test_cli.py (test_load_says_what_it_is_doing_loading_draining_and_done)."""

from __future__ import annotations

import io
import threading
import time

from shmserve.console import Steps
from shmserve.watch import VersionView, Watch, changes, view


def entry(version: int, state: str, ready: int = 1, workers: int = 1, reason: str = "", name: str = "m") -> dict:
    return {"name": name, "version": version, "state": state, "workers_ready": ready, "workers": workers,
            "reason": reason}


def test_a_view_is_the_models_versions_and_a_draining_versions_requests():
    repository = {"models": [entry(1, "draining", 1, 1), entry(2, "ready"), entry(1, "ready", name="other"),
                             {"name": "m", "version": None, "state": "unavailable", "reason": "bad config"}]}
    info = {"workers": [{"model": "m", "version": 1, "inflight": 2}, {"model": "m", "version": 1, "inflight": 1},
                        {"model": "m", "version": 2, "inflight": 5}, {"model": "other", "version": 1, "inflight": 7}]}
    v = view(repository, info, "m")
    assert v == {1: VersionView("draining", 1, 1, 3), 2: VersionView("ready", 1, 1, None)}
    assert view(repository, None, "m")[1].in_flight is None  # info not asked: not known


def test_the_lines_of_a_swap_from_loading_to_unloaded():
    steps = [{1: VersionView("ready")},
             {1: VersionView("ready"), 2: VersionView("loading", 0, 2)},
             {1: VersionView("ready"), 2: VersionView("loading", 1, 2)},
             {1: VersionView("draining", 1, 1, 4), 2: VersionView("ready", 2, 2)},
             {1: VersionView("draining", 1, 1, 4), 2: VersionView("ready", 2, 2)},  # nothing changed: no line
             {1: VersionView("draining", 1, 1, 1), 2: VersionView("ready", 2, 2)},
             {1: VersionView("unloaded", 0, 0, reason="replaced by version 2"), 2: VersionView("ready", 2, 2)}]
    lines = [line for before, after in zip(steps, steps[1:]) for line in changes(before, after)]
    assert lines == ["version 2: loading: 0 of 2 workers ready (each loads the model and warms it up)",
                     "version 2: loading: 1 of 2 workers ready (each loads the model and warms it up)",
                     "version 1: draining: 4 requests in flight (its workers finish them, then stop)",
                     "version 2: ready, 2 of 2 workers ready",
                     "version 1: draining: 1 request in flight (its workers finish them, then stop)",
                     "version 1: unloaded: replaced by version 2"]


def test_a_version_that_goes_from_the_list_is_unloaded_once_and_a_failure_says_why():
    assert changes({1: VersionView("ready"), 2: VersionView("unloaded")}, {}) == ["version 1: unloaded"]
    assert changes({}, {3: VersionView("unavailable", 0, 1, reason="import failed")}) == \
        ["version 3: unavailable: import failed"]
    assert changes({1: VersionView("ready")}, {1: VersionView("restarting", 0, 1)}) == \
        ["version 1: restarting, 0 of 1 worker ready"]


class FakeServer:
    """Answers repository and info from a list of states a test moves through; counts info calls."""

    def __init__(self, states: list[dict]):
        self.states, self.at, self.info_calls, self.closed = states, 0, 0, 0
        self.moved = threading.Event()

    def repository(self) -> dict:
        return self.states[min(self.at, len(self.states) - 1)]

    def info(self) -> dict:
        self.info_calls += 1
        return {"workers": [{"model": "m", "version": 1, "inflight": 2}]}

    def close(self) -> None:
        self.closed += 1


def test_the_watch_reports_changes_from_its_thread_and_the_last_one_at_its_end():
    server = FakeServer([{"models": [entry(1, "ready")]},
                         {"models": [entry(1, "ready"), entry(2, "loading", 0, 1)]},
                         {"models": [entry(1, "draining"), entry(2, "ready")]},
                         {"models": [entry(1, "unloaded", 0, 0, "replaced by version 2"), entry(2, "ready")]}])
    lines: list[str] = []
    with Watch(lambda: server, "m", lines.append, poll_s=0.01):
        assert lines == []  # the state before the call is not news
        for at in (1, 2):
            server.at = at
            for _ in range(3000):  # bounded: the thread polls every 10 ms
                if len(lines) >= at:
                    break
                time.sleep(0.01)
        server.at = 3  # changed as the call ends: reported by the last look
    assert lines[0].startswith("version 2: loading")
    assert "version 1: draining: 2 requests in flight (its workers finish them, then stop)" in lines
    assert lines[-1] == "version 1: unloaded: replaced by version 2"
    assert server.info_calls >= 1 and server.closed == 1


def test_a_watch_whose_server_is_gone_says_nothing_and_ends():
    def connect():
        raise ConnectionRefusedError("no server")

    lines: list[str] = []
    with Watch(connect, "m", lines.append, poll_s=0.01):
        time.sleep(0.05)
    assert lines == []


def test_steps_piped_are_plain_lines_with_the_time_so_far():
    now = [100.0]
    stream = io.StringIO()
    steps = Steps(stream=stream, clock=lambda: now[0])
    steps.step("version 2: loading")
    now[0] += 12.25
    steps.step("version 2: ready")
    steps.close()
    steps.close()  # idempotent
    assert stream.getvalue() == "[  0.0 s] version 2: loading\n[ 12.2 s] version 2: ready\n"
