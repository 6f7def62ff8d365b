"""A door process: the native Unix socket served by one of N processes beside the main one.

Owns: accepting on the listening socket main passes (every door accepts on the
same one), each connection's identity (``SO_PEERCRED`` and its groups, read
from the socket exactly as main's Unix door reads them; the only identity a
door has or passes on), pumping its bytes through the sans-I/O protocol,
serving the INFERs the lane dispatcher carries and relaying every other frame
whole to main over the link (main serves it as that connection, with that
identity: ``frontend/relay.py``), the connection's answer order, and the
door's reports to main.

A connection (``DoorConnection``):

* is announced to main (``conn``) and read only once main admits it
  (``admit``: its allow-lists and connection limits, and its uid's row in the
  doors' ledger), or closed with main's refusal;
* counts each INFER among its uid's requests in flight across every door
  (``doors.ledger``) from its arrival until its answer is written back, and
  answers one past ``max_inflight_per_uid`` ``overloaded`` in its place; a
  payload it holds to relay counts in the uid's buffered bytes
  (``max_buffered_bytes_per_uid``) until it goes to main;
* keeps INFER answers in the order the requests came: a lane call's when it
  finishes, a relayed one's placeholder filled by the next answer main marks
  ``ordered``; every other answer main sends goes out at once (as main's own
  door sends them);
* stops reading while its answers wait unread in its transport, while
  ``max_inflight_per_connection`` INFERs wait for answers, while
  ``RELAY_UNTAKEN_MAX`` other frames wait for main to take them (``taken``), while main asked
  it to (``pause``: main's connection waits for arena space or its client),
  or while more than ``RELAY_PENDING_MAX`` bytes wait on the link;
* sends a frame that carries a descriptor (a REGION answer) only when its
  transport is empty (``send_fds``), and what main sends after it waits
  behind it.

Every ``REPORT_S`` the door reports to main: its outcome counts per model
version (cumulative: main adds the difference), its connections, calls in
flight, lanes and relayed frames.

Must not: trust a client byte (the protocol module parses, main decides
everything it relays), decide a route (``directory``), or outlive main (it
exits when the link closes).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import signal
import socket
import sys

from shmserve import protocol
from shmserve.doors.directory import Directory
from shmserve.doors.dispatcher import Call, LaneDispatcher
from shmserve.doors.ledger import UidLedger
from shmserve.doors.lanepool import LanePool
from shmserve.doors.link import Link
from shmserve.errors import ErrorCode
from shmserve.doorkit import MID_PAYLOAD, UNKNOWN_PEER, FlowControl, FramePump, InputDeadline, big_buffers, peer_of
from shmserve.frontend.unix import READ_BUFFER
from shmserve.protocol import Frame, Kind, PayloadDone, ProtocolError, ProtocolViolation
from shmserve.rings import drain_eventfd, new_eventfd

log = logging.getLogger("shmserve.door")

REPORT_S = 0.1  # how often a door reports its counts and state to main (a canary window sees them this late)
RELAY_PENDING_MAX = 64 << 20  # bytes waiting on the link to main: no connection is read past this
# Frames other than INFERs one connection has relayed that main has not taken yet: main's own door
# serves such a frame before it reads the next, so a client that never reads its answers holds a
# few of them, not a flood (an INFER is bounded by max_inflight_per_connection).
RELAY_UNTAKEN_MAX = 4
FRAMES_PER_TURN = 64  # as main's door: frames one connection takes in one turn of the loop
MAX_RELAY_PAYLOAD_SLACK = 1 << 20  # a relayed payload may be max_request_bytes plus this (protocol.REGION_SLACK)


class _Entry:
    """An INFER's place in its connection's answer order: its answer's parts once there is one;
    ``counted``: it holds one of its uid's requests in the ledger until it is written back."""

    __slots__ = ("parts", "relayed", "counted")

    def __init__(self, relayed: bool, counted: bool = False):
        self.parts: list | None = None
        self.relayed, self.counted = relayed, counted


