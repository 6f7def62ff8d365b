"""The KServe v2 HTTP door against hostile and odd clients: a real server, raw sockets, every byte
written by the test (``helpers.raw_http``).

What Triton's qa suites check (L0_http, L0_input_validation), and more: headers that lie about the
body (Inference-Header-Content-Length, Content-Length, binary_data_size), bodies cut short, bodies
that stall, headers that never end or never stop, JSON that is not JSON, too deep or too large,
requests that do not fit their model (BYTES elements that lie about their lengths, BF16 out of
range), every optional field and parameter refused or taken,
transfer and content encodings (chunked, gzip, a gzip bomb), pipelining (and garbage behind it),
a request split at every byte boundary, streamed requests refused before their body is in, a
client that never reads, clients that vanish mid-request and mid-answer, HTTP/1.0,
``Connection: close``, ``Expect: 100-continue``, HEAD, 404 and 405, the other routes' bodies, the
per-uid connection limit and shutdown with connections open.

Each refusal is a 4xx with the stable code in a ``{"error": "[code] ...", "code": ...}`` body.
After every test the server is alive, answers a good request, holds no slot or arena space
(``wait_idle``) and has no more descriptors open than before the module began.  Its deadlines are
1 s (``helpers.v2_server``), so every wait here is bounded.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import shutil
import signal
import socket
import tempfile
import time
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from helpers import raw_http
from helpers.raw_http import Reader, Sender, binary_infer, connect, json_infer, one, request
from helpers.server import wait_for
from helpers.v2_server import (BIG_OUT, DEADLINE_S, MAX_REQUEST_BYTES, auth, python_model, server_fixture, still_serving,
                               v2_serving)
from helpers.v2_server import baseline  # noqa: F401  (a fixture)

MAX_BODY = 2 * MAX_REQUEST_BYTES + (1 << 20)  # the server's HTTP body limit


srv = server_fixture("v2http")


@pytest.fixture(autouse=True)
def serving_after(srv, baseline):
    yield
    still_serving(srv, baseline)


def tensor(name="x", datatype="UINT8", shape=(4,), **parameters) -> dict:
    t = {"name": name, "datatype": datatype, "shape": list(shape)}
    if parameters:
        t["parameters"] = parameters
    return t


def binary_header(n: int, **extra) -> dict:
    """The JSON header of an identity request of ``n`` UINT8s sent in binary, answered in binary."""
    return {"inputs": [tensor(shape=(n,), binary_data_size=n)], "parameters": {"binary_data_output": True}, **extra}


def json_body(data=(1, 2, 3, 4), **extra) -> dict:
    return {"inputs": [tensor(shape=(len(data),), **{}) | {"data": list(data)}], **extra}


def refused(r: raw_http.Response, status: int, code: str, *words: str) -> None:
    """``r`` is the refusal ``status`` with stable ``code`` whose message says each of ``words``."""
    assert r.status == status and r.code == code, r
    assert r.headers["content-type"] == "application/json"
    for word in words:
        assert word in r.error, (word, r.error)


def answered_identity(r: raw_http.Response, x: bytes) -> None:
    assert r.status == 200, r
    out = r.json()["outputs"][0]
    assert out["name"] == "y" and out["shape"] == [len(x)]
    if r.header_length is not None:
        assert out["parameters"]["binary_data_size"] == len(x) and r.binary == x
    else:
        assert bytes(out["data"]) == x


def then_closed(reader: Reader) -> None:
    assert reader.closes()


def keeps_serving(s: socket.socket, reader: Reader) -> None:
    """The same connection still answers a good request."""
    s.sendall(json_infer("identity", json_body((5, 6, 7))))
    answered_identity(reader.one(), bytes((5, 6, 7)))


def split_at_header(header: dict, data: bytes, model: str = "identity", extra: dict | None = None):
    """(the request's bytes up to and including its JSON header, the rest)."""
    whole = binary_infer(model, header, data, extra)
    return whole[:len(whole) - len(data)], whole[len(whole) - len(data):]


# -- Inference-Header-Content-Length and Content-Length that lie --------------------------------

@pytest.mark.parametrize("value", ["-1", "abc", "\xb2", "1e3", "0x10", "", " ", "+5", "9" * 19, "1.5"])
def test_a_header_length_that_is_not_a_number_is_refused_and_the_connection_closed(srv, value):
    body = json.dumps(binary_header(4)).encode() + b"abcd"
    with connect(srv.http) as s:
        s.sendall(request("POST", "/v2/models/identity/infer", body, {"Inference-Header-Content-Length": value}))
        reader = Reader(s)
        refused(reader.one(), 400, "bad_frame", "Inference-Header-Content-Length")
        then_closed(reader)


def test_a_header_length_bigger_than_the_body_is_refused_before_the_body_is_read(srv):
    text = json.dumps(binary_header(4)).encode()
    head = request("POST", "/v2/models/identity/infer", b"", {
        "Inference-Header-Content-Length": str(len(text) + 5), "Content-Length": str(len(text) + 4)})
    with connect(srv.http) as s:
        s.sendall(head)  # no body at all: the answer cannot wait for it
        reader = Reader(s)
        refused(reader.one(), 400, "bad_frame", f"{len(text) + 5} is more than", str(len(text) + 4))
        then_closed(reader)


@pytest.mark.parametrize("length, code, status", [
    ("12a", "bad_frame", 400), ("-5", "bad_frame", 400), ("5, 6", "bad_frame", 400),
    (str(MAX_BODY + 1), "too_large", 413), (str(1 << 62), "too_large", 413), ("9" * 30, "bad_frame", 400)])
def test_a_content_length_that_is_not_a_length_or_over_the_limit_is_refused_unread(srv, length, code, status):
    with connect(srv.http) as s:
        s.sendall(request("POST", "/v2/models/identity/infer", b"", {"Content-Length": length}))
        reader = Reader(s)
        refused(reader.one(), status, code)
        then_closed(reader)


def test_two_content_lengths_or_one_with_chunked_are_refused(srv):
    for headers in ({"Content-Length": "2\r\nContent-Length: 3"}, {"Content-Length": "2\r\nContent-Length: 2"},
                    {"Content-Length": "5", "Transfer-Encoding": "chunked"}):
        with connect(srv.http) as s:
            s.sendall(request("POST", "/v2/models/identity/infer", b"{}   ", headers))
            reader = Reader(s)
            refused(reader.one(), 400, "bad_frame", "malformed HTTP request")
            then_closed(reader)


def test_a_json_header_that_is_not_json_is_refused_and_the_connection_kept(srv):
    garbage = b"{not json at all}"
    for name, cut in (("buffered", None), ("streamed", 3)):
        whole = request("POST", "/v2/models/identity/infer", garbage + b"abcdef",
                        {"Inference-Header-Content-Length": str(len(garbage))})
        with connect(srv.http) as s:
            reader = Reader(s)
            if cut is None:
                s.sendall(whole)
            else:  # the header is in and the tensors still coming: refused, the rest read and dropped
                s.sendall(whole[:-cut])
                time.sleep(0.05)
                s.sendall(whole[-cut:])
            refused(reader.one(), 400, "bad_frame", "the JSON header is not JSON")
            keeps_serving(s, reader)


def test_raw_binary_bodies(srv):
    x = bytes(range(200))
    raw = {"Inference-Header-Content-Length": "0"}
    answered_identity(one(srv.http, request("POST", "/v2/models/identity/infer", x, raw)), x)
    r = one(srv.http, request("POST", "/v2/models/two_inputs/infer", x, raw))
    refused(r, 400, "bad_input", "Raw request must only have 1 input", "got 2 inputs in 'two_inputs'")
    r = one(srv.http, request("POST", "/v2/models/f32/infer", bytes(16), raw))  # max_batch_size 0: [n, m]
    refused(r, 400, "bad_input", "can not be deduced because there are more than one variable-sized dimension")
    r = one(srv.http, request("POST", "/v2/models/slow/infer", bytes(7), raw))
    refused(r, 400, "bad_input", "not a whole number of 4-byte rows")
    r = one(srv.http, request("POST", "/v2/models/no_such_model/infer", x, raw))
    refused(r, 400, "unknown_model", "Request for unknown model: 'no_such_model' is not found")


# -- bodies cut short: closed, or stalled ---------------------------------------------------------

def test_a_body_shorter_than_declared_then_closed_frees_the_request(srv):
    x = bytes(range(256)) * 4096  # 1 MiB: streamed into the arena as it comes
    head, rest = split_at_header(binary_header(len(x)), x)
    for cut in (0, 1, len(x) // 2, len(x) - 1):
        s = connect(srv.http)
        s.sendall(head + rest[:cut])
        if cut:
            wait_for(lambda: srv.info()["stats"]["slots_in_use"] == 1, "the streamed request to hold its slot")
        s.close()
        srv.wait_idle()
    for body in (json.dumps(json_body()).encode(), b'{"inputs": [{"name": "x", "da'):  # JSON: buffered
        with connect(srv.http) as s:
            s.sendall(request("POST", "/v2/models/identity/infer", b"", {"Content-Length": str(len(body) + 10)}) + body)
    srv.wait_idle()


@pytest.mark.parametrize("what", ["streamed", "json", "refused_streamed", "chunked"])
def test_a_body_that_stalls_is_answered_504_at_the_upload_deadline_and_closed(srv, what):
    x = bytes(64 * 1024)
    if what == "streamed":
        head, rest = split_at_header(binary_header(len(x)), x)
        data = head + rest[:1000]
    elif what == "refused_streamed":  # refused at its header (too big for the body), its body then stalls
        head, rest = split_at_header(binary_header(len(x) + 1), x)
        data = head + rest[:1000]
    elif what == "json":
        body = json.dumps(json_body()).encode()
        data = request("POST", "/v2/models/identity/infer", b"", {"Content-Length": str(len(body) + 1)}) + body
    else:
        data = request("POST", "/v2/models/identity/infer", b"", {"Transfer-Encoding": "chunked"}) + b"10\r\n{\"in"
    with connect(srv.http) as s:
        start = time.monotonic()
        s.sendall(data)
        reader = Reader(s)
        refused(reader.one(), 504, "timeout", f"within {DEADLINE_S} s (server.upload_timeout_s)")
        then_closed(reader)
        assert time.monotonic() - start >= DEADLINE_S * 0.9


@pytest.mark.parametrize("data", [b"", b"POST /v2/models/identity/inf", b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n",
                                  b"GET /v2/health/live HTTP/1.1\r\nX-Slow: aaaa"])
def test_headers_that_never_finish_are_answered_at_the_frame_deadline_and_closed(srv, data):
    with connect(srv.http) as s:
        s.sendall(data)
        reader = Reader(s)
        if not data:  # nothing begun: an idle keep-alive connection has no deadline
            s.settimeout(DEADLINE_S * 2)
            with pytest.raises(socket.timeout):
                reader.one()
            return
        start = time.monotonic()
        for _ in range(3):  # a byte now and then does not move the deadline
            time.sleep(DEADLINE_S / 4)
            try:
                s.sendall(b"a")
            except OSError:  # a slow machine: the deadline came first
                break
        refused(reader.one(), 400, "bad_frame", "the request line and headers did not all arrive",
                "server.frame_timeout_s")
        then_closed(reader)
        assert time.monotonic() - start >= DEADLINE_S * 0.9


@pytest.mark.parametrize("headers", [{"X-Big": "a" * (64 * 1024 + 1)},
                                     {f"X-H{i}": "1" for i in range(101)},
                                     {f"X-H{i}": "b" * 1000 for i in range(70)}])
def test_headers_over_the_limits_are_refused_431_and_closed(srv, headers):
    with connect(srv.http) as s:
        sender = Sender(s, request("GET", "/v2/health/live", b"", headers))
        reader = Reader(s)
        refused(reader.one(), 431, "frame_too_large")
        then_closed(reader)
        sender.join(10)
    long_url = "/v2/health/live?" + "q" * (64 * 1024)
    with connect(srv.http) as s:
        Sender(s, request("GET", long_url)).join(10)
        refused(Reader(s).one(), 431, "frame_too_large")


# -- binary_data_size, datatypes, shapes and byte sizes that do not fit ------------------------------

@pytest.mark.parametrize("path", ["buffered", "streamed"])
@pytest.mark.parametrize("size, words", [(3, ["add up to 3 bytes, but 4 follow"]), (5, ["goes past the end"]),
                                         (0, ["add up to 0 bytes"])])
def test_a_wrong_binary_data_size_is_refused(srv, path, size, words):
    x = b"abcd"
    header = {"inputs": [tensor(shape=(4,), binary_data_size=size)]}
    with connect(srv.http) as s:
        reader = Reader(s)
        whole = binary_infer("identity", header, x)
        if path == "buffered":
            s.sendall(whole)
        else:
            s.sendall(whole[:-2])
            time.sleep(0.05)
            s.sendall(whole[-2:])
        refused(reader.one(), 400, "bad_input", *words)
        keeps_serving(s, reader)


@pytest.mark.parametrize("model, header, status, code", [
    ("no_such_model", binary_header(1 << 20), 400, "unknown_model"),
    ("identity", {"inputs": [tensor(datatype="INT8", shape=(1 << 20,), binary_data_size=1 << 20)]}, 400, "bad_dtype"),
    ("identity", {"inputs": [tensor(shape=(1024, 1024), binary_data_size=1 << 20)]}, 400, "bad_shape"),
    ("identity", {"inputs": [tensor(shape=(1 << 19,), binary_data_size=1 << 20)]}, 400, "bad_input"),
    ("two_inputs", {"inputs": [tensor("a", "INT32", (1 << 18,), binary_data_size=1 << 20)]}, 400, "bad_input"),
    ("identity", binary_header(1 << 20, outputs=[{"name": "nope"}]), 400, "bad_input"),
])
def test_a_streamed_request_refused_before_its_body_is_in_is_answered_once_the_body_is_read(srv, model, header,
                                                                                           status, code):
    """The JSON header is in and refused; 1 MiB of tensors is still coming: it is read and
    dropped, then the refusal is sent and the connection serves on."""
    head, rest = split_at_header(header, bytes(1 << 20), model)
    with connect(srv.http) as s:
        reader = Reader(s)
        s.sendall(head + rest[:100])
        time.sleep(0.05)
        sender = Sender(s, rest[100:])
        refused(reader.one(), status, code)
        sender.join(10)
        assert sender.error is None
        keeps_serving(s, reader)


def test_a_request_that_times_out_while_its_body_streams_in_is_answered_once_the_body_is_read(srv):
    """Its timeout (0.2 s) passes while its tensors arrive; once they are in it is timed out (the
    slow model would take 0.5 s: no worker can finish it first), after its body is read."""
    x = np.zeros(1 << 16, np.float32)
    x[0] = 0.5
    header = {"inputs": [tensor(datatype="FP32", shape=x.shape, binary_data_size=x.nbytes)],
              "parameters": {"timeout": 200_000}}
    head, rest = split_at_header(header, x.tobytes(), "slow")
    with connect(srv.http) as s:
        reader = Reader(s)
        s.sendall(head + rest[:1000])
        time.sleep(0.4)  # past its timeout, within the upload deadline
        sender = Sender(s, rest[1000:])
        refused(reader.one(), 504, "timeout", "within 0.2 s")
        sender.join(10)
        assert sender.error is None
        keeps_serving(s, reader)


@pytest.mark.parametrize("method, path, body, status, code", [
    ("POST", "/v2/systemsharedmemory/region/r/register", b"[1]", 400, "bad_frame"),
    ("POST", "/v2/systemsharedmemory/region/r/register", b"{key", 400, "bad_frame"),
    ("POST", "/v2/systemsharedmemory/region/r/register", b'{"key": 5, "byte_size": 1}', 400, "bad_region"),
    ("POST", "/v2/systemsharedmemory/register", b'{"key": "/x", "byte_size": 1}', 400, "bad_region"),
    ("POST", "/v2/repository/index", b'{"ready": "yes"}', 400, "bad_input"),
    ("POST", "/v2/repository/models/identity/load", b'{"parameters": [1]}', 400, "bad_input"),
    ("POST", "/v2/repository/models/identity/load", b'{"parameters": {"config": "{}"}}', 400, "bad_input"),
    ("POST", "/v2/repository/models/identity/unload", b'{"parameters": {"version": "x"}}', 404, "unknown_model"),
    ("POST", "/v2/repository/models/%00/load", b"", 400, "bad_input"),
    ("POST", "/v2/repository/models/no_such_model/load", b"", 404, "unknown_model"),  # shmserve's own words
    ("GET", "/v2/health/live", b"not json", 400, "bad_frame"),
    ("GET", "/v2/models/identity/versions/0", b"", 404, "unknown_model"),
    ("GET", "/v2/models/no_such_model/stats", b"", 400, "unknown_model"),  # Triton's statuses
    ("GET", "/v2/systemsharedmemory/region/nope/status", b"", 404, "bad_region"),
    ("GET", "/v2/cudasharedmemory/region/nope/status", b"", 400, "bad_region"),
    ("POST", "/v2/cudasharedmemory/region/c/register", b'{"raw_handle": {"b64": "AA=="}, "byte_size": 4}', 400,
     "bad_region"),
])
def test_the_other_routes_check_their_bodies_and_names(srv, method, path, body, status, code):
    refused(one(srv.http, request(method, path, body, auth("admin"))), status, code)


def test_binary_data_sizes_of_several_inputs_must_each_fit(srv):
    a, b = np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32) * 7
    good = {"inputs": [tensor("a", "INT32", (3,), binary_data_size=12),
                       tensor("b", "INT32", (3,), binary_data_size=12)],
            "parameters": {"binary_data_output": True}}
    r = one(srv.http, binary_infer("two_inputs", good, a.tobytes() + b.tobytes()))
    assert r.status == 200 and np.array_equal(np.frombuffer(r.binary, np.int32), a + b), r
    skewed = json.loads(json.dumps(good))
    skewed["inputs"][0]["parameters"]["binary_data_size"] = 8
    skewed["inputs"][1]["parameters"]["binary_data_size"] = 16
    refused(one(srv.http, binary_infer("two_inputs", skewed, a.tobytes() + b.tobytes())), 400, "bad_input",
            "input byte size mismatch for input 'a' for model 'two_inputs'. Expected 12, got 8")


@pytest.mark.parametrize("body, status, code, words", [
    (json_body() | {"inputs": [tensor(datatype="FP32", shape=(1,)) | {"data": [1.0]}]}, 400, "bad_dtype", []),
    (json_body() | {"inputs": [tensor(datatype="FP8", shape=(1,)) | {"data": [1]}]}, 400, "bad_dtype", ["FP8"]),
    (json_body() | {"inputs": [tensor(datatype="BOOL", shape=(1,)) | {"data": [True]}]}, 400, "bad_dtype", []),
    (json_body() | {"inputs": [tensor(datatype=["UINT8"], shape=(1,)) | {"data": [1]}]}, 400, "bad_dtype", []),
    (json_body() | {"inputs": [tensor(datatype={"t": 1}, shape=(1,)) | {"data": [1]}]}, 400, "bad_dtype", []),
    (json_body() | {"inputs": [tensor(shape=(2, 2)) | {"data": [1, 2, 3, 4]}]}, 400, "bad_shape", []),
    (json_body() | {"inputs": [tensor(shape=(2, -2)) | {"data": [1]}]}, 400, "bad_shape", ["'shape'"]),
    (json_body() | {"inputs": [tensor(shape=(2**4, 2**60 + 2)) | {"data": [1]}]}, 400, "bad_shape", []),
    (json_body() | {"inputs": [tensor(shape=[1] * 9) | {"data": [1]}]}, 400, "bad_shape", ["at most 8"]),
    (json_body() | {"inputs": [tensor(shape=(True,)) | {"data": [1]}]}, 400, "bad_shape", []),
    (json_body() | {"inputs": [tensor(shape=(5,)) | {"data": [1, 2, 3]}]}, 400, "bad_input",
     ["Failed to parse 'data' field: shape does not match true shape", "3 elements", "needs 5"]),
    (json_body() | {"inputs": [tensor(shape=(2,)) | {"data": [1, 256]}]}, 400, "bad_input", ["outside the range"]),
    (json_body() | {"inputs": [tensor(shape=(2,)) | {"data": [1, -1]}]}, 400, "bad_input", ["outside the range"]),
    (json_body() | {"inputs": [tensor(shape=(2,)) | {"data": [1, 2.5]}]}, 400, "bad_input", ["integers"]),
    (json_body() | {"inputs": [tensor(shape=(2,)) | {"data": [[1], [2, 3]]}]}, 400, "bad_input",
     ["shape does not match true shape"]),  # read in order, as Triton does: 3 values
    (json_body() | {"inputs": [tensor(shape=(2,)) | {"data": ["a", "b"]}]}, 400, "bad_input", []),
    (json_body() | {"inputs": [tensor(shape=(1,)) | {"data": [None]}]}, 400, "bad_input", []),
    (json_body() | {"inputs": [tensor(datatype="BYTES", shape=(2,)) | {"data": ["a", 5]}]}, 400, "bad_input",
     ["BYTES data must be strings"]),
    (json_body() | {"inputs": [tensor(datatype="BYTES", shape=(3,)) | {"data": ["a", "b"]}]}, 400, "bad_input",
     ["2 elements"]),
])
def test_tensors_that_do_not_fit_their_model_or_their_own_shape_are_refused(srv, body, status, code, words):
    refused(one(srv.http, json_infer("identity", body)), status, code, *words)


def test_byte_sizes_that_do_not_fit_the_shape_are_refused(srv):
    for shape, datatype, size, model in (((4,), "UINT8", 8, "identity"), ((2,), "FP32", 7, "slow"),
                                         ((2, 3), "FP32", 20, "f32"), ((0,), "UINT8", 1, "identity")):
        header = {"inputs": [tensor(datatype=datatype, shape=shape, binary_data_size=size)]}
        refused(one(srv.http, binary_infer(model, header, bytes(size))), 400, "bad_input",
                f"input byte size mismatch for input 'x' for model '{model}'", f"got {size}")
    empty = {"inputs": [tensor(shape=(0,), binary_data_size=0)], "parameters": {"binary_data_output": True}}
    answered_identity(one(srv.http, binary_infer("identity", empty, b"")), b"")


def bytes_request(elements_data: bytes, count: int, **output) -> bytes:
    header = {"inputs": [tensor(datatype="BYTES", shape=(count,), binary_data_size=len(elements_data))]}
    if output:
        header["outputs"] = [{"name": "y", "parameters": output}]
    return binary_infer("reverse", header, elements_data)


@pytest.mark.parametrize("data, count", [
    (b"\xff\xff\xff\x7fabc", 1), (b"\x05\x00\x00\x00abc", 1), (b"\x01\x00", 1), (b"", 1),
    (b"\x01\x00\x00\x00ab", 1), (b"\x01\x00\x00\x00a", 2), (b"\x00\x00\x00\x00\x00\x00\x00\x00", 1),
])
def test_malformed_bytes_tensors_are_refused(srv, data, count):
    """BYTES data whose element lengths run past the end, stop inside a length, or leave bytes
    over (a BYTES model's input: the worker reads the elements)."""
    refused(one(srv.http, bytes_request(data, count)), 400, "bad_input")


def test_bytes_tensors_json_and_binary(srv):
    elements = [b"abc", b"", "é".encode(), b"\x00\xff"]
    raw = b"".join(len(e).to_bytes(4, "little") + e for e in elements)
    r = one(srv.http, bytes_request(raw, 4, binary_data=True))
    assert r.status == 200 and r.binary == b"".join(len(e).to_bytes(4, "little") + e[::-1] for e in elements), r
    text = {"inputs": [tensor(datatype="BYTES", shape=(3,)) | {"data": ["ab", "", "x\u00e7"]}]}  # reversed byte-wise
    r = one(srv.http, json_infer("reverse", text))
    assert r.status == 400 and "not UTF-8" in r.error, r  # "xç" reversed is not text
    text["inputs"][0]["data"] = ["ab", "", "xyz"]
    r = one(srv.http, json_infer("reverse", text))
    assert r.status == 200 and r.json()["outputs"][0]["data"] == ["ba", "", "zyx"], r
    # elements that are not UTF-8 cannot be answered in JSON: refused, the result let go
    refused(one(srv.http, bytes_request(raw, 4, binary_data=False)), 400, "bad_input", "binary_data = true")
    for data in ([{"b64": "AAAA"}], ["a", 5], [None], ["a", ["b", "c"]]):
        refused(one(srv.http, json_infer("reverse", {"inputs": [tensor(datatype="BYTES", shape=(len(data),))
                                                                 | {"data": data}]})), 400, "bad_input")


def test_bf16_json_data_is_rounded_once_and_refused_past_its_range(srv):
    values = [1.0, -2.5, 3.140625, 1e38, 0.0]
    r = one(srv.http, json_infer("bf16", {"inputs": [tensor(datatype="BF16", shape=(5,)) | {"data": values}],
                                          "parameters": {"binary_data_output": True}}))
    assert r.status == 200 and r.binary == np.array(values, np.float64).astype(ml_dtypes.bfloat16).tobytes(), r
    too_big = {"inputs": [tensor(datatype="BF16", shape=(2,)) | {"data": [1.0, 1e39]}]}
    refused(one(srv.http, json_infer("bf16", too_big)), 400, "bad_input", "outside the range of BF16")


# -- JSON too deep or too large -------------------------------------------------------------------

@pytest.mark.parametrize("body, code, words", [
    (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "bad_frame", ["not JSON", "depth"]),
    (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "bad_frame", ["not JSON", "depth"]),
    (json.dumps({"inputs": [tensor(shape=(1,)) | {"data": [1], "parameters": {"a": {"b": {"c": {"d": {"e": {
        "f": {"g": {"h": {"i": {"j": {"k": {"l": {}}}}}}}}}}}}}}]}).encode(), "bad_input", ["unknown parameter 'a'"]),
], ids=["100000_lists", "100000_objects", "deep_parameters"])
def test_deeply_nested_json_is_refused(srv, body, code, words):
    """orjson refuses nesting past 1024; within it, objects where no field takes one are refused as
    what they are."""
    with connect(srv.http) as s:
        s.sendall(request("POST", "/v2/models/identity/infer", body, {"Content-Type": "application/json"}))
        reader = Reader(s)
        refused(reader.one(), 400, code, *words)
        keeps_serving(s, reader)


@pytest.mark.parametrize("depth", [14, 1000])  # past the shape; past numpy's 64 dimensions, within orjson's 1024
def test_json_data_nested_deeper_than_its_shape_is_read_as_triton_reads_it(srv, depth):
    body = b'{"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": ' + b"[" * depth + b"7" + \
        b"]" * depth + b"}]}"
    with connect(srv.http) as s:
        s.sendall(request("POST", "/v2/models/identity/infer", body, {"Content-Type": "application/json"}))
        reader = Reader(s)
        answered_identity(reader.one(), b"\x07")
        keeps_serving(s, reader)


def test_a_json_body_over_8_mib_is_refused_413_and_closed_without_reading_it_all(srv):
    body = b'{"inputs": [{"name": "x", "datatype": "UINT8", "shape": [4500000], "data": [' + \
        b"1," * 4_500_000 + b"1]}]}"
    assert len(body) > 8 << 20
    with connect(srv.http) as s:
        sender = Sender(s, request("POST", "/v2/models/identity/infer", body))
        reader = Reader(s)
        refused(reader.one(), 413, "too_large", "send tensors as binary data")
        then_closed(reader)
        sender.join(10)
    header = b'{"inputs": [' + b" " * (9 << 20) + b"]}"  # a JSON header over the limit, in binary form
    with connect(srv.http) as s:
        sender = Sender(s, request("POST", "/v2/models/identity/infer", header + b"abcd",
                                   {"Inference-Header-Content-Length": str(len(header))}))
        refused(Reader(s).one(), 413, "too_large", "the JSON header")
        sender.join(10)


# -- every field and parameter of an infer request ------------------------------------------------

def with_input(**changes) -> dict:
    """An identity request whose one input has ``changes``."""
    return {"inputs": [tensor() | {"data": [1, 2, 3, 4]} | changes]}


@pytest.mark.parametrize("body, words", [
    (json_body() | {"outputs": [{"name": "y"}, {"name": "y"}]}, ["output 'y' already exists in request"]),
    ({"inputs": [tensor() | {"data": [1, 2, 3, 4]}, tensor() | {"data": [1, 2, 3, 4]}]}, ["'x' appears twice"]),
    (json_body() | {"unknown": 1}, ["unknown field 'unknown'"]),
    (json_body() | {"sequence": 1}, ["unknown field"]),
    (json_body() | {"parameters": {"binary_data": True}}, ["unknown parameter 'binary_data'"]),
    (json_body() | {"parameters": {"sequence_id": 7}}, ["sequence_id", "no sequence batching"]),
    (json_body() | {"parameters": {"sequence_start": True}}, ["sequence_start"]),
    (json_body() | {"parameters": {"priority": -2}}, ["'priority'"]),
    (json_body() | {"parameters": {"priority": "2"}}, ["'priority'"]),
    (json_body() | {"parameters": {"timeout": -1}}, ["'timeout'"]),
    (json_body() | {"parameters": {"timeout": 86400 * 10**6 + 1}}, ["'timeout'"]),
    (json_body() | {"parameters": {"timeout": "10"}}, ["'timeout'"]),
    (json_body() | {"parameters": {"timeout": 1.5}}, ["'timeout'"]),
    (json_body() | {"parameters": {"binary_data_output": "yes"}}, ["binary_data_output"]),
    (json_body() | {"parameters": {"routing_key": ""}}, ["routing_key"]),
    (json_body() | {"parameters": []}, ["'parameters' must be an object"]),
    (json_body() | {"id": 5}, ["'id'"]),
    (json_body() | {"id": "i" * 300}, ["'id'"]),
    (json_body() | {"outputs": {"name": "y"}}, ["'outputs'"]),
    (json_body() | {"outputs": [{"name": "y", "parameters": {"colour": 1}}]}, ["unknown parameter 'colour'"]),
    (json_body() | {"outputs": [{"name": "y", "parameters": {"classification": "3"}}]}, ["classification"]),
    (json_body() | {"outputs": [{"name": "y", "parameters": {"binary_data": 1}}]}, ["binary_data"]),
    (json_body() | {"outputs": [{"name": "y", "shape": [4]}]}, ["unknown field 'shape'"]),
    (json_body() | {"outputs": [{"name": "z"}]}, ["unexpected inference output 'z' for model 'identity'"]),
    (json_body() | {"outputs": [{}]}, ["'name'"]),
    (with_input(parameters={"scale": 2}), ["unknown parameter 'scale'"]),
    (with_input(parameters={"binary_data_size": 4}), ["exactly one of"]),
    (with_input(contents={"int_contents": [1]}), ["unknown field 'contents'"]),
    (with_input(name=""), ["'name'"]),
    (with_input(name=7), ["'name'"]),
    ({"inputs": []}, ["'inputs' must be a non-empty list"]),
    ({"inputs": {"x": 1}}, ["'inputs'"]),
    ({"inputs": [tensor() | {"data": [1, 2, 3, 4]}] * 17}, ["at most 16"]),
    ({"inputs": ["x"]}, ["inputs[0] must be an object"]),
    ({}, ["'inputs'"]),
])
def test_each_field_and_parameter_is_checked(srv, body, words):
    refused(one(srv.http, json_infer("identity", body)), 400, "bad_input", *words)


def test_the_optional_fields_and_parameters_that_are_taken(srv):
    body = json_body() | {"id": "req-7", "model_name": "identity", "model_version": "1", "parameters": {
        "timeout": 5_000_000, "routing_key": "k1", "binary_data_output": False, "sequence_id": 0, "priority": 0,
        "sequence_start": False}, "outputs": [{"name": "y", "parameters": {"binary_data": False}}]}
    r = one(srv.http, json_infer("identity", body))
    answered_identity(r, bytes((1, 2, 3, 4)))
    assert r.json()["id"] == "req-7" and r.json()["model_version"] == "1"
    binary_out = json_body() | {"outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
    answered_identity(one(srv.http, json_infer("identity", binary_out)), bytes((1, 2, 3, 4)))
    r = one(srv.http, json_infer("two_inputs", {"inputs": [tensor("a", "INT32", (2,)) | {"data": [1, 2]}]}))
    assert r.status == 400 and r.code in ("bad_input",) and "'b'" in r.error, r  # a missing input


@pytest.mark.parametrize("path, status, code", [
    ("/v2/models/no_such_model/infer", 400, "unknown_model"),  # Triton's status
    ("/v2/models/identity/versions/7/infer", 404, "unknown_model"),
    ("/v2/models/identity/versions/x/infer", 404, "unknown_model"),
    ("/v2/models/identity/versions/99999999999999999999/infer", 404, "unknown_model"),
    ("/v2/models/%ff/infer", 400, "bad_frame"),
    ("/v2/models/%00/infer", 400, "bad_frame"),
])
def test_unknown_models_versions_and_undecodable_names(srv, path, status, code):
    refused(one(srv.http, request("POST", path, json.dumps(json_body()).encode())), status, code)


def test_percent_encoded_names_and_versions_are_decoded(srv):
    body = json.dumps(json_body()).encode()
    for path in ("/v2/models/ident%69ty/infer", "/v2/models/identity/versions/1/infer",
                 "/v2/models/identity/versions//infer", "/v2/models/identity/infer/", "/v2/models/identity/infer?a=b"):
        answered_identity(one(srv.http, request("POST", path, body)), bytes((1, 2, 3, 4)))
    r = one(srv.http, request("GET", "/v2/models/ident%69ty/versions/%31"))
    assert r.status == 200 and r.json()["name"] == "identity", r


# -- routes and methods ----------------------------------------------------------------------------

@pytest.mark.parametrize("method, path", [("GET", "/"), ("GET", "/v2/nope"), ("GET", "/v3"), ("POST", "/v2/models"),
                                          ("GET", "/v2/models/a/b/c"), ("GET", "/v2//health/live")])
def test_unknown_paths_are_404(srv, method, path):
    refused(one(srv.http, request(method, path)), 404, "not_found", "no v2 route")


@pytest.mark.parametrize("method, path, allow", [
    ("GET", "/v2/models/identity/infer", "POST"), ("POST", "/v2/health/live", "GET"), ("PUT", "/v2", "GET"),
    ("DELETE", "/v2/models/identity", "GET"), ("GET", "/v2/repository/index", "POST"),
    ("POST", "/v2/systemsharedmemory/status", "GET"), ("PATCH", "/v2/models/identity/infer", "POST")])
def test_the_wrong_method_is_405_with_an_allow_header(srv, method, path, allow):
    r = one(srv.http, request(method, path))
    refused(r, 405, "bad_frame", f"{method} is not allowed")
    assert r.headers["allow"] == allow


def test_a_head_request_is_answered_without_a_body(srv):
    """HEAD is on no route: 405, and no body after the head (HTTP forbids one), so the next answer
    on the connection starts right after it."""
    for path in ("/v2/health/live", "/v2/models/identity", "/v2/models/identity/infer", "/nope"):
        with connect(srv.http) as s:
            s.sendall(request("HEAD", path) + request("GET", "/v2/health/live", headers={"Connection": "close"}))
            data = b""
            while chunk := s.recv(1 << 16):
                data += chunk
        first, _, rest = data.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 405 " if path != "/nope" else b"HTTP/1.1 404 "), data
        assert rest.startswith(b"HTTP/1.1 200 OK\r\n"), data


def test_a_method_that_is_not_a_token_is_refused_and_closed(srv):
    with connect(srv.http) as s:
        s.sendall(b"G(T /v2/health/live HTTP/1.1\r\n\r\n")
        reader = Reader(s)
        refused(reader.one(), 400, "bad_frame", "malformed HTTP request")
        then_closed(reader)


# -- encodings ---------------------------------------------------------------------------------------

def chunked(body: bytes, pieces: int = 3) -> bytes:
    step = max(1, len(body) // pieces)
    parts = [body[i:i + step] for i in range(0, len(body), step)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def test_chunked_bodies_json_binary_and_raw(srv):
    te = {"Transfer-Encoding": "chunked"}
    body = json.dumps(json_body()).encode()
    r = one(srv.http, request("POST", "/v2/models/identity/infer", chunked(body), te))
    answered_identity(r, bytes((1, 2, 3, 4)))
    x = bytes(range(100))
    text = json.dumps(binary_header(len(x))).encode()
    r = one(srv.http, request("POST", "/v2/models/identity/infer", chunked(text + x, 7),
                              te | {"Inference-Header-Content-Length": str(len(text))}))
    answered_identity(r, x)
    r = one(srv.http, request("POST", "/v2/models/identity/infer", chunked(x),
                              te | {"Inference-Header-Content-Length": "0"}))
    answered_identity(r, x)
    r = one(srv.http, request("POST", "/v2/models/identity/infer", chunked(text[:10]),
                              te | {"Inference-Header-Content-Length": str(len(text))}))
    refused(r, 400, "bad_frame", "is more than the 10-byte body")
    with connect(srv.http) as s:
        s.sendall(request("POST", "/v2/models/identity/infer", b"zz\r\nabc\r\n0\r\n\r\n", te))
        reader = Reader(s)
        refused(reader.one(), 400, "bad_frame", "malformed HTTP request")
        then_closed(reader)


@pytest.mark.parametrize("coding", ["gzip, chunked", "deflate,chunked", "identity, chunked"])
def test_a_transfer_coding_other_than_chunked_alone_is_answered_501_never_ignored(srv, coding):
    """h11's rule: only ``Transfer-Encoding: chunked``.  ``gzip, chunked`` (its gzip coding would be
    silently dropped) is 501 with the stable code, and the connection is closed; other clients are
    served on."""
    body = gzip.compress(json.dumps(json_body()).encode())
    with connect(srv.http) as s:
        s.sendall(request("POST", "/v2/models/identity/infer", chunked(body), {"Transfer-Encoding": coding}))
        reader = Reader(s)
        refused(reader.one(), 501, "bad_frame", "is not supported (only 'chunked'")
        then_closed(reader)
    answered_identity(one(srv.http, json_infer("identity", json_body())), bytes((1, 2, 3, 4)))


def gzip_bomb(inflated: int) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1 << 20)
    return b"".join([z.compress(block) for _ in range(inflated >> 20)] + [z.flush()])


def test_gzip_and_deflate_bodies_work_and_a_gzip_bomb_is_refused(srv):
    body = json.dumps(json_body()).encode()
    for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)),
                             ("GZIP", gzip.compress(body))):
        r = one(srv.http, request("POST", "/v2/models/identity/infer", packed, {"Content-Encoding": encoding}))
        answered_identity(r, bytes((1, 2, 3, 4)))
    x = bytes(range(256)) * 3
    text = json.dumps(binary_header(len(x))).encode()
    r = one(srv.http, request("POST", "/v2/models/identity/infer", gzip.compress(text + x),
                              {"Content-Encoding": "gzip", "Inference-Header-Content-Length": str(len(text))}))
    answered_identity(r, x)
    bomb = gzip_bomb(MAX_BODY + (8 << 20))
    assert len(bomb) < 1 << 20
    for headers in ({}, {"Inference-Header-Content-Length": "100"}):
        with connect(srv.http) as s:
            s.sendall(request("POST", "/v2/models/identity/infer", bomb, {"Content-Encoding": "gzip", **headers}))
            reader = Reader(s)
            refused(reader.one(), 413, "too_large", "inflates to more than")
            keeps_serving(s, reader)
    for encoding, packed in (("gzip", b"not gzip"), ("gzip", gzip.compress(body)[:-9]), ("br", body),
                             ("gzip, gzip", gzip.compress(gzip.compress(body)))):
        r = one(srv.http, request("POST", "/v2/models/identity/infer", packed, {"Content-Encoding": encoding}))
        assert r.status == 400 and r.code == "bad_frame", (encoding, r)


