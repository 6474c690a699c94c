"""Keeping the disk tier within its byte cap: entries leave in the order of diskcache's eviction
policy, in batches, never the one just stored.

diskcache's own culling is off (`cull_limit=0`): at each write over the cap it dropped the ten
entries first in line, which with a few long phrases were all of them, the new one too.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator

import diskcache  # type: ignore[import-untyped]

from .layout import Layout

BATCH = 512
"""At most this many entries evicted in one transaction."""


def evict_to_cap(db: sqlite3.Connection, db_lock: threading.Lock, layout: Layout, volume: Callable[[], int],
                 cap: int, policy: str, keep: str | None) -> Iterator[tuple[int, int]]:
    """Evict until `volume()` is within `cap`, never `keep`; yields for each batch its count of
    entries and of value files that could not be deleted (orphans now, for a repair).

    A batch is worth at most a quarter of the excess by the bytes its rows hold: an entry's share
    of the database's pages can be up to about twice that, so a batch never takes more than the
    excess, and thousands of small entries go in a few dozen transactions instead of one each."""
    order = diskcache.core.EVICTION_POLICY[policy]["cull"]
    while order is not None and (excess := volume() - cap) > 0:
        with db_lock:
            victims = _first_in_line(db, order, keep, excess // 4)
            if not victims:
                return
            # By row, not by key: diskcache's delete decodes the key, and a row whose key is not
            # text (damage, tampering) then stopped eviction for good.
            deleted = _delete_rows(db, [rowid for rowid, _ in victims])
        yield deleted, _remove_value_files(layout, [name for _, name in victims])


def _first_in_line(db: sqlite3.Connection, order: str, keep: str | None, budget: int) -> list[tuple[int, object]]:
    """(rowid, value file) of the entries first in the policy's line, other than `keep`: at least
    one, then as many as `budget` bytes of their stored values cover."""
    fields = "rowid, key, filename, ifnull(size, 0) + ifnull(length(value), 0)"  # a damaged row: NULL
    rows = db.execute(order.format(fields=fields, now=time.time()), (BATCH + 1,)).fetchall()
    victims, taken = [], 0
    for rowid, key, name, stored in rows:
        if key == keep:
            continue
        if victims and taken + stored > budget:
            break
        victims.append((rowid, name))
        taken += stored
    return victims


def _remove_value_files(layout: Layout, names: list[object]) -> int:
    """Delete the value files of rows already deleted; how many could not be. One that fails
    (a directory made unwritable) must not leave the rest of the batch behind too."""
    failed = 0
    for name in names:
        try:
            layout.remove_value_file(name)
        except OSError:
            failed += 1
    return failed


def _delete_rows(db: sqlite3.Connection, rowids: list[int]) -> int:
    """Delete these rows of diskcache's table in one transaction (the connection autocommits)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        deleted = sum(db.execute("DELETE FROM Cache WHERE rowid = ?", (rowid,)).rowcount for rowid in rowids)
    except BaseException:
        if db.in_transaction:  # SQLite has already rolled back after some errors (a full disk)
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return deleted