class DoorConnection(FramePump):
    """One client of this door (see the module)."""

    def __init__(self, door: "Door"):
        self.door = door
        self.cid = door.new_cid()
        self.proto = protocol.Connection(protocol.Role.SERVER)
        self.read_buffer = bytearray(READ_BUFFER)
        self.read_view = memoryview(self.read_buffer)
        self.into_payload = False
        self.order: collections.deque[_Entry] = collections.deque()
        self.relay_waiting: collections.deque[_Entry] = collections.deque()  # relayed INFERs, oldest first
        self.frame_head: bytes | None = None  # a relayed frame whose payload is arriving: its header and meta
        self.payload: bytearray | None = None
        self.call: Call | None = None  # a lane call whose payload is arriving
        self.calls: dict[Call, float] = {}  # lane calls of this connection -> when they started
        self.held: collections.deque = collections.deque()  # main's answers behind a frame with descriptors
        self.admitted = self.closed = self.paused_by_main = False
        self.eof = self.eof_sent = False  # the client shut its side; main told (after every frame before it)
        self.starved = False  # the last look at the protocol needed more bytes
        self.yielded = False
        self.relayed = 0  # frames relayed (stats)
        self.pid = self.uid = self.gid = -1
        self.row: int | None = None  # the uid's row in the ledger (main says, when it admits us)
        self.held_bytes = 0  # of a relayed payload arriving, counted in the ledger
        self.payload_entry: _Entry | None = None  # the relayed INFER whose payload is arriving
        self.payload_rid: int | None = None  # the id of the relayed frame whose payload is arriving
        self.flow = FlowControl(self._later)  # reading, writing, and the stall timer (answers unread)
        self.input_deadline = InputDeadline(self._later)  # of what the client is sending now
        self.untaken = 0  # frames other than INFERs relayed that main has not said it took

    # -- set-up -----------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        FlowControl.zero_write_buffer(transport)  # as main's door: pause_writing = "not all sent"
        sock = transport.get_extra_info("socket")
        big_buffers(sock)
        peer = peer_of(sock) or UNKNOWN_PEER
        self.pid, self.uid, self.gid = peer.pid, peer.uid, peer.gid
        groups = sorted(peer.groups)
        self.door.connections[self.cid] = self
        self._set_reading(False)
        self.door.link.send({"op": "conn", "c": self.cid, "pid": self.pid, "uid": self.uid, "gid": self.gid,
                             "groups": groups})

    def admit(self, row) -> None:
        """Main counted this connection (its uid's row in the ledger: ``row``): serve it."""
        if type(row) is int and 0 <= row < self.door.ledger.rows:
            self.row = row
        self.admitted = True
        self._update()

    # -- reading (FramePump's get_buffer and buffer_updated) ----------------------------------

    def _update(self) -> None:
        self._process()
        self._set_reading(self._wants_input())
        if self.eof and self.starved and self.admitted and not self.eof_sent and not self.closed:
            # Every frame before the end went its way: main ends the connection as its own door does.
            self.eof_sent = True
            self.door.link.send({"op": "eof", "c": self.cid})

    def _wants_input(self) -> bool:
        if self.closed or not self.admitted or self.yielded or self.paused_by_main:
            return False
        if self.proto.state in MID_PAYLOAD:
            return True
        return self._takes_frames()

    def _takes_frames(self) -> bool:
        door = self.door
        return (not self.flow.write_blocked and not self.held and len(self.order) < door.max_inflight
                and self.untaken < RELAY_UNTAKEN_MAX and door.link.pending < RELAY_PENDING_MAX)

    def _set_reading(self, want: bool) -> None:
        self._read_while(want)

    def _process(self) -> None:
        proto = self.proto
        self.starved = False
        for _ in range(FRAMES_PER_TURN):
            if self.closed or not self.admitted or self.paused_by_main or proto.state is protocol.State.AWAIT:
                return
            if proto.state not in (protocol.State.PAYLOAD, protocol.State.DISCARD) and not self._takes_frames():
                return
            event = proto.next_event()
            if event is protocol.NEED_DATA:
                self.starved = True
                self._await_input()
                return
            self.input_deadline.cancel()  # a frame's header and metadata, or a payload, is complete
            if isinstance(event, Frame):
                self._on_frame(event)
            elif isinstance(event, PayloadDone):
                self._payload_done()
            elif isinstance(event, ProtocolError):
                # as main's door: an error frame without an id, and the connection closes
                self._close(protocol.error_frame(None, event.code, event.message))
                return
        self.yielded = True
        asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self.yielded = False
        self._update()

    def _on_frame(self, frame: Frame) -> None:
        door = self.door
        if frame.kind is Kind.CANCEL and self._cancel(protocol.request_id(frame.meta)):
            return
        infer = frame.kind in (Kind.INFER, Kind.INFER_REGION)
        if infer and not self._take_request(frame):
            return
        if frame.kind is Kind.INFER:
            try:
                parsed = protocol.parse_infer(frame.meta, zero_copy=False)
            except ProtocolViolation:
                parsed = None  # main answers it
            plan = door.dispatcher.carries(parsed, frame.data_len) if parsed is not None else None
            if plan is not None:
                entry = _Entry(relayed=False, counted=self.row is not None)
                call = door.dispatcher.begin(self, entry, parsed, plan)
                if call is not None:
                    self.order.append(entry)
                    self.calls[call] = door.clock()
                    self.call = call
                    if frame.data_len:
                        self.proto.accept_payload(call.sinks)
                    else:
                        self._payload_done()
                    return
        head = protocol.encode_frame(frame.kind, frame.meta, frame.data_len)
        if not infer:
            self.untaken += 1  # until main says it took it (``taken``: after its answer)
        if infer:
            entry = _Entry(relayed=True, counted=self.row is not None)
            self.order.append(entry)
            self.relay_waiting.append(entry)
        if not frame.data_len:
            self._relay(head)
            return
        if frame.data_len > door.max_request_bytes + MAX_RELAY_PAYLOAD_SLACK:
            # Too large for main to take: answered here, the payload skipped (main would say the same).
            self._refuse_payload(frame, infer, ErrorCode.TOO_LARGE,
                                 f"payload of {frame.data_len} bytes > max_request_bytes ({door.max_request_bytes}): "
                                 f"raise [server] max_request_bytes")
            return
        if self.row is not None:
            held = door.ledger.take_bytes(self.row, door.index, frame.data_len, door.max_buffered_per_uid)
            if held is not None:
                self._refuse_payload(frame, infer, ErrorCode.OVERLOADED,
                                     f"uid {self.uid} has {held} bytes of requests held in the door processes' "
                                     f"memory; {frame.data_len} more would pass server.max_buffered_bytes_per_uid")
                return
            self.held_bytes = frame.data_len
        self.payload_entry = self.relay_waiting[-1] if infer else None
        self.payload_rid = protocol.request_id(frame.meta)
        self.frame_head, self.payload = head, bytearray(frame.data_len)
        self.proto.accept_payload([self.payload])

    def _take_request(self, frame: Frame) -> bool:
        """Count an INFER among its uid's requests in flight across every door (the ledger); or, at
        ``max_inflight_per_uid``, answer it OVERLOADED in its place (its payload skipped) and
        return False."""
        door = self.door
        if self.row is None:
            return True
        held = door.ledger.take_request(self.row, door.index, door.max_inflight_per_uid)
        if held is None:
            door.held_requests += 1
            return True
        if frame.data_len:
            self.proto.discard_payload()
        model = frame.meta.get("model")
        door.count_refusal(model, ErrorCode.OVERLOADED)
        entry = _Entry(relayed=False)
        self.order.append(entry)
        self._fill(entry, [protocol.error_frame(protocol.request_id(frame.meta), ErrorCode.OVERLOADED,
                                                f"uid {self.uid} has {held} requests in flight through the "
                                                f"server's door processes (server.max_inflight_per_uid)")])
        return False

    def _refuse_payload(self, frame: Frame, infer: bool, code: ErrorCode, message: str) -> None:
        """Answer a frame whose payload the door will not hold (main would say the same), the
        payload skipped: an INFER's in its place, anything else at once."""
        self.proto.discard_payload()
        error = protocol.error_frame(protocol.request_id(frame.meta), code, message)
        if infer:
            self.door.count_refusal(frame.meta.get("model"), code)
            self._fill(self.relay_waiting.popleft(), [error])
        elif not self.closed and not self.transport.is_closing():
            self.transport.write(error)

    def _cancel(self, rid: int | None) -> bool:
        """A CANCEL of a lane call this door serves for the connection: taken back if its worker has
        not claimed it (``LaneDispatcher.abandon``: the lane's slot is free at once), answered
        CANCELLED in order; whether it was one.  Any other CANCEL goes to main (a relayed request's
        is main's to drop; one of no request, main ignores or refuses)."""
        for call in self.calls:
            if call.parsed.id == rid and call is not self.call and call.entry.parts is None:
                dispatcher = self.door.dispatcher
                self.door.count_cancel(call, dispatcher.abandon(call))
                dispatcher.count(call.plan.view.name, call.plan.view.version, ErrorCode.CANCELLED.wire)
                self.answer_call(call, [protocol.error_frame(rid, ErrorCode.CANCELLED, "cancelled by the client")])
                return True
        return False

    def _payload_done(self) -> None:
        if self.call is not None:
            call, self.call = self.call, None
            self.door.dispatcher.submit(call)
            return
        head, payload, self.frame_head, self.payload = self.frame_head, self.payload, None, None
        self.payload_entry = self.payload_rid = None
        self._give_bytes()
        if head is not None:
            self._relay(head + payload)

    def _give_bytes(self) -> None:
        if self.held_bytes:
            self.door.ledger.give_bytes(self.row, self.door.index, self.held_bytes)
            self.held_bytes = 0

    def _relay(self, data: bytes) -> None:
        self.relayed += 1
        self.door.relayed += 1
        self.door.link.send({"op": "frame", "c": self.cid}, data)

    # -- deadlines (main's door's: ``FramePump._await_input``, ``ClientConnection.pause_writing``) --

    def _later(self, seconds: float, callback, *args):
        return self.door.loop.call_later(seconds, callback, *args)

    def _input_limit(self, phase: str) -> float:
        return self.door.deadlines[phase]

    def _input_timed_out(self, key: str, seconds: float) -> None:
        """A frame or payload the client began did not complete in time: as main's door, the
        connection is closed with an error frame (a request receiving its payload: TIMEOUT with its
        id; a lane call's slot is taken back, a relayed frame's bytes dropped)."""
        if self.closed:
            return
        rid, entry = None, None
        door = self.door
        if self.call is not None:
            call, self.call = self.call, None
            rid, entry = call.parsed.id, call.entry
            self.calls.pop(call, None)
            door.dispatcher.abandon(call)
            door.dispatcher.count(call.plan.view.name, call.plan.view.version, ErrorCode.TIMEOUT.wire)
        elif self.frame_head is not None:
            rid, entry = self.payload_rid, self.payload_entry
            self.frame_head = self.payload = self.payload_entry = self.payload_rid = None
            self._give_bytes()
            if entry is not None:
                self.relay_waiting.remove(entry)
        if entry is not None:
            self.order.remove(entry)
            if entry.counted:
                entry.counted = False
                door.give_requests(self.row, 1)
        self._close(self._input_refusal(key, rid))

    def _stalled(self) -> None:
        if self.closed:
            return
        log.warning("closing the connection of pid %d uid %d: its answers went unread for %g s "
                    "(server.stall_timeout_s); %d bytes unsent", self.pid, self.uid,
                    self.door.deadlines["stall_timeout_s"], self.transport.get_write_buffer_size())
        self.closed = True
        self.proto.close()
        self.input_deadline.cancel()
        self.transport.abort()  # now, unsent bytes and all: connection_lost takes back what it held

    # -- answers ----------------------------------------------------------------------------

    def started_at(self, call: Call) -> float:
        return self.calls.get(call, self.door.clock())

    def answer_call(self, call: Call, parts: list) -> None:
        """The dispatcher answers a lane call of this connection."""
        self.calls.pop(call, None)
        self._fill(call.entry, parts)

    def relay_call(self, call: Call, frame: bytes) -> None:
        """A lane call goes to main after all: its place in the order waits for main's answer."""
        self.calls.pop(call, None)
        entry = call.entry
        entry.relayed = True
        # main answers relayed INFERs in the order it got them: this one's answer comes after those relayed before
        self.relay_waiting.append(entry)
        self._relay(frame)

    def _fill(self, entry: _Entry, parts: list) -> None:
        entry.parts = parts
        self._flush()
        if not self.flow.reading:
            self._update()

    def _flush(self) -> None:
        while self.order and self.order[0].parts is not None and not self.held:
            entry = self.order.popleft()
            if entry.counted:
                entry.counted = False
                self.door.give_requests(self.row, 1)
            if not self.closed and not self.transport.is_closing():
                self.transport.writelines(entry.parts)

    def from_main(self, meta: dict, data: bytes, fds: list[int]) -> None:
        """An answer main wrote to this connection (``ordered``: a relayed INFER's)."""
        if meta.get("ordered") and self.relay_waiting:
            entry = self.relay_waiting.popleft()
            self._fill(entry, [data])
            return
        if fds or self.held:
            self.held.append((data, fds))
            self._send_held()
            return
        if not self.closed and not self.transport.is_closing():
            self.transport.write(data)

    def _send_held(self) -> None:
        """Send what main sent behind a frame with descriptors, once the transport is empty."""
        while self.held and not self.transport.get_write_buffer_size():
            data, fds = self.held.popleft()
            if self.closed or self.transport.is_closing():
                for fd in fds:
                    os.close(fd)
                continue
            if not fds:
                self.transport.write(data)
                continue
            sock = socket.socket(fileno=os.dup(self.transport.get_extra_info("socket").fileno()))
            try:
                sent = socket.send_fds(sock, [data], fds)
            except BlockingIOError:
                sent = 0
            except OSError:
                sent = len(data)
            finally:
                sock.close()
                for fd in fds:
                    os.close(fd)
            if sent == 0:
                log.warning("socket full while passing a region descriptor; closing the connection")
                self.transport.close()
                return
            if sent < len(data):
                self.transport.write(data[sent:])
        if not self.held:
            self._flush()

    def pause_writing(self) -> None:
        """Answers wait in the transport (the client is not reading them): take no new frame, and
        close the connection if they are still there after ``stall_timeout_s``."""
        self.flow.writing_paused(self.door.deadlines["stall_timeout_s"], self._stalled)
        self._set_reading(False)

    def resume_writing(self) -> None:
        self.flow.writing_resumed()
        self._send_held()
        self._update()

    def unsent(self) -> int:
        """Bytes of answers written to the client that it has not read yet (its transport holds them)."""
        transport = getattr(self, "transport", None)
        return transport.get_write_buffer_size() if transport is not None and not transport.is_closing() else 0

    def taken(self) -> None:
        """Main took a frame (not an INFER) this connection relayed; its answer came before."""
        self.untaken = max(0, self.untaken - 1)
        if not self.flow.reading:
            self._update()

    def main_paused(self, paused: bool) -> None:
        self.paused_by_main = paused
        self._update()

    # -- the end ----------------------------------------------------------------------------

    def _close(self, frame: bytes | None = None) -> None:
        if frame is not None and not self.transport.is_closing():
            self._flush()
            self.transport.write(frame)
        self.closed = True
        self.proto.close()
        self.input_deadline.cancel()
        self.transport.close()

    def close_from_main(self) -> None:
        """Main ends this connection (it refused it, or its frames): after what is written."""
        self._flush()
        self._close()

    def eof_received(self):
        """The client shut its side: main hears of it once every frame before it was taken (main's
        door closes the connection then); the transport stays open for the answers meanwhile."""
        self.eof = True
        self._update()
        return True

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.proto.close()
        self.input_deadline.cancel()
        self.flow.stop()
        door = self.door
        for call in list(self.calls):
            door.count_cancel(call, door.dispatcher.abandon(call))
        if self.call is not None:
            door.count_cancel(self.call, door.dispatcher.abandon(self.call))
            self.call = None
        self.calls.clear()
        self._give_bytes()
        taken = sum(entry.counted for entry in self.order)
        if taken:
            door.give_requests(self.row, taken)
        for entry in self.order:
            entry.counted = False
        for _, fds in self.held:
            for fd in fds:
                os.close(fd)
        self.held.clear()
        if door.connections.pop(self.cid, None) is not None:
            door.link.send({"op": "gone", "c": self.cid})


