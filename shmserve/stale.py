"""Finding arenas in /dev/shm and removing those whose owner is gone.

Owns: the answer to "is this arena's owner alive?" and the sweep that the
server runs for its own instance at start and ``shmserve cleanup`` runs on
demand.

An owner is alive exactly while it holds the exclusive ``flock`` it took on
the segment at creation (``shmserve.arena``): the kernel drops that lock when
the process dies, SIGKILL included, and pid reuse cannot fake it.  An arena
whose header names another boot is stale whatever its lock says.  A segment
with our prefix but no valid header is left alone while it is younger than
``INIT_GRACE_S`` (its creator may be writing the header right now).

Must not: remove a live arena, or follow anything but names under /dev/shm
that start with ``shmserve.``.  Reading a segment is read-only.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass

import posix_ipc

from shmserve import layout
from shmserve.arena import SHM_DIR, boot_id, process_start_ticks

INIT_GRACE_S = 30.0  # a creator writes its header within microseconds; 30 s is generous


@dataclass(frozen=True)
class ArenaRecord:
    """What a sweep learned about one segment named ``shmserve.*``."""

    name: str  # without the leading slash, as listed in /dev/shm
    instance: str
    size: int
    owner_pid: int | None
    owner_alive: bool
    pid_alive: bool  # the recorded pid runs the same process (pid and start time match)
    same_boot: bool
    valid: bool  # header decoded
    reason: str  # why it is (or is not) stale, in words
    socket_path: str = ""  # where its owner listened (from the header)
    region: bool = False  # a client region (shmserve.<instance>.r<N>), alive exactly while its instance is

    @property
    def stale(self) -> bool:
        if self.region:
            return not self.owner_alive
        return not self.owner_alive and (self.valid or self.reason.startswith("unreadable"))


def list_arenas(instance: str | None = None) -> list[ArenaRecord]:
    """Describe every ``shmserve.*`` segment (or only ``instance``'s).  Never raises for a bad segment."""
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    records, regions = [], []
    for name in names:
        parsed = layout.parse_segment_name(name)
        if parsed is None:
            continue
        owner, region = parsed
        if instance is not None and owner != instance:
            continue
        if region is not None:
            regions.append((name, owner))
            continue
        record = _examine(name)
        if record is not None:
            records.append(record)
    live = {r.instance for r in records if r.owner_alive}
    for name, owner in regions:
        try:
            size = os.stat(os.path.join(SHM_DIR, name)).st_size
        except OSError:
            continue
        alive = owner in live
        records.append(ArenaRecord(name, owner, size, None, alive, False, True, False,
                                   f"client region of instance {owner} ({'live' if alive else 'its server is gone'})",
                                   region=True))
    return records


def sweep(instance: str | None = None, *, dry_run: bool = False) -> list[ArenaRecord]:
    """Remove stale arenas (of ``instance`` only, if given); returns the records removed (or,
    with ``dry_run``, that would be).  A live arena is never removed."""
    removed = []
    records = list_arenas(instance)
    for record in sorted(records, key=lambda r: r.region):  # arenas first: their regions follow them
        if not record.stale:
            continue
        if record.region:
            ok = dry_run or _unlink(record.name)
        else:
            ok = dry_run or _remove_if_still_stale(record.name)
            if ok and not dry_run and record.socket_path:
                _remove_dead_socket(record.socket_path)
        if ok:
            removed.append(record)
    return removed


def _unlink(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory("/" + name)
        return True
    except posix_ipc.Error:
        return False


def _remove_dead_socket(path: str) -> None:
    """Remove a dead instance's socket file if it is a socket nobody listens on."""
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return
    except OSError:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        try:
            os.unlink(path)
        except OSError:
            pass
    except OSError:
        pass
    finally:
        probe.close()


def _examine(name: str) -> ArenaRecord | None:
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        instance = layout.parse_segment_name(name)[0]
        return ArenaRecord(name, instance, 0, None, True, False, True, False, f"cannot open: {exc.strerror}")
    try:
        return _examine_fd(name, fd, _lock_held(fd))
    finally:
        os.close(fd)


def _examine_fd(name: str, fd: int, locked: bool) -> ArenaRecord:
    instance = layout.parse_segment_name(name)[0]
    st = os.fstat(fd)
    try:
        info = layout.decode_header(os.pread(fd, layout.HEADER_SIZE, 0), st.st_size)
    except (OSError, layout.LayoutError) as exc:
        young = time.time() - st.st_ctime < INIT_GRACE_S
        if locked or young:
            reason = "being created" if young and not locked else "owner holds it; header unreadable"
            return ArenaRecord(name, instance, st.st_size, None, True, False, True, False, reason)
        return ArenaRecord(name, instance, st.st_size, None, False, False, True, False,
                           f"unreadable header and no owner: {exc}")
    same_boot = info.boot_id == boot_id()
    pid_alive = same_boot and process_start_ticks(info.owner_pid) == info.owner_start_ticks
    owner_alive = locked and same_boot
    if not same_boot:
        reason = "created during an earlier boot"
    elif owner_alive:
        reason = "owner alive"
    else:
        reason = f"owner pid {info.owner_pid} is gone"
    return ArenaRecord(name, info.instance, st.st_size, info.owner_pid, owner_alive, pid_alive,
                       same_boot, True, reason, info.socket_path)


def _lock_held(fd: int) -> bool:
    """True if another open file description holds an flock on the segment."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _remove_if_still_stale(name: str) -> bool:
    """Unlink ``name`` while holding its lock, if it is still the same dead segment."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # an owner took it meanwhile
        try:
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                return False  # replaced by a new arena since we looked
        except FileNotFoundError:
            return False
        # Decide again under the lock: a creator that opened this name a moment
        # ago is blocked on the lock we hold, with its header not yet written.
        if not _examine_fd(name, fd, locked=False).stale:
            return False
        try:
            posix_ipc.unlink_shared_memory("/" + name)
        except posix_ipc.ExistentialError:
            return False
        return True
    finally:
        os.close(fd)
