"""The KServe v2 HTTP door: HTTP/1.1 on the front-end's loop, parsed by httptools.

Owns: the listening socket (a loopback ``host:port``, or a Unix socket path
made like the native socket: its directory trusted, its mode and group
set), who each request is (on a Unix socket the peer's uid from
``SO_PEERCRED``, checked against the allow-list when it connects; on TCP the
``Authorization: Bearer`` token of each request, or anonymous: a proxy's
connection carries many callers' requests), and each connection: it pumps
bytes into an ``httptools.HttpRequestParser``, answers requests one at a time
in the order they came (pipelined ones wait their turn), and bounds what a
client can make it hold (``HttpLimits``, the native door's ``DoorLimits``,
and the v2 ``Ledger`` per caller).

A request is identified and checked (``auth.Authenticator.check``: may it
run this operation; is its caller within ``max_inflight_per_uid``) as soon as
its headers are in, before a byte of its body is read; a refused one is
answered and its connection closed, so a caller that is refused holds
nothing.  Every body byte held in memory counts against its caller
(``max_buffered_bytes_per_uid``) until its answer is sent.

A connection's life is a table (``RULES``: state, event, next state); the
request line and headers must arrive within ``frame_timeout_s``, a body
within ``upload_timeout_s``; answers left unread for ``stall_timeout_s``
close the connection.  Only one request is served at a time: once a parsed
request waits behind the one being served, the socket is not read until its
turn (the rest stays in the kernel's buffer).  An infer request is served
without a task: ``V2Service.start`` calls back when it is answered, in the
turn of the loop that collected its completion.

Data path: a binary infer request (``Inference-Header-Content-Length``, a
``Content-Length``, no transfer or content encoding) whose body is still
arriving once its JSON header is in is *streamed*: the header is parsed and
the request submitted, and once the dispatcher gives it arena space
(``BodyStream.fill``, the ``BodyReceiver``) ``get_buffer`` returns views of that space, so the
kernel copies the tensor bytes straight into shared memory, as on the native
socket.  Binary outputs are written with ``writelines`` from views of the
arena, released once the transport has sent them.  Smaller requests (the
whole body in one read) are parsed from the buffer they arrived in.

Work on the loop is bounded per turn: a body whose JSON is more than
``INLINE_DECODE_BYTES``, or that came gzip or deflate, is decoded on a thread
(inflating lets go of Python's lock, a piece at a time into pages mapped as
they are written, so that no copy of the whole body holds the lock; JSON tensor
data is turned into arrays
``rest.JSON_PIECE`` elements at a time; a body inflates at most to what it
may hold: ``max_json_bytes`` for JSON, ``max_body_bytes`` for binary).  A
large JSON answer (``rest.ResultBody`` not ``small``) is made a piece at a
time, one piece per turn: once to count its length, then again as the
transport sends it, so an answer nobody reads holds one piece and its arena
space, not its whole text (``_answer_step``, ``PiecedAnswer``).  Transfer codings other than
``chunked`` are answered 501 (as h11 does), never ignored.

The parts: ``HttpConnection`` is the transport, the parser's callbacks, the
input table and the writing, built on the door kit (``shmserve.doorkit``:
``FlowControl`` for reading, writing and the stall timer, ``InputDeadline``,
``ConnectionCounts``, ``Listener``, ``peer_of``); each request is an
``Exchange`` (which serves itself when its turn comes) and each answer an ``Answer`` (``shmserve.v2.exchange``, where
the operations other than infer are a table, ``OPERATIONS``); the body being
streamed into the arena, or dropped, is a ``BodyStream``.  Its timers come
from ``HttpDoor.clock`` (the loop, or a fake clock in tests).

Must not: decide anything about a request (``shmserve.v2.service``), know the
JSON and binary forms (``shmserve.v2.rest``), or block the loop.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import socket

import httptools

from shmserve.doorkit import ConnectionCounts, DoorLimits, FlowControl, InputDeadline, Listener, peer_of
from shmserve.errors import ErrorCode
from shmserve.v2 import rest
from shmserve.v2.auth import Identity
from shmserve.v2.exchange import Answer, Exchange, HttpLimits, PiecedAnswer, infer_answer
from shmserve.v2.messages import Incoming, V2Error
from shmserve.v2.service import Caller, V2Service

log = logging.getLogger("shmserve.v2.http")

READ_BUFFER = 256 * 1024  # request heads and small bodies; streamed bodies bypass it
MAX_HEAD_BYTES = 64 * 1024  # request line and headers (nginx's default large_client_header_buffers is 32 KiB)
MAX_HEADERS = 100
MAX_PIPELINED = 16  # requests parsed ahead of the one being served
MAX_DISCARD_BYTES = 64 << 20  # the rest of a refused body read and dropped to keep the connection; beyond, close
REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 413: "Payload Too Large", 415: "Unsupported Media Type", 429: "Too Many Requests",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
           503: "Service Unavailable", 504: "Gateway Timeout"}


# -- what a connection is receiving ---------------------------------------------------------------

class Input(enum.Enum):
    IDLE = "idle"  # between requests: no deadline
    HEAD = "head"  # a request line and headers are arriving (frame_timeout_s)
    BODY = "body"  # a body is arriving into the parser (upload_timeout_s)
    STREAM = "stream"  # a binary body is arriving straight into arena space (upload_timeout_s)
    DISCARD = "discard"  # the rest of a refused body is read and dropped (upload_timeout_s)
    CLOSED = "closed"  # nothing more is read


class Ev(enum.Enum):
    BEGIN = "begin"
    HEADERS = "headers"
    COMPLETE = "complete"
    STREAM = "stream"
    REFUSED = "refused"
    RECEIVED = "received"
    CLOSE = "close"


# Rules
# -----
# ========  ========  ========  ==========================================================
# from      event     to        when
# ========  ========  ========  ==========================================================
# IDLE      BEGIN     HEAD      the first byte of a request
# HEAD      HEADERS   BODY      its headers are complete (a request without a body
#                               completes at once)
# BODY      COMPLETE  IDLE      the whole request is parsed: queued to be served
# BODY      STREAM    STREAM    a binary infer's JSON header is in, its tensors are not
# STREAM    RECEIVED  IDLE      its tensors are in the arena
# STREAM    REFUSED   DISCARD   it was refused or answered before its tensors were all in
# DISCARD   RECEIVED  IDLE      the rest of its body is dropped
# any       CLOSE     CLOSED    the connection ends (an error, a deadline, shutdown)
# ========  ========  ========  ==========================================================
#
# Apart from that: one request at a time is *served* (``HttpConnection.current``); the socket is
# read while no parsed request waits behind it (a pipelined one stops the reading until its turn),
# so a client can make a connection hold one parsed read of requests (``MAX_PIPELINED``), the one
# being parsed (within the body limits), and one answer.
I = Input
RULES: dict[tuple[Input, Ev], Input] = {
    (I.IDLE, Ev.BEGIN): I.HEAD,
    (I.HEAD, Ev.HEADERS): I.BODY,
    (I.BODY, Ev.COMPLETE): I.IDLE,
    (I.BODY, Ev.STREAM): I.STREAM,
    (I.STREAM, Ev.RECEIVED): I.IDLE,
    (I.STREAM, Ev.REFUSED): I.DISCARD,
    (I.DISCARD, Ev.RECEIVED): I.IDLE,
    **{(state, Ev.CLOSE): I.CLOSED for state in Input},
}
_DEADLINES = {I.HEAD: "frame_timeout_s", I.BODY: "upload_timeout_s", I.STREAM: "upload_timeout_s",
              I.DISCARD: "upload_timeout_s"}


class HeadTooLarge(V2Error):
    """The request line and headers are over ``MAX_HEAD_BYTES`` or ``MAX_HEADERS``: 431 (RFC 6585),
    not 413, which is about the body."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.FRAME_TOO_LARGE, message)

    @property
    def http_status(self) -> int:
        return 431


