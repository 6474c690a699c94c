"""The daemon's cache under faults: SIGKILL during write-heavy bursts (tools.daemon_crash), a full
disk under the cache directory, and a corrupted cache database found at start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cache_helpers import fill, small_filesystem
from daemon_harness import Daemon, Reply, wait_for

from edged.cache.layout import DBNAME, Layout
from tools.daemon_crash import Ledger, crash_rounds

SLOW = os.environ.get("EDGED_SLOW_TESTS") == "1"
MEMORY_OFF = "[cache]\nmemory_bytes = 1\nwrite_retry_seconds = 0\n"
"""Nothing fits in memory, so a hit comes from disk and a miss that was not stored stays a miss;
every disk write is tried (no pause after a failure), so each failure is counted."""


def _synth(daemon: Daemon, text: str) -> Reply:
    reply = daemon.request("POST", "/v1/synthesize", {"text": text, "format": "pcm"})
    assert reply.status == 200, reply.body[:300]
    assert len(reply.body) > 2205  # at least 50 ms of audio
    return reply


def _flushed(daemon: Daemon) -> dict:
    return wait_for(lambda: (c := daemon.status()["cache"])["write_queue_bytes"] == 0
                    and c["in_flight"] == 0 and c)


def test_ledger_counts_a_hit_that_differs_as_wrong() -> None:
    ledger = Ledger()
    ledger.record("a", "miss", b"first!")
    ledger.record("a", "hit", b"first!")
    ledger.record("a", "hit", b"other!")  # neither the reference nor any answer seen: wrong
    ledger.record("b", "miss", b"one!")
    ledger.record("b", "miss", b"two!")  # the stored audio is now "two"
    ledger.record("b", "hit", b"one!")  # an older answer: counted apart, not wrong
    ledger.record("c", "miss", None)  # cut: what was stored is unknown, the next hit is adopted
    ledger.record("c", "hit", b"three!")
    ledger.record("d", "miss", b"odd")  # not whole 16-bit samples: wrong even as a miss
    counts = ledger.counts
    assert (counts["wrong"], counts["older"], counts["adopted"], counts["hits_checked"]) == (2, 1, 1, 3)


def test_sigkill_during_write_heavy_bursts_serves_no_wrong_audio(tmp_path: Path, bundle_dir: Path) -> None:
    rounds = 100 if SLOW else 5
    result = crash_rounds(rounds, tmp_path, seed=1)
    assert result["failed_starts"] == 0, result
    assert result["wrong"] == 0, result
    assert result["hits_checked"] > 0 and result["misses"] > 0, result  # the check had something to check


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root")
def test_full_disk_keeps_serving_without_storing(tmp_path: Path, bundle_dir: Path) -> None:
    daemon = Daemon(tmp_path / "d", MEMORY_OFF)
    with small_filesystem(daemon.cache_dir.parent, 4096) as mount:
        daemon.start()
        try:
            daemon.wait_state("READY")
            stored = _synth(daemon, "Stored before the disk filled.")
            assert _flushed(daemon)["disk_entries"] == 1
            filler = fill(mount)
            for _ in range(2):  # served each time, never stored: the second is a miss again
                reply = _synth(daemon, "Asked for on a full disk.")
                assert reply.headers["x-edged-cache"] == "miss"
                cache = _flushed(daemon)
            assert cache["disk_store_failures"].get("disk_full", 0) >= 1, cache
            assert cache["disk_entries"] == 1
            metrics = daemon.get("/metrics").body.decode()
            assert 'edged_cache_disk_write_failures_total{reason="disk_full"}' in metrics
            again = _synth(daemon, "Stored before the disk filled.")  # reads go on
            assert again.headers["x-edged-cache"] == "hit" and again.body == stored.body
            filler.unlink()
        finally:
            assert daemon.stop() == 0, daemon.log_text()


def test_corrupted_cache_database_is_moved_aside_at_start(tmp_path: Path, bundle_dir: Path) -> None:
    daemon = Daemon(tmp_path / "d", MEMORY_OFF)
    database = Layout(daemon.cache_dir).store / DBNAME
    database.parent.mkdir(parents=True)
    database.write_bytes(os.urandom(64 * 1024))
    daemon.start()
    try:
        daemon.wait_state("READY")
        first = _synth(daemon, "Served over a corrupted cache.")
        assert first.headers["x-edged-cache"] == "miss"
        cache = _flushed(daemon)
        assert cache["disk_state"] == "ok" and cache["disk_recoveries"] == 1, cache
        assert "edged_cache_disk_recoveries_total 1.0" in daemon.get("/metrics").body.decode()  # both say so
        again = _synth(daemon, "Served over a corrupted cache.")  # the rebuilt database stores
        assert again.headers["x-edged-cache"] == "hit" and again.body == first.body
        aside = [p for p in (daemon.cache_dir / "corrupt").glob("cache.db.*") if not p.name.endswith(("-wal", "-shm"))]
        assert len(aside) == 1 and aside[0].stat().st_size == 64 * 1024
    finally:
        assert daemon.stop() == 0, daemon.log_text()
