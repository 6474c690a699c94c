"""Text -> sentences -> phoneme ids, exactly as Piper makes them (its espeak-ng bridge and id map).

Long text is phonemized a block at a time, so the first sentence is ready at once and memory does
not grow with the text. Long sentences are cut at clause boundaries into *pieces*, each run through
the front graph on its own: the VITS text encoder attends over its whole input, so its cost grows
with input length and no exact streaming of it is possible; cutting at a comma is where a speaker
would pause anyway. Sentences no longer than `first_piece_max` are never cut, which keeps their ids
identical to Piper's.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from piper.phoneme_ids import phonemes_to_ids
from piper.phonemize_espeak import EspeakPhonemizer

from .errors import BadInput

# espeak-ng keeps global state: one bridge per process, one caller at a time.
_ESPEAK_LOCK = threading.Lock()
_espeak: EspeakPhonemizer | None = None

_BLOCK_CHARS = 2000
"""Text is phonemized in blocks of about this many characters (espeak: ~2 ms per 1,000)."""
_SENTENCE_END = re.compile(r"[.!?]['\")\]]*\s+")
_CLAUSE_END = {",", ";", ":"}
_LETTER_CHAIN = re.compile(r"(?:\b\w\.\s?){20,}")
"""20 or more single letters each followed by a dot ("a.b.c.d..."): espeak-ng reads such a run as
one abbreviation and crashes (segfault) when it is long, from ~40 letters on here."""
_LETTER_DOT = re.compile(r"\.\s?")


@dataclass(frozen=True)
class PieceLimits:
    """Longest runs of phonemes given to the front graph at once (0 = never cut)."""

    first_piece_max: int = 80
    """First piece of a sentence: small, since time to first audio waits for it."""
    piece_max: int = 240
    """Later pieces: the front runs while earlier audio plays, so they can be longer."""


def _phonemize_block(espeak_voice: str, block: str) -> list[list[str]]:
    global _espeak
    with _ESPEAK_LOCK:
        if _espeak is None:
            _espeak = EspeakPhonemizer()
            _set_voice_only_on_change()
        return _espeak.phonemize(espeak_voice, block)


def _set_voice_only_on_change() -> None:
    """espeak-ng copies the voice on every set_voice and frees the copy only when it makes sound,
    which a phonemizer never does (speech.c DoVoiceChange); Piper's phonemize() sets the voice
    on every call, so a daemon leaked ~1.3 KB per request (+13 MB per 10,000). Selecting the same
    voice again changes nothing, so it is skipped - until espeak-ng is initialized again (another
    EspeakPhonemizer, e.g. piper-tts's own in a tool or test): that reloads the phoneme data the
    selected voice points into, and phonemizing without selecting it again crashed (seen in the
    test suite: a segfault in get_phonemes)."""
    from piper import espeakbridge

    select, initialize = espeakbridge.set_voice, espeakbridge.initialize

    def set_voice(voice: str) -> None:
        if _selected.voice != voice:
            select(voice)
            _selected.voice = voice

    def initialize_again(data_dir: str) -> None:
        initialize(data_dir)
        _selected.voice = None

    espeakbridge.set_voice = set_voice
    espeakbridge.initialize = initialize_again


class _Selected:
    voice: str | None = None
    """The espeak-ng voice selected since espeak-ng was last initialized."""


_selected = _Selected()


def text_blocks(text: str, block_chars: int = _BLOCK_CHARS) -> Iterator[str]:
    """Cut text after a sentence end near every `block_chars` characters (at a space if none)."""
    start = 0
    while len(text) - start > block_chars:
        window = text[start : start + block_chars]
        cut = 0
        for match in _SENTENCE_END.finditer(window):
            cut = match.end()
        if cut == 0:
            cut = window.rfind(" ") + 1 or block_chars
        yield text[start : start + cut]
        start += cut
    if start < len(text):
        yield text[start:]


def sentences(text: str, espeak_voice: str) -> Iterator[list[str]]:
    """Phonemes of each sentence that has something to pronounce."""
    if not text.strip():
        raise BadInput("text is empty")
    for block in text_blocks(_safe_for_espeak(text)):
        for phonemes in _phonemize_block(espeak_voice, block):
            if any(p.isalpha() for p in phonemes):
                yield phonemes


def _safe_for_espeak(text: str) -> str:
    """Text that espeak-ng can take: letters of a long letter-dot run spelled one by one ("a. b.
    c."), which is how it reads them anyway, and NUL (which its C API cannot carry) as a space.
    Short runs such as "e.g." or "U.S.A." are left alone, so ids still match Piper's."""
    text = _LETTER_CHAIN.sub(lambda run: _LETTER_DOT.sub(". ", run.group()), text)
    return text.replace("\0", " ")


def split_pieces(phonemes: list[str], limits: PieceLimits) -> list[list[str]]:
    """Cut one sentence's phonemes at clause ends (else word ends) into pieces within the limits."""
    pieces: list[list[str]] = []
    rest = phonemes
    limit = limits.first_piece_max
    while limit and len(rest) > limit:
        cut = _last_boundary(rest, limit)
        pieces.append(rest[:cut])
        rest = rest[cut:]
        limit = limits.piece_max
    pieces.append(rest)
    return pieces


def _last_boundary(phonemes: list[str], limit: int) -> int:
    """Index just after the last clause end within `limit`, else the last space, else `limit`."""
    last_space = 0
    for i in range(min(limit, len(phonemes) - 1), 0, -1):
        if phonemes[i] == " ":
            if phonemes[i - 1] in _CLAUSE_END:
                return i + 1
            last_space = last_space or i + 1
    return last_space or limit


def pieces_ids(
    text: str, espeak_voice: str, id_map: dict[str, list[int]], limits: PieceLimits
) -> Iterator[list[int]]:
    """Phoneme ids of every piece of every sentence, in order, produced lazily."""
    for phonemes in sentences(text, espeak_voice):
        for piece in split_pieces(phonemes, limits):
            yield phonemes_to_ids(piece, id_map)
