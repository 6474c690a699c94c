"""One cache entry as stored: a small JSON header in front of the raw audio bytes.

    b"EDGA" | u8 layout | u32 header length (LE) | JSON header | audio

JSON and a byte slice are all a reader ever parses: nothing from disk is unpickled. The header
carries the sha256 of the audio; an entry whose audio does not match it is never served.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import types
import typing
from dataclasses import asdict, dataclass
from typing import Any

from ..untrusted_json import loads
from .generations import SCOPES

MAGIC = b"EDGA"
LAYOUT = 1
_PREFIX = struct.Struct("<4sBI")
_MAX_HEADER = 64 * 1024
MAX_OVERHEAD = _PREFIX.size + _MAX_HEADER
"""Bytes a record may have besides its audio."""


class CorruptEntry(Exception):
    """A stored entry is malformed or fails its checksum (it is dropped, never served)."""


@dataclass(frozen=True)
class EntryMeta:
    """What is stored next to the audio."""

    key: str
    """CacheKey.digest the entry was stored under (a mix-up is treated as corruption)."""
    voice: str
    version: str
    format: str
    sample_rate: int
    """Hz."""
    tag: str | None
    """The request's tag (e.g. "prompts-v3"), for invalidation by tag."""
    created: float
    """Unix time (s) the synthesis finished."""
    expires: float | None
    """Unix time (s) after which the entry is never served; None: no expiry."""
    generations: tuple[int, ...]
    """Invalidation generations current when synthesis began (generations.Generations.snapshot)."""
    sha256: str
    """Hex digest of the audio bytes."""
    size: int
    """Audio length in bytes."""

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires


@dataclass(frozen=True)
class CachedAudio:
    meta: EntryMeta
    audio: bytes


def _json_types(hint: Any) -> tuple[type, ...]:
    """The JSON values a field of type `hint` may hold (a float may be written as an int)."""
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return tuple(t for member in members for t in ((int, float) if member is float else (member,)))


_HEADER_TYPES = {name: _json_types(hint) for name, hint in typing.get_type_hints(EntryMeta).items()
                 if name != "generations"}  # checked as it is converted to a tuple
"""What each header field must be: only the audio is checksummed."""


def audio_checksum(audio: bytes) -> str:
    return hashlib.sha256(audio).hexdigest()


def checksummed(entry: CachedAudio) -> CachedAudio:
    """The entry with its audio's checksum in its header (hashing up to 16 MiB: done where it is
    written, on the disk tier's thread, not on the event loop for every synthesis)."""
    return CachedAudio(dataclasses.replace(entry.meta, sha256=audio_checksum(entry.audio)), entry.audio)


def encode(entry: CachedAudio) -> bytes:
    header = json.dumps(asdict(entry.meta), separators=(",", ":")).encode("utf-8")
    return _PREFIX.pack(MAGIC, LAYOUT, len(header)) + header + entry.audio


def decode(record: bytes, expected_key: str) -> CachedAudio:
    """Parse and verify one stored record; CorruptEntry if anything is off."""
    if len(record) < _PREFIX.size:
        raise CorruptEntry("record too short")
    magic, layout, header_len = _PREFIX.unpack_from(record)
    if magic != MAGIC or layout != LAYOUT or header_len > min(_MAX_HEADER, len(record) - _PREFIX.size):
        raise CorruptEntry("bad record prefix")
    start = _PREFIX.size + header_len
    try:
        fields = loads(record[_PREFIX.size : start])
        # Only the audio is checksummed: a header field of the wrong type (a flipped bit, an
        # edit) would fail later, at every request for the entry, instead of dropping it here.
        for name, allowed in _HEADER_TYPES.items():
            if not isinstance(fields[name], allowed) or isinstance(fields[name], bool):
                raise TypeError(f"{name} is not {allowed[0].__name__}")
        fields["generations"] = tuple(int(g) for g in fields["generations"])
        meta = EntryMeta(**fields)
    except (ValueError, TypeError, KeyError) as error:
        raise CorruptEntry(f"bad record header: {type(error).__name__} {error}"[:200]) from None
    audio = record[start:]
    if meta.key != expected_key or len(meta.generations) != SCOPES:
        raise CorruptEntry("record belongs to another key")
    if meta.size != len(audio) or audio_checksum(audio) != meta.sha256:
        raise CorruptEntry("audio fails its checksum")
    return CachedAudio(meta, audio)
