"""Finding arenas in /dev/shm and removing those whose owner is gone.

Owns: the answer to "is this arena's owner alive?", the sweep that the
server runs for its own instance at start and ``shmserve cleanup`` runs on
demand, and the rule for what a sweep may remove (below).

An owner is alive exactly while it holds the exclusive ``flock`` it took on
the segment at creation (``shmserve.arena``): the kernel drops that lock when
the process dies, SIGKILL included, and pid reuse cannot fake it.  An arena
whose header names another boot is stale whatever its lock says.  A segment
with our prefix but no valid header is left alone while it is younger than
``INIT_GRACE_S`` (its creator may be writing the header right now).

Trust: any local user can put anything under a ``shmserve.*`` name, and a
header says whatever its writer wrote.  A sweep removes only what it can
prove is a dead instance's, of an owner it trusts (``trusted_uids``: the
caller, and root):
- a segment: a regular file (never a FIFO, socket, directory, symlink or
  device), of a trusted uid, with a mode ``create`` makes; entries are
  lstat'ed before they are opened, and opened without following a symlink
  or blocking (``arena.open_segment``).  Anything else is reported with why
  it was left (``ArenaRecord.refused``), never unlinked.
- its socket (the path in the header): only if the segment's owner (fstat)
  is trusted and also owns the socket; the path is absolute; its directory
  is not a symlink, belongs to that owner or root and is writable by nobody
  else (or is sticky); the entry is a socket (lstat: a symlink is never
  followed) that refuses connections; and the name is one that owner
  recorded (a 0600 segment: only its owner writes the header) or the one the
  instance uses by default (``<instance>.sock``) when the segment is
  group-writable.  Everything after the directory check goes through the
  directory's descriptor, so the path cannot be swapped under the check.

Must not: remove a live arena, or follow anything but names under /dev/shm
that start with ``shmserve.``.  Reading a segment is read-only.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import socket
import stat
import time
from dataclasses import dataclass

from shmserve import layout
from shmserve.arena import (SHM_DIR, ArenaError, boot_id, entry_kind, open_segment, process_start_ticks,
                            segment_path, segment_problem, uid_words)

INIT_GRACE_S = 30.0  # a creator writes its header within microseconds; 30 s is generous
PROBE_TIMEOUT_S = 1.0  # connecting to a dead socket is refused at once; a live but busy one may take a while


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
    socket_path: str = ""  # where its owner listened (from the header: whoever can write the segment wrote it)
    region: bool = False  # a client region (shmserve.<instance>.r<N>), alive exactly while its instance is
    uid: int = -1  # who owns the entry (lstat, then fstat)
    mode: int = 0  # its permission bits
    refused: str = ""  # why no sweep removes it, whatever its state (see "Trust"), with the fix; empty if none
    socket_kept: str = ""  # set by ``sweep``: why it left ``socket_path`` in place (empty: removed, or would be)

    @property
    def stale(self) -> bool:
        if self.refused:
            return False
        if self.region:
            return not self.owner_alive
        return not self.owner_alive and (self.valid or self.reason.startswith("unreadable"))


def trusted_uids() -> frozenset[int]:
    """The owners whose dead segments and sockets this process may remove: itself and root."""
    return frozenset({0, os.geteuid()})


def refusal(st: os.stat_result) -> str:
    """Why a sweep by this process leaves the entry ``st`` (an lstat or fstat) alone, with the
    fix; empty if it may remove it once it is proven dead."""
    problem = segment_problem(st, owners=None)
    if problem:
        return f"{problem}, not a segment shmserve made: never removed here; its owner or root can remove it"
    trusted = trusted_uids()
    if st.st_uid not in trusted:
        return (f"{segment_problem(st, owners=trusted)}, whom a cleanup by {uid_words(os.geteuid())} does not "
                f"trust: run 'shmserve cleanup' as that user")
    return ""


def live_arena(instance: str) -> ArenaRecord | None:
    """The arena of ``instance`` that a live server of a trusted owner serves (its header read),
    or None: none, a dead one's, or a name held by something else (``Arena.create`` says what)."""
    return next((r for r in list_arenas(instance) if not r.region and r.valid and r.owner_alive and not r.refused),
                None)


