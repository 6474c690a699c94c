"""How the int8 graphs compare with fp32 on this CPU, and which precision a bundle defaults to.

tools.build_voice records `report()` in the manifest; tools.quantize_sweep uses `measure()`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from edged.engine import back_feed, front_feed
from edged.phonemes import PieceLimits, pieces_ids
from edged.sessions import SessionSettings, open_session
from edged.windows import Window

from .quantize import CHOSEN, SWEEP_FILE, VoiceFacts, lsd, snr_db
from .stats import median

# Quality is measured on sentences that are not in the calibration text.
EVAL_TEXTS = (
    "The library closes at nine o'clock tonight, but the reading room stays open until ten.",
    "Have you seen my keys anywhere?",
    "In 2019, the team shipped 312 devices to customers in 14 countries.",
    "Breathe in slowly, hold it, and breathe out.",
)
SPEED_TEXT = "When it turns cold, the heating comes on by itself at six in the morning."
"""161 phoneme ids in one piece: a front run on a typical long piece."""
SPEED_FRAMES = 96
"""One back run over 96 frames, all decoded: per frame, close to the large windows that make most
of a long text (256 frames, of which the decoder's context is a small part)."""


class _Sessions:
    """fp32 and int8 sessions of the two graphs, opened as the daemon opens them."""

    def __init__(self, paths: dict[str, dict[str, Path]], threads: int = 2) -> None:
        settings = SessionSettings(threads=threads)
        self.by = {prec: {g: open_session(p, settings)[0] for g, p in graphs.items()}
                   for prec, graphs in paths.items()}

    def speak(self, front: str, back: str, feed: dict, back_graph: str = "back") -> np.ndarray:
        """Whole-sentence audio through the front of one precision and the back (or back_fixed)
        of another."""
        (latents,) = self.by[front]["front"].run(None, feed)
        whole = Window(0, latents.shape[2], 0, latents.shape[2])
        masked = back_graph == "back_fixed"
        return self.by[back][back_graph].run(None, back_feed(latents, whole, masked))[0].reshape(-1)


def measure(paths: dict[str, dict[str, Path]], facts: VoiceFacts, runs: int = 15) -> dict[str, Any]:
    """Speed (median ms of interleaved runs) and quality (int8 audio against fp32) of both precisions.

    paths["fp32"|"int8"]["front"|"back"] are optimized graph files (and, where given,
    ["back_fixed"], whose quality is measured as the back's).
    """
    sessions = _Sessions(paths)
    ids = next(pieces_ids(SPEED_TEXT, facts.espeak_voice, facts.phoneme_id_map, PieceLimits(0, 0)))
    feeds = {"front": front_feed(ids, facts.scales())}
    (latents,) = sessions.by["fp32"]["front"].run(None, feeds["front"])
    feeds["back"] = back_feed(latents, Window(0, SPEED_FRAMES, 0, SPEED_FRAMES))
    times: dict[str, list[float]] = {f"{g}.{p}": [] for g in feeds for p in paths}
    for i in range(runs + 2):  # interleaved, so that load from elsewhere hits both alike
        for key, taken in times.items():
            graph, prec = key.split(".")
            started = time.perf_counter()
            sessions.by[prec][graph].run(None, feeds[graph])
            if i >= 2:  # the first runs warm up
                taken.append((time.perf_counter() - started) * 1000)
    ms = {key: median(values, digits=2) for key, values in times.items()}
    frames = latents.shape[2]
    for prec in paths:  # one piece of speech: its front run and the back over all of its frames
        ms[f"piece.{prec}"] = round(ms[f"front.{prec}"] + ms[f"back.{prec}"] * frames / SPEED_FRAMES, 2)
    return {"speed_ms": ms, "speed_input": {"front_ids": len(ids), "back_frames": SPEED_FRAMES,
                                             "piece_frames": frames, "threads": 2, "runs": runs},
            "quality": _quality(sessions, facts)}


def _quality(sessions: _Sessions, facts: VoiceFacts) -> dict[str, float]:
    """int8 against fp32 without noise (each graph alone, then the whole voice), and two yardsticks:
    fp32 audio stored as 8-bit PCM, and two fp32 renditions with the voice's default noise."""
    figures: dict[str, list[float]] = {k: [] for k in (
        "back_lsd_db", "back_snr_db", "front_lsd_db", "voice_lsd_db", "pcm8_lsd_db",
        "fp32_renditions_lsd_db")}
    fixed = all("back_fixed" in graphs for graphs in sessions.by.values())
    if fixed:
        figures["back_fixed_lsd_db"] = []
    for text in EVAL_TEXTS:
        for ids in facts.ids(text):
            feed = front_feed(ids, facts.scales(noise=False))
            reference = sessions.speak("fp32", "fp32", feed)
            back_only = sessions.speak("fp32", "int8", feed)
            figures["back_lsd_db"].append(lsd(reference, back_only))
            figures["back_snr_db"].append(snr_db(reference, back_only))
            if fixed:  # the fixed-shape mode's graphs, quantized alike, held to the same rule
                figures["back_fixed_lsd_db"].append(lsd(sessions.speak("fp32", "fp32", feed, "back_fixed"),
                                                        sessions.speak("fp32", "int8", feed, "back_fixed")))
            # The int8 front predicts slightly different durations: align before comparing.
            figures["front_lsd_db"].append(lsd(reference, sessions.speak("int8", "fp32", feed), True))
            figures["voice_lsd_db"].append(lsd(reference, sessions.speak("int8", "int8", feed), True))
            figures["pcm8_lsd_db"].append(lsd(reference, np.round(reference * 127) / 127))
            noisy = front_feed(ids, facts.scales())
            figures["fp32_renditions_lsd_db"].append(
                lsd(sessions.speak("fp32", "fp32", noisy), sessions.speak("fp32", "fp32", noisy), True))
    return {key: round(statistics.mean(values), 3) for key, values in figures.items()}


# -- the decision ----------------------------------------------------------------------------

MIN_SPEEDUP = 1.1
"""int8 must be at least this much faster: timings on a shared box wander by several percent."""
RULE = ("int8 only if (1) a piece (front + back over its frames) runs >= 1.1x faster than fp32, "
        "(2) the int8 back (and back_fixed) adds no more than fp32 audio stored as 8-bit PCM loses "
        "(back_lsd_db, back_fixed_lsd_db <= pcm8_lsd_db), and (3) the int8 front changes the speech less than two fp32 "
        "renditions with the voice's own noise differ (front_lsd_db <= fp32_renditions_lsd_db)")


def report(paths: dict[str, dict[str, Path]], facts: VoiceFacts) -> dict[str, Any]:
    """The manifest's report on int8: what was built, its figures, and the default precision.

    The back's error is noise on the same speech, so it is held to a noise yardstick; the front's
    is another rendition (durations, formants), so it is held to the voice's own variation.
    """
    figures = measure(paths, facts)
    ms, quality = figures["speed_ms"], figures["quality"]
    speedup = round(ms["piece.fp32"] / ms["piece.int8"], 2)
    faster = speedup >= MIN_SPEEDUP
    holds = (max(quality["back_lsd_db"], quality.get("back_fixed_lsd_db", 0.0)) <= quality["pcm8_lsd_db"]
             and quality["front_lsd_db"] <= quality["fp32_renditions_lsd_db"])
    return {"int8": {
        "variants": {graph: variant.label for graph, variant in CHOSEN.items()},
        **figures,
        "speedup": speedup,
        "faster": faster,
        "quality_holds": holds,
        "default_precision": "int8" if faster and holds else "fp32",
        "rule": RULE,
        "sweep": _sweep_table(),
    }}


def _sweep_table() -> list[str]:
    """The variants tried by `--sweep` (tools/quantize_sweep.json), one line each."""
    if not SWEEP_FILE.exists():
        return []
    rows = json.loads(SWEEP_FILE.read_text(encoding="utf-8"))
    return [f"{r['graph']}: {r['variant']}: x{r['speedup']}, "
            + ", ".join(f"{k} {v}" for k, v in r.items() if k.endswith("_db")) for r in rows]


