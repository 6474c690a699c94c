"""Audio quality on the real voice: streamed windows against the unsplit Piper model, seams, ASR.

The full evaluation (int8, the whole sentence set) is `python -m tools.eval_quality`; these are its
fast checks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edged.engine import EngineSettings, SynthesisParams, Voice
from edged.windows import growing_windows
from tools.asr import WHISPER_RATE, Asr, normalize, resample, word_error_rate
from tools.eval_quality import (
    SNR_TEXTS,
    UNSPLIT,
    ZERO_NOISE,
    SourceModel,
    Streamed,
    check_source,
    default_source,
    seam_report,
    stream,
    synthesize,
)
from tools.quantize import snr_db

MIN_SNR_DB = 60.0


@pytest.fixture(scope="module")
def source() -> SourceModel:
    return SourceModel(default_source())


@pytest.fixture(scope="module")
def unsplit(source: SourceModel, bundle_dir: Path) -> dict[str, np.ndarray]:
    """The source model's audio for each text, noise scales 0."""
    voice = Voice.load(bundle_dir, EngineSettings("fp32", pieces=UNSPLIT))
    return {name: source.run(_only_piece(voice, text)) for name, text in SNR_TEXTS.items()}


@pytest.fixture(scope="module", params=[False, True], ids=["growing", "fixed"])
def streamed(request: pytest.FixtureRequest, bundle_dir: Path) -> dict[str, Streamed]:
    voice = Voice.load(bundle_dir, EngineSettings("fp32", fixed_shape=request.param, pieces=UNSPLIT))
    return {name: stream(voice, voice.front(_only_piece(voice, text), ZERO_NOISE))
            for name, text in SNR_TEXTS.items()}


def _only_piece(voice: Voice, text: str) -> list[int]:
    (ids,) = list(voice.pieces(text))
    return ids


def test_streamed_windows_match_the_unsplit_model(streamed: dict[str, Streamed],
                                                  unsplit: dict[str, np.ndarray]) -> None:
    assert len(unsplit["long"]) / 22050 > 20
    assert len(streamed["short"].joins) <= 1  # 0.5 s: the first window and the rest (one, padded, if fixed)
    assert len(streamed["long"].joins) >= 3
    for name, out in streamed.items():
        assert len(out.audio) == len(unsplit[name]), name
        assert snr_db(unsplit[name], out.audio) >= MIN_SNR_DB, name


@pytest.mark.parametrize(("text", "speed"), [("[[a]]", 1.0), ("Hi.", 4.0)])
def test_fixed_shape_pieces_that_end_in_sound_match_the_unsplit_model(bundle_dir: Path, source: SourceModel,
                                                                      text: str, speed: float) -> None:
    # Pieces shorter than the fixed shape are padded. Padded with zero frames alone, where such a
    # piece ends in sound (a lone phoneme, a word spoken fast) its last frames differed from the
    # unsplit decoder's: 27.8 and 48.8 dB; int8 20.6 and 33.7 dB against its growing windows.
    params = SynthesisParams(speed=speed, noise_scale=0.0, noise_w=0.0)
    voices = {(precision, fixed): Voice.load(bundle_dir, EngineSettings(precision, fixed_shape=fixed, pieces=UNSPLIT))
              for precision in ("fp32", "int8") for fixed in (False, True)}
    ids = _only_piece(voices["fp32", True], text)
    latents = voices["fp32", True].front(ids, params)
    (window,) = voices["fp32", True].windows(latents)
    assert window.pad > 0
    unsplit = source.run(ids, voices["fp32", True].manifest.inference["length_scale"] / speed)
    assert snr_db(unsplit, stream(voices["fp32", True], latents).audio) >= MIN_SNR_DB
    latents = voices["int8", True].front(ids, params)
    growing = stream(voices["int8", False], latents).audio
    assert snr_db(growing, stream(voices["int8", True], latents).audio) >= MIN_SNR_DB


def test_window_joins_do_not_stand_out(streamed: dict[str, Streamed],
                                       unsplit: dict[str, np.ndarray]) -> None:
    for name in ("medium", "long"):
        report = seam_report(streamed[name].audio, streamed[name].joins, unsplit[name])
        assert report["joins"] > 0
        assert report["over_p999"] == 0 and report["over_local"] == 0, (name, report)
        assert report["join_snr_db"] >= MIN_SNR_DB, (name, report)


def test_seam_check_catches_windows_decoded_without_context(bundle_dir: Path,
                                                            unsplit: dict[str, np.ndarray]) -> None:
    """The seam measures are not blind: windows decoded with no context do show at their joins."""
    voice = Voice.load(bundle_dir, EngineSettings("fp32", pieces=UNSPLIT))
    latents = voice.front(_only_piece(voice, SNR_TEXTS["long"]), ZERO_NOISE)
    streaming = voice.manifest.streaming
    windows = growing_windows(latents.n_frames, streaming.first_window, streaming.max_window, context=0)
    chunks = [voice.decode_float(latents, w) for w in windows]
    joins = [int(j) for j in np.cumsum([len(c) for c in chunks])[:-1]]
    report = seam_report(np.concatenate(chunks), joins, unsplit["long"])
    assert report["over_local"] >= 1
    assert report["join_snr_db"] < 20


def test_word_error_rate_normalizes_both_sides() -> None:
    assert normalize("It's 7 o'clock, Mr-Smith!") == ["its", "seven", "oclock", "mr", "smith"]
    assert word_error_rate("Close the door.", "close the door") == 0.0
    assert word_error_rate("I have twenty one cats.", "I have 21 cats") == 0.0
    assert word_error_rate("the cat sat", "the cat sat down") == pytest.approx(1 / 3)
    assert word_error_rate("the cat sat", "a dog") == 1.0


def test_resample_keeps_a_tone_and_the_duration() -> None:
    t = np.arange(22050) / 22050
    out = resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), 22050, WHISPER_RATE)
    expected = np.sin(2 * np.pi * 440 * np.arange(WHISPER_RATE) / WHISPER_RATE)
    assert len(out) == WHISPER_RATE
    assert snr_db(expected[200:-200], out[200:-200]) > 40


def test_asr_round_trip_hears_the_engine(bundle_dir: Path) -> None:
    voice = Voice.load(bundle_dir, EngineSettings("fp32", pieces=UNSPLIT))
    text = "Please close the kitchen window before it starts to rain."
    heard = Asr.load().transcribe(synthesize(voice, text, ZERO_NOISE).audio, voice.sample_rate)
    assert word_error_rate(text, heard) <= 0.2, heard


def test_eval_quality_refuses_a_model_the_bundle_was_not_built_from(tmp_path: Path, bundle_dir: Path) -> None:
    # It measured every bundle against the default voice's model: another voice's bundle got a
    # traceback ("lengths differ"), or an SNR of two different voices.
    check_source(bundle_dir, default_source())
    other = tmp_path / "other.onnx"
    other.write_bytes(default_source().read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError, match="was not built from"):
        check_source(bundle_dir, other)
