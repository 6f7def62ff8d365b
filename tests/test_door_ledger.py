"""The doors' shared per-uid ledger (``shmserve/doors/ledger.py``): in-process with several views of
one table, across real processes hammering it, and through a real server with ``doors = 2`` where one
uid's requests spread over both door processes."""

from __future__ import annotations

import mmap
import multiprocessing
import os

import numpy as np
import pytest

from shmserve import _atomics as atomics
from shmserve import protocol
from shmserve.doors.ledger import RowBook, UidLedger
from shmserve.protocol import Kind

from helpers.raw_frames import connect, read_frames
from helpers.server import serving, wait_for
from helpers.v2_server import python_model


def views(columns: int, n: int, rows: int = 8) -> list[UidLedger]:
    """Main's ledger and ``n - 1`` more views of it, each mapped from its own descriptor (as a door
    maps it)."""
    main, fd = UidLedger.create(columns, rows)
    try:
        return [main] + [UidLedger.attach(os.dup(fd), rows, columns) for _ in range(n - 1)]
    finally:
        os.close(fd)


def test_a_uid_holds_at_most_its_limit_across_every_door():
    main, d0, d1 = views(columns=2, n=3)
    assert [d0.take_request(3, 0, limit=3) for _ in range(2)] == [None, None]
    assert d1.take_request(3, 1, limit=3) is None
    assert d1.take_request(3, 1, limit=3) == 3  # refused: holds 3 across both doors
    assert d0.take_request(3, 0, limit=3) == 3
    assert main.held(3) == (3, 0)
    assert d1.take_request(4, 1, limit=3) is None  # another uid's row is its own
    d0.give_request(3, 0)
    assert d1.take_request(3, 1, limit=3) is None
    assert main.held(3) == (3, 0)


def test_a_dead_doors_column_is_taken_back_and_nothing_else():
    main, d0, d1 = views(columns=2, n=3)
    for _ in range(2):
        assert d0.take_request(1, 0, limit=4) is None
    assert d1.take_request(1, 1, limit=4) is None
    assert d0.take_bytes(1, 0, 100, limit=1000) is None
    assert main.clear_column(0, [1]) == (2, 100)  # door 0 died
    assert main.held(1) == (1, 0)
    assert [d1.take_request(1, 1, limit=4) for _ in range(4)] == [None, None, None, 4]


def test_bytes_fit_within_the_limit_or_alone():
    main, d0, d1 = views(columns=2, n=3)
    assert d0.take_bytes(0, 0, 5000, limit=1000) is None  # the only bytes the uid holds: fits
    assert d1.take_bytes(0, 1, 1, limit=1000) == 5000
    d0.give_bytes(0, 0, 5000)
    assert d1.take_bytes(0, 1, 600, limit=1000) is None
    assert d0.take_bytes(0, 0, 400, limit=1000) is None
    assert d0.take_bytes(0, 0, 1, limit=1000) == 1000
    assert main.held(0) == (0, 1000)


def test_cells_outside_the_table_are_refused():
    main, = views(columns=2, n=1, rows=4)
    for row, column in ((4, 0), (0, 2), (-1, 0)):
        with pytest.raises(ValueError):
            main.take_request(row, column, 1)
    with pytest.raises(ValueError):
        UidLedger(bytearray(10), 4, 2)


def test_a_row_goes_to_another_uid_only_once_its_counts_are_back():
    main, door = views(columns=1, n=2, rows=2)
    book = RowBook(main)
    a = book.acquire(1000)
    assert book.acquire(1000) == a  # a second connection of the same uid
    b = book.acquire(1001)
    assert {a, b} == {0, 1} and book.acquire(1002) is None  # every row taken
    assert door.take_request(a, 0, limit=9) is None
    book.release(1000)
    book.release(1000)  # uid 1000 has no connection; its door has not given back yet
    assert book.acquire(1002) is None
    door.give_request(a, 0)
    assert book.acquire(1002) == a
    book.release(1001)
    assert book.acquire(1000) == b


