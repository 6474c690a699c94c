"""The request path: admission -> text -> front -> back windows -> output, each stage bounded.

    async for chunk in pipeline.synthesize_stream(request):   # PCM, as produced
        await pipeline.output.wait(send(chunk))

The blocking stages (text, front, back) have their own concurrency limit, timeout and threads,
so a long front run cannot take the slots of the back windows; the output has a timeout per
write and no shared limit (see OutputSettings). Admission in front of
them is bounded: past `queue_size` waiting requests the answer is Busy at once, so overload costs
a refusal, not memory. Cancellation (a client hanging up) is checked at every await, that is
before each window: the window being decoded finishes in its thread, no further one starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .admission import Admission, Slot
from .config import OutputSettings, PipelineSettings, StageSettings
from .errors import NotReady, StageTimeout
from .messages import AudioFormat
from .preemption import Background, Preemption

if TYPE_CHECKING:
    from .engine import Voice

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class SynthesisRequest:
    """Everything that decides the audio bytes, and how they are sent (format, sample rate)."""

    text: str
    voice_id: str
    voice_version: str
    precision: str
    """fp32 or int8, as the voice is loaded: it changes the audio."""
    sample_rate: int
    """Hz, of the voice; written into the WAV header."""
    speed: float = 1.0
    format: AudioFormat = "wav"
    """What the client gets: wav (a streaming WAV header, then the PCM) or pcm (the PCM alone).
    The audio source always produces PCM; the header is added on the way out."""
    bundle_digest: str = field(kw_only=True)
    """The voice bundle's Manifest.audio_digest: the version alone may survive a rebuild."""


class VoiceSource(Protocol):
    async def voice(self, voice_id: str, wait_s: float) -> Voice: ...


class _Timed:
    """What every stage counts, and its deadline per call."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.concurrency: int | None = None
        """Calls at once; None: no bound."""
        self.running = 0
        self.waiting = 0
        self.calls = 0
        self.timeouts = 0

    def start_threads(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _timed_out(self) -> StageTimeout:
        self.timeouts += 1
        return StageTimeout(f"{self.name} stage took longer than {self.timeout_s:g} s")


class Stage(_Timed):
    """A bounded number of concurrent calls in the stage's threads, each with a deadline covering
    its wait and its run."""

    def __init__(self, name: str, settings: StageSettings, nice: int = 0) -> None:
        super().__init__(name, settings.timeout_s)
        self.concurrency = settings.concurrency
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._threads = concurrent.futures.ThreadPoolExecutor(
            settings.concurrency, thread_name_prefix=f"edged-{name}",
            initializer=lower_thread_priority, initargs=(nice,))

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in this stage's threads. On timeout or cancellation the call still runs to
        its end in its thread (onnxruntime cannot be interrupted), and only then frees its slot."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        await self._acquire(deadline)
        future = loop.run_in_executor(self._threads, fn, *args)
        future.add_done_callback(self._release_after_thread)
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(future)
        except TimeoutError:
            raise self._timed_out() from None

    def start_threads(self) -> None:
        """Start all of this stage's threads now. A thread pool otherwise adds threads as calls
        race it, at any time; each new thread brings its own allocator arena, and memory then
        steps up during service (seen: +0.3 to +5 MB once, thousands of requests in)."""
        all_started = threading.Barrier(self.concurrency or 1)
        for _ in range(self.concurrency or 1):
            self._threads.submit(all_started.wait)  # each blocks, so each needs a new thread

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def _acquire(self, deadline: float) -> None:
        self.waiting += 1
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            raise self._timed_out() from None
        finally:
            self.waiting -= 1
        self.running += 1
        self.calls += 1

    def _release_after_thread(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled():
            future.exception()  # retrieved here, so an abandoned call logs no "never retrieved"
        self.running -= 1
        self._slots.release()


class OutputStage(_Timed):
    """Awaited writes to clients, each with a deadline and no shared bound (see OutputSettings)."""

    def __init__(self, settings: OutputSettings) -> None:
        super().__init__("output", settings.timeout_s)

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` (an async operation such as a socket write) within the deadline."""
        self.running += 1
        self.calls += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                return await awaitable
        except TimeoutError:
            raise self._timed_out() from None
        finally:
            self.running -= 1


@dataclass
class PipelineCounts:
    completed: int = 0
    cancelled: int = 0
    """Streams stopped before their end: the client hung up or stopped reading."""
    failed: int = 0
    windows: int = 0
    """Back-graph windows decoded, over all requests."""


