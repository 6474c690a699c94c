"""onnxruntime sessions: options for a 2-core box, and execution providers with CPU fallback."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from .errors import BundleError

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"


@dataclass(frozen=True)
class SessionSettings:
    threads: int = 2
    """Intra-op threads per session; the box has 2 cores."""
    providers: tuple[str, ...] = (CPU,)
    """Execution providers to try, in order; CPU is always the last resort."""
    optimize_at_load: bool = False
    """Graphs are optimized when the bundle is built; re-optimizing at load copies weights to the heap."""
    spin: bool = False
    """Let idle onnxruntime threads spin for more work. Off: a voice has two sessions, each with its
    own pool, and on 2 cores the idle pool's spinning took CPU from the busy one (measured: short
    sentence first audio 52-75 ms with spinning, 31-41 ms without; long-text RTF 0.049-0.066 vs 0.046).
    Letting only the back's pool spin was ~10% faster for one stream, but under overload (2
    syntheses at once) it completed ~15% fewer of them (tools.daemon_bench --only overload)."""
    prepack: bool = True
    """Let onnxruntime repack conv and matmul weights for its kernels: a heap copy of weights that
    otherwise stay in the mapped file. Measured with the int8 default (tools.bench, two runs each,
    alternating): first audio 24 against 30-35 ms (short) and 28 against 39-42 ms (22 s sentence),
    RTF ratio to Piper 0.85-0.87 against 0.89-0.91; for +9 MB anonymous memory after load (61
    against 52 MB; Piper 107; fp32 graphs +3 MB) and 8-17 ms more load time. Both graphs gain: the
    front's repacking is most of the first-audio gain, the back's most of the RTF gain."""


def session_options(settings: SessionSettings) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = settings.threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # onnxruntime's memory arena stays on, though it keeps the largest run's tensors for good
    # (~200 MB anonymous after the 22 s sentence): without it, 165 against 202 MB, but the 22 s
    # sentence took 1.50 against 1.31 s; with malloc_trim after each synthesis too, 61 MB and
    # 1.58-1.71 s, first audio +5-15 ms (int8, in process, two processes of each, alternating).
    if not settings.optimize_at_load:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if not settings.spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not settings.prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    # Fatal only: its errors come back as exceptions, which edged reports (with the priority
    # journald files them at); printed by onnxruntime too, they reached the journal unformatted.
    options.log_severity_level = 4
    return options


def open_session(path: Path, settings: SessionSettings) -> tuple[ort.InferenceSession, str]:
    """The first provider that onnxruntime offers and that can create the session, and its name."""
    offered = set(ort.get_available_providers())
    wanted = [p for p in settings.providers if p in offered and p != CPU] + [CPU]
    for provider in wanted:
        try:
            session = ort.InferenceSession(str(path), session_options(settings), providers=[provider])
        except Exception as exc:  # a provider that fails to create falls back to the next one
            if provider == CPU:  # the graph itself is bad (its checksums matched: built so)
                raise BundleError(f"{path}: onnxruntime cannot load it: {str(exc).splitlines()[0]}") from exc
            log.warning("provider %s failed for %s, falling back: %s", provider, path.name, exc)
            continue
        return session, provider
    raise AssertionError("unreachable: CPU is always tried")
