"""Which slot and which data extent a request gets.

Owns: the free lists of slots and of data extents of one arena.  Exactly one
process allocates (the arena's owner, the front-end), so the free lists live
in that process's memory; the arena only records occupancy counters for the
inspection tool.

Must not: change a slot's status word (``Arena.transition`` does) or
read/write tensor data.
"""

from __future__ import annotations

from typing import NamedTuple

from shmserve import layout


class Extent(NamedTuple):
    offset: int  # absolute arena offset, aligned per its class
    size: int  # the class's extent size (>= the bytes asked for)
    size_class: int


class AllocationError(Exception):
    """Double free or a free of something this allocator never handed out: a bug, not bad input."""


class SlotPool:
    """Free slot indices, lowest first (hot descriptors stay in cache)."""

    def __init__(self, slot_count: int):
        self._free = list(range(slot_count - 1, -1, -1))
        self._in_use: set[int] = set()

    def acquire(self) -> int | None:
        """Return a free slot index, or None when all are in use (the caller answers 'overloaded')."""
        if not self._free:
            return None
        index = self._free.pop()
        self._in_use.add(index)
        return index

    def release(self, index: int) -> None:
        try:
            self._in_use.remove(index)
        except KeyError:
            raise AllocationError(f"slot {index} released but not in use") from None
        self._free.append(index)

    @property
    def in_use(self) -> int:
        return len(self._in_use)


class ExtentAllocator:
    """Extents of the data region, by size class.

    ``allocate(n)`` takes an extent from the smallest class whose extents hold
    ``n`` bytes, falling back to larger classes when that one is exhausted.
    """

    def __init__(self, geometry: layout.Geometry):
        self._classes = geometry.classes
        self._free = [
            [cls.offset + i * cls.extent_size for i in range(cls.extent_count - 1, -1, -1)]
            for cls in self._classes
        ]
        self._in_use: dict[int, int] = {}  # offset -> class index
        self.bytes_in_use = 0

    @property
    def largest(self) -> int:
        """The largest request (bytes) this arena can ever hold."""
        return self._classes[-1].extent_size

    def allocate(self, nbytes: int) -> Extent | None:
        """Return an extent of at least ``nbytes`` (>= 0), or None if none is free now.

        Raises ValueError if ``nbytes`` exceeds ``largest`` (it could never fit).
        """
        if nbytes > self.largest:
            raise ValueError(f"{nbytes} bytes exceed the largest arena extent ({self.largest} bytes)")
        for index, cls in enumerate(self._classes):
            if cls.extent_size >= nbytes and self._free[index]:
                offset = self._free[index].pop()
                self._in_use[offset] = index
                self.bytes_in_use += cls.extent_size
                return Extent(offset, cls.extent_size, index)
        return None

    def free(self, extent: Extent) -> None:
        index = self._in_use.pop(extent.offset, None)
        if index is None or index != extent.size_class:
            raise AllocationError(f"extent at {extent.offset} freed but not allocated")
        self._free[index].append(extent.offset)
        self.bytes_in_use -= extent.size

    def free_count(self, size_class: int) -> int:
        return len(self._free[size_class])
