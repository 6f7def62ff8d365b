"""The arena's lifecycle and its word-level operations.

Owns: creating, attaching, closing and unlinking the shared-memory segment of
an instance (``/dev/shm/shmserve.<instance>``); prefaulting it; the owner's
liveness lock; and the ordered operations on its words (slot status CAS,
heartbeats, statistics).  Offsets come from ``shmserve.layout``; allowed slot
transitions from ``shmserve.slotstate``.

Lifecycle (after CPython's multiprocessing.shared_memory and posix_ipc's
demos): only the creator creates (O_CREX) and unlinks; a failed create
unlinks before re-raising; attachers map and close their descriptor at once;
``close()`` is idempotent; both are context managers.  The creator keeps its
descriptor open with an exclusive ``flock`` on it for as long as it lives: the
kernel drops that lock when the process dies, however it dies, which is how a
sweep tells a live owner from a dead one (``shmserve.stale``).

Must not: decide which slot or extent to use (``shmserve.allocator``) or
interpret requests.  It never trusts what it reads: attaching decodes and
validates the header before anything else is used.
"""

from __future__ import annotations

import fcntl
import grp
import mmap
import os
import time

import posix_ipc

from shmserve import _atomics as atomics
from shmserve import layout
from shmserve.slotstate import Actor, SlotState, check_transition

SHM_DIR = "/dev/shm"  # where Linux exposes POSIX shared memory; only used to list and stat names

DEFAULT_SIZE_CLASSES = (  # (extent size, count): ~150 MiB in all, enough for the demo and tests
    (4096, 256), (64 * 1024, 64), (1024 * 1024, 16), (16 * 1024 * 1024, 4), (64 * 1024 * 1024, 1),
)


class ArenaError(Exception):
    """An arena could not be created, attached or used; the message says why and what to do."""


class ArenaExists(ArenaError):
    """An arena of that instance name already exists."""


class ArenaNotFound(ArenaError):
    """No arena of that instance name exists."""


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
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[19])  # field 22 of stat(5), counted after "pid (comm) "


class Arena:
    """A mapped arena.  Use ``Arena.create`` (the owner) or ``Arena.attach``.

    ``buf`` is the writable (or, read-only attach, read-only) mmap of the whole
    segment; ``geometry`` says where everything is.  Pickles as its instance
    name: unpickling attaches.
    """

    def __init__(self, instance: str, shm: posix_ipc.SharedMemory | None, buf: mmap.mmap,
                 info: layout.HeaderInfo, *, owner: bool, read_only: bool):
        self.instance = instance
        self.name = layout.arena_name(instance)
        self.buf = buf
        self.info = info
        self.geometry = info.geometry
        self.is_owner = owner
        self.read_only = read_only
        self._shm = shm  # the owner keeps its descriptor (and its flock) until close
        self._closed = False

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
        never a lost entry).  Raises ArenaExists if the name is taken (run
        ``shmserve cleanup`` if its owner is dead), ArenaError if /dev/shm is
        too small or the parameters are impossible.  On any failure nothing is
        left behind in /dev/shm.
        """
        name = layout.arena_name(instance)
        if ring_capacity is None:  # every slot once, and as much again for commands and stale entries
            ring_capacity = min(layout.MAX_RING_CAPACITY, 1 << max(0, (2 * slot_count - 1).bit_length()))
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
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=geometry.total_size)
        except posix_ipc.ExistentialError:
            raise ArenaExists(f"arena {name} already exists; if its server is gone, run "
                              f"'shmserve cleanup'") from None
        except (OSError, ValueError, posix_ipc.Error) as exc:
            raise ArenaError(f"cannot create arena {name}: {exc}") from None
        buf = None
        try:
            fcntl.flock(shm.fd, fcntl.LOCK_EX)  # blocks only while a sweep probes this new name
            os.fchmod(shm.fd, mode)  # shm_open applied the umask
            if gid != -1:
                os.fchown(shm.fd, -1, gid)
            try:
                # Allocate every page now: a full /dev/shm fails here with ENOSPC
                # instead of a SIGBUS on first touch in the middle of a request.
                os.posix_fallocate(shm.fd, 0, geometry.total_size)
            except OSError as exc:
                raise ArenaError(f"cannot allocate {geometry.total_size} bytes in {SHM_DIR} ({exc.strerror}); "
                                 f"make it larger or configure a smaller arena") from None
            buf = _map(shm.fd, geometry.total_size, read_only=False, prefault=prefault)
            pid = os.getpid()
            layout.encode_header(buf, geometry, instance=instance, boot_id=boot_id(),
                                 created_unix_ns=time.time_ns(), owner_pid=pid,
                                 owner_start_ticks=process_start_ticks(pid) or 0, socket_path=socket_path)
            # Order matters here: the header is complete before state turns LIVE,
            # and attachers load-acquire the state before they trust the header.
            atomics.store32(buf, layout.HEADER.offset("state"), layout.ARENA_LIVE)
            info = layout.decode_header(buf)
        except BaseException:
            if buf is not None:
                buf.close()
            posix_ipc.unlink_shared_memory(name)
            shm.close_fd()
            raise
        return cls(instance, shm, buf, info, owner=True, read_only=False)

    @classmethod
    def attach(cls, instance: str, *, read_only: bool = False, prefault: bool = True) -> "Arena":
        """Map an existing arena after validating its header.

        Raises ArenaNotFound if there is none, ArenaError if the segment is
        still being created, is not a shmserve arena, or is corrupt (the
        message carries the layout error).  Read-only attaches never write.
        """
        name = layout.arena_name(instance)
        try:
            shm = posix_ipc.SharedMemory(name, read_only=read_only)
        except posix_ipc.ExistentialError:
            raise ArenaNotFound(f"no arena {name} (is the server for instance {instance!r} running?)") from None
        except posix_ipc.PermissionsError as exc:
            raise ArenaError(f"cannot open arena {name}: {exc}") from None
        try:
            size = os.fstat(shm.fd).st_size
            if size < layout.HEADER_SIZE:
                raise ArenaError(f"arena {name} is {size} bytes: still being created, or not an arena")
            buf = _map(shm.fd, size, read_only=read_only, prefault=prefault and not read_only)
        finally:
            shm.close_fd()
        try:
            if atomics.load32(buf, layout.HEADER.offset("state")) == layout.ARENA_INITIALIZING:
                raise ArenaError(f"arena {name} is still being created")
            info = layout.decode_header(buf, size)
            if info.instance != instance:
                raise ArenaError(f"arena {name} belongs to instance {info.instance!r}")
        except layout.LayoutError as exc:
            buf.close()
            raise ArenaError(f"arena {name} is corrupt or foreign: {exc}") from None
        except BaseException:
            buf.close()
            raise
        return cls(instance, None, buf, info, owner=False, read_only=read_only)

    def close(self) -> None:
        """Unmap (and, for the owner, release the liveness lock).  Idempotent.

        Raises BufferError if numpy arrays or memoryviews of the arena are
        still alive: release them first.
        """
        if self._closed:
            return
        self.buf.close()
        self._closed = True
        if self._shm is not None:
            self._shm.close_fd()
            self._shm = None

    def unlink(self) -> None:
        """Remove the arena's name (owner only); mappings stay valid until closed.  Idempotent."""
        if not self.is_owner:
            raise ArenaError("only the creator of an arena unlinks it")
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
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


def _map(fd: int, size: int, *, read_only: bool, prefault: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
    prot = mmap.PROT_READ | (0 if read_only else mmap.PROT_WRITE)
    return mmap.mmap(fd, size, flags=flags, prot=prot)
