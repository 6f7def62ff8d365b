"""No exception on a door's answer path can leak what a request holds (issue 23, finding 4), against
real servers.

- A system shared-memory output written into a sparse object when /dev/shm is full: ENOSPC for
  real.  The server runs in its own mount namespace over a small tmpfs /dev/shm (never the host's:
  others run tests on it), which the test reaches through ``/proc/<pid>/root``; skipped where
  mounting is not allowed.  Each such request is answered BAD_REGION, holds nothing after, and
  three times as many of them as the arena has slots leave the server serving.
- Every door callback raising once, under load (``helpers.faults`` wraps them in the server's own
  process): the native socket's ``Door`` methods, the v2 door's for HTTP and for gRPC callers, the
  HTTP connection's ``BodyReceiver.fill`` and its answer callback, and system shared-memory reads
  and writes.  Each fault costs exactly the one request it hit (its connection ends, or it is
  answered INTERNAL); every other request gets its right answer; the server holds nothing after
  and keeps serving.

The in-process side of the same rules is ``test_dispatcher`` ("a door that raises").
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from conftest import new_instance
from helpers import raw_http
from helpers.server import wait_for
from helpers.v2_server import MODELS, grpc_stub, still_serving, v2_serving
from shmserve.errors import ConnectionClosed, ShmserveError

SLOTS = 8
SMALL_ARENA = f"[arena]\nslots = {SLOTS}\nsize_classes = [[4096, 64], [2097152, 4]]\n\n"
SHM_MIB = 24  # the server's own /dev/shm: its arena (~9 MiB), then filled up by the test
GENEROUS_S = 60  # upload and stall deadlines: no client here may meet one, however busy the machine


def _namespaced_dev_shm() -> list[str]:
    """A launcher that runs the server in a new mount namespace whose /dev/shm is a small tmpfs of its
    own; skips the test where that is not allowed (no unshare, not root, a seccomp filter)."""
    mount = f'mount -t tmpfs -o size={SHM_MIB}m,mode=1777 shmserve-test /dev/shm && exec "$@"'
    launcher = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to give the server a /dev/shm of its own")
    probe = subprocess.run([*launcher, "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a new mount namespace here: {probe.stderr.decode()[-200:]}")
    return launcher


def register(srv, name: str, key: str, size: int) -> raw_http.Response:
    body = json.dumps({"key": key, "offset": 0, "byte_size": size}).encode()
    return raw_http.one(srv.http, raw_http.request("POST", f"/v2/systemsharedmemory/region/{name}/register", body))


def shm_out_request(x: np.ndarray, region: str) -> bytes:
    """slow(x) (2x, after sleeping x[0] seconds) with its output written into ``region``."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.tolist()}],
            "outputs": [{"name": "y", "parameters": {"shared_memory_region": region,
                                                     "shared_memory_byte_size": x.nbytes}}]}
    return raw_http.json_infer("slow", body)


