"""The lanes a door process owns: one client lane per worker of each version it serves itself.

Owns: each ``DoorLane`` (a region with a lane queue that main granted the
door, mapped here: ``lanes.ClientLane`` over it, its data space cut into one
equal part per lane slot, its calls in flight, and the armed eventfd wake-up
of its completion ring); asking main for lanes (``open_lane`` over the link,
at most one request per version at a time, up to the version's worker
count: main attaches each new lane to the worker with the fewest); and
giving them back (``retire``: when a version stops serving, each of its
lanes is closed once idle).

A lane slot ``i`` owns ``[DATA_FLOOR + i * part, DATA_FLOOR + (i + 1) * part)``:
its inputs first, each at a tensor-aligned offset, then its output area.  A
slot is in use from ``submit`` until ``read`` frees it (or, for an abandoned
call, until the worker has finished with it), so no two calls share bytes.

Must not: decide which requests go through a lane (``dispatcher``), or
trust the lane's bytes more than a client would (``lanes.ClientLane``
validates every output descriptor it reads).
"""

from __future__ import annotations

import logging
import mmap
import os

from shmserve import _atomics as atomics
from shmserve import layout, lanes
from shmserve.doors.directory import VersionView

log = logging.getLogger("shmserve.doors.lanes")


class DoorLane:
    """One lane of version ``view``: ``calls`` maps a busy slot to its call."""

    def __init__(self, region: int, fd: int, size: int, view: VersionView):
        try:
            self.buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.mem = memoryview(self.buf)  # payloads are received into views of it (the calls' sinks)
        self.region, self.size, self.view = region, size, view
        self.lane = lanes.ClientLane(self.buf, region, view.name)
        self.part = (size - lanes.DATA_FLOOR) // layout.LANE_SLOTS // layout.TENSOR_ALIGN * layout.TENSOR_ALIGN
        self.calls: dict[int, object] = {}  # slot -> the dispatcher's call
        self.waiters_off = self.lane.completions.waiters_offset
        self.retiring = False

    @property
    def idle(self) -> bool:
        """Whether no call of this door is in it (abandoned ones included)."""
        return not self.calls and not self.lane.abandoned

    def base(self, slot: int) -> int:
        """Where slot ``slot``'s part of the data space begins."""
        return lanes.DATA_FLOOR + slot * self.part

    def free_slot(self) -> int | None:
        """The slot the next ``lane.submit`` takes, or None if none is free."""
        if not self.lane.has_free_slot():
            return None
        return self.lane.free[-1]

    def arm(self) -> None:
        """Ask the worker to ring the door's eventfd on its next completion here."""
        atomics.exchange32(self.buf, self.waiters_off, 1)

    def close(self) -> None:
        try:
            self.mem.release()
            self.buf.close()
        except BufferError:  # a view of it is still alive: the kernel unmaps it at exit
            log.warning("lane %d still has views; left mapped", self.region)


class LanePool:
    """Every lane of this door by (model, version).  ``ask(view)`` sends an ``open_lane`` request
    (the caller's link); ``give_back(region)`` a ``close_lane``."""

    def __init__(self, ask, give_back):
        self.ask, self.give_back = ask, give_back
        self.lanes: dict[tuple[str, int], list[DoorLane]] = {}
        self.by_region: dict[int, DoorLane] = {}
        self.asking: set[tuple[str, int]] = set()  # versions with an open_lane request out
        self.refused: set[tuple[str, int]] = set()  # main refused a lane (not asked again until it changes)

    def pick(self, view: VersionView) -> DoorLane | None:
        """The lane of ``view`` with the fewest calls that can take one now; asks main for another
        while the version has fewer lanes than workers.  None: relay the request."""
        key = (view.name, view.version)
        have = self.lanes.get(key, ())
        best = None
        for lane in have:
            if lane.retiring or lane.view.model_id != view.model_id:
                continue
            if (best is None or len(lane.calls) < len(best.calls)) and lane.lane.routable():
                best = lane
        if len(have) < view.workers and key not in self.asking and key not in self.refused \
                and (best is None or best.calls):
            self.asking.add(key)
            self.ask(view)
        if best is None or best.free_slot() is None:
            return None
        return best

    def opened(self, view: VersionView, region: int, fd: int, size: int) -> DoorLane:
        key = (view.name, view.version)
        self.asking.discard(key)
        lane = DoorLane(region, fd, size, view)
        self.lanes.setdefault(key, []).append(lane)
        self.by_region[region] = lane
        return lane

    def not_opened(self, key: tuple[str, int]) -> None:
        self.asking.discard(key)
        self.refused.add(key)

    def retire(self, key: tuple[str, int]) -> None:
        """Version ``key`` no longer serves (or was swapped): its lanes are given back once idle."""
        self.refused.discard(key)
        for lane in self.lanes.get(key, ()):
            lane.retiring = True
        self.sweep()

    def sweep(self) -> None:
        """Give back every retiring lane that is idle (reclaiming abandoned slots first)."""
        for key, have in list(self.lanes.items()):
            for lane in list(have):
                if lane.lane.abandoned:
                    lane.lane.has_free_slot()  # reclaims finished abandoned slots
                if lane.retiring and lane.idle:
                    have.remove(lane)
                    del self.by_region[lane.region]
                    self.give_back(lane.region)
                    lane.close()
            if not have:
                del self.lanes[key]

    def all(self) -> list[DoorLane]:
        return list(self.by_region.values())

    def close_all(self) -> None:
        for lane in self.all():
            lane.close()
        self.lanes.clear()
        self.by_region.clear()
