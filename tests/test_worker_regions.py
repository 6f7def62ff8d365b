"""Client regions in a worker, and the order a worker's resources are released in.

Regions are real sealed memfds, passed over a real socketpair the way the
front-end passes them to a worker; the arena is real.  Page-locking is
played by ``LockRecorder``, which stands in for ``workers.regions.GpuMemory``
only as bookkeeping: it notes each registration and whether the memory was
still mapped when it was unregistered.  The real CUDA registrations run in
test_gpu.py (GPU machines), through the same ``locked`` context managers.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import mmap
import os
import socket
import threading

import numpy as np
import pytest

from shmserve import layout, workerlink
from shmserve.arena import Arena
from shmserve.config import ModelConfig
from shmserve.errors import ErrorCode
from shmserve.frontend.regions import sealed_memfd
from workers.regions import RegionCache
from workers.step import RequestFailed
from workers.worker import StartFailed, open_worker

EVENTS: list[tuple] = []  # what happened, in order: the recorder's and the backend's


class LockRecorder:
    """GpuMemory's interface, recording instead of registering (``fail`` names a buffer it refuses)."""

    def __init__(self, fail: str | None = None):
        self.fail = fail
        self.memory = "device memory"
        self.in_use = iter(range(1 << 30, 1 << 31, 12345))  # the device's use: 12345 bytes more at each look

    def bytes_in_use(self) -> int:
        return next(self.in_use)

    @contextlib.contextmanager
    def locked(self, buf, what: str):
        if what == self.fail:
            raise RuntimeError("cudaHostRegister failed: memlock")
        EVENTS.append(("lock", what))
        try:
            yield what
        finally:
            EVENTS.append(("unlock", what, "mapped" if not buf.closed else "UNMAPPED"))

    def describe(self, registration) -> dict:
        return {"registered": registration}


class RecordedIdentity:
    """A python-backend model whose close is recorded (``options = {factory = true}``)."""

    inputs = [{"name": "x", "dtype": "uint8", "shape": ["n"]}]
    outputs = [{"name": "y", "dtype": "uint8", "shape": ["n"]}]

    def __init__(self, config):
        pass

    def __call__(self, inputs):
        return {"y": inputs["x"]}

    def close(self):
        EVENTS.append(("backend closed",))


@pytest.fixture
def region_maker():
    """Sends sealed regions to a worker's end of a control socketpair (``fetch`` takes them there,
    as ``workers.main`` does); ``open_fds`` counts this process's descriptors."""
    front, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def make(region: int, size: int = 65536) -> None:
        fd = sealed_memfd(f"test.r{region}", size)
        try:
            assert workerlink.send_region(front, region, size, fd)
        finally:
            os.close(fd)

    make.fetch = functools.partial(workerlink.receive_regions, worker)
    yield make
    front.close()
    worker.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_region_is_mapped_on_first_use_at_its_sent_size_and_dropped_when_told(region_maker):
    before = open_fds()
    region_maker(3, 3 * 4096)
    region_maker(4)
    with RegionCache(region_maker.fetch) as regions:
        regions.ensure(0)  # the arena: never a region
        regions.ensure(3)
        regions.ensure(4)
        assert regions.sizes == {3: 3 * 4096, 4: 65536} and not regions.given
        mapping = regions.maps[3]
        regions.ensure(3)
        assert regions.maps[3] is mapping  # mapped once
        regions.forget(3)
        assert mapping.closed and 3 not in regions.maps and 4 in regions.maps
        four = regions.maps[4]
    assert four.closed and not regions.maps
    assert open_fds() == before  # every descriptor received was closed once mapped


def test_a_region_forgotten_before_its_first_use_closes_its_descriptor(region_maker):
    before = open_fds()
    region_maker(5)
    region_maker(6)
    with RegionCache(region_maker.fetch) as regions:
        regions.forget(5)  # takes what arrived, closes region 5's descriptor
        assert set(regions.given) == {6} and open_fds() == before + 1
        with pytest.raises(RequestFailed) as info:
            regions.ensure(5)
        assert info.value.code is ErrorCode.BAD_REGION
    assert open_fds() == before  # region 6's descriptor, never mapped, closed with the cache


def test_a_region_that_was_never_sent_is_a_bad_region(region_maker):
    with RegionCache(region_maker.fetch) as regions, pytest.raises(RequestFailed) as info:
        regions.ensure(99)
    assert info.value.code is ErrorCode.BAD_REGION
    assert info.value.message == "region 99 is not open (closed, or never opened)"


