"""The front-end: socket, arena, admission, scheduling, completions, shutdown.

Owns: the Unix socket and its access control (mode + SO_PEERCRED allow-list),
the arena (created here, swept of a dead predecessor first), every request
from its first byte to its last (admission into arena space, publication to
a worker, timeout, the response), client regions for the zero-copy path, and
the order of shutdown.  Runs on uvloop; never imports CUDA or a model
runtime.

Data path (the copies are the product): an inline request's tensor bytes are
received by the kernel straight into arena space (``BufferedProtocol``
returns views of the arena from ``get_buffer``); results are written from
views of the arena (``writelines``), and a slot is freed only once the
transport has flushed them.  A zero-copy request carries only descriptors of
tensors already in the client's own region.  A lane (a region opened for one
model) takes the front-end off the data path altogether: its first
``layout.LANE_BYTES`` are a queue the client and one worker share, and the
front-end only attaches it to a worker, moves it when that worker dies
(failing what it was running) and detaches it when the client goes.

Must not: block the loop, parse bytes (``shmserve.protocol`` does), or
compute offsets (``shmserve.layout`` does).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import signal
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import mmap

import posix_ipc

from shmserve import __version__, lanes, layout, protocol, stale, systemd, workerlink
from shmserve.allocator import Extent, ExtentAllocator, SlotPool
from shmserve.arena import Arena, SlotConflict
from shmserve.config import ServerConfig, spin_default_us
from shmserve.errors import ErrorCode, ShmserveError
from shmserve.protocol import Frame, Kind, PayloadDone, ProtocolError, ProtocolViolation
from shmserve.rings import drain_eventfd, new_eventfd
from shmserve.slotstate import Actor, SlotState
from shmserve.spec import bind_inputs, estimate_output_bytes
from shmserve.supervisor import FAILED, READY, STARTING, Supervisor, WorkerHandle

log = logging.getLogger("shmserve.server")

READ_BUFFER = 256 * 1024  # protocol bytes between payloads; payloads bypass it
SOCKET_BUFFER = 4 * 1024 * 1024  # kernel socket buffers (capped by net.core.wmem_max/rmem_max)
HEARTBEAT_S = 0.5
STARTUP_TIMEOUT_S = 300.0  # loading large engines takes a while; a hung worker must not hang start-up
MAX_REGIONS_PER_CONNECTION = 16
STATUS_WORD = {SlotState.DONE, SlotState.ERROR}
_PEERCRED = struct.Struct("3i")


@dataclass(eq=False)
class Region:
    id: int
    name: str  # posix shm name, with the leading slash
    size: int
    lane_model: "ModelState | None" = None  # set for a lane: the model its queue serves
    lane_worker: WorkerHandle | None = None  # the worker it is attached to (None: waiting for one)
    lane_buf: mmap.mmap | None = None  # the front-end's mapping of the lane's queue (LANE_BYTES)


@dataclass(eq=False)
class Request:
    conn: "ClientConnection"
    id: int
    model: "ModelState"
    inputs: tuple
    timeout_s: float
    zero_copy: bool = False
    region: Region | None = None
    out_offset: int = 0
    out_capacity: int = 0
    total_bytes: int = 0
    slot: int | None = None
    generation: int = 0
    extent: Extent | None = None
    worker: WorkerHandle | None = None
    state: str = "new"  # new | waiting | receiving | queued | answered
    orphan: bool = False  # nobody to answer: free the slot when the worker is done
    response: list | None = None
    holds_slot_until_flushed: bool = False
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class ModelState:
    index: int
    name: str
    config: object
    workers: list[WorkerHandle] = field(default_factory=list)

    @property
    def spec(self):
        for w in self.workers:
            if w.spec is not None:
                return w.spec
        return None

    def pick_worker(self) -> WorkerHandle | None:
        ready = [w for w in self.workers if w.state == READY]
        return min(ready, key=lambda w: len(w.inflight)) if ready else None

    @property
    def state(self) -> str:
        if any(w.state == READY for w in self.workers):
            return "ready"
        if all(w.state == FAILED for w in self.workers):
            return "unavailable"
        return "restarting"

    def unavailable_reason(self) -> str:
        errors = sorted({w.error for w in self.workers if w.error})
        if self.state == "unavailable":
            return f"model {self.name!r} is unavailable: {'; '.join(errors) or 'its workers failed'}"
        return f"model {self.name!r} has no running worker (restarting)"


class Frontend:
    def __init__(self, config: ServerConfig, socket_path: str, *, listen_sock: socket.socket | None = None,
                 config_path: str | None = None, metrics_address: str | None = None):
        self.config = config
        self.socket_path = socket_path
        self.listen_sock = listen_sock  # passed by systemd socket activation: not ours to unlink
        self.config_path = config_path
        self.metrics_address = metrics_address
        self.outcomes: collections.Counter = collections.Counter()  # (model, outcome) -> requests answered
        self.models = {m.name: ModelState(i, m.name, m) for i, m in enumerate(config.models)}
        self.pending: dict[int, Request] = {}  # slot -> request handed to a worker
        self.waiting: collections.deque[Request] = collections.deque()
        self.connections: set[ClientConnection] = set()
        self.regions: dict[int, Region] = {}
        self.next_region = 1
        self.stopping = False
        self.started = time.monotonic()
        self.allowed_uids = {os.getuid(), 0, *config.allow_uids}
        self.spin_s = config.effective_spin_us() / 1e6
        self._polling = False
        self._poll_until = 0.0
        self.allowed_gids = set(config.allow_gids)

    # -- life -----------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.loop = loop
        if self.listen_sock is None and len(os.fsencode(self.socket_path)) > 107:
            raise SystemExit(f"shmserve: socket path {self.socket_path!r} is longer than the 107 bytes a Unix "
                             f"socket address holds; choose a shorter --socket")
        for removed in stale.sweep(self.config.instance):
            log.warning("removed stale arena /dev/shm/%s (%s)", removed.name, removed.reason)
        self._sweep_regions()
        n_workers = sum(m.instances for m in self.config.models)
        systemd.notify("STATUS=creating the arena")
        self.arena = Arena.create(self.config.instance, slot_count=self.config.arena_slots,
                                  max_workers=n_workers, size_classes=self.config.arena_size_classes(),
                                  socket_path=self.socket_path)
        self.view = memoryview(self.arena.buf)
        self.slots = SlotPool(self.arena.geometry.slot_count)
        self.extents = ExtentAllocator(self.arena.geometry)
        self.max_request = min(self.config.max_request_bytes, self.extents.largest)
        self.efd = new_eventfd()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload()))
        server = heartbeat = watchdog = metrics = None
        try:
            loop.add_reader(self.efd, self._on_completions)
            self.supervisor = Supervisor(self.arena, self.config, self.efd, self._worker_ready, self._worker_exited)
            for w in self.supervisor.workers:
                self.models[w.model.name].workers.append(w)
                w.completion_bell.arm()  # the loop is idle: the first completion must wake it
            log.info("instance %s: arena %s (%d MiB, %d slots), %d worker(s)", self.config.instance,
                     self.arena.name, self.arena.geometry.total_size >> 20, self.arena.geometry.slot_count, n_workers)
            systemd.notify(f"STATUS=loading {n_workers} worker(s)")
            await self.supervisor.start_all(STARTUP_TIMEOUT_S)
            for m in self.models.values():
                if m.state != "ready":
                    log.error("%s", m.unavailable_reason())
            sock = self.listen_sock or self._bind_socket()
            server = await loop.create_unix_server(lambda: ClientConnection(self), sock=sock)
            heartbeat = loop.create_task(self._heartbeat())
            if self.metrics_address:
                from shmserve.metrics import MetricsServer

                metrics = await MetricsServer(self).start(self.metrics_address)
            ready = sum(m.state == "ready" for m in self.models.values())
            log.info("ready: listening on %s (%d of %d models ready)", self.socket_path, ready, len(self.models))
            systemd.notify("READY=1", f"STATUS=serving {ready} of {len(self.models)} models on {self.socket_path}")
            interval = systemd.watchdog_interval()
            if interval:
                watchdog = loop.create_task(self._watchdog(interval))
            await stop.wait()
            log.info("shutting down: draining up to %.1f s", self.config.drain_timeout_s)
            systemd.notify("STOPPING=1", "STATUS=draining in-flight requests")
        finally:
            for task in (watchdog, heartbeat):
                if task is not None:
                    task.cancel()
            if metrics is not None:
                await metrics.stop()
            await self._shutdown(server)
        log.info("stopped")
        return 0

    # -- health, watchdog, reload ---------------------------------------------------------

    def wedged_workers(self) -> list[WorkerHandle]:
        """Ready workers whose heartbeat (a thread in each worker, every 0.5 s) is older than
        worker_timeout_s: stopped (SIGSTOP), hung in the kernel, or dead without an exit yet."""
        now = time.monotonic_ns()
        out = []
        for w in self.supervisor.workers:
            if w.state != READY:
                continue
            beat = layout.WORKER.read(self.arena.buf, self.arena.geometry.worker_off(w.index)).heartbeat_ns
            if now - beat > self.config.worker_timeout_s * 1e9:
                out.append(w)
        return out

    async def _watchdog(self, interval: float) -> None:
        """Feed systemd's watchdog only while the loop runs on time and no worker is wedged.

        A wedged worker is killed (and so restarted) after 2 x worker_timeout_s; feeding
        resumes once it is healthy again.
        """
        expected = time.monotonic() + interval
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            late = now - expected
            expected = now + interval
            wedged = self.wedged_workers()
            if wedged:
                names = ", ".join(f"{w.index} ({w.model.name}, pid {w.pid})" for w in wedged)
                log.error("not feeding the watchdog: worker(s) %s have not beaten for %.0f s", names,
                          self.config.worker_timeout_s)
                systemd.notify(f"STATUS=worker(s) {names} not responding")
                for w in wedged:
                    self._kill_if_still_wedged(w)
                continue
            if late > interval:
                log.warning("event loop ran %.2f s late", late)
            systemd.notify("WATCHDOG=1")

    def _kill_if_still_wedged(self, w: WorkerHandle) -> None:
        beat = layout.WORKER.read(self.arena.buf, self.arena.geometry.worker_off(w.index)).heartbeat_ns
        if time.monotonic_ns() - beat > 2 * self.config.worker_timeout_s * 1e9:
            log.error("killing wedged worker %d (pid %s)", w.index, w.pid)
            self.supervisor.kill(w)

    async def reload(self) -> None:
        """SIGHUP: re-read the config file; apply what can change while serving.

        Applied: request and queue limits, the allow-lists, and any model whose
        settings changed (its workers restart with the new settings).  Not
        applied (logged; needs a restart): instance, socket, arena, spin, added
        or removed models, a model's instance count.
        """
        if self.config_path is None:
            log.warning("reload: started without --config; nothing to reload")
            return
        from shmserve import config as cfgmod

        systemd.notify("RELOADING=1", f"MONOTONIC_USEC={systemd.monotonic_usec()}", "STATUS=reloading")
        try:
            new = cfgmod.load(self.config_path, instance=self.config.instance)
        except cfgmod.ConfigError as exc:
            log.error("reload: %s; keeping the running configuration", exc)
            systemd.notify("READY=1", "STATUS=reload failed: configuration error; still serving")
            return
        old = self.config
        fixed = [k for k in ("socket", "arena_slots", "size_classes", "max_request_bytes", "spin_us",
                             "socket_mode", "socket_group") if getattr(new, k) != getattr(old, k)]
        old_models = {m.name: m for m in old.models}
        new_models = {m.name: m for m in new.models}
        if set(old_models) != set(new_models):
            fixed.append("the set of models")
        changed = []
        for name, model in new_models.items():
            before = old_models.get(name)
            if before is None or before == model:
                continue
            if before.instances != model.instances:
                fixed.append(f"models.{name}.instances")
                continue
            changed.append(model)
        import dataclasses

        changed_names = {m.name for m in changed}
        self.config = dataclasses.replace(
            old, request_timeout_s=new.request_timeout_s, drain_timeout_s=new.drain_timeout_s,
            max_waiting=new.max_waiting, max_inflight_per_connection=new.max_inflight_per_connection,
            allow_uids=new.allow_uids, allow_gids=new.allow_gids, worker_timeout_s=new.worker_timeout_s,
            models=tuple(new_models[m.name] if m.name in changed_names else m for m in old.models))
        self.allowed_uids = {os.getuid(), 0, *self.config.allow_uids}
        self.allowed_gids = set(self.config.allow_gids)
        for model in changed:
            self.models[model.name].config = model
            self.supervisor.replace_model(model)
            log.info("reload: model %s changed; restarting its workers", model.name)
        if fixed:
            log.warning("reload: not applied (needs a restart): %s", ", ".join(sorted(set(fixed))))
        log.info("reload: done (%d model(s) restarted)", len(changed))
        systemd.notify("READY=1", f"STATUS=serving on {self.socket_path} (reloaded)")

    def _bind_socket(self) -> socket.socket:
        path = Path(self.socket_path)
        if not path.parent.exists():
            path.parent.mkdir(mode=0o700, parents=True)
            self._created_socket_dir = path.parent  # removed again at exit if we leave it empty
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise SystemExit(f"shmserve: {path} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
                raise SystemExit(f"shmserve: another server is listening on {path}")
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink()  # left behind by a server that died
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        mode = self.config.socket_mode
        if self.config.socket_group is not None:
            import grp

            os.chown(path, -1, grp.getgrnam(self.config.socket_group).gr_gid)
        os.chmod(path, mode)
        sock.listen(512)
        self._owns_socket_file = True
        return sock

    async def _heartbeat(self) -> None:
        while True:
            self.arena.beat()
            await asyncio.sleep(HEARTBEAT_S)

    async def _shutdown(self, server) -> None:
        self.stopping = True
        if getattr(self, "supervisor", None) is not None:
            self.supervisor.stopping = True  # a worker dying now is not restarted
        if getattr(self, "arena", None) is None:
            return
        self.arena.set_state(layout.ARENA_STOPPING)
        if server is not None:
            server.close()
        if getattr(self, "_owns_socket_file", False):
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
            created = getattr(self, "_created_socket_dir", None)
            if created is not None:
                try:
                    created.rmdir()
                except OSError:
                    pass  # not empty: somebody else's files live there too
        while self.waiting:
            req = self.waiting.popleft()
            req.conn.skip_pending_payload()
            self._answer_error(req, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
            req.conn.resume()
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for req in list(self.pending.values()):
            if not req.orphan:
                self._answer_error(req, ErrorCode.SHUTTING_DOWN, "the server stopped before this request finished")
        await self._flush_connections(1.0)
        for conn in list(self.connections):
            conn.transport.close()
        await asyncio.sleep(0)
        if getattr(self, "supervisor", None) is not None:
            await self.supervisor.stop_all()
        self.loop.remove_reader(self.efd)
        os.close(self.efd)
        for region in list(self.regions.values()):
            self._drop_region(region)
        self.view.release()
        self.arena.unlink()
        try:
            self.arena.close()
        except BufferError:
            log.warning("arena still exported at exit; the kernel unmaps it")

    async def _flush_connections(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(c.transport.get_write_buffer_size() for c in self.connections
                                                  if not c.transport.is_closing()):
            await asyncio.sleep(0.01)

    # -- workers --------------------------------------------------------------------------

    def _worker_ready(self, w: WorkerHandle) -> None:
        self._attach_waiting_lanes(self.models[w.model.name])
        self._admit_waiting()

    def _worker_exited(self, w: WorkerHandle, how: str) -> None:
        """Recover what a dead worker finished, fail what it did not, free its queue."""
        self._drain(w)
        for index in sorted(w.inflight):
            req = self.pending.get(index)
            generation, state = self.arena.slot_status(index)
            if req is None or generation != req.generation:
                continue
            if state in STATUS_WORD:  # finished but not yet pushed: deliver it
                self._complete(w, index, generation)
                continue
            layout.encode_error(self.arena.buf, self.arena.geometry, index, ErrorCode.WORKER_CRASHED,
                                f"worker {w.index} for model {w.model.name!r} {how} while running this request")
            self.arena.transition(index, generation, SlotState(state), SlotState.ERROR, Actor.FRONTEND)
            self._complete(w, index, generation)
        w.inflight.clear()
        w.submissions.discard()
        self._lanes_lost(w, how)

    # -- completions ----------------------------------------------------------------------

    def _on_completions(self) -> None:
        drain_eventfd(self.efd)
        self._drain_and_arm()

    def _drain_and_arm(self) -> None:
        workers = self.supervisor.workers
        while True:
            for w in workers:
                self._drain(w)
            if not any(w.completion_bell.arm() for w in workers):
                return

    def _start_polling(self) -> None:
        """While requests are in flight, poll the completion rings from the loop (call_soon keeps
        socket I/O flowing between polls) for up to spin_us after the last completion, instead of
        paying a wake-up per completion.  Then fall back to the armed eventfd."""
        self._poll_until = time.monotonic() + self.spin_s
        if not self._polling and self.spin_s > 0:
            self._polling = True
            self.loop.call_soon(self._poll)

    def _poll(self) -> None:
        got = False
        for w in self.supervisor.workers:
            if not w.completions.empty():
                self._drain(w)
                got = True
        now = time.monotonic()
        if got:
            self._poll_until = now + self.spin_s
        if self.pending and now < self._poll_until and not self.stopping:
            self.loop.call_soon(self._poll)
            return
        self._polling = False
        self._drain_and_arm()

    def _drain(self, w: WorkerHandle) -> None:
        for entry in w.completions.pop_all():
            index, generation = layout.split_entry(entry)
            if index in w.inflight:
                self._complete(w, index, generation)

    def _complete(self, w: WorkerHandle, index: int, generation: int) -> None:
        req = self.pending.get(index)
        if req is None or req.generation != generation:
            return
        status_gen, state = self.arena.slot_status(index)  # load-acquire before reading outputs
        if status_gen != generation or state not in STATUS_WORD:
            log.error("slot %d completed in state %s; ignoring", index, state)
            return
        del self.pending[index]
        w.inflight.discard(index)
        if req.timer is not None:
            req.timer.cancel()
        self.arena.add_stat("requests_total", 1)
        if req.orphan or req.state == "answered":
            self._release(req)
            return
        if state == SlotState.ERROR:
            code, message = layout.decode_error(self.arena.buf, self.arena.geometry, index)
            try:
                err = ErrorCode(code)
            except ValueError:
                err = ErrorCode.INTERNAL
            self.arena.add_stat("errors_total", 1)
            self._answer_error(req, err, message)
            return
        try:
            frame_parts = self._result_parts(req, index)
        except layout.LayoutError as exc:
            self._answer_error(req, ErrorCode.INTERNAL, f"worker wrote invalid outputs: {exc}")
            return
        req.response = frame_parts
        req.holds_slot_until_flushed = not req.zero_copy
        req.state = "answered"
        self.outcomes[(req.model.name, "ok")] += 1
        if req.zero_copy:
            self._release(req)
        req.conn.flush()

    def _result_parts(self, req: Request, index: int) -> list:
        g, buf = self.arena.geometry, self.arena.buf
        slot = layout.SLOT.read(buf, g.slot_off(index))
        spec = req.model.spec
        sizes = {req.region.id: req.region.size} if req.region else None
        outs = [layout.decode_tensor(buf, g, index, slot.n_inputs + i, sizes) for i in range(slot.n_outputs)]
        metas = []
        for d in outs:
            if d.role != layout.ROLE_OUTPUT or d.name_index >= len(spec.outputs):
                raise layout.LayoutError("descriptor is not an output of this model")
            meta = {"name": spec.outputs[d.name_index].name, "dtype": d.dtype.name, "shape": list(d.shape)}
            if req.zero_copy:
                if d.region != req.region.id:
                    raise layout.LayoutError("output outside the client's region")
                meta["offset"] = d.offset
            elif d.region != 0:
                raise layout.LayoutError("inline output outside the arena")
            metas.append(meta)
        if req.zero_copy:
            return [protocol.encode_frame(Kind.RESULT_REGION, {"id": req.id, "outputs": metas})]
        total = sum(d.nbytes for d in outs)
        self.arena.add_stat("bytes_out", total)
        header = protocol.encode_frame(Kind.RESULT, {"id": req.id, "outputs": metas}, total)
        return [header] + [self.view[d.offset:d.offset + d.nbytes] for d in outs if d.nbytes]

    def _answer_error(self, req: Request, code: ErrorCode, message: str) -> None:
        """Answer ``req`` with an error now (in its connection's order) and free what it holds
        unless a worker may still touch it (then it is freed on completion)."""
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        if req.state == "answered":
            return
        log.debug("request %d on model %s: %s: %s", req.id, req.model.name, code.wire, message)
        self.outcomes[(req.model.name, code.wire)] += 1
        req.response = [protocol.error_frame(req.id, code, message)]
        req.holds_slot_until_flushed = False
        in_worker = req.slot is not None and req.slot in self.pending
        req.state = "answered"
        if not in_worker:
            self._release(req)
        else:
            req.orphan = True
        req.conn.flush()

    # -- slots and space ------------------------------------------------------------------

    def _release(self, req: Request) -> None:
        """Return a request's slot and extent (whatever state the slot reached) and admit waiters."""
        if req.slot is None:
            return
        index, generation = req.slot, req.generation
        status_gen, state = self.arena.slot_status(index)
        if status_gen == generation and state != SlotState.FREE:
            if state == SlotState.READY:
                self.arena.transition(index, generation, SlotState.READY, SlotState.ERROR, Actor.FRONTEND)
                state = SlotState.ERROR
            self.arena.transition(index, generation, SlotState(state), SlotState.FREE, Actor.FRONTEND)
        self.slots.release(index)
        self.arena.add_stat("slots_in_use", -1)
        if req.extent is not None:
            self.extents.free(req.extent)
            self.arena.add_stat("extent_bytes_in_use", -req.extent.size)
        req.slot = req.extent = None
        self._admit_waiting()

    def _try_allocate(self, req: Request) -> bool:
        index = self.slots.acquire()
        if index is None:
            return False
        extent = None
        if not req.zero_copy:
            extent = self.extents.allocate(req.total_bytes)
            if extent is None:
                self.slots.release(index)
                return False
            self.arena.add_stat("extent_bytes_in_use", extent.size)
        self.arena.add_stat("slots_in_use", 1)
        generation = self.arena.slot_status(index)[0]
        req.generation = self.arena.transition(index, generation, SlotState.FREE, SlotState.WRITING, Actor.FRONTEND)
        req.slot, req.extent = index, extent
        layout.reset_stages(self.arena.buf, self.arena.geometry, index, time.monotonic_ns())
        return True

    def _admit_waiting(self) -> None:
        while self.waiting and not self.stopping:
            req = self.waiting[0]
            if req.conn.closed:
                self.waiting.popleft()
                continue
            if not self._try_allocate(req):
                return
            self.waiting.popleft()
            self._start_receiving(req)

    # -- requests -------------------------------------------------------------------------

    def on_frame(self, conn: "ClientConnection", frame: Frame) -> None:
        kind, meta = frame.kind, frame.meta
        rid = protocol.request_id(meta)
        try:
            if kind == Kind.INFER:
                self._on_infer(conn, protocol.parse_infer(meta, zero_copy=False), frame.data_len)
                return
            if kind == Kind.INFER_REGION:
                self._on_infer(conn, protocol.parse_infer(meta, zero_copy=True), 0)
                return
            if rid is None:
                raise ShmserveError(ErrorCode.BAD_FRAME, "'id' must be an integer in [0, 2**63)")
            if kind == Kind.MODELS:
                conn.reply(rid, {"models": self.model_listing()})
            elif kind == Kind.HEALTH:
                conn.reply(rid, self.health())
            elif kind == Kind.INFO:
                conn.reply(rid, self.info())
            elif kind == Kind.OPEN_REGION:
                self._open_region(conn, rid, meta)
            elif kind == Kind.CLOSE_REGION:
                region = conn.regions.pop(meta.get("region"), None)
                if region is None:
                    raise ShmserveError(ErrorCode.BAD_REGION, "no such region on this connection")
                self._drop_region(region)
                conn.reply(rid, {"closed": region.id})
        except (ProtocolViolation, ShmserveError) as exc:
            answer = protocol.error_frame(rid, exc.code, exc.message)
            if frame.data_len and conn.proto.state is protocol.State.AWAIT:
                conn.proto.discard_payload()
            if kind in (Kind.INFER, Kind.INFER_REGION):
                conn.answer_in_order(answer)  # after the results of earlier requests on this connection
                model = meta.get("model")  # a label only for real models: clients must not mint series
                self.outcomes[(model if model in self.models else "_unknown", exc.code.wire)] += 1
            else:
                conn.send_now(answer)

    def _on_infer(self, conn: "ClientConnection", parsed: protocol.InferRequest, data_len: int) -> None:
        model = self.models.get(parsed.model)
        if model is None:
            raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"no model {parsed.model!r} (models: "
                                                         f"{', '.join(sorted(self.models))})")
        timeout = min(parsed.timeout_s or self.config.request_timeout_s, self.config.request_timeout_s)
        req = Request(conn, parsed.id, model, parsed.inputs, timeout, zero_copy=parsed.region is not None)
        if self.stopping:
            raise ShmserveError(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        spec = model.spec
        if spec is None or model.pick_worker() is None:
            raise ShmserveError(ErrorCode.MODEL_UNAVAILABLE, model.unavailable_reason())
        symbols = bind_inputs(spec, parsed.inputs)
        in_bytes = sum(t.nbytes for t in parsed.inputs)
        if req.zero_copy:
            self._check_region_request(conn, req, parsed)
        else:
            if data_len != in_bytes:
                raise ShmserveError(ErrorCode.BAD_FRAME, f"payload is {data_len} bytes, inputs need {in_bytes}")
            padded = sum(layout.align_tensor(t.nbytes) for t in parsed.inputs)
            req.total_bytes = padded + estimate_output_bytes(spec, symbols, model.config.max_output_bytes)
            if req.total_bytes > self.max_request:
                raise ShmserveError(ErrorCode.TOO_LARGE, f"request needs {req.total_bytes} bytes of arena space "
                                                         f"(inputs {in_bytes}); the limit is {self.max_request}")
        if len(conn.order) >= self.config.max_inflight_per_connection:
            raise ShmserveError(ErrorCode.OVERLOADED, f"more than {self.config.max_inflight_per_connection} "
                                                      f"requests in flight on this connection")
        self.arena.add_stat("bytes_in", in_bytes)
        if not self.waiting and self._try_allocate(req):
            conn.order.append(req)
            self._start_receiving(req)
            return
        if len(self.waiting) >= self.config.max_waiting:
            raise ShmserveError(ErrorCode.OVERLOADED, f"arena full and {len(self.waiting)} requests waiting")
        conn.order.append(req)
        req.state = "waiting"
        req.timer = self.loop.call_later(req.timeout_s, self._on_timeout, req)
        self.waiting.append(req)
        conn.pause()  # its payload stays in the socket until there is space for it

    def _check_region_request(self, conn, req: Request, parsed: protocol.InferRequest) -> None:
        region = conn.regions.get(parsed.region)
        if region is None:
            raise ShmserveError(ErrorCode.BAD_REGION, f"region {parsed.region} is not open on this connection")
        for t in parsed.inputs:
            if not layout.is_tensor_aligned(t.offset) or t.offset + t.nbytes > region.size:
                raise ShmserveError(ErrorCode.BAD_REGION, f"input {t.name!r} at [{t.offset}, +{t.nbytes}) is not "
                                                          f"{layout.TENSOR_ALIGN}-aligned inside region {region.id} "
                                                          f"({region.size} bytes)")
        end = parsed.output_offset + parsed.output_capacity
        if not layout.is_tensor_aligned(parsed.output_offset) or end > region.size:
            raise ShmserveError(ErrorCode.BAD_REGION, f"output area [{parsed.output_offset}, +"
                                                      f"{parsed.output_capacity}) is not aligned inside region "
                                                      f"{region.id} ({region.size} bytes)")
        req.region, req.out_offset, req.out_capacity = region, parsed.output_offset, parsed.output_capacity

    def _start_receiving(self, req: Request) -> None:
        """Write the input descriptors; inline: point the socket at the arena; zero-copy: publish."""
        g, buf = self.arena.geometry, self.arena.buf
        spec = req.model.spec
        sinks, pos = [], req.extent.offset if req.extent else 0
        for i, t in enumerate(req.inputs):
            if req.zero_copy:
                offset, region = t.offset, req.region.id
            else:
                offset, region = pos, 0
                pos += layout.align_tensor(t.nbytes)
                sinks.append(self.view[offset:offset + t.nbytes])
            layout.encode_tensor(buf, g, req.slot, i, role=layout.ROLE_INPUT, name_index=spec.input_index(t.name),
                                 dtype=t.dtype, shape=t.shape, offset=offset, region=region)
        if req.zero_copy:
            self._publish(req)
            req.conn.resume()
            return
        req.out_offset, req.out_capacity = pos, req.extent.offset + req.extent.size - pos
        conn = req.conn
        if not any(t.nbytes for t in req.inputs):  # every input is empty: nothing to receive
            self._publish(req)
            conn.resume()
            return
        req.state = "receiving"
        conn.receiving = req
        conn.proto.accept_payload(sinks)
        conn.resume()

    def on_payload_done(self, conn: "ClientConnection") -> None:
        req = conn.receiving
        conn.receiving = None
        if req is None:
            return  # a discarded payload
        if req.state != "receiving":
            return
        self._publish(req)

    def _publish(self, req: Request) -> None:
        worker = req.model.pick_worker()
        if worker is None or self.stopping:
            code = ErrorCode.SHUTTING_DOWN if self.stopping else ErrorCode.MODEL_UNAVAILABLE
            self._answer_error(req, code, "the server is shutting down" if self.stopping
                               else req.model.unavailable_reason())
            return
        g, buf, index = self.arena.geometry, self.arena.buf, req.slot
        layout.encode_slot_request(buf, g, index, request_id=req.id, model_id=req.model.index,
                                   worker=worker.index, n_inputs=len(req.inputs),
                                   out_region=req.region.id if req.zero_copy else 0, out_off=req.out_offset,
                                   out_capacity=req.out_capacity)
        self.arena.stamp(index, "t_ready")
        # Order matters here: descriptors and (inline) input bytes are complete before READY.
        self.arena.transition(index, req.generation, SlotState.WRITING, SlotState.READY, Actor.FRONTEND)
        req.state, req.worker = "queued", worker
        self.pending[index] = req
        worker.inflight.add(index)
        worker.submissions.push(layout.slot_entry(index, req.generation))
        worker.doorbell.notify()
        self._start_polling()
        if req.timer is None:
            req.timer = self.loop.call_later(req.timeout_s, self._on_timeout, req)

    def _on_timeout(self, req: Request) -> None:
        req.timer = None
        if req.state == "waiting":
            self.waiting.remove(req)
            req.conn.skip_pending_payload()
            self._answer_error(req, ErrorCode.TIMEOUT, f"no arena space within {req.timeout_s:g} s")
            req.conn.resume()
        elif req.state == "queued":
            index = req.slot
            try:  # not claimed yet: take it back now rather than when the worker gets to it
                self.arena.transition(index, req.generation, SlotState.READY, SlotState.ERROR, Actor.FRONTEND)
            except SlotConflict:
                pass  # running: the worker keeps it; freed when it finishes
            else:
                del self.pending[index]
                req.worker.inflight.discard(index)
            self._answer_error(req, ErrorCode.TIMEOUT, f"no result within {req.timeout_s:g} s")

    def connection_lost(self, conn: "ClientConnection") -> None:
        self.connections.discard(conn)
        for req in list(conn.order):
            if req.timer is not None:
                req.timer.cancel()
            if req.state == "waiting":
                self.waiting.remove(req)
            elif req.slot is not None and req.slot in self.pending:
                req.orphan = True  # the worker has it: freed on completion
            else:
                self._release(req)
            req.state = "answered"
        conn.order.clear()
        for region in list(conn.regions.values()):
            self._drop_region(region)
        conn.regions.clear()

    # -- regions (zero-copy) --------------------------------------------------------------

    def _open_region(self, conn: "ClientConnection", rid: int, meta: dict) -> None:
        size = meta.get("size")
        limit = self.config.max_request_bytes + (1 << 20)  # one largest request, with room for alignment
        if type(size) is not int or not 0 < size <= limit:
            raise ShmserveError(ErrorCode.TOO_LARGE if type(size) is int and size > 0 else ErrorCode.BAD_FRAME,
                                f"'size' must be an integer in [1, {limit}]")
        lane_model = None
        if "lane" in meta:
            lane_model = self.models.get(meta["lane"]) if isinstance(meta["lane"], str) else None
            if lane_model is None:
                raise ShmserveError(ErrorCode.UNKNOWN_MODEL, f"'lane' must name a model: {meta['lane']!r} is none")
            served = sum(r.lane_model is lane_model for r in self.regions.values())
            if served >= workerlink.MAX_LANES * len(lane_model.workers):
                raise ShmserveError(ErrorCode.OVERLOADED, f"model {lane_model.name!r} serves {served} lanes, its "
                                                          f"most; use a region without a lane")
            size += layout.LANE_BYTES
        if len(conn.regions) >= MAX_REGIONS_PER_CONNECTION:
            raise ShmserveError(ErrorCode.OVERLOADED, f"at most {MAX_REGIONS_PER_CONNECTION} regions per connection")
        size = (size + layout.PAGE - 1) // layout.PAGE * layout.PAGE
        region_id = self.next_region
        self.next_region += 1
        name = layout.region_name(self.config.instance, region_id)
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
        region = Region(region_id, name, size, lane_model, None, lane_buf)
        self.regions[region_id] = region
        conn.regions[region_id] = region
        answer = {"id": rid, "region": region_id, "size": size}
        if lane_model is not None:
            lanes.init_header(lane_buf, lane_model.index)
            self._attach_lane(region)
            self._tune_lane_spin()
            answer["lane"] = {"model": lane_model.name, "data_offset": layout.LANE_BYTES,
                              "slots": layout.LANE_SLOTS}
        try:
            conn.send_with_fd(protocol.encode_frame(Kind.REGION, answer), shm.fd)
        finally:
            shm.close_fd()

    def _drop_region(self, region: Region) -> None:
        self.regions.pop(region.id, None)
        if region.lane_buf is not None:
            if region.lane_worker is not None:
                self._command(region.lane_worker, layout.command_entry(layout.CMD_DETACH_LANE, region.id))
                region.lane_worker = None
                self._attach_waiting_lanes(region.lane_model)  # a worker has room again
            region.lane_buf.close()
            region.lane_buf = None
            self._tune_lane_spin()
        try:
            posix_ipc.unlink_shared_memory(region.name)
        except posix_ipc.ExistentialError:
            pass

    # -- lanes ----------------------------------------------------------------------------

    def _attach_lane(self, region: Region) -> None:
        """Give a lane to the ready worker of its model that has the fewest (none ready: it waits
        for ``_worker_ready``; requests queued meanwhile run once it is attached)."""
        load = collections.Counter(r.lane_worker for r in self.regions.values() if r.lane_worker is not None)
        ready = [w for w in region.lane_model.workers if w.state == READY and load[w] < workerlink.MAX_LANES]
        if not ready or self.stopping:
            region.lane_worker = None
            return
        worker = min(ready, key=lambda w: load[w])
        region.lane_worker = worker
        lanes.assign_worker(region.lane_buf, worker.index)
        self._command(worker, layout.command_entry(layout.CMD_ATTACH_LANE, region.id))

    def _attach_waiting_lanes(self, model: ModelState) -> None:
        """Attach the lanes of ``model`` that have no worker (none was ready, or all were full)."""
        for region in list(self.regions.values()):
            if region.lane_model is model and region.lane_worker is None and region.lane_buf is not None:
                self._attach_lane(region)

    def _tune_lane_spin(self) -> None:
        """Tell lane clients whether to spin for completions: only while there are at most half as
        many lanes as CPUs.  A spinning client needs a core of its own, and its worker another;
        past that, spinners steal the CPU the workers need (measured in docs/performance.md:
        8 lane clients on 2 vCPUs served 11,000 req/s spinning 50 us, 17,500 not spinning)."""
        lane_regions = [r for r in self.regions.values() if r.lane_buf is not None]
        spin = spin_default_us(client=True) if len(lane_regions) <= max(1, (os.cpu_count() or 1) // 2) else 0
        for region in lane_regions:
            lanes.set_spin_hint(region.lane_buf, spin)

    def _command(self, worker: WorkerHandle, entry: int) -> None:
        """Push a command on a worker's submission ring (retried shortly if the ring is full)."""
        if worker.state not in (READY, STARTING):
            return  # a dead worker's ring is discarded; its successor starts with no lanes
        if worker.submissions.push(entry):
            worker.doorbell.notify()
        else:
            self.loop.call_later(0.001, self._command, worker, entry)

    def _lanes_lost(self, worker: WorkerHandle, how: str) -> None:
        """A worker died: fail what its lanes had queued or running, and move them on."""
        for region in list(self.regions.values()):
            if region.lane_worker is not worker:
                continue
            region.lane_worker = None
            lanes.fail_lane(region.lane_buf, ErrorCode.WORKER_CRASHED,
                       f"worker {worker.index} for model {worker.model.name!r} {how} while running this request")
            self._attach_lane(region)

    def _sweep_regions(self) -> None:
        prefix = layout.region_prefix(self.config.instance)
        for name in os.listdir("/dev/shm"):
            if name.startswith(prefix):
                try:
                    posix_ipc.unlink_shared_memory("/" + name)
                    log.warning("removed stale region /dev/shm/%s", name)
                except posix_ipc.Error:
                    pass

    # -- control answers ------------------------------------------------------------------

    def model_listing(self) -> list[dict]:
        out = []
        for m in self.models.values():
            spec = m.spec
            entry = {"name": m.name, "backend": m.config.backend, "path": m.config.path, "device": m.config.device,
                     "instances": m.config.instances, "state": m.state,
                     "max_batch_size": m.config.max_batch_size,
                     "inputs": [t.to_dict() for t in spec.inputs] if spec else [],
                     "outputs": [t.to_dict() for t in spec.outputs] if spec else []}
            if m.state != "ready":
                entry["error"] = m.unavailable_reason()
            out.append(entry)
        return out

    def health(self) -> dict:
        states = {m.name: m.state for m in self.models.values()}
        status = "shutting_down" if self.stopping else "ok" if all(s == "ready" for s in states.values()) \
            else "degraded"
        return {"status": status, "models": {
            m.name: {"state": m.state, "workers": len(m.workers),
                     "workers_ready": sum(w.state == READY for w in m.workers),
                     "restarts": sum(w.restarts for w in m.workers)} for m in self.models.values()}}

    def worker_counters(self, w: WorkerHandle) -> dict:
        """What worker ``w`` has finished (socket and lane calls) and how many lanes it serves."""
        entry = layout.WORKER.read(self.arena.buf, self.arena.geometry.worker_off(w.index))
        return {"requests": entry.requests, "errors": entry.errors,
                "lanes": sum(r.lane_worker is w for r in self.regions.values())}

    def info(self) -> dict:
        g = self.arena.geometry
        return {"version": __version__, "protocol": protocol.PROTOCOL_VERSION, "instance": self.config.instance,
                "pid": os.getpid(), "socket": self.socket_path, "uptime_s": round(time.monotonic() - self.started, 3),
                "arena": {"name": self.arena.name, "size": g.total_size, "slots": g.slot_count,
                          "largest_extent": self.extents.largest},
                "max_request_bytes": self.max_request, "request_timeout_s": self.config.request_timeout_s,
                "stats": {name: self.arena.stat(name) for name in layout.STAT_NAMES},
                "lanes": sum(r.lane_buf is not None for r in self.regions.values()),
                "workers": [{**self.worker_counters(w), "index": w.index, "model": w.model.name,
                             "device": w.model.device, "pid": w.pid,
                             "state": w.state, "restarts": w.restarts, "inflight": len(w.inflight),
                             "io_mode": w.model.io_mode if w.model.device != "cpu" else None, "gpu": w.gpu}
                            for w in self.supervisor.workers]}


class _Answered:
    """A place in a connection's answer order for a request refused before it held anything."""

    state = "answered"
    slot = None
    timer = None
    holds_slot_until_flushed = False

    def __init__(self, response: list):
        self.response = response


def _peer_groups(pid: int, gid: int) -> set[int]:
    """The peer's primary gid (SO_PEERCRED) and its supplementary groups (from /proc)."""
    groups = {gid}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
                    break
    except (OSError, ValueError):
        pass
    return groups


class ClientConnection(asyncio.BufferedProtocol):
    """One client: pumps bytes between the socket and the sans-I/O protocol, keeps responses in order."""

    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.proto = protocol.Connection(protocol.Role.SERVER)
        self.read_buffer = bytearray(READ_BUFFER)
        self.read_view = memoryview(self.read_buffer)
        self.into_payload = False
        self.order: collections.deque[Request] = collections.deque()
        self.unflushed: list[Request] = []
        self.regions: dict[int, Region] = {}
        self.receiving: Request | None = None
        self.paused = False
        self.processing = False
        self.closed = False
        self.deferred_fd_frames: list[tuple[bytes, int]] = []

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.frontend.connections.add(self)
        transport.set_write_buffer_limits(high=0, low=0)  # resume_writing == "all flushed"
        sock = transport.get_extra_info("socket")
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # big inline tensors: fewer, larger transfers
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
            except OSError:
                pass
        try:
            pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            pid = uid = gid = -1
        if uid not in self.frontend.allowed_uids and not (_peer_groups(pid, gid) & self.frontend.allowed_gids):
            log.warning("refused connection from pid %d uid %d gid %d (not on the allow-list)", pid, uid, gid)
            transport.write(protocol.error_frame(None, ErrorCode.PERMISSION_DENIED,
                                                 f"uid {uid} is not allowed to use this server"))
            self.closed = True
            transport.close()

    # reading

    def get_buffer(self, sizehint: int):
        target = self.proto.payload_buffer()
        self.into_payload = target is not None
        return target if target is not None else self.read_view

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        if self.into_payload:
            self.proto.payload_received(nbytes)
        else:
            self.proto.receive_data(self.read_view[:nbytes])
        self.process()

    def process(self) -> None:
        if self.processing:
            return  # re-entered (e.g. resume() from inside a frame handler): the outer loop continues
        self.processing = True
        try:
            self._process()
        finally:
            self.processing = False

    def _process(self) -> None:
        while not self.closed and not self.paused:
            if self.proto.state is protocol.State.AWAIT:
                return  # waiting for arena space
            event = self.proto.next_event()
            if event is protocol.NEED_DATA:
                return
            try:
                if isinstance(event, Frame):
                    self.frontend.on_frame(self, event)
                elif isinstance(event, PayloadDone):
                    self.frontend.on_payload_done(self)
            except Exception:  # our bug: this connection ends, the server goes on
                log.exception("internal error handling a %s; closing that connection", type(event).__name__)
                self.send_now(protocol.error_frame(None, ErrorCode.INTERNAL, "internal server error"))
                self.closed = True
                self.transport.close()
                return
            if isinstance(event, ProtocolError):
                log.info("closing a connection: %s: %s", event.code.wire, event.message)
                self.send_now(protocol.error_frame(None, event.code, event.message))
                self.closed = True
                self.transport.close()
                return

    def skip_pending_payload(self) -> None:
        """Drop the payload of a refused inline request (if it has one)."""
        if self.proto.state is protocol.State.AWAIT:
            self.proto.discard_payload()

    def pause(self) -> None:
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        self.process()

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        for req in self.unflushed:
            self.frontend._release(req)
        self.unflushed.clear()
        for frame, fd in self.deferred_fd_frames:
            os.close(fd)
        self.deferred_fd_frames.clear()
        if self.receiving is not None:
            self.receiving = None
        self.frontend.connection_lost(self)

    # writing

    def reply(self, rid: int, body: dict) -> None:
        self.send_now(protocol.encode_frame(Kind.REPLY, {"id": rid, **body}))

    def send_now(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    def answer_in_order(self, data: bytes) -> None:
        """Send an answer that holds nothing, but only after every earlier request's answer."""
        if not self.order:
            self.send_now(data)
            return
        self.order.append(_Answered([data]))
        self.flush()

    def flush(self) -> None:
        """Write answered requests from the head of this connection's order."""
        while self.order and self.order[0].state == "answered" and self.order[0].response is not None:
            req = self.order.popleft()
            parts, req.response = req.response, None
            if self.transport.is_closing():
                if req.holds_slot_until_flushed:
                    self.frontend._release(req)
                continue
            self.transport.writelines(parts)
            if req.holds_slot_until_flushed:
                if self.transport.get_write_buffer_size() == 0:
                    self.frontend._release(req)
                else:
                    self.unflushed.append(req)

    def send_with_fd(self, frame: bytes, fd: int) -> None:
        """Send a frame with a descriptor attached (SCM_RIGHTS), after anything already queued."""
        if self.transport.get_write_buffer_size():
            self.deferred_fd_frames.append((frame, os.dup(fd)))
            return
        self._sendmsg_fd(frame, fd)

    def _sendmsg_fd(self, frame: bytes, fd: int) -> None:
        sock = socket.socket(fileno=os.dup(self.transport.get_extra_info("socket").fileno()))
        try:
            sent = socket.send_fds(sock, [frame], [fd])
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                raise
            sent = len(frame)
        finally:
            sock.close()
        if sent == 0:
            log.warning("socket full while passing a region descriptor; closing the connection")
            self.transport.close()
        elif sent < len(frame):
            self.transport.write(frame[sent:])

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        for req in self.unflushed:
            self.frontend._release(req)
        self.unflushed.clear()
        while self.deferred_fd_frames and not self.transport.get_write_buffer_size():
            frame, fd = self.deferred_fd_frames.pop(0)
            try:
                self._sendmsg_fd(frame, fd)
            finally:
                os.close(fd)


def serve(config: ServerConfig, socket_path: str, *, listen_sock: socket.socket | None = None,
          config_path: str | None = None, metrics_address: str | None = None) -> int:
    """Run the front-end until SIGTERM/SIGINT; returns the exit status (0 after a clean stop)."""
    import uvloop

    return uvloop.run(Frontend(config, socket_path, listen_sock=listen_sock, config_path=config_path,
                               metrics_address=metrics_address).run())
