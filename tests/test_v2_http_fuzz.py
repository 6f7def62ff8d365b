"""A fuzz run over the v2 HTTP door of a real server: hypothesis mutates valid requests (bytes
flipped, inserted, deleted, repeated, cut; header values and names replaced; bodies replaced by
arbitrary JSON; requests pipelined) and sends each on a fresh loopback connection, ending it by
half-closing or by going quiet.

Whatever it sends, every byte the server writes back must parse as HTTP/1.1 answers, each a 1xx,
200 or a 4xx/503/504 refusal in the ``{"error": "[code] ...", "code": ...}`` form: never a 500
(an exception the door did not expect is a bug).  Afterwards the server is alive, serves a good
request, holds no slot or arena space, and has no more descriptors open than before.

The run is bounded (``EXAMPLES``) and seeded: the seed is printed, and ``SHMSERVE_SEED=<seed>``
replays it.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import socket
import time

import httptools
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from helpers import raw_http
from helpers.raw_http import Reader, binary_infer, connect, json_infer, request
from helpers.v2_server import TOKENS, auth, json_values, open_fds, shm_objects, still_serving, v2_serving

SEED = int(os.environ.get("SHMSERVE_SEED") or random.SystemRandom().randrange(2**32))
EXAMPLES = int(os.environ.get("SHMSERVE_FUZZ_EXAMPLES", "600"))  # ~10 s on 2 cores
ANSWERS = {100, 200, 400, 401, 403, 404, 405, 413, 431, 501, 503, 504}  # 501: a transfer coding not served
QUIET_S = 0.1  # an example that goes quiet is closed after this long without an answer


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with v2_serving(tmp_path_factory.mktemp("v2fuzz")) as s, shm_objects() as make:
        s.key = make(4096)
        yield s


def bases(key: str) -> list[bytes]:
    """Valid requests: each is answered 200 as it is."""
    x = bytes(range(24))
    header = {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [24], "parameters": {"binary_data_size": 24}}],
              "parameters": {"binary_data_output": True},
              "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
    body = {"id": "f", "inputs": [{"name": "x", "datatype": "UINT8", "shape": [4], "data": [1, 2, 3, 4]}],
            "parameters": {"timeout": 5000000}}
    two = {"inputs": [{"name": "a", "datatype": "INT32", "shape": [2], "data": [1, 2]},
                      {"name": "b", "datatype": "INT32", "shape": [2], "parameters": {"binary_data_size": 8}}]}
    text = json.dumps(body).encode()
    return [
        json_infer("identity", {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [3], "data": [1, 2, 3]}]}),
        json_infer("f32", {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [0.5, -1e3]}]}),
        json_infer("identity", body),
        binary_infer("identity", header, x),
        binary_infer("two_inputs", two, bytes(8)),
        request("POST", "/v2/models/identity/infer", x, {"Inference-Header-Content-Length": "0"}),
        request("POST", "/v2/models/identity/versions/1/infer", gzip.compress(text), {"Content-Encoding": "gzip"}),
        request("POST", "/v2/models/identity/infer", b"%x\r\n%s\r\n0\r\n\r\n" % (len(text), text),
                {"Transfer-Encoding": "chunked"}),
        request("GET", "/v2/health/ready") + request("GET", "/v2/models/identity/versions/1"),
        request("GET", "/v2/models/identity/config"),
        request("GET", "/v2/models/two_inputs/stats", b"", auth("client")),
        request("POST", "/v2/repository/index", b'{"ready": true}', auth("admin")),
        request("POST", "/v2/systemsharedmemory/region/fz/register",
                json.dumps({"key": key, "offset": 16, "byte_size": 1024}).encode(), auth("client")),
        json_infer("identity", {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [3], "data": [1, 2, 3]}],
                                "outputs": [{"name": "y", "parameters": {"shared_memory_region": "fz",
                                                                         "shared_memory_byte_size": 3}}]},
                   auth("client")),
        request("POST", "/v2/systemsharedmemory/region/fz/unregister", b"", auth("client")),
        request("GET", "/v2/systemsharedmemory/status", b"", auth("client")),
        request("POST", "/v2/models/identity/infer", text, {"Expect": "100-continue"}),
        request("GET", "/v2/health/live", version="1.0"),
        json_infer("reverse", {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2], "data": ["ab", "c"]}]}),
        binary_infer("reverse", {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [2],
                                             "parameters": {"binary_data_size": 13}}]},
                     b"\x05\x00\x00\x00hello\x00\x00\x00\x00"),
        json_infer("bf16", {"inputs": [{"name": "x", "datatype": "BF16", "shape": [2], "data": [1.5, -3e38]}]}),
    ]


HEADER_NAMES = ["Content-Length", "Transfer-Encoding", "Inference-Header-Content-Length", "Content-Encoding",
                "Expect", "Connection", "Host", "Content-Type", "Authorization", "X-" + "a" * 300]
HEADER_VALUES = st.one_of(
    st.integers(-5, 2**70).map(str),
    st.sampled_from(["", " ", "-1", "0", "chunked", "gzip", "deflate", "gzip, chunked", "identity", "close",
                     "keep-alive", "100-continue", "\xb2", "1e3", "0x10", "18446744073709551616", "1 2", "\t7",
                     "Bearer", "Bearer ", "bearer " + TOKENS["admin"], "Basic dTpw", "Bearer " + "A" * 600,
                     "Bearer " + TOKENS["client"][:-1], "Bearer a b"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"), max_size=24))
JSON = json_values(st.sampled_from(["inputs", "outputs", "name", "datatype", "shape", "data", "parameters",
                                     "binary_data_size", "id", "key", "offset", "byte_size", "timeout"])
                   | st.text(max_size=6), max_leaves=30)


def split_head(data: bytes) -> tuple[bytes, bytes]:
    head, sep, body = data.partition(b"\r\n\r\n")
    return head, body if sep else b""


@st.composite
def mutated_request(draw, key: str):
    data = bytearray(draw(st.sampled_from(bases(key))))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "repeat", "cut", "header_value", "header_add",
                                   "header_drop", "json_body", "request_line", "pipeline"]))
        n = len(data)
        if op == "flip" and n:
            for _ in range(draw(st.integers(1, 4))):
                data[draw(st.integers(0, n - 1))] ^= draw(st.integers(1, 255))
        elif op == "insert":
            at = draw(st.integers(0, n))
            data[at:at] = draw(st.binary(min_size=1, max_size=16)
                               | st.sampled_from([b"\r\n", b"\r\n\r\n", b":", b"\0"]))
        elif op == "delete" and n:
            at = draw(st.integers(0, n - 1))
            del data[at:at + draw(st.integers(1, 16))]
        elif op == "repeat" and n:
            at = draw(st.integers(0, n - 1))
            data[at:at] = data[at:at + draw(st.integers(1, 64))]
        elif op == "cut" and n:
            del data[draw(st.integers(0, n - 1)):]
        elif op in ("header_value", "header_add", "header_drop"):
            head, body = split_head(bytes(data))
            lines = head.split(b"\r\n")
            if op == "header_add" or len(lines) < 2:
                name = draw(st.sampled_from(HEADER_NAMES))
                line = f"{name}: {draw(HEADER_VALUES)}".encode("latin-1")
                lines.insert(draw(st.integers(1, max(1, len(lines)))), line)
            else:
                i = draw(st.integers(1, len(lines) - 1))
                if op == "header_drop":
                    del lines[i]
                else:
                    name = lines[i].partition(b":")[0]
                    lines[i] = name + b": " + draw(HEADER_VALUES).encode("latin-1")
            data = bytearray(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        elif op == "json_body":
            head, _ = split_head(bytes(data))
            body = json.dumps(draw(JSON)).encode()
            if draw(st.booleans()):  # keep the framing honest, so the body reaches the codec
                lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith((b"content-length",
                                                                                       b"transfer-encoding",
                                                                                       b"content-encoding",
                                                                                       b"inference-header"))]
                head = b"\r\n".join(lines + [b"Content-Length: %d" % len(body)])
            data = bytearray(head + b"\r\n\r\n" + body)
        elif op == "request_line":
            head, body = split_head(bytes(data))
            first, _, rest = head.partition(b"\r\n")
            # not HEAD: its answer has no body, which the response parser cannot know (test_v2_http_edges)
            method = draw(st.sampled_from(["GET", "POST", "PUT", "OPTIONS", "DELETE", "G T", "post"]))
            path = draw(st.sampled_from(["/v2/models/identity/infer", "/v2", "/v2/models/%ff/infer", "*",
                                         "http://x/v2/health/live", "/v2/models/identity/versions/0/infer",
                                         "/v2/models/identity/versions/1/ready", "/" + "a" * 70000,
                                         "/v2/systemsharedmemory/region/%2F/status", "/v2/models/" + "m" * 300]))
            version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1.1 x", ""]))
            data = bytearray(f"{method} {path} {version}".encode() + b"\r\n" + rest + b"\r\n\r\n" + body)
        elif op == "pipeline":
            data += draw(st.sampled_from(bases(key)))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))  # written in pieces: streamed bodies
    ending = draw(st.sampled_from(["half_close", "quiet"]))
    return [bytes(data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(data)])], ending


def answers_to(hostport: str, pieces: list[bytes], ending: str) -> list[raw_http.Response]:
    """Send ``pieces`` (1 ms apart) on a fresh connection and collect what the server answers
    before it closes (``half_close``) or goes quiet for QUIET_S (``quiet``).  Every byte must parse
    as HTTP."""
    with connect(hostport, timeout=10) as s:
        reader = Reader(s)
        try:
            for i, piece in enumerate(pieces):
                if i:
                    time.sleep(0.001)
                s.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):  # refused and closed before it had all of it
            pass
        if ending == "half_close":
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            reader.closes()
        else:
            s.settimeout(QUIET_S)
            try:
                reader.closes()
            except socket.timeout:
                pass
    return reader.done


def check(r: raw_http.Response, note: str) -> None:
    assert r.status in ANSWERS, f"{note}: status {r.status}: {r}"
    if r.status >= 400:
        assert r.code, note  # the error body's form (Response.code checks "[code] message")
    if r.status == 200 and r.headers.get("content-type") == "application/json" and r.body:
        json.loads(bytes(r.body))


def test_the_fuzz_starts_from_valid_requests(srv):
    for i, data in enumerate(bases(srv.key)):
        with connect(srv.http) as s:
            s.sendall(data)
            reader = Reader(s)
            count = 2 if data.count(b" HTTP/1.") == 2 else 1
            for r in reader.read(count):
                assert r.status == 200, (i, r)
    raw_http.one(srv.http, request("POST", "/v2/systemsharedmemory/unregister", b"", auth("client")))


def test_fuzzed_requests_against_the_live_server(srv):
    print(f"v2 http fuzz seed={SEED} examples={EXAMPLES}")
    still_serving(srv)
    fds = open_fds(srv)
    seen: dict[int, int] = {}

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(mutated_request(srv.key))
    def fuzz(example):
        pieces, ending = example
        data = b"".join(pieces)
        try:
            answers = answers_to(srv.http, pieces, ending)
        except httptools.HttpParserError as exc:
            raise AssertionError(f"seed {SEED}: the server's answer is not HTTP ({exc}) to {data[:300]!r}") from None
        for r in answers:
            seen[r.status] = seen.get(r.status, 0) + 1
            check(r, f"seed {SEED}: {data[:300]!r}")
        assert srv.proc.poll() is None, f"seed {SEED}: the server died on {data[:300]!r}"

    start = time.monotonic()
    fuzz()
    print(f"v2 http fuzz: answers by status {dict(sorted(seen.items()))} in {time.monotonic() - start:.1f} s")
    assert seen.get(200) and len(seen) > 3, f"seed {SEED}: the fuzz hardly reached the server: {seen}"
    raw_http.one(srv.http, request("POST", "/v2/systemsharedmemory/unregister", b"", auth("client")))
    still_serving(srv, fds)
