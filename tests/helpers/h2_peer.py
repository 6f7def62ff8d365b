"""A hostile HTTP/2 peer of the gRPC door (with the ``h2`` library): it opens streams and sends
unfinished messages, as far as the server's flow control lets it, which no gRPC client does."""

from __future__ import annotations

import socket
import struct
import time

import h2.config
import h2.connection
import h2.events
import h2.settings

from helpers.raw_http import address


class Flood:
    """``streams`` gRPC calls of ``method`` on one connection, each sending the first bytes of a
    ``message_bytes`` message that never ends.  ``run(seconds)`` sends whatever flow control
    allows for that long; then ``sent`` (bytes the server let in), ``refused`` (streams it reset
    or ended) and ``closed`` (it closed the connection) say what happened."""

    def __init__(self, hostport: str, method: str, streams: int, message_bytes: int, metadata: dict | None = None):
        host, port = address(hostport)
        self.s = socket.create_connection((host, port), timeout=5)
        self.s.settimeout(0.05)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
        self.payload = b"\x00" + struct.pack(">I", message_bytes) + b"\x01" * (message_bytes - 1)
        self.progress: dict[int, int | None] = {}
        self.refused = 0
        self.sent = 0
        self.closed = False
        headers = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", hostport),
                   ("content-type", "application/grpc"), ("te", "trailers"), *(metadata or {}).items()]
        for _ in range(streams):
            sid = self.conn.get_next_available_stream_id()
            self.conn.send_headers(sid, headers)
            self.progress[sid] = 0
        self._flush()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            try:
                self.s.sendall(data)
            except OSError:
                self.closed = True

    def run(self, seconds: float) -> "Flood":
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.closed:
            for sid, done in self.progress.items():
                if done is None:
                    continue
                try:
                    room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size,
                               len(self.payload) - 1 - done)  # never the last byte: the message never ends
                except Exception:  # the stream was closed meanwhile
                    continue
                if room > 0:
                    self.conn.send_data(sid, self.payload[done:done + room])
                    self.progress[sid] = done + room
                    self.sent += room
            self._flush()
            try:
                data = self.s.recv(1 << 20)
            except socket.timeout:
                continue
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            for event in self.conn.receive_data(data):
                if isinstance(event, (h2.events.StreamReset, h2.events.StreamEnded)) and \
                        self.progress.get(event.stream_id) is not None:
                    self.progress[event.stream_id] = None
                    self.refused += 1
            self._flush()
        return self

    def close(self) -> None:
        self.s.close()


def hello(hostport: str) -> socket.socket:
    """A connection that says the HTTP/2 preface and nothing more (an idle gRPC connection)."""
    host, port = address(hostport)
    s = socket.create_connection((host, port), timeout=5)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    s.sendall(conn.data_to_send())
    return s
