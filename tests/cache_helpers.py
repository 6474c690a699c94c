"""Helpers shared by the cache tests: a controllable async producer and small runners."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest

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


def stored_before_a_restart(tmp_path: Path, producer: Producer) -> None:
    """`producer`'s audio for KEY stored by a cache on `tmp_path`, which is then closed."""
    async def store() -> None:
        cache = await AudioCache.open(settings(tmp_path))
        await fetch(cache, producer)
        await cache.close()

    run(store())


async def settle(cache: AudioCache) -> None:
    """Let running syntheses end and queued disk work finish."""
    while cache.stats().in_flight:
        await asyncio.sleep(0.005)
    await cache.flush()


async def stores_again(cache: AudioCache) -> None:
    """A new entry is stored and then served as a hit: the disk tier works."""
    new = Producer()
    await fetch(cache, new, CacheKey.make("new", "v", "1"))
    await settle(cache)
    assert await fetch(cache, new, CacheKey.make("new", "v", "1")) == ("hit", new.whole)


@contextmanager
def small_filesystem(path: Path, size_kb: int) -> Iterator[Path]:
    """A real filesystem of `size_kb`: tmpfs, else a loop-mounted ext4 image (root needed)."""
    path.mkdir()
    attempts = [["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)]]
    image = path.with_suffix(".img")
    reasons = []
    for command in attempts + [None]:
        if command is None:  # fall back to a loop-mounted image
            try:
                subprocess.run(["truncate", "-s", f"{max(size_kb, 2048)}k", str(image)], check=True)
                subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
            except (OSError, subprocess.CalledProcessError) as error:
                reasons.append(str(error))
                break
            command = ["mount", "-o", "loop", str(image), str(path)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode == 0:
            break
        reasons.append(result.stderr.strip())
    else:
        reasons.append("no mount worked")
    if not os.path.ismount(path):
        pytest.skip(f"cannot mount a small filesystem here: {reasons}")
    try:
        yield path
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(path)], capture_output=True, check=False)
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)  # a failed test left files open
        image.unlink(missing_ok=True)


def fill(path: Path) -> Path:
    """Take every free byte of the filesystem at `path`."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    try:
        while True:  # the last partial block
            os.write(fd, b"\0" * 512)
    except OSError:
        pass
    os.close(fd)
    return filler
