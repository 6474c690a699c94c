"""Static int8 quantization of the front, back and back_fixed graphs, calibrated on
tools/calibration.txt.

tools.build_voice builds the chosen variant (`CHOSEN`) and records the figures of
tools.quantize_report; `python -m tools.quantize --sweep` (tools.quantize_sweep) tries the other
variants on the same graphs and prints a table of speed and quality against fp32, which is how
`CHOSEN` was picked. `lsd` and `snr_db` compare audio.

Calibration: the front sees the phoneme ids of every calibration sentence at the voice's default
scales; the back sees the latent frames the fp32 front makes of them, cut into windows as the
engine cuts them, and so does back_fixed, with a frame mask of ones (the same ranges as the
back's). The front's noise comes from RandomNormalLike nodes: the copy that is calibrated gets a
fixed seed (removed again from the result), so the same input always builds the same files.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import dtw
import numpy as np
import onnx
import onnxruntime as ort
import scipy.signal
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_static,
)

from edged.bundle import Streaming, check_phoneme_id_map
from edged.engine import back_feed, front_feed
from edged.phonemes import PieceLimits, pieces_ids
from edged.windows import growing_windows

from .graphs import audio_rate_nodes, save_mapped

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
SWEEP_FILE = Path(__file__).with_name("quantize_sweep.json")
NOISE_SEED = 1234.0
"""Seed of the noise nodes in the copy of the front that is calibrated (and that feeds the back)."""

@dataclass(frozen=True)
class Variant:
    """One way of quantizing a graph (the options of onnxruntime's quantize_static)."""

    quant_format: Literal["QDQ", "QOperator"] = "QDQ"
    per_channel: bool = True
    op_types: tuple[str, ...] = ("Conv",)
    """Operator types to quantize; () lets the quantizer take every type it supports."""
    keep_fp32: tuple[str, ...] = ()
    """Node-name prefixes left in fp32 (e.g. "/flow/")."""
    activations: Literal["s8", "u8"] = "s8"
    reduce_range: bool = False
    method: Literal["MinMax", "Percentile", "Entropy"] = "MinMax"
    dedicated_pairs: bool = True
    """One Q/DQ pair per consumer: onnxruntime fuses DQ -> Conv -> Q into QLinearConv only where
    the DQ feeds that Conv alone (a shared one leaves an fp32 Conv with weights dequantized per run)."""

    @property
    def label(self) -> str:
        parts = [self.quant_format, "per-channel" if self.per_channel else "per-tensor",
                 "+".join(self.op_types) or "all-ops", f"{self.activations}-act", self.method]
        parts += [f"fp32:{p}" for p in self.keep_fp32] + (["reduce-range"] if self.reduce_range else [])
        parts += [] if self.dedicated_pairs else ["shared-qdq"]
        return " ".join(parts)


FLOW = ("/flow/",)
"""The front's normalizing flow (last before the decoder): quantized, it moves the waveform far
from fp32 (SNR ~4 dB) but not its spectrum (LSD +0.6 dB) nor the noise in pauses."""
AUDIO_RATE = "audio-rate"
"""In keep_fp32: the decoder's layers at the audio rate (graphs.audio_rate_nodes), where activation
rounding is heard as hiss. Found in the graph: which resblocks they are depends on the voice's
quality (6-8 in a medium voice, 9-11 in a high one)."""
LAST_STAGE = (AUDIO_RATE,)
FRONT_KEEP = ("/dp/", "/enc_p/proj", "/enc_p/encoder/attn")
"""Duration predictor, latent projection and attention: little time, much of the error."""

CHOSEN = {
    # The encoder's feed-forward convs and the flow hold most of the front's time; attention,
    # the duration predictor and the latent projection cost little and, quantized, make most of
    # its error. Activations u8: with s8, onnxruntime's x86 optimizer turns some Q/DQ pairs to u8
    # and not others (a Q read by two DQs), and a Conv whose input and output types then differ
    # is not fused: it runs in fp32 with its weights dequantized at every run. That made the
    # quantized flow slower than the fp32 one; with u8 every Conv is a QLinearConv.
    # Weights in 7 bits (reduce_range): x86 without VNNI (AVX2) multiplies u8 by s8 in pairs
    # summed into 16 bits, which saturate with 8-bit weights. On such a CPU the front's
    # log-spectral distance to fp32 was 3.51 dB with 8-bit weights, 1.98 with 7, at the same speed;
    # with VNNI, which does not saturate, 7 bits cost ~0.1 dB (tools/quantize_sweep.json).
    "front": Variant(keep_fp32=FRONT_KEEP, method="Percentile", activations="u8", reduce_range=True),
    # The decoder's audio-rate layers add hiss when quantized (noise in pauses +14 dB, LSD 1.8 ->
    # 3.8 dB): they stay fp32. Entropy ranges: 1.8 -> 1.5 dB.
    "back": Variant(keep_fp32=LAST_STAGE, method="Entropy"),
}
"""Picked with `python -m tools.quantize --sweep`; its table is tools/quantize_sweep.json."""
CHOSEN["back_fixed"] = CHOSEN["back"]  # the same decoder, with its padding masked


@dataclass(frozen=True)
class VoiceFacts:
    """What calibration and measurement need to know about the voice (from its config)."""

    espeak_voice: str
    phoneme_id_map: dict[str, list[int]]
    inference: dict[str, float]
    streaming: Streaming = field(default_factory=Streaming)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VoiceFacts:
        """From a Piper voice's .onnx.json (with Piper's defaults for what it leaves out).
        ValueError for a voice that edged cannot read text for as Piper does, TypeError or
        BundleError for a config of another shape than Piper's."""
        if not isinstance(config, dict):
            raise TypeError("the config is not a JSON object")
        espeak, inference = config.get("espeak"), config.get("inference", {})
        if not (isinstance(espeak, dict) and isinstance(espeak.get("voice"), str) and isinstance(inference, dict)):
            raise TypeError("config: 'espeak' must be an object naming the espeak-ng voice ('voice'), and "
                            "'inference', if given, an object")
        check_phoneme_id_map(config.get("phoneme_id_map"))
        if config.get("phoneme_type", "espeak") != "espeak" or config.get("vowel_clusters"):
            raise ValueError("edged reads text with espeak-ng only, without vowel clusters; this voice's "
                             f"config asks for phoneme_type {config.get('phoneme_type', 'espeak')!r}"
                             + (" and vowel clusters" if config.get("vowel_clusters") else ""))
        if espeak["voice"] == "ar":  # piper-tts: voice.py, "Arabic diacritization"
            raise ValueError("edged reads text with espeak-ng only; for an Arabic voice (espeak voice 'ar') "
                             "Piper first adds the vowel marks with its tashkeel model, which edged does not: "
                             "the voice would get phonemes other than those it was trained on")
        return cls(espeak["voice"], config["phoneme_id_map"], {
            "noise_scale": float(inference.get("noise_scale", 0.667)),
            "length_scale": float(inference.get("length_scale", 1.0)),
            "noise_w": float(inference.get("noise_w", 0.8)),
        })

    def ids(self, text: str) -> list[list[int]]:
        return list(pieces_ids(text, self.espeak_voice, self.phoneme_id_map, PieceLimits()))

    def scales(self, noise: bool = True) -> np.ndarray:
        inf = self.inference
        return np.array([inf["noise_scale"] if noise else 0.0, inf["length_scale"],
                         inf["noise_w"] if noise else 0.0], dtype=np.float32)


def calibration_sentences(path: Path = CALIBRATION_TEXT) -> list[str]:
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def seeded(model: onnx.ModelProto, seed: float | None) -> onnx.ModelProto:
    """A copy whose random nodes draw from `seed` (None removes the seeds)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        if node.op_type.startswith("RandomNormal"):
            kept = [a for a in node.attribute if a.name != "seed"]
            del node.attribute[:]
            node.attribute.extend(kept)
            if seed is not None:
                node.attribute.append(onnx.helper.make_attribute("seed", seed))
    return copy


def calibration_feeds(front: onnx.ModelProto, facts: VoiceFacts) -> dict[str, list[dict]]:
    """Inputs for calibrating each graph: {"front": [...], "back": [...], "back_fixed": [...]}."""
    feeds = [front_feed(ids, facts.scales()) for text in calibration_sentences() for ids in facts.ids(text)]
    session = ort.InferenceSession(seeded(front, NOISE_SEED).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    streaming, back, back_fixed = facts.streaming, [], []
    for feed in feeds:
        (latents,) = session.run(None, feed)
        for w in growing_windows(latents.shape[2], streaming.first_window, streaming.max_window,
                                 streaming.context):
            back.append(back_feed(latents, w))
            back_fixed.append(back_feed(latents, w, masked=True))
    return {"front": feeds, "back": back, "back_fixed": back_fixed}


class _Feeds(CalibrationDataReader):
    """The calibration inputs, one at a time (`set_range` lets histograms be built input by input)."""

    def __init__(self, feeds: list[dict]) -> None:
        self._all = feeds
        self._feeds: Iterator[dict] = iter(feeds)

    def __len__(self) -> int:
        return len(self._all)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._feeds = iter(self._all[start_index:end_index])

    def get_next(self) -> dict | None:
        return next(self._feeds, None)


def quantize_graph(model: onnx.ModelProto, feeds: list[dict], variant: Variant, target: Path,
                   cache: Path | None = None) -> list[str]:
    """Quantize one plain fp32 graph and save it optimized and mapped, like the fp32 graphs.

    `cache` keeps the calibrated ranges (JSON) for other variants with the same op types and method.
    """
    from .build_voice import optimize_offline  # here: build_voice imports this module

    # Beside the target: the builder's staging directory, which an interrupted build leaves for the next to remove.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".quantizing-") as tmp, _quiet():
        raw = Path(tmp) / "int8.onnx"
        quantize_static(
            seeded(model, NOISE_SEED), raw, _Feeds(feeds),
            quant_format=QuantFormat.QDQ if variant.quant_format == "QDQ" else QuantFormat.QOperator,
            op_types_to_quantize=list(variant.op_types) or None,
            per_channel=variant.per_channel,
            reduce_range=variant.reduce_range,
            activation_type=QuantType.QInt8 if variant.activations == "s8" else QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=_kept_fp32(model.graph, variant.keep_fp32),
            calibrate_method=CalibrationMethod[variant.method],
            calibration_cache_path=cache,
            extra_options={
                "DedicatedQDQPair": variant.dedicated_pairs,
                # Histograms one input at a time: inputs differ in length, and all at once would
                # hold every activation of every input in memory.
                **({"CalibStridedMinMax": 1} if variant.method != "MinMax" else {}),
            },
        )
        plain = Path(tmp) / "plain.onnx"
        save_mapped(seeded(onnx.load(str(raw)), None), plain)
        # Common-subexpression elimination would merge the dedicated Q/DQ pairs again.
        disabled = ("CommonSubexpressionElimination",) if variant.dedicated_pairs else ()
        return optimize_offline(plain, target, disabled)


def _kept_fp32(graph: onnx.GraphProto, keep_fp32: tuple[str, ...]) -> list[str]:
    """Names of the nodes that `keep_fp32` (name prefixes, or AUDIO_RATE) leaves in fp32."""
    audio_rate = audio_rate_nodes(graph) if AUDIO_RATE in keep_fp32 else set()
    prefixes = tuple(p for p in keep_fp32 if p != AUDIO_RATE)
    return [n.name for n in graph.node if n.name in audio_rate or n.name.startswith(prefixes)]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hush the quantizer: it prints a line per calibration input and advises pre-processing
    (quant_pre_process: tried on the back, it left the graph and the result unchanged)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)


def build_int8(raw: dict[str, Path], facts: VoiceFacts, out_dir: Path,
               variants: dict[str, Variant] = CHOSEN) -> dict[str, list[str]]:
    """Write <graph>.int8.onnx (+ .data) into out_dir for each plain fp32 graph `raw[graph]`
    ("front", "back", "back_fixed"); returns the files written per graph."""
    models = {name: onnx.load(str(path)) for name, path in raw.items()}
    feeds = calibration_feeds(models["front"], facts)
    return {name: quantize_graph(model, feeds[name], variants[name], out_dir / f"{name}.int8.onnx")
            for name, model in models.items()}


# -- comparing audio -------------------------------------------------------------------------

def _log_power(audio: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    """Power spectrogram in dB, frames x bins."""
    _, _, spec = scipy.signal.stft(np.asarray(audio, np.float64), nperseg=n_fft,
                                   noverlap=n_fft - hop, boundary=None, padded=False)
    return 10 * np.log10(np.abs(spec.T) ** 2 + 1e-30)


def lsd(reference: np.ndarray, test: np.ndarray, align: bool = False, n_fft: int = 1024,
        hop: int = 256, floor_db: float = -60.0) -> float:
    """Log-spectral distance in dB: RMS over frequency of the dB difference, averaged over frames.

    Both spectra are floored `floor_db` below the reference's loudest bin, so that differences far
    under the speech (in silence, above 8 kHz) do not swamp the figure; for scale, 8-bit linear
    PCM of the same audio scores about 1.9 dB, 8-bit mu-law 0.4 dB. `align` pairs frames by
    dynamic time warping, for audio whose timing differs (another duration prediction); without it
    the longer input is cut.
    """
    ref, out = _log_power(reference, n_fft, hop), _log_power(test, n_fft, hop)
    floor = ref.max() + floor_db
    ref, out = np.maximum(ref, floor), np.maximum(out, floor)
    if align:
        path = dtw.dtw(ref, out, step_pattern="symmetric2")
        ref, out = ref[path.index1], out[path.index2]
    else:
        n = min(len(ref), len(out))
        ref, out = ref[:n], out[:n]
    return float(np.mean(np.sqrt(np.mean((ref - out) ** 2, axis=1))))


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-noise ratio in dB of `test` against `reference` (inf when they are equal)."""
    if len(reference) != len(test):
        raise ValueError(f"lengths differ: {len(reference)} vs {len(test)} samples")
    noise = float(np.sum((test.astype(np.float64) - reference) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    return float("inf") if noise == 0 else float(10 * np.log10(signal / noise))

if __name__ == "__main__":  # `python -m tools.quantize --sweep`: the experiment lives beside
    from .quantize_sweep import main

    raise SystemExit(main())