class Pipeline:
    def __init__(self, settings: PipelineSettings, voices: VoiceSource) -> None:
        self.settings = settings
        self.voices = voices
        self.admission = Admission(settings.max_active, settings.queue_size, settings.queue_timeout_s)
        nice = settings.compute_nice
        self.text = Stage("text", settings.text, nice=nice)
        self.front = Stage("front", settings.front, nice=nice)
        self.back = Stage("back", settings.back, nice=nice)
        self.output = OutputStage(settings.output)
        self.counts = PipelineCounts()
        self.preemption = Preemption()

    @property
    def stages(self) -> tuple[Stage | OutputStage, ...]:
        return (self.text, self.front, self.back, self.output)

    def start_threads(self) -> None:
        for stage in self.stages:
            stage.start_threads()

    async def synthesize_stream(self, request: SynthesisRequest,
                                background: Background | None = None) -> AsyncGenerator[bytes, None]:
        """16-bit mono PCM of `request` as each window is decoded (whatever `request.format`:
        the container is the output's business); errors before the first chunk (Busy, NotReady,
        BadInput) are raised by the first `anext`.

        A background synthesis (cache warm-up) takes no admission slot: each of its steps waits
        until no live synthesis is about, and is stopped and made again when one comes (until it is
        promoted, see edged.preemption)."""
        call: Callable[..., Awaitable[Any]]
        slot: Slot | None = None
        if background is not None:
            call = functools.partial(self.preemption.run, background=background)
        else:
            self.preemption.live_started()
            try:
                await self.admission.enter()
            except BaseException as exc:
                self.preemption.live_ended()
                if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                    self.counts.cancelled += 1  # its client hung up while it waited for a slot
                raise
            slot = Slot(self.admission, self.preemption, self.settings.park_after_s)
            call = functools.partial(_live_call, slot)
        finished = False
        try:
            voice = await self.voices.voice(request.voice_id, self.settings.loading_wait_s)
            _expect_bundle(voice, request)
            from .engine import SynthesisParams  # imported by the voice loader already

            params = SynthesisParams(speed=request.speed)
            pieces = voice.pieces(request.text)  # lazy: each next() phonemizes a little more
            read_next = functools.partial(call, self.text, _next_piece, pieces)
            produced = 0
            ids = await read_next()
            while ids is not None:
                latents = await call(self.front, voice.front, ids, params)
                # Requests waiting for admission: the box is past its capacity, and their wait,
                # not first audio, is what grows; so decode for throughput (see Voice.windows).
                throughput = background is not None or self.admission.waiting + self.admission.resuming > 0
                windows = voice.windows(latents, produced, throughput)
                for window in windows:
                    pcm = await call(self.back, voice.decode, latents, window)
                    self.counts.windows += 1
                    reading_failed: Exception | None = None
                    if window is windows[-1]:
                        # The next piece is read before this piece's last chunk goes out, while
                        # the slot is held: a stream parked after its last chunk (a slow client)
                        # then ends without waiting for a slot behind another whole synthesis.
                        try:
                            ids = await read_next()
                        except Exception as exc:  # noqa: BLE001 (raised once the chunk made is sent)
                            reading_failed = exc
                    if slot is not None:
                        slot.park_if_slow()
                    yield pcm
                    if reading_failed is not None:
                        raise reading_failed
                produced += latents.n_frames
                if not windows:  # a piece without frames: read on, or the loop would never end
                    ids = await read_next()
            finished = True
        except (asyncio.CancelledError, GeneratorExit):
            self.counts.cancelled += 1
            raise
        except Exception:
            self.counts.failed += 1
            raise
        finally:
            if slot is not None:
                slot.release()
            if finished:
                self.counts.completed += 1

    def close(self) -> None:
        for stage in self.stages:
            stage.close()


def _expect_bundle(voice: Voice, request: SynthesisRequest) -> None:
    """The request's facts (its cache key) were read from the voice's bundle before the voice was
    loaded; if the bundle was replaced in between, its audio is not what the key stands for."""
    loaded = (voice.manifest.version, voice.manifest.audio_digest, voice.precision)
    if loaded != (request.voice_version, request.bundle_digest, request.precision):
        raise NotReady(f"voice {request.voice_id!r} was replaced while this request was made; ask again")


async def _live_call(slot: Slot, stage: Stage, fn: Callable[..., T], *args: object) -> T:
    """A live synthesis's stage call: its admission slot first, if it was parked meanwhile."""
    await slot.take_back()
    return await stage.run(fn, *args)


def _next_piece(pieces: Iterator[list[int]], run_options: object = None) -> list[int] | None:
    """The next piece's phoneme ids, None after the last. (`run_options` is for the calling
    convention of edged.preemption: phonemizing has no onnxruntime run to stop.)"""
    return next(pieces, None)


def lower_thread_priority(nice: int) -> None:
    """Make the calling thread (and the threads it starts later, such as onnxruntime's pools)
    `nice` steps nicer than the event loop. Linux applies niceness per thread."""
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except OSError as exc:
        log.warning("could not lower the priority of synthesis threads: %s", exc)

