"""Arena lifecycle, permissions, validation on attach, slot transitions, and the allocator."""

from __future__ import annotations

import grp
import os
import pickle
import stat

import numpy as np
import posix_ipc
import pytest

from shmserve import layout
from shmserve.allocator import AllocationError, ExtentAllocator, SlotPool
from shmserve.arena import SHM_DIR, Arena, ArenaError, ArenaExists, ArenaNotFound, SlotConflict
from shmserve.layout import arena_name, validate_instance
from shmserve.slotstate import Actor, IllegalTransition, SlotState

from conftest import shm_names

SMALL = dict(slot_count=8, max_workers=2, size_classes=[(4096, 4), (3333 * 1024, 2)])


def test_create_attach_share_memory(instance_name):
    name = instance_name()
    with Arena.create(name, **SMALL) as owner, Arena.attach(name) as other:
        assert owner.geometry == other.geometry
        assert other.info.owner_pid == os.getpid()
        assert owner.state() == layout.ARENA_LIVE
        off = owner.geometry.classes[1].offset
        owner.buf[off:off + 5] = b"hello"
        assert other.buf[off:off + 5] == b"hello"
        owner.beat()
        assert other.heartbeat_ns() == owner.heartbeat_ns() > 0
    assert f"shmserve.{name}" not in shm_names()


def test_arena_is_private_to_its_user(instance_name):
    with Arena.create(instance_name(), **SMALL) as arena:
        mode = stat.S_IMODE(os.stat(os.path.join(SHM_DIR, arena.name[1:])).st_mode)
        assert mode == 0o600


def test_group_arena_is_0660_even_under_a_strict_umask(instance_name):
    gid = os.getgid()
    old = os.umask(0o077)
    try:
        with Arena.create(instance_name(), group=grp.getgrgid(gid).gr_name, **SMALL) as arena:
            st = os.stat(os.path.join(SHM_DIR, arena.name[1:]))
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
    finally:
        os.umask(old)
    with pytest.raises(ArenaError, match="does not exist"):
        Arena.create(instance_name(), group="no-such-group-shmserve", **SMALL)


def test_create_refuses_an_existing_name(instance_name):
    name = instance_name()
    with Arena.create(name, **SMALL):
        with pytest.raises(ArenaExists, match="cleanup"):
            Arena.create(name, **SMALL)


def test_close_is_idempotent_and_unlink_is_owner_only(instance_name):
    name = instance_name()
    owner = Arena.create(name, **SMALL)
    other = Arena.attach(name)
    with pytest.raises(ArenaError, match="only the creator"):
        other.unlink()
    other.close()
    other.close()
    assert other.closed
    owner.unlink()
    owner.unlink()
    owner.close()
    owner.close()
    with pytest.raises(ArenaNotFound):
        Arena.attach(name)


def test_close_refuses_while_views_are_alive(instance_name):
    with Arena.create(instance_name(), **SMALL) as arena:
        view = np.frombuffer(arena.buf, dtype=np.uint8, count=16, offset=arena.geometry.data_off)
        with pytest.raises(BufferError):
            arena.close()
        del view
        arena.close()


def test_failed_create_leaves_nothing_behind(instance_name):
    before = shm_names()
    with pytest.raises(ArenaError, match="cannot allocate"):
        Arena.create(instance_name(), slot_count=4, max_workers=1, size_classes=[(2**40, 64)])
    with pytest.raises(ArenaError, match="cannot lay out"):
        Arena.create(instance_name(), slot_count=0)
    assert shm_names() == before


def test_invalid_instance_names():
    for bad in ["", "a/b", "../x", "a b", "x" * 65, "dot.ted", None]:
        with pytest.raises(ValueError):
            validate_instance(bad)
    assert arena_name("demo_1-x") == "/shmserve.demo_1-x"


def test_attach_refuses_foreign_and_corrupt_segments(instance_name):
    name = instance_name()
    raw = posix_ipc.SharedMemory(arena_name(name), posix_ipc.O_CREX, size=3 * 4096)
    try:
        os.pwrite(raw.fd, b"garbage!" * 64, 0)
        os.pwrite(raw.fd, b"\1\0\0\0", layout.HEADER.offset("state"))  # not "initializing"
        with pytest.raises(ArenaError, match="corrupt or foreign"):
            Arena.attach(name)
        os.ftruncate(raw.fd, 100)
        with pytest.raises(ArenaError, match="100 bytes"):
            Arena.attach(name)
    finally:
        raw.close_fd()
        raw.unlink()
    # a real arena whose header was damaged afterwards
    with Arena.create(name, **SMALL) as arena:
        layout.HEADER.write(arena.buf, 0, slot_table_off=arena.geometry.slot_table_off + 64)
        with pytest.raises(ArenaError, match="corrupt"):
            Arena.attach(name)


def test_read_only_attach_cannot_write(instance_name):
    name = instance_name()
    with Arena.create(name, **SMALL) as owner, Arena.attach(name, read_only=True) as ro:
        owner.transition(0, 0, SlotState.FREE, SlotState.WRITING, Actor.FRONTEND)
        assert ro.slot_status(0) == (1, SlotState.WRITING)
        with pytest.raises(TypeError):
            ro.transition(0, 1, SlotState.WRITING, SlotState.READY, Actor.FRONTEND)
        with pytest.raises(TypeError):
            ro.buf[0] = 1


