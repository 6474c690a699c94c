"""Singleflight: one synthesis per key, its chunks fanned out to every waiter as they arrive.

A `Flight` is an append-only list of chunks plus the set of streams reading it, each at its own
position. A late joiner replays from the first chunk and then follows live. A stream that goes
away leaves the flight; when the last one leaves before the end, `on_abandon` runs (the cache
cancels the producer and stores nothing). Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Literal, Self

from .generations import SCOPES

Status = Literal["hit", "miss", "joined"]
_tokens = itertools.count()

HIGH_WATER = 1024 * 1024
"""A producer waits while its audio runs this far ahead of its listeners (~24 s of 22 kHz audio):
a synthesis for a slow listener then lends its slot out (edged.pipeline parks it)."""
OVER_BUDGET_WATER = 128 * 1024
"""The same, for flights not cached because the daemon-wide stream buffer is full."""

Chunk = bytes | memoryview


def chunks_of(audio: bytes, size: int) -> list[Chunk]:
    """Views into `audio`, not copies: every stream of a hit shares the one cached audio."""
    view = memoryview(audio)
    return [view[i : i + size] for i in range(0, len(audio), size)]


class Held:
    """Audio that flights hold for their streams, all flights together, against a limit. Caching
    a synthesis means holding all its audio until it is whole and stored (its producer runs up to
    HIGH_WATER ahead of its fastest stream, its fastest live one for a live synthesis). Past the
    limit, a flight being produced is no longer cached, keeps only what its slowest stream has not
    read, and runs at most OVER_BUDGET_WATER ahead of it. Slow listeners cannot fill memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0


