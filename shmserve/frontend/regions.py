"""Client regions and lanes: memory a front door's client writes tensors into.

Owns: creating a region (a ``memfd`` of the recorded size, sealed against
shrinking and growing before its descriptor leaves this process, so no
client can pull memory out from under a worker or the front-end, and it
needs no name in /dev/shm; its pages are charged to whoever first touches
them, the client for its inputs), the record of each region in the arena's
region table (``inspect`` reads them), the limits on what one connection
and one uid may hold, passing a region's descriptor to a worker before the
first request that names it (``deliver``), and a region's release: closed,
it is unreachable at once; every worker that has it is told to drop it and
says when it has (``worker_dropped``); then its pages are punched out (a
client that kept the descriptor keeps an empty file, any page it touches
again is its own), its record freed and its bytes no longer counted against
its owner and uid.  Also the bounds check of a
zero-copy request against its region, and the lanes among them: which
worker serves each lane (``shmserve.lanes`` header and the worker's
attach/detach commands), moving a lane when its worker dies (failing the
call it was running; what it had queued runs on the next worker), the lanes'
watchdog (``watch_lanes``: a lane no worker could take attached once one can,
a call left READY told to its worker again), and what every lane header says
besides: the version it serves, its model's routing epoch (``route_changed``),
the spin and divert hints.

Must not: hold requests (``shmserve.frontend.dispatcher``), talk to a
client's socket (a front door passes on ``Region.fd``), or read a client's
tensor bytes.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, NamedTuple

from shmserve import lanes, layout, workerlink
from shmserve.arena import Arena
from shmserve.config import spin_default_us
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.models import SERVING, ModelState, Models
from shmserve.protocol import REGION_SLACK, TensorMeta
from shmserve.supervisor import READY, WorkerHandle

log = logging.getLogger("shmserve.regions")

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# A lane call READY this long in a lane whose worker is ready: that worker is told to serve the
# lane's queue again (``watch_lanes``).  Longer than a healthy worker takes to claim a call it was
# handed (microseconds, milliseconds behind a batch), short against any request timeout.
LANE_NUDGE_S = 1.0


class RegionLimits(NamedTuple):
    """What one connection and one uid may hold (config keys of the same names)."""

    max_regions_per_connection: int = 16
    max_regions_per_uid: int = 256
    max_region_bytes_per_connection: int = 1 << 30
    max_region_bytes_per_uid: int = 4 << 30


@dataclass(eq=False)
class Region:
    id: int
    fd: int  # the sealed memfd; -1 once closed
    size: int
    owner: Hashable
    uid: int
    record: int  # its index in the arena's region table
    lane_model: ModelState | None = None  # set for a lane: the model version its queue serves
    lane_worker: WorkerHandle | None = None  # the worker it is attached to (None: waiting for one)
    lane_buf: mmap.mmap | None = None  # the front-end's mapping of the lane's queue (LANE_BYTES)
    sent_to: set = field(default_factory=set)  # workers (handles) that were passed its descriptor
    closing: bool = False  # closed: unreachable, waiting for the workers in ``sent_to`` to drop it
    moving_from: WorkerHandle | None = None  # a lane handed over: the worker that must drop it first
    bell: int = -1  # a door process's lane: the eventfd its door sleeps on (the door's desk owns it), sent
    #                 to each worker with the region; -1: a client's lane, woken by its futex

    @property
    def is_lane(self) -> bool:
        return self.lane_buf is not None

    @property
    def closed(self) -> bool:
        return self.closing or self.fd < 0


def check_request(region: Region, inputs: tuple[TensorMeta, ...], out_offset: int, out_capacity: int) -> None:
    """BAD_REGION unless every input and the output area of a zero-copy request are aligned and
    inside ``region``."""
    for t in inputs:
        if not layout.is_tensor_aligned(t.offset) or t.offset + t.nbytes > region.size:
            raise ShmserveError(ErrorCode.BAD_REGION, f"input {t.name!r} at [{t.offset}, +{t.nbytes}) is not "
                                                      f"{layout.TENSOR_ALIGN}-aligned inside region {region.id} "
                                                      f"({region.size} bytes)")
    if not layout.is_tensor_aligned(out_offset) or out_offset + out_capacity > region.size:
        raise ShmserveError(ErrorCode.BAD_REGION, f"output area [{out_offset}, +{out_capacity}) is not aligned "
                                                  f"inside region {region.id} ({region.size} bytes)")


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes, sealed against shrinking, growing and further sealing (the
    client may write it, never resize it); its descriptor.  No page is allocated here: each is
    charged to the process that first touches it, and making one costs the same at any size.

    OSError if it cannot be made (EMFILE, ENOMEM)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def empty_and_close(fd: int, size: int) -> None:
    """Free every page of a released region (punch a hole over all of it: whoever still holds a
    descriptor or mapping of it sees zeros, and pages touched again are charged to whoever
    touches them), then close our descriptor."""
    try:
        _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size)
    finally:
        os.close(fd)


class RegionTable:
    """Every region of this front-end, by id and by owner, recorded in ``arena``'s region table.

    ``command(worker, entry)`` pushes a command on a worker's submission ring
    (the supervisor's); ``models`` are the models lanes may serve.
    """

    def __init__(self, arena: Arena, models: Models,
                 command: Callable[[WorkerHandle, int], None], *, max_request_bytes: int,
                 limits: RegionLimits = RegionLimits(), cpus: int | None = None,
                 offload: Callable[[Callable[[], None]], None] = lambda work: work()):
        self.arena, self.models, self.command = arena, models, command
        self.max_request_bytes, self.limits = max_request_bytes, limits
        self.offload = offload  # runs a released region's page freeing (the server: off the event loop)
        self.closing: dict[int, Region] = {}  # closed, waiting for workers to drop them
        self.count_of_uid: collections.Counter = collections.Counter()
        self.cpus = cpus or os.cpu_count() or 1
        self.regions: dict[int, Region] = {}
        self.by_owner: dict[Hashable, dict[int, Region]] = {}
        self.bytes_of_owner: collections.Counter = collections.Counter()
        self.bytes_of_uid: collections.Counter = collections.Counter()
        self.free_records = list(range(arena.geometry.max_regions - 1, -1, -1))
        self.next_id = 1
        self.stopping = False
        self.divert_every = False  # shutting down: Client.infer comes over the socket (``divert_all``)
        self.pending_since: dict[int, float] = {}  # lane region -> since when every look saw a call pending
        self.ready_since: dict[tuple, float] = {}  # (region, slot entry) -> when watch_lanes first saw it READY
        self.nudged_at: dict[int, float] = {}  # lane region -> when watch_lanes last told its worker to look

    # -- lifecycle ------------------------------------------------------------------------

    def open(self, owner: Hashable, size, lane=None, *, uid: int = -1, pid: int = 0, version: int | None = None,
             bell: int = -1) -> Region:
        """Create a sealed region of ``size`` bytes (plus a lane's queue if ``lane`` names a model:
        to a worker of its ``version``, if given, else of its default) for ``owner`` (a connection
        of ``uid``, ``pid``); the caller passes ``region.fd`` on (the region keeps it: it closes
        with the region).  A door process's lane (``bell``: the eventfd its door sleeps on, kept
        open by the caller while the region lives) is not counted against the per-connection
        limits nor against its uid's (the door's desk bounds its lanes; their uid is the server's, which
        a client of the same uid must not find spent).

        Raises ShmserveError: BAD_FRAME/TOO_LARGE for a bad size, UNKNOWN_MODEL for a lane of no
        model or of a version not serving, OVERLOADED when a limit (named in the message) is
        reached, the model's workers serve all the lanes they can or none of its ready workers
        can take the lane now, or the region cannot be made.
        """
        limit = self.max_request_bytes + REGION_SLACK
        if type(size) is not int or size <= 0:
            raise ShmserveError(ErrorCode.BAD_FRAME, f"'size' must be an integer in [1, {limit}]")
        if size > limit:
            raise ShmserveError(ErrorCode.TOO_LARGE, f"region of {size} bytes > {limit} (server.max_request_bytes "
                                                     f"+ 1 MiB): ask for less, or raise [server] max_request_bytes")
        lane_model = None
        if lane is not None:
            named = self.models.get(lane)
            if named is not None and version is not None:
                lane_model = named.versions.get(version)
                if bell >= 0:  # a door's lane: none of a version that takes no calls (refused below)
                    if lane_model is not None and not lane_model.taking:
                        lane_model = None
                elif lane_model is None or lane_model.phase != SERVING:
                    raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"model {lane!r} has no version {version} serving "
                                                                 f"(serving: {sorted(v.version for v in named.serving())})")
            else:
                lane_model = named.current if named is not None else None
            if lane_model is None:
                raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"'lane' must name a model: {lane!r} is none"
                                    if named is None else f"model {lane!r} has no version serving now")
            served = sum(r.lane_model is lane_model for r in self.regions.values())
            if served >= workerlink.MAX_LANES * len(lane_model.workers):
                raise ShmserveError(ErrorCode.OVERLOADED, f"model {lane_model.name!r} serves {served} lanes, its "
                                                          f"most; use a region without a lane")
            size += layout.LANE_BYTES
        size = (size + layout.PAGE - 1) // layout.PAGE * layout.PAGE
        if bell < 0:
            self._check_limits(owner, uid, size)
        elif not self.free_records:
            raise ShmserveError(ErrorCode.OVERLOADED, f"the server holds {self.arena.geometry.max_regions} "
                                                      f"regions, its most (server.max_regions)")
        region_id = self.next_id
        self.next_id += 1
        try:
            fd = sealed_memfd(f"shmserve.{self.arena.instance}.r{region_id}", size)
        except OSError as exc:
            raise ShmserveError(ErrorCode.OVERLOADED, f"cannot make a {size}-byte region: {exc.strerror}") from None
        try:
            lane_buf = mmap.mmap(fd, layout.LANE_BYTES) if lane_model is not None else None
        except OSError as exc:
            os.close(fd)
            raise ShmserveError(ErrorCode.OVERLOADED, f"cannot map a new lane: {exc.strerror}") from None
        region = Region(region_id, fd, size, owner, uid, self.free_records.pop(), lane_model, None, lane_buf,
                        bell=bell)
        self.regions[region_id] = region
        self.by_owner.setdefault(owner, {})[region_id] = region
        self.bytes_of_owner[owner] += size
        if bell < 0:  # a door's lane is the server's own, in no caller's budget (its uid is the server's)
            self.bytes_of_uid[uid] += size
            self.count_of_uid[uid] += 1
        layout.REGION.write(self.arena.buf, self.arena.geometry.region_off(region.record),
                            kind=layout.REGION_LANE if lane_model is not None else layout.REGION_PLAIN,
                            id=region_id, size=size, owner_pid=max(pid, 0), owner_uid=layout.region_uid(uid),
                            worker=layout.NO_WORKER, model_id=lane_model.index if lane_model is not None else 0,
                            created_unix_ns=time.time_ns())
        if lane_model is not None:
            lanes.init_header(lane_buf, lane_model.index, lane_model.version, named.route_epoch)
            lanes.set_divert(lane_buf, self.divert_every)
            if not self._attach(region):
                self._close(region)
                raise ShmserveError(ErrorCode.OVERLOADED, f"no worker of model {lane_model.name!r} can take a "
                                                          f"new lane now (busy); use a region without a lane")
            self._tune_spin()
        return region

    def _check_limits(self, owner: Hashable, uid: int, size: int) -> None:
        """OVERLOADED, naming the config key, if a region of ``size`` bytes would take ``owner`` or
        ``uid`` past its limit or the arena's region table is full."""
        lim = self.limits
        if len(self.by_owner.get(owner, ())) >= lim.max_regions_per_connection:
            raise ShmserveError(ErrorCode.OVERLOADED, f"this connection holds {lim.max_regions_per_connection} "
                                                      f"regions (server.max_regions_per_connection); close one first")
        if self.bytes_of_owner[owner] + size > lim.max_region_bytes_per_connection:
            raise ShmserveError(ErrorCode.OVERLOADED, f"a {size}-byte region would take this connection past "
                                                      f"{lim.max_region_bytes_per_connection} bytes of regions "
                                                      f"(server.max_region_bytes_per_connection)")
        if self.count_of_uid[uid] >= lim.max_regions_per_uid:
            raise ShmserveError(ErrorCode.OVERLOADED, f"uid {uid} holds {self.count_of_uid[uid]} regions "
                                                      f"(server.max_regions_per_uid); close some first")
        if self.bytes_of_uid[uid] + size > lim.max_region_bytes_per_uid:
            raise ShmserveError(ErrorCode.OVERLOADED, f"a {size}-byte region would take uid {uid} past "
                                                      f"{lim.max_region_bytes_per_uid} bytes of regions "
                                                      f"(server.max_region_bytes_per_uid)")
        if not self.free_records:
            raise ShmserveError(ErrorCode.OVERLOADED, f"the server holds {self.arena.geometry.max_regions} "
                                                      f"regions, its most (server.max_regions)")

    def get(self, owner: Hashable, region_id) -> Region | None:
        """``owner``'s region ``region_id``, or None: a region is reachable only from its owner."""
        if type(region_id) is not int:
            return None
        return self.by_owner.get(owner, {}).get(region_id)

    def close(self, owner: Hashable, region_id) -> Region:
        """Close ``owner``'s region ``region_id``; BAD_REGION if it holds none of that id."""
        region = self.get(owner, region_id)
        if region is None:
            raise ShmserveError(ErrorCode.BAD_REGION, "no such region on this connection")
        self._close(region)
        return region

    def drop_owner(self, owner: Hashable) -> None:
        """Close every region of ``owner`` (its connection is gone)."""
        for region in list(self.by_owner.get(owner, {}).values()):
            self._close(region)
        self.by_owner.pop(owner, None)

    def close_all(self) -> None:
        """At shutdown (the workers are stopped): close and release every region now."""
        self.stopping = True
        for region in list(self.regions.values()):
            self._close(region)
        for region in list(self.closing.values()):
            region.sent_to.clear()
            self._release(region)
        self.by_owner.clear()

    def _close(self, region: Region) -> None:
        """``region`` is closed: nobody may name it any more; detach its lane and tell every worker
        that has it to drop it (after the requests of it in hand: a drop detaches a lane too).
        It is released once they all have (``worker_dropped``, ``worker_lost``)."""
        self.regions.pop(region.id, None)
        self.pending_since.pop(region.id, None)
        owned = self.by_owner.get(region.owner)
        if owned is not None:
            owned.pop(region.id, None)
        region.closing = True
        if region.lane_buf is not None:
            if region.lane_worker is not None:
                region.lane_worker = None
                self.attach_waiting(region.lane_model)  # a worker has room again
            region.lane_buf.close()
            region.lane_buf = None
            self._tune_spin()
        for w in region.sent_to:
            self.command(w, layout.command_entry(layout.CMD_DROP_REGION, region.id))
        self.closing[region.id] = region
        if not region.sent_to:
            self._release(region)

    def worker_dropped(self, w: WorkerHandle, region_id) -> None:
        """Worker ``w`` says it dropped region ``region_id`` (unmapped, descriptor closed): a
        closed region may be released, a lane handed over goes to its next worker."""
        if type(region_id) is not int:
            return
        region = self.closing.get(region_id)
        if region is not None:
            region.sent_to.discard(w)
            if not region.sent_to:
                self._release(region)
            return
        region = self.regions.get(region_id)
        if region is not None:
            region.sent_to.discard(w)
            if region.moving_from is w:
                region.moving_from = None
                self._attach(region)

    def move_lanes(self, w: WorkerHandle, to: ModelState | None = None) -> int:
        """Hand the lanes of worker ``w`` (being retired) to another worker: of ``to`` (another
        version of their model) or of their own version.  ``w`` drops each one after the calls it
        has in hand; the next worker then serves the lane's queue from where ``w`` left it (calls
        queued meanwhile wait, none fails).  The number of lanes moved."""
        moved = 0
        for region in list(self.regions.values()):
            if region.lane_worker is not w:
                continue
            if to is not None:
                region.lane_model = to
                lanes.set_serves(region.lane_buf, to.version)  # its client plans the calls that follow for it
            region.lane_worker = None
            region.moving_from = w
            lanes.assign_worker(region.lane_buf, layout.NO_WORKER)
            layout.REGION.write(self.arena.buf, self.arena.geometry.region_off(region.record),
                                worker=layout.NO_WORKER)
            self.command(w, layout.command_entry(layout.CMD_DROP_REGION, region.id))
            moved += 1
        return moved

    def adopt_lanes(self, version: ModelState) -> None:
        """``version`` is its model's default now: lanes of that model left without a version
        (theirs no longer takes requests) and without a worker are given to it."""
        for region in list(self.regions.values()):
            old = region.lane_model
            if region.is_lane and old is not None and old is not version and old.name == version.name \
                    and not old.taking and region.lane_worker is None and region.moving_from is None:
                region.lane_model = version
                self._attach(region)

    def lane_pending_since(self, version: ModelState, now: float) -> float | None:
        """Since when a lane of ``version`` has held a call queued or running without a break, as
        far as the looks (the calls of this method, at ``now``) saw: the latest such time among its
        lanes with a call pending now; None if none has one.  Per lane, not per call: a client that
        rewrites its slots (a new generation, another slot) does not start the time again; a look
        that finds the lane idle does.  The status words are the client's to write, so this is only
        what they say: the lifecycle decides how long to believe it (residency, ``lane_busy``)."""
        latest = None
        for region in self.regions.values():
            if not region.is_lane or region.closed or region.lane_model is not version:
                continue
            if lanes.has_pending(region.lane_buf):
                since = self.pending_since.setdefault(region.id, now)
                latest = since if latest is None else max(latest, since)
            else:
                self.pending_since.pop(region.id, None)
        return latest

    def route_changed(self, model: str, epoch: int) -> None:
        """``model``'s routing changed (a canary started, stepped or ended): write its new routing
        ``epoch`` into each of its lanes' headers.  A lane client reads it before it routes a call
        and asks for the model's route again when it is not its route's (``shmserve.routing``)."""
        for region in self.regions.values():
            if region.is_lane and region.lane_model is not None and region.lane_model.name == model:
                lanes.set_route_epoch(region.lane_buf, epoch)

    def divert_all(self) -> None:
        """Shutting down: ``Client.infer`` requests come over the socket (answered SHUTTING_DOWN)
        on every lane from now on; zero-copy calls still queued or running drain (``lanes_pending``)."""
        self.divert_every = True
        for region in self.regions.values():
            if region.is_lane:
                lanes.set_divert(region.lane_buf, True)

    def divert_where(self, diverted) -> int:
        """Set each client lane's divert hint to ``diverted(region)`` (or on, while shutting down):
        a reload put its owner under a rate limit of its model, so ``Client.infer`` calls come
        over the socket (a ``zero_copy`` call's own lane is not checked per call: docs/config.md,
        "Rate limits").  Door lanes (``bell``) are left alone.  How many are diverted."""
        n = 0
        for region in self.regions.values():
            if region.is_lane and region.bell < 0 and region.lane_model is not None:
                divert = self.divert_every or bool(diverted(region))
                lanes.set_divert(region.lane_buf, divert)
                n += divert
        return n

    def fail_pending_lanes(self, code: ErrorCode, message: str) -> int:
        """Every worker has stopped (a shutdown) with lane calls still queued or running: fail them
        with ``code``; how many."""
        return sum(lanes.fail_lane(region.lane_buf, code, message)
                   for region in self.regions.values() if region.is_lane and not region.closed)

    def lanes_pending(self) -> bool:
        """Whether any lane holds a call queued or running."""
        return any(region.is_lane and not region.closed and lanes.has_pending(region.lane_buf)
                   for region in self.regions.values())

    def fail_lanes(self, version: ModelState, why: str) -> None:
        """``version`` is gone and its model has no other: fail what its lanes hold; they stay
        open without a worker (a version loaded later takes them)."""
        for region in list(self.regions.values()):
            if region.lane_model is version and region.is_lane and region.lane_worker is None \
                    and region.moving_from is None:
                lanes.fail_lane(region.lane_buf, ErrorCode.MODEL_UNAVAILABLE, why)

    def _release(self, region: Region) -> None:
        """Nobody in the server uses ``region`` any more: free its pages (whoever else still holds
        it), its record and what it counted against its owner and uid."""
        del self.closing[region.id]
        fd, region.fd = region.fd, -1
        self.offload(lambda: empty_and_close(fd, region.size))
        layout.REGION.write(self.arena.buf, self.arena.geometry.region_off(region.record), kind=layout.REGION_FREE)
        self.free_records.append(region.record)
        counted = ((self.bytes_of_owner, region.owner, region.size),)
        if region.bell < 0:  # (a door's lane counted against no uid: ``open``)
            counted += ((self.bytes_of_uid, region.uid, region.size), (self.count_of_uid, region.uid, 1))
        for counter, key, n in counted:
            counter[key] -= n
            if not counter[key]:
                del counter[key]

    def deliver(self, w: WorkerHandle, region: Region) -> tuple[ErrorCode, str] | None:
        """Make sure worker ``w`` has ``region``'s descriptor before a ring entry naming the
        region reaches it; None once it has, else why not (the request is failed with it):
        BAD_REGION if the region was closed, OVERLOADED if the worker's control socket is full or
        its ring has no room for more commands (``ring_has_room``)."""
        if region.closed:
            return ErrorCode.BAD_REGION, f"region {region.id} was closed before this request ran"
        if w in region.sent_to:
            return None
        if not self.ring_has_room(w) or w.control is None or \
                not workerlink.send_region(w.control, region.id, region.size, region.fd, region.bell):
            return ErrorCode.OVERLOADED, (f"worker {w.index} of model {w.model.name!r} is not taking new "
                                          f"regions now (busy or stuck); retry")
        region.sent_to.add(w)
        return None

    def ring_has_room(self, w: WorkerHandle) -> bool:
        """Whether a region may be given to worker ``w`` now.  Each one given costs commands on
        its submission ring later (attach, drop), and the ring holds twice the arena's slots: the
        commands of region ops may take only the half the slots never need, so a client opening
        and closing lanes quickly while the worker is busy cannot crowd out anyone's requests."""
        ring = w.submissions
        return len(ring) < ring.capacity - self.arena.geometry.slot_count

    # -- lanes ----------------------------------------------------------------------------

    def lanes_of(self, w: WorkerHandle) -> int:
        return sum(r.lane_worker is w for r in self.regions.values())

    @property
    def lane_count(self) -> int:
        return sum(r.is_lane for r in self.regions.values())

    def attach_waiting(self, model: ModelState) -> None:
        """Attach the lanes of ``model`` that have no worker (none was ready, or all were full)."""
        for region in list(self.regions.values()):
            if region.lane_model is model and region.lane_worker is None and region.is_lane:
                self._attach(region)

    def watch_lanes(self, now: float) -> int:
        """The lanes' watchdog, run every heartbeat (``now``: monotonic seconds).  A lane left
        without a worker while a ready worker of its version could take it (none could when it
        lost its last one: a full ring or control socket) is attached now.  A lane whose worker
        is ready and has a call READY for LANE_NUDGE_S or more gets that worker told, again, to
        serve the lane's queue (an attach command: the worker claims whatever is still READY in
        it, ``lanes.queued_entries``), at most once per LANE_NUDGE_S: a call whose ring entry was
        lost on its way (a worker that died with it in hand, whatever took it) is answered
        within LANE_NUDGE_S and a heartbeat, not at its timeout.  Returns how many lanes it acted on."""
        acted, seen = 0, {}
        for region in list(self.regions.values()):
            if not region.is_lane or region.closed or region.moving_from is not None or self.stopping:
                continue
            w = region.lane_worker
            if w is None:
                version = region.lane_model
                if version.taking and any(x.state == READY and not x.retiring for x in version.workers):
                    self._attach(region)
                    acted += region.lane_worker is not None
                continue
            if w.state != READY:
                continue
            stuck = False
            for entry in lanes.queued_entries(region.lane_buf):
                first = seen[(region.id, entry)] = self.ready_since.get((region.id, entry), now)
                stuck = stuck or now - first >= LANE_NUDGE_S
            if stuck and now - self.nudged_at.get(region.id, -LANE_NUDGE_S) >= LANE_NUDGE_S and self.ring_has_room(w):
                self.nudged_at[region.id] = now
                log.warning("lane %d: a call READY for %.1f s or more; worker %d told to serve its queue again",
                            region.id, LANE_NUDGE_S, w.index)
                self.command(w, layout.command_entry(layout.CMD_ATTACH_LANE, region.id))
                acted += 1
        self.ready_since = seen
        self.nudged_at = {k: t for k, t in self.nudged_at.items() if k in self.regions}
        return acted

    def lane_failed(self, w: WorkerHandle, region_id, why: str) -> None:
        """Worker ``w`` cannot serve the lane of region ``region_id`` it was told to attach (it
        could not map or page-lock it): fail the calls queued in it, and leave it without a
        worker (a later ready worker may take it); its client is told why."""
        region = self.regions.get(region_id) if type(region_id) is int else None
        if region is None or region.lane_worker is not w:
            return
        log.warning("worker %d cannot serve lane %d: %s", w.index, region.id, why)
        region.lane_worker = None
        lanes.fail_lane(region.lane_buf, ErrorCode.INTERNAL, f"worker {w.index} of model {w.model.name!r} "
                                                             f"cannot serve this lane: {why}")
        lanes.assign_worker(region.lane_buf, layout.NO_WORKER)
        layout.REGION.write(self.arena.buf, self.arena.geometry.region_off(region.record), worker=layout.NO_WORKER)

    def worker_lost(self, w: WorkerHandle, how: str) -> None:
        """Worker ``w`` died: it holds no region any more (closed ones it had may be released);
        fail the call its lanes had running (WORKER_CRASHED; SHUTTING_DOWN when the server stopped
        it; its version's drain failure when a drain timed out and terminated it, as the socket's
        calls get), and move them on (the calls it had not claimed run on the next worker)."""
        version = self.models.version_of(w)
        code, why = ((ErrorCode.SHUTTING_DOWN, "the server is shutting down") if self.divert_every else
                     version.drain_failure if version is not None and version.drain_failure else
                     (ErrorCode.WORKER_CRASHED,
                      f"worker {w.index} for model {w.model.name!r} {how} while running this request"))
        for region in list(self.closing.values()):
            self.worker_dropped(w, region.id)
        for region in list(self.regions.values()):
            region.sent_to.discard(w)
            if region.moving_from is w:  # it died while handing the lane over
                region.moving_from = None
                lanes.fail_lane(region.lane_buf, code, why, running_only=True)
                self._attach(region)
                continue
            if region.lane_worker is not w:
                continue
            region.lane_worker = None
            lanes.fail_lane(region.lane_buf, code, why, running_only=True)
            self._attach(region)

    def _attach(self, region: Region) -> bool:
        """Give a lane to the ready worker of its model that has the fewest and can take its
        descriptor now.  None ready: it waits for ``attach_waiting`` (calls queued meanwhile run
        once it is attached).  False if ready workers there are but none can take it (their
        control sockets are full: busy or stuck)."""
        if region.moving_from is not None:  # its old worker has not dropped it yet: attached once it has
            return True
        load = collections.Counter(r.lane_worker for r in self.regions.values() if r.lane_worker is not None)
        ready = [w for w in region.lane_model.workers
                 if w.state == READY and not w.retiring and load[w] < workerlink.MAX_LANES]
        worker = None
        if not self.stopping:
            for w in sorted(ready, key=lambda w: load[w]):
                if self.deliver(w, region) is None:
                    worker = w
                    break
        region.lane_worker = worker
        index = layout.NO_WORKER if worker is None else worker.index
        lanes.set_serves(region.lane_buf, region.lane_model.version)
        lanes.assign_worker(region.lane_buf, index)
        layout.REGION.write(self.arena.buf, self.arena.geometry.region_off(region.record), worker=index)
        if worker is not None:
            self.command(worker, layout.command_entry(layout.CMD_ATTACH_LANE, region.id))
        return worker is not None or not ready or self.stopping

    def _tune_spin(self) -> None:
        """Tell lane clients whether to spin for completions: only while there are at most half as
        many lanes as CPUs.  A spinning client needs a core of its own, and its worker another;
        past that, spinners steal the CPU the workers need (measured in docs/performance.md:
        8 lane clients on 2 vCPUs served 11,000 req/s spinning 50 us, 17,500 not spinning)."""
        lane_regions = [r for r in self.regions.values() if r.is_lane]
        spin = spin_default_us(client=True) if len(lane_regions) <= max(1, self.cpus // 2) else 0
        for region in lane_regions:
            lanes.set_spin_hint(region.lane_buf, spin)
