"""The daemon's engine: its state (NEW -> LOADING -> READY -> DRAINING -> STOPPED), its voices, its
pipeline, and the one place where a request gets its audio (`audio_for`), which a cache can wrap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from . import __version__
from .cacheservice import CacheService
from .config import Settings, named_voices
from .errors import EdgedError, NotReady
from .espeak_worker import ESPEAK
from .pipeline import Pipeline, SynthesisRequest
from .registry import VoiceRegistry

if TYPE_CHECKING:
    from .engine import Voice

log = logging.getLogger(__name__)

CacheStatus = Literal["hit", "miss"]


class PcmStream(Protocol):
    """16-bit mono PCM as it is produced: the pipeline's async generator, or the cache's
    AudioStream (edged.cache). The consumer closes it (`aclose`) when it is done or its client
    went away."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def __anext__(self) -> bytes: ...

    async def aclose(self) -> None: ...


class State(enum.Enum):
    NEW = "NEW"
    LOADING = "LOADING"
    READY = "READY"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = State.NEW
        self.started = time.monotonic()
        self.ready_after_s: float | None = None
        self.registry = VoiceRegistry(settings.voices, settings.pipeline.compute_nice)
        self.pipeline = Pipeline(settings.pipeline, self.registry)
        self.disconnects = 0
        """Streams stopped because the client hung up."""
        self.write_stalls = 0
        """Streams stopped because the client stopped reading for longer than the output timeout."""
        self.connections_refused = 0
        """Requests answered 503 busy because the server was at its connection limit."""
        self.on_state: list[Callable[[State], None]] = []
        self.cache: CacheService | None = (
            CacheService(settings.cache, self.pipeline, self.registry, settings.voices.default,
                         settings.limits.max_text_chars)
            if settings.cache.enabled else None)
        """Opened by `open_cache` (needs the event loop); None when disabled in the config."""

    def set_state(self, state: State) -> None:
        if state is self.state:
            return
        log.info("state %s -> %s", self.state.value, state.value)
        self.state = state
        if state is State.READY:
            self.ready_after_s = time.monotonic() - self.started
        for callback in self.on_state:
            callback(state)

    def start_loading(self) -> concurrent.futures.Future[Voice]:
        """Load the default and preloaded voices in parallel threads (returns at once); the
        default voice's load is returned."""
        self.set_state(State.LOADING)
        self.pipeline.start_threads()
        loads = {voice_id: self.registry.load(voice_id)
                 for voice_id in dict.fromkeys([self.settings.voices.default, *self.settings.voices.preload])}
        self._warn_of_missing_openai_voices()  # after: the loads need not wait for its manifest reads
        return loads[self.settings.voices.default]

    def _warn_of_missing_openai_voices(self) -> None:
        """The OpenAI route's voices are not loaded at start (the default and preloaded ones
        are, and fail the start if missing): a typo would only be seen as each request's 404."""
        for setting, voice_id in named_voices(self.settings):
            if setting.startswith("openai.") and voice_id:
                try:
                    self.registry.info(voice_id)
                except EdgedError as exc:  # not installed, or installed but unusable
                    log.warning("%s names a voice its requests cannot have: %s", setting, exc)

    async def until_ready(self, default_load: concurrent.futures.Future[Voice]) -> None:
        """READY once the default voice can answer (`default_load`, from start_loading); its
        load error is raised otherwise. (Not a new load: one that failed fast was made twice.)"""
        await asyncio.wrap_future(default_load)
        if self.state is State.LOADING:
            self.set_state(State.READY)

    async def open_cache(self) -> None:
        """Open the audio cache; on failure the daemon serves without it (logged)."""
        if self.cache is None:
            return
        try:
            await self.cache.open()
        except Exception:
            log.exception("audio cache could not be opened; serving without it")
            self.cache = None
            return
        if self.settings.cache.warm_file:
            self.cache.warm_from_file(Path(self.settings.cache.warm_file))

    async def close_cache(self) -> None:
        """Stop warm-up and flush queued disk writes (after the drain: nothing reads it then)."""
        if self.cache is not None:
            await self.cache.close()

    async def audio_for(self, request: SynthesisRequest, tag: str | None = None) -> tuple[CacheStatus, PcmStream]:
        """The PCM of `request` and where it came from: the cache ("hit"), else synthesized
        ("miss"; a request joining an identical synthesis under way counts as a miss here)."""
        if self.state in (State.DRAINING, State.STOPPED):
            raise NotReady(f"edged is {self.state.value.lower()}")
        if self.cache is not None and self.cache.audio is not None:
            stream = await self.cache.stream(request, tag)
            return ("hit" if stream.status == "hit" else "miss"), stream
        return "miss", self.pipeline.synthesize_stream(request)

    def health(self) -> dict[str, Any]:
        return {"state": self.state.value, "version": __version__,
                "uptime_s": round(time.monotonic() - self.started, 3)}

    def status(self) -> dict[str, Any]:
        pipeline = self.pipeline
        admission = pipeline.admission
        counts = pipeline.counts
        return {
            **self.health(),
            "ready_after_s": None if self.ready_after_s is None else round(self.ready_after_s, 3),
            "pid": os.getpid(),
            "voices": self.registry.describe(),
            "admission": {"active": admission.active, "waiting": admission.waiting, "parked": admission.parked,
                          "resuming": admission.resuming,
                          "capacity": admission.capacity, "queue_size": admission.queue_size,
                          "rejected": admission.rejected, "connections_refused": self.connections_refused},
            "stages": {
                stage.name: {"concurrency": stage.concurrency, "running": stage.running,
                             "waiting": stage.waiting, "calls": stage.calls, "timeouts": stage.timeouts}
                for stage in pipeline.stages
            },
            "synthesis": {"completed": counts.completed, "cancelled": counts.cancelled,
                          "failed": counts.failed, "windows": counts.windows,
                          "background_preempted": pipeline.preemption.preempted,
                          "background_promoted": pipeline.preemption.promoted,
                          "espeak_restarts": ESPEAK.restarts,
                          "disconnects": self.disconnects, "write_stalls": self.write_stalls},
            "process": _in_mib(process_figures()),
            "cache": self.cache.describe() if self.cache is not None else {"enabled": False, "open": False},
        }

    def close(self) -> None:
        self.pipeline.close()
        self.registry.close()


def _in_mib(figures: dict[str, int]) -> dict[str, float]:
    """process_figures as /v1/status shows them: memory in MiB (rss_mb, anon_mb, file_mb), threads."""
    shown: dict[str, float] = {f"{kind}_mb": round(figures[kind] / 2**20, 1)
                               for kind in ("rss", "anon", "file") if kind in figures}
    if "threads" in figures:
        shown["threads"] = figures["threads"]
    return shown


def process_figures() -> dict[str, int]:
    """From /proc/self/status: resident memory in bytes (rss, anon = heap, file = mapped weights
    and libraries) and the number of threads (onnxruntime's own included)."""
    wanted = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "Threads": "threads"}
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in wanted:
                    value = int(rest.split()[0])
                    found[wanted[key]] = value if key == "Threads" else value * 1024  # kB
    except OSError:
        pass
    return found
