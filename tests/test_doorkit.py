"""The door kit's parts (``shmserve.doorkit``) on their own: connection counts, flow control and
the stall timer, the input deadline (a fake clock), and who a peer is (a real socket pair: only
what the kernel says).  The doors built on them are tested in ``test_frontend_unix.py`` and
``test_v2_http_conn.py`` (in-process) and through real servers."""

from __future__ import annotations

import os
import socket

from shmserve.doorkit import ConnectionCounts, DoorLimits, FlowControl, InputDeadline, peer_of

from helpers.fake_frontend import FakeClock

LIMITS = DoorLimits(max_connections=3, max_connections_per_uid=2, max_inflight_per_uid=8,
                    max_inflight_bytes_per_connection=1 << 20, stall_timeout_s=10.0, frame_timeout_s=5.0,
                    upload_timeout_s=7.0)


class Transport:
    def __init__(self):
        self.calls = []

    def pause_reading(self):
        self.calls.append("pause")

    def resume_reading(self):
        self.calls.append("resume")


def test_connection_counts_refuse_past_each_limit_naming_its_key():
    counts = ConnectionCounts()
    a, b, c, d = object(), object(), object(), object()
    counts.enter(a, 1000)
    counts.enter(b, 1000)
    assert counts.refusal(LIMITS, 1000, "uid 1000") == \
        "uid 1000 has 2 connections open (server.max_connections_per_uid)"
    assert counts.refusal(LIMITS, 1001, "uid 1001") is None
    counts.enter(c, None)  # no owner (TCP): counted in all only
    assert counts.refusal(LIMITS, 1001, "uid 1001", door="the HTTP door") == \
        "the HTTP door has 3 connections open (server.max_connections)"
    assert counts.leave(a) and not counts.leave(d)  # one never counted is no change
    assert len(counts) == 2 and counts.count(1000) == 1 and counts.of_owner == {1000: {b}}
    counts.leave(b)
    counts.leave(c)
    assert len(counts) == 0 and counts.of_owner == {}


def test_reading_is_paused_and_resumed_only_when_that_changes_something():
    flow, transport = FlowControl(FakeClock().call_later), Transport()
    assert flow.reading and not flow.read_while(transport, True)
    assert flow.read_while(transport, False) and not flow.read_while(transport, False)
    assert flow.read_while(transport, True)
    assert transport.calls == ["pause", "resume"]


def test_the_stall_timer_runs_from_the_first_pause_and_stops_when_all_is_sent():
    clock = FakeClock()
    flow, stalled = FlowControl(clock.call_later), []
    flow.writing_paused(10.0, lambda: stalled.append(clock.now))
    clock.advance(6)
    flow.writing_paused(10.0, lambda: stalled.append(clock.now))  # the timer of the first pause runs on
    assert flow.write_blocked
    flow.writing_resumed()
    clock.advance(100)
    assert not stalled and not flow.write_blocked and flow.stall_timer is None
    start = clock.now
    flow.writing_paused(10.0, lambda: stalled.append(clock.now))
    clock.advance(10)
    assert stalled == [start + 10] and flow.stall_timer is None


def test_stop_cancels_the_stall_timer():
    clock = FakeClock()
    flow, stalled = FlowControl(clock.call_later), []
    flow.writing_paused(1.0, lambda: stalled.append(1))
    flow.stop()
    clock.advance(5)
    assert not stalled


def test_the_input_deadline_restarts_only_when_what_it_times_changes():
    clock = FakeClock()
    deadline, fired = InputDeadline(clock.call_later), []
    deadline.run("frame_timeout_s", 5.0, lambda key, s: fired.append((key, s, clock.now)))
    clock.advance(4)
    deadline.run("frame_timeout_s", 5.0, lambda key, s: fired.append((key, s, clock.now)))  # runs on
    clock.advance(1)
    assert fired == [("frame_timeout_s", 5.0, 1005.0)] and not deadline.running and deadline.key is None
    deadline.run("frame_timeout_s", 5.0, fired.append)
    clock.advance(4)
    deadline.run("upload_timeout_s", 7.0, lambda key, s: fired.append((key, s, clock.now)))  # restarted
    clock.advance(6)
    assert len(fired) == 1
    clock.advance(1)
    assert fired[-1] == ("upload_timeout_s", 7.0, 1016.0)
    deadline.run("upload_timeout_s", 7.0, fired.append)
    deadline.cancel()
    clock.advance(100)
    assert len(fired) == 2


def test_a_unix_peer_is_who_the_kernel_says_and_a_tcp_peer_is_nobody():
    a, b = socket.socketpair()
    try:
        peer = peer_of(a)
        assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
        assert os.getegid() in peer.groups
    finally:
        a.close()
        b.close()
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    try:
        assert peer_of(client) is None and peer_of(None) is None
    finally:
        client.close()
        listener.close()
