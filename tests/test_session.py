"""The client's sans-I/O session, driven with byte strings only (no server, no socket).

Requests encode to the frames docs/protocol.md documents; the server's answers, fed split
at every byte boundary (through ``receive_data`` and through ``read_buffer``/``read_done``,
as the pumps do) and in chunks hypothesis picks, give the same typed events; payloads land
in the returned arrays; descriptors pair with REGION answers and are closed when nobody takes
them; every malformed answer ends the connection with ConnectionFailed and never raises.
"""

from __future__ import annotations

import math
import os
import struct

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmserve import layout, protocol
from shmserve.errors import BadArgument, ConnectionClosed, ErrorCode, ShmserveError
from shmserve.protocol import FRAME_HEADER, Kind, TensorMeta
from shmserve.session import (NEED_DATA, NOT_SENT, ClientSession, ConnectionFailed, InferResult, Placement,
                              RegionGranted, RegionResult, Reply, RequestFailed, check_tensor)

EVENT_TYPES = (InferResult, RegionResult, Reply, RegionGranted, RequestFailed, ConnectionFailed)


def frame(kind: Kind, meta: dict, payload: bytes = b"") -> bytes:
    return protocol.encode_frame(kind, meta, len(payload)) + payload


def result(rid: int, outputs: list[dict], payload: bytes = b"") -> bytes:
    return frame(Kind.RESULT, {"id": rid, "outputs": outputs}, payload)


def drain(session: ClientSession) -> list:
    """Events until NEED_DATA; stops at ConnectionFailed (which next_event repeats)."""
    out = []
    while (event := session.next_event()) is not NEED_DATA:
        out.append(event)
        if type(event) is ConnectionFailed:
            break
    return out


def pump(session: ClientSession, stream: bytes, cuts=(), fds: dict[int, int] | None = None, *,
         via_buffer: bool) -> list:
    """Feed ``stream`` split at ``cuts`` the way a socket pump does: through ``read_buffer``/
    ``read_done`` (each read at most what the buffer holds) or ``receive_data``.  ``fds``:
    stream position -> descriptor, handed over with the read that contains that byte (as the
    kernel does with SCM_RIGHTS).  Returns every event."""
    events, pos = [], 0
    fds = dict(fds or {})
    for end in sorted({min(cut, len(stream)) for cut in cuts} | {len(stream)}):
        while pos < end and not (events and type(events[-1]) is ConnectionFailed):
            if via_buffer:
                buf = session.read_buffer()
                n = min(len(buf), end - pos)
                buf[:n] = stream[pos:pos + n]
            else:
                n = end - pos
            passed = [fds.pop(at) for at in sorted(fds) if at < pos + n]
            if passed:
                session.receive_fds(passed)
            if via_buffer:
                session.read_done(n)
            else:
                session.receive_data(stream[pos:pos + n])
            pos += n
            events += drain(session)
    return events


def summary(event):
    """An event as plain data (arrays as dtype, shape and bytes; errors as code and message)."""
    if type(event) is InferResult:
        return ("result", event.request_id,
                {name: (a.dtype.str, a.shape, layout.encode_bytes(a) if a.dtype == object else a.tobytes())
                 for name, a in event.outputs.items()})
    if type(event) is RequestFailed:
        return ("failed", event.request_id, event.error.code, event.error.message)
    if type(event) is RegionGranted:
        return ("region", event.request_id, event.region, event.size, event.lane)  # the fd is checked apart
    if type(event) is ConnectionFailed:
        return ("connection failed", event.code, event.message)
    return event


