"""A door process's deadlines are main's door's (docs/doors.md): through a real server with
``doors = 2``, on a connection of each door, a half-sent frame is closed after ``frame_timeout_s``,
a stalled upload (a lane call's or a relayed frame's) is answered TIMEOUT after
``upload_timeout_s``, a client that never reads is closed after ``stall_timeout_s``, and a
request's own deadline is answered TIMEOUT; the door then holds nothing of them."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from shmserve import protocol
from shmserve.protocol import Kind

from helpers.raw_frames import connect, infer_frame, read_frames, read_to_end
from helpers.server import SLOW_MODEL, serving, wait_for
from helpers.v2_server import python_model

STALL_S, FRAME_S, UPLOAD_S = 2, 2, 2
SECTION = (f"doors = 2\nmax_request_bytes = 4194304\nstall_timeout_s = {STALL_S}\nframe_timeout_s = {FRAME_S}\n"
           f"upload_timeout_s = {UPLOAD_S}\n")
MODELS = python_model("identity", "shmserve.models:identity", instances=2) + SLOW_MODEL


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("door_deadlines"), MODELS, server_section=SECTION) as s:
        wait_for(lambda: all(d["up"] for d in s.info()["doors"]), "both doors up")
        yield s


def on_door(srv, door: int, rcvbuf: int | None = None) -> socket.socket:
    """A raw connection the door process ``door`` serves (bounded: the kernel picks the door)."""
    for _ in range(400):
        s = connect(srv.socket, rcvbuf=rcvbuf)
        s.sendall(protocol.encode_frame(Kind.INFO, {"id": 0}))
        [reply] = read_frames(s, 1)
        if reply.meta["door_process"] == door:
            return s
        s.close()
    raise AssertionError(f"door {door} was not reached in 400 connections")


def door_holds_nothing(srv) -> None:
    """Every door's lane calls and ledger counts are back to nothing (the doors report every 0.1 s)."""
    wait_for(lambda: all(d["in_flight"] == 0 and d["held_requests"] == 0 for d in srv.info()["doors"]),
             "the doors to hold nothing")
    with srv.client(lanes=False) as c:
        x = np.arange(4096, dtype=np.uint8)
        np.testing.assert_array_equal(c.infer("identity", {"x": x})["y"], x)


@pytest.mark.parametrize("door", [0, 1])
@pytest.mark.parametrize("cut", [5, protocol.HEADER_SIZE + 10], ids=["header", "metadata"])
def test_a_half_sent_frame_is_closed_after_the_frame_timeout(srv, door, cut):
    s = on_door(srv, door)
    try:
        s.sendall(protocol.encode_frame(Kind.HEALTH, {"id": 1, "padding": "x" * 100})[:cut])
        frames = read_to_end(s)
    finally:
        s.close()
    assert [(f.kind, f.meta["code"]) for f in frames] == [(Kind.ERROR, "bad_frame")]
    assert f"within {FRAME_S} s (server.frame_timeout_s)" in frames[0].meta["message"]


@pytest.mark.parametrize("door", [0, 1])
@pytest.mark.parametrize("n", [4096, 1 << 20], ids=["lane_call", "relayed"])
def test_a_stalled_upload_is_answered_timeout_and_the_door_holds_nothing(srv, door, n):
    """4 KiB: a lane call of the door, its slot reserved while its payload arrives; 1 MiB: more than
    a lane slot's part, held by the door to relay it."""
    s = on_door(srv, door)
    try:
        s.sendall(infer_frame(7, n)[:-(n - 1000)])  # the header and 1000 bytes of the payload
        frames = read_to_end(s)
    finally:
        s.close()
    assert [(f.kind, f.meta["id"], f.meta["code"]) for f in frames] == [(Kind.ERROR, 7, "timeout")]
    assert f"the payload of request 7 did not all arrive within {UPLOAD_S} s (server.upload_timeout_s)" \
        in frames[0].meta["message"]
    door_holds_nothing(srv)


@pytest.mark.parametrize("door", [0, 1])
def test_a_client_that_never_reads_is_closed_after_the_stall_timeout(srv, door):
    s = on_door(srv, door, rcvbuf=4096)
    mark = len(srv.log())
    s.settimeout(STALL_S + 30)
    try:
        sent = 0
        try:
            for rid in range(1, 2000):  # 256 KiB answers, never read: the door stops reading us
                s.sendall(infer_frame(rid, 256 * 1024))
                sent += 1
        except OSError:
            pass  # closed by the door (reset), or our send timed out
        wait_for(lambda: "(server.stall_timeout_s)" in srv.log()[mark:], "the stall to be logged")
    finally:
        s.close()
    assert sent < 2000, "the door read everything a client that never reads sent"
    door_holds_nothing(srv)


@pytest.mark.parametrize("door", [0, 1])
def test_a_requests_own_deadline_is_answered_timeout(srv, door):
    s = on_door(srv, door)
    try:
        x = np.array([3.0], np.float32)  # the model sleeps 3 s; the request gives it 0.3
        meta = {"id": 5, "model": "slow", "timeout_s": 0.3,
                "inputs": [{"name": "x", "dtype": "float32", "shape": [1]}]}
        s.sendall(protocol.encode_frame(Kind.INFER, meta, x.nbytes) + x.tobytes())
        [f] = read_frames(s, 1)
    finally:
        s.close()
    assert (f.kind, f.meta["id"], f.meta["code"]) == (Kind.ERROR, 5, "timeout")
    door_holds_nothing(srv)
