"""A command line's text in (an argument, or `-` for standard input) and audio out (a file given
with `-o`, or standard output). Shared by `edged synth` and `edgectl synth`; standard library
only, as edgectl starts fast.

A regular file (or a new one) is written beside its target, as a new file of its own, and renamed
over it at the end, so a failure (or SIGTERM, SIGHUP, Ctrl-C) leaves no half-written file. A
device, a FIFO, or a symlink to one of them (`-o /dev/null`, `-o /dev/stdout`) is written in place:
renaming over it would replace the device itself. Symlinks are followed, never replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

from .wav import write_sizes


class OutputError(Exception):
    """The audio cannot be written where asked; the message says where and why."""


class InputError(Exception):
    """The text cannot be read; the message says why."""


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived (`timeout`, a closed terminal): the command ends as on Ctrl-C,
    through the clean-up that removes a partial output file. Exit status 128 + `signum`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def interrupted_by_signals() -> Iterator[None]:
    """Raise Interrupted on SIGTERM and SIGHUP while the block runs; a signal ignored by whoever
    started us (nohup) stays ignored."""
    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


MAX_TEXT_CHARS = 1 << 24
"""Texts the commands read: far past a daemon's limit (its limits.max_text_chars, 100,000 by
default) and a long book for `edged synth`, which streams any length in bounded memory; but a
bound on what an endless standard input (`yes | edged synth -`) costs."""
MAX_SHOWN_NAME = 200
"""Bytes of an output's name kept in the name of the file written before it takes its place."""


def read_text(arg: str, max_chars: int = MAX_TEXT_CHARS) -> str:
    """The text argument itself, or standard input's (UTF-8) for `-`; at most `max_chars`
    characters (standard input is not read past them)."""
    if arg != "-":
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:  # bytes the locale could not decode, kept as surrogates
            raise InputError("the text argument is not valid UTF-8") from None
        return _at_most(arg, max_chars)
    if sys.stdin is None:
        raise InputError("standard input is closed")
    room = 4 * max_chars + 2  # UTF-8 takes up to 4 bytes a character, and a line ending may follow
    data = sys.stdin.buffer.read(room + 1)
    if len(data) > room:
        raise InputError(f"the text is longer than {max_chars} characters")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"stdin is not valid UTF-8 (byte {exc.start})") from None
    # The one line ending of piped text (`echo ... |`) is not part of it, as for Piper's own
    # command line: with it, the text would miss the cache entry of its words.
    return _at_most(text[:-2] if text.endswith("\r\n") else text.removesuffix("\n"), max_chars)


def _at_most(text: str, max_chars: int) -> str:
    if len(text) > max_chars:
        raise InputError(f"the text is longer than {max_chars} characters")
    return text


def print_report(lines: list[str]) -> None:
    """A command's report on standard output. Standard output closed or unwritable (a full disk)
    is an OutputError, as it is for audio: not a silent success, nor a traceback."""
    stdout = _stdout()
    _write(stdout.buffer, "standard output", "".join(f"{line}\n" for line in lines).encode(stdout.encoding, "replace"))


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
        _write(self._file, self.name, data)  # flushed: a player reading the output starts at once
        self.written += len(data)

    def finish_wav(self) -> None:
        if self.own_file and self.written >= 44 and not write_sizes(self._file, self.written - 44):
            # Over 4 GiB: players read a streaming header to the end of the file.
            print(f"note: {self.name} is too long for a WAV header's sizes; they are left as "
                  "for a stream", file=sys.stderr)


def output_path(text: str) -> Path:
    """The path `-o` names. Path() drops a trailing "/" (and "/."), and "out.wav/" then replaced
    the file out.wav: a name that can only be a directory is refused, as the shell's `>` does."""
    if os.path.basename(text) in ("", "."):
        raise argparse.ArgumentTypeError(f"{text!r} names a directory, not a file to write")
    return Path(text)


