"""Shared fixtures: the real default voice bundle, built by tools.build_voice (bootstrap does it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / "models" / "en_US-joe-medium"


@pytest.fixture(scope="session")
def bundle_dir() -> Path:
    if not (BUNDLE / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "tools.build_voice", "--if-stale"], cwd=REPO, check=True)
    return BUNDLE


@pytest.fixture(scope="session")
def voice(bundle_dir: Path):
    from edged.engine import EngineSettings, Voice

    return Voice.load(bundle_dir, EngineSettings(precision="fp32"))


@pytest.fixture(scope="session")
def piper_voice():
    from phoneme_helpers import phonemizing_piper

    return phonemizing_piper()


DAEMON_CONFIG = """
[server]
header_timeout_s = 1.0
body_timeout_s = 1.0

[pipeline.output]
timeout_s = 1.5
"""
"""Short client timeouts, so that the tests of misbehaving clients finish quickly."""


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory, bundle_dir: Path):
    """The real daemon (`python -m edged serve`) on a temporary socket, shared by the tests that
    do not stop or overload it."""
    from daemon_harness import Daemon

    with Daemon(tmp_path_factory.mktemp("daemon"), DAEMON_CONFIG) as running:
        yield running
