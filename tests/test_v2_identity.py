"""Issue 23's findings 1, 2, 3 and 7 attacked through a real server: identity on the v2 doors is
only what the kernel vouches for (a Unix socket's SO_PEERCRED) or a token the operator issued, and
nothing is held for a caller before it is known and within its limits.

1. A TCP caller is anonymous however it connects: one that queues idle connections, connects,
   pipelines control requests and closes at once (its socket in FIN_WAIT2/TIME_WAIT, listed in
   /proc/net/tcp with uid 0) unloads nothing and registers nothing.
2. gRPC identity is per call, from its metadata: a call without a token on the very connection an
   admin's call just used is anonymous.
3. gRPC holds bounded memory for messages that never finish: 40 unfinished 15 MiB messages on one
   connection add little, and another caller is served meanwhile.
7. gRPC connections are capped; the native socket and the HTTP door keep accepting.
Also: HTTP request bodies count against their caller's ``max_buffered_bytes_per_uid``; the
descriptor budget and the token file are checked at start; a reload applies new tokens.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")
import grpc  # noqa: E402
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

from helpers import raw_http  # noqa: E402
from helpers.h2_peer import Flood, hello  # noqa: E402
from helpers.raw_http import Reader, connect, json_infer, one, request  # noqa: E402
from helpers.server import wait_for  # noqa: E402
from helpers.v2_server import (MAX_REQUEST_BYTES, TOKENS, auth, grpc_stub, open_fds, python_model, server_fixture,  # noqa: E402
                               shm_objects, still_serving, v2_serving)

MODELS = python_model("identity", "shmserve.models:identity") + python_model("slow", "serving_models:slow")
srv = server_fixture("v2identity", models=MODELS)


def grpc_infer_request(n: int = 4) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="identity")
    msg.inputs.add(name="x", datatype="UINT8", shape=[n])
    msg.raw_input_contents.append(bytes(range(n)))
    return msg


def model_loaded(srv, name: str = "identity") -> bool:
    with srv.client() as c:
        return any(m["name"] == name and m.get("state") == "ready" for m in c.models())


def grpc_code(call) -> str:
    try:
        call()
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


# -- 1: a TCP caller is anonymous however it connects ------------------------------------------------------

def test_a_tcp_caller_without_a_token_may_infer_and_read_metadata_but_nothing_more(srv):
    with shm_objects() as make:
        key = make(64)
        with connect(srv.http) as s:
            reader = Reader(s)
            for method, path, status in (("GET", "/v2/health/live", 200), ("GET", "/v2/models/identity", 200),
                                         ("GET", "/v2/models/identity/ready", 200)):
                s.sendall(request(method, path))
                assert reader.one().status == status, path
            s.sendall(json_infer("identity", {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [3],
                                                         "data": [1, 2, 3]}]}))
            r = reader.one()
            assert r.status == 200 and r.json()["outputs"][0]["data"] == [1, 2, 3]
        for method, path, body, words in (
                ("POST", "/v2/repository/models/identity/unload", b"", "repository operations"),
                ("POST", "/v2/repository/index", b"{}", "repository operations"),
                ("GET", "/v2/models/identity/stats", b"", "statistics operations"),
                ("POST", "/v2/systemsharedmemory/region/r/register",
                 json.dumps({"key": key, "byte_size": 64}).encode(), "shared_memory operations")):
            r = one(srv.http, request(method, path, body))
            assert (r.status, r.code) == (403, "permission_denied") and "an anonymous caller" in r.error, r
            assert words in r.error and "Authorization: Bearer" in r.error and key.lstrip("/") not in r.error
        with grpc_stub(srv.grpc, role=None) as stub:
            assert stub.ModelInfer(grpc_infer_request()).raw_output_contents[0] == bytes(range(4))
            assert stub.ModelMetadata(pb.ModelMetadataRequest(name="identity")).name == "identity"
            for call in (lambda: stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="identity")),
                         lambda: stub.RepositoryIndex(pb.RepositoryIndexRequest()),
                         lambda: stub.ModelStatistics(pb.ModelStatisticsRequest(name="identity")),
                         lambda: stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
                             name="r", key=key, byte_size=64))):
                assert grpc_code(call) == "PERMISSION_DENIED"
    assert model_loaded(srv)
    still_serving(srv)


def _fin_wait_attack(http: str, grpc_address: str | None, key: str) -> str:
    """The attack of finding 1: idle connections queued ahead, then connections that pipeline
    control requests and close at once, over HTTP (and gRPC, unless ``grpc_address`` is None: a
    forked child cannot use gRPC).  Returns what it saw (JSON)."""
    idle = [socket.create_connection(raw_http.address(http)) for _ in range(32)]
    statuses = []
    try:
        register = json.dumps({"key": key, "byte_size": 64}).encode()
        for _ in range(10):
            for data in (request("POST", "/v2/repository/models/identity/unload") * 2,
                         request("POST", "/v2/systemsharedmemory/region/stolen/register", register) +
                         request("POST", "/v2/repository/models/identity/unload")):
                s = socket.create_connection(raw_http.address(http))
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                s.close()  # gone before the server looks: FIN_WAIT2, then TIME_WAIT
        with connect(http) as s:  # and one that reads its answers
            s.sendall(request("POST", "/v2/repository/models/identity/unload"))
            statuses.append(Reader(s).one().status)
        if grpc_address is None:
            return json.dumps(statuses)
        with grpc.insecure_channel(grpc_address) as channel:
            from tritonclient.grpc import service_pb2_grpc

            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            statuses.append(grpc_code(lambda: stub.RepositoryModelUnload(
                pb.RepositoryModelUnloadRequest(model_name="identity"))))
    finally:
        for s in idle:
            s.close()
    return json.dumps(statuses)


def test_a_caller_that_closes_before_the_server_looks_is_still_anonymous(srv):
    """Finding 1: as the test's own uid, and as nobody (not on the allow-list) when run as root."""
    with shm_objects() as make:
        key = make(64, data=b"secret" * 10)
        seen = [json.loads(_fin_wait_attack(srv.http, srv.grpc, key))]
        if os.getuid() == 0:
            from helpers.other_user import as_nobody, nobody_group

            nobody_group()
            answer = as_nobody(lambda: _fin_wait_attack(srv.http, None, key))
            seen.append(json.loads(answer) + ["PERMISSION_DENIED"] if answer.startswith("[") else pytest.fail(answer))
        for statuses in seen:
            assert statuses == [403, "PERMISSION_DENIED"], statuses
        time.sleep(0.5)  # the closed connections' requests, had any been served, would have been by now
        assert model_loaded(srv), "an anonymous caller unloaded a model"
        status = one(srv.http, request("GET", "/v2/systemsharedmemory/status", b"", auth("client")))
        assert status.status == 200 and status.json() == []
        r = one(srv.http, request("GET", "/v2/systemsharedmemory/status", b"", auth("admin")))
        assert r.json() == [], "an anonymous caller registered a region"
    still_serving(srv)


