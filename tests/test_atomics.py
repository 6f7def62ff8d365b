"""The C extension on its own: values, bounds, alignment, buffer types, futex wait/wake across processes."""

from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap
import time

import numpy as np
import posix_ipc
import pytest

from shmserve import _atomics as atomics

LOADS = [atomics.load32, atomics.load64]
WIDTH = {atomics.load32: 4, atomics.load64: 8}


@pytest.fixture
def buf():
    m = mmap.mmap(-1, 4096)
    yield m
    m.close()


def test_load_store_roundtrip(buf):
    atomics.store32(buf, 4, 0xDEADBEEF)
    atomics.store64(buf, 8, 0x0123456789ABCDEF)
    assert atomics.load32(buf, 4) == 0xDEADBEEF
    assert atomics.load64(buf, 8) == 0x0123456789ABCDEF
    assert buf[4:8] == (0xDEADBEEF).to_bytes(4, "little")


def test_cas_succeeds_only_on_expected(buf):
    atomics.store64(buf, 0, 5)
    assert atomics.cas64(buf, 0, 4, 9) is False
    assert atomics.load64(buf, 0) == 5
    assert atomics.cas64(buf, 0, 5, 9) is True
    assert atomics.load64(buf, 0) == 9
    atomics.store32(buf, 16, 1)
    assert atomics.cas32(buf, 16, 1, 2) and atomics.load32(buf, 16) == 2


def test_fetch_add_wraps_and_returns_old(buf):
    atomics.store32(buf, 0, 0xFFFFFFFF)
    assert atomics.fetch_add32(buf, 0, 1) == 0xFFFFFFFF
    assert atomics.load32(buf, 0) == 0
    assert atomics.fetch_add32(buf, 0, -1) == 0
    assert atomics.load32(buf, 0) == 0xFFFFFFFF
    atomics.store64(buf, 8, 10)
    assert atomics.fetch_add64(buf, 8, -3) == 10
    assert atomics.load64(buf, 8) == 7
    assert atomics.fetch_add64(buf, 8, 2**64 - 1) == 7  # adding 2**64-1 is subtracting 1
    assert atomics.load64(buf, 8) == 6


def test_exchange_returns_old(buf):
    atomics.store32(buf, 0, 3)
    assert atomics.exchange32(buf, 0, 8) == 3
    assert atomics.exchange64(buf, 8, 2**63) == 0
    assert atomics.load64(buf, 8) == 2**63


@pytest.mark.parametrize("offset", [-1, -8, 4096, 4093, 4089, 2**62, 2**70])
def test_out_of_range_offsets_raise(buf, offset):
    for load in LOADS:
        with pytest.raises(ValueError):
            load(buf, offset)
    with pytest.raises(ValueError):
        atomics.store64(buf, offset, 1)
    with pytest.raises(ValueError):
        atomics.futex_wait(buf, offset, 0, 0)


def test_last_word_is_in_range(buf):
    atomics.store32(buf, 4092, 7)
    atomics.store64(buf, 4088, 9)
    assert atomics.load64(buf, 4088) == 9


@pytest.mark.parametrize("offset", [1, 2, 3, 5, 6, 7])
def test_misaligned_offsets_raise(buf, offset):
    with pytest.raises(ValueError, match="aligned"):
        atomics.load64(buf, offset)
    with pytest.raises(ValueError, match="aligned"):
        atomics.cas64(buf, offset, 0, 1)
    if offset % 4:
        with pytest.raises(ValueError, match="aligned"):
            atomics.store32(buf, offset, 1)


def test_alignment_is_of_the_address_not_the_offset(buf):
    view = memoryview(buf)[4:]  # starts 4 bytes into a page-aligned mapping
    atomics.store32(view, 0, 1)  # address 4: fine for 32 bits
    with pytest.raises(ValueError, match="aligned"):
        atomics.store64(view, 0, 1)  # address 4: not 8-aligned
    atomics.store64(view, 4, 1)  # address 8
    view.release()


