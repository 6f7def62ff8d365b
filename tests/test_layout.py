"""The layout module: geometry, encode/decode round trips, and hostile bytes (errors, never crashes)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shmserve import layout
from shmserve.layout import LayoutError

size_classes = st.lists(st.tuples(st.integers(1, 4 * 1024 * 1024), st.integers(1, 8)), min_size=1,
                        max_size=layout.MAX_SIZE_CLASSES)
geometries = st.builds(
    lambda slots, classes, workers, ring_shift: layout.plan(
        slot_count=slots, size_classes=classes, max_workers=workers,
        ring_capacity=1 << max(ring_shift, (slots - 1).bit_length())),
    st.integers(1, 300), size_classes, st.integers(1, 16), st.integers(0, 10))


def make_header(geometry: layout.Geometry, instance="inst") -> bytearray:
    buf = bytearray(layout.HEADER_SIZE)
    layout.encode_header(buf, geometry, instance=instance, boot_id=b"b" * 16, created_unix_ns=123,
                         owner_pid=4242, owner_start_ticks=99)
    return buf


def test_geometry_regions_are_ordered_aligned_and_disjoint():
    g = layout.plan(slot_count=100, size_classes=[(3333, 5), (5 * 1024 * 1024, 2), (4096, 1)],
                    max_workers=3, ring_capacity=128)
    assert g.worker_table_off == layout.HEADER_SIZE
    assert g.ring_table_off >= g.worker_table_off + 3 * layout.WORKER_SIZE
    assert g.slot_table_off >= g.ring_table_off + 6 * g.ring_stride
    assert g.slot_table_off % layout.PAGE == 0
    assert g.data_off >= g.slot_table_off + 100 * layout.SLOT_SIZE
    assert g.data_off % layout.HUGE_PAGE == 0
    sizes = [c.extent_size for c in g.classes]
    assert sizes == sorted(sizes) == [4096, 4096, 6 * 1024 * 1024]  # 3333 rounds up to a page, 5 MiB to 2 MiB
    for c in g.classes:
        assert c.offset % layout.class_alignment(c.extent_size) == 0
        assert c.extent_size % layout.class_alignment(c.extent_size) == 0
    for a, b in zip(g.classes, g.classes[1:]):
        assert a.end <= b.offset
    assert g.classes[-1].end <= g.total_size == g.data_off + g.data_size


@pytest.mark.parametrize("kwargs", [
    dict(slot_count=0), dict(max_workers=0), dict(ring_capacity=3), dict(size_classes=[]),
    dict(size_classes=[(0, 1)]), dict(size_classes=[(4096, 0)]), dict(size_classes=[(4096, 1)] * 9),
])
def test_plan_rejects_impossible_parameters(kwargs):
    params = dict(slot_count=4, size_classes=[(4096, 1)], max_workers=1, ring_capacity=4) | kwargs
    with pytest.raises(ValueError):
        layout.plan(**params)


@given(geometries)
@settings(max_examples=200)
def test_header_roundtrip(geometry):
    buf = make_header(geometry)
    info = layout.decode_header(buf, geometry.total_size)
    assert info.geometry == geometry
    assert (info.instance, info.owner_pid, info.owner_start_ticks) == ("inst", 4242, 99)
    assert info.state == layout.ARENA_INITIALIZING


@given(st.binary(min_size=0, max_size=layout.HEADER_SIZE), st.integers(0, 2**40))
@settings(max_examples=300)
def test_random_header_bytes_raise_layout_error_only(data, size):
    data = data.ljust(layout.HEADER_SIZE, b"\0") if len(data) > 8 and data[:8] == layout.MAGIC else data
    try:
        layout.decode_header(data, size)
    except LayoutError:
        pass


@given(geometries, st.data())
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_valid_header_is_rejected_or_still_consistent(geometry, data):
    buf = make_header(geometry)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, 1023))
        buf[pos] = data.draw(st.integers(0, 255))
    try:
        info = layout.decode_header(buf, geometry.total_size)
    except LayoutError:
        return
    g = info.geometry  # whatever survived must still lie inside the segment, in order
    assert g.total_size == geometry.total_size
    assert g.worker_table_off < g.ring_table_off <= g.slot_table_off < g.data_off <= g.total_size
    assert all(g.data_off <= c.offset and c.end <= g.total_size for c in g.classes)


def test_specific_corruptions_are_named():
    g = layout.plan(slot_count=4, size_classes=[(4096, 2)], max_workers=1, ring_capacity=4)
    good = make_header(g)
    cases = {
        "magic": ("magic", b"NOTSHMSV"),
        "version": ("version", 99),
        "offsets": ("data_off", g.data_off + 4096),
        "size-class": ("n_classes", 0),
        "state": ("state", 17),
    }
    for what, (field, value) in cases.items():
        buf = bytearray(good)
        layout.HEADER.write(buf, 0, **{field: value})
        with pytest.raises(LayoutError):
            layout.decode_header(buf, g.total_size)
    with pytest.raises(LayoutError, match="segment has"):
        layout.decode_header(good, g.total_size + 4096)
    with pytest.raises(LayoutError, match="smaller than"):
        layout.decode_header(good[:100])


def test_status_word_packs_generation_and_state():
    word = layout.pack_status(7, 3)
    assert layout.unpack_status(word) == (7, 3)
    assert layout.unpack_status(layout.pack_status(2**32 + 5, 1)) == (5, 1)  # generation wraps


@pytest.fixture(scope="module")
def small_arena_buf():
    g = layout.plan(slot_count=2, size_classes=[(4096, 2)], max_workers=1, ring_capacity=2)
    buf = bytearray(g.total_size)
    layout.encode_header(buf, g, instance="x", boot_id=b"\0" * 16, created_unix_ns=0, owner_pid=1,
                         owner_start_ticks=0)
    return g, buf


def test_tensor_roundtrip(small_arena_buf):
    g, buf = small_arena_buf
    off = g.classes[0].offset + 64
    nbytes = layout.encode_tensor(buf, g, 1, 3, role=layout.ROLE_INPUT, name_index=2, dtype="float32",
                                  shape=(2, 3, 4), offset=off)
    assert nbytes == 96
    t = layout.decode_tensor(buf, g, 1, 3)
    assert (t.dtype, t.shape, t.offset, t.nbytes, t.role, t.name_index) == (
        np.dtype("float32"), (2, 3, 4), off, 96, layout.ROLE_INPUT, 2)
    layout.encode_tensor(buf, g, 0, 0, role=layout.ROLE_OUTPUT, name_index=0, dtype=np.int8, shape=(),
                         offset=off)
    assert layout.decode_tensor(buf, g, 0, 0).shape == ()
    layout.encode_tensor(buf, g, 0, 1, role=layout.ROLE_INPUT, name_index=0, dtype="uint8", shape=(100,),
                         offset=128, region=3)
    assert layout.decode_tensor(buf, g, 0, 1, {3: 228}).region == 3
    for sizes in (None, {3: 227}, {4: 10**9}):
        with pytest.raises(LayoutError):
            layout.decode_tensor(buf, g, 0, 1, sizes)


@given(st.binary(min_size=layout.TENSOR_SIZE, max_size=layout.TENSOR_SIZE))
@settings(max_examples=500)
def test_hostile_tensor_descriptors_never_escape_their_space(small_arena_buf, raw):
    g, buf = small_arena_buf
    base = g.tensor_off(0, 5)
    buf[base:base + layout.TENSOR_SIZE] = raw
    regions = {7: 10_000}
    try:
        t = layout.decode_tensor(buf, g, 0, 5, regions)
    except LayoutError:
        return
    if t.region == 0:
        assert g.data_off <= t.offset and t.offset + t.nbytes <= g.data_off + g.data_size
    else:
        assert t.region == 7 and t.offset + t.nbytes <= 10_000
    count = int(np.prod(t.shape, dtype=object))
    if t.dtype is layout.BYTES_DTYPE:  # its size is its data's: at least a length per element
        assert t.nbytes >= layout.BYTES_LENGTH.size * count
    else:
        assert t.nbytes == t.dtype.itemsize * count


@given(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**64 - 1), st.sampled_from(list(layout.DTYPE_CODES)))
def test_forged_offsets_are_rejected(small_arena_buf, dim, offset, dtype):
    g, buf = small_arena_buf
    base = g.tensor_off(1, 0)
    itemsize = layout.ITEMSIZES.get(dtype, layout.BYTES_LENGTH.size)
    layout.TENSOR.pack(buf, base, layout.DTYPE_CODES[dtype], 1, layout.ROLE_INPUT, 0, 0, offset,
                       max(dim, 0) * itemsize % 2**64, dim, *[0] * 7)
    try:
        t = layout.decode_tensor(buf, g, 1, 0)
    except LayoutError:
        return
    assume(t is not None)
    assert g.contains_data(t.offset, t.nbytes)


def test_bfloat16_and_bytes_descriptors_round_trip(small_arena_buf):
    g, buf = small_arena_buf
    off = g.classes[0].offset + 128
    bf16 = layout.numpy_dtype("bfloat16")
    assert layout.encode_tensor(buf, g, 1, 0, role=layout.ROLE_INPUT, name_index=0, dtype=bf16, shape=(3, 5),
                                offset=off) == 30
    t = layout.decode_tensor(buf, g, 1, 0)
    assert (t.dtype, t.shape, t.nbytes, layout.dtype_name(t.dtype)) == (bf16, (3, 5), 30, "bfloat16")
    assert layout.encode_tensor(buf, g, 1, 1, role=layout.ROLE_OUTPUT, name_index=1, dtype="bytes", shape=(2, 3),
                                offset=off, nbytes=100) == 100
    t = layout.decode_tensor(buf, g, 1, 1)
    assert (t.dtype, t.shape, t.nbytes, layout.dtype_name(t.dtype)) == (layout.BYTES_DTYPE, (2, 3), 100, "bytes")
    assert layout.dtype_code(np.dtype(object)) == layout.BYTES_CODE == layout.dtype_code("bytes")
    assert layout.encode_tensor(buf, g, 1, 1, role=layout.ROLE_OUTPUT, name_index=1, dtype="bytes", shape=(0,),
                                offset=off, nbytes=0) == 0
    assert layout.decode_tensor(buf, g, 1, 1).nbytes == 0


@pytest.mark.parametrize("dtype,shape,nbytes", [
    ("bytes", (3,), None),  # a bytes tensor's size is not its shape's: it must be given
    ("bytes", (3,), 11),  # fewer bytes than three lengths
    ("bytes", (1,), 2**64),
    ("float32", (3,), 11),  # given for a fixed-size tensor, it must be what the shape says
])
def test_encoding_a_descriptor_checks_its_size(small_arena_buf, dtype, shape, nbytes):
    g, buf = small_arena_buf
    with pytest.raises(LayoutError):
        layout.encode_tensor(buf, g, 0, 2, role=layout.ROLE_INPUT, name_index=0, dtype=dtype, shape=shape,
                             offset=g.classes[0].offset, nbytes=nbytes)


def _bytes_descriptor(buf, g, shape, offset, nbytes, region=0):
    layout.TENSOR.pack(buf, g.tensor_off(0, 3), layout.BYTES_CODE, len(shape), layout.ROLE_INPUT, 0, region, offset,
                       nbytes, *shape, *[0] * (layout.MAX_DIMS - len(shape)))
    return layout.decode_tensor(buf, g, 0, 3, {5: 4096})


def test_hostile_bytes_descriptors_are_bounded(small_arena_buf):
    g, buf = small_arena_buf
    start, end = g.data_off, g.data_off + g.data_size
    assert _bytes_descriptor(buf, g, (4,), start, 16).nbytes == 16
    assert _bytes_descriptor(buf, g, (2,), 64, 4032, region=5).nbytes == 4032
    for shape, offset, nbytes, region in [
        ((4,), start, 15, 0),  # less than a length per element
        ((2**40, 2**40), start, 64, 0),  # a huge shape in a few bytes
        ((1,), end - 64, 128, 0),  # past the data region
        ((1,), start, 2**64 - 1, 0),  # offset + nbytes beyond any region (no wrap-around)
        ((1,), 64, 4096, 5),  # past its client region
        ((1,), 0, 8, 6),  # an unknown region
    ]:
        with pytest.raises(LayoutError):
            _bytes_descriptor(buf, g, shape, offset, nbytes, region)


elements = st.lists(st.binary(max_size=40), max_size=20)


@given(elements, st.sampled_from(["bytes", "str"]))
def test_bytes_tensors_round_trip(items, kind):
    given_items = [e.decode("latin-1") for e in items] if kind == "str" else items
    data = layout.encode_bytes(np.array(given_items + [b""], dtype=object)[:len(items)])
    assert len(data) == sum(4 + len(e.encode() if isinstance(e, str) else e) for e in given_items)
    decoded = layout.decode_bytes(data, (len(items),))
    assert decoded.dtype == object and decoded.shape == (len(items),)
    assert decoded.tolist() == [e.encode() if isinstance(e, str) else e for e in given_items]
    framed = b"junk" + data + b"more"  # at an offset of a larger buffer, with the size given
    assert layout.decode_bytes(framed, (len(items),), 4, len(data)).tolist() == decoded.tolist()


@given(st.binary(max_size=64), st.lists(st.integers(0, 6), max_size=3))
@settings(max_examples=500)
def test_hostile_bytes_tensors_are_refused_or_exact(raw, shape):
    try:
        decoded = layout.decode_bytes(raw, shape)
    except LayoutError:
        return
    assert decoded.shape == tuple(shape)
    assert layout.encode_bytes(decoded) == raw  # accepted: exactly its elements, nothing else


@pytest.mark.parametrize("raw,shape,what", [
    (struct.pack("<I", 3) + b"ab", (1,), "runs past the end"),
    (struct.pack("<I", 2**32 - 1) + b"abcd", (1,), "runs past the end"),
    (struct.pack("<I", 1) + b"a" + b"\x01\x00\x00", (2,), "its length lies past the end"),
    (struct.pack("<I", 1) + b"ab", (1,), "1 bytes follow"),
    (b"\0" * 7, (2,), "at least 8"),
    (b"", (2**40, 2**40), "at least"),
])
def test_bytes_tensor_errors_say_what_is_wrong(raw, shape, what):
    with pytest.raises(LayoutError, match=what):
        layout.decode_bytes(raw, shape)


def test_bytes_elements_must_be_bytes_or_str():
    for bad in ([b"a", 1], [b"a", None], [np.float32(1)], [memoryview(b"ab")]):
        with pytest.raises(LayoutError, match="not bytes or str"):
            layout.encode_bytes(np.array(bad + [0], dtype=object)[:len(bad)])


def test_arrays_from_tensor_bytes():
    x = np.arange(6, dtype=np.float32).astype(layout.numpy_dtype("bfloat16")).reshape(2, 3)
    got = layout.array_from_bytes(x.tobytes(), "bfloat16", (2, 3))
    assert got.dtype == x.dtype and got.tobytes() == x.tobytes()
    assert layout.array_from_bytes(layout.encode_bytes([b"a", b""]), "bytes", (2,)).tolist() == [b"a", b""]
    assert layout.array_from_bytes(b"", "int8", (0, 4)).shape == (0, 4)
    with pytest.raises(LayoutError):
        layout.array_from_bytes(b"abc", "float32", (1,))


def test_index_bounds():
    g = layout.plan(slot_count=2, size_classes=[(4096, 1)], max_workers=1, ring_capacity=2)
    for call in (lambda: g.slot_off(2), lambda: g.slot_off(-1), lambda: g.worker_off(1),
                 lambda: g.ring_off(1, False), lambda: g.tensor_off(0, layout.MAX_TENSORS)):
        with pytest.raises(LayoutError):
            call()


def test_error_message_truncates_on_a_character_boundary(small_arena_buf):
    g, buf = small_arena_buf
    layout.encode_error(buf, g, 0, 42, "é" * 200)
    code, message = layout.decode_error(buf, g, 0)
    assert code == 42 and message == "é" * (layout.ERROR_MESSAGE_MAX // 2)
    layout.SLOT.write(buf, g.slot_off(0), error_len=2**32 - 1)  # hostile length
    assert len(layout.decode_error(buf, g, 0)[1]) <= layout.ERROR_MESSAGE_MAX


def test_unsupported_dtype():
    with pytest.raises(LayoutError, match="not supported"):
        layout.dtype_code(np.complex64)
    with pytest.raises(LayoutError):
        layout.dtype_from_code(250)


# -- the encodings every other module takes from here -------------------------------------------

@given(st.integers(0, layout.MAX_SLOTS - 1), st.integers(0, 2**32 - 1))
def test_slot_entries_round_trip_and_are_never_commands(index, generation):
    entry = layout.slot_entry(index, generation)
    assert layout.split_entry(entry) == (index, generation)
    assert not layout.is_command(entry)
    assert 0 <= entry < 2**64


def test_command_entries():
    for op in (layout.CMD_STOP, layout.CMD_ATTACH_LANE, layout.CMD_DROP_REGION):
        entry = layout.command_entry(op, 12345)
        assert layout.is_command(entry) and layout.split_entry(entry) == (op, 12345)
    assert layout.is_command(layout.STOP_ENTRY) and layout.split_entry(layout.STOP_ENTRY)[0] == layout.CMD_STOP


def test_generations_wrap():
    assert layout.next_generation(7) == 8
    assert layout.next_generation(2**32 - 1) == 0
    assert layout.unpack_status(layout.pack_status(2**32 + 5, 3)) == (5, 3)


@pytest.mark.parametrize("nbytes,aligned,span", [(0, 0, 64), (1, 64, 64), (64, 64, 64), (65, 128, 128),
                                                  (4097, 4160, 4160)])
def test_tensor_alignment(nbytes, aligned, span):
    assert layout.align_tensor(nbytes) == aligned and layout.tensor_span(nbytes) == span
    assert layout.is_tensor_aligned(aligned) and not layout.is_tensor_aligned(aligned + 1)


def test_segment_names_round_trip_and_foreign_names_are_not_ours():
    assert layout.arena_name("vision") == "/shmserve.vision"
    assert layout.parse_segment_name("shmserve.vision") == ("vision", None)
    assert layout.parse_segment_name("shmserve.vision.r7") == ("vision", 7)
    assert layout.parse_segment_name("shmserve.vision.junk") == ("vision", 0)
    assert layout.parse_segment_name("shmserve.vision.r99999999999") == ("vision", 0)
    assert layout.parse_segment_name("other.vision") is None
    with pytest.raises(ValueError):
        layout.arena_name("../etc")


def test_region_records_are_read_back_and_their_table_bounded():
    g = layout.plan(slot_count=4, size_classes=[(4096, 4)], max_workers=1, ring_capacity=8, max_regions=3)
    assert g.ring_table_off + 2 * g.ring_stride <= g.region_table_off
    assert g.region_table_off + 3 * layout.REGION_RECORD_SIZE <= g.slot_table_off
    buf = bytearray(g.total_size)
    layout.REGION.write(buf, g.region_off(2), kind=layout.REGION_LANE, id=9, size=8192, owner_pid=5, owner_uid=7,
                        worker=1, model_id=0, created_unix_ns=11)
    layout.REGION.write(buf, g.region_off(0), kind=77, id=3)  # unknown kind: skipped, never trusted
    [record] = layout.read_regions(buf, g)
    assert (record.id, record.size, record.owner_uid, record.worker) == (9, 8192, 7, 1)
    with pytest.raises(LayoutError):
        g.region_off(3)
    for bad in (0, layout.MAX_REGIONS + 1):
        with pytest.raises(ValueError):
            layout.plan(slot_count=4, size_classes=[(4096, 4)], max_workers=1, ring_capacity=8, max_regions=bad)


def test_histograms_record_and_read_through_one_encoding():
    g = layout.plan(slot_count=4, size_classes=[(4096, 1)], max_workers=2, ring_capacity=4)
    buf = bytearray(g.hist_table_off + 2 * layout.HIST_WORKER_SIZE)
    for value in (0, 1, 3, 1000, 2**40):
        layout.record_sample(buf, g, 1, "batch_size", value)
    buckets, total = layout.read_histogram(buf, g, 1, "batch_size")
    assert total == 0 + 1 + 3 + 1000 + 2**40 and sum(buckets) == 5
    assert buckets[0] == 2 and buckets[1] == 1 and buckets[9] == 1 and buckets[-1] == 1
    assert layout.read_histogram(buf, g, 0, "batch_size") == ((0,) * layout.HIST_BUCKETS, 0)  # the other worker
    assert layout.hist_upper_bound(9) == 1024 and layout.hist_bucket(1023) == 9
    with pytest.raises(LayoutError):
        layout.read_histogram(buf, g, 2, "total")
    with pytest.raises(LayoutError):
        layout.read_histogram(bytearray(16), g, 0, "total")


def test_a_record_with_an_array_field_reads_it_as_a_tuple():
    buf = bytearray(layout.TENSOR_SIZE)
    layout.TENSOR.pack(buf, 0, 11, 2, 1, 0, 0, 64, 32, 2, 4, 0, 0, 0, 0, 0, 0)
    t = layout.TENSOR.read(buf)
    assert (t.dtype, t.offset, t.nbytes, t.shape[:2]) == (11, 64, 32, (2, 4)) and len(t.shape) == layout.MAX_DIMS
    with pytest.raises(LayoutError):
        layout.TENSOR.read(buf[:10])
