"""The system shared-memory registry of the v2 door (shmserve.v2.sysshm) on real /dev/shm objects.

Triton's CVE lessons, each as a refusal: registration off by default, keys naming the server's
segments (by name, with any number of leading slashes, or by being the same file), links, FIFOs,
other uids' and world-writable objects, ranges past the end at registration and at use, a region
shrunk under a request, and unregistering while a request uses it.  Keys never appear in errors.
"""

from __future__ import annotations

import os

import pytest

from conftest import new_instance
from helpers.v2_server import shm_objects
from shmserve.errors import ErrorCode
from shmserve.v2.messages import ShmRef, V2Error
from shmserve.v2.sysshm import SHM_DIR, SystemShm

UID = os.getuid()
OWNER = f"uid:{UID}"  # the caller the registry keeps regions under (an identity's key)


@pytest.fixture
def shm_object():
    """A factory of /dev/shm objects of this test session (mode, size); removed after the test."""
    with shm_objects() as make:
        yield make


def refused(code: ErrorCode, call, *args, secret: str | None = None) -> str:
    with pytest.raises(V2Error) as info:
        call(*args)
    assert info.value.code == code, info.value.message
    if secret:
        assert secret.lstrip("/") not in info.value.message, "a key appeared in an error message"
    return info.value.message


def test_registration_is_off_unless_enabled(shm_object):
    key = shm_object()
    message = refused(ErrorCode.PERMISSION_DENIED, SystemShm(enabled=False, own=set()).register,
                      OWNER, UID, "r", key, 0, 4096, secret=key)
    assert "v2_system_shared_memory" in message


@pytest.mark.parametrize("key", ["", "/", "a/b", "/a/../b", "..", "/..", "x\0y", "k" * 300,
                                 "/shmserve.default", "///shmserve.prod", "shmserve.prod.r1"])
def test_keys_that_are_not_one_plain_name_or_name_our_segments_are_refused(key):
    message = refused(ErrorCode.BAD_REGION, SystemShm(enabled=True, own=set()).register, OWNER, UID, "r", key, 0, 1)
    if "shmserve." in key:
        assert "shmserve's own segments" in message
        assert "prod" not in message and "default" not in message


def test_a_key_that_is_the_same_file_as_the_arena_is_refused(shm_object):
    key = shm_object()
    st = os.stat(os.path.join(SHM_DIR, key.lstrip("/")))
    registry = SystemShm(enabled=True, own={(st.st_dev, st.st_ino)})
    for spelled in (key, "//" + key.lstrip("/"), key.lstrip("/")):
        message = refused(ErrorCode.BAD_REGION, registry.register, OWNER, UID, "r", spelled, 0, 16, secret=key)
        assert "server's own segments" in message
    assert registry.regions == {}


def test_links_fifos_missing_and_world_writable_objects_are_refused_without_hanging(shm_object):
    registry = SystemShm(enabled=True, own=set())
    target = shm_object()
    link = "/" + new_instance("v2link")
    fifo = "/" + new_instance("v2fifo")
    os.symlink(os.path.join(SHM_DIR, target.lstrip("/")), os.path.join(SHM_DIR, link.lstrip("/")))
    os.mkfifo(os.path.join(SHM_DIR, fifo.lstrip("/")), 0o600)
    try:
        refused(ErrorCode.BAD_REGION, registry.register, OWNER, UID, "a", link, 0, 16, secret=link)
        refused(ErrorCode.BAD_REGION, registry.register, OWNER, UID, "b", fifo, 0, 16, secret=fifo)  # O_NONBLOCK: no hang
        refused(ErrorCode.BAD_REGION, registry.register, OWNER, UID, "c", "/" + new_instance("absent"), 0, 16)
        loose = shm_object(mode=0o666)
        assert "o+w" in refused(ErrorCode.BAD_REGION, registry.register, OWNER, UID, "d", loose, 0, 16, secret=loose)
    finally:
        for name in (link, fifo):
            os.unlink(os.path.join(SHM_DIR, name.lstrip("/")))
    assert registry.regions == {}


def test_another_uids_object_is_refused(shm_object):
    key = shm_object()
    registry = SystemShm(enabled=True, own=set(), server_uid=UID)
    other = UID + 12345
    assert "another uid" in refused(ErrorCode.BAD_REGION, registry.register, f"uid:{other}", other, "r", key, 0, 16, secret=key)
    assert registry.regions == {}


