"""Main's side of the door processes: start them, restart them, tell them the models, serve their relays.

Owns: ``DoorHouse`` — the N door processes (``python -P -m shmserve.doors``,
each handed the Unix listening socket, one end of a link and the uid ledger
they share: ``doors.ledger``), restarted with back-off when one dies (its
connections end; its lanes are released: they are recorded under the door's
pid and owned by its desk; its column of the ledger is zeroed once it is
waited for), the ledger's rows (one per uid with connections open through
the doors, named in ``admit``), the ``models`` message
every door routes by (sent to every door when it starts and on every
lifecycle change: ``sync`` returns once every live door has applied it), the
doors' state for ``info`` and metrics (``describe``), and draining and
stopping them at shutdown.  ``DoorDesk`` — one door: its link's messages
(``conn``, ``frame``, ``eof``, ``gone``: its connections, served by ``relay.Relay``;
``open_lane``, ``close_lane``: lanes for it from the region table, woken by
the eventfd it sends; ``report``: its counts and stats; ``synced``,
``drained``).

Lifecycle of a door (``DoorDesk.state``)::

    starting --hello--> up --link closed or process gone--> down --back-off--> starting
    any --stop--> stopped

Must not: serve a client's bytes itself (the relayed connection does, through
the Unix door's code), or decide a route (a door routes by the models message
exactly as ``Models.resolve`` would; whatever it cannot, it relays).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from shmserve import layout
from shmserve.doors.ledger import RowBook, UidLedger
from shmserve.doors.link import Link
from shmserve.errors import ShmserveError
from shmserve.frontend.models import MODEL_READY, SERVING
from shmserve.frontend.relay import Relay
from shmserve.doorkit import LISTEN_BACKLOG
from shmserve.protocol import REGION_SLACK

log = logging.getLogger("shmserve.doors")

RESTART_BACKOFF_S = (0.1, 5.0)  # first delay, longest (doubled per death within HEALTHY_S)
HEALTHY_S = 10.0  # a door up this long starts its back-off again from the first delay
SYNC_TIMEOUT_S = 2.0  # how long ``sync`` waits for a door to apply a models message
STOP_TIMEOUT_S = 2.0  # SIGTERM, then SIGKILL after this


class DoorDesk:
    """One door process and its link (see the module)."""

    def __init__(self, house: "DoorHouse", index: int):
        self.house, self.index = house, index
        self.proc: subprocess.Popen | None = None
        self.link: Link | None = None
        self.relay: Relay | None = None
        self.state = "down"
        self.restarts = 0
        self.streak = 0
        self.started_at = 0.0
        self.bells: dict[int, int] = {}  # lane region -> the door's eventfd (ours to close with the lane)
        self.counts: dict[tuple, int] = {}  # (model, version, outcome) -> n, as the door last reported
        self.cancelled: dict[tuple, int] = {}  # (model, version, stage) -> its lane calls given up on, likewise
        self.stats: dict = {}
        self.synced_seq = 0
        self.drained = asyncio.Event()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, listen_sock: socket.socket) -> None:
        house = self.house
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            ledger = house.ledger
            argv = [sys.executable, "-P", "-m", "shmserve.doors", "--index", str(self.index), "--link-fd",
                    str(theirs.fileno()), "--listen-fd", str(listen_sock.fileno()), "--ledger-fd",
                    str(house.ledger_fd), "--ledger-rows", str(ledger.rows), "--ledger-columns", str(ledger.columns),
                    "--log-format", house.log_format]
            if house.verbose:
                argv.append("--verbose")
            self.proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(), listen_sock.fileno(), house.ledger_fd))
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.state = "starting"
        self.started_at = time.monotonic()
        self.drained.clear()
        self.link = Link(ours, house.loop, self.on_message, self.on_closed)
        self.relay = Relay(house.unix, self.link, self.index, house.rows)
        self.link.send(house.models_message())

    # -- the door's messages ------------------------------------------------------------------

    def on_message(self, meta: dict, data: bytes, fds: list[int]) -> None:
        op, relay = meta.get("op"), self.relay
        try:
            if op == "frame":
                relay.frame(meta.get("c"), data)
            elif op == "conn":
                relay.opened(meta.get("c"), meta.get("pid", -1), meta.get("uid", -1), meta.get("gid", -1),
                             meta.get("groups", ()))
            elif op == "gone":
                relay.lost(meta.get("c"))
            elif op == "eof":
                relay.eof(meta.get("c"))
            elif op == "report":
                self.counts = {(m, v, o): n for m, v, o, n in meta.get("counts", ())}
                self.cancelled = {(m, v, s): n for m, v, s, n in meta.get("cancelled", ())}
                self.stats = meta.get("stats", {})
            elif op == "open_lane":
                self.open_lane(meta, fds)
                fds = []
            elif op == "close_lane":
                self.close_lane(meta.get("region"))
            elif op == "synced":
                self.synced_seq = max(self.synced_seq, int(meta.get("seq") or 0))
                self.house.synced.set()
            elif op == "hello":
                self.state = "up"
                log.info("door %d up (pid %d)", self.index, self.pid)
                # The door's listen() (its loop's, on the inherited socket) made it the listener's peer
                # for SO_PEERCRED; main's again, so that a probe (socket_left_by_the_dead) names main.
                self.house.listen_sock.listen(LISTEN_BACKLOG)
            elif op == "drained":
                self.drained.set()
        finally:
            for fd in fds:
                os.close(fd)

    def open_lane(self, meta: dict, fds: list[int]) -> None:
        """A lane of ``meta``'s model version for the door, woken by the eventfd it sent."""
        house, model, version = self.house, meta.get("model"), meta.get("version")
        answer = {"op": "lane", "model": model, "version": version}
        bell = fds[0] if len(fds) == 1 else -1
        for fd in fds[1:]:
            os.close(fd)
        if bell < 0 or type(version) is not int or house.stopping:
            if bell >= 0:
                os.close(bell)
            self.link.send({**answer, "error": "not now"})
            return
        size = min(house.lane_bytes, house.regions.max_request_bytes + REGION_SLACK) - layout.LANE_BYTES
        try:
            region = house.regions.open(self, size, model, uid=os.getuid(), pid=self.pid or 0, version=version,
                                        bell=bell)
        except ShmserveError as exc:
            os.close(bell)
            self.link.send({**answer, "error": exc.message})
            return
        self.bells[region.id] = bell
        self.link.send({**answer, "region": region.id, "size": region.size}, fds=[region.fd])

    def close_lane(self, region_id) -> None:
        if type(region_id) is not int or region_id not in self.bells:
            return
        try:
            self.house.regions.close(self, region_id)
        except ShmserveError:
            pass
        os.close(self.bells.pop(region_id))

    # -- its end --------------------------------------------------------------------------------

    def on_closed(self) -> None:
        """The link is gone: the door died (or was stopped).  Its connections end, its lanes are
        released, and it is restarted after a back-off unless the server is stopping."""
        house = self.house
        if self.relay is not None:
            self.relay.lose_all()
        house.regions.drop_owner(self)
        for bell in self.bells.values():
            os.close(bell)
        self.bells.clear()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        # Dead now (waited for): what it held of each uid's limits is free again.
        requests, nbytes = house.ledger.clear_column(self.index, list(house.rows.row_of.values()))
        if requests or nbytes:
            log.info("door %d held %d requests and %d bytes of its callers' limits; released", self.index, requests,
                     nbytes)
        self.drained.set()
        if self.state == "stopped":
            return
        how = "exited" if proc is None or proc.returncode is None else \
            f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        self.state = "down"
        if house.stopping:
            return
        healthy = time.monotonic() - self.started_at >= HEALTHY_S
        self.streak = 0 if healthy else self.streak + 1
        first, longest = RESTART_BACKOFF_S
        delay = min(longest, first * 2 ** max(0, self.streak - 1))
        log.warning("door %d (pid %s) %s; restarting it in %.1f s", self.index, self.pid, how, delay)
        house.loop.call_later(delay, self.restart)

    def restart(self) -> None:
        house = self.house
        if house.stopping or self.state != "down":
            return
        self.restarts += 1
        try:
            self.start(house.listen_sock)
        except OSError as exc:
            log.error("door %d cannot start: %s", self.index, exc)
            self.state = "down"
            house.loop.call_later(RESTART_BACKOFF_S[1], self.restart)

    def describe(self) -> dict:
        return {"index": self.index, "pid": self.pid, "up": self.state == "up", "state": self.state,
                "restarts": self.restarts, "connections": len(self.relay) if self.relay is not None else 0,
                "lanes": len(self.bells), "in_flight": self.stats.get("in_flight", 0),
                "relayed": self.stats.get("relayed", 0), "held_requests": self.stats.get("held_requests", 0),
                "refused": self.stats.get("refused", 0), "held_bytes": self.stats.get("held_bytes", 0),
                "unsent_bytes": self.stats.get("unsent_bytes", 0)}


