"""Text -> sentences -> phoneme ids, exactly as Piper makes them (its espeak-ng bridge and id map).

Long text is phonemized a block at a time (edged.textblocks), so the first sentence is ready at
once and memory does not grow with the text. Long sentences are cut at clause boundaries into
*pieces*, each run through the front graph on its own: the VITS text encoder attends over its whole
input, so its cost grows with input length and no exact streaming of it is possible; cutting at a
comma is where a speaker would pause anyway. Sentences no longer than `first_piece_max` are never
cut, which keeps their ids identical to Piper's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from piper.phoneme_ids import phonemes_to_ids

from .errors import BadInput
from .espeak_safety import nothing_to_read, safe_for_espeak
from .espeak_worker import ESPEAK, TextStalled
from .textblocks import BLOCK_CHARS, text_blocks

log = logging.getLogger(__name__)

_RAW_PHONEMES = re.compile(r"(\[\[.*?\]\])")
"""Phonemes written out in a text, as piper-tts reads them: "[[" and "]]" on one line."""


@dataclass(frozen=True)
class PieceLimits:
    """Longest runs of phonemes given to the front graph at once (0 = never cut)."""

    first_piece_max: int = 80
    """First piece of a sentence: small, since time to first audio waits for it."""
    piece_max: int = 240
    """Later pieces: the front runs while earlier audio plays, so they can be longer."""


def start_espeak() -> None:
    """Start espeak-ng's process now (a voice load does), so that the first text does not wait for it."""
    ESPEAK.start()


def pieces_ids(
    text: str, espeak_voice: str, id_map: dict[str, list[int]], limits: PieceLimits
) -> Iterator[list[int]]:
    """Phoneme ids of every piece of every sentence, in order, produced lazily. Phonemes the voice
    has no id for are skipped, as Piper skips them (but without a warning for each: phonemes
    written out in a text could fill the log)."""
    for phonemes in sentences(text, espeak_voice):
        known = [p for p in phonemes if p in id_map]
        if len(known) < len(phonemes):
            log.debug("%d phoneme(s) the voice has no id for were skipped", len(phonemes) - len(known))
        for piece in split_pieces(known, limits):
            yield phonemes_to_ids(piece, id_map)


def sentences(text: str, espeak_voice: str) -> Iterator[list[str]]:
    """Phonemes of each sentence that has something to pronounce. Phonemes written out in the text
    ("[[ h@loU ]]") are taken as Piper takes them: as they are, in the sentence they stand in."""
    if nothing_to_read(text):
        raise BadInput("text is empty")
    parts = _split_written(text)  # text, [[phonemes]], text, ...
    last = len(parts) // 2  # the text after the last written phonemes (all of it, if none)
    held: list[str] = []  # the last sentence, while phonemes written after it may join it
    for i, part_sentences in enumerate(_sentences_of_each(parts[::2], espeak_voice)):
        if i:
            held += _written_phonemes(parts, 2 * i - 1)
        for k, sentence in enumerate(part_sentences):
            if i and k == 0:  # the first sentence after written phonemes continues theirs
                held += sentence
            else:
                yield from _spoken([held])
                held = list(sentence)
            if i == last:  # nothing will join it: not held until the next block is read
                yield from _spoken([held])
                held = []
    yield from _spoken([held])


def _split_written(text: str) -> list[str]:
    """The text cut into text, written phonemes, text, ... as Piper cuts it. Piper takes any part
    that begins with "[[" as phonemes, closed or not: an unclosed "[[" at the start of the text or
    right after "]]" makes the rest phonemes (less its last two characters)."""
    parts: list[str] = []
    for i, part in enumerate(_RAW_PHONEMES.split(text)):
        parts += ["", part, ""] if i % 2 == 0 and part.startswith("[[") else [part]
    return parts


