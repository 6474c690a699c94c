"""Helpers shared by the cache tests: a controllable async producer and small runners."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from edged.cache import AudioCache, CacheKey, CacheSettings

T = TypeVar("T")
RATE = 22050
KEY = CacheKey.make("Your timer is done.", "en_US-joe-medium", "1.0.0")


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 30)

    return asyncio.run(bounded())


def settings(tmp_path: Path, **overrides: object) -> CacheSettings:
    values: dict[str, object] = {"directory": tmp_path / "cache", "ttl_seconds": None}
    values.update(overrides)
    return CacheSettings(**values)  # type: ignore[arg-type]


class Producer:
    """Yields `chunks` random chunks; counts calls; optionally waits for a gate before each chunk."""

    def __init__(self, chunks: int = 4, size: int = 30_000, gated: bool = False,
                 fail_after: int | None = None) -> None:
        self.audio = [os.urandom(size) for _ in range(chunks)]
        self.calls = 0
        self.produced = 0
        self.finished = False
        self.closed = False
        self.gates: list[asyncio.Event] = [asyncio.Event() for _ in range(chunks)] if gated else []
        self.fail_after = fail_after

    @property
    def whole(self) -> bytes:
        return b"".join(self.audio)

    def __call__(self) -> AsyncIterator[bytes]:
        self.calls += 1
        return self._run()

    async def _run(self) -> AsyncIterator[bytes]:
        try:
            for i, chunk in enumerate(self.audio):
                if self.fail_after is not None and i == self.fail_after:
                    raise RuntimeError("synthesis failed")
                if self.gates:
                    await self.gates[i].wait()
                else:
                    await asyncio.sleep(0.001)
                self.produced += 1
                yield chunk
            self.finished = True
        finally:
            self.closed = True


async def fetch(cache: AudioCache, producer: Callable[[], AsyncIterator[bytes]],
                key: CacheKey = KEY, tag: str | None = None) -> tuple[str, bytes]:
    async with await cache.stream(key, producer, sample_rate=RATE, tag=tag) as stream:
        status = stream.status
        return str(status), await stream.read_all()


async def settle(cache: AudioCache) -> None:
    """Let running syntheses end and queued disk work finish."""
    while cache.stats().in_flight:
        await asyncio.sleep(0.005)
    await cache.flush()
