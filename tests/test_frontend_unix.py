"""The Unix-socket door's connection (``shmserve.frontend.unix.ClientConnection``) over a fake
transport: bytes fed in as a socket would deliver them, frames read back from what it writes, the
real dispatcher and fake workers behind it (``helpers.fake_frontend``).  No process, no loop."""

from __future__ import annotations

import dataclasses
import os
import socket

import numpy as np
import pytest

from shmserve import protocol
from shmserve.doorkit import DoorLimits
from shmserve.errors import ErrorCode
from shmserve.frontend.unix import FRAMES_PER_TURN, UnixDoor
from shmserve.protocol import Frame, Kind, PayloadDone

from helpers.fake_frontend import make_fixture, no_children_left, no_processes  # noqa: F401 (fixtures)
from helpers.fake_transport import FakeTransport


LIMITS = DoorLimits(max_connections=8, max_connections_per_uid=4, max_inflight_per_uid=1024,
                    max_inflight_bytes_per_connection=1 << 20,
                    stall_timeout_s=10.0, frame_timeout_s=5.0, upload_timeout_s=5.0)


class Client:
    """One connection to a door (its own, unless ``door`` is given), and the frames it has been sent."""

    def __init__(self, fe, door: UnixDoor | None = None):
        self.door = door or UnixDoor(fe.dispatcher, fe.regions, status=None, clock=fe.clock, limits=LIMITS)
        self.conn = self.door.protocol()
        self.sock, self.peer = socket.socketpair()
        self.transport = FakeTransport(self.sock)
        self.transport.protocol = self.conn
        self.conn.connection_made(self.transport)
        self.reader = protocol.Connection(protocol.Role.CLIENT)
        self.seen = 0
        self.lost = False

    def send(self, data: bytes) -> None:
        """Deliver bytes as the event loop would: into whatever buffer the connection offers."""
        view = memoryview(data)
        while len(view):
            assert self.transport.reading, "sent to a connection that is not reading"
            target = self.conn.get_buffer(len(view))
            n = min(len(target), len(view))
            target[:n] = view[:n]
            self.conn.buffer_updated(n)
            view = view[n:]

    def frames(self) -> list[tuple[Frame, bytes]]:
        """The frames written since the last call, with their payloads."""
        self.reader.receive_data(bytes(self.transport.written[self.seen:]))
        self.seen = len(self.transport.written)
        out = []
        while (event := self.reader.next_event()) is not protocol.NEED_DATA:
            assert isinstance(event, Frame), event
            data = bytearray(event.data_len)
            if event.data_len:
                self.reader.accept_payload([data])
                assert isinstance(self.reader.next_event(), PayloadDone)
            out.append((event, bytes(data)))
        return out

    def lose(self) -> None:
        """The transport is gone (closed or aborted): the loop's ``connection_lost``."""
        if not self.lost:
            self.lost = True
            self.conn.connection_lost(None)

    def close(self) -> None:
        self.lose()
        self.sock.close()
        self.peer.close()


@pytest.fixture
def clients():
    made = []
    yield lambda fe, door=None: made.append(Client(fe, door)) or made[-1]
    for client in made:
        client.close()


def infer_frame(rid: int, x: np.ndarray, *, timeout_s: float | None = None, region: int | None = None) -> bytes:
    meta = {"id": rid, "model": "add", "inputs": [{"name": "x", "dtype": "float32", "shape": list(x.shape)}]}
    if timeout_s is not None:
        meta["timeout_s"] = timeout_s
    if region is None:
        return protocol.encode_frame(Kind.INFER, meta, x.nbytes)
    meta["inputs"][0]["offset"] = 0
    meta.update(region=region, output_offset=4096, output_capacity=4096)
    return protocol.encode_frame(Kind.INFER_REGION, meta)


def test_an_inline_request_is_received_into_the_arena_and_answered_in_one_frame(make, clients):
    """The payload goes straight into the views the dispatcher gave; the RESULT frame carries the
    worker's bytes; the request is released once written (nothing held after)."""
    fe = make()
    client = clients(fe)
    x = np.arange(16, dtype=np.float32)
    client.send(infer_frame(1, x) + x.tobytes())
    fe.workers[0].step()
    assert fe.deliver()
    [(frame, data)] = client.frames()
    assert frame.kind is Kind.RESULT and frame.meta["id"] == 1
    assert np.array_equal(np.frombuffer(data, np.float32), x + 1)
    assert fe.arena.stat("slots_in_use") == 0


