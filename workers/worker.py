"""A worker's life after the arena is mapped: open everything in order, then serve until told to stop.

Owns: ``open_worker``, which enters everything a worker holds on one
``contextlib.ExitStack`` in the order it must be released in reverse:

    arena mapping (the caller)  ->  arena page-locked (GPU)  ->  heartbeat
    ->  backend (loaded, warmed, its memory measured)  ->  client regions (each unregistered, then unmapped)

so regions go first, then the backend closes, the heartbeat stops, the
arena is unregistered and only then unmapped.  And the serve loop
(``Worker``): the worker's state in the worker table, waiting on its own
submission ring and its lanes' at once, the front-end's commands on its
ring (stop, attach a lane — again: look at its queue again —, drop a region:
unmapped as soon as no request in hand uses it, busy or idle), orphan
detection, holding what it gathered in a ``shmserve.scheduling.Scheduler``
(each slot's priority, deadline and flags read, untrusted, before the
claim; the caller: an arena slot's ``caller`` field, a lane's region) and
handing requests in its order to ``workers.step`` one by one or to
``workers.batching`` (under the default policy, without batching, what one
look brings in ``scheduling.in_turn``'s order, each request checked, claimed
and counted in one ``hotpath.claim_checked``), answering those it expired or refused (``timeout``,
``overloaded``) unrun, the scheduling counters in the arena
(``layout.sched_base``), and when to tell the front-end the step's
input-signature counts (at most once a second while busy, at once when
idle: ``tell_signatures_now``).

Must not: parse arguments, handle signals or talk on the control socket
(``workers.main`` hands it the callables that do), look inside a request
(``workers.step``), or decide the order of requests (``shmserve.scheduling``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable

from shmserve import _atomics as atomics
from shmserve import hotpath, lanes, layout, workerlink
from shmserve.arena import Arena
from shmserve.config import ModelConfig
from shmserve.errors import ErrorCode
from shmserve.scheduling import LANE_CALLERS, Policy, Scheduler, lane_caller
from shmserve.scheduling import in_turn as scheduling_in_turn
from shmserve.rings import EventfdDoorbell, Ring, wait_any
from workers import memory
from workers.adapter import BackendAdapter
from workers.batching import Batcher, batchable
from workers.regions import GpuMemory, RegionCache
from workers.step import RequestFailed, Space, Step

CPUS = os.cpu_count() or 1
IDLE_TICK_S = 0.5  # heartbeat period, and how often an idle worker looks for orphaning
SIGNATURES_EVERY_S = 1.0  # the most often a busy worker tells the front-end its input-signature counts
HEARTBEAT_JOIN_S = 2.0  # the heartbeat thread writes into the arena: it is joined before the arena is unmapped
_claim_checked = hotpath.active.claim_checked  # serve_alone's and serve_in_turn's claim: compiled, or the reference
MAX_CALLERS_REMEMBERED = 1 << 16  # in_turn's memory of when each caller was last served, at most


def caller_key(space: Space, caller: int) -> int:
    """The key a request is scheduled under for fairness (``shmserve.scheduling``), from its slot's
    ``caller`` field: an arena slot's as written (the front-end wrote it); a client's lane is one
    caller, its region (what its client writes is not taken); a door process's lane (the
    server's own) is one caller per connection the door wrote, apart from every other lane."""
    if not space.is_lane:
        return caller
    return lane_caller(space.region, caller if space.wake == hotpath.LANE_EVENTFD else None)


_CALLER = layout.U32  # a slot's caller field, read without a call into layout: in_turn's cost is per request
_CALLER_OFF, _SLOT_SIZE, _INDEX = layout.SLOT.offset("caller"), layout.SLOT_SIZE, layout.ENTRY_INDEX_MASK


def gathered_key(space: Space, entry: int) -> int:
    """The ``caller_key`` of a gathered request (ring ``entry`` of ``space``): a client's lane needs
    no read; an arena or door-lane slot's caller is read from it (an entry out of range: caller 0)."""
    if space.wake == hotpath.LANE_FUTEX:  # a client's lane: lane_caller(region), inline
        return LANE_CALLERS + space.region
    index, g, caller = entry & _INDEX, space.geometry, 0
    if index < g.slot_count:
        caller = _CALLER.unpack_from(space.buf, g.slot_table_off + index * _SLOT_SIZE + _CALLER_OFF)[0]
    return caller_key(space, caller)


