"""What a disk-tier failure means: the reason it is counted under, and whether it is corruption."""

from __future__ import annotations

import errno
import sqlite3

import diskcache  # type: ignore[import-untyped]  # no type hints in 5.6.3

CORRUPT_CODES = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
PAUSING = ("disk_full", "unwritable", "io_error", "busy")
"""The reasons that pause writes for a while (corrupt rebuilds). Busy too: another process
holding the database made every queued write wait its whole timeout (5 s), and an invalidation
or the daemon's exit waited behind them all (45 s for 8 writes)."""


def sqlite_code(error: BaseException) -> str:
    """Primary SQLite result code name, e.g. SQLITE_IOERR for SQLITE_IOERR_WRITE."""
    name = getattr(error, "sqlite_errorname", None) or ""
    return "_".join(name.split("_")[:2])


def is_corruption(error: BaseException) -> bool:
    return isinstance(error, sqlite3.DatabaseError) and sqlite_code(error) in CORRUPT_CODES


def reason(error: BaseException) -> str:
    """disk_full, unwritable, busy, corrupt or io_error."""
    if isinstance(error, diskcache.Timeout):
        return "busy"
    if isinstance(error, OSError):
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            return "disk_full"
        if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return "unwritable"
        return "io_error"
    code = sqlite_code(error)
    if code in CORRUPT_CODES:
        return "corrupt"
    if code == "SQLITE_FULL":
        return "disk_full"
    if code in ("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM"):
        return "unwritable"
    if code in ("SQLITE_BUSY", "SQLITE_LOCKED"):
        return "busy"
    return "io_error"