@pytest.mark.skipif(UID != 0, reason="needs root to give an object to another uid")
def test_root_may_register_anyones_object_but_never_one_of_the_servers_uid(shm_object):
    key = shm_object()
    os.chown(os.path.join(SHM_DIR, key.lstrip("/")), 54321, -1)
    registry = SystemShm(enabled=True, own=set(), server_uid=54321)  # a service running as uid 54321
    assert "server's uid" in refused(ErrorCode.BAD_REGION, registry.register, "uid:0", 0, "r", key, 0, 16, secret=key)
    registry.register("uid:54321", 54321, "mine", key, 0, 16)  # its owner (here the server's own uid) may
    registry = SystemShm(enabled=True, own=set(), server_uid=0)
    registry.register("uid:0", 0, "r", key, 0, 16)  # root may register another uid's object
    registry.close_all()


def test_ranges_past_the_end_are_refused_at_registration_and_at_use(shm_object):
    key = shm_object(size=4096)
    registry = SystemShm(enabled=True, own=set())
    for offset, size in ((0, 4097), (4096, 1), (1 << 62, 1 << 62), (-1, 16), (0, -5)):
        refused(ErrorCode.BAD_REGION, registry.register, OWNER, UID, "r", key, offset, size, secret=key)
    registry.register(OWNER, UID, "r", key, 1024, 2048)
    refused(ErrorCode.BAD_REGION, registry.register, OWNER, UID, "r", key, 0, 16)  # the name is taken
    for ref, nbytes in ((ShmRef("r", 2049), 16), (ShmRef("r", 16, 2040), 16), (ShmRef("r", 16), 17),
                        (ShmRef("r", 16, -1), 16), (ShmRef("nope", 16), 16)):
        refused(ErrorCode.BAD_REGION, registry.take, OWNER, ref, nbytes, "input 'x'")
    refused(ErrorCode.BAD_REGION, registry.take, "uid:other", ShmRef("r", 16), 16, "input 'x'")  # names are per uid
    region = registry.take(OWNER, ShmRef("r", 16, 2032), 16, "input 'x'")
    registry.give_back(region)
    registry.close_all()


def test_reads_and_writes_go_through_the_descriptor_and_a_shrunk_object_fails_only_that_request(shm_object):
    key = shm_object(size=8192, data=bytes(range(256)) * 32)
    registry = SystemShm(enabled=True, own=set())
    registry.register(OWNER, UID, "r", key, 256, 4096)
    ref = ShmRef("r", 512, 0)
    region = registry.take(OWNER, ref, 512, "input 'x'")
    sink = bytearray(512)
    registry.read_into(region, ref, memoryview(sink), "input 'x'")
    assert sink == (bytes(range(256)) * 2)
    out = ShmRef("r", 4, 1000)
    registry.write_from(region, out, memoryview(b"abcd"), "output 'y'")
    path = os.path.join(SHM_DIR, key.lstrip("/"))
    with open(path, "rb") as f:
        f.seek(256 + 1000)
        assert f.read(4) == b"abcd"
    os.truncate(path, 300)  # the client shrinks its object under the server
    with pytest.raises(V2Error) as info:
        registry.read_into(region, ref, memoryview(sink), "input 'x'")
    assert info.value.code == ErrorCode.BAD_REGION and "truncated" in info.value.message
    with pytest.raises(V2Error):
        registry.write_from(region, out, memoryview(b"abcd"), "output 'y'")
    assert os.stat(path).st_size == 300  # never grown back
    registry.give_back(region)
    registry.close_all()


