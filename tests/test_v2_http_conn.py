"""The HTTP door's connection (``shmserve.v2.http.HttpConnection``) in-process: a fake transport
(``helpers.fake_transport``: it records writes, can hold them as a client that does not read, and
follows pause and resume of reading), a fake clock for every deadline and for the pieces of a large
answer, and a stand-in ``V2Service`` (the real ``Authenticator`` and ``Ledger``; infer calls the test
answers by hand).  No server, no socket, no thread.  What a real server adds is
``test_v2_http_edges.py``'s."""

from __future__ import annotations

import asyncio
import json
import os
import socket

import httptools
import numpy as np
import pytest

from shmserve.doorkit import DoorLimits
from shmserve.errors import ErrorCode
from shmserve.v2 import rest
from shmserve.v2.auth import Authenticator
from shmserve.v2.exchange import OPERATIONS, Answer, Exchange, HttpLimits, serve_operation
from shmserve.v2.http import MAX_HEAD_BYTES, MAX_PIPELINED, HttpConnection, HttpDoor, Input
from shmserve.v2.messages import InferResult, OutputTensor, V2Error
from shmserve.v2.service import Caller, Ledger

from helpers.fake_frontend import FakeClock
from helpers.fake_transport import FakeTransport

LIMITS = DoorLimits(max_connections=8, max_connections_per_uid=4, max_inflight_per_uid=64,
                    max_inflight_bytes_per_connection=1 << 20,
                    stall_timeout_s=10.0, frame_timeout_s=5.0, upload_timeout_s=7.0)


# -- the stand-ins ------------------------------------------------------------------------------

class FakeCall:
    """What ``V2Service.start`` returns: ``answer`` (by the test) calls the connection's ``done``."""

    def __init__(self, caller, request, done):
        self.caller, self.request, self.done = caller, request, done
        self.ended = self.cancelled = False

    def answer(self, result=None, error=None) -> None:
        self.ended = True
        self.done(result, error)

    def cancel(self) -> None:
        self.cancelled = self.ended = True


class FakeV2Door:
    on_abort = None


class FakeService:
    """The parts of ``V2Service`` a connection calls; metadata answers are fixed values."""

    def __init__(self):
        self.auth = Authenticator(allowed=lambda uid, groups: True, is_admin=lambda uid, groups: False)
        self.ledger = Ledger(lambda: 64, lambda: 1 << 30)
        self.calls: list[FakeCall] = []
        self.doors = 0

    def open_door(self):
        self.doors += 1
        return FakeV2Door()

    def close_door(self, door) -> None:
        self.doors -= 1

    def check_rate(self, identity, model, nbytes) -> None:
        pass

    def raw_input(self, model, version):
        return None

    def start(self, caller, request, done) -> FakeCall:
        call = FakeCall(caller, request, done)
        self.calls.append(call)
        return call

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return False

    def server_metadata(self) -> dict:
        return {"name": "shmserve", "extensions": []}

    def model_metadata(self, model, version) -> dict:
        if model != "m":
            raise V2Error(ErrorCode.UNKNOWN_MODEL, f"no model {model!r}")
        return {"name": model, "versions": ["1"]}


def result_of(x: np.ndarray, released: list, binary: bool = True) -> InferResult:
    """An infer result with one output ``y`` = ``x``, binary unless not ``binary`` (its data a plain
    buffer: ``released`` counts the door's ``release``)."""
    return InferResult("m", "1", None, [OutputTensor("y", "FP32", x.shape, memoryview(x.tobytes()), binary=binary)],
                       releaser=lambda: released.append(1))


class Response:
    def __init__(self):
        self.status, self.headers, self.body, self.done = 0, {}, bytearray(), False

    def json(self) -> dict:
        return json.loads(bytes(self.body))


