"""One HTTP request of the KServe v2 door and its answer: the per-request half of ``v2.http``.

Owns: what one parsed request is (``Exchange``: its line, headers, body and who sent it, and the
work that serves it: its body decoded, on the loop or a thread, then its infer call submitted or its
operation's task run, each cancelled if its connection gives up on it), the
decoding of its body (inflated if it came gzip or deflate, bounded by what it may hold: pure, so
that it runs on the loop for a small body and on a thread for the rest), the infer request it
makes, the operations other than infer as a table (``OPERATIONS``: route -> handler), and every
answer as a typed value (``Answer``: status, content type, body parts, extra headers and the
result whose arena views the parts are; ``PiecedAnswer``: a large JSON answer made a piece at a
time as its client reads it).

Must not: touch a socket or a transport (``v2.http`` writes answers), decide anything about a
request (``v2.service``), or know the JSON and binary forms beyond calling ``v2.rest``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import mmap
import zlib
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from shmserve.errors import ErrorCode
from shmserve.v2 import rest
from shmserve.v2.messages import RateLimited, V2Error
from shmserve.v2.service import Caller, V2Service

MAX_JSON_BYTES = 8 << 20  # JSON is parsed in one call that holds Python's lock (~50 ms for 8 MiB): bigger goes binary
# A body whose JSON is at most this (and not encoded) is decoded on the loop (well under a millisecond,
# no thread hop), as is a streamed request's JSON header; more, or gzip or deflate, on a thread.
INLINE_DECODE_BYTES = 64 * 1024
INFLATE_PIECE = 1 << 20  # bytes inflated, then copied, at a time
log = logging.getLogger("shmserve.v2.http")

JSON = "application/json"
BINARY = "application/octet-stream"


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP request may hold.  ``max_body_bytes``: a body (the server sets twice
    ``server.max_request_bytes`` plus 1 MiB: the arena refuses what does not fit with its own
    message)."""

    max_body_bytes: int
    max_json_bytes: int = MAX_JSON_BYTES

    @property
    def rest(self) -> rest.Limits:
        """The limits ``shmserve.v2.rest`` checks a body against."""
        return rest.Limits(self.max_body_bytes, self.max_json_bytes)


# -- answers ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Answer:
    """One HTTP answer: ``status``, content type ``ctype``, the body ``parts`` (bytes, or views of the
    arena), ``extra`` headers ((name, value) byte pairs), and ``result``: the infer result the parts
    are views of, released once they are all sent (None: the parts hold nothing)."""

    status: int
    ctype: str = JSON
    parts: list = field(default_factory=list)
    extra: tuple = ()
    result: object = None

    @classmethod
    def of_error(cls, error: V2Error) -> "Answer":
        """``error``'s answer: its HTTP status, the error body, and the header it calls for (Allow
        for a 405/404 route, WWW-Authenticate for UNAUTHENTICATED, Retry-After when rate limited)."""
        if isinstance(error, rest.NoRoute):
            extra = ((b"allow", ", ".join(error.allow).encode()),)
        elif error.code is ErrorCode.UNAUTHENTICATED:
            extra = ((b"www-authenticate", b'Bearer realm="shmserve"'),)
        elif isinstance(error, RateLimited):  # whole seconds (RFC 9110 10.2.3), never 0 for a wait
            extra = ((b"retry-after", b"%d" % max(1, math.ceil(error.retry_after))),)
        else:
            extra = ()
        return cls(error.http_status, JSON, [rest.error_body(error)], extra)

    @classmethod
    def of_value(cls, value) -> "Answer":
        """An operation's answer: a bool is health or readiness (200 or 503, no body), None an empty
        200, anything else its JSON."""
        if isinstance(value, bool):
            return cls(200 if value else 503)
        return cls(200, JSON, [rest.dumps(value)] if value is not None else [])

    def release(self) -> None:
        """Let go of the result the parts are views of (they are not sent after all)."""
        if self.result is not None:
            self.result.release()


@dataclass(eq=False)
class PiecedAnswer:
    """A large JSON answer on its way (``HttpConnection._answer_step``): its header is made twice, a
    piece at a time, once to count its length (nothing kept) and once to send it."""

    body: rest.ResultBody
    result: object  # released once all is sent (its binary parts, views of the arena, go last)
    pieces: object  # the pass under way
    length: int = 0  # of the JSON header, counted in the first pass
    counting: bool = True

    def head(self) -> Answer:
        """The answer's head once counted: status, type and headers; its body comes in pieces."""
        extra = ((b"inference-header-content-length", b"%d" % self.length),) if self.body.binary else ()
        return Answer(200, BINARY if self.body.binary else JSON, [], extra)

    @property
    def total(self) -> int:
        """The body's length: the JSON header and the binary parts."""
        return self.length + sum(len(p) for p in self.body.parts)