def pipe_end() -> tuple[int, int]:
    """(read end, write end): once every copy of the write end is closed, the read end says EOF."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    return r, w


def all_closed(read_end: int) -> bool:
    try:
        return os.read(read_end, 1) == b""
    except BlockingIOError:
        return False  # a copy of the write end is still open somewhere


# -- requests ---------------------------------------------------------------------------

def decode_request(parts: list) -> tuple[tuple, dict, bytes]:
    """(header fields, metadata, data) of one request, read back as the server reads it."""
    data = b"".join(bytes(p) for p in parts)
    header = FRAME_HEADER.unpack_from(data)
    conn = protocol.Connection(protocol.Role.SERVER)
    conn.receive_data(data)
    ev = conn.next_event()
    assert isinstance(ev, protocol.Frame), ev
    sink = bytearray(ev.data_len)
    if ev.data_len:
        conn.accept_payload([sink])
        assert isinstance(conn.next_event(), protocol.PayloadDone)
    assert conn.next_event() is NEED_DATA
    return header, ev.meta, bytes(sink)


def test_requests_encode_to_the_documented_frames():
    s = ClientSession()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    flag = np.array([True])
    empty = np.zeros((0, 4), np.int64)
    rid, parts = s.infer("m", {"x": x, "flag": flag, "empty": empty}, 7.5)
    header, meta, data = decode_request(parts)
    assert rid == 1 and header[:3] == (b"SV", protocol.PROTOCOL_VERSION, Kind.INFER) and header[4] == 25
    assert meta == {"id": 1, "model": "m", "timeout_s": 7.5, "inputs": [
        {"name": "x", "dtype": "float32", "shape": [2, 3]}, {"name": "flag", "dtype": "bool", "shape": [1]},
        {"name": "empty", "dtype": "int64", "shape": [0, 4]}]}
    assert data == x.tobytes() + flag.tobytes()
    request = protocol.parse_infer(meta, zero_copy=False)  # what the server will accept
    assert [t.name for t in request.inputs] == ["x", "flag", "empty"]
    # one part per non-empty input, sent from the caller's own memory: no copy
    assert len(parts) == 3 and np.shares_memory(np.frombuffer(parts[1], np.uint8), x)

    inputs = [TensorMeta("x", "uint8", (100,), 65536), TensorMeta("w", "float16", (2, 2), 66560)]
    rid, parts = s.infer_region("m", inputs, 3, 70000, 4096, 2.0)
    header, meta, data = decode_request(parts)
    assert rid == 2 and header[2] == Kind.INFER_REGION and header[4] == 0 and data == b""
    assert meta == {"id": 2, "model": "m", "region": 3, "output_offset": 70000, "output_capacity": 4096,
                    "timeout_s": 2.0, "inputs": [
                        {"name": "x", "dtype": "uint8", "shape": [100], "offset": 65536},
                        {"name": "w", "dtype": "float16", "shape": [2, 2], "offset": 66560}]}
    assert protocol.parse_infer(meta, zero_copy=True).output_capacity == 4096

    controls = [(s.open_region(8192), Kind.OPEN_REGION, {"size": 8192}),
                (s.open_region(8192, "m"), Kind.OPEN_REGION, {"size": 8192, "lane": "m"}),
                (s.close_region(3), Kind.CLOSE_REGION, {"region": 3}),
                (s.models(), Kind.MODELS, {}), (s.health(), Kind.HEALTH, {}), (s.info(), Kind.INFO, {})]
    for expected_id, ((rid, parts), kind, fields) in enumerate(controls, start=3):
        assert rid == expected_id and len(parts) == 1
        body = orjson.dumps({"id": rid, **fields})
        assert parts[0] == FRAME_HEADER.pack(b"SV", 1, kind, len(body), 0) + body  # byte for byte
    assert s.reserve_id() == 9 and s.last_request_id == 9 and s.models()[0] == 10


def test_an_unsupported_dtype_is_refused_before_an_id_is_taken():
    s = ClientSession()
    with pytest.raises(ShmserveError) as info:
        s.infer("m", {"x": np.array([object()])}, 1.0)
    assert info.value.code is ErrorCode.BAD_DTYPE and "'x'" in info.value.message
    assert s.health()[0] == 1


def test_bytes_and_bfloat16_inputs_encode_to_what_the_server_accepts():
    s = ClientSession()
    text = np.array([[b"ab", "é"], [b"", b"\x00"]], dtype=object)
    half = np.arange(3, dtype=np.float32).astype(layout.numpy_dtype("bfloat16"))
    rid, parts = s.infer("m", {"text": text, "half": half}, 1.0)
    header, meta, data = decode_request(parts)
    packed = layout.encode_bytes(text)
    assert meta["inputs"] == [{"name": "text", "dtype": "bytes", "shape": [2, 2], "nbytes": len(packed)},
                              {"name": "half", "dtype": "bfloat16", "shape": [3]}]
    assert data == packed + half.tobytes() and header[4] == len(data)
    request = protocol.parse_infer(meta, zero_copy=False)
    assert [t.nbytes for t in request.inputs] == [len(packed), 6]
    with pytest.raises(BadArgument) as info:
        s.infer("m", {"text": np.array([b"a", 1.5], dtype=object)}, 1.0)
    assert info.value.code is ErrorCode.BAD_DTYPE and "element 1" in info.value.message
    for dtype in (object, "bytes"):
        with pytest.raises(BadArgument) as info:
            check_tensor("x", (2,), dtype)
        assert info.value.code is ErrorCode.BAD_DTYPE and "infer()" in info.value.message
    assert check_tensor("x", (2,), "bfloat16") == ((2,), layout.numpy_dtype("bfloat16"))


def test_bytes_outputs_are_unpacked_and_a_malformed_one_fails_only_its_request():
    s = ClientSession()
    bad, good = s.infer("m", {}, 1.0)[0], s.infer("m", {}, 1.0)[0]
    region = s.infer_region("m", [], 1, 0, 4096, 1.0)[0]
    packed = layout.encode_bytes([b"xy", b""])
    half = np.ones(2, layout.numpy_dtype("bfloat16"))
    stream = (result(bad, [{"name": "y", "dtype": "bytes", "shape": [1], "nbytes": 6}], struct.pack("<I", 3) + b"ab")
              + result(good, [{"name": "y", "dtype": "bytes", "shape": [2], "nbytes": len(packed)},
                              {"name": "h", "dtype": "bfloat16", "shape": [2]},
                              {"name": "none", "dtype": "bytes", "shape": [0, 3], "nbytes": 0}],
                       packed + half.tobytes())
              + frame(Kind.RESULT_REGION, {"id": region, "outputs": [
                  {"name": "y", "dtype": "bytes", "shape": [1], "nbytes": 4, "offset": 0}]}))
    first, second, third = pump(s, stream, range(0, len(stream), 5), via_buffer=True)
    assert type(first) is RequestFailed and first.error.code is ErrorCode.INTERNAL and "'y'" in first.error.message
    assert type(second) is InferResult and second.request_id == good
    assert second.outputs["y"].tolist() == [b"xy", b""] and second.outputs["none"].shape == (0, 3)
    assert second.outputs["h"].dtype == half.dtype and second.outputs["h"].tobytes() == half.tobytes()
    assert type(third) is RequestFailed and third.error.code is ErrorCode.BAD_DTYPE
    assert s.failure is None


# -- answers, split at every boundary -----------------------------------------------------

def conversation() -> tuple[ClientSession, bytes, int]:
    """A session with a request of every kind outstanding and the server's answers (not in
    request order: only ids match them) as one stream; and where the REGION answer starts."""
    s = ClientSession()
    x = np.arange(10, dtype=np.float32)
    s.infer("m", {"x": x}, 5.0)  # 1
    s.infer_region("m", [TensorMeta("x", "uint8", (8,), layout.LANE_BYTES)], 3, layout.LANE_BYTES + 4096, 4096,
                   5.0)  # 2
    s.open_region(8192, "m")  # 3
    s.models()  # 4
    s.health()  # 5
    s.info()  # 6
    s.close_region(3)  # 7
    s.infer("nope", {"x": x}, 5.0)  # 8
    s.infer("m", {"x": x}, 5.0)  # 9
    y = np.arange(10, dtype=np.float32).reshape(2, 5) * 1.5
    z = np.array(-7, np.int64)
    before = (result(1, [{"name": "y", "dtype": "float32", "shape": [2, 5]},
                         {"name": "z", "dtype": "int64", "shape": []},
                         {"name": "e", "dtype": "uint8", "shape": [0]}], y.tobytes() + z.tobytes())
              + frame(Kind.REPLY, {"id": 5, "state": "ready", "models": {"m": {"state": "ready"}}}))
    stream = (before
              + frame(Kind.REGION, {"id": 3, "region": 3, "size": layout.LANE_BYTES + 8192,
                                    "lane": {"model": "m", "data_offset": layout.LANE_BYTES, "slots": 16}})
              + frame(Kind.RESULT_REGION, {"id": 2, "outputs": [
                  {"name": "y", "dtype": "uint8", "shape": [8], "offset": layout.LANE_BYTES + 4096}]})
              + frame(Kind.REPLY, {"id": 4, "models": [{"name": "m", "backend": "python"}]})
              + frame(Kind.ERROR, {"id": 8, "code": "unknown_model", "message": "no model 'nope'"})
              + frame(Kind.REPLY, {"id": 6, "version": "0.1.0"})
              + frame(Kind.REPLY, {"id": 7, "closed": 3})
              + result(9, [{"name": "none", "dtype": "float64", "shape": [0, 3]}]))
    return s, stream, len(before)


EXPECTED = [
    ("result", 1, {"y": ("<f4", (2, 5), (np.arange(10, dtype=np.float32) * 1.5).tobytes()),
                   "z": ("<i8", (), np.array(-7, np.int64).tobytes()), "e": ("|u1", (0,), b"")}),
    Reply(5, {"state": "ready", "models": {"m": {"state": "ready"}}}),
    ("region", 3, 3, layout.LANE_BYTES + 8192, {"model": "m", "data_offset": layout.LANE_BYTES, "slots": 16}),
    RegionResult(2, (Placement("y", np.dtype(np.uint8), (8,), layout.LANE_BYTES + 4096),)),
    Reply(4, [{"name": "m", "backend": "python"}]),
    ("failed", 8, ErrorCode.UNKNOWN_MODEL, "no model 'nope'"),
    Reply(6, {"version": "0.1.0"}),
    Reply(7, {"closed": 3}),
    ("result", 9, {"none": ("<f8", (0, 3), b"")}),
]


def run_conversation(cuts, *, via_buffer: bool, write_end: int) -> list:
    s, stream, region_at = conversation()
    fd = os.dup(write_end)
    events = pump(s, stream, cuts, {region_at: fd}, via_buffer=via_buffer)
    (grant,) = [e for e in events if type(e) is RegionGranted]
    assert grant.fd == fd  # the descriptor passed with the REGION answer's bytes
    os.close(grant.fd)
    assert s.next_event() is NEED_DATA and not s._outstanding
    s.close()
    return [summary(e) for e in events]


@pytest.mark.parametrize("via_buffer", [False, True], ids=["receive_data", "read_buffer"])
def test_answers_split_at_every_byte_boundary_give_the_same_events(via_buffer):
    _, stream, _ = conversation()
    read_end, write_end = pipe_end()
    assert run_conversation((), via_buffer=via_buffer, write_end=write_end) == EXPECTED
    assert run_conversation(range(len(stream)), via_buffer=via_buffer, write_end=write_end) == EXPECTED  # byte by byte
    for cut in range(1, len(stream)):
        assert run_conversation((cut,), via_buffer=via_buffer, write_end=write_end) == EXPECTED, cut
    for cut in range(1, len(stream), 5):
        for cut2 in range(cut + 1, len(stream), 37):
            assert run_conversation((cut, cut2), via_buffer=via_buffer, write_end=write_end) == EXPECTED
    os.close(write_end)
    assert all_closed(read_end)  # every descriptor handed over was closed: none leaked
    os.close(read_end)


@given(st.lists(st.integers(1, 400), max_size=40), st.booleans())
@settings(max_examples=300, deadline=None)
def test_answers_in_any_chunks_give_the_same_events(sizes, via_buffer):
    cuts, pos = [], 0
    for size in sizes:
        pos += size
        cuts.append(pos)
    read_end, write_end = pipe_end()
    try:
        assert run_conversation(cuts, via_buffer=via_buffer, write_end=write_end) == EXPECTED
        os.close(write_end)
        assert all_closed(read_end)
    finally:
        os.close(read_end)


outputs_strategy = st.lists(st.tuples(st.sampled_from(protocol.SUPPORTED_DTYPES),
                                      st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=5)


@given(outputs_strategy, st.integers(1, 64), st.randoms(use_true_random=False))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_result_payloads_land_in_the_returned_arrays(outputs, read_size, rnd):
    s = ClientSession()
    rid, _ = s.infer("m", {}, 1.0)
    metas, payload, want = [], b"", {}
    for i, (dtype, shape) in enumerate(outputs):
        if dtype == "bytes":  # elements of any length, empty ones among them, serialized
            data = layout.encode_bytes([rnd.randbytes(rnd.randrange(3)) for _ in range(math.prod(shape))])
        else:
            data = rnd.randbytes(protocol.tensor_nbytes(dtype, shape))
        metas.append(protocol.tensor_wire(f"o{i}", dtype, shape, len(data)))
        want[f"o{i}"] = (layout.numpy_dtype(dtype).str, tuple(shape), data)
        payload += data
    stream = result(rid, metas, payload)
    events = pump(s, stream, range(0, len(stream), read_size), via_buffer=True)
    assert [summary(e) for e in events] == [("result", rid, want)]


def test_a_payload_is_read_straight_into_its_array():
    s = ClientSession()
    rid, _ = s.infer("m", {}, 1.0)
    y = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    stream = result(rid, [{"name": "y", "dtype": "uint8", "shape": [1 << 20]}], y.tobytes())
    head = len(stream) - y.nbytes + 100  # the header, the metadata and 100 payload bytes in the first read
    seen = []
    pos = 0
    while True:
        buf = s.read_buffer()
        n = min(len(buf), (head if pos == 0 else 65536), len(stream) - pos)
        buf[:n] = stream[pos:pos + n]
        if pos:
            seen.append(buf)
        s.read_done(n)
        pos += n
        events = drain(s)
        if events:
            break
    (event,) = events
    out = event.outputs["y"]
    np.testing.assert_array_equal(out, y)
    assert seen and all(np.shares_memory(np.frombuffer(b, np.uint8), out) for b in seen)  # no copy of ours


# -- descriptors --------------------------------------------------------------------------

def test_descriptors_pair_with_region_answers_in_order_and_leftovers_are_closed():
    s = ClientSession()
    ends = [pipe_end() for _ in range(4)]
    a, _ = s.open_region(4096)
    b, _ = s.open_region(4096)
    s.receive_fds([ends[0][1], ends[1][1], ends[2][1]])
    events = pump(s, frame(Kind.REGION, {"id": a, "region": 1, "size": 4096})
                  + frame(Kind.REGION, {"id": b, "region": 2, "size": 4096}), via_buffer=True)
    assert [(e.request_id, e.region, e.fd) for e in events] == [(a, 1, ends[0][1]), (b, 2, ends[1][1])]
    s.discard(events[0])  # an answer nobody waits for: its descriptor is closed
    assert all_closed(ends[0][0])
    assert not all_closed(ends[2][0])  # still held by the session
    s.close()
    assert all_closed(ends[2][0])  # never handed out: closed with the session
    s.receive_fds([ends[3][1]])  # after the end: closed at once
    assert all_closed(ends[3][0])
    os.close(ends[1][1])
    for r, _ in ends:
        os.close(r)
    s.close()  # idempotent


def test_a_region_answer_without_a_descriptor_fails_only_its_request():
    s = ClientSession()
    rid, _ = s.open_region(4096)
    health, _ = s.health()
    events = pump(s, frame(Kind.REGION, {"id": rid, "region": 1, "size": 4096})
                  + frame(Kind.REPLY, {"id": health, "state": "ready"}), via_buffer=False)
    assert [summary(e) for e in events] == [
        ("failed", rid, ErrorCode.INTERNAL, "the server's region answer carried no descriptor"),
        Reply(health, {"state": "ready"})]


def test_an_output_outside_the_output_area_fails_only_its_request():
    s = ClientSession()
    inside, _ = s.infer_region("m", [], 1, 4096, 4096, 1.0)
    outside, _ = s.infer_region("m", [], 1, 4096, 4096, 1.0)
    stream = (frame(Kind.RESULT_REGION, {"id": outside, "outputs": [
                  {"name": "y", "dtype": "float32", "shape": [1024], "offset": 4100}]})  # ends 4 bytes too far
              + frame(Kind.RESULT_REGION, {"id": inside, "outputs": [
                  {"name": "y", "dtype": "float32", "shape": [1024], "offset": 4096}]}))
    events = pump(s, stream, via_buffer=True)
    assert [summary(e) for e in events] == [
        ("failed", outside, ErrorCode.INTERNAL, "server placed an output outside the output area"),
        RegionResult(inside, (Placement("y", np.dtype(np.float32), (1024,), 4096),))]


# -- the connection's end -----------------------------------------------------------------

def test_the_servers_error_without_an_id_ends_the_connection_with_its_code():
    s = ClientSession()
    s.infer("m", {}, 1.0)
    events = pump(s, frame(Kind.ERROR, {"id": None, "code": "permission_denied", "message": "uid 5 may not"}),
                  via_buffer=True)
    assert [summary(e) for e in events] == [("connection failed", ErrorCode.PERMISSION_DENIED, "uid 5 may not")]
    error = events[0].error
    assert type(error) is ShmserveError and error.code is ErrorCode.PERMISSION_DENIED
    assert s.next_event() is events[0]  # for good
    with pytest.raises(ConnectionClosed, match="uid 5 may not"):
        s.health()


def test_an_error_answer_with_an_unknown_code_is_internal():
    s = ClientSession()
    rid, _ = s.health()
    (event,) = pump(s, frame(Kind.ERROR, {"id": rid, "code": "brand_new", "message": 42}), via_buffer=False)
    assert summary(event) == ("failed", rid, ErrorCode.INTERNAL, "42")


def test_the_first_failure_stands():
    s = ClientSession()
    s.health()
    first = s.fail("no answer from the server in time", ErrorCode.TIMEOUT)
    assert s.fail("the server closed the connection") is first and s.failure is first
    assert type(first.error) is ShmserveError and first.error.code is ErrorCode.TIMEOUT
    assert first.error is not first.error  # a new exception for each caller that raises it
    s.receive_data(frame(Kind.REPLY, {"id": 1}))  # ignored from now on
    s.read_done(len(s.read_buffer()))
    assert s.next_event() is first
    with pytest.raises(ConnectionClosed, match="in time"):
        s.ensure_open()
    s.close()
    assert s.failure is first


H = FRAME_HEADER.pack


def region_answer(**fields) -> bytes:
    return frame(Kind.REGION, {"id": 3, **fields})


def out(**fields) -> dict:
    return {"name": "y", "dtype": "uint8", "shape": [4], **fields}


MALFORMED = [  # (what, answer, what the failure says) — ids 1-4 are outstanding: INFER, INFER_REGION, OPEN_REGION, MODELS
    ("bad magic", b"XX" + bytes(14), "bad frame magic"),
    ("another version", H(b"SV", 9, Kind.REPLY, 2, 0) + b"{}", "protocol version 9"),
    ("a client's kind", frame(Kind.INFER, {"id": 1}), "kind 1 is not valid"),
    ("metadata not JSON", H(b"SV", 1, Kind.REPLY, 3, 0) + b"{x}", "not valid JSON"),
    ("metadata not an object", H(b"SV", 1, Kind.REPLY, 3, 0) + b"[4]", "must be a JSON object"),
    ("a payload on a reply", H(b"SV", 1, Kind.REPLY, 2, 4) + b"{}abcd", "carries no payload"),
    ("metadata too large", H(b"SV", 1, Kind.REPLY, protocol.MAX_META + 1, 0), "exceeds"),
    ("an id never sent", frame(Kind.REPLY, {"id": 99}), NOT_SENT),
    ("an id as a string", frame(Kind.REPLY, {"id": "4", "models": []}), NOT_SENT),
    ("an id as a list", frame(Kind.REPLY, {"id": [4], "models": []}), NOT_SENT),
    ("an id as true", frame(Kind.REPLY, {"id": True, "models": []}), NOT_SENT),
    ("no id", frame(Kind.REPLY, {"models": []}), NOT_SENT),
    ("an error for an id never sent", frame(Kind.ERROR, {"id": 99, "code": "internal", "message": "x"}), NOT_SENT),
    ("an error for an id as a list", frame(Kind.ERROR, {"id": [1], "code": "internal", "message": "x"}), NOT_SENT),
    ("one id answered twice", frame(Kind.REPLY, {"id": 4, "models": []}) * 2, NOT_SENT),
    ("the wrong kind of answer", frame(Kind.REPLY, {"id": 1}), "server answered INFER with REPLY"),
    ("a result for a region request", result(2, [out()], b"abcd"), "answered INFER_REGION with RESULT"),
    ("a payload shorter than the outputs", result(1, [out()], b"abc"), "payload does not match its outputs"),
    ("a payload longer than the outputs", result(1, [out()], b"abcde"), "payload does not match its outputs"),
    ("a shape too large to hold", result(1, [out(shape=[2**40, 2**40])], b"abcd"), "does not match"),
    ("outputs not a list", result(1, {"y": out()}, b"abcd"), "'outputs' must be a list"),
    ("17 outputs", result(1, [out(name=str(i), shape=[0]) for i in range(17)]), "at most 16"),
    ("an output not an object", result(1, [["y", "uint8", [4]]], b"abcd"), "must be an object"),
    ("an object dtype", result(1, [out(dtype="object", shape=[1])], bytes(8)), "not supported"),
    ("a dtype not a string", result(1, [out(dtype=["uint8"])], b"abcd"), "not supported"),
    ("a bytes output without nbytes", result(1, [out(dtype="bytes", shape=[1])], b"abcd"), "'nbytes'"),
    ("a bytes output too small for its shape", result(1, [out(dtype="bytes", shape=[2]) | {"nbytes": 4}],
                                                       b"abcd"), "at least 4 per element"),
    ("a name not a string", result(1, [out(name=3)], b"abcd"), "not a string"),
    ("one name twice", result(1, [out(), out()], bytes(8)), "appears twice"),
    ("a negative dimension", result(1, [out(shape=[-4])], b""), "non-negative"),
    ("a fractional dimension", result(1, [out(shape=[4.0])], b"abcd"), "non-negative"),
    ("a boolean dimension", result(1, [out(shape=[True])], b"a"), "non-negative"),
    ("nine dimensions", result(1, [out(shape=[1] * 9)], b"a"), "at most 8"),
    ("a shape not a list", result(1, [out(shape="4")], b"abcd"), "shape must be a list"),
    ("a placement without an offset", frame(Kind.RESULT_REGION, {"id": 2, "outputs": [out()]}), "'offset'"),
    ("a negative offset", frame(Kind.RESULT_REGION, {"id": 2, "outputs": [out(offset=-1)]}), "'offset'"),
    ("a region answer without a region", region_answer(size=4096), "positive integer 'region'"),
    ("region 0", region_answer(region=0, size=4096), "positive integer 'region'"),
    ("a size as a string", region_answer(region=1, size="4096"), "positive integer 'region' and 'size'"),
    ("a lane without a model", region_answer(region=1, size=1 << 20, lane={}), "lane"),
    ("a lane that does not fit", region_answer(region=1, size=4096, lane={"model": "m"}), "hold a lane"),
    ("models not a list", frame(Kind.REPLY, {"id": 4, "models": {"m": {}}}), "'models'"),
    ("a model without a name", frame(Kind.REPLY, {"id": 4, "models": [{"backend": "python"}]}), "'models'"),
]


def outstanding() -> ClientSession:
    s = ClientSession()
    s.infer("m", {"x": np.ones(4, np.uint8)}, 1.0)
    s.infer_region("m", [TensorMeta("x", "uint8", (4,), 0)], 1, 4096, 4096, 1.0)
    s.open_region(4096)
    s.models()
    return s


@pytest.mark.parametrize("answer,says", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
@pytest.mark.parametrize("split", ["whole", "byte by byte"])
def test_a_malformed_answer_ends_the_connection_and_nothing_else(answer, says, split):
    s = outstanding()
    read_end, write_end = pipe_end()
    s.receive_fds([write_end])  # a descriptor nobody will take
    events = pump(s, answer, range(len(answer)) if split != "whole" else (), via_buffer=True)
    failure = events[-1]
    assert type(failure) is ConnectionFailed and failure.code is None, events
    assert says in failure.message
    assert all(type(e) is not ConnectionFailed for e in events[:-1])
    assert type(failure.error) is ConnectionClosed and failure.error.code is ErrorCode.UNAVAILABLE
    assert s.next_event() is failure
    assert all_closed(read_end)  # the session closed what it held when the connection ended
    os.close(read_end)
    with pytest.raises(ConnectionClosed):
        s.models()


@given(st.data())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fuzzed_answers_never_raise(data):
    s, stream, _ = conversation()
    choice = data.draw(st.sampled_from(["random", "flipped", "truncated", "spliced"]))
    if choice == "random":
        stream = data.draw(st.binary(max_size=300))
    elif choice == "flipped":
        stream = bytearray(stream)
        for _ in range(data.draw(st.integers(1, 6))):
            stream[data.draw(st.integers(0, len(stream) - 1))] = data.draw(st.integers(0, 255))
        stream = bytes(stream)
    elif choice == "truncated":
        stream = stream[:data.draw(st.integers(0, len(stream)))]
    else:
        at = data.draw(st.integers(0, len(stream)))
        stream = stream[:at] + data.draw(st.binary(max_size=40)) + stream[at:]
    read_end, write_end = pipe_end()
    s.receive_fds([write_end])
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(stream))), max_size=8)))
    events = pump(s, stream, cuts, via_buffer=data.draw(st.booleans()))
    assert all(isinstance(e, EVENT_TYPES) for e in events)
    assert all(type(e) is not ConnectionFailed for e in events[:-1])
    for e in events:
        if type(e) is RegionGranted:
            os.close(e.fd)
    s.close()
    assert all_closed(read_end)
    os.close(read_end)


# -- CANCEL (issue 29) ------------------------------------------------------------------------

def test_a_cancel_is_sent_only_for_an_outstanding_request_and_its_answer_is_still_taken():
    """The session makes a CANCEL for a request it waits for; the request stays outstanding, so
    its one answer (CANCELLED, or the result it had) is read in step; nothing for a request not
    outstanding, nor once the connection is over."""
    session = ClientSession()
    rid, _ = session.infer("m", {"x": np.zeros(2, np.float32)}, 1.0)
    wire = session.cancel(rid)
    header = FRAME_HEADER.unpack_from(wire)
    assert header[2] == Kind.CANCEL and header[4] == 0
    assert orjson.loads(wire[FRAME_HEADER.size:]) == {"id": rid}
    assert session.cancel(rid + 1) is None  # never sent
    session.receive_data(protocol.error_frame(rid, ErrorCode.CANCELLED, "cancelled by the client"))
    [event] = drain(session)
    assert event.request_id == rid and event.error.code is ErrorCode.CANCELLED
    assert session.cancel(rid) is None  # answered: nothing left to cancel
    control, _ = session.models()
    assert session.cancel(control) is None  # a control call runs to its end
    rid, _ = session.infer_region("m", [], 1, 0, 64, 1.0)
    assert session.cancel(rid) is not None
    session.fail("gone")
    assert session.cancel(rid) is None