def test_an_object_truncated_between_the_size_check_and_the_write_fails_its_request(shm_object, monkeypatch):
    """The race a client can run: it truncates its object after the server has looked at the size
    and before the output is written.  Made certain here by truncating inside the server's first
    size check (it sees the old size).  The request fails BAD_REGION (the client learns its output
    is not there as it should be); the object was grown back by the write, to the end of that
    write and no further (sysshm's header says why this is not prevented)."""
    key = shm_object(size=16384)
    path = os.path.join(SHM_DIR, key.lstrip("/"))
    registry = SystemShm(enabled=True, own=set())
    registry.register(OWNER, UID, "r", key, 0, 16384)
    out = ShmRef("r", 4096, 4096)
    region = registry.take(OWNER, out, 4096, "output 'y'")
    real_fstat, calls = os.fstat, []

    def fstat_then_truncate(fd):
        st = real_fstat(fd)
        if fd == region.fd and not calls:
            calls.append(st.st_size)
            os.truncate(path, 100)  # the client, right after the check read the size
        return st

    monkeypatch.setattr(os, "fstat", fstat_then_truncate)
    with pytest.raises(V2Error) as info:
        registry.write_from(region, out, memoryview(b"z" * 4096), "output 'y'")
    monkeypatch.undo()
    assert calls == [16384]
    assert info.value.code == ErrorCode.BAD_REGION and "truncated while its output was written" in info.value.message
    assert os.stat(path).st_size == 8192, "grown past the end of the write"
    registry.give_back(region)
    registry.close_all()


def test_unregister_returns_at_once_and_a_region_in_use_goes_with_its_last_request(shm_object):
    """As Triton: unregistering a region a request still uses returns at once; the region is still
    listed (and its name still taken) until the request gives it back, then it goes and its name
    is free again.  Unlike Triton, no new request may name it meanwhile."""
    key, key2 = shm_object(), shm_object()
    registry = SystemShm(enabled=True, own=set())
    registry.register(OWNER, UID, "a", key, 0, 4096)
    registry.register(OWNER, UID, "b", key2, 0, 64)
    assert [r["name"] for r in registry.status(OWNER, None)] == ["a", "b"]
    assert registry.status("uid:other", None) == []
    in_use = registry.take(OWNER, ShmRef("a", 16), 16, "input 'x'")
    fd = in_use.fd
    registry.unregister(OWNER, "a")  # returns: nothing to wait for
    assert [r["name"] for r in registry.status(OWNER, None)] == ["a", "b"], "listed until its request is done"
    assert registry.status(OWNER, "a")[0]["name"] == "a"
    message = refused(ErrorCode.BAD_REGION, registry.take, OWNER, ShmRef("a", 16), 16, "input 'x'")
    assert message.startswith("Unable to find shared memory region: 'a'") and "being unregistered" in message
    assert "already in manager" in refused(ErrorCode.BAD_REGION, registry.register, OWNER, UID, "a", key, 0, 4096)
    registry.give_back(in_use)
    assert in_use.fd == -1 and [r["name"] for r in registry.status(OWNER, None)] == ["b"]
    with pytest.raises(OSError):
        os.fstat(fd)
    assert refused(ErrorCode.BAD_REGION, registry.status, OWNER, "a") == "Unable to find system shared memory region: 'a'"
    registry.register(OWNER, UID, "a", key, 0, 4096)  # the name is free again
    registry.unregister(OWNER, "never-registered")  # as Triton: not an error
    registry.unregister(OWNER, None)
    assert registry.regions == {}


def test_one_uid_may_hold_only_so_many_regions(shm_object):
    key = shm_object()
    registry = SystemShm(enabled=True, own=set(), max_per_uid=2)
    registry.register(OWNER, UID, "a", key, 0, 16)
    registry.register(OWNER, UID, "b", key, 16, 16)
    assert "max_regions_per_uid" in refused(ErrorCode.OVERLOADED, registry.register, OWNER, UID, "c", key, 32, 16)
    registry.close_all()


@pytest.mark.skipif(UID != 0, reason="needs root to give an object to another uid")
def test_a_tokens_uid_is_exact_even_root(shm_object):
    """A token with uid 0 registers root's own objects only: 'root may register anyone's' is for
    root the kernel vouches for (a Unix-socket peer), never for a secret."""
    key, mine = shm_object(), shm_object()
    os.chown(os.path.join(SHM_DIR, key.lstrip("/")), 54321, -1)
    registry = SystemShm(enabled=True, own=set(), server_uid=1234)
    with pytest.raises(V2Error) as info:
        registry.register("token:t", 0, "r", key, 0, 16, exact=True)
    assert info.value.code == ErrorCode.BAD_REGION and "another uid" in info.value.message
    registry.register("token:t", 0, "mine", mine, 0, 16, exact=True)  # root's own
    registry.register("uid:0", 0, "r", key, 0, 16)  # root over the Unix socket: anyone's
    registry.close_all()
