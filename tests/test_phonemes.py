"""Phoneme ids must be Piper's, id for id; long sentences are cut into pieces at clause ends."""

from __future__ import annotations

import logging

import pytest
from phoneme_helpers import edged_ids, piper_ids
from piper import PiperVoice

from edged.errors import BadInput
from edged.espeak_safety import safe_for_espeak
from edged.phonemes import PieceLimits, sentences, split_pieces

CORPUS = [
    "Your timer is done.",
    "It's 3:45 pm on March 3rd, 2024; the temperature is -4.5 degrees.",
    "Dr. Smith paid $1,299.99 for 2 tickets (about 650 each).",
    'She said "hello" and then \u201cgoodbye\u201d \u2014 without a pause!',
    "Is the NASA/ESA mission at 10 km altitude? Yes... maybe.",
    "Caf\u00e9 na\u00efve fa\u00e7ade, \u00fcber r\u00e9sum\u00e9: Zo\u00eb and Bj\u00f6rk met Se\u00f1or Mu\u00f1oz.",
    "Call 555-0123 or e-mail info@example.com, e.g. at 9 a.m. etc.",
    "The 1st, 2nd and 33rd items cost 50% less; 1/2 of them are new.",
    "Wait -- what?! No; it can't be: 100% sure?",
    "Mr. and Mrs. O'Neil live at 221B Baker St. in London, U.K.",
]


@pytest.mark.parametrize("text", CORPUS + [" ".join(CORPUS), " ".join(CORPUS * 8)])
def test_phoneme_ids_match_piper(piper_voice: PiperVoice, text: str) -> None:
    assert edged_ids(piper_voice, text) == piper_ids(piper_voice, text)


# espeak-ng segfaults on each of these as they are (found by fuzzing); its process would die and
# the text be refused. They are given to it spelled out or broken up instead, and spoken.
_FUZZ_LETTERS = ("kpkzpsnzusfvrphqhiqxtrhgmgmoizkmagbcdjlqnqpjatrullpbdybymxinobrainltqyunbecdpytuixjkmiaaqpp"
                 "adliowhpyzfkpljiimkigehorpyfw")
"""Letters of a chain the fuzzer made (an alphabetical a.b.c... chain of the same length is read fine)."""
CRASHED_ESPEAK = [
    "a." * 300, "a.b.c. " * 100, "A.B.C." * 100, "http://" + "a.b.c.d." * 25 + "com",  # dotted letters
    "k . e . m . u . " * 25, "k..e..m.." * 33, "\u00e9 . \u00e8 . \u00ea . " * 17, "k.e., m.u., b.c., " * 17,
    "".join(f"{c}\u00ad." for c in _FUZZ_LETTERS),  # soft hyphens
    "\U0001d41a.\U0001d41b." * 13,  # 4-byte letters: from 26 on
    "ness" * 71, "s'" * 71, "'s" * 71, "hopelessness" + "ness" * 70, "The " + "ness" * 71 + " is here.",  # suffix stacks
]


@pytest.mark.parametrize("text", CRASHED_ESPEAK)
def test_texts_that_crash_espeak_are_spoken_not_refused(text: str) -> None:
    assert len(list(sentences(text, "en-us"))) >= 1


@pytest.mark.parametrize("text", [
    "Meet me at 9 a.m. in the U.S.A., e.g. at the N.A.S.A. office.",
    # What follows the last dot is no part of the abbreviation (it was counted, and the emoji lost).
    "e.g. \U0001f3f3\ufe0f\u200d\U0001f308\U0001f3f3\ufe0f\u200d\U0001f308\U0001f3f3\ufe0f\u200d\U0001f308",
    "I live in the U.S. " + "\U0001f600" * 10, "U.S.A. " + "\u00ab" * 20,
])
def test_short_abbreviations_are_left_to_espeak(piper_voice: PiperVoice, text: str) -> None:
    assert edged_ids(piper_voice, text) == piper_ids(piper_voice, text)


@pytest.mark.parametrize("text", [
    "Authors: A. B., C. D., E. F., G. H., I. J., K. L., M. N. and J. R. R. Tolkien.",
    'She said "I. M. F."\n\n\nNext chapter, version 1.2.3.4 at 10.0.0.1, U.S.      now.',
    "\u6211\u4eec\u4eca\u5929\u53bb\u516c\u56ed\u6563\u6b65\u3002" * 8,  # Chinese: no spaces, 80 characters
    "\u0e27\u0e31\u0e19\u0e19\u0e35\u0e49\u0e2d\u0e32\u0e01\u0e32\u0e28\u0e14\u0e35" * 6,  # Thai, likewise
])
def test_ordinary_text_passes_the_guards_untouched(text: str) -> None:
    assert safe_for_espeak(text) == text


