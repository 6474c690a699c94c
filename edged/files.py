"""Reading a file that may not be what its name says (a FIFO, a device, a huge file)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotARegularFile(OSError):
    """Not a regular file, or larger than the reader takes."""


def read_regular_file(path: str | Path, max_bytes: int, *, follow_symlinks: bool = True) -> bytes:
    """The bytes of `path` if it is a regular file of at most `max_bytes`: a FIFO would block the
    read for good, /dev/zero would fill memory. NotARegularFile otherwise; OSError as open raises it
    (ELOOP for a symlink when `follow_symlinks` is false)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:  # checked before a file object is made of it: for a directory, that fails naming the fd
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile(f"{path} is not a regular file")
        if info.st_size > max_bytes:
            raise NotARegularFile(f"{path} is over {max_bytes} bytes")
        data = b""
        while len(data) <= max_bytes and (block := os.read(fd, max_bytes + 1 - len(data))):
            data += block
        return data
    finally:
        os.close(fd)


def identity(path: str | Path) -> tuple[int, int]:
    """(device, inode) of the file at `path`: a file put there since (the old one replaced, or its
    directory removed and made again) has another. OSError as os.stat raises it."""
    info = os.stat(path)
    return info.st_dev, info.st_ino
