"""Both clients as pumps: real ``Client`` and ``AsyncClient`` on a real Unix socket, against a
scripted peer that answers what a real server never would (answers split into odd pieces,
out of order, malformed, cut off, with descriptors nobody asked for).

What the session decides is tested in test_session.py with byte strings; here: that each pump
delivers it — the right answer to the right caller, a clear ConnectionClosed instead of a
crash or a hang, and no descriptor left open.  The clients are made with ``lanes=False``: these
are the socket's pumps (``infer`` through a lane is tested against real servers in test_lanes.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import numpy as np
import pytest

from shmserve import AsyncClient, Client, ConnectionClosed, ErrorCode, ShmserveError, protocol
from shmserve.protocol import Kind

from test_session import all_closed, frame, pipe_end, result

WAIT_S = 10.0


class Peer:
    """A scripted server: accepts one connection and calls ``answer(kind, meta)`` for every
    request frame it reads; ``answer`` sends what it wants with ``send``/``send_fds``/``close``.
    Requests whose answer is held back can be answered later from the test (``held``)."""

    def __init__(self, path: str, answer):
        self.answer = answer
        self.held: list[tuple[Kind, dict]] = []
        self.conn: socket.socket | None = None
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def send(self, data: bytes, pieces: int = 1, pause: float = 0.0) -> None:
        step = -(-len(data) // pieces)
        for at in range(0, len(data), step):
            self.conn.sendall(data[at:at + step])
            if pause:
                time.sleep(pause)

    def send_fds(self, data: bytes, fds: list[int]) -> None:
        socket.send_fds(self.conn, [data], fds)

    def close(self) -> None:
        self.conn.shutdown(socket.SHUT_RDWR)

    def _serve(self) -> None:
        self.conn, _ = self.listener.accept()
        proto = protocol.Connection(protocol.Role.SERVER)
        try:
            while data := self.conn.recv(1 << 20):
                proto.receive_data(data)
                while (ev := proto.next_event()) is not protocol.NEED_DATA:
                    if isinstance(ev, protocol.ProtocolError):
                        return
                    if isinstance(ev, protocol.Frame):
                        if ev.data_len:
                            proto.discard_payload()
                        self.answer(self, ev.kind, ev.meta)
        except OSError:
            pass

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()
        self.thread.join(WAIT_S)


@pytest.fixture
def peer(tmp_path):
    made = []

    def make(answer) -> tuple[Peer, str]:
        path = str(tmp_path / f"peer{len(made)}.sock")
        made.append(Peer(path, answer))
        return made[-1], path

    yield make
    for p in made:
        p.stop()


def echo_result(p: Peer, meta: dict, pieces: int = 1) -> None:
    """A RESULT whose one output is the request's first input, all ones, in ``pieces`` writes."""
    shape = meta["inputs"][0]["shape"]
    data = np.ones(shape, np.uint8).tobytes()
    p.send(result(meta["id"], [{"name": "y", "dtype": "uint8", "shape": shape}], data), pieces, 0.001)