# -- pipelining, splitting, streaming ---------------------------------------------------------------

def test_pipelined_requests_are_answered_in_order(srv):
    slow = {"inputs": [tensor(datatype="FP32", shape=(2,)) | {"data": [0.3, 1.0]}]}
    x = bytes(range(50))
    data = (json_infer("slow", slow) + request("GET", "/v2/health/live")
            + binary_infer("identity", binary_header(50), x) + request("GET", "/v2/models/nope")
            + json_infer("identity", json_body((9, 8))))
    with connect(srv.http) as s:
        s.sendall(data)
        answers = Reader(s).read(5)
    assert answers[0].status == 200 and answers[0].json()["outputs"][0]["data"] == pytest.approx([0.6, 2.0])
    assert answers[1].status == 200 and answers[1].body == b""
    answered_identity(answers[2], x)
    refused(answers[3], 400, "unknown_model")
    answered_identity(answers[4], bytes((9, 8)))


def test_garbage_pipelined_behind_a_request_is_refused_and_the_connection_closed(srv):
    """The request before it in the same read may go unanswered (the close tells the client to
    send it again, as with any pipelined request); the garbage is answered 400 and nothing after."""
    slow = json_infer("slow", {"inputs": [tensor(datatype="FP32", shape=(1,)) | {"data": [0.3]}]})
    with connect(srv.http) as s:
        s.sendall(slow + b"NOT HTTP AT ALL\r\n\r\n" + request("GET", "/v2/health/live"))
        reader = Reader(s)
        then_closed(reader)
    *before, last = reader.done
    refused(last, 400, "bad_frame", "malformed HTTP request")
    assert len(before) <= 1 and all(r.status == 200 and r.json()["outputs"][0]["data"] == pytest.approx([0.6])
                                    for r in before), before