def test_an_inline_request_that_times_out_waiting_lets_its_connection_read_again(make, clients):
    """Waiting for space, the connection stops reading (the payload stays in the socket); answered
    TIMEOUT, it skips that payload and reads again."""
    fe = make()
    fill = fe.door()
    for _ in range(4):
        fill.infer("add", {"x": np.zeros(16, np.float32)})
    client = clients(fe)
    x = np.arange(16, dtype=np.float32)
    client.send(infer_frame(1, x, timeout_s=1))
    assert not client.transport.reading
    fe.clock.advance(1)
    [(frame, _)] = client.frames()
    assert frame.kind is Kind.ERROR and frame.meta["code"] == ErrorCode.TIMEOUT.wire
    assert client.transport.reading
    client.send(x.tobytes())  # the skipped payload
    fe.settle()


def test_a_zero_copy_request_that_times_out_waiting_lets_its_connection_read_again(make, clients):
    """As the inline case: a zero-copy request answered TIMEOUT while waiting for a slot must let
    its connection read the client's next request."""
    fe = make()
    fill = fe.door()
    for _ in range(4):
        fill.infer("add", {"x": np.zeros(16, np.float32)})
    client = clients(fe)
    region = fe.regions.open(client.conn, 8192)
    client.send(infer_frame(1, np.zeros(16, np.float32), timeout_s=1, region=region.id))
    assert not client.transport.reading
    fe.clock.advance(1)
    [(frame, _)] = client.frames()
    assert frame.kind is Kind.ERROR and frame.meta["code"] == ErrorCode.TIMEOUT.wire
    assert client.transport.reading, "the connection answered its only request and still does not read"
    fe.settle()


# -- what one client can make the server hold ----------------------------------------------------


def control_frame(rid: int) -> bytes:
    """A control message that needs no status view: closing a region it does not have (BAD_REGION)."""
    return protocol.encode_frame(Kind.CLOSE_REGION, {"id": rid, "region": 99})


def run_one(fe, client, rid: int, x: np.ndarray) -> None:
    """Send one inline request and let a worker answer it."""
    client.send(infer_frame(rid, x) + x.tobytes())
    fe.workers[0].step()
    assert fe.deliver()


def test_a_connection_whose_answers_wait_unread_takes_no_new_frame(make, clients):
    """Write backpressure: while a result waits in the transport, the connection is not read and
    its result keeps its slot; once the client reads, the slot is freed and reading resumes."""
    fe = make()
    client = clients(fe)
    client.transport.hold = True
    x = np.arange(16, dtype=np.float32)
    run_one(fe, client, 1, x)
    assert not client.transport.reading and fe.arena.stat("slots_in_use") == 1
    client.transport.hold = False
    client.transport.drain()
    assert client.transport.reading and fe.arena.stat("slots_in_use") == 0
    [(frame, data)] = client.frames()
    assert frame.meta["id"] == 1 and np.array_equal(np.frombuffer(data, np.float32), x + 1)


def test_control_replies_wait_one_at_a_time_for_a_client_that_does_not_read(make, clients):
    """Frames already received are not answered while the reply before them waits unread: the
    server buffers one reply, not one per frame the client sent."""
    fe = make()
    client = clients(fe)
    client.transport.hold = True
    client.send(b"".join(control_frame(rid) for rid in range(1, 6)))
    assert not client.transport.reading
    waiting = protocol.Connection(protocol.Role.CLIENT)
    waiting.receive_data(bytes(client.transport.held))
    assert isinstance(waiting.next_event(), Frame) and waiting.next_event() is protocol.NEED_DATA
    for rid in range(1, 6):
        client.transport.drain()
        [(frame, _)] = client.frames()
        assert frame.meta["id"] == rid and frame.meta["code"] == ErrorCode.BAD_REGION.wire
    client.transport.drain()
    assert client.frames() == [] and client.transport.reading


def test_a_region_is_not_opened_while_answers_wait_unread(make, clients):
    """An OPEN_REGION behind an unread reply waits in the socket: no region is made and no
    descriptor duplicated for it until the client reads; then its descriptor comes with it."""
    fe = make()
    client = clients(fe)
    client.transport.hold = True
    client.send(control_frame(1) + protocol.encode_frame(Kind.OPEN_REGION, {"id": 2, "size": 4096}))
    assert fe.regions.get(client.conn, 1) is None
    client.transport.hold = False
    client.transport.drain()
    [(bad, _)] = client.frames()
    assert bad.meta["id"] == 1
    data, fds, _, _ = socket.recv_fds(client.peer, 4096, 1)  # passed on the socket itself
    for fd in fds:
        os.close(fd)
    reader = protocol.Connection(protocol.Role.CLIENT)
    reader.receive_data(data)
    granted = reader.next_event()
    assert granted.kind is Kind.REGION and granted.meta["id"] == 2 and len(fds) == 1
    assert fe.regions.get(client.conn, granted.meta["region"]) is not None


