"""The two-tier audio cache: hits, singleflight streaming, integrity, TTL and invalidation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cache_helpers import KEY, RATE, Producer, fetch, run, settings, settle, stored_before_a_restart

from edged.cache import AudioCache, CacheKey, SynthesisCancelled


def test_miss_then_memory_hit_is_byte_identical(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer()
        assert await fetch(cache, producer) == ("miss", producer.whole)
        assert await fetch(cache, producer) == ("hit", producer.whole)
        assert producer.calls == 1
        stats = cache.stats()
        assert (stats.memory_hits, stats.memory_misses, stats.disk_misses) == (1, 1, 1)
        await cache.close()

    run(scenario())


def test_memory_hit_needs_no_thread_hop(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer()
        await fetch(cache, producer)
        coro = cache.stream(KEY, producer, sample_rate=RATE)
        # A hit completes on the first step: it never suspends to wait for a thread.
        with pytest.raises(StopIteration) as done:
            coro.send(None)
        stream = done.value.value
        assert stream.status == "hit"
        assert await stream.read_all() == producer.whole
        await cache.close()

    run(scenario())


def test_restart_serves_from_disk_byte_identical(tmp_path: Path) -> None:
    producer = Producer()

    async def second() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        assert await fetch(cache, producer) == ("hit", producer.whole)
        assert cache.stats().disk_hits == 1
        assert await fetch(cache, producer) == ("hit", producer.whole)
        assert cache.stats().memory_hits == 1  # promoted
        await cache.close()

    stored_before_a_restart(tmp_path, producer)
    run(second())
    assert producer.calls == 1


def test_every_hit_is_counted_in_a_tier_and_a_stale_entry_is_a_miss(tmp_path: Path) -> None:
    producer = Producer()

    async def second() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        # Four at once after a restart: one reads the disk, the others join that read.
        answers = await asyncio.gather(*(fetch(cache, producer) for _ in range(4)))
        assert answers == [("hit", producer.whole)] * 4
        stats = cache.stats()
        assert stats.memory_hits + stats.disk_hits == 4 and stats.disk_misses == 0
        # Invalidated: the disk row is found but stale, which is a miss, not a hit.
        await cache.invalidate(KEY.voice, None)
        assert (await fetch(cache, producer))[0] == "miss"
        after = cache.stats()
        assert after.disk_hits == stats.disk_hits and after.disk_misses == 1
        await cache.close()

    stored_before_a_restart(tmp_path, producer)
    run(second())


def test_identical_concurrent_requests_synthesize_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer(chunks=6)
        results = await asyncio.gather(*[fetch(cache, producer) for _ in range(5)])
        assert producer.calls == 1
        assert sorted(status for status, _ in results) == ["joined"] * 4 + ["miss"]
        assert all(audio == producer.whole for _, audio in results)
        assert cache.stats().joined == 4
        await cache.close()

    run(scenario())


def test_requests_with_other_tags_join_one_synthesis(tmp_path: Path) -> None:
    # An invalidated tag (generation 1) once made tagged and untagged requests replace each
    # other's flight: three syntheses for one key.
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        await cache.invalidate(tag="prompts")
        producer = Producer(chunks=6)
        results = await asyncio.gather(fetch(cache, producer), fetch(cache, producer, tag="prompts"),
                                       fetch(cache, producer), fetch(cache, producer, tag="other"))
        assert producer.calls == 1
        assert sorted(status for status, _ in results) == ["joined"] * 3 + ["miss"]
        assert all(audio == producer.whole for _, audio in results)
        await cache.close()

    run(scenario())


def test_joiners_stream_audio_before_synthesis_completes(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer(chunks=3, gated=True)
        first = await cache.stream(KEY, producer, sample_rate=RATE)
        second = await cache.stream(KEY, producer, sample_rate=RATE)
        assert (first.status, second.status) == ("miss", "joined")
        producer.gates[0].set()
        assert await anext(first) == producer.audio[0]
        assert await anext(second) == producer.audio[0]
        assert not producer.finished and producer.produced == 1  # still synthesizing
        # A late joiner replays what was produced so far, then follows live.
        producer.gates[1].set()
        assert await anext(first) == producer.audio[1]
        late = await cache.stream(KEY, producer, sample_rate=RATE)
        assert late.status == "joined"
        assert await anext(late) == producer.audio[0]
        producer.gates[2].set()
        rest = [await second.read_all(), await late.read_all(), await first.read_all()]
        assert rest == [producer.audio[1] + producer.audio[2], producer.audio[1] + producer.audio[2],
                        producer.audio[2]]
        assert producer.calls == 1
        await cache.close()

    run(scenario())


def test_failed_synthesis_reaches_every_reader_and_is_not_stored(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        failing = Producer(chunks=3, fail_after=2)
        streams = [await cache.stream(KEY, failing, sample_rate=RATE) for _ in range(2)]
        for stream in streams:
            with pytest.raises(RuntimeError, match="synthesis failed"):
                await stream.read_all()
        await settle(cache)
        good = Producer()
        assert await fetch(cache, good) == ("miss", good.whole)
        assert failing.calls == 1 and good.calls == 1
        await cache.close()

    run(scenario())
    # Nor on disk: a fresh process misses too.
    assert run(_status_after_restart(tmp_path, CacheKey.make("never stored", "v", "1"))) == "miss"


async def _status_after_restart(tmp_path: Path, key: CacheKey) -> str:
    cache = await AudioCache.open(settings(tmp_path))
    status, _ = await fetch(cache, Producer(), key)
    await cache.close()
    return status


def test_reader_leaving_does_not_stop_the_others(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer(chunks=3, gated=True)
        leaver = await cache.stream(KEY, producer, sample_rate=RATE)
        stayer = await cache.stream(KEY, producer, sample_rate=RATE)
        producer.gates[0].set()
        assert await anext(leaver) == producer.audio[0]
        await leaver.aclose()
        for gate in producer.gates:
            gate.set()
        assert await stayer.read_all() == producer.whole
        await stayer.aclose()
        assert producer.finished
        assert await fetch(cache, producer) == ("hit", producer.whole)
        await cache.close()

    run(scenario())


def test_when_every_reader_leaves_synthesis_is_cancelled_and_nothing_stored(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer(chunks=3, gated=True)
        streams = [await cache.stream(KEY, producer, sample_rate=RATE) for _ in range(2)]
        producer.gates[0].set()
        for stream in streams:
            assert await anext(stream) == producer.audio[0]
            await stream.aclose()
        await asyncio.sleep(0.01)
        assert producer.closed and not producer.finished  # the producer was stopped mid-way
        assert cache.stats().in_flight == 0
        await settle(cache)
        again = Producer()
        assert await fetch(cache, again) == ("miss", again.whole)
        await cache.close()

    run(scenario())


def test_a_cancelled_request_task_cancels_a_synthesis_it_alone_wanted(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer(chunks=2, gated=True)

        async def client() -> None:
            async with await cache.stream(KEY, producer, sample_rate=RATE) as stream:
                await stream.read_all()

        task = asyncio.create_task(client())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)
        assert producer.closed and not producer.finished
        assert cache.stats().in_flight == 0
        await cache.close()

    run(scenario())


def test_close_cancels_running_syntheses(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer(chunks=2, gated=True)
        stream = await cache.stream(KEY, producer, sample_rate=RATE)
        await cache.close()
        with pytest.raises(SynthesisCancelled):
            await stream.read_all()

    run(scenario())


def test_expired_entries_are_never_served(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path, ttl_seconds=0.3, ttl_jitter=0.0))
        producer = Producer()
        await fetch(cache, producer)
        assert (await fetch(cache, producer))[0] == "hit"
        await settle(cache)
        await asyncio.sleep(0.35)
        assert (await fetch(cache, producer))[0] == "miss"
        await cache.close()
        await asyncio.sleep(0.35)
        cache = await AudioCache.open(settings(tmp_path, ttl_seconds=0.3, ttl_jitter=0.0))
        assert (await fetch(cache, producer))[0] == "miss"  # expired on disk too
        await cache.close()
        assert producer.calls == 3

    run(scenario())


def test_ttl_is_jittered_within_bounds(tmp_path: Path) -> None:
    async def scenario() -> list[float]:
        cache = await AudioCache.open(settings(tmp_path, ttl_seconds=1000.0, ttl_jitter=0.2, disk=False))
        lifetimes = []
        for i in range(40):
            key = CacheKey.make(f"phrase {i}", "v", "1")
            await fetch(cache, Producer(chunks=1, size=100), key)
            entry = cache._memory.get(key.digest)
            assert entry is not None and entry.meta.expires is not None
            lifetimes.append(entry.meta.expires - entry.meta.created)
        await cache.close()
        return lifetimes

    lifetimes = run(scenario())
    assert all(800.0 <= t <= 1200.0 for t in lifetimes)
    assert max(lifetimes) - min(lifetimes) > 100.0  # spread, not one fixed value


def _keys() -> dict[str, tuple[CacheKey, str | None]]:
    return {
        "a1": (CacheKey.make("one", "voice-a", "1"), "prompts-v3"),
        "a1b": (CacheKey.make("two", "voice-a", "1"), None),
        "a2": (CacheKey.make("one", "voice-a", "2"), None),
        "b1": (CacheKey.make("one", "voice-b", "1"), "prompts-v3"),
        "a2t": (CacheKey.make("two", "voice-a", "2"), "prompts-v3"),
    }


@pytest.mark.parametrize(
    ("action", "gone"),
    [
        ("version", {"a1", "a1b"}),
        ("voice", {"a1", "a1b", "a2", "a2t"}),
        ("tag", {"a1", "b1", "a2t"}),
        # Both names: only what has both (once it was either, and a voice lost all its audio).
        ("voice and tag", {"a1", "a2t"}),
        ("version and tag", {"a1"}),
        ("all", {"a1", "a1b", "a2", "b1", "a2t"}),
    ],
)
def test_invalidation_drops_exactly_its_scope_and_survives_restart(
        tmp_path: Path, action: str, gone: set[str]) -> None:
    keys = _keys()

    async def invalidate(cache: AudioCache, in_memory: bool) -> None:
        if action == "version":
            result = await cache.invalidate("voice-a", "1")
            assert result.disk_dropped == 2
        elif action == "voice":
            result = await cache.invalidate("voice-a")
        elif action == "tag":
            result = await cache.invalidate(tag="prompts-v3")
        elif action == "voice and tag":
            result = await cache.invalidate("voice-a", tag="prompts-v3")
        elif action == "version and tag":
            result = await cache.invalidate("voice-a", "1", "prompts-v3")
        else:
            result = await cache.clear()
            assert result.disk_dropped == 5
        assert result.persisted and result.memory_dropped == (len(gone) if in_memory else 0)

    async def statuses(cache: AudioCache) -> dict[str, str]:
        return {name: (await fetch(cache, Producer(), key, tag))[0] for name, (key, tag) in keys.items()}

    async def first() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        await statuses(cache)
        await settle(cache)
        await invalidate(cache, in_memory=True)
        assert {n for n, s in (await statuses(cache)).items() if s == "miss"} == gone
        await cache.close()

    async def restarted_after_resynthesis() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        assert {n for n, s in (await statuses(cache)).items() if s == "hit"} == set(keys)
        await cache.close()

    run(first())
    run(restarted_after_resynthesis())  # the re-synthesized entries are new and valid

    # And an invalidation before a restart holds after it: invalidate, restart, nothing of the scope.
    async def again() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        await invalidate(cache, in_memory=False)
        await cache.close()
        cache = await AudioCache.open(settings(tmp_path))
        assert {n for n, s in (await statuses(cache)).items() if s == "miss"} == gone
        await cache.close()

    run(again())


def test_invalidation_counters_are_bounded_and_a_full_clear_restarts_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each scope ever invalidated kept a counter, in memory and on disk: a client clearing a new
    # tag each time grew them without end.
    import sqlite3

    from edged.cache import generations
    from edged.cache.layout import DBNAME, Layout

    monkeypatch.setattr(generations, "MAX_SCOPES", 5)

    def stored_scopes() -> list[str]:
        db = sqlite3.connect(Layout(tmp_path / "cache").store / DBNAME)
        try:
            return [row[0] for row in db.execute("SELECT scope FROM edged_generations")]
        finally:
            db.close()

    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        tagged = Producer()
        await fetch(cache, tagged, KEY, "kept-before")
        for i in range(5):
            assert not (await cache.invalidate(tag=f"tag-{i}")).everything
        await settle(cache)
        assert len(stored_scopes()) == 5
        result = await cache.invalidate(tag="one-too-many")  # past the bound: everything goes
        assert result.everything and result.memory_dropped == 1
        await settle(cache)
        assert stored_scopes() == [generations.ALL]
        assert (await fetch(cache, tagged, KEY, "kept-before"))[0] == "miss"
        await cache.close()

    run(scenario())


def test_synthesis_running_during_invalidation_is_not_stored(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer(chunks=2, gated=True)
        stream = await cache.stream(KEY, producer, sample_rate=RATE)
        await cache.invalidate(KEY.voice, KEY.version)
        # A request after the invalidation must not join the old synthesis.
        fresh = Producer()
        assert await fetch(cache, fresh) == ("miss", fresh.whole)
        for gate in producer.gates:
            gate.set()
        assert await stream.read_all() == producer.whole
        await stream.aclose()
        assert cache.stats().not_stored == 1
        assert await fetch(cache, fresh) == ("hit", fresh.whole)  # the new one was kept
        await cache.close()

    run(scenario())


def test_memory_tier_is_a_byte_capped_lru(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path, memory_bytes=100_000, disk=False))
        keys = [CacheKey.make(f"phrase {i}", "v", "1") for i in range(4)]
        producers = [Producer(chunks=1, size=30_000) for _ in keys]
        for key, producer in zip(keys[:3], producers):
            await fetch(cache, producer, key)
        await fetch(cache, producers[0], keys[0])  # 0 is now the most recent
        await fetch(cache, producers[3], keys[3])  # evicts 1, the least recent
        assert cache.stats().memory_evictions == 1
        assert cache.stats().memory_bytes <= 100_000
        assert [(await fetch(cache, p, k))[0] for k, p in zip(keys, producers)][:2] == ["hit", "miss"]
        await cache.close()

    run(scenario())


def test_audio_too_long_to_cache_is_streamed_whole_but_not_stored(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path, max_entry_bytes=50_000))
        producer = Producer(chunks=4, size=30_000)
        first = await cache.stream(KEY, producer, sample_rate=RATE)
        assert await first.read_all() == producer.whole
        await first.aclose()
        assert cache.stats().not_stored == 1
        assert (await fetch(cache, producer))[0] == "miss"
        await cache.close()

    run(scenario())


def test_audio_held_for_slow_listeners_is_bounded_and_paces_the_synthesis(tmp_path: Path) -> None:
    # A synthesis runs ahead of its listeners to be cached whole: three listeners that do not
    # read used to hold all of their audio (up to max_entry_bytes each). Past the stream buffer,
    # syntheses are no longer cached and wait for their listeners.
    from edged.cache.flight import HIGH_WATER

    async def scenario() -> None:
        limit = 1_000_000
        cache = await AudioCache.open(settings(tmp_path, stream_buffer_bytes=limit))
        producers = [Producer(chunks=40, size=100_000) for _ in range(3)]
        streams = [await cache.stream(CacheKey.make(f"text {i}", "v", "1", 1.0, "pcm"), producer,
                                      sample_rate=RATE) for i, producer in enumerate(producers)]
        await asyncio.sleep(0.5)  # ample time to produce all 12 MB, were nothing waiting
        held = cache.stats().stream_buffer_bytes
        assert held <= limit + 3 * (HIGH_WATER + 100_000)
        assert all(not p.finished for p in producers)  # paced by the listeners that do not read
        for stream, producer in zip(streams, producers):
            assert await stream.read_all() == producer.whole
            await stream.aclose()
        stats = cache.stats()
        assert stats.not_stored >= 2 and stats.stream_buffer_bytes == 0
        await cache.close()

    run(scenario())


def test_a_stored_synthesis_holds_only_what_its_listener_has_not_read(tmp_path: Path) -> None:
    producer = Producer(chunks=10, size=100_000)

    async def first() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        stream = await cache.stream(KEY, producer, sample_rate=RATE)
        read = [await anext(stream)]
        await settle(cache)  # synthesized and stored; the listener is still at its first chunk
        read += [await anext(stream) for _ in range(8)]
        assert cache.stats().stream_buffer_bytes == 100_000  # the one chunk left to read
        read += [chunk async for chunk in stream]
        assert b"".join(read) == producer.whole and cache.stats().stream_buffer_bytes == 0
        await cache.close()

    async def after_restart() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        stream = await cache.stream(KEY, producer, sample_rate=RATE)
        assert stream.status == "hit"
        assert cache.stats().stream_buffer_bytes == 0  # a disk hit's audio is the cache's own
        assert await stream.read_all() == producer.whole
        await cache.close()

    run(first())
    run(after_restart())


def test_a_synthesis_to_be_cached_waits_for_its_listener_and_is_stored_whole(tmp_path: Path) -> None:
    # It ran to its end at full speed for a listener who had read nothing, holding its slot.
    from edged.cache.flight import HIGH_WATER

    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer(chunks=40, size=100_000)
        stream = await cache.stream(KEY, producer, sample_rate=RATE)
        await asyncio.sleep(0.3)
        assert producer.produced * 100_000 <= HIGH_WATER + 100_000 and not producer.finished
        assert await stream.read_all() == producer.whole
        await stream.aclose()
        await settle(cache)
        assert (await fetch(cache, producer))[0] == "hit" and producer.calls == 1
        await cache.close()

    run(scenario())


def test_a_warm_up_reading_a_live_synthesis_does_not_let_it_run_ahead_of_its_listener(tmp_path: Path) -> None:
    # Paced by its fastest reader, a live synthesis joined by a warm-up (which reads at once) never
    # waited for its slow listener, so it never lent its slot out.
    from edged.cache.flight import HIGH_WATER

    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer(chunks=40, size=100_000)
        listener = await cache.stream(KEY, producer, sample_rate=RATE)
        warm_up = await cache.stream(KEY, producer, sample_rate=RATE, counted=False)
        assert warm_up.status == "joined"
        reading = asyncio.create_task(warm_up.read_all())
        await asyncio.sleep(0.3)
        assert producer.produced * 100_000 <= HIGH_WATER + 100_000 and not producer.finished
        assert await listener.read_all() == producer.whole == await reading
        await listener.aclose()
        await warm_up.aclose()
        await cache.close()

    run(scenario())


def test_a_disk_hit_the_memory_tier_does_not_keep_counts_as_held(tmp_path: Path) -> None:
    producer = Producer(chunks=10, size=100_000)
    stored_before_a_restart(tmp_path, producer)

    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path, memory_bytes=0))
        stream = await cache.stream(KEY, producer, sample_rate=RATE)
        assert stream.status == "hit" and cache.stats().stream_buffer_bytes == 1_000_000
        assert await stream.read_all() == producer.whole
        assert cache.stats().stream_buffer_bytes == 0
        await cache.close()

    run(scenario())


def test_every_listener_of_a_hit_shares_the_cached_audio(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        producer = Producer(chunks=8, size=100_000)
        await fetch(cache, producer)
        hits = [await cache.stream(KEY, producer, sample_rate=RATE) for _ in range(2)]
        firsts = [await anext(hit) for hit in hits]
        assert all(isinstance(chunk, memoryview) for chunk in firsts)  # views, not copies
        assert firsts[0].obj is firsts[1].obj
        for hit in hits:
            await hit.aclose()
        await cache.close()

    run(scenario())


def test_memory_only_when_disk_is_off(tmp_path: Path) -> None:
    async def scenario() -> None:
        cache = await AudioCache.open(settings(tmp_path, disk=False))
        producer = Producer()
        await fetch(cache, producer)
        assert (await fetch(cache, producer))[0] == "hit"
        assert cache.stats().disk_state == "off"
        await cache.close()

    run(scenario())
    assert not (tmp_path / "cache").exists()


def test_real_voice_audio_is_served_identical_after_restart(tmp_path: Path, voice) -> None:  # type: ignore[no-untyped-def]
    text = "The cache keeps this sentence."
    key = CacheKey.make(text, voice.voice_id, voice.manifest.version)

    def synthesize() -> AsyncIterator[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            pieces = voice.synthesize(text)
            while (pcm := await asyncio.to_thread(next, pieces, None)) is not None:
                yield pcm
        return chunks()

    async def once() -> tuple[str, bytes]:
        cache = await AudioCache.open(settings(tmp_path))
        result = await fetch(cache, synthesize, key)
        await cache.close()
        return result

    status, audio = run(once())
    assert status == "miss" and len(audio) > RATE  # over half a second of 16-bit audio
    assert run(once()) == ("hit", audio)
