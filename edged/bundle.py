"""Voice bundles on disk: the manifest, and checking every file against it.

A bundle is a directory holding `manifest.json` and the graph files it lists. The manifest
records each file's sha256 and size; a bundle whose files do not match is refused at load.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import BundleError
from .files import NotARegularFile, read_regular_file
from .untrusted_json import loads

NAME_MAX = 64
"""Longest voice id, version or cache tag: the names a client gives to clear cached audio."""

FILE_NAME_BYTES = 255
"""Longest name of a file in a bundle (NAME_MAX of Linux file systems)."""
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20
"""A built manifest is ~11 kB; status calls read the manifests of voices not loaded."""
FORMAT_VERSION = 4
"""4: each precision also has a back_fixed graph, the back with a frame mask for the fixed-shape
mode, which may read the back's weight file (`weights`). 3: the flow is in the front graph, the
back is the decoder alone. 2: the back held the flow and had a `trim` input. 1: its decoder decoded
all of the flow's context."""
GRAPH_ROLES = ("front", "back", "back_fixed")
"""The graphs of each precision: back_fixed is the back with a `frame_mask` input, which the
fixed-shape mode runs (it masks a short piece's padding at every layer)."""

Precision = Literal["fp32", "int8"]
PIPER_MARKERS = ("^", "$", "_")
"""Phonemes Piper's id sequence always uses: start, end and the pad between phonemes."""
MAX_NOISE = 2.0
"""Largest noise_scale and noise_w, a voice's default or a call's (SynthesisParams): past ~3,
noise_w stretched a sentence to 10^5 frames and onnxruntime's buffers past the box's memory;
at 2 a sentence has up to ~5 times its frames at the default."""
MAX_PHONEME_ID = 1 << 16
"""Piper's voices have a few hundred phoneme ids; an id past the front graph's embedding table is
caught when the graph runs (BundleError), this bound keeps absurd ones out of int64 arrays."""
MAX_IDS_PER_PHONEME = 8
"""Piper's voices give each phoneme one id; a list of thousands (a damaged map) made one request
take seconds and gigabytes."""
MAX_FRAMES = 4096
"""Largest window or context a manifest may ask for (~47 s of audio; memory grows with it)."""


@dataclass(frozen=True)
class Streaming:
    """How the back graph is run over latent frames (one frame = hop_length samples)."""

    first_window: int = 16
    """Frames decoded in the first window; later windows grow eightfold up to `max_window`.
    16 rather than 32 took ~15 ms off time to first audio here (tools.bench), at no cost in SNR."""
    max_window: int = 256
    """Caps the decoder's working memory (its activations grow with the window). 256 rather than
    512: anonymous memory after synthesis 209 against 316 MB, and the real-time factor the same
    within noise (0.775 against 0.771x Piper's; with the flow in the front, a window's context is
    only 12 frames). tools.bench, which reports both."""
    context: int = 12
    """Frames of context given to the decoder on each side of a window: its receptive field,
    rounded up (tools.graphs.context_frames; 12 for a medium voice). 12 kept the joins exact (126
    dB SNR against one whole decode), 8 gave 63 dB."""
    fixed_window: int = 64
    """Window of the fixed-shape mode (input is always fixed_window + 2 * context frames)."""

    def __post_init__(self) -> None:
        for name in ("first_window", "max_window", "fixed_window", "context"):
            _require(_is_int(getattr(self, name)) and 0 <= getattr(self, name) <= MAX_FRAMES,
                     f"streaming.{name} must be a whole number of frames up to {MAX_FRAMES}")
        _require(1 <= self.first_window <= self.max_window and self.fixed_window >= 1,
                 "streaming windows must hold at least one frame, the first no more than max_window")