def test_a_sealed_region_cannot_shrink_or_grow_under_a_worker(region_maker):
    """The attack of issue 11 finding 1: a client truncating its region to 0 would SIGBUS the
    worker.  The descriptor the client gets is the same sealed memfd."""
    fd = sealed_memfd("test.sealed", 8192)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) == (
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        for size in (0, 4096, 1 << 30):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # the seals cannot be changed either
        with mmap.mmap(fd, 8192) as m:  # writing is the client's right
            m[-1] = 7
        assert os.fstat(fd).st_size == 8192
    finally:
        os.close(fd)


def test_a_region_is_unregistered_before_it_is_unmapped(region_maker):
    region_maker(5)
    region_maker(6)
    EVENTS.clear()
    with RegionCache(region_maker.fetch, LockRecorder()) as regions:
        regions.ensure(5)
        regions.ensure(6)
        regions.drop(5)
        assert EVENTS == [("lock", "region 5"), ("lock", "region 6"), ("unlock", "region 5", "mapped")]
    assert EVENTS[-1] == ("unlock", "region 6", "mapped")


def test_a_region_that_cannot_be_page_locked_fails_the_request_and_stays_unmapped(region_maker):
    region_maker(7)
    EVENTS.clear()
    with RegionCache(region_maker.fetch, LockRecorder(fail="region 7")) as regions:
        with pytest.raises(RequestFailed) as info:
            regions.ensure(7)
        assert info.value.code is ErrorCode.INTERNAL and "cannot page-lock region 7" in info.value.message
        assert 7 not in regions.maps and EVENTS == []


def test_a_worker_unwinds_regions_then_backend_then_arena_registration_then_mapping(instance_name, region_maker):
    instance = instance_name("reg")
    region_maker(8)
    config = ModelConfig(name="recorded", backend="python", path="test_worker_regions:RecordedIdentity",
                         options={"factory": True})
    EVENTS.clear()
    with Arena.create(instance, slot_count=4, max_workers=1, size_classes=[(4096, 4)], prefault=False):
        completion_fd = os.eventfd(0)
        try:
            with contextlib.ExitStack() as stack:
                arena = stack.enter_context(Arena.attach(instance))  # the mapping: first in, last out
                worker = open_worker(stack, arena, 0, config, completion_fd, 0.0, region_maker.fetch, LockRecorder())
                assert worker.gpu_info == {"registered": f"arena {arena.name}"}
                # before the load and after warm-up: the device's use grew by 12345 bytes meanwhile
                assert worker.memory["device_bytes"] == 12345 and worker.memory["host_bytes"] > 0
                assert worker.warmup["runs"] == 1
                worker.regions.ensure(8)
                view = np.ndarray(16, np.uint8, buffer=worker.regions.maps[8])  # views end before unmapping
                del view
            assert EVENTS == [("lock", f"arena {arena.name}"), ("lock", "region 8"),
                              ("unlock", "region 8", "mapped"), ("backend closed",),
                              ("unlock", f"arena {arena.name}", "mapped")]
            assert arena.closed
            assert "heartbeat" not in {t.name for t in threading.enumerate()}  # it wrote into the arena
        finally:
            os.close(completion_fd)


def test_a_worker_that_cannot_load_unwinds_what_it_opened(instance_name):
    instance = instance_name("load")
    config = ModelConfig(name="broken", backend="python", path="serving_models:broken_factory",
                         options={"factory": True})
    EVENTS.clear()
    with Arena.create(instance, slot_count=4, max_workers=1, size_classes=[(4096, 4)], prefault=False):
        with contextlib.ExitStack() as stack:
            arena = stack.enter_context(Arena.attach(instance))
            with pytest.raises(StartFailed) as info:
                open_worker(stack, arena, 0, config, -1, 0.0, list, LockRecorder())
            assert EVENTS == [("lock", f"arena {arena.name}")]
        assert EVENTS[-1] == ("unlock", f"arena {arena.name}", "mapped") and arena.closed
    assert info.value.exit_code == workerlink.EXIT_LOAD_FAILED
    assert info.value.message == ("cannot load model 'broken' (python, serving_models:broken_factory): "
                                  "RuntimeError: this model cannot be loaded")


def test_an_arena_that_cannot_be_page_locked_stops_the_worker_with_what_to_change(instance_name):
    instance = instance_name("lock")
    config = ModelConfig(name="m", backend="python", path="shmserve.models:identity", device="cuda:0")
    with Arena.create(instance, slot_count=4, max_workers=1, size_classes=[(4096, 4)], prefault=False):
        with contextlib.ExitStack() as stack:
            arena = stack.enter_context(Arena.attach(instance))
            with pytest.raises(StartFailed) as info:
                open_worker(stack, arena, 0, config, -1, 0.0, list, LockRecorder(fail=f"arena {arena.name}"))
    assert info.value.exit_code == workerlink.EXIT_ARENA_FAILED
    assert info.value.message == "cannot use cuda:0 for model 'm': cudaHostRegister failed: memlock"


def test_a_lane_the_worker_cannot_map_is_reported_not_silently_dropped(instance_name, region_maker):
    """An attach command for a region the worker cannot map (here: never given to it) is told to
    the front-end (``tell_lane_failed``), which fails the lane's calls; the worker serves on."""
    from shmserve.rings import Ring

    instance = instance_name("lanefail")
    config = ModelConfig(name="m", backend="python", path="shmserve.models:identity")
    told = []
    with Arena.create(instance, slot_count=4, max_workers=1, size_classes=[(4096, 4)], prefault=False):
        completion_fd = os.eventfd(0)
        try:
            with contextlib.ExitStack() as stack:
                arena = stack.enter_context(Arena.attach(instance))
                worker = open_worker(stack, arena, 0, config, completion_fd, 0.0, region_maker.fetch,
                                     tell_lane_failed=lambda region, why: told.append((region, why)))
                Ring.of_worker(arena, 0, completion=False).push(layout.command_entry(layout.CMD_ATTACH_LANE, 5))
                assert worker.gather() == ([], False)
                assert told == [(5, "region 5 is not open (closed, or never opened)")] and 5 not in worker.lanes
        finally:
            os.close(completion_fd)
