"""Main's side of a door process's connection: the frames a door relays, served as that connection.

Owns: ``RelayedConnection`` — the Unix door's ``ClientConnection`` whose bytes
come from a door process over the link, not from a socket, and whose identity
(pid, uid, gid, groups) is the one the door read with ``SO_PEERCRED`` from
the real client's socket; everything else (the protocol, the dispatcher, the
limits, the answer order, control calls, regions) is the Unix door's own code
path, unchanged.  ``RelayTransport`` — what that connection writes to: each
write becomes an ``out`` message to the door (``ordered`` when it is the
answer of an INFER, which the door puts in its place in the connection's
order), a frame with a descriptor carries it, ``pause_reading`` and
``resume_reading`` tell the door to stop or go on reading the client, and
``close`` or ``abort`` end the door's connection; every frame but an INFER
is acknowledged (``taken``) once served, after its answer, so a door relays
only a few at a time (an INFER is bounded by the door's own count).  ``Relay`` — one door's
connections by the door's connection id.

The bytes a door relays are the client's, untouched: as hostile as any
socket's, parsed by the same protocol module.  Answers are copied into the
message when written, so a result's arena views are released at once (the
link, not the arena, holds them until the door has them).

Must not: trust anything a door says but the identity it read from the
kernel (a door is our own process), or decide anything about a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from shmserve import protocol
from shmserve.doors.ledger import RowBook
from shmserve.errors import ErrorCode
from shmserve.frontend.unix import ClientConnection, UnixDoor
from shmserve.protocol import Kind

log = logging.getLogger("shmserve.relay")


class RelayTransport(asyncio.Transport):
    """The transport of a ``RelayedConnection``: the door's connection ``cid`` over ``link``."""

    def __init__(self, relay: "Relay", cid: int):
        super().__init__()
        self.relay, self.cid = relay, cid
        self.ordered = False  # set while the connection writes an INFER's answer
        self.closing = False
        self.paused = False
        self.protocol: RelayedConnection | None = None

    def write(self, data) -> None:
        if not self.closing:
            self.relay.link.send({"op": "out", "c": self.cid, "ordered": self.ordered}, bytes(data))

    def writelines(self, parts) -> None:
        if not self.closing:
            self.relay.link.send({"op": "out", "c": self.cid, "ordered": self.ordered}, b"".join(parts))

    def send_fds(self, data: bytes, fds: list[int]) -> None:
        if not self.closing:
            self.relay.link.send({"op": "out", "c": self.cid, "ordered": False}, data, fds)

    def get_write_buffer_size(self) -> int:
        return 0  # every write is copied into the link at once

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        if not self.paused and not self.closing:
            self.paused = True
            self.relay.link.send({"op": "pause", "c": self.cid})

    def resume_reading(self) -> None:
        if self.paused and not self.closing:
            self.paused = False
            self.relay.link.send({"op": "resume", "c": self.cid})
            conn = self.protocol
            if conn is not None and conn.backlog:
                asyncio.get_running_loop().call_soon(conn.feed, b"")

    def is_reading(self) -> bool:
        return not self.paused

    def get_extra_info(self, name, default=None):
        return default

    def close(self) -> None:
        self._end("close")

    def abort(self) -> None:
        self._end("close")

    def _end(self, op: str) -> None:
        if self.closing:
            return
        self.closing = True
        self.relay.link.send({"op": op, "c": self.cid})
        conn = self.protocol
        if conn is not None:
            asyncio.get_running_loop().call_soon(self.relay.lost, self.cid)


