"""The asyncio client: ``AsyncClient`` (its public face) over ``AsyncPump`` (its I/O).

Owns: the asyncio I/O of one connection at a time: several requests in
flight on it (frames sent whole under a lock; one reader task settles each
caller's future by request id), lane completions woken into the loop by a
``LaneWatcher`` thread per lane (a loop cannot wait on a futex), and a new
connection when one is over (concurrent callers share it).
``AsyncPump.run`` and ``AsyncPump.perform`` are ``BlockingPump``'s, awaiting
where it blocks; what to send, to wait for, or to make of an answer is the
core's (``shmserve.client.core``, ``infer``, ``zerocopy``).

Must not: decide anything about a request (the steps do), or parse or build
frames (the session does).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import GeneratorType
from typing import Mapping

import numpy as np

from shmserve.client.core import ClientCore, ClientFace
from shmserve.client.infer import InferOperation
from shmserve.client.memory import Region
from shmserve.client.pump import ANSWER_GRACE_S, FD_SPACE, LOOK_S, MAX_IOV, Pump, check_server_socket, \
    closed_message, no_server, passed_fds, sent, unix_socket
from shmserve.client.steps import Exchange
from shmserve.client.zerocopy import AsyncZeroCopyCall
from shmserve.config import DEFAULT_INSTANCE
from shmserve.errors import ConnectionClosed, ErrorCode, ShmserveError
from shmserve.lanes import WAIT_SLICE_S, ClientLane
from shmserve.protocol import Kind
from shmserve.session import NEED_DATA, ConnectionFailed, RequestFailed

_monotonic = time.monotonic


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


class AsyncPump(Pump):
    """The asyncio I/O of ``core``'s connection (see the module); ``connect`` makes it."""

    def __init__(self, core: ClientCore):
        super().__init__(core)
        self.watchers: dict[int, LaneWatcher] = {}  # lane region id -> its completion watcher
        self.waiters: dict[int, asyncio.Future] = {}  # request id -> its caller
        self.send_lock = asyncio.Lock()  # frames of concurrent calls must not interleave
        self.reader_task: asyncio.Task | None = None
        self.connecting: asyncio.Lock | None = None  # one new connection at a time (made in the loop)
        self.cancels: set[asyncio.Task] = set()  # CANCEL frames being sent (``give_up``)

    # -- carrying out the core's steps (as BlockingPump's, awaiting where it blocks) -----------

    async def perform(self, op, args: tuple):
        """As ``BlockingPump.perform``."""
        if _monotonic() - self.seen_at > LOOK_S:  # (look_if_due asks again: this spares a call per call)
            self.look_if_due()
        call = op.begin(args)
        kind = type(call)
        if kind is tuple:
            try:  # (wait_lane, written out: a call fewer on the hot path)
                await self.lane_watcher(call[0]).wait(call[1], call[2], max(0.0, call[3] - _monotonic()))
            except BaseException as exc:
                call = op.answer(call, exc)
            else:
                call = op.answer(call, None)
            kind = type(call)
            if kind is dict:  # the result
                return call
        if kind is Exchange:  # the one request that ends it
            build, timeout = call
            return op.answered(await self.exchange(build, timeout))
        return await self.run(call)

    async def run(self, steps):
        """As ``BlockingPump.run``."""
        send, answer = steps.send, None
        while True:
            try:
                step = send(answer)
            except StopIteration as done:
                return done.value
            send = steps.send
            try:
                answer = await self.carry_out(step)
            except BaseException as exc:
                answer, send = exc, steps.throw

    async def wait_lane(self, call: tuple) -> None:
        """As ``BlockingPump.wait_lane`` (its watcher wakes the loop)."""
        await self.lane_watcher(call[0]).wait(call[1], call[2], max(0.0, call[3] - _monotonic()))

    def lane_watcher(self, region: Region) -> LaneWatcher:
        self.core.session.ensure_open()
        watcher = self.watchers.get(region.id)
        if watcher is None:
            watcher = self.watchers[region.id] = LaneWatcher(region.lane, asyncio.get_running_loop())
        return watcher

    # -- the connection ---------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect and start reading answers; ConnectionClosed if no server listens."""
        loop = asyncio.get_running_loop()
        path = self.core.path
        sock = unix_socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise no_server(path, exc) from None
        check_server_socket(sock, path, self.core.trusted)
        self.sock = sock
        self.seen_at = _monotonic()
        self.reader_task = loop.create_task(self.reader())

    async def ensure_connected(self) -> None:
        """As ``BlockingPump.ensure_connected`` (the reader task sees most closes first; concurrent
        callers share one new connection)."""
        self.look_if_due()
        core = self.core
        if not core.connection_over():
            return
        if self.connecting is None:
            self.connecting = asyncio.Lock()
        async with self.connecting:
            if core.session.failure is None:
                return  # another call connected again meanwhile
            await self.stop_reading()
            self.stop_watchers()
            core.forget_connection()
            try:
                await self.connect()
            except ShmserveError as exc:
                raise core.reconnect_refused(exc) from None

    async def stop_reading(self) -> None:
        """Stop the reader task and close the socket (idempotent)."""
        task, self.reader_task = self.reader_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def stop_watchers(self) -> None:
        for watcher in self.watchers.values():
            watcher.stop()  # before the lanes' memory is unmapped
        self.watchers.clear()

    async def close(self) -> None:
        self.core.closed = True
        await self.stop_reading()
        self.fail("client closed")
        self.stop_watchers()
        self.core.close()

    def fail(self, message: str, code: ErrorCode | None = None) -> ShmserveError:
        """The connection is over (the first reason stands): every caller waiting fails (calls
        through lanes with ConnectionClosed); the error to raise."""
        failure = self.core.session.fail(message, code)
        self.fail_all(failure)
        return failure.error

    def fail_all(self, failure: ConnectionFailed) -> None:
        for watcher in self.watchers.values():  # lane calls in flight: the server is gone
            watcher.fail(ConnectionClosed(failure.message))
        for future in self.waiters.values():
            if not future.done():
                future.set_exception(failure.error)

    # -- requests ---------------------------------------------------------------------------

    async def exchange(self, build, timeout: float | None = None):
        """As ``BlockingPump.exchange`` (a new connection first if this one is over, or if not a
        byte of the request could be sent); the reader task settles the future by request id.
        TIMEOUT after the timeout and grace (the connection goes on; a late answer is dropped)."""
        await self.ensure_connected()
        core = self.core
        for attempt in (0, 1):
            session = core.session
            rid, parts = build(session)
            future = asyncio.get_running_loop().create_future()
            self.waiters[rid] = future
            unsent = False
            try:
                async with self.send_lock:
                    try:
                        await self.send(parts)
                    except OSError as exc:
                        if core.retry_unsent(exc, attempt):
                            unsent = self.waiters.pop(rid, None) is not None  # sent again below, not failed
                        self.fail(f"connection to {core.path} lost while sending: {exc}")
                if not unsent:
                    try:
                        return await asyncio.wait_for(future, core.timeout_of(timeout) + ANSWER_GRACE_S)
                    except asyncio.TimeoutError:
                        self.give_up(rid, session)
                        raise ShmserveError(ErrorCode.TIMEOUT, "no answer from the server in time") from None
                    except asyncio.CancelledError:
                        self.give_up(rid, session)
                        raise
            finally:
                self.waiters.pop(rid, None)
            await self.ensure_connected()  # it never reached the server: again, on a new connection

    def give_up(self, rid: int, session) -> None:
        """The caller no longer waits for request ``rid`` of ``session`` (its task was cancelled, or its wait timed
        out): a CANCEL goes to the server at once, in a task of its own (after any frame being
        sent: frames must not interleave), so that the server drops the request.  Its answer,
        when it comes, is discarded (no waiter)."""
        frame = session.cancel(rid) if session is self.core.session else None
        if frame is None:
            return
        task = asyncio.get_running_loop().create_task(self._send_cancel(frame))
        self.cancels.add(task)
        task.add_done_callback(self.cancels.discard)

    async def _send_cancel(self, frame: bytes) -> None:
        try:
            async with self.send_lock:
                await self.send([frame])
        except OSError:
            pass  # the connection is going: the server drops the request with it

    async def send(self, parts: list) -> None:
        """Send every part; OSError if the socket refuses, its ``sent`` saying whether any byte went."""
        loop, went = asyncio.get_running_loop(), False
        try:
            while parts:
                if self.sock is None:
                    raise ConnectionResetError("the connection is closed")
                try:
                    sent(parts, self.sock.sendmsg(parts[:MAX_IOV]))
                    went = True
                except BlockingIOError:
                    await self.ready(loop.add_writer, loop.remove_writer)
        except OSError as exc:
            exc.sent = went
            raise

    async def reader(self) -> None:
        """Read answers until the connection ends; settle each caller's future."""
        session = self.core.session
        try:
            while True:
                event = session.next_event()
                if event is NEED_DATA:
                    n = await self.recv_into(session.read_buffer())
                    if n == 0:
                        raise ConnectionError(closed_message(self.core.path))
                    self.seen_at = _monotonic()
                    session.read_done(n)
                    continue
                if type(event) is ConnectionFailed:
                    self.fail_all(event)
                    return
                future = self.waiters.get(event.request_id)
                if future is None or future.done():
                    session.discard(event)  # its caller timed out or was cancelled
                elif type(event) is RequestFailed:
                    future.set_exception(event.error)
                else:
                    future.set_result(event)
        except (ConnectionError, OSError) as exc:
            self.fail_all(session.fail(str(exc)))
        except Exception as exc:  # a bug here: fail the callers now rather than at their timeouts
            self.fail_all(session.fail(f"the client stopped reading: {exc!r}"))
            raise

    async def recv_into(self, buffer) -> int:
        """recvmsg_into on the non-blocking socket, handing any descriptors to the session."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                n, ancdata, _, _ = self.sock.recvmsg_into([buffer], FD_SPACE)
            except BlockingIOError:
                await self.ready(loop.add_reader, loop.remove_reader)
                continue
            if ancdata:
                self.core.session.receive_fds(passed_fds(ancdata))
            return n

    async def ready(self, add, remove) -> None:
        """Until the socket is readable (``loop.add_reader``) or writable (``loop.add_writer``)."""
        fd = self.sock.fileno()
        ready = asyncio.get_running_loop().create_future()
        add(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            remove(fd)


class AsyncClient(ClientFace):
    """The asyncio client: ``async with AsyncClient(path) as c: await c.infer(...)``.

    Several requests may be in flight at once on one connection; answers are
    matched by id.  ``zero_copy`` works as in ``Client`` (``await call.run()``);
    ``server_uid`` and the check of who serves, as in ``Client`` (at ``connect``).
    """

    def __init__(self, socket_path: str | None = None, *, timeout: float = 60.0, instance: str = DEFAULT_INSTANCE,
                 lanes: bool = True, server_uid: int | str | None = None):
        self._core = core = ClientCore(socket_path, timeout, instance, lanes, server_uid)
        self._infer = InferOperation(core)
        self._pump = AsyncPump(core)

    async def connect(self) -> AsyncClient:
        """Connect and start reading answers; ConnectionClosed if no server listens."""
        await self._pump.connect()
        return self

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._pump.close()

    # -- public API (as Client's) ---------------------------------------------------------

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray], *, timeout: float | None = None,
                    version: int | None = None, key: str | None = None, priority: int = 0) -> dict[str, np.ndarray]:
        """As ``Client.infer``: through a lane of ``model`` when it can take the call (several
        calls may be in it at once), else over the socket; ``priority`` as there (0: the model's
        default level, 1 served first; ValueError for a negative or non-int one)."""
        return await self._pump.perform(self._infer, (model, inputs, timeout, version, key, priority))

    async def models(self) -> list[dict]:
        return await self._pump.run(self._core.models())

    async def health(self) -> dict:
        return await self._pump.run(self._core.health())

    async def info(self) -> dict:
        return await self._pump.run(self._core.info())

    async def repository(self) -> dict:
        return await self._pump.run(self._core.repository())

    async def load(self, model: str, *, version: int | None = None, instances: int | None = None, keep: bool = False,
                   timeout: float | None = None) -> dict:
        return await self._pump.run(self._core.control(Kind.LOAD, model, timeout, version=version,
                                                       instances=instances, keep=keep or None))

    async def unload(self, model: str, *, version: int | None = None, timeout: float | None = None) -> dict:
        return await self._pump.run(self._core.control(Kind.UNLOAD, model, timeout, version=version))

    async def scale(self, model: str, instances: int, *, version: int | None = None,
                    timeout: float | None = None) -> dict:
        return await self._pump.run(self._core.control(Kind.SCALE, model, timeout, version=version,
                                                       instances=instances))

    async def canary(self, model: str, action: str, *, version: int | None = None, plan: dict | None = None,
                     timeout: float | None = None) -> dict:
        return await self._pump.run(self._core.control(Kind.CANARY, model, timeout, action=action, version=version,
                                                       plan=plan))

    async def open_region(self, size: int, *, lane: str | None = None) -> Region:
        """As ``Client.open_region``."""
        return await self._pump.run(self._core.open_region(size, lane))

    async def zero_copy(self, model: str, inputs: Mapping[str, tuple], *, output_capacity: int | None = None,
                        version: int | None = None, key: str | None = None, priority: int = 0) -> AsyncZeroCopyCall:
        """As ``Client.zero_copy`` (``priority`` too); ``async with await c.zero_copy(...) as call:
        await call.run()``.  Lane calls wake the loop through a watcher thread per lane (a loop
        cannot wait on a futex)."""
        operation = await self._pump.run(self._core.zero_copy(model, inputs, output_capacity, version, key,
                                                              priority))
        return AsyncZeroCopyCall(self, self._pump, operation)