def in_turn(work: list[tuple[Space, int]], last_served: dict[int, int]) -> list[tuple[int, Space, int]]:
    """``work`` (gathered: (space, entry)) as (caller key, space, entry) in ``scheduling.in_turn``'s
    order (each request's caller: ``gathered_key``)."""
    return scheduling_in_turn([(gathered_key(space, entry), space, entry) for space, entry in work], last_served)


class StartFailed(Exception):
    """The worker cannot start: ``message`` for the front-end, ``exit_code`` (``workerlink``) to exit with."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code, self.message = exit_code, message


def device_unusable(config: ModelConfig, exc: Exception) -> StartFailed:
    """No device, no cuda-python, or page-locking refused (memlock): a host problem, not retried."""
    return StartFailed(workerlink.EXIT_ARENA_FAILED, f"cannot use {config.device} for model {config.name!r}: {exc}")


@contextlib.contextmanager
def heartbeat(arena: Arena, index: int):
    """Beat in the worker table from a thread every IDLE_TICK_S, busy or idle, inside the block: the
    front-end's watchdog reads it.  It stops only when the whole process stops (SIGSTOP, a hang in
    the kernel, death) or the block ends."""
    buf, offset = arena.buf, arena.geometry.worker_off(index) + layout.WORKER.offset("heartbeat_ns")
    stop = threading.Event()

    def beat():
        while not stop.wait(IDLE_TICK_S):
            atomics.store64(buf, offset, time.monotonic_ns())

    atomics.store64(buf, offset, time.monotonic_ns())
    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(HEARTBEAT_JOIN_S)


def open_worker(stack: contextlib.ExitStack, arena: Arena, index: int, config: ModelConfig, completion_fd: int,
                spin_s: float, fetch_regions: Callable[[], list[tuple[int, int, int]]],
                gpu: GpuMemory | None = None, tell_dropped: Callable[[int], None] = lambda region: None,
                tell_lane_failed: Callable[[int, str], None] = lambda region, why: None,
                tell_signatures: Callable[[dict], None] = lambda counts: None) -> "Worker":
    """Everything worker ``index`` holds, entered on ``stack`` above ``arena``'s mapping (which the
    caller entered first); a Worker ready to serve.  ``fetch_regions``: the region descriptors the
    front-end has sent (``RegionCache``); ``tell_dropped(region)``: tells it a region it closed
    is dropped here; ``tell_lane_failed(region, why)``: that a lane it attached cannot be served.  ``gpu``: the device's page-locked memory on a
    GPU worker (the arena is registered with it here, before the model loads: DESIGN.md section 6).

    The Worker carries what the ready message tells besides the spec: ``memory`` (``workers.memory``,
    measured after warm-up), ``warmup`` (runs and seconds) and ``threads`` (its runtime's pools).
    ``tell_signatures(counts)`` tells the front-end how many requests brought an input signature the
    worker had not met (``Worker.tell_signatures_now``).

    Raises StartFailed: EXIT_ARENA_FAILED if the arena cannot be page-locked (or the device's memory
    use read), EXIT_LOAD_FAILED if the model cannot be loaded and warmed up.  What was entered so far unwinds with ``stack``.
    """
    arena_registration = None
    if gpu is not None:
        try:
            arena_registration = stack.enter_context(gpu.locked(arena.buf, f"arena {arena.name}"))
        except Exception as exc:
            raise device_unusable(config, exc) from None
    stack.enter_context(heartbeat(arena, index))  # loading a large model takes a while: be seen alive
    device_before = _device_bytes(gpu, config)
    try:
        adapter = stack.enter_context(BackendAdapter.load(config))
        spec = adapter.prepare(config, gpu.memory if gpu is not None else None)
        warmed = adapter.warm_up(config, spec)
        own_device_bytes = adapter.device_bytes() if gpu is not None else None
        threads = adapter.threads()
    except Exception as exc:
        raise StartFailed(workerlink.EXIT_LOAD_FAILED,
                          f"cannot load model {config.name!r} ({config.backend}, {config.path}): "
                          f"{type(exc).__name__}: {exc}") from None
    used = memory.measured(own_device_bytes, device_before, _device_bytes(gpu, config))
    regions = stack.enter_context(RegionCache(fetch_regions, gpu))
    gpu_info = gpu.describe(arena_registration) if gpu is not None else None
    step = Step(arena, index, regions, adapter, spec, config.version, config.max_output_bytes)
    return Worker(arena, index, config, completion_fd, spin_s, step, gpu_info, tell_dropped, tell_lane_failed,
                  memory=used, warmup=warmed.to_dict(), threads=threads, tell_signatures=tell_signatures)


def _device_bytes(gpu: GpuMemory | None, config: ModelConfig) -> int | None:
    """The device's memory in use now (None on a CPU worker); StartFailed if CUDA cannot tell."""
    if gpu is None:
        return None
    try:
        return gpu.bytes_in_use()
    except Exception as exc:
        raise device_unusable(config, exc) from None


class Worker:
    """The serve loop of worker ``index``: its own ring (``main``) and the lanes attached to it.

    ``spec`` is the model's final spec, ``gpu_info`` what the GPU
    registered (None on a CPU worker), ``memory`` what the worker uses and
    ``warmup`` what its warm-up ran (``open_worker``), for the ready message.  Implements
    ``workers.batching.Submissions`` for the batcher.
    """

    def __init__(self, arena: Arena, index: int, config: ModelConfig, completion_fd: int, spin_s: float, step: Step,
                 gpu_info: dict | None = None, tell_dropped: Callable[[int], None] = lambda region: None,
                 tell_lane_failed: Callable[[int, str], None] = lambda region, why: None, *,
                 memory: dict | None = None, warmup: dict | None = None, threads: dict | None = None,
                 tell_signatures: Callable[[dict], None] = lambda counts: None,
                 clock: Callable[[], float] = time.monotonic):
        self.buf, self.step, self.spec, self.gpu_info = arena.buf, step, step.spec, gpu_info
        self.memory, self.warmup, self.threads = memory, warmup, threads or {}
        self.tell_signatures, self.clock = tell_signatures, clock
        self._told_signatures, self._told_short, self._told_at = 0, 0, -SIGNATURES_EVERY_S
        self.regions = step.regions
        self.state_off = arena.geometry.worker_off(index) + layout.WORKER.offset("state")
        completions = Ring.of_worker(arena, index, completion=True)
        self.main = Space(arena.buf, arena.geometry, Ring.of_worker(arena, index, completion=False), completions,
                          EventfdDoorbell(completions, completion_fd))
        self.lanes: dict[int, Space] = {}  # region id -> lane attached by the front-end
        self.dropped: set[int] = set()  # regions the front-end closed, unmapped once no work in hand uses them
        self.tell_dropped, self.tell_lane_failed = tell_dropped, tell_lane_failed
        self._rings = [self.main.submissions]
        self.spin_s = spin_s
        self.batcher = Batcher(step, config) if config.max_batch_size > 1 and batchable(step.spec) else None
        self.ppid = os.getppid()
        # What it holds, in the order it takes them (shmserve.scheduling), and its counters in the arena.
        self.sched = Scheduler(Policy.of(config))
        # Under such a policy the order of what one gather brings is settled at once: its callers in turn
        # (``serve_in_turn``), each request checked as ``Scheduler.alone`` checks one; no ticket, no
        # look at the rings between requests (that look, before every request, halved what 16 lane
        # clients got on 16 cores: 88k -> 38-50k req/s, tools/device_issue29_run.sh, 2026-12-03).
        self.in_turn_will_do = (config.priority_levels <= 1 and not config.max_queue_size
                                and (not config.default_timeout_us or config.timeout_action == "reject"))
        self.round_robin = config.fairness == "callers"
        self._queue_timeout_ns = config.default_timeout_us * 1000  # (serve_in_turn: Scheduler.alone's rule)
        # a request whose deadline is its caller's own timeout is not held to the queue timeout where that wins
        self._exempt_flags = layout.SLOT_FLAG_OWN_TIMEOUT if config.allow_timeout_override else 0
        self._last_served: dict[int, int] = {}  # caller key -> when it was last served (``in_turn``)
        self._served = 0
        self._told_demoted = self._told_expired = 0
        base = layout.sched_base(arena.geometry, index)
        self._expired_off, self._demoted_off = base + layout.SCHED_EXPIRED_OFF, base + layout.SCHED_DEMOTED_OFF
        levels = range(1, max(config.priority_levels, 1) + 1)
        self._queued_off = [0, *(layout.sched_level_off(base, level, "queued") for level in levels)]
        self._claimed_off = [0, *(layout.sched_level_off(base, level, "claimed") for level in levels)]
        self._wait_off = [0, *(layout.sched_level_off(base, level, "wait_us") for level in levels)]
        # hotpath.claim_checked's arguments after the entry and clock (serve_alone, serve_in_turn): level 1's counters
        self._checks = (self._queue_timeout_ns, self._exempt_flags, self.buf, self._claimed_off[1], self._wait_off[1])
        for level in range(1, layout.SCHED_LEVELS + 1):  # a gauge: what a predecessor in this entry held is gone
            atomics.store64(self.buf, layout.sched_level_off(base, level, "queued"), 0)

    def serve(self) -> int:
        """Serve until a stop command (EXIT_OK) or until the front-end is gone (EXIT_ORPHANED)."""
        atomics.store32(self.buf, self.state_off, layout.WORKER_READY)
        batcher, sched = self.batcher, self.sched
        solo = batcher is None  # one request alone needs no scheduler: Scheduler.alone
        in_turn = solo and self.in_turn_will_do  # what is gathered needs no scheduler either
        while True:
            if self.step.new_signatures != self._told_signatures or self.step.short_answers != self._told_short:
                # a short answer is told at once (each cost a run, which a message does not outweigh)
                self.tell_signatures_now(idle=self.step.short_answers != self._told_short)
            if not sched and not wait_any(self._rings, IDLE_TICK_S, self.spin_s):
                if self.step.new_signatures != self._told_signatures:
                    self.tell_signatures_now(idle=True)
                if os.getppid() != self.ppid:
                    return workerlink.EXIT_ORPHANED
                continue
            work, stop = self.gather()
            if solo and len(work) == 1 and not stop and not sched and not in_turn:
                self.serve_solo(*work[0])  # one request alone under a policy of several levels
                if self.dropped:
                    self._unmap_dropped()
                continue
            if in_turn and not stop and not sched:  # one level, no queue limit, nothing to delay: no scheduler
                if len(work) == 1:
                    self.serve_alone(*work[0])
                else:
                    self.serve_in_turn(work)
                if self.dropped:
                    self._unmap_dropped()
                continue
            self.hold(work)
            if batcher is not None and not stop:
                stop = batcher.run([], self)
                self._unmap_dropped()
                if not stop:
                    continue
                # a stop came while a batch gathered: run the rest, then stop
            stop = self.serve_held(stop)
            self._unmap_dropped()
            if stop:
                atomics.store32(self.buf, self.state_off, layout.WORKER_STOPPING)
                return workerlink.EXIT_OK

    def serve_held(self, stopping: bool) -> bool:
        """Serve what the worker holds one by one, in the scheduler's order, taking in what arrives
        meanwhile (unless ``stopping``: then only what it holds); whether a stop came.  Unless
        stopping, it returns to the serve loop early (the rest still held) when the loop has
        something to do: a dropped region to unmap, signature counts or a short answer to tell."""
        serve_claimed, step = self.step.serve_claimed, self.step
        while True:
            taken = self.take()
            if taken is None:
                return stopping
            serve_claimed(*taken)
            if stopping:
                continue
            if self.dropped or step.new_signatures != self._told_signatures or step.short_answers != self._told_short:
                return False
            if self.pending():
                more, stopping = self.gather()
                self.hold(more)

    def tell_signatures_now(self, idle: bool) -> None:
        """Tell the front-end the input-signature counts and the short answers (at most once a second
        while busy, unless ``idle``: a model whose inputs change shape on every call must not send a
        message per call)."""
        now = self.clock()
        if not idle and now - self._told_at < SIGNATURES_EVERY_S:
            return
        step = self.step
        self._told_signatures, self._told_short, self._told_at = step.new_signatures, step.short_answers, now
        self.tell_signatures({"new": step.new_signatures, "distinct": step.distinct_signatures,
                              "short": step.short_answers})

    # -- submissions: the worker's own ring and its lanes' -------------------------------------

    def gather(self) -> tuple[list[tuple[Space, int]], bool]:
        """Everything submitted now, in arrival order per ring: (work, stop).  Commands on the
        worker's own ring are carried out here; entries after a stop are dropped (the front-end
        fails them)."""
        work: list[tuple[Space, int]] = []
        stop = False
        main = self.main
        for entry in main.submissions.pop_all():
            if not layout.is_command(entry):
                work.append((main, entry))
                continue
            op, argument = layout.split_entry(entry)
            if op == layout.CMD_STOP:
                stop = True
                break
            if op == layout.CMD_ATTACH_LANE:
                work.extend(self._attach_lane(argument))
            elif op == layout.CMD_DROP_REGION:
                self._drop_region(argument)
        for lane in self.lanes.values():
            try:
                work.extend((lane, entry) for entry in lane.submissions.pop_all())
            except RuntimeError:  # the client corrupted its ring indices: resynchronize, drop them
                lane.submissions.discard()
        return work, stop

    # -- the order it serves them in (shmserve.scheduling) --------------------------------------

    def hold(self, work: list[tuple[Space, int]]) -> None:
        """Hand gathered entries to the scheduler, each with what its slot asks (priority, deadline,
        flags, ready time; untrusted in a lane: the scheduler clamps), under its ``caller_key``.
        A request ``max_queue_size`` refuses is answered
        OVERLOADED here."""
        sched, buf, queued = self.sched, self.buf, self._queued_off
        read = layout.read_slot_schedule
        for item in work:
            space, entry = item
            index, _ = layout.split_entry(entry)
            if index < space.geometry.slot_count:
                t_ready, priority, caller, deadline, flags = read(space.buf, space.geometry, index)
            else:  # a hostile entry: its claim fails, nothing is answered
                t_ready = priority = caller = deadline = flags = 0
            refused = sched.hold(item, priority, caller_key(space, caller), deadline, flags, t_ready)
            atomics.fetch_add64(buf, queued[sched.last_level], 1)
            for ticket in refused:
                atomics.fetch_add64(buf, queued[ticket.level], -1)
                self._answer(ticket.item, ErrorCode.OVERLOADED, sched.refusal_message())

    def serve_solo(self, space: Space, entry: int) -> None:
        """Serve the one request gathered, nothing else held (``Scheduler.alone``: its order is
        settled, only its deadline and queue timeout are checked; expired, it is answered TIMEOUT
        unrun), counted as claimed at its level, never queued."""
        sched = self.sched
        index, _ = layout.split_entry(entry)
        t_ready = priority = deadline = flags = 0
        if index < space.geometry.slot_count:
            t_ready, priority, _, deadline, flags = layout.read_slot_schedule(space.buf, space.geometry, index)
        level, why = sched.alone(priority, deadline, flags, t_ready)
        if why or sched.demoted != self._told_demoted:
            self._expired_and_demoted()
            if why:
                self._answer((space, entry), ErrorCode.TIMEOUT, sched.expiry_message(why))
                return
        index = self.step.claim(space, entry)
        if index is None:
            return
        buf, now = self.buf, time.monotonic_ns()
        atomics.fetch_add64(buf, self._claimed_off[level], 1)
        if 0 < t_ready < now:
            atomics.fetch_add64(buf, self._wait_off[level], (now - t_ready) // 1000)
        self.step.serve_claimed(space, entry, index)

    def serve_in_turn(self, work: list[tuple[Space, int]]) -> None:
        """Serve what one gather brought (nothing held, a policy of one level with no queue limit and
        nothing delayed: ``in_turn_will_do``), its callers in turn (fairness "callers": ``in_turn``,
        the caller served longest ago first; "arrival": as gathered).  Each is
        checked as ``Scheduler.alone`` checks one (its deadline, the queue timeout: expired, it is
        answered TIMEOUT unrun) and counted as claimed with its wait, in one call
        (``hotpath.claim_checked``, compiled unless SHMSERVE_HOTPATH=python): this is every
        request's path under the default policy.  A
        gather of one request is served at once (``serve_alone``); a round of several counts as
        queued at level 1 until it is done.  It does not look at the rings again until the round is
        done: what came meanwhile is the next gather's, ordered by when each caller was last served
        (a look before a round's last request made gathers smaller and cost 16 lane clients a
        quarter of their rate on the 16-core host; fairness between paths held without it)."""
        if len(work) == 1:
            self.serve_alone(*work[0])
            return
        buf, last, queued_off = self.buf, self._last_served, self._queued_off[1]
        order = in_turn(work, last) if self.round_robin else [(0, space, entry) for space, entry in work]
        atomics.fetch_add64(buf, queued_off, len(order))
        served, turn = 0, self._served
        checks, serve_claimed = self._checks, self.step.serve_claimed
        try:
            for key, space, entry in order:
                served += 1
                last[key] = turn + served
                # serve_alone's claim, inline (every request of a busy worker under the default policy)
                index = _claim_checked(space.buf, space.geometry, entry, 0, *checks)
                if index is None:  # taken back by its client or the front-end, or a hostile entry
                    continue
                if index < 0:
                    self._expired(space, entry, index)
                    continue
                serve_claimed(space, entry, index)
        finally:
            self._served = turn + served
            atomics.fetch_add64(buf, queued_off, -len(order))
            if len(last) > MAX_CALLERS_REMEMBERED:  # connections come and go: forget them all, rarely
                last.clear()

    def serve_alone(self, space: Space, entry: int) -> None:
        """``serve_in_turn`` of a gather of one request (the path of every request of one client):
        its caller's turn noted, then checked, claimed and counted in one call
        (``hotpath.claim_checked``) and served; not ours (taken back by its client or the
        front-end, or a hostile entry), nothing; expired, ``_expired``."""
        if self.round_robin:
            self._served += 1
            last = self._last_served
            last[gathered_key(space, entry)] = self._served
            if len(last) > MAX_CALLERS_REMEMBERED:  # connections come and go: forget them all, rarely
                last.clear()
        index = _claim_checked(space.buf, space.geometry, entry, 0, *self._checks)
        if index is not None:
            if index >= 0:
                self.step.serve_claimed(space, entry, index)
            else:
                self._expired(space, entry, index)

    def _expired(self, space: Space, entry: int, why: int) -> None:
        """Answer TIMEOUT, unrun, a request ``claim_checked`` found expired (``why``: EXPIRED_DEADLINE
        or EXPIRED_QUEUE), counted in the arena's expired."""
        atomics.fetch_add64(self.buf, self._expired_off, 1)
        reason = "deadline" if why == hotpath.EXPIRED_DEADLINE else "queue timeout"
        self._answer((space, entry), ErrorCode.TIMEOUT, self.sched.expiry_message(reason))

    def take(self) -> tuple[Space, int, int] | None:
        """The next request in the scheduler's order, claimed: (space, entry, slot index); None when
        none is held.  Those expired on the way are answered TIMEOUT unrun; requests claimed are
        counted (claimed, their wait) by level."""
        sched, buf = self.sched, self.buf
        claim = self.step.claim
        while True:
            ticket = sched.take()
            if sched.expired_count != self._told_expired or sched.demoted != self._told_demoted:
                self._expired_and_demoted()
            if ticket is None:
                return None
            level = ticket.level
            atomics.fetch_add64(buf, self._queued_off[level], -1)
            space, entry = ticket.item
            index = claim(space, entry)
            if index is None:  # taken back by its client or the front-end, or a hostile entry
                continue
            atomics.fetch_add64(buf, self._claimed_off[level], 1)
            wait = time.monotonic_ns() - ticket.t_ready
            if wait > 0:
                atomics.fetch_add64(buf, self._wait_off[level], wait // 1000)
            return space, entry, index

    def _expired_and_demoted(self) -> None:
        """Answer TIMEOUT what expired unrun, and count in the arena what expired and was delayed."""
        sched, buf = self.sched, self.buf
        if sched.demoted != self._told_demoted:
            atomics.fetch_add64(buf, self._demoted_off, sched.demoted - self._told_demoted)
            self._told_demoted = sched.demoted
        if sched.expired_count != self._told_expired:
            atomics.fetch_add64(buf, self._expired_off, sched.expired_count - self._told_expired)
            self._told_expired = sched.expired_count
        for ticket in sched.expired():
            atomics.fetch_add64(buf, self._queued_off[ticket.level], -1)
            self._answer(ticket.item, ErrorCode.TIMEOUT, sched.expiry_message(ticket.why))

    def _answer(self, item: tuple[Space, int], code: ErrorCode, message: str) -> None:
        """Answer a held request with an error without running it (nothing if it is not ours to
        claim: taken back meanwhile)."""
        space, entry = item
        index = self.step.claim(space, entry)
        if index is not None:
            self.step.finish(space, entry, index, 0, (code, message))

    def held(self) -> list[tuple[Space, int]]:
        """What the worker holds and has not run yet, in no order."""
        return [ticket.item for ticket in self.sched.waiting()]

    def wait_for_more(self, timeout: float) -> bool:
        # Spinning here would take the CPU from the very clients whose requests we wait for
        # once they outnumber the cores: then sleep (futex) until one arrives.
        spin = min(timeout, self.spin_s) if len(self.lanes) <= CPUS // 2 else 0.0
        return wait_any(self._rings, timeout, spin)

    def pending(self) -> bool:
        return any(not ring.empty() for ring in self._rings)

    def _attach_lane(self, region: int) -> list[tuple[Space, int]]:
        """Serve the queue at the start of client region ``region`` (front-end command); the calls
        already queued in it (a worker before this one may have taken them off the ring and died
        or retired before claiming them: ``lanes.queued_entries``).  A lane served already is
        looked at again: the front-end says a call has waited READY in it too long
        (``RegionTable.watch_lanes``); a claim of one in hand already fails, harmlessly."""
        space = self.lanes.get(region)
        if space is not None:  # (those it holds already are not held twice: they would count twice)
            held = set(self.held())
            return [(space, entry) for entry in lanes.queued_entries(space.buf) if (space, entry) not in held]
        try:
            self.regions.ensure(region)
        except RequestFailed as exc:  # not mapped (no memory, no descriptor left) or not page-locked
            self.tell_lane_failed(region, exc.message)
            return []
        buf = self.regions.maps[region]
        if not lanes.usable(self.regions.sizes[region]):
            self.tell_lane_failed(region, "too small for a lane")
            return []
        submissions, completions, doorbell = lanes.worker_rings(buf)
        bell = self.regions.bells.get(region)
        if bell is not None:  # a door process's lane: its door sleeps on an eventfd, not the futex
            doorbell = EventfdDoorbell(completions, bell)
        space = self.lanes[region] = Space(buf, layout.LANE, submissions, completions, doorbell, region=region,
                                           data_floor=lanes.DATA_FLOOR, eventfd=bell is not None)
        self._rings = [self.main.submissions] + [lane.submissions for lane in self.lanes.values()]
        return [(space, entry) for entry in lanes.queued_entries(buf)]

    def _drop_region(self, region: int) -> None:
        """The front-end closed ``region``: stop serving it if it is a lane.  Its mapping stays
        until ``_unmap_dropped``: a drop can arrive while a batch gathers, with requests that
        use it already claimed, or behind requests still in hand."""
        if self.lanes.pop(region, None) is not None:
            self._rings = [self.main.submissions] + [lane.submissions for lane in self.lanes.values()]
        self.dropped.add(region)

    def _unmap_dropped(self) -> None:
        """Unmap (or close, if never mapped) dropped regions that no work still held uses."""
        if self.dropped:
            keep = set().union(*(self.step.regions_of(space, entry) for space, entry in self.held()))
            for region in self.dropped - keep:
                self.regions.forget(region)
                self.tell_dropped(region)
            self.dropped &= keep
