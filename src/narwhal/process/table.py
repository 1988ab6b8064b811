"""Counts shared by the control process and its workers: one row of int64 per worker.

A `memfd` (no name to leak, freed with its last holder) mapped by every process. Only a row's
owner writes it; an aligned 8-byte store is never torn, and readers sum the rows, so a reader
is at most one update behind, which placement and drain settling tolerate.

Row layout: `[0]` completions and `[1]` chat requests in progress (what a crash loses),
`[2]` data connections in use, `[3]` requests waiting for one, `[4..6]` placements made per
role (their sum over rows is the router's rotation), `[7]` sockets open to engines (idle
keep-alive ones included), `[8]` legs waiting for a socket, `[9]` embed placements, `[10]`
client connections open (`serving.max_client_connections`), `[11 + c]` in flight on engine
column `c`. There are `ENGINE_COLUMNS` engine columns, so engines can join at runtime (DESIGN
§10): the control process assigns each member a column and tells the workers in its snapshots;
a column is reused only once its count is back to zero.

Three steps take the table's lock (`lockf`, dropped by the kernel if its holder dies), each
for a few memory reads and never across an await: taking a data connection, opening a socket,
and placing a leg.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager

from narwhal.fleet.inflight import Choose

COMPLETIONS, CHAT, POOL_IN_USE, POOL_WAITING = 0, 1, 2, 3
TURN_COLUMN = {"prefill": 4, "decode": 5, "both": 6, "embed": 9}
SOCKETS_OPEN, SOCKETS_WANTED = 7, 8
CLIENT_CONNECTIONS = 10
_FIXED = 11
ENGINE_COLUMNS = 1024  # the most engines one router fronts at once
ENDPOINT_COLUMN = {"completions": COMPLETIONS, "chat": CHAT}


class WorkerTable:
    def __init__(self, fd: int, rows: int, engine_columns: int = ENGINE_COLUMNS) -> None:
        self.fd = fd
        self.rows = rows
        self.engine_columns = engine_columns
        self.width = _FIXED + engine_columns
        self._map = mmap.mmap(fd, rows * self.width * 8)
        self._words = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, rows: int, engine_columns: int = ENGINE_COLUMNS) -> WorkerTable:
        """A fresh, zeroed table; its fd is inheritable only where passed explicitly."""
        fd = os.memfd_create("narwhal-workers", os.MFD_CLOEXEC)
        os.ftruncate(fd, rows * (_FIXED + engine_columns) * 8)
        return cls(fd, rows, engine_columns)

    def add(self, row: int, column: int, delta: int) -> None:
        """Only `row`'s owner calls this."""
        self._words[row * self.width + column] += delta

    def get(self, row: int, column: int) -> int:
        return self._words[row * self.width + column]

    def total(self, column: int) -> int:
        # A strided view of the column, summed in C (a generator here was the hottest
        # Python code of placement: several totals per request).
        return sum(self._words[column :: self.width])

    def zero(self, row: int) -> None:
        """A dead worker's row (the control process, before the replacement starts)."""
        base = row * self.width
        for i in range(self.width):
            self._words[base + i] = 0

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive against every other process's `locked` on this table."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._words.release()
        self._map.close()
        os.close(self.fd)


