"""The disk tier: a byte-capped diskcache on local disk that survives kill -9, a full disk and a
corrupted database. Blocking: the facade calls it from worker threads.

What lives in the cache directory, and the lock that keeps a second process out of it: see
edged.cache.layout.

Faults, and what happens:
- kill -9 at any moment: SQLite's WAL rolls back the open transaction on the next open; a value
  file written before its row committed is an orphan, removed by `repair()` (diskcache's
  `check(fix=True)`), which the facade runs in the background when the last run did not close
  cleanly (`needs_repair`). A row whose audio is incomplete fails its checksum and is dropped.
- Another process has the directory open: this tier stays off (memory-only), logged.
- Disk full, read-only or unwritable directory: the write is undone (no partial file), logged once,
  counted in `stats.store_failures`, and writes pause for `write_retry_seconds`; reads go on.
  A directory that cannot be opened at all leaves the tier off (memory-only).
- A corrupted database (not a database, malformed pages): moved aside to `corrupt/` and rebuilt
  empty; the old value files are moved out of the way and deleted by `repair()`.
- The directory removed or replaced while open (`rm -rf` to clear it): SQLite would go on writing
  to the unlinked database, lost at the next start, with value files outside any database. The
  next write or invalidation sees that the database file is another (or gone) and opens the
  directory anew (repairing it on the writer thread if only the database went).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import diskcache  # type: ignore[import-untyped]  # no type hints in 5.6.3

from ..files import identity
from . import faults, record
from .eviction import evict_to_cap
from .generations import ALL, Generations
from .layout import DBNAME, Layout
from .rawdisk import RawDisk, UnreadableRow
from .settings import CacheSettings

log = logging.getLogger(__name__)

EvictionPolicy = Literal["least-recently-stored", "least-recently-used"]
DiskState = Literal["ok", "paused", "off"]
RAISE_GENERATION = ("INSERT INTO edged_generations VALUES (?, ?) ON CONFLICT(scope)"
                    " DO UPDATE SET gen = max(gen, excluded.gen)")
"""Store a scope's invalidation counter, never lowering it."""
RECOUNT_SIZE = "UPDATE Settings SET value = (SELECT ifnull(sum(size), 0) FROM Cache) WHERE key = 'size'"
"""diskcache's count of the bytes in value files and rows, made again from the rows."""


@dataclass
class DiskStats:
    corrupt_dropped: int = 0
    """Entries that failed their checksum or were unreadable: dropped, never served."""
    evictions: int = 0
    """Entries the tier removed itself: over its byte cap, or expired."""
    store_failures: dict[str, int] = field(default_factory=dict)
    """Failed writes by reason: disk_full, unwritable, io_error, busy, corrupt."""
    store_skipped: int = 0
    """Writes not tried: paused after a failure, or an entry larger than the whole tier (and,
    counted by the facade, the write queue full)."""
    recoveries: int = 0
    """Times a corrupted database was moved aside and rebuilt."""