class CodingNotImplemented(V2Error):
    """A ``Transfer-Encoding`` other than ``chunked`` alone (``gzip, chunked``): 501, as h11 answers;
    the body's coding would otherwise be ignored.  (``Content-Encoding`` is the supported way.)"""

    def __init__(self, message: str):
        super().__init__(ErrorCode.BAD_FRAME, message)

    @property
    def http_status(self) -> int:
        return 501


class IllegalTransition(RuntimeError):
    """A bug in the connection: an event its input state does not take."""


class HttpDoor:
    """The HTTP door of one server: its listener and open connections.

    ``limits``: what one request may hold; ``door_limits``: the native door's per-connection and
    per-uid bounds, the same values (the server replaces both on reload);
    ``socket_mode``/``socket_group``: for a Unix socket path; ``clock``: the connections' timers
    (``call_later``, ``call_soon``; None: the running loop's)."""

    def __init__(self, service: V2Service, limits: HttpLimits, door_limits: DoorLimits, *,
                 socket_mode: int = 0o600, socket_group: str | None = None, clock=None):
        self.service, self.limits, self.door_limits = service, limits, door_limits
        self.socket_mode, self.socket_group = socket_mode, socket_group
        self.clock = clock
        self.server: asyncio.AbstractServer | None = None
        self.listener: Listener | None = None
        self.address: str | None = None
        self.connections = ConnectionCounts()  # open connections; Unix-socket peers by identity key

    async def start(self, address: str) -> None:
        """Listen on ``address``.  SystemExit naming the flag and why if it cannot."""
        loop = asyncio.get_running_loop()
        try:
            if "/" in address:
                self.listener = Listener(address, mode=self.socket_mode, group=self.socket_group)
                self.server = await loop.create_unix_server(lambda: HttpConnection(self), sock=self.listener.sock)
                self.address = address
            else:
                host, _, port = address.rpartition(":")
                self.server = await loop.create_server(lambda: HttpConnection(self), host=host.strip("[]") or
                                                       "127.0.0.1", port=int(port), reuse_address=True, backlog=512)
                bound = self.server.sockets[0].getsockname()
                self.address = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
        except OSError as exc:
            raise SystemExit(f"shmserve serve: --http {address}: cannot listen: {exc.strerror or exc}") from None

    async def stop_listening(self) -> None:
        """Take no new connection or request; those being served are answered (with Connection:
        close) before ``close``."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.listener is not None:
            self.listener.remove()
            self.listener = None
        for conn in list(self.connections):
            conn.stop_reading()

    async def close(self) -> None:
        for conn in list(self.connections):
            conn.transport.abort()

    def enter(self, conn: "HttpConnection", peer: Identity | None) -> str | None:
        """Count ``conn`` (``peer``: its Unix-socket peer; None on TCP, where a connection has no
        owner); or why it may not be served (``max_connections``, ``max_connections_per_uid``)."""
        key = peer.key if peer is not None else None
        refusal = self.connections.refusal(self.door_limits, key, peer.who if peer is not None else "",
                                           door="the HTTP door", kind="HTTP ")
        if refusal is None:
            self.connections.enter(conn, key)
        return refusal

    def leave(self, conn: "HttpConnection") -> None:
        self.connections.leave(conn)


class BodyStream:
    """The body of the request being streamed (``Input.STREAM``): its tensors go from the socket
    straight into the arena space the dispatcher gives it (``BodyReceiver.fill``); once the request
    is refused or answered before they are all in (``Input.DISCARD``), the rest is read and dropped.

    ``tail``: what came with its JSON header before there was space; ``remaining``: the bytes still
    in the socket; ``refusal``: the answer sent once the rest is dropped (None: its call answers)."""

    __slots__ = ("conn", "sinks", "pos", "remaining", "tail", "done", "refusal")

    def __init__(self, conn: "HttpConnection", remaining: int, tail: bytes):
        self.conn = conn
        self.sinks: list[memoryview] = []
        self.pos = 0  # in sinks[0]
        self.remaining, self.tail = remaining, tail
        self.done = None  # whom to tell it is all in
        self.refusal: V2Error | Answer | None = None

    def buffer(self, read_view: memoryview) -> memoryview:
        """Where the next bytes from the socket go: arena space, or (dropping) a scratch buffer."""
        if self.sinks:
            return self.sinks[0][self.pos:]
        return read_view[:min(len(read_view), self.remaining)]

    def fill(self, sinks: list[memoryview], done) -> None:
        """``BodyReceiver.fill``: the request has space; what came with its header goes in now, the
        rest straight from the socket."""
        conn = self.conn
        if conn.input is not Input.STREAM or conn.stream is not self:
            return
        self.sinks, self.pos, self.done = list(sinks), 0, done
        tail, self.tail = memoryview(self.tail), b""
        while tail:
            n = min(len(self.sinks[0]) - self.pos, len(tail))
            self.sinks[0][self.pos:self.pos + n] = tail[:n]
            tail = tail[n:]
            self._advance(n)
        if not self.sinks:
            self._complete()
        conn._update()

    def abort(self) -> None:
        """``BodyReceiver.abort``: answered before its tensors were all in: drop the rest."""
        if self.conn.input is Input.STREAM and self.conn.stream is self:
            self.conn._refuse_stream(None)

    def received(self, n: int) -> None:
        """``n`` bytes came from the socket into ``buffer``."""
        self.remaining -= n
        if self.conn.input is Input.STREAM:
            self._advance(n)
            if not self.sinks:
                self._complete()
        elif self.remaining == 0:
            self.conn._discard_done()

    def refuse(self) -> None:
        """Its request will not use the rest: no more into arena space; past ``MAX_DISCARD_BYTES``
        nothing more is read at all (the connection closes after its answer)."""
        self.sinks, self.tail, self.done = [], b"", None
        if self.remaining > MAX_DISCARD_BYTES:
            self.conn.closing = True
            self.remaining = 0

    def _advance(self, n: int) -> None:
        self.pos += n
        if self.pos == len(self.sinks[0]):
            self.sinks.pop(0)
            self.pos = 0

    def _complete(self) -> None:
        self.conn.advance(Ev.RECEIVED)
        self.conn.stream = None
        done, self.done = self.done, None
        done()


class HttpConnection(asyncio.BufferedProtocol):
    """One HTTP client (see the module header and ``RULES``): the transport, the parser's callbacks,
    and the kit's parts (``FlowControl``, ``InputDeadline``); each request an ``Exchange``, the one
    streamed a ``BodyStream``, each answer an ``Answer``."""

    def __init__(self, door: HttpDoor):
        self.door, self.service = door, door.service
        self.clock = door.clock if door.clock is not None else asyncio.get_running_loop()
        self.input = Input.IDLE
        self.parser = httptools.HttpRequestParser(self)
        self.read_view = memoryview(bytearray(READ_BUFFER))
        self.msg: Exchange | None = None  # being parsed
        self.queue: collections.deque[Exchange] = collections.deque()  # parsed, waiting their turn
        self.current: Exchange | None = None  # being served (its task runs, or its answer is being sent)
        self.held: list = []  # results whose arena views the transport may still hold
        self.after: V2Error | None = None  # the answer to send once the current one is sent, then close
        self.head_bytes = 0
        self.v2door = None  # the connection's requests in flight (V2Service.open_door), once it is served
        self.peer: Identity | None = None  # a Unix-socket peer (SO_PEERCRED); None on TCP
        self.who = "a TCP peer"  # for logs
        self.flow = FlowControl(self.clock.call_later)  # reading, writing, the stall timer
        self.deadline = InputDeadline(self.clock.call_later)  # of what the client is sending now
        self.closing = False  # answer with Connection: close, then close
        self.last_closes = False  # the last request parsed closes the connection (HTTP/1.0, Connection: close)
        self.stream: BodyStream | None = None  # the body being streamed or dropped (STREAM, DISCARD)
        self.answer: PiecedAnswer | None = None  # a large JSON answer being made and sent

    def advance(self, event: Ev) -> None:
        to = RULES.get((self.input, event))
        if to is None:
            raise IllegalTransition(f"HTTP connection: {event.value} while {self.input.value}")
        self.input = to

    @property
    def reading(self) -> bool:
        return self.flow.reading

    @property
    def write_blocked(self) -> bool:
        return self.flow.write_blocked

    # -- transport events -------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        FlowControl.zero_write_buffer(transport)  # pause_writing: "not all sent"; resume: "all sent"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            kernel = peer_of(sock)
            try:
                if kernel is None:
                    raise V2Error(ErrorCode.PERMISSION_DENIED, "the kernel did not say who the peer is")
                self.peer = self.service.auth.peer(kernel.uid, kernel.groups)
            except V2Error as exc:
                log.warning("HTTP: refused a connection of uid %s: %s", kernel.uid if kernel else None, exc.message)
                self._refuse_connection(exc)
                return
            self.who = self.peer.who
        refusal = self.door.enter(self, self.peer)
        if refusal is not None:
            log.warning("HTTP: refused a connection of %s: %s", self.who, refusal)
            self._refuse_connection(V2Error(ErrorCode.OVERLOADED, refusal))
            return
        self.v2door = self.service.open_door()
        self.v2door.on_abort = self._door_failed

    def _refuse_connection(self, exc: V2Error) -> None:
        """Answer the request the client is about to send with ``exc``, and close."""
        self.closing = True
        self._write(Answer.of_error(exc))
        self._close()

    def get_buffer(self, sizehint: int):
        if self.input in (Input.STREAM, Input.DISCARD):
            return self.stream.buffer(self.read_view)
        return self.read_view

    def buffer_updated(self, nbytes: int) -> None:
        if self.input in (Input.STREAM, Input.DISCARD):
            self.stream.received(nbytes)
        elif self.input is not Input.CLOSED:
            self._feed(self.read_view[:nbytes])
        self._update()

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.input = Input.CLOSED
        self.stream = None
        self.deadline.cancel()
        self.flow.stop()
        self._release_held()
        if self.answer is not None:
            answer, self.answer = self.answer, None
            answer.result.release()
        if self.current is not None:
            self.current.cancel()
        for msg in (self.msg, self.current, *self.queue):
            if msg is not None:
                msg.release(self.service)
        if self.v2door is not None:
            self.door.leave(self)
            self.service.close_door(self.v2door)
            self.v2door = None

    def _door_failed(self, exc: Exception) -> None:
        """``V2Door.abort``: a method of this connection's door raised (a bug, or a fault beneath it):
        the connection ends now.  Its transport is aborted (nothing more is read into arena space
        or sent from it), then everything it held is let go as when its peer leaves."""
        log.error("HTTP: closing a connection of %s: serving it failed (%s: %s)", self.who, type(exc).__name__, exc)
        self.transport.abort()
        self.connection_lost(exc)

    def pause_writing(self) -> None:
        """The answer waits in the transport: close the connection if it still does after
        ``stall_timeout_s``."""
        self.flow.writing_paused(self.door.door_limits.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self.flow.writing_resumed()
        self._release_held()
        if self.answer is not None:
            if not self.answer.counting:
                self._answer_step()
        elif self.current is not None and self.current.work is None:
            self._sent()

    def _stalled(self) -> None:
        log.warning("HTTP: closing a connection of %s: its answer went unread for %g s (server.stall_timeout_s)",
                    self.who, self.door.door_limits.stall_timeout_s)
        self.transport.abort()

    def stop_reading(self) -> None:
        """Shutting down: the request being served is answered with Connection: close; nothing
        more is read (a connection with none is closed now)."""
        self.closing = True
        if self.current is None and self.input is Input.IDLE:
            self._close()
        else:
            self._update()

    # -- parsing (the parser's callbacks) -----------------------------------------------------

    def _feed(self, data) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            error = exc.__context__ if isinstance(exc.__context__, V2Error) else None
            if error is None:
                log.error("HTTP: internal error parsing a request; closing that connection", exc_info=exc)
                error = V2Error(ErrorCode.INTERNAL, "internal server error")
            self._fail_input(error)
            return
        except httptools.HttpParserError as exc:
            if self.last_closes:
                return  # llhttp refuses bytes after a request that closes: they are never read (RFC 9112 9.6)
            self._fail_input(V2Error(ErrorCode.BAD_FRAME, f"malformed HTTP request: {exc}"))
            return
        msg = self.msg
        if msg is not None and self.input is Input.BODY and msg.size >= (msg.header_length or 0) and \
                self.current is None and not self.queue and msg.streamable():
            self._start_stream(msg)

    def _fail_input(self, error: V2Error) -> None:
        """What the client sent cannot be read on (not HTTP, over a limit, a deadline): answer
        ``error`` after the answers before it, and close."""
        self.closing = True
        for msg in (self.msg, *self.queue):
            if msg is not None:
                msg.release(self.service)
        self.queue.clear()
        self.msg = None
        receiving = self.input in (Input.STREAM, Input.DISCARD)  # the current request's own body
        discarding = self.input is Input.DISCARD
        self.advance(Ev.CLOSE)
        self.stream = None
        self.deadline.cancel()
        if receiving and self.current.work is not None:
            self.current.cancel()  # a streamed request whose body will never be in
            self.current.release(self.service)
            self.current = None
        elif discarding and self.current.work is None:  # a refused one: its answer waited for the rest of its body
            self.current.release(self.service)
            self.current = None
        if self.current is None:
            self.current = Exchange()
            self.respond(Answer.of_error(error))
        else:
            self.after = error

    def on_message_begin(self) -> None:
        if len(self.queue) >= MAX_PIPELINED:
            raise V2Error(ErrorCode.OVERLOADED, f"more than {MAX_PIPELINED} pipelined requests")
        self.msg = Exchange()
        self.head_bytes = 0
        self.advance(Ev.BEGIN)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        self.msg.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        headers = self.msg.headers
        if len(headers) >= MAX_HEADERS:
            raise HeadTooLarge(f"more than {MAX_HEADERS} headers")
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def _count_head(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > MAX_HEAD_BYTES:
            raise HeadTooLarge(f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        msg, parser = self.msg, self.parser
        msg.method = parser.get_method().decode("latin-1")
        msg.keep_alive = parser.should_keep_alive()
        msg.version = parser.get_http_version()
        length = msg.headers.get("content-length")
        msg.length = int(length) if length is not None else None  # llhttp has checked it is digits
        limit = self.door.limits.max_body_bytes
        if msg.length is not None and msg.length > limit:
            raise V2Error(ErrorCode.TOO_LARGE, f"a body of {msg.length} bytes is more than this server takes "
                                               f"({limit}: server.max_request_bytes)")
        ihcl = msg.headers.get("inference-header-content-length")
        if ihcl is not None:
            if not (ihcl.isascii() and ihcl.strip().isdigit()) or len(ihcl) > 18:  # str.isdigit takes '²'
                raise V2Error(ErrorCode.BAD_FRAME, f"Inference-Header-Content-Length must be a number of bytes "
                                                   f">= 0, got {ihcl[:20]!r}")
            msg.header_length = int(ihcl)
            if msg.length is not None and msg.header_length > msg.length:  # chunked: checked once it is in
                raise V2Error(ErrorCode.BAD_FRAME, f"Inference-Header-Content-Length {msg.header_length} is more "
                                                   f"than the body's Content-Length {msg.length}")
        coding = msg.headers.get("transfer-encoding")
        if coding is not None and [c.strip() for c in coding.lower().split(",") if c.strip()] != ["chunked"]:
            raise CodingNotImplemented(f"Transfer-Encoding {coding[:40]!r} is not supported (only 'chunked'; "
                                       "compress a body with Content-Encoding)")
        msg.caller = self._identify(msg)
        self.advance(Ev.HEADERS)
        if msg.headers.get("expect", "").lower() == "100-continue" and msg.version == "1.1":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _identify(self, msg: Exchange) -> Caller:
        """Who sends ``msg`` (its headers are in, its body is not), checked before any of its body
        is read: may it run this operation, and (infer) is it within its requests in flight.
        V2Error UNAUTHENTICATED (a token this server does not know), PERMISSION_DENIED,
        OVERLOADED; a request to no route is let through (it is answered 404 or 405 in turn)."""
        service = self.service
        identity = self.peer if self.peer is not None else service.auth.bearer(msg.headers.get("authorization"))
        try:
            op, params = rest.route(msg.method, msg.url.decode("latin-1"))[:2]
        except (V2Error, UnicodeDecodeError):
            op = None
        if op is not None:
            service.auth.check(identity, op)
            if op == "infer":
                ledger = service.ledger
                if ledger.requests[identity.key] >= ledger.max_requests():
                    raise V2Error(ErrorCode.OVERLOADED, f"{identity.who} has {ledger.requests[identity.key]} v2 "
                                                        "requests in flight (server.max_inflight_per_uid)")
                service.check_rate(identity, params.get("m") or "", msg.length)  # before its body is read
        return Caller(identity, self.v2door)

    def on_body(self, body: bytes) -> None:
        msg = self.msg
        self.service.ledger.take_bytes(msg.caller.identity, len(body), msg.held)  # OVERLOADED: over its budget
        msg.held += len(body)
        msg.size += len(body)
        limits = self.door.limits
        if msg.size > limits.max_body_bytes:
            raise V2Error(ErrorCode.TOO_LARGE, f"the body is more than this server takes ({limits.max_body_bytes} "
                                               f"bytes: server.max_request_bytes)")
        if msg.header_length is None and msg.size > limits.max_json_bytes:
            raise V2Error(ErrorCode.TOO_LARGE, f"a JSON body of more than {limits.max_json_bytes} bytes: send "
                                               "tensors as binary data (Inference-Header-Content-Length)")
        msg.body.append(body)

    def on_message_complete(self) -> None:
        msg, self.msg = self.msg, None
        self.queue.append(msg)
        self.last_closes = not msg.keep_alive  # nothing after it is read, whenever it comes
        self.advance(Ev.COMPLETE)

    # -- reading and deadlines ----------------------------------------------------------------

    def _update(self) -> None:
        """Serve what is parsed if nothing is served; read exactly while more may be read; run the
        deadline of what the client is sending while it is read."""
        if self.current is None and self.queue and self.input is not Input.CLOSED:
            self._serve_next()
        if self.input is Input.CLOSED:
            return
        if self.input is Input.STREAM:
            want = bool(self.stream.sinks)
        elif self.input is Input.DISCARD:
            want = True
        else:  # read on while one is served (no epoll change per request); stop once one waits behind it
            want = not self.queue and not self.closing and not self.last_closes
        self.flow.read_while(self.transport, want)
        key = _DEADLINES.get(self.input) if want else None
        if key is None:
            self.deadline.cancel()
        else:
            self.deadline.run(key, getattr(self.door.door_limits, key), self._timed_out)

    def _timed_out(self, key: str, limit: float) -> None:
        what = "the request line and headers" if key == "frame_timeout_s" else "the body"
        error = V2Error(ErrorCode.TIMEOUT if key == "upload_timeout_s" else ErrorCode.BAD_FRAME,
                        f"{what} did not all arrive within {limit:g} s (server.{key})")
        log.info("HTTP: closing a connection of %s: %s", self.who, error.message)
        self._fail_input(error)

    # -- serving ----------------------------------------------------------------------------

    def _serve_next(self) -> None:
        self.current = self.queue.popleft()
        self.current.serve(self)

    def _infer_done(self, result, error: V2Error | None) -> None:
        """``V2Service.start``'s ``done``: the current infer request's answer."""
        if self.current is not None:
            self.current.work = None
        if self.input is Input.CLOSED and self.current is None:
            if result is not None:
                result.release()
            return
        receiving = self.input in (Input.STREAM, Input.DISCARD)  # answered before its body was all in
        answer = None
        if error is None:
            try:
                answer = infer_answer(result, self.current.request.binary_outputs, pieced=not receiving)
            except V2Error as exc:
                error = exc
        if isinstance(answer, PiecedAnswer):
            self.answer = answer  # made as its client reads it
            self._answer_step()
            return
        if receiving:
            if answer is not None and answer.result is not None:  # holds nothing while the body is dropped
                answer.release()
                answer = None
            self._refuse_stream(error, answer)
            return
        self.respond(Answer.of_error(error) if error is not None else answer)

    # -- writing ----------------------------------------------------------------------------

    def respond(self, answer: Answer) -> None:
        """Write the current request's answer (``Exchange`` calls it too); the next is served once it
        is all sent."""
        msg = self.current
        if msg is not None and not msg.keep_alive:
            self.closing = True
        self._write(answer, body=msg is None or msg.method != "HEAD")
        if answer.result is not None:
            self.held.append(answer.result)
        if not self.flow.write_blocked:
            self._release_held()
            self._sent()

    def _answer_step(self) -> None:
        """One piece of a large JSON answer (``answer``).  First pass: counted, one piece per turn
        of the loop.  Then the head (with the length), and the second pass: each piece written once
        the one before has left the transport (its client reads: an answer nobody reads holds one
        piece, not its whole text), one per turn.  Then its binary parts, and it is done as any
        answer.  A V2Error (a BYTES output that is not text) comes in the first pass: answered."""
        answer = self.answer
        if answer is None or self.transport.is_closing():  # gone: connection_lost lets go of it
            return
        soon = self.clock.call_soon
        try:
            piece = next(answer.pieces, None)
        except V2Error as exc:
            self.answer = None
            answer.result.release()
            self.respond(Answer.of_error(exc))
            return
        if piece is not None:
            if answer.counting:
                answer.length += len(piece)
                soon(self._answer_step)
                return
            self.transport.write(piece)
        elif answer.counting:  # counted: the head, then the same pieces again
            answer.counting, answer.pieces = False, answer.body.pieces()
            if not self.current.keep_alive:
                self.closing = True
            self._write(answer.head(), length=answer.total)
        else:  # all of the JSON is out: the binary parts, then the next request
            self.answer = None
            self.transport.writelines(answer.body.parts)
            self.held.append(answer.result)
            if not self.flow.write_blocked:
                self._release_held()
                self._sent()
            return
        if not self.flow.write_blocked:
            soon(self._answer_step)  # else resume_writing takes the next step

    def _write(self, answer: Answer, body: bool = True, length: int | None = None) -> None:
        """``answer``'s head and (unless ``body`` is false: a HEAD request's) its parts (``length``:
        the body's, when it is sent in pieces later)."""
        parts = answer.parts
        length = sum(len(p) for p in parts) if length is None else length
        head = [b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (
            answer.status, REASONS.get(answer.status, "Error").encode(), answer.ctype.encode(), length)]
        head.extend(b"%s: %s\r\n" % (name, value) for name, value in answer.extra)
        if self.closing and self.after is None:  # only the last answer says so (an error may follow this one)
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        self.transport.writelines([b"".join(head), *(parts if body else ())])

    def _sent(self) -> None:
        """The current answer is all sent: serve the next request, or read for one (or close)."""
        if self.current is not None:
            self.current.release(self.service)
        self.current = None
        if self.after is not None:
            error, self.after = self.after, None
            self.current = Exchange()
            self.respond(Answer.of_error(error))
            return
        if self.closing and (self.input in (Input.IDLE, Input.CLOSED) and not self.queue):
            self._close()
            return
        self._update()

    def _release_held(self) -> None:
        held, self.held = self.held, []
        for result in held:
            result.release()

    # -- the streamed body --------------------------------------------------------------------

    def _start_stream(self, msg: Exchange) -> None:
        """``msg``'s JSON header is in, its tensors are still in the socket: submit it now; they
        land in the arena once it has space (``BodyStream.fill``)."""
        data, h = msg.data(), msg.header_length
        self.msg = None
        self.parser = httptools.HttpRequestParser(self)  # the old one is mid-body: the next request starts afresh
        self.last_closes = not msg.keep_alive  # the fresh parser cannot know: nothing after it is read
        self.advance(Ev.STREAM)
        self.stream = stream = BodyStream(self, msg.length - msg.size, data[h:])
        self.current = msg
        try:
            _, params = msg.route()
            model, version = params["m"], params["v"]
            if h == 0:
                request = rest.raw_binary_request(model, version, self.service.raw_input(model, version),
                                                  msg.length, Incoming(msg.length))
            else:
                header = rest.loads(data[:h], self.door.limits.rest, "the JSON header")
                request = rest.parse_infer(model, version, header, streamed=msg.length - h)
        except V2Error as exc:
            self._refuse_stream(exc)
            return
        msg.request, request.body = request, stream
        try:
            call = self.service.start(msg.caller, request, self._infer_done)
        except V2Error as exc:
            self._refuse_stream(exc)
            return
        if not call.ended:
            msg.work = call

    def _refuse_stream(self, error: V2Error | None, answer: Answer | None = None) -> None:
        """The streamed request will not use the rest of its body: read and drop it, then send
        ``error`` (or ``answer``; neither: its call answers)."""
        stream = self.stream
        if self.input is Input.STREAM:
            stream.refuse()
            self.advance(Ev.REFUSED)
        if error is not None or answer is not None:
            stream.refusal = error if error is not None else answer
        if stream.remaining == 0:
            self._discard_done()
        self._update()

    def _discard_done(self) -> None:
        refusal, self.stream = self.stream.refusal, None
        self.advance(Ev.RECEIVED)
        if isinstance(refusal, V2Error):
            self.respond(Answer.of_error(refusal))
        elif refusal is not None:
            self.respond(refusal)
        # None: the request's call is still running; its answer comes when it is done

    def _close(self) -> None:
        if self.input is not Input.CLOSED:
            self.advance(Ev.CLOSE)
        self.deadline.cancel()
        self.transport.close()
