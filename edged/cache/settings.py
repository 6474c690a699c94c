"""Cache settings: one frozen dataclass with documented defaults, embeddable in the daemon's config."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MiB = 1024 * 1024
DAY = 86400.0


@dataclass(frozen=True)
class CacheSettings:
    """Sizes in bytes, times in seconds. Defaults suit a 2-core, 4 GB box.

    22,050 Hz 16-bit mono PCM is ~2.6 MB a minute: the memory tier holds ~25 minutes of audio,
    the disk tier ~6.5 hours.
    """

    directory: Path | None = None
    """Disk tier location; None -> `default_directory()`."""
    memory_bytes: int = 64 * MiB
    """Cap of the in-memory LRU tier (audio bytes plus a small per-entry overhead)."""
    disk_bytes: int = 1024 * MiB
    """Cap of the disk tier (diskcache `size_limit`: database pages plus value files). SQLite's
    write-ahead log beside the database is not counted: up to ~4 MB more (its 1,000-page
    checkpoint), the same whatever the cap."""
    disk: bool = True
    """False runs memory-only (nothing is written to disk)."""
    ttl_seconds: float | None = 7 * DAY
    """Lifetime of an entry; None or 0 keeps entries until evicted or invalidated."""
    ttl_jitter: float = 0.2
    """Each entry's lifetime is ttl * uniform(1 - jitter, 1 + jitter), so a warm-up's entries
    do not all expire in the same minute."""
    max_entry_bytes: int = 16 * MiB
    """Audio longer than this (~6 min) is streamed but not cached, so one long text cannot flush
    the memory tier or hold its whole audio in memory for late joiners."""
    stream_buffer_bytes: int = 64 * MiB
    """Audio held for the streams of syntheses being cached, all together: a synthesis keeps what
    it has made until it is whole and stored. Past this, a synthesis is streamed without being
    cached, at its slowest listener's pace, so slow listeners cannot fill memory."""
    chunk_bytes: int = 64 * 1024
    """A hit is streamed in chunks of this size."""
    write_queue_bytes: int = 32 * MiB
    """Finished audio waiting for the disk writer; past this a disk write is skipped (the entry
    stays in memory), so a slow disk cannot grow memory."""
    touch_interval_seconds: float = 3600.0
    """The disk tier evicts the least recently *stored* entry (reads never write: see
    tools/cache_bench.py); an entry served from memory has its disk recency refreshed at most this
    often, so phrases hot in memory are not the first evicted from disk."""
    write_retry_seconds: float = 60.0
    """After a failed disk write (disk full, read-only), disk writes pause this long."""
    disk_timeout_seconds: float = 5.0
    """SQLite busy timeout of the disk tier, and the longest a disk read may take before its request
    is answered as a miss (a stalled disk does not hold requests up)."""

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        for name in ("memory_bytes", "disk_bytes", "max_entry_bytes", "stream_buffer_bytes", "write_queue_bytes",
                     "touch_interval_seconds", "write_retry_seconds", "disk_timeout_seconds"):
            if not getattr(self, name) >= 0:  # also refuses NaN
                raise ValueError(f"{name} must be >= 0")
        if not 0.0 <= self.ttl_jitter < 1.0:
            raise ValueError("ttl_jitter must be in [0, 1)")
        if self.ttl_seconds is not None and not self.ttl_seconds >= 0:
            raise ValueError("ttl_seconds must be >= 0 (0 or None: no expiry)")

    def resolved_directory(self) -> Path:
        return Path(self.directory).expanduser() if self.directory is not None else default_directory()


def default_directory(environ: dict[str, str] | None = None) -> Path:
    """$CACHE_DIRECTORY (systemd CacheDirectory=; first of a colon list), else
    $XDG_CACHE_HOME/edged, else ~/.cache/edged."""
    env = os.environ if environ is None else environ
    systemd = env.get("CACHE_DIRECTORY", "")
    if systemd:
        return Path(systemd.split(":")[0])
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "edged"
