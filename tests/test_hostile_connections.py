"""Hostile connections through a real server: what one client can make the server hold is bounded,
and a client that stalls is cut off in time, while others go on being served.

The attackers speak raw protocol frames over their own sockets (``shmserve.protocol``).  The
server runs with short deadlines and small limits from its config, so every wait here is bounded
and nothing asserts how fast the server is, except that a well-behaved client is answered within
a second while an attacker holds what it may.
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time

import numpy as np
import pytest

from shmserve import protocol
from shmserve.protocol import Kind

from helpers.raw_frames import connect, infer_frame, read_frames, read_to_end
from helpers.server import serving, wait_for

STALL_S, FRAME_S, UPLOAD_S = 2, 2, 3
MAX_INFLIGHT = 4
PER_UID = 6
SERVER_SECTION = f"""
request_timeout_s = 20
max_request_bytes = 4194304
stall_timeout_s = {STALL_S}
frame_timeout_s = {FRAME_S}
upload_timeout_s = {UPLOAD_S}
max_inflight_per_connection = {MAX_INFLIGHT}
max_connections_per_uid = {PER_UID}
"""
MODELS = """
[arena]
slots = 16

[[models]]
name = "identity"
backend = "python"
path = "shmserve.models:identity"
instances = 2
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("hostile"), MODELS, server_section=SERVER_SECTION) as srv:
        yield srv


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed ``s`` (what it sent before is drained first)."""
    try:
        while s.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    return True


def held(server, stat: str, door_stat: str) -> int:
    """What main's door holds (``info``'s ``stats[stat]``) or, when door processes serve the socket
    (docs/doors.md), what they hold (each door's ``door_stat``), whichever is there."""
    info = server.info()
    return info["stats"][stat] or sum(d[door_stat] for d in info.get("doors") or ())


def served_within_a_second(server) -> None:
    with server.client(timeout=10) as c:
        x = np.arange(100, dtype=np.uint8)
        for _ in range(3):
            start = time.monotonic()
            assert np.array_equal(c.infer("identity", {"x": x})["y"], x)
            assert time.monotonic() - start < 1.0, "a well-behaved client waited on the attacker"


class Sender(threading.Thread):
    """Sends ``data`` on ``s`` in the background; ``error`` is what ended it (None: all sent)."""

    def __init__(self, s: socket.socket, data: bytes):
        super().__init__(daemon=True)
        self.s, self.data, self.error = s, data, None

    def run(self) -> None:
        try:
            self.s.sendall(self.data)
        except OSError as exc:
            self.error = exc


# -- a client that never reads ----------------------------------------------------------------


def test_a_client_that_never_reads_is_stopped_then_closed_and_frees_everything(server):
    """Many requests, no reads: the server stops reading it once its answers wait, holds at most
    its max_inflight_per_connection slots meanwhile, serves others, and at the stall deadline
    closes it and frees every slot and extent."""
    n, size = 128, 256 * 1024
    attacker = connect(server.socket, rcvbuf=4096)
    sender = Sender(attacker, b"".join(infer_frame(rid, size) for rid in range(1, n + 1)))
    mark = len(server.log())
    sender.start()
    try:
        # main's door holds them in arena slots; a door process copies them into its transport
        wait_for(lambda: held(server, "slots_in_use", "unsent_bytes"),
                 "the attacker's results hold slots (or a door's transport)")
        assert max(server.info()["stats"]["slots_in_use"] for _ in range(10)) <= MAX_INFLIGHT
        served_within_a_second(server)
        sender.join(STALL_S + 30)
        assert not sender.is_alive()
        assert isinstance(sender.error, OSError), "the server read everything a client that never reads sent"
        server.wait_idle()
        assert "(server.stall_timeout_s)" in server.log()[mark:]
    finally:
        attacker.close()
    served_within_a_second(server)


def test_control_replies_a_client_does_not_read_are_not_buffered(server):
    """A burst of info requests, never read: the server stops taking them once a reply waits; at
    the deadline it has at most the one reply that filled the socket left to send."""
    attacker = connect(server.socket, rcvbuf=4096)
    burst = b"".join(protocol.encode_frame(Kind.INFO, {"id": rid}) for rid in range(1, 100_001))
    sender = Sender(attacker, burst)
    mark = len(server.log())
    sender.start()
    try:
        served_within_a_second(server)
        sender.join(STALL_S + 30)
        assert isinstance(sender.error, OSError)
        line = wait_for(lambda: re.search(r"unread for [\d.]+ s \(server.stall_timeout_s\); (\d+) bytes unsent",
                                          server.log()[mark:]), "the stall is logged")
        assert int(line.group(1)) < 64 * 1024
    finally:
        attacker.close()
    server.wait_idle()


# -- half-sent frames and stalled uploads -----------------------------------------------------


def test_a_stalled_upload_is_failed_and_its_space_freed(server):
    n = 1 << 20
    attacker = connect(server.socket)
    try:
        attacker.sendall(infer_frame(1, n)[:-(n - 1000)])  # the header and 1000 bytes of the payload
        # main's door receives it into arena space; a door process, into its memory (docs/doors.md)
        wait_for(lambda: held(server, "extent_bytes_in_use", "held_bytes"),
                 "the upload holds arena space (or a door's memory)")
        served_within_a_second(server)
        frames = read_to_end(attacker)
    finally:
        attacker.close()
    assert [(f.kind, f.meta["id"], f.meta["code"]) for f in frames] == [(Kind.ERROR, 1, "timeout")]
    assert "server.upload_timeout_s" in frames[0].meta["message"]
    server.wait_idle()


@pytest.mark.parametrize("cut", [5, protocol.HEADER_SIZE + 10], ids=["header", "metadata"])
def test_a_half_sent_frame_is_closed_after_the_frame_timeout(server, cut):
    attacker = connect(server.socket)
    try:
        attacker.sendall(protocol.encode_frame(Kind.HEALTH, {"id": 1, "padding": "x" * 100})[:cut])
        served_within_a_second(server)
        frames = read_to_end(attacker)
    finally:
        attacker.close()
    assert [(f.kind, f.meta["code"]) for f in frames] == [(Kind.ERROR, "bad_frame")]
    assert "server.frame_timeout_s" in frames[0].meta["message"]


# -- connection limits --------------------------------------------------------------------------


def open_until_refused(server, limit: int) -> tuple[int, protocol.Frame]:
    """Open connections (each answered once, so that it is counted) until one is refused; returns
    how many were served and the refusal.  Connections other tests closed may still be counted
    for a moment (the server sees their end asynchronously): then try again."""
    for _ in range(50):
        opened = []
        try:
            for rid in range(limit + 1):
                s = connect(server.socket)
                opened.append(s)
                try:
                    s.sendall(protocol.encode_frame(Kind.HEALTH, {"id": rid}))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused and closed before we sent: its refusal is still there to read
                conn = protocol.Connection(protocol.Role.CLIENT)
                while (event := conn.next_event()) is protocol.NEED_DATA:
                    data = s.recv(65536)
                    assert data, "closed without an answer"
                    conn.receive_data(data)
                if event.kind is Kind.ERROR:
                    assert closed_by_server(s)
                    break
            else:
                raise AssertionError(f"{limit + 1} connections were all served")
        finally:
            for s in opened:
                s.close()
        if len(opened) == limit + 1:
            return limit, event
        time.sleep(0.1)
    raise AssertionError(f"fewer than {limit} connections were served")


def test_connections_over_the_limits_are_refused_naming_the_key(server):
    served, refusal = open_until_refused(server, PER_UID)
    assert refusal.meta["code"] == "overloaded" and "(server.max_connections_per_uid)" in refusal.meta["message"]

    # max_connections, applied by a reload (all connections here are of one uid: set it below that limit)
    text = server.config_path.read_text()
    reloads = server.log().count("reload: done")
    server.config_path.write_text(text.replace(f"max_connections_per_uid = {PER_UID}", "max_connections = 3"))
    try:
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: server.log().count("reload: done") > reloads, "the reload")
        served, refusal = open_until_refused(server, 3)
        assert refusal.meta["code"] == "overloaded" and "(server.max_connections)" in refusal.meta["message"]
    finally:
        server.config_path.write_text(text)
        reloads = server.log().count("reload: done")
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: server.log().count("reload: done") > reloads, "the reload back")
    served_within_a_second(server)