def _hammer(fd: int, rows: int, columns: int, column: int, limit: int, rounds: int, watch: str) -> None:
    ledger = UidLedger.attach(fd, rows, columns)
    with open(watch, "r+b") as f:
        admitted = mmap.mmap(f.fileno(), 16)
    for _ in range(rounds):
        if ledger.take_request(0, column, limit) is None:
            if atomics.fetch_add64(admitted, 0, 1) + 1 > limit:
                atomics.fetch_add64(admitted, 8, 1)  # a violation seen
            atomics.fetch_add64(admitted, 0, -1)
            ledger.give_request(0, column)


def test_processes_racing_on_one_row_never_hold_more_than_the_limit(tmp_path):
    """Each of 4 processes (a door's column each) takes and gives back as fast as it can; a second
    counter, raised after each admitted take and lowered before its give-back, never passes the
    limit (it would if two takes raced past it)."""
    columns, limit = 4, 2
    main, fd = UidLedger.create(columns, rows=2)
    watch = tmp_path / "admitted"
    watch.write_bytes(bytes(16))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_hammer, args=(os.dup(fd), 2, columns, c, limit, 20000, str(watch)))
             for c in range(columns)]
    os.close(fd)
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with open(watch, "rb") as f:
        admitted = mmap.mmap(f.fileno(), 16, prot=mmap.PROT_READ)
        assert atomics.load64(admitted, 8) == 0
    assert main.held(0) == (0, 0)


# -- through a real server ---------------------------------------------------------------------

def infer_frame(rid: int, tag: int) -> bytes:
    """An INFER of ``gated`` that runs until its gate file is made (``serving_models.gated``)."""
    x = np.array([tag, 1.0], np.float32)
    meta = {"id": rid, "model": "gated", "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}]}
    return protocol.encode_frame(Kind.INFER, meta, x.nbytes) + x.tobytes()


def door_of(sock) -> int:
    sock.sendall(protocol.encode_frame(Kind.INFO, {"id": 1}))
    [reply] = read_frames(sock, 1)
    return reply.meta["door_process"]


def test_one_uids_requests_over_both_doors_stay_within_max_inflight_per_uid(tmp_path):
    """max_inflight_per_uid = 4, one uid, a connection on each door, three requests held by the
    model on each: four are served, two are refused 'overloaded' naming the key (whichever came
    last), and once the model lets the four go the uid is served again on both doors."""
    record, gates = tmp_path / "record", tmp_path / "gates"
    gates.mkdir()
    record.touch()
    models = python_model("gated", "serving_models:gated",
                          options={"factory": True, "record": str(record), "gates": str(gates)})
    section = "doors = 2\nmax_inflight_per_uid = 4\nmax_inflight_per_connection = 8\n"
    with serving(tmp_path, models, server_section=section) as srv:
        on: dict[int, object] = {}
        for _ in range(400):
            s = connect(srv.socket)
            door = door_of(s)
            if door in on:
                s.close()
            else:
                on[door] = s
            if len(on) == 2:
                break
        assert set(on) == {0, 1}
        try:
            tags = {0: (1, 2, 3), 1: (4, 5, 6)}
            for door, s in on.items():
                s.sendall(b"".join(infer_frame(10 + t, t) for t in tags[door]))

            def counted():  # what the doors report: requests held (ledger), refused
                doors = srv.info()["doors"]
                held, refused = sum(d["held_requests"] for d in doors), sum(d["refused"] for d in doors)
                return (held, refused) if held + refused == 6 else None

            # nothing finishes before a gate opens: whichever two came last found four held
            assert wait_for(counted, "every request taken or refused by the doors") == (4, 2)
            for t in range(1, 7):
                (gates / str(t)).touch()
            answers = [f for s in on.values() for f in read_frames(s, 3)]
            refused = [f for f in answers if f.kind is Kind.ERROR]
            assert len(refused) == 2 and sum(f.kind is Kind.RESULT for f in answers) == 4
            for f in refused:
                assert f.meta["code"] == "overloaded", f.meta
                assert "(server.max_inflight_per_uid)" in f.meta["message"]
            for door, s in on.items():  # given back: served again on both doors
                (gates / str(20 + door)).touch()
                s.sendall(infer_frame(30 + door, 20 + door))
                [f] = read_frames(s, 1)
                assert f.kind is Kind.RESULT and f.meta["id"] == 30 + door
        finally:
            for s in on.values():
                s.close()
