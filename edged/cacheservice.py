"""The audio cache in the daemon: the request path through it, invalidation, and warm-up.

A hit needs no model: the key is built from the voice's manifest (id, version, precision and the
digest of its files, read without loading its graphs), and the producer - the synthesis pipeline -
runs only on a miss. So after a restart, cached phrases are served while voices are still loading.

Warm-up yields to live requests: one phrase at a time, synthesized in the background (see
edged.preemption: it runs only while no live synthesis is about, and stops at once for one).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import CacheConfig
from .errors import Busy, StageTimeout, TextTooLong
from .files import read_regular_file
from .messages import MAX_WARM_FILE_BYTES, Phrase, parse_phrase_lines
from .pipeline import Pipeline, SynthesisRequest
from .preemption import Background

if TYPE_CHECKING:
    from .cache import AudioCache, AudioStream, CacheKey
    from .registry import VoiceRegistry

log = logging.getLogger(__name__)

CACHED_FORMAT = "pcm"
"""Cached bytes are always bare PCM: a WAV header is added when the audio is sent."""
MAX_WARM_QUEUE = 20_000
"""Phrases waiting for warm-up; more are refused (busy), so repeated calls cannot grow memory."""
MAX_WARM_CHARS = 16_000_000
"""Characters of the phrases waiting for warm-up: 20,000 phrases could otherwise hold 2 GB of text."""
WARM_JOIN_ATTEMPTS = 10
WARM_JOIN_RETRY_S = 0.5
"""A warm-up phrase that joined a live request's refused synthesis asks again this often."""


class NotCached(Exception):
    """A warm-up phrase whose audio will not be stored: synthesizing it on would be for nothing."""


@dataclass
class WarmProgress:
    total: int = 0
    """Phrases asked for since start."""
    done: int = 0
    """Phrases handled (cached already, synthesized now, or failed)."""
    synthesized: int = 0
    empty: int = 0
    """Phrases with nothing to pronounce: no audio, so nothing stored."""
    failed: int = 0


