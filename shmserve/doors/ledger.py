"""What each peer uid holds across every door process: a table of counters in shared memory.

Owns: ``UidLedger`` — a memfd main creates (``create``) and every door maps
(``attach``): one row per peer uid that has connections open through the
doors, one column per door process, and in each cell two counters, the
uid's INFERs that door has in flight (answered or not yet written back) and
the request bytes it holds in its own memory (a relayed frame's payload
arriving); ``RowBook`` — main's assignment of rows to uids (a row is the
uid's while it has a connection open, and is given to another uid only once
every door gave its counts back).

How a limit holds across processes without a lock: a door adds to its own
cell first (``fetch_add``, sequentially consistent), then sums the row; if
the sum passes the limit it takes its addition back and refuses.  Of any
set of counts held at once, the last one added saw every other one in its
sum, so no more than the limit is ever held; two racing takers may both be
refused (never both admitted) where one would have fitted.  Only a door
writes its own column (adds and gives back); main reads rows and, once a
door process is dead (after ``wait``), zeroes its column (``clear_column``):
what the dead door held is free again, nothing else is touched.

Cell layout (little-endian, 8-byte aligned; ``cell(row, column)``)::

    +------------------+------------------+
    | requests (u64)   | bytes (u64)      |     16 B per cell
    +------------------+------------------+
    row r, column c at (r * columns + c) * 16

Counters are unsigned words read as signed (a bug that gave back too much
shows as a negative count, never a huge one).  The memfd is sparse: only
the pages of rows in use are ever touched.

Must not: decide what a request is (the door's connection says when it
takes and gives), or block (nothing waits: a take fits now or is refused).
"""

from __future__ import annotations

import mmap
import os

from shmserve import _atomics as atomics

CELL = 16  # bytes per cell: requests, then bytes
ROWS = 4096  # uids with connections open through the doors at once (a row each)
_WRAP = 1 << 64
_SIGN = 1 << 63


def _signed(value: int) -> int:
    return value - _WRAP if value >= _SIGN else value