def test_more_pipelined_requests_than_a_connection_holds_are_refused_503_in_order(srv):
    with connect(srv.http) as s:
        s.sendall(request("GET", "/v2/health/live") * 40)
        reader = Reader(s)
        reader.closes()
        answers = reader.done
    assert answers and all(a.status == 200 for a in answers[:-1]), answers
    refused(answers[-1], 503, "overloaded", "pipelined")


@pytest.mark.parametrize("form", ["binary", "raw", "json"])
def test_a_request_split_at_every_byte_boundary_is_answered(srv, form):
    """Two writes, cut at each offset: the head or the JSON header cut anywhere, or the tensors
    still coming once the header is in (streamed straight into the arena)."""
    x = bytes(range(7, 47))
    if form == "binary":
        data = binary_infer("identity", binary_header(len(x)), x)
    elif form == "raw":
        data = request("POST", "/v2/models/identity/infer", x, {"Inference-Header-Content-Length": "0"})
    else:
        data = json_infer("identity", json_body(tuple(x)))
    with connect(srv.http) as s:
        reader = Reader(s)
        for cut in range(len(data) + 1):
            s.sendall(data[:cut])
            time.sleep(0.001)  # the server reads the first part on its own
            s.sendall(data[cut:])
            r = reader.one()
            assert r.status == 200, (cut, r)
            answered_identity(r, x)


