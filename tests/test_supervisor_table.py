"""A worker's life as the supervisor keeps it (``shmserve.supervisor``), without a process: the state
table, ``WorkerHandle.set_state``, the restart back-off, what a death does to a worker's state, and
the commands it is sent.  A ``Supervisor`` is built on a real arena inside a running loop (its
constructor spawns nothing); process exits are fed in with a stand-in for ``subprocess.Popen``."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import time

import pytest

from shmserve import _atomics as atomics
from shmserve import layout, workerlink
from shmserve.arena import Arena
from shmserve.config import ModelConfig, ServerConfig
from shmserve.rings import new_eventfd
from shmserve.spec import ModelSpec
from shmserve.supervisor import (COMMAND_RETRY_S, FAILED, MAX_BACKOFF_DOUBLINGS, READY, RESTARTING, STARTING, STOPPED,
                                 TRANSITIONS, IllegalTransition, Supervisor, WorkerHandle, WorkerState)

from helpers.fake_frontend import no_children_left, no_processes, reachable  # noqa: F401 (fixtures)

W = WorkerState


def reachable_from(start: WorkerState) -> set[WorkerState]:
    return reachable(start, TRANSITIONS)


# -- the table --------------------------------------------------------------------------------

def test_every_state_is_reachable_from_starting_and_every_one_can_stop():
    """No dead state; shutdown can stop a worker whatever state it is in."""
    assert reachable_from(STARTING) == set(W)
    for state in W:
        assert STOPPED in reachable_from(state)


def test_stopped_and_failed_are_final_but_for_stopping():
    """A stopped worker stays stopped; a failed one is never restarted, only stopped."""
    assert reachable_from(STOPPED) == {STOPPED}
    assert reachable_from(FAILED) == {FAILED, STOPPED}


def test_only_a_started_or_restarted_worker_becomes_ready():
    """READY only after a (re)start, never straight from FAILED or STOPPED."""
    assert {frm for frm, to in TRANSITIONS if to is READY} == {STARTING, RESTARTING}


@pytest.mark.parametrize("frm,to", list(itertools.product(W, W)))
def test_set_state_follows_the_table(frm, to):
    """Allowed: an edge of the table, or staying put; anything else raises and changes nothing."""
    w = WorkerHandle(0, ModelConfig("m", "fake", "fake"), None, None, None, None, state=frm)
    if frm == to or (frm, to) in TRANSITIONS:
        w.set_state(to)
        assert w.state is to
    else:
        with pytest.raises(IllegalTransition, match=f"{frm.name} -> {to.name}"):
            w.set_state(to)
        assert w.state is frm


# -- a supervisor without processes ----------------------------------------------------------------

class FakeProc:
    """What the supervisor asks of a ``subprocess.Popen``: pid, poll and wait."""

    pid = 424242

    def __init__(self, returncode: int | None = None):
        self.returncode = returncode

    def poll(self):
        return self.returncode

    def wait(self):
        return self.returncode


class RecordingLoop:
    """The running loop, except that timers and soon-callbacks are recorded, not run (a restart
    would start a process)."""

    def __init__(self, loop):
        self.loop, self.later, self.soon = loop, [], []

    def __getattr__(self, name):
        return getattr(self.loop, name)

    def call_later(self, delay, callback, *args):
        self.later.append((delay, callback, args))

    def call_soon(self, callback, *args):
        self.soon.append((callback, args))


class Parts:
    """A real arena and eventfd for supervisors made in a test; run ``with_supervisor(fn)``."""

    def __init__(self, instance: str):
        self.arena = Arena.create(instance, slot_count=4, max_workers=2, size_classes=[(4096, 2)], prefault=False)
        self.efd = new_eventfd()

    def with_supervisor(self, fn, *, backoff=(0.5, 30.0), instances: int = 1, **config):
        """Run ``fn(supervisor, events)`` inside a running loop (a ``RecordingLoop`` for the
        supervisor); ``events`` collects its on_ready/on_exit calls with the worker's state then."""
        cfg = ServerConfig(models=(ModelConfig("m", "fake", "fake", instances=instances),), restart_backoff_s=backoff,
                           **config)
        events = []

        async def main():
            sup = Supervisor(self.arena, cfg, self.efd, lambda w: events.append(("ready", w.index)),
                             lambda w, how: events.append(("exit", w.index, how, w.state)))
            sup.loop = RecordingLoop(sup.loop)
            for model in cfg.models:
                for _ in range(model.instances):
                    sup.new_handle(model)
            return fn(sup, events)

        return asyncio.run(main())

    def close(self):
        os.close(self.efd)
        self.arena.unlink()
        self.arena.close()