class Flight:
    def __init__(self, max_bytes: int, on_abandon: Callable[[Flight], None],
                 generations: tuple[int, ...] = (0,) * SCOPES, tag: str | None = None,
                 held: Held | None = None, live: bool = True) -> None:
        self.max_bytes = max_bytes
        self.live = live
        """Made for a live request: abandoned once only background streams (warm-up) read it,
        which would otherwise keep a live synthesis's priority and slot for work nobody waits for."""
        self.held = held
        """Where this flight's buffered bytes are counted (None: a hit, over audio the cache holds)."""
        self.generations = generations
        """Invalidation generations when the flight began (see generations.py)."""
        self.tag = tag
        """Request tag of the flight's creator: its entry is stored under it."""
        self.chunks: list[Chunk] = []
        self.base = 0
        """Index, in the whole chunk sequence, of chunks[0] (chunks are trimmed once uncacheable)."""
        self.size = 0
        self.buffered = 0
        self.cacheable = True
        """False once the audio is over max_bytes: it will not be stored and no one may join."""
        self.done = False
        self.error: BaseException | None = None
        self.status: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None
        self._positions: dict[int, int] = {}
        self._background: set[int] = set()
        """Tokens of the background streams among `_positions`."""
        self._on_abandon = on_abandon
        self._more = asyncio.Event()
        self._room = asyncio.Event()

    @classmethod
    def complete(cls, audio: bytes, chunk_bytes: int) -> Flight:
        """A finished flight over audio already at hand (a cache hit)."""
        flight = cls(len(audio), lambda _: None)
        flight.chunks = chunks_of(audio, chunk_bytes)
        flight.size = flight.buffered = len(audio)
        flight.done = True
        flight.status.set_result("hit")
        return flight

    # -- producer side ---------------------------------------------------------------------------

    def resolve(self, status: Literal["hit", "miss"]) -> None:
        if not self.status.done():
            self.status.set_result(status)

    def append(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        self._buffer(len(chunk))
        if self.cacheable and (self.size > self.max_bytes or (self.held and self.held.bytes > self.held.limit)):
            self.cacheable = False
            self._trim()
        self._wake()

    def finish(self, error: BaseException | None = None) -> None:
        self.resolve("miss")
        self.done = True
        self.error = error
        self._trim()  # stored by now (or never to be): nobody may join a finished flight
        self._wake()

    async def room(self) -> None:
        """Wait while the audio runs too far ahead of its listeners: of the fastest (live one, for a
        live synthesis), for a flight to be stored (it keeps every chunk anyway, and no listener
        waits for a slower one); of the slowest, for one that will not be (what all have read is
        dropped, so memory stays bounded)."""
        while self._positions and self._ahead() > self._water():
            self._room.clear()
            await self._room.wait()

    def _ahead(self) -> int:
        if not self.cacheable:
            return self.buffered
        # A live synthesis goes at its live listeners' pace: a warm-up reading it at once must
        # not keep it from waiting (and lending its slot out) for a slow one.
        live = [p for t, p in self._positions.items() if t not in self._background] if self.live else []
        fastest = max(live or self._positions.values()) - self.base
        return sum(len(c) for c in self.chunks[fastest:])

    def _water(self) -> int:
        if self.cacheable or self.held is None or self.held.bytes <= self.held.limit:
            return HIGH_WATER
        return OVER_BUDGET_WATER

    def audio(self) -> bytes:
        """The whole audio (cacheable flights only)."""
        assert self.cacheable and self.base == 0
        return b"".join(self.chunks)

    # -- stream side -----------------------------------------------------------------------------

    @property
    def joinable(self) -> bool:
        return self.cacheable and not self.done

    def join(self, status: Status | None = None, background: bool = False) -> AudioStream:
        token = next(_tokens)
        self._positions[token] = self.base
        if background:
            self._background.add(token)
        return AudioStream(self, token, status)

    def leave(self, token: int) -> None:
        if self._positions.pop(token, None) is None:
            return
        self._background.discard(token)
        if not self.done and (not self._positions or (self.live and self._positions.keys() <= self._background)):
            self._on_abandon(self)
        elif not self.cacheable or self.done:
            self._trim()
        self._room.set()

    def _next(self, token: int) -> Chunk | None:
        pos = self._positions[token]
        index = pos - self.base
        if index >= len(self.chunks):
            return None
        self._positions[token] = pos + 1
        chunk = self.chunks[index]
        if not self.cacheable or self.done:
            self._trim()
        self._room.set()  # the producer looks again (room)
        return chunk

    def _trim(self) -> None:
        """Drop chunks every stream has read (only once the flight is stored, or will not be)."""
        low = min(self._positions.values(), default=self.base + len(self.chunks))
        drop = low - self.base
        if drop > 0:
            self._buffer(-sum(len(c) for c in self.chunks[:drop]))
            del self.chunks[:drop]
            self.base = low

    def _buffer(self, n: int) -> None:
        self.buffered += n
        if self.held is not None:
            self.held.bytes += n

    def _wake(self) -> None:
        more, self._more = self._more, asyncio.Event()
        more.set()


class AudioStream(AsyncIterator[Chunk]):
    """One waiter's view of a flight: chunks from the first, live until the end.

    Close it (`aclose()` or `async with`) when done; an unclosed stream leaves its flight when it
    is garbage-collected."""

    def __init__(self, flight: Flight, token: int, status: Status | None) -> None:
        self._flight: Flight | None = flight
        self._token = token
        self.status: Status | None = status
        self._on_close: list[Callable[[], None]] = []
        loop = asyncio.get_running_loop()
        self._finalizer = weakref.finalize(self, _leave_later, loop, flight, token, self._on_close)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Chunk:
        while (flight := self._flight) is not None:
            chunk = flight._next(self._token)
            if chunk is not None:
                return chunk
            if flight.done:
                self._leave()
                if flight.error is not None:
                    raise flight.error
                break
            await flight._more.wait()
        raise StopAsyncIteration

    @property
    def cacheable(self) -> bool:
        """Whether the audio read so far may still be stored (not too long, buffer not full)."""
        return self._flight is not None and self._flight.cacheable

    @property
    def known_size(self) -> int | None:
        """Bytes of the whole audio once the flight has all of it (always, for a hit)."""
        flight = self._flight
        return flight.size if flight is not None and flight.done and flight.error is None else None

    async def read_all(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def aclose(self) -> None:
        self._leave()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._leave()

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the stream is closed (also if it is only garbage-collected)."""
        if self._flight is None:
            callback()
        else:
            self._on_close.append(callback)

    @property
    def live(self) -> bool:
        """Whether the synthesis it reads was made for a live request (not a warm-up's)."""
        return self._flight is not None and self._flight.live

    def _leave(self) -> None:
        flight, self._flight = self._flight, None
        if flight is not None:
            self._finalizer.detach()
            _leave(flight, self._token, self._on_close)


def _leave_later(loop: asyncio.AbstractEventLoop, flight: Flight, token: int,
                 on_close: list[Callable[[], None]]) -> None:
    # Garbage collection may run on any thread: hand the departure to the loop.
    try:
        loop.call_soon_threadsafe(_leave, flight, token, on_close)
    except RuntimeError:  # loop closed: nothing left to cancel
        pass


def _leave(flight: Flight, token: int, on_close: list[Callable[[], None]]) -> None:
    flight.leave(token)
    for callback in on_close:
        callback()
