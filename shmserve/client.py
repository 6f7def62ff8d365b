"""Client library: ``Client`` (blocking) and ``AsyncClient`` (asyncio), two pumps over one session.

Owns: the client's socket I/O and timeouts, and what both clients do with
shared memory.  Everything about frames — building requests, request ids,
checking and decoding answers, the descriptors the server passes — is
``shmserve.session.ClientSession``'s: ``Client`` sends a request's parts with
one vectored ``sendmsg`` and reads with ``recvmsg_into`` into the buffer the
session names (a result's payload straight into its new arrays) until the
session yields that request's answer; ``AsyncClient`` does the same from one
reader task and settles each caller's future by request id.

Zero-copy calls work in a region of shared memory the server created for
this connection and passed as a file descriptor: inputs are written into it
by the caller, outputs are read from it, and only small descriptors cross the
socket, or nothing at all: a lane region carries its own queue to a worker
(``shmserve.lanes.ClientLane``), which both clients use by default.  Planning
where a call's tensors go (``_ZeroCopyPlan``, ``RegionAllocator``) and the
call itself (``ZeroCopyCall``) are shared; ``AsyncClient`` wakes its loop for
lane completions with a ``LaneWatcher`` thread per lane.

Before either client sends anything it checks who serves the socket
(``SO_PEERCRED``): its own uid, root, or the ``server_uid`` it was given
(else $SHMSERVE_SERVER_UID); anyone else is refused with PERMISSION_DENIED
(``session.check_server``).

Errors raise ``ShmserveError`` (``.code`` is the server's stable code);
``ConnectionClosed`` when no server answers or the connection ended.  A
connection that ended is replaced by a new one on the next call
(``_ensure_connected``; a server restarted on the same socket serves it), and
a request not a byte of which reached the socket is sent once more on it;
one that may have reached the server is never sent again (docs/protocol.md,
"When the server goes away").  Neither client is thread-safe; use one per
thread (they are cheap).

Must not: parse or build frames (the session does), or trust what the server
sends (the session checks frames; ``Region`` checks the memory it is given).
"""

from __future__ import annotations

import array
import asyncio
import bisect
import mmap
import os
import select
import socket
import struct
import threading
import time
from typing import Iterable, Mapping, NamedTuple

import numpy as np

from shmserve import lanes, layout, protocol
from shmserve.config import DEFAULT_INSTANCE, resolve_socket, spin_default_us, trusted_server_uids
from shmserve.errors import BadArgument, ConnectionClosed, ErrorCode, ShmserveError
from shmserve.lanes import WAIT_SLICE_S, ClientLane
from shmserve.protocol import Kind, TensorMeta
from shmserve.session import (FIXED_DTYPES, NEED_DATA, ClientSession, ConnectionFailed, Placement, RegionGranted,
                              RequestFailed, check_server, check_tensor, check_timeout)
from shmserve.spec import ModelSpec, bind_inputs, estimate_output_bytes, output_shapes

ANSWER_GRACE_S = 5.0  # wait this much longer than the request's timeout for the server's own answer
DEFAULT_REGION_BYTES = 64 * 1024 * 1024
DEFAULT_OUTPUT_CAPACITY = 16 * 1024 * 1024
SOCKET_BUFFER = 4 * 1024 * 1024  # fewer, larger transfers for big inline tensors (capped by net.core.*mem_max)
MAX_IOV = 512  # buffers per sendmsg (the kernel takes up to IOV_MAX, 1024)
LANE_RETRY_S = 1.0  # a lane refused for Client.infer (the server's limits, no version serving): ask again after
LOOK_S = WAIT_SLICE_S  # a call through a lane first looks whether the server is still there, if not seen since
_FD_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


# -- socket helpers, for both pumps ---------------------------------------------------------

def _unix_socket() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError:
            pass
    return sock


def _no_server(path: str, exc: OSError) -> ConnectionClosed:
    return ConnectionClosed(f"no shmserve server at {path} ({exc.strerror})")


def _check_server(sock: socket.socket, path: str, trusted: frozenset[int]) -> None:
    """Close ``sock`` and raise PERMISSION_DENIED unless a trusted uid serves it (nothing sent yet)."""
    try:
        pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        check_server(path, pid, uid, trusted)
    except BaseException:
        sock.close()
        raise


def _passed_fds(ancdata) -> list[int]:
    """The descriptors a recvmsg received (SCM_RIGHTS)."""
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return list(fds)


def _closed_message(path: str) -> str:
    """Why calls in flight fail when the server closes the connection: it went away (or stopped
    serving this client) with them unanswered.  They may have run: they are not sent again."""
    return (f"the server at {path} closed the connection (a call in flight may have run: it is not sent "
            f"again; the next call connects again)")


def _sent(parts: list, n: int) -> None:
    """Drop from ``parts`` the ``n`` bytes one sendmsg took (and empty parts at the front)."""
    while parts and n >= len(parts[0]):
        n -= len(parts[0])
        del parts[0]
    if n:
        parts[0] = memoryview(parts[0])[n:]


# -- shared memory --------------------------------------------------------------------------

LIFECYCLE_TIMEOUT_S = 900.0  # a control call's default wait: a load of large engines plus a drain

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
        self.abandoned: list[tuple[int, int, "ZeroCopyCall | _Seat"]] = []  # timed out: space held until done
        self.gone = False  # its connection ended: unmapped (once no view holds it), never named again
        self.seats: dict[tuple, _Seat] = {}  # Client.infer's space per input signature, kept between calls

    def seat(self, signature: tuple, arrays: dict[str, np.ndarray], form: "_LaneForm") -> "_Seat | None":
        """Space for an infer call of ``signature``: the one kept for it if it is free, else new
        (kept for the next call while at most SEATS_MAX are, else released after this one; kept
        seats not in use are given back when the lane has no room left).  None if it does not fit."""
        seat = self.seats.get(signature)
        if seat is not None and not seat.busy:
            return seat
        seat = _Seat.make(self, arrays, form)
        if seat is None and self.seats:
            for key, idle in list(self.seats.items()):
                if not idle.busy:
                    del self.seats[key]
                    idle.kept = False
                    idle.release()
            seat = _Seat.make(self, arrays, form)
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

    def defer_release(self, call: "ZeroCopyCall | _Seat", index: int, generation: int) -> None:
        """Keep ``call``'s space until the worker has finished lane slot ``index`` (it timed out:
        the worker may still write its outputs there)."""
        self.abandoned.append((index, generation, call))

    def reclaim(self) -> None:
        """Release the space of timed-out calls whose slots have finished since (or were recycled)."""
        lane, still = self.lane, []
        for index, generation, call in self.abandoned:
            if lane is None or lane.finished(index, generation) or lane.abandoned.get(index) != generation:
                call.release()
            else:
                still.append((index, generation, call))
        self.abandoned = still

    def close(self) -> None:
        self.lane, self.gone = None, True
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
        except BaseException:  # cancelled: the worker may still write the call's outputs
            if not self.lane.finished(index, generation):
                self.lane.abandon(index, generation)
            raise
        finally:
            self.waiting.pop(index, None)

    def fail(self, exc: Exception) -> None:
        """The connection is over: every call waited for fails with ``exc``, but one that has
        finished (answered just before the server went) is settled with its answer."""
        self._settle()
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


# -- zero-copy calls ------------------------------------------------------------------------

_LIST_MODELS = object()  # a zero-copy call's step: the answer of models(), to read the spec afresh