def test_a_large_binary_request_in_random_pieces_streams_into_the_arena(srv):
    seed = random.SystemRandom().randrange(2**32)
    print(f"v2 http random pieces seed={seed}")
    rng = random.Random(seed)
    with connect(srv.http) as s:
        reader = Reader(s)
        for round_ in range(3):
            x = rng.randbytes(2 << 20)
            small = bytes(rng.randrange(1, 200) for _ in range(rng.randrange(1, 30)))
            data = binary_infer("identity", binary_header(len(x)), x)
            follow = binary_infer("identity", binary_header(len(small)), small)  # pipelined behind it
            data += follow if round_ else b""
            pos, sends = 0, 0
            while pos < len(data):
                n = rng.choice((1, rng.randrange(1, 4096), rng.randrange(1, 300_000)))
                s.sendall(data[pos:pos + n])
                pos, sends = pos + n, sends + 1
                if sends % 16 == 0:
                    time.sleep(0.001)
            r = reader.one()
            assert r.status == 200 and r.binary == x, f"seed {seed} round {round_}: {r}"
            if round_:
                answered_identity(reader.one(), small)


# -- clients that never read, or vanish ----------------------------------------------------------------

def big_request() -> bytes:
    x = np.ones(4096, np.float32)
    header = {"inputs": [tensor(datatype="FP32", shape=(4096,), binary_data_size=x.nbytes)],
              "parameters": {"binary_data_output": True}}
    return binary_infer("big", header, x.tobytes())