def test_a_connection_that_stays_stalled_is_closed_and_what_it_held_freed(make, clients):
    fe = make()
    client = clients(fe)
    client.transport.hold = True
    run_one(fe, client, 1, np.zeros(16, np.float32))
    fe.clock.advance(LIMITS.stall_timeout_s - 0.5)
    assert not client.transport.closing and fe.arena.stat("slots_in_use") == 1
    fe.clock.advance(0.5)
    assert client.transport.aborted
    client.lose()
    assert fe.arena.stat("slots_in_use") == 0 and fe.arena.stat("extent_bytes_in_use") == 0


def test_a_client_that_reads_in_time_is_not_closed(make, clients):
    """The stall deadline runs from when writes wait to when all is sent, and starts afresh."""
    fe = make()
    client = clients(fe)
    client.transport.hold = True
    for rid in (1, 2):
        run_one(fe, client, rid, np.zeros(16, np.float32))
        fe.clock.advance(LIMITS.stall_timeout_s - 1)
        client.transport.drain()
    fe.clock.advance(LIMITS.stall_timeout_s)
    assert not client.transport.closing
    assert [f.meta["id"] for f, _ in client.frames()] == [1, 2]


@pytest.mark.parametrize("cut", [5, protocol.HEADER_SIZE, protocol.HEADER_SIZE + 7])
def test_a_half_sent_frame_is_closed_after_the_frame_timeout(make, clients, cut):
    """A header or metadata cut short: BAD_FRAME naming the key at the deadline, and the deadline
    is not pushed back by trickling more bytes of the same frame."""
    fe = make()
    client = clients(fe)
    frame = infer_frame(1, np.zeros(16, np.float32))
    client.send(frame[:cut - 1])
    fe.clock.advance(LIMITS.frame_timeout_s - 1)
    client.send(frame[cut - 1:cut])
    assert not client.transport.closing
    fe.clock.advance(1)
    [(error, _)] = client.frames()
    assert error.meta["code"] == ErrorCode.BAD_FRAME.wire and "server.frame_timeout_s" in error.meta["message"]
    assert client.transport.closing


def test_a_frame_completed_in_time_is_not_timed_out(make, clients):
    fe = make()
    client = clients(fe)
    frame = control_frame(1)
    client.send(frame[:5])
    fe.clock.advance(LIMITS.frame_timeout_s - 1)
    client.send(frame[5:])
    fe.clock.advance(LIMITS.frame_timeout_s * 2)
    [(reply, _)] = client.frames()
    assert reply.meta["id"] == 1 and not client.transport.closing


def test_a_stalled_upload_is_failed_and_its_space_freed_at_once(make, clients):
    fe = make()
    client = clients(fe)
    x = np.zeros(4096, np.float32)
    client.send(infer_frame(7, x) + x.tobytes()[:1000])
    assert fe.arena.stat("extent_bytes_in_use") > 0
    fe.clock.advance(LIMITS.upload_timeout_s)
    [(error, _)] = client.frames()
    assert error.meta["id"] == 7 and error.meta["code"] == ErrorCode.TIMEOUT.wire
    assert "server.upload_timeout_s" in error.meta["message"]
    assert client.transport.closing
    assert fe.arena.stat("slots_in_use") == 0 and fe.arena.stat("extent_bytes_in_use") == 0
    assert client.conn.get_buffer(1) is client.conn.read_view  # nothing more lands in its space


def test_the_frame_deadline_stops_while_the_server_is_the_one_not_reading(make, clients):
    """A begun frame whose rest the server does not read (its answers wait unread) is not late by
    the client's fault: its deadline stops while reading is paused and starts afresh after."""
    fe = make()
    client = clients(fe)
    client.transport.hold = True
    x = np.zeros(16, np.float32)
    frame = control_frame(2)
    client.send(infer_frame(1, x) + x.tobytes() + frame[:3])
    fe.workers[0].step()
    assert fe.deliver() and not client.transport.reading
    fe.clock.advance(LIMITS.frame_timeout_s + 1)  # less than the stall deadline
    assert not client.transport.closing
    client.transport.hold = False
    client.transport.drain()
    fe.clock.advance(LIMITS.frame_timeout_s - 1)
    client.send(frame[3:])
    assert [f.meta["id"] for f, _ in client.frames()] == [1, 2] and not client.transport.closing


def test_connections_over_a_limit_are_refused_naming_the_key(make, clients):
    fe = make()
    door = UnixDoor(fe.dispatcher, fe.regions, status=None, clock=fe.clock,
                    limits=dataclasses.replace(LIMITS, max_connections=3, max_connections_per_uid=2))
    first, _ = clients(fe, door), clients(fe, door)
    refused = clients(fe, door)
    [(error, _)] = refused.frames()
    assert error.meta["code"] == ErrorCode.OVERLOADED.wire and "server.max_connections_per_uid" in error.meta["message"]
    assert refused.transport.closing and len(door.connections) == 2
    refused.lose()
    first.lose()
    assert not clients(fe, door).transport.closing  # the uid has one open again
    door.limits = dataclasses.replace(door.limits, max_connections_per_uid=10)
    assert not clients(fe, door).transport.closing and len(door.connections) == 3
    refused = clients(fe, door)
    [(error, _)] = refused.frames()
    assert error.meta["code"] == ErrorCode.OVERLOADED.wire and "server.max_connections" in error.meta["message"]