def test_pickles_as_its_name(instance_name):
    name = instance_name()
    with Arena.create(name, **SMALL) as owner:
        clone = pickle.loads(pickle.dumps(owner))
        try:
            assert not clone.is_owner and clone.geometry == owner.geometry
        finally:
            clone.close()


def test_slot_generations_and_transitions(instance_name):
    with Arena.create(instance_name(), **SMALL) as arena:
        F, W, R, RUN, D, E = (SlotState.FREE, SlotState.WRITING, SlotState.READY, SlotState.RUNNING,
                              SlotState.DONE, SlotState.ERROR)
        gen = arena.transition(3, 0, F, W, Actor.FRONTEND)
        assert gen == 1
        arena.transition(3, gen, W, R, Actor.FRONTEND)
        with pytest.raises(IllegalTransition):
            arena.transition(3, gen, R, RUN, Actor.FRONTEND)  # claiming is the worker's edge
        arena.transition(3, gen, R, RUN, Actor.WORKER)
        with pytest.raises(SlotConflict):
            arena.transition(3, gen, R, RUN, Actor.WORKER)  # lost race: already running
        arena.transition(3, gen, RUN, D, Actor.WORKER)
        arena.transition(3, gen, D, F, Actor.FRONTEND)
        gen2 = arena.transition(3, gen, F, W, Actor.FRONTEND)
        assert gen2 == gen + 1
        with pytest.raises(SlotConflict) as info:  # a stale handle cannot move the reused slot
            arena.transition(3, gen, W, R, Actor.FRONTEND)
        assert info.value.actual == (gen2, W)
        arena.transition(3, gen2, W, R, Actor.FRONTEND)
        arena.transition(3, gen2, R, E, Actor.FRONTEND)
        arena.transition(3, gen2, E, F, Actor.FRONTEND)
        with pytest.raises(IllegalTransition):
            arena.transition(3, gen2, F, D, Actor.WORKER)
        with pytest.raises(layout.LayoutError):
            arena.slot_status(SMALL["slot_count"])


def test_stats_and_stamps(instance_name):
    with Arena.create(instance_name(), **SMALL) as arena:
        arena.add_stat("requests_total", 3)
        arena.add_stat("slots_in_use", 2)
        arena.add_stat("slots_in_use", -1)
        assert arena.stat("requests_total") == 3 and arena.stat("slots_in_use") == 1
        arena.stamp(1, "t_ready")
        assert layout.SLOT.read(arena.buf, arena.geometry.slot_off(1)).t_ready > 0


def test_slot_pool():
    pool = SlotPool(3)
    got = [pool.acquire() for _ in range(4)]
    assert got == [0, 1, 2, None] and pool.in_use == 3
    pool.release(1)
    assert pool.acquire() == 1
    with pytest.raises(AllocationError):
        pool.release(7)


def test_extent_allocator_classes_alignment_and_fallback():
    g = layout.plan(slot_count=4, size_classes=[(4096, 2), (64 * 1024, 1), (3 * 1024 * 1024, 1)],
                    max_workers=1, ring_capacity=4)
    alloc = ExtentAllocator(g)
    a = alloc.allocate(1)
    b = alloc.allocate(4096)
    assert a.size == b.size == 4096 and a.offset % 4096 == 0 and a.offset != b.offset
    c = alloc.allocate(100)  # small class exhausted: falls back to the next
    assert c.size == 64 * 1024
    d = alloc.allocate(3 * 1024 * 1024)
    assert d.size == 4 * 1024 * 1024 and d.offset % layout.HUGE_PAGE == 0
    assert alloc.allocate(1) is None  # everything is in use
    assert alloc.bytes_in_use == 2 * 4096 + 64 * 1024 + 4 * 1024 * 1024
    with pytest.raises(ValueError, match="largest"):
        alloc.allocate(alloc.largest + 1)
    alloc.free(a)
    with pytest.raises(AllocationError):
        alloc.free(a)
    assert alloc.allocate(10).offset == a.offset
    for ext in (b, c, d):
        assert g.extent_class(ext.offset, ext.size) == ext.size_class
    with pytest.raises(layout.LayoutError):
        g.extent_class(a.offset + 64, 4096)


def test_rings_hold_every_slot_twice_by_default(instance_name):
    """Room for every slot once plus as many commands and stale entries (the front-end still checks
    for room before each push)."""
    with Arena.create(instance_name(), slot_count=100, max_workers=1, size_classes=[(4096, 1)],
                      prefault=False) as arena:
        assert arena.geometry.ring_capacity == 256


def test_a_dev_shm_too_small_is_said_in_one_line_naming_its_size_and_the_fixes():
    import errno

    from shmserve.arena import SHM_DIR, no_room

    message = no_room(200 << 20, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert "\n" not in message and message.startswith("cannot allocate the 200.0 MiB arena in /dev/shm: ")
    st = os.statvfs(SHM_DIR)
    assert f"of its {st.f_blocks * st.f_frsize / (1 << 20):.1f} MiB" in message
    assert "No space left on device" in message and "--shm-size" in message and "max_request_bytes" in message