class Client:
    """One connection of a door of its own: bytes in as the loop would deliver them, answers parsed
    back from what the fake transport was sent."""

    def __init__(self, *, limits: HttpLimits = HttpLimits(max_body_bytes=1 << 20)):
        self.clock, self.service = FakeClock(), FakeService()
        self.door = HttpDoor(self.service, limits, LIMITS, clock=self.clock)
        self.conn = HttpConnection(self.door)
        self.transport = FakeTransport()
        self.transport.protocol = self.conn
        self.conn.connection_made(self.transport)
        self.answers: list[Response] = []
        self._parser = httptools.HttpResponseParser(self)
        self._seen = 0

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while len(view):
            assert self.transport.reading, "sent to a connection that is not reading"
            target = self.conn.get_buffer(len(view))
            n = min(len(target), len(view))
            target[:n] = view[:n]
            self.conn.buffer_updated(n)
            view = view[n:]

    def received(self) -> list[Response]:
        """The answers completed so far (the 100 Continue interim answer included)."""
        new = bytes(self.transport.written[self._seen:])
        self._seen = len(self.transport.written)
        if new:
            self._parser.feed_data(new)
        return [r for r in self.answers if r.done]

    def lose(self) -> None:
        self.conn.connection_lost(None)

    # httptools' callbacks
    def on_message_begin(self):
        self.answers.append(Response())

    def on_header(self, name, value):
        self.answers[-1].headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self):
        self.answers[-1].status = self._parser.get_status_code()

    def on_body(self, body):
        self.answers[-1].body += body

    def on_message_complete(self):
        self.answers[-1].done = True


def get(path: str, *extra: str, version: str = "1.1") -> bytes:
    return (f"GET {path} HTTP/{version}\r\nHost: x\r\n" + "".join(f"{h}\r\n" for h in extra) + "\r\n").encode()


def binary_infer(x: np.ndarray, *, model: str = "m", length: int | None = None) -> tuple[bytes, bytes]:
    """(the request's head and JSON header, its tensor bytes) of a binary infer of ``x``."""
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                     "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    body_length = len(header) + x.nbytes if length is None else length
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {body_length}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n\r\n").encode()
    return head + header, x.tobytes()