class DiskStore:
    """Writes, touches, invalidations and (re)opening run on the facade's one writer thread; get()
    runs on reader threads, and may delete a corrupt entry or rebuild a corrupted database itself."""

    def __init__(self, settings: CacheSettings, generations: Generations,
                 eviction_policy: EvictionPolicy = "least-recently-stored") -> None:
        self.settings = settings
        self.layout = Layout(settings.resolved_directory())
        self.directory = self.layout.store
        """diskcache's directory."""
        self.policy = eviction_policy
        self.stats = DiskStats()
        self.state: DiskState = "off"
        self.needs_repair = False
        self.volume = 0
        """Bytes on disk (database pages + value files) as of the last write."""
        self.count = 0
        self._generations = generations
        self._cache: diskcache.Cache | None = None
        self._lock_fd: int | None = None
        self._db: sqlite3.Connection | None = None
        self._db_lock = threading.Lock()
        self._reconnect_lock = threading.Lock()
        """Held while the connections are replaced, so that one reopening or rebuild runs at a time."""
        self._retry_after = 0.0
        """No write, and no opening of a tier left off, is tried before this (time.monotonic)."""
        self._closed = False
        self._logged: set[str] = set()
        self._db_file: tuple[int, int] | None = None
        """(device, inode) of the database file opened: another one there means it was replaced."""

    @classmethod
    def open(cls, settings: CacheSettings, generations: Generations,
             eviction_policy: EvictionPolicy = "least-recently-stored") -> DiskStore:
        """Open (creating, checking or rebuilding as needed). Never raises: a tier that cannot be
        opened is left off and logged."""
        store = cls(settings, generations, eviction_policy)
        store._open()
        return store

    # -- opening, closing, recovering ------------------------------------------------------

    def _open(self) -> None:
        try:
            if self._lock_fd is None:
                self._lock_fd = self.layout.claim()
            self.needs_repair = self.layout.marker.exists()
            try:
                self._connect()
            except (sqlite3.DatabaseError, TypeError, ValueError) as error:
                # diskcache passes unknown disk_* rows of its Settings table to the Disk
                # (TypeError) and trusts its stored counts (ValueError): a damaged table too.
                if isinstance(error, sqlite3.DatabaseError) and not faults.is_corruption(error):
                    raise
                self._set_aside(error)
                self._connect()
        except (OSError, sqlite3.Error, diskcache.Timeout) as error:
            self._close_connections()
            self._release()
            self.state = "off"
            self._retry_after = time.monotonic() + self.settings.write_retry_seconds
            self._log_once("open", "cache directory %s unusable, caching in memory only: %s",
                           self.layout.directory, error)
            return
        self.state = "ok"
        self._mark_open()
        self._shrink_to_limit()
        if any(self.layout.corrupt.glob("trash-*")):
            self.needs_repair = True

    def _shrink_to_limit(self, keep: str | None = None) -> None:
        """Expired entries out, then evict by the policy down to `disk_bytes`; never `keep`, the
        entry just stored."""
        assert self._cache is not None and self._db is not None
        cache = self._cache
        try:
            if self._volume() > self.settings.disk_bytes:
                self.stats.evictions += cache.expire()
            for evicted, files_left in evict_to_cap(self._db, self._db_lock, self.layout, self._volume,
                                                    self.settings.disk_bytes, self.policy, keep):
                self.stats.evictions += evicted
                if files_left:
                    self.needs_repair = True  # the next start repairs: close() leaves the marker
                    self._log_once("evict-files", "cache could not delete %d evicted value files in %s;"
                                   " they are removed at the next start", files_left, self.directory)
        except (OSError, sqlite3.Error, diskcache.Timeout) as error:
            self._log_once("cull", "cache could not evict down to its size limit: %s", error)
        self._refresh_volume(cache)

    def _volume(self) -> int:
        """diskcache's volume(), its byte count recomputed first if a damaged row made it NULL:
        diskcache's delete trigger subtracts each row's size, and NULL minus NULL stays NULL, so
        one row with no size stopped eviction (a TypeError) for as long as the database lived."""
        assert self._cache is not None and self._db is not None
        try:
            return self._cache.volume()
        except TypeError:
            with self._db_lock:
                self._db.execute(RECOUNT_SIZE)
            return self._cache.volume()

    def retry_open(self) -> None:
        """Open again a tier left off (full disk: SQLite cannot even create its WAL), at most
        every `write_retry_seconds`; repair if needed. For the writer thread."""
        if self.state != "off" or self._closed or time.monotonic() < self._retry_after:
            return
        self._open()
        if self.state == "ok":
            log.info("cache directory %s usable again", self.directory)
            self._logged.discard("open")
            self._repair_if_needed()

    def _connect(self) -> None:
        self._forget_stored_settings()
        cache = diskcache.Cache(
            str(self.directory), timeout=self.settings.disk_timeout_seconds, disk=RawDisk,
            size_limit=self.settings.disk_bytes, eviction_policy=self.policy, cull_limit=0,
            statistics=False, tag_index=True,
        )
        cache.disk.max_value_bytes = self.settings.max_entry_bytes + record.MAX_OVERHEAD
        db = None
        try:
            db = sqlite3.connect(self.directory / DBNAME, timeout=self.settings.disk_timeout_seconds,
                                 isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA synchronous = NORMAL")  # as diskcache's own connections (WAL)
            db.execute("CREATE TABLE IF NOT EXISTS edged_generations"
                       " (scope TEXT PRIMARY KEY, gen INTEGER NOT NULL)")
            stored = dict(db.execute("SELECT scope, gen FROM edged_generations").fetchall())
            self._generations.merge(stored)
            # After a rebuild the table is empty: carry over what this process knows.
            known = self._generations.items()
            db.executemany(RAISE_GENERATION, known)
            self._generations.saved(known)
            self._cache, self._db = cache, db
            self.volume, self.count = self._volume(), len(cache)
            self._db_file = identity(self.directory / DBNAME)
        except BaseException:
            self._cache = self._db = None
            if db is not None:
                db.close()
            cache.close()
            raise

    def _forget_stored_settings(self) -> None:
        """diskcache applies the sqlite_* rows of its Settings table to every new connection before
        it reads what it is given (a row 'journal_mode = delete' waited 60 s for a lock), and the
        disk_* rows go to the Disk as they are. They are removed: diskcache then takes (and
        writes back) its own defaults for them."""
        database = self.directory / DBNAME
        if not database.exists():
            return
        db = sqlite3.connect(database, timeout=self.settings.disk_timeout_seconds, isolation_level=None)
        try:
            db.execute("DELETE FROM Settings WHERE key LIKE 'sqlite!_%' ESCAPE '!'"
                       " OR key LIKE 'disk!_%' ESCAPE '!' OR key = 'cull_limit'")
        except sqlite3.OperationalError as error:
            if "no such table" not in str(error):
                raise
        finally:
            db.close()

    def _set_aside(self, error: BaseException) -> None:
        """Move a corrupted database and its value files out of the way; keep the newest db."""
        self._close_connections()
        self.layout.set_aside_database()
        self.stats.recoveries += 1
        self.needs_repair = True
        log.warning("cache database %s was corrupted (%s): moved to %s, rebuilt empty",
                    self.directory / DBNAME, error, self.layout.corrupt)

    def _recover(self, error: sqlite3.DatabaseError) -> None:
        with self._reconnect_lock:
            if self._cache is None:
                return
            try:
                self._set_aside(error)
                self._connect()
                self.state = "ok"
            except (OSError, sqlite3.Error, diskcache.Timeout) as again:
                self._close_connections()
                self.state = "off"
                self._log_once("recover", "cache could not be rebuilt, memory only: %s", again)

    def _reopen_if_replaced(self) -> None:
        """Open the directory anew if its database file is no longer the one open (one stat per
        write). Entries stored before are no longer served (gone, or in the directory moved away)."""
        if self._cache is None or not self._replaced():
            return
        with self._reconnect_lock:
            if self._cache is None or not self._replaced():
                return  # a reader rebuilt a corrupted database meanwhile
            log.warning("cache database %s was removed or replaced while in use: opening the cache "
                        "directory anew", self.directory / DBNAME)
            self._close_connections()
            self._release()
            self._resume_writes()  # a pause (a full disk, say) was the old directory's
            self._open()
        # diskcache closes only this thread's connection: the readers' ones to the deleted files
        # (and the disk space they hold) go when their Cache object is collected.
        gc.collect()
        self._repair_if_needed()  # only the database removed: its value files are orphans

    def _replaced(self) -> bool:
        try:
            return identity(self.directory / DBNAME) != self._db_file
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError:  # cannot tell (a failing disk): the writes' own errors will say
            return False

    def _repair_if_needed(self) -> None:
        if self.state == "ok" and self.needs_repair:
            self.repair()

    def _resume_writes(self) -> None:
        """Writes go on at once, and their next failure is logged again."""
        self._retry_after = 0.0
        self._logged.difference_update(faults.PAUSING)

    def _mark_open(self) -> None:
        try:
            self.layout.mark_open()
        except OSError:  # a full disk: the next open just will not know to repair
            pass

    def _close_connections(self) -> None:
        cache, db, self._cache, self._db = self._cache, self._db, None, None
        if db is not None:
            db.close()
        if cache is not None:
            cache.close()

    def _release(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        self._closed = True
        was_open = self._cache is not None
        self._close_connections()
        self.state = "off"
        if was_open and not self.needs_repair:
            try:
                self.layout.marker.unlink(missing_ok=True)
            except OSError:  # read-only by now: the next open repairs, which is harmless
                pass
        self._release()

    def repair(self) -> int:
        """Check and fix database and files (orphan value files, counts); delete trash left by a
        rebuild. Slow on a big cache: run it in the background. Returns the number of fixes."""
        for trash in self.layout.corrupt.glob("trash-*"):
            shutil.rmtree(trash, ignore_errors=True)
        cache = self._cache
        if cache is None:
            return 0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")  # check() reports by warnings; keep them as a list
                found = cache.check(fix=True, retry=True)
        except sqlite3.DatabaseError as error:
            self._on_db_error(error, "repair")
            return 0
        except (OSError, diskcache.Timeout) as error:
            log.warning("cache repair failed: %s", error)
            return 0
        self.needs_repair = False
        if found:
            log.info("cache repair fixed %d problems, e.g. %s", len(found), found[0].message)
        self._refresh_volume(cache)
        return len(found)

    # -- reads ---------------------------------------------------------------------------------

    def get(self, digest: str) -> record.CachedAudio | None:
        """The verified entry, or None. A row that fails to parse or its checksum is deleted.
        (Hits and misses are counted by the facade, which also judges freshness.)"""
        cache = self._cache
        if cache is None:
            return None
        try:
            blob = cache.get(digest)
        except UnreadableRow:
            blob = b""
        except sqlite3.DatabaseError as error:
            self._on_db_error(error, "read")
            return None
        except diskcache.Timeout:
            return None
        if blob is None:
            return None
        try:
            entry = record.decode(blob, digest)
        except record.CorruptEntry as error:
            self.stats.corrupt_dropped += 1
            self._log_once("corrupt-entry", "dropping corrupt cache entry %s: %s", digest, error)
            self.delete(digest)
            return None
        return entry

    # -- writes (the facade runs these on its single writer thread) ----------------------------

    def put(self, entry: record.CachedAudio, expire: float | None) -> bool:
        """Store one entry; False if it was not stored (tier off or paused, or the write failed).
        A directory removed or replaced under us is opened anew first."""
        self._reopen_if_replaced()
        cache = self._cache
        if cache is None:
            return False
        if self._retry_after > time.monotonic():
            self.stats.store_skipped += 1
            return False
        meta = entry.meta
        encoded = record.encode(record.checksummed(entry))
        if len(encoded) > self.settings.disk_bytes:  # kept as the one just stored, it held the tier over its cap
            self.stats.store_skipped += 1
            return False
        disk: RawDisk = cache.disk
        try:
            cache.set(meta.key, encoded, expire=expire,
                      tag=voice_tag(meta.voice, meta.version))
            disk.saved()
        except (OSError, sqlite3.Error, diskcache.Timeout) as error:
            disk.discard_unsaved()
            self._store_failed(error)
            return False
        self._shrink_to_limit(keep=meta.key)
        if self.state == "paused":
            self.state = "ok"
            self._resume_writes()
            log.info("cache writes to %s work again", self.directory)
        if self._generations.pending():  # an invalidation the database missed: written now it works
            self.save_pending()
        return True

    def touch(self, digest: str) -> None:
        """Mark an entry recently used without rewriting it (see CacheSettings.touch_interval_seconds).

        diskcache has no public call that refreshes store_time, so this updates that column of its
        `Cache` table directly; tests/test_cache_disk.py checks that it still steers eviction."""
        if self.policy != "least-recently-stored" or self._db is None or self.state != "ok":
            return
        try:
            with self._db_lock:
                self._db.execute("UPDATE Cache SET store_time = ? WHERE key = ? AND raw = 1",
                                 (time.time(), digest))
        except sqlite3.DatabaseError as error:
            self._on_db_error(error, "touch")

    def delete(self, digest: str) -> None:
        self._guarded(lambda cache: cache.delete(digest), "delete")

    def evict_version(self, voice: str, version: str) -> int:
        self._reopen_if_replaced()
        tag = voice_tag(voice, version)
        return self._guarded(self._freeing_space_first(lambda cache: cache.evict(tag), "tag = ?", (tag,)), "evict")

    def clear(self) -> int:
        self._reopen_if_replaced()
        return self._guarded(self._freeing_space_first(lambda cache: cache.clear(), "1", ()), "clear")

    def _freeing_space_first(self, drop: Callable[[diskcache.Cache], int], rows: str,
                             params: tuple[object, ...]) -> Callable[[diskcache.Cache], int]:
        """`drop`, which deletes rows and then their value files: on a full disk the deletion
        itself fails (SQLite's WAL needs room), so the files of those rows are removed first and
        it is tried again. Else a clear on a full disk freed nothing, and the tier stayed paused."""
        def dropping(cache: diskcache.Cache) -> int:
            try:
                return drop(cache)
            except (OSError, sqlite3.Error) as error:
                if faults.reason(error) != "disk_full" or self._db is None:
                    raise
                with self._db_lock:
                    names = self._db.execute(f"SELECT filename FROM Cache WHERE filename IS NOT NULL AND ({rows})",
                                             params).fetchall()
                for (name,) in names:
                    self.layout.remove_value_file(name)
                return drop(cache)
        return dropping

    def save_generation(self, scope: str, value: int) -> bool:
        """Persist one invalidation counter; False if it could not be written."""
        self._reopen_if_replaced()
        if self._db is None:
            return False
        try:
            with self._db_lock:
                self._db.execute(RAISE_GENERATION, (scope, value))
                if scope == ALL:  # the other counters start again (Generations.bump); only once
                    # ALL is stored: the other way round, a crash between would revive old entries
                    self._db.execute("DELETE FROM edged_generations WHERE scope != ?", (ALL,))
            return True
        except sqlite3.DatabaseError as error:
            self._on_db_error(error, "invalidate")
            return False

    def save_pending(self) -> bool:
        """Write the counters of invalidations the database missed (a write failed, or the tier was
        paused): else they were lost at the next start, and what they invalidated served again.
        Whether none is left to write."""
        pending = self._generations.pending()
        if all(self.save_generation(scope, value) for scope, value in pending):
            self._generations.saved(pending)
            return True
        return False

    # -- helpers -------------------------------------------------------------------------------

    def _guarded(self, action: Callable[[diskcache.Cache], object], what: str) -> int:
        cache = self._cache
        if cache is None:
            return 0
        try:
            result = action(cache)
        except (sqlite3.DatabaseError, OSError, diskcache.Timeout) as error:
            if isinstance(error, sqlite3.DatabaseError):
                self._on_db_error(error, what)
            else:
                log.warning("cache %s failed (%s): %s", what, faults.reason(error), error)
            return 0
        self._refresh_volume(cache)
        return result if isinstance(result, int) else 0

    def _refresh_volume(self, cache: diskcache.Cache) -> None:
        try:
            self.volume, self.count = self._volume(), len(cache)
        except sqlite3.Error:
            pass

    def _on_db_error(self, error: sqlite3.DatabaseError, what: str) -> None:
        if faults.is_corruption(error):
            self._recover(error)
        else:
            self._log_once(f"db-{what}", "cache %s failed: %s", what, error)

    def _store_failed(self, error: BaseException) -> None:
        reason = faults.reason(error)
        self.stats.store_failures[reason] = self.stats.store_failures.get(reason, 0) + 1
        if reason == "corrupt":
            assert isinstance(error, sqlite3.DatabaseError)
            self._recover(error)
            return
        self._retry_after = time.monotonic() + self.settings.write_retry_seconds
        self.state = "paused"
        self._log_once(reason, "cache write to %s failed (%s), serving without storing: %s",
                       self.directory, reason, error)

    def _log_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(message, *args)


def voice_tag(voice: str, version: str) -> str:
    """diskcache's tag column holds the voice version, so dropping a version is one indexed evict."""
    return f"{voice}\x1f{version}"
