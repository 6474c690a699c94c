"""tools.bench in its quick mode (real voices, real worker processes) and tools.procmem."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools.procmem import read_memory

REPO = Path(__file__).resolve().parent.parent


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.bench", *args], cwd=REPO, check=False,
                          capture_output=True, text=True, timeout=180)


def test_quick_bench_reports_both_engines_and_draws_the_plot(tmp_path: Path, bundle_dir: Path) -> None:
    png = tmp_path / "ttfa.png"
    result = _bench("--quick", "--bundle", str(bundle_dir), "--plot", str(png))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for engine in ("edged", "piper"):
        figures = report[engine]
        for label in ("short", "medium", "long"):
            assert figures["ttfa_ms"][label] > 0
            assert figures["total_ms"][label] >= figures["ttfa_ms"][label]
        audio = figures["audio_s"]
        assert 0.5 < audio["short"] < audio["medium"] < audio["long"] < 30, audio
        assert figures["rtf"] > 0 and figures["load_ms"] > 0
        assert figures["rss_mb"] > figures["anon_mb"] > 0
        stages = figures["memory_mb"]
        assert stages["loaded"]["rss"] > stages["imported"]["rss"]  # the voice itself takes room
        assert [p["audio_s"] for p in figures["sweep"]] == sorted(p["audio_s"] for p in figures["sweep"])
    # Piper waits for the whole sentence; its first audio must come later for the long text.
    assert report["piper"]["ttfa_ms"]["long"] > report["piper"]["ttfa_ms"]["short"]
    compare = report["compare"]
    assert compare["ttfa_growth_ms"]["piper"] == report["piper"]["ttfa_ms"]["long_minus_short"]
    # Time over the same texts and runs, not each engine's time over its own audio.
    assert compare["rtf_ratio"] == pytest.approx(report["edged"]["synthesis_ms"] / report["piper"]["synthesis_ms"],
                                                 rel=0.01)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # One cold run of each text: Piper's first long run is slow, and the ratio looked met (0.57).
    assert report["meta"]["quick"] and compare["meets"] is None


def test_bench_refuses_a_bundle_of_another_voice_than_pipers(tmp_path: Path, bundle_dir: Path) -> None:
    other = tmp_path / bundle_dir.name
    shutil.copytree(bundle_dir, other)
    manifest = json.loads((other / "manifest.json").read_text(encoding="utf-8"))
    manifest["build"]["model_sha256"] = "0" * 64  # built from another Piper model
    (other / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    result = _bench("--quick", "--bundle", str(other))
    assert result.returncode == 1 and "not built from the voice Piper runs" in result.stderr, result.stderr


def test_bench_stops_with_a_clear_error_when_the_voice_is_missing(tmp_path: Path) -> None:
    result = _bench("--quick", "--bundle", str(tmp_path / "no-such-voice"))
    assert result.returncode == 1
    assert "unknown voice" in result.stderr and result.stdout == ""


def test_read_memory_sees_anonymous_memory_grow() -> None:
    before = read_memory()
    block = np.ones(64 * 1024 * 1024 // 8)  # 64 MiB, every page touched
    after = read_memory()
    assert after.anon - before.anon > 60
    # anon counts shared pages in part (Pss_Anon): below rss's share once a child shares pages
    # with its forks (the espeak-ng child, when a test before this one started it).
    assert after.anon + after.file + after.shmem <= after.rss + 0.1
    assert after.peak >= after.rss
    del block


def test_read_memory_counts_the_processes_it_started() -> None:
    before = read_memory()
    code = "import numpy, sys; block = numpy.ones(64 * 1024 * 1024 // 8); print(flush=True); sys.stdin.read()"
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline()  # its 64 MiB are touched
            assert read_memory().anon - before.anon > 60
        finally:
            child.kill()


def test_read_memory_counts_pages_a_fork_shares_once() -> None:
    # edged's espeak-ng child keeps a fork of itself ready: their shared pages were counted twice.
    code = ("import numpy, os, sys; block = numpy.ones(64 * 1024 * 1024 // 8)\n"
            "if os.fork() == 0: sys.stdin.read(); os._exit(0)\n"
            "print(flush=True); sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as parent:
        try:
            assert parent.stdout is not None and parent.stdout.readline()
            assert 60 < read_memory(parent.pid).anon < 100
        finally:
            parent.kill()


def test_read_memory_of_a_finished_process_raises() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    with pytest.raises(ProcessLookupError):
        read_memory(process.pid)