def wait_closed(read_end: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not all_closed(read_end):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- answers reach their callers ----------------------------------------------------------

def test_the_blocking_client_reads_a_result_that_arrives_in_odd_pieces(peer):
    _, path = peer(lambda p, kind, meta: echo_result(p, meta, pieces=37))
    with Client(path, timeout=WAIT_S, lanes=False) as c:
        for n in (0, 1, 4096, 3 << 20):
            out = c.infer("m", {"x": np.zeros(n, np.uint8)})["y"]
            assert out.shape == (n,) and out.sum() == n


def test_the_async_client_gives_each_caller_its_own_answer_in_any_order(peer):
    def answer(p, kind, meta):
        p.held.append(meta)
        if len(p.held) == 8:  # all in flight: answer the last first
            for m in reversed(p.held):
                echo_result(p, m, pieces=5)

    _, path = peer(answer)

    async def main():
        async with AsyncClient(path, timeout=WAIT_S, lanes=False) as c:
            # up to 2.8 MB each: sends that do not fit the socket wait for it (and must not interleave)
            sizes = [i * 400_000 + i for i in range(8)]
            outs = await asyncio.gather(*(c.infer("m", {"x": np.zeros(n, np.uint8)}) for n in sizes))
            assert [(o["y"].size, int(o["y"].sum())) for o in outs] == [(n, n) for n in sizes]

    asyncio.run(main())


# -- malformed answers end the connection cleanly -------------------------------------------

def short_payload(p: Peer, kind, meta) -> None:
    p.send(result(meta["id"], [{"name": "y", "dtype": "uint8", "shape": [4]}], b"abc"))


def test_a_malformed_answer_closes_the_blocking_client_with_the_reason(peer):
    p, path = peer(short_payload)
    with Client(path, timeout=WAIT_S, lanes=False) as c:
        t0 = time.monotonic()
        with pytest.raises(ConnectionClosed, match="payload does not match its outputs"):
            c.infer("m", {"x": np.ones(4, np.uint8)})
        p.listener.close()
        with pytest.raises(ConnectionClosed, match="no shmserve server"):
            c.health()  # the connection is over: the next call connects again, and nobody listens
        assert time.monotonic() - t0 < WAIT_S / 2


def test_a_malformed_answer_fails_every_async_call_in_flight(peer):
    def answer(p, kind, meta):
        p.held.append(meta)
        if len(p.held) == 3:
            short_payload(p, kind, p.held[1])

    p, path = peer(answer)

    async def main():
        async with AsyncClient(path, timeout=WAIT_S, lanes=False) as c:
            outcomes = await asyncio.gather(*(c.infer("m", {"x": np.ones(4, np.uint8)}) for _ in range(3)),
                                            return_exceptions=True)
            assert all(type(o) is ConnectionClosed and "does not match" in o.message for o in outcomes), outcomes
            p.listener.close()
            with pytest.raises(ConnectionClosed, match="no shmserve server"):
                await c.health()  # the next call connects again, and nobody listens

    asyncio.run(asyncio.wait_for(main(), WAIT_S))


def test_the_servers_own_reason_is_reported_to_both_clients(peer):
    def answer(p, kind, meta):
        p.send(frame(Kind.ERROR, {"id": None, "code": "shutting_down", "message": "going away"}))
        p.close()

    for make in range(2):
        p, path = peer(answer)
        if make == 0:
            with Client(path, timeout=WAIT_S, lanes=False) as c:
                with pytest.raises(ShmserveError) as info:
                    c.models()
                assert info.value.code is ErrorCode.SHUTTING_DOWN and info.value.message == "going away"
                p.listener.close()
                with pytest.raises(ConnectionClosed, match="no shmserve server"):
                    c.models()  # a new connection is tried, and nobody listens
        else:
            async def main():
                async with AsyncClient(path, timeout=WAIT_S, lanes=False) as c:
                    with pytest.raises(ShmserveError) as info:
                        await c.models()
                    assert info.value.code is ErrorCode.SHUTTING_DOWN
                    p.listener.close()
                    with pytest.raises(ConnectionClosed, match="no shmserve server"):
                        await c.models()

            asyncio.run(main())


def test_a_server_gone_mid_payload_is_connection_closed_not_a_hang(peer):
    def answer(p, kind, meta):
        p.send(protocol.encode_frame(Kind.RESULT, {"id": meta["id"], "outputs": [
            {"name": "y", "dtype": "uint8", "shape": [1 << 20]}]}, 1 << 20) + bytes(1000))
        p.close()

    _, path = peer(answer)
    with Client(path, timeout=WAIT_S, lanes=False) as c:
        with pytest.raises(ConnectionClosed, match="closed the connection"):
            c.infer("m", {"x": np.ones(4, np.uint8)})

    _, path = peer(answer)

    async def main():
        async with AsyncClient(path, timeout=WAIT_S, lanes=False) as c:
            with pytest.raises(ConnectionClosed, match="closed the connection"):
                await c.infer("m", {"x": np.ones(4, np.uint8)})

    asyncio.run(asyncio.wait_for(main(), WAIT_S))


# -- descriptors --------------------------------------------------------------------------

def region_fd(size: int) -> int:
    fd = os.memfd_create("shmserve-test-region")
    os.ftruncate(fd, size)
    return fd


def test_a_granted_region_is_mapped_and_a_stray_descriptor_is_closed(peer):
    read_end, stray = pipe_end()

    def answer(p, kind, meta):
        if kind == Kind.HEALTH:  # a descriptor with an answer that carries none: nobody takes it
            p.send_fds(frame(Kind.REPLY, {"id": meta["id"], "state": "ready"}), [stray])
            return
        size = meta["size"]
        real = region_fd(size if size != 12345 else 4096)  # 12345: a region smaller than it says
        p.send_fds(frame(Kind.REGION, {"id": meta["id"], "region": 7, "size": size}), [real])
        os.close(real)

    _, path = peer(answer)
    with Client(path, timeout=WAIT_S, lanes=False) as c:
        region = c.open_region(8192)
        region.buf[:4] = b"abcd"  # mapped, writable
        assert region.id == 7 and region.size == 8192
        with pytest.raises(ShmserveError) as info:
            c.open_region(12345)  # never mapped: touching the missing pages would be SIGBUS
        assert info.value.code is ErrorCode.INTERNAL and "smaller" in info.value.message
        assert c.health() == {"state": "ready"}  # the connection goes on
        os.close(stray)
        assert not all_closed(read_end)  # the client's copy, held by its session
    assert wait_closed(read_end)  # closed with the client
    os.close(read_end)


def test_a_region_granted_after_its_async_caller_gave_up_is_closed(peer):
    read_end, write_end = pipe_end()
    asked = threading.Event()

    def answer(p, kind, meta):
        if kind == Kind.OPEN_REGION:
            p.held.append(meta)
            asked.set()
        else:
            p.send_fds(frame(Kind.REGION, {"id": p.held[0]["id"], "region": 1, "size": 4096}), [write_end])
            p.send(frame(Kind.REPLY, {"id": meta["id"], "state": "ready"}))

    _, path = peer(answer)

    async def main():
        async with AsyncClient(path, timeout=WAIT_S, lanes=False) as c:
            task = asyncio.ensure_future(c.open_region(4096))
            await asyncio.get_running_loop().run_in_executor(None, asked.wait, WAIT_S)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await c.health()) == {"state": "ready"}  # after the late REGION answer

    asyncio.run(asyncio.wait_for(main(), WAIT_S))
    os.close(write_end)
    assert wait_closed(read_end)
    os.close(read_end)


