"""kill -9 during cache writes, N rounds: every entry served afterwards is the audio that was stored.

    python -m tools.cache_crash [--rounds 100] [--dir DIR]

Each round starts a writer process that stores phrases as fast as it can through AudioCache (the
daemon's write path: singleflight, writer thread, diskcache; a capped disk tier, so it also
evicts, and a background repair when the previous round was killed), SIGKILLs it at a random
moment, then opens the cache here as a restarted daemon would (timed), reads every phrase that
may have been written, and repairs. An entry served must be byte-identical to its phrase's audio.
Prints JSON; exits 1 on any wrong answer or failed open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from edged.cache import AudioCache, CacheKey, CacheSettings
from edged.cache.diskstore import DiskStore
from edged.cache.generations import Generations

from .stats import middle_and_max

PHRASES = 1500
REPO = Path(__file__).resolve().parent.parent


def cache_settings(directory: Path) -> CacheSettings:
    # ~1,500 phrases of ~65 KB on average do not fit in 48 MB: the tier evicts as it goes.
    return CacheSettings(directory=directory, disk_bytes=48 * 1024 * 1024, memory_bytes=8 * 1024 * 1024,
                         ttl_seconds=None, touch_interval_seconds=0.0)


def phrase_key(i: int) -> CacheKey:
    return CacheKey.make(f"phrase number {i}", "en_US-joe-medium", "1")


def phrase_audio(i: int) -> bytes:
    return random.Random(i).randbytes(10_000 + (i * 7919) % 110_000)


async def write_forever(directory: Path, seed: int) -> None:
    cache = await AudioCache.open(cache_settings(directory))
    rng = random.Random(seed)
    print("ready", flush=True)
    while True:
        i = rng.randrange(PHRASES)

        async def produce(i: int = i) -> AsyncIterator[bytes]:
            audio = phrase_audio(i)
            for start in range(0, len(audio), 16384):
                yield audio[start : start + 16384]

        async with await cache.stream(phrase_key(i), produce, sample_rate=22050) as stream:
            await stream.read_all()
        while cache.stats().write_queue_bytes > 2 * 1024 * 1024:  # keep the disk busy, never idle
            await asyncio.sleep(0.001)


def verify(directory: Path) -> dict[str, Any]:
    """Open as a restarted daemon would, read every phrase, then repair."""
    started = time.perf_counter()
    store = DiskStore.open(cache_settings(directory), Generations())
    open_ms = (time.perf_counter() - started) * 1000
    served = wrong = 0
    for i in range(PHRASES):
        entry = store.get(phrase_key(i).digest)
        if entry is not None:
            served += 1
            wrong += entry.audio != phrase_audio(i)
    row = {"state": store.state, "open_ms": round(open_ms, 1), "served": served, "wrong": wrong,
           "dropped": store.stats.corrupt_dropped, "needed_repair": store.needs_repair,
           "repaired": store.repair() if store.needs_repair else 0}
    row["orphans"] = len(list(store.directory.glob("??/??/*.val"))) - _file_rows(store)
    store.close()
    return row


def _file_rows(store: DiskStore) -> int:
    import sqlite3

    db = sqlite3.connect(store.directory / "cache.db")
    try:
        return int(db.execute("SELECT COUNT(*) FROM Cache WHERE filename IS NOT NULL").fetchone()[0])
    finally:
        db.close()


def crash_rounds(rounds: int, directory: Path, max_delay: float = 0.4, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    rows = []
    for n in range(rounds):
        writer = subprocess.Popen(
            [sys.executable, "-m", "tools.cache_crash", "--writer", str(directory), "--seed", str(n + seed)],
            cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert writer.stdout is not None
        ready = writer.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.02, max_delay))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        row = verify(directory)
        row["writer_ready"] = ready
        rows.append(row)
    open_p50, open_max = middle_and_max(r["open_ms"] for r in rows)
    return {
        "rounds": rounds,
        "wrong": sum(r["wrong"] for r in rows),
        "served": sum(r["served"] for r in rows),
        "dropped": sum(r["dropped"] for r in rows),
        "repairs": sum(r["needed_repair"] for r in rows),
        "fixed": sum(r["repaired"] for r in rows),
        "orphans_left": max(r["orphans"] for r in rows),
        "failed_opens": sum(r["state"] != "ok" for r in rows),
        "writers_ready": sum(r["writer_ready"] for r in rows),
        "open_ms_p50": open_p50, "open_ms_max": open_max,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--writer", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.writer is not None:
        asyncio.run(write_forever(args.writer, args.seed))
        return
    with tempfile.TemporaryDirectory(prefix="edged-cache-crash-", dir=args.dir) as scratch:
        result = crash_rounds(args.rounds, Path(scratch) / "cache", seed=args.seed)
    print(json.dumps(result, indent=2))
    if result["wrong"] or result["failed_opens"]:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
