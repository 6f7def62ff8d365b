"""Raw protocol frames over a real socket, for tests that play a hostile client: they send what
the client library never would (a request that never ends, a header cut short) and read what the
server answers until it closes the connection."""

from __future__ import annotations

import socket

from shmserve import protocol
from shmserve.protocol import Kind


def connect(path: str, rcvbuf: int | None = None, timeout: float = 30.0) -> socket.socket:
    """A connection to the server at ``path`` (``rcvbuf``: a small receive buffer, for a client
    that does not read); every read on it gives up after ``timeout`` seconds."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect(path)
    return s


def infer_frame(rid: int, n: int) -> bytes:
    """An inline identity request of ``n`` bytes, payload included."""
    meta = {"id": rid, "model": "identity", "inputs": [{"name": "x", "dtype": "uint8", "shape": [n]}]}
    return protocol.encode_frame(Kind.INFER, meta, n) + bytes(n)


def read_to_end(s: socket.socket) -> list[protocol.Frame]:
    """Every frame the server sends until it closes ``s`` (bounded by the socket's timeout:
    ``socket.timeout`` if it is not closed by then)."""
    data = bytearray()
    while True:
        try:
            chunk = s.recv(1 << 20)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            break
        data += chunk
    conn = protocol.Connection(protocol.Role.CLIENT)
    conn.receive_data(data)
    frames = []
    while isinstance(event := conn.next_event(), protocol.Frame):
        frames.append(event)
        if event.data_len:
            conn.discard_payload()
            if not isinstance(conn.next_event(), protocol.PayloadDone):
                break
    return frames


def read_frames(s: socket.socket, count: int) -> list[protocol.Frame]:
    """The next ``count`` frames the server sends on ``s``, the connection left open (bounded by
    the socket's timeout)."""
    conn, frames = protocol.Connection(protocol.Role.CLIENT), []
    while len(frames) < count:
        chunk = s.recv(1 << 20)
        assert chunk, f"closed after {len(frames)} of {count} frames"
        conn.receive_data(chunk)
        while isinstance(event := conn.next_event(), (protocol.Frame, protocol.PayloadDone)):
            if isinstance(event, protocol.Frame):
                frames.append(event)
                if event.data_len:
                    conn.discard_payload()
    return frames
