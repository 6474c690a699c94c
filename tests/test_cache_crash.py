"""kill -9 while the cache is being written: it always opens again and never serves wrong audio.

Ten rounds here; EDGED_SLOW_TESTS=1 runs the hundred of the issue (also `python -m tools.cache_crash`).
"""

from __future__ import annotations

import os
from pathlib import Path

from tools.cache_crash import crash_rounds


def test_sigkill_during_writes_never_serves_wrong_audio(tmp_path: Path) -> None:
    rounds = 100 if os.environ.get("EDGED_SLOW_TESTS") == "1" else 10
    result = crash_rounds(rounds, tmp_path / "cache", seed=7)
    assert result["writers_ready"] == rounds  # every writer got to write before it was killed
    assert result["failed_opens"] == 0
    assert result["wrong"] == 0
    assert result["served"] > 0  # entries written before the kills survive them
    assert result["repairs"] == rounds  # each kill was noticed at the next open ...
    assert result["orphans_left"] == 0  # ... and its half-written files cleaned up
