"""Raw HTTP/1.1 over a loopback TCP socket (or the door's Unix socket), for tests that play a hostile v2 client: they write
every byte themselves (a header that lies, a body cut short, a request split anywhere) and read
what the server answers with httptools' response parser, until it has answered or closed."""

from __future__ import annotations

import json
import socket
import threading

import httptools


def address(hostport: str) -> tuple[str, int]:
    """``"127.0.0.1:8000"`` (or ``"[::1]:8000"``) as a socket address."""
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


def connect(hostport: str, timeout: float = 30.0, rcvbuf: int | None = None) -> socket.socket:
    """A connection to the HTTP door at ``hostport`` (or a Unix socket path); every read on it
    gives up after ``timeout`` seconds (``rcvbuf``: a small receive buffer, for a client that does
    not read)."""
    if "/" in hostport:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target = hostport
    else:
        host, port = address(hostport)
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        target = (host, port)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect(target)
    return s


def request(method: str, path: str, body: bytes = b"", headers: dict | None = None, *,
            version: str = "1.1", length: bool = True) -> bytes:
    """The bytes of one request; ``Content-Length`` is the body's unless ``headers`` gives one
    (or ``length`` is false)."""
    head = [f"{method} {path} HTTP/{version}", "Host: localhost"]
    given = {k.lower() for k in (headers or {})}
    if length and "content-length" not in given and "transfer-encoding" not in given and (body or method == "POST"):
        head.append(f"Content-Length: {len(body)}")
    head.extend(f"{k}: {v}" for k, v in (headers or {}).items())
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def binary_infer(model: str, header: dict, data: bytes, headers: dict | None = None) -> bytes:
    """A binary-tensor infer request: the JSON ``header``, then ``data``."""
    text = json.dumps(header).encode()
    return request("POST", f"/v2/models/{model}/infer", text + data,
                   {"Inference-Header-Content-Length": str(len(text)), **(headers or {})})


def json_infer(model: str, body: dict, headers: dict | None = None) -> bytes:
    return request("POST", f"/v2/models/{model}/infer", json.dumps(body).encode(),
                   {"Content-Type": "application/json", **(headers or {})})


class Response:
    """One answer: ``status``, ``headers`` (lower-case names), ``body``."""

    def __init__(self):
        self.status, self.headers, self.body = 0, {}, bytearray()

    def json(self):
        return json.loads(bytes(self.body[:self.header_length] if self.header_length is not None else self.body))

    @property
    def header_length(self) -> int | None:
        value = self.headers.get("inference-header-content-length")
        return int(value) if value is not None else None

    @property
    def binary(self) -> bytes:
        """What follows the JSON header of a binary answer."""
        return bytes(self.body[self.header_length:])

    @property
    def code(self) -> str | None:
        """The stable shmserve code of an error answer (the error text says it too, in front,
        unless the text is Triton's own wording: then it is never in front of it)."""
        if self.status < 400:
            return None
        body = json.loads(bytes(self.body))
        assert body["error"].startswith(f"[{body['code']}] ") or not body["error"].startswith(f"[{body['code']}]"), body
        return body["code"]

    @property
    def error(self) -> str:
        return json.loads(bytes(self.body))["error"]

    def __repr__(self):
        return f"<Response {self.status} {bytes(self.body[:200])!r}>"


class Reader:
    """Answers read from one connection, in order (interim 1xx answers are kept too)."""

    def __init__(self, s: socket.socket):
        self.s, self.done, self.closed = s, [], False
        self._new()

    def _new(self):
        self.current = Response()
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes):
        self.current.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes):
        self.current.body += body

    def on_headers_complete(self):
        self.current.status = self.parser.get_status_code()  # llhttp knows a 1xx answer has no body

    def on_message_complete(self):
        self.done.append(self.current)
        self.current = Response()

    def read(self, count: int = 1, *, interim: bool = False) -> list[Response]:
        """The next ``count`` final answers (with ``interim``: 1xx ones count as answers too).
        AssertionError if the connection closes first; socket.timeout if they do not come."""
        out = []
        while True:
            while self.done and len(out) < count:
                r = self.done.pop(0)
                if interim or r.status >= 200:
                    out.append(r)
            if len(out) == count:
                return out
            assert not self.closed, f"the server closed the connection after {len(out)} of {count} answers"
            self._recv()

    def one(self) -> Response:
        return self.read(1)[0]

    def _recv(self):
        try:
            chunk = self.s.recv(1 << 20)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            self.closed = True
            return
        try:
            self.parser.feed_data(chunk)
        except httptools.HttpParserUpgrade:
            pass

    def closes(self) -> bool:
        """Whether the server closes the connection, with no more answers than those read
        (what arrives meanwhile is kept in ``done``); socket.timeout if it does not."""
        while not self.closed:
            self._recv()
        return True


def exchange(hostport: str, data: bytes, count: int = 1, timeout: float = 30.0) -> list[Response]:
    """Send ``data`` on a fresh connection and read ``count`` answers."""
    with connect(hostport, timeout) as s:
        s.sendall(data)
        return Reader(s).read(count)


def one(hostport: str, data: bytes, timeout: float = 30.0) -> Response:
    return exchange(hostport, data, 1, timeout)[0]


class Sender(threading.Thread):
    """Sends ``data`` on ``s`` in the background (for a body the server may refuse before it has
    read it all); ``error`` is what ended it (None: all sent)."""

    def __init__(self, s: socket.socket, data: bytes):
        super().__init__(daemon=True)
        self.s, self.data, self.error = s, data, None
        self.start()

    def run(self) -> None:
        try:
            self.s.sendall(self.data)
        except OSError as exc:
            self.error = exc
