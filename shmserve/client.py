"""Client library: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Owns: the client side of the socket.  Inline calls send tensors from the
caller's arrays with one vectored ``sendmsg`` and receive results straight
into freshly allocated arrays (``recvmsg_into``); zero-copy calls work in a
region of shared memory the server created for this connection and passed as
a file descriptor: inputs are written into it by the caller, outputs are read
from it, and only small descriptors cross the socket, or nothing at all: a
lane region carries its own queue to a worker (``shmserve.lanes``), which the
blocking client uses for zero-copy calls by default.

Errors raise ``ShmserveError`` (``.code`` is the server's stable code);
``ConnectionClosed`` when no server answers.  Neither client is thread-safe;
use one per thread (they are cheap).

Must not: parse frames itself (``shmserve.protocol`` does).
"""

from __future__ import annotations

import array
import asyncio
import bisect
import mmap
import os
import select
import socket
import threading
import time
from collections import deque
from typing import Mapping

import numpy as np

from shmserve import layout, protocol
from shmserve.config import DEFAULT_INSTANCE, resolve_socket, spin_default_us
from shmserve.errors import ConnectionClosed, ErrorCode, ShmserveError
from shmserve.protocol import Frame, Kind, PayloadDone, ProtocolError
from shmserve.lanes import WAIT_SLICE_S, ClientLane
from shmserve.spec import ModelSpec, bind_inputs, estimate_output_bytes

READ_BUFFER = 256 * 1024
ANSWER_GRACE_S = 5.0  # wait this much longer than the request's timeout for the server's own answer
DEFAULT_REGION_BYTES = 64 * 1024 * 1024
DEFAULT_OUTPUT_CAPACITY = 16 * 1024 * 1024
_FD_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)
_ARRAYS = "_arrays"  # key under which a received RESULT's arrays are attached to its frame's meta


def _raw(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8))


_DTYPE_NAMES = {np.dtype(name): name for name in protocol.SUPPORTED_DTYPES}  # dtype.name is slow


def _prepare_inputs(inputs: Mapping[str, np.ndarray]) -> tuple[list[dict], list[np.ndarray]]:
    metas, arrays = [], []
    for name, value in inputs.items():
        a = np.ascontiguousarray(value)
        dtype = _DTYPE_NAMES.get(a.dtype)
        if dtype is None:
            raise ShmserveError(ErrorCode.BAD_DTYPE, f"input {name!r}: dtype {a.dtype} is not supported")
        metas.append({"name": name, "dtype": dtype, "shape": list(a.shape)})
        arrays.append(a)
    return metas, arrays


SOCKET_BUFFER = 4 * 1024 * 1024  # fewer, larger transfers for big inline tensors (capped by net.core.*mem_max)


