"""The memory a worker reaches besides the arena: client regions, and on a GPU its page-locked ranges.

Owns: the client regions this worker was given (``RegionCache``): their
descriptors as they arrive from the front-end (sealed memfds, with the size
it recorded), mapping each on first use at that size, and dropping it when
the front-end says so; and the GPU worker's page-locked ranges
(``GpuMemory``): the arena, registered once at start, and each client region
while it is mapped.

Ordering (STYLE.md point 8): a registration is a context manager entered
inside the lifetime of the mapping it registers, so unregister always runs
before unmap.  The arena's registration sits on the worker's own
``ExitStack`` above the arena's mapping (``workers.worker.open_worker``);
each region has a small ``ExitStack`` of its own (unmap pushed first, then
the registration), closed when the region is dropped, and the cache itself
is on the worker's stack, so every region is dropped before the backend
closes and the arena is unregistered and unmapped.

Must not: trust region ids (they come from clients: an id this worker was
not given is BAD_REGION), read the control socket itself (``fetch`` does),
validate descriptors (``shmserve.layout`` does), or import CUDA on a CPU
worker (``workers.cuda`` is imported by ``GpuMemory`` only).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Callable, Iterator

from shmserve.errors import ErrorCode
from workers.step import RequestFailed


class GpuMemory:
    """The GPU worker's page-locked ranges (``cudaHostRegister``, Portable | Mapped) on one device.

    Constructing it selects the device (CudaError if it cannot); ``locked``
    registers a buffer for the life of a ``with`` block; ``memory`` (a
    ``workers.cuda.DeviceMemory``) translates host views inside registered
    ranges to device addresses for backends in mapped mode.
    """

    def __init__(self, device_index: int):
        from workers import cuda

        self.cuda = cuda
        self.device_index = device_index
        cuda.set_device(device_index)
        self.memory = cuda.DeviceMemory()

    @contextlib.contextmanager
    def locked(self, buf, what: str) -> Iterator:
        """Page-lock ``buf`` (named ``what`` in errors) inside the block; yields its Registration.
        Enter it while ``buf`` is mapped: it is unregistered on the way out, before the caller unmaps."""
        with self.cuda.registered(buf, what) as reg:
            self.memory.add(reg)
            try:
                yield reg
            finally:
                self.memory.remove(reg.host)

    def bytes_in_use(self) -> int:
        """The device's memory in use now, by every process on it (``workers.memory`` says why)."""
        return self.cuda.device_bytes_in_use()

    def describe(self, arena_registration) -> dict:
        """For the front-end's info: the device and the arena's host and device addresses."""
        reg = arena_registration
        return {"device": self.device_index, "arena_host": hex(reg.host), "arena_device": hex(reg.device),
                "arena_bytes": reg.size, "flags": "Portable|Mapped"}


class RegionCache:
    """Client regions given to this worker, mapped on first use (``ensure``), dropped when the
    front-end says (``forget``).

    ``fetch()`` returns the descriptors that arrived since it was last
    called, as (region, size, fd), or (region, size, fd, bell) for a door
    process's lane (``workerlink.receive_regions`` on the control socket;
    ``bells[id]`` keeps its eventfd until the region is forgotten); they are
    taken only when a region id is not known yet.
    ``maps[id]`` is a mapped region's mmap and ``sizes[id]`` its size; region
    0 is the arena itself and never in them.  With ``gpu`` (a ``GpuMemory``)
    each region is page-locked while mapped.  A context manager: leaving it
    drops every region and closes every descriptor not mapped yet.
    """

    def __init__(self, fetch: Callable[[], list[tuple[int, int, int]]], gpu: GpuMemory | None = None):
        self.fetch = fetch
        self.gpu = gpu
        self.given: dict[int, tuple[int, int]] = {}  # region -> (fd, size), not mapped yet
        self.maps: dict[int, mmap.mmap] = {}
        self.sizes: dict[int, int] = {}
        self._held: dict[int, contextlib.ExitStack] = {}  # region -> its unregister, then unmap
        self.bells: dict[int, int] = {}  # region -> the eventfd its lane's door sleeps on (door lanes only)

    def take_arrived(self) -> None:
        """Take every descriptor that has arrived (a second one for the same region is closed)."""
        for region, size, fd, *bell in self.fetch():
            if region in self.given or region in self.maps or size <= 0:
                for each in (fd, *bell):
                    os.close(each)
            else:
                self.given[region] = (fd, size)
                if bell:
                    self.bells[region] = bell[0]

    def ensure(self, region: int) -> None:
        """Map ``region`` (and page-lock it on a GPU) unless it is the arena or mapped already.

        RequestFailed: BAD_REGION if the front-end did not give it to this
        worker (or it cannot be mapped), INTERNAL if it cannot be page-locked
        (nothing is left mapped then).
        """
        if region == 0 or region in self.maps:
            return
        if region not in self.given:
            self.take_arrived()
        entry = self.given.pop(region, None)
        if entry is None:
            raise RequestFailed(ErrorCode.BAD_REGION, f"region {region} is not open (closed, or never opened)")
        fd, size = entry
        with contextlib.ExitStack() as held:
            try:
                mapping = mmap.mmap(fd, size)  # the size the front-end sealed, never the descriptor's word
            except OSError as exc:
                raise RequestFailed(ErrorCode.BAD_REGION, f"cannot map region {region}: {exc.strerror}") from None
            finally:
                os.close(fd)
            held.callback(mapping.close)
            if self.gpu is not None:
                try:
                    held.enter_context(self.gpu.locked(mapping, f"region {region}"))
                except Exception as exc:
                    raise RequestFailed(ErrorCode.INTERNAL, f"cannot page-lock region {region}: {exc}") from None
            self._held[region] = held.pop_all()
        self.maps[region] = mapping
        self.sizes[region] = size

    def buffer(self, region: int, arena_buf):
        """The buffer a tensor of ``region`` lies in (``arena_buf`` for region 0); the region is mapped."""
        return arena_buf if region == 0 else self.maps[region]

    def forget(self, region: int) -> None:
        """The front-end closed ``region``: close its descriptor if it was never mapped, else unmap it
        (``drop``)."""
        self.take_arrived()
        entry = self.given.pop(region, None)
        if entry is not None:
            os.close(entry[0])
        bell = self.bells.pop(region, None)
        if bell is not None:
            os.close(bell)
        self.drop(region)

    def drop(self, region: int) -> None:
        """Unregister (GPU) and unmap ``region``; nothing if it is not mapped.  BufferError if views
        of it are still alive (the worker releases every view when a request ends)."""
        held = self._held.pop(region, None)
        if held is None:
            return
        del self.maps[region], self.sizes[region]
        held.close()

    def close(self) -> None:
        for region in list(self._held):
            self.drop(region)
        for fd, _ in self.given.values():
            os.close(fd)
        self.given.clear()
        for bell in self.bells.values():
            os.close(bell)
        self.bells.clear()

    def __enter__(self) -> "RegionCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