def test_a_refused_zero_copy_region_is_asked_again_smaller_then_without_a_lane():
    """A region limit (overloaded) refuses the default 64 MiB region: the plan asks next for only
    what the call needs, then for a region without a lane, then gives up with the server's
    answer; any other refusal is raised at once."""
    from shmserve.client.planning import DEFAULT_REGION_BYTES, ZeroCopyPlan
    from shmserve.spec import ModelSpec

    spec = ModelSpec.from_dict({"name": "m", "backend": "python",
                                "inputs": [{"name": "x", "dtype": "uint8", "shape": ["n"]}],
                                "outputs": [{"name": "y", "dtype": "uint8", "shape": ["n"]}]})
    overloaded = ShmserveError(ErrorCode.OVERLOADED, "limit (max_region_bytes_per_uid)")
    plan = ZeroCopyPlan(spec, "m", {"x": ((100,), np.uint8)}, None, [])
    assert plan.region_size == DEFAULT_REGION_BYTES and plan.lane == "m"
    plan.refused(overloaded)
    assert plan.region_size == plan.needed < 4096 and plan.lane == "m"
    plan.refused(overloaded)
    assert plan.lane is None and plan.region is None
    with pytest.raises(ShmserveError) as info:
        plan.refused(overloaded)
    assert info.value is overloaded
    plan = ZeroCopyPlan(spec, "m", {"x": ((100,), np.uint8)}, None, [])
    too_large = ShmserveError(ErrorCode.TOO_LARGE, "too large")
    assert plan.refused(too_large) is True  # the server's limit is unknown: learn it and ask again
    assert plan.limited(1 << 20) == 1 << 20 and plan.region_size == 1 << 20
    with pytest.raises(ShmserveError) as info:  # known now: the server's answer stands
        plan.refused(too_large)
    assert info.value is too_large
    plan = ZeroCopyPlan(spec, "m", {"x": ((4 << 20,), np.uint8)}, None, [], region_limit=1 << 20)
    assert plan.region_size == plan.needed > 4 << 20  # never less than the call needs: the server says why


