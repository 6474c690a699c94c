"""Cache keys: sha256 over normalized text, voice id, voice version, speed, output format, the
graphs' precision and the bundle's audio digest.

Normalization only touches ASCII whitespace, in ways espeak-ng reads the same (checked against
the real phonemizer in tests/test_cache_key.py). Unicode normalization is deliberately left out:
espeak reads "e" + combining acute differently from precomposed "é", so NFC/NFKC can change
pronunciation. Letter case and punctuation are left alone too ("US" vs "us").
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

KEY_SCHEMA = "edged-cache/3"
"""Part of every digest: bump it when the key or the synthesis output changes meaning."""

_LINE_ENDS = re.compile(r"\r\n?")
# A run of whitespace holding two or more newlines is a paragraph break for espeak (it drops the
# sentence's final stop): keep it as one blank line. One newline is kept as a newline, and a run
# without newlines becomes one space.
_PARAGRAPH = re.compile(r"[ \t\f\v]*\n[ \t\f\v]*(?:\n[ \t\f\v]*)+")
_LINE = re.compile(r"[ \t\f\v]*\n[ \t\f\v]*")
_SPACES = re.compile(r"[ \t\f\v]+")


def normalize_text(text: str) -> str:
    """The text with ASCII whitespace canonicalized; the pronunciation cannot change."""
    text = _LINE_ENDS.sub("\n", text)
    text = _PARAGRAPH.sub("\n\n", text)
    text = _LINE.sub("\n", text)
    text = _SPACES.sub(" ", text)
    return text.strip(" \t\n\f\v")


@dataclass(frozen=True)
class CacheKey:
    """What makes two requests give the same audio. Build with `CacheKey.make` (normalizes)."""

    text: str
    """Normalized text (`normalize_text`)."""
    voice: str
    version: str
    speed: float
    format: str
    """Output format of the cached bytes, e.g. "pcm" (16-bit LE mono)."""
    precision: str = ""
    """fp32 or int8: the same voice gives other audio at another precision."""
    bundle: str = ""
    """The bundle's audio digest (Manifest.audio_digest): a voice rebuilt under the same version
    gives other audio."""
    digest: str = field(init=False, compare=False, repr=False)
    """sha256 hex of all of the above: the key in both tiers."""

    def __post_init__(self) -> None:
        fields = [KEY_SCHEMA, self.text, self.voice, self.version, repr(float(self.speed)), self.format,
                  self.precision, self.bundle]
        # JSON keeps the fields unambiguous; ensure_ascii makes lone surrogates encodable.
        blob = json.dumps(fields, ensure_ascii=True, separators=(",", ":")).encode("ascii")
        object.__setattr__(self, "digest", hashlib.sha256(blob).hexdigest())

    @classmethod
    def make(cls, text: str, voice: str, version: str, speed: float = 1.0, format: str = "pcm",
             precision: str = "", bundle: str = "") -> CacheKey:
        return cls(normalize_text(text), voice, version, float(speed), format, precision, bundle)