def _large_buffers(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError:
            pass


def _keep_fds(ancdata, into: deque) -> None:
    for level, typ, data in ancdata:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
            into.extend(fds)


def _raise_error(frame: Frame):
    raise ShmserveError(ErrorCode.from_wire(str(frame.meta.get("code"))), str(frame.meta.get("message")))


def _output_sinks(frame: Frame) -> tuple[dict[str, np.ndarray], list]:
    outputs, sinks = {}, []
    for item in frame.meta.get("outputs", []):
        arr = np.empty(item["shape"], dtype=item["dtype"])
        outputs[item["name"]] = arr
        if arr.nbytes:
            sinks.append(_raw(arr))
    return outputs, sinks


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
    worker of its model: calls placed in it skip the socket altogether.
    """

    def __init__(self, region_id: int, size: int, fd: int, lane: dict | None = None):
        self.id, self.size = region_id, size
        try:
            self.buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.lane = ClientLane(self.buf, region_id, lane["model"]) if lane else None
        self.allocator = RegionAllocator(size, layout.LANE_BYTES if lane else 0)

    def close(self) -> None:
        self.lane = None
        try:
            self.buf.close()
        except BufferError:
            pass  # views still alive: the mapping goes when they do


class LaneWatcher:
    """Wakes an asyncio loop for a lane's completions.  A loop cannot wait on a futex, so a
    thread sleeps on the lane's completion doorbell and hands over with call_soon_threadsafe;
    every WAIT_SLICE_S it also has the loop look at the slots (the status word is the answer,
    an entry only a wake-up)."""

    def __init__(self, lane: ClientLane, loop: asyncio.AbstractEventLoop):
        self.lane, self.loop = lane, loop
        self.waiting: dict[int, tuple[int, asyncio.Future]] = {}  # slot -> (generation, its caller)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"shmserve-lane-{lane.region_id}", daemon=True)
        self._thread.start()

    async def wait(self, index: int, generation: int, timeout: float) -> None:
        """Until slot ``index`` finished; TIMEOUT after ``timeout`` s (the slot is reclaimed later)."""
        future = self.loop.create_future()
        self.waiting[index] = (generation, future)
        self._settle()
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self.lane.abandon(index, generation)
            raise ShmserveError(ErrorCode.TIMEOUT, "no answer from the worker in time") from None
        finally:
            self.waiting.pop(index, None)

    def fail(self, exc: Exception) -> None:
        for _, future in self.waiting.values():
            if not future.done():
                future.set_exception(exc)

    def stop(self) -> None:
        """Stop the thread (before the lane's memory is unmapped)."""
        self._stop.set()
        self._thread.join(5.0)

    def _watch(self) -> None:
        while not self._stop.is_set():
            if not self.lane.wait_for_wakeup(WAIT_SLICE_S) and not self.waiting:
                continue
            try:
                self.loop.call_soon_threadsafe(self._settle)
            except RuntimeError:  # the loop is closed
                return

    def _settle(self) -> None:
        for index, (generation, future) in list(self.waiting.items()):
            if not future.done() and self.lane.finished(index, generation):
                future.set_result(None)


class ZeroCopyCall:
    """One zero-copy request: write ``inputs`` (numpy views into the region), call ``run``,
    read the returned views; ``release`` (or leaving the ``with`` block) returns the space."""

    def __init__(self, client: "Client", model: str, region: Region, inputs: dict[str, tuple[int, np.ndarray]],
                 out_offset: int, out_capacity: int):
        self.client, self.model, self.region = client, model, region
        self._inputs = inputs
        self.inputs = {name: view for name, (_, view) in inputs.items()}
        self.out_offset, self.out_capacity = out_offset, out_capacity
        self.outputs: dict[str, np.ndarray] | None = None
        self._released = False

    def run(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Run the model on what is in ``inputs`` now; returns read-only views valid until release."""
        if self._lane_usable():
            index, generation = self._lane_submit()
            lane, client = self.region.lane, self.client
            lane.wait(index, generation, time.monotonic() + (timeout or client.timeout), client._lane_spin_s,
                      client._check_alive)
            return self._lane_collect(index, generation)
        return self._collect(self.client._call(Kind.INFER_REGION, self._meta(timeout), timeout=timeout))

    def _lane_usable(self) -> bool:
        """Through the region's own queue if it has one with a free slot (all 16 busy: this call
        goes over the socket instead, as a descriptor naming the same region)."""
        return self.region.lane is not None and self.region.lane.has_free_slot()

    def _lane_submit(self) -> tuple[int, int]:
        spec = self.client._specs[self.model]
        names = [t.name for t in spec.inputs]
        try:
            inputs = [(names.index(n), off, v) for n, (off, v) in self._inputs.items()]
        except ValueError:
            raise ShmserveError(ErrorCode.BAD_INPUT, f"model {self.model!r} inputs are {names}, "
                                                     f"got {list(self._inputs)}") from None
        rid = self.client._next_id
        self.client._next_id += 1
        return self.region.lane.submit(rid, 0, inputs, self.out_offset, self.out_capacity)

    def _lane_collect(self, index: int, generation: int) -> dict[str, np.ndarray]:
        spec = self.client._specs[self.model]
        placed = self.region.lane.read(index, generation, self.out_offset, self.out_capacity)
        outputs = {}
        for name_index, (dtype, shape, offset) in sorted(placed.items()):
            view = np.ndarray(shape, dtype, buffer=self.region.buf, offset=offset)
            view.flags.writeable = False
            outputs[spec.outputs[name_index].name] = view
        self.outputs = outputs
        return outputs

    def _meta(self, timeout: float | None) -> dict:
        metas = [{"name": n, "dtype": v.dtype.name, "shape": list(v.shape), "offset": off}
                 for n, (off, v) in self._inputs.items()]
        return {"model": self.model, "inputs": metas, "region": self.region.id, "output_offset": self.out_offset,
                "output_capacity": self.out_capacity, "timeout_s": timeout or self.client.timeout}

    def _collect(self, frame: Frame) -> dict[str, np.ndarray]:
        outputs = {}
        for item in frame.meta.get("outputs", []):
            offset, nbytes = item["offset"], protocol.tensor_nbytes(item["dtype"], item["shape"])
            if not (self.out_offset <= offset and offset + nbytes <= self.out_offset + self.out_capacity):
                raise ShmserveError(ErrorCode.INTERNAL, "server placed an output outside the output area")
            view = np.ndarray(item["shape"], item["dtype"], buffer=self.region.buf, offset=offset)
            view.flags.writeable = False
            outputs[item["name"]] = view
        self.outputs = outputs
        return outputs

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.inputs = {}
        self.outputs = None
        for offset, view in self._inputs.values():
            self.region.allocator.release(offset, view.nbytes)
        self._inputs = {}
        self.region.allocator.release(self.out_offset, self.out_capacity)

    def __enter__(self) -> "ZeroCopyCall":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class AsyncZeroCopyCall(ZeroCopyCall):
    """``ZeroCopyCall`` for ``AsyncClient``: ``outputs = await call.run()``."""

    async def run(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        if self._lane_usable():
            index, generation = self._lane_submit()
            await self.client._lane_watcher(self.region).wait(index, generation, timeout or self.client.timeout)
            return self._lane_collect(index, generation)
        return self._collect(await self.client._call(Kind.INFER_REGION, self._meta(timeout), timeout=timeout))

    async def __aenter__(self) -> "AsyncZeroCopyCall":
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


def _normalize(inputs: Mapping[str, tuple]) -> tuple[dict, dict]:
    specs = {name: (tuple(int(d) for d in shape), np.dtype(dtype)) for name, (shape, dtype) in inputs.items()}
    return specs, {name: protocol.tensor_nbytes(dt.name, shape) for name, (shape, dt) in specs.items()}


def _fits(region: Region, sizes: list[int]) -> bool:
    free = sorted((length for _, length in region.allocator.free), reverse=True)
    for size in sorted(sizes, reverse=True):
        need = layout.tensor_span(size)
        if not free or free[0] < need:
            return False
        free[0] -= need
        free.sort(reverse=True)
    return True


def _find_region(regions: list[Region], sizes: list[int]) -> Region | None:
    return next((r for r in regions if _fits(r, sizes)), None)


def _place(region: Region, specs: dict, sizes: dict, output_capacity: int) -> tuple[dict, int]:
    placed = {}
    for name, (shape, dt) in specs.items():
        off = region.allocator.allocate(sizes[name])
        placed[name] = (off, np.ndarray(shape, dt, buffer=region.buf, offset=off))
    return placed, region.allocator.allocate(output_capacity)


def _region_size(sizes: dict, output_capacity: int) -> int:
    return max(DEFAULT_REGION_BYTES,
               sum(layout.tensor_span(s) for s in sizes.values()) + layout.tensor_span(output_capacity))


def _estimate(spec: ModelSpec | None, specs: dict) -> int:
    if spec is None:
        return DEFAULT_OUTPUT_CAPACITY
    metas = [protocol.TensorMeta(n, dt.name, shape) for n, (shape, dt) in specs.items()]
    try:
        symbols = bind_inputs(spec, metas)
    except ShmserveError:
        return DEFAULT_OUTPUT_CAPACITY  # the server will say what is wrong
    return estimate_output_bytes(spec, symbols, DEFAULT_OUTPUT_CAPACITY)


def _spec_of(listing: list[dict], model: str) -> ModelSpec | None:
    entry = next((m for m in listing if m["name"] == model and m.get("inputs")), None)
    return ModelSpec.from_dict(entry) if entry else None


class _ZeroCopyPlan:
    """Where a zero-copy call of ``model`` goes, shared by both clients (they differ only in how
    they ask the server for a region): a lane of the model when ``lane`` is set and the model
    is known, else a region without one; output capacity from the spec unless given."""

    def __init__(self, spec: ModelSpec | None, lane: str | None, inputs: Mapping[str, tuple],
                 output_capacity: int | None):
        self.specs, self.sizes = _normalize(inputs)
        self.output_capacity = _estimate(spec, self.specs) if output_capacity is None else output_capacity
        self.wanted = list(self.sizes.values()) + [self.output_capacity]
        self.lane = lane if spec is not None else None
        self.region_size = _region_size(self.sizes, self.output_capacity)

    def region_in(self, regions: list[Region]) -> Region | None:
        """An open region of the planned kind with room for the call."""
        return _find_region([r for r in regions if (r.lane.model if r.lane else None) == self.lane], self.wanted)

    def after_lane_refused(self, exc: ShmserveError, regions: list[Region]) -> Region | None:
        """The server refused a lane: if its workers serve all they can (overloaded), plan for a
        region without one (None: open it); any other refusal is raised."""
        if exc.code is not ErrorCode.OVERLOADED:
            raise exc
        self.lane = None
        return self.region_in(regions)

    def place(self, region: Region) -> tuple:
        """(region, inputs placed, output offset, output capacity): ZeroCopyCall's arguments."""
        placed, out_off = _place(region, self.specs, self.sizes, self.output_capacity)
        return region, placed, out_off, self.output_capacity


class Client:
    """A blocking connection to a shmserve server.

    ``socket``: the server's socket path (default: $SHMSERVE_SOCKET, else the
    runtime-directory default for ``instance``).  ``timeout``: default
    seconds per request, enforced by the server (and by this client with a
    grace period should the server not answer at all).
    """

    def __init__(self, socket_path: str | None = None, *, timeout: float = 60.0, instance: str = DEFAULT_INSTANCE,
                 spin_us: int | None = None, lanes: bool = True):
        self.path = resolve_socket(socket_path, None, instance)
        self.timeout = timeout
        # Zero-copy calls go through a lane (a region with its own queue to a worker: no socket
        # round trip) unless this is False (then each call is a descriptor over the socket).
        self.lanes = lanes
        # Poll for the answer this long before sleeping in recv (None: by core count; 0: never).
        # Lane calls follow the server's hint instead unless spin_us is given.
        self.spin_s = (spin_default_us(client=True) if spin_us is None else spin_us) / 1e6
        self._lane_spin_s = None if spin_us is None else spin_us / 1e6
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _large_buffers(self._sock)
        try:
            self._sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            self._sock.close()
            raise ConnectionClosed(f"no shmserve server at {self.path} ({exc.strerror})") from None
        self._proto = protocol.Connection(protocol.Role.CLIENT)
        self._buffer = bytearray(READ_BUFFER)
        self._view = memoryview(self._buffer)
        self._fds: deque[int] = deque()
        self._next_id = 1
        self._regions: list[Region] = []
        self._specs: dict[str, ModelSpec | None] = {}
        self._broken: str | None = None

    # -- public API -----------------------------------------------------------------------

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], *, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Run ``model`` on ``inputs`` (name -> array); returns name -> array (new arrays)."""
        metas, arrays = _prepare_inputs(inputs)
        total = sum(a.nbytes for a in arrays)
        frame = self._call(Kind.INFER, {"model": model, "inputs": metas, "timeout_s": timeout or self.timeout},
                           payload=[_raw(a) for a in arrays if a.nbytes], data_len=total, timeout=timeout)
        return frame.meta[_ARRAYS]

    def models(self) -> list[dict]:
        return self._call(Kind.MODELS, {}).meta["models"]

    def health(self) -> dict:
        meta = dict(self._call(Kind.HEALTH, {}).meta)
        meta.pop("id", None)
        return meta

    def info(self) -> dict:
        meta = dict(self._call(Kind.INFO, {}).meta)
        meta.pop("id", None)
        return meta

    def open_region(self, size: int, *, lane: str | None = None) -> Region:
        """Ask the server for ``size`` bytes of shared memory for zero-copy calls on this connection.

        ``lane``: a model name; the region then also carries a queue to one of that model's
        workers, and zero-copy calls placed in it do not touch the socket."""
        frame = self._call(Kind.OPEN_REGION, {"size": size} if lane is None else {"size": size, "lane": lane})
        if not self._fds:
            raise ShmserveError(ErrorCode.INTERNAL, "the server's region answer carried no descriptor")
        region = Region(frame.meta["region"], frame.meta["size"], self._fds.popleft(), frame.meta.get("lane"))
        self._regions.append(region)
        return region

    def zero_copy(self, model: str, inputs: Mapping[str, tuple], *, output_capacity: int | None = None) -> ZeroCopyCall:
        """Reserve region space for one call of ``model``.

        ``inputs`` maps input names to ``(shape, dtype)``; the returned call's
        ``inputs`` are writable numpy views of that space.  Outputs get
        ``output_capacity`` bytes (default: computed from the model's spec
        where its output shapes follow from the inputs, else 16 MiB).  With
        ``lanes`` (the default) the space is in a lane of ``model``.
        """
        if model not in self._specs:
            self._specs[model] = _spec_of(self.models(), model)
        plan = _ZeroCopyPlan(self._specs[model], model if self.lanes else None, inputs, output_capacity)
        region = plan.region_in(self._regions)
        if region is None and plan.lane is not None:
            try:
                region = self.open_region(plan.region_size, lane=plan.lane)
            except ShmserveError as exc:
                region = plan.after_lane_refused(exc, self._regions)
        return ZeroCopyCall(self, model, *plan.place(region or self.open_region(plan.region_size)))

    def close(self) -> None:
        for region in self._regions:
            region.close()
        self._regions.clear()
        while self._fds:
            os.close(self._fds.popleft())
        self._sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def _call(self, kind: Kind, meta: dict, *, payload=(), data_len: int = 0, timeout: float | None = None) -> Frame:
        if self._broken:
            raise ConnectionClosed(self._broken)
        rid = self._next_id
        self._next_id += 1
        try:
            self._send([protocol.encode_frame(kind, {"id": rid, **meta}, data_len), *payload])
        except ConnectionClosed:
            # The server may have said why before it closed (e.g. permission_denied): report that.
            self._broken = None
            self._receive(rid, time.monotonic() + 1.0)
            raise
        deadline = time.monotonic() + (timeout or self.timeout) + ANSWER_GRACE_S
        return self._receive(rid, deadline)

    def _send(self, parts: list) -> None:
        views = [memoryview(p) for p in parts]
        try:
            while views:
                sent = self._sock.sendmsg(views[:512])
                while sent and views:
                    if sent >= len(views[0]):
                        sent -= len(views.pop(0))
                    else:
                        views[0] = views[0][sent:]
                        sent = 0
        except OSError as exc:
            self._fail(f"connection to {self.path} lost while sending: {exc}")

    def _receive(self, rid: int, deadline: float) -> Frame:
        frame_out = None
        outputs: dict | None = None
        while True:
            event = self._proto.next_event()
            if event is protocol.NEED_DATA:
                self._read(deadline)
                continue
            if isinstance(event, ProtocolError):
                self._fail(f"unreadable answer from the server: {event.message}")
            if isinstance(event, PayloadDone):
                return frame_out if outputs is None else Frame(frame_out.kind, {**frame_out.meta, _ARRAYS: outputs}, 0)
            if event.kind == Kind.RESULT:
                outputs, sinks = _output_sinks(event)
                if sum(len(s) for s in sinks) != event.data_len:
                    self._fail("server sent a result whose payload does not match its outputs")
                if event.meta.get("id") != rid:
                    self._fail("server answered a request this client did not send")
                if not event.data_len:
                    return Frame(event.kind, {**event.meta, _ARRAYS: outputs}, 0)
                self._proto.accept_payload(sinks)
                frame_out = event
                continue
            if event.meta.get("id") not in (rid, None):
                self._fail("server answered a request this client did not send")
            if event.kind == Kind.ERROR:
                if event.meta.get("id") is None:
                    self._broken = str(event.meta.get("message"))
                _raise_error(event)
            return event

    def _read(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self._fail("no answer from the server in time", ErrorCode.TIMEOUT)
        target = self._proto.payload_buffer()
        buffers = [target if target is not None else self._view]
        try:
            got = self._poll_read(buffers) if self.spin_s > 0 else None
            if got is None:
                self._sock.settimeout(remaining)
                got = self._sock.recvmsg_into(buffers, _FD_SPACE)
            n, ancdata, _, _ = got
        except socket.timeout:
            self._fail("no answer from the server in time", ErrorCode.TIMEOUT)
        except OSError as exc:
            self._fail(f"connection to {self.path} lost: {exc}")
        _keep_fds(ancdata, self._fds)
        if n == 0:
            self._fail(f"the server at {self.path} closed the connection")
        if target is not None:
            self._proto.payload_received(n)
        else:
            self._proto.receive_data(self._view[:n])

    def _poll_read(self, buffers):
        """Non-blocking reads for up to spin_s; None if nothing came (then block)."""
        end = time.perf_counter() + self.spin_s
        while True:
            try:
                return self._sock.recvmsg_into(buffers, _FD_SPACE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= end:
                    return None

    def _check_alive(self) -> None:
        """ConnectionClosed if the server closed this connection (lane calls wait off the socket).
        Never blocks: the socket's own timeout would make a peek wait (CPython polls first)."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            if readable and self._sock.recv(1, socket.MSG_PEEK) == b"":
                self._fail(f"the server at {self.path} closed the connection")
        except OSError as exc:
            self._fail(f"connection to {self.path} lost: {exc}")

    def _fail(self, message: str, code: ErrorCode | None = None):
        self._broken = message
        if code is not None:
            raise ShmserveError(code, message)
        raise ConnectionClosed(message)


class AsyncClient:
    """The asyncio client: ``async with AsyncClient(path) as c: await c.infer(...)``.

    Several requests may be in flight at once on one connection; answers are
    matched by id.  ``zero_copy`` works as in ``Client`` (``await call.run()``).
    """

    def __init__(self, socket_path: str | None = None, *, timeout: float = 60.0, instance: str = DEFAULT_INSTANCE,
                 lanes: bool = True):
        self.path = resolve_socket(socket_path, None, instance)
        self.timeout = timeout
        self.lanes = lanes  # zero-copy calls through lanes (see Client)
        self._watchers: dict[int, LaneWatcher] = {}  # lane region id -> its completion watcher
        self._next_id = 1
        self._waiters: dict[int, asyncio.Future] = {}
        self._lock = asyncio.Lock()
        self._reader_task = None
        self._sock = None
        self._closed_reason: str | None = None
        self._fds: deque[int] = deque()
        self._regions: list[Region] = []
        self._specs: dict[str, ModelSpec | None] = {}

    async def connect(self) -> "AsyncClient":
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self.path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise ConnectionClosed(f"no shmserve server at {self.path} ({exc.strerror})") from None
        self._sock = sock
        self._proto = protocol.Connection(protocol.Role.CLIENT)
        self._reader_task = loop.create_task(self._reader())
        return self

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            try:
                await self._reader_task
            except (asyncio.CancelledError, Exception):
                pass
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._fail_all("client closed")
        for watcher in self._watchers.values():
            watcher.stop()  # before the lanes' memory is unmapped
        self._watchers.clear()
        for region in self._regions:
            region.close()
        self._regions.clear()
        while self._fds:
            os.close(self._fds.popleft())

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray], *, timeout: float | None = None) -> dict[str, np.ndarray]:
        metas, arrays = _prepare_inputs(inputs)
        frame = await self._call(Kind.INFER, {"model": model, "inputs": metas, "timeout_s": timeout or self.timeout},
                                 [_raw(a) for a in arrays if a.nbytes], sum(a.nbytes for a in arrays), timeout)
        return frame.meta[_ARRAYS]

    async def models(self) -> list[dict]:
        return (await self._call(Kind.MODELS, {})).meta["models"]

    async def health(self) -> dict:
        return {k: v for k, v in (await self._call(Kind.HEALTH, {})).meta.items() if k != "id"}

    async def info(self) -> dict:
        return {k: v for k, v in (await self._call(Kind.INFO, {})).meta.items() if k != "id"}

    async def open_region(self, size: int, *, lane: str | None = None) -> Region:
        """As ``Client.open_region``."""
        frame = await self._call(Kind.OPEN_REGION, {"size": size} if lane is None else {"size": size, "lane": lane})
        if not self._fds:
            raise ShmserveError(ErrorCode.INTERNAL, "the server's region answer carried no descriptor")
        region = Region(frame.meta["region"], frame.meta["size"], self._fds.popleft(), frame.meta.get("lane"))
        self._regions.append(region)
        return region

    async def zero_copy(self, model: str, inputs: Mapping[str, tuple], *,
                        output_capacity: int | None = None) -> AsyncZeroCopyCall:
        """As ``Client.zero_copy``; ``async with await c.zero_copy(...) as call: await call.run()``.
        Lane calls wake the loop through a watcher thread per lane (a loop cannot wait on a futex)."""
        if model not in self._specs:
            self._specs[model] = _spec_of(await self.models(), model)
        plan = _ZeroCopyPlan(self._specs[model], model if self.lanes else None, inputs, output_capacity)
        region = plan.region_in(self._regions)
        if region is None and plan.lane is not None:
            try:
                region = await self.open_region(plan.region_size, lane=plan.lane)
            except ShmserveError as exc:
                region = plan.after_lane_refused(exc, self._regions)
        return AsyncZeroCopyCall(self, model, *plan.place(region or await self.open_region(plan.region_size)))

    def _lane_watcher(self, region: Region) -> LaneWatcher:
        if self._closed_reason:
            raise ConnectionClosed(self._closed_reason)
        watcher = self._watchers.get(region.id)
        if watcher is None:
            watcher = self._watchers[region.id] = LaneWatcher(region.lane, asyncio.get_running_loop())
        return watcher

    async def _call(self, kind: Kind, meta: dict, payload=(), data_len: int = 0, timeout: float | None = None) -> Frame:
        if self._closed_reason:
            raise ConnectionClosed(self._closed_reason)
        loop = asyncio.get_running_loop()
        rid = self._next_id
        self._next_id += 1
        fut = loop.create_future()
        self._waiters[rid] = fut
        async with self._lock:  # frames of concurrent calls must not interleave
            try:
                await loop.sock_sendall(self._sock, protocol.encode_frame(kind, {"id": rid, **meta}, data_len))
                for part in payload:
                    await loop.sock_sendall(self._sock, part)
            except OSError as exc:
                self._fail_all(f"connection lost while sending: {exc}")
        try:
            return await asyncio.wait_for(fut, (timeout or self.timeout) + ANSWER_GRACE_S)
        except asyncio.TimeoutError:
            raise ShmserveError(ErrorCode.TIMEOUT, "no answer from the server in time") from None
        finally:
            self._waiters.pop(rid, None)

    async def _reader(self) -> None:
        loop = asyncio.get_running_loop()
        buffer = bytearray(READ_BUFFER)
        view = memoryview(buffer)
        current: tuple[Frame, dict] | None = None
        try:
            while True:
                event = self._proto.next_event()
                if event is protocol.NEED_DATA:
                    target = self._proto.payload_buffer()
                    n = await self._recv_into(loop, target if target is not None else view)
                    if n == 0:
                        raise ConnectionError("the server closed the connection")
                    if target is not None:
                        self._proto.payload_received(n)
                    else:
                        self._proto.receive_data(view[:n])
                    continue
                if isinstance(event, ProtocolError):
                    raise ConnectionError(f"unreadable answer from the server: {event.message}")
                if isinstance(event, PayloadDone):
                    frame, outputs = current
                    current = None
                    self._resolve(Frame(frame.kind, {**frame.meta, _ARRAYS: outputs}, 0))
                    continue
                if event.kind == Kind.RESULT:
                    outputs, sinks = _output_sinks(event)
                    if sum(len(s) for s in sinks) != event.data_len:
                        raise ConnectionError("result payload does not match its outputs")
                    if not event.data_len:
                        self._resolve(Frame(event.kind, {**event.meta, _ARRAYS: outputs}, 0))
                        continue
                    self._proto.accept_payload(sinks)
                    current = (event, outputs)
                    continue
                self._resolve(event)
        except (ConnectionError, OSError) as exc:
            self._fail_all(str(exc))

    async def _recv_into(self, loop, target) -> int:
        """recvmsg_into on the non-blocking socket, keeping any descriptors the server passed."""
        while True:
            try:
                n, ancdata, _, _ = self._sock.recvmsg_into([target], _FD_SPACE)
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_reader(self._sock.fileno(), ready.set_result, None)
                try:
                    await ready
                finally:
                    loop.remove_reader(self._sock.fileno())
                continue
            _keep_fds(ancdata, self._fds)
            return n

    def _resolve(self, frame: Frame) -> None:
        rid = frame.meta.get("id")
        if rid is None and frame.kind == Kind.ERROR:
            self._fail_all(str(frame.meta.get("message")), frame)
            return
        fut = self._waiters.get(rid)
        if fut is None or fut.done():
            return
        if frame.kind == Kind.ERROR:
            fut.set_exception(ShmserveError(ErrorCode.from_wire(str(frame.meta.get("code"))),
                                            str(frame.meta.get("message"))))
        else:
            fut.set_result(frame)

    def _fail_all(self, reason: str, frame: Frame | None = None) -> None:
        self._closed_reason = self._closed_reason or reason
        for watcher in self._watchers.values():  # lane calls in flight: the server is gone
            watcher.fail(ConnectionClosed(reason))
        for fut in self._waiters.values():
            if not fut.done():
                if frame is not None:
                    fut.set_exception(ShmserveError(ErrorCode.from_wire(str(frame.meta.get("code"))), reason))
                else:
                    fut.set_exception(ConnectionClosed(reason))
