"""Text made safe for espeak-ng: the runs of characters it is known to crash on, rewritten as it
would read them anyway (found by fuzzing; edged.phonemes applies this before every read)."""

from __future__ import annotations

import re

_DOTTED_LETTER = r"(?<![^\W_])([^\W_])[^\w.]*\.[\W_]*"
"""One letter (or digit) standing alone, a dot after it (spaces, soft hyphens... between them),
and whatever non-letters follow."""
_ONE_DOTTED_LETTER = re.compile(_DOTTED_LETTER)
_LETTER_CHAIN = re.compile(f"(?:{_DOTTED_LETTER}){{2,}}")
"""Several of them in a row ("a.b.c.d...", "k . e . m", "a.b.-c.d.", "a..b..c"): espeak-ng reads such
a run as one abbreviation and crashes (segfault: an 80-byte buffer in CheckDottedAbbrev) when it is
long: from ~97 ASCII letters, ~26 letters of 4 UTF-8 bytes, fewer with combining marks between."""
_CHAIN_MAX_LETTERS = 20
"""A run of this many dotted letters is spelled out; shorter ones ("U.S.A.", "e.g.", "A. B., C. D.")
are left to espeak-ng, so that their ids stay Piper's..."""
_CHAIN_MAX_BYTES = 40
"""... and so is one whose letters and marks (spaces and ASCII punctuation not counted) take this
many UTF-8 bytes."""
_NOT_COUNTED = re.compile(r"[\s!-/:-@\[-`{-~]")
_MAX_RUN = 128
_UNBROKEN = re.compile(r"[^\s\u0e00-\u0fff\u1000-\u109f\u1780-\u17ff\u3000-\u9fff\uf900-\ufaff\uff00-\uffef"
                       rf"\U00020000-\U0003ffff]{{{_MAX_RUN + 1},}}")
"""Over 128 characters without a space, in scripts that separate words with spaces (not Thai, Lao,
Tibetan, Myanmar, Khmer, Chinese, Japanese). espeak-ng crashes (a buffer overrun in TranslateWord3)
on a word that stacks ~70 suffixes: "hope" + "'s" * 70 (144 characters) is the shortest found.
Runs of up to 128 (URLs, hashes, e-mail addresses, compounds) are left whole, as Piper reads them."""
_BREAK_AFTER = "/-._,;:?&=+"
"""Where such a run is best broken: a URL or a hyphenated compound then reads part by part."""


def safe_for_espeak(text: str) -> str:
    """Text that espeak-ng can take (see _LETTER_CHAIN, _UNBROKEN; found by fuzzing): a long run of
    dotted letters spelled one by one ("a. b. c. "), which is how espeak-ng reads them anyway; a run
    of over 128 characters without a space broken up (see _broken_up); NUL (which its C API cannot
    carry) as a space. Short runs such as "e.g." or "U.S.A." and real words are left alone, so ids
    still match Piper's. What still crashes it only costs its own process (edged.espeak_worker)."""
    text = _LETTER_CHAIN.sub(_spelled_if_long, text)
    text = _UNBROKEN.sub(_broken_up, text)
    return text.replace("\0", " ")


def nothing_to_read(text: str) -> bool:
    """Whether espeak-ng is given only spaces (a NUL is one, see safe_for_espeak)."""
    return not text.replace("\0", " ").strip()


def _broken_up(run: re.Match[str]) -> str:
    """The run with a space at most every _MAX_RUN characters: after the last of _BREAK_AFTER in
    each stretch that has one, else after its _MAX_RUN-th character."""
    rest, parts = run.group(), []
    while len(rest) > _MAX_RUN:
        stretch = rest[:_MAX_RUN]
        cut = max(stretch.rfind(c) for c in _BREAK_AFTER) + 1 or _MAX_RUN
        parts.append(rest[:cut])
        rest = rest[cut:]
    parts.append(rest)
    return " ".join(parts)


def _spelled_if_long(run: re.Match[str]) -> str:
    # What follows the last dot (emoji, quotes, dashes) is not part of the abbreviation: counted,
    # "e.g." before three flag emoji was spelled out and the emoji lost, where Piper reads both.
    end = run.group().rindex(".") + 1
    chain, after = run.group()[:end], run.group()[end:]
    counted = _NOT_COUNTED.sub("", chain).encode("utf-8", "replace")
    if len(_ONE_DOTTED_LETTER.findall(chain)) < _CHAIN_MAX_LETTERS and len(counted) < _CHAIN_MAX_BYTES:
        return run.group()
    return _ONE_DOTTED_LETTER.sub(r"\1. ", chain) + after
