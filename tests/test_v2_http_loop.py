"""The HTTP door does not hold the event loop (issue 23, finding 8), against a real server.

- While a big body is decoded (a gzip bomb inflating to 40 MB, 7 MB of JSON tensor data), the
  native socket is served: requests sent once the server has read the whole big body (its socket's
  receive queue, in /proc/net/tcp, is empty) are answered before the big one is.  Before, the loop
  decoded the body in the callback that read it, so its answer always came first.  No duration is
  measured: only the order of the answers.
- A large JSON answer that its client does not read holds one piece of its text in the server, not
  the whole text (counted by the server's anonymous memory, /proc/<pid>/status, once the answer's
  head has arrived), and it is all there, right, when the client does read.
"""

from __future__ import annotations

import gzip
import json
import os
import select
import socket

import numpy as np
import pytest

from helpers import raw_http
from helpers.server import wait_for
from helpers.v2_server import BIG_OUT, server_fixture, still_serving

srv = server_fixture("v2loop", deadlines=60)  # a client that reads slowly on a busy machine is not cut off

NATIVE_BEFORE = 3  # native answers that must come before the big request's


def server_rx_queue(server: str, client: socket.socket) -> int | None:
    """The bytes waiting in the server's end of ``client``'s connection (its receive queue, from
    /proc/net/tcp or tcp6), None if that socket is not listed."""
    host, port = raw_http.address(server)
    local_port = client.getsockname()[1]
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and int(fields[2].rsplit(":", 1)[1], 16) == local_port:
                    return int(fields[4].split(":")[1], 16)
    return None


def gzip_bomb_request() -> bytes:
    """A binary infer of 40 MB of zeros for a model that does not exist, gzip: 40 KB on the wire."""
    size = 40 << 20
    header = json.dumps({"inputs": [{"name": "x", "datatype": "UINT8", "shape": [size],
                                     "parameters": {"binary_data_size": size}}]}).encode()
    z = gzip.compress(header + bytes(size), compresslevel=1)
    return raw_http.request("POST", "/v2/models/no_such_model/infer", z,
                            {"Content-Encoding": "gzip", "Inference-Header-Content-Length": str(len(header))})


def huge_json_request() -> bytes:
    """7 MB of JSON tensor data for a model that does not exist, gzip."""
    x = np.random.default_rng(8).random(700_000).round(6).tolist()
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(x)], "data": x}]}).encode()
    return raw_http.request("POST", "/v2/models/no_such_model/infer", gzip.compress(body, compresslevel=1),
                            {"Content-Encoding": "gzip", "Content-Type": "application/json"})


@pytest.mark.parametrize("make", [gzip_bomb_request, huge_json_request], ids=["gzip bomb", "huge JSON"])
def test_the_native_socket_is_served_while_a_big_body_is_decoded(srv, make):
    """The big request is sent whole; once the server has read all of it, native requests are sent
    one after the other: at least three are answered before the big request's answer (404: no such
    model, once its body is decoded) has arrived.  The big one is answered all the same."""
    data = make()
    x = np.arange(64, dtype=np.uint8)
    with srv.client(lanes=False) as native, raw_http.connect(srv.http, timeout=120) as big:
        native.infer("identity", {"x": x})  # connected and warm
        big.sendall(data)
        wait_for(lambda: server_rx_queue(srv.http, big) == 0, "the server to read the whole big body", timeout=60)
        answered = 0
        while answered < NATIVE_BEFORE and not select.select([big], [], [], 0)[0]:
            assert np.array_equal(native.infer("identity", {"x": x})["y"], x)
            answered += 1
        assert answered == NATIVE_BEFORE, f"only {answered} native answers came before the big request's"
        r = raw_http.Reader(big).one()
    assert r.status == 400 and r.code == "unknown_model", r  # Triton's status for an unknown model
    still_serving(srv)


def anon_rss(pid: int) -> int:
    """The process's anonymous resident bytes (its heap: not the arena, which is shared memory)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/<pid>/status")


def test_a_large_json_answer_nobody_reads_holds_a_piece_of_its_text_not_all_of_it(srv):
    """``big`` answers 4096 float32s with 4.1 M of them (16 MB in the arena; about 16 MB of JSON
    text, "0.0" each).  Its client reads only the head of the answer at first: by then the whole
    text used to be made and queued in the transport; now the server holds less than a quarter of
    it.  Then the client reads it all: the JSON is whole and right."""
    x = np.ones(4096, np.float32)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [4096], "data": x.tolist()}]}
    pid = srv.proc.pid
    still_serving(srv)
    before = anon_rss(pid)
    with raw_http.connect(srv.http, timeout=120, rcvbuf=64 * 1024) as s:
        s.sendall(raw_http.json_infer("big", body))
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(1)
            assert chunk, "the server closed the connection"
            head += chunk
        status, *lines = head.decode("latin-1").split("\r\n")
        assert status.startswith("HTTP/1.1 200"), head
        length = int(next(line.split(":")[1] for line in lines if line.lower().startswith("content-length")))
        held = anon_rss(pid) - before
        assert length > BIG_OUT // 2, length
        assert held < length // 4, f"the server holds {held} bytes of a {length}-byte answer nobody reads"
        rest = bytearray()
        while len(rest) < length:
            chunk = s.recv(1 << 20)
            assert chunk, "the server closed the connection before the whole answer"
            rest += chunk
    answer = json.loads(bytes(rest))
    [out] = answer["outputs"]
    assert out["shape"] == [4096 * 1000] and len(out["data"]) == 4096 * 1000 and not any(out["data"])
    wait_for(lambda: srv.info()["stats"]["slots_in_use"] == 0, "its slot to be released")
    still_serving(srv)
    assert os.path.exists(f"/proc/{pid}")


def test_a_large_json_answer_is_finished_before_garbage_sent_behind_it_is_refused(srv):
    """Garbage arrives while a large JSON answer is on its way: the answer is sent whole, then the
    garbage is answered 400 and the connection closed."""
    x = np.ones(1024, np.float32)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1024], "data": x.tolist()}]}
    with raw_http.connect(srv.http, timeout=120, rcvbuf=64 * 1024) as s:
        s.sendall(raw_http.json_infer("big", body))
        assert s.recv(12) == b"HTTP/1.1 200"  # the answer is on its way
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reader = raw_http.Reader(s)
        reader.parser.feed_data(b"HTTP/1.1 200")
        first, second = reader.read(2)
        assert reader.closes()
    assert len(json.loads(bytes(first.body))["outputs"][0]["data"]) == 1024 * 1000
    assert second.status == 400 and second.code == "bad_frame", second
    still_serving(srv)
