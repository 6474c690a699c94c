"""A diskcache `Disk` that stores str keys and bytes values only, and never unpickles.

diskcache's own Disk falls back to pickle for other types and unpickles whatever a row says is a
pickle; this one refuses such rows (UnreadableRow), so a tampered database cannot run code.
"""

from __future__ import annotations

import errno
import os
import re
import sqlite3
import threading
from typing import Any

import diskcache  # type: ignore[import-untyped]  # no type hints in 5.6.3
from diskcache.core import MODE_BINARY, MODE_RAW, UNKNOWN  # type: ignore[import-untyped]

from ..files import NotARegularFile, read_regular_file

_VALUE_FILE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")
DEFAULT_MAX_VALUE_BYTES = 64 * 1024 * 1024


class UnreadableRow(Exception):
    """A row is not one this Disk wrote (pickled, text, or a file name outside the cache)."""


class RawDisk(diskcache.Disk):
    def __init__(self, directory: str, **kwargs: Any) -> None:
        super().__init__(directory, **kwargs)
        self._written = threading.local()
        self.max_value_bytes = DEFAULT_MAX_VALUE_BYTES
        """Largest value file read (its owner sets it from the largest entry it stores)."""

    def put(self, key: Any) -> tuple[Any, bool]:
        if type(key) is not str:
            raise TypeError("cache keys are str")
        return key, True

    def get(self, key: Any, raw: bool) -> Any:
        if not raw or type(key) is not str:
            raise UnreadableRow("key is not a raw string")
        return key

    def store(self, value: Any, read: bool, key: Any = UNKNOWN) -> tuple[int, int, str | None, Any]:
        if type(value) is not bytes or read:
            raise TypeError("cache values are bytes")
        if len(value) < self.min_file_size:
            return 0, MODE_RAW, None, sqlite3.Binary(value)
        filename, full_path = self.filename(key, value)
        os.makedirs(os.path.dirname(full_path), mode=0o700, exist_ok=True)
        self._written.path = full_path
        with open(full_path, "xb") as file:  # a failed write leaves the path for discard_unsaved
            file.write(value)
        return len(value), MODE_BINARY, filename, None

    def fetch(self, mode: int, filename: Any, value: Any, read: bool) -> bytes:
        if read:
            raise TypeError("file handles are not served")
        if mode == MODE_RAW and type(value) is bytes:
            return value
        if mode == MODE_BINARY and type(filename) is str and _VALUE_FILE.fullmatch(filename):
            return self._read_value_file(filename)
        raise UnreadableRow(f"row of mode {mode} was not written by this cache")

    def _read_value_file(self, filename: str) -> bytes:
        """The file's bytes if it is a regular file of at most `max_value_bytes`: a FIFO put in its
        place would block the reader for good, a huge file would fill memory."""
        try:
            return read_regular_file(os.path.join(self._directory, filename), self.max_value_bytes,
                                     follow_symlinks=False)
        except NotARegularFile as exc:
            raise UnreadableRow(f"value file {exc}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink: not a file this cache wrote
                raise UnreadableRow(f"value file {filename} is a symlink") from None
            raise  # gone (deleted meanwhile): diskcache reads that as a miss

    def saved(self) -> None:
        """The last stored value's row is committed: its file is no longer ours to remove."""
        self._written.path = None

    def discard_unsaved(self) -> None:
        """Remove the file of a value whose row was never committed (failed or interrupted set)."""
        path = getattr(self._written, "path", None)
        self._written.path = None
        if path:
            try:
                os.remove(path)
            except OSError:
                pass