class RelayedConnection(ClientConnection):
    """A client of a door process, served by main as the Unix door serves its own (see the module)."""

    def __init__(self, door: UnixDoor, relay: "Relay", cid: int):
        super().__init__(door)
        self.relay, self.cid = relay, cid
        self.backlog = bytearray()  # relayed bytes not taken yet (the connection stopped reading)
        self.row: int | None = None  # its uid's row in the doors' ledger while it is open

    def start(self, pid: int, uid: int, gid: int, groups: set[int]) -> None:
        """``connection_made`` for a door's connection: the identity is the door's SO_PEERCRED read
        of the client's socket.  Main counts it (allow-lists, connection limits), then tells the
        door to serve it, or refuses it (the refusal is its last frame)."""
        transport = RelayTransport(self.relay, self.cid)
        transport.protocol = self
        self.transport = transport
        self.pid, self.uid = pid, uid
        self.groups = set(groups) | {gid}
        refusal = self.door.enter(self, pid, uid, gid, self.groups)
        if refusal is None:
            self.row = self.relay.rows.acquire(uid)
            if self.row is None:
                self.door.leave(self)
                refusal = protocol.error_frame(None, ErrorCode.OVERLOADED,
                                               f"{self.relay.rows.ledger.rows} uids have connections open through "
                                               f"the door processes, as many as their ledger holds; try again later "
                                               f"(or set [server] doors = 0)")
        if refusal is not None:
            self._close(refusal)
            return
        self.relay.link.send({"op": "admit", "c": self.cid, "row": self.row})

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        if self.row is not None:
            self.row = None
            self.relay.rows.release(self.uid)

    def feed(self, data: bytes) -> None:
        """Bytes the door relayed: into the protocol (payloads into the arena views they are for),
        as far as the connection reads now; the rest waits in ``backlog``."""
        if data:
            self.backlog += data
        view = memoryview(self.backlog)
        pos = 0
        try:
            while pos < len(view) and not self.closed and not self.transport.paused:
                target = self.get_buffer(len(view) - pos)
                n = min(len(target), len(view) - pos)
                target[:n] = view[pos:pos + n]
                pos += n
                self.buffer_updated(n)
        finally:
            view.release()
        del self.backlog[:pos]
        if self.closed:
            self.backlog.clear()

    # -- what tells the door an answer's place ---------------------------------------------

    @contextlib.contextmanager
    def _ordered(self):
        """What is written meanwhile is an INFER's answer (the door puts it in its place)."""
        self.transport.ordered = True
        try:
            yield
        finally:
            self.transport.ordered = False

    def flush(self) -> None:
        with self._ordered():
            super().flush()

    def answer_in_order(self, data: bytes) -> None:
        with self._ordered():
            super().answer_in_order(data)

    def send_with_fd(self, frame: bytes, fd: int) -> None:
        self.transport.send_fds(frame, [fd])

    def on_frame(self, frame) -> None:
        if frame.kind == Kind.INFO:  # which door process served the caller
            self.relay.info_for = self
        try:
            super().on_frame(frame)
        finally:
            self.relay.info_for = None
            if frame.kind not in (Kind.INFER, Kind.INFER_REGION):
                # taken (its answer, if any, is on the link before this): the door may relay another
                self.relay.link.send({"op": "taken", "c": self.cid})

    def reply(self, rid: int, body: dict) -> None:
        if self.relay.info_for is self:
            body = {**body, "door_process": self.relay.index}
        super().reply(rid, body)


class Relay:
    """One door process's connections, served by main (``link``: the door's link)."""

    def __init__(self, door: UnixDoor, link, index: int, rows: RowBook):
        self.door, self.link, self.index, self.rows = door, link, index, rows
        self.connections: dict[int, RelayedConnection] = {}
        self.info_for: RelayedConnection | None = None

    def opened(self, cid: int, pid: int, uid: int, gid: int, groups) -> None:
        if type(cid) is not int or cid in self.connections:
            return
        conn = self.connections[cid] = RelayedConnection(self.door, self, cid)
        conn.start(int(pid), int(uid), int(gid), {int(g) for g in groups})

    def frame(self, cid: int, data: bytes) -> None:
        conn = self.connections.get(cid)
        if conn is not None:
            conn.feed(data)

    def eof(self, cid: int) -> None:
        """The client of ``cid`` shut its side after the frames relayed so far: as a socket's EOF."""
        conn = self.connections.get(cid)
        if conn is not None and not conn.eof_received():
            conn.transport.close()

    def lost(self, cid: int) -> None:
        """The door's connection ``cid`` is gone (or main ended it): free what it held."""
        conn = self.connections.pop(cid, None)
        if conn is not None:
            conn.transport.closing = True
            conn.connection_lost(None)

    def lose_all(self) -> None:
        """The door process is gone: every connection of it is."""
        for cid in list(self.connections):
            self.lost(cid)

    def __len__(self) -> int:
        return len(self.connections)
