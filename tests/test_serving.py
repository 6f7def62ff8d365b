"""The serving path through real server and worker processes on a temporary socket."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from shmserve import AsyncClient, BadArgument, Client, ErrorCode, ShmserveError, layout, protocol
from shmserve.protocol import Kind

from conftest import shm_names
from helpers.other_user import as_nobody, server_nobody_can_reach
from helpers.server import BROKEN_MODEL, DEMO_PATH, SLOW_MODEL, TESTS_DIR, ServerProcess, serving, standard_models

MiB = 1024 * 1024
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("srv"), standard_models(),
                 server_section="request_timeout_s = 20\nmax_request_bytes = 140000000") as srv:
        yield srv


def demo_reference(x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(DEMO_PATH, providers=["CPUExecutionProvider"])
    return session.run(None, {"image": x})[0]


# -- results --------------------------------------------------------------------------------

def test_demo_inline_and_zero_copy_equal_onnxruntime(server):
    rng = np.random.default_rng(1)
    for batch in (1, 3, 16):
        x = rng.random((batch, 3, 32, 32), dtype=np.float32)
        ref = demo_reference(x)
        with server.client() as c:
            out = c.infer("demo", {"image": x})
            assert out["probabilities"].dtype == np.float32
            np.testing.assert_array_equal(out["probabilities"], ref)  # same runtime, same model: exact
            with c.zero_copy("demo", {"image": (x.shape, np.float32)}) as call:
                call.inputs["image"][...] = x
                zc = call.run()
                np.testing.assert_array_equal(zc["probabilities"], ref)
                assert not zc["probabilities"].flags.writeable


def test_identity_and_empty_and_scalar_edges(server):
    with server.client() as c:
        for n in (0, 1, 63, 64, 65, 4097):
            x = np.arange(n, dtype=np.uint8)
            np.testing.assert_array_equal(c.infer("identity", {"x": x})["y"], x)


def test_dynamic_output_size_known_only_after_running(server):
    with server.client() as c:
        x = np.zeros(1000, np.float32)
        x[[3, 500, 999]] = 1
        assert c.infer("nonzero", {"x": x})["indices"].tolist() == [3, 500, 999]
        with c.zero_copy("nonzero", {"x": ((1000,), np.float32)}) as call:
            call.inputs["x"][...] = x
            assert call.run()["indices"].tolist() == [3, 500, 999]


def test_models_listing_and_info(server):
    with server.client() as c:
        models = {m["name"]: m for m in c.models()}
        demo = models["demo"]
        assert demo["backend"] == "onnxruntime" and demo["device"] == "cpu" and demo["path"] == DEMO_PATH
        assert demo["inputs"] == [{"name": "image", "dtype": "float32", "shape": ["batch", 3, 32, 32]}]
        assert demo["outputs"] == [{"name": "probabilities", "dtype": "float32", "shape": ["batch", 10]}]
        assert models["broken"]["state"] == "unavailable" and "cannot be loaded" in models["broken"]["error"]
        info = c.info()
        assert info["instance"] == server.instance and info["protocol"] == protocol.PROTOCOL_VERSION
        assert len([w for w in info["workers"] if w["model"] == "identity"]) == 2
        health = c.health()
        assert health["status"] == "degraded" and health["models"]["demo"]["state"] == "ready"


# -- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("model,inputs,code", [
    ("nope", {"x": np.zeros(1, np.uint8)}, ErrorCode.UNKNOWN_MODEL),
    ("demo", {"img": np.zeros((1, 3, 32, 32), np.float32)}, ErrorCode.BAD_INPUT),
    ("demo", {"image": np.zeros((1, 3, 32, 32), np.float64)}, ErrorCode.BAD_DTYPE),
    ("demo", {"image": np.zeros((3, 32, 32), np.float32)}, ErrorCode.BAD_SHAPE),
    ("demo", {"image": np.zeros((1, 3, 32, 31), np.float32)}, ErrorCode.BAD_SHAPE),
    ("identity", {"x": np.zeros(100 * MiB, np.uint8)}, ErrorCode.TOO_LARGE),
    ("fails", {"x": np.full(4, -1, np.float32)}, ErrorCode.MODEL_ERROR),
    ("wrong_dtype", {"x": np.ones(4, np.float32)}, ErrorCode.MODEL_ERROR),
    ("grow", {"x": np.ones(64, np.float32)}, ErrorCode.OUTPUT_TOO_LARGE),
    ("broken", {"x": np.ones(1, np.float32)}, ErrorCode.MODEL_UNAVAILABLE),
])
def test_bad_requests_get_stable_codes_and_the_server_keeps_serving(server, model, inputs, code):
    with server.client() as c:
        with pytest.raises(ShmserveError) as info:
            c.infer(model, inputs)
        assert info.value.code is code, info.value
        assert info.value.message
        np.testing.assert_array_equal(c.infer("identity", {"x": np.arange(9, dtype=np.uint8)})["y"], np.arange(9))
    server.wait_idle()


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), 86401, True, "5"])
def test_bad_timeouts_are_refused_by_the_client_before_sending(server, timeout):
    """A timeout out of (0, 86400] s is the caller's mistake, said in its own process (BadArgument:
    a ShmserveError with code bad_argument and a ValueError), not a server's bad_frame."""
    with pytest.raises(BadArgument) as info:
        Client(server.socket, timeout=timeout)
    assert info.value.code is ErrorCode.BAD_ARGUMENT and isinstance(info.value, ValueError)
    assert "timeout must be a number of seconds in (0, 86400]" in info.value.message
    x = np.ones(4, np.uint8)
    with server.client() as c:
        with pytest.raises(BadArgument):
            c.infer("identity", {"x": x}, timeout=timeout)
        for lanes in (True, False):
            c.lanes = lanes
            with c.zero_copy("identity", {"x": (x.shape, np.uint8)}) as call:
                with pytest.raises(BadArgument):
                    call.run(timeout=timeout)
        assert c.infer("identity", {"x": x}, timeout=5)["y"].tolist() == [1] * 4  # nothing was sent: still in step

    async def main():
        async with AsyncClient(server.socket) as c:
            with pytest.raises(BadArgument):
                await c.infer("identity", {"x": x}, timeout=timeout)
            return (await c.infer("identity", {"x": x}))["y"].tolist()

    assert asyncio.run(main()) == [1] * 4
    server.wait_idle()


