"""The in-memory tier: a byte-capped LRU of finished audio. Event-loop thread only (no locks)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .record import CachedAudio

ENTRY_OVERHEAD = 512
"""Bytes charged per entry on top of its audio (dict slot, meta object, key string)."""


class MemoryTier:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, CachedAudio] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> CachedAudio | None:
        entry = self._entries.get(digest)
        if entry is not None:
            self._entries.move_to_end(digest)
        return entry

    def put(self, digest: str, entry: CachedAudio) -> bool:
        """Insert as most recent, evicting the least recent; False if it can never fit."""
        cost = _cost(entry)
        if cost > self.capacity:
            return False
        self.discard(digest)
        self._entries[digest] = entry
        self.bytes += cost
        while self.bytes > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.bytes -= _cost(old)
            self.evictions += 1
        return True

    def discard(self, digest: str) -> bool:
        entry = self._entries.pop(digest, None)
        if entry is None:
            return False
        self.bytes -= _cost(entry)
        return True

    def purge(self, stale: Callable[[CachedAudio], bool]) -> int:
        """Drop every entry for which `stale` is true; the number dropped."""
        doomed = [digest for digest, entry in self._entries.items() if stale(entry)]
        for digest in doomed:
            self.discard(digest)
        return len(doomed)


def _cost(entry: CachedAudio) -> int:
    return len(entry.audio) + ENTRY_OVERHEAD
