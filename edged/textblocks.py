"""Where long text is cut into blocks for espeak-ng: only where espeak-ng itself ends a sentence.

Piper phonemizes a whole text in one reading. edged reads long text a block at a time, so that the
first sentence is ready at once and memory does not grow with the text. A cut where espeak-ng would
read on ("approx. ten", "9 a.m. today", "Well... Then") would add a sentence break that Piper does
not make, so likely sentence ends are found by pattern and each is confirmed by espeak-ng
(`ends_sentence`, edged.phonemes) before a cut is made there.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable, Iterator

BLOCK_CHARS = 2000
"""Text is phonemized in blocks of about this many characters (espeak-ng: ~4 ms per 1,000)."""
MAX_BLOCK_CHARS = 8000
"""A block grows up to this while no sentence end in it is confirmed (a list without stops, say),
since Piper reads on there; past it, the likeliest place is taken unconfirmed."""
MAX_CHECKS = 8
"""Candidate cuts asked about in each BLOCK_CHARS a block grows by (an espeak-ng fork each, ~3 ms;
~50 ms on slow words); the first is nearly always it."""

_CLOSING = "'\")\\]\u2019\u201d\u300d\u300f"
_SENTENCE_END = re.compile(
    # espeak-ng ends sentences at these when a space follows...
    f"[.!?\u2026\u061f\u06d4\u0965\u1362\u0701\u203c\u2047\uff61\ufe52][{_CLOSING}]*\\s+"
    # ... and at these (CJK, Devanagari, Armenian full stops) even without one.
    f"|[\u3002\uff01\uff1f\uff0e\u0964\u0589][{_CLOSING}]*\\s*")
_JOINERS = "\u200c\u200d\u2060\ufeff"
"""Characters that belong with the one before them, as combining marks and variation selectors do."""


def text_blocks(
    text: str, block_chars: int = BLOCK_CHARS, ends_sentence: Callable[[str, int], bool] | None = None,
) -> Iterator[str]:
    """The text in blocks of about `block_chars`, each ending where `ends_sentence(text, i)`
    confirms that espeak-ng ends a sentence. Without a checker, each ends at the likeliest place."""
    if ends_sentence is not None:  # a block asks about ends past its cut, which the next asks again
        ends_sentence = functools.cache(ends_sentence)
    start = 0
    while len(text) - start > block_chars:
        length = _confirmed_block(text, start, block_chars, ends_sentence) if ends_sentence else 0
        length = length or _likeliest_block(text, start, block_chars)
        yield text[start : start + length]
        start += length
    if start < len(text):
        yield text[start:]


def _confirmed_block(text: str, start: int, block_chars: int, ends_sentence: Callable[[str, int], bool]) -> int:
    """Length of a block that ends at a confirmed sentence end (all the rest, if it fits), else 0.
    The block grows by `block_chars` at a time, checking at most MAX_CHECKS of the candidates each
    growth added (a check of slow words takes espeak-ng ~50 ms): with one budget for all of them,
    ". and" after ". and" (places espeak-ng reads on) used it up before a real end was reached."""
    for size in range(block_chars, max(MAX_BLOCK_CHARS, block_chars) + 1, block_chars):
        if len(text) - start <= size:
            return len(text) - start
        for candidate in likely_sentence_ends(text, start, size, since=size - block_chars)[:MAX_CHECKS]:
            if ends_sentence(text, start + candidate):
                return candidate
    return 0


def _likeliest_block(text: str, start: int, block_chars: int) -> int:
    """Length of a block that ends at the likeliest sentence end, else after the last whitespace
    (a list may have newlines only), else anywhere but before a mark that belongs to a letter."""
    candidates = likely_sentence_ends(text, start, block_chars)
    if candidates:
        return candidates[0]
    window = text[start : start + block_chars]
    after_space = next((i + 1 for i in range(len(window) - 1, -1, -1) if window[i].isspace()), 0)
    if after_space:
        return after_space
    length = block_chars
    while length > 1 and _belongs_to_previous(text[start + length]):
        length -= 1
    # A window of marks or joiners alone has no letter to cut before: cut inside the run (its
    # marks belong to no letter of this block anyway). Blocks of one character were a fork of
    # espeak-ng each, ~6 ms: 100,000 joiners held the text stage for ten minutes.
    return length if length > 1 else block_chars


def likely_sentence_ends(text: str, start: int, size: int, since: int = 0) -> list[int]:
    """Offsets from `start`, in (since, size], just after a sentence end, likeliest first: those
    before a capital or a letter of a script without case, latest first; then before anything
    else ("approx. ten": espeak-ng reads on); then after an ellipsis, which espeak-ng rarely ends
    a sentence on."""
    likely: list[int] = []
    unlikely: list[int] = []
    ellipses: list[int] = []
    for match in _SENTENCE_END.finditer(text, start, start + size):
        end = match.end() - start
        if end <= since:
            continue
        if text[match.start()] == "\u2026" or text.startswith("...", max(0, match.start() - 2)):
            ellipses.append(end)
        elif (following := text[match.end() : match.end() + 1]).isalpha() and not following.islower():
            likely.append(end)
        else:
            unlikely.append(end)
    return likely[::-1] + unlikely[::-1] + ellipses[::-1]


def _belongs_to_previous(char: str) -> bool:
    return unicodedata.category(char).startswith("M") or char in _JOINERS