@pytest.mark.parametrize("shape,dtype,code", [
    ((4,), np.complex64, ErrorCode.BAD_DTYPE), ((4,), "nope", ErrorCode.BAD_DTYPE), ((4,), ">f4", ErrorCode.BAD_DTYPE),
    ((-4,), np.uint8, ErrorCode.BAD_SHAPE), (4, np.uint8, ErrorCode.BAD_SHAPE), ((1.5,), np.uint8, ErrorCode.BAD_SHAPE),
    ((1,) * 9, np.uint8, ErrorCode.BAD_SHAPE),
])
def test_bad_zero_copy_inputs_are_refused_by_the_client(server, shape, dtype, code):
    with server.client() as c:
        with pytest.raises(BadArgument) as info:
            c.zero_copy("identity", {"x": (shape, dtype)})
        assert info.value.code is code and "input 'x'" in info.value.message, info.value
        assert not c._core.regions  # refused before any region was asked for


def test_timeout(server):
    with server.client() as c:
        with pytest.raises(ShmserveError) as info:
            c.infer("slow", {"x": np.array([1.5], np.float32)}, timeout=0.3)
        assert info.value.code is ErrorCode.TIMEOUT
        assert c.infer("identity", {"x": np.ones(3, np.uint8)})["y"].tolist() == [1, 1, 1]
    server.wait_idle()  # the slot came back once the worker finished


def infer_region(c: Client, region: int, inputs=(("x", 100, 0),), output_offset: int = 4096,
                 output_capacity: int = 4096):
    """One INFER_REGION with hand-written descriptors (as a buggy or hostile client could send):
    ``inputs`` are (name, uint8 count, offset); returns the session's RegionResult."""
    tensors = [protocol.TensorMeta(name, "uint8", (n,), offset) for name, n, offset in inputs]
    return c._pump.exchange(lambda session: session.infer_region("identity", tensors, region, output_offset,
                                                            output_capacity, c.timeout))


