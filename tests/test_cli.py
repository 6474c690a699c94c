"""`edged synth` as a user runs it: a real process, a real WAV file, PCM on stdout."""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

import numpy as np


def _edged(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edged", *args], input=stdin, capture_output=True,
                          timeout=120)


def test_synth_writes_a_wav_file(tmp_path: Path, bundle_dir: Path) -> None:
    out = tmp_path / "out.wav"
    result = _edged("synth", "Hello from edged.", "--voice", str(bundle_dir), "-o", str(out))
    assert result.returncode == 0, result.stderr
    with wave.open(str(out)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 22050)
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    assert 0.5 < len(samples) / 22050 < 3.0
    assert np.abs(samples).max() > 3000  # speech, not silence


def test_synth_raw_reads_stdin_and_streams_pcm(bundle_dir: Path) -> None:
    result = _edged("synth", "-", "--raw", "--voice", str(bundle_dir), stdin="Good morning.".encode())
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) % 2 == 0 and len(result.stdout) > 22050


def test_synth_rejects_bad_utf8_on_stdin(bundle_dir: Path) -> None:
    result = _edged("synth", "-", "--raw", "--voice", str(bundle_dir), stdin=b"caf\xe9 \xff")
    assert result.returncode == 2
    assert b"not valid UTF-8" in result.stderr and result.stdout == b""


def test_synth_names_an_unknown_voice(tmp_path: Path) -> None:
    result = _edged("synth", "Hi.", "--voice", "no-such-voice", "-o", str(tmp_path / "x.wav"))
    assert result.returncode == 2
    assert b"unknown voice 'no-such-voice'" in result.stderr


def test_synth_refuses_empty_text(tmp_path: Path, bundle_dir: Path) -> None:
    result = _edged("synth", "  ", "--voice", str(bundle_dir), "-o", str(tmp_path / "x.wav"))
    assert result.returncode == 2 and b"text is empty" in result.stderr
    assert list(tmp_path.iterdir()) == []