@pytest.fixture
def loop():
    """A loop for the operations other than infer (each runs as a task); ``step`` runs it a while."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


def within(loop, send) -> None:
    """``send()`` inside the loop (an operation's task is made there), then the loop run a while."""
    async def run():
        send()
        await asyncio.sleep(0.01)
    loop.run_until_complete(run())


# -- parsing, keep-alive, pipelining -----------------------------------------------------------

def test_a_request_is_parsed_and_its_operation_answered_from_the_table(loop):
    client = Client()
    within(loop, lambda: client.send(get("/v2")))
    [answer] = client.received()
    assert answer.status == 200 and answer.headers["content-type"] == "application/json"
    assert answer.json() == {"name": "shmserve", "extensions": []}
    assert int(answer.headers["content-length"]) == len(answer.body)
    within(loop, lambda: client.send(get("/v2/health/ready")))  # a bool: the status says it, no body
    assert [(r.status, bytes(r.body)) for r in client.received()[1:]] == [(503, b"")]


def test_keep_alive_serves_one_request_after_another_and_connection_close_ends_it(loop):
    client = Client()
    for n in range(3):
        within(loop, lambda: client.send(get("/v2/health/live")))
        assert len(client.received()) == n + 1 and not client.transport.closing
    assert all("connection" not in r.headers for r in client.received())
    within(loop, lambda: client.send(get("/v2/health/live", "Connection: close")))
    last = client.received()[-1]
    assert last.status == 200 and last.headers["connection"] == "close" and client.transport.closing


def test_http_1_0_closes_after_its_answer(loop):
    client = Client()
    within(loop, lambda: client.send(get("/v2/health/live", version="1.0")))
    assert client.received()[0].headers["connection"] == "close" and client.transport.closing


def test_pipelined_requests_are_answered_in_order_and_reading_stops_while_one_waits():
    """Three infers in one read: the first is served, the others wait parsed (the socket is not read
    meanwhile); each is served once the one before it is answered, in the order they came."""
    client = Client()
    xs = [np.full(4, i, np.float32) for i in range(3)]
    client.send(b"".join(b"".join(binary_infer(x)) for x in xs))
    assert len(client.service.calls) == 1 and len(client.conn.queue) == 2
    assert not client.transport.reading  # parsed requests wait: nothing more is read
    released = []
    for i, x in enumerate(xs):
        call = client.service.calls[i]
        assert np.array_equal(np.frombuffer(call.request.inputs[0].data, np.float32), x)
        call.answer(result_of(x, released))
        assert len(client.service.calls) == min(i + 2, 3)
    answers = client.received()
    assert [a.status for a in answers] == [200, 200, 200]
    for a, x in zip(answers, xs):
        h = int(a.headers["inference-header-content-length"])
        assert np.array_equal(np.frombuffer(bytes(a.body[h:]), np.float32), x)
    assert released == [1, 1, 1] and client.transport.reading
    assert sum(client.service.ledger.bytes.values()) == 0  # every body's bytes given back


def test_more_than_max_pipelined_requests_are_refused_overloaded_and_closed():
    client = Client()
    x = np.zeros(2, np.float32)
    client.send(b"".join(binary_infer(x)))  # served
    client.send(b"".join(binary_infer(x)) * (MAX_PIPELINED + 1))  # 16 wait their turn; one more is refused
    assert not client.received() and not client.conn.queue  # the refusal waits for the answer before it
    client.service.calls[0].answer(result_of(x, []))
    answers = client.received()
    assert [a.status for a in answers] == [200, 503] and len(client.service.calls) == 1
    assert answers[-1].json()["code"] == "overloaded" and answers[-1].headers["connection"] == "close"
    assert client.transport.closing


# -- refusals of the request itself ---------------------------------------------------------------

def test_an_oversized_header_is_refused_431_and_closed():
    client = Client()
    client.send(b"GET /v2 HTTP/1.1\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\n\r\n")
    [answer] = client.received()
    assert answer.status == 431 and answer.json()["code"] == "frame_too_large"
    assert str(MAX_HEAD_BYTES) in answer.json()["error"] and client.transport.closing


def test_too_many_headers_are_refused_431():
    client = Client()
    client.send(b"GET /v2 HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n")
    [answer] = client.received()
    assert answer.status == 431 and "headers" in answer.json()["error"]


def test_a_bad_method_is_refused_400_and_a_known_method_on_the_wrong_route_405(loop):
    client = Client()
    client.send(b"BREW /v2 HTTP/1.1\r\n\r\n")
    [answer] = client.received()
    assert answer.status == 400 and answer.json()["code"] == "bad_frame" and client.transport.closing
    other = Client()
    other.send(b"DELETE /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    [answer] = other.received()
    assert answer.status == 405 and answer.headers["allow"] == "GET" and not other.transport.closing


def test_an_unknown_transfer_coding_is_refused_501():
    client = Client()
    client.send(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n")
    [answer] = client.received()
    assert answer.status == 501 and answer.json()["code"] == "bad_frame"


# -- deadlines (the fake clock) -----------------------------------------------------------------

def test_a_stalled_body_hits_its_upload_deadline_and_its_bytes_are_given_back():
    client = Client()
    client.send(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"{" * 10)
    assert client.conn.input is Input.BODY and client.conn.deadline.key == "upload_timeout_s"
    client.clock.advance(LIMITS.upload_timeout_s - 0.5)
    client.send(b" " * 10)  # more of the same body: the deadline runs on, it does not restart
    assert not client.received()
    client.clock.advance(0.5)
    [answer] = client.received()
    assert answer.status == 504 and answer.json()["code"] == "timeout"
    assert "within 7 s (server.upload_timeout_s)" in answer.json()["error"]
    assert client.transport.closing and sum(client.service.ledger.bytes.values()) == 0


def test_a_stalled_request_head_hits_its_frame_deadline():
    client = Client()
    client.send(b"GET /v2 HTTP/1.1\r\nHo")
    client.clock.advance(LIMITS.frame_timeout_s)
    [answer] = client.received()
    assert answer.status == 400 and "server.frame_timeout_s" in answer.json()["error"]


def test_no_deadline_runs_between_requests_or_while_one_is_served():
    client = Client()
    assert client.conn.deadline.key is None
    client.send(b"".join(binary_infer(np.zeros(2, np.float32))))
    assert client.conn.deadline.key is None  # served: the client is not the one keeping us waiting
    client.clock.advance(1000)
    assert not client.received() and not client.transport.closing


# -- flow control ---------------------------------------------------------------------------------

def test_an_unread_answer_pauses_the_next_request_and_resumes_once_it_is_read():
    client = Client()
    x = np.arange(4, dtype=np.float32)
    client.send(b"".join(binary_infer(x)) * 2)
    client.transport.hold = True  # the client does not read
    released = []
    client.service.calls[0].answer(result_of(x, released))
    assert client.conn.write_blocked and client.conn.flow.stall_timer is not None
    assert len(client.service.calls) == 1 and not released  # the next waits; the arena views are held
    client.transport.hold = False
    client.transport.drain()
    assert not client.conn.write_blocked and client.conn.flow.stall_timer is None
    assert released == [1] and len(client.service.calls) == 2


def test_an_answer_left_unread_past_stall_timeout_s_closes_the_connection():
    client = Client()
    x = np.arange(4, dtype=np.float32)
    client.send(b"".join(binary_infer(x)))
    client.transport.hold = True
    released = []
    client.service.calls[0].answer(result_of(x, released))
    client.clock.advance(LIMITS.stall_timeout_s)
    assert client.transport.aborted
    client.lose()
    assert released == [1] and client.service.doors == 0 and len(client.door.connections) == 0


# -- a streamed body, and an answer sent in pieces ------------------------------------------------

def test_a_binary_body_still_arriving_is_streamed_into_the_space_the_service_gives():
    client = Client()
    x = np.arange(1 << 14, dtype=np.float32)
    head, tensor = binary_infer(x)
    client.send(head + tensor[:1000])
    assert client.conn.input is Input.STREAM and not client.transport.reading  # no space yet
    call = client.service.calls[0]
    space = bytearray(x.nbytes)
    done = []
    call.request.body.fill([memoryview(space)[:5000], memoryview(space)[5000:]], lambda: done.append(1))
    assert client.transport.reading
    for i in range(1000, len(tensor), 3333):  # odd pieces: across the two sinks' boundary
        client.send(tensor[i:i + 3333])
    assert done == [1] and bytes(space) == tensor and client.conn.input is Input.IDLE
    call.answer(result_of(x[:4], []))
    assert client.received()[0].status == 200


def test_a_streamed_request_refused_before_its_body_is_in_is_answered_once_the_rest_is_dropped():
    client = Client()
    x = np.arange(1 << 14, dtype=np.float32)
    head, tensor = binary_infer(x)
    client.send(head + tensor[:1000])
    call = client.service.calls[0]
    call.answer(error=V2Error(ErrorCode.TIMEOUT, "too late"))
    assert client.conn.input is Input.DISCARD and not client.received()  # its answer waits for the body
    client.send(tensor[1000:])
    [answer] = client.received()
    assert answer.status == 504 and client.conn.input is Input.IDLE and not client.transport.closing


def test_a_large_json_answer_is_made_and_sent_a_piece_at_a_time_as_its_client_reads():
    client = Client()
    x = np.arange(3 * rest.JSON_PIECE, dtype=np.float32)
    head, tensor = binary_infer(np.zeros(2, np.float32))
    client.send(head + tensor)
    released = []
    client.transport.hold = True  # the client reads only when the test says
    client.service.calls[0].answer(result_of(x, released, binary=False))
    assert not client.transport.written and not client.transport.held  # counted first: nothing written
    client.clock.run_soon()  # counted, then the head: it waits unread, so nothing more is made
    assert client.transport.held.startswith(b"HTTP/1.1 200 OK") and not client.clock.soon_pending
    pieces = 0
    while client.transport.held:
        client.transport.drain()  # the client reads what waits: the next piece is made and written
        pieces += 1
        assert len(client.transport.held) <= 2 * 16 * rest.JSON_PIECE  # one piece at a time
        client.clock.run_soon()
    assert pieces >= 4  # the head and at least three pieces of data
    [answer] = client.received()
    assert answer.status == 200 and int(answer.headers["content-length"]) == len(answer.body)
    assert answer.json()["outputs"][0]["data"] == x.tolist() and released == [1]


# -- the operations table ---------------------------------------------------------------------------

def test_every_route_but_infer_has_an_operation_in_the_table():
    assert set(OPERATIONS) == {op for _, _, op in rest.ROUTES} - {"infer"}


def test_an_operation_s_body_is_checked_by_its_handler(loop):
    service = FakeService()
    msg = Exchange()
    msg.body, msg.size, msg.caller = [b'{"ready": "yes"}'], 16, Caller(service.auth.anonymous, None)
    with pytest.raises(V2Error, match="'ready' must be true or false"):
        loop.run_until_complete(serve_operation(service, msg, "repository_index", {}, HttpLimits(1 << 20)))
    answer = loop.run_until_complete(serve_operation(service, Exchange(), "model_metadata", {"m": "m"},
                                                     HttpLimits(1 << 20)))
    assert answer == Answer(200, "application/json", [b'{"name":"m","versions":["1"]}'])


def test_an_operation_s_error_is_its_answer_with_the_header_it_calls_for(loop):
    client = Client()
    within(loop, lambda: client.send(get("/v2/models/nope")))
    [answer] = client.received()
    assert answer.status == 404 and answer.json()["code"] == "unknown_model"
    assert Answer.of_error(rest.NoRoute("/x", ["GET", "POST"])).extra == ((b"allow", b"GET, POST"),)


def test_connections_past_max_connections_are_refused_503():
    client = Client()
    door = client.door
    for _ in range(LIMITS.max_connections - 1):
        conn = HttpConnection(door)
        conn.connection_made(FakeTransport())
    extra = HttpConnection(door)
    transport = FakeTransport()
    extra.connection_made(transport)
    assert transport.closing and b"503" in transport.written[:20] and b"server.max_connections" in transport.written


def test_a_unix_socket_peer_is_who_the_kernel_says_and_counted_per_uid():
    """On a Unix socket the connection's owner is its ``SO_PEERCRED`` uid (a real socket pair):
    past ``max_connections_per_uid`` of one uid, 503 naming the key; a closed one makes room."""
    client = Client()
    door, pairs, conns = client.door, [], []
    try:
        for _ in range(LIMITS.max_connections_per_uid + 1):
            a, b = socket.socketpair()
            pairs += [a, b]
            conn, transport = HttpConnection(door), FakeTransport(a)
            transport.protocol = conn
            conn.connection_made(transport)
            conns.append((conn, transport))
        assert all(c.peer is not None and c.peer.uid == os.geteuid() for c, _ in conns[:-1])
        refused = conns[-1][1]
        assert refused.closing and b"503" in refused.written[:20]
        assert b"server.max_connections_per_uid" in refused.written and b"HTTP connections" in refused.written
        conns[0][0].connection_lost(None)
        conn, transport = HttpConnection(door), FakeTransport(pairs[0])
        transport.protocol = conn
        conn.connection_made(transport)
        assert not transport.closing
    finally:
        for s in pairs:
            s.close()


def test_an_operation_under_way_is_cancelled_when_its_connection_goes(loop, monkeypatch):
    client = Client()
    started = []

    async def never_done(service, caller, params, body):
        started.append(1)
        await asyncio.Event().wait()

    monkeypatch.setitem(OPERATIONS, "server_metadata", never_done)
    within(loop, lambda: client.send(get("/v2")))
    task = client.conn.current.work
    assert started == [1] and not task.done()
    client.lose()
    loop.run_until_complete(asyncio.sleep(0.01))
    assert task.cancelled() and not client.received()


def test_a_gzip_body_is_decoded_on_a_thread_then_submitted(loop):
    import gzip

    client = Client()
    body = gzip.compress(json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [3],
                                                 "data": [1, 2, 3]}]}).encode())
    within(loop, lambda: client.send(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
                                     b"Content-Length: %d\r\n\r\n" % len(body) + body))
    for _ in range(100):
        if client.service.calls:
            break
        loop.run_until_complete(asyncio.sleep(0.01))
    [call] = client.service.calls
    assert call.request.inputs[0].shape == (3,) and client.conn.current.work is call
