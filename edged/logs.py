"""Log lines on standard error, with the priority prefix journald reads when it is the journal."""

from __future__ import annotations

import logging
import os

FORMAT = "%(levelname)s %(name)s: %(message)s"
_PRIORITIES = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}
"""syslog priorities of logging's levels (sd-daemon(3))."""


class JournalPrefix(logging.Formatter):
    """Each line begins with "<N>", its syslog priority: journald files a line by it (systemd's
    SyslogLevelPrefix=, on by default), so `journalctl -p warning` finds the warnings. Without
    it every line is filed at the unit's default level. A traceback's lines each get it too."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{_priority(record.levelno)}>"
        return prefix + super().format(record).replace("\n", "\n" + prefix)


def setup(level: int) -> None:
    """Logging to standard error, prefixed for journald when standard error is the journal."""
    handler = logging.StreamHandler()
    handler.setFormatter(JournalPrefix(FORMAT) if stderr_is_journal() else logging.Formatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])


def stderr_is_journal() -> bool:
    """Whether systemd connected standard error to the journal: $JOURNAL_STREAM names its device
    and inode (not merely set: a program started from the service inherits it, its stderr elsewhere)."""
    try:
        info = os.fstat(2)
    except OSError:
        return False
    return os.environ.get("JOURNAL_STREAM") == f"{info.st_dev}:{info.st_ino}"


def _priority(levelno: int) -> int:
    return next((p for level, p in sorted(_PRIORITIES.items(), reverse=True) if levelno >= level), 7)
