"""The arena layout: every struct format, offset and limit of the shared segment.

Owns: the binary layout of the arena and its version number, the geometry
computation (where each region starts), and the validating decoders that turn
arena bytes into Python values.  The front-end, workers, client and inspection
tool all compute offsets through this module and nothing else does; the
compiled hot path (``shmserve/_hotpath.c``) is handed them, once, by
``hotpath_constants``.

Must not: touch a file descriptor, create or map memory, or trust the bytes it
decodes.  Arena contents are untrusted input: every decoder checks offsets,
sizes and enumerations against the arena it was given and raises
``LayoutError`` (never IndexError, struct.error or a crash).

One arena (``/dev/shm/shmserve.<instance>``), little-endian, version 3::

    0                 +-------------------------------------------------------+
                      | header page (4 KiB)                                   |
                      |   magic "SHMSERVE", layout version, header size,      |
                      |   total size, instance name, boot id, created (unix), |
                      |   owner pid + process start ticks, owner heartbeat,   |
                      |   state (INITIALIZING -> LIVE -> STOPPING),           |
                      |   geometry of every region, size-class table,         |
                      |   statistics counters (from STATS_OFFSET)             |
    worker_table_off  +-------------------------------------------------------+
                      | worker table: max_workers x WORKER (256 B)            |
                      |   pid, state, restarts, heartbeat, counters, device,  |
                      |   name, crash streak, time of the next restart,       |
                      |   its CPUs (a count and a mask of CPUs 0-1023)        |
    hist_table_off    +-------------------------------------------------------+
                      | histograms: max_workers x HIST_STAGES x               |
                      |   (HIST_BUCKETS counters + 1 sum), u64: stage times   |
                      |   in us, bucket i counts [2**i, 2**(i+1)) (0: < 2),   |
                      |   and batch sizes (requests per run) the same way;    |
                      |   then the worker's lane outcomes (LANE_OUTCOME_*):   |
                      |   faults u64, LANE_OUTCOME_BUCKETS u64 counters       |
    ring_table_off    +-------------------------------------------------------+
                      | rings: 2 per worker, submission then completion;      |
                      | each ring_stride bytes:                               |
                      |   +0   tail  u64   (producer's cache line)            |
                      |   +64  head  u64   (consumer's cache line)            |
                      |   +128 doorbell seq u32, waiters u32                  |
                      |   +192 entries: ring_capacity x u64                   |
    region_table_off  +-------------------------------------------------------+
                      | region table: max_regions x REGION (64 B): kind,      |
                      |   id, size, owner pid + uid, lane worker and model,   |
                      |   created (unix): the front-end's record of each      |
                      |   client region (the memory is a nameless memfd)      |
    slot_table_off    +-------------------------------------------------------+
                      | slot table: slot_count x SLOT (2 KiB, 64-B aligned)   |
                      |   +0    status u64 = generation << 32 | state         |
                      |   +8    request id, model id, worker, counts, flags,  |
                      |         error code + message, stage timestamps        |
                      |   +512  MAX_TENSORS x TENSOR (96 B): dtype, ndim,     |
                      |         role, name index, region, offset, nbytes,     |
                      |         shape[8]; region 0 = this arena's data region,|
                      |         r > 0 = client region r (a sealed memfd)      |
                      |         (a bytes tensor's nbytes: its serialized size,|
                      |         "Bytes tensors" below)                        |
    data_off          +-------------------------------------------------------+
     (2 MiB aligned)  | data region: size classes one after the other; each   |
                      | class is extent_count extents of extent_size bytes,   |
                      | extents 4 KiB aligned (2 MiB from 2 MiB upwards)      |
    total_size        +-------------------------------------------------------+

Publication rule (DESIGN.md section 4): whoever fills a slot's descriptors or
data writes them first and then store-releases the slot's status word; a
reader load-acquires the status word before it reads anything else.  The
status word and ring indices are only touched through ``shmserve._atomics``.
"""

from __future__ import annotations

import math
import re
import struct
from collections import namedtuple
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import ml_dtypes
import numpy as np

from shmserve import _atomics as atomics

MAGIC = b"SHMSERVE"
LAYOUT_VERSION = 5  # 3: the worker table's entries grew to 256 B for the CPU mask; 4: lane outcomes per worker;
# 5: a slot's scheduling fields (priority, caller, deadline) and the scheduling counters per worker

PAGE = 4096
HUGE_PAGE = 2 * 1024 * 1024  # larger size classes align to this (THP / DMA friendly)
CACHE_LINE = 64

HEADER_SIZE = PAGE
SLOT_SIZE = 2048
WORKER_SIZE = 256
CPU_MASK_BYTES = 128  # a worker's CPUs 0-1023 as a bit mask (CPU c: bit c % 8 of byte c // 8)
RING_ENTRIES_OFFSET = 3 * CACHE_LINE  # tail, head and doorbell each own a cache line
TENSOR_SIZE = 96
TENSORS_OFFSET = 512  # within a slot
MAX_TENSORS = (SLOT_SIZE - TENSORS_OFFSET) // TENSOR_SIZE  # 16 inputs + outputs
MAX_DIMS = 8
MAX_SIZE_CLASSES = 8
TENSOR_ALIGN = CACHE_LINE  # every tensor starts on a cache line inside its extent
MIN_EXTENT = PAGE
INSTANCE_MAX = 64  # bytes of UTF-8; also bounds the /dev/shm name length
ERROR_MESSAGE_MAX = 192
MAX_SLOTS = 1 << 20  # sanity bound for hostile headers: 2 GiB of slot table
MAX_WORKERS = 1024
MAX_RING_CAPACITY = 1 << 20
MAX_REGIONS = 1 << 16  # sanity bound for hostile headers: 4 MiB of region records
DEFAULT_MAX_REGIONS = 1024

# Arena-wide states (header field `state`).
ARENA_INITIALIZING, ARENA_LIVE, ARENA_STOPPING = 0, 1, 2
ARENA_STATE_NAMES = {ARENA_INITIALIZING: "initializing", ARENA_LIVE: "live", ARENA_STOPPING: "stopping"}

# Tensor roles within a slot.
ROLE_INPUT, ROLE_OUTPUT = 1, 2

# dtype codes: stable on the wire and in the arena, never renumbered.
DTYPE_CODES: dict[str, int] = {
    "bool": 1, "int8": 2, "uint8": 3, "int16": 4, "uint16": 5, "int32": 6, "uint32": 7,
    "int64": 8, "uint64": 9, "float16": 10, "float32": 11, "float64": 12, "bfloat16": 13, "bytes": 14,
}
DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
BYTES = "bytes"  # variable-size elements (KServe v2 BYTES): "Bytes tensors" below
BYTES_CODE = DTYPE_CODES[BYTES]
BYTES_DTYPE = np.dtype(object)  # a bytes tensor in numpy: an object array whose elements are bytes
BYTES_LENGTH = struct.Struct("<I")  # each element of a bytes tensor: this length, then its bytes
# Why a zero-copy call (client region or lane) refuses a bytes tensor: its space cannot be laid out
# before its data is known, nor read back as a view.
NO_ZERO_COPY_BYTES = "zero-copy calls carry fixed-size tensors only; send bytes tensors with infer()"
# The numpy dtype of each name: numpy has no bfloat16, ml_dtypes' is the one onnx, jax and
# tritonclient use; a bytes tensor is an object array.
NUMPY_DTYPES: dict[str, np.dtype] = {
    name: BYTES_DTYPE if name == BYTES else np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    for name in DTYPE_CODES}
# Bytes per element of the fixed-size dtypes (a bytes tensor has no element size).
ITEMSIZES: dict[str, int] = {name: dtype.itemsize for name, dtype in NUMPY_DTYPES.items() if name != BYTES}
# Bytes per element by code; for bytes, the least an element takes (its length).
_ITEMSIZE = {DTYPE_CODES[name]: ITEMSIZES.get(name, BYTES_LENGTH.size) for name in DTYPE_CODES}


class LayoutError(ValueError):
    """Arena bytes that do not describe a valid arena of this layout version."""


# ---------------------------------------------------------------------------
# Names in /dev/shm.  An instance's arena is ``/shmserve.<instance>``; the client
# regions (and lanes) it creates are ``/shmserve.<instance>.r<id>``.  Everything that
# names, lists or parses a segment goes through these.

NAME_PREFIX = "shmserve."
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
REGION_ID_MAX = 0xFFFFFFFF  # region ids are u32 in a tensor descriptor; 0 is the arena itself


def validate_instance(instance: str) -> str:
    """Return ``instance`` if it is a valid instance name, else raise ValueError."""
    if not isinstance(instance, str) or not _INSTANCE_RE.match(instance):
        raise ValueError(f"invalid instance name {instance!r}: use 1-64 of A-Z a-z 0-9 _ -")
    return instance


