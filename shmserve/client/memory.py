"""The shared memory a client holds: regions the server granted, their space, and infer's seats in lanes.

Owns: mapping a granted region (``Region``: checked to be as large as the
server said), first-fit allocation of its 64-byte aligned ranges
(``RegionAllocator``), the space ``Client.infer`` keeps in a lane per input
signature (``Seat``, ``Region.seat``), and the space of timed-out lane calls,
held until their worker is done with it (``Region.defer_release``,
``Region.reclaim``).

Must not: talk to the server (the core asks for regions; the pumps carry
it), decide where a call's tensors go (``planning``), or trust the server's
sizes (a region smaller than said is refused before it is touched).
"""

from __future__ import annotations

import bisect
import mmap
import os
from typing import TYPE_CHECKING

import numpy as np

from shmserve import layout
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.lanes import ClientLane

if TYPE_CHECKING:
    from shmserve.client.planning import LaneForm

SEATS_MAX = 8  # input signatures per lane whose space stays reserved between infer calls


class RegionAllocator:
    """First-fit allocation of 64-byte aligned ranges in [start, size) of one region (client side)."""

    def __init__(self, size: int, start: int = 0):
        self.size = size
        self.free: list[tuple[int, int]] = [(start, size - start)] if size > start else []  # sorted (offset, length)

    def allocate(self, nbytes: int) -> int | None:
        need = layout.tensor_span(nbytes)
        for i, (off, length) in enumerate(self.free):
            if length >= need:
                if length == need:
                    del self.free[i]
                else:
                    self.free[i] = (off + need, length - need)
                return off
        return None

    def release(self, offset: int, nbytes: int) -> None:
        need = layout.tensor_span(nbytes)
        i = bisect.bisect(self.free, (offset, 0))
        self.free.insert(i, (offset, need))
        merged: list[tuple[int, int]] = []
        for off, length in self.free:  # coalesce neighbours
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((off, length))
        self.free = merged


class Region:
    """Shared memory the server made for this connection; ``buf`` is its mapping.

    A lane region (``lane`` set) also holds, below ``data_offset``, a queue to one
    worker of its model: calls placed in it skip the socket altogether.  Takes
    ``fd`` (closed here, mapped or not); INTERNAL if it holds fewer than ``size``
    bytes (touching the missing pages would kill the process with SIGBUS).
    """

    def __init__(self, region_id: int, size: int, fd: int, lane: dict | None = None):
        self.id, self.size = region_id, size
        try:
            if os.fstat(fd).st_size < size:
                raise ShmserveError(ErrorCode.INTERNAL, f"region {region_id} is smaller than the {size} bytes "
                                                        f"the server said")
            self.buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.lane = ClientLane(self.buf, region_id, lane["model"]) if lane else None
        self.allocator = RegionAllocator(size, layout.LANE_BYTES if lane else 0)
        self.abandoned: list[tuple[int, int, Seat]] = []  # timed out: space held until done
        self.gone = False  # its connection ended: unmapped (once no view holds it), never named again
        self.seats: dict[tuple, Seat] = {}  # Client.infer's space per input signature, kept between calls

    def seat(self, signature: tuple, arrays: dict[str, np.ndarray], form: LaneForm) -> Seat | None:
        """Space for an infer call of ``signature``: the one kept for it if it is free, else new
        (kept for the next call while at most SEATS_MAX are, else released after this one; kept
        seats not in use are given back when the lane has no room left).  None if it does not fit."""
        seat = self.seats.get(signature)
        if seat is not None and not seat.busy:
            return seat
        seat = Seat.make(self, arrays, form)
        if seat is None and self.seats:
            for key, idle in list(self.seats.items()):
                if not idle.busy:
                    del self.seats[key]
                    idle.kept = False
                    idle.release()
            seat = Seat.make(self, arrays, form)
        if seat is not None and signature not in self.seats and len(self.seats) < SEATS_MAX:
            seat.kept = True
            self.seats[signature] = seat
        return seat

    def drop_seats(self) -> None:
        """Give back the space kept for infer calls (planned from a spec that is out of date); a
        seat in use goes when its call ends."""
        seats, self.seats = self.seats, {}
        for seat in seats.values():
            seat.kept = False
            if not seat.busy:
                seat.release()

    def defer_release(self, seat: Seat, index: int, generation: int) -> None:
        """Keep ``seat``'s space until the worker has finished lane slot ``index`` (its call timed
        out: the worker may still write its outputs there)."""
        self.abandoned.append((index, generation, seat))

    def reclaim(self) -> None:
        """Release the space of timed-out calls whose slots have finished since (or were recycled)."""
        lane, still = self.lane, []
        for index, generation, seat in self.abandoned:
            if lane is None or lane.finished(index, generation) or lane.abandoned.get(index) != generation:
                seat.release()
            else:
                still.append((index, generation, seat))
        self.abandoned = still

    def close(self) -> None:
        self.lane, self.gone = None, True
        try:
            self.buf.close()
        except BufferError:
            pass  # views still alive: the mapping goes when they do


class Seat:
    """Space in a lane for infer calls of one input signature: each input's view and the output
    area.  ``busy`` while a call uses it; a ``kept`` seat stays reserved for the next call of its
    signature (no allocation per call), any other is released when its call ends."""

    __slots__ = ("region", "views", "described", "out_offset", "out_capacity", "busy", "kept", "_spans")

    def __init__(self, region: Region, views: list, described: list, out_offset: int, out_capacity: int,
                 spans: list):
        self.region, self.views, self.described = region, views, described
        self.out_offset, self.out_capacity = out_offset, out_capacity
        self.busy = self.kept = False
        self._spans = spans

    @classmethod
    def make(cls, region: Region, arrays: dict[str, np.ndarray], form: LaneForm) -> Seat | None:
        allocator, spans = region.allocator, []
        for nbytes in form.sizes + (form.output_capacity,):
            offset = allocator.allocate(nbytes)
            if offset is None:
                for off, n in spans:
                    allocator.release(off, n)
                return None
            spans.append((offset, nbytes))
        views, described = [], []
        for a, name_index, (offset, _) in zip(arrays.values(), form.name_indices, spans):
            view = np.ndarray(a.shape, a.dtype, buffer=region.buf, offset=offset)
            views.append(view)
            described.append((name_index, offset, view))
        return cls(region, views, described, spans[-1][0], form.output_capacity, spans)

    def release(self) -> None:
        """The call is over (or the worker is done with the call that timed out): free for the next
        call of its signature if kept, else its space goes back to the region."""
        self.busy = False
        if not self.kept and self._spans:
            for off, n in self._spans:
                self.region.allocator.release(off, n)
            self._spans = []