class _LaneWait(NamedTuple):
    """A zero-copy call's step: wait until its lane call (slot ``index`` of ``generation``) has
    finished, by ``deadline`` (monotonic)."""

    index: int
    generation: int
    deadline: float


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
        self._plan: _CallPlan | None = None  # how its tensors are named to a lane worker (one version's spec)
        self._refused: ShmserveError | None = None  # the version serving now refuses this call: said once, kept
        self._looked_at: ModelSpec | None = None  # the client's spec the plan was last checked against

    def run(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Run the model on what is in ``inputs`` now; returns read-only views valid until release.
        Raises the request's ShmserveError; TIMEOUT after ``timeout`` (default: the client's).

        A lane call that a worker of another version refuses (the model's default version
        changed under the spec it was planned from) is planned again from the spec the client
        reads afresh, and sent again: the caller sees nothing of the swap.  If the new version
        does not take this call's inputs (names, dtypes, shapes) or its outputs would not fit the
        space reserved for them, the call fails with the new version's own code (BAD_INPUT,
        BAD_DTYPE, BAD_SHAPE, OUTPUT_TOO_LARGE) and a message naming both versions and what the
        new one refuses, and keeps failing so (make a new ``zero_copy`` call)."""
        client = self.client
        deadline, started = self._start(timeout)
        refused = None
        if started is not None:
            self.region.lane.wait(started[0], started[1], deadline, client._lane_spin_s, client._check_alive)
            outputs, refused = self._collected(started)
            if outputs is not None:
                return outputs
        steps, answer = self._steps(deadline, refused), None
        try:
            while True:
                step = steps.send(answer)
                if step is _LIST_MODELS:
                    answer = client.models()
                elif type(step) is _LaneWait:
                    self.region.lane.wait(step.index, step.generation, step.deadline, client._lane_spin_s,
                                          client._check_alive)
                else:
                    answer = client._exchange(*step)
        except StopIteration as done:
            return done.value

    def _start(self, timeout: float | None) -> tuple[float, tuple[int, int] | None]:
        """The call's common case, without I/O: (its deadline, the lane slot it was submitted in, or
        None when the rest needs the steps: its first run, or no lane slot free)."""
        client = self.client
        deadline = time.monotonic() + client._timeout(timeout)  # checked before anything is submitted
        client._look_if_due()
        if self.region.gone or client._session.failure is not None:
            raise self._gone()
        if self._plan is None or not self._lane_usable():
            return deadline, None
        return deadline, self._lane_submit(self._lane_plan())

    def _collected(self, started: tuple[int, int]) -> tuple[dict | None, ShmserveError | None]:
        """(the outputs of the lane call ``_start`` submitted, None), or (None, why) if a worker of
        another version refused it (``_steps`` plans it again); any other error is raised."""
        try:
            return self._lane_collect(*started), None
        except ShmserveError as exc:
            if not self._stale(exc, 0):
                raise
            return None, exc

    def _steps(self, deadline: float, refused: ShmserveError | None):
        """The rest of the call (``_start`` did not submit it, or a worker of another version refused
        it: ``refused``), as steps both clients carry out: a generator that yields
        ``_LIST_MODELS`` for the answer of ``models()``, a ``_LaneWait`` to wait for, or the
        (request, timeout) to exchange over the socket for its event; it returns the outputs."""
        client, first = self.client, 0
        if refused is not None:
            if client._spec_read(self.model, (yield _LIST_MODELS)) is None:
                raise refused
            first = 1
        for attempt in range(first, SPEC_RETRIES + 1):
            if not self._lane_usable():
                break
            if self._plan is None and client._specs.get(self.model) is None:
                client._spec_read(self.model, (yield _LIST_MODELS))  # infer forgot it (a swap): read it again
            plan = self._lane_plan()
            if plan is None:
                break  # the model lists no spec now: the socket says why
            index, generation = self._lane_submit(plan)
            yield _LaneWait(index, generation, deadline)
            try:
                return self._lane_collect(index, generation)
            except ShmserveError as exc:
                if not self._stale(exc, attempt) or client._spec_read(self.model, (yield _LIST_MODELS)) is None:
                    raise
        left = _left(deadline)
        return self._views((yield (self._request(left), left)).outputs)

    def _lane_usable(self) -> bool:
        """Through the region's own queue if it has one with a free slot (all 16 busy: this call
        goes over the socket instead, as a descriptor naming the same region)."""
        return self.region.lane is not None and self.region.lane.has_free_slot()

    def _lane_plan(self) -> "_CallPlan | None":
        """How this call names its tensors to a lane worker: planned from the client's spec of the
        model, again whenever that spec is of another version than the plan (a swap); None if the
        client has no spec of it.  Raises the clear error if the version the spec is of refuses
        the call (and keeps raising it)."""
        if self._refused is not None:
            raise self._refused
        spec, plan = self.client._specs.get(self.model), self._plan
        if spec is not None and spec is not self._looked_at:  # (the same spec object: nothing to do)
            if plan is None or _version_of(spec) != plan.version:
                try:
                    plan = self._plan = _call_plan(self.model, spec, self._inputs, self.out_capacity, plan)
                except ShmserveError as exc:
                    if plan is not None:  # it was planned from another version's spec: say what changed
                        self._refused = exc
                    raise
            self._looked_at = spec
        return plan

    def _lane_submit(self, plan: "_CallPlan") -> tuple[int, int]:
        return self.region.lane.submit(self.client._session.reserve_id(), plan.version, plan.described,
                                       self.out_offset, self.out_capacity)

    def _stale(self, exc: ShmserveError, attempt: int) -> bool:
        """Whether a lane call that failed with ``exc`` should be planned again from a spec read
        afresh and sent again: a worker of another version refused it before running it
        (``lanes.version_moved``; a call that failed MODEL_UNAVAILABLE otherwise, a drain that timed
        out, ran, and is never sent again), and fewer than SPEC_RETRIES attempts were made."""
        return lanes.version_moved(exc) and attempt < SPEC_RETRIES and self._plan is not None

    def _lane_collect(self, index: int, generation: int) -> dict[str, np.ndarray]:
        outputs = self._plan.outputs
        placed = self.region.lane.read(index, generation, self.out_offset, self.out_capacity)
        return self._views([(outputs[name_index], dtype, shape, offset)
                            for name_index, (dtype, shape, offset) in sorted(placed.items())])

    def _request(self, timeout: float):
        """What builds the INFER_REGION frame naming this call's space (no lane, or its slots all
        busy) on a session: ConnectionClosed (``_gone``) if its region is of a connection that ended."""
        tensors = [TensorMeta(name, view.dtype.name, view.shape, offset)
                   for name, (offset, view) in self._inputs.items()]

        def build(session: ClientSession) -> tuple[int, list]:
            if self.region.gone:  # (a new connection since: the id may name another region of ours there)
                raise self._gone()
            return session.infer_region(self.model, tensors, self.region.id, self.out_offset, self.out_capacity,
                                        timeout)
        return build

    def _gone(self) -> ConnectionClosed:
        """The error of a call whose region belonged to a connection that ended."""
        client = self.client
        if client._closed:
            return ConnectionClosed("client closed")
        failure = client._session.failure
        why = f" ({failure.message})" if failure is not None else ""
        return ConnectionClosed(f"this zero-copy call's space was in a region of a connection to {client.path} "
                                f"that ended{why}; the client connects again by itself: make a new zero_copy call")

    def _views(self, placements: Iterable[Placement]) -> dict[str, np.ndarray]:
        """Read-only views of the region where the outputs were placed (checked to lie in the
        output area: by the session, or by ``ClientLane.read``)."""
        outputs = {}
        for name, dtype, shape, offset in placements:
            view = np.ndarray(shape, dtype, buffer=self.region.buf, offset=offset)
            view.flags.writeable = False
            outputs[name] = view
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
        """As ``ZeroCopyCall.run`` (a swap under it included)."""
        client = self.client
        deadline, started = self._start(timeout)
        refused = None
        if started is not None:
            await client._lane_watcher(self.region).wait(started[0], started[1], max(0.0, deadline - time.monotonic()))
            outputs, refused = self._collected(started)
            if outputs is not None:
                return outputs
        steps, answer = self._steps(deadline, refused), None
        try:
            while True:
                step = steps.send(answer)
                if step is _LIST_MODELS:
                    answer = await client.models()
                elif type(step) is _LaneWait:
                    await client._lane_watcher(self.region).wait(step.index, step.generation,
                                                                 max(0.0, step.deadline - time.monotonic()))
                else:
                    answer = await client._exchange(*step)
        except StopIteration as done:
            return done.value

    async def __aenter__(self) -> "AsyncZeroCopyCall":
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


# -- planning where a zero-copy call goes (both clients) ------------------------------------

def _normalize(inputs: Mapping[str, tuple]) -> tuple[dict, dict]:
    specs = {name: check_tensor(name, shape, dtype) for name, (shape, dtype) in inputs.items()}
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
    return next((r for r in regions if not r.gone and _fits(r, sizes)), None)


def _place(region: Region, specs: dict, sizes: dict, output_capacity: int) -> tuple[dict, int]:
    placed = {}
    for name, (shape, dt) in specs.items():
        off = region.allocator.allocate(sizes[name])
        placed[name] = (off, np.ndarray(shape, dt, buffer=region.buf, offset=off))
    return placed, region.allocator.allocate(output_capacity)


def _needed_bytes(sizes: dict, output_capacity: int) -> int:
    """The least region space one call needs: its inputs and its output area."""
    return sum(layout.tensor_span(s) for s in sizes.values()) + layout.tensor_span(output_capacity)


def _estimate(spec: ModelSpec | None, specs: dict, fallback: int = DEFAULT_OUTPUT_CAPACITY) -> tuple[int, bool]:
    """(bytes to reserve for the outputs, whether that is exact: every output's shape follows
    from the inputs); ``fallback`` for each output whose size it cannot tell."""
    if spec is None:
        return fallback, False
    metas = [protocol.TensorMeta(n, dt.name, shape) for n, (shape, dt) in specs.items()]
    try:
        symbols = bind_inputs(spec, metas)
    except ShmserveError:
        return fallback, False  # the server will say what is wrong
    capacity = estimate_output_bytes(spec, symbols, fallback)
    return capacity, capacity == estimate_output_bytes(spec, symbols, 0)


def _check_fixed_outputs(spec: ModelSpec) -> None:
    """BadArgument (BAD_DTYPE) if the model has a bytes output: a zero-copy call cannot carry one."""
    carried = [t.name for t in spec.outputs if t.dtype == protocol.BYTES]
    if carried:
        raise BadArgument(ErrorCode.BAD_DTYPE, f"model {spec.name!r} outputs {', '.join(map(repr, carried))} as "
                                               f"bytes: {layout.NO_ZERO_COPY_BYTES}")


def region_limit(info: dict) -> int:
    """The largest region a server makes, from its ``info`` (its max_request_bytes + slack)."""
    limit = info.get("max_request_bytes")
    if type(limit) is not int or limit <= 0:
        raise ShmserveError(ErrorCode.INTERNAL, f"the server's info has no usable max_request_bytes: {limit!r}")
    return limit + protocol.REGION_SLACK


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic); TIMEOUT if none are left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ShmserveError(ErrorCode.TIMEOUT, "no answer in time")
    return left


def _version_of(spec: ModelSpec | None) -> int:
    """The version the server listed ``spec`` for (0: not said): a lane call names it, and a worker
    of another version refuses the call (MODEL_UNAVAILABLE) instead of reading it by the wrong spec."""
    version = spec.extra.get("version") if spec is not None else None
    return version if type(version) is int and 0 < version < 2**32 else 0


def _spec_of(listing: list[dict], model: str) -> ModelSpec | None:
    """The spec the server lists for ``model`` (None: not listed, or listed without inputs)."""
    entry = next((m for m in listing if m["name"] == model and m.get("inputs")), None)
    if entry is None:
        return None
    try:
        return ModelSpec.from_dict(entry)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ShmserveError(ErrorCode.INTERNAL, f"the server's listing of {model!r} is unreadable: {exc!r}") from None


SPEC_RETRIES = 3  # a zero-copy lane call refused for its version: planned again from a fresh spec this often


class _CallPlan(NamedTuple):
    """How one zero-copy call names its tensors to a lane worker of one version (from its spec)."""

    version: int  # the version whose spec planned it (a worker of another refuses the call)
    described: list  # (input index in that spec, offset in the region, view), in the call's order
    outputs: tuple[str, ...]  # the output names by index, as that spec lists them


def _call_plan(model: str, spec: ModelSpec, inputs: dict[str, tuple[int, np.ndarray]], out_capacity: int,
               before: _CallPlan | None) -> _CallPlan:
    """Plan a zero-copy call of ``model`` (``inputs``: name -> (offset, view)) from ``spec``.
    BAD_INPUT for an input the model does not have.  Planned again (``before``: the plan of
    another version) the call is checked as that version's workers will check it, and refused
    with their code (BAD_INPUT, BAD_DTYPE, BAD_SHAPE; OUTPUT_TOO_LARGE if outputs whose sizes the
    inputs fix would not fit ``out_capacity``; BAD_DTYPE for a bytes output), in a message that
    names both versions."""
    names = [t.name for t in spec.inputs]
    version = _version_of(spec)
    try:
        if before is not None:
            _check_fixed_outputs(spec)
            symbols = bind_inputs(spec, [TensorMeta(n, v.dtype.name, v.shape) for n, (_, v) in inputs.items()])
            need = _outputs_need(spec, symbols)
            if need is not None and need > out_capacity:
                raise ShmserveError(ErrorCode.OUTPUT_TOO_LARGE, f"its outputs take {need} bytes for these inputs, "
                                                                f"more than the {out_capacity} this call reserved")
        elif any(n not in names for n in inputs):
            raise ShmserveError(ErrorCode.BAD_INPUT, f"model {model!r} inputs are {names}, got {list(inputs)}")
    except ShmserveError as exc:
        if before is None:
            raise
        raise ShmserveError(exc.code, f"model {model!r} changed from version {before.version} to version "
                                      f"{version}, which refuses this call: {exc.message}; make a new zero_copy "
                                      f"call for it") from None
    return _CallPlan(version, [(names.index(n), offset, view) for n, (offset, view) in inputs.items()],
                     tuple(t.name for t in spec.outputs))


def _outputs_need(spec: ModelSpec, symbols: dict[str, int]) -> int | None:
    """The bytes a worker lays ``spec``'s outputs out in (each 64-byte aligned, in order) when the
    inputs' ``symbols`` fix every output's shape; None if they do not."""
    pos = 0
    for t, shape in zip(spec.outputs, output_shapes(spec.outputs, symbols)):
        if shape is None:
            return None
        pos = layout.align_tensor(pos) + protocol.tensor_nbytes(t.dtype, shape)
    return pos


class _ZeroCopyPlan:
    """Where a zero-copy call of ``model`` goes, shared by both clients (they differ only in how
    they ask the server for a region): a lane of the model when ``lane`` is set and the model
    is known, else a region without one; output capacity from the spec unless given.

    ``region`` is an open region of the planned kind with room for the call, or None: then
    open one of ``region_size`` (with ``lane``) and report it with ``opened``, or the server's
    refusal with ``refused``, until ``region`` is set; then ``place``.

    ``region_limit``: the largest region the server makes (``region_limit``), None while
    unknown; the default region is cut to it, never below what the call needs (a call larger
    than the server allows gets the server's TOO_LARGE, which names the key to raise).
    """

    def __init__(self, spec: ModelSpec | None, lane: str | None, inputs: Mapping[str, tuple],
                 output_capacity: int | None, regions: list[Region], region_limit: int | None = None):
        self.specs, self.sizes = _normalize(inputs)
        if spec is not None:
            _check_fixed_outputs(spec)
        self.output_capacity = _estimate(spec, self.specs)[0] if output_capacity is None else output_capacity
        self.wanted = list(self.sizes.values()) + [self.output_capacity]
        self.lane = lane if spec is not None else None
        self.needed = _needed_bytes(self.sizes, self.output_capacity)
        self.region_limit = region_limit
        self.region_size = self._sized(DEFAULT_REGION_BYTES)  # room for the calls that follow
        self.regions = regions
        self.region = self._region_in()

    def opened(self, region: Region) -> None:
        self.region = region

    def limited(self, region_limit: int) -> int:
        """The server makes regions of at most ``region_limit`` bytes: ask for no more unless the
        call needs more.  Returns ``region_limit`` (the client keeps it for its next plans)."""
        self.region_limit = region_limit
        self.region_size = self._sized(self.region_size)
        return region_limit

    def refused(self, exc: ShmserveError) -> bool:
        """The server refused the region.  Too large while the server's limit is unknown and
        the region is larger than the call needs: returns True, the caller learns the limit
        (``region_limit`` of its ``info``), passes it to ``limited`` and asks again.  Overloaded
        (a region limit of the connection or uid, or a lane whose workers serve all they can):
        first ask for only what this call needs, then for a region without a lane.  Any other
        refusal, or the last, is raised."""
        if exc.code is ErrorCode.TOO_LARGE and self.region_limit is None and self.region_size > self.needed:
            return True
        if exc.code is not ErrorCode.OVERLOADED:
            raise exc
        if self.region_size > self.needed:
            self.region_size = self.needed
        elif self.lane is not None:
            self.lane = None
            self.region = self._region_in()
        else:
            raise exc
        return False

    def place(self) -> tuple:
        """(region, inputs placed, output offset, output capacity): ZeroCopyCall's arguments."""
        placed, out_off = _place(self.region, self.specs, self.sizes, self.output_capacity)
        return self.region, placed, out_off, self.output_capacity

    def _sized(self, size: int) -> int:
        limit = self.region_limit
        return max(self.needed, size if limit is None else min(size, limit))

    def _region_in(self) -> Region | None:
        return _find_region([r for r in self.regions if (r.lane.model if r.lane else None) == self.lane],
                            self.wanted)


# -- Client.infer through a lane (both clients) ---------------------------------------------

SEATS_MAX = 8  # input signatures per lane whose space stays reserved between infer calls


class _Seat:
    """Space in a lane for infer calls of one input signature: each input's view and the output
    area.  ``busy`` while a call uses it; a ``kept`` seat stays reserved for the next call of its
    signature (no allocation per call), any other is released when its call ends."""

    __slots__ = ("region", "views", "described", "out_offset", "out_capacity", "busy", "kept", "_spans")

    def __init__(self, region: "Region", views: list, described: list, out_offset: int, out_capacity: int,
                 spans: list):
        self.region, self.views, self.described = region, views, described
        self.out_offset, self.out_capacity = out_offset, out_capacity
        self.busy = self.kept = False
        self._spans = spans

    @classmethod
    def make(cls, region: "Region", arrays: dict[str, np.ndarray], form: "_LaneForm") -> "_Seat | None":
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

class _LaneForm(NamedTuple):
    """What a lane call of one input signature needs, worked out once per model and signature."""

    name_indices: tuple[int, ...]  # each input's index among the model's inputs, in the caller's order
    sizes: tuple[int, ...]  # each input's bytes
    output_capacity: int
    exact: bool  # reserved as the server would (else a guess: OUTPUT_TOO_LARGE sends the call to the socket)
    needed: int  # the least lane space one call takes
    version: int  # the version whose spec planned it (the worker refuses the call if it serves another)
    outputs: tuple[str, ...]  # the output names by index, as that spec lists them


_NEED_SPEC = object()  # _lane_form: ask the server for the model's spec first
LANE_FORMS_MAX = 256  # signatures remembered per client (then forgotten at once)


def _lane_form(spec: ModelSpec, arrays: dict[str, np.ndarray]) -> _LaneForm | None:
    """How ``arrays`` go through a lane of the model ``spec`` describes; None if they cannot (an
    input the model does not have, a bytes output): then the socket carries the call, and the
    server's answer says what is wrong, as for any other client."""
    names = [t.name for t in spec.inputs]
    if any(t.dtype == protocol.BYTES for t in spec.outputs) or any(n not in names for n in arrays) \
            or len(arrays) + len(spec.outputs) > layout.MAX_TENSORS or any(a.ndim > protocol.MAX_DIMS
                                                                           for a in arrays.values()):
        return None  # (the last two: more than a slot's descriptors hold; the socket says what is wrong)
    specs = {n: (a.shape, a.dtype) for n, a in arrays.items()}
    sizes = {n: a.nbytes for n, a in arrays.items()}
    reserved = spec.extra.get("max_output_bytes")  # what the server reserves per output it cannot size
    if type(reserved) is int and reserved >= 0:
        capacity, exact = _estimate(spec, specs, reserved)[0], True  # OUTPUT_TOO_LARGE is the socket's answer too
    else:
        capacity, exact = _estimate(spec, specs)
    return _LaneForm(tuple(names.index(n) for n in arrays), tuple(sizes.values()), capacity, exact,
                     _needed_bytes(sizes, capacity), _version_of(spec), tuple(t.name for t in spec.outputs))


# -- the clients ----------------------------------------------------------------------------

class _ClientBase:
    """What both clients keep besides their socket: the session, the regions it granted, and
    the model specs zero-copy calls are planned from."""

    def __init__(self, socket_path: str | None, timeout: float, instance: str, lanes: bool,
                 server_uid: int | str | None):
        self.path = resolve_socket(socket_path, None, instance)
        self.trusted = trusted_server_uids(server_uid)  # who may serve us: we check before sending
        self.timeout = check_timeout(timeout)
        # Zero-copy calls go through a lane (a region with its own queue to a worker: no socket
        # round trip) unless this is False (then each call is a descriptor over the socket).
        self.lanes = lanes
        self._session = ClientSession()
        self._regions: list[Region] = []
        self._specs: dict[str, ModelSpec | None] = {}
        self._region_limit: int | None = None  # the server's largest region, learned when one is refused
        self._infer_lanes: dict[str, Region] = {}  # model -> the lane Client.infer uses
        self._lane_forms: dict[tuple, _LaneForm | None] = {}  # (model, signature) -> how it goes through a lane
        self._no_lane_until: dict[str, float] = {}  # model -> monotonic time: until then infer uses the socket
        self._closed = False  # close() was called: no new connection is made
        self._seen_at = 0.0  # when the connection was last seen open (monotonic): lane calls look every LOOK_S

    def _timeout(self, timeout: float | None) -> float:
        """A call's timeout: ``timeout``, else the client's.  BadArgument if out of range."""
        return self.timeout if timeout is None else check_timeout(timeout)

    def _add_region(self, grant: RegionGranted) -> Region:
        region = Region(grant.region, grant.size, grant.fd, grant.lane)
        self._regions.append(region)
        return region

    def _plan(self, model: str, inputs: Mapping[str, tuple], output_capacity: int | None) -> _ZeroCopyPlan:
        infer_lanes = set(map(id, self._infer_lanes.values()))  # infer's own: a zero-copy call's misuse stays out
        return _ZeroCopyPlan(self._specs[model], model if self.lanes else None, inputs, output_capacity,
                             [r for r in self._regions if id(r) not in infer_lanes], self._region_limit)

    def _release(self) -> None:
        """Unmap the regions; the session closes the descriptors it still holds."""
        for region in self._regions:
            region.close()
        self._regions.clear()
        self._infer_lanes.clear()
        self._session.close()

    def _forget_connection(self) -> None:
        """The connection is over: forget what was of it (its regions — zero-copy calls made in them
        fail from now on —, the specs, lanes and limits it told) and start a new session."""
        self._release()
        self._specs.clear()
        self._lane_forms.clear()
        self._no_lane_until.clear()
        self._region_limit = None
        self._session = ClientSession()

    def _reconnect_refused(self, exc: ShmserveError) -> ShmserveError:
        """Connecting again failed with ``exc``: the new session is over too (the next call tries
        again); the error to raise."""
        self._session.fail(exc.message, None if isinstance(exc, ConnectionClosed) else exc.code)
        return exc

    def _retry_unsent(self, exc: OSError, attempt: int) -> bool:
        """Whether a request whose send failed with ``exc`` is sent again on a new connection: not one
        byte of it went (the connection was over before this call: it never reached the server),
        the server left no reason (``ConnectionFailed.code``), and it is the first attempt."""
        failure = self._session.failure
        return not getattr(exc, "sent", True) and attempt == 0 and not self._closed and \
            (failure is None or failure.code is None)

    # -- Client.infer through a lane: the steps both clients take, around their own I/O -------

    def _lane_wanted(self, model: str, inputs: Mapping[str, np.ndarray], version, key):
        """(arrays, form) for an ``infer`` call that may go through a lane, ``_NEED_SPEC`` if the
        model's spec must be fetched first, or None: the socket carries it (lanes off, a version
        or routing key given, the lane refused lately, a bytes or unsupported tensor, an input
        the model does not have).  The lane serves the model's default version, as the socket
        does; while a canary or shadow runs the front-end asks for the socket (``routable``)."""
        if not self.lanes or version is not None or key is not None:
            return None
        until = self._no_lane_until.get(model)
        if until is not None:
            if time.monotonic() < until:
                return None
            del self._no_lane_until[model]
            self._forget_spec(model)  # ask again: a model loaded meanwhile has a spec now, a new version another
        if model not in self._specs:
            return _NEED_SPEC
        spec = self._specs[model]
        if spec is None:
            self._no_lane_until[model] = time.monotonic() + LANE_RETRY_S
            return None
        arrays = {}
        for name, value in inputs.items():
            a = np.ascontiguousarray(value)
            if a.dtype not in FIXED_DTYPES:
                return None  # bytes or unsupported: the socket path serializes or refuses it
            arrays[name] = a
        signature = (model, tuple((n, a.dtype, a.shape) for n, a in arrays.items()))
        form = self._lane_forms.get(signature, _NEED_SPEC)
        if form is _NEED_SPEC:
            if len(self._lane_forms) >= LANE_FORMS_MAX:
                self._lane_forms.clear()
            form = self._lane_forms[signature] = _lane_form(spec, arrays)
        return None if form is None else (arrays, form, signature)

    def _spec_read(self, model: str, listing: list[dict]) -> ModelSpec | None:
        """Keep the spec ``listing`` (``models()``) gives ``model``; if it is of another version than
        the one kept, what was planned from the old one goes first (``_forget_spec``)."""
        spec = _spec_of(listing, model)
        if model in self._specs and _version_of(self._specs[model]) != _version_of(spec):
            self._forget_spec(model)
        self._specs[model] = spec
        return spec

    def _forget_spec(self, model: str) -> None:
        """Drop what was planned from ``model``'s spec (its spec, its lane forms, the space kept in
        its infer lane for them): the next call asks the server for the spec again."""
        self._specs.pop(model, None)
        for signature in [sig for sig in self._lane_forms if sig[0] == model]:
            del self._lane_forms[signature]
        region = self._infer_lanes.get(model)
        if region is not None:
            region.drop_seats()

    def _lane_size(self, form: _LaneForm) -> int | None:
        """The size to open a model's infer lane with: room for many calls, within the server's
        largest region; None if even this call is larger than that (the socket says TOO_LARGE)."""
        limit = self._region_limit
        if limit is not None and form.needed > limit:
            return None
        return max(form.needed, DEFAULT_REGION_BYTES if limit is None else min(DEFAULT_REGION_BYTES, limit))

    def _lane_refused(self, model: str, exc: ShmserveError) -> None:
        """The server would not open a lane of ``model`` (its limits, no version serving now): infer
        goes over the socket for LANE_RETRY_S.  A lost connection is raised."""
        if isinstance(exc, ConnectionClosed):
            raise exc
        self._no_lane_until[model] = time.monotonic() + LANE_RETRY_S

    def _lane_start(self, region: Region, arrays: dict[str, np.ndarray], form: _LaneForm, signature: tuple):
        """Copy ``arrays`` into the lane and submit the call: (seat, slot, generation), or None if
        the lane cannot take it now (no worker serves it, the front-end diverts its model, all
        its slots or its space are taken): then the socket carries it."""
        if region.abandoned:
            region.reclaim()
        lane = region.lane
        if lane is None or not lane.routable() or not lane.has_free_slot():
            return None
        seat = region.seat(signature, arrays, form)
        if seat is None:
            return None
        seat.busy = True
        try:
            for view, a in zip(seat.views, arrays.values()):
                view[...] = a  # the one copy the socket path makes too (there: into the server's arena)
            index, generation = lane.submit(self._session.reserve_id(), form.version, seat.described,
                                            seat.out_offset, seat.out_capacity)
        except BaseException:
            seat.release()
            raise
        return seat, index, generation

    def _lane_answer(self, model: str, started: tuple, form: _LaneForm, failure: BaseException | None = None):
        """The outputs of a lane call that finished (new arrays), or None if the socket should
        carry it after all: the lane lost its version (MODEL_UNAVAILABLE: the socket path loads
        it again or says why) or the outputs outgrew a guessed capacity.  ``failure``: waiting
        for it failed (a timeout keeps its space until the worker is done with it); raised."""
        seat, index, generation = started
        lane = seat.region.lane
        if failure is not None:
            if lane is not None and not lane.finished(index, generation):
                # Timed out, interrupted or cancelled: the worker may still write its outputs there.
                lane.abandon(index, generation)
                seat.region.defer_release(seat, index, generation)
                raise failure
            if lane is None:
                seat.release()
                raise failure
            # (it finished as the wait was interrupted: read it, so that its slot is freed)
        try:
            placed = lane.read(index, generation, seat.out_offset, seat.out_capacity)
            if failure is not None:
                raise failure
            buf, names = seat.region.buf, form.outputs
            # New arrays the caller owns, copied out of the lane (as the socket path's are new).
            return {names[name_index]: np.ndarray(shape, dtype, buffer=buf, offset=offset).copy()
                    for name_index, (dtype, shape, offset) in sorted(placed.items())}
        except ShmserveError as exc:
            if exc is failure:
                raise
            if lanes.version_moved(exc):
                # The lane's version changed under the spec this call was planned from, and nothing
                # of it ran: the socket answers this one, the next asks for the spec again.
                self._forget_spec(model)
                return None
            if exc.code is ErrorCode.MODEL_UNAVAILABLE:
                self._forget_spec(model)  # (it ran: its error is the answer; the next call asks again)
            if exc.code is ErrorCode.OUTPUT_TOO_LARGE and not form.exact:
                return None
            raise
        finally:
            seat.release()


class Client(_ClientBase):
    """A blocking connection to a shmserve server.

    ``socket``: the server's socket path (default: $SHMSERVE_SOCKET, else the
    runtime-directory default for ``instance``).  ``timeout``: default
    seconds per request, enforced by the server (and by this client with a
    grace period should the server not answer at all: the connection is then
    given up).  ``server_uid``: a uid (or user name) trusted to serve, besides
    our own and root (default: $SHMSERVE_SERVER_UID).  ConnectionClosed if no
    server listens there; ShmserveError PERMISSION_DENIED if another uid does
    (nothing is sent to it); ValueError for a ``server_uid`` that is no user.
    Arguments are checked here, before anything is sent: a timeout that is not in
    (0, 86400] s, or a zero-copy input's unsupported dtype or malformed shape, raise
    ``BadArgument`` (a ShmserveError and a ValueError).
    """

    def __init__(self, socket_path: str | None = None, *, timeout: float = 60.0, instance: str = DEFAULT_INSTANCE,
                 spin_us: int | None = None, lanes: bool = True, server_uid: int | str | None = None):
        super().__init__(socket_path, timeout, instance, lanes, server_uid)
        # Poll for the answer this long before sleeping in recv (None: by core count; 0: never).
        # Lane calls follow the server's hint instead unless spin_us is given.
        self.spin_s = (spin_default_us(client=True) if spin_us is None else spin_us) / 1e6
        self._lane_spin_s = None if spin_us is None else spin_us / 1e6
        self._sock = self._connect()

    def _connect(self) -> socket.socket:
        """A connected socket to a trusted server; ConnectionClosed if none listens,
        PERMISSION_DENIED if another uid serves it."""
        sock = _unix_socket()
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise _no_server(self.path, exc) from None
        _check_server(sock, self.path, self.trusted)
        self._seen_at = time.monotonic()
        return sock

    def _ensure_connected(self) -> None:
        """Before a call: if the connection is over (the server closed it, went away — seen now if it
        was not seen open within LOOK_S —, or a call gave up on it), a new one, with a new session;
        ConnectionClosed if no server listens now (the next call tries again), or if this client
        was closed."""
        self._look_if_due()
        if self._session.failure is None:
            return
        if self._closed:
            self._session.ensure_open()
        self._sock.close()
        self._forget_connection()
        try:
            self._sock = self._connect()
        except ShmserveError as exc:
            raise self._reconnect_refused(exc) from None

    def _look_if_due(self) -> None:
        """If the connection was not seen open within LOOK_S, look (``_check_alive``) and mark it over
        if the server closed it: a call through a lane touches no socket, so a server that went
        away while this client was idle is noticed here, before the call is placed in a dead lane."""
        if self._session.failure is None and time.monotonic() - self._seen_at > LOOK_S:
            try:
                self._check_alive()
            except ShmserveError:
                pass  # the session is over now: the caller connects again

    # -- public API -----------------------------------------------------------------------

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], *, timeout: float | None = None,
              version: int | None = None, key: str | None = None) -> dict[str, np.ndarray]:
        """Run ``model`` on ``inputs`` (name -> array); returns name -> array (new arrays).
        ``version``: that version of the model (default: the model's default version); ``key``: a
        routing key — while a canary runs, requests with the same key reach the same version.

        With ``lanes`` (the default) the call goes through a lane of ``model`` the client opens
        on first use (a region with its own queue to a worker: the inputs are copied into it,
        the outputs copied out, and nothing crosses the socket); over the socket instead when
        the lane cannot take it (given a ``version`` or ``key``, a bytes tensor, a request larger
        than the lane, all its slots busy, a canary running, the lane refused by the server).
        Either way the same errors, with the same codes."""
        seconds = self._timeout(timeout)
        self._ensure_connected()
        wanted = self._lane_wanted(model, inputs, version, key)
        if wanted is _NEED_SPEC:
            self._specs[model] = _spec_of(self.models(), model)
            wanted = self._lane_wanted(model, inputs, version, key)
        if wanted is not None:
            deadline = time.monotonic() + seconds
            outputs = self._lane_infer(model, *wanted, seconds)
            if outputs is not None:
                return outputs
            seconds = _left(deadline)  # the socket gets what the lane left of the timeout
        return self._exchange(lambda session: session.infer(model, inputs, seconds, version, key), seconds).outputs

    def _lane_infer(self, model: str, arrays: dict, form: _LaneForm, signature: tuple,
                    seconds: float) -> dict | None:
        region = self._infer_lanes.get(model)
        if region is None:
            region = self._open_infer_lane(model, form)
            if region is None:
                return None
        started = self._lane_start(region, arrays, form, signature)
        if started is None:
            return None
        _, index, generation = started
        try:
            region.lane.wait(index, generation, time.monotonic() + seconds, self._lane_spin_s, self._check_alive)
        except BaseException as exc:
            return self._lane_answer(model, started, form, exc)
        return self._lane_answer(model, started, form)

    def _open_infer_lane(self, model: str, form: _LaneForm) -> Region | None:
        size = self._lane_size(form)
        try:
            while size is not None:
                try:
                    region = self._infer_lanes[model] = self.open_region(size, lane=model)
                    return region
                except ShmserveError as exc:
                    if exc.code is not ErrorCode.TOO_LARGE or self._region_limit is not None:
                        raise
                    self._region_limit = region_limit(self.info())
                    size = self._lane_size(form)
        except ShmserveError as exc:
            self._lane_refused(model, exc)
        return None

    def models(self) -> list[dict]:
        """The served models: name, backend, inputs and outputs (name, dtype, shape), and more."""
        return self._exchange(lambda session: session.models()).value

    def health(self) -> dict:
        """The server's health: ``status`` (ok, degraded, shutting_down) and each model's workers."""
        return self._exchange(lambda session: session.health()).value

    def info(self) -> dict:
        """What the server runs: version, instance, arena, limits, statistics, lanes and workers."""
        return self._exchange(lambda session: session.info()).value

    # -- the model lifecycle (docs/models.md); all but ``repository`` need an admin uid --

    def repository(self) -> dict:
        """Every model and version with its state (loading, ready, draining, unavailable, evicted,
        unloaded) and reason, the defaults, canaries and recent lifecycle events."""
        return self._exchange(lambda session: session.repository()).value

    def load(self, model: str, *, version: int | None = None, instances: int | None = None, keep: bool = False,
             timeout: float | None = None) -> dict:
        """Load ``version`` of ``model`` (default: the newest its policy selects), warm it and make
        it the default; the one serving before drains and is unloaded unless ``keep``.  Waits
        for all of it (``timeout``: default ``LIFECYCLE_TIMEOUT_S``, 900 s).  ShmserveError: PERMISSION_DENIED,
        UNKNOWN_MODEL, MODEL_UNAVAILABLE (it did not load: why; the old one still serves), ..."""
        return self._control(Kind.LOAD, model, timeout, version=version, instances=instances, keep=keep or None)

    def unload(self, model: str, *, version: int | None = None, timeout: float | None = None) -> dict:
        """Drain and unload ``version`` of ``model`` (default: all of them)."""
        return self._control(Kind.UNLOAD, model, timeout, version=version)

    def scale(self, model: str, instances: int, *, version: int | None = None, timeout: float | None = None) -> dict:
        """Run ``instances`` workers for ``model``'s default version (or ``version``)."""
        return self._control(Kind.SCALE, model, timeout, version=version, instances=instances)

    def canary(self, model: str, action: str, *, version: int | None = None, plan: dict | None = None,
               timeout: float | None = None) -> dict:
        """``start`` a canary of ``version`` under ``plan`` (``canary.CanaryPlan`` fields), or
        ``promote``, ``abort`` it, or get its ``status``; the rollout's snapshot."""
        return self._control(Kind.CANARY, model, timeout, action=action, version=version, plan=plan)

    def _control(self, kind: Kind, model: str, timeout: float | None, **fields) -> dict:
        timeout = LIFECYCLE_TIMEOUT_S if timeout is None else timeout
        return self._exchange(lambda session: session.lifecycle(kind, model, **fields), timeout).value

    def open_region(self, size: int, *, lane: str | None = None) -> Region:
        """Ask the server for ``size`` bytes of shared memory for zero-copy calls on this connection.

        ``lane``: a model name; the region then also carries a queue to one of that model's
        workers, and zero-copy calls placed in it do not touch the socket."""
        return self._add_region(self._exchange(lambda session: session.open_region(size, lane)))

    def zero_copy(self, model: str, inputs: Mapping[str, tuple], *, output_capacity: int | None = None) -> ZeroCopyCall:
        """Reserve region space for one call of ``model``.

        ``inputs`` maps input names to ``(shape, dtype)``; the returned call's
        ``inputs`` are writable numpy views of that space.  Outputs get
        ``output_capacity`` bytes (default: computed from the model's spec
        where its output shapes follow from the inputs, else 16 MiB).  With
        ``lanes`` (the default) the space is in a lane of ``model``.
        """
        self._ensure_connected()
        if model not in self._specs:
            self._specs[model] = _spec_of(self.models(), model)
        plan = self._plan(model, inputs, output_capacity)
        while plan.region is None:
            try:
                plan.opened(self.open_region(plan.region_size, lane=plan.lane))
            except ShmserveError as exc:
                if plan.refused(exc):
                    self._region_limit = plan.limited(region_limit(self.info()))
        return ZeroCopyCall(self, model, *plan.place())

    def close(self) -> None:
        self._closed = True
        self._release()
        self._sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the pump -------------------------------------------------------------------------

    def _exchange(self, build, timeout: float | None = None):
        """Send the request ``build(session)`` makes (its id and parts) and return the event answering
        it; raises the request's error, or the connection's.  On a connection that is over it
        is made on a new one first (``_ensure_connected``), and so is one not a byte of which
        could be sent (``_retry_unsent``): either way it never reached the server."""
        self._ensure_connected()
        for attempt in (0, 1):
            rid, parts = build(self._session)
            try:
                self._send(parts)
                break
            except OSError as exc:
                try:  # the server may have said why before it closed (e.g. permission_denied): report that
                    self._receive(rid, time.monotonic() + 1.0)
                except ConnectionClosed:
                    if not self._retry_unsent(exc, attempt):
                        raise
                else:
                    raise self._fail(f"connection to {self.path} lost while sending: {exc}") from None
                self._ensure_connected()
        return self._receive(rid, time.monotonic() + self._timeout(timeout) + ANSWER_GRACE_S)

    def _send(self, parts: list) -> None:
        """Send every part; OSError if the socket refuses, its ``sent`` saying whether any byte went."""
        sent = False
        try:
            while parts:
                _sent(parts, self._sock.sendmsg(parts[:MAX_IOV]))
                sent = True
        except OSError as exc:
            exc.sent = sent
            raise

    def _receive(self, rid: int, deadline: float):
        session = self._session
        while True:
            event = session.next_event()
            if event is NEED_DATA:
                self._read(deadline)
            elif event.request_id != rid:
                if type(event) is ConnectionFailed:
                    raise event.error
                session.discard(event)  # the answer to a call interrupted earlier
            elif type(event) is RequestFailed:
                raise event.error
            else:
                return event

    def _read(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._fail("no answer from the server in time", ErrorCode.TIMEOUT)
        buffers = [self._session.read_buffer()]
        try:
            got = self._poll_read(buffers) if self.spin_s > 0 else None
            if got is None:
                self._sock.settimeout(remaining)
                got = self._sock.recvmsg_into(buffers, _FD_SPACE)
            n, ancdata, _, _ = got
        except socket.timeout:
            raise self._fail("no answer from the server in time", ErrorCode.TIMEOUT) from None
        except OSError as exc:
            raise self._fail(f"connection to {self.path} lost: {exc}") from None
        if ancdata:
            self._session.receive_fds(_passed_fds(ancdata))
        if n == 0:
            raise self._fail(_closed_message(self.path))
        self._seen_at = time.monotonic()
        self._session.read_done(n)

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
        self._session.ensure_open()
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            if readable and self._sock.recv(1, socket.MSG_PEEK) == b"":
                raise self._fail(_closed_message(self.path))
        except OSError as exc:
            raise self._fail(f"connection to {self.path} lost: {exc}") from None
        self._seen_at = time.monotonic()

    def _fail(self, message: str, code: ErrorCode | None = None) -> ShmserveError:
        """The connection is over (the first reason stands): the error to raise."""
        return self._session.fail(message, code).error


class AsyncClient(_ClientBase):
    """The asyncio client: ``async with AsyncClient(path) as c: await c.infer(...)``.

    Several requests may be in flight at once on one connection; answers are
    matched by id.  ``zero_copy`` works as in ``Client`` (``await call.run()``);
    ``server_uid`` and the check of who serves, as in ``Client`` (at ``connect``).
    """

    def __init__(self, socket_path: str | None = None, *, timeout: float = 60.0, instance: str = DEFAULT_INSTANCE,
                 lanes: bool = True, server_uid: int | str | None = None):
        super().__init__(socket_path, timeout, instance, lanes, server_uid)
        self._watchers: dict[int, LaneWatcher] = {}  # lane region id -> its completion watcher
        self._waiters: dict[int, asyncio.Future] = {}  # request id -> its caller
        self._send_lock = asyncio.Lock()  # frames of concurrent calls must not interleave
        self._reader_task: asyncio.Task | None = None
        self._sock: socket.socket | None = None
        self._opening: set[str] = set()  # models whose infer lane is being opened
        self._connecting: asyncio.Lock | None = None  # one new connection at a time (made in the loop)

    async def connect(self) -> "AsyncClient":
        """Connect and start reading answers; ConnectionClosed if no server listens."""
        loop = asyncio.get_running_loop()
        sock = _unix_socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self.path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise _no_server(self.path, exc) from None
        _check_server(sock, self.path, self.trusted)
        self._sock = sock
        self._seen_at = time.monotonic()
        self._reader_task = loop.create_task(self._reader())
        return self

    async def _ensure_connected(self) -> None:
        """As ``Client._ensure_connected`` (the reader task sees most closes first; concurrent callers
        share one new connection)."""
        self._look_if_due()
        if self._session.failure is None:
            return
        if self._closed:
            self._session.ensure_open()
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._session.failure is None:
                return  # another call connected again meanwhile
            await self._stop_reading()
            for watcher in self._watchers.values():
                watcher.stop()  # before the lanes' memory is unmapped
            self._watchers.clear()
            self._forget_connection()
            try:
                await self.connect()
            except ShmserveError as exc:
                raise self._reconnect_refused(exc) from None

    def _look_if_due(self) -> None:
        """As ``Client._look_if_due``: a peek at the socket if it was not seen open within LOOK_S."""
        sock = self._sock
        if sock is None or self._session.failure is not None or time.monotonic() - self._seen_at <= LOOK_S:
            return
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable and sock.recv(1, socket.MSG_PEEK) == b"":
                self._fail_all(self._session.fail(_closed_message(self.path)))
                return
        except OSError as exc:
            self._fail_all(self._session.fail(f"connection to {self.path} lost: {exc}"))
            return
        self._seen_at = time.monotonic()

    async def _stop_reading(self) -> None:
        """Stop the reader task and close the socket (idempotent)."""
        task, self._reader_task = self._reader_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        await self._stop_reading()
        self._fail_all(self._session.fail("client closed"))
        for watcher in self._watchers.values():
            watcher.stop()  # before the lanes' memory is unmapped
        self._watchers.clear()
        self._release()

    # -- public API (as Client's) ---------------------------------------------------------

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray], *, timeout: float | None = None,
                    version: int | None = None, key: str | None = None) -> dict[str, np.ndarray]:
        """As ``Client.infer``: through a lane of ``model`` when it can take the call (several
        calls may be in it at once), else over the socket."""
        seconds = self._timeout(timeout)
        await self._ensure_connected()
        wanted = self._lane_wanted(model, inputs, version, key)
        if wanted is _NEED_SPEC:
            spec = _spec_of(await self.models(), model)
            self._specs.setdefault(model, spec)  # (another call may have fetched it meanwhile)
            wanted = self._lane_wanted(model, inputs, version, key)
        if wanted is not None and wanted is not _NEED_SPEC:
            deadline = time.monotonic() + seconds
            outputs = await self._lane_infer(model, *wanted, seconds)
            if outputs is not None:
                return outputs
            seconds = _left(deadline)  # the socket gets what the lane left of the timeout
        return (await self._exchange(lambda session: session.infer(model, inputs, seconds, version, key), seconds)).outputs

    async def _lane_infer(self, model: str, arrays: dict, form: _LaneForm, signature: tuple,
                          seconds: float) -> dict | None:
        region = self._infer_lanes.get(model)
        if region is None:
            if model in self._opening:
                return None  # another call is opening it: this one goes over the socket
            self._opening.add(model)
            try:
                region = await self._open_infer_lane(model, form)
            finally:
                self._opening.discard(model)
            if region is None:
                return None
        started = self._lane_start(region, arrays, form, signature)
        if started is None:
            return None
        _, index, generation = started
        try:
            await self._lane_watcher(region).wait(index, generation, seconds)
        except BaseException as exc:
            return self._lane_answer(model, started, form, exc)
        return self._lane_answer(model, started, form)

    async def _open_infer_lane(self, model: str, form: _LaneForm) -> Region | None:
        size = self._lane_size(form)
        try:
            while size is not None:
                try:
                    region = self._infer_lanes[model] = await self.open_region(size, lane=model)
                    return region
                except ShmserveError as exc:
                    if exc.code is not ErrorCode.TOO_LARGE or self._region_limit is not None:
                        raise
                    self._region_limit = region_limit(await self.info())
                    size = self._lane_size(form)
        except ShmserveError as exc:
            self._lane_refused(model, exc)
        return None

    async def models(self) -> list[dict]:
        return (await self._exchange(lambda session: session.models())).value

    async def health(self) -> dict:
        return (await self._exchange(lambda session: session.health())).value

    async def info(self) -> dict:
        return (await self._exchange(lambda session: session.info())).value

    async def repository(self) -> dict:
        return (await self._exchange(lambda session: session.repository())).value

    async def load(self, model: str, *, version: int | None = None, instances: int | None = None, keep: bool = False,
                   timeout: float | None = None) -> dict:
        return await self._control(Kind.LOAD, model, timeout, version=version, instances=instances, keep=keep or None)

    async def unload(self, model: str, *, version: int | None = None, timeout: float | None = None) -> dict:
        return await self._control(Kind.UNLOAD, model, timeout, version=version)

    async def scale(self, model: str, instances: int, *, version: int | None = None,
                    timeout: float | None = None) -> dict:
        return await self._control(Kind.SCALE, model, timeout, version=version, instances=instances)

    async def canary(self, model: str, action: str, *, version: int | None = None, plan: dict | None = None,
                     timeout: float | None = None) -> dict:
        return await self._control(Kind.CANARY, model, timeout, action=action, version=version, plan=plan)

    async def _control(self, kind: Kind, model: str, timeout: float | None, **fields) -> dict:
        timeout = LIFECYCLE_TIMEOUT_S if timeout is None else timeout
        return (await self._exchange(lambda session: session.lifecycle(kind, model, **fields), timeout)).value

    async def open_region(self, size: int, *, lane: str | None = None) -> Region:
        """As ``Client.open_region``."""
        return self._add_region(await self._exchange(lambda session: session.open_region(size, lane)))

    async def zero_copy(self, model: str, inputs: Mapping[str, tuple], *,
                        output_capacity: int | None = None) -> AsyncZeroCopyCall:
        """As ``Client.zero_copy``; ``async with await c.zero_copy(...) as call: await call.run()``.
        Lane calls wake the loop through a watcher thread per lane (a loop cannot wait on a futex)."""
        await self._ensure_connected()
        if model not in self._specs:
            self._specs[model] = _spec_of(await self.models(), model)
        plan = self._plan(model, inputs, output_capacity)
        while plan.region is None:
            try:
                plan.opened(await self.open_region(plan.region_size, lane=plan.lane))
            except ShmserveError as exc:
                if plan.refused(exc):
                    self._region_limit = plan.limited(region_limit(await self.info()))
        return AsyncZeroCopyCall(self, model, *plan.place())

    # -- the pump -------------------------------------------------------------------------

    def _lane_watcher(self, region: Region) -> LaneWatcher:
        self._session.ensure_open()
        watcher = self._watchers.get(region.id)
        if watcher is None:
            watcher = self._watchers[region.id] = LaneWatcher(region.lane, asyncio.get_running_loop())
        return watcher

    async def _exchange(self, build, timeout: float | None = None):
        """As ``Client._exchange`` (a new connection first if this one is over, or if not a byte of
        the request could be sent); the reader task settles the future by request id.  TIMEOUT
        after the timeout and grace (the connection goes on; a late answer is dropped)."""
        await self._ensure_connected()
        for attempt in (0, 1):
            rid, parts = build(self._session)
            future = asyncio.get_running_loop().create_future()
            self._waiters[rid] = future
            unsent = False
            try:
                async with self._send_lock:
                    try:
                        await self._send(parts)
                    except OSError as exc:
                        if self._retry_unsent(exc, attempt):
                            unsent = self._waiters.pop(rid, None) is not None  # sent again below, not failed
                        self._fail_all(self._session.fail(f"connection to {self.path} lost while sending: {exc}"))
                if not unsent:
                    try:
                        return await asyncio.wait_for(future, self._timeout(timeout) + ANSWER_GRACE_S)
                    except asyncio.TimeoutError:
                        raise ShmserveError(ErrorCode.TIMEOUT, "no answer from the server in time") from None
            finally:
                self._waiters.pop(rid, None)
            await self._ensure_connected()  # it never reached the server: again, on a new connection

    async def _send(self, parts: list) -> None:
        """Send every part; OSError if the socket refuses, its ``sent`` saying whether any byte went."""
        loop, sent = asyncio.get_running_loop(), False
        try:
            while parts:
                if self._sock is None:
                    raise ConnectionResetError("the connection is closed")
                try:
                    _sent(parts, self._sock.sendmsg(parts[:MAX_IOV]))
                    sent = True
                except BlockingIOError:
                    await self._ready(loop.add_writer, loop.remove_writer)
        except OSError as exc:
            exc.sent = sent
            raise

    async def _reader(self) -> None:
        """Read answers until the connection ends; settle each caller's future."""
        session = self._session
        try:
            while True:
                event = session.next_event()
                if event is NEED_DATA:
                    n = await self._recv_into(session.read_buffer())
                    if n == 0:
                        raise ConnectionError(_closed_message(self.path))
                    self._seen_at = time.monotonic()
                    session.read_done(n)
                    continue
                if type(event) is ConnectionFailed:
                    self._fail_all(event)
                    return
                future = self._waiters.get(event.request_id)
                if future is None or future.done():
                    session.discard(event)  # its caller timed out or was cancelled
                elif type(event) is RequestFailed:
                    future.set_exception(event.error)
                else:
                    future.set_result(event)
        except (ConnectionError, OSError) as exc:
            self._fail_all(session.fail(str(exc)))
        except Exception as exc:  # a bug here: fail the callers now rather than at their timeouts
            self._fail_all(session.fail(f"the client stopped reading: {exc!r}"))
            raise

    async def _recv_into(self, buffer) -> int:
        """recvmsg_into on the non-blocking socket, handing any descriptors to the session."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                n, ancdata, _, _ = self._sock.recvmsg_into([buffer], _FD_SPACE)
            except BlockingIOError:
                await self._ready(loop.add_reader, loop.remove_reader)
                continue
            if ancdata:
                self._session.receive_fds(_passed_fds(ancdata))
            return n

    async def _ready(self, add, remove) -> None:
        """Until the socket is readable (``loop.add_reader``) or writable (``loop.add_writer``)."""
        fd = self._sock.fileno()
        ready = asyncio.get_running_loop().create_future()
        add(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            remove(fd)

    def _fail_all(self, failure: ConnectionFailed) -> None:
        for watcher in self._watchers.values():  # lane calls in flight: the server is gone
            watcher.fail(ConnectionClosed(failure.message))
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(failure.error)