def arena_name(instance: str) -> str:
    """The POSIX shared-memory name of an instance's arena (leading slash included)."""
    return "/" + NAME_PREFIX + validate_instance(instance)


def parse_segment_name(listed: str) -> tuple[str, int | None] | None:
    """(instance, region id or None for the arena) of a /dev/shm listing name, or None if the
    name is not one of ours.  A region name whose id does not parse yields (instance, 0)."""
    if not listed.startswith(NAME_PREFIX):
        return None
    instance, dot, rest = listed[len(NAME_PREFIX):].partition(".")
    if not dot:
        return instance, None
    region = rest[1:]
    return instance, int(region) if rest[:1] == "r" and region.isdigit() and len(region) <= 10 else 0


_DTYPES = {code: NUMPY_DTYPES[name] for name, code in DTYPE_CODES.items()}
_CODE_OF_DTYPE = {dtype: code for code, dtype in _DTYPES.items()}
_NAME_OF_DTYPE = {dtype: name for name, dtype in NUMPY_DTYPES.items()}
# code -> (numpy dtype, bytes per element; for bytes the least one takes): decode_tensor's one lookup
_DECODE = {code: (_DTYPES[code], _ITEMSIZE[code]) for code in _DTYPES}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name (``NUMPY_DTYPES``); LayoutError if it is not one."""
    try:
        return NUMPY_DTYPES[name]
    except (KeyError, TypeError):
        raise LayoutError(f"dtype {name!r} is not supported (supported: {', '.join(DTYPE_CODES)})") from None


def dtype_code(dtype) -> int:
    """Return the arena code of a numpy dtype (or dtype name); LayoutError if it has none.
    The object dtype is bytes' (``BYTES_DTYPE``)."""
    try:  # the hot path passes names or native dtypes: a dict lookup (dtype.name is slow)
        code = DTYPE_CODES.get(dtype) if isinstance(dtype, str) else _CODE_OF_DTYPE.get(dtype)
    except TypeError:  # unhashable: let numpy say what it is
        code = None
    if code is not None:
        return code
    name = np.dtype(dtype).name
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise LayoutError(f"dtype {name!r} is not supported (supported: {', '.join(DTYPE_CODES)})") from None