def infer_answer(result, binary_outputs: bool, pieced: bool = True) -> Answer | PiecedAnswer:
    """The answer to an infer request whose ``result`` came: small (or not ``pieced``), made now (its
    binary parts hold ``result`` until sent; a JSON-only one releases it at once); large, a
    ``PiecedAnswer`` made as its client reads it.  V2Error (``result`` released): a BYTES output
    that is not text."""
    body = rest.ResultBody(result, binary_outputs)
    if pieced and not body.small:
        return PiecedAnswer(body, result, body.pieces())
    try:
        header = body.header()
    except V2Error:
        result.release()
        raise
    if not body.binary:
        result.release()
        return Answer(200, JSON, [header])
    return Answer(200, BINARY, [header, *body.parts],
                  ((b"inference-header-content-length", b"%d" % len(header)),), result)


# -- one request --------------------------------------------------------------------------------

class Exchange:
    """One parsed request: its line, headers and (unless streamed) body, who sent it, and what it
    holds of its caller's budget until it is answered."""

    __slots__ = ("method", "url", "headers", "body", "size", "keep_alive", "version", "length", "header_length",
                 "request", "caller", "held", "work")

    def __init__(self):
        self.url, self.headers, self.body, self.size = bytearray(), {}, [], 0
        self.caller: Caller | None = None  # who sends it (known once its headers are in)
        self.held = 0  # its body bytes counted against its caller (Ledger.take_bytes) until it is done
        self.method, self.keep_alive, self.version = "", True, "1.1"
        self.length: int | None = None  # Content-Length
        self.header_length: int | None = None  # Inference-Header-Content-Length
        self.request = None  # an infer's InferRequest (a streamed one: parsed from its header alone)
        self.work = None  # its InferCall, or the Task or thread Future serving it (each has cancel())

    def data(self) -> bytes:
        return b"".join(self.body)

    @property
    def encoding(self) -> str:
        return self.headers.get("content-encoding", "identity").lower()

    def decodes_inline(self) -> bool:
        """Whether its body is decoded on the loop (``INLINE_DECODE_BYTES``)."""
        json_bytes = self.size if self.header_length is None else self.header_length
        return json_bytes <= INLINE_DECODE_BYTES and self.encoding == "identity"

    def route(self) -> tuple[str, dict]:
        """``rest.route`` of it: (operation, path parameters).  V2Error: NoRoute, or BAD_FRAME for
        a path that is not percent-encoded UTF-8."""
        try:
            op, params, _ = rest.route(self.method, self.url.decode("latin-1"))
        except UnicodeDecodeError:
            raise V2Error(ErrorCode.BAD_FRAME, "the path is not valid percent-encoded UTF-8") from None
        return op, params

    def streamable(self) -> bool:
        """Whether its body may go straight into the arena (the connection also asks that nothing is
        served or waits before it): a binary infer request with a plain body of known length whose
        JSON header is parsed on the loop."""
        return (self.header_length is not None and self.length is not None and self.method == "POST"
                and self.header_length <= INLINE_DECODE_BYTES and "transfer-encoding" not in self.headers
                and self.encoding == "identity"
                and bytes(self.url).split(b"?", 1)[0].rstrip(b"/").endswith(b"/infer"))

    # -- serving: the connection calls ``serve`` when this request's turn comes; its answer goes
    #    back through ``conn.respond(Answer)`` or (infer) ``conn._infer_done(result, error)`` ----

    def serve(self, conn) -> None:
        """Serve this request for ``conn`` (an ``HttpConnection``: its ``service``, ``door.limits``,
        ``respond`` and ``_infer_done``).  Infer, the hot path, runs without a task: its body is
        decoded on the loop (small and plain) or on a thread, then submitted; any other operation
        runs as a task (``serve_operation``).  Whatever is under way is ``work`` (``cancel``)."""
        service, limits = conn.service, conn.door.limits
        try:
            op, params = self.route()
            if op == "infer":
                model, version = params["m"], params["v"]
                spec_input = service.raw_input(model, version) if self.header_length == 0 else None
                decode = functools.partial(infer_request, self, model, version, spec_input, limits)
                if self.decodes_inline():
                    self.start_infer(conn, decode())
                else:
                    self._offload(conn, decode)
                return
        except V2Error as exc:
            conn.respond(Answer.of_error(exc))
            return
        self.work = asyncio.get_running_loop().create_task(serve_operation(service, self, op, params, limits))
        self.work.add_done_callback(lambda task: self._served(conn, task))

    def start_infer(self, conn, request) -> None:
        """Submit ``request`` (this one's); V2Error if it is refused at once."""
        self.request = request
        call = conn.service.start(self.caller, request, conn._infer_done)
        if not call.ended:  # (an answer given at once has already been sent)
            self.work = call

    def cancel(self) -> None:
        """Its connection gives up on it: what is under way is cancelled (nobody is told)."""
        if self.work is not None:
            work, self.work = self.work, None
            work.cancel()

    def _offload(self, conn, job) -> None:
        """Decode on a thread: ``job`` (pure: it touches nothing of the connection) runs there, then
        is submitted back on the loop, unless this was cancelled meanwhile.  A V2Error of either
        is the answer."""
        future = asyncio.get_running_loop().run_in_executor(None, job)
        self.work = future
        future.add_done_callback(lambda f: self._offloaded(conn, f))

    def _offloaded(self, conn, future: asyncio.Future) -> None:
        if future is not self.work:  # cancelled: the connection is gone
            return
        self.work = None
        try:
            self.start_infer(conn, future.result())
        except V2Error as exc:
            conn.respond(Answer.of_error(exc))
        except Exception as exc:  # our bug: this request is answered, the connection goes on
            log.error("HTTP: internal error decoding a request", exc_info=exc)
            conn.respond(Answer.of_error(V2Error(ErrorCode.INTERNAL, f"internal server error ({type(exc).__name__})")))

    def _served(self, conn, task: asyncio.Task) -> None:
        if task is not self.work:
            return  # cancelled (the connection ended, or gave up on it)
        self.work = None
        exc = task.exception()
        if exc is None:
            conn.respond(task.result())
            return
        if not isinstance(exc, V2Error):
            log.error("HTTP: internal error serving a request", exc_info=exc)
            exc = V2Error(ErrorCode.INTERNAL, f"internal server error ({type(exc).__name__})")
        conn.respond(Answer.of_error(exc))

    def release(self, service: V2Service) -> None:
        """It is done with (answered, dropped, or its connection gone): its body bytes no longer
        count against its caller."""
        if self.held:
            service.ledger.give_bytes(self.caller.identity, self.held)
            self.held = 0