def test_a_long_unspaced_run_gets_a_space_where_words_are_spaced() -> None:
    assert safe_for_espeak("x" * 140) == "x" * 128 + " " + "x" * 12
    assert safe_for_espeak("x" * 128) == "x" * 128
    url = "https://downloads.example.org/releases/2026/" + "edged-voice-bundle-en-us-joe-medium-" * 3 + "x.tar.gz"
    broken = safe_for_espeak(url)
    assert broken.replace(" ", "") == url
    assert broken.split(" ")[0] == url[:url.rindex("-", 0, 128) + 1]
    assert all(len(part) <= 128 for part in broken.split(" "))


@pytest.mark.parametrize("text", [
    "Visit https://downloads.example.org/releases/2026/edged-voice-bundle-en-us-joe-medium.tar.gz today.",
    "Write to firstname.lastname.department@subdomain.university-of-somewhere.example.edu please.",
    "The checksum is sha256:1fa53c24e217085832994342f9db42bd795318a5cedd98a7ca12ea76392b8e0b.",
    "Donaudampfschifffahrtselektrizitaetenhauptbetriebswerkbauunterbeamtengesellschaft.",
])
def test_long_words_that_espeak_reads_are_left_to_it(piper_voice: PiperVoice, text: str) -> None:
    # Runs over 64 characters were broken up, and read otherwise than Piper reads them.
    assert edged_ids(piper_voice, text) == piper_ids(piper_voice, text)


def test_nul_in_text_is_read_as_a_space() -> None:
    assert list(sentences("Hello\0there.", "en-us")) == list(sentences("Hello there.", "en-us"))


@pytest.mark.parametrize("text", ["", "   ", "\n\t "])
def test_empty_text_is_refused(text: str) -> None:
    with pytest.raises(BadInput, match="empty"):
        list(sentences(text, "en-us"))


def test_punctuation_only_text_has_nothing_to_say() -> None:
    assert list(sentences("... ?! ,;", "en-us")) == []


def test_long_sentence_is_cut_at_clause_ends_within_limits() -> None:
    text = ", ".join(["the quick brown fox jumps over the lazy dog"] * 12) + "."
    (phonemes,) = list(sentences(text, "en-us"))
    limits = PieceLimits(first_piece_max=80, piece_max=240)
    pieces = list(split_pieces(phonemes, limits))
    assert len(pieces) > 2
    assert [p for piece in pieces for p in piece] == phonemes
    assert len(pieces[0]) <= 80 and all(len(p) <= 240 for p in pieces[1:])
    assert all(p[-2] == "," and p[-1] == " " for p in pieces[:-1])


def test_sentence_without_clauses_is_cut_at_a_word_end() -> None:
    phonemes = list("ab cd ef gh ij kl mn op")
    pieces = list(split_pieces(phonemes, PieceLimits(first_piece_max=7, piece_max=7)))
    assert [p for piece in pieces for p in piece] == phonemes
    assert all(p[-1] == " " for p in pieces[:-1]) and all(len(p) <= 7 for p in pieces)


@pytest.mark.parametrize(("text", "first", "later"), [
    ("aaaa, " + "b" * 20, 5, 5),  # a clause end just past the limit
    ("a" * 5 + " " + "b" * 4 + " " + "c" * 6, 10, 5),  # a word end just past it
])
def test_pieces_never_pass_the_limit_by_the_space_after_them(text: str, first: int, later: int) -> None:
    phonemes = list(text)
    pieces = list(split_pieces(phonemes, PieceLimits(first_piece_max=first, piece_max=later)))
    assert [p for piece in pieces for p in piece] == phonemes
    assert len(pieces[0]) <= first and all(len(p) <= later for p in pieces[1:])


def test_short_sentence_is_never_cut() -> None:
    phonemes = list("hello, world")
    assert list(split_pieces(phonemes, PieceLimits())) == [phonemes]


@pytest.mark.parametrize("ending", ["Wait..", "It is U.S.e.g.."])
def test_a_text_does_not_change_how_the_next_one_is_read(piper_voice: PiperVoice, ending: str) -> None:
    # espeak-ng kept the last dot of "Wait.." and began the next text, another client's, with "dot".
    expected = piper_ids(piper_voice, "Paul walked home?")
    assert list(sentences(ending, "en-us"))
    assert edged_ids(piper_voice, "Paul walked home?") == expected


