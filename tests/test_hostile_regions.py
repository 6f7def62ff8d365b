"""A client attacking its own regions and lanes (issue 11, findings 1 and 2), through a real server.

Regions and lanes are sealed memfds: the descriptor a client receives cannot
shrink or grow the memory, so a truncation can no longer kill a worker or the
front-end with SIGBUS, and a grown region can no longer make a worker map (or
page-lock) more than the server recorded.  What a client can still do to its
own memory (punch holes in it, scribble over its lane) hurts only that client.
Each test checks that the attacker alone is affected: the server stays up,
another client is served, the workers' restart counts do not change, and
nothing is left: no region record, no mapping in any server process, no
descriptor.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from shmserve import ErrorCode, ShmserveError, client as client_module

from helpers.server import ServerProcess, standard_models, wait_for

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("hostile-regions"), standard_models()).start()
    try:
        yield srv
    finally:
        assert srv.stop() == 0


@pytest.fixture
def kept_descriptors(monkeypatch):
    """The descriptors of every region this process's clients receive, kept open (the library
    closes its own once mapped; an attacker keeps it)."""
    kept: dict[int, int] = {}
    real_init = client_module.Region.__init__

    def keep(self, region_id, size, fd, lane=None):
        kept[region_id] = os.dup(fd)
        real_init(self, region_id, size, fd, lane)

    monkeypatch.setattr(client_module.Region, "__init__", keep)
    yield kept
    for fd in kept.values():
        os.close(fd)


def restarts(srv) -> list[int]:
    return [w["restarts"] for w in srv.info()["workers"]]


def bystander_is_served(srv) -> None:
    """Another client, inline and through a lane, gets right answers."""
    x = np.arange(256, dtype=np.uint8)
    with srv.client() as c:
        assert np.array_equal(c.infer("identity", {"x": x})["y"], x)
        with c.zero_copy("identity", {"x": ((256,), np.uint8)}) as call:
            call.inputs["x"][...] = x
            assert np.array_equal(call.run()["y"], x)


def nothing_left(srv) -> None:
    """Every client region is closed, unrecorded and unmapped (a door process's own lanes, recorded
    under its pid, are the server's: docs/doors.md)."""
    def clients_regions() -> set[int]:
        doors = {d["pid"] for d in srv.info().get("doors") or ()}
        recorded = srv.recorded_regions()
        door_lanes = {rid for rid, r in recorded.items() if r["owner_pid"] in doors}
        return (set(recorded) | set().union(*srv.mapped_regions().values())) - door_lanes

    wait_for(lambda: not clients_regions(), "every region to be closed, unrecorded and unmapped in every server process")


def mapping_sizes(srv, region_id: int) -> dict[int, int]:
    """The size of region ``region_id``'s mapping in each server process that maps it."""
    marker = f"/memfd:shmserve.{srv.instance}.r{region_id} "
    sizes = {}
    for pid in srv.pids():
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if marker in line + " ":
                    start, end = (int(v, 16) for v in re.match(r"([0-9a-f]+)-([0-9a-f]+)", line).groups())
                    sizes[pid] = sizes.get(pid, 0) + end - start
    return sizes


def test_a_region_or_lane_cannot_be_shrunk_or_grown_by_its_client(server, kept_descriptors):
    """Finding 1 (truncate to 0: SIGBUS in the worker, then the front-end) and finding 2 (grown to
    64 GiB: mapped and page-locked at the client's size)."""
    before = restarts(server)
    x = np.arange(100, dtype=np.uint8)
    with server.client() as c:
        plain = c.open_region(1 << 20)
        with c.zero_copy("identity", {"x": ((100,), np.uint8)}) as call:
            call.inputs["x"][...] = x
            assert np.array_equal(call.run()["y"], x)  # the lane is attached and mapped by its worker
            lane_id = call.region.id
            for region_id in (plain.id, lane_id):
                fd = kept_descriptors[region_id]
                assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
                size = os.fstat(fd).st_size
                for attack in (0, 4096, size + 4096, 64 << 30):
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, attack)
                with pytest.raises(PermissionError):
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # nor can the seals change
                assert os.fstat(fd).st_size == size
            call.inputs["x"][...] = x[::-1]
            assert np.array_equal(call.run()["y"], x[::-1])  # the attacker's own lane still works
            lane_size = call.region.size
            assert all(size <= lane_size for size in mapping_sizes(server, lane_id).values())
            assert max(mapping_sizes(server, lane_id).values()) == lane_size  # its worker maps the recorded size
        bystander_is_served(server)
    assert restarts(server) == before
    nothing_left(server)


