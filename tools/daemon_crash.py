"""kill -9 of the daemon during write-heavy bursts, N rounds: every hit it serves is audio it made.

    python -m tools.daemon_crash [--rounds 100] [--dir DIR] [--seed 0]

Each round starts the real daemon (tools.daemon_bench's process) on the same cache directory,
waits until it answers READY, fires a burst of short phrases from a few concurrent clients (mostly
new ones, so misses get stored, plus repeats of earlier ones, which a restarted daemon serves from
disk), and SIGKILLs it at a random moment of the burst.

Synthesis has noise, so a phrase's audio is whatever the daemon produced for it: the reference
checksum of a phrase is the sha256 of its latest complete miss (that audio is what gets stored).
A hit must be byte-identical to that reference; a hit matching no complete answer ever recorded
for its phrase is a wrong answer. A miss cut by the kill leaves the stored audio unknown: the next
hit becomes the reference (counted as `adopted`). A hit equal to an older miss of its phrase (a
later miss's disk write was skipped) is counted as `older`, not wrong. Prints JSON; exits 1 on any
wrong answer or failed start.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edged.client import DaemonUnreachable, UnixConnection

from .daemon_bench import DaemonProcess
from .stats import middle_and_max

WORDS = ["red", "blue", "green", "small", "quick", "quiet", "north", "south", "warm", "cold", "lamp",
         "door", "cup", "bird", "tree", "boat", "road", "stone", "rain", "bell"]
CLIENTS = 3
UNKNOWN = "unknown"


def phrase(i: int) -> str:
    """Short and distinct: a fraction of a second of audio each, so syntheses are quick."""
    return f"{WORDS[i % 20]} {WORDS[(i // 20) % 20]} {i}."


@dataclass
class Ledger:
    """What the client saw, across rounds: per phrase, the checksums of its complete answers."""

    latest: dict[str, str] = field(default_factory=dict)
    """Phrase -> checksum of the audio the cache should hold, or UNKNOWN."""
    seen: dict[str, set[str]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("answers", "hits", "misses", "hits_checked", "wrong", "older", "adopted", "cut", "refused", "busy", "other"), 0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, text: str, cache: str | None, audio: bytes | None) -> None:
        """One answer: `cache` is None when no headers came, `audio` None when the body was cut."""
        with self.lock:
            if audio is None:
                self.counts["cut"] += 1
                if cache != "hit":  # a cut miss may still have been stored: its audio is unknown
                    self.latest[text] = UNKNOWN
                return
            self.counts["answers"] += 1
            if not audio or len(audio) % 2:  # 16-bit PCM: whole samples, never empty
                self.counts["wrong"] += 1
                return
            digest = hashlib.sha256(audio).hexdigest()
            if cache == "hit":
                self.counts["hits"] += 1
                self._check_hit(text, digest)
            else:
                self.counts["misses"] += 1
                self.latest[text] = digest
            self.seen.setdefault(text, set()).add(digest)

    def _check_hit(self, text: str, digest: str) -> None:
        expected = self.latest.get(text, UNKNOWN)
        if expected == UNKNOWN:
            self.counts["adopted"] += 1
            self.latest[text] = digest
            return
        self.counts["hits_checked"] += 1
        if digest == expected:
            return
        if digest in self.seen.get(text, set()):
            self.counts["older"] += 1
        else:
            self.counts["wrong"] += 1


def ask(socket_path: Path, text: str, ledger: Ledger) -> None:
    connection = UnixConnection(socket_path, timeout=30)
    cache = None
    try:
        connection.connect()
    except DaemonUnreachable:  # killed before this request: it reached nobody
        with ledger.lock:
            ledger.counts["refused"] += 1
        return
    try:
        connection.request("POST", "/v1/synthesize", body=json.dumps({"text": text, "format": "pcm"}),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            response.read()
            with ledger.lock:
                ledger.counts["busy" if response.status == 503 else "other"] += 1
            return
        cache = response.getheader("X-Edged-Cache")
        audio = response.read()
    except (OSError, http.client.HTTPException):  # the kill: reset, refused, incomplete body
        audio = None
    finally:
        connection.close()
    ledger.record(text, cache, audio)


def burst(socket_path: Path, texts: list[str], ledger: Ledger, stop: threading.Event) -> None:
    """`texts` spread over CLIENTS threads, each asking one after another until the kill."""
    def client(part: list[str]) -> None:
        for text in part:
            if stop.is_set():
                return
            ask(socket_path, text, ledger)

    threads = [threading.Thread(target=client, args=(texts[k::CLIENTS],), daemon=True) for k in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


def crash_rounds(rounds: int, directory: Path, seed: int = 0, new_per_round: int = 12,
                 repeats_per_round: int = 12, max_delay: float = 2.0) -> dict[str, Any]:
    rng = random.Random(seed)
    ledger = Ledger()
    failed_starts = 0
    ready_ms: list[float] = []
    next_phrase = 0
    started = time.perf_counter()
    for _ in range(rounds):
        daemon = DaemonProcess(directory)
        try:
            ready_ms.append(daemon.wait_ready(timeout_s=60)["ready_ms"])
        except RuntimeError:
            failed_starts += 1
            daemon.kill()
            continue
        known = list(ledger.latest)
        texts = [phrase(next_phrase + k) for k in range(new_per_round)]
        next_phrase += new_per_round
        texts += rng.sample(known, min(repeats_per_round, len(known)))
        texts += rng.sample(texts, len(texts) // 4)  # repeats within the round: memory hits, joins
        rng.shuffle(texts)
        stop = threading.Event()
        runner = threading.Thread(target=burst, args=(daemon.socket, texts, ledger, stop), daemon=True)
        runner.start()
        runner.join(rng.uniform(0.05, max_delay))
        stop.set()  # no new requests: those under way are cut by the kill
        daemon.kill()
        runner.join(60)
    ready_p50, ready_max = middle_and_max(ready_ms)
    return {"rounds": rounds, "failed_starts": failed_starts, **ledger.counts,
            "phrases": len(ledger.latest),
            "ready_ms_p50": ready_p50, "ready_ms_max": ready_max,
            "wall_s": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.daemon_crash", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=None, help="parent of the scratch directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="edged-daemon-crash-", dir=args.dir) as scratch:
        result = crash_rounds(args.rounds, Path(scratch), seed=args.seed)
    print(json.dumps(result, indent=2))
    return 1 if result["wrong"] or result["failed_starts"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