def list_arenas(instance: str | None = None) -> list[ArenaRecord]:
    """Describe every ``shmserve.*`` entry (or only ``instance``'s), whoever owns it.  Never raises
    for a bad entry and never blocks on one (a FIFO or device is lstat'ed, not opened)."""
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
            st = os.lstat(segment_path(name))
        except OSError:
            continue
        alive = owner in live
        records.append(ArenaRecord(name, owner, st.st_size, None, alive, False, True, False,
                                   f"client region of instance {owner} ({'live' if alive else 'its server is gone'})",
                                   region=True, uid=st.st_uid, mode=stat.S_IMODE(st.st_mode),
                                   refused=refusal(st)))
    return records


def sweep(instance: str | None = None, *, dry_run: bool = False) -> list[ArenaRecord]:
    """Remove stale arenas (of ``instance`` only, if given) and their sockets; returns the records
    removed (or, with ``dry_run``, that would be), each saying in ``socket_kept`` why its socket
    stays.  A live arena is never removed, nor anything ``refused`` (see "Trust")."""
    removed = []
    records = list_arenas(instance)
    for record in sorted(records, key=lambda r: r.region):  # arenas first: their regions follow them
        if not record.stale:
            continue
        if record.region:
            if dry_run or _unlink_region(record.name):
                removed.append(record)
            continue
        if dry_run:
            kept = _dead_socket(record.socket_path, record.name, record.uid, record.mode, remove=False)
        else:
            st = _remove_if_still_stale(record.name)
            if st is None:
                continue
            kept = _dead_socket(record.socket_path, record.name, st.st_uid, stat.S_IMODE(st.st_mode), remove=True)
        removed.append(dataclasses.replace(record, socket_kept=kept))
    return removed


def _unlink_region(name: str) -> bool:
    """Unlink a dead instance's region if it still is one a sweep may remove."""
    path = segment_path(name)
    try:
        if refusal(os.lstat(path)):
            return False
        os.unlink(path)  # /dev/shm is sticky: only its owner (trusted, just checked) or root can swap it
        return True
    except OSError:
        return False


def _dead_socket(path: str, name: str, owner_uid: int, segment_mode: int, *, remove: bool) -> str:
    """Remove (if ``remove``) the socket ``path`` that the header of segment ``name``, owned by
    ``owner_uid`` with ``segment_mode``, recorded, if every rule of "Trust" holds.  Returns why it
    was left in place, or "" if it was removed (or would be)."""
    if not path:
        return ""
    if owner_uid not in trusted_uids():
        return f"the arena's owner {uid_words(owner_uid)} is not trusted here"
    if not os.path.isabs(path) or "\0" in path:
        return "not an absolute path"
    directory, base = os.path.split(path)
    instance = layout.parse_segment_name(name)[0]
    if segment_mode & 0o022 and base != f"{instance}.sock":
        return (f"the arena is writable by others than its owner, so its header may not be the owner's, "
                f"and the name is not {instance}.sock")
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(directory):
            return "its directory is a symlink"
        return f"cannot open its directory: {exc.strerror}"
    try:
        dst = os.fstat(dfd)
        if dst.st_uid not in (owner_uid, 0):
            return f"its directory belongs to {uid_words(dst.st_uid)}, not to the arena's owner"
        if dst.st_mode & 0o022 and not dst.st_mode & stat.S_ISVTX:
            return "its directory is writable by others (and not sticky)"
        try:
            lst = os.lstat(base, dir_fd=dfd)
        except FileNotFoundError:
            return "it is gone"
        except OSError as exc:
            return exc.strerror
        if not stat.S_ISSOCK(lst.st_mode):
            return f"a {entry_kind(lst.st_mode)}, not a socket"
        if lst.st_uid != owner_uid:
            return f"the socket belongs to {uid_words(lst.st_uid)}, not to the arena's owner"
        alive = _not_dead(f"/proc/self/fd/{dfd}/{base}")
        if alive:
            return alive
        if not remove:
            return ""
        again = os.lstat(base, dir_fd=dfd)
        if (again.st_dev, again.st_ino) != (lst.st_dev, lst.st_ino):
            return "it was replaced while it was checked"
        os.unlink(base, dir_fd=dfd)
        return ""
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        os.close(dfd)