class SharedInFlight:
    """`InFlight` over the table: a worker writes its own row (`row`); every reader sums.

    The control process (`row` None) assigns each member's column in `add`; a worker is told
    it (`bind`) before the member joins its replica. A column that a removed engine leaves
    is kept by the worker while its own legs on it finish, and reused by the control process
    only once the column's count is zero."""

    def __init__(self, table: WorkerTable, row: int | None) -> None:
        self._table = table
        self._row = row
        self._columns: dict[str, int] = {}
        self._retired: dict[str, int] = {}  # a worker's removed engines with legs still on them

    @property
    def columns(self) -> dict[str, int]:
        """Engine id to table column, for the control process's snapshots."""
        return self._columns

    def add(self, engine_id: str) -> None:
        if self._row is not None:
            assert engine_id in self._columns, f"no column bound for {engine_id}"
            return
        taken = set(self._columns.values())
        table = self._table
        for column in range(_FIXED, _FIXED + table.engine_columns):
            if column not in taken and table.total(column) == 0:
                self._columns[engine_id] = column
                return
        raise ValueError(f"no room for another engine ({table.engine_columns} at most)")

    def bind(self, engine_id: str, column: int) -> None:
        """A worker learns the column the control process gave `engine_id`."""
        self._retired.pop(engine_id, None)
        self._columns[engine_id] = column

    def remove(self, engine_id: str) -> None:
        column = self._columns.pop(engine_id, None)
        if column is not None and self._row is not None and self._table.get(self._row, column):
            self._retired[engine_id] = column

    def claim(self, role: str, choose: Choose) -> str | None:
        """The turn is the sum of every worker's placements for `role`, so a request that
        follows another in a different worker gets the next turn, as with one process."""
        assert self._row is not None, "the control process only reads in-flight counts"
        table, column = self._table, TURN_COLUMN[role]
        with table.locked():
            turn = table.total(column)
            table.add(self._row, column, 1)
            engine_id = choose(turn)
            if engine_id is not None:
                table.add(self._row, self._columns[engine_id], 1)
        return engine_id

    def enter(self, engine_id: str) -> None:
        assert self._row is not None, "the control process only reads in-flight counts"
        self._table.add(self._row, self._columns[engine_id], 1)

    def leave(self, engine_id: str) -> None:
        assert self._row is not None, "the control process only reads in-flight counts"
        column = self._columns.get(engine_id)
        if column is not None:
            self._table.add(self._row, column, -1)
            return
        column = self._retired.get(engine_id)  # removed while this leg ran
        if column is not None:
            self._table.add(self._row, column, -1)
            if not self._table.get(self._row, column):
                del self._retired[engine_id]

    def of(self, engine_id: str) -> int:
        column = self._columns.get(engine_id)
        return 0 if column is None else self._table.total(column)


class _SharedCount:
    """A router-wide bound of `limit` on the sum of one column, taken by worker `row`: a unit
    is taken under the table's lock (the check and the increment are one step for every
    worker, so the sum never passes `limit`); a unit is given back without it (a reader that
    misses it refuses once, harmlessly)."""

    _column: int

    def __init__(self, table: WorkerTable, row: int, limit: int) -> None:
        self._table = table
        self._row = row
        self._limit = limit

    def take(self) -> bool:
        table = self._table
        with table.locked():
            if table.total(self._column) >= self._limit:
                return False
            table.add(self._row, self._column, 1)
            return True

    def give_back(self) -> None:
        self._table.add(self._row, self._column, -1)


class SharedBudget(_SharedCount):
    """The router's data connections in use, as a `dataplane.pool.Budget` of worker `row`."""

    _column = POOL_IN_USE


class SharedSockets(_SharedCount):
    """The router's open engine sockets, as an `engine.h1.SocketBudget` of worker `row`.

    Connections in use are bounded by `SharedBudget`; this bounds what they leave behind, the
    idle keep-alive sockets, so that `serving.max_connections` is the router's number of
    sockets to its engines. A socket is counted from before it is opened until it is closed.
    A worker that finds the bound reached closes one of its own idle sockets; when it has
    none, it says it waits (`SOCKETS_WANTED`), and the workers holding idle sockets close
    them (`engine/h1.py`)."""

    _column = SOCKETS_OPEN

    def want(self, delta: int) -> None:
        self._table.add(self._row, SOCKETS_WANTED, delta)

    def wanted_elsewhere(self) -> int:
        """How many legs of other workers wait for a socket."""
        table = self._table
        return table.total(SOCKETS_WANTED) - table.get(self._row, SOCKETS_WANTED)


class SharedConnections(_SharedCount):
    """The router's client connections, as an `h1_server.ConnectionBudget` of worker `row`:
    `serving.max_client_connections` bounds them all, whichever worker accepted them."""

    _column = CLIENT_CONNECTIONS