def check_writable(path: Path | None) -> None:
    """Refuse now what cannot be written (before any synthesis is done for it). None is standard
    output: it must be open, and not a terminal (audio there garbles it)."""
    if path is None:
        if _stdout().isatty():
            raise OutputError("not writing audio to a terminal; give -o FILE or redirect standard output")
        return
    try:
        _check_writable(path)
    except OSError as exc:  # a name too long, a symlink loop, ...
        raise _cannot_write(path, exc) from None


def _check_writable(path: Path) -> None:
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
    # The audio replaces the file by a rename, which the directory allows: a file that `>` may
    # not write (read-only, another user's) is refused as `>` refuses it.
    if kind == "file" and not os.access(target, os.W_OK):
        raise OutputError(f"cannot write {path}: {os.strerror(errno.EACCES)}")


@contextlib.contextmanager
def open_output(path: Path | None) -> Iterator[AudioOutput]:
    """An output to `path`, or to standard output when `path` is None."""
    if path is None:
        yield AudioOutput(_stdout().buffer, "standard output", own_file=False)
        return
    check_writable(path)
    # /dev/stdout and its like are written where they point, appending: opened afresh, a regular
    # file behind them would be truncated (the shell may have opened it to append).
    try:
        in_place = _kind(path) == "special" or _through_proc(path)
    except OSError as exc:
        raise _cannot_write(path, exc) from None
    if in_place:
        try:
            file = open(path, "ab")  # noqa: SIM115 (closed by _closing)
        except OSError as exc:
            raise _cannot_write(path, exc) from None
        with _closing(file, path):
            yield AudioOutput(file, str(path), own_file=False)
        return
    # realpath: a symlink to a regular file is written through, not replaced. The file written
    # is new and ours alone (created exclusively: two runs on one target, or a planted symlink
    # where it is made, cannot mix into it), with the mode the target has or would get.
    target = Path(os.path.realpath(path))
    # The name of the file being written says what it will be, within the 255 bytes a name has.
    shown = target.name if len(os.fsencode(target.name)) <= MAX_SHOWN_NAME else "edged"
    try:
        fd, part = tempfile.mkstemp(dir=target.parent, prefix=f".{shown}.", suffix=".part")
    except OSError as exc:
        raise _cannot_write(path, exc) from None
    try:
        file = os.fdopen(fd, "wb")
        try:
            os.fchmod(fd, _mode_for(target))
        except OSError as exc:
            file.close()
            raise _cannot_write(path, exc) from None
        with _closing(file, path):
            yield AudioOutput(file, str(path), own_file=True)
        try:
            os.replace(part, target)
        except OSError as exc:  # another's file in a sticky directory (/tmp)
            raise _cannot_write(path, exc) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)


@contextlib.contextmanager
def _closing(file: BinaryIO, path: Path) -> Iterator[None]:
    """Close `file`; a failure to (a full disk: the last bytes are flushed then) is an OutputError,
    unless an error is already on its way out."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            file.close()
        raise
    try:
        file.close()
    except OSError as exc:
        raise _cannot_write(path, exc) from None


def _stdout() -> TextIO:
    if sys.stdout is None:  # started with it closed (>&-)
        raise OutputError("standard output is closed")
    return sys.stdout


def _write(file: BinaryIO, name: str, data: bytes) -> None:
    """Write and flush `data`; a failure is an OutputError, except a reader gone (BrokenPipeError)."""
    try:
        file.write(data)
        file.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise _cannot_write(name, exc) from None


def _cannot_write(path: Path | str, exc: OSError) -> OutputError:
    return OutputError(f"cannot write {path}: {exc.strerror or exc}")


def _mode_for(target: Path) -> int:
    """The permission bits of `target` if it exists, else those a new file gets (0o666 less the umask)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        umask = os.umask(0o022)
        os.umask(umask)
        return 0o666 & ~umask


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
    except (FileNotFoundError, NotADirectoryError):  # (a symlink loop is an error, not "missing")
        return "missing"
    if stat.S_ISDIR(mode):
        return "directory"
    return "file" if stat.S_ISREG(mode) else "special"
