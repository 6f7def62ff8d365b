"""The front-end's composition root: build the parts, wire them, run, shut down in order.

Owns: the order of start-up (refuse, before spawning anything, an instance or a
socket path a live server holds, naming its pid; sweep a dead predecessor's arena and regions,
create the arena, start and warm the workers, then listen and report
READY), the event loop's hooks (the completion eventfd, the signals, the
owner heartbeat, systemd's watchdog), reload on SIGHUP, and the order of
shutdown (stop listening, answer what waits, drain what runs on the socket
and in lanes, stop the workers, fail the lane calls left, close the
connections, remove regions, arena and socket).

The parts (``shmserve.frontend``): the dispatcher owns requests; the region
table owns client regions and lanes; the supervisor owns worker processes
and their health; the status view answers info, health and metrics; the
Unix-socket door speaks the native protocol.  A new front door builds on
the dispatcher and the status view the same way the Unix door does.

Must not: handle a request, parse bytes, or block the loop.  It never imports
CUDA or a model runtime.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import time

from shmserve import layout, stale, systemd, workerlink
from shmserve.arena import Arena
from shmserve.config import ServerConfig
from shmserve.doorkit import DoorLimits, Listener, check_socket_path
from shmserve.errors import ErrorCode
from shmserve.frontend.dispatcher import Dispatcher, Limits, LoopClock
from shmserve.frontend.history import History
from shmserve.frontend.lifecycle import Lifecycle
from shmserve.frontend.models import MODEL_READY, ModelState, Models
from shmserve.frontend.ratelimit import RateLimiter
from shmserve.frontend.regions import RegionLimits, RegionTable
from shmserve.frontend.shadow import Shadowing
from shmserve.frontend.status import Status
from shmserve.frontend.unix import ClientConnection, UnixDoor
from shmserve.lanes import WAIT_SLICE_S
from shmserve.rings import drain_eventfd, new_eventfd
from shmserve.supervisor import Supervisor, WorkerHandle

log = logging.getLogger("shmserve.server")

HEARTBEAT_S = 0.5  # the owner's heartbeat in the arena header (inspect reads it)
STARTUP_TIMEOUT_S = 300.0  # loading large engines takes a while; a hung worker must not hang start-up
FLUSH_AT_EXIT_S = 1.0  # how long answers already given may take to reach their clients at shutdown
DRAIN_POLL_S = 0.01
DOORS_UP_TIMEOUT_S = 30.0  # at start: the door processes' hello (connections wait in the backlog meanwhile)


def limits_of(config: ServerConfig) -> Limits:
    return Limits(request_timeout_s=config.request_timeout_s, max_waiting=config.max_waiting,
                  max_request_bytes=config.max_request_bytes,
                  max_inflight_per_door=config.max_inflight_per_connection,
                  spin_s=config.effective_spin_us() / 1e6)


def region_limits_of(config: ServerConfig) -> RegionLimits:
    return RegionLimits(max_regions_per_connection=config.max_regions_per_connection,
                        max_regions_per_uid=config.max_regions_per_uid,
                        max_region_bytes_per_connection=config.max_region_bytes_per_connection,
                        max_region_bytes_per_uid=config.max_region_bytes_per_uid)
def door_limits_of(config: ServerConfig) -> DoorLimits:
    return DoorLimits(max_connections=config.max_connections, max_connections_per_uid=config.max_connections_per_uid,
                      max_inflight_per_uid=config.max_inflight_per_uid,
                      max_inflight_bytes_per_connection=config.max_inflight_bytes_per_connection,
                      stall_timeout_s=config.stall_timeout_s, frame_timeout_s=config.frame_timeout_s,
                      upload_timeout_s=config.upload_timeout_s)


def check_not_served(instance: str) -> None:
    """SystemExit naming the server and the fix if a live server already serves ``instance``
    (its arena's owner holds it); a dead one's arena is the sweep's to remove."""
    live = stale.live_arena(instance)
    if live is None:
        return
    who = f"pid {live.owner_pid}" + (f", listening on {live.socket_path}" if live.socket_path else "")
    raise SystemExit(f"shmserve: instance {instance!r} is already served by {who}; stop that server first, or "
                     f"start this one with another --instance")


# The one command that installs what the v2 doors need (README.md and docs/v2.md give the same).
V2_INSTALL = "pip install -e '.[v2]' (in the shmserve checkout)"


def check_v2(config: ServerConfig) -> None:
    """SystemExit naming the fix if the v2 doors the config asks for cannot run here (checked
    before anything is spawned)."""
    if config.grpc:
        try:
            import shmserve.v2.grpc  # noqa: F401
        except ImportError as exc:
            raise SystemExit(f"serve --grpc needs the v2 extra ({exc}): {V2_INSTALL}") from None
    for address in (config.http, config.grpc):
        if address and "/" in address:
            check_socket_path(address)
    if config.v2_tokens and (config.http or config.grpc):
        load_v2_tokens(config)
    check_descriptors(config)


def load_v2_tokens(config: ServerConfig) -> tuple:
    """The token table ``server.v2_tokens`` names (empty without one).  SystemExit naming the fix
    if it cannot be used."""
    if not config.v2_tokens:
        return ()
    from shmserve.v2.auth import TokenFileError, load_tokens

    try:
        return load_tokens(config.v2_tokens)
    except TokenFileError as exc:
        raise SystemExit(f"shmserve serve: {exc}") from None


def check_descriptors(config: ServerConfig) -> None:
    """SystemExit naming the limits and the fix if the front-end's descriptor limit (lifted to its
    hard limit first) is smaller than what the configured limits let clients make it hold: one
    client could otherwise use up the descriptors every door needs to accept anyone."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    budget = config.descriptor_budget()
    need = sum(budget.values())
    if soft != resource.RLIM_INFINITY and need > soft:
        parts = ", ".join(f"{n} {what}" for what, n in budget.items())
        raise SystemExit(f"shmserve serve: the limits let clients hold up to {need} descriptors ({parts}), but "
                         f"RLIMIT_NOFILE is {soft}: raise it (LimitNOFILE={max(need * 2, 65536)} in the unit, or "
                         f"ulimit -n) or lower those limits")


def strict_refusal(unready: list[ModelState], n_models: int) -> str:
    """The one line a strict start ends with: which models did not load, and why."""
    why = "; ".join(" ".join(m.unavailable_reason().split()) for m in unready)
    return f"shmserve serve: strict: {len(unready)} of {n_models} models did not load, not serving: {why}"


class Frontend:
    def __init__(self, config: ServerConfig, socket_path: str, *, listen_sock: socket.socket | None = None,
                 config_path: str | None = None, metrics_address: str | None = None,
                 repository_override: str | None = None):
        self.config = config
        self.socket_path = socket_path
        self.listen_sock = listen_sock  # passed by systemd socket activation: not ours to unlink
        self.config_path = config_path
        self.metrics_address = metrics_address
        self.repository_override = repository_override  # serve --model-repository: kept over reloads
        self.models = Models()
        self.lifecycle: Lifecycle | None = None
        self.arena: Arena | None = None
        self.supervisor: Supervisor | None = None
        self.dispatcher: Dispatcher | None = None
        self.regions: RegionTable | None = None
        self.door: UnixDoor | None = None
        self.listener: Listener | None = None
        self.efd: int | None = None
        self.v2 = None  # the KServe v2 service (shmserve.v2.service), when http or grpc is on
        self.v2_doors: list = []  # its HTTP and gRPC doors
        self.doors = None  # the door processes (frontend/doorhouse.py), when [server] doors > 0

    # -- life -----------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        workerlink.raise_descriptor_limit()
        check_not_served(self.config.instance)  # these two before anything is spawned: no model load is wasted
        if self.listen_sock is None:
            check_socket_path(self.socket_path)
        check_v2(self.config)
        for removed in stale.sweep(self.config.instance):
            log.warning("removed stale arena /dev/shm/%s (%s)", removed.name, removed.reason)
        stop = asyncio.Event()
        tasks: list[asyncio.Task] = []
        server = metrics = None
        try:
            self._build(loop)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload()))
            log.info("instance %s: arena %s (%d MiB, %d slots, up to %d workers)", self.config.instance,
                     self.arena.name, self.arena.geometry.total_size >> 20, self.arena.geometry.slot_count,
                     self.arena.geometry.max_workers)
            systemd.notify("STATUS=loading the models")
            tasks.append(loop.create_task(self.supervisor.watch_health()))
            await self.lifecycle.start()
            unready = [m for m in self.models.versions() if m.state != MODEL_READY and m.config.load == "startup"]
            for m in unready:
                log.error("%s", m.unavailable_reason())
            if unready and self.config.strict:  # stopped in order by the finally below
                raise SystemExit(strict_refusal(unready, len(self.models)))
            await self._start_v2()  # first: once the native socket answers, every door does
            self.listener = Listener(self.socket_path, mode=self.config.socket_mode, group=self.config.socket_group,
                                     sock=self.listen_sock)
            if self.metrics_address:  # before the socket answers (a door answers as soon as it is up)
                from shmserve.metrics import MetricsServer

                metrics = await MetricsServer(self.status).start(self.metrics_address)
            n_doors = self.config.effective_doors()
            if n_doors:  # the door processes accept on the listener; main serves what they relay
                self._start_doors(loop, n_doors)
                if not await self.doors.wait_up(DOORS_UP_TIMEOUT_S):
                    log.warning("doors: not every door process is up after %.0f s; serving with those that are",
                                DOORS_UP_TIMEOUT_S)
            else:
                server = await loop.create_unix_server(self.door.protocol, sock=self.listener.sock)
            tasks.append(loop.create_task(self._heartbeat()))
            ready = sum(m.state == MODEL_READY for m in self.models.versions())
            log.info("ready: listening on %s (%d of %d models ready)", self.socket_path, ready, len(self.models))
            systemd.notify("READY=1", f"STATUS=serving {ready} of {len(self.models)} models on {self.socket_path}")
            interval = systemd.watchdog_interval()
            if interval:
                tasks.append(loop.create_task(self._watchdog(interval)))
            await stop.wait()
            log.info("shutting down: draining up to %.1f s", self.config.drain_timeout_s)
            systemd.notify("STOPPING=1", "STATUS=draining in-flight requests")
        finally:
            for task in tasks:
                task.cancel()
            if metrics is not None:
                await metrics.stop()
            await self._shutdown(server)
        log.info("stopped")
        return 0

    def _build(self, loop) -> None:
        """Sweep, create the arena, and wire the parts together (workers are not started yet)."""
        systemd.notify("STATUS=creating the arena")
        n_workers = max(self.config.max_workers, sum(m.instances for m in self.config.models))
        self.arena = Arena.create(self.config.instance, slot_count=self.config.arena_slots, max_workers=n_workers,
                                  size_classes=self.config.arena_size_classes(), socket_path=self.socket_path,
                                  max_regions=self.config.max_regions)
        self.efd = new_eventfd()
        self.supervisor = Supervisor(self.arena, self.config, self.efd, self._worker_ready, self._worker_exited)
        self.regions = RegionTable(self.arena, self.models, self.supervisor.command,
                                   max_request_bytes=self.config.max_request_bytes,
                                   limits=region_limits_of(self.config),
                                   offload=lambda work: loop.run_in_executor(None, work))
        self.supervisor.on_dropped = self.regions.worker_dropped
        self.supervisor.on_lane_failed = self.regions.lane_failed
        self.dispatcher = Dispatcher(self.arena, self.models, self.supervisor.workers, limits_of(self.config),
                                     LoopClock(loop), self.regions.deliver)
        self.lifecycle = Lifecycle(self.models, self.supervisor, self.dispatcher, self.regions, lambda: self.config,
                                   clock=self.dispatcher.clock, startup_timeout=STARTUP_TIMEOUT_S,
                                   finished=self._finished_by, failed=self._failed_by,
                                   lane_counts=self._lane_outcomes_of)
        self.dispatcher.load_on_demand = self.lifecycle.load_on_demand  # the lifecycle's hooks
        self.dispatcher.observe = self.lifecycle.observe
        self.dispatcher.offer_shadow = Shadowing(self.dispatcher, self.models, self.dispatcher.clock.monotonic).offer
        self.history = History()
        self.status = Status(config=lambda: self.config, arena=self.arena, models=self.models,
                             workers=self.supervisor.workers, dispatcher=self.dispatcher, regions=self.regions,
                             socket_path=self.socket_path, lifecycle=self.lifecycle, history=self.history)
        self.door = UnixDoor(self.dispatcher, self.regions, self.status, clock=self.dispatcher.clock,
                             limits=door_limits_of(self.config), allow_uids=self.config.allow_uids,
                             allow_gids=self.config.allow_gids, lifecycle=self.lifecycle,
                             admin=(self.config.admin_uids, self.config.admin_gids),
                             rate=RateLimiter(self.config.rate_limits))
        self.status.rate = self.door.rate  # one set of buckets for every door
        loop.add_reader(self.efd, self._on_completions)

    def _start_doors(self, loop, n: int) -> None:
        """Start ``n`` door processes on the Unix listener (docs/doors.md); every lifecycle step waits
        until each door routes by its outcome before it answers (``Lifecycle.announce``)."""
        from shmserve import logs
        from shmserve.frontend.doorhouse import DoorHouse

        root = logging.getLogger()
        fmt = "json" if any(isinstance(h.formatter, logs.JsonFormatter) for h in root.handlers) else "text"
        self.doors = DoorHouse(n, unix=self.door, regions=self.regions, models=self.models,
                               dispatcher=self.dispatcher, config=lambda: self.config, listen_sock=self.listener.sock,
                               loop=loop, log_format=fmt, verbose=root.level <= logging.DEBUG)
        self.lifecycle.announce = self.doors.sync
        self.lifecycle.on_change = self.doors.changed
        self.status.doors = self.doors.describe
        self.status.door_outcomes = self.doors.counts
        self.status.door_cancelled = self.doors.cancelled
        self.doors.start()
        log.info("doors: %d door processes serve %s", n, self.socket_path)

    async def _start_v2(self) -> None:
        """Open the KServe v2 doors the config asks for (HTTP, gRPC), over one v2 service."""
        config = self.config
        if not (config.http or config.grpc):
            return
        from shmserve.v2.auth import Authenticator, Scope
        from shmserve.v2.service import Ledger, V2Service
        from shmserve.v2.sysshm import SystemShm

        shm = SystemShm(enabled=config.v2_system_shared_memory, own={self.arena.file_id},
                        max_per_uid=config.max_regions_per_uid, max_total=config.max_regions)
        auth = Authenticator(allowed=self.door.allowed, is_admin=self.door.is_admin, tokens=load_v2_tokens(config),
                             anonymous=[Scope(s) for s in config.v2_anonymous])
        ledger = Ledger(lambda: self.config.max_inflight_per_uid, lambda: self.config.max_buffered_bytes_per_uid)
        self.v2 = V2Service(dispatcher=self.dispatcher, models=self.models, status=self.status,
                            lifecycle=self.lifecycle, shm=shm, auth=auth, ledger=ledger)
        self.v2.rate = self.door.rate  # a uid is one caller on every door
        if config.http:
            from shmserve.v2.http import HttpDoor, HttpLimits

            door = HttpDoor(self.v2, HttpLimits(max_body_bytes=2 * config.max_request_bytes + (1 << 20)),
                            door_limits_of(config), socket_mode=config.socket_mode, socket_group=config.socket_group)
            await door.start(config.http)
            self.v2_doors.append(door)
            self.status.front_doors["http"] = door.address
            log.info("v2: HTTP on %s", door.address)
        if config.grpc:
            from shmserve.v2.grpc import GrpcDoor, GrpcLimits

            door = GrpcDoor(self.v2, GrpcLimits(max_message_bytes=2 * config.max_request_bytes + (1 << 20),
                                                max_read_bytes=config.max_grpc_read_bytes,
                                                max_streams=config.max_inflight_per_connection,
                                                max_connections=config.max_connections), door_limits_of(config))
            await door.start(config.grpc)
            self.v2_doors.append(door)
            self.status.front_doors["grpc"] = door.address
            log.info("v2: gRPC on %s", door.address)

    # -- loop hooks -----------------------------------------------------------------------

    def _on_completions(self) -> None:
        drain_eventfd(self.efd)
        self.dispatcher.on_completions()

    def _worker_ready(self, w: WorkerHandle) -> None:
        version = self.models.version_of(w)
        if version is not None:
            self.regions.attach_waiting(version)
        self.dispatcher.worker_ready(w)
        self.lifecycle.worker_ready(w)

    def _worker_exited(self, w: WorkerHandle, how: str) -> None:
        try:
            self.dispatcher.worker_exited(w, how)
        finally:  # whatever happened there, the dead worker holds no region and its lanes move on
            self.regions.worker_lost(w, how)

    async def _heartbeat(self) -> None:
        while True:
            self.arena.beat()
            try:
                self.regions.watch_lanes(time.monotonic())
            except Exception:  # a bug there must not stop the heartbeat
                log.exception("watching the lanes failed")
            if self.lifecycle is not None:
                self.lifecycle.note_lane_use()
                self.lifecycle.load_for_lanes()
                self.lifecycle.note_lane_outcomes()
            if self.doors is not None:
                self.doors.changed()  # a worker's readiness changes what the doors serve themselves
            now = time.monotonic()
            if self.history.due(now):  # a sample a minute: the baseline 'shmserve doctor' compares with
                self.history.record(self.status.sample(now))
            await asyncio.sleep(HEARTBEAT_S)

    def _finished_by(self, w: WorkerHandle) -> int:
        """Requests worker ``w`` has finished (its entry in the arena's worker table)."""
        return self.arena.worker_counter(w.index, "requests")

    def _failed_by(self, w: WorkerHandle) -> int:
        """Of those, the ones it answered with an error."""
        return self.arena.worker_counter(w.index, "errors")

    def _lane_outcomes_of(self, w: WorkerHandle) -> tuple[int, tuple[int, ...]]:
        """Worker ``w``'s lane outcomes (``layout.read_lane_outcomes``): its faults and bucket counts."""
        return layout.read_lane_outcomes(self.arena.buf, self.arena.geometry, w.index)

    async def _watchdog(self, interval: float) -> None:
        """Feed systemd's watchdog only while the loop runs on time and no worker is wedged (the
        supervisor terminates a wedged worker; feeding resumes once it is back)."""
        expected = time.monotonic() + interval
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            late = now - expected
            expected = now + interval
            wedged = self.supervisor.wedged()
            if wedged:
                names = ", ".join(f"{w.index} ({w.model.name}, pid {w.pid})" for w in wedged)
                log.error("not feeding the watchdog: worker(s) %s have not beaten for %.0f s", names,
                          self.config.worker_timeout_s)
                systemd.notify(f"STATUS=worker(s) {names} not responding")
                continue
            if late > interval:
                log.warning("event loop ran %.2f s late", late)
            systemd.notify("WATCHDOG=1")

    # -- reload ---------------------------------------------------------------------------

    async def reload(self) -> None:
        """SIGHUP: re-read the config file; apply what can change while serving.

        Applied: request and queue limits, what one client can make the server hold
        (``config.CLIENT_LIMIT_KEYS`` and the region limits: for connections already open too, but
        one over a new connection limit is not closed), the allow-lists and admin lists, the v2
        doors' tokens and what anonymous callers may do (``v2_tokens``, ``v2_anonymous``: for the
        next request), ``max_buffered_bytes_per_uid``, the rate limits (``_apply_rate_limits``),
        restart_healthy_s, the lifecycle keys, and every difference in the models (the config
        file's and the repository's): added ones are loaded, removed ones drained and unloaded,
        changed ones get new workers (started and warmed first), a changed instance count is
        scaled (``Lifecycle.apply``).  Not applied (logged; needs a restart): instance, socket,
        arena geometry (slots, size classes, max_request_bytes, max_workers, max_regions), spin,
        the v2 doors' addresses and ``max_grpc_read_bytes``.
        """
        if self.config_path is None:
            if self.config.model_repository:  # serve --model-repository alone: look at the repository again
                done = await self.lifecycle.apply()
                log.info("reload: repository read again (%s)", "; ".join(done) or "no model changed")
            else:
                log.warning("reload: started without --config or --model-repository; nothing to reload")
            return
        from shmserve import config as cfgmod

        systemd.notify("RELOADING=1", f"MONOTONIC_USEC={systemd.monotonic_usec()}", "STATUS=reloading")
        try:
            new = cfgmod.load(self.config_path, instance=self.config.instance,
                              repository_given=self.repository_override is not None)
        except cfgmod.ConfigError as exc:
            log.error("reload: %s; keeping the running configuration", exc)
            systemd.notify("READY=1", "STATUS=reload failed: configuration error; still serving")
            return
        tokens = None
        if self.v2 is not None:
            try:
                tokens = load_v2_tokens(new)
            except SystemExit as exc:
                log.error("reload: %s; keeping the running configuration", str(exc).removeprefix("shmserve serve: "))
                systemd.notify("READY=1", "STATUS=reload failed: v2 token file error; still serving")
                return
        old = self.config
        fixed = [k for k in ("socket", "arena_slots", "size_classes", "max_request_bytes", "spin_us", "max_workers",
                             "socket_mode", "socket_group", "max_regions", "http", "grpc",
                             "v2_system_shared_memory", "max_grpc_read_bytes") if getattr(new, k) != getattr(old, k)]
        if self.repository_override is not None:  # serve --model-repository wins over the file
            new = dataclasses.replace(new, model_repository=self.repository_override)
        self.config = dataclasses.replace(
            old, request_timeout_s=new.request_timeout_s, drain_timeout_s=new.drain_timeout_s,
            max_waiting=new.max_waiting, max_inflight_per_connection=new.max_inflight_per_connection,
            allow_uids=new.allow_uids, allow_gids=new.allow_gids, worker_timeout_s=new.worker_timeout_s,
            max_regions_per_connection=new.max_regions_per_connection,
            max_regions_per_uid=new.max_regions_per_uid,
            max_region_bytes_per_connection=new.max_region_bytes_per_connection,
            max_region_bytes_per_uid=new.max_region_bytes_per_uid,
            restart_healthy_s=new.restart_healthy_s, models=new.models, model_repository=new.model_repository,
            admin_uids=new.admin_uids, admin_gids=new.admin_gids,
            version_drain_timeout_s=new.version_drain_timeout_s, memory_budget=new.memory_budget,
            v2_tokens=new.v2_tokens, v2_anonymous=new.v2_anonymous,
            max_buffered_bytes_per_uid=new.max_buffered_bytes_per_uid)
        self.config = dataclasses.replace(self.config, **{key: getattr(new, key) for key in cfgmod.CLIENT_LIMIT_KEYS})
        self.supervisor.config = self.config
        self.dispatcher.limits = limits_of(self.config)
        self.regions.limits = region_limits_of(self.config)
        self.door.limits = door_limits_of(self.config)
        for door in self.v2_doors:
            door.door_limits = door_limits_of(self.config)
        self.door.set_access(self.config.allow_uids, self.config.allow_gids)
        self.door.admin = (self.config.admin_uids, self.config.admin_gids)
        if new.rate_limits != old.rate_limits:
            self._apply_rate_limits(new.rate_limits)
        if self.v2 is not None:
            from shmserve.v2.auth import Scope

            self.v2.auth.configure(tokens, [Scope(s) for s in self.config.v2_anonymous])
        if fixed:
            log.warning("reload: not applied (needs a restart): %s", ", ".join(sorted(set(fixed))))
        done = await self.lifecycle.apply()
        log.info("reload: done (%s)", "; ".join(done) or "no model changed")
        systemd.notify("READY=1", f"STATUS=serving on {self.socket_path} (reloaded)")

    def _apply_rate_limits(self, limits) -> None:
        """A reload's ``[rate_limits]``: in force for the next request (an unchanged limit keeps its
        buckets); lanes whose owners a limit now holds are diverted to the socket, the others not
        (``RegionTable.divert_where``); door processes relay the models a limit covers."""
        self.config = dataclasses.replace(self.config, rate_limits=limits)
        rate = self.door.rate
        rate.configure(limits)
        diverted = self.regions.divert_where(
            lambda r: isinstance(r.owner, ClientConnection) and rate.covering(r.owner.caller(), r.lane_model.name))
        if self.doors is not None:
            self.doors.changed()
        log.info("reload: %d rate limit(s) in force; %d lane(s) diverted to the socket", len(limits), diverted)

    # -- shutdown -------------------------------------------------------------------------

    async def _shutdown(self, server) -> None:
        if self.supervisor is not None:
            self.supervisor.stopping = True  # a worker dying now is not restarted
        if self.lifecycle is not None:
            await self.lifecycle.stop()
        if self.arena is None:
            return
        self.arena.set_state(layout.ARENA_STOPPING)
        if server is not None:
            server.close()
        if self.listener is not None:
            self.listener.remove()
        for door in self.v2_doors:  # stop taking new v2 requests; those in flight drain below
            await door.stop_listening()
        if self.doors is not None:  # the doors accept no more; their lane calls in flight are answered
            await self.doors.drain(self.config.drain_timeout_s)
        if self.dispatcher is not None:
            self.dispatcher.stop_admitting()
            self.regions.divert_all()  # Client.infer over the socket now: answered SHUTTING_DOWN
            if self.doors is not None:
                self.doors.changed()  # the doors relay everything now: main answers SHUTTING_DOWN
            deadline = time.monotonic() + self.config.drain_timeout_s
            while (self.dispatcher.in_flight or self.regions.lanes_pending()) and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            self.dispatcher.fail_in_flight()
        if self.door is not None:
            deadline = time.monotonic() + FLUSH_AT_EXIT_S
            while time.monotonic() < deadline and self.door.unflushed():
                await asyncio.sleep(DRAIN_POLL_S)

        for door in self.v2_doors:
            await door.close()
        if self.v2 is not None:
            self.v2.shm.close_all()
        if self.supervisor is not None:
            await self.supervisor.stop_all()
        # The workers are gone: lane calls still queued or running are failed (the front-end is the
        # completion rings' only producer now) while their clients' connections are still open, so
        # that they read SHUTTING_DOWN rather than a closed connection.
        if self.regions is not None and self.regions.fail_pending_lanes(ErrorCode.SHUTTING_DOWN,
                                                                        "the server is shutting down"):
            await asyncio.sleep(2 * WAIT_SLICE_S)  # (their clients look at the status word that often)
        if self.doors is not None:  # after the lane calls' SHUTTING_DOWN: their clients' connections end with them
            await self.doors.stop()
        if self.door is not None:
            self.door.close_all()
            await asyncio.sleep(0)
        if self.efd is not None:
            asyncio.get_running_loop().remove_reader(self.efd)
            os.close(self.efd)
        if self.regions is not None:
            self.regions.close_all()
        if self.dispatcher is not None:
            self.dispatcher.view.release()
        self.arena.unlink()
        try:
            self.arena.close()
        except BufferError:
            log.warning("arena still exported at exit; the kernel unmaps it")


def serve(config: ServerConfig, socket_path: str, *, listen_sock: socket.socket | None = None,
          config_path: str | None = None, metrics_address: str | None = None,
          repository_override: str | None = None) -> int:
    """Run the front-end until SIGTERM/SIGINT; returns the exit status (0 after a clean stop).
    ``repository_override``: serve --model-repository (kept over the config file's on reload)."""
    import uvloop

    return uvloop.run(Frontend(config, socket_path, listen_sock=listen_sock, config_path=config_path,
                               metrics_address=metrics_address, repository_override=repository_override).run())