def test_requests_in_flight_of_one_uid_are_bounded_across_its_connections(tmp_path):
    """max_inflight_per_uid: several connections of one uid together hold at most that many
    requests; the next is answered 'overloaded' naming the key, and once answers are read the uid
    is served again."""
    from helpers.server import SLOW_MODEL

    section = "max_inflight_per_connection = 2\nmax_inflight_per_uid = 3\n"
    with serving(tmp_path, SLOW_MODEL, server_section=section) as srv:
        def slow_frame(rid: int, seconds: float) -> bytes:
            x = np.array([seconds], np.float32)
            meta = {"id": rid, "model": "slow", "inputs": [{"name": "x", "dtype": "float32", "shape": [1]}]}
            return protocol.encode_frame(Kind.INFER, meta, x.nbytes) + x.tobytes()

        a, b = connect(srv.socket), connect(srv.socket)
        try:
            a.sendall(slow_frame(1, 1.0) + slow_frame(2, 0.0))
            wait_for(lambda: srv.info()["stats"]["slots_in_use"] >= 1, "the first requests to be admitted")
            b.sendall(slow_frame(3, 0.0) + slow_frame(4, 0.0))
            answers = {f.meta["id"]: f for f in read_frames(a, 2) + read_frames(b, 2)}
        finally:
            a.close()
            b.close()
        assert {i for i, f in answers.items() if f.kind is Kind.RESULT} == {1, 2, 3}
        assert answers[4].kind is Kind.ERROR and answers[4].meta["code"] == "overloaded"
        assert "(server.max_inflight_per_uid)" in answers[4].meta["message"]
        with srv.client() as c:
            assert c.infer("slow", {"x": np.zeros(1, np.float32)})["y"].tolist() == [0.0]