class DoorHouse:
    """The door processes of this server (see the module)."""

    def __init__(self, n: int, *, unix, regions, models, dispatcher, config, listen_sock: socket.socket, loop,
                 log_format: str = "text", verbose: bool = False):
        self.unix, self.regions, self.models, self.dispatcher = unix, regions, models, dispatcher
        self.config = config  # a callable: the configuration now
        self.listen_sock, self.loop = listen_sock, loop
        self.log_format, self.verbose = log_format, verbose
        self.lane_bytes = config().door_lane_bytes
        # Every uid's requests and buffered bytes across the doors (doors/ledger.py); a column per door.
        self.ledger, self.ledger_fd = UidLedger.create(n)
        self.rows = RowBook(self.ledger)
        self.desks = [DoorDesk(self, i) for i in range(n)]
        self.stopping = False
        self.seq = 0
        self.synced = asyncio.Event()
        self.last_message: dict | None = None

    def start(self) -> None:
        for desk in self.desks:
            desk.start(self.listen_sock)

    async def wait_up(self, timeout: float) -> bool:
        """Wait (up to ``timeout`` s) until every door has said hello; whether they all have."""
        deadline = time.monotonic() + timeout
        while any(d.state != "up" for d in self.desks):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    # -- the models message ------------------------------------------------------------------

    def models_message(self) -> dict:
        regions, dispatcher = self.regions, self.dispatcher
        models = {}
        for name, model in self.models.by_name.items():
            versions = {}
            for number, v in model.versions.items():
                spec = v.spec
                versions[str(number)] = {"id": model.index, "serving": v.phase == SERVING and v.state == MODEL_READY,
                                         "workers": len(v.workers), "max_output_bytes": v.config.max_output_bytes,
                                         "spec": spec.to_dict() if spec is not None else None}
            models[name] = {"default": model.default, "versions": versions,
                            "rollout": model.rollout is not None or regions.divert_every,
                            "limited": self.unix.rate.model_limited(name)}  # main keeps its rate limits
        config = self.config()
        return {"op": "models", "seq": self.seq, "stopping": dispatcher.stopping or self.stopping,
                "max_request_bytes": dispatcher.max_request, "models": models,
                "limits": {"max_inflight_per_connection": config.max_inflight_per_connection,
                           "request_timeout_s": config.request_timeout_s,
                           "max_inflight_per_uid": config.max_inflight_per_uid,
                           "max_buffered_bytes_per_uid": config.max_buffered_bytes_per_uid,
                           "stall_timeout_s": config.stall_timeout_s, "frame_timeout_s": config.frame_timeout_s,
                           "upload_timeout_s": config.upload_timeout_s}}

    def changed(self) -> None:
        """Something the doors route by may have changed: send the models message if it did."""
        message = self.models_message()
        if message == self.last_message:
            return
        self.last_message = dict(message)
        self.seq += 1
        message["seq"] = self.seq
        for desk in self.desks:
            if desk.link is not None and not desk.link.closed:
                desk.link.send(message)

    async def sync(self) -> None:
        """Send the models message and wait (up to SYNC_TIMEOUT_S) until every live door applied it."""
        self.last_message = None
        self.changed()
        seq = self.seq
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while time.monotonic() < deadline:
            waiting = [d for d in self.desks if d.link is not None and not d.link.closed and d.state == "up"
                       and d.synced_seq < seq]
            if not waiting:
                return
            self.synced.clear()
            try:
                await asyncio.wait_for(self.synced.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
        log.warning("doors: not every door applied the models message within %.1f s", SYNC_TIMEOUT_S)

    # -- state ----------------------------------------------------------------------------------

    def describe(self) -> list[dict]:
        return [desk.describe() for desk in self.desks]

    def counts(self) -> collections.Counter:
        """Every door's outcome counts, summed: (model, version, outcome) -> n."""
        total: collections.Counter = collections.Counter()
        for desk in self.desks:
            total.update(desk.counts)
        return total

    def cancelled(self) -> collections.Counter:
        """Every door's lane calls given up on, summed: (model, version, stage) -> n."""
        total: collections.Counter = collections.Counter()
        for desk in self.desks:
            total.update(desk.cancelled)
        return total

    # -- the end --------------------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """Stop every door accepting and wait (up to ``timeout``) until its lane calls in flight are
        answered; their connections stay (main answers what they relay)."""
        live = [d for d in self.desks if d.link is not None and not d.link.closed]
        for desk in live:
            desk.link.send({"op": "drain"})
        if live:
            await asyncio.wait([asyncio.ensure_future(d.drained.wait()) for d in live], timeout=timeout)

    async def stop(self) -> None:
        """Stop every door: what main wrote to them is sent first (bounded), then SIGTERM, then SIGKILL."""
        self.stopping = True
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline and any(d.link is not None and d.link.pending for d in self.desks):
            await asyncio.sleep(0.01)
        for desk in self.desks:
            if desk.proc is not None and desk.proc.poll() is None:
                desk.proc.send_signal(signal.SIGTERM)
        while time.monotonic() < deadline + STOP_TIMEOUT_S and any(
                d.proc is not None and d.proc.poll() is None for d in self.desks):
            await asyncio.sleep(0.01)
        for desk in self.desks:
            desk.state = "stopped"
            if desk.link is not None:
                desk.link.close()
        if self.ledger_fd >= 0:
            os.close(self.ledger_fd)
            self.ledger_fd = -1