def test_wrong_argument_types(buf):
    with pytest.raises(TypeError):
        atomics.load32(object(), 0)
    with pytest.raises(TypeError):
        atomics.load32(buf, 0.0)
    with pytest.raises(TypeError):
        atomics.load32(buf, "0")
    with pytest.raises(TypeError):
        atomics.load32(buf)
    with pytest.raises(TypeError):
        atomics.store32(buf, 0, "1")
    with pytest.raises(OverflowError):
        atomics.store32(buf, 0, 2**32)
    with pytest.raises(OverflowError):
        atomics.store32(buf, 0, -1)
    with pytest.raises(OverflowError):
        atomics.store64(buf, 0, 2**64)
    with pytest.raises(OverflowError):
        atomics.fetch_add64(buf, 0, -(2**63) - 1)
    with pytest.raises(ValueError):
        atomics.futex_wait(buf, 0, 0, -1)
    with pytest.raises(ValueError):
        atomics.futex_wait(buf, 0, 0, float("nan"))
    with pytest.raises(ValueError):
        atomics.futex_wake(buf, 0, 0)


def test_read_only_buffers_load_but_refuse_writes():
    with pytest.raises(TypeError):
        atomics.store32(bytes(64), 0, 1)  # bytes export read-only buffers
    m = mmap.mmap(-1, 4096)
    m[0:8] = (42).to_bytes(8, "little")
    ro_view = memoryview(m).toreadonly()
    assert atomics.load64(ro_view, 0) == 42
    for op, args in [(atomics.store64, (1,)), (atomics.cas64, (42, 1)), (atomics.fetch_add64, (1,)),
                     (atomics.exchange64, (1,)), (atomics.store32, (1,))]:
        with pytest.raises(TypeError, match="read-only"):
            op(ro_view, 0, *args)
    assert atomics.load64(ro_view, 0) == 42
    ro_view.release()
    m.close()


def test_read_only_mmap_refuses_writes():
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
    assert atomics.load32(m, 0) == 0
    with pytest.raises(TypeError):
        atomics.store32(m, 0, 1)
    m.close()


def test_numpy_and_bytearray_buffers():
    arr = np.zeros(16, dtype=np.uint64)
    atomics.store64(arr, 8, 77)
    assert arr[1] == 77
    with pytest.raises((TypeError, BufferError, ValueError)):
        atomics.load64(arr[::2], 0)  # not contiguous
    frozen = np.zeros(4, dtype=np.uint64)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        atomics.store64(frozen, 0, 1)


def test_closed_mmap_raises_instead_of_crashing():
    m = mmap.mmap(-1, 4096)
    m.close()
    with pytest.raises(ValueError):
        atomics.load32(m, 0)


def test_exported_buffer_blocks_close_during_futex_wait(buf):
    # While a call holds the buffer, mmap.close() must refuse (no use-after-unmap).
    import threading

    started = threading.Event()
    result = []

    def waiter():
        started.set()
        result.append(atomics.futex_wait(buf, 0, 0, 2.0))

    t = threading.Thread(target=waiter)
    t.start()
    started.wait()
    time.sleep(0.05)
    with pytest.raises(BufferError):
        buf.close()
    atomics.store32(buf, 0, 1)
    atomics.futex_wake(buf, 0)
    t.join(5)
    assert result and result[0] in (atomics.WOKEN, atomics.CHANGED)


def test_futex_wait_outcomes(buf):
    atomics.store32(buf, 0, 3)
    assert atomics.futex_wait(buf, 0, 4, 1.0) == atomics.CHANGED
    t0 = time.monotonic()
    assert atomics.futex_wait(buf, 0, 3, 0.05) == atomics.TIMED_OUT
    assert time.monotonic() - t0 >= 0.04
    assert atomics.futex_wake(buf, 0, 10) == 0


CHILD_WAITER = textwrap.dedent("""
    import mmap, sys, posix_ipc
    from shmserve import _atomics as atomics
    shm = posix_ipc.SharedMemory(sys.argv[1])
    m = mmap.mmap(shm.fd, 4096); shm.close_fd()
    atomics.store32(m, 4, 1)                      # tell the parent we are about to wait
    atomics.futex_wake(m, 4)
    r = atomics.futex_wait(m, 0, 0, 20.0)         # sleep until the parent changes word 0
    print(r, atomics.load32(m, 0), atomics.load64(m, 8), flush=True)
""")


