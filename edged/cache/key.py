"""Cache keys: sha256 over normalized text, voice id, voice version, speed, the stored bytes'
format (PCM: a WAV answer is the same samples behind a header, so both share an entry), the
graphs' precision and the bundle's audio digest.

Normalization must not change pronunciation, and espeak-ng hears more whitespace than one would
think: a run of spaces after "A" makes it the letter rather than the article, a blank line drops
a sentence's final stop, a lone CR after "U.S." adds a sentence break, a tab after a final "-"
changes the stress before it, and leading blanks move where a long text is cut into blocks. So
only spaces at the end of the text are dropped (tests/test_cache_key.py checks the cases above
against the real phonemizer). Unicode normalization is left out too: espeak reads "e" +
combining acute differently from precomposed "é". Letter case and punctuation are left alone ("US" vs "us").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

KEY_SCHEMA = "edged-cache/5"
"""Part of every digest: bump it when the key or the synthesis output changes meaning."""


def normalize_text(text: str) -> str:
    """The text without spaces at its end; the pronunciation cannot change."""
    return text.rstrip(" ")


@dataclass(frozen=True)
class CacheKey:
    """What makes two requests give the same audio. Its text must be `normalize_text`-ed already;
    `CacheKey.make` does that."""

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