# -- decoding a body (pure: these run on the loop for small bodies, on a thread for the rest) -------

def decoded(msg: Exchange, limits: HttpLimits) -> bytes | memoryview:
    """``msg``'s body, inflated if it came gzip or deflate.  The inflated size is bounded by what it
    may hold: a JSON body ``max_json_bytes``, a binary one ``max_body_bytes`` (V2Error TOO_LARGE;
    BAD_FRAME for an unknown coding, or a body that does not inflate, is cut short, or has bytes
    after its end).  zlib lets go of Python's lock while it inflates."""
    data, encoding = msg.data(), msg.encoding
    if encoding == "identity":
        return data
    if encoding not in ("gzip", "deflate"):
        raise V2Error(ErrorCode.BAD_FRAME, f"Content-Encoding {encoding[:20]!r} is not supported (gzip, deflate)")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    if msg.header_length is None:
        limit, why = limits.max_json_bytes, "a JSON body's limit: send tensors as binary data"
    else:
        limit, why = limits.max_body_bytes, "server.max_request_bytes"
    # Into pages mapped as they are written (nothing is touched twice, nothing zeroed first), a
    # piece at a time: inflate lets go of Python's lock, each copy holds it for one piece only.
    out, size, pending = mmap.mmap(-1, limit + INFLATE_PIECE), 0, data
    while True:
        try:
            piece = inflater.decompress(pending, INFLATE_PIECE)
        except zlib.error as exc:
            raise V2Error(ErrorCode.BAD_FRAME, f"the {encoding} body does not inflate: {exc}") from None
        out[size:size + len(piece)] = piece
        size += len(piece)
        pending = inflater.unconsumed_tail
        if size > limit:
            raise V2Error(ErrorCode.TOO_LARGE, f"the body inflates to more than {limit} bytes ({why})")
        if not piece and not pending or inflater.eof:
            break
    if not inflater.eof or inflater.unused_data:  # cut short (its checksum never seen), or more after it
        raise V2Error(ErrorCode.BAD_FRAME, f"the {encoding} body is cut short or has bytes after its end")
    return memoryview(out)[:size]


def json_body(msg: Exchange, limits: HttpLimits) -> dict:
    """The JSON object of an operation's body (``rest.loads``)."""
    return rest.loads(decoded(msg, limits), limits.rest)