def test_futex_wake_across_processes(instance_name):
    name = "/shmserve-atomics-" + instance_name()
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=4096)
    m = mmap.mmap(shm.fd, 4096)
    shm.close_fd()
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD_WAITER, name], stdout=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 20
            while atomics.load32(m, 4) == 0 and time.monotonic() < deadline:
                atomics.futex_wait(m, 4, 0, 0.1)
            time.sleep(0.05)  # let it reach futex_wait (if not, it sees CHANGED: also correct)
            atomics.store64(m, 8, 0xABCDEF)  # data first ...
            atomics.store32(m, 0, 1)  # ... then the published word
            woken = 0
            while woken == 0 and child.poll() is None and time.monotonic() < deadline:
                woken = atomics.futex_wake(m, 0)
                time.sleep(0.01)
            out, _ = child.communicate(timeout=20)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        outcome, word, data = map(int, out.split())
        assert outcome in (atomics.WOKEN, atomics.CHANGED)
        assert (word, data) == (1, 0xABCDEF)
        assert child.returncode == 0
    finally:
        m.close()
        posix_ipc.unlink_shared_memory(name)


def test_futex_waitv_outcomes(buf):
    atomics.store32(buf, 0, 3)
    atomics.store32(buf, 64, 5)
    assert atomics.futex_waitv([(buf, 0, 3), (buf, 64, 6)], 1.0) == atomics.CHANGED
    t0 = time.monotonic()
    assert atomics.futex_waitv([(buf, 0, 3), (buf, 64, 5)], 0.05) == atomics.TIMED_OUT
    assert time.monotonic() - t0 >= 0.04


def test_futex_waitv_wakes_on_any_word(buf):
    import threading

    def wake_second():
        time.sleep(0.05)
        atomics.store32(buf, 64, 1)
        atomics.futex_wake(buf, 64)

    t = threading.Thread(target=wake_second)
    t.start()
    t0 = time.monotonic()
    assert atomics.futex_waitv([(buf, 0, 0), (buf, 64, 0)], 10.0) in (atomics.WOKEN, atomics.CHANGED)
    assert time.monotonic() - t0 < 5
    t.join()


def test_futex_waitv_checks_its_arguments(buf):
    ro = memoryview(bytes(64))
    assert atomics.futex_waitv([(ro, 0, 1)], 0.0) == atomics.CHANGED  # read-only buffers are fine
    with pytest.raises(ValueError):
        atomics.futex_waitv([], 0.0)
    with pytest.raises(ValueError):
        atomics.futex_waitv([(buf, 0, 0)] * 129, 0.0)
    with pytest.raises(ValueError):
        atomics.futex_waitv([(buf, 2, 0)], 0.0)  # misaligned
    with pytest.raises(ValueError):
        atomics.futex_waitv([(buf, 4096, 0)], 0.0)  # out of range
    with pytest.raises(TypeError):
        atomics.futex_waitv([(buf, 0)], 0.0)
    with pytest.raises(TypeError):
        atomics.futex_waitv(5, 0.0)
    with pytest.raises(OverflowError):
        atomics.futex_waitv([(buf, 0, 2**32)], 0.0)
    with pytest.raises(ValueError):
        atomics.futex_waitv([(buf, 0, 0)], -1.0)


def test_address_is_numpys_data_pointer_for_every_view_a_worker_hands_a_backend(buf):
    base = np.ndarray((4096,), np.uint8, buffer=buf)
    frozen = np.ndarray((16, 8), np.float32, buffer=buf, offset=512)
    frozen.flags.writeable = False  # as a worker's input views are
    for view in (base, base[64:], frozen, frozen[1:], frozen[:, ::2], np.zeros((0, 3), np.float32)):
        assert atomics.address(view) == view.ctypes.data
    assert atomics.address(buf) == base.ctypes.data
    with pytest.raises(TypeError):
        atomics.address(object())