def test_holes_punched_in_a_lane_hurt_only_its_client(server, kept_descriptors):
    """Punching holes is still the client's right over its own memory (it is not sealed against
    writes): the pages read back as zeros.  Its lane header and rings become zeros under the
    worker and the front-end; neither may fault or fail anyone else."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = restarts(server)
    x = np.arange(64, dtype=np.uint8)
    with server.client() as c:
        call = c.zero_copy("identity", {"x": ((64,), np.uint8)})
        call.inputs["x"][...] = x
        assert np.array_equal(call.run()["y"], x)
        fd = kept_descriptors[call.region.id]
        assert libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, ctypes.c_long(0),
                              ctypes.c_long(call.region.size)) == 0, os.strerror(ctypes.get_errno())
        for _ in range(3):  # whatever the lane does now, it ends in an answer or a clear error
            try:
                call.inputs["x"][...] = x
                result = call.run(timeout=2)
                assert np.array_equal(result["y"], x)
            except ShmserveError as exc:
                assert exc.code in (ErrorCode.TIMEOUT, ErrorCode.BAD_FRAME, ErrorCode.BAD_INPUT,
                                    ErrorCode.BAD_REGION, ErrorCode.INTERNAL), exc
        bystander_is_served(server)
        call.release()
    assert server.proc.poll() is None and restarts(server) == before
    bystander_is_served(server)
    nothing_left(server)


def test_the_server_records_every_region_for_inspect_and_forgets_it_on_close(server):
    """No client memory has a name in /dev/shm; ``inspect`` lists it from the arena's records."""
    with server.client() as c:
        a = c.open_region(1 << 20)
        b = c.open_region(4096, lane="identity")
        records = server.recorded_regions()
        assert {r: (records[r]["kind"], records[r]["owner_uid"], records[r]["size"]) for r in records} == {
            a.id: ("region", os.getuid(), a.size), b.id: ("lane", os.getuid(), b.size)}
        assert records[a.id]["owner_pid"] == os.getpid() and records[b.id]["model"] == "identity"
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shmserve.{server.instance}.")]
        shown = subprocess.run([sys.executable, "-m", "shmserve.cli", "inspect", "--instance", server.instance],
                               capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="200"))
        assert shown.returncode == 0, shown.stderr
        table = shown.stdout[shown.stdout.index("client regions and lanes"):]
        assert re.search(rf"\b{a.id}\b.*\bregion\b.*{a.size:,}", table)
        assert re.search(rf"\b{b.id}\b.*\blane\b.*{b.size:,}.*identity", table)
        c._pump.exchange(lambda session: session.close_region(a.id))  # the protocol's CLOSE_REGION (the client has no call for it)
        wait_for(lambda: a.id not in server.recorded_regions(), "the closed region's record to go")
    nothing_left(server)


