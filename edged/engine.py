"""A loaded voice and its data path: text -> phoneme ids -> front -> back windows -> PCM chunks.

    voice = Voice.load(bundle_dir)
    for pcm in voice.synthesize("Hello there."):   # 16-bit mono PCM bytes, as produced
        ...

Each step is also public (`pieces`, `front`, `windows`, `decode`) so that the daemon can run them as
separate pipeline stages with their own concurrency limits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnxruntime import InferenceSession, RunOptions
from onnxruntime.capi.onnxruntime_pybind11_state import (
    Fail,
    InvalidArgument,
    RuntimeException,
)

from .bundle import MAX_NOISE, Manifest, Precision, read_manifest, verify_files
from .errors import BadInput, BundleError
from .files import identity
from .messages import SPEED_RANGE
from .phonemes import PieceLimits, pieces_ids, start_espeak
from .sessions import SessionSettings, open_session
from .windows import Window, fixed_windows, growing_windows

log = logging.getLogger(__name__)

_INT16_MAX = 32767.0
FRONT_INPUTS = ("input", "input_lengths", "scales")
"""The front graph's inputs: those of the whole Piper model (see front_feed)."""
BACK_INPUTS = ("latents",)
"""The back graph's input (see back_feed)."""
FRAME_MASK = "frame_mask"
"""1 x 1 x frames: 1 for the frames of a window, 0 for its padding (see back_feed)."""
BACK_FIXED_INPUTS = (*BACK_INPUTS, FRAME_MASK)
"""The inputs of the back graph of the fixed-shape mode, back_fixed (see back_feed)."""