def test_requests_in_flight_of_one_uid_are_bounded_across_its_connections(make, clients):
    """max_inflight_per_uid: two connections of one uid together hold at most 3 requests in flight;
    the next is refused 'overloaded' naming the key (after its connection's earlier answers), and
    once one is answered and written the uid may send again."""
    fe = make(max_inflight_per_door=2)
    door = UnixDoor(fe.dispatcher, fe.regions, status=None, clock=fe.clock,
                    limits=dataclasses.replace(LIMITS, max_inflight_per_uid=3))
    a, b = clients(fe, door), clients(fe, door)
    x = np.zeros(16, np.float32)
    a.send(infer_frame(1, x) + x.tobytes() + infer_frame(2, x) + x.tobytes())
    b.send(infer_frame(3, x) + x.tobytes() + infer_frame(4, x) + x.tobytes())
    assert fe.arena.stat("slots_in_use") == 3  # the fourth was refused, holding nothing
    fe.settle()
    answers = sorted((f.meta["id"], f.kind, f.meta.get("code"), f.meta.get("message", ""))
                     for c in (a, b) for f, _ in c.frames())
    assert [(i, k) for i, k, _, _ in answers] == [(1, Kind.RESULT), (2, Kind.RESULT), (3, Kind.RESULT),
                                                   (4, Kind.ERROR)]
    assert answers[3][2] == ErrorCode.OVERLOADED.wire and "(server.max_inflight_per_uid)" in answers[3][3]
    b.send(infer_frame(5, x) + x.tobytes())
    fe.settle()
    assert [(f.meta["id"], f.kind) for f, _ in b.frames()] == [(5, Kind.RESULT)]
    assert fe.arena.stat("slots_in_use") == 0


def test_a_connection_holding_its_bytes_in_flight_is_read_again_once_they_are_written(make, clients):
    """max_inflight_bytes_per_connection: backpressure, not an error: the next frame waits in the
    socket until the requests in flight are answered and written."""
    fe = make()
    door = UnixDoor(fe.dispatcher, fe.regions, status=None, clock=fe.clock,
                    limits=dataclasses.replace(LIMITS, max_inflight_bytes_per_connection=1))
    client = clients(fe, door)
    x = np.arange(16, dtype=np.float32)
    client.send(infer_frame(1, x) + x.tobytes() + infer_frame(2, x) + x.tobytes())
    assert not client.transport.reading and fe.arena.stat("slots_in_use") == 1
    fe.workers[0].step()
    assert fe.deliver()
    assert [f.meta["id"] for f, _ in client.frames()] == [1]
    assert not client.transport.reading and fe.arena.stat("slots_in_use") == 1  # the second one in flight now
    fe.workers[0].step()
    assert fe.deliver()
    assert [f.meta["id"] for f, _ in client.frames()] == [2] and client.transport.reading


def test_a_burst_of_frames_is_taken_a_turn_at_a_time(make, clients):
    """FRAMES_PER_TURN frames, then the loop serves others; the connection is not read meanwhile."""
    fe = make()
    client = clients(fe)
    client.send(b"".join(control_frame(rid) for rid in range(1, FRAMES_PER_TURN + 11)))
    assert len(client.frames()) == FRAMES_PER_TURN and not client.transport.reading
    fe.clock.run_soon()
    assert [f.meta["id"] for f, _ in client.frames()] == list(range(FRAMES_PER_TURN + 1, FRAMES_PER_TURN + 11))
    assert client.transport.reading


def test_refusals_waiting_behind_a_running_request_are_bounded(make, clients):
    """Refusals are answered in order, after the requests before them: while
    max_inflight_per_connection of them wait behind one still running, no new frame is taken."""
    fe = make()
    client = clients(fe)
    limit = fe.dispatcher.limits.max_inflight_per_door
    x = np.zeros(16, np.float32)
    unknown = protocol.encode_frame(Kind.INFER, {"id": 0, "model": "nope", "inputs": []})
    client.send(infer_frame(1, x) + x.tobytes() + unknown * (limit + 5))
    assert not client.transport.reading and client.frames() == []
    assert len(client.conn.order) == 1 + limit
    fe.workers[0].step()
    assert fe.deliver()
    answers = client.frames()
    assert [f.kind for f, _ in answers] == [Kind.RESULT] + [Kind.ERROR] * (limit + 5)
    assert client.transport.reading