def test_zero_copy_descriptors_are_bounds_checked(server):
    with server.client() as c:
        region = c.open_region(1 << 20)
        for patch in ({"region": region.id + 1000},
                      {"inputs": [("x", 100, region.size - 50)]},
                      {"inputs": [("x", 100, 3)]},
                      {"output_offset": region.size},
                      {"output_capacity": 2**40}):
            with pytest.raises(ShmserveError) as info:
                infer_region(c, **({"region": region.id} | patch))
            assert info.value.code is ErrorCode.BAD_REGION, patch
        with pytest.raises(ShmserveError) as info:
            c.open_region(2**40)
        assert info.value.code is ErrorCode.TOO_LARGE
        assert infer_region(c, region.id).outputs[0].offset == 4096


IDENTITY_ONLY = """
[[models]]
name = "identity"
backend = "python"
path = "shmserve.models:identity"
"""


def test_zero_copy_fits_its_regions_to_a_small_max_request_bytes(tmp_path):
    """With max_request_bytes = 1 MiB the default 64 MiB region is refused: both clients learn
    the server's limit once and ask for regions within it; a call larger than the limit gets the
    server's TOO_LARGE, which names the key to raise."""
    x = np.arange(100_000, dtype=np.uint8)
    with serving(tmp_path, IDENTITY_ONLY, server_section="max_request_bytes = 1048576") as srv:
        limit = srv.info()["max_request_bytes"] + protocol.REGION_SLACK
        for lanes in (True, False):
            with Client(srv.socket, lanes=lanes) as c:
                for _ in range(2):
                    with c.zero_copy("identity", {"x": (x.shape, np.uint8)}) as call:
                        call.inputs["x"][...] = x
                        np.testing.assert_array_equal(call.run()["y"], x)
                assert c._core.region_limit == limit
                assert all(r.size - (layout.LANE_BYTES if r.lane else 0) <= limit for r in c._core.regions)
                with pytest.raises(ShmserveError) as info:
                    c.zero_copy("identity", {"x": ((2 << 20,), np.uint8)})
                assert info.value.code is ErrorCode.TOO_LARGE
                assert "raise [server] max_request_bytes" in info.value.message, info.value
                with pytest.raises(ShmserveError) as info:  # inline: the same key, in the same words
                    c.infer("identity", {"x": np.zeros(2 << 20, np.uint8)})
                assert info.value.code is ErrorCode.TOO_LARGE
                assert "request needs 4 MiB > max_request_bytes (1 MiB): raise [server] max_request_bytes" \
                    in info.value.message, info.value

        async def main():
            async with AsyncClient(srv.socket) as c:
                async with await c.zero_copy("identity", {"x": (x.shape, np.uint8)}) as call:
                    call.inputs["x"][...] = x
                    np.testing.assert_array_equal((await call.run())["y"], x)
                return c._core.region_limit

        assert asyncio.run(main()) == limit
        srv.wait_idle()


def test_another_clients_region_is_out_of_reach(server):
    with server.client() as a, server.client() as b:
        region = a.open_region(1 << 20)
        with pytest.raises(ShmserveError) as info:
            infer_region(b, region.id, [("x", 10, 0)])
        assert info.value.code is ErrorCode.BAD_REGION
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shmserve.{server.instance}.")
                    and n != f"shmserve.{server.instance}"], "a region has a name anyone could open"
        record = server.recorded_regions()[region.id]
        assert (record["kind"], record["owner_uid"], record["size"]) == ("region", os.getuid(), region.size)


