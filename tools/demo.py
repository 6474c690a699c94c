"""The main job, end to end: start the daemon on a socket, speak a sentence into hello.wav over
that socket with edgectl, play it where the box has a sound card, and stop the daemon.

    python -m tools.demo ["Text to speak."] [-o hello.wav]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

SENTENCE = "Hello! This is edged, speaking from your edge box."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__)
    parser.add_argument("text", nargs="?", default=SENTENCE)
    parser.add_argument("-o", "--output", type=Path, default=Path("hello.wav"))
    args = parser.parse_args(argv)
    bin_dir = Path(sys.executable).parent
    run_dir = Path(tempfile.mkdtemp(prefix="edged-demo-"))
    env = {**os.environ, "EDGED_SOCKET": str(run_dir / "edged.sock")}
    daemon = subprocess.Popen([str(bin_dir / "edged"), "serve"], env=env)
    try:
        if not _wait_ready(bin_dir, env, daemon):
            print("demo: the daemon did not become ready", file=sys.stderr)
            return 1
        subprocess.run([str(bin_dir / "edgectl"), "synth", args.text, "-o", str(args.output)],
                       env=env, check=True)
        with wave.open(str(args.output)) as wav:
            seconds = wav.getnframes() / wav.getframerate()
        print(f"demo: wrote {args.output} ({seconds:.1f} s of speech)")
        _play(args.output)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _wait_ready(bin_dir: Path, env: dict[str, str], daemon: subprocess.Popen) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and daemon.poll() is None:
        status = subprocess.run([str(bin_dir / "edgectl"), "status"], env=env, capture_output=True, check=False)
        if status.returncode == 0 and b"READY" in status.stdout:
            return True
        time.sleep(0.1)
    return False


def _play(path: Path) -> None:
    """Play on the default output device, if this machine has one."""
    try:
        import numpy as np
        import sounddevice

        sounddevice.query_devices(kind="output")
    except Exception as exc:  # noqa: BLE001 (no PortAudio, no device: nothing to play on)
        print(f"demo: no sound card to play on ({exc})")
        return
    with wave.open(str(path)) as wav:
        audio = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
        rate = wav.getframerate()
    sounddevice.play(audio, rate, blocking=True)
    print("demo: played on the speakers")


if __name__ == "__main__":
    sys.exit(main())
