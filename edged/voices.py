"""Finding a voice bundle by id or directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .bundle import MANIFEST_NAME, NAME_MAX
from .errors import UnknownVoice

DEFAULT_VOICE = "en_US-joe-medium"

VOICE_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{NAME_MAX - 1}}}")
"""Ids only, never paths: a client must not make the daemon load a directory of its choosing.
No longer than a manifest's voice id may be."""


def voice_dirs() -> list[Path]:
    """Where bundles are looked up by id: $EDGED_VOICES (colon-separated), then the usual places."""
    dirs = [Path(p) for p in os.environ.get("EDGED_VOICES", "").split(":") if p]
    repo_models = Path(__file__).resolve().parent.parent / "models"
    dirs += [repo_models, Path("/var/lib/edged/voices"), Path("/usr/share/edged/voices")]
    return dirs


def find_bundle(voice: str, search: list[Path] | None = None) -> Path:
    """A bundle directory from a voice id (looked up in `search`) or a path to the bundle itself."""
    as_path = Path(voice)
    if voice and _exists(as_path / MANIFEST_NAME):
        return as_path
    if "/" not in voice and voice not in ("", ".", ".."):
        found = bundles_by_id(voice, search if search is not None else voice_dirs())
        if found:
            return found[0]
    raise UnknownVoice(f"unknown voice {voice!r}: no bundle with that id or directory")


def bundles_by_id(voice_id: str, search: list[Path]) -> list[Path]:
    """Every bundle named `voice_id` in the `search` directories, in their order: the first is the
    one used (the caller checks the id)."""
    return [root / voice_id for root in search if _exists(root / voice_id / MANIFEST_NAME)]


def _exists(path: Path) -> bool:
    """Path.exists, also False for a name too long for the file system (ENAMETOOLONG). Not is_file:
    a manifest that is a FIFO or a directory is a bundle to refuse with that reason, not "no bundle"."""
    try:
        return path.exists()
    except OSError:
        return False