@dataclass(frozen=True)
class Manifest:
    voice_id: str
    version: str
    sample_rate: int
    """Output sample rate in Hz."""
    hop_length: int
    """Audio samples per latent frame."""
    espeak_voice: str
    phoneme_id_map: dict[str, list[int]]
    inference: dict[str, float]
    """Default noise_scale, length_scale and noise_w of the voice."""
    graphs: dict[str, dict[str, str]]
    """graphs[precision][front|back|back_fixed] -> file name of the ONNX graph."""
    files: dict[str, dict[str, Any]]
    """file name -> {"sha256": hex, "size": bytes} for every file of the bundle."""
    streaming: Streaming = field(default_factory=Streaming)
    default_precision: str = "fp32"
    report: dict[str, Any] = field(default_factory=dict)
    """Quality and speed figures measured by the builder."""
    build: dict[str, str] = field(default_factory=dict)
    """What the bundle was built from: digests of the source voice and of the builder's code."""
    weights: dict[str, str] = field(default_factory=dict)
    """graph file -> the file its weights are in, where that is not `<graph>.data`: back_fixed
    reads the back's (the same weights; the builder shares them only where they are identical)."""

    def __post_init__(self) -> None:
        """Types and ranges of what the engine uses: a damaged or hand-edited manifest is refused
        here, with the field named, not met later as a crash in the middle of a synthesis."""
        for name in ("voice_id", "version", "espeak_voice"):
            _require(isinstance(getattr(self, name), str) and getattr(self, name), f"{name} must be a non-empty string")
        for name in ("voice_id", "version"):  # as a client names them, to clear their cached audio
            _require(len(getattr(self, name)) <= NAME_MAX and getattr(self, name).isprintable(),
                     f"{name} must be printable and at most {NAME_MAX} characters")
        _require(_is_int(self.sample_rate) and 8000 <= self.sample_rate <= 192_000,
                 "sample_rate must be a whole number of Hz between 8000 and 192000")
        _require(_is_int(self.hop_length) and 1 <= self.hop_length <= 4096, "hop_length must be between 1 and 4096")
        check_phoneme_id_map(self.phoneme_id_map)
        _require(isinstance(self.inference, dict) and all(
            isinstance(self.inference.get(k), (int, float)) and not isinstance(self.inference[k], bool)
            and 0 <= self.inference[k] <= limit
            for k, limit in (("noise_scale", MAX_NOISE), ("length_scale", 10), ("noise_w", MAX_NOISE)))
            and self.inference["length_scale"] > 0,
            f"inference must hold noise_scale and noise_w between 0 and {MAX_NOISE:g}, and length_scale "
            "above 0 and at most 10")
        _require(isinstance(self.files, dict) and all(
            _is_plain_name(name) and isinstance(entry, dict) and _is_int(entry.get("size"))
            and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64
            for name, entry in self.files.items()),
            f"files must map plain file names of the bundle (at most {FILE_NAME_BYTES} bytes) to their sha256 and size")
        _require(isinstance(self.graphs, dict) and self.graphs and all(
            precision in ("fp32", "int8") and isinstance(roles, dict) and set(roles) == set(GRAPH_ROLES)
            and all(isinstance(g, str) and g in self.files for g in roles.values())
            for precision, roles in self.graphs.items()),
            "graphs must name, for fp32 and/or int8, a front, a back and a back_fixed graph listed in files")
        _require(isinstance(self.weights, dict) and all(
            isinstance(graph, str) and isinstance(data, str) for graph, data in self.weights.items()),
            "weights must map graph files to weight files")
        _require(all(self.weights_file(g) in self.files for roles in self.graphs.values() for g in roles.values()),
                 "graphs must have their weight files listed in files")
        _require(isinstance(self.default_precision, str) and self.default_precision in self.graphs,
                 "default_precision must be one of the bundle's graphs")

    def weights_file(self, graph: str) -> str:
        """The external-data file holding a graph's weights."""
        return self.weights.get(graph, graph + ".data")

    @functools.cached_property
    def audio_digest(self) -> str:
        """sha256 (hex, 16 digits) of what decides the bundle's audio: its files' digests, voice
        settings and window plan. The version alone does not: a rebuild may keep it."""
        decides = {"files": {name: entry["sha256"] for name, entry in self.files.items()},
                   "graphs": self.graphs, "inference": self.inference, "espeak_voice": self.espeak_voice,
                   "phoneme_id_map": self.phoneme_id_map, "streaming": self.streaming.__dict__,
                   "sample_rate": self.sample_rate, "hop_length": self.hop_length}
        blob = json.dumps(decides, sort_keys=True, ensure_ascii=True).encode("ascii")
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_json(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # not cached properties
        data = {"format": FORMAT_VERSION, **fields, "streaming": self.streaming.__dict__}
        return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        if data.get("format") != FORMAT_VERSION:
            raise BundleError(f"unsupported bundle format {data.get('format')!r} (this edged reads "
                              f"format {FORMAT_VERSION}): rebuild it with python -m tools.build_voice")
        fields = {k: v for k, v in data.items() if k != "format"}
        try:
            fields["streaming"] = Streaming(**fields.get("streaming", {}))
            return cls(**fields)
        except (TypeError, BundleError) as exc:
            raise BundleError(f"malformed manifest: {exc}") from None


def check_phoneme_id_map(id_map: object) -> None:
    """BundleError unless `id_map` maps phonemes to short lists of ids and has Piper's markers."""
    _require(isinstance(id_map, dict) and all(
        isinstance(ids, list) and 1 <= len(ids) <= MAX_IDS_PER_PHONEME
        and all(_is_int(i) and 0 <= i < MAX_PHONEME_ID for i in ids)
        for ids in id_map.values()), f"phoneme_id_map must map phonemes to lists of 1 to "
        f"{MAX_IDS_PER_PHONEME} ids under {MAX_PHONEME_ID}")
    _require(all(p in id_map for p in PIPER_MARKERS),  # type: ignore[operator]
             f"phoneme_id_map lacks one of Piper's markers {PIPER_MARKERS}")


def file_digest(path: Path) -> dict[str, Any]:
    """sha256 and size of one file, read in blocks so large weight files stay out of memory."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    return {"sha256": digest.hexdigest(), "size": size}


def read_manifest(bundle_dir: Path) -> Manifest:
    path = bundle_dir / MANIFEST_NAME
    try:  # a FIFO by that name blocked the status call listing it, and the daemon with it, for good
        data = loads(read_regular_file(path, MAX_MANIFEST_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{bundle_dir}: no {MANIFEST_NAME}, not a voice bundle") from None
    except NotARegularFile as exc:
        raise BundleError(f"unusable manifest: {exc}") from None
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON, nested too deeply
        raise BundleError(f"{path}: unreadable manifest: {exc}") from None
    if not isinstance(data, dict):
        raise BundleError(f"{path}: manifest is not a JSON object")
    return Manifest.from_dict(data)


def verify_files(bundle_dir: Path, manifest: Manifest, names: list[str] | None = None) -> None:
    """Check size and sha256 of the named files (all by default); raise BundleError on a mismatch."""
    for name in names if names is not None else sorted(manifest.files):
        expected = manifest.files.get(name)
        if expected is None:
            raise BundleError(f"{bundle_dir}: {name} is not listed in the manifest")
        path = bundle_dir / name
        try:  # is_file too: it raises for a name too long (ENAMETOOLONG) or a directory not searchable
            if not path.is_file():
                raise BundleError(f"{bundle_dir}: missing file {name}")
            if path.stat().st_size != expected["size"]:
                raise BundleError(f"{bundle_dir}: {name} has the wrong size (damaged or tampered)")
            if file_digest(path)["sha256"] != expected["sha256"]:
                raise BundleError(f"{bundle_dir}: {name} fails its sha256 check (damaged or tampered)")
        except OSError as exc:  # unreadable: copied in by another user, say, or a failing disk
            raise BundleError(f"{bundle_dir}: cannot read {name}: {exc.strerror or exc}") from None


def _require(condition: object, message: str) -> None:
    if not condition:
        raise BundleError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_plain_name(name: object) -> bool:
    """A name of a file in the bundle directory itself: no directory part, not "." or "..", and
    not longer than a file name may be (opening one raised ENAMETOOLONG deep in a load)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and len(name.encode("utf-8", "surrogatepass")) <= FILE_NAME_BYTES)
