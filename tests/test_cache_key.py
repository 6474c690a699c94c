"""Cache keys: whitespace normalization never changes what espeak hears; every field matters."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.cache import CacheKey, normalize_text
from edged.phonemes import sentences

VARIANTS = [
    ("Hello world. How are you?", "Hello world. How are you?  "),
    ("Dr. Smith paid $1,299.99, Mr. O'Neil did not.", "Dr. Smith paid $1,299.99, Mr. O'Neil did not. "),
]


@pytest.mark.parametrize(("canonical", "messy"), VARIANTS)
def test_normalization_is_canonical(canonical: str, messy: str) -> None:
    assert normalize_text(messy) == canonical
    assert normalize_text(canonical) == canonical


@pytest.mark.parametrize(("canonical", "messy"), VARIANTS)
def test_normalization_keeps_pronunciation(canonical: str, messy: str) -> None:
    # The real phonemizer: the raw text and its normalized form give the same phonemes.
    assert list(sentences(messy, "en-us")) == list(sentences(normalize_text(messy), "en-us"))


@pytest.mark.parametrize(
    "text",
    [
        "Cafe\u0301 time.",  # combining accent: espeak reads it differently from "Café"
        "US and us",  # case carries meaning
        "x\u00b2 \ufb01ne",  # NFKC would turn these into "x2 fine"
        "Hello\u00a0world.",  # non-ASCII spaces are left alone
    ],
)
def test_normalization_leaves_letters_alone(text: str) -> None:
    assert normalize_text(text) == text


@pytest.mark.parametrize(("spaced", "plain"), [
    ("A \t 3.5 apples.", "A 3.5 apples."),  # "A" then a run of spaces: the letter, not the article
    ("I work for the U.S.\rgovernment.", "I work for the U.S.\ngovernment."),  # a lone CR is a space
    ("Your timer is done.\n\n", "Your timer is done."),  # a trailing blank line drops the final stop
    ("Plan A -\t", "Plan A -"),  # a tab after a final hyphen: "A" the article, not the letter
])
def test_whitespace_espeak_hears_is_kept(spaced: str, plain: str) -> None:
    # Each was folded into its plain form by the cache key (and so synthesized as such): the
    # daemon spoke it otherwise than edged synth and Piper.
    assert list(sentences(spaced, "en-us")) != list(sentences(plain, "en-us"))
    assert normalize_text(spaced) == spaced


def test_blank_line_is_kept_because_espeak_hears_it() -> None:
    # A paragraph break drops the sentence's final stop in espeak; folding it into a space would
    # change the audio, so the key must keep it.
    assert list(sentences("Hello world.\n\nHow are you?", "en-us")) != list(
        sentences("Hello world. How are you?", "en-us"))
    assert CacheKey.make("Hello world.\n\nHow are you?", "v", "1").digest != CacheKey.make(
        "Hello world. How are you?", "v", "1").digest


def test_every_field_changes_the_digest() -> None:
    base = CacheKey.make("Hello.", "en_US-joe-medium", "1.0.0", 1.0, "pcm")
    others = [
        CacheKey.make("Hello!", "en_US-joe-medium", "1.0.0", 1.0, "pcm"),
        CacheKey.make("Hello.", "en_US-other", "1.0.0", 1.0, "pcm"),
        CacheKey.make("Hello.", "en_US-joe-medium", "1.0.1", 1.0, "pcm"),
        CacheKey.make("Hello.", "en_US-joe-medium", "1.0.0", 1.25, "pcm"),
        CacheKey.make("Hello.", "en_US-joe-medium", "1.0.0", 1.0, "wav"),
        CacheKey.make("Hello.", "en_US-joe-medium", "1.0.0", 1.0, "pcm", "fp32"),
    ]
    digests = {base.digest} | {k.digest for k in others}
    assert len(digests) == 7
    assert all(len(d) == 64 and int(d, 16) >= 0 for d in digests)


def test_equal_requests_share_a_key() -> None:
    a = CacheKey.make("Hello there.  ", "v", "1", 1, "pcm")
    b = CacheKey.make("Hello there.", "v", "1", 1.0, "pcm")
    assert a == b and a.digest == b.digest


def test_fields_cannot_run_into_each_other() -> None:
    # Without a framed encoding, ("ab", "c") and ("a", "bc") could hash alike.
    assert CacheKey("ab", "c", "1", 1.0, "pcm").digest != CacheKey("a", "bc", "1", 1.0, "pcm").digest


def test_lone_surrogates_do_not_break_the_key() -> None:
    assert len(CacheKey.make("bad \ud800 text", "v", "1").digest) == 64


def test_the_text_synthesized_is_the_text_the_key_stands_for() -> None:
    # Long text is cut into blocks by length: the text synthesized must be the key's, or two
    # requests with one key could get different audio.
    from edged.registry import VoiceInfo

    info = VoiceInfo("en_US-joe-medium", "1.0.0", "int8", 22050, Path("."))
    raw = "  word   and\tword  " * 200 + "\n\n\n  end  "
    request = info.request(raw, 1.0, "wav")
    assert request.text == normalize_text(raw) == CacheKey.make(raw, "v", "1", 1.0, "pcm", "int8").text
    assert request.text == raw.rstrip(" ")