def dtype_from_code(code: int) -> np.dtype:
    """Return the numpy dtype of an arena dtype code; LayoutError if unknown."""
    try:
        return _DTYPES[code]
    except KeyError:
        raise LayoutError(f"unknown dtype code {code}") from None


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name`` without its cost for the supported dtypes."""
    return _NAME_OF_DTYPE.get(dtype) or dtype.name


class Record:
    """A fixed-size little-endian record: named fields at fixed offsets.

    Fields are laid out in order with natural alignment; ``offset(name)`` is the
    byte offset atomics use, ``read`` decodes the whole record into a namedtuple
    and ``write`` encodes the named fields.  Reads of a buffer that is too short
    raise LayoutError.
    """

    def __init__(self, name: str, size: int, fields: Sequence[tuple[str, str]]):
        self.name, self.size = name, size
        self._offsets: dict[str, int] = {}
        self._fields: dict[str, struct.Struct] = {}
        self._arrays: list[tuple[int, int]] = []  # (position in the flat tuple, length) of array fields
        fmt, pos = "<", 0
        for field, code in fields:
            st = struct.Struct("<" + code)
            align = struct.calcsize(code[-1]) if code[-1] in "bBhHiIqQd" else 1
            pad = (-pos) % align
            fmt += "x" * pad
            pos += pad
            self._offsets[field] = pos
            self._fields[field] = st
            values = len(st.unpack(bytes(st.size)))
            if values > 1:
                self._arrays.append((len(self._offsets) - 1 + sum(n - 1 for _, n in self._arrays), values))
            fmt += code
            pos += st.size
        if pos > size:
            raise AssertionError(f"record {name} needs {pos} bytes, has {size}")
        self._struct = struct.Struct(fmt)
        self.tuple = namedtuple(name, list(self._offsets))

    def offset(self, field: str) -> int:
        return self._offsets[field]

    def read(self, buf, base: int = 0):
        """The whole record as a namedtuple (an array field as a tuple); LayoutError if short."""
        try:
            values = self._struct.unpack_from(buf, base)
        except struct.error as exc:
            raise LayoutError(f"{self.name} at offset {base}: {exc}") from None
        for start, length in reversed(self._arrays):
            values = values[:start] + (values[start:start + length],) + values[start + length:]
        return self.tuple._make(values)

    def read_field(self, buf, base: int, field: str):
        try:
            return self._fields[field].unpack_from(buf, base + self._offsets[field])[0]
        except struct.error as exc:
            raise LayoutError(f"{self.name}.{field} at offset {base}: {exc}") from None

    def write(self, buf, base: int = 0, **values) -> None:
        for field, value in values.items():
            self._fields[field].pack_into(buf, base + self._offsets[field], value)

    def pack(self, buf, base: int, *values) -> None:
        """Write every field at once, in declaration order (array fields flattened)."""
        self._struct.pack_into(buf, base, *values)

    def unpack(self, buf, base: int = 0) -> tuple:
        """Read every field at once as a flat tuple; struct.error if the buffer is short."""
        return self._struct.unpack_from(buf, base)


HEADER = Record("Header", 1024, [
    ("magic", "8s"),
    ("version", "I"),
    ("header_size", "I"),
    ("total_size", "Q"),
    ("instance", f"{INSTANCE_MAX}s"),
    ("boot_id", "16s"),
    ("created_unix_ns", "Q"),
    ("owner_pid", "I"),
    ("state", "I"),
    ("owner_start_ticks", "Q"),
    ("owner_heartbeat_ns", "Q"),
    ("max_workers", "I"),
    ("slot_count", "I"),
    ("worker_table_off", "Q"),
    ("ring_table_off", "Q"),
    ("ring_capacity", "I"),
    ("ring_stride", "I"),
    ("slot_table_off", "Q"),
    ("slot_size", "I"),
    ("n_classes", "I"),
    ("data_off", "Q"),
    ("data_size", "Q"),
    ("hist_table_off", "Q"),
    ("region_table_off", "Q"),
    ("max_regions", "I"),
    ("socket_path", "108s"),  # where the owner listens (for cleanup of a dead instance's socket)
    # size-class table: (extent_size, extent_count, offset) x MAX_SIZE_CLASSES
    *[(f"class{i}_{what}", "Q") for i in range(MAX_SIZE_CLASSES) for what in ("size", "count", "offset")],
])

# Statistics counters (u64 each, updated with fetch_add64) from STATS_OFFSET in
# the header page.  Append only: an inspection tool reads them by name.
STATS_OFFSET = 1024
STAT_NAMES = (
    "requests_total", "errors_total", "bytes_in", "bytes_out",
    "slots_in_use", "extent_bytes_in_use",
)
STAT_OFFSETS = {name: STATS_OFFSET + 8 * i for i, name in enumerate(STAT_NAMES)}

WORKER = Record("Worker", WORKER_SIZE, [
    ("pid", "I"),
    ("state", "I"),
    ("restarts", "I"),
    ("incarnation", "I"),
    ("heartbeat_ns", "Q"),
    ("requests", "Q"),
    ("errors", "Q"),
    ("device", "16s"),
    ("name", "48s"),
    # Added within the record's spare bytes (an older arena reads 0: no streak, no restart due).
    ("crash_streak", "I"),  # deaths in a row before a healthy run (shmserve.supervisor)
    ("restart_at_ns", "Q"),  # CLOCK_MONOTONIC ns of its scheduled restart; 0 when none is scheduled
    ("version", "I"),  # the version of the model it serves (0 in an arena older than versions)
    ("cpu_count", "I"),  # the CPUs it is pinned to, how many (0: not pinned); the mask holds those below 1024
    ("cpu_mask", f"{CPU_MASK_BYTES}s"),
])


def encode_cpu_mask(cpus) -> tuple[int, bytes]:
    """A worker's CPU set as the worker table holds it: (cpu_count, cpu_mask); None: (0, zeros)."""
    mask = bytearray(CPU_MASK_BYTES)
    if cpus is None:
        return 0, bytes(mask)
    for cpu in cpus:
        if 0 <= cpu < 8 * CPU_MASK_BYTES:
            mask[cpu // 8] |= 1 << (cpu % 8)
    return len(cpus), bytes(mask)


def decode_cpu_mask(count: int, mask: bytes) -> tuple[frozenset[int] | None, int]:
    """(the CPUs of the mask, how many more the count says it could not hold); (None, 0) when not
    pinned."""
    if not count:
        return None, 0
    cpus = frozenset(8 * i + b for i, byte in enumerate(mask[:CPU_MASK_BYTES]) for b in range(8) if byte >> b & 1)
    return cpus, max(0, count - len(cpus))
# Worker states (worker table field `state`).
WORKER_EMPTY, WORKER_STARTING, WORKER_READY, WORKER_STOPPING, WORKER_DEAD = 0, 1, 2, 3, 4
WORKER_STATE_NAMES = {0: "empty", 1: "starting", 2: "ready", 3: "stopping", 4: "dead"}

# Region table: the front-end's record of every client region and lane it holds (the memory
# itself is a sealed memfd with no name: only these records let ``inspect`` see it, live or
# after a crash).  Written by the front-end only; a record is free while ``kind`` is 0.
REGION_RECORD_SIZE = 64
REGION = Record("Region", REGION_RECORD_SIZE, [
    ("kind", "I"),  # REGION_FREE, REGION_PLAIN or REGION_LANE
    ("id", "I"),
    ("size", "Q"),
    ("owner_pid", "I"),
    ("owner_uid", "I"),  # region_uid(): NO_UID when the owner's uid is not known
    ("worker", "I"),  # a lane's worker, NO_WORKER while it has none (and for a plain region)
    ("model_id", "I"),  # a lane's model (index in the front-end's model list)
    ("created_unix_ns", "Q"),
])
REGION_FREE, REGION_PLAIN, REGION_LANE = 0, 1, 2
NO_UID = 0xFFFFFFFF  # a region record's ``owner_uid`` when its owner's uid is not known (-1 in the front-end)


def region_uid(uid: int) -> int:
    """``uid`` as a region record's ``owner_uid`` (u32): NO_UID for an unknown one (below 0)."""
    return NO_UID if uid < 0 else uid
REGION_KIND_NAMES = {REGION_FREE: "free", REGION_PLAIN: "region", REGION_LANE: "lane"}


def read_regions(buf, geometry: "Geometry") -> list:
    """Every region record in use, in table order (``REGION`` namedtuples; untrusted: a record
    whose kind is unknown is skipped)."""
    records = []
    for index in range(geometry.max_regions):
        record = REGION.read(buf, geometry.region_off(index))
        if record.kind in (REGION_PLAIN, REGION_LANE):
            records.append(record)
    return records

# Per-worker latency histograms, written by the worker after each request (fetch_add64).
HIST_STAGES = ("queue", "copy_in", "compute", "copy_out", "total", "batch_size")  # batch_size: requests per run
HIST_STAGE_BOUNDS = {  # (from, to) slot timestamps of each stage
    "queue": ("t_ready", "t_claimed"), "copy_in": ("t_claimed", "t_compute_start"),
    "compute": ("t_compute_start", "t_compute_end"), "copy_out": ("t_compute_end", "t_done"),
    "total": ("t_acquired", "t_done"),
}
HIST_BUCKETS = 32
HIST_STAGE_SIZE = 8 * (HIST_BUCKETS + 1)  # buckets, then the sum in us
# A worker's lane outcomes, after its stage histograms: the lane calls it finished that are outcomes of
# its version (DONE, or ERROR for its own fault: LANE_FAULT_CODES; a call the worker refused for what
# its client sent is none), for the canary windows (read by the front-end on its heartbeat).  A u64
# count of the faults, then LANE_OUTCOME_BUCKETS u64 counters of their claim-to-publish times, in
# units of 2**LANE_TIME_SHIFT ns, log-linear: LANE_SUB_BUCKETS per power of two (``lane_bucket``), so a
# bucket's middle is within 1/16 of any time in it (the stage histograms' powers of two are too coarse
# to judge a p99 ratio of 1.5).
LANE_OUTCOME_BUCKETS = 256
LANE_SUB_BITS = 3  # 8 buckets per power of two
LANE_TIME_SHIFT = 7  # 128 ns units: 1 us is bucket 7, 20 us bucket 45; the top bucket holds 2**34 units (36 min) up
LANE_FAULT_CODES = (25, 27)  # ErrorCode.MODEL_ERROR, ErrorCode.INTERNAL (layout imports nothing of errors.py)
LANE_OUTCOME_OFFSET = HIST_STAGE_SIZE * len(HIST_STAGES)  # within a worker's histogram block
LANE_OUTCOME_SIZE = 8 * (1 + LANE_OUTCOME_BUCKETS)
# A worker's scheduling counters, after its lane outcomes (``shmserve.scheduling``; written by the worker,
# read by metrics, ``info``, ``inspect`` and ``bench``): u64 ``expired`` (requests answered TIMEOUT
# unrun: their deadline passed before a claim), u64 ``demoted`` (requests whose queue timeout passed under
# ``timeout_action = "delay"``: moved behind every other), then per priority level 1..SCHED_LEVELS three
# u64: ``queued`` (a gauge: held by the worker, unclaimed, now), ``claimed`` (a total) and ``wait_us``
# (the sum of their ready-to-claim waits, microseconds).
SCHED_LEVELS = 16  # priority levels 1 (first) .. 16; a model's priority_levels is at most this
SCHED_OFFSET = LANE_OUTCOME_OFFSET + LANE_OUTCOME_SIZE
SCHED_LEVEL_SIZE = 24
SCHED_SIZE = 16 + SCHED_LEVELS * SCHED_LEVEL_SIZE
HIST_WORKER_SIZE = SCHED_OFFSET + SCHED_SIZE


def hist_bucket(value: int) -> int:
    """The histogram bucket of a value (a duration in microseconds, or a batch size)."""
    return min(max(value, 1).bit_length() - 1, HIST_BUCKETS - 1)


def lane_bucket(ns: int) -> int:
    """The lane outcome bucket of a claim-to-publish time of ``ns`` nanoseconds (>= 0)."""
    v = ns >> LANE_TIME_SHIFT
    if v < 1 << LANE_SUB_BITS:
        return v
    e = v.bit_length() - 1
    sub = LANE_SUB_BITS
    return min(((e - sub + 1) << sub) + ((v >> (e - sub)) & ((1 << sub) - 1)), LANE_OUTCOME_BUCKETS - 1)


def lane_bucket_seconds(bucket: int) -> float:
    """The middle of lane outcome ``bucket``, in seconds (the time its calls enter a canary window as)."""
    sub = LANE_SUB_BITS
    if bucket < 1 << sub:
        units = bucket + 0.5
    else:
        e = (bucket >> sub) + sub - 1
        width = 1 << (e - sub)
        units = (((1 << sub) + (bucket & ((1 << sub) - 1))) << (e - sub)) + width / 2
    return units * (1 << LANE_TIME_SHIFT) / 1e9


def read_lane_outcomes(buf, geometry: "Geometry", worker: int) -> tuple[int, tuple[int, ...]]:
    """(faults, bucket counts) of worker ``worker``'s lane outcomes; LayoutError if out of range."""
    off = geometry.hist_off(worker, HIST_STAGES[0]) + LANE_OUTCOME_OFFSET
    try:
        faults, *buckets = _LANE_OUTCOMES.unpack_from(buf, off)
    except struct.error:
        raise LayoutError(f"lane outcomes of worker {worker} lie outside the arena") from None
    return faults, tuple(buckets)


def record_lane_outcome(arena_buf, hist_base: int, ns: int, fault: bool) -> None:
    """Count one lane call's outcome (``ns``: its claim-to-publish time) in the block of the worker
    whose histograms start at ``hist_base``."""
    off = hist_base + LANE_OUTCOME_OFFSET
    if fault:
        atomics.fetch_add64(arena_buf, off, 1)
    atomics.fetch_add64(arena_buf, off + 8 + 8 * lane_bucket(ns), 1)


_LANE_OUTCOMES = struct.Struct(f"<{1 + LANE_OUTCOME_BUCKETS}Q")


SchedLevel = namedtuple("SchedLevel", "queued claimed wait_us")
SchedCounters = namedtuple("SchedCounters", "expired demoted levels")  # levels: SCHED_LEVELS SchedLevel, 1 first
_SCHED = struct.Struct(f"<{2 + 3 * SCHED_LEVELS}Q")


def sched_base(geometry: "Geometry", worker: int) -> int:
    """Offset of worker ``worker``'s scheduling counters (LayoutError if out of range)."""
    return geometry.hist_off(worker, HIST_STAGES[0]) + SCHED_OFFSET


def sched_level_off(base: int, level: int, field: str) -> int:
    """Offset of ``field`` (queued, claimed, wait_us) of priority ``level`` (1..SCHED_LEVELS) in the
    counters at ``base``; ValueError for a level out of range."""
    if not 1 <= level <= SCHED_LEVELS:
        raise ValueError(f"priority level {level} out of range 1..{SCHED_LEVELS}")
    return base + 16 + (level - 1) * SCHED_LEVEL_SIZE + 8 * SchedLevel._fields.index(field)


SCHED_EXPIRED_OFF, SCHED_DEMOTED_OFF = 0, 8  # within the counters


def read_sched_counters(buf, geometry: "Geometry", worker: int) -> SchedCounters:
    """A moment's copy of worker ``worker``'s scheduling counters; LayoutError if out of range."""
    try:
        expired, demoted, *rest = _SCHED.unpack_from(buf, sched_base(geometry, worker))
    except struct.error:
        raise LayoutError(f"scheduling counters of worker {worker} lie outside the arena") from None
    levels = tuple(SchedLevel(*rest[3 * i:3 * i + 3]) for i in range(SCHED_LEVELS))
    return SchedCounters(expired, demoted, levels)


def hist_upper_bound(bucket: int) -> int:
    """The exclusive upper bound of ``bucket`` (the top bucket also holds everything above it)."""
    return 2 ** (bucket + 1)


def hist_quantile(counts: Sequence[int], q: float) -> int | None:
    """The upper bound of the bucket holding quantile ``q`` (0-1) of a histogram's ``counts``
    (microseconds for a stage); None for an empty histogram."""
    total = sum(counts)
    if not total:
        return None
    target, running = q * total, 0
    for i, n in enumerate(counts):
        running += n
        if running >= target:
            return hist_upper_bound(i)
    return hist_upper_bound(len(counts) - 1)


RING_TAIL, RING_HEAD, RING_SEQ, RING_WAITERS = 0, CACHE_LINE, 2 * CACHE_LINE, 2 * CACHE_LINE + 4

SLOT = Record("Slot", TENSORS_OFFSET, [
    ("status", "Q"),
    ("request_id", "Q"),
    ("model_id", "I"),
    ("worker", "I"),
    ("n_inputs", "H"),
    ("n_outputs", "H"),
    ("flags", "I"),
    # where the worker writes outputs: region 0 is the arena's data region,
    # region r > 0 a client's region segment (shmserve.<instance>.r<r>)
    ("out_region", "I"),
    ("out_off", "Q"),
    ("out_capacity", "Q"),
    ("error_code", "I"),
    ("error_len", "I"),
    ("error_msg", f"{ERROR_MESSAGE_MAX}s"),
    # monotonic-clock nanoseconds per stage (0 = not reached)
    ("t_acquired", "Q"),
    ("t_ready", "Q"),
    ("t_claimed", "Q"),
    ("t_compute_start", "Q"),
    ("t_compute_end", "Q"),
    ("t_done", "Q"),
    # scheduling (LAYOUT_VERSION 5; ``shmserve.scheduling``): written with the request, read by its worker
    ("priority", "I"),  # level 1 (first) .. SCHED_LEVELS; 0: the model's default_priority_level
    ("caller", "I"),  # who asked, for fairness between callers of one model: a uid, connection or lane; 0: unknown
    ("deadline_ns", "Q"),  # CLOCK_MONOTONIC ns after which no worker starts it (answered TIMEOUT); 0: none
])
STAGE_FIELDS = ("t_acquired", "t_ready", "t_claimed", "t_compute_start", "t_compute_end", "t_done")

# The request part of a slot (request_id .. error_len) and its stage times, each written with
# one pack_into on the hot path; the asserts keep them in step with SLOT above.
_SLOT_REQUEST = struct.Struct("<QIIHHII4xQQII")  # 4x: out_off is 8-aligned
_SLOT_STAGES = struct.Struct("<6Q")
assert SLOT.offset("request_id") + _SLOT_REQUEST.size == SLOT.offset("error_len") + 4
assert [SLOT.offset(f) for f in STAGE_FIELDS] == [SLOT.offset("t_acquired") + 8 * i for i in range(6)]


_SLOT_SCHED = struct.Struct("<IIQ")  # priority, caller, deadline_ns
assert SLOT.offset("caller") == SLOT.offset("priority") + 4 and SLOT.offset("deadline_ns") == SLOT.offset("priority") + 8
SlotSched = namedtuple("SlotSched", "priority caller deadline_ns")


# A slot's ``flags``: SLOT_FLAG_OWN_TIMEOUT: its ``deadline_ns`` is a timeout its caller chose (a queue
# policy's ``allow_timeout_override`` lets it replace the model's ``default_timeout_microseconds``), not
# only the server's default request timeout.
SLOT_FLAG_OWN_TIMEOUT = 1


def encode_slot_request(buf, geometry: "Geometry", index: int, *, request_id: int, model_id: int, worker: int,
                        n_inputs: int, out_region: int, out_off: int, out_capacity: int,
                        priority: int = 0, caller: int = 0, deadline_ns: int = 0, flags: int = 0) -> None:
    """Write what a worker needs to run slot ``index`` (outputs and error cleared) and how to schedule
    it (``priority`` 0: the model's default level; ``caller`` 0: unknown; ``deadline_ns`` 0: none;
    ``flags``: SLOT_FLAG_*)."""
    off = geometry.slot_off(index)
    _SLOT_REQUEST.pack_into(buf, off + SLOT.offset("request_id"), request_id, model_id,
                            worker, n_inputs, 0, flags, out_region, out_off, out_capacity, 0, 0)
    _SLOT_SCHED.pack_into(buf, off + SLOT.offset("priority"), priority, caller, deadline_ns)


def decode_slot_sched(buf, geometry, index: int) -> SlotSched:
    """How slot ``index`` asks to be scheduled, as written (untrusted: the reader clamps the level)."""
    return SlotSched._make(_SLOT_SCHED.unpack_from(buf, geometry.slot_off(index) + SLOT.offset("priority")))


# flags .. deadline_ns in one read (what lies between skipped: padding bytes cost nothing to unpack)
_FLAGS_OFF, _T_READY_OFF, _PRIORITY_OFF = SLOT.offset("flags"), SLOT.offset("t_ready"), SLOT.offset("priority")
_SLOT_SCHEDULE = struct.Struct(f"<I{_T_READY_OFF - _FLAGS_OFF - 4}xQ{_PRIORITY_OFF - _T_READY_OFF - 8}xIIQ")
assert _FLAGS_OFF < _T_READY_OFF < _PRIORITY_OFF and _SLOT_SCHEDULE.size == SLOT.offset("deadline_ns") + 8 - _FLAGS_OFF


def read_slot_schedule(buf, geometry, index: int) -> tuple[int, int, int, int, int]:
    """(t_ready, priority, caller, deadline_ns, flags) of slot ``index``, as written: what a worker
    reads of a request it holds before claiming it (untrusted in a lane: ``shmserve.scheduling``
    clamps).  LayoutError for an index out of range."""
    flags, t_ready, priority, caller, deadline = _SLOT_SCHEDULE.unpack_from(buf, geometry.slot_off(index) + _FLAGS_OFF)
    return t_ready, priority, caller, deadline, flags


def reset_stages(buf, geometry: "Geometry", index: int, t_acquired: int, t_ready: int = 0) -> None:
    """Clear a slot's stage times and set when it was acquired (and made ready), in one store."""
    _SLOT_STAGES.pack_into(buf, geometry.slot_off(index) + SLOT.offset("t_acquired"), t_acquired, t_ready, 0, 0, 0, 0)


_U64 = struct.Struct("<Q")
_U16 = struct.Struct("<H")
# For the per-request paths that cannot afford a call per field (workers.step's stage times, workers.worker's
# caller of each gathered request): a slot field's codec, its offset from SLOT.offset; the encoding stays here.
U64, U32 = _U64, struct.Struct("<I")
_STAGE_OFFSETS = {stage: SLOT.offset(stage) for stage in STAGE_FIELDS}
SlotRequest = namedtuple("SlotRequest", "request_id model_id worker n_inputs n_outputs flags out_region out_off "
                                        "out_capacity")


def stamp(buf, geometry, index: int, stage: str, ns: int) -> None:
    """Record that slot ``index`` reached ``stage`` (one of STAGE_FIELDS) at monotonic ``ns``."""
    _U64.pack_into(buf, geometry.slot_off(index) + _STAGE_OFFSETS[stage], ns)


def set_n_outputs(buf, geometry, index: int, n_outputs: int) -> None:
    _U16.pack_into(buf, geometry.slot_off(index) + SLOT.offset("n_outputs"), n_outputs)


def decode_slot_request(buf, geometry, index: int) -> SlotRequest:
    """What a worker needs of slot ``index`` (counts and output area), in one read."""
    return SlotRequest._make(_SLOT_REQUEST.unpack_from(buf, geometry.slot_off(index) + SLOT.offset("request_id"))[:9])


def read_stages(buf, slot_off: int) -> tuple:
    """The six stage times of the slot at ``slot_off``, in STAGE_FIELDS order."""
    return _SLOT_STAGES.unpack_from(buf, slot_off + SLOT.offset("t_acquired"))


TENSOR = Record("Tensor", TENSOR_SIZE, [
    ("dtype", "B"),
    ("ndim", "B"),
    ("role", "B"),
    ("name_index", "B"),
    ("region", "I"),
    ("offset", "Q"),
    ("nbytes", "Q"),
    ("shape", f"{MAX_DIMS}q"),
])


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def class_alignment(extent_size: int) -> int:
    """Alignment of extents of one size class: 2 MiB from 2 MiB up, else 4 KiB."""
    return HUGE_PAGE if extent_size >= HUGE_PAGE else PAGE


@dataclass(frozen=True)
class SizeClass:
    extent_size: int
    extent_count: int
    offset: int = 0  # absolute arena offset of the first extent

    @property
    def end(self) -> int:
        return self.offset + self.extent_size * self.extent_count


class SlotTable:
    """Offsets of slots and their tensor descriptors: the arena's slot table or a lane's.
    Subclasses provide ``slot_count`` and ``slot_table_off``."""

    slot_count: int
    slot_table_off: int

    def slot_off(self, index: int) -> int:
        if not 0 <= index < self.slot_count:
            raise LayoutError(f"slot index {index} out of range 0..{self.slot_count - 1}")
        return self.slot_table_off + index * SLOT_SIZE

    def tensor_off(self, slot_index: int, tensor_index: int) -> int:
        if not 0 <= tensor_index < MAX_TENSORS:
            raise LayoutError(f"tensor index {tensor_index} out of range 0..{MAX_TENSORS - 1}")
        return self.slot_off(slot_index) + TENSORS_OFFSET + tensor_index * TENSOR_SIZE


@dataclass(frozen=True)
class Geometry(SlotTable):
    """Where every region of an arena lives.  Built by ``plan`` or ``decode_header``."""

    total_size: int
    max_workers: int
    slot_count: int
    ring_capacity: int
    ring_stride: int
    worker_table_off: int
    hist_table_off: int
    ring_table_off: int
    slot_table_off: int
    region_table_off: int
    max_regions: int
    data_off: int
    data_size: int
    classes: tuple[SizeClass, ...]

    def worker_off(self, index: int) -> int:
        if not 0 <= index < self.max_workers:
            raise LayoutError(f"worker index {index} out of range 0..{self.max_workers - 1}")
        return self.worker_table_off + index * WORKER_SIZE

    def hist_off(self, worker: int, stage: str) -> int:
        """Offset of a worker's histogram for ``stage`` (one of HIST_STAGES)."""
        if not 0 <= worker < self.max_workers:
            raise LayoutError(f"worker index {worker} out of range 0..{self.max_workers - 1}")
        return self.hist_table_off + worker * HIST_WORKER_SIZE + HIST_STAGES.index(stage) * HIST_STAGE_SIZE

    def clear_worker_histograms(self, buf, worker: int) -> None:
        """Zero worker ``worker``'s histograms (a new worker in a reused entry starts from none)."""
        start = self.hist_off(worker, HIST_STAGES[0])
        buf[start:start + HIST_WORKER_SIZE] = bytes(HIST_WORKER_SIZE)

    def region_off(self, index: int) -> int:
        """Offset of region record ``index`` (0 .. max_regions - 1)."""
        if not 0 <= index < self.max_regions:
            raise LayoutError(f"region record {index} out of range 0..{self.max_regions - 1}")
        return self.region_table_off + index * REGION_RECORD_SIZE

    def ring_off(self, worker: int, completion: bool) -> int:
        if not 0 <= worker < self.max_workers:
            raise LayoutError(f"worker index {worker} out of range 0..{self.max_workers - 1}")
        return self.ring_table_off + (2 * worker + int(completion)) * self.ring_stride

    def contains_data(self, offset: int, nbytes: int) -> bool:
        """True if [offset, offset+nbytes) lies inside the data region."""
        return self.data_off <= offset and nbytes >= 0 and offset + nbytes <= self.data_off + self.data_size

    def extent_class(self, offset: int, size: int) -> int:
        """Index of the size class holding exactly the extent [offset, offset+size); LayoutError otherwise."""
        for i, cls in enumerate(self.classes):
            if cls.offset <= offset < cls.end:
                if size != cls.extent_size or (offset - cls.offset) % cls.extent_size:
                    break
                return i
        raise LayoutError(f"[{offset}, +{size}) is not an extent of this arena")


def plan(*, slot_count: int, size_classes: Sequence[tuple[int, int]], max_workers: int,
         ring_capacity: int, max_regions: int = DEFAULT_MAX_REGIONS) -> Geometry:
    """Compute the geometry of a new arena.

    ``size_classes`` is a sequence of ``(extent_size, extent_count)``; sizes are
    rounded up to 4 KiB.  ``ring_capacity`` must be a power of two (a producer
    checks for room before it pushes).  Raises ValueError on
    impossible parameters.
    """
    if not 1 <= slot_count <= MAX_SLOTS:
        raise ValueError(f"slot_count must be in 1..{MAX_SLOTS}")
    if not 1 <= max_workers <= MAX_WORKERS:
        raise ValueError(f"max_workers must be in 1..{MAX_WORKERS}")
    if ring_capacity < 1 or ring_capacity & (ring_capacity - 1) or ring_capacity > MAX_RING_CAPACITY:
        raise ValueError(f"ring_capacity must be a power of two up to {MAX_RING_CAPACITY}")
    if not 1 <= max_regions <= MAX_REGIONS:
        raise ValueError(f"max_regions must be in 1..{MAX_REGIONS}")
    if not 1 <= len(size_classes) <= MAX_SIZE_CLASSES:
        raise ValueError(f"between 1 and {MAX_SIZE_CLASSES} size classes")
    ring_stride = _align(RING_ENTRIES_OFFSET + 8 * ring_capacity, CACHE_LINE)
    worker_table_off = HEADER_SIZE
    hist_table_off = _align(worker_table_off + max_workers * WORKER_SIZE, CACHE_LINE)
    ring_table_off = _align(hist_table_off + max_workers * HIST_WORKER_SIZE, CACHE_LINE)
    region_table_off = _align(ring_table_off + 2 * max_workers * ring_stride, CACHE_LINE)
    slot_table_off = _align(region_table_off + max_regions * REGION_RECORD_SIZE, PAGE)
    data_off = _align(slot_table_off + slot_count * SLOT_SIZE, HUGE_PAGE)
    for size, count in size_classes:
        if size < 1 or count < 1:
            raise ValueError(f"size class ({size}, {count}): size and count must be positive")
    pos, classes = data_off, []
    for size, count in sorted((_align(size, class_alignment(size)), count) for size, count in size_classes):
        pos = _align(pos, class_alignment(size))
        classes.append(SizeClass(size, count, pos))
        pos += size * count
    total = _align(pos, PAGE)
    return Geometry(total, max_workers, slot_count, ring_capacity, ring_stride, worker_table_off, hist_table_off,
                    ring_table_off, slot_table_off, region_table_off, max_regions, data_off, total - data_off,
                    tuple(classes))


def encode_header(buf, geometry: Geometry, *, instance: str, boot_id: bytes, created_unix_ns: int,
                  owner_pid: int, owner_start_ticks: int, socket_path: str = "") -> None:
    """Write a fresh header (state INITIALIZING) for ``geometry`` into ``buf``."""
    name = instance.encode()
    if len(name) > INSTANCE_MAX:
        raise ValueError(f"instance name longer than {INSTANCE_MAX} bytes")
    sock = socket_path.encode()
    if len(sock) > 107:
        raise ValueError("socket path longer than 107 bytes (the AF_UNIX limit)")
    fields = dict(
        magic=MAGIC, version=LAYOUT_VERSION, header_size=HEADER_SIZE, total_size=geometry.total_size,
        instance=name, boot_id=boot_id, created_unix_ns=created_unix_ns, owner_pid=owner_pid,
        state=ARENA_INITIALIZING, owner_start_ticks=owner_start_ticks, owner_heartbeat_ns=0,
        max_workers=geometry.max_workers, slot_count=geometry.slot_count,
        worker_table_off=geometry.worker_table_off, hist_table_off=geometry.hist_table_off,
        ring_table_off=geometry.ring_table_off, socket_path=sock,
        region_table_off=geometry.region_table_off, max_regions=geometry.max_regions,
        ring_capacity=geometry.ring_capacity, ring_stride=geometry.ring_stride,
        slot_table_off=geometry.slot_table_off, slot_size=SLOT_SIZE, n_classes=len(geometry.classes),
        data_off=geometry.data_off, data_size=geometry.data_size,
    )
    for i in range(MAX_SIZE_CLASSES):
        cls = geometry.classes[i] if i < len(geometry.classes) else SizeClass(0, 0, 0)
        fields.update({f"class{i}_size": cls.extent_size, f"class{i}_count": cls.extent_count,
                       f"class{i}_offset": cls.offset})
    HEADER.write(buf, 0, **fields)


@dataclass(frozen=True)
class HeaderInfo:
    """The identity part of a decoded header, plus its geometry."""

    instance: str
    boot_id: bytes
    created_unix_ns: int
    owner_pid: int
    owner_start_ticks: int
    owner_heartbeat_ns: int
    state: int
    geometry: Geometry
    socket_path: str = ""


def decode_header(buf, buffer_size: int | None = None) -> HeaderInfo:
    """Decode and validate the header of an arena of ``buffer_size`` bytes.

    Checks magic, version, sizes, that every region lies inside the buffer in
    order without overlapping, and that the geometry equals what ``plan``
    would compute from the same parameters (so no offset can be forged).
    Raises LayoutError describing the first inconsistency.
    """
    size = len(buf) if buffer_size is None else buffer_size
    if size < HEADER_SIZE:
        raise LayoutError(f"segment is {size} bytes, smaller than an arena header ({HEADER_SIZE})")
    h = HEADER.read(buf, 0)
    if h.magic != MAGIC:
        raise LayoutError(f"bad magic {h.magic!r}: not a shmserve arena")
    if h.version != LAYOUT_VERSION:
        raise LayoutError(f"arena layout version {h.version}, this shmserve reads version {LAYOUT_VERSION}")
    if h.header_size != HEADER_SIZE or h.slot_size != SLOT_SIZE:
        raise LayoutError("header or slot size differs from this layout version")
    if h.total_size != size:
        raise LayoutError(f"header says {h.total_size} bytes, segment has {size}")
    if h.state not in ARENA_STATE_NAMES:
        raise LayoutError(f"unknown arena state {h.state}")
    if not 1 <= h.n_classes <= MAX_SIZE_CLASSES:
        raise LayoutError(f"size-class count {h.n_classes} out of range")
    try:
        instance = h.instance.rstrip(b"\0").decode()
    except UnicodeDecodeError:
        raise LayoutError("instance name is not UTF-8") from None
    classes = [(getattr(h, f"class{i}_size"), getattr(h, f"class{i}_count")) for i in range(h.n_classes)]
    try:
        expected = plan(slot_count=h.slot_count, size_classes=classes, max_workers=h.max_workers,
                        ring_capacity=h.ring_capacity, max_regions=h.max_regions)
    except ValueError as exc:
        raise LayoutError(f"impossible geometry: {exc}") from None
    actual = Geometry(
        h.total_size, h.max_workers, h.slot_count, h.ring_capacity, h.ring_stride, h.worker_table_off,
        h.hist_table_off, h.ring_table_off, h.slot_table_off, h.region_table_off, h.max_regions, h.data_off,
        h.data_size,
        tuple(SizeClass(getattr(h, f"class{i}_size"), getattr(h, f"class{i}_count"),
                        getattr(h, f"class{i}_offset")) for i in range(h.n_classes)))
    if actual != expected:
        raise LayoutError("region offsets do not match the layout computed from the header's sizes")
    socket_path = h.socket_path.rstrip(b"\0").decode("utf-8", "replace")
    return HeaderInfo(instance, h.boot_id, h.created_unix_ns, h.owner_pid, h.owner_start_ticks,
                      h.owner_heartbeat_ns, h.state, actual, socket_path)



# ---------------------------------------------------------------------------
# Lanes: a client region whose first LANE_BYTES are a private queue to one worker.
#
#   0      lane header (LANE_HEADER): magic "SHMLANE1", version, model id, worker, spin hint, divert,
#          the model version it serves, its model's routing epoch (the front-end writes all but the first
#          three after it made it; the client reads them: ``shmserve.lanes``)
#   256    submission ring (client -> worker), LANE_SLOTS entries, same format as the arena's
#   +      completion ring (worker -> client)
#   1024   LANE_SLOTS slots, each the arena's SLOT + TENSOR records (SLOT_SIZE bytes)
#   65536  the client's data space (tensors the slots point at: region = this region's id)
#
# The geometry is fixed, never read from the lane: a client writes all of it and the
# worker decodes every slot and descriptor through the same validating decoders as the
# arena's, against this region only (region 0, the arena, is never reachable from a lane).

LANE_MAGIC = b"SHMLANE1"
LANE_VERSION = 1
LANE_SLOTS = 16
LANE_BYTES = 64 * 1024
LANE_HEADER = Record("LaneHeader", 64, [
    ("magic", "8s"),
    ("version", "I"),
    ("slot_count", "I"),
    ("model_id", "I"),
    ("worker", "I"),
    ("data_off", "Q"),
    ("spin_us", "I"),  # how long the client should spin for a completion before it sleeps (front-end's hint)
    ("divert", "I"),  # nonzero while Client.infer should not use the lane (the server is shutting down)
    ("serves", "I"),  # the model version the lane's calls run on now (0: not said); moves with a drain
    ("route_epoch", "I"),  # the model's routing epoch (``shmserve.routing``): a client routes by the route of this epoch
])


class LaneGeometry(SlotTable):
    """Where the rings and slots of a lane lie (the same for every lane)."""

    slot_count = LANE_SLOTS
    ring_capacity = LANE_SLOTS
    submission_off = 256
    completion_off = submission_off + _align(RING_ENTRIES_OFFSET + 8 * LANE_SLOTS, CACHE_LINE)
    slot_table_off = 1024
    data_off = LANE_BYTES

    def contains_data(self, offset: int, nbytes: int) -> bool:
        return False  # region 0 (the arena's data) is never named from a lane


LANE = LaneGeometry()
assert 2 * LANE.completion_off - LANE.submission_off <= LANE.slot_table_off  # both rings fit
assert LANE.slot_table_off + LANE_SLOTS * SLOT_SIZE <= LANE_BYTES


def encode_lane_header(buf, *, model_id: int, worker: int, spin_us: int, divert: int = 0, serves: int = 0,
                       route_epoch: int = 0) -> None:
    LANE_HEADER.write(buf, 0, magic=LANE_MAGIC, version=LANE_VERSION, slot_count=LANE_SLOTS,
                      model_id=model_id, worker=worker, data_off=LANE_BYTES, spin_us=spin_us, divert=divert,
                      serves=serves, route_epoch=route_epoch)


LANE_SPIN_OFFSET = LANE_HEADER.offset("spin_us")
LANE_WORKER_OFFSET = LANE_HEADER.offset("worker")
LANE_DIVERT_OFFSET = LANE_HEADER.offset("divert")
LANE_SERVES_OFFSET = LANE_HEADER.offset("serves")
LANE_EPOCH_OFFSET = LANE_HEADER.offset("route_epoch")
NO_WORKER = 0xFFFFFFFF  # a lane header's ``worker`` while no worker serves the lane

# ---------------------------------------------------------------------------
# Slot status word: generation << 32 | state.  One 64-bit word so that a CAS
# checks both at once: a stale handle (old generation) can never move a slot.

GENERATION_MASK = 0xFFFFFFFF


def pack_status(generation: int, state: int) -> int:
    return ((generation & GENERATION_MASK) << 32) | (state & 0xFFFFFFFF)


def unpack_status(word: int) -> tuple[int, int]:
    """Return (generation, state) of a status word."""
    return word >> 32, word & 0xFFFFFFFF


def next_generation(generation: int) -> int:
    """The generation a slot takes when it is acquired again (wraps at 2**32)."""
    return (generation + 1) & GENERATION_MASK


# ---------------------------------------------------------------------------
# Ring entries (u64).  A slot entry is ``generation << 32 | slot index``; on a worker's own
# submission ring an entry whose low 32 bits are COMMAND_BASE or more is a command from the
# front-end, its argument in the high 32 bits.  Slot indices stay below MAX_SLOTS, far below
# COMMAND_BASE, so the two can never be confused.

COMMAND_BASE = 0xFFFFFF00
CMD_STOP, CMD_ATTACH_LANE, CMD_DROP_REGION = 0xFFFFFFFF, 0xFFFFFFFE, 0xFFFFFFFD
STOP_ENTRY = 2**64 - 1  # CMD_STOP with argument 0xFFFFFFFF: finish what you have, then exit
assert MAX_SLOTS < COMMAND_BASE


def slot_entry(index: int, generation: int) -> int:
    """The ring entry that hands over slot ``index`` of ``generation``."""
    return (generation & GENERATION_MASK) << 32 | index


ENTRY_INDEX_MASK = 0xFFFFFFFF  # a slot entry's index bits (split_entry's, for a hot path that takes only the index)


def split_entry(entry: int) -> tuple[int, int]:
    """(slot index, generation) of a slot entry (untrusted: the caller checks the index)."""
    return entry & ENTRY_INDEX_MASK, entry >> 32


def command_entry(op: int, argument: int) -> int:
    """A command entry: CMD_ATTACH_LANE and CMD_DROP_REGION (which detaches a lane) take a region id."""
    return (argument & 0xFFFFFFFF) << 32 | op


def is_command(entry: int) -> bool:
    return entry & 0xFFFFFFFF >= COMMAND_BASE


# ---------------------------------------------------------------------------
# Tensor alignment: every tensor starts on a TENSOR_ALIGN boundary of the space it lies in.

def align_tensor(nbytes: int) -> int:
    """``nbytes`` rounded up to the tensor alignment (the space one tensor takes when packed)."""
    return (nbytes + TENSOR_ALIGN - 1) // TENSOR_ALIGN * TENSOR_ALIGN


def tensor_span(nbytes: int) -> int:
    """The space a tensor takes in an allocator that never hands out empty ranges."""
    return max(TENSOR_ALIGN, align_tensor(nbytes))


def is_tensor_aligned(offset: int) -> bool:
    return offset % TENSOR_ALIGN == 0


class TensorDesc(NamedTuple):
    """One tensor of a slot, validated against the space it lies in (a tuple: made per tensor on
    every request, so it must be cheap)."""

    role: int
    name_index: int
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # within its region (region 0: absolute arena offset)
    nbytes: int
    region: int = 0


def encode_tensor(buf, geometry: Geometry, slot_index: int, tensor_index: int, *, role: int,
                  name_index: int, dtype, shape: Sequence[int], offset: int, region: int = 0,
                  nbytes: int | None = None) -> int:
    """Write one tensor descriptor; returns its nbytes.

    ``nbytes``: a bytes tensor's serialized size (required for one: its shape does not say it;
    at least ``BYTES_LENGTH.size`` per element); for a fixed-size dtype it may be given and must
    then be what the shape says.  LayoutError on bad shapes, dtypes or sizes."""
    if len(shape) > MAX_DIMS:
        raise LayoutError(f"rank {len(shape)} exceeds the maximum of {MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise LayoutError(f"negative dimension in shape {tuple(shape)}")
    code = dtype_code(dtype)
    size = math.prod(shape) * _ITEMSIZE[code]
    if code == BYTES_CODE:
        if nbytes is None or not size <= nbytes < 2**64:
            raise LayoutError(f"a bytes tensor of shape {tuple(shape)} needs its nbytes, at least {size}; "
                              f"got {nbytes}")
    elif nbytes is not None and nbytes != size:
        raise LayoutError(f"shape {tuple(shape)} of {DTYPE_NAMES[code]} is {size} bytes, not {nbytes}")
    else:
        nbytes = size
    dims = list(shape) + [0] * (MAX_DIMS - len(shape))
    TENSOR.pack(buf, geometry.tensor_off(slot_index, tensor_index),
                code, len(shape), role, name_index, region, offset, nbytes, *dims)
    return nbytes


def decode_tensor(buf, geometry: Geometry, slot_index: int, tensor_index: int,
                  region_sizes=None) -> TensorDesc:
    """Read and validate one tensor descriptor: LayoutError if anything is out of bounds.

    Region 0 is checked against the arena's data region; region r > 0 against
    ``region_sizes[r]`` (a mapping of region id to size in bytes; an id not
    in it is an error).  A bytes tensor's nbytes must be at least
    ``BYTES_LENGTH.size`` per element (its elements are checked when they
    are read: ``decode_bytes``).
    """
    base = geometry.tensor_off(slot_index, tensor_index)
    try:
        code, ndim, role, name_index, region, offset, nbytes, *dims = TENSOR.unpack(buf, base)
    except struct.error as exc:
        raise LayoutError(f"tensor descriptor at {base}: {exc}") from None
    entry = _DECODE.get(code)
    if entry is None:
        raise LayoutError(f"unknown dtype code {code}")
    dtype, expected = entry
    if ndim > MAX_DIMS:
        raise LayoutError(f"tensor rank {ndim} exceeds {MAX_DIMS}")
    if role != ROLE_INPUT and role != ROLE_OUTPUT:
        raise LayoutError(f"unknown tensor role {role}")
    shape = tuple(dims[:ndim])
    for d in shape:
        if d < 0:
            raise LayoutError(f"negative dimension in shape {shape}")
        expected *= d
    if expected != nbytes and (code != BYTES_CODE or nbytes < expected):
        raise LayoutError(f"shape {shape} of {DTYPE_NAMES[code]} is {'at least ' if code == BYTES_CODE else ''}"
                          f"{expected} bytes, descriptor says {nbytes}")
    if offset % TENSOR_ALIGN:
        raise LayoutError(f"tensor offset {offset} is not {TENSOR_ALIGN}-byte aligned")
    if region == 0:
        if not geometry.contains_data(offset, nbytes):
            raise LayoutError(f"tensor [{offset}, +{nbytes}) lies outside the data region")
    else:
        size = None if region_sizes is None else region_sizes.get(region)
        if size is None:
            raise LayoutError(f"tensor lies in unknown region {region}")
        if offset + nbytes > size:
            raise LayoutError(f"tensor [{offset}, +{nbytes}) lies outside region {region} ({size} bytes)")
    return TensorDesc(role, name_index, dtype, shape, offset, nbytes, region)


# ---------------------------------------------------------------------------
# Bytes tensors (KServe v2 BYTES, Triton's TYPE_STRING): elements of any length, serialized
# in row-major order, each as its length (BYTES_LENGTH: u32, little-endian) and then its bytes,
# with nothing between or after them.  The same bytes in the arena, in a client region and in
# a frame's payload; the descriptor's nbytes is their total (a shape does not say it).  In
# numpy a bytes tensor is an object array of ``bytes`` (``BYTES_DTYPE``); ``str`` elements
# are taken as their UTF-8.

def encode_bytes(array) -> bytes:
    """The serialized form of a bytes tensor: ``array`` (an object array, or anything numpy makes
    one of) of bytes, bytearray or str elements.  LayoutError naming the first element that is
    none of these (or one of 4 GiB or more)."""
    flat = np.asarray(array, dtype=object).reshape(-1)
    pack, parts = BYTES_LENGTH.pack, []
    for i, element in enumerate(flat):
        if isinstance(element, str):
            element = element.encode()
        elif not isinstance(element, (bytes, bytearray)):
            raise LayoutError(f"element {i} of a bytes tensor is {type(element).__name__}, not bytes or str")
        try:
            parts.append(pack(len(element)))
        except struct.error:
            raise LayoutError(f"element {i} of a bytes tensor is {len(element)} bytes, more than a u32 "
                              f"length says") from None
        parts.append(element)
    return b"".join(parts)


def decode_bytes(buf, shape: Sequence[int], offset: int = 0, nbytes: int | None = None) -> np.ndarray:
    """A bytes tensor of ``shape`` from ``nbytes`` bytes of ``buf`` at ``offset`` (default: to
    the end): a new object array of ``bytes``.  Untrusted: LayoutError unless exactly
    ``prod(shape)`` elements take exactly ``nbytes`` (a length running past the end, bytes left
    over, fewer bytes than the lengths alone need)."""
    with memoryview(buf) as whole, whole.cast("B") as view:  # released on the way out: buf may be unmapped
        end = len(view) if nbytes is None else offset + nbytes
        if not 0 <= offset <= end <= len(view):
            raise LayoutError(f"bytes tensor [{offset}, {end}) lies outside its buffer of {len(view)} bytes")
        count = math.prod(shape)
        step = BYTES_LENGTH.size
        if count * step > end - offset:
            raise LayoutError(f"{count} elements need at least {count * step} bytes, the tensor has "
                              f"{end - offset}")
        out = np.empty(count, dtype=object)
        unpack, pos = BYTES_LENGTH.unpack_from, offset
        for i in range(count):
            if end - pos < step:
                raise LayoutError(f"element {i} of {count}: its length lies past the end of the tensor")
            (length,) = unpack(view, pos)
            pos += step
            if length > end - pos:
                raise LayoutError(f"element {i} of {count}: length {length} runs past the end of the tensor "
                                  f"({end - pos} bytes left)")
            out[i] = bytes(view[pos:pos + length])
            pos += length
        if pos != end:
            raise LayoutError(f"{end - pos} bytes follow the last of {count} elements")
    return out.reshape(tuple(shape))


def array_from_bytes(data, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """A new array of ``dtype`` (a name) and ``shape`` holding the tensor bytes ``data`` (raw
    elements; a bytes tensor's serialized form).  LayoutError if they do not make one."""
    if dtype == BYTES:
        return decode_bytes(data, shape)
    out = np.empty(tuple(shape), numpy_dtype(dtype))
    if out.nbytes != len(data):
        raise LayoutError(f"shape {tuple(shape)} of {dtype} is {out.nbytes} bytes, the data {len(data)}")
    if out.nbytes:
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, np.uint8)
    return out


def region_of_tensor(buf, geometry: Geometry, slot_index: int, tensor_index: int) -> int:
    """The region id a tensor descriptor names (to map it before ``decode_tensor``)."""
    return TENSOR.read_field(buf, geometry.tensor_off(slot_index, tensor_index), "region")


def decode_error(buf, geometry: Geometry, slot_index: int) -> tuple[int, str]:
    """Return (error_code, message) of a slot; the message is bounded and decoded leniently."""
    base = geometry.slot_off(slot_index)
    code = SLOT.read_field(buf, base, "error_code")
    length = min(SLOT.read_field(buf, base, "error_len"), ERROR_MESSAGE_MAX)
    raw = SLOT.read_field(buf, base, "error_msg")[:length]
    return code, raw.decode("utf-8", "replace")


def encode_error(buf, geometry: Geometry, slot_index: int, code: int, message: str) -> None:
    """Write an error code and message (truncated to ERROR_MESSAGE_MAX bytes on a UTF-8 boundary)."""
    raw = message.encode()[:ERROR_MESSAGE_MAX].decode("utf-8", "ignore").encode()
    SLOT.write(buf, geometry.slot_off(slot_index), error_code=code, error_len=len(raw), error_msg=raw)


# ---------------------------------------------------------------------------
# Histograms: per worker and stage, HIST_BUCKETS u64 counters then the u64 sum, at
# ``Geometry.hist_off``.  Workers add with fetch_add64; readers take a moment's copy.

_HISTOGRAM = struct.Struct(f"<{HIST_BUCKETS + 1}Q")
_HIST_SUM = 8 * HIST_BUCKETS
_HIST_PAIRS = tuple((HIST_STAGES.index(stage) * HIST_STAGE_SIZE, STAGE_FIELDS.index(start), STAGE_FIELDS.index(end))
                    for stage, (start, end) in HIST_STAGE_BOUNDS.items())


def read_histogram(buf, geometry: Geometry, worker: int, stage: str) -> tuple[tuple[int, ...], int]:
    """(bucket counts, sum) of one worker's histogram for ``stage``; LayoutError if out of range."""
    try:
        *buckets, total = _HISTOGRAM.unpack_from(buf, geometry.hist_off(worker, stage))
    except struct.error as exc:
        raise LayoutError(f"histogram of worker {worker}: {exc}") from None
    return tuple(buckets), total


def read_histograms(buf, geometry: Geometry, workers, stage: str) -> tuple[tuple[int, ...], int]:
    """(bucket counts, sum) of ``stage`` summed over the workers (indices) given."""
    counts, total = [0] * HIST_BUCKETS, 0
    for worker in workers:
        buckets, worker_total = read_histogram(buf, geometry, worker, stage)
        counts = [a + b for a, b in zip(counts, buckets)]
        total += worker_total
    return tuple(counts), total


def sample_offsets(geometry: Geometry, worker: int, stage: str, value: int) -> tuple[int, int]:
    """Where ``record_sample`` counts ``value`` (>= 0) in one worker's histogram for ``stage``: (its
    bucket's counter, the sum), for one who counts the same value often (a worker's runs of one
    request: ``workers.step``).  LayoutError for a worker out of range."""
    base = geometry.hist_off(worker, stage)
    return base + 8 * hist_bucket(value), base + _HIST_SUM


def record_sample(buf, geometry: Geometry, worker: int, stage: str, value: int) -> None:
    """Count ``value`` (>= 0) in one worker's histogram for ``stage``."""
    bucket, total = sample_offsets(geometry, worker, stage, value)
    atomics.fetch_add64(buf, bucket, 1)
    atomics.fetch_add64(buf, total, value)


def record_stages(arena_buf, geometry: Geometry, worker: int, slot_buf, slot_off: int) -> None:
    """Add the stage durations of the finished slot at ``slot_off`` in ``slot_buf`` (the arena or a
    lane) to ``worker``'s histograms in the arena.  Times come from the slot: a lane's are written
    by its client, so nonsense (end before start) is skipped and huge values land in the top bucket."""
    record_stages_at(arena_buf, geometry.hist_off(worker, HIST_STAGES[0]), slot_buf, slot_off)


def record_stages_at(arena_buf, base: int, slot_buf, slot_off: int) -> None:
    """``record_stages`` into the histograms at ``base`` (``Geometry.hist_off(worker, HIST_STAGES[0])``)."""
    times = read_stages(slot_buf, slot_off)
    add, top = atomics.fetch_add64, HIST_BUCKETS - 1
    for stage_off, start, end in _HIST_PAIRS:
        t0, t1 = times[start], times[end]
        if t0 and t1 >= t0:
            micros = (t1 - t0) // 1000
            off = base + stage_off
            add(arena_buf, off + 8 * min(max(micros, 1).bit_length() - 1, top), 1)  # hist_bucket, inlined
            add(arena_buf, off + _HIST_SUM, micros)


# ---------------------------------------------------------------------------
# The compiled hot path (shmserve/_hotpath.c, chosen by shmserve.hotpath) has no offsets of its own:
# it is handed every offset, size and encoding it uses from the records above, once, at import.

def hotpath_constants() -> dict:
    """What ``shmserve._hotpath.configure`` takes: slot, tensor, ring, lane and histogram offsets,
    the status word's packing, the dtype table.  ``tests/test_hotpath.py`` checks the module holds
    exactly these."""
    dtypes = max(DTYPE_CODES.values()) + 1
    return dict(
        slot_size=SLOT_SIZE, tensors_off=TENSORS_OFFSET, tensor_size=TENSOR_SIZE, max_tensors=MAX_TENSORS,
        max_dims=MAX_DIMS, tensor_align=TENSOR_ALIGN,
        status_off=SLOT.offset("status"), request_id_off=SLOT.offset("request_id"),
        model_id_off=SLOT.offset("model_id"), worker_off=SLOT.offset("worker"),
        n_inputs_off=SLOT.offset("n_inputs"), n_outputs_off=SLOT.offset("n_outputs"),
        flags_off=SLOT.offset("flags"), out_region_off=SLOT.offset("out_region"),
        out_off_off=SLOT.offset("out_off"), out_capacity_off=SLOT.offset("out_capacity"),
        error_code_off=SLOT.offset("error_code"), error_len_off=SLOT.offset("error_len"),
        error_msg_off=SLOT.offset("error_msg"), error_msg_max=ERROR_MESSAGE_MAX,
        request_span=_SLOT_REQUEST.size,  # request_id .. error_len, padding included: encode_slot_request
        stages_off=SLOT.offset(STAGE_FIELDS[0]), n_stages=len(STAGE_FIELDS),
        **{f"stage_{name[2:]}": STAGE_FIELDS.index(name) for name in ("t_acquired", "t_ready", "t_claimed", "t_done")},
        t_dtype_off=TENSOR.offset("dtype"), t_ndim_off=TENSOR.offset("ndim"), t_role_off=TENSOR.offset("role"),
        t_name_off=TENSOR.offset("name_index"), t_region_off=TENSOR.offset("region"),
        t_offset_off=TENSOR.offset("offset"), t_nbytes_off=TENSOR.offset("nbytes"),
        t_shape_off=TENSOR.offset("shape"), role_input=ROLE_INPUT, role_output=ROLE_OUTPUT,
        generation_shift=32, generation_mask=GENERATION_MASK,
        ring_tail=RING_TAIL, ring_head=RING_HEAD, ring_seq=RING_SEQ, ring_waiters=RING_WAITERS,
        ring_entries=RING_ENTRIES_OFFSET,
        lane_bytes=LANE_BYTES, lane_slots=LANE.slot_count, lane_slot_table_off=LANE.slot_table_off,
        lane_submission_off=LANE.submission_off, lane_completion_off=LANE.completion_off,
        lane_ring_capacity=LANE.ring_capacity,
        hist_buckets=HIST_BUCKETS, hist_sum_off=_HIST_SUM, hist_worker_size=HIST_WORKER_SIZE,
        hist_pairs=_HIST_PAIRS,
        lane_outcome_off=LANE_OUTCOME_OFFSET, lane_outcome_buckets=LANE_OUTCOME_BUCKETS,
        lane_sub_bits=LANE_SUB_BITS, lane_time_shift=LANE_TIME_SHIFT,
        lane_fault_mask=sum(1 << code for code in LANE_FAULT_CODES),
        priority_off=SLOT.offset("priority"), deadline_off=SLOT.offset("deadline_ns"),
        bytes_code=BYTES_CODE,
        itemsizes=tuple(_ITEMSIZE.get(code, 0) for code in range(dtypes)),
        dtypes=tuple(_DTYPES.get(code) for code in range(dtypes)),
        dtype_names=tuple(DTYPE_NAMES.get(code) for code in range(dtypes)),
        code_of_dtype=dict(_CODE_OF_DTYPE),
        no_zero_copy_bytes=NO_ZERO_COPY_BYTES,
    )