def infer_request(msg: Exchange, model: str, version: str | None, spec_input, limits: HttpLimits):
    """The infer request of a buffered ``msg`` (``spec_input``: the model's one input, for a raw
    binary body).  V2Error as ``rest.parse_infer`` says."""
    if msg.header_length is None:
        return rest.parse_infer(model, version, rest.loads(decoded(msg, limits), limits.rest))
    data = memoryview(decoded(msg, limits))
    h = msg.header_length
    if h > len(data):
        raise V2Error(ErrorCode.BAD_FRAME, f"Inference-Header-Content-Length {h} is more than the "
                                           f"{len(data)}-byte body")
    if h == 0:
        return rest.raw_binary_request(model, version, spec_input, len(data), data)
    header = rest.loads(data[:h], limits.rest, "the JSON header")
    return rest.parse_infer(model, version, header, binary=data[h:])


# -- the operations other than infer --------------------------------------------------------------

Handler = Callable[[V2Service, Caller, dict, dict], Awaitable[object]]


def _params(p: dict) -> tuple:
    return p.get("m"), p.get("v")


async def _repository_index(service: V2Service, caller: Caller, p: dict, body: dict):
    ready = body.get("ready", False)
    if type(ready) is not bool:
        raise V2Error(ErrorCode.BAD_INPUT, "'ready' must be true or false")
    return service.repository_index(caller, ready)


def _load_parameters(body: dict):
    parameters = body.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise V2Error(ErrorCode.BAD_INPUT, "'parameters' must be an object")
    return parameters


async def _repository_load(service: V2Service, caller: Caller, p: dict, body: dict):
    await service.repository_load(caller, p.get("m"), _load_parameters(body))


async def _repository_unload(service: V2Service, caller: Caller, p: dict, body: dict):
    await service.repository_unload(caller, p.get("m"), _load_parameters(body))


async def _shm_register(service: V2Service, caller: Caller, p: dict, body: dict):
    r = p.get("r")
    if r is None:
        raise V2Error(ErrorCode.BAD_REGION, "register names its region: POST "
                                            "/v2/systemsharedmemory/region/{name}/register")
    service.shm_register(caller, r, body.get("key"), body.get("offset", 0), body.get("byte_size"))


async def _shm_unregister(service: V2Service, caller: Caller, p: dict, body: dict):
    await service.shm_unregister(caller, p.get("r"))


async def _cuda_shm_register(service: V2Service, caller: Caller, p: dict, body: dict):
    service.cuda_shm_register(caller, p.get("r"), body.get("raw_handle"), body.get("device_id"),
                              body.get("byte_size"))


async def _nothing(service: V2Service, caller: Caller, p: dict, body: dict):
    return None  # cuda_shm_unregister: nothing is ever registered


def _plain(call: Callable[[V2Service, Caller, dict], object]) -> Handler:
    """A handler for an operation that takes no body and does not wait."""
    async def handler(service: V2Service, caller: Caller, p: dict, body: dict):
        return call(service, caller, p)
    return handler


# operation (``rest.ROUTES``) -> handler(service, caller, path parameters, JSON body): its value
# (``Answer.of_value``).  V2Error: the answer is that error.
OPERATIONS: dict[str, Handler] = {
    "live": _plain(lambda s, c, p: s.live()),
    "ready": _plain(lambda s, c, p: s.ready()),
    "server_metadata": _plain(lambda s, c, p: s.server_metadata()),
    "model_metadata": _plain(lambda s, c, p: s.model_metadata(*_params(p))),
    "model_ready": _plain(lambda s, c, p: s.model_ready(*_params(p))),
    "model_config": _plain(lambda s, c, p: s.model_config(*_params(p))),
    "statistics": _plain(lambda s, c, p: s.statistics(c, *_params(p))),
    "repository_index": _repository_index,
    "repository_load": _repository_load,
    "repository_unload": _repository_unload,
    "shm_status": _plain(lambda s, c, p: s.shm_status(c, p.get("r"))),
    "shm_register": _shm_register,
    "shm_unregister": _shm_unregister,
    "cuda_shm_status": _plain(lambda s, c, p: s.cuda_shm_status(c, p.get("r"))),
    "cuda_shm_register": _cuda_shm_register,
    "cuda_shm_unregister": _nothing,
}


async def serve_operation(service: V2Service, msg: Exchange, op: str, params: dict, limits: HttpLimits) -> Answer:
    """The answer to ``msg``, a request for ``op`` (not infer) with path ``params``: its JSON body
    decoded (on a thread unless it is small and plain), then its handler run.  V2Error: the
    handler's, or the body's."""
    body = {}
    if msg.size:
        body = json_body(msg, limits) if msg.decodes_inline() else \
            await asyncio.get_running_loop().run_in_executor(None, json_body, msg, limits)
    return Answer.of_value(await OPERATIONS[op](service, msg.caller, params, body))