def test_lane_ring_indices_at_the_top_of_u64_hurt_only_their_client(server):
    """Finding 3: two 64-bit stores (a lane's ring indices set to 2**64 - 1) made the worker's
    ``tail + 1`` overflow and the front-end's own push raise inside its worker-exit handler, so the
    model stayed 'restarting' for good.  Now nothing overflows: the worker serves on, and when the
    lane's worker dies the front-end still fails the lane's calls and restarts the worker."""
    from shmserve import _atomics as atomics, layout

    x = np.arange(32, dtype=np.uint8)
    before = restarts(server)
    with server.client() as c:
        call = c.zero_copy("identity", {"x": ((32,), np.uint8)})
        call.inputs["x"][...] = x
        assert np.array_equal(call.run()["y"], x)
        buf = call.region.buf
        for ring in (layout.LANE.submission_off, layout.LANE.completion_off):
            for field in (0, 64):  # tail, head: each on its own cache line
                atomics.store64(buf, ring + field, 2**64 - 1)
        lane = call.region.lane
        lane.submissions.push(layout.slot_entry(0, 1))  # a push over the top: it wraps, never raises
        lane.bell.notify()
        bystander_is_served(server)
        assert restarts(server) == before
        assert all(w["state"] == "ready" for w in server.info()["workers"] if w["model"] == "identity")
        worker = next(w for w in server.info()["workers"] if w["lanes"] and w["model"] == "identity")
        os.kill(worker["pid"], 9)  # its worker dies: the front-end fails the lane and moves it on
        wait_for(lambda: [w for w in server.info()["workers"] if w["index"] == worker["index"]
                          and w["state"] == "ready" and w["pid"] != worker["pid"]], "the killed worker to restart")
        call.release()
    after = restarts(server)
    assert after[worker["index"]] == before[worker["index"]] + 1
    assert [r for i, r in enumerate(after) if i != worker["index"]] == [
        r for i, r in enumerate(before) if i != worker["index"]]
    bystander_is_served(server)
    nothing_left(server)


def test_region_limits_are_refused_naming_their_key_and_hold_nothing(tmp_path):
    """Finding 6 (regions): a connection's count and bytes of regions and a uid's bytes are
    bounded; each refusal is 'overloaded' naming its config key; closing frees the budget."""
    section = ("max_regions_per_connection = 3\nmax_region_bytes_per_connection = 262144\n"
               "max_region_bytes_per_uid = 393216\n")
    srv = ServerProcess(tmp_path, standard_models(1), server_section=section).start()
    try:
        def refused(c, size, key):
            with pytest.raises(ShmserveError) as info:
                c.open_region(size)
            assert info.value.code is ErrorCode.OVERLOADED and f"(server.{key})" in info.value.message, info.value.message

        with srv.client() as a, srv.client() as b, srv.client() as c:
            for _ in range(3):
                a.open_region(4096)
            refused(a, 4096, "max_regions_per_connection")
            b.open_region(200_000)
            refused(b, 100_000, "max_region_bytes_per_connection")
            refused(c, 200_000, "max_region_bytes_per_uid")  # a holds 3 pages, b 200 KB: the uid's budget
            bystander_is_served(srv)
        nothing_left(srv)
        with srv.client() as c:  # the budget came back with the connections
            c.open_region(262144)
    finally:
        assert srv.stop() == 0


def test_a_closed_region_is_emptied_even_if_its_client_kept_the_descriptor(server, kept_descriptors):
    """Review H1: the client can keep a region's descriptor after closing it, and with it the
    memory.  Once every worker that had the region has dropped it, the server punches all its
    pages out: the kept descriptor reads zeros and holds no memory, and what the client touches
    again is its own.  Until then the region still counts against its uid (and shows in inspect)."""
    with server.client() as c:
        plain = c.open_region(8 << 20)
        plain.buf[:] = b"\x07" * len(plain.buf)  # every page touched
        x = np.arange(64, dtype=np.uint8)
        with c.zero_copy("identity", {"x": ((64,), np.uint8)}) as call:
            call.inputs["x"][...] = x
            assert np.array_equal(call.run()["y"], x)  # the lane's worker maps it
            lane_id = call.region.id
        fds = {plain.id: kept_descriptors[plain.id], lane_id: kept_descriptors[lane_id]}
        assert os.fstat(fds[plain.id]).st_blocks * 512 >= 8 << 20
        c._pump.exchange(lambda session: session.close_region(plain.id))
    nothing_left(server)  # the lane closed with its connection; both released
    for region_id, fd in fds.items():  # the pages are freed off the server's event loop: soon after
        wait_for(lambda: os.fstat(fd).st_blocks == 0, f"region {region_id}'s memory to be freed")
        assert os.pread(fd, 4096, 0) == bytes(4096)
