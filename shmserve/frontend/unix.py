"""The Unix-socket front door: the native protocol over a local stream socket.

Owns: who may connect (the peer's ``SO_PEERCRED``, read by ``doorkit.peer_of``, against the
allow-lists), and each connection: it pumps bytes between the socket and the sans-I/O protocol
(``shmserve.protocol``), hands inference requests to the dispatcher, answers
control messages (models, health, info, regions), drops a request its client
cancels (CANCEL: ``Dispatcher.cancel``), keeps answers in the order
the requests came, passes region descriptors (``SCM_RIGHTS``), and frees
what a connection held when it goes.  It bounds what one client can make the
server hold (``doorkit.DoorLimits``): connections in all and per uid, write
backpressure (a connection whose answers wait unread takes no new frame, and
is closed after ``stall_timeout_s``), the arena bytes a connection's requests
may hold before it is read again, and deadlines on a half-sent frame and on a
stalled upload.  It keeps the rate limits (``shmserve.frontend.ratelimit``, shared
with the v2 doors) as each request enters, from its frame's metadata, before its
payload is read; a caller a limit holds is given no lane of that model.

Data path: a connection is an ``asyncio.BufferedProtocol``; while an inline
request's payload arrives, ``get_buffer`` returns the views of arena space
the dispatcher gave it (``Door.admitted``), so the kernel copies the bytes
straight into shared memory.  Results are written with ``writelines`` from
views of the arena, which are released only once the transport has flushed
them (the write buffer limit is 0, so ``pause_writing`` means "not all sent"
and ``resume_writing`` "all sent").

The listening socket (its path, mode and group, a dead predecessor's socket file, a directory
nobody else controls), the peer's credentials, connection counting, flow control, the stall
timer, the input deadlines and the native protocol's byte pump are the door kit's
(``shmserve.doorkit``), shared with the v2 doors and the door processes.

Must not: decide anything about a request (the dispatcher does), parse bytes
itself (the protocol module does), or block the loop.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import socket

from shmserve import lanes, layout, protocol
from shmserve.doorkit import (MID_PAYLOAD, UNKNOWN_PEER, ConnectionCounts, DoorLimits, FlowControl, FramePump,
                              InputDeadline, big_buffers, peer_of)
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.dispatcher import Answer, Clock, Dispatcher, Failure, Outputs, new_caller
from shmserve.frontend.ratelimit import Caller, RateLimiter
from shmserve.frontend.regions import RegionTable
from shmserve.frontend.requests import Request, RequestState
from shmserve.frontend.status import Status
from shmserve.protocol import Frame, Kind, PayloadDone, ProtocolError, ProtocolViolation

log = logging.getLogger("shmserve.unix")

READ_BUFFER = 256 * 1024  # protocol bytes between payloads; payloads bypass it
# Frames one connection takes in one turn of the loop before others are served: one read of
# tiny frames is thousands of them (measured: ~0.1 s of a burst of 'info' on the 2-vCPU VM).
FRAMES_PER_TURN = 64


class UnixDoor:
    """The door itself: what every connection shares, the set of open connections, and how many
    each peer uid has open."""

    def __init__(self, dispatcher: Dispatcher, regions: RegionTable, status: Status, *, clock: Clock,
                 limits: DoorLimits, allow_uids=(), allow_gids=(), lifecycle=None, admin=((), ()),
                 rate: RateLimiter | None = None):
        self.dispatcher, self.regions, self.status, self.clock = dispatcher, regions, status, clock
        self.limits = limits
        self.rate = rate if rate is not None else RateLimiter()  # per-caller rate limits ([rate_limits])
        self.lifecycle = lifecycle  # the model lifecycle: control calls (load, unload, scale, canary)
        self.admin = admin  # (uids, gids) allowed control calls besides our own uid and root
        self.connections = ConnectionCounts()  # open connections, in all and per peer uid
        self.set_access(allow_uids, allow_gids)

    def set_access(self, allow_uids, allow_gids) -> None:
        """Who may connect: these uids and gids (primary or supplementary), our own uid and root."""
        self.allowed_uids = {os.getuid(), 0, *allow_uids}
        self.allowed_gids = set(allow_gids)

    def allowed(self, uid: int, groups: set[int]) -> bool:
        return uid in self.allowed_uids or bool(groups & self.allowed_gids)

    def is_admin(self, uid: int, groups: set[int]) -> bool:
        """Whether a peer may make control calls: our own uid, root, or on ``admin_uids`` /
        ``admin_gids`` (primary or supplementary group)."""
        uids, gids = self.admin
        return uid in (os.getuid(), 0) or uid in uids or bool(groups & set(gids))

    def enter(self, conn: "ClientConnection", pid: int, uid: int, gid: int, groups: set[int]) -> bytes | None:
        """Count ``conn`` (its peer's credentials: ``groups`` are its gid and supplementary groups)
        among the open connections; or, if it may not be served, the error frame that says why:
        PERMISSION_DENIED (not on the allow-lists) or OVERLOADED (``max_connections``,
        ``max_connections_per_uid``)."""
        if not self.allowed(uid, groups):
            log.warning("refused connection from pid %d uid %d gid %d (not on the allow-list)", pid, uid, gid)
            return protocol.error_frame(None, ErrorCode.PERMISSION_DENIED, f"uid {uid} is not allowed to use this server")
        refusal = self.connections.refusal(self.limits, uid, f"uid {uid}")
        if refusal is not None:
            log.warning("refused connection from pid %d uid %d: %s", pid, uid, refusal)
            return protocol.error_frame(None, ErrorCode.OVERLOADED, refusal)
        self.connections.enter(conn, uid)
        return None

    def leave(self, conn: "ClientConnection") -> None:
        """``conn`` is gone (a refused one was never counted)."""
        self.connections.leave(conn)

    def check_uid_in_flight(self, uid: int) -> None:
        """OVERLOADED if ``uid``'s connections together have ``max_inflight_per_uid`` requests in
        flight.  Summed only when its connections could reach it at all (few connections: free)."""
        limit, conns = self.limits.max_inflight_per_uid, self.connections.of_owner.get(uid, ())
        if len(conns) * self.dispatcher.limits.max_inflight_per_door <= limit:
            return
        held = sum(c.in_flight() for c in conns)
        if held >= limit:
            raise ShmserveError(ErrorCode.OVERLOADED, f"uid {uid} has {held} requests in flight on its "
                                                      f"{len(conns)} connections (server.max_inflight_per_uid)")

    def check_rate(self, conn: "ClientConnection", model: str, nbytes: int) -> None:
        """OVERLOADED, naming the limit and when to retry (``retry_after``), if a rate limit holding
        ``conn``'s peer refuses a request of ``nbytes`` bytes for ``model`` now; else it is charged."""
        refusal = self.rate.admit(conn.caller(), model, nbytes, self.clock.monotonic())
        if refusal is not None:
            raise ShmserveError(ErrorCode.OVERLOADED, refusal.message, refusal.retry_after)

    def check_lane(self, conn: "ClientConnection", model: str) -> None:
        """OVERLOADED if a rate limit holds ``conn``'s peer's calls of ``model``: such a caller is
        given no lane (a lane call never passes the front-end), so its calls come over the socket,
        where ``check_rate`` keeps the limit (docs/config.md, "Rate limits")."""
        limit = self.rate.covering(conn.caller(), model) if self.rate.limits else None
        if limit is not None:
            raise ShmserveError(ErrorCode.OVERLOADED, f"rate limit {limit.key!r} holds uid {conn.uid}'s calls of "
                                                      f"model {model!r}: no lane (its calls go over the socket)")

    def protocol(self) -> "ClientConnection":
        return ClientConnection(self)

    def unflushed(self) -> bool:
        """Whether any open connection still has answers in its transport's buffer."""
        return any(c.transport.get_write_buffer_size() for c in self.connections if not c.transport.is_closing())

    def close_all(self) -> None:
        """At exit, once answers have had their time to flush: drop every connection now (what is
        still unsent never will be; what it held is freed as each goes)."""
        for conn in list(self.connections):
            conn.transport.abort()


class _Entry:
    """A request's place in its connection's answer order: the frame parts of its answer once
    there is one; ``req`` is None for a request refused before the dispatcher took it."""

    __slots__ = ("req", "parts", "held", "payload_pending")

    def __init__(self, req: Request | None, parts: list | None = None, payload_pending: bool = False):
        self.req, self.parts, self.held, self.payload_pending = req, parts, False, payload_pending


class ClientConnection(FramePump):
    """One client: pumps bytes between the socket and the sans-I/O protocol, keeps answers in
    order.  It is the dispatcher's ``Door`` for the requests it submits.

    When it reads (write backpressure): a new frame is taken only while nothing waits in the
    transport (the client reads its answers), no request of it waits for arena space, fewer than
    ``max_inflight_per_connection`` refusals wait in order behind a request still running, and its
    requests in flight hold less than ``max_inflight_bytes_per_connection``; at most
    ``FRAMES_PER_TURN`` frames are taken in one turn of the loop.  The socket is read exactly while
    a frame may be taken, or while a payload is arriving.  So what a client can make this
    connection buffer is one read of frames, the one reply that filled its socket, and the answers
    of its requests in flight (``max_inflight_per_connection``, enforced by the dispatcher) and of
    as many refusals.

    Deadlines (``DoorLimits``): answers unread for ``stall_timeout_s`` close the connection; a
    frame begun must complete its header and metadata within ``frame_timeout_s``, and a payload
    being received must complete within ``upload_timeout_s``, else the connection is closed with
    an error frame naming the key.  The input deadlines run only while the server waits for the
    client (never while this side stopped reading).
    """

    def __init__(self, door: UnixDoor):
        self.door, self.dispatcher = door, door.dispatcher
        self.proto = protocol.Connection(protocol.Role.SERVER)
        self.read_buffer = bytearray(READ_BUFFER)
        self.read_view = memoryview(self.read_buffer)
        self.into_payload = False
        self.order: collections.deque[_Entry] = collections.deque()
        self.entries: dict[Request, _Entry] = {}
        self.unflushed: list[Request] = []  # results written, their views not yet all sent
        self.receiving: Request | None = None
        self.waiting_for_space: Request | None = None  # the request this connection stopped reading for
        self.flow = FlowControl(self._later)  # reading, writing and the stall timer
        self.input_deadline = InputDeadline(self._later)  # of what the client is sending now
        self.processing = False
        self.yielded = False  # FRAMES_PER_TURN taken: the rest waits for the loop's next turn
        self.closed = False
        self.pid = self.uid = -1
        self.groups: set[int] = set()
        self._caller: Caller | None = None
        self.caller_key = new_caller()  # its requests' key for fairness between callers (Door.caller_key)

    def connection_made(self, transport) -> None:
        self.transport = transport
        FlowControl.zero_write_buffer(transport)
        sock = transport.get_extra_info("socket")
        big_buffers(sock)
        peer = peer_of(sock) or UNKNOWN_PEER
        pid, uid, gid = peer.pid, peer.uid, peer.gid
        self.pid, self.uid = pid, uid
        self.groups = set(peer.groups)
        refusal = self.door.enter(self, pid, uid, gid, self.groups)
        if refusal is not None:
            self._close(refusal)

    def caller(self) -> Caller:
        """Its peer as rate limits see it (its uid and groups, as the kernel said at connect)."""
        if self._caller is None or self._caller.uid != self.uid:
            self._caller = Caller.of_uid(self.uid, self.groups)
        return self._caller

    # -- reading --------------------------------------------------------------------------

    def _update(self) -> None:
        """Take what may be taken now, then read the socket exactly while more may be."""
        self.process()
        self._set_reading()

    def _set_reading(self) -> None:
        if self.closed:
            return
        want = (self.waiting_for_space is None and not self.yielded
                and (self.proto.state in MID_PAYLOAD or self._takes_frames()))
        self._read_while(want)

    def _takes_frames(self) -> bool:
        """Whether a new frame may be taken: not while answers wait unread in the transport, nor
        while ``max_inflight_per_connection`` refusals wait for their turn behind a request still
        running, nor while this connection's requests in flight hold
        ``max_inflight_bytes_per_connection``."""
        if self.flow.write_blocked:
            return False
        if not self.entries and not self.unflushed:
            return True
        if len(self.order) - len(self.entries) >= self.dispatcher.limits.max_inflight_per_door:
            return False
        held = sum(r.total_bytes for r in self.entries) + sum(r.total_bytes for r in self.unflushed)
        return held < self.door.limits.max_inflight_bytes_per_connection

    def process(self) -> None:
        if self.processing:
            return  # re-entered (e.g. an answer from inside a frame handler): the outer loop continues
        self.processing = True
        try:
            self._process()
        finally:
            self.processing = False

    def _process(self) -> None:
        proto = self.proto
        for _ in range(FRAMES_PER_TURN):
            if self.closed or self.yielded or proto.state is protocol.State.AWAIT:
                return  # AWAIT: waiting for arena space
            if proto.state not in MID_PAYLOAD and not self._takes_frames():
                return
            event = proto.next_event()
            if event is protocol.NEED_DATA:
                self._await_input()
                return
            self.input_deadline.cancel()  # a frame's header and metadata, or a payload, is complete
            try:
                if isinstance(event, Frame):
                    self.on_frame(event)
                elif isinstance(event, PayloadDone):
                    req, self.receiving = self.receiving, None
                    if req is not None:  # None: a discarded payload
                        self.dispatcher.received(req)
            except Exception:  # our bug: this connection ends, the server goes on
                log.exception("internal error handling a %s; closing that connection", type(event).__name__)
                self._close(protocol.error_frame(None, ErrorCode.INTERNAL, "internal server error"))
                return
            if isinstance(event, ProtocolError):
                log.info("closing a connection: %s: %s", event.code.wire, event.message)
                self._close(protocol.error_frame(None, event.code, event.message))
                return
        self.yielded = True  # the rest on the loop's next turn; not read meanwhile
        self.door.clock.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self.yielded = False
        self._update()

    def _later(self, seconds: float, callback, *args):
        return self.door.clock.call_later(seconds, callback, *args)

    def _input_limit(self, phase: str) -> float:
        return getattr(self.door.limits, phase)

    def _input_timed_out(self, key: str, seconds: float) -> None:
        """A frame or payload the client began did not complete in time: it is answered (a request
        receiving its payload: TIMEOUT, and its space is freed now) and the connection closed."""
        if self.closed:
            return
        req, self.receiving = self.receiving, None
        frame = self._input_refusal(key, req.id if req is not None else None)
        self._close(frame)  # first: nothing more is received into the request's space
        if req is not None:
            self.order.remove(self.entries.pop(req))
            self.dispatcher.drop(req, cancelled=False)  # answered here; its space is free for others now

    def on_frame(self, frame: Frame) -> None:
        kind, meta = frame.kind, frame.meta
        rid = protocol.request_id(meta)
        infer = kind in (Kind.INFER, Kind.INFER_REGION)
        try:
            if infer:
                self._on_infer(frame)
            elif rid is None:
                raise ShmserveError(ErrorCode.BAD_FRAME, "'id' must be an integer in [0, 2**63)")
            elif kind == Kind.CANCEL:
                self._cancel(protocol.parse_cancel(meta))
            elif kind == Kind.MODELS:
                self.reply(rid, {"models": self.door.status.model_listing()})
            elif kind == Kind.HEALTH:
                self.reply(rid, self.door.status.health())
            elif kind == Kind.INFO:
                self.reply(rid, self.door.status.info(self.uid))
            elif kind == Kind.OPEN_REGION:
                self._open_region(rid, meta)
            elif kind == Kind.CLOSE_REGION:
                region = self.door.regions.close(self, meta.get("region"))
                self.reply(rid, {"closed": region.id})
            elif kind == Kind.REPOSITORY:
                self.reply(rid, self.door.status.repository_index(self.door.is_admin(self.uid, self.groups)))
            elif kind in protocol.CONTROL_KINDS:
                self._control(rid, protocol.parse_control(kind, meta))
        except (ProtocolViolation, ShmserveError) as exc:
            answer = protocol.error_frame(rid, exc.code, exc.message, getattr(exc, "retry_after", None))
            if frame.data_len and self.proto.state is protocol.State.AWAIT:
                self.proto.discard_payload()
            if infer:
                if isinstance(exc, ProtocolViolation):  # submit counts its own refusals
                    self.dispatcher.refused(meta.get("model"), exc.code, exc.message)
                self.answer_in_order(answer)  # after the results of earlier requests on this connection
            else:
                self.send_now(answer)

    def _on_infer(self, frame: Frame) -> None:
        parsed = protocol.parse_infer(frame.meta, zero_copy=frame.kind == Kind.INFER_REGION)
        region = self.door.regions.get(self, parsed.region) if parsed.region is not None else None
        try:
            self.door.check_uid_in_flight(self.uid)
            if self.door.rate.limits:  # (no limits: one attribute test per request)
                self.door.check_rate(self, parsed.model, frame.data_len if region is None else
                                     sum(t.nbytes for t in parsed.inputs))
        except ShmserveError as exc:
            self.dispatcher.refused(parsed.model, exc.code, exc.message)
            raise
        req = self.dispatcher.submit(self, parsed, payload_bytes=frame.data_len, region=region)
        entry = _Entry(req, payload_pending=frame.data_len > 0)
        self.order.append(entry)
        self.entries[req] = entry
        self.dispatcher.admit(req)

    def _cancel(self, rid: int) -> None:
        """A CANCEL: this connection's request ``rid`` is dropped if it is still unanswered
        (``Dispatcher.cancel``: answered CANCELLED, in order); never answered itself.  An id this
        connection does not hold — answered already, never sent, another connection's — is
        ignored, and so is a request still receiving its payload (its deadline ends it)."""
        for entry in self.order:  # (at most max_inflight_per_connection requests and their refusals)
            req = entry.req
            if req is not None and req.id == rid and req is not self.receiving:
                if entry.parts is None or req.state is RequestState.FLUSHING:  # (flushing: counted, kept)
                    self.dispatcher.cancel(req)
                return

    def _control(self, rid: int, call: protocol.ControlCall) -> None:
        """A model-lifecycle call: PERMISSION_DENIED unless the peer is an admin; it runs as a task
        (a load takes seconds) and is answered when it is done, whatever this connection does
        meanwhile (its other requests are served)."""
        if not self.door.is_admin(self.uid, self.groups):
            log.warning("refused %s from pid %d uid %d (not on the admin list)", call.kind.name.lower(), self.pid,
                        self.uid)
            raise ShmserveError(ErrorCode.PERMISSION_DENIED, f"uid {self.uid} may not {call.kind.name.lower()} "
                                                             f"models (server.admin_uids, server.admin_gids)")
        if self.door.lifecycle is None:
            raise ShmserveError(ErrorCode.INTERNAL, "this server has no model lifecycle")
        log.info("%s %s from pid %d uid %d", call.kind.name.lower(), call.model, self.pid, self.uid)
        task = asyncio.get_running_loop().create_task(self.door.lifecycle.control(call, by=f"uid {self.uid}"))
        task.add_done_callback(lambda t: self._control_done(rid, t))

    def _control_done(self, rid: int, task: "asyncio.Task") -> None:
        if self.closed or task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self.reply(rid, task.result())
        elif isinstance(exc, ShmserveError):
            self.send_now(protocol.error_frame(rid, exc.code, exc.message))
        else:
            log.error("control call failed: %r", exc)
            self.send_now(protocol.error_frame(rid, ErrorCode.INTERNAL, f"the control call failed: {exc!r}"))

    def _open_region(self, rid: int, meta: dict) -> None:
        lane = meta.get("lane")
        if "lane" in meta and not isinstance(lane, str):
            raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"'lane' must name a model: {lane!r} is none")
        version = meta.get("version")
        if version is not None and (type(version) is not int or not 1 <= version <= protocol.MAX_VERSION):
            raise ShmserveError(ErrorCode.BAD_ARGUMENT, f"'version' must be a positive integer, not {version!r:.40}")
        if lane is not None:
            self.door.check_lane(self, lane)
        region = self.door.regions.open(self, meta.get("size"), lane, uid=self.uid, pid=self.pid,
                                        version=version if lane is not None else None)
        answer = {"id": rid, "region": region.id, "size": region.size}
        if region.is_lane:
            answer["lane"] = {"model": region.lane_model.name, "version": region.lane_model.version,
                              "data_offset": lanes.DATA_FLOOR,
                              "slots": layout.LANE_SLOTS}
        self.send_with_fd(protocol.encode_frame(Kind.REGION, answer), region.fd)

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self._end_input()
        self.door.leave(self)
        self._unblocked()
        self.receiving = None
        for entry in self.order:
            if entry.req is not None:
                self.dispatcher.drop(entry.req)
        self.order.clear()
        self.entries.clear()
        self.door.regions.drop_owner(self)

    # -- the dispatcher's Door ------------------------------------------------------------

    def in_flight(self) -> int:
        return len(self.order) + len(self.unflushed)

    def waiting(self, req: Request) -> None:
        self.waiting_for_space = req
        self._set_reading()  # its payload (and every later request) stays in the socket until there is space

    def admitted(self, req: Request, sinks: list | None) -> None:
        if req is self.waiting_for_space:
            self.waiting_for_space = None
        if self.closed:
            return  # ending: connection_lost drops it
        if sinks is not None:
            self.entries[req].payload_pending = False
            self.receiving = req
            self.proto.accept_payload(sinks)
        self._update()

    def abort(self, exc: Exception) -> None:
        """``Door.abort``: a method of this connection raised (a bug, or a fault beneath it): it ends
        now.  Its transport is aborted (nothing more lands in a request's space, nothing queued is
        sent from the arena); ``connection_lost`` then drops what it held."""
        log.error("closing the connection of pid %d uid %d: serving it failed (%s: %s)", self.pid, self.uid,
                  type(exc).__name__, exc)
        self._end_input()
        self.transport.abort()

    def answer(self, req: Request, answer: Answer) -> None:
        entry = self.entries.get(req)
        if entry is None:
            if isinstance(answer, Outputs) and answer.in_arena:
                self.dispatcher.release(req)  # its connection is gone
            return
        if req is self.waiting_for_space:
            self.waiting_for_space = None
        if isinstance(answer, Failure):
            entry.parts = [protocol.error_frame(req.id, answer.code, answer.message)]
            if entry.payload_pending:  # answered before its payload was read: skip the payload
                entry.payload_pending = False
                if self.proto.state is protocol.State.AWAIT:
                    self.proto.discard_payload()
        elif answer.in_arena:
            metas = [{"name": o.name, "dtype": o.dtype, "shape": list(o.shape)} if o.dtype != protocol.BYTES
                     else protocol.tensor_wire(o.name, o.dtype, o.shape, o.nbytes) for o in answer.outputs]
            header = protocol.encode_frame(Kind.RESULT, {"id": req.id, "outputs": metas},
                                           sum(o.nbytes for o in answer.outputs))
            entry.parts = [header] + [o.view for o in answer.outputs if o.nbytes]
            entry.held = True
        else:
            metas = [protocol.tensor_wire(o.name, o.dtype, o.shape, o.nbytes, o.offset) for o in answer.outputs]
            entry.parts = [protocol.encode_frame(Kind.RESULT_REGION, {"id": req.id, "outputs": metas})]
        self.flush()
        if not self.flow.reading:
            self._update()  # it may take frames again (space, or bytes in flight, freed up)

    # -- writing --------------------------------------------------------------------------

    def reply(self, rid: int, body: dict) -> None:
        self.send_now(protocol.encode_frame(Kind.REPLY, {"id": rid, **body}))

    def send_now(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    def answer_in_order(self, data: bytes) -> None:
        """Send an answer that holds nothing, but only after every earlier request's answer."""
        if not self.order:
            self.send_now(data)
            return
        self.order.append(_Entry(None, [data]))
        self.flush()

    def flush(self) -> None:
        """Write answered requests from the head of this connection's order."""
        while self.order and self.order[0].parts is not None:
            entry = self.order.popleft()
            parts, entry.parts = entry.parts, None
            if entry.req is not None:
                del self.entries[entry.req]
            if self.transport.is_closing():
                if entry.held:
                    self.dispatcher.release(entry.req)
                continue
            self.transport.writelines(parts)
            if entry.held:
                if self.transport.get_write_buffer_size() == 0:
                    self.dispatcher.release(entry.req)
                else:
                    self.unflushed.append(entry.req)

    def send_with_fd(self, frame: bytes, fd: int) -> None:
        """Send a frame with a descriptor attached (SCM_RIGHTS).  Frames are taken only while
        nothing waits in the transport, so nothing can be queued ahead of it: the descriptor is
        never held back (nor duplicated) for a client that does not read."""
        if self.transport.get_write_buffer_size():
            raise RuntimeError("a descriptor to pass while answers wait in the transport")
        sock = socket.socket(fileno=os.dup(self.transport.get_extra_info("socket").fileno()))
        try:
            sent = socket.send_fds(sock, [frame], [fd])
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                raise
            sent = len(frame)
        finally:
            sock.close()
        if sent == 0:
            log.warning("socket full while passing a region descriptor; closing the connection")
            self._close()
        elif sent < len(frame):
            self.transport.write(frame[sent:])

    def pause_writing(self) -> None:
        """Answers wait in the transport (the client is not reading them): take no new frame, and
        close the connection if they are still there after ``stall_timeout_s``."""
        self.flow.writing_paused(self.door.limits.stall_timeout_s, self._stalled)
        self._set_reading()

    def resume_writing(self) -> None:
        """Everything written is sent: release the results it held, and take frames again."""
        self.flow.writing_resumed()
        self._unblocked()
        self._update()

    def _unblocked(self) -> None:
        """Nothing waits in the transport any more (all sent, or the connection is gone): stop the
        stall timer and release the results the transport held."""
        self.flow.stop()
        held, self.unflushed = self.unflushed, []
        for req in held:
            self.dispatcher.release(req)

    def _stalled(self) -> None:
        log.warning("closing the connection of pid %d uid %d: its answers went unread for %g s "
                    "(server.stall_timeout_s); %d bytes unsent, %d results held", self.pid, self.uid,
                    self.door.limits.stall_timeout_s, self.transport.get_write_buffer_size(), len(self.unflushed))
        self._end_input()
        self.transport.abort()  # now, unsent bytes and all: connection_lost frees what it held

    def _close(self, frame: bytes | None = None) -> None:
        """End this connection: ``frame`` (if any) is the last it is sent, after what is queued, and
        nothing more is read.  What it holds is freed in ``connection_lost``, once the transport
        has let go of its views: as soon as they are sent, or at the stall deadline."""
        if frame is not None:
            self.send_now(frame)
        self._end_input()
        self.transport.close()

    def _end_input(self) -> None:
        """Read nothing more: no byte more lands in a request's arena space, no deadline runs."""
        self.closed = True
        self.proto.close()
        self.input_deadline.cancel()