# -- tokens ---------------------------------------------------------------------------------------------

def test_tokens_say_who_calls_on_both_doors_and_a_bad_one_is_never_anonymous(srv):
    index = request("POST", "/v2/repository/index", b"{}", auth("admin"))
    r = one(srv.http, index)
    assert r.status == 200 and {m["name"] for m in r.json()} >= {"identity", "slow"}
    r = one(srv.http, request("POST", "/v2/repository/index", b"{}", auth("client")))
    assert (r.status, r.code) == (403, "permission_denied") and "admin tokens" in r.error
    assert one(srv.http, request("GET", "/v2/models/identity/stats", b"", auth("client"))).status == 200
    for bad in ("Bearer " + TOKENS["admin"][:-1], "Basic YWRtaW46eA==", "Bearer", "Bearer a b"):
        r = one(srv.http, request("GET", "/v2/health/live", b"", {"Authorization": bad}))
        assert (r.status, r.code) == (401, "unauthenticated") and r.headers["www-authenticate"].startswith("Bearer")
        assert TOKENS["admin"] not in r.error
    with grpc_stub(srv.grpc, role="admin") as admin, grpc_stub(srv.grpc, role="client") as client:
        assert admin.RepositoryIndex(pb.RepositoryIndexRequest()).models
        assert grpc_code(lambda: client.RepositoryIndex(pb.RepositoryIndexRequest())) == "PERMISSION_DENIED"
        assert client.ModelStatistics(pb.ModelStatisticsRequest(name="identity")).model_stats
    with grpc_stub(srv.grpc, role=None) as stub:
        bad = (("authorization", "Bearer " + TOKENS["admin"][:-1]),)
        assert grpc_code(lambda: stub.ServerLive(pb.ServerLiveRequest(), metadata=bad)) == "UNAUTHENTICATED"
    still_serving(srv)


# -- 2: gRPC identity per call, never per address ---------------------------------------------------------

def test_a_grpc_call_without_a_token_on_an_admins_connection_is_anonymous(srv):
    """Finding 2: the old door trusted a uid per peer address for a second.  Here the same channel
    (one connection: the same address and port) carries an admin's call, then calls without a
    token or with a bad one: each is judged by its own metadata."""
    admin = (("authorization", auth("admin")["authorization"]),)
    with grpc_stub(srv.grpc, role=None) as stub:
        for _ in range(3):
            assert stub.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=admin).models
            assert grpc_code(lambda: stub.RepositoryIndex(pb.RepositoryIndexRequest())) == "PERMISSION_DENIED"
            assert grpc_code(lambda: stub.RepositoryModelUnload(
                pb.RepositoryModelUnloadRequest(model_name="identity"))) == "PERMISSION_DENIED"
    assert model_loaded(srv)


