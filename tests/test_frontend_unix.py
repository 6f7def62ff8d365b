"""The Unix-socket door's connection (``shmserve.frontend.unix.ClientConnection``) over a fake
transport: bytes fed in as a socket would deliver them, frames read back from what it writes, the
real dispatcher and fake workers behind it (``helpers.fake_frontend``).  No process, no loop."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from shmserve import protocol
from shmserve.errors import ErrorCode
from shmserve.frontend.unix import UnixDoor
from shmserve.protocol import Frame, Kind, PayloadDone

from helpers.fake_frontend import make_fixture, no_children_left, no_processes  # noqa: F401 (fixtures)


class FakeTransport:
    """What ``ClientConnection`` asks of its asyncio transport; ``reading`` follows pause/resume."""

    def __init__(self, sock: socket.socket):
        self.sock, self.reading, self.closing = sock, True, False
        self.written = bytearray()

    def get_extra_info(self, name):
        return self.sock if name == "socket" else None

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True

    def is_closing(self):
        return self.closing

    def write(self, data):
        self.written += data

    def writelines(self, parts):
        for part in parts:
            self.written += part

    def get_write_buffer_size(self):
        return 0  # everything written is flushed at once

    def close(self):
        self.closing = True


class Client:
    """One connection to the door, and the frames it has been sent."""

    def __init__(self, fe):
        self.door = UnixDoor(fe.dispatcher, fe.regions, status=None)
        self.conn = self.door.protocol()
        self.sock, self.peer = socket.socketpair()
        self.transport = FakeTransport(self.sock)
        self.conn.connection_made(self.transport)
        self.reader = protocol.Connection(protocol.Role.CLIENT)
        self.seen = 0

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

    def close(self) -> None:
        self.conn.connection_lost(None)
        self.sock.close()
        self.peer.close()


@pytest.fixture
def clients():
    made = []
    yield lambda fe: made.append(Client(fe)) or made[-1]
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
