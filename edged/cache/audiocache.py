"""The cache facade: memory tier -> in-flight syntheses -> disk tier -> producer.

    cache = await AudioCache.open(CacheSettings())
    stream = await cache.stream(CacheKey.make(text, voice, version, speed), producer, sample_rate=22050)
    stream.status                      # "hit" | "miss" | "joined"
    async with stream:
        async for pcm in stream: ...   # as it is produced on a miss
    await cache.close()

A memory hit is answered on the event loop without a thread hop. Everything else for one key goes
through one `Flight`: the disk lookup (on a reader thread), then, on a miss, the producer. Disk
writes run on one writer thread, behind a byte-bounded queue.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import generations as gen
from .diskstore import DiskState, DiskStore
from .flight import AudioStream, Flight, Held, chunks_of
from .key import CacheKey
from .memory import MemoryTier
from .record import CachedAudio, EntryMeta
from .settings import CacheSettings

log = logging.getLogger(__name__)

READERS = 2
"""Threads reading the disk tier."""
Producer = Callable[[], AsyncIterator[bytes]]
T = TypeVar("T")


class SynthesisCancelled(Exception):
    """Raised to readers still attached when the cache closes under a running synthesis."""


@dataclass(frozen=True)
class Invalidation:
    memory_dropped: int
    disk_dropped: int
    """Entries deleted from disk now; others of the scope are skipped and dropped when read."""
    disk_swept: bool
    """The scope's entries on disk were looked for and deleted now (everything, or a voice's
    version, whose files can be found); else they are stale there, dropped when read or evicted."""
    persisted: bool
    """False if the disk tier could not record it (then it holds only until restart)."""
    everything: bool = False
    """Everything was cleared (asked for, or past generations.MAX_SCOPES)."""


@dataclass(frozen=True)
class CacheStats:
    memory_hits: int
    memory_misses: int
    memory_bytes: int
    memory_entries: int
    memory_evictions: int
    disk_hits: int
    disk_misses: int
    disk_bytes: int
    disk_entries: int
    disk_evictions: int
    disk_state: DiskState
    disk_store_failures: dict[str, int]
    disk_store_skipped: int
    disk_corrupt_dropped: int
    disk_recoveries: int
    joined: int
    """Requests that joined a synthesis already under way."""
    stale_dropped: int
    """Entries found expired or invalidated and dropped."""
    not_stored: int
    """Finished syntheses not stored: too long, over the stream buffer, or invalidated while running."""
    in_flight: int
    write_queue_bytes: int
    stream_buffer_bytes: int
    """Audio held for streams (see CacheSettings.stream_buffer_bytes)."""


@dataclass
class _Counters:
    memory_hits: int = 0
    memory_misses: int = 0
    disk_hits: int = 0
    """Requests answered from the disk tier (also those that joined another's read of it)."""
    disk_misses: int = 0
    """Disk reads that found nothing fresh."""
    joined: int = 0
    stale_dropped: int = 0
    not_stored: int = 0
    queue_skipped: int = 0
    writes: set[asyncio.Future[Any]] = field(default_factory=set)


class AudioCache:
    def __init__(self, settings: CacheSettings) -> None:
        self.settings = settings
        self.disk: DiskStore | None = None
        self._generations = gen.Generations()
        self._memory = MemoryTier(settings.memory_bytes)
        self._touched: dict[str, float] = {}
        self._flights: dict[str, Flight] = {}
        self._held = Held(settings.stream_buffer_bytes)
        self._counters = _Counters()
        self._queued = 0
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="edged-cache-read")
        self._stuck_reads = 0
        """Disk reads that timed out and have not returned (a stalled disk)."""
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="edged-cache-write")
        self._closed = False

    @classmethod
    async def open(cls, settings: CacheSettings) -> AudioCache:
        """Open both tiers. Never fails for disk trouble: the disk tier is then off (logged)."""
        cache = cls(settings)
        if settings.disk:
            # On the writer thread, which then owns the connection that opening made.
            disk = await cache._write(DiskStore.open, settings, cache._generations)
            cache.disk = disk
            if disk.needs_repair:  # the last run was killed, or a rebuild left old files behind
                cache._write(disk.repair)
        return cache

    async def flush(self) -> None:
        """Wait until queued disk work (writes, touches, deletes) is done."""
        while self._counters.writes:
            await asyncio.wait(list(self._counters.writes))

    async def close(self) -> None:
        """Cancel syntheses still running (nothing of them is stored), finish queued writes."""
        self._closed = True
        tasks = [f.task for f in self._flights.values() if f.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.flush()
        if self.disk is not None:
            await asyncio.get_running_loop().run_in_executor(self._writer, self.disk.save_pending)
            await asyncio.get_running_loop().run_in_executor(self._writer, self.disk.close)
        # Threads that end drop their SQLite connections with them.
        self._readers.shutdown(wait=False, cancel_futures=True)  # one may be stuck in a stalled read
        self._writer.shutdown(wait=True)

    # -- the request path --------------------------------------------------------------------

    async def stream(self, key: CacheKey, producer: Producer, *, sample_rate: int,
                     tag: str | None = None, counted: bool = True) -> AudioStream:
        """Audio for `key`: from memory or disk ("hit"), from a synthesis already under way for the
        same key ("joined"), or from `producer()` ("miss"), streamed as it is produced. A miss is
        stored only if the producer ends without error and without every reader leaving.
        `counted=False` (warm-up) leaves the hit, miss and join counts to requests, and reads as a
        background stream: a live synthesis it joined stops when its live readers have all left.

        The caller must close the returned stream (`async with stream:`)."""
        if self._closed:
            raise RuntimeError("cache is closed")
        digest = key.digest
        entry = self._memory.get(digest)
        if entry is not None:
            if self._fresh(entry.meta, time.time()):
                self._counters.memory_hits += counted
                self._touch_if_due(digest)
                return Flight.complete(entry.audio, self.settings.chunk_bytes).join("hit")
            self._drop(digest)
        self._counters.memory_misses += counted

        flight = self._flights.get(digest)
        # As for a hit: a flight may be joined while nothing it will be stored under (its creator's
        # tag among them) has been invalidated since it began, whatever the joining request's tag.
        creator = flight is None or not flight.joinable or flight.generations != self._generations.snapshot(
            key.voice, key.version, flight.tag)
        if creator:
            flight = Flight(self.settings.max_entry_bytes, self._abandon,
                            self._generations.snapshot(key.voice, key.version, tag), tag, self._held, live=counted)
            self._flights[digest] = flight
            stream = flight.join(background=not counted)
            flight.task = asyncio.get_running_loop().create_task(
                self._fill(flight, key, producer, sample_rate))
        else:
            assert flight is not None
            stream = flight.join(background=not counted)
        try:
            status = await asyncio.shield(flight.status)
        except BaseException:
            await stream.aclose()
            raise
        if status == "hit":  # from the disk tier (a memory hit returned above), read or joined
            stream.status = "hit"
            self._counters.disk_hits += counted
        elif creator:
            stream.status = "miss"
        else:
            stream.status = "joined"
            self._counters.joined += counted
        return stream

    async def _fill(self, flight: Flight, key: CacheKey, producer: Producer, sample_rate: int) -> None:
        digest = key.digest
        try:
            if self._disk_readable():
                entry = await self._read_entry(digest)
                if entry is not None and self._fresh(entry.meta, time.time()):
                    self._remember(entry)
                    self._write(self.disk.touch, digest)  # type: ignore[union-attr]
                    flight.resolve("hit")
                    if digest in self._memory:  # audio the cache holds anyway, as for a memory hit
                        flight.held = None
                    for chunk in chunks_of(entry.audio, self.settings.chunk_bytes):
                        flight.append(chunk)
                    flight.finish()
                    return
                self._counters.disk_misses += flight.live  # none, or stale (dropped below)
                if entry is not None:
                    self._counters.stale_dropped += 1
                    self._write(self.disk.delete, digest)  # type: ignore[union-attr]
            flight.resolve("miss")
            chunks = producer()
            try:
                async for chunk in chunks:
                    if chunk:
                        flight.append(bytes(chunk))
                        await flight.room()
            finally:
                aclose = getattr(chunks, "aclose", None)
                if aclose is not None:
                    await aclose()
        except asyncio.CancelledError:
            flight.finish(SynthesisCancelled("synthesis was cancelled"))
            raise
        except BaseException as error:  # the producer's error reaches every reader
            flight.finish(error)
            if not isinstance(error, Exception):
                raise
        else:
            try:
                self._store(flight, key, sample_rate)
            except Exception:  # a bug: the readers have their audio; the entry is only not kept
                log.exception("could not store the audio of %s", key.digest[:16])
                self._counters.not_stored += 1
            finally:  # its readers must not wait for ever, whatever storing did
                flight.finish()
        finally:
            if self._flights.get(digest) is flight:
                del self._flights[digest]

    def _abandon(self, flight: Flight) -> None:
        """Every reader left before the end: stop the producer, store nothing."""
        for digest, current in list(self._flights.items()):
            if current is flight:
                del self._flights[digest]
        if flight.task is not None:
            flight.task.cancel()

    def _store(self, flight: Flight, key: CacheKey, sample_rate: int) -> None:
        if not flight.cacheable or flight.size == 0 or self._closed:
            self._counters.not_stored += int(flight.size > 0)
            return
        if self._generations.snapshot(key.voice, key.version, flight.tag) != flight.generations:
            self._counters.not_stored += 1  # invalidated while it was being synthesized
            return
        audio = flight.audio()
        now = time.time()
        ttl = self.settings.ttl_seconds
        jitter = self.settings.ttl_jitter
        lifetime = ttl * random.uniform(1 - jitter, 1 + jitter) if ttl else None
        meta = EntryMeta(
            key=key.digest, voice=key.voice, version=key.version, format=key.format,
            sample_rate=sample_rate, tag=flight.tag, created=now,
            expires=now + lifetime if lifetime else None, generations=flight.generations,
            sha256="", size=len(audio),  # its checksum is the disk tier's, made on its thread
        )
        entry = CachedAudio(meta, audio)
        self._remember(entry)
        if self.disk is None:
            return
        if self.disk.state == "off":
            self._write(self.disk.retry_open)  # for the next ones; a no-op until it is due
            return
        if self._queued + len(audio) > self.settings.write_queue_bytes:
            self._counters.queue_skipped += 1
            return
        self._queued += len(audio)
        self._write(self.disk.put, entry, lifetime).add_done_callback(
            lambda _: self._dequeue(len(audio)))

    def _dequeue(self, size: int) -> None:
        self._queued -= size

    # -- invalidation --------------------------------------------------------------------------

    async def invalidate(self, voice: str | None = None, version: str | None = None,
                         tag: str | None = None) -> Invalidation:
        """Drop the entries that have every name given: a voice (one version of it, or all), a
        tag, or both; with none given, everything."""
        scope = gen.scope_of(voice, version, tag)
        if scope == gen.ALL:
            return await self.clear()
        if version is not None and tag is None:  # its files can be found on disk: deleted now
            return await self._invalidate(scope, lambda: self.disk.evict_version(voice, version))  # type: ignore[union-attr,arg-type]
        return await self._invalidate(scope, None)

    async def clear(self) -> Invalidation:
        return await self._invalidate(gen.ALL, lambda: self.disk.clear())  # type: ignore[union-attr]

    async def _invalidate(self, scope: str, delete: Callable[[], int] | None) -> Invalidation:
        if scope != gen.ALL and self._generations.full(scope):
            log.warning("%d cache scopes invalidated already; clearing everything instead of one more",
                        gen.MAX_SCOPES)
            return await self.clear()
        value = self._generations.bump(scope)
        now = time.time()
        dropped = self._memory.purge(lambda entry: not self._fresh(entry.meta, now))
        persisted, disk_dropped = False, 0
        if self.disk is not None and self.disk.state != "off":
            # Earlier counters the database missed go first: an ALL written after this counter
            # would delete it. While they cannot be written, this one waits with them.
            if await self._write(self.disk.save_pending):
                persisted = await self._write(self.disk.save_generation, scope, value)
            if delete is not None:
                disk_dropped = await self._write(delete)
        if not persisted:
            self._generations.unsaved(scope)
        return Invalidation(dropped, disk_dropped, delete is not None, persisted, everything=scope == gen.ALL)

    # -- metrics --------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        c, disk = self._counters, self.disk
        d = disk.stats if disk is not None else None
        return CacheStats(
            memory_hits=c.memory_hits, memory_misses=c.memory_misses,
            memory_bytes=self._memory.bytes, memory_entries=len(self._memory),
            memory_evictions=self._memory.evictions,
            disk_hits=c.disk_hits, disk_misses=c.disk_misses,
            disk_bytes=disk.volume if disk else 0, disk_entries=disk.count if disk else 0,
            disk_evictions=d.evictions if d else 0, disk_state=disk.state if disk else "off",
            disk_store_failures=dict(d.store_failures) if d else {},
            disk_store_skipped=(d.store_skipped if d else 0) + c.queue_skipped,
            disk_corrupt_dropped=d.corrupt_dropped if d else 0,
            disk_recoveries=d.recoveries if d else 0,
            joined=c.joined, stale_dropped=c.stale_dropped, not_stored=c.not_stored,
            in_flight=len(self._flights), write_queue_bytes=self._queued,
            stream_buffer_bytes=self._held.bytes,
        )

    # -- helpers ----------------------------------------------------------------------------------

    def _fresh(self, meta: EntryMeta, now: float) -> bool:
        return not meta.expired(now) and meta.generations == self._generations.snapshot(
            meta.voice, meta.version, meta.tag)

    def _remember(self, entry: CachedAudio) -> None:
        digest = entry.meta.key
        if self._memory.put(digest, entry):
            self._touched[digest] = time.monotonic()
            if len(self._touched) > 2 * len(self._memory) + 64:  # forget entries evicted since
                self._touched = {d: t for d, t in self._touched.items() if d in self._memory}

    def _drop(self, digest: str) -> None:
        self._memory.discard(digest)
        self._counters.stale_dropped += 1
        if self._disk_readable():
            self._write(self.disk.delete, digest)  # type: ignore[union-attr]

    def _touch_if_due(self, digest: str) -> None:
        """A phrase served from memory never reaches the disk tier: refresh its disk recency now
        and then, so it is not the first to be evicted there."""
        now = time.monotonic()
        if now - self._touched.setdefault(digest, now) >= self.settings.touch_interval_seconds:
            self._touched[digest] = now
            if self._disk_readable():
                self._write(self.disk.touch, digest)  # type: ignore[union-attr]

    def _disk_readable(self) -> bool:
        return self.disk is not None and self.disk.state != "off"

    def _read(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(self._readers, fn, *args)

    async def _read_entry(self, digest: str) -> CachedAudio | None:
        """The disk tier's entry, or None; a read that takes over `disk_timeout_seconds` (a stalled
        disk) is a miss, and while as many reads are stuck as there are reader threads, every read
        is a miss at once: requests do not wait behind them."""
        if self._stuck_reads >= READERS:
            return None
        reading = self._read(self.disk.get, digest)  # type: ignore[union-attr]
        try:
            return await asyncio.wait_for(asyncio.shield(reading), self.settings.disk_timeout_seconds or None)
        except TimeoutError:
            log.warning("cache disk read took over %g s; answered as a miss", self.settings.disk_timeout_seconds)
            self._stuck_reads += 1
            reading.add_done_callback(self._read_unstuck)
            return None

    def _read_unstuck(self, _: asyncio.Future[Any]) -> None:
        self._stuck_reads -= 1

    def _write(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        future = asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)
        self._counters.writes.add(future)
        future.add_done_callback(self._counters.writes.discard)
        return future
