"""Micro-benchmark of the cache: disk-tier eviction policies, and memory-tier hit latency.

    python -m tools.cache_bench [--entries 10000] [--requests 20000] [--quick]

Workload: `--entries` distinct phrases of 20-100 KB of audio each, requested with Zipf popularity
(exponent `--zipf`); the disk tier is capped at `--disk-fraction` of their total size, so it must
evict. Policies, all through edged's DiskStore (RawDisk, record checksums):

- lru:         diskcache "least-recently-used": every read is a write transaction.
- lrs:         "least-recently-stored", reads never write (evicts in store order, like FIFO).
- lrs+touch:   lrs, and a hit refreshes the entry's store time (one small UPDATE), as edged
               does on promotion from disk to memory.
- lrs+reset:   lrs, and a hit stores the entry again (diskcache's public API; rewrites the file).

Phases per policy: `sequential` (one thread: get, on a miss put), `two_tier` (a memory LRU of
`--memory-mb` in front, as in the daemon: hit ratios), `concurrent` (2 reader threads while a
writer stores new entries, as the daemon's thread layout: read latency under writes).
Prints JSON. Timings on a shared machine are indicative only.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edged.cache import AudioCache, CacheKey, CacheSettings
from edged.cache.diskstore import DiskStore, EvictionPolicy
from edged.cache.generations import SCOPES, Generations
from edged.cache.memory import MemoryTier
from edged.cache.record import CachedAudio, EntryMeta, audio_checksum

from .stats import percentile

MiB = 1024 * 1024
POLICIES: dict[str, tuple[EvictionPolicy, str]] = {
    "lru": ("least-recently-used", "none"),
    "lrs": ("least-recently-stored", "none"),
    "lrs+touch": ("least-recently-stored", "touch"),
    "lrs+reset": ("least-recently-stored", "reset"),
}


class Workload:
    def __init__(self, entries: int, zipf: float, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.sizes = self.rng.integers(20_000, 100_001, size=entries)
        ranks = np.arange(1, entries + 1, dtype=np.float64)
        weights = ranks ** -zipf
        self.p = weights / weights.sum()
        self.order = self.rng.permutation(entries)  # popularity rank -> phrase id
        self.noise = self.rng.integers(0, 256, size=200_000, dtype=np.uint8).tobytes()
        self.digests = [f"{i:064x}" for i in range(entries)]

    def requests(self, n: int) -> np.ndarray:
        return self.order[self.rng.choice(len(self.p), size=n, p=self.p)]

    def entry(self, i: int) -> CachedAudio:
        size = int(self.sizes[i])
        start = (i * 7919) % (len(self.noise) - size)
        audio = i.to_bytes(8, "little") + self.noise[start : start + size - 8]
        meta = EntryMeta(key=self.digests[i], voice="en_US-joe-medium", version="1", format="pcm",
                         sample_rate=22050, tag=None, created=time.time(), expires=None,
                         generations=(0,) * SCOPES, sha256=audio_checksum(audio), size=len(audio))
        return CachedAudio(meta, audio)


def pct(values: list[float], q: float) -> float:
    """The `q`th percentile of `values` (seconds) in ms, 3 decimals; 0.0 when there are none."""
    return percentile(values, q, scale=1000, digits=3) if values else 0.0


def open_store(root: Path, name: str, policy: EvictionPolicy, cap: int) -> DiskStore:
    directory = root / name.replace("+", "_")
    shutil.rmtree(directory, ignore_errors=True)
    settings = CacheSettings(directory=directory, disk_bytes=cap, ttl_seconds=None)
    return DiskStore.open(settings, Generations(), policy)


def on_hit(store: DiskStore, mode: str, entry: CachedAudio) -> None:
    if mode == "touch":
        store.touch(entry.meta.key)
    elif mode == "reset":
        store.put(entry, None)


def prefill(store: DiskStore, work: Workload, cap: int) -> None:
    for i in work.rng.permutation(len(work.sizes)):
        store.put(work.entry(int(i)), None)
        if store.volume >= cap:
            break


def sequential(store: DiskStore, mode: str, work: Workload, n: int) -> dict[str, Any]:
    hit_ms: list[float] = []
    miss_ms: list[float] = []
    put_ms: list[float] = []
    after_hit_ms: list[float] = []
    started = time.perf_counter()
    for i in work.requests(n):
        t0 = time.perf_counter()
        entry = store.get(work.digests[i])
        if entry is not None:
            hit_ms.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            on_hit(store, mode, entry)  # in the daemon: queued to the writer thread
            if mode != "none":
                after_hit_ms.append(time.perf_counter() - t1)
            continue
        t1 = time.perf_counter()
        miss_ms.append(t1 - t0)
        store.put(work.entry(int(i)), None)
        put_ms.append(time.perf_counter() - t1)
    elapsed = time.perf_counter() - started
    return {
        "ops_per_s": round(n / elapsed), "hit_ratio": round(len(hit_ms) / n, 3),
        "hit_p50_ms": pct(hit_ms, 50), "hit_p99_ms": pct(hit_ms, 99),
        "hit_write_p50_ms": pct(after_hit_ms, 50), "hit_write_p99_ms": pct(after_hit_ms, 99),
        "miss_p50_ms": pct(miss_ms, 50), "put_p50_ms": pct(put_ms, 50), "put_p99_ms": pct(put_ms, 99),
    }


def two_tier(store: DiskStore, mode: str, work: Workload, n: int, memory_bytes: int) -> dict[str, Any]:
    memory = MemoryTier(memory_bytes)
    mem_hits = disk_hits = 0
    for i in work.requests(n):
        digest = work.digests[i]
        if memory.get(digest) is not None:
            mem_hits += 1
            continue
        entry = store.get(digest)
        if entry is not None:
            disk_hits += 1
            on_hit(store, mode, entry)
        else:
            entry = work.entry(int(i))
            store.put(entry, None)
        memory.put(digest, entry)
    return {"memory_hit_ratio": round(mem_hits / n, 3), "disk_hit_ratio": round(disk_hits / n, 3),
            "miss_ratio": round(1 - (mem_hits + disk_hits) / n, 3)}


def concurrent(store: DiskStore, mode: str, work: Workload, seconds: float, read_rate: float,
               write_rate: float) -> dict[str, Any]:
    """The daemon's thread layout under load: 2 reader threads issue `read_rate` disk reads a
    second in all (memory misses), a hit's touch or reset is queued to the single writer thread,
    which also stores `write_rate` fresh entries a second (syntheses finishing)."""
    writes: queue.Queue[Callable[[], None]] = queue.Queue()
    stop = threading.Event()
    hit_times: list[float] = []
    miss_times: list[float] = []
    stored = [0]

    def reader(offset: float) -> None:
        due = time.perf_counter() + offset
        for i in work.requests(int(seconds * read_rate)):
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            due += 2 / read_rate
            if stop.is_set():
                return
            t0 = time.perf_counter()
            entry = store.get(work.digests[i])
            (hit_times if entry is not None else miss_times).append(time.perf_counter() - t0)
            if entry is not None and mode != "none":
                writes.put(functools.partial(on_hit, store, mode, entry))

    def writer() -> None:
        fresh = len(work.sizes)
        next_store = time.perf_counter()
        while not stop.is_set():
            try:
                writes.get(timeout=max(0.0, next_store - time.perf_counter()))()
                continue
            except queue.Empty:
                pass
            next_store += 1 / write_rate
            fresh += 1  # a new phrase: an existing body under a new key
            entry = work.entry(fresh % len(work.sizes))
            meta = EntryMeta(**{**entry.meta.__dict__, "key": f"{fresh:064x}"})
            store.put(CachedAudio(meta, entry.audio), None)
            stored[0] += 1

    threads = [threading.Thread(target=reader, args=(k / read_rate,)) for k in range(2)]
    writer_thread = threading.Thread(target=writer)
    started = time.perf_counter()
    for t in threads + [writer_thread]:
        t.start()
    for t in threads:
        t.join(seconds * 2)
    stop.set()
    writer_thread.join()
    elapsed = time.perf_counter() - started
    reads = len(hit_times) + len(miss_times)
    return {"reads_per_s": round(reads / elapsed), "hit_ratio": round(len(hit_times) / max(1, reads), 3),
            "hit_p50_ms": pct(hit_times, 50), "hit_p99_ms": pct(hit_times, 99),
            "hit_max_ms": pct(hit_times, 100), "miss_p99_ms": pct(miss_times, 99),
            "writes_per_s": round(stored[0] / elapsed), "writer_backlog": writes.qsize()}


async def memory_hit_latency(root: Path, n: int) -> dict[str, Any]:
    """Latency of AudioCache.stream() + reading all chunks for a memory hit (no thread hop)."""
    cache = await AudioCache.open(CacheSettings(directory=root / "memhit", ttl_seconds=None))
    key = CacheKey.make("Your timer is done.", "en_US-joe-medium", "1")
    audio = os.urandom(60_000)

    async def producer():  # type: ignore[no-untyped-def]
        yield audio

    async with await cache.stream(key, producer, sample_rate=22050) as stream:
        await stream.read_all()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with await cache.stream(key, producer, sample_rate=22050) as stream:
            assert stream.status == "hit"
            await stream.read_all()
        times.append(time.perf_counter() - t0)
    await cache.close()
    return {"n": n, "p50_us": percentile(times, 50, scale=1e6), "p99_us": percentile(times, 99, scale=1e6)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--disk-fraction", type=float, default=0.5)
    parser.add_argument("--memory-mb", type=int, default=64)
    parser.add_argument("--concurrent-seconds", type=float, default=10.0)
    parser.add_argument("--read-rate", type=float, default=400.0,
                        help="disk reads a second in the concurrent phase (memory misses at ~800 req/s)")
    parser.add_argument("--write-rate", type=float, default=20.0,
                        help="new entries a second in the concurrent phase (syntheses finishing)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--dir", type=Path, default=None, help="where to build the caches (local disk)")
    parser.add_argument("--quick", action="store_true", help="2,000 entries, 4,000 requests, 3 s")
    args = parser.parse_args()
    if args.quick:
        args.entries, args.requests, args.concurrent_seconds = 2000, 4000, 3.0
    root = Path(tempfile.mkdtemp(prefix="edged-cache-bench-", dir=args.dir))
    workload: dict[str, Any] = {"entries": args.entries, "requests": args.requests,
                                "zipf": args.zipf, "memory_mb": args.memory_mb}
    result: dict[str, Any] = {"workload": workload}
    try:
        for name in args.policies.split(","):
            policy, mode = POLICIES[name]
            work = Workload(args.entries, args.zipf, seed=1)
            cap = int(work.sizes.sum() * args.disk_fraction)
            workload["disk_mb"] = round(cap / MiB)
            store = open_store(root, name, policy, cap)
            prefill(store, work, cap)
            row: dict[str, Any] = {"sequential": sequential(store, mode, work, args.requests)}
            row["two_tier"] = two_tier(store, mode, work, args.requests, args.memory_mb * MiB)
            row["concurrent"] = concurrent(store, mode, work, args.concurrent_seconds,
                                           args.read_rate, args.write_rate)
            row["disk_evictions"] = store.stats.evictions
            store.close()
            shutil.rmtree(store.directory, ignore_errors=True)
            result[name] = row
            print(f"{name}: {json.dumps(row)}", flush=True, file=__import__("sys").stderr)
        result["memory_hit"] = asyncio.run(memory_hit_latency(root, 2000))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
