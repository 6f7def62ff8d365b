"""The arena's lifecycle and its word-level operations.

Owns: creating, attaching, closing and unlinking the shared-memory segment of
an instance (``/dev/shm/shmserve.<instance>``); prefaulting it; the owner's
liveness lock; and the ordered operations on its words (slot status CAS,
heartbeats, statistics).  Offsets come from ``shmserve.layout``; allowed slot
transitions from ``shmserve.slotstate``.

Lifecycle (after CPython's multiprocessing.shared_memory and posix_ipc's
demos): only the creator creates (O_CREAT|O_EXCL) and unlinks; a failed create
unlinks before re-raising; attachers map and close their descriptor at once;
``close()`` is idempotent; both are context managers.

Squatting: /dev/shm is writable by every local user, so whatever holds a
name there may be anybody's.  Every open here is ``O_NOFOLLOW | O_NONBLOCK |
O_CLOEXEC`` after an ``lstat`` (a symlink is never followed, a FIFO never
blocks, a device node is never opened), and the entry is checked with
``fstat`` before use (``segment_problem``: a regular file, an owner we trust,
a mode ``create`` makes).  Anything else is ``ArenaSquatted``, a one-line
message naming what holds the name, whose it is, and the fix.  The creator keeps its
descriptor open with an exclusive ``flock`` on it for as long as it lives: the
kernel drops that lock when the process dies, however it dies, which is how a
sweep tells a live owner from a dead one (``shmserve.stale``).

Must not: decide which slot or extent to use (``shmserve.allocator``) or
interpret requests.  It never trusts what it reads: attaching decodes and
validates the header before anything else is used.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import mmap
import os
import pwd
import stat
import time
from collections.abc import Collection

from shmserve import _atomics as atomics
from shmserve import layout
from shmserve.slotstate import Actor, SlotState, check_transition

SHM_DIR = "/dev/shm"  # where Linux exposes POSIX shared memory (shm_open is open(2) on this tmpfs)
SEGMENT_MODES = (0o600, 0o660)  # what ``create`` makes: private, or shared with the configured group
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # no symlink followed, no FIFO waited on

DEFAULT_SIZE_CLASSES = (  # (extent size, count): ~150 MiB in all, enough for the demo and tests
    (4096, 256), (64 * 1024, 64), (1024 * 1024, 16), (16 * 1024 * 1024, 4), (64 * 1024 * 1024, 1),
)


def default_ring_capacity(slot_count: int) -> int:
    """A worker ring's entries for an arena of ``slot_count`` slots: every slot once, and as much
    again for commands and stale entries (a power of two).  ``Arena.create``'s default; ``shmserve
    doctor`` sizes an arena that is not made yet with it."""
    return min(layout.MAX_RING_CAPACITY, 1 << max(0, (2 * slot_count - 1).bit_length()))


class ArenaError(Exception):
    """An arena could not be created, attached or used; the message says why and what to do."""


class ArenaExists(ArenaError):
    """An arena of that instance name already exists."""


class ArenaNotFound(ArenaError):
    """No arena of that instance name exists."""


class ArenaPermission(ArenaError):
    """The arena exists and the kernel will not let us open it (another user's, mode 0600)."""


class ArenaSquatted(ArenaError):
    """Something that is not an arena we may use holds the instance's name in /dev/shm."""


def segment_path(name: str) -> str:
    """The /dev/shm path of a segment name (with or without its leading slash)."""
    return os.path.join(SHM_DIR, name.lstrip("/"))


_KINDS = ((stat.S_ISREG, "regular file"), (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"))


def entry_kind(mode: int) -> str:
    """What kind of file ``mode`` (st_mode) describes, in words."""
    return next((word for test, word in _KINDS if test(mode)), "unknown file type")


def uid_words(uid: int) -> str:
    """``uid 1000 (alice)``, or ``uid 1000`` when it has no name."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def segment_problem(st: os.stat_result, *, owners: Collection[int] | None) -> str | None:
    """Why the entry ``st`` (from lstat or fstat) describes is not a segment shmserve may use, or
    None if it is one: a regular file, owned by one of ``owners`` (None: any owner), with a mode
    ``create`` makes.  The answer says what the entry is and whose, e.g. ``a fifo owned by uid 1000
    (alice)``."""
    whose = f"a {entry_kind(st.st_mode)} owned by {uid_words(st.st_uid)}"
    if not stat.S_ISREG(st.st_mode):
        return whose
    if owners is not None and st.st_uid not in owners:
        return whose
    mode = stat.S_IMODE(st.st_mode)
    if mode not in SEGMENT_MODES:
        return f"{whose} with mode {mode:04o} (shmserve makes 0600 or 0660)"
    return None


def squatted(name: str, what: str) -> ArenaSquatted:
    """The one-line error for an arena name held by ``what`` (a ``segment_problem`` answer)."""
    path = segment_path(name)
    return ArenaSquatted(f"{path} is held by {what}, not an arena of ours; serve another --instance, "
                         f"or have its owner or root remove it (rm {path})")


def open_segment(name: str, flags: int, *, owners: Collection[int] | None) -> tuple[int, os.stat_result]:
    """Open an existing segment without following a symlink or blocking, and check it.

    ``flags`` is O_RDONLY or O_RDWR; ``owners`` as in ``segment_problem``.
    The entry is lstat'ed first (a FIFO, socket or device is never opened),
    then opened with O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC and fstat'ed: it must
    be the same file, and still one we may use.  Returns (descriptor, fstat).
    Raises FileNotFoundError if there is no such name, ArenaSquatted if
    the entry is not a segment we may use, ArenaError if it cannot be
    opened (the message says why) or changed while it was opened.
    """
    path = segment_path(name)
    listed = os.lstat(path)  # FileNotFoundError goes to the caller
    problem = segment_problem(listed, owners=owners)
    if problem:
        raise squatted(name, problem)
    try:
        fd = os.open(path, flags | _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # replaced by a symlink or socket since the lstat
            raise ArenaSquatted(f"{path} was replaced while it was opened; run the command again") from None
        kind = ArenaPermission if exc.errno in (errno.EACCES, errno.EPERM) else ArenaError
        raise kind(f"cannot open {path} ({uid_words(listed.st_uid)}, mode "
                   f"{stat.S_IMODE(listed.st_mode):04o}): {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        before = os.lstat(path)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise ArenaSquatted(f"{path} was replaced while it was opened; run the command again")
        problem = segment_problem(st, owners=owners)
        if problem:
            raise squatted(name, problem)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class SlotConflict(ArenaError):
    """A slot was not in the (generation, state) the caller expected: stale handle or lost race."""

    def __init__(self, index: int, expected: tuple[int, int], actual: tuple[int, int]):
        self.index, self.expected, self.actual = index, expected, actual
        super().__init__(f"slot {index}: expected generation {expected[0]} state "
                         f"{SlotState(expected[1]).name}, found generation {actual[0]} state {actual[1]}")


def boot_id() -> bytes:
    """16 bytes identifying the current boot of this machine (kernel random boot_id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16]
    except OSError:
        return b"\0" * 16


def process_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot, or None if there is no such process.

    Together with the pid it identifies a process across pid reuse.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()
    return int(fields[19])  # field 22 of stat(5), counted after "pid (comm) "


class Arena:
    """A mapped arena.  Use ``Arena.create`` (the owner) or ``Arena.attach``.

    ``buf`` is the writable (or, read-only attach, read-only) mmap of the whole
    segment; ``geometry`` says where everything is.  Pickles as its instance
    name: unpickling attaches.
    """

    def __init__(self, instance: str, lock_fd: int | None, buf: mmap.mmap, info: layout.HeaderInfo,
                 st: os.stat_result, *, owner: bool, read_only: bool):
        self.instance = instance
        self.name = layout.arena_name(instance)
        self.buf = buf
        self.info = info
        self.geometry = info.geometry
        self.is_owner = owner
        self.read_only = read_only
        self.owner_uid = st.st_uid  # whose segment this is (fstat when it was opened)
        self._file_id = (st.st_dev, st.st_ino)  # unlink removes the name only while it is still this file
        self._lock_fd = lock_fd  # the owner keeps its descriptor (and its flock) until close
        self._closed = False

    @property
    def file_id(self) -> tuple[int, int]:
        """(st_dev, st_ino) of the segment: what names this arena however it is reached."""
        return self._file_id

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    def create(cls, instance: str, *, slot_count: int = 256, max_workers: int = 8,
               size_classes=DEFAULT_SIZE_CLASSES, ring_capacity: int | None = None,
               group: str | int | None = None, prefault: bool = True, socket_path: str = "",
               max_regions: int = layout.DEFAULT_MAX_REGIONS) -> "Arena":
        """Create, size, prefault and map a new arena; the caller becomes its owner.

        Mode 0600, or 0660 owned by ``group`` (name or gid).  ``ring_capacity``
        defaults to the next power of two at or above twice ``slot_count``: every
        slot once, with room for the front-end's commands and for entries of
        slots taken back before their worker saw them (the front-end checks
        for room before every push: a full ring is an 'overloaded' answer,
        never a lost entry).  Raises ArenaExists if an arena of ours holds the
        name (run ``shmserve cleanup`` if its owner is dead), ArenaSquatted if
        anything else does (another uid's file, a FIFO, a symlink, a file
        of ours with a mode we never make), ArenaError if /dev/shm is too
        small or the parameters are impossible.  On any failure nothing is
        left behind in /dev/shm.
        """
        name = layout.arena_name(instance)
        if ring_capacity is None:
            ring_capacity = default_ring_capacity(slot_count)
        try:
            geometry = layout.plan(slot_count=slot_count, size_classes=size_classes,
                                   max_workers=max_workers, ring_capacity=ring_capacity, max_regions=max_regions)
        except ValueError as exc:
            raise ArenaError(f"cannot lay out arena: {exc}") from None
        mode = 0o600
        gid = -1
        if group is not None:
            mode = 0o660
            try:
                gid = group if isinstance(group, int) else grp.getgrnam(group).gr_gid
            except KeyError:
                raise ArenaError(f"group {group!r} does not exist") from None
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, mode)
        except FileExistsError:
            raise _taken(name) from None
        except OSError as exc:
            raise ArenaError(f"cannot create arena {path}: {exc.strerror}") from None
        buf = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a sweep probes this new name
            os.fchmod(fd, mode)  # open applied the umask
            if gid != -1:
                os.fchown(fd, -1, gid)
            os.ftruncate(fd, geometry.total_size)
            try:
                # Allocate every page now: a full /dev/shm fails here with ENOSPC
                # instead of a SIGBUS on first touch in the middle of a request.
                os.posix_fallocate(fd, 0, geometry.total_size)
            except OSError as exc:
                raise ArenaError(no_room(geometry.total_size, exc)) from None
            buf = _map(fd, geometry.total_size, read_only=False, prefault=prefault)
            pid = os.getpid()
            layout.encode_header(buf, geometry, instance=instance, boot_id=boot_id(),
                                 created_unix_ns=time.time_ns(), owner_pid=pid,
                                 owner_start_ticks=process_start_ticks(pid) or 0, socket_path=socket_path)
            # Order matters here: the header is complete before state turns LIVE,
            # and attachers load-acquire the state before they trust the header.
            atomics.store32(buf, layout.HEADER.offset("state"), layout.ARENA_LIVE)
            info = layout.decode_header(buf)
            st = os.fstat(fd)
        except BaseException:
            if buf is not None:
                buf.close()
            os.unlink(path)  # the name is ours: O_EXCL made it, and /dev/shm is sticky
            os.close(fd)
            raise
        return cls(instance, fd, buf, info, st, owner=True, read_only=False)

    @classmethod
    def attach(cls, instance: str, *, read_only: bool = False, prefault: bool = True) -> "Arena":
        """Map an existing arena after checking the file and validating its header.

        A writable attach takes only a segment of our own uid; a read-only
        one (inspection) takes any owner's.  Either way it must be a regular
        file with a mode ``create`` makes, reached without following a
        symlink or blocking (``open_segment``).  Raises ArenaNotFound if there
        is none, ArenaSquatted if the name is held by anything else,
        ArenaError if the segment cannot be opened, is still being created,
        is not a shmserve arena, or is corrupt (the message carries the
        layout error).  Read-only attaches never write.
        """
        name = layout.arena_name(instance)
        owners = None if read_only else (os.geteuid(),)
        try:
            fd, st = open_segment(name, os.O_RDONLY if read_only else os.O_RDWR, owners=owners)
        except FileNotFoundError:
            raise ArenaNotFound(f"no arena {name} (is the server for instance {instance!r} running?)") from None
        # a read-only look at another user's segment: the errors say whose it is
        shown = name if st.st_uid == os.geteuid() else f"{name} (owned by {uid_words(st.st_uid)})"
        try:
            if st.st_size < layout.HEADER_SIZE:
                raise ArenaError(f"arena {shown} is {st.st_size} bytes: still being created, or not an arena")
            buf = _map(fd, st.st_size, read_only=read_only, prefault=prefault and not read_only)
        finally:
            os.close(fd)
        try:
            if atomics.load32(buf, layout.HEADER.offset("state")) == layout.ARENA_INITIALIZING:
                raise ArenaError(f"arena {shown} is still being created")
            info = layout.decode_header(buf, st.st_size)
            if info.instance != instance:
                raise ArenaError(f"arena {shown} belongs to instance {info.instance!r}")
        except layout.LayoutError as exc:
            buf.close()
            raise ArenaError(f"arena {shown} is corrupt or foreign: {exc}") from None
        except BaseException:
            buf.close()
            raise
        return cls(instance, None, buf, info, st, owner=False, read_only=read_only)

    def close(self) -> None:
        """Unmap (and, for the owner, release the liveness lock).  Idempotent.

        Raises BufferError if numpy arrays or memoryviews of the arena are
        still alive: release them first.
        """
        if self._closed:
            return
        self.buf.close()
        self._closed = True
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def unlink(self) -> None:
        """Remove the arena's name (owner only) if it still names this arena; mappings stay valid
        until closed.  Idempotent."""
        if not self.is_owner:
            raise ArenaError("only the creator of an arena unlinks it")
        path = segment_path(self.name)
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == self._file_id:
                os.unlink(path)
        except FileNotFoundError:
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.is_owner:
                self.unlink()
        finally:
            self.close()

    def __reduce__(self):
        return (Arena.attach, (self.instance,))

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "attached"
        return f"<Arena {self.name} {role} {self.geometry.total_size} bytes{' closed' if self._closed else ''}>"

    # -- header words -----------------------------------------------------------------------

    def state(self) -> int:
        return atomics.load32(self.buf, layout.HEADER.offset("state"))

    def set_state(self, state: int) -> None:
        atomics.store32(self.buf, layout.HEADER.offset("state"), state)

    def beat(self) -> None:
        """Owner heartbeat: store the monotonic clock into the header."""
        atomics.store64(self.buf, layout.HEADER.offset("owner_heartbeat_ns"), time.monotonic_ns())

    def heartbeat_ns(self) -> int:
        return atomics.load64(self.buf, layout.HEADER.offset("owner_heartbeat_ns"))

    def add_stat(self, name: str, delta: int) -> int:
        """Add ``delta`` (may be negative) to a statistics counter; returns the old value."""
        return atomics.fetch_add64(self.buf, layout.STAT_OFFSETS[name], delta)

    def stat(self, name: str) -> int:
        return atomics.load64(self.buf, layout.STAT_OFFSETS[name])

    def worker_counter(self, index: int, name: str) -> int:
        """Load worker ``index``'s counter ``name`` (``requests``, ``errors``) from the worker table."""
        return atomics.load64(self.buf, self.geometry.worker_off(index) + layout.WORKER.offset(name))

    # -- slots ------------------------------------------------------------------------------

    def slot_status(self, index: int) -> tuple[int, int]:
        """Load-acquire slot ``index``'s status: (generation, state)."""
        return layout.unpack_status(atomics.load64(self.buf, self.geometry.slot_off(index)))

    def transition(self, index: int, generation: int, frm: SlotState, to: SlotState, actor: Actor) -> int:
        """Move slot ``index`` from ``frm`` to ``to`` if it still is (``generation``, ``frm``).

        See ``transition_slot``; this is it for the arena's slot table.
        """
        return transition_slot(self.buf, self.geometry, index, generation, frm, to, actor)

    def stamp(self, index: int, stage: str) -> None:
        """Record the monotonic time a slot reached ``stage`` (one of layout.STAGE_FIELDS)."""
        layout.stamp(self.buf, self.geometry, index, stage, time.monotonic_ns())


_WRITING = int(SlotState.WRITING)
_pack, _next_generation = layout.pack_status, layout.next_generation  # bound once: the hot path


def transition_slot(buf, geometry, index: int, generation: int, frm: SlotState, to: SlotState,
                    actor: Actor) -> int:
    """Move slot ``index`` of a slot table (the arena's or a lane's: ``geometry``) from ``frm`` to
    ``to`` if it still is (``generation``, ``frm``).

    FREE -> WRITING starts a new generation: pass the generation the slot
    was freed with; the new one is returned (otherwise ``generation`` is).
    The CAS is sequentially consistent, so everything this process wrote
    to the slot before is visible to whoever load-acquires the new status.
    Raises IllegalTransition for an edge the table forbids, SlotConflict
    if the slot was not in the expected generation and state.
    """
    check_transition(frm, to, actor)
    new_generation = _next_generation(generation) if to == _WRITING else generation
    offset = geometry.slot_off(index)
    if not atomics.cas64(buf, offset, _pack(generation, frm), _pack(new_generation, to)):
        raise SlotConflict(index, (generation, int(frm)), layout.unpack_status(atomics.load64(buf, offset)))
    return new_generation


def _taken(name: str) -> ArenaError:
    """Why ``create`` found ``name`` taken: a squatter (ArenaSquatted, naming it), or an arena
    of ours (ArenaExists: live, or dead and left to ``shmserve cleanup``)."""
    try:
        problem = segment_problem(os.lstat(segment_path(name)), owners=(os.geteuid(),))
    except FileNotFoundError:  # removed since: whoever held it was quicker than us
        return ArenaExists(f"arena {name} was being created or removed by someone else; try again")
    if problem:
        return squatted(name, problem)
    return ArenaExists(f"arena {name} already exists; if its server is gone, run 'shmserve cleanup'")


def no_room(size: int, exc: OSError) -> str:
    """The one-line error for an arena of ``size`` bytes that /dev/shm cannot hold (``exc`` from
    allocating it): the size asked, /dev/shm's own size and what is free there, and the fixes."""
    try:
        st = os.statvfs(SHM_DIR)
        room = f"{SHM_DIR} has {_mib(st.f_bavail * st.f_frsize)} free of its {_mib(st.f_blocks * st.f_frsize)}"
    except OSError:
        room = f"{SHM_DIR}'s size is unknown"
    return (f"cannot allocate the {_mib(size)} arena in {SHM_DIR}: {room} ({exc.strerror}); raise its size "
            f"(mount -o remount,size=<bytes> {SHM_DIR}; a container's --shm-size) or make the arena smaller "
            f"([server] max_request_bytes, [arena] size_classes and slots)")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _map(fd: int, size: int, *, read_only: bool, prefault: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
    prot = mmap.PROT_READ | (0 if read_only else mmap.PROT_WRITE)
    return mmap.mmap(fd, size, flags=flags, prot=prot)