def test_a_client_that_never_reads_its_16_mib_answer_is_closed_at_the_stall_deadline(srv):
    mark = len(srv.log())
    s = connect(srv.http, rcvbuf=4096)
    try:
        s.sendall(big_request())
        wait_for(lambda: "its answer went unread" in srv.log()[mark:], "the stall deadline", timeout=20)
        srv.wait_idle()
        got = 0
        try:
            while chunk := s.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        assert got < BIG_OUT
    finally:
        s.close()


def test_a_client_that_reads_its_16_mib_answer_slowly_but_steadily_gets_it_all(srv):
    with connect(srv.http) as s:
        s.sendall(big_request())
        reader = Reader(s)
        time.sleep(DEADLINE_S / 3)
        r = reader.one()
        assert r.status == 200 and len(r.binary) == BIG_OUT and not any(r.binary), r.status


def test_a_client_that_disconnects_mid_answer_or_mid_request_leaks_nothing(srv):
    for read in (0, 1, 64 * 1024, 4 << 20):
        s = connect(srv.http)
        s.sendall(big_request())
        got = 0
        while got < read:
            chunk = s.recv(min(1 << 20, read - got))
            assert chunk, "closed before the answer was all sent"
            got += len(chunk)
        s.close()
        srv.wait_idle()
    slow = json_infer("slow", {"inputs": [tensor(datatype="FP32", shape=(1,)) | {"data": [0.4]}]})
    for _ in range(3):  # gone while the model runs
        s = connect(srv.http)
        s.sendall(slow)
        wait_for(lambda: srv.info()["stats"]["slots_in_use"] >= 1, "the request to run")
        s.close()
    srv.wait_idle()
    s = connect(srv.http)
    s.sendall(slow + request("GET", "/v2/health/live") * 3)  # gone with requests queued behind
    s.close()
    srv.wait_idle()


