"""The sans-I/O protocol: frames split at every boundary, payload sinks, limits, hostile bytes."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmserve import protocol
from shmserve.errors import ErrorCode
from shmserve.protocol import (NEED_DATA, Connection, Frame, Kind, PayloadDone, ProtocolError, ProtocolViolation,
                               Role, State)


def events(conn: Connection, sinks_for=None) -> list:
    out = []
    while True:
        ev = conn.next_event()
        if ev is NEED_DATA:
            return out
        out.append(ev)
        if isinstance(ev, Frame) and ev.data_len:
            if sinks_for is None:
                conn.discard_payload()
            else:
                conn.accept_payload(sinks_for(ev))
        if isinstance(ev, ProtocolError):
            return out


def infer_frame(rid=1, data=b"abcdefgh"):
    meta = {"id": rid, "model": "m", "inputs": [{"name": "x", "dtype": "uint8", "shape": [len(data)]}]}
    return protocol.encode_frame(Kind.INFER, meta, len(data)) + data


def test_one_frame_round_trip():
    conn = Connection(Role.SERVER)
    conn.receive_data(protocol.encode_frame(Kind.HEALTH, {"id": 7}))
    assert events(conn) == [Frame(Kind.HEALTH, {"id": 7}, 0)]
    assert conn.state is State.HEADER


def test_frames_split_at_every_boundary_land_in_sinks():
    stream = infer_frame(1, b"0123456789") + protocol.encode_frame(Kind.MODELS, {"id": 2}) + infer_frame(3, b"xyz")
    for cut in range(len(stream) + 1):
        for cut2 in range(cut, len(stream) + 1, 7):
            conn = Connection(Role.SERVER)
            sinks = []

            def sinks_for(ev):
                a, b = bytearray(3), bytearray(ev.data_len - 3)
                sinks.append((a, b))
                return [a, b]

            got = []
            for piece in (stream[:cut], stream[cut:cut2], stream[cut2:]):
                conn.receive_data(piece)
                got += events(conn, sinks_for)
            kinds = [type(e).__name__ if not isinstance(e, Frame) else e.kind.name for e in got]
            assert kinds == ["INFER", "PayloadDone", "MODELS", "INFER", "PayloadDone"], cut
            assert [bytes(a + b) for a, b in sinks] == [b"0123456789", b"xyz"]


def test_payload_can_be_received_directly_into_the_sink():
    conn = Connection(Role.SERVER)
    data = bytes(range(200))
    frame = infer_frame(1, data)
    header_len = len(frame) - len(data)
    conn.receive_data(frame[:header_len + 5])  # some payload arrives with the header
    ev = conn.next_event()
    assert isinstance(ev, Frame) and ev.data_len == 200
    target = np.zeros(200, np.uint8)
    conn.accept_payload([target])
    assert conn.payload_remaining == 195
    view = conn.payload_buffer()  # the socket layer would recv_into this
    assert len(view) == 195
    view[:100] = data[5:105]
    conn.payload_received(100)
    view = conn.payload_buffer()
    view[:95] = data[105:]
    conn.payload_received(95)
    assert isinstance(conn.next_event(), PayloadDone)
    assert target.tobytes() == data
    assert conn.payload_buffer() is None


def test_discarded_payload_is_skipped():
    conn = Connection(Role.SERVER)
    conn.receive_data(infer_frame(1, b"x" * 1000) + protocol.encode_frame(Kind.INFO, {"id": 2}))
    got = events(conn)
    assert [type(e) for e in got] == [Frame, PayloadDone, Frame] and got[2].kind is Kind.INFO


@pytest.mark.parametrize("mutate,code", [
    (lambda f: b"XX" + f[2:], ErrorCode.BAD_FRAME),
    (lambda f: f[:2] + bytes([9]) + f[3:], ErrorCode.VERSION_MISMATCH),
    (lambda f: f[:3] + bytes([Kind.RESULT]) + f[4:], ErrorCode.BAD_FRAME),  # a server kind sent to the server
    (lambda f: f[:3] + bytes([200]) + f[4:], ErrorCode.BAD_FRAME),
    (lambda f: f[:4] + struct.pack("<I", protocol.MAX_META + 1) + f[8:], ErrorCode.FRAME_TOO_LARGE),
    (lambda f: f[:8] + struct.pack("<Q", 2**63) + f[16:], ErrorCode.FRAME_TOO_LARGE),
])
def test_bad_headers(mutate, code):
    conn = Connection(Role.SERVER)
    conn.receive_data(mutate(infer_frame()))
    (ev,) = events(conn)
    assert isinstance(ev, ProtocolError) and ev.code is code
    assert conn.state is State.ERROR
    conn.receive_data(protocol.encode_frame(Kind.HEALTH, {"id": 1}))
    assert conn.next_event() is NEED_DATA  # nothing more after an error


def test_payload_on_a_kind_without_one_and_bad_metadata():
    for raw in (protocol.FRAME_HEADER.pack(b"SV", 1, Kind.HEALTH, 2, 5) + b"{}12345",
                protocol.FRAME_HEADER.pack(b"SV", 1, Kind.HEALTH, 3, 0) + b"[1]",
                protocol.FRAME_HEADER.pack(b"SV", 1, Kind.HEALTH, 4, 0) + b"{no}"):
        conn = Connection(Role.SERVER)
        conn.receive_data(raw)
        (ev,) = events(conn)
        assert isinstance(ev, ProtocolError) and ev.code is ErrorCode.BAD_FRAME


def test_accept_requires_matching_sizes_and_state():
    conn = Connection(Role.SERVER)
    with pytest.raises(RuntimeError):
        conn.accept_payload([])
    conn.receive_data(infer_frame(1, b"abcd"))
    conn.next_event()
    with pytest.raises(ValueError):
        conn.accept_payload([bytearray(3)])
    with pytest.raises(RuntimeError):
        conn.next_event()  # a decision is required first


def test_client_role_accepts_only_server_kinds():
    conn = Connection(Role.CLIENT)
    conn.receive_data(protocol.encode_frame(Kind.INFER, {"id": 1}))
    assert isinstance(conn.next_event(), ProtocolError)
    conn = Connection(Role.CLIENT)
    conn.receive_data(protocol.error_frame(4, ErrorCode.TIMEOUT, "late"))
    ev = conn.next_event()
    assert ev.kind is Kind.ERROR and ev.meta == {"id": 4, "code": "timeout", "message": "late"}


@given(st.binary(max_size=300), st.integers(1, 50))
@settings(max_examples=400)
def test_random_bytes_never_raise_unexpectedly(data, chunk):
    conn = Connection(Role.SERVER, max_data=4096)
    for i in range(0, len(data), chunk):
        conn.receive_data(data[i:i + chunk])
        for ev in events(conn, sinks_for=lambda ev: [bytearray(ev.data_len)]):
            assert isinstance(ev, (Frame, PayloadDone, ProtocolError))


@given(st.lists(st.sampled_from([Kind.HEALTH, Kind.MODELS, Kind.INFER, Kind.INFO]), min_size=1, max_size=6),
       st.lists(st.integers(1, 40), min_size=1, max_size=20))
@settings(max_examples=200)
def test_valid_streams_parse_identically_however_they_are_split(kinds, cuts):
    stream, expected = b"", []
    for i, kind in enumerate(kinds):
        if kind is Kind.INFER:
            stream += infer_frame(i, bytes([i]) * (i + 1))
            expected += ["INFER", "PayloadDone"]
        else:
            stream += protocol.encode_frame(kind, {"id": i})
            expected.append(kind.name)
    conn, got, pos = Connection(Role.SERVER), [], 0
    for cut in cuts + [len(stream)]:
        conn.receive_data(stream[pos:pos + cut])
        pos += cut
        got += events(conn, sinks_for=lambda ev: [bytearray(ev.data_len)])
    conn.receive_data(stream[pos:])
    got += events(conn, sinks_for=lambda ev: [bytearray(ev.data_len)])
    assert [e.kind.name if isinstance(e, Frame) else type(e).__name__ for e in got] == expected


def test_parse_infer_schema():
    good = {"id": 5, "model": "demo", "inputs": [{"name": "x", "dtype": "float32", "shape": [2, 3]}], "timeout_s": 1}
    req = protocol.parse_infer(good, zero_copy=False)
    assert req.inputs[0].nbytes == 24 and req.timeout_s == 1
    cases = [
        ({"id": -1}, ErrorCode.BAD_FRAME), ({"id": "1"}, ErrorCode.BAD_FRAME), ({"model": ""}, ErrorCode.BAD_FRAME),
        ({"inputs": {}}, ErrorCode.BAD_FRAME), ({"inputs": [{"name": "x", "dtype": "complex64", "shape": [1]}]},
                                                ErrorCode.BAD_DTYPE),
        ({"inputs": [{"name": "x", "dtype": "uint8", "shape": [-1]}]}, ErrorCode.BAD_SHAPE),
        ({"inputs": [{"name": "x", "dtype": "uint8", "shape": [1] * 9}]}, ErrorCode.BAD_SHAPE),
        ({"inputs": [{"name": "x", "dtype": "uint8", "shape": [1]}] * 2}, ErrorCode.BAD_INPUT),
        ({"timeout_s": 0}, ErrorCode.BAD_FRAME), ({"timeout_s": True}, ErrorCode.BAD_FRAME),
    ]
    for patch, code in cases:
        with pytest.raises(ProtocolViolation) as info:
            protocol.parse_infer(good | patch, zero_copy=False)
        assert info.value.code is code, patch
    zc = good | {"inputs": [{"name": "x", "dtype": "float32", "shape": [2, 3], "offset": 64}], "region": 1,
                 "output_offset": 128, "output_capacity": 64}
    assert protocol.parse_infer(zc, zero_copy=True).region == 1
    for patch in ({"region": 0}, {"output_offset": -1}, {"inputs": [{"name": "x", "dtype": "uint8", "shape": [1]}]}):
        with pytest.raises(ProtocolViolation) as info:
            protocol.parse_infer(zc | patch, zero_copy=True)
        assert info.value.code is ErrorCode.BAD_REGION


def test_parse_infer_priority():
    """``priority``: an integer in [0, 2**32 - 1], 0 when left out, on INFER and INFER_REGION;
    anything else is BAD_INPUT naming the field."""
    good = {"id": 5, "model": "demo", "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}]}
    assert protocol.parse_infer(good, zero_copy=False).priority == 0
    for value in (0, 1, 7, 2**32 - 1):
        assert protocol.parse_infer(good | {"priority": value}, zero_copy=False).priority == value
    zc = good | {"inputs": [{"name": "x", "dtype": "float32", "shape": [2], "offset": 0}], "region": 1,
                 "output_offset": 64, "output_capacity": 64, "priority": 3}
    assert protocol.parse_infer(zc, zero_copy=True).priority == 3
    for value in (-1, 2**32, 1.0, "1", True, None, [1]):
        with pytest.raises(ProtocolViolation) as info:
            protocol.parse_infer(good | {"priority": value}, zero_copy=False)
        assert info.value.code is ErrorCode.BAD_INPUT and "'priority'" in info.value.message, value


def test_encode_frame_layout():
    raw = protocol.encode_frame(Kind.MODELS, {"id": 1}, 0)
    magic, version, kind, meta_len, data_len = protocol.FRAME_HEADER.unpack_from(raw)
    assert (magic, version, kind, data_len) == (b"SV", protocol.PROTOCOL_VERSION, Kind.MODELS, 0)
    assert orjson.loads(raw[16:16 + meta_len]) == {"id": 1}


def test_mid_frame_is_true_exactly_while_a_header_or_metadata_is_incomplete():
    frame = infer_frame()
    end_of_meta = len(frame) - 8
    for cut in range(len(frame) + 1):
        conn = Connection(Role.SERVER)
        conn.receive_data(frame[:cut])
        events(conn, lambda ev: [bytearray(ev.data_len)])
        assert conn.mid_frame == (0 < cut < end_of_meta), cut


def test_close_stops_receiving_into_the_sinks():
    conn = Connection(Role.SERVER)
    sink = bytearray(8)
    conn.receive_data(infer_frame()[:-8])
    assert isinstance(conn.next_event(), Frame)
    conn.accept_payload([sink])
    assert conn.payload_buffer() is not None
    conn.close()
    conn.receive_data(b"abcdefgh")
    assert conn.state is State.ERROR and conn.payload_buffer() is None and conn.next_event() is NEED_DATA
    assert sink == bytearray(8) and not conn.mid_frame


# -- bytes tensors carry their size; no other tensor does ---------------------------------------

def test_a_bytes_tensor_descriptor_carries_nbytes():
    # the form shmserve.v2.service builds for a KServe v2 BYTES input
    items = [{"name": "s", "dtype": "bytes", "shape": [2, 3], "nbytes": 30},
             {"name": "b", "dtype": "bfloat16", "shape": [4]}]
    s, b = protocol.parse_tensor_list(items, "inputs", with_offset=False)
    assert (s.dtype, s.shape, s.nbytes, s.byte_size) == ("bytes", (2, 3), 30, 30)
    assert (b.dtype, b.nbytes, b.byte_size) == ("bfloat16", 8, None)
    assert s.to_wire() == items[0] and b.to_wire() == items[1]
    assert protocol.parse_tensor_list([s.to_wire(), b.to_wire()], "inputs", with_offset=False) == (s, b)
    zc = protocol.parse_tensor_list([items[0] | {"offset": 64}], "inputs", with_offset=True)[0]
    assert (zc.offset, zc.nbytes) == (64, 30) and zc.to_wire() == items[0] | {"offset": 64}
    assert protocol.parse_tensor_list([{"name": "e", "dtype": "bytes", "shape": [0], "nbytes": 0}], "inputs",
                                      with_offset=False)[0].nbytes == 0
    with pytest.raises(ValueError, match="does not follow from its shape"):
        protocol.tensor_nbytes("bytes", (1,))


@pytest.mark.parametrize("item,code", [
    ({"dtype": "bytes", "shape": [2]}, ErrorCode.BAD_FRAME),  # no nbytes
    ({"dtype": "bytes", "shape": [2], "nbytes": "8"}, ErrorCode.BAD_FRAME),
    ({"dtype": "bytes", "shape": [2], "nbytes": True}, ErrorCode.BAD_FRAME),
    ({"dtype": "bytes", "shape": [2], "nbytes": -1}, ErrorCode.BAD_FRAME),
    ({"dtype": "bytes", "shape": [2], "nbytes": protocol.MAX_DATA + 1}, ErrorCode.BAD_FRAME),
    ({"dtype": "bytes", "shape": [2], "nbytes": 7}, ErrorCode.BAD_INPUT),  # two lengths need 8
    ({"dtype": "bytes", "shape": [2**39, 2**39], "nbytes": 2**40}, ErrorCode.BAD_INPUT),
    ({"dtype": "uint8", "shape": [2], "nbytes": 2}, ErrorCode.BAD_FRAME),  # only bytes tensors carry it
    ({"dtype": "bfloat16", "shape": [2], "nbytes": 4}, ErrorCode.BAD_FRAME),
    ({"dtype": "string", "shape": [2], "nbytes": 8}, ErrorCode.BAD_DTYPE),
])
def test_nbytes_is_for_bytes_tensors_only_and_checked(item, code):
    with pytest.raises(ProtocolViolation) as info:
        protocol.parse_tensor_list([{"name": "x"} | item], "inputs", with_offset=False)
    assert info.value.code is code, info.value.message


@given(st.sampled_from(protocol.SUPPORTED_DTYPES), st.lists(st.integers(0, 2**12), max_size=3),
       st.one_of(st.none(), st.integers(-2, 2**41), st.text(max_size=2)))
@settings(max_examples=300)
def test_tensor_descriptors_are_accepted_only_with_a_size_that_can_hold_them(dtype, shape, nbytes):
    item = {"name": "x", "dtype": dtype, "shape": shape}
    if nbytes is not None:
        item["nbytes"] = nbytes
    try:
        (t,) = protocol.parse_tensor_list([item], "inputs", with_offset=False)
    except ProtocolViolation as exc:
        assert exc.code in (ErrorCode.BAD_FRAME, ErrorCode.BAD_INPUT)
        return
    if dtype == "bytes":
        assert t.nbytes == nbytes and 4 * int(np.prod(shape, dtype=object)) <= nbytes <= protocol.MAX_DATA
    else:
        assert nbytes is None and t.nbytes == protocol.tensor_nbytes(dtype, shape)


# -- CANCEL (issue 29) ------------------------------------------------------------------------

def test_a_cancel_frame_names_one_request_and_carries_nothing_else():
    """A CANCEL is a client kind with an id and no payload; a server reads it whole, however
    split; a client never accepts one (it is never an answer)."""
    wire = protocol.encode_frame(Kind.CANCEL, {"id": 7})
    for cut in range(len(wire) + 1):
        conn = Connection(Role.SERVER)
        conn.receive_data(wire[:cut])
        conn.receive_data(wire[cut:])
        ev = conn.next_event()
        assert ev == Frame(Kind.CANCEL, {"id": 7}, 0)
        assert protocol.parse_cancel(ev.meta) == 7
    conn = Connection(Role.SERVER)
    conn.receive_data(protocol.encode_frame(Kind.CANCEL, {"id": 7}, 8) + b"\0" * 8)
    assert ev_code(conn) is ErrorCode.BAD_FRAME  # a CANCEL carries no payload
    conn = Connection(Role.CLIENT)
    conn.receive_data(wire)
    assert ev_code(conn) is ErrorCode.BAD_FRAME


def ev_code(conn: Connection) -> ErrorCode:
    ev = conn.next_event()
    assert isinstance(ev, ProtocolError), ev
    return ev.code


@pytest.mark.parametrize("meta", [{}, {"id": -1}, {"id": 2**63}, {"id": "7"}, {"id": 7.0}, {"id": None},
                                  {"id": True}])
def test_a_cancel_without_a_request_id_is_bad_frame(meta):
    with pytest.raises(ProtocolViolation) as info:
        protocol.parse_cancel(meta)
    assert info.value.code is ErrorCode.BAD_FRAME