def test_outputs_into_a_sparse_region_on_a_full_dev_shm_fail_their_requests_not_the_server(tmp_path):
    """The output of each request is 4 KiB into a registered object that is all hole, on a /dev/shm
    with no page left: writing it raises ENOSPC.  Each request is answered BAD_REGION naming the
    cause; three times as many as the arena has slots (each one leaked its slot before), with
    ordinary requests between them, leave the server serving and holding nothing."""
    launcher = _namespaced_dev_shm()
    with v2_serving(tmp_path, models=SMALL_ARENA + MODELS, http=str(tmp_path / "http.sock"), deadlines=GENEROUS_S,
                    launcher=launcher) as srv:
        shm = f"/proc/{srv.proc.pid}/root/dev/shm"
        assert os.statvfs(shm).f_blocks * os.statvfs(shm).f_frsize <= SHM_MIB << 20, "not the server's own tmpfs"
        name = new_instance("sparse")
        fd = os.open(f"{shm}/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, 1 << 20)  # all hole: a write into it needs new pages
        finally:
            os.close(fd)
        assert register(srv, "sparse", "/" + name, 1 << 20).status == 200
        with open(f"{shm}/filler", "wb", buffering=0) as filler:  # /dev/shm full, to the last page
            with contextlib.suppress(OSError):
                while True:
                    filler.write(b"\xff" * (1 << 16))
            with contextlib.suppress(OSError):
                while True:
                    filler.write(b"\xff")
        x = np.arange(1024, dtype=np.float32)  # x[0] = 0: slow does not sleep
        for i in range(3 * SLOTS):
            r = raw_http.one(srv.http, shm_out_request(np.where(x > 0, x + i, 0), "sparse"), timeout=60)
            assert r.status == 400 and r.code == "bad_region", r
            assert "no room for its pages" in r.error and name not in r.error, r.error
            if i % 4 == 0:
                with srv.client(lanes=False) as c:
                    np.testing.assert_array_equal(c.infer("slow", {"x": x})["y"], 2 * x)
        still_serving(srv)
        assert srv.info()["stats"]["slots_in_use"] == 0
        os.unlink(f"{shm}/filler")  # room again: the same request now succeeds
        r = raw_http.one(srv.http, shm_out_request(x, "sparse"), timeout=60)
        assert r.status == 200, r
        with open(f"{shm}/{name}", "rb") as f:
            assert np.frombuffer(f.read(x.nbytes), np.float32).tolist() == (2 * x).tolist()


# -- every door callback raising once, under load ----------------------------------------------------

FAULT_SLOTS = 4
BLOCKERS = FAULT_SLOTS  # native requests that hold every slot while the "waiting" faults are hit
ROUNDS = 12  # requests per load thread (two threads per door)
# Phase B's faults, each on the n-th call of its point after phase A (whose calls are counted in
# below: phase A's blockers are admitted and answered through the native door).
LOAD_FAULTS = {"unix.admitted": 3, "unix.answer": 5, "http.admitted": 3, "http.answer": 5, "http.fill": 2,
               "http.done": 7, "grpc.admitted": 3, "grpc.answer": 5, "sysshm.read": 2, "sysshm.write": 4}
PHASE_A_CALLS = {"unix.admitted": BLOCKERS, "unix.answer": BLOCKERS}
WAIT_FAULTS = ("unix.waiting", "http.waiting", "grpc.waiting")


def fault_spec() -> str:
    return ",".join([f"{p}:1" for p in WAIT_FAULTS] +
                    [f"{p}:{n + PHASE_A_CALLS.get(p, 0)}" for p, n in LOAD_FAULTS.items()])


def http_answer(address: str, data: bytes) -> raw_http.Response | None:
    """The answer to ``data`` on a fresh connection, or None if the server closed it without one."""
    with raw_http.connect(address, timeout=60) as s:
        reader = raw_http.Reader(s)
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # closed while it sent or read
            s.sendall(data)
            while not reader.done and not reader.closed:
                reader._recv()
        return reader.done[0] if reader.done else None


def grpc_identity(x: np.ndarray) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="identity", raw_input_contents=[x.tobytes()])
    msg.inputs.add(name="x", datatype="UINT8", shape=[x.size])
    return msg


class Outcomes:
    """What each load thread's requests got: right answers, and the failures by kind."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ok = 0
        self.failed: list[str] = []
        self.wrong: list[str] = []

    def record(self, what: str, kind: str | None) -> None:
        with self.lock:
            if kind is None:
                self.ok += 1
            elif kind.startswith("wrong"):
                self.wrong.append(f"{what}: {kind}")
            else:
                self.failed.append(f"{what}: {kind}")


def unix_load(srv, t: int, out: Outcomes) -> None:
    rng = np.random.default_rng(t)
    client = srv.client(lanes=False, timeout=60)
    try:
        for i in range(ROUNDS):
            x = rng.integers(0, 255, 4096 + i, dtype=np.uint8)
            try:
                y = client.infer("identity", {"x": x})["y"]
                out.record(f"unix {t}.{i}", None if np.array_equal(y, x) else "wrong result")
            except ConnectionClosed:
                out.record(f"unix {t}.{i}", "connection closed")
                client.close()
                client = srv.client(lanes=False, timeout=60)
    finally:
        client.close()


def http_load(srv, t: int, out: Outcomes, regions: tuple[str, str]) -> None:
    from helpers.v2_server import shm_path

    rng = np.random.default_rng(100 + t)
    in_key, out_key = regions
    for i in range(ROUNDS):
        if i % 2 == 0:  # a binary body of 1 MiB: streamed into the arena through BodyReceiver.fill
            x = rng.integers(0, 255, (1 << 20) + i, dtype=np.uint8)
            header = {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [x.size],
                                  "parameters": {"binary_data_size": x.size}}],
                      "parameters": {"binary_data_output": True}}
            r = http_answer(srv.http, raw_http.binary_infer("identity", header, x.tobytes()))
            good = r is not None and r.status == 200 and r.binary == x.tobytes()
        else:  # input read from a registered region, output written into one
            x = np.concatenate([[0], rng.random(255)]).astype(np.float32)  # x[0] = 0: slow does not sleep
            with open(shm_path(in_key), "r+b") as f:
                f.write(x.tobytes())
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [x.size],
                                "parameters": {"shared_memory_region": f"in{t}", "shared_memory_byte_size": x.nbytes}}],
                    "outputs": [{"name": "y", "parameters": {"shared_memory_region": f"out{t}",
                                                             "shared_memory_byte_size": x.nbytes}}]}
            r = http_answer(srv.http, raw_http.json_infer("slow", body))
            with open(shm_path(out_key), "rb") as f:
                good = r is not None and r.status == 200 and np.array_equal(np.frombuffer(f.read(x.nbytes),
                                                                                          np.float32), 2 * x)
        kind = None if good else ("connection closed" if r is None else
                                  f"{r.status} {r.code}" if r.status >= 400 else "wrong result")
        out.record(f"http {t}.{i}", kind)


def grpc_load(srv, t: int, out: Outcomes) -> None:
    """One thread's gRPC calls, on a connection of its own: a fault ends every call in flight on its
    connection, and channels to one target otherwise share theirs."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    rng = np.random.default_rng(200 + t)
    channel = grpc.insecure_channel(srv.grpc, options=[("grpc.use_local_subchannel_pool", 1)])
    with channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for i in range(ROUNDS):
            x = rng.integers(0, 255, 4096 + i, dtype=np.uint8)
            try:
                reply = stub.ModelInfer(grpc_identity(x), timeout=60)
                y = np.frombuffer(reply.raw_output_contents[0], np.uint8)
                out.record(f"grpc {t}.{i}", None if np.array_equal(y, x) else "wrong result")
            except grpc.RpcError as exc:
                out.record(f"grpc {t}.{i}", f"{exc.code().name} {exc.details()[:60]}")