# -- HTTP/1.0, Connection: close, Expect -------------------------------------------------------------

def test_http_1_0_is_answered_and_closed(srv):
    for data in (b"GET /v2/health/live HTTP/1.0\r\n\r\n",
                 request("POST", "/v2/models/identity/infer", json.dumps(json_body()).encode(), version="1.0")):
        with connect(srv.http) as s:
            s.sendall(data)
            reader = Reader(s)
            r = reader.one()
            assert r.status == 200 and r.headers.get("connection") == "close", r
            then_closed(reader)


def test_connection_close_is_answered_then_closed_and_what_follows_is_not_read(srv):
    with connect(srv.http) as s:
        s.sendall(json_infer("identity", json_body(), {"Connection": "close"}) + request("GET", "/v2/health/live"))
        reader = Reader(s)
        r = reader.one()
        answered_identity(r, bytes((1, 2, 3, 4)))
        assert r.headers["connection"] == "close"
        then_closed(reader)
        assert not reader.done, "answered a request sent after Connection: close"
    with connect(srv.http) as s:  # keep-alive is the HTTP/1.1 default: several on one connection
        reader = Reader(s)
        for _ in range(3):
            s.sendall(request("GET", "/v2/health/ready"))
            r = reader.one()
            assert r.status == 200 and "connection" not in r.headers


