"""A stand-in for an asyncio transport, for a door's connection tested without a loop or a socket:
it records what is written, can hold it (a client that does not read) and let it go (``drain``),
and follows pause and resume of reading.  Used by the Unix door's and the HTTP door's in-process
tests (``test_frontend_unix.py``, ``test_v2_http_conn.py``)."""

from __future__ import annotations

import socket


class FakeTransport:
    """What a door's connection asks of its asyncio transport; ``reading`` follows pause/resume.

    Writes are sent at once, unless ``hold`` is set (a client that does not read): then they wait
    in the transport, its protocol is told ``pause_writing``, and ``drain`` sends them (and says
    ``resume_writing``) as a client's read would, with the write buffer limit 0 the door sets."""

    def __init__(self, sock: socket.socket | None = None):
        self.sock, self.reading, self.closing, self.aborted = sock, True, False, False
        self.protocol = None
        self.written = bytearray()  # sent
        self.held = bytearray()  # written, not sent
        self.hold = False

    def get_extra_info(self, name):
        return self.sock if name == "socket" else None

    def set_write_buffer_limits(self, high=None, low=None):
        assert (high, low) == (0, 0), "the door relies on resume_writing meaning 'all sent'"

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True

    def is_closing(self):
        return self.closing

    def write(self, data):
        if not data:
            return  # as asyncio's: an empty write is nothing
        if not (self.hold or self.held):
            self.written += data
            return
        self.held += data
        if len(self.held) == len(data):
            self.protocol.pause_writing()

    def writelines(self, parts):
        self.write(b"".join(parts))

    def get_write_buffer_size(self):
        return len(self.held)

    def drain(self) -> None:
        """The client reads what waits: it is sent, and the protocol may write again."""
        if self.held:
            self.written += self.held
            self.held.clear()
            self.protocol.resume_writing()

    def close(self):
        self.closing, self.reading = True, False

    def abort(self):
        self.close()
        self.aborted = True
        self.held.clear()