def test_a_zero_copy_call_is_planned_again_from_another_versions_spec_or_says_what_changed():
    """A zero-copy call's plan (the version it names, its input indices, the output names) is made
    again from a new version's spec: tensors listed in another order get their new indices; inputs
    the new version refuses, or outputs that would not fit the call's space, fail with the code the
    new version's workers would give and a message naming both versions."""
    from shmserve.client.planning import call_plan
    from shmserve.spec import ModelSpec

    def spec(version, inputs, outputs, shape=("n",)):
        return ModelSpec.from_dict({"name": "m", "backend": "python", "version": version,
                                    "inputs": [{"name": n, "dtype": "float32", "shape": list(shape)} for n in inputs],
                                    "outputs": [{"name": n, "dtype": "float32", "shape": list(shape)}
                                                for n in outputs]})

    buf = bytearray(4096)
    a, b = np.ndarray((5,), np.float32, buf, 0), np.ndarray((5,), np.float32, buf, 64)
    inputs = {"a": (0, a), "b": (64, b)}
    first = call_plan("m", spec(1, "ab", "ds"), inputs, 128, None)
    assert first.version == 1 and [d[:2] for d in first.described] == [(0, 0), (1, 64)] and first.outputs == ("d", "s")
    again = call_plan("m", spec(2, "ba", "sd"), inputs, 128, first)
    assert again.version == 2 and [d[:2] for d in again.described] == [(1, 0), (0, 64)] and again.outputs == ("s", "d")
    with pytest.raises(ShmserveError) as info:
        call_plan("m", spec(3, "ab", "ds", shape=(8,)), inputs, 128, again)
    assert info.value.code is ErrorCode.BAD_SHAPE
    assert "from version 2 to version 3" in info.value.message and "make a new zero_copy call" in info.value.message
    with pytest.raises(ShmserveError) as info:  # 2 outputs of 20 bytes: the second at 64, ending at 84
        call_plan("m", spec(4, "ab", "ds"), inputs, 83, again)
    assert info.value.code is ErrorCode.OUTPUT_TOO_LARGE and "84 bytes" in info.value.message
    assert call_plan("m", spec(4, "ab", "ds"), inputs, 84, again).version == 4
    with pytest.raises(ShmserveError) as info:  # planned the first time: the server's own check follows
        call_plan("m", spec(1, "ac", "ds"), inputs, 128, None)
    assert info.value.code is ErrorCode.BAD_INPUT and "version" not in info.value.message


# -- a server that goes away, and the next one ------------------------------------------------

def models_reply(name: str):
    """An answer to every MODELS request: one model named ``name``; every other request is held."""
    def answer(p, kind, meta):
        if kind is Kind.MODELS:
            p.send(frame(Kind.REPLY, {"id": meta["id"], "models": [{"name": name}]}))
        else:
            p.held.append((kind, meta))
    return answer


def gone(p: Peer, path: str) -> None:
    """The server dies: its connection and listener closed, its socket file left behind (as a
    killed server leaves it; the next one replaces it)."""
    p.listener.close()
    os.unlink(path)
    p.close()


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_a_call_after_the_server_went_away_goes_to_the_next_one_and_one_in_flight_fails_once(tmp_path, kind):
    """A call that found its connection over never reached a server: it is made on a new connection
    to whoever serves the socket now.  A call in flight when the server went away may have run:
    it fails with ConnectionClosed (saying so) and is never sent again."""
    path = str(tmp_path / "s.sock")
    first = Peer(path, models_reply("first"))
    peers = [first]
    try:
        async def calls(c, call):
            assert (await call(c.models()))[0]["name"] == "first"
            gone(first, path)
            second = Peer(path, models_reply("second"))
            peers.append(second)
            assert (await call(c.models()))[0]["name"] == "second"  # never reached the first: made again
            held = asyncio.ensure_future(call(c.info())) if kind == "async" else None
            if held is None:
                threading.Timer(0.2, gone, (second, path)).start()
                with pytest.raises(ConnectionClosed, match="may have run"):
                    c.info()
            else:
                while not second.held:
                    await asyncio.sleep(0.01)
                gone(second, path)
                with pytest.raises(ConnectionClosed, match="may have run"):
                    await held
            assert [k for k, _ in second.held] == [Kind.INFO]
            third = Peer(path, models_reply("third"))
            peers.append(third)
            assert (await call(c.models()))[0]["name"] == "third"
            assert third.held == []  # the info call in flight was not sent again

        async def same(value):
            return await value if asyncio.iscoroutine(value) else value

        if kind == "blocking":
            with Client(path, timeout=WAIT_S, lanes=False) as c:
                asyncio.run(calls(c, same))
        else:
            async def main():
                async with AsyncClient(path, timeout=WAIT_S, lanes=False) as c:
                    await calls(c, same)
            asyncio.run(asyncio.wait_for(main(), 3 * WAIT_S))
    finally:
        for p in peers:
            p.stop()


def test_a_closed_client_does_not_connect_again(peer):
    p, path = peer(models_reply("m"))
    c = Client(path, timeout=WAIT_S, lanes=False)
    c.close()
    with pytest.raises(ConnectionClosed, match="client closed"):
        c.models()