@dataclass(frozen=True)
class SynthesisParams:
    """Per-call overrides; None takes the voice's own default."""

    speed: float = 1.0
    """Speaking rate; 2.0 is twice as fast (length_scale = voice default / speed)."""
    noise_scale: float | None = None
    noise_w: float | None = None

    def __post_init__(self) -> None:
        low, high = SPEED_RANGE
        if not low <= self.speed <= high:
            raise BadInput(f"speed must be between {low} and {high}")
        for name in ("noise_scale", "noise_w"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= MAX_NOISE:
                raise BadInput(f"{name} must be between 0 and {MAX_NOISE:g}")


@dataclass(frozen=True)
class EngineSettings:
    precision: Precision | None = None
    """None takes the bundle's recorded default (chosen by measurement at build time)."""
    fixed_shape: bool = False
    """Run the back graph at one input shape only, as an NPU needs: the bundle's back_fixed graph,
    which masks the padding of a piece shorter than that shape."""
    pieces: PieceLimits = field(default_factory=PieceLimits)
    sessions: SessionSettings = field(default_factory=SessionSettings)
    verify: bool = True
    """Check the sha256 of the files this voice opens (the front, and the back or back_fixed, with
    their weights) against the manifest before using them."""


@dataclass
class Latents:
    """Front output for one piece: the decoder's input frames (1 x 192 x frames), the flow run
    and the frame mask applied."""

    frames: np.ndarray

    @property
    def n_frames(self) -> int:
        return int(self.frames.shape[2])


LOAD_ATTEMPTS = 3
"""Loads of a bundle that was replaced while it loaded, before giving up."""


def _identity_or_none(bundle_dir: Path) -> tuple[int, int] | None:
    try:
        return identity(bundle_dir)
    except OSError:
        return None


class Voice:
    def __init__(self, bundle_dir: Path, manifest: Manifest, settings: EngineSettings) -> None:
        self.bundle_dir = bundle_dir
        self.manifest = manifest
        self.settings = settings
        self.precision: str = settings.precision or manifest.default_precision
        graphs = manifest.graphs.get(self.precision)
        if graphs is None:
            raise BundleError(f"{bundle_dir}: bundle has no {self.precision} graphs")
        started = time.perf_counter()
        start_espeak()  # its process starts while the graphs load
        # Only the back graph this mode runs is opened: memory.
        back_graph, back_inputs = ("back_fixed", BACK_FIXED_INPUTS) if settings.fixed_shape else ("back", BACK_INPUTS)
        graph_files = [graphs["front"], graphs[back_graph]]
        if settings.verify:
            # The graph files (small) are checked before onnxruntime parses them; their weights
            # (tens of MB) are hashed while the sessions are made, which halves the load time on
            # 2 cores. A mismatch still refuses the voice: the sessions are then thrown away.
            verify_files(bundle_dir, manifest, graph_files)
        with ThreadPoolExecutor(3, thread_name_prefix="edged-voice") as pool:
            weights = [manifest.weights_file(g) for g in graph_files] if settings.verify else []
            checked = pool.submit(verify_files, bundle_dir, manifest, weights)
            front, back = (pool.submit(open_session, bundle_dir / name, settings.sessions) for name in graph_files)
            checked.result()
            self._front, front_provider = front.result()
            self._back, back_provider = back.result()
        _expect_graph(self._front, FRONT_INPUTS, bundle_dir / graph_files[0])
        _expect_graph(self._back, back_inputs, bundle_dir / graph_files[1])
        self.providers = {"front": front_provider, "back": back_provider}
        self.load_ms = (time.perf_counter() - started) * 1000
        log.info("voice %s %s (%s) loaded in %.0f ms, providers %s", manifest.voice_id,
                 manifest.version, self.precision, self.load_ms, self.providers)

    @classmethod
    def load(cls, bundle_dir: Path, settings: EngineSettings | None = None) -> Voice:
        """The voice of the bundle in `bundle_dir`, wholly from one bundle: its files are opened by
        name at several moments, and a bundle installed in its place meanwhile (the builder
        exchanges whole directories) would mix the two bundles' files, or fail their checks. A
        load during which the directory was replaced is done again, from the new one."""
        settings = settings or EngineSettings()
        for _ in range(LOAD_ATTEMPTS):
            before = _identity_or_none(bundle_dir)
            try:
                voice = cls(bundle_dir, read_manifest(bundle_dir), settings)
            except BundleError:
                if _identity_or_none(bundle_dir) == before:
                    raise
                continue
            if _identity_or_none(bundle_dir) == before:
                return voice
            log.info("bundle %s was replaced while it loaded: loading it again", bundle_dir)
        raise BundleError(f"{bundle_dir}: replaced {LOAD_ATTEMPTS} times while it loaded")

    @property
    def voice_id(self) -> str:
        return self.manifest.voice_id

    @property
    def sample_rate(self) -> int:
        return self.manifest.sample_rate

    # -- the data path, top to bottom --------------------------------------------------------

    def pieces(self, text: str) -> Iterator[list[int]]:
        """Phoneme ids of each piece to run through the front graph, produced lazily."""
        manifest = self.manifest
        return pieces_ids(text, manifest.espeak_voice, manifest.phoneme_id_map, self.settings.pieces)

    def front(self, ids: list[int], params: SynthesisParams, run_options: RunOptions | None = None) -> Latents:
        defaults = self.manifest.inference
        scales = np.array(
            [
                _default(params.noise_scale, defaults["noise_scale"]),
                defaults["length_scale"] / params.speed,
                _default(params.noise_w, defaults["noise_w"]),
            ],
            dtype=np.float32,
        )
        (frames,) = self._run(self._front, "front", front_feed(ids, scales), run_options)
        if frames.ndim != 3 or frames.shape[0] != 1 or frames.dtype != np.float32:
            raise BundleError(f"{self.bundle_dir}: the {self.precision} front graph gave {frames.dtype} frames of "
                              f"shape {frames.shape}, not float32 (1, channels, frames)")
        return Latents(frames)

    def windows(self, latents: Latents, produced: int = 0, throughput: bool = False) -> list[Window]:
        """The back-graph windows of one piece, `produced` frames into the text.

        `throughput` plans the largest windows from the start, for when first audio matters less
        than throughput (requests queue behind this one, or it is a background synthesis): the
        small first window pays for its context again, which makes a 1 s prompt cost ~18% more in
        all (tools.bench's short text, 54-56 against 46-47 ms in process). The fixed-shape mode
        keeps its one shape anyway.
        """
        streaming = self.manifest.streaming
        if self.settings.fixed_shape:
            return fixed_windows(latents.n_frames, streaming.fixed_window, streaming.context)
        first = streaming.max_window if throughput else streaming.first_window
        return growing_windows(latents.n_frames, first, streaming.max_window, streaming.context,
                               produced=produced)

    def decode_float(self, latents: Latents, window: Window, run_options: RunOptions | None = None) -> np.ndarray:
        """Audio samples for the frames the window keeps (about [-1, 1]; to_pcm16 clips)."""
        feed = back_feed(latents.frames, window, masked=self.settings.fixed_shape)
        audio = self._run(self._back, "back", feed, run_options)[0].reshape(-1)
        hop, start = self.manifest.hop_length, window.in_start
        if audio.size != feed["latents"].shape[2] * hop:  # else the trim below cuts the wrong samples
            raise BundleError(f"{self.bundle_dir}: the {self.precision} back graph gave {audio.size} samples for "
                              f"{feed['latents'].shape[2]} frames: the manifest's hop_length {hop} is not the graph's")
        if not np.isfinite(audio).all():  # cheap (~0.1 ms a window); else NaN would play as noise
            raise BundleError(f"{self.bundle_dir}: the {self.precision} back graph gave NaN or infinite "
                              "samples: its weights are damaged")
        return audio[(window.keep_start - start) * hop : (window.keep_end - start) * hop]

    def _run(self, session: InferenceSession, graph: str, feed: dict[str, np.ndarray],
             run_options: RunOptions | None) -> list[np.ndarray]:
        try:
            return session.run(None, feed, run_options)
        except (Fail, InvalidArgument, RuntimeException) as exc:
            if run_options is not None and run_options.terminate:
                raise  # stopped on purpose (edged.preemption), not the graph's fault
            # A damaged graph, or a manifest whose ids the graph has no row for.
            raise BundleError(f"{self.bundle_dir}: the {self.precision} {graph} graph failed: "
                              f"{str(exc).splitlines()[0][:300]}") from exc

    def decode(self, latents: Latents, window: Window, run_options: RunOptions | None = None) -> bytes:
        """16-bit little-endian mono PCM for the frames the window keeps."""
        return to_pcm16(self.decode_float(latents, window, run_options))

    def synthesize(self, text: str, params: SynthesisParams | None = None,
                   throughput: bool = False) -> Iterator[bytes]:
        """PCM chunks as they are decoded; `throughput` when nobody listens to the first chunk
        early (a file written whole), see `windows`."""
        params = params or SynthesisParams()
        produced = 0
        for ids in self.pieces(text):
            latents = self.front(ids, params)
            for window in self.windows(latents, produced, throughput):
                yield self.decode(latents, window)
            produced += latents.n_frames


def front_feed(ids: list[int], scales: np.ndarray) -> dict[str, np.ndarray]:
    """Inputs of the front graph, which are those of the whole Piper model: one utterance's
    phoneme ids and its [noise_scale, length_scale, noise_w]."""
    return {"input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64), "scales": scales}


def back_feed(frames: np.ndarray, window: Window, masked: bool = False) -> dict[str, np.ndarray]:
    """Inputs of the back graph for one window of a piece's frames: the window's input frames,
    zero-padded to a fixed shape; `masked` (the back_fixed graph) adds the frame mask, 0 on the
    padding, with which the graph zeroes every layer's input there as the unsplit decoder's own
    padding does (zero frames alone are not: conv_pre's bias makes them nonzero)."""
    frames = frames[:, :, window.in_start : window.in_end]
    if window.pad:
        frames = np.pad(frames, ((0, 0), (0, 0), (0, window.pad)))
    if not masked:
        return {"latents": frames}
    mask = np.ones((1, 1, window.in_frames), dtype=np.float32)
    mask[:, :, window.in_frames - window.pad :] = 0.0
    return {"latents": frames, FRAME_MASK: mask}


def to_pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1.0, 1.0) * _INT16_MAX).astype("<i2").tobytes()


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


def _expect_graph(session: InferenceSession, inputs: tuple[str, ...], path: Path) -> None:
    """Refuse at load a graph that is not the one expected (a front where the back should be)."""
    found = tuple(i.name for i in session.get_inputs())
    if sorted(found) != sorted(inputs):
        raise BundleError(f"{path}: graph inputs {found} are not the expected {inputs}")
    if len(session.get_outputs()) != 1:
        raise BundleError(f"{path}: graph has {len(session.get_outputs())} outputs, not one")