# -- 3: gRPC memory before any check ------------------------------------------------------------------------

def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_unfinished_grpc_messages_hold_bounded_memory_and_others_are_served(tmp_path):
    """Finding 3: one connection opens 40 ModelInfer streams and sends 15 MiB of each message,
    never finishing one (600 MiB buffered before any check in the old door).  Streams past
    max_inflight_per_connection are refused, unread ones hold one flow-control window, a caller's
    reads are bounded (half of max_grpc_read_bytes), and a read ends at upload_timeout_s: the
    front-end grows by little, and a token holder is served all along."""
    extra = "max_inflight_per_connection = 8\nupload_timeout_s = 3\n"
    with v2_serving(tmp_path, models=MODELS, extra=extra) as small:
        still_serving(small)
        before = rss_kib(small.proc.pid)
        flood = Flood(small.grpc, "/inference.GRPCInferenceService/ModelInfer", 40, 15 << 20)
        served = 0
        try:
            with grpc_stub(small.grpc, role="client") as stub:
                deadline = time.monotonic() + 6
                while time.monotonic() < deadline:
                    flood.run(0.2)
                    assert stub.ModelInfer(grpc_infer_request()).raw_output_contents[0] == bytes(range(4))
                    served += 1
            grown = rss_kib(small.proc.pid) - before
        finally:
            flood.close()
        assert served > 0
        assert flood.refused >= 32, f"only {flood.refused} of 40 streams refused (8 allowed per connection)"
        assert flood.sent < 64 << 20, f"the server let {flood.sent >> 20} MiB in"
        assert grown < 96 * 1024, f"the front-end grew by {grown >> 10} MiB"
        still_serving(small)


# -- 7: connection caps ---------------------------------------------------------------------------------------

def test_grpc_connections_are_capped_and_the_other_doors_keep_accepting(tmp_path):
    """Finding 7: connections past max_connections on the gRPC door are closed; its descriptors
    stay bounded, and the native socket and the HTTP door accept as before."""
    with v2_serving(tmp_path, models=MODELS, extra="max_connections = 4\n") as small:
        still_serving(small)
        fds = open_fds(small)
        held = [hello(small.grpc) for _ in range(12)]
        try:
            time.sleep(0.5)
            assert open_fds(small) <= fds + 4 + 1, f"{open_fds(small) - fds} descriptors for 12 gRPC connections"
            with small.client() as c:
                assert np.array_equal(c.infer("identity", {"x": np.arange(3, dtype=np.uint8)})["y"], np.arange(3))
            still_serving(small)
        finally:
            for s in held:
                s.close()
        with grpc_stub(small.grpc) as stub:
            wait_for(lambda: grpc_code(lambda: stub.ServerLive(pb.ServerLiveRequest(), timeout=2)) == "OK",
                     "the gRPC door to accept again")


# -- HTTP bodies count against their caller ------------------------------------------------------------------

def chunked_binary_head(nbytes: int, headers: dict | None = None) -> bytes:
    """The head of a chunked binary infer (not streamed into the arena: its body is buffered)."""
    header = json.dumps({"inputs": [{"name": "x", "datatype": "UINT8", "shape": [nbytes],
                                     "parameters": {"binary_data_size": nbytes}}]}).encode()
    head = request("POST", "/v2/models/identity/infer", b"", {"Transfer-Encoding": "chunked",
                                                             "Inference-Header-Content-Length": str(len(header)),
                                                             **(headers or {})}, length=False)
    return head + b"%x\r\n%s\r\n" % (len(header), header)


def test_http_bodies_count_against_their_caller_and_a_caller_over_its_budget_is_refused(tmp_path):
    extra = f"max_buffered_bytes_per_uid = {4 << 20}\nupload_timeout_s = 30\n"
    chunk = b"%x\r\n%s\r\n" % (3 << 20, b"\x07" * (3 << 20))
    with v2_serving(tmp_path, models=MODELS, extra=extra) as small:
        first, second, tokened = connect(small.http), connect(small.http), connect(small.http)
        try:
            first.sendall(chunked_binary_head(6 << 20) + chunk)  # 3 MiB held, 3 MiB to come
            time.sleep(0.3)
            second.sendall(chunked_binary_head(3 << 20))
            sender = raw_http.Sender(second, chunk + b"0\r\n\r\n")
            r = Reader(second).one()
            assert (r.status, r.code) == (503, "overloaded") and "max_buffered_bytes_per_uid" in r.error, r
            assert "an anonymous caller" in r.error
            sender.join(10)
            tokened.sendall(chunked_binary_head(3 << 20, auth("client")) + chunk + b"0\r\n\r\n")
            r = Reader(tokened).one()  # its own budget
            assert r.status == 200 and r.json()["outputs"][0]["shape"] == [3 << 20], r
            first.sendall(chunk + b"0\r\n\r\n")
            r = Reader(first).one()
            assert r.status == 200 and r.json()["outputs"][0]["shape"] == [6 << 20], r
        finally:
            for s in (first, second, tokened):
                s.close()
        still_serving(small)