def test_what_follows_a_closing_request_is_not_read_even_when_it_comes_later(srv):
    """The door reads on while it serves; a request sent after one that closes (an HTTP/1.0 call of
    the slow model here), arriving while that one is being served, is never read nor answered: the
    one answer carries Connection: close and then the connection closes (found by the fuzz run)."""
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [0.5]}]}).encode()
    with connect(srv.http) as s:
        s.sendall(request("POST", "/v2/models/slow/infer", body, version="1.0"))
        time.sleep(0.2)  # the slow request (0.5 s) is being served
        s.sendall(json_infer("identity", json_body()))
        reader = Reader(s)
        r = reader.one()
        assert r.status == 200 and r.headers.get("connection") == "close", r
        then_closed(reader)
        assert not reader.done, "answered a request sent after a closing one"


def test_a_streamed_binary_request_that_closes_ends_the_connection_too(srv):
    """A binary infer request whose tensors stream straight into the arena (its header first, the
    rest later) with Connection: close, and another request right behind its body: one answer,
    with Connection: close, then the connection closes; the second is never read (found by the fuzz
    run: the streamed path started a fresh parser and forgot that the request closes)."""
    x = bytes(range(40))
    whole = binary_infer("identity", binary_header(len(x)), x, {"Connection": "close"})
    with connect(srv.http) as s:
        s.sendall(whole[:-len(x)])
        time.sleep(0.2)  # the header is in: the door streams the body
        s.sendall(whole[-len(x):] + request("GET", "/v2/health/live"))
        reader = Reader(s)
        r = reader.one()
        answered_identity(r, x)
        assert r.headers.get("connection") == "close", r
        then_closed(reader)
        assert not reader.done, "answered a request sent after a closing one"


def test_garbage_behind_a_request_being_served_is_answered_after_it_and_only_that_answer_closes(srv):
    """Bytes that are not HTTP arrive while the request before them is served: its answer comes
    first, without Connection: close, then the 400 that closes (found by the fuzz run: the first
    answer said close and another followed it)."""
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [0.5]}]}).encode()
    with connect(srv.http) as s:
        s.sendall(request("POST", "/v2/models/slow/infer", body))
        time.sleep(0.2)  # the slow request (0.5 s) is being served
        s.sendall(b"\x11\x12 not http\r\n\r\n")
        reader = Reader(s)
        first, second = reader.read(2)
        assert first.status == 200 and "connection" not in first.headers, first
        assert second.status == 400 and second.headers.get("connection") == "close", second
        then_closed(reader)


def test_expect_100_continue(srv):
    body = json.dumps(json_body()).encode()
    head = request("POST", "/v2/models/identity/infer", b"",
                   {"Content-Length": str(len(body)), "Expect": "100-continue"})
    with connect(srv.http) as s:
        s.sendall(head)
        reader = Reader(s)
        assert reader.read(1, interim=True)[0].status == 100
        s.sendall(body)
        answered_identity(reader.one(), bytes((1, 2, 3, 4)))
    x = bytes(range(30))
    whole = binary_infer("identity", binary_header(len(x)), x, {"Expect": "100-continue"})
    with connect(srv.http) as s:
        s.sendall(whole[:-len(x)])
        reader = Reader(s)
        assert reader.read(1, interim=True)[0].status == 100
        s.sendall(whole[-len(x):])
        answered_identity(reader.one(), x)
    too_big = request("POST", "/v2/models/identity/infer", b"", {"Content-Length": str(MAX_BODY + 1),
                                                                  "Expect": "100-continue"})
    with connect(srv.http) as s:  # refused at once: no 100 first
        s.sendall(too_big)
        refused(Reader(s).read(1, interim=True)[0], 413, "too_large")