class CacheService:
    def __init__(self, config: CacheConfig, pipeline: Pipeline, registry: VoiceRegistry,
                 default_voice: str, max_text_chars: int) -> None:
        self.config = config
        self.max_text_chars = max_text_chars
        """The API's limit, which phrases of a warm file are held to as well."""
        self.pipeline = pipeline
        self.registry = registry
        self.default_voice = default_voice
        self.audio: AudioCache | None = None
        """The cache itself, once open (until then, or if it cannot be opened, None)."""
        self.warm = WarmProgress()
        self._phrases: collections.deque[Phrase] = collections.deque()
        self._queued_chars = 0
        self._warmer: asyncio.Task[None] | None = None
        self._warming: dict[str, Background] = {}
        """Cache key digest -> the warm-up synthesis under way for it."""

    async def open(self) -> None:
        """Open both tiers (the disk tier off, logged, if its directory cannot be used)."""
        from .cache import AudioCache

        settings = dataclasses.replace(self.config, directory=self.config.resolved_directory())
        self.audio = await AudioCache.open(settings)
        log.info("audio cache at %s (disk %s)", settings.directory,
                 self.audio.disk.state if self.audio.disk is not None else "off")

    async def close(self) -> None:
        if self._warmer is not None:
            self._warmer.cancel()
            await asyncio.gather(self._warmer, return_exceptions=True)
        if self.audio is not None:
            cache, self.audio = self.audio, None
            await cache.close()

    # -- the request path ----------------------------------------------------------------------

    async def stream(self, request: SynthesisRequest, tag: str | None = None) -> AudioStream:
        """The PCM of `request`: cached, joined to the same synthesis under way, or synthesized."""
        assert self.audio is not None
        key = _key(request)
        stream = await self.audio.stream(key, lambda: self.pipeline.synthesize_stream(request),
                                         sample_rate=request.sample_rate, tag=tag)
        warming = self._warming.get(key.digest)
        # Joined a warm-up's synthesis (not a live one made after it, under the same key): it waits
        # for the warm-up's audio.
        if stream.status == "joined" and warming is not None and not stream.live:
            self.pipeline.preemption.promote(warming)
            stream.on_close(functools.partial(self.pipeline.preemption.demote, warming))
        return stream

    # -- administration ------------------------------------------------------------------------

    async def invalidate(self, voice: str | None, version: str | None, tag: str | None) -> dict[str, Any]:
        """Drop the entries with every name given (a voice, one version of it, a tag), or (nothing
        given) everything."""
        assert self.audio is not None  # a version without a voice is refused by messages.cache_scope
        result = await self.audio.invalidate(voice, version, tag)
        return {
            "scope": {"voice": voice, "version": version, "tag": tag, "all": result.everything},
            "memory_dropped": result.memory_dropped,
            "disk_dropped": result.disk_dropped,
            "disk_swept": result.disk_swept,
            "persisted": result.persisted,
        }

    def add_warm(self, phrases: list[Phrase]) -> None:
        """Queue phrases for warm-up (answers at once; progress is in `self.warm`)."""
        chars = sum(len(p.text) for p in phrases)
        if len(self._phrases) + len(phrases) > MAX_WARM_QUEUE or self._queued_chars + chars > MAX_WARM_CHARS:
            raise Busy(f"warm-up queue full ({len(self._phrases)} phrases, {self._queued_chars} characters waiting)")
        self._phrases.extend(phrases)
        self._queued_chars += chars
        self.warm.total += len(phrases)
        if phrases and (self._warmer is None or self._warmer.done()):
            self._warmer = asyncio.get_running_loop().create_task(self._warm_all())

    def warm_from_file(self, path: Path) -> None:
        try:
            phrases = parse_phrase_lines(read_regular_file(path, MAX_WARM_FILE_BYTES).decode("utf-8"))
        except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or a NUL in the path
            log.error("cannot read warm_file %s: %s", path, exc)
            return
        fits = itertools.accumulate(len(p.text) for p in phrases)
        room = min(MAX_WARM_QUEUE - len(self._phrases),
                   sum(1 for total in fits if self._queued_chars + total <= MAX_WARM_CHARS))
        if len(phrases) > room:  # a start-up file must not stop the daemon: warm what fits
            log.error("warm_file %s has %d phrases; warming the first %d", path, len(phrases), room)
            phrases = phrases[:room]
        log.info("warming %d phrase(s) from %s", len(phrases), path)
        self.add_warm(phrases)

    async def _warm_all(self) -> None:
        while self._phrases:
            phrase = self._phrases.popleft()
            self._queued_chars -= len(phrase.text)
            try:
                await self._warm_one(phrase)
            except Exception as exc:  # noqa: BLE001 (bad phrase, unknown voice, busy, cache closing)
                self.warm.failed += 1
                log.warning("warm-up of %r failed: %s", phrase.text[:60], exc)
            finally:
                self.warm.done += 1

    async def _warm_one(self, phrase: Phrase) -> None:
        from .cache import SynthesisCancelled  # loaded with the cache already

        assert self.audio is not None
        if len(phrase.text) > self.max_text_chars:
            raise TextTooLong(f"phrase of {len(phrase.text)} characters, over the limit of {self.max_text_chars}")
        info = self.registry.info(phrase.voice or self.default_voice)
        request = info.request(phrase.text, 1.0, CACHED_FORMAT)
        key, background = _key(request), Background()

        async def in_background() -> AsyncIterator[bytes]:
            # Runs only if the phrase is neither cached nor being synthesized already.
            self._warming[key.digest] = background
            try:
                # The registry's rules (load_on_demand; a failed load tried again after a while), no deadline.
                await self.registry.voice(info.voice_id, math.inf)
                async for chunk in self.pipeline.synthesize_stream(request, background):
                    yield chunk
            finally:
                # The same phrase warmed again (after this one was given up) has its own entry.
                if self._warming.get(key.digest) is background:
                    del self._warming[key.digest]

        for _attempt in range(WARM_JOIN_ATTEMPTS):
            # Not counted: the hit ratio is the requests' (warm-up's own figures are in self.warm).
            stream = await self.audio.stream(key, in_background, sample_rate=request.sample_rate,
                                             counted=False)
            try:
                audio = False
                async with stream:
                    async for chunk in stream:
                        if not stream.cacheable:  # too long, or the stream buffer is full
                            raise NotCached("its audio will not be stored (too long, or the "
                                            "stream buffer is full); left to live listeners, if any")
                        audio = audio or bool(chunk)
                # Counted here, once read whole: a phrase given up or failed counts as failed only.
                if stream.status == "miss":  # its own synthesis (not a hit, nor a live one joined)
                    if audio:
                        self.warm.synthesized += 1
                    else:
                        self.warm.empty += 1
                return
            except (Busy, StageTimeout, SynthesisCancelled):
                if stream.status != "joined":
                    raise
                # It joined a live request's synthesis of the same phrase, and that request was
                # refused (the box is full) or left: a warm-up waits its turn, so it asks again
                # (then with a synthesis of its own, in the background).
                await asyncio.sleep(WARM_JOIN_RETRY_S)
        raise Busy(f"the phrase was refused {WARM_JOIN_ATTEMPTS} times in live requests' syntheses")

    # -- figures ----------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The "cache" block of /v1/status."""
        if self.audio is None:
            return {"enabled": self.config.enabled, "open": False}
        stats = dataclasses.asdict(self.audio.stats())
        return {"enabled": True, "open": True, "directory": str(self.audio.settings.directory),
                **stats, "warm": dataclasses.asdict(self.warm)}


def _key(request: SynthesisRequest) -> CacheKey:
    from .cache import CacheKey

    # The request's text is the key's already (VoiceInfo.request).
    return CacheKey(request.text, request.voice_id, request.voice_version, float(request.speed), CACHED_FORMAT,
                    request.precision, request.bundle_digest)

