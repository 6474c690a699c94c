"""A command line's text in (an argument, or `-` for standard input) and audio out (a file given
with `-o`, or standard output). Shared by `edged synth` and `edgectl synth`; standard library
only, as edgectl starts fast.

A regular file (or a new one) is written beside its target and renamed over it at the end, so a
failure leaves no half-written file. A device, a FIFO, or a symlink to one of them (`-o /dev/null`,
`-o /dev/stdout`) is written in place: renaming over it would replace the device itself. Symlinks
are followed, never replaced.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .wav import write_sizes


class OutputError(Exception):
    """The audio cannot be written where asked; the message says where and why."""


class InputError(Exception):
    """The text cannot be read; the message says why."""


def read_text(arg: str) -> str:
    """The text argument itself, or standard input's (UTF-8) for `-`."""
    if arg != "-":
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:  # bytes the locale could not decode, kept as surrogates
            raise InputError("the text argument is not valid UTF-8") from None
        return arg
    if sys.stdin is None:
        raise InputError("standard input is closed")
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"stdin is not valid UTF-8 (byte {exc.start})") from None


class AudioOutput:
    """An open output: `write` audio bytes, then `finish_wav` to put the real sizes into a WAV
    header written for streaming (only in a file of our own: standard output or a device may
    hold other bytes before ours, and seeking there would write over them)."""

    def __init__(self, file: BinaryIO, name: str, own_file: bool) -> None:
        self._file = file
        self.name = name
        self.own_file = own_file
        self.written = 0

    def write(self, data: bytes) -> None:
        try:
            self._file.write(data)
            self._file.flush()  # a player reading the output starts at once
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(f"cannot write {self.name}: {exc.strerror or exc}") from None
        self.written += len(data)

    def finish_wav(self) -> None:
        if self.own_file and self.written >= 44 and not write_sizes(self._file, self.written - 44):
            # Over 4 GiB: players read a streaming header to the end of the file.
            print(f"note: {self.name} is too long for a WAV header's sizes; they are left as "
                  "for a stream", file=sys.stderr)


def check_writable(path: Path) -> None:
    """Refuse now what cannot be written (before any synthesis is done for it)."""
    kind = _kind(path)
    if kind == "directory":
        raise OutputError(f"cannot write {path}: it is a directory")
    if kind == "special":
        return  # a device or FIFO: opened for writing later, in place
    target = Path(os.path.realpath(path))
    if not target.parent.is_dir():
        raise OutputError(f"cannot write {path}: no directory {target.parent}")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {path}: no permission to create files in {target.parent}")


@contextlib.contextmanager
def open_output(path: Path | None) -> Iterator[AudioOutput]:
    """An output to `path`, or to standard output when `path` is None."""
    if path is None:
        if sys.stdout is None:
            raise OutputError("standard output is closed")
        yield AudioOutput(sys.stdout.buffer, "standard output", own_file=False)
        return
    check_writable(path)
    # /dev/stdout and its like are written where they point, appending: opened afresh, a regular
    # file behind them would be truncated (the shell may have opened it to append).
    in_place = _kind(path) == "special" or _through_proc(path)
    # realpath: a symlink to a regular file is written through, not replaced.
    target = path if in_place else Path(os.path.realpath(path))
    written_to = target if in_place else target.with_name(target.name + ".part")
    try:
        try:
            file = open(written_to, "ab" if in_place else "wb")  # noqa: SIM115 (closed below)
        except OSError as exc:
            raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
        with file:
            yield AudioOutput(file, str(path), own_file=not in_place)
        if not in_place:
            written_to.replace(target)
    finally:
        if not in_place:
            written_to.unlink(missing_ok=True)


def _through_proc(path: Path) -> bool:
    """Whether a symlink on the way to `path` points into /proc (/dev/stdout -> /proc/self/fd/1),
    or its directory is there (/dev/fd/1, /proc/self/fd/1): an open file of a process, not one
    to replace."""
    current = Path(os.path.abspath(path))
    for _ in range(40):  # the kernel's own limit on symlinks followed
        if os.path.realpath(current.parent).startswith("/proc/"):
            return True
        if not current.is_symlink():
            return False
        target = os.readlink(current)
        if target.startswith("/proc/"):
            return True
        current = Path(os.path.abspath(current.parent / target))
    return False


def _kind(path: Path) -> str:
    """What `path` is, symlinks followed (os.stat also follows /dev/stdout's /proc links, which
    realpath cannot): "missing", "file", "directory" or "special" (device, FIFO, socket)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "missing"
    if stat.S_ISDIR(mode):
        return "directory"
    return "file" if stat.S_ISREG(mode) else "special"