@pytest.mark.parametrize("text", [
    "See [[Paris]] now.", "Say [[h\u0259l\u02c8o\u028a]].", "[[h\u0259l\u02c8o\u028a]] world. Next one.",
    "A. [[b]] [[c]] d. E [[f]]", "x [[a]][[b]] y.", "First. Second [[w\u02c8\u025c\u02d0ld]]. Third.",
    "Hi [[ t\u02c8u\u02d0 ]], you.", "Unclosed [[ here.", "Over [[two\nlines]] is text.",
    # An unclosed "[[" that begins the text, or follows "]]": the rest is phonemes to Piper.
    "[[hello world", "[[e", "[[a]][[b c d", "[[1] First item.", "[[a\nb]] c",
    # A block after an unclosed part that ends with a space: a space between them, as in Piper.
    "[[x\ny [[]]z", "[[\n [[]]s", "[[a \n]] [[b]] c",
    # espeak-ng's state (here a number's grouping) does not cross from one part to the next.
    "4547568\ts[[]]20189,506,995",
])
def test_phonemes_written_in_the_text_are_taken_as_piper_takes_them(piper_voice: PiperVoice, text: str) -> None:
    # Piper reads "[[ ... ]]" as phonemes, not text: edged read them out ("bracket h schwa ...").
    assert edged_ids(piper_voice, text) == piper_ids(piper_voice, text)


def test_phonemes_the_voice_has_no_id_for_are_skipped_without_a_warning_each(
        piper_voice: PiperVoice, caplog: pytest.LogCaptureFixture) -> None:
    # Piper's phonemes_to_ids warns once per unknown phoneme: 100,000 characters, 100,000 lines.
    text = "Prices in [[" + "\u20ac" * 1000 + "]] euros."
    expected = piper_ids(piper_voice, text)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert edged_ids(piper_voice, text) == expected
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_text_between_written_phonemes_is_read_a_block_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each part of the text between [[ ]] went to espeak-ng alone, a fork each (~4 ms): 10,000
    # parts took 40 s inside one step of the text stage, whose only slot the daemon's other
    # clients then waited for.
    import edged.phonemes

    calls: list[int] = []
    real = edged.phonemes.ESPEAK.phonemize_each

    def counting(espeak_voice: str, texts: list[str]) -> list[list[list[str]]]:
        calls.append(len(texts))
        return real(espeak_voice, texts)

    monkeypatch.setattr(edged.phonemes.ESPEAK, "phonemize_each", counting)
    (sentence,) = sentences("[[ a ]] b " * 1000, "en-us")  # one sentence, as Piper makes it
    assert sum(calls) == 1001 and len(calls) <= 10
    assert sentence.count("a") == 1000


def test_a_block_of_one_sentence_is_yielded_before_the_next_block_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each block's last sentence was held until the next block was read (in case phonemes
    # written in [[ ]] followed it): a text whose blocks are single long sentences read twice as
    # much before its first audio.
    import edged.phonemes

    read: list[str] = []
    real = edged.phonemes.ESPEAK.phonemize_each

    def recording(espeak_voice: str, texts: list[str]) -> list[list[list[str]]]:
        read.extend(texts)
        return real(espeak_voice, texts)

    monkeypatch.setattr(edged.phonemes.ESPEAK, "phonemize_each", recording)
    one_sentence = "And then we walked on, " + "and then we walked on, " * 84 + "until the end. "  # 1,970
    stream = sentences(one_sentence * 3, "en-us")
    next(stream)
    blocks = [text for text in read if len(text) > 1000]
    assert blocks == [one_sentence]


def test_pieces_of_a_long_sentence_are_the_same_wherever_it_is_cut_from() -> None:
    # Cut by index from the start of the sentence: each piece as if the rest had been cut off.
    phonemes = list(("ab cd, ef gh ij; " * 40).strip())
    limits = PieceLimits(first_piece_max=9, piece_max=13)
    pieces = list(split_pieces(phonemes, limits))
    rest, expected = phonemes, []
    for limit in [9] + [13] * len(pieces):
        if len(rest) <= limit:
            expected.append(rest)
            break
        (first, *_) = split_pieces(rest, PieceLimits(first_piece_max=limit, piece_max=limit))
        expected.append(first)
        rest = rest[len(first):]
    assert pieces == expected and len(pieces) > 10