def raw_exchange(path: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes, return whatever comes back until the server closes or goes quiet."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        s.close()


def parse_answers(data: bytes) -> list:
    conn = protocol.Connection(protocol.Role.CLIENT)
    conn.receive_data(data)
    out = []
    while True:
        ev = conn.next_event()
        if ev is protocol.NEED_DATA or isinstance(ev, protocol.ProtocolError):
            return out
        out.append(ev)
        if isinstance(ev, protocol.Frame) and ev.data_len:
            conn.discard_payload()


@pytest.mark.parametrize("data,code", [
    (b"GET / HTTP/1.1\r\n\r\n", "bad_frame"),
    (protocol.FRAME_HEADER.pack(b"SV", 2, Kind.HEALTH, 2, 0) + b"{}", "version_mismatch"),
    (protocol.FRAME_HEADER.pack(b"SV", 1, Kind.INFER, 2**31, 0), "frame_too_large"),
    (protocol.FRAME_HEADER.pack(b"SV", 1, Kind.HEALTH, 5, 0) + b"[1,2]", "bad_frame"),
    (protocol.encode_frame(Kind.INFER, {"id": 1, "model": "identity",
                                        "inputs": [{"name": "x", "dtype": "uint8", "shape": [10]}]}, 5) + b"12345",
     "bad_frame"),
    (protocol.encode_frame(Kind.INFER, {"id": 1, "model": "identity", "inputs": "x"}), "bad_frame"),
    (protocol.encode_frame(Kind.HEALTH, {"id": "x"}), "bad_frame"),
    (protocol.encode_frame(Kind.CLOSE_REGION, {"id": 1, "region": 99}), "bad_region"),
])
def test_hostile_frames_get_errors_and_others_are_served(server, data, code):
    answers = parse_answers(raw_exchange(server.socket, data))
    assert answers and answers[-1].kind is Kind.ERROR and answers[-1].meta["code"] == code, answers
    with server.client() as c:
        assert c.infer("identity", {"x": np.ones(5, np.uint8)})["y"].sum() == 5


def test_fuzzed_bytes_against_the_live_server(server):
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    valid = protocol.encode_frame(Kind.INFER, {"id": 3, "model": "identity",
                                               "inputs": [{"name": "x", "dtype": "uint8", "shape": [16]}]}, 16) + bytes(16)
    for i in range(60):
        choice = rng.randrange(4)
        if choice == 0:
            data = rng.randbytes(rng.randrange(1, 200))
        elif choice == 1:
            data = valid[:rng.randrange(1, len(valid))]  # truncated
        elif choice == 2:
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        else:
            data = valid + rng.randbytes(rng.randrange(1, 64))
        try:
            raw_exchange(server.socket, data, timeout=2)
        except OSError as exc:
            pytest.fail(f"seed {seed} case {i}: {exc}")
    with server.client() as c:
        assert c.infer("identity", {"x": np.ones(7, np.uint8)})["y"].sum() == 7, f"seed {seed}"
    server.wait_idle()


def test_client_disconnecting_mid_upload_and_mid_run_leaks_nothing(server):
    header = protocol.encode_frame(Kind.INFER, {"id": 1, "model": "identity",
                                                "inputs": [{"name": "x", "dtype": "uint8", "shape": [1 << 20]}]}, 1 << 20)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.socket)
    s.sendall(header + bytes(1000))  # most of the payload never comes
    time.sleep(0.2)
    s.close()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.socket)
    x = np.array([0.5], np.float32)
    s.sendall(protocol.encode_frame(Kind.INFER, {"id": 2, "model": "slow", "inputs": [
        {"name": "x", "dtype": "float32", "shape": [1]}]}, 4) + x.tobytes())
    time.sleep(0.1)
    s.close()  # gone while the worker runs it
    server.wait_idle()
    with server.client() as c:
        assert c.infer("slow", {"x": np.array([0.0], np.float32)})["y"].tolist() == [0.0]


def test_cli_infer_models_and_no_server(server, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    run = lambda *args: subprocess.run([sys.executable, "-m", "shmserve.cli", *args], capture_output=True, text=True,
                                       env=env, timeout=60)
    r = run("infer", "demo", "--random", "--socket", server.socket)
    assert r.returncode == 0, r.stderr
    assert all(cell in r.stdout for cell in ("probabilities", "float32", "(1, 10)", "crc32", "round trip:"))
    x = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    r = run("infer", "demo", "--input", f"image={tmp_path / 'x.npy'}", "--save", str(tmp_path / "out"),
            "--json", "--socket", server.socket)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["outputs"][0]["shape"] == [2, 10]
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "probabilities.npy"), demo_reference(x))
    r = run("models", "--json", "--socket", server.socket)
    listed = json.loads(r.stdout)
    assert r.returncode == 0 and isinstance(listed, list)
    assert all({"name", "backend", "path", "device", "inputs", "outputs"} <= set(m) for m in listed)
    r = run("models", "--socket", str(tmp_path / "nobody.sock"))
    assert r.returncode == 3 and "no shmserve server" in r.stderr
    r = run("infer", "nope", "--random", "--socket", server.socket)
    assert r.returncode == 1