# -- connection limits and shutdown (servers of their own) -------------------------------------------

SMALL = python_model("identity", "shmserve.models:identity") + python_model("slow", "serving_models:slow")


@contextlib.contextmanager
def unix_http(tmp_path, **options):
    """A v2 server whose HTTP door is a Unix socket in a fresh 0755 directory (mode 0660, group
    ``group`` if given, so another user's processes can reach it): callers are who SO_PEERCRED says."""
    group = options.pop("group", None)
    sockdir = Path(tempfile.mkdtemp(prefix="shmserve-v2http-"))
    os.chmod(sockdir, 0o755)
    extra = options.pop("extra", "") + (f'socket_mode = 0o660\nsocket_group = "{group}"\n' if group else "")
    try:
        with v2_serving(tmp_path, http=str(sockdir / "http.sock"), extra=extra, **options) as srv:
            yield srv
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def test_connections_over_the_per_uid_limit_are_refused_503_and_closed(tmp_path):
    """On a Unix socket a connection has an owner (SO_PEERCRED): past max_connections_per_uid its
    next one is refused 503 and closed before it sends anything; a place freed lets one in."""
    with unix_http(tmp_path, models=SMALL, extra="max_connections_per_uid = 3\n") as small:
        held = [connect(small.http) for _ in range(3)]
        try:
            readers = [Reader(s) for s in held]
            for s, reader in zip(held, readers):  # let in, counted, kept open
                s.sendall(request("GET", "/v2/health/live"))
                assert reader.one().status == 200
            for _ in range(2):
                with connect(small.http) as s:  # sends nothing: the refusal is written at once
                    reader = Reader(s)
                    refused(reader.one(), 503, "overloaded", f"uid {os.getuid()} has 3 HTTP connections",
                            "max_connections_per_uid")
                    then_closed(reader)
            held.pop().close()

            def let_in() -> bool:
                with connect(small.http) as s:
                    reader = Reader(s)
                    s.settimeout(0.5)
                    try:  # refused: the 503 comes unasked; let in: nothing until it asks
                        return reader.one().status != 503
                    except socket.timeout:
                        return True

            wait_for(let_in, "the closed connection's place to free up")
        finally:
            for s in held:
                s.close()
        still_serving(small)


def test_tcp_connections_over_the_doors_limit_are_refused_503_and_closed(tmp_path):
    """On TCP a connection has no owner the kernel vouches for: max_connections bounds the door."""
    with v2_serving(tmp_path, models=SMALL, extra="max_connections = 3\n") as small:
        held = [connect(small.http) for _ in range(3)]
        try:
            for s in held:
                s.sendall(request("GET", "/v2/health/live"))
                assert Reader(s).one().status == 200
            with connect(small.http) as s:
                reader = Reader(s)
                refused(reader.one(), 503, "overloaded", "the HTTP door has 3 connections open", "max_connections")
                then_closed(reader)
        finally:
            for s in held:
                s.close()
        still_serving(small)


def test_a_uid_not_on_the_allow_list_is_refused_403_before_it_sends_anything(tmp_path):
    from helpers.other_user import as_nobody, nobody_group

    group = nobody_group()  # skips unless root on a machine with nobody
    with unix_http(tmp_path, models=SMALL, group=group) as small:
        def as_nobody_client() -> str:
            with connect(small.http) as s:
                reader = Reader(s)
                r = reader.one()
                return json.dumps([r.status, r.code, r.error, reader.closes()])

        answer = as_nobody(as_nobody_client)
        status, code, error, closed = json.loads(answer) if answer.startswith("[") else pytest.fail(answer)
        assert (status, code, closed) == (403, "permission_denied", True) and "uid 65534 is not allowed" in error
        still_serving(small)


def test_shutdown_answers_the_request_being_served_with_connection_close_and_closes_the_rest(tmp_path):
    with v2_serving(tmp_path, models=SMALL) as small:
        busy, idle, half = connect(small.http), connect(small.http), connect(small.http)
        idle.sendall(request("GET", "/v2/health/live"))
        idle_reader = Reader(idle)
        assert idle_reader.one().status == 200
        busy.sendall(json_infer("slow", {"inputs": [tensor(datatype="FP32", shape=(1,)) | {"data": [0.8]}]}))
        half.sendall(b"GET /v2/health/live HTTP/1.1\r\nHo")
        wait_for(lambda: small.info()["stats"]["slots_in_use"] == 1, "the slow request to run")
        small.proc.send_signal(signal.SIGTERM)
        busy_reader = Reader(busy)
        r = busy_reader.one()
        assert r.status == 200 and r.json()["outputs"][0]["data"] == [1.6] and r.headers["connection"] == "close"
        for reader in (busy_reader, idle_reader, Reader(half)):
            then_closed(reader)
            assert not reader.done
        assert small.proc.wait(30) == 0
        for s in (busy, idle, half):
            s.close()


def test_an_allowed_uid_that_is_no_admin_may_infer_but_not_touch_the_repository(tmp_path):
    """``allow_uids`` lets nobody in over the Unix socket; only admins (the server's uid, root,
    ``admin_uids``) may index, load or unload models: 403 naming the keys, and the model keeps
    serving.  Over gRPC's TCP door nobody is anonymous: PERMISSION_DENIED too."""
    import grpc  # imported here: the child that drops to nobody cannot read the interpreter's files
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    from helpers.other_user import NOBODY, as_nobody, nobody_group

    group = nobody_group()  # skips unless root on a machine with nobody
    with unix_http(tmp_path, models=SMALL, group=group, extra=f"allow_uids = [{NOBODY}]\n") as small:
        def as_nobody_client() -> str:
            answers = []
            with connect(small.http) as s:
                reader = Reader(s)
                for path in ("/v2/repository/index", "/v2/repository/models/identity/load",
                             "/v2/repository/models/identity/unload"):
                    s.sendall(request("POST", path, b"{}"))
                    r = reader.one()
                    answers.append([r.status, r.code, r.error])
                    if r.headers.get("connection") == "close":
                        break
            with connect(small.http) as s:
                s.sendall(request("GET", "/v2/models/identity/ready"))
                answers.append([Reader(s).one().status, None, None])
            with grpc.insecure_channel(small.grpc) as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                for call in (lambda: stub.RepositoryIndex(pb.RepositoryIndexRequest()),
                             lambda: stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="identity"))):
                    try:
                        call()
                        answers.append(["ok", None, None])
                    except grpc.RpcError as e:
                        answers.append([e.code().name, None, e.details()])
            return json.dumps(answers)

        raw = as_nobody(as_nobody_client)
        assert raw.startswith("["), raw
        answers = json.loads(raw)
        http_answers, ready, grpc_answers = answers[:-3], answers[-3], answers[-2:]
        for status, code, error in http_answers:
            assert (status, code) == (403, "permission_denied") and "admin_uids" in error, (status, code, error)
        assert ready[0] == 200  # still loaded, and nobody may ask
        for status, _, details in grpc_answers:
            assert status == "PERMISSION_DENIED" and "permission_denied" in details, (status, details)
        still_serving(small)