def _written_phonemes(parts: list[str], i: int) -> list[str]:
    """The phonemes of parts[i] ("[[ ... ]]"), with a space on a side where the text has one. As
    in Piper, the side of a block that follows an unclosed "[[" part is that part: past the empty
    text _split_written puts between them (a closed block never ends with a space)."""
    left = parts[i - 1] or (parts[i - 2] if i >= 2 else "")
    before, after = [" "] * left.endswith(" "), [" "] * parts[i + 1].startswith(" ")
    return before + list(parts[i][2:-2].strip()) + after


def _sentences_of_each(texts: list[str], espeak_voice: str) -> Iterator[Iterable[list[str]]]:
    """The sentences of each text, in order: a long one a block at a time, short ones read
    together, up to BLOCK_CHARS of them in one fork (one fork each, 10,000 parts of text between
    written phonemes took 40 s)."""
    batch: list[str] = []
    batch_chars = 0
    for text in texts:
        if len(text) > BLOCK_CHARS:
            if batch:
                yield from _read_each(espeak_voice, batch)
                batch, batch_chars = [], 0
            yield (sentence for block in text_blocks(text, ends_sentence=espeak_ends_sentence(espeak_voice))
                   for sentence in _read_each(espeak_voice, [block])[0])
            continue
        batch.append(text)
        batch_chars += len(text)
        if batch_chars >= BLOCK_CHARS:
            yield from _read_each(espeak_voice, batch)
            batch, batch_chars = [], 0
    if batch:
        yield from _read_each(espeak_voice, batch)


def _read_each(espeak_voice: str, texts: list[str]) -> list[list[list[str]]]:
    """espeak-ng's phonemes of each sentence of each text (see EspeakProcess.phonemize_each)."""
    return ESPEAK.phonemize_each(espeak_voice, [safe_for_espeak(text) for text in texts])


def _spoken(sentences: list[list[str]]) -> list[list[str]]:
    """The sentences that have something to pronounce (not punctuation alone, not empty)."""
    return [s for s in sentences if any(p.isalpha() for p in s)]


_CHECK_CHARS = 100
"""Text read on each side of a candidate cut: a few sentences. What decides a sentence end in
espeak-ng lies within a few words of it."""


def espeak_ends_sentence(espeak_voice: str) -> Callable[[str, int], bool]:
    """Whether espeak-ng ends a sentence at text[i], asked of espeak-ng itself: it reads the text
    around i whole and cut at i, and the two must give the same spoken sentences (cut after a
    closing quote, espeak-ng adds an empty one)."""

    def ends_sentence(text: str, i: int) -> bool:
        before, after = text[max(0, i - _CHECK_CHARS) : i], text[i : i + _CHECK_CHARS]
        try:
            whole, cut_before, cut_after = (_spoken(read) for read in
                                            _read_each(espeak_voice, [before + after, before, after]))
        except TextStalled:  # the text's own fault: refused now, not once per candidate (2 s each)
            raise
        except BadInput:  # espeak-ng crashed on this stretch: no answer, so not confirmed
            return False
        return whole == cut_before + cut_after

    return ends_sentence


_CLAUSE_END = {",", ";", ":"}


def split_pieces(phonemes: list[str], limits: PieceLimits) -> Iterator[list[str]]:
    """Cut one sentence's phonemes at clause ends (else word ends) into pieces within the limits,
    yielded as they are cut. By index, not by slicing off the rest: that copied what was left at
    every cut, and a sentence of a million phonemes written out waited seconds for its first audio."""
    start, limit = 0, limits.first_piece_max
    while limit and len(phonemes) - start > limit:
        cut = _last_boundary(phonemes, start, limit)
        yield phonemes[start:cut]
        start, limit = cut, limits.piece_max
    yield phonemes[start:]


def _last_boundary(phonemes: list[str], start: int, limit: int) -> int:
    """Index just after the last clause end within `limit` of `start`, else the last space, else
    `start + limit`."""
    last_space = 0
    for i in range(min(start + limit, len(phonemes)) - 1, start, -1):  # a piece ends with the space at i
        if phonemes[i] == " ":
            if phonemes[i - 1] in _CLAUSE_END:
                return i + 1
            last_space = last_space or i + 1
    return last_space or start + limit