# -- start-up checks and reload --------------------------------------------------------------------------------

def serve_once(tmp_path, server_section: str, nofile: int | None = None) -> subprocess.CompletedProcess:
    from conftest import new_instance
    from helpers.server import TESTS_DIR

    config = tmp_path / "config.toml"
    config.write_text(f'[server]\ninstance = "{new_instance("refuse")}"\n{server_section}\n' + MODELS)

    def limit():
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", "--config", str(config), "--socket",
                           str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=120, env=env,
                          preexec_fn=limit)


def test_serve_refuses_limits_that_could_use_up_its_descriptors(tmp_path):
    done = serve_once(tmp_path, 'http = "127.0.0.1:0"\ngrpc = "127.0.0.1:0"\nv2_system_shared_memory = true\n',
                      nofile=1024)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "RLIMIT_NOFILE is 1024" in last and "LimitNOFILE=" in last and "max_connections (gRPC)" in last, last
    assert "Traceback" not in done.stderr


def test_serve_refuses_a_token_file_others_can_read(tmp_path):
    from helpers.v2_server import write_tokens

    path = write_tokens(tmp_path)
    os.chmod(path, 0o644)
    done = serve_once(tmp_path, f'http = "127.0.0.1:0"\nv2_tokens = "{path}"\n')
    assert done.returncode != 0 and f"chmod 600 {path}" in done.stderr.strip().splitlines()[-1], done.stderr
    assert "Traceback" not in done.stderr


def test_a_reload_applies_new_tokens_and_keeps_the_old_ones_if_the_file_is_bad(tmp_path):
    from shmserve.v2.auth import token_entry

    with v2_serving(tmp_path, models=MODELS) as small:
        path = tmp_path / "tokens.toml"
        index = lambda token: one(small.http, request("POST", "/v2/repository/index", b"{}",  # noqa: E731
                                                      {"Authorization": f"Bearer {token}"})).status
        assert index(TOKENS["admin"]) == 200 and index("fresh-token") == 401
        path.write_text(path.read_text() + "\n" + token_entry("fresh", "fresh-token", "admin"))
        small.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: index("fresh-token") == 200, "the reload to apply the new token")
        os.chmod(path, 0o644)
        small.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "keeping the running configuration" in small.log(), "the reload to be refused")
        assert index("fresh-token") == 200 and index(TOKENS["admin"]) == 200
        os.chmod(path, 0o600)


# -- gRPC calls of one caller overlap ----------------------------------------------------------------------------

def test_one_callers_grpc_calls_run_at_once_under_the_default_budget_ratio(tmp_path):
    """Two gRPC calls of one token are in the model at the same time (a rendezvous model: each waits
    for the other's mark), with max_buffered_bytes_per_uid four times max_request_bytes as the
    defaults are (256 and 64 MiB).  Was: each call reserved twice the largest message (2 x (2 x
    max_request_bytes + 1 MiB)) before reading it, more than the whole budget, so a call waited until
    the caller held nothing: the first call met no one in the model (the device run's gRPC
    system-shared-memory case, 8 clients of one token: half the throughput of before)."""
    import threading

    meeting = tmp_path / "meeting"
    meeting.mkdir()
    models = python_model("rendezvous", "serving_models:rendezvous", instances=2)
    extra = f"max_buffered_bytes_per_uid = {4 * MAX_REQUEST_BYTES}\nrequest_timeout_s = 60\n"
    with v2_serving(tmp_path, models=models, extra=extra, deadlines=30,
                    env={"SHMSERVE_TEST_MEETING": str(meeting)}) as srv, grpc_stub(srv.grpc, role="client") as s:
        for mark in meeting.iterdir():  # the warm-up's
            mark.unlink()
        seen = [None, None]

        def call(i):
            msg = pb.ModelInferRequest(model_name="rendezvous", raw_input_contents=[bytes([i])])
            msg.inputs.add(name="x", datatype="UINT8", shape=[1])
            seen[i] = np.frombuffer(s.ModelInfer(msg, timeout=60).raw_output_contents[0], np.uint8)[0]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert seen == [2, 2], seen
