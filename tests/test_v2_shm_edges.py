"""System shared memory through both v2 doors of a real server, on real /dev/shm objects: the
edge cases of Triton's L0_shared_memory and its CVE lessons, end to end.

``test_v2_sysshm`` checks the registry's rules one by one in-process; here each goes through HTTP
and gRPC as a client would send it: registration off unless enabled, offsets and sizes out of
range at registration and at use, keys naming the server's own arena (by name with any number of
slashes, by a hard link, by a symlink), FIFOs and directories planted in /dev/shm, an object
truncated under registered requests, unregistering while a request reads and writes a region,
and names kept per caller.  Keys never appear in an error; the server keeps serving, holds nothing
after, and each registration's descriptor is closed when it is unregistered.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from helpers import raw_http
from helpers.raw_http import one
from helpers.server import wait_for
from helpers.v2_server import (auth, grpc_refused, grpc_stub, open_fds, server_fixture, shm_objects,
                               shm_path, still_serving, v2_serving)
from helpers.v2_server import baseline, stub  # noqa: F401  (fixtures)

# Every request here presents the "admin" token, as the module's gRPC stub does (regions are their
# caller's own; a TCP caller without a token is anonymous and registers nothing), unless it passes
# role=None (anonymous) or another role.


def request(method: str, path: str, body: bytes = b"", headers: dict | None = None, role: str | None = "admin"):
    return raw_http.request(method, path, body, {**(auth(role) if role else {}), **(headers or {})})


def json_infer(model: str, body: dict, role: str | None = "admin") -> bytes:
    return raw_http.json_infer(model, body, auth(role) if role else None)


def client_fds(srv) -> int:
    """The server's descriptors open on this test session's /dev/shm objects (registrations)."""
    from conftest import SESSION_TAG

    return open_fds(srv, f"/dev/shm/{SESSION_TAG}")


srv = server_fixture("v2shm")


@pytest.fixture
def make(srv, stub, baseline):
    """/dev/shm objects for the test; after it: every region unregistered, the server serving,
    holding nothing, and back to its descriptors."""
    with shm_objects() as factory:
        yield factory
        assert unregister(srv).status == 200
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())
        still_serving(srv, baseline)


def register(srv, name: str, key, offset=0, byte_size=None, *, address: str | None = None,
             role: str | None = "admin") -> raw_http.Response:
    body = {"key": key, "offset": offset}
    if byte_size is not None:
        body["byte_size"] = byte_size
    return one(address or srv.http, request("POST", f"/v2/systemsharedmemory/region/{name}/register",
                                            json.dumps(body).encode(), role=role))


def unregister(srv, name: str | None = None, address: str | None = None, role: str | None = "admin"
               ) -> raw_http.Response:
    path = f"/v2/systemsharedmemory/region/{name}/unregister" if name else "/v2/systemsharedmemory/unregister"
    return one(address or srv.http, request("POST", path, role=role))


def status(srv, address: str | None = None, role: str | None = "admin") -> list:
    r = one(address or srv.http, request("GET", "/v2/systemsharedmemory/status", role=role))
    assert r.status == 200, r
    return r.json()


def grpc_register(stub, name: str, key: str, offset: int, byte_size: int):
    return stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset,
                                                                                byte_size=byte_size))


def no_key_in(text: str, key: str, srv=None) -> None:
    assert key.lstrip("/") not in text, f"the key appeared in an error: {text}"
    if srv is not None:
        assert srv.instance not in text, f"the server's instance appeared in an error: {text}"


def refused_http(r: raw_http.Response, status_code: int, code: str, key: str | None = None, srv=None) -> str:
    assert r.status == status_code and r.code == code, r
    if key is not None:
        no_key_in(r.error, key, srv)
    return r.error


def shm_infer(x: np.ndarray, region: str, byte_size: int | None = None, offset: int = 0, model: str = "slow",
              out: tuple | None = None) -> dict:
    """A request for ``model`` (FP32 vectors x -> y) whose input is in ``region``; ``out``:
    (region, byte_size, offset) for the output."""
    params = {"shared_memory_region": region, "shared_memory_byte_size": x.nbytes if byte_size is None else byte_size}
    if offset:
        params["shared_memory_offset"] = offset
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "parameters": params}]}
    if out is not None:
        params = {"shared_memory_region": out[0], "shared_memory_byte_size": out[1]}
        if out[2]:
            params["shared_memory_offset"] = out[2]
        body["outputs"] = [{"name": "y", "parameters": params}]
    return body


def grpc_shm_infer(x: np.ndarray, region: str, byte_size: int, offset: int = 0, out: tuple | None = None):
    msg = pb.ModelInferRequest(model_name="slow")
    t = msg.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    t.parameters["shared_memory_region"].string_param = region
    t.parameters["shared_memory_byte_size"].int64_param = byte_size
    if offset:
        t.parameters["shared_memory_offset"].int64_param = offset
    if out is not None:
        o = msg.outputs.add(name="y")
        o.parameters["shared_memory_region"].string_param = out[0]
        o.parameters["shared_memory_byte_size"].int64_param = out[1]
    return msg


def floats(key: str, n: int, offset: int = 0) -> np.ndarray:
    with open(shm_path(key), "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(4 * n), np.float32)


# -- off unless enabled ------------------------------------------------------------------------------

def test_registration_is_off_by_default_on_both_doors(tmp_path):
    with v2_serving(tmp_path, shm=False) as off, shm_objects() as make, grpc_stub(off.grpc) as stub:
        key = make(256)
        r = register(off, "r", key, 0, 256)
        assert "v2_system_shared_memory" in refused_http(r, 403, "permission_denied", key, off)
        details = grpc_refused(lambda: grpc_register(stub, "r", key, 0, 256), "PERMISSION_DENIED", "permission_denied")
        no_key_in(details, key, off)
        assert status(off) == [] and unregister(off).status == 200 and unregister(off, "r").status == 200
        x = np.ones(4, np.float32)
        r = one(off.http, json_infer("slow", shm_infer(x, "r")))
        assert refused_http(r, 404, "bad_region", key) == "Unable to find shared memory region: 'r'"
        grpc_refused(lambda: stub.ModelInfer(grpc_shm_infer(x, "r", 16)), "NOT_FOUND", "bad_region")
        still_serving(off)


# -- ranges at registration and at use -----------------------------------------------------------------

@pytest.mark.parametrize("offset, size", [(0, 4097), (4096, 1), (4095, 2), (1 << 62, 1 << 62), (2**64 - 32, 64),
                                          (0, 2**64 - 1), (-1, 16), (0, -16), ("0", 16), (0, 16.0), (True, 16),
                                          (0, None), (None, 16)])
def test_out_of_range_or_mistyped_registrations_are_refused_over_http(srv, make, offset, size):
    key = make(4096)
    fds = client_fds(srv)
    refused_http(register(srv, "r", key, offset, size), 400, "bad_region", key, srv)
    assert status(srv) == [] and client_fds(srv) == fds


@pytest.mark.parametrize("offset, size", [(0, 4097), (4096, 1), (2**63, 2**63), (2**64 - 1, 1), (1, 2**64 - 1)])
def test_out_of_range_registrations_are_refused_over_grpc(srv, stub, make, offset, size):
    key = make(4096)
    fds = client_fds(srv)
    no_key_in(grpc_refused(lambda: grpc_register(stub, "r", key, offset, size), "INVALID_ARGUMENT", "bad_region"),
              key, srv)
    assert not stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest()).regions and client_fds(srv) == fds


def test_ranges_at_use_are_checked_against_the_registration_on_both_doors(srv, stub, make):
    x = np.arange(8, dtype=np.float32) / 4
    key = make(256, data=bytes(64) + x.tobytes())
    out_key = make(64)
    assert register(srv, "in", key, 64, 128).status == 200  # bytes 64..191 of the object
    assert register(srv, "out", out_key, 0, 32).status == 200
    r = one(srv.http, json_infer("slow", shm_infer(x, "in", out=("out", 32, 0))))
    assert r.status == 200 and r.json()["outputs"][0]["parameters"]["shared_memory_byte_size"] == 32, r
    assert np.array_equal(floats(out_key, 8), x * 2)
    cases = [(shm_infer(x, "in", 32, offset=100), 400, "bad_region",
              ["Invalid offset + byte size for shared memory region: 'in'", "offset 100 + byte_size 32", "128 bytes"]),
             (shm_infer(x, "in", 32, offset=128), 400, "bad_region", ["Invalid offset for shared memory region: 'in'"]),
             (shm_infer(x, "in", 129), 400, "bad_input", ["input byte size mismatch", "Expected 32, got 129"]),
             (shm_infer(x, "in", 16), 400, "bad_input", ["Expected 32, got 16"]),
             (shm_infer(x, "in", out=("out", 16, 0)), 400, "bad_region",
              ["output 'y' (16 bytes) should be at least 32 bytes to hold the results"]),
             (shm_infer(x, "in", out=("out", 32, 4)), 400, "bad_region",
              ["Invalid offset + byte size for shared memory region: 'out'"]),
             (shm_infer(x, "nope"), 404, "bad_region", ["Unable to find shared memory region: 'nope'"]),
             (shm_infer(x, "in", out=("nope", 32, 0)), 404, "bad_region", ["Unable to find shared memory region: 'nope'"])]
    for body, http_status, code, words in cases:
        message = refused_http(one(srv.http, json_infer("slow", body)), http_status, code, key, srv)
        assert all(w in message for w in words), (words, message)
    for msg, code, words in ((grpc_shm_infer(x, "in", 32, offset=97), "bad_region", ["Invalid offset + byte size"]),
                             (grpc_shm_infer(x, "in", 16), "bad_input", ["Expected 32, got 16"]),
                             (grpc_shm_infer(x, "in", 32, out=("out", 8)), "bad_region",
                              ["output 'y' (8 bytes) should be at least 32 bytes"])):
        details = grpc_refused(lambda: stub.ModelInfer(msg), "INVALID_ARGUMENT", code)
        assert all(w in details for w in words) and key.lstrip("/") not in details, details
    reply = stub.ModelInfer(grpc_shm_infer(x, "in", 32))
    assert np.array_equal(np.frombuffer(reply.raw_output_contents[0], np.float32), x * 2)
    # the same name twice is refused; once unregistered it may be registered again
    assert refused_http(register(srv, "in", key, 0, 16), 400, "bad_region", key, srv) == \
        "shared memory region 'in' already in manager"
    assert unregister(srv, "in").status == 200
    assert register(srv, "in", key, 0, 16).status == 200


# -- keys that name the server's own segments, links, FIFOs, directories ---------------------------------

def test_a_key_naming_the_servers_arena_is_refused_however_it_is_spelled(srv, stub, make):
    arena = f"shmserve.{srv.instance}"
    assert os.path.exists(shm_path(arena))
    spellings = [arena, "/" + arena, "//" + arena, "/" * 40 + arena, "shmserve.other-instance", "/shmserve.x",
                 f"shmserve.{srv.instance}.r1"]
    fds = client_fds(srv)
    for key in spellings:
        message = refused_http(register(srv, "a", key, 0, 16), 400, "bad_region", key, srv)
        assert "shmserve's own segments" in message
        details = grpc_refused(lambda: grpc_register(stub, "a", key, 0, 16), "INVALID_ARGUMENT", "bad_region")
        no_key_in(details, key, srv)
    for key in ("/dev/shm/" + arena, f"../shm/{arena}", f"/x/../{arena}", arena + "\0", f"./{arena}"):
        refused_http(register(srv, "a", key, 0, 16), 400, "bad_region", key, srv)
    assert status(srv) == [] and client_fds(srv) == fds


def test_the_arena_by_another_name_a_hard_link_or_a_symlink_is_refused(srv, stub, make):
    """A name that does not begin 'shmserve.' but is the arena's file (a hard link root can make)
    or points at it (a symlink: never followed)."""
    from conftest import new_instance

    arena = shm_path(f"shmserve.{srv.instance}")
    hard, soft = "/" + new_instance("hard"), "/" + new_instance("soft")
    os.link(arena, shm_path(hard))
    os.symlink(arena, shm_path(soft))
    try:
        for key, words in ((hard, "the server's own segments"), (soft, "cannot be opened")):
            message = refused_http(register(srv, "a", key, 0, 16), 400, "bad_region", key, srv)
            assert words in message, message
            grpc_refused(lambda: grpc_register(stub, "a", key, 0, 16), "INVALID_ARGUMENT", "bad_region")
    finally:
        os.unlink(shm_path(hard))
        os.unlink(shm_path(soft))


def test_fifos_directories_symlinks_and_loose_objects_planted_in_dev_shm_are_refused_without_hanging(srv, stub, make):
    from conftest import new_instance

    target = make(4096)
    fifo, folder, link = ("/" + new_instance(t) for t in ("fifo", "dir", "link"))
    os.mkfifo(shm_path(fifo), 0o600)
    os.mkdir(shm_path(folder), 0o700)
    os.symlink(shm_path(target), shm_path(link))
    loose = make(4096, mode=0o666)
    try:
        fds = client_fds(srv)
        for key, words in ((fifo, "does not name a shared-memory object"), (folder, "cannot be opened"),
                           (link, "cannot be opened"), (loose, "o+w"),
                           ("/" + new_instance("absent"), "no shared-memory")):
            start = time.monotonic()
            message = refused_http(register(srv, "p", key, 0, 16), 400, "bad_region", key, srv)
            assert words in message, message
            grpc_refused(lambda: grpc_register(stub, "p", key, 0, 16), "INVALID_ARGUMENT", "bad_region")
            assert time.monotonic() - start < 5, "registering a planted object hung"
        assert status(srv) == [] and client_fds(srv) == fds
    finally:
        os.unlink(shm_path(fifo))
        os.rmdir(shm_path(folder))
        os.unlink(shm_path(link))


# -- an object truncated under the server --------------------------------------------------------------

def test_an_object_truncated_after_registration_fails_its_requests_not_the_server(srv, stub, make):
    x = np.arange(16, dtype=np.float32)
    key = make(4096, data=x.tobytes())
    out_key = make(4096)
    assert register(srv, "in", key, 0, 4096).status == 200
    assert register(srv, "out", out_key, 0, 4096).status == 200
    pid = srv.proc.pid
    os.truncate(shm_path(key), 10)  # shorter than the input
    message = refused_http(one(srv.http, json_infer("slow", shm_infer(x, "in"))), 400, "bad_region", key)
    assert "shorter than registered" in message
    grpc_refused(lambda: stub.ModelInfer(grpc_shm_infer(x, "in", 64)), "INVALID_ARGUMENT", "bad_region")
    os.truncate(shm_path(key), 0)
    refused_http(one(srv.http, json_infer("slow", shm_infer(x, "in"))), 400, "bad_region", key)
    os.truncate(shm_path(out_key), 16)  # the output no longer fits
    json_x = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [16], "data": x.tolist()}],
              "outputs": [{"name": "y", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 64}}]}
    message = refused_http(one(srv.http, json_infer("slow", json_x)), 400, "bad_region", out_key)
    assert "output 'y'" in message and "shorter than registered" in message
    assert os.stat(shm_path(out_key)).st_size == 16, "the server grew a client's object"
    assert srv.proc.poll() is None and srv.proc.pid == pid
    with open(shm_path(key), "r+b") as f:  # grown back and refilled: served again
        f.truncate(4096)
        f.write((x + 1).tobytes())
    os.truncate(shm_path(out_key), 4096)
    r = one(srv.http, json_infer("slow", shm_infer(x, "in", out=("out", 64, 0))))
    assert r.status == 200 and np.array_equal(floats(out_key, 16), (x + 1) * 2), r


# -- unregistering while requests use a region ----------------------------------------------------------

@pytest.mark.parametrize("which", ["out", "in", "all"])
def test_unregister_returns_at_once_and_the_region_goes_when_its_request_is_done(srv, stub, make, which):
    """As Triton's qa L0_shared_memory (TestSharedMemoryUnregister): while a request reads its input
    from "in" and will write its output into "out", the client unregisters "out" (HTTP), "in" (HTTP)
    or all (gRPC): the call returns while the request still runs, the regions stay listed until it
    is done, the request succeeds, and then they are gone.  Unlike Triton, no new request may name
    a region being unregistered."""
    x = np.array([3, 1, 2, 3], np.float32)  # slow sleeps x[0] seconds: the unregister is answered well before
    in_key, out_key = make(64, data=x.tobytes()), make(64)
    assert register(srv, "in", in_key, 0, 64).status == 200
    assert register(srv, "out", out_key, 0, 64).status == 200
    answers = {}
    runner = threading.Thread(target=lambda: answers.update(r=one(srv.http, json_infer(
        "slow", shm_infer(x, "in", out=("out", 16, 0))))))
    runner.start()
    wait_for(lambda: srv.info()["stats"]["slots_in_use"] == 1, "the request to run")
    if which == "all":
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())
    else:
        assert unregister(srv, which).status == 200
    running = runner.is_alive()
    listed = {r["name"] for r in status(srv)}
    refusal = one(srv.http, json_infer("slow", shm_infer(x[1:], "in", out=("out", 16, 0))))
    runner.join(30)
    assert answers["r"].status == 200, answers["r"]
    assert np.array_equal(floats(out_key, 4), x * 2)
    gone = {"in", "out"} if which == "all" else {which}
    assert running, "the unregister waited for the request"
    assert listed == {"in", "out"}, listed
    assert "(it is being unregistered" in refused_http(refusal, 404, "bad_region")
    assert {r["name"] for r in status(srv)} == {"in", "out"} - gone


def test_an_unregister_whose_client_leaves_still_frees_the_name(srv, stub, make):
    """The client of an unregister closes its connection at once, while a request still reads the
    region: the region goes all the same once the request is done, its descriptor is closed, and
    its name can be registered again."""
    x = np.array([0.8, 1, 2, 3], np.float32)  # slow sleeps x[0] seconds
    key = make(64, data=x.tobytes())
    fds = client_fds(srv)
    assert register(srv, "r", key, 0, 64).status == 200
    answers = {}
    runner = threading.Thread(target=lambda: answers.update(r=one(srv.http, json_infer(
        "slow", shm_infer(x, "r")))))
    runner.start()
    wait_for(lambda: srv.info()["stats"]["slots_in_use"] == 1, "the request to run")
    with raw_http.connect(srv.http) as s:
        s.sendall(request("POST", "/v2/systemsharedmemory/region/r/unregister"))
    runner.join(30)
    assert answers["r"].status == 200, answers["r"]
    wait_for(lambda: "r" not in [r["name"] for r in status(srv)], "the region to go")
    wait_for(lambda: client_fds(srv) == fds, "the region's descriptor to be closed", timeout=15)
    assert register(srv, "r", key, 0, 64).status == 200, "the name stayed blocked"


def test_each_registration_holds_one_descriptor_until_it_is_unregistered(srv, stub, make):
    keys = [make(256) for _ in range(5)]
    fds = client_fds(srv)
    for i, key in enumerate(keys):
        assert register(srv, f"r{i}", key, 0, 256).status == 200
    grpc_register(stub, "g", keys[0], 0, 128)
    assert client_fds(srv) == fds + 6
    assert unregister(srv, "r0").status == 200 and unregister(srv, "never").status == 200
    assert client_fds(srv) == fds + 5
    assert unregister(srv).status == 200
    assert client_fds(srv) == fds


# -- names are per caller --------------------------------------------------------------------------------

def test_region_names_are_per_caller(srv, make):
    """Two token holders ("admin", "other": another uid) each register "r": each sees, uses and
    unregisters only its own; "other" cannot register the admin's uid's object; an anonymous
    caller registers nothing and reaches no one's region."""
    if os.getuid() != 0:
        pytest.skip("needs root to make an object of the other token's uid")
    from helpers.v2_server import OTHER_UID

    x = np.arange(4, dtype=np.float32)  # slow sleeps x[0] seconds
    y = np.array([0.01, 7, 8, 9], np.float32)
    mine = make(64, data=y.tobytes())
    theirs = make(64, data=x.tobytes(), uid=OTHER_UID)
    assert register(srv, "r", mine, 0, 64).status == 200
    assert register(srv, "admin_only", mine, 0, 64).status == 200
    assert register(srv, "r", theirs, 0, 64, role="other").status == 200
    assert "another uid" in refused_http(register(srv, "s", mine, 0, 64, role="other"), 400, "bad_region", mine)
    assert [r["name"] for r in status(srv, role="other")] == ["r"]
    r = one(srv.http, json_infer("slow", shm_infer(x, "r"), role="other"))
    assert r.status == 200 and r.json()["outputs"][0]["data"] == (x * 2).tolist(), r  # its own "r"
    assert "Unable to find shared memory region: 'admin_only'" in one(srv.http, json_infer(
        "slow", shm_infer(x, "admin_only"), role="other")).error
    refused_http(register(srv, "a", theirs, 0, 64, role=None), 403, "permission_denied", theirs)
    refused_http(one(srv.http, json_infer("slow", shm_infer(x, "r"), role=None)), 404, "bad_region")
    assert unregister(srv, role="other").status == 200
    assert [r["name"] for r in status(srv)] == ["admin_only", "r"]  # the other's unregister left the admin's
    r = one(srv.http, json_infer("slow", shm_infer(x, "r")))
    assert r.status == 200 and np.array_equal(np.array(r.json()["outputs"][0]["data"], np.float32), y * 2), r
