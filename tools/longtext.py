"""Memory while a very long text streams: python -m tools.longtext [--chars 100000] [--seconds 600]

Runs `edged synth --raw -` on a long text in a child process, drains its stdout, and samples the
child's resident memory as audio comes out. Flat memory means the text is phonemized and
synthesized piece by piece, not held whole. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

from edged.bundle import read_manifest
from edged.voices import DEFAULT_VOICE, find_bundle

from .procmem import read_memory

PARAGRAPH = (
    "Edge boxes speak many kinds of text, from short prompts to long documents. "
    "This paragraph repeats, with a number like 42 and a question: is it still speaking? "
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.longtext", description=__doc__)
    parser.add_argument("--chars", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=600.0,
                        help="stop after this long (the default text takes ~3-4 minutes here)")
    parser.add_argument("--voice", default=None, help="voice id or bundle directory")
    args = parser.parse_args(argv)

    text = (PARAGRAPH * (args.chars // len(PARAGRAPH) + 1))[: args.chars]
    bytes_per_s = 2 * read_manifest(find_bundle(args.voice or DEFAULT_VOICE)).sample_rate  # 16-bit mono
    command = [sys.executable, "-m", "edged", "synth", "-", "--raw"]
    if args.voice:
        command += ["--voice", args.voice]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin and child.stdout
    threading.Thread(target=_feed, args=(child.stdin, text.encode()), daemon=True).start()

    audio_bytes, samples, finished = 0, [], False
    started = time.monotonic()
    next_sample = started
    try:
        while time.monotonic() - started < args.seconds:
            chunk = child.stdout.read1(1 << 16)  # type: ignore[attr-defined]
            if not chunk:
                finished = child.wait() == 0
                break
            audio_bytes += len(chunk)
            if time.monotonic() >= next_sample:
                memory = read_memory(child.pid)
                samples.append({"t_s": round(time.monotonic() - started, 1),
                                "audio_s": round(audio_bytes / bytes_per_s, 1),
                                "rss_mb": round(memory.rss, 1), "anon_mb": round(memory.anon, 1)})
                next_sample += 1.0
    finally:
        child.kill()
        child.wait()
    after_first = samples[2:] or samples
    report = {
        "chars": args.chars,
        "audio_seconds": round(audio_bytes / bytes_per_s, 1),
        "finished": finished,  # the whole text spoken within --seconds (else sampling stopped there)
        "anon_mb_first": after_first[0]["anon_mb"] if after_first else None,
        "anon_mb_max": max(s["anon_mb"] for s in after_first) if after_first else None,
        "anon_mb_last": after_first[-1]["anon_mb"] if after_first else None,
        "anon_mb_growth": round(after_first[-1]["anon_mb"] - after_first[0]["anon_mb"], 1) if after_first else None,
        "samples": samples,
    }
    print(json.dumps(report, indent=2))
    return 0 if finished else 1  # a run cut short proves nothing about the whole text


def _feed(stdin, data: bytes) -> None:  # type: ignore[no-untyped-def]
    try:
        stdin.write(data)
        stdin.close()
    except BrokenPipeError:
        pass


if __name__ == "__main__":
    sys.exit(main())