class Door:
    """This door process: its connections, lanes, link to main and counts."""

    def __init__(self, index: int, link_sock: socket.socket, listen_sock: socket.socket, loop, ledger: UidLedger):
        self.index, self.loop, self.listen_sock = index, loop, listen_sock
        self.ledger = ledger  # every door's per-uid counts (column ``index`` is ours)
        self.clock = loop.time
        self.connections: dict[int, DoorConnection] = {}
        self._cid = 0
        self.directory = Directory()
        self.efd = new_eventfd()
        self.pool = LanePool(self._ask_lane, lambda region: self.link.send({"op": "close_lane", "region": region}))
        self.dispatcher = LaneDispatcher(self.directory, self.pool, self._count, self._limits, self.clock)
        self.counts: collections.Counter = collections.Counter()  # (model, version, outcome) -> n
        self.cancelled: collections.Counter = collections.Counter()  # (model, version, stage) -> n
        self.relayed = 0
        self.held_requests = 0  # INFERs of this door counted in the ledger now (every uid)
        self.refused = 0  # INFERs this door refused itself (max_inflight_per_uid, buffered bytes, too large)
        self.max_inflight = 64
        self.max_request_bytes = 64 << 20
        self.request_timeout_s = 30.0
        self.max_inflight_per_uid = 512
        self.max_buffered_per_uid = 256 << 20
        # main's door's deadlines for its connections (DoorLimits), as main says
        self.deadlines = {"stall_timeout_s": 30.0, "frame_timeout_s": 30.0, "upload_timeout_s": 30.0}
        self.server: asyncio.AbstractServer | None = None
        self.done = loop.create_future()
        self.draining = False
        self.link = Link(link_sock, loop, self._on_message, self._on_link_closed)
        loop.add_reader(self.efd, self._on_completions)

    def new_cid(self) -> int:
        self._cid += 1
        return self._cid

    def _limits(self) -> tuple[float, int]:
        return self.request_timeout_s, self.max_request_bytes

    def _count(self, name: str, version: int, outcome: str) -> None:
        self.counts[(name, version, outcome)] += 1

    def give_requests(self, row: int, n: int) -> None:
        """``n`` INFERs of ``row``'s uid counted in the ledger are written back (or gone)."""
        self.ledger.give_request(row, self.index, n)
        self.held_requests -= n

    def count_refusal(self, model, code: ErrorCode) -> None:
        """A request this door refused before any lane or main saw it, counted as main's
        ``Dispatcher.refused`` counts its own (a label only for a model the door knows)."""
        label = model if isinstance(model, str) and model in self.directory.models else "_unknown"
        self.refused += 1
        self.counts[(label, "", code.wire)] += 1

    def count_cancel(self, call: Call, stage: str | None) -> None:
        """A lane call of this door its caller gave up on, where it was (``LaneDispatcher.abandon``);
        main adds these to its own (``cancelled`` in ``info`` and metrics)."""
        if stage is not None:
            self.cancelled[(call.plan.view.name, call.plan.view.version, stage)] += 1

    def _ask_lane(self, view) -> None:
        self.link.send({"op": "open_lane", "model": view.name, "version": view.version}, fds=[self.efd])

    # -- main's messages ----------------------------------------------------------------------

    def _on_message(self, meta: dict, data: bytes, fds: list[int]) -> None:
        op = meta.get("op")
        conn = self.connections.get(meta.get("c")) if "c" in meta else None
        if op == "out":
            if conn is not None:
                conn.from_main(meta, data, fds)
            else:
                for fd in fds:
                    os.close(fd)
        elif op == "admit":
            if conn is not None:
                conn.admit(meta.get("row"))
        elif op == "close":
            if conn is not None:
                conn.close_from_main()
        elif op == "taken":
            if conn is not None:
                conn.taken()
        elif op in ("pause", "resume"):
            if conn is not None:
                conn.main_paused(op == "pause")
        elif op == "models":
            self._models(meta)
        elif op == "lane":
            self._lane(meta, fds)
        elif op == "drain":
            self.loop.create_task(self.drain())
        else:
            for fd in fds:
                os.close(fd)

    def _models(self, meta: dict) -> None:
        gone = self.directory.update(meta)
        self.pool.refused.clear()
        for key in gone:
            self.pool.retire(key)
        for (name, version), lanes in list(self.pool.lanes.items()):
            view = self.directory.versions.get((name, version))
            if view is not None:
                for lane in lanes:
                    if lane.view.model_id != view.model_id:
                        lane.retiring = True
        limits = meta.get("limits", {})
        self.max_inflight = int(limits.get("max_inflight_per_connection", self.max_inflight))
        self.max_request_bytes = int(meta.get("max_request_bytes", self.max_request_bytes))
        self.request_timeout_s = float(limits.get("request_timeout_s", self.request_timeout_s))
        self.max_inflight_per_uid = int(limits.get("max_inflight_per_uid", self.max_inflight_per_uid))
        self.max_buffered_per_uid = int(limits.get("max_buffered_bytes_per_uid", self.max_buffered_per_uid))
        for key in self.deadlines:
            self.deadlines[key] = float(limits.get(key, self.deadlines[key]))
        self.link.send({"op": "synced", "seq": meta.get("seq")})

    def _lane(self, meta: dict, fds: list[int]) -> None:
        key = (meta.get("model"), meta.get("version"))
        view = self.directory.versions.get(key)
        if meta.get("error") or len(fds) != 1 or view is None:
            for fd in fds:
                os.close(fd)
            if meta.get("region") is not None and view is None:
                self.link.send({"op": "close_lane", "region": meta["region"]})
            self.pool.not_opened(key)
            if meta.get("error"):
                log.info("door %d: no lane of %s:%s (%s)", self.index, key[0], key[1], meta["error"])
            return
        self.pool.opened(view, meta["region"], fds[0], meta["size"])

    def _on_link_closed(self) -> None:
        log.info("door %d: main is gone; exiting", self.index)
        if not self.done.done():
            self.done.set_result(None)

    # -- completions and reports --------------------------------------------------------------

    def _on_completions(self) -> None:
        drain_eventfd(self.efd)
        self.dispatcher.collect()

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(REPORT_S)
            self.dispatcher.collect()  # a safety net: a lost wake-up costs at most REPORT_S
            self.dispatcher.expire(self.clock())
            self.pool.sweep()
            for conn in list(self.connections.values()):
                if not conn.reading and conn.admitted:
                    conn._update()
            self.report()

    def report(self) -> None:
        counts = [[name, version, outcome, n] for (name, version, outcome), n in self.counts.items()]
        cancelled = [[name, version, stage, n] for (name, version, stage), n in self.cancelled.items()]
        self.link.send({"op": "report", "counts": counts, "cancelled": cancelled,
                        "stats": {"connections": len(self.connections), "in_flight": self.dispatcher.in_flight,
                                  "lanes": len(self.pool.by_region), "relayed": self.relayed,
                                  "held_requests": self.held_requests, "refused": self.refused,
                                  "held_bytes": sum(c.held_bytes for c in self.connections.values()),
                                  "unsent_bytes": sum(c.unsent() for c in self.connections.values())}})

    # -- life ---------------------------------------------------------------------------------

    async def serve(self) -> None:
        self.server = await self.loop.create_unix_server(lambda: DoorConnection(self), sock=self.listen_sock)
        self.link.send({"op": "hello", "index": self.index, "pid": os.getpid()})
        ticker = self.loop.create_task(self.tick())
        try:
            await self.done
        finally:
            ticker.cancel()
            self.pool.close_all()

    async def drain(self) -> None:
        """Stop accepting; answer the lane calls in flight; then tell main (it stops this process)."""
        if self.draining:
            return
        self.draining = True
        if self.server is not None:
            self.server.close()
        deadline = self.clock() + 30
        while self.dispatcher.in_flight and self.clock() < deadline:
            self.dispatcher.collect()
            await asyncio.sleep(0.005)
        self.report()
        self.link.send({"op": "drained"})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmserve.doors", description="A shmserve door process "
                                     "(started by shmserve serve --doors N; not for people to run).")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--link-fd", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--ledger-fd", type=int, required=True)
    parser.add_argument("--ledger-rows", type=int, required=True)
    parser.add_argument("--ledger-columns", type=int, required=True)
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    from shmserve import logs

    logs.configure(args.log_format, args.verbose)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's ^C is main's to act on
    link_sock = socket.socket(fileno=args.link_fd)
    listen_sock = socket.socket(fileno=args.listen_fd)
    ledger = UidLedger.attach(args.ledger_fd, args.ledger_rows, args.ledger_columns)
    import uvloop

    async def run() -> None:
        loop = asyncio.get_running_loop()
        door = Door(args.index, link_sock, listen_sock, loop, ledger)
        loop.add_signal_handler(signal.SIGTERM, lambda: door.done.done() or door.done.set_result(None))
        await door.serve()

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