def test_every_door_callback_raising_once_under_load_costs_only_its_own_request(tmp_path):
    """Phase A: every slot held by a slow native request; one request through each door waits for
    space, and its door's ``waiting`` raises: the native and HTTP connections are closed, the gRPC
    call answered INTERNAL, at once.  Phase B: two threads per door (native socket; HTTP with 1 MiB
    streamed bodies and with system shared-memory inputs and outputs; gRPC) send requests one
    after the other while ten more callbacks raise once each.  Every fault costs exactly the
    request it hit (HTTP and native: a closed connection; gRPC and shared memory: INTERNAL), every
    other request gets its right answer, and the server holds no slot nor arena byte after, and
    serves."""
    from helpers.v2_server import shm_objects

    with v2_serving(tmp_path, models=f"[arena]\nslots = {FAULT_SLOTS}\n\n" + MODELS, deadlines=GENEROUS_S,
                    http=str(tmp_path / "http.sock"), module="helpers.faults",
                    env={"SHMSERVE_TEST_FAULTS": fault_spec()}) as srv, shm_objects() as make_object:
        # -- phase A: waiting ------------------------------------------------------------------------
        blockers, blocked = [], []
        for _ in range(BLOCKERS):
            x = np.array([0.4, 1, 2], np.float32)  # slow sleeps x[0] seconds, one request at a time

            def block(x=x):
                with srv.client(lanes=False, timeout=60) as c:
                    blocked.append(np.array_equal(c.infer("slow", {"x": x})["y"], 2 * x))

            blockers.append(threading.Thread(target=block))
            blockers[-1].start()
        wait_for(lambda: srv.info()["stats"]["slots_in_use"] == FAULT_SLOTS, "every slot to be held")
        x = np.arange(64, dtype=np.uint8)
        with srv.client(lanes=False, timeout=60) as c, pytest.raises(ConnectionClosed):
            c.infer("identity", {"x": x})
        assert http_answer(srv.http, raw_http.binary_infer("identity", {"inputs": [
            {"name": "x", "datatype": "UINT8", "shape": [64], "parameters": {"binary_data_size": 64}}]},
            x.tobytes())) is None
        import grpc

        with grpc_stub(srv.grpc) as stub, pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(grpc_identity(x), timeout=60)
        assert info.value.code() == grpc.StatusCode.INTERNAL, info.value.details()
        for thread in blockers:
            thread.join(60)
        assert blocked == [True] * BLOCKERS
        # -- phase B: load -----------------------------------------------------------------------------
        regions = []
        for t in range(2):
            keys = (make_object(1024), make_object(1024))
            for name, key in zip((f"in{t}", f"out{t}"), keys):
                assert register(srv, name, key, 1024).status == 200
            regions.append(keys)
        out = Outcomes()
        threads = [threading.Thread(target=unix_load, args=(srv, t, out)) for t in range(2)]
        threads += [threading.Thread(target=http_load, args=(srv, t, out, regions[t])) for t in range(2)]
        threads += [threading.Thread(target=grpc_load, args=(srv, t, out)) for t in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not any(thread.is_alive() for thread in threads), "a client hung"
        fired = [line.split()[-1] for line in srv.log().splitlines() if line.startswith("INJECTED FAULT")]
        assert sorted(fired) == sorted([*WAIT_FAULTS, *LOAD_FAULTS]), fired
        assert not out.wrong, out.wrong
        assert len(out.failed) == len(LOAD_FAULTS), "\n".join(out.failed)
        kinds = sorted(f.split(": ", 1)[1].split()[0] for f in out.failed)
        # native and HTTP connections ended (6); gRPC calls (2) and shared-memory copies (2) INTERNAL
        assert kinds == sorted(["connection"] * 6 + ["INTERNAL"] * 2 + ["500"] * 2), "\n".join(out.failed)
        assert out.ok == 6 * ROUNDS - len(LOAD_FAULTS)
        still_serving(srv)
        assert srv.info()["stats"]["slots_in_use"] == 0
        unregister = raw_http.one(srv.http, raw_http.request("POST", "/v2/systemsharedmemory/unregister"))
        assert unregister.status == 200, unregister
