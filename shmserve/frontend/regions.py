"""Client regions and lanes: shared memory a front door's client writes tensors into.

Owns: creating a region (``layout.region_name``: ``/shmserve.<instance>.r<id>``,
mode 0600, allocated up front), the regions each owner (a front door's
connection) holds and the per-owner limit, the bounds check of a zero-copy
request against its region, removal (on close, on the owner's departure, at
shutdown, and of a dead predecessor's at start), and the lanes among them:
which worker serves each lane (``shmserve.lanes`` header and the worker's
attach/detach commands), moving a lane when its worker dies (failing what
it had queued or running), and the spin hint in every lane header.

Must not: hold requests (``shmserve.frontend.dispatcher``), talk to a socket
(a front door passes the descriptor ``open`` returns), or read a client's
tensor bytes.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Callable, Hashable

import posix_ipc

from shmserve import lanes, layout, workerlink
from shmserve.arena import SHM_DIR
from shmserve.config import spin_default_us
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.frontend.models import ModelState
from shmserve.protocol import TensorMeta
from shmserve.supervisor import READY, WorkerHandle

log = logging.getLogger("shmserve.regions")

MAX_REGIONS_PER_OWNER = 16
REGION_SLACK = 1 << 20  # a region may hold one largest request plus this much for alignment


@dataclass(eq=False)
class Region:
    id: int
    name: str  # posix shm name, with the leading slash
    size: int
    owner: Hashable
    lane_model: ModelState | None = None  # set for a lane: the model its queue serves
    lane_worker: WorkerHandle | None = None  # the worker it is attached to (None: waiting for one)
    lane_buf: mmap.mmap | None = None  # the front-end's mapping of the lane's queue (LANE_BYTES)

    @property
    def is_lane(self) -> bool:
        return self.lane_buf is not None


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


def sweep_stale(instance: str) -> list[str]:
    """Remove every region of ``instance`` from /dev/shm (call it only once this process owns the
    instance's arena: they are a dead predecessor's); returns their names."""
    prefix, removed = layout.region_prefix(instance), []
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix):
            try:
                posix_ipc.unlink_shared_memory("/" + name)
                removed.append(name)
            except posix_ipc.Error:
                pass
    return removed


class RegionTable:
    """Every region of this front-end, by id and by owner.

    ``command(worker, entry)`` pushes a command on a worker's submission ring
    (the supervisor's); ``models`` are the models lanes may serve.
    """

    def __init__(self, instance: str, models: dict[str, ModelState],
                 command: Callable[[WorkerHandle, int], None], *, max_request_bytes: int,
                 cpus: int | None = None):
        self.instance, self.models, self.command = instance, models, command
        self.max_request_bytes = max_request_bytes
        self.cpus = cpus or os.cpu_count() or 1
        self.regions: dict[int, Region] = {}
        self.by_owner: dict[Hashable, dict[int, Region]] = {}
        self.next_id = 1
        self.stopping = False

    # -- lifecycle ------------------------------------------------------------------------

    def open(self, owner: Hashable, size, lane=None) -> tuple[Region, int]:
        """Create a region of ``size`` bytes (plus a lane's queue if ``lane`` names a model) for
        ``owner``; returns it and a descriptor of it that the caller passes on and closes.

        Raises ShmserveError: BAD_FRAME/TOO_LARGE for a bad size, UNKNOWN_MODEL for a lane of no
        model, OVERLOADED when the owner holds MAX_REGIONS_PER_OWNER, the model's workers serve
        all the lanes they can, or /dev/shm is full; INTERNAL if the segment cannot be created.
        """
        limit = self.max_request_bytes + REGION_SLACK
        if type(size) is not int or not 0 < size <= limit:
            raise ShmserveError(ErrorCode.TOO_LARGE if type(size) is int and size > 0 else ErrorCode.BAD_FRAME,
                                f"'size' must be an integer in [1, {limit}]")
        lane_model = None
        if lane is not None:
            lane_model = self.models.get(lane) if isinstance(lane, str) else None
            if lane_model is None:
                raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"'lane' must name a model: {lane!r} is none")
            served = sum(r.lane_model is lane_model for r in self.regions.values())
            if served >= workerlink.MAX_LANES * len(lane_model.workers):
                raise ShmserveError(ErrorCode.OVERLOADED, f"model {lane_model.name!r} serves {served} lanes, its "
                                                          f"most; use a region without a lane")
            size += layout.LANE_BYTES
        owned = self.by_owner.setdefault(owner, {})
        if len(owned) >= MAX_REGIONS_PER_OWNER:
            raise ShmserveError(ErrorCode.OVERLOADED, f"at most {MAX_REGIONS_PER_OWNER} regions per connection")
        size = (size + layout.PAGE - 1) // layout.PAGE * layout.PAGE
        region_id = self.next_id
        self.next_id += 1
        name = layout.region_name(self.instance, region_id)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        except posix_ipc.Error as exc:
            raise ShmserveError(ErrorCode.INTERNAL, f"cannot create a region: {exc}") from None
        try:
            os.posix_fallocate(shm.fd, 0, size)
            lane_buf = mmap.mmap(shm.fd, layout.LANE_BYTES) if lane_model is not None else None
        except OSError as exc:
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise ShmserveError(ErrorCode.OVERLOADED, f"no shared memory for a {size}-byte region: "
                                                      f"{exc.strerror}") from None
        region = Region(region_id, name, size, owner, lane_model, None, lane_buf)
        self.regions[region_id] = owned[region_id] = region
        if lane_model is not None:
            lanes.init_header(lane_buf, lane_model.index)
            self._attach(region)
            self._tune_spin()
        return region, shm.fd

    def get(self, owner: Hashable, region_id) -> Region | None:
        """``owner``'s region ``region_id``, or None: a region is reachable only from its owner."""
        if type(region_id) is not int:
            return None
        return self.by_owner.get(owner, {}).get(region_id)

    def close(self, owner: Hashable, region_id) -> Region:
        """Remove ``owner``'s region ``region_id``; BAD_REGION if it holds none of that id."""
        region = self.get(owner, region_id)
        if region is None:
            raise ShmserveError(ErrorCode.BAD_REGION, "no such region on this connection")
        self._drop(region)
        return region

    def drop_owner(self, owner: Hashable) -> None:
        """Remove every region of ``owner`` (its connection is gone)."""
        for region in list(self.by_owner.get(owner, {}).values()):
            self._drop(region)
        self.by_owner.pop(owner, None)

    def close_all(self) -> None:
        self.stopping = True
        for region in list(self.regions.values()):
            self._drop(region)
        self.by_owner.clear()

    def _drop(self, region: Region) -> None:
        self.regions.pop(region.id, None)
        owned = self.by_owner.get(region.owner)
        if owned is not None:
            owned.pop(region.id, None)
        if region.lane_buf is not None:
            if region.lane_worker is not None:
                self.command(region.lane_worker, layout.command_entry(layout.CMD_DETACH_LANE, region.id))
                region.lane_worker = None
                self.attach_waiting(region.lane_model)  # a worker has room again
            region.lane_buf.close()
            region.lane_buf = None
            self._tune_spin()
        try:
            posix_ipc.unlink_shared_memory(region.name)
        except posix_ipc.ExistentialError:
            pass

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

    def worker_lost(self, w: WorkerHandle, how: str) -> None:
        """Worker ``w`` died: fail what its lanes had queued or running, and move them on."""
        for region in list(self.regions.values()):
            if region.lane_worker is not w:
                continue
            region.lane_worker = None
            lanes.fail_lane(region.lane_buf, ErrorCode.WORKER_CRASHED,
                            f"worker {w.index} for model {w.model.name!r} {how} while running this request")
            self._attach(region)

    def _attach(self, region: Region) -> None:
        """Give a lane to the ready worker of its model that has the fewest (none ready: it waits
        for ``attach_waiting``; calls queued meanwhile run once it is attached)."""
        load = collections.Counter(r.lane_worker for r in self.regions.values() if r.lane_worker is not None)
        ready = [w for w in region.lane_model.workers if w.state == READY and load[w] < workerlink.MAX_LANES]
        if not ready or self.stopping:
            region.lane_worker = None
            lanes.assign_worker(region.lane_buf, layout.NO_WORKER)
            return
        worker = min(ready, key=lambda w: load[w])
        region.lane_worker = worker
        lanes.assign_worker(region.lane_buf, worker.index)
        self.command(worker, layout.command_entry(layout.CMD_ATTACH_LANE, region.id))

    def _tune_spin(self) -> None:
        """Tell lane clients whether to spin for completions: only while there are at most half as
        many lanes as CPUs.  A spinning client needs a core of its own, and its worker another;
        past that, spinners steal the CPU the workers need (measured in docs/performance.md:
        8 lane clients on 2 vCPUs served 11,000 req/s spinning 50 us, 17,500 not spinning)."""
        lane_regions = [r for r in self.regions.values() if r.is_lane]
        spin = spin_default_us(client=True) if len(lane_regions) <= max(1, self.cpus // 2) else 0
        for region in lane_regions:
            lanes.set_spin_hint(region.lane_buf, spin)