@pytest.fixture
def parts(instance_name):
    made = Parts(instance_name("sup"))
    try:
        yield made
    finally:
        made.close()


def test_restart_delay_doubles_with_the_crash_streak_from_the_first_to_the_longest(parts):
    """The delay doubles per death of the crash streak from the first delay, capped by the longest;
    the exponent is capped too (MAX_BACKOFF_DOUBLINGS).  The total restart count plays no part."""
    def delays(sup, events):
        w = sup.workers[0]
        w.restarts = 1000
        out = []
        for streak in (0, 1, 2, 3, 6, 7, 100):
            w.crash_streak = streak
            out.append(sup.restart_delay(w))
        return out

    def capped(sup, events):
        sup.workers[0].crash_streak = 100
        return sup.restart_delay(sup.workers[0])

    assert parts.with_supervisor(delays) == [0.5, 1.0, 2.0, 4.0, 30.0, 30.0, 30.0]
    assert parts.with_supervisor(capped, backoff=(1.0, 1e12)) == 2.0 ** MAX_BACKOFF_DOUBLINGS


def _ready(sup, w) -> None:
    """Feed the supervisor a worker's "ready" message, as its control socket would."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with child:
        child.send(workerlink.encode({"event": "ready", "spec": ModelSpec("m", "fake", (), ()).to_dict()}))
    w.control, w.ready_future = parent, sup.loop.create_future()
    sup._on_control(w)
    parent.close()
    w.control = None


def test_a_worker_that_served_restart_healthy_s_starts_its_back_off_over(parts):
    """Ready: a check is scheduled restart_healthy_s later.  If the same process is still ready
    then, its crash streak ends (here and in the worker table) and its next death is restarted
    after the first delay; a process that died meanwhile, or a successor, keeps its streak."""
    def serve(sup, events):
        w = sup.workers[0]
        w.proc, w.crash_streak = FakeProc(None), 4
        _ready(sup, w)
        [(delay, check, args)] = sup.loop.later
        streak_entry = lambda: layout.WORKER.read(sup.arena.buf, sup.arena.geometry.worker_off(0)).crash_streak
        layout.WORKER.write(sup.arena.buf, sup.arena.geometry.worker_off(0), crash_streak=4)
        replaced = w.proc
        w.proc = FakeProc(None)  # died and restarted meanwhile: not the process that was checked
        check(*args)
        kept = (w.crash_streak, streak_entry())
        w.proc = replaced
        check(*args)
        return delay, kept, (w.crash_streak, streak_entry()), sup.restart_delay(w)

    delay, kept, reset, next_delay = parts.with_supervisor(serve, restart_healthy_s=2.5)
    assert delay == 2.5 and kept == (4, 4) and reset == (0, 0) and next_delay == 0.5


def _exit(sup, w, returncode: int) -> None:
    """Feed the supervisor a process exit of ``w``, as its pidfd would."""
    w.proc = FakeProc(returncode)
    w.pidfd = os.eventfd(0)  # stands in for the pidfd, which the supervisor closes
    w.ready_future = sup.loop.create_future()
    sup._on_process_exit(w)


@pytest.mark.parametrize("before,returncode,stopping,after,how", [
    (READY, -signal.SIGKILL, False, RESTARTING, "killed by SIGKILL"),
    (STARTING, 1, False, RESTARTING, "exit 1 (error)"),
    (RESTARTING, -signal.SIGSEGV, False, RESTARTING, "killed by SIGSEGV"),
    (STARTING, workerlink.EXIT_LOAD_FAILED, False, FAILED, "exit 3 (model failed to load)"),
    (READY, workerlink.EXIT_ARENA_FAILED, False, FAILED, "exit 4 (could not use the arena)"),
    (READY, 0, True, STOPPED, "exit 0 (stopped)"),
])
def test_a_death_moves_the_worker_on_and_tells_the_front_end(parts, before, returncode, stopping, after, how):
    """The exit status decoded, the worker moved through the table (restarted unless its exit code
    says a restart cannot help, stopped when stopping), the front-end told after the move, a
    restart scheduled after the back-off only when RESTARTING, and the worker table says dead."""
    def die(sup, events):
        w = sup.workers[0]
        w.state, w.restarts, w.crash_streak, sup.stopping = before, 5, 2, stopping
        t0 = time.monotonic()
        _exit(sup, w, returncode)
        return (w.state, w.restarts, w.crash_streak, w.last_exit, w.restart_in(t0), events, sup.loop.later,
                w.ready_future.result(), sup._respawn)

    state, restarts, streak, last_exit, restart_in, events, later, ready, respawn = parts.with_supervisor(
        die, backoff=(1.0, 1000.0))
    assert state is after and events == [("exit", 0, how, after)] and ready is False and last_exit == how
    entry = layout.WORKER.read(parts.arena.buf, parts.arena.geometry.worker_off(0))
    assert entry.state == layout.WORKER_DEAD
    if after is RESTARTING:
        [(delay, callback, args)] = later
        assert (restarts, streak) == (6, 3) and delay == 4.0 and callback == respawn and args[0].index == 0
        assert 4.0 <= restart_in < 4.1 and entry.crash_streak == 3
        assert 3.9e9 < entry.restart_at_ns - time.monotonic_ns() <= 4e9  # what inspect reads
    else:
        assert (restarts, streak, restart_in) == (5, 2, None) and later == []


def test_a_retired_worker_takes_its_stop_behind_its_commands_and_is_stopped_for_good_once_it_exits(parts):
    """Retiring a running worker marks it retiring, pushes what ``before`` pushes and then a STOP
    entry on its ring, and schedules its termination after the drain time; its exit stops it for
    good (the front-end told, no restart scheduled or counted), empties and frees its worker-table
    entry, and completes the future ``retire`` returned."""
    entry = layout.command_entry(layout.CMD_ATTACH_LANE, 7)

    def retire(sup, events):
        w = sup.workers[0]
        w.state, w.proc, w.pidfd = READY, FakeProc(None), os.eventfd(0)
        stopped = sup.retire(w, 7.0, before=lambda: sup.command(w, entry))
        pushed = w.submissions.pop_all()
        [(delay, _, _)] = sup.loop.later
        os.close(w.pidfd)  # _exit gives it the pidfd its exit is read from
        _exit(sup, w, 0)
        table = layout.WORKER.read(sup.arena.buf, sup.arena.geometry.worker_off(0))
        return (w.retiring, pushed, delay, w.state, w.restarts, events, len(sup.loop.later), w in sup.workers,
                0 in sup.free_entries, table.state, stopped.done() and stopped.result())

    (retiring, pushed, delay, state, restarts, events, later, listed, free, table_state,
     stopped) = parts.with_supervisor(retire)
    assert retiring and pushed == [entry, layout.STOP_ENTRY] and delay == 7.0
    assert (state, restarts, later) == (STOPPED, 0, 1) and events == [("exit", 0, "exit 0 (stopped)", STOPPED)]
    assert not listed and free and table_state == layout.WORKER_EMPTY and stopped is True


def test_commands_reach_only_a_running_worker_and_wait_for_room(parts):
    """A command goes on the worker's ring and rings its doorbell; for a worker with no process,
    or a failed one, it is dropped; on a full ring it is tried again a moment later."""
    entry = layout.command_entry(layout.CMD_ATTACH_LANE, 7)

    def commands(sup, events):
        w = sup.workers[0]
        def rung():
            return atomics.load32(sup.arena.buf, w.submissions.seq_offset)

        got = []
        sup.command(w, entry)  # no process
        got.append(w.submissions.pop_all())
        w.proc, w.pidfd, w.state = FakeProc(None), os.eventfd(0), FAILED  # a process: its pidfd is watched
        sup.command(w, entry)
        got.append(w.submissions.pop_all())
        w.state = READY
        before = rung()
        sup.command(w, entry)
        got.append(w.submissions.pop_all())
        assert rung() == before + 1
        for _ in range(w.submissions.capacity):
            assert w.submissions.push(1)
        sup.command(w, entry)  # full
        [(delay, retry, args)] = sup.loop.later
        got.append(w.submissions.pop_all())
        retry(*args)
        got.append(w.submissions.pop_all())
        os.close(w.pidfd)
        return got, delay, w.submissions.capacity

    got, delay, capacity = parts.with_supervisor(commands)
    assert got == [[], [], [entry], [1] * capacity, [entry]] and delay == COMMAND_RETRY_S


def test_a_ready_worker_whose_heartbeat_stopped_is_wedged(parts):
    """Only a READY worker silent for longer than worker_timeout_s is wedged."""
    def wedged(sup, events):
        a, b = sup.workers
        a.state = b.state = READY
        for w, silent in ((a, 0.0), (b, 11.0)):
            layout.WORKER.write(sup.arena.buf, sup.arena.geometry.worker_off(w.index),
                                heartbeat_ns=time.monotonic_ns() - int(silent * 1e9))
        found = [w.index for w in sup.wedged()]
        b.state = RESTARTING  # only ready workers are watched
        return found, sup.wedged()

    assert parts.with_supervisor(wedged, instances=2, worker_timeout_s=10.0) == ([1], [])


def test_a_front_end_that_fails_to_recover_a_dead_worker_does_not_stop_its_restart(parts):
    """If telling the front-end raises (a bug, or memory a client scribbled on), the worker is
    still moved on and its restart still scheduled: a model never stays 'restarting' for good."""
    def die(sup, events):
        def broken(w, how):
            raise OverflowError("a client's ring indices")

        sup.on_exit = broken
        w = sup.workers[0]
        w.state, w.started_at = READY, time.monotonic()
        _exit(sup, w, -signal.SIGKILL)
        return w.state, [callback for _, callback, _ in sup.loop.later], sup._respawn

    state, scheduled, respawn = parts.with_supervisor(die)
    assert state is RESTARTING and scheduled == [respawn]


def test_a_wedged_worker_is_terminated_at_worker_timeout_s_and_a_stopped_one_killed_at_once(parts):
    """Silent for worker_timeout_s (not twice that): terminated.  A stopped process (SIGSTOP) cannot
    act on SIGTERM: it is killed at once; a running one gets SIGTERM, SIGKILL following later."""
    class SignalledProc(FakeProc):
        def __init__(self, pid):
            super().__init__()
            self.pid, self.signals = pid, []

        def send_signal(self, sig):
            self.signals.append(sig)

    def check(sup, events):
        stopped, hung = sup.workers
        for w, pid in ((stopped, 1001), (hung, 1002)):
            w.state, w.proc, w.pidfd = READY, SignalledProc(pid), -1
            layout.WORKER.write(sup.arena.buf, sup.arena.geometry.worker_off(w.index),
                                heartbeat_ns=time.monotonic_ns() - int(11.0 * 1e9))  # > 10 s, < 20 s
        sup.stopped = lambda pid: pid == 1001
        sup.check_health()
        sup.check_health()  # once terminating, not again
        return ([(w.terminating, w.proc.signals) for w in sup.workers],
                [(callback, args[1].pid) for _, callback, args in sup.loop.later], sup._kill_if_still)

    workers, later, kill_if_still = parts.with_supervisor(check, instances=2, worker_timeout_s=10.0)
    assert workers == [(True, [signal.SIGKILL]), (True, [signal.SIGTERM])]
    assert later == [(kill_if_still, 1002)]  # the one that was not stopped: SIGKILL if TERM did not do


def test_a_process_stopped_is_told_from_a_running_one_by_proc():
    from shmserve.supervisor import process_stopped

    assert process_stopped(os.getpid()) is False
    assert process_stopped(None) is False and process_stopped(2**22 + 12345) is False
