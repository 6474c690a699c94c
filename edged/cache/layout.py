"""The cache directory: what the disk tier keeps in it, and the lock that gives it to one process.

    <directory>/       the configured directory: created (mode 0700) if missing, else left as it is
        audio/         diskcache's own directory (database and value files). A repair deletes every
                       file in it that diskcache does not know, so nothing else may live there.
        audio.lock     flock'ed while a process has the tier open
        audio.open     present while the tier is open: found at open, the last run did not close
        corrupt/       corrupted databases moved aside, and value files waiting to be deleted

The configured directory may be shared (a misconfigured "/tmp", or "/var/cache"): nothing outside
these names is ever changed, and an `audio/` that holds files diskcache would not have written is
refused rather than repaired.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DBNAME = "cache.db"


class CacheDirectoryError(OSError):
    """The directory cannot be used: another process has it, or it holds files that are not ours.
    An OSError, so that the tier handles it as any unusable directory (memory-only, logged)."""


@dataclass(frozen=True)
class Layout:
    directory: Path

    @property
    def store(self) -> Path:
        return self.directory / "audio"

    @property
    def lock(self) -> Path:
        return self.directory / "audio.lock"

    @property
    def marker(self) -> Path:
        return self.directory / "audio.open"

    @property
    def corrupt(self) -> Path:
        return self.directory / "corrupt"

    def mark_open(self) -> None:
        """Write the marker (our pid), never through a symlink another user put in its place."""
        fd = os.open(self.marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as marker:
            marker.write(str(os.getpid()))

    def set_aside_database(self) -> None:
        """Move the database (a corrupted one) into `corrupt/`, where only the newest is kept, and
        its value directories into a `corrupt/trash-*` that a repair deletes."""
        own_private_dir(self.corrupt)  # another user's would get to read the cached audio moved there
        for old in self.corrupt.glob(DBNAME + ".*"):
            old.unlink(missing_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for suffix in ("-wal", "-shm", ""):  # the WAL first: a fresh db must never meet an old WAL
            path = self.store / (DBNAME + suffix)
            if path.exists():
                path.rename(self.corrupt / f"{DBNAME}.{stamp}{suffix}")
        trash = Path(tempfile.mkdtemp(prefix="trash-", dir=self.corrupt))
        for sub in self.store.iterdir():
            if sub.is_dir() and is_value_dir(sub.name):
                sub.rename(trash / sub.name)

    def remove_value_file(self, name: object) -> None:
        """The value file a row named (None: its value is inside the row), if the name is
        diskcache's "ab/cd/<hex>.val" and nothing else."""
        parts = Path(str(name)).parts
        if name is not None and len(parts) == 3 and is_value_dir(parts[0]) and is_value_dir(parts[1]):
            (self.store / str(name)).unlink(missing_ok=True)

    def claim(self) -> int:
        """Take the directory for this process: returns the descriptor that holds its lock (closing
        it releases the lock; so does the process's death). Creates what is missing."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CacheDirectoryError(f"{self.directory} is in use by another edged process") from None
            _require_own(os.fstat(fd), self.lock)
            if self.store.is_dir() and (strangers := _strangers(self.store)):
                raise CacheDirectoryError(f"{self.store} holds files that are not the cache's "
                                          f"(e.g. {strangers[0]}); not using it")
            own_private_dir(self.store)
        except BaseException:
            os.close(fd)
            raise
        return fd


def own_private_dir(path: Path) -> None:
    """`path` made (mode 0700) or tightened, and refused unless it is a directory of ours (not a
    symlink, not another user's)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise CacheDirectoryError(f"{path} is not a directory; not using it")
    if info.st_uid == os.geteuid() and info.st_mode & 0o077:
        os.chmod(path, 0o700)
        info = os.lstat(path)
    _require_own(info, path)


def _require_own(info: os.stat_result, path: Path) -> None:
    """In a shared directory another user could have made `audio/` (or the lock) first, writable
    by them: they could then plant or delete cached audio."""
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise CacheDirectoryError(f"{path} belongs to another user or is writable by others; not using it")


def _strangers(store: Path) -> list[str]:
    """Names in `store` that diskcache does not make: its database (and WAL files) and value
    directories named by two hex digits."""
    return [entry.name for entry in store.iterdir()
            if not (entry.name.startswith(DBNAME) or (entry.is_dir() and is_value_dir(entry.name)))]


def is_value_dir(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)
