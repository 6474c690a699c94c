"""Persistent two-tier audio cache: memory LRU in front of a diskcache tier,
singleflight for identical concurrent requests, invalidation by voice, version and tag.

Names are imported on first use (PEP 562): the daemon's config embeds `CacheSettings` and must not
pay for diskcache and sqlite3 (~60 ms) before its voices start loading."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .audiocache import (
        AudioCache,
        CacheStats,
        Invalidation,
        Producer,
        SynthesisCancelled,
    )
    from .flight import AudioStream, Status
    from .key import CacheKey, normalize_text
    from .settings import CacheSettings, default_directory

_WHERE = {
    "AudioCache": "audiocache", "CacheStats": "audiocache", "Invalidation": "audiocache",
    "Producer": "audiocache", "SynthesisCancelled": "audiocache", "AudioStream": "flight",
    "Status": "flight", "CacheKey": "key", "normalize_text": "key", "CacheSettings": "settings",
    "default_directory": "settings",
}

__all__ = [
    "AudioCache", "AudioStream", "CacheKey", "CacheSettings", "CacheStats", "Invalidation",
    "Producer", "Status", "SynthesisCancelled", "default_directory", "normalize_text",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