def test_serve_mistakes_end_in_a_message_not_a_traceback(tmp_path):
    """A bad instance name, or a socket that cannot be made: one line naming the fix, a non-zero
    exit, nothing left in /dev/shm."""
    from conftest import new_instance

    before = shm_names()
    run = lambda *args: subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", *args], capture_output=True,
                                       text=True, timeout=120)
    r = run("--instance", "bad name", "--socket", str(tmp_path / "s.sock"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "invalid instance name" in r.stderr, r.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = run("--instance", new_instance("cli"), "--socket", str(blocker / "s.sock"))  # its "directory" is a file
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "cannot listen on" in r.stderr and "choose another --socket" in r.stderr
    assert shm_names() == before


def test_async_client_many_in_flight(server):
    import asyncio

    async def main():
        async with AsyncClient(server.socket) as c:
            xs = [np.full(i + 1, i, np.uint8) for i in range(40)]
            outs = await asyncio.gather(*(c.infer("identity", {"x": x}) for x in xs))
            for x, out in zip(xs, outs):
                np.testing.assert_array_equal(out["y"], x)
            with pytest.raises(ShmserveError) as info:
                await c.infer("nope", {"x": xs[0]})
            assert info.value.code is ErrorCode.UNKNOWN_MODEL
            assert (await c.health())["models"]["identity"]["state"] == "ready"
            assert any(m["name"] == "demo" for m in await c.models())
            x = np.random.default_rng(2).random((2, 3, 32, 32), dtype=np.float32)
            async with await c.zero_copy("demo", {"image": (x.shape, np.float32)}) as call:
                call.inputs["image"][...] = x
                out = await call.run()
                np.testing.assert_array_equal(out["probabilities"], demo_reference(x))

    asyncio.run(main())


# -- concurrency ----------------------------------------------------------------------------

LOAD_CLIENT = str(Path(__file__).parent / "helpers" / "load_client.py")


def test_sixteen_concurrent_clients_threads_and_processes(server):
    seed = random.SystemRandom().randrange(2**32)
    print(f"concurrency seed={seed}")
    procs = [subprocess.Popen([sys.executable, LOAD_CLIENT, server.socket, str(seed + i), "6"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(8)]
    failures: list[str] = []

    def thread_client(i: int):
        from helpers.load_client import run_client
        try:
            run_client(server.socket, seed + 100 + i, 6)
        except Exception as exc:  # reported below with the seed
            failures.append(f"thread {i}: {exc!r}")

    threads = [threading.Thread(target=thread_client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for p in procs:
        out, err = p.communicate(timeout=300)
        if p.returncode != 0:
            failures.append(f"process: {err.strip()[-2000:]}")
    assert not failures, f"seed {seed}: {failures}"
    server.wait_idle()


# -- faults with their own server ----------------------------------------------------------

@pytest.mark.parametrize("lanes", [False, True], ids=["socket", "lanes"])
def test_worker_killed_mid_request(tmp_path, lanes):
    """Four requests on one worker, one running: killed, the running one fails WORKER_CRASHED; the
    three it had not claimed yet run on its restart, and so does a request sent meanwhile.  The
    same through lanes (Client.infer's default): the restarted worker takes the lanes over and
    runs the calls still queued in them, even those the dead one had taken off their rings."""
    before = shm_names()
    srv = ServerProcess(tmp_path, SLOW_MODEL + """
        [[models]]
        name = "identity"
        backend = "python"
        path = "shmserve.models:identity"
    """, server_section="request_timeout_s = 60").start()
    try:
        (victim,) = [w["pid"] for w in srv.info()["workers"] if w["model"] == "slow"]
        results: list = []

        def call():
            with srv.client(timeout=60, lanes=lanes) as c:
                t0 = time.monotonic()
                try:
                    y = c.infer("slow", {"x": np.array([2.0], np.float32)})["y"]
                    results.append(("ok", y.tolist(), time.monotonic() - t0))
                except ShmserveError as exc:
                    results.append((exc.code, exc.message, time.monotonic() - t0))

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20

        def reached() -> int:
            """Calls sent to the worker: its lanes (a lane call is in no front-end count), or over the
            socket main's requests in flight plus the door processes' lane calls (docs/doors.md)."""
            info = srv.info()
            [w] = [w for w in info["workers"] if w["model"] == "slow"]
            return w["lanes"] if lanes else w["inflight"] + sum(d["in_flight"] for d in info.get("doors") or ())

        while reached() != 4:
            assert time.monotonic() < deadline, "requests never reached the worker"
            time.sleep(0.02)
        if lanes or srv.info().get("doors"):
            time.sleep(0.5)  # each call is submitted as soon as its lane is open; the worker claims within ms
        os.kill(victim, 9)
        with srv.client(timeout=60, lanes=lanes) as c:  # sent while it restarts: waits for it
            assert c.infer("slow", {"x": np.array([0.0], np.float32)})["y"].tolist() == [0.0]
        for t in threads:
            t.join(60)
        assert len(results) == 4
        crashed = [r for r in results if r[0] != "ok"]
        assert len(crashed) == 1, results
        outcome, detail, elapsed = crashed[0]
        assert outcome is ErrorCode.WORKER_CRASHED and "SIGKILL" in detail and elapsed < 10
        assert sorted(r[:2] for r in results if r[0] == "ok") == [("ok", [4.0])] * 3
        info = srv.wait_idle()
        (worker,) = [w for w in info["workers"] if w["model"] == "slow"]
        assert worker["restarts"] == 1 and worker["pid"] != victim and worker["last_exit"] == "killed by SIGKILL"
    finally:
        assert srv.stop() == 0, srv.log()
    assert shm_names() == before
    assert not os.path.exists(srv.socket)


def test_overloaded_when_arena_and_queue_are_full(tmp_path):
    """The arena's slots and the wait queue are the socket path's (a lane queues in its own slots)."""
    srv = ServerProcess(tmp_path, "[arena]\nslots = 2\n" + SLOW_MODEL,
                        server_section="max_waiting = 0\ndoors = 0").start()  # main serves the socket: its arena
    try:
        done = []

        def call():
            with srv.client(lanes=False) as c:
                done.append(c.infer("slow", {"x": np.array([1.0], np.float32)}))

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        with srv.client(lanes=False) as c:
            with pytest.raises(ShmserveError) as info:
                c.infer("slow", {"x": np.array([0.0], np.float32)})
            assert info.value.code is ErrorCode.OVERLOADED
        for t in threads:
            t.join(30)
        assert len(done) == 2
        srv.wait_idle()
    finally:
        assert srv.stop() == 0, srv.log()


def test_sigterm_drains_in_flight_requests(tmp_path):
    before = shm_names()
    srv = ServerProcess(tmp_path, SLOW_MODEL).start()
    results = []

    def call():
        with srv.client() as c:
            results.append(c.infer("slow", {"x": np.array([1.0], np.float32)})["y"].tolist())

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.3)
    late = srv.client()  # connected before the stop, asks during the drain
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    with pytest.raises(ShmserveError) as info:
        late.infer("slow", {"x": np.array([0.0], np.float32)})
    assert info.value.code is ErrorCode.SHUTTING_DOWN
    late.close()
    assert srv.stop() == 0, srv.log()
    t.join(10)
    assert results == [[2.0]]  # finished during the drain, not cut off
    assert shm_names() == before
    assert not os.path.exists(srv.socket_dir)
    assert "stopped" in srv.log()


@pytest.mark.parametrize("lanes", [False, True], ids=["socket", "lanes"])
def test_a_stop_that_outlasts_its_time_terminates_busy_workers_before_killing_them(tmp_path, lanes):
    """STOP entry, then SIGTERM after the supervisor's stop timeout: a worker busy in a long model call
    leaves at once on TERM (releasing what it holds), so SIGKILL is never needed.  The call still
    running when the drain ran out is answered SHUTTING_DOWN, through a lane too."""
    srv = ServerProcess(tmp_path, SLOW_MODEL, server_section="drain_timeout_s = 0.2").start()
    results = []

    def call():
        with srv.client(lanes=lanes) as c:
            try:
                c.infer("slow", {"x": np.array([120.0], np.float32)}, timeout=200)
            except ShmserveError as exc:
                results.append(exc.code)

    t = threading.Thread(target=call)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while [w["lanes" if lanes else "inflight"] for w in srv.info()["workers"]] != [1]:
            assert time.monotonic() < deadline, "the request never reached the worker"
            time.sleep(0.02)
        if lanes:
            time.sleep(0.5)  # submitted as soon as its lane is open; claimed within ms
    except BaseException:
        srv.stop()  # a failed test leaves no server (nor its 120 s request) behind
        raise
    assert srv.stop() == 0, srv.log()
    t.join(10)
    assert results == [ErrorCode.SHUTTING_DOWN]
    log = srv.log()
    assert "sending SIGTERM" in log and "exit 6 (terminated)" in log, log
    assert "SIGKILL" not in log, log


def test_a_stray_sigterm_to_a_worker_is_ignored(server):
    """A TERM the supervisor did not send (a shell's pkill, a kill of the process group) does not
    take a worker down: it keeps serving, and is not restarted."""
    (worker,) = [w for w in server.info()["workers"] if w["model"] == "demo"]
    os.kill(worker["pid"], signal.SIGTERM)
    time.sleep(0.5)
    x = np.zeros((1, 3, 32, 32), np.float32)
    with server.client() as c:
        assert c.infer("demo", {"image": x})["probabilities"].shape == (1, 10)
    (after,) = [w for w in server.info()["workers"] if w["model"] == "demo"]
    assert after["pid"] == worker["pid"] and after["restarts"] == 0 and after["state"] == "ready"


def health_as_seen(path: str) -> str:
    """"served", or the error code a health check at ``path`` got (run as another user)."""
    try:
        with Client(path, timeout=10) as c:
            c.health()
        return "served"
    except ShmserveError as exc:
        return exc.code.wire


def test_peer_credentials_refuse_other_users(tmp_path):
    with server_nobody_can_reach(tmp_path) as srv:
        answer = as_nobody(lambda: health_as_seen(srv.socket))  # nobody is not on the allow-list
        assert answer == "permission_denied", answer
        assert "refused connection from pid" in srv.log() and "uid 65534" in srv.log()
        with srv.client() as c:  # the owner still is served
            assert c.infer("identity", {"x": np.ones(3, np.uint8)})["y"].sum() == 3


def test_a_supplementary_group_on_the_allow_list_lets_its_members_in(tmp_path):
    """allow_gids counts a peer's supplementary groups, read from the socket (SO_PEERGROUPS: the
    groups it had when it connected, whatever its pid is by the time the server looks)."""
    member_gid = 4242  # any gid will do for setgroups; nothing else on the machine uses it here
    with server_nobody_can_reach(tmp_path, server_section=f"allow_gids = [{member_gid}]") as srv:
        assert as_nobody(lambda: health_as_seen(srv.socket), groups=(member_gid,)) == "served"
        assert as_nobody(lambda: health_as_seen(srv.socket)) == "permission_denied"


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_no_descriptor_leaks_in_server_or_workers(server):
    info = server.info()
    pids = [server.proc.pid] + [w["pid"] for w in info["workers"] if w["state"] == "ready"]
    for _ in range(3):  # warm: lazily opened descriptors (logging, region maps) exist before we count
        _exercise_everything(server)
    server.wait_idle()
    time.sleep(1.2)  # workers unmap closed regions (each mapping holds a descriptor) on their idle tick
    before = {pid: _fds(pid) for pid in pids}
    for _ in range(5):
        _exercise_everything(server)
    server.wait_idle()
    time.sleep(1.2)
    after = {pid: _fds(pid) for pid in pids}
    assert after == before


def _exercise_everything(server):
    """Connections, inline and zero-copy requests, regions, errors, abrupt disconnects."""
    with server.client() as c:
        c.infer("identity", {"x": np.arange(100, dtype=np.uint8)})
        with c.zero_copy("identity", {"x": ((100,), np.uint8)}) as call:
            call.inputs["x"][...] = 1
            call.run()
        with pytest.raises(ShmserveError):
            c.infer("nope", {"x": np.ones(1, np.uint8)})
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.socket)
    s.sendall(protocol.encode_frame(Kind.OPEN_REGION, {"id": 1, "size": 4096}))
    s.recv(4096)  # the region's descriptor arrives with this; closing drops it
    s.close()
    raw_exchange(server.socket, b"garbage that is not a frame")


def _second_serve(server, *args: str, instance: str | None = None) -> subprocess.CompletedProcess:
    """``serve`` with the running server's config file; returns once it exited."""
    instance_args = ["--instance", instance] if instance else []
    return subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", "--config", str(server.config_path),
                           *instance_args, *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(TESTS_DIR)))


def test_a_second_server_for_the_same_instance_refuses_cleanly(server, tmp_path):
    """A second serve for a live instance names the pid that serves it and its socket and suggests
    another --instance; one for another instance on a live server's socket names that server's pid.
    Both say so before spawning a worker (no model is loaded for nothing)."""
    r = _second_serve(server, "--socket", str(tmp_path / "second.sock"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert (f"instance {server.instance!r} is already served by pid {server.proc.pid}, listening on "
            f"{server.socket}; stop that server first, or start this one with another --instance") in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "worker" not in r.stderr, r.stderr
    assert not (tmp_path / "second.sock").exists()
    r = _second_serve(server, "--socket", server.socket, instance="other-" + server.instance[-8:])
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"another server (pid {server.proc.pid}) is listening on {server.socket}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "worker" not in r.stderr, r.stderr
    with server.client() as c:  # the first one is untouched
        assert c.infer("identity", {"x": np.ones(2, np.uint8)})["y"].sum() == 2
    r = _second_serve(server, "--socket", "/tmp/" + "s" * 120, instance="other-" + server.instance[-8:])
    assert r.returncode != 0 and "107 bytes" in r.stderr


@pytest.mark.parametrize("how", ["--strict", "strict = true"])
def test_strict_serve_stops_when_a_model_cannot_load(tmp_path, how):
    """``serve --strict`` (or [server] strict = true): a model that cannot load stops the start
    with exit 1 and one line naming it and why; nothing is left behind.  Without it the others
    are served (the module's server has a broken model too)."""
    before = shm_names()
    srv = ServerProcess(tmp_path, IDENTITY_ONLY + BROKEN_MODEL, extra_args=[how] if how.startswith("--") else [],
                        server_section="" if how.startswith("--") else how)
    with pytest.raises(RuntimeError) as info:
        srv.start()
    assert srv.proc.returncode == 1
    last = srv.log().strip().splitlines()[-1]
    assert last == ("shmserve serve: strict: 1 of 2 models did not load, not serving: model 'broken' is "
                    "unavailable: cannot load model 'broken' (python, serving_models:broken_factory): "
                    "RuntimeError: this model cannot be loaded"), info.value
    assert "Traceback" not in srv.log().split("cannot be loaded")[-1]
    assert shm_names() == before and not os.path.exists(srv.socket)
    srv.stop()


def test_a_refused_request_is_answered_after_earlier_ones_on_its_connection(server):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.socket)
    s.settimeout(30)
    slow = np.array([0.3], np.float32)
    s.sendall(protocol.encode_frame(Kind.INFER, {"id": 1, "model": "slow", "inputs": [
        {"name": "x", "dtype": "float32", "shape": [1]}]}, 4) + slow.tobytes()
        + protocol.encode_frame(Kind.INFER, {"id": 2, "model": "no-such-model", "inputs": [
            {"name": "x", "dtype": "float32", "shape": [1]}]}, 4) + slow.tobytes())
    conn = protocol.Connection(protocol.Role.CLIENT)
    answers = []
    while len(answers) < 2:
        conn.receive_data(s.recv(65536))
        while (ev := conn.next_event()) is not protocol.NEED_DATA:
            if isinstance(ev, protocol.Frame):
                answers.append((ev.kind, ev.meta["id"]))
                if ev.data_len:
                    conn.discard_payload()
    s.close()
    assert answers == [(Kind.RESULT, 1), (Kind.ERROR, 2)]
