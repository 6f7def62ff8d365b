"""Cancellation that frees work (issue 29 part 3), through a real server on every path.

One server, one worker of ``gated`` (``serving_models.gated``): every run records its tag in a
file, and a run with ``hold`` waits until the test opens its gate, so the worker is busy while
a test gives up on other calls queued behind it.  For each path — the socket (a cancelled
asyncio task, an interrupted blocking call, a closed connection), a lane (``Client.infer`` and
``zero_copy``: a timeout, an interrupt, a cancelled task), HTTP (a client that disconnects)
and gRPC (a cancelled call, a deadline) — the test checks that the request given up on before
a worker claimed it is never run (its tag never recorded, and the worker's own count of runs
agrees), that the server counts it where it happened (``info``'s ``cancelled``; a lane call
never reaches the server: its client counts it) and that nothing is left held (slots, arena
space, the lane's slot free at once).  ``tools/bench_cancel.py``'s storm runs here bounded
(500 cancellations).  Hostile CANCEL frames are ignored or refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from shmserve import AsyncClient, lanes, protocol
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.layout import LANE_SLOTS
from shmserve.protocol import Kind

from helpers import raw_frames, raw_http
from helpers.server import held_call, scrape_text, serving, wait_for
from helpers.v2_server import auth, python_model, triton_client, v2_serving

MODEL = "gated"
ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_cancel", ROOT / "tools" / "bench_cancel.py")
bench_cancel = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_cancel)

tags = itertools.count(1)  # every call of this module has its own tag (0 is the warm-up's)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    work = tmp_path_factory.mktemp("cancel")
    record, gates = work / "record", work / "gates"
    gates.mkdir()
    record.touch()
    models = python_model(MODEL, "serving_models:gated",
                          options={"factory": True, "record": str(record), "gates": str(gates)})
    # Main's own door serves the socket here (the door processes' lanes: ``test_a_door_process_...``).
    metrics = str(work / "metrics.sock")
    with v2_serving(work, models=models, deadlines=30, extra="doors = 0\n", extra_args=["--metrics", metrics]) as s:
        s.record, s.gates, s.metrics = record, gates, metrics
        yield s


def x(tag: int, hold: bool = False) -> np.ndarray:
    return np.array([tag, 1.0 if hold else 0.0], np.float32)


def infer_frame(rid: int, tag: int, hold: bool = False) -> bytes:
    """A raw INFER of MODEL on tag ``tag``, payload included."""
    meta = {"id": rid, "model": MODEL, "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}]}
    return protocol.encode_frame(Kind.INFER, meta, 8) + x(tag, hold).tobytes()


def ran(srv) -> list[int]:
    """The tags the worker ran, in order."""
    return [int(line) for line in srv.record.read_text().split()]


def cancelled(srv) -> dict[str, int]:
    [entry] = [e for e in srv.info()["cancelled"] if e["model"] == MODEL]
    return {stage: entry[stage] for stage in ("queued", "running", "answered")}


def worker(srv) -> dict:
    [w] = [w for w in srv.info()["workers"] if w["model"] == MODEL]
    return w


def queued_behind(srv, n: int) -> None:
    """Until the worker holds ``n`` requests of the front-end (its held one and those behind it)."""
    wait_for(lambda: worker(srv)["inflight"] == n, f"{n} requests with the worker")


@contextlib.contextmanager
def held(srv):
    """The worker busy with a held call (over the socket) until the block ends; yields its tag.
    On the way out its gate opens, the call is answered, and the server ends idle."""
    tag = next(tags)
    with held_call(srv, MODEL, x(tag, hold=True), lambda: tag in ran(srv), srv.gates / str(tag)):
        yield tag
    srv.wait_idle()


def stage_counts_grow(srv, before: dict, **grown) -> None:
    want = {stage: before[stage] + grown.get(stage, 0) for stage in before}
    wait_for(lambda: cancelled(srv) == want, f"the server to count {grown}")


def runs_match(srv, runs_before: int, ran_before: int) -> None:
    """The worker's own count of runs moved exactly as the model's record did."""
    assert worker(srv)["requests"] - runs_before == len(ran(srv)) - ran_before


class Interrupted(BaseException):
    """What the signal handler raises in the waiting thread (as KeyboardInterrupt would)."""


@contextlib.contextmanager
def interrupt_when(ready):
    """Interrupt the main thread, blocked in a call, with a signal once ``ready()`` is true (as a
    Ctrl-C would: the handler raises there)."""
    main = threading.main_thread().ident

    def raise_it(*_):
        raise Interrupted()

    old = signal.signal(signal.SIGUSR1, raise_it)
    stop = threading.Event()

    def watch():
        wait_for(lambda: stop.is_set() or ready(), "the call to wait", timeout=60)
        if not stop.is_set():
            signal.pthread_kill(main, signal.SIGUSR1)

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(60)
        signal.signal(signal.SIGUSR1, old)


def infer_lane(client):
    """The ClientLane ``Client.infer`` uses for MODEL (open once a call went through it)."""
    return client._core.infer_lanes[MODEL].lane


# -- the socket ------------------------------------------------------------------------------

def test_a_cancelled_asyncio_task_takes_its_socket_request_back_before_a_worker_runs_it(srv):
    """The task's CANCEL reaches the server at once: the request is answered, counted as
    cancelled before claim, and never run; the connection serves the next call."""
    before, runs, ran_before = cancelled(srv), worker(srv)["requests"], len(ran(srv))
    tag, later = next(tags), next(tags)

    async def main():
        async with AsyncClient(srv.socket, lanes=False, timeout=60) as c:
            with held(srv):
                task = asyncio.ensure_future(c.infer(MODEL, {"x": x(tag)}))
                await asyncio.to_thread(queued_behind, srv, 2)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await asyncio.to_thread(stage_counts_grow, srv, before, queued=1)
                await asyncio.to_thread(queued_behind, srv, 1)  # taken off the worker's queue
            return (await c.infer(MODEL, {"x": x(later)}))["y"]

    assert asyncio.run(main()).tolist() == [2 * later, 0]
    assert tag not in ran(srv) and later in ran(srv)
    runs_match(srv, runs, ran_before)


def test_an_interrupted_blocking_call_takes_its_socket_request_back(srv):
    """Ctrl-C in ``Client.infer`` (over the socket) sends a CANCEL before the interrupt goes on."""
    before, runs, ran_before = cancelled(srv), worker(srv)["requests"], len(ran(srv))
    tag, later = next(tags), next(tags)
    with srv.client(lanes=False, timeout=60) as c:
        with held(srv):
            with interrupt_when(lambda: worker(srv)["inflight"] == 2), pytest.raises(Interrupted):
                c.infer(MODEL, {"x": x(tag)})
            stage_counts_grow(srv, before, queued=1)
        assert c.infer(MODEL, {"x": x(later)})["y"].tolist() == [2 * later, 0]  # the answer it discarded
    assert tag not in ran(srv)
    runs_match(srv, runs, ran_before)


def test_a_closed_connection_takes_its_queued_request_back(srv):
    """A client that closes its connection with a request queued: dropped, counted, never run."""
    tag = next(tags)
    gone_before_claim(srv, lambda: raw_frames.connect(srv.socket), infer_frame(1, tag), tag)
    shown_everywhere(srv)


def gone_before_claim(srv, connect, request: bytes, tag: int) -> None:
    """``request`` (of ``tag``) sent on a new connection (``connect()``), queued behind the held
    worker, then the connection closed: dropped before a worker claimed it, counted so, never
    run (the worker's own count of runs agrees)."""
    before, runs, ran_before = cancelled(srv), worker(srv)["requests"], len(ran(srv))
    with held(srv):
        s = connect()
        s.sendall(request)
        queued_behind(srv, 2)
        s.close()
        stage_counts_grow(srv, before, queued=1)
        queued_behind(srv, 1)
    assert tag not in ran(srv)
    runs_match(srv, runs, ran_before)


def shown_everywhere(srv) -> None:
    """The counts ``info`` gives are the metric's and the repository's (what ``inspect`` shows)."""
    counts = cancelled(srv)
    text = scrape_text(srv.metrics)
    for stage, n in counts.items():
        line = f'shmserve_cancelled_requests_total{{model="{MODEL}",stage="{stage}",version="1"}} {float(n)}'
        assert line in text.splitlines(), (line, [t for t in text.splitlines() if "cancelled" in t])
    with srv.client() as c:
        [entry] = [m for m in c.repository()["models"] if m["name"] == MODEL]
    assert entry["cancelled"] == counts
    from rich.console import Console

    from shmserve.inspection import render_lifecycle

    console = Console(width=200, record=True)
    console.print(render_lifecycle({"models": [entry]}))
    assert f"{counts['queued']}/{counts['running']}/{counts['answered']}" in console.export_text()


def test_a_cancel_of_a_running_request_answers_at_once_and_discards_its_result(srv):
    """The request the worker runs cannot be stopped: it is answered CANCELLED at once, counted as
    running, and its slot is freed when the worker finishes (the server ends idle)."""
    before = cancelled(srv)
    s = raw_frames.connect(srv.socket)
    tag = next(tags)
    s.sendall(infer_frame(7, tag, hold=True))
    wait_for(lambda: tag in ran(srv), "the call to run")
    s.sendall(protocol.encode_frame(Kind.CANCEL, {"id": 7}))
    [answer] = raw_frames.read_frames(s, 1)
    assert answer.kind is Kind.ERROR and answer.meta["id"] == 7 and answer.meta["code"] == "cancelled"
    stage_counts_grow(srv, before, running=1)
    assert srv.info()["stats"]["slots_in_use"] == 1  # the worker still has it
    (srv.gates / str(tag)).touch()
    s.close()
    srv.wait_idle()


def test_hostile_cancels_are_ignored_or_refused_and_touch_nobody_elses_request(srv):
    """A CANCEL of an id never sent, of an id already answered, twice, or of another connection's
    request changes nothing; one without a valid id is refused BAD_FRAME (an error with no id) and
    the connection goes on."""
    before = cancelled(srv)
    tag = next(tags)
    with held(srv):
        victim = raw_frames.connect(srv.socket)
        victim.sendall(infer_frame(5, tag))
        queued_behind(srv, 2)
        hostile = raw_frames.connect(srv.socket)
        for rid in (5, 0, 2**63 - 1, 999):
            hostile.sendall(protocol.encode_frame(Kind.CANCEL, {"id": rid}))
        hostile.sendall(protocol.encode_frame(Kind.CANCEL, {"id": "5"}))
        [refusal] = raw_frames.read_frames(hostile, 1)
        assert refusal.kind is Kind.ERROR and refusal.meta["id"] is None and refusal.meta["code"] == "bad_frame"
        hostile.sendall(protocol.encode_frame(Kind.HEALTH, {"id": 1}))
        [health] = raw_frames.read_frames(hostile, 1)
        assert health.kind is Kind.REPLY
        hostile.close()
    [answer] = raw_frames.read_frames(victim, 1)
    assert answer.kind is Kind.RESULT and answer.meta["id"] == 5
    victim.sendall(protocol.encode_frame(Kind.CANCEL, {"id": 5}))  # answered already: ignored
    victim.sendall(protocol.encode_frame(Kind.HEALTH, {"id": 6}))
    [health] = raw_frames.read_frames(victim, 1)
    assert health.kind is Kind.REPLY and health.meta["id"] == 6
    victim.close()
    assert tag in ran(srv) and cancelled(srv) == before


# -- lanes -----------------------------------------------------------------------------------

def lane_client(srv):
    """A client whose ``infer`` goes through its lane of MODEL (opened by a first call)."""
    c = srv.client(timeout=60)
    warm = next(tags)
    assert c.infer(MODEL, {"x": x(warm)})["y"].tolist() == [2 * warm, 0]
    assert infer_lane(c).taken_back == 0
    return c


def test_a_lane_call_that_times_out_is_taken_back_and_its_slot_is_free_at_once(srv):
    """``Client.infer`` through a lane, timed out while the worker is busy: the client takes its
    slot back (the worker's claim fails: it never runs) and the slot is free again at once."""
    runs, ran_before = worker(srv)["requests"], len(ran(srv))
    with lane_client(srv) as c:
        lane = infer_lane(c)
        tag = next(tags)
        with held(srv):
            with pytest.raises(ShmserveError) as info:
                c.infer(MODEL, {"x": x(tag)}, timeout=0.5)
            assert info.value.code is ErrorCode.TIMEOUT
            assert lane.taken_back == 1 and not lane.abandoned and lane.free_slots() == LANE_SLOTS
        later = next(tags)
        assert c.infer(MODEL, {"x": x(later)})["y"].tolist() == [2 * later, 0]
    assert tag not in ran(srv) and later in ran(srv)
    runs_match(srv, runs, ran_before)


def test_an_interrupted_lane_call_is_taken_back(srv):
    """Ctrl-C while ``Client.infer`` waits on its lane: taken back, never run."""
    with lane_client(srv) as c:
        lane = infer_lane(c)
        tag = next(tags)
        with held(srv):
            with interrupt_when(lambda: lanes.has_pending(lane.buf)), pytest.raises(Interrupted):
                c.infer(MODEL, {"x": x(tag)})
            assert lane.taken_back == 1 and lane.free_slots() == LANE_SLOTS
    assert tag not in ran(srv)


def test_a_cancelled_asyncio_lane_call_is_taken_back(srv):
    """``AsyncClient.infer`` through its lane, its task cancelled: taken back, never run."""
    tag = next(tags)

    async def main():
        async with AsyncClient(srv.socket, timeout=60) as c:
            warm = next(tags)
            await c.infer(MODEL, {"x": x(warm)})
            lane = c._core.infer_lanes[MODEL].lane
            with held(srv):
                task = asyncio.ensure_future(c.infer(MODEL, {"x": x(tag)}))
                await asyncio.sleep(0)
                while not lanes.has_pending(lane.buf):
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert lane.taken_back == 1 and lane.free_slots() == LANE_SLOTS

    asyncio.run(main())
    assert tag not in ran(srv)


def test_a_zero_copy_call_that_times_out_is_taken_back(srv):
    """``zero_copy`` through its lane, timed out while the worker is busy: taken back, never run,
    and the call runs again on the same slot space once the worker is free."""
    with srv.client(timeout=60) as c:
        with c.zero_copy(MODEL, {"x": ((2,), np.float32)}) as call:
            tag = next(tags)
            call.inputs["x"][:] = x(tag)
            lane = call.region.lane
            with held(srv):
                with pytest.raises(ShmserveError) as info:
                    call.run(timeout=0.5)
                assert info.value.code is ErrorCode.TIMEOUT
            assert lane.taken_back == 1 and not lane.abandoned
            again = next(tags)
            call.inputs["x"][:] = x(again)
            assert call.run()["y"].tolist() == [2 * again, 0]
    assert tag not in ran(srv) and again in ran(srv)


# -- the v2 doors ----------------------------------------------------------------------------

def test_an_http_client_that_disconnects_has_its_request_dropped(srv):
    """A v2 HTTP request queued behind the busy worker, its client gone: dropped, counted, never run."""
    tag = next(tags)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": x(tag).tolist()}]}
    gone_before_claim(srv, lambda: raw_http.connect(srv.http), raw_http.json_infer(MODEL, body, auth()), tag)


def test_an_http_client_that_disconnects_while_its_request_runs_is_counted_and_freed_after(srv):
    """Its request runs on: counted as cancelled while running, its slot held until the worker
    finishes, then freed (its result never written anywhere)."""
    before, tag = cancelled(srv), next(tags)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": x(tag, hold=True).tolist()}]}
    s = raw_http.connect(srv.http)
    s.sendall(raw_http.json_infer(MODEL, body, auth()))
    wait_for(lambda: tag in ran(srv), "the call to run")
    s.close()
    stage_counts_grow(srv, before, running=1)
    assert srv.info()["stats"]["slots_in_use"] == 1
    (srv.gates / str(tag)).touch()
    srv.wait_idle()


def grpc_infer_input(tag: int):
    import tritonclient.grpc as grpcclient

    inp = grpcclient.InferInput("x", [2], "FP32")
    inp.set_data_from_numpy(x(tag))
    return [inp]


def test_a_cancelled_grpc_call_has_its_request_dropped(srv):
    """A gRPC ModelInfer cancelled by its client (``async_infer``'s context): dropped, counted
    before claim, never run."""
    import tritonclient.grpc as grpcclient

    before, tag = cancelled(srv), next(tags)
    with triton_client(grpcclient, srv.grpc) as client, held(srv):
        done = threading.Event()
        ctx = client.async_infer(MODEL, grpc_infer_input(tag), callback=lambda result, error: done.set())
        queued_behind(srv, 2)
        ctx.cancel()
        stage_counts_grow(srv, before, queued=1)
        queued_behind(srv, 1)
        assert done.wait(30)
    assert tag not in ran(srv)


def test_a_grpc_deadline_drops_the_request(srv):
    """A gRPC call whose deadline passes while it is queued: the client gets DEADLINE_EXCEEDED
    and the server drops the request (counted before claim); it never runs."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    before, tag = cancelled(srv), next(tags)
    with triton_client(grpcclient, srv.grpc) as client, held(srv):
        with pytest.raises(InferenceServerException, match="(?i)deadline"):
            client.infer(MODEL, grpc_infer_input(tag), client_timeout=1.0)
        stage_counts_grow(srv, before, queued=1)
        queued_behind(srv, 1)
    assert tag not in ran(srv)


# -- the target, bounded ---------------------------------------------------------------------

def test_500_cancellations_none_run_that_were_cancelled_before_claim(srv):
    """tools/bench_cancel.py's storm: 1000 requests to a slow model, every odd one cancelled right
    after it is sent.  Of those the server took back before a worker claimed them, the worker
    ran none; the rest were answered; the worker's count of runs is the model's record."""
    result = bench_cancel.storm(srv.socket, srv.record, cancels=500, first_tag=next(tags) + 1_000_000,
                                window=32, sleep_s=0.001)
    counted = result["server_counted"]
    assert result["cancels_sent"] == 500
    assert counted["queued"] > 0 and sum(counted.values()) <= 500
    assert result["cancelled_before_claim_and_run"] == 0
    assert result["never_run_but_not_answered_cancelled"] == 0
    assert result["not_cancelled_answered_ok"] == 500
    assert result["worker_runs"] == result["ran"] == 1000 - result["cancelled_never_run"]
    srv.wait_idle()


# -- a door process (docs/doors.md) -----------------------------------------------------------

def test_a_door_process_takes_back_the_lane_call_its_client_cancels(tmp_path):
    """With door processes, a socket INFER is a lane call of the door: its CANCEL (read after the
    INFER, on the same connection) takes the lane slot back before the worker claims it, and is
    answered CANCELLED in order; a closed connection's queued call is taken back too.  The door
    reports both to main, which counts them with its own (``info``'s ``cancelled``)."""
    record, gates = tmp_path / "record", tmp_path / "gates"
    gates.mkdir()
    record.touch()
    models = python_model(MODEL, "serving_models:gated",
                          options={"factory": True, "record": str(record), "gates": str(gates)})
    with serving(tmp_path, models, server_section="doors = 1\n") as s:
        s.record, s.gates = record, gates
        with held(s):
            c = raw_frames.connect(s.socket)
            cancelled_tag, closed_tag = next(tags), next(tags)
            c.sendall(infer_frame(3, cancelled_tag) + protocol.encode_frame(Kind.CANCEL, {"id": 3}))
            [answer] = raw_frames.read_frames(c, 1)
            assert answer.kind is Kind.ERROR and answer.meta == {"id": 3, "code": "cancelled",
                                                                 "message": "cancelled by the client"}
            gone = raw_frames.connect(s.socket)
            gone.sendall(infer_frame(3, closed_tag) + protocol.encode_frame(Kind.HEALTH, {"id": 4}))
            raw_frames.read_frames(gone, 1)  # (the health answer: its INFER was taken before it)
            gone.close()
            wait_for(lambda: cancelled(s) == {"queued": 2, "running": 0, "answered": 0},
                     "main to count the door's two calls as taken back before claim")
            later = next(tags)
            c.sendall(infer_frame(5, later))
        [result] = raw_frames.read_frames(c, 1)
        assert result.kind is Kind.RESULT and result.meta["id"] == 5
        c.close()
        assert cancelled_tag not in ran(s) and closed_tag not in ran(s) and later in ran(s)