class UidLedger:
    """A ``rows`` x ``columns`` table of (requests, bytes) counters over ``buf`` (see the module)."""

    def __init__(self, buf, rows: int, columns: int):
        if rows < 1 or columns < 1 or len(buf) < rows * columns * CELL:
            raise ValueError(f"a ledger of {rows} rows and {columns} columns needs {rows * columns * CELL} bytes, "
                             f"not {len(buf)}")
        self.buf, self.rows, self.columns = buf, rows, columns

    @classmethod
    def create(cls, columns: int, rows: int = ROWS) -> tuple["UidLedger", int]:
        """A new, zeroed ledger in a memfd; returns it and the memfd (the caller passes it to the
        doors and closes it)."""
        fd = os.memfd_create("shmserve-uid-ledger", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, rows * columns * CELL)
            buf = mmap.mmap(fd, rows * columns * CELL)
        except OSError:
            os.close(fd)
            raise
        return cls(buf, rows, columns), fd

    @classmethod
    def attach(cls, fd: int, rows: int, columns: int) -> "UidLedger":
        """Map the ledger main created (``fd`` is closed here: the mapping keeps it)."""
        try:
            return cls(mmap.mmap(fd, rows * columns * CELL), rows, columns)
        finally:
            os.close(fd)

    def cell(self, row: int, column: int) -> int:
        """Where ``row``'s counters of door ``column`` lie; ValueError out of the table."""
        if not (0 <= row < self.rows and 0 <= column < self.columns):
            raise ValueError(f"no cell ({row}, {column}) in a ledger of {self.rows} x {self.columns}")
        return (row * self.columns + column) * CELL

    # -- a door's side ----------------------------------------------------------------------

    def _take(self, row: int, column: int, field: int, n: int, limit: int, alone_fits: bool) -> int | None:
        off = self.cell(row, column) + field
        mine = _signed(atomics.fetch_add64(self.buf, off, n)) + n
        total = self._sum(row, field)
        if total <= limit or (alone_fits and total == mine == n):
            return None
        atomics.fetch_add64(self.buf, off, -n)
        return total - n

    def take_request(self, row: int, column: int, limit: int) -> int | None:
        """Count one more request of ``row``'s uid in door ``column``; or, if the uid's requests
        in every door would then pass ``limit``, count nothing and return how many it holds."""
        return self._take(row, column, 0, 1, limit, alone_fits=False)

    def give_request(self, row: int, column: int, n: int = 1) -> None:
        atomics.fetch_add64(self.buf, self.cell(row, column), -n)

    def take_bytes(self, row: int, column: int, nbytes: int, limit: int) -> int | None:
        """Count ``nbytes`` more held for ``row``'s uid in door ``column``, if the uid's bytes in
        every door stay within ``limit`` — or if these are the only bytes it holds (one at a time
        fits, whatever its size: ``v2.service.Ledger``'s rule); else count nothing and return
        what it holds."""
        return self._take(row, column, 8, nbytes, limit, alone_fits=True)

    def give_bytes(self, row: int, column: int, nbytes: int) -> None:
        atomics.fetch_add64(self.buf, self.cell(row, column) + 8, -nbytes)

    # -- main's side ------------------------------------------------------------------------

    def _sum(self, row: int, field: int) -> int:
        base, buf = row * self.columns * CELL + field, self.buf
        return sum(_signed(atomics.load64(buf, base + c * CELL)) for c in range(self.columns))

    def held(self, row: int) -> tuple[int, int]:
        """(requests, bytes) ``row``'s uid holds in every door together."""
        self.cell(row, 0)
        return self._sum(row, 0), self._sum(row, 8)

    def clear_column(self, column: int, rows) -> tuple[int, int]:
        """Door ``column`` is dead: zero what it held in ``rows`` (those in use: the others are
        zero, and stay untouched pages); returns what that was (requests, bytes).  Main's alone,
        after the door process has been waited for."""
        requests = nbytes = 0
        for row in rows:
            off = self.cell(row, column)
            requests += _signed(atomics.exchange64(self.buf, off, 0))
            nbytes += _signed(atomics.exchange64(self.buf, off + 8, 0))
        return requests, nbytes

    def close(self) -> None:
        self.buf.close()


class RowBook:
    """Main's rows of a ``UidLedger``: ``acquire(uid)`` when a uid's connection opens through a
    door (None: every row is taken), ``release(uid)`` when it ends.  A uid keeps its row while
    it has connections; a row it left is given to another uid only once its counts are zero
    (a door gives back what a closed connection held a little later than main hears of it)."""

    def __init__(self, ledger: UidLedger):
        self.ledger = ledger
        self.row_of: dict[int, int] = {}
        self.open: dict[int, int] = {}  # uid -> its connections open through the doors
        self.idle: list[int] = []  # uids with no connection whose row is not clean yet
        self.free = list(range(ledger.rows - 1, -1, -1))  # lowest row first (the fewest pages touched)

    def acquire(self, uid: int) -> int | None:
        row = self.row_of.get(uid)
        if row is None:
            row = self._free_row()
            if row is None:
                return None
            self.row_of[uid] = row
        if uid in self.idle:
            self.idle.remove(uid)
        self.open[uid] = self.open.get(uid, 0) + 1
        return row

    def release(self, uid: int) -> None:
        n = self.open.get(uid, 0) - 1
        if n > 0:
            self.open[uid] = n
            return
        self.open.pop(uid, None)
        if uid in self.row_of:
            self.idle.append(uid)
            self._sweep()

    def _sweep(self) -> None:
        """Free the rows of uids without connections whose counts are all given back."""
        for uid in list(self.idle):
            row = self.row_of[uid]
            if self.ledger.held(row) == (0, 0):
                self.idle.remove(uid)
                del self.row_of[uid]
                self.free.append(row)

    def _free_row(self) -> int | None:
        if not self.free:
            self._sweep()
        return self.free.pop() if self.free else None
