"""Persistent two-tier audio cache (design point 5): memory LRU in front of a diskcache tier,
singleflight for identical concurrent requests, invalidation by voice, version and tag."""

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

__all__ = [
    "AudioCache", "AudioStream", "CacheKey", "CacheSettings", "CacheStats", "Invalidation",
    "Producer", "Status", "SynthesisCancelled", "default_directory", "normalize_text",
]