def _not_dead(path: str) -> str:
    """Why the socket ``path`` may not be dead (something accepted a connection, or the probe could
    not tell), or the empty string if connecting is refused: nobody listens, its server is gone."""
    if len(path.encode()) > 107:
        return "its path is too long to probe"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
        return "something listens there"
    except ConnectionRefusedError:
        return ""
    except OSError as exc:
        return f"cannot probe it: {exc.strerror or exc}"
    finally:
        probe.close()


def _examine(name: str) -> ArenaRecord | None:
    instance = layout.parse_segment_name(name)[0]
    try:
        listed = os.lstat(segment_path(name))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return ArenaRecord(name, instance, 0, None, True, False, True, False, f"cannot stat: {exc.strerror}")
    refused = refusal(listed)
    if segment_problem(listed, owners=None):  # never opened: a FIFO would block, a device act
        return ArenaRecord(name, instance, listed.st_size, None, False, False, True, False, "not an arena",
                           uid=listed.st_uid, mode=stat.S_IMODE(listed.st_mode), refused=refused)
    try:
        fd, st = open_segment(name, os.O_RDONLY, owners=None)
    except FileNotFoundError:
        return None
    except ArenaError as exc:
        return ArenaRecord(name, instance, listed.st_size, None, True, False, True, False, str(exc),
                           uid=listed.st_uid, mode=stat.S_IMODE(listed.st_mode), refused=refused)
    try:
        return _examine_fd(name, fd, st, _lock_held(fd))
    finally:
        os.close(fd)


def _examine_fd(name: str, fd: int, st: os.stat_result, locked: bool) -> ArenaRecord:
    instance = layout.parse_segment_name(name)[0]
    whose = dict(uid=st.st_uid, mode=stat.S_IMODE(st.st_mode), refused=refusal(st))
    try:
        info = layout.decode_header(os.pread(fd, layout.HEADER_SIZE, 0), st.st_size)
    except (OSError, layout.LayoutError) as exc:
        young = time.time() - st.st_ctime < INIT_GRACE_S
        if locked or young:
            reason = "being created" if young and not locked else "owner holds it; header unreadable"
            return ArenaRecord(name, instance, st.st_size, None, True, False, True, False, reason, **whose)
        return ArenaRecord(name, instance, st.st_size, None, False, False, True, False,
                           f"unreadable header and no owner: {exc}", **whose)
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
                       same_boot, True, reason, info.socket_path, **whose)


def _lock_held(fd: int) -> bool:
    """True if another open file description holds an flock on the segment."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _remove_if_still_stale(name: str) -> os.stat_result | None:
    """Unlink ``name`` while holding its lock, if it is still the same dead segment and one a
    sweep may remove; returns its fstat (whose it was), or None if it was left."""
    path = segment_path(name)
    try:
        fd, st = open_segment(name, os.O_RDONLY, owners=trusted_uids())
    except (OSError, ArenaError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # an owner took it meanwhile
        try:
            if os.lstat(path).st_ino != st.st_ino:
                return None  # replaced by a new arena since we looked
        except FileNotFoundError:
            return None
        # Decide again under the lock: a creator that opened this name a moment
        # ago is blocked on the lock we hold, with its header not yet written.
        if not _examine_fd(name, fd, st, locked=False).stale:
            return None
        try:
            os.unlink(path)
        except OSError:
            return None
        return st
    finally:
        os.close(fd)
