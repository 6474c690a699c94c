"""The disk tier under faults: full disk, read-only and unwritable directories, corrupted database
and entries, tampered rows; eviction order and directory permissions."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import pickle
import shutil
import sqlite3
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from cache_helpers import (
    KEY,
    Producer,
    fetch,
    fill,
    run,
    settle,
    small_filesystem,
    stored_before_a_restart,
    stores_again,
)

from edged.cache import AudioCache, CacheKey, CacheSettings, default_directory
from edged.cache.diskstore import DiskStore
from edged.cache.generations import ALL, SCOPES, Generations
from edged.cache.layout import DBNAME, Layout
from edged.cache.record import CachedAudio, EntryMeta, audio_checksum

LOGGER = "edged.cache.diskstore"


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def value_files(directory: Path) -> list[Path]:
    """The value files of the cache configured at `directory`."""
    return list(Layout(directory).store.glob("??/??/*.val"))


def database(directory: Path) -> Path:
    return Layout(directory).store / DBNAME


def warnings_logged(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_disk_full_keeps_serving_without_storing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with small_filesystem(tmp_path / "small", 4096) as mount:
        cache_settings = CacheSettings(directory=mount / "cache", memory_bytes=1, ttl_seconds=None,
                                       write_retry_seconds=0.0)
        keys = [CacheKey.make(f"phrase {i}", "v", "1") for i in range(6)]
        producers = [Producer(chunks=2, size=60_000) for _ in keys]

        async def scenario() -> None:
            cache = await AudioCache.open(cache_settings)
            await fetch(cache, producers[0], keys[0])
            await settle(cache)
            filler = fill(mount)
            for key, producer in zip(keys[1:5], producers[1:5]):
                assert await fetch(cache, producer, key) == ("miss", producer.whole)  # served
                await settle(cache)
            stats = cache.stats()
            assert stats.disk_store_failures.get("disk_full", 0) == 4
            assert stats.disk_state == "paused"
            assert warnings_logged(caplog, "serving without storing") == 1  # once, not per write
            assert value_files(cache_settings.resolved_directory()).__len__() == 1  # no partial files
            assert await fetch(cache, producers[0], keys[0]) == ("hit", producers[0].whole)  # reads go on
            filler.unlink()
            await fetch(cache, producers[5], keys[5])
            await settle(cache)
            assert cache.stats().disk_state == "ok"
            assert await fetch(cache, producers[5], keys[5]) == ("hit", producers[5].whole)
            await cache.close()

        run(scenario())


def test_a_clear_on_a_full_disk_frees_the_space(tmp_path: Path) -> None:
    # Deleting rows needs room in SQLite's WAL: on a full disk the clear failed before it removed
    # any value file (answered 200, persisted), nothing was freed and the tier stayed paused.
    with small_filesystem(tmp_path / "small", 4096) as mount:
        cache_settings = CacheSettings(directory=mount / "cache", memory_bytes=1, ttl_seconds=None,
                                       write_retry_seconds=0.0)
        keys = [CacheKey.make(f"phrase {i}", "v", "1") for i in range(4)]

        async def scenario() -> None:
            cache = await AudioCache.open(cache_settings)
            for key in keys[:3]:
                await fetch(cache, Producer(chunks=2, size=60_000), key)
                await settle(cache)
            fill(mount)
            await fetch(cache, Producer(chunks=2, size=60_000), keys[3])
            await settle(cache)
            assert cache.stats().disk_state == "paused"
            await cache.clear()
            assert value_files(cache_settings.resolved_directory()) == []
            assert cache.stats().disk_entries == 0
            producer = Producer(chunks=2, size=60_000)  # the room freed takes new audio
            await fetch(cache, producer, keys[3])
            await settle(cache)
            assert cache.stats().disk_state == "ok"
            assert await fetch(cache, producer, keys[3]) == ("hit", producer.whole)
            await cache.close()

        run(scenario())


def test_cache_opened_on_a_full_disk_comes_back_when_space_is_freed(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "small", 2048) as mount:
        cache_settings = CacheSettings(directory=mount / "cache", memory_bytes=1, ttl_seconds=None,
                                       write_retry_seconds=0.0)
        old, new = Producer(), Producer()
        old_key, new_key = CacheKey.make("old", "v", "1"), CacheKey.make("new", "v", "1")

        async def scenario() -> None:
            cache = await AudioCache.open(cache_settings)
            await fetch(cache, old, old_key)
            await cache.close()
            filler = fill(mount)
            cache = await AudioCache.open(cache_settings)  # SQLite cannot create its WAL: off
            assert cache.stats().disk_state == "off"
            assert await fetch(cache, old, old_key) == ("miss", old.whole)  # still serving
            filler.unlink()
            await fetch(cache, new, new_key)  # a store finds the tier off: it reopens it
            await settle(cache)
            assert cache.stats().disk_state == "ok"
            assert await fetch(cache, old, old_key) == ("hit", old.whole)
            await cache.close()

        run(scenario())


def test_unwritable_directory_runs_memory_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with small_filesystem(tmp_path / "ro", 1024) as mount:
        remount(mount, "ro")

        async def scenario() -> None:
            cache = await AudioCache.open(CacheSettings(directory=mount / "edged", ttl_seconds=None))
            producer = Producer()
            assert await fetch(cache, producer) == ("miss", producer.whole)
            assert await fetch(cache, producer) == ("hit", producer.whole)
            assert cache.stats().disk_state == "off"
            await cache.close()

        run(scenario())
        assert warnings_logged(caplog, "caching in memory only") == 1


def test_directory_turning_read_only_pauses_writes_but_not_reads(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    cache_settings = CacheSettings(directory=directory, memory_bytes=1, ttl_seconds=None)
    kept, lost = Producer(), Producer()
    kept_key, lost_key = CacheKey.make("kept", "v", "1"), CacheKey.make("lost", "v", "1")

    async def scenario() -> None:
        cache = await AudioCache.open(cache_settings)
        await fetch(cache, kept, kept_key)
        await settle(cache)
        # Linux refuses to remount read-only under open files, so a read-only bind mount of the
        # directory over itself: new files get EROFS, files already open stay writable.
        await asyncio.to_thread(subprocess.run, ["mount", "--bind", str(directory), str(directory)], check=True)
        try:
            await asyncio.to_thread(subprocess.run, ["mount", "-o", "remount,bind,ro", str(directory)], check=True)
            assert await fetch(cache, lost, lost_key) == ("miss", lost.whole)
            await settle(cache)
            stats = cache.stats()
            assert stats.disk_state == "paused" and stats.disk_store_failures.get("unwritable") == 1
            assert await fetch(cache, kept, kept_key) == ("hit", kept.whole)
            await cache.close()
        finally:
            await asyncio.to_thread(subprocess.run, ["umount", "-l", str(directory)], check=True)

    if os.geteuid() != 0:
        pytest.skip("needs root to bind-mount a directory read-only")
    run(scenario())


def _stored(tmp_path: Path, names: list[str]) -> dict[str, Producer]:
    producers = {name: Producer() for name in names}

    async def scenario() -> None:
        cache = await AudioCache.open(CacheSettings(directory=tmp_path / "cache", ttl_seconds=None))
        for name, producer in producers.items():
            await fetch(cache, producer, CacheKey.make(name, "v", "1"))
        await cache.close()

    run(scenario())
    return producers


def test_corrupted_database_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    old = _stored(tmp_path, ["one", "two"])
    assert len(value_files(directory)) == 2
    database(directory).write_bytes(b"not a database " * 4096)

    async def scenario() -> None:
        cache = await AudioCache.open(CacheSettings(directory=directory, memory_bytes=1, ttl_seconds=None))
        assert cache.stats().disk_recoveries == 1
        for name, producer in old.items():  # the old entries are gone, and nothing else is served
            assert await fetch(cache, producer, CacheKey.make(name, "v", "1")) == ("miss", producer.whole)
        await stores_again(cache)
        await cache.close()

    run(scenario())
    kept = [p.name for p in (directory / "corrupt").glob("cache.db.*") if not p.name.endswith(("-wal", "-shm"))]
    assert len(kept) == 1  # the damaged database is kept for a post-mortem
    store = DiskStore.open(CacheSettings(directory=directory), Generations())
    assert store.state == "ok" and store.count == 3  # the two re-synthesized phrases and "new"
    store.repair()
    assert not list((directory / "corrupt").glob("trash-*"))  # the old value files are deleted
    assert len(value_files(directory)) == 3
    store.close()


def test_database_overwritten_while_open_never_gives_a_wrong_answer(tmp_path: Path) -> None:
    # SQLite may go on answering from its WAL and page cache, or see the damage: either way every
    # answer is the right audio or a miss, and the cache works again after a restart.
    directory = tmp_path / "cache"
    old = _stored(tmp_path, ["one", "two", "three"])
    keys = {name: CacheKey.make(name, "v", "1") for name in old}

    async def check(cache: AudioCache) -> None:
        for name, producer in old.items():
            status, audio = await fetch(cache, producer, keys[name])
            assert status in ("hit", "miss") and audio == producer.whole

    async def scenario() -> None:
        cache = await AudioCache.open(CacheSettings(directory=directory, memory_bytes=1, ttl_seconds=None))
        database(directory).write_bytes(os.urandom(database(directory).stat().st_size))
        await check(cache)
        await settle(cache)
        await cache.close()
        cache = await AudioCache.open(CacheSettings(directory=directory, memory_bytes=1, ttl_seconds=None))
        await check(cache)
        await stores_again(cache)
        await cache.close()

    run(scenario())


@pytest.mark.parametrize("how", ["removed", "replaced", "database removed"])
def test_cache_directory_removed_while_open_is_opened_anew(tmp_path: Path, how: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    # rm -rf of the cache directory to clear it: writes must not go on into the unlinked database
    # (lost at the next start, with value files outside any database).
    directory = tmp_path / "cache"
    before, after = Producer(), Producer()
    before_key, after_key = CacheKey.make("before", "v", "1"), CacheKey.make("after", "v", "1")

    async def scenario() -> None:
        cache = await AudioCache.open(CacheSettings(directory=directory, memory_bytes=1, ttl_seconds=None))
        await fetch(cache, before, before_key)
        await settle(cache)
        if how == "removed":
            shutil.rmtree(directory)
        elif how == "replaced":  # moved away and an empty directory put in its place
            directory.rename(tmp_path / "old")
            directory.mkdir(mode=0o700)
        else:  # its value files are left without a database: repaired away
            for path in database(directory).parent.glob(DBNAME + "*"):
                path.unlink()
        await fetch(cache, after, after_key)
        await settle(cache)
        assert cache.stats().disk_state == "ok"
        await cache.close()
        cache = await AudioCache.open(CacheSettings(directory=directory, memory_bytes=1, ttl_seconds=None))
        assert await fetch(cache, after, after_key) == ("hit", after.whole)  # stored where it lasts
        assert await fetch(cache, before, before_key) == ("miss", before.whole)
        await cache.close()

    with caplog.at_level(logging.WARNING):
        run(scenario())
    assert warnings_logged(caplog, "removed or replaced while in use") == 1
    assert len(value_files(directory)) == 2  # "after" and "before" again: none outside the database


def test_writes_paused_in_a_removed_directory_go_on_in_the_new_one(tmp_path: Path) -> None:
    # A full disk pauses writes; removing the directory to make room must not leave them paused.
    directory = tmp_path / "cache"
    store = DiskStore.open(CacheSettings(directory=directory, write_retry_seconds=3600), Generations())
    _put(store, "before")
    store._store_failed(OSError(errno.ENOSPC, "No space left on device"))
    assert store.state == "paused"
    shutil.rmtree(directory)
    entry = _put(store, "after")  # asserts it is stored
    assert store.state == "ok" and store.stats.store_skipped == 0
    store.close()
    store = DiskStore.open(CacheSettings(directory=directory), Generations())
    assert store.get(entry.meta.key) == entry
    store.close()


def test_an_invalidation_after_the_directory_was_replaced_is_kept_in_the_new_one(tmp_path: Path) -> None:
    # Written to the database moved away, it would be lost at the next start (and with the old
    # directory put back, what it invalidated served again).
    directory = tmp_path / "cache"
    store = DiskStore.open(CacheSettings(directory=directory), Generations())
    _put(store, "before")
    directory.rename(tmp_path / "old")
    directory.mkdir(mode=0o700)
    assert store.save_generation(ALL, 1)
    store.close()
    stored = Generations()
    DiskStore.open(CacheSettings(directory=directory), stored).close()
    assert dict(stored.items())[ALL] == 1


def _entry(name: str, size: int = 40_000) -> CachedAudio:
    audio = os.urandom(size)
    key = CacheKey.make(name, "v", "1").digest
    meta = EntryMeta(key=key, voice="v", version="1", format="pcm", sample_rate=22050, tag=None,
                     created=0.0, expires=None, generations=(0,) * SCOPES,
                     sha256=audio_checksum(audio), size=len(audio))
    return CachedAudio(meta, audio)


def _put(store: DiskStore, name: str, size: int = 40_000) -> CachedAudio:
    entry = _entry(name, size)
    assert store.put(entry, None)
    return entry


def test_entry_failing_its_checksum_is_dropped_not_served(tmp_path: Path) -> None:
    store = DiskStore.open(CacheSettings(directory=tmp_path / "cache"), Generations())
    entry = _put(store, "hello")
    (path,) = value_files(store.layout.directory)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one flipped bit of audio
    path.write_bytes(bytes(data))
    assert store.get(entry.meta.key) is None
    assert store.stats.corrupt_dropped == 1
    assert store.count == 0 and not value_files(store.layout.directory)
    store.close()


def test_tampered_rows_are_never_unpickled(tmp_path: Path) -> None:
    store = DiskStore.open(CacheSettings(directory=tmp_path / "cache"), Generations())
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (open, (str(marker), "w"))

    db = sqlite3.connect(database(store.layout.directory))
    rows = [("pickled", 4, None, pickle.dumps(Exploit())), ("escape", 2, "../../etc/passwd", None)]
    for key, mode, filename, value in rows:
        db.execute("INSERT INTO Cache (key, raw, store_time, access_time, tag, size, mode, filename, value)"
                   " VALUES (?, 1, 0, 0, NULL, 0, ?, ?, ?)", (key, mode, filename, value))
    db.commit()
    db.close()
    assert store.get("pickled") is None and store.get("escape") is None
    assert not marker.exists()
    assert store.stats.corrupt_dropped == 2 and store.count == 0
    store.close()


def test_eviction_takes_the_first_in_line_and_only_as_many_as_needed(tmp_path: Path) -> None:
    # diskcache culled the 10 least recently stored entries at each write over the cap.
    names = [f"e{i}" for i in range(12)]
    scratch = DiskStore.open(CacheSettings(directory=tmp_path / "scratch"), Generations())
    for name in names:
        _put(scratch, name)
    full = scratch.volume  # the cap that twelve entries just fit under
    scratch.close()

    def survivors(touch: bool) -> set[str]:
        store = DiskStore.open(CacheSettings(directory=tmp_path / f"touch-{touch}", disk_bytes=full + 4096),
                               Generations())
        entries = {name: _put(store, name) for name in names}
        if touch:
            store.touch(entries["e0"].meta.key)
        entries["new"] = _put(store, "new")
        kept = {name for name, e in entries.items() if store.get(e.meta.key) is not None}
        assert store.stats.evictions == 1 and store.volume <= full + 4096
        store.close()
        return kept

    assert survivors(touch=False) == {*names, "new"} - {"e0"}
    assert survivors(touch=True) == {*names, "new"} - {"e1"}  # touched, e0 is no longer first in line


def test_a_tier_that_holds_a_few_long_phrases_keeps_the_one_just_stored(tmp_path: Path) -> None:
    # With fewer than ten entries in the tier, diskcache's cull of ten emptied it at the write
    # that crossed the cap, the entry just stored included: a miss after a restart.
    store = DiskStore.open(CacheSettings(directory=tmp_path / "cache", disk_bytes=3_000_000,
                                         max_entry_bytes=1_000_000), Generations())
    entries = [_put(store, f"p{i}", size=465_000) for i in range(9)]
    assert [store.get(e.meta.key) is not None for e in entries] == [False] * 3 + [True] * 6
    assert store.stats.evictions == 3 and store.volume <= 3_000_000
    store.close()


def _eviction_after(tmp_path: Path, *damage: tuple[str, tuple[object, ...]]) -> None:
    """30 entries stored, the database damaged by `damage` (SQL with its parameters), then opened
    with a cap that holds a few: the oldest go first, and the tier stays within its cap after."""
    directory = tmp_path / "cache"
    store = DiskStore.open(CacheSettings(directory=directory), Generations())
    entries = [_put(store, f"e{i}") for i in range(30)]
    store.close()
    db = sqlite3.connect(database(directory))
    for statement, parameters in damage:
        db.execute(statement, parameters)
    db.commit()
    db.close()
    store = DiskStore.open(CacheSettings(directory=directory, disk_bytes=500_000), Generations())
    assert store.state == "ok" and store.volume <= 500_000
    kept = [e for e in entries if store.get(e.meta.key) is not None]
    assert 0 < len(kept) < len(entries) - 1 and kept == entries[-len(kept):]
    _put(store, "new", size=200_000)
    assert store.volume <= 500_000 and store.state == "ok"
    store.close()


def test_a_row_whose_key_is_not_text_does_not_stop_eviction(tmp_path: Path) -> None:
    # Evicting by key passed that key to the raw-bytes disk, which refuses what is not text: the
    # tier then grew past its cap for good, and a daemon opening it ran without a cache.
    insert = ("INSERT INTO Cache (key, raw, store_time, access_time, tag, size, mode, filename, value)"
              " VALUES (?, 0, 0, 0, NULL, 0, 1, NULL, ?)")
    _eviction_after(tmp_path, (insert, (b"\x80\x04K\x01.", b"x")))


def test_a_row_with_no_size_does_not_stop_eviction(tmp_path: Path) -> None:
    # diskcache's delete trigger subtracts the row's size from its byte count: once a row with no
    # size was deleted the count stayed NULL, and every eviction failed on it from then on.
    _eviction_after(tmp_path,
                    ("UPDATE Cache SET size = NULL WHERE rowid IN (SELECT rowid FROM Cache ORDER BY rowid LIMIT 2)",
                     ()),
                    ("DELETE FROM Cache WHERE rowid = (SELECT min(rowid) FROM Cache)", ()))


def killed(store: DiskStore) -> None:
    """Leave `store` as a kill -9 would: connections and lock gone, the open marker left."""
    store._close_connections()
    store._release()


def test_unclean_shutdown_is_detected_and_repaired(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    store = DiskStore.open(CacheSettings(directory=directory), Generations())
    entry = _put(store, "kept")
    assert not store.needs_repair
    orphan = store.directory / "ab" / "cd" / ("0" * 28 + ".val")  # a value whose row never committed
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"partial")
    killed(store)

    again = DiskStore.open(CacheSettings(directory=directory), Generations())
    assert again.needs_repair
    assert again.repair() >= 1
    assert not orphan.exists() and not again.needs_repair
    assert again.get(entry.meta.key) == entry
    again.close()
    assert not DiskStore.open(CacheSettings(directory=directory), Generations()).needs_repair


def test_cache_directory_is_private(tmp_path: Path) -> None:
    fresh = tmp_path / "a" / "b" / "cache"
    DiskStore.open(CacheSettings(directory=fresh), Generations()).close()
    assert fresh.stat().st_mode & 0o777 == 0o700
    assert Layout(fresh).store.stat().st_mode & 0o777 == 0o700
    # A directory that exists keeps its mode (it may not be the cache's alone); the audio is
    # kept in a private directory of its own inside it.
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    DiskStore.open(CacheSettings(directory=loose), Generations()).close()
    assert loose.stat().st_mode & 0o777 == 0o755
    assert Layout(loose).store.stat().st_mode & 0o777 == 0o700


def test_default_directory_follows_systemd_then_xdg(tmp_path: Path) -> None:
    assert default_directory({"CACHE_DIRECTORY": "/var/cache/edged:/var/cache/other"}) == Path("/var/cache/edged")
    assert default_directory({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "edged"
    assert default_directory({"XDG_CACHE_HOME": "relative"}) == Path.home() / ".cache" / "edged"
    assert default_directory({}) == Path.home() / ".cache" / "edged"


def test_unclean_stop_in_a_shared_directory_repairs_only_the_cache(tmp_path: Path) -> None:
    # A cache configured onto a directory that holds other files (here, a world-writable one):
    # the repair after a kill -9 must not sweep them, nor change the directory's mode.
    shared = tmp_path / "shared"
    (shared / "docs").mkdir(parents=True)
    (shared / "docs" / "thesis.txt").write_text("important")
    (shared / "notes.txt").write_text("also important")
    shared.chmod(0o1777)
    store = DiskStore.open(CacheSettings(directory=shared), Generations())
    _put(store, "hello")
    killed(store)
    orphan = Layout(shared).store / "ab" / "cd" / "orphan.val"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"x")

    again = DiskStore.open(CacheSettings(directory=shared), Generations())
    assert again.state == "ok" and again.needs_repair
    assert again.repair() >= 1 and not orphan.exists()
    assert (shared / "docs" / "thesis.txt").read_text() == "important"
    assert (shared / "notes.txt").read_text() == "also important"
    assert shared.stat().st_mode & 0o7777 == 0o1777
    assert len(value_files(shared)) == 1
    again.close()


def test_store_directory_holding_other_files_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store_dir = Layout(tmp_path / "cache").store
    store_dir.mkdir(parents=True)
    (store_dir / "photo.jpg").write_bytes(b"\xff\xd8")
    store = DiskStore.open(CacheSettings(directory=tmp_path / "cache"), Generations())
    assert store.state == "off"
    assert warnings_logged(caplog, "photo.jpg") == 1
    assert (store_dir / "photo.jpg").read_bytes() == b"\xff\xd8"
    assert not (store_dir / DBNAME).exists()
    store.close()


def test_second_process_on_one_cache_directory_stays_memory_only(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    settings = CacheSettings(directory=tmp_path / "cache", write_retry_seconds=0)
    first = DiskStore.open(settings, Generations())
    _put(first, "hello")
    # flock is per open file, so a second store in this process stands for a second process.
    second = DiskStore.open(settings, Generations())
    assert first.state == "ok" and second.state == "off"
    assert warnings_logged(caplog, "in use by another edged process") == 1
    first.close()
    second.retry_open()  # the directory is free again
    assert second.state == "ok" and second.count == 1 and not second.needs_repair
    second.close()


def _dropped_with_header(tmp_path: Path, header: Callable[[CachedAudio], bytes]) -> None:
    """An entry stored again with another record header is dropped when read, never served."""
    store = DiskStore.open(CacheSettings(directory=tmp_path / "cache"), Generations())
    entry = _put(store, "hello")
    tampered = header(entry)
    assert store._cache is not None
    store._cache.set(entry.meta.key, struct.pack("<4sBI", b"EDGA", 1, len(tampered)) + tampered + entry.audio)
    assert store.get(entry.meta.key) is None
    assert store.stats.corrupt_dropped == 1 and store.count == 0
    store.close()


def test_a_record_with_a_deeply_nested_header_is_dropped_not_raised(tmp_path: Path) -> None:
    _dropped_with_header(tmp_path, lambda _: b"[" * 20_000 + b"]" * 20_000)  # json.loads: RecursionError


def test_a_cache_directory_others_can_write_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Made first by another user in a shared directory, it would let them plant audio. (As root
    # here, ownership cannot be faked; a lock file others may write stands for it.)
    settings = CacheSettings(directory=tmp_path / "shared")
    lock = Layout(tmp_path / "shared").lock
    lock.parent.mkdir()
    lock.touch()
    lock.chmod(0o666)
    store = DiskStore.open(settings, Generations())
    assert store.state == "off"
    assert warnings_logged(caplog, "writable by others") == 1
    store.close()


@pytest.mark.parametrize("replacement", ["fifo", "huge", "symlink"])
def test_a_value_file_that_is_not_what_the_cache_wrote_is_dropped_without_reading_it(
        tmp_path: Path, replacement: str) -> None:
    # A FIFO in its place blocked the reader thread for good (every later miss hung behind it,
    # and the daemon could not stop); a huge file was read whole, twice over, into memory.
    store = DiskStore.open(CacheSettings(directory=tmp_path / "cache", max_entry_bytes=200_000), Generations())
    entry = _put(store, "hello")
    (path,) = value_files(store.layout.directory)
    path.unlink()
    if replacement == "fifo":
        os.mkfifo(path)
    elif replacement == "huge":
        with open(path, "wb") as sparse:
            sparse.truncate(2**40)  # 1 TiB, sparse: nothing is written
    else:
        (tmp_path / "elsewhere").write_bytes(b"x" * 300_000)
        path.symlink_to(tmp_path / "elsewhere")
    assert store.get(entry.meta.key) is None
    assert store.stats.corrupt_dropped == 1 and store.count == 0
    store.close()


@pytest.mark.parametrize(("field", "value"), [("expires", "2030-01-01"), ("sample_rate", "22050"),
                                              ("tag", 5), ("size", True), ("created", None)])
def test_a_record_header_field_of_the_wrong_type_is_dropped(tmp_path: Path, field: str, value: object) -> None:
    # Only the audio is checksummed: such a header was served, and failed at every request (500).
    _dropped_with_header(tmp_path, lambda entry: json.dumps({**entry.meta.__dict__, field: value}).encode())


def test_files_planted_beside_the_store_by_another_user_are_never_written_through(tmp_path: Path) -> None:
    # In a directory others can write: the "open" marker as a symlink to one of our files was
    # followed (the file overwritten with a pid), and a corrupt/ of theirs was given our audio.
    directory = tmp_path / "cache"
    _stored(tmp_path, ["one"])
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    Layout(directory).marker.symlink_to(victim)
    store = DiskStore.open(CacheSettings(directory=directory), Generations())
    assert store.state == "ok"
    store.close()
    assert victim.read_text() == "precious"

    for wal in database(directory).parent.glob(DBNAME + "-*"):  # its pages would mask the damage
        wal.unlink()
    database(directory).write_bytes(b"not a database " * 4096)
    corrupt = Layout(directory).corrupt
    corrupt.mkdir(mode=0o777, exist_ok=True)
    os.chown(corrupt, 65534, 65534)
    corrupt.chmod(0o777)
    store = DiskStore.open(CacheSettings(directory=directory), Generations())
    assert store.state == "off"  # memory only, rather than hand the database to that user
    store.close()
    assert list(corrupt.iterdir()) == []


def test_a_lowered_size_limit_is_met_at_open(tmp_path: Path) -> None:
    _stored(tmp_path, [f"phrase {i}" for i in range(30)])  # 30 x 120 kB
    store = DiskStore.open(CacheSettings(directory=tmp_path / "cache", disk_bytes=1_500_000), Generations())
    assert store.state == "ok" and store.volume <= 1_500_000 and 0 < store.count < 30
    store.close()


def test_a_clear_made_while_the_disk_tier_was_off_holds_when_it_comes_back(tmp_path: Path) -> None:
    # The tier opened late merged the stored counters over the clear's: cleared audio was served.
    import fcntl

    old = Producer()

    async def before() -> None:
        cache = await AudioCache.open(CacheSettings(directory=tmp_path / "cache", ttl_seconds=None))
        await cache.clear()  # the stored counter is ahead of a fresh process's
        await fetch(cache, old)
        await cache.close()

    async def with_the_tier_off_at_first(lock: int) -> None:
        settings = CacheSettings(directory=tmp_path / "cache", ttl_seconds=None, write_retry_seconds=0.0)
        cache = await AudioCache.open(settings)
        assert cache.disk is not None and cache.disk.state == "off"  # the directory is locked
        assert not (await cache.clear()).persisted
        os.close(lock)  # the directory is free: the next store opens the tier
        await fetch(cache, Producer(), CacheKey.make("another", "v", "1"))
        await settle(cache)
        assert cache.disk.state == "ok"
        assert (await fetch(cache, Producer()))[0] == "miss"
        await cache.close()

    run(before())
    lock = os.open(Layout(tmp_path / "cache").lock, os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    run(with_the_tier_off_at_first(lock))


def _database_held(directory: Path, seconds: float | None = None) -> sqlite3.Connection:
    """Another writer holding the cache's database: for `seconds`, else until released."""
    import threading

    holder = sqlite3.connect(Layout(directory).store / DBNAME, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    if seconds is not None:
        threading.Timer(seconds, _released, (holder,)).start()
    return holder


def _released(holder: sqlite3.Connection) -> None:
    holder.execute("ROLLBACK")
    holder.close()


def _promo_cleared_after_a_restart(cache_settings: CacheSettings) -> None:
    async def after_a_restart() -> None:
        cache = await AudioCache.open(cache_settings)
        assert (await fetch(cache, Producer(), KEY, "promo"))[0] == "miss"
        await cache.close()

    run(after_a_restart())


@pytest.mark.parametrize("then", ["another invalidation", "close"])
def test_an_invalidation_the_database_missed_is_written_when_it_can_be(tmp_path: Path, then: str) -> None:
    # A clear that could not be written (the database locked here; full, read-only...) held in
    # memory only, and was lost at the next start even when writes worked again long before it:
    # the cleared audio was served again.
    cache_settings = CacheSettings(directory=tmp_path / "cache", ttl_seconds=None, disk_timeout_seconds=0.2)

    async def missed() -> None:
        cache = await AudioCache.open(cache_settings)
        await fetch(cache, Producer(), KEY, "promo")
        await settle(cache)
        holder = _database_held(tmp_path / "cache")
        assert not (await cache.invalidate(tag="promo")).persisted
        _released(holder)
        if then == "another invalidation":  # written then, before the close
            assert (await cache.invalidate(tag="another")).persisted
            with sqlite3.connect(Layout(tmp_path / "cache").store / DBNAME) as db:
                scopes = [row[0] for row in db.execute("SELECT scope FROM edged_generations")]
            assert sum("promo" in scope for scope in scopes) == 1
        await cache.close()

    run(missed())
    _promo_cleared_after_a_restart(cache_settings)


def test_a_database_held_by_another_process_pauses_writes_not_each_for_its_timeout(tmp_path: Path) -> None:
    # Busy writes were tried one after another, each waiting its whole timeout (5 s by default):
    # an invalidation, or the daemon's exit, waited behind all of them (45 s for 8 writes).
    cache_settings = CacheSettings(directory=tmp_path / "cache", ttl_seconds=None, disk_timeout_seconds=0.2)

    async def held() -> None:
        cache = await AudioCache.open(cache_settings)
        holder = _database_held(tmp_path / "cache")
        for i in range(6):
            await fetch(cache, Producer(), CacheKey.make(f"Phrase {i}.", "en_US-joe-medium", "1.0.0"))
            await settle(cache)
        stats = cache.stats()
        assert stats.disk_state == "paused"
        assert stats.disk_store_failures == {"busy": 1} and stats.disk_store_skipped == 5
        _released(holder)
        await cache.close()

    run(held())


def test_an_invalidation_the_database_missed_is_written_by_the_next_store(tmp_path: Path) -> None:
    # A clear missed while the database was busy was written only by a later clear or a clean
    # close: a crash in between lost it (and its audio was served again), though stores worked.
    cache_settings = CacheSettings(directory=tmp_path / "cache", ttl_seconds=None, disk_timeout_seconds=0.2,
                                   write_retry_seconds=0.01)

    async def missed() -> None:
        cache = await AudioCache.open(cache_settings)
        holder = _database_held(tmp_path / "cache")
        assert not (await cache.invalidate(tag="promo")).persisted
        _released(holder)
        await fetch(cache, Producer(), KEY)
        await settle(cache)
        with sqlite3.connect(Layout(tmp_path / "cache").store / DBNAME) as db:
            scopes = [row[0] for row in db.execute("SELECT scope FROM edged_generations")]
        assert sum("promo" in scope for scope in scopes) == 1  # on disk before any close
        await cache.close()

    run(missed())


@pytest.mark.parametrize("row", [("disk_foo", 1), ("count", -5), ("sqlite_journal_mode", "delete")],
                         ids=["unknown disk setting", "negative count", "journal mode"])
def test_a_damaged_settings_table_does_not_turn_the_cache_off(tmp_path: Path, row: tuple[str, object]) -> None:
    # diskcache takes its settings from its database: an unknown disk_* row was a TypeError and a
    # negative count a ValueError at every start (the whole cache off, memory tier too); a journal
    # mode other than WAL made it retry a PRAGMA for 60 s.
    stored_before_a_restart(tmp_path, Producer())
    with sqlite3.connect(Layout(tmp_path / "cache").store / DBNAME) as db:
        db.execute("INSERT OR REPLACE INTO Settings VALUES (?, ?)", row)

    async def reopened() -> None:
        cache = await AudioCache.open(CacheSettings(directory=tmp_path / "cache", ttl_seconds=None))
        assert cache.stats().disk_state == "ok"
        assert (await fetch(cache, Producer()))[0] in ("hit", "miss")  # kept, or set aside and rebuilt
        await settle(cache)
        assert cache.stats().disk_entries == 1
        await cache.close()

    run(reopened())


def test_a_clear_of_everything_written_late_does_not_undo_a_later_one(tmp_path: Path) -> None:
    # A clear of everything the database missed was written after a tag's clear that did get
    # written (and was answered "persisted"): writing ALL deletes every other counter, so the
    # tag's clear was lost at the next start and its audio served again.
    cache_settings = CacheSettings(directory=tmp_path / "cache", ttl_seconds=None, disk_timeout_seconds=0.2)

    async def clears() -> None:
        cache = await AudioCache.open(cache_settings)
        holder = _database_held(tmp_path / "cache")
        assert not (await cache.clear()).persisted
        _released(holder)
        await fetch(cache, Producer(), KEY, "promo")
        await settle(cache)
        _database_held(tmp_path / "cache", 0.3)  # the pending ALL times out; the tag's could follow
        await cache.invalidate(tag="promo")
        await cache.close()

    run(clears())
    _promo_cleared_after_a_restart(cache_settings)


def test_reads_stuck_on_a_stalled_disk_do_not_hold_up_later_requests(tmp_path: Path) -> None:
    # A disk that stops answering cannot be made here: its reads are held on an event instead
    # (the real read follows). Once both reader threads are stuck, reads are misses at once.
    import threading
    import time

    stored = Producer()

    async def before() -> None:
        cache = await AudioCache.open(CacheSettings(directory=tmp_path / "cache", ttl_seconds=None))
        await fetch(cache, stored)
        await cache.close()

    async def stalled() -> None:
        settings = CacheSettings(directory=tmp_path / "cache", ttl_seconds=None, memory_bytes=0,
                                 disk_timeout_seconds=0.2)
        cache = await AudioCache.open(settings)
        assert cache.disk is not None
        disk_answers, real_get = threading.Event(), cache.disk.get

        def held_get(digest: str):  # type: ignore[no-untyped-def]
            disk_answers.wait(30)
            return real_get(digest)

        cache.disk.get = held_get  # type: ignore[method-assign]
        keys = [CacheKey.make(f"stuck {i}", "v", "1") for i in range(2)]
        await asyncio.gather(*(fetch(cache, Producer(), key) for key in keys))  # 0.2 s each, in parallel
        started = time.monotonic()
        assert (await fetch(cache, Producer()))[0] == "miss"  # KEY is stored, but the disk is stuck
        assert time.monotonic() - started < 0.15
        disk_answers.set()
        await asyncio.sleep(0.2)
        assert (await fetch(cache, stored))[0] == "hit"  # the disk answers again
        await cache.close()

    run(before())
    run(stalled())


def commits(statements: list[str]) -> int:
    """Commits of deleting statements: a transaction's COMMIT, or each DELETE run outside one.
    (SQLite traces a statement again for each trigger it fires: repeats are one statement.)"""
    count, open_transaction = 0, False
    for statement, previous in zip(statements, [None, *statements]):
        if statement == previous:
            continue
        if statement.startswith("BEGIN"):
            open_transaction = True
        elif statement == "COMMIT":
            count, open_transaction = count + 1, False
        elif statement.startswith("DELETE") and not open_transaction:
            count += 1
    return count


def test_many_small_entries_are_evicted_in_a_few_transactions_and_no_more_than_needed(tmp_path: Path) -> None:
    # One at a time, a large entry that had to evict ~1,500 small ones spent ~0.4 s on the writer thread.
    store = DiskStore.open(CacheSettings(directory=tmp_path / "cache", disk_bytes=4_000_000,
                                         max_entry_bytes=5_000_000), Generations())
    small = [_put(store, f"s{i}", size=1_500) for i in range(2_000)]
    footprint = store.volume / store.count  # an in-row entry's share of the database's pages
    evicted_before = store.stats.evictions
    statements: list[str] = []
    assert store._db is not None
    store._db.set_trace_callback(statements.append)
    big = _put(store, "big", size=3_000_000)
    store._db.set_trace_callback(None)

    evicted = store.stats.evictions - evicted_before
    kept = [store.get(e.meta.key) is not None for e in small]
    assert evicted > 1_000 and commits(statements) < 50
    assert kept == sorted(kept)  # the first in line went, and only they
    assert store.get(big.meta.key) is not None
    assert 0 <= store.settings.disk_bytes - store.volume < 2 * footprint
    store.close()


def test_a_value_file_that_cannot_be_deleted_does_not_stop_the_rest_of_an_eviction(tmp_path: Path) -> None:
    # The first file that failed to unlink ended the batch: the rest of its files stayed on disk
    # with no row to find them by, and nothing looked for them unless a stop was unclean.
    directory = tmp_path / "cache"
    store = DiskStore.open(CacheSettings(directory=directory), Generations())
    entries = [_put(store, f"e{i}") for i in range(30)]
    store.close()
    db = sqlite3.connect(database(directory))
    file_of = {key: Layout(directory).store / name for key, name in db.execute("SELECT key, filename FROM Cache")}
    db.close()
    stuck = file_of[entries[0].meta.key].parent  # the oldest entry's: the first evicted
    if os.geteuid() == 0:  # root deletes even where it may not write: a read-only bind mount
        subprocess.run(["mount", "--bind", str(stuck), str(stuck)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(stuck)], check=True)
    else:
        stuck.chmod(0o500)
    try:
        store = DiskStore.open(CacheSettings(directory=directory, disk_bytes=500_000), Generations())
        assert store.state == "ok" and store.volume <= 500_000
        evicted = [e for e in entries if store.get(e.meta.key) is None]
        assert store.stats.evictions == len(evicted) > 1
        left = {e.meta.key for e in evicted if file_of[e.meta.key].exists()}
        assert left == {e.meta.key for e in evicted if file_of[e.meta.key].parent == stuck}
        assert store.needs_repair
        store.close()
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(stuck)], check=True)
        else:
            stuck.chmod(0o700)
    again = DiskStore.open(CacheSettings(directory=directory, disk_bytes=500_000), Generations())
    assert again.needs_repair  # the close left its marker: the next start finds the orphans
    again.repair()
    assert len(value_files(directory)) == again.count and not again.needs_repair
    again.close()


def test_an_entry_larger_than_the_whole_tier_is_not_stored_on_disk(tmp_path: Path) -> None:
    # Stored, it was the entry eviction must keep: the tier emptied and stayed over its cap.
    store = DiskStore.open(CacheSettings(directory=tmp_path / "cache", disk_bytes=300_000), Generations())
    small = [_put(store, f"s{i}") for i in range(3)]
    assert not store.put(_entry("long", size=400_000), None)
    assert store.stats.store_skipped == 1 and store.volume <= 300_000
    assert all(store.get(e.meta.key) == e for e in small)  # nothing evicted for it
    store.close()
