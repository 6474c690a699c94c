"""espeak-ng in a process of its own, so that a text it crashes on costs one request, not the daemon.

espeak-ng (inside piper-tts's phonemizer) segfaults on some texts: long runs of dotted letters,
long words made of a repeated suffix ("nessnessness..."), and who knows what else. A child process
runs piper-tts's EspeakPhonemizer; this process sends it one batch of texts (blocks of a long text,
or one text) at a time and gets back the phonemes of each sentence. The child reads each batch in a
fork of itself: espeak-ng keeps state from one text to the next (the last dot of "Wait.." was read
as the word "dot" at the start of the next text; after "4547568<TAB>s" a long number was grouped
otherwise), so one client's text changed how another's was read. A fork starts from the state the
child had after start-up (texts given to one fork together, by phonemize_each, are read one after
another), and a crash takes only the fork: that text is refused (BadInput). If no fork can be made
(out of processes), the request gets NotReady. If the child itself stalls or dies, the next call
starts a new one; killed from outside while it reads (the OOM killer), the text is asked again.

The child's side is edged.espeak_child.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

from .errors import BadInput, BundleError, NotReady

log = logging.getLogger(__name__)

BLOCK_TIMEOUT_S = 2.0
"""Longest time one block of text may take: espeak-ng needs ~7 ms for a block (2,000 characters),
~0.2 s for the slowest found by fuzzing. Well under the text stage's timeout (5 s by default), so
that a stalled text gets its own 400, not a stage timeout for it and for the requests behind it."""


CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL})
"""Signals by which espeak-ng itself fails on a text; any other death (SIGKILL) came from outside."""
CRASHED = "espeak-ng, which reads the text, crashed on it; it was not spoken"
CHILD = (sys.executable, "-m", "edged.espeak_child")
"""How the child is started."""


class TextStalled(BadInput):
    """espeak-ng took longer than its timeout over a text (and its process was replaced)."""


class EspeakProcess:
    """The parent's side: one child at a time, one request at a time (espeak-ng is single-threaded)."""

    def __init__(self, timeout_s: float = BLOCK_TIMEOUT_S, command: tuple[str, ...] = CHILD) -> None:
        self.timeout_s = timeout_s
        self.command = command
        self.restarts = 0
        """Children started again after one died or stalled on a text."""
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the child now; it initializes espeak-ng while the caller goes on."""
        with self._lock:
            self._running()

    def phonemize(self, voice: str, text: str) -> list[list[str]]:
        """Phonemes (characters) of each sentence of `text`, as piper-tts's phonemizer gives them."""
        return self.phonemize_each(voice, [text])[0]

    def phonemize_each(self, voice: str, texts: list[str]) -> list[list[list[str]]]:
        """phonemize() of each of `texts`, read one after another in one fork (each starts as
        espeak-ng left the one before: a fork costs ~3 ms, reading a short text ~0.2 ms).
        BadInput for a text espeak-ng cannot read; NotReady if it could not be asked now."""
        with self._lock:
            for _attempt in range(2):  # a child killed from outside gets the text again, once
                reply = self._ask(voice, texts)
                if reply is not None:
                    break
            else:
                raise NotReady("espeak-ng, which reads the text, was killed twice while reading it; try again")
        if "unavailable" in reply:
            raise NotReady(f"espeak-ng could not start reading the text ({reply['unavailable']}); try again")
        if "no_voice" in reply:
            raise BundleError(f"espeak-ng has no voice {voice!r} (the bundle's espeak_voice): {reply['no_voice']}")
        if "error" in reply:
            raise BadInput(f"espeak-ng could not read the text: {reply['error']}")
        return reply["sentences"]  # type: ignore[no-any-return]

    def _ask(self, voice: str, texts: list[str]) -> dict[str, Any] | None:
        """The child's reply to `texts`; None if the child was killed from outside while it read
        (the OOM killer, an operator: not the text's doing). BadInput if it crashed or stalled on
        the text. A child that died or stalled is replaced by the next call."""
        child = self._running()
        assert child.stdin is not None and child.stdout is not None
        try:
            child.stdin.write(json.dumps({"voice": voice, "texts": texts}).encode("ascii") + b"\n")
            child.stdin.flush()
            line = _read_line(child.stdout, time.monotonic() + self.timeout_s)
        except BrokenPipeError:
            line = b""
        if line is None:
            self._lose(child, "stalled on a text")
            raise TextStalled(f"espeak-ng took over {self.timeout_s:g} s to read this text; it was not spoken")
        if not line:
            self._lose(child, "died on a text")
            if not _died_of_crash(child.returncode):
                return None
            raise BadInput(CRASHED)
        try:
            reply: dict[str, Any] = json.loads(line)
        except ValueError:  # out of step with us: its next line could answer another text
            self._lose(child, "answered out of protocol")
            raise BadInput("espeak-ng failed on this text; it was not spoken") from None
        if "signal" in reply:  # the fork that read the text died; the child lives on
            if not _died_of_crash(-reply["signal"]):
                return None
            log.warning("espeak-ng crashed on a text (signal %d); it was refused", reply["signal"])
            raise BadInput(CRASHED)
        return reply

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                child, self._child = self._child, None
                _stop(child)

    def _running(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is not None:
            self._lose(self._child, "had exited")  # killed from outside, between two texts
        if self._child is None:
            self._child = subprocess.Popen(  # a process group of its own: stopping it stops its forks
                self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, process_group=0)
        return self._child

    def _lose(self, child: subprocess.Popen[bytes], how: str) -> None:
        _stop(child)
        self._child = None
        self.restarts += 1
        log.error("the espeak-ng process %s (exit %s); a new one takes the next text", how, child.returncode)


ESPEAK = EspeakProcess()
"""The process's one espeak-ng (edged.phonemes uses it); no child runs until it is first needed."""
atexit.register(ESPEAK.close)


def _died_of_crash(returncode: int | None) -> bool:
    """Whether a process died of a signal espeak-ng raises itself (a return code of -signal, as
    Popen reports it); any other end (killed from outside, or failed itself) is worth one more try."""
    return returncode is not None and returncode < 0 and -returncode in CRASH_SIGNALS


def _read_line(stream: IO[bytes], deadline: float) -> bytes | None:
    """One line from a pipe: b"" if it closed first, None if `deadline` passed first."""
    fd = stream.fileno()
    ready = select.poll()
    ready.register(fd, select.POLLIN)
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not ready.poll(remaining * 1000):
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b""
        data += chunk
    return data


def _stop(child: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the child and the fork reading a text, if any
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    if os.getpid() == 1:  # no init above us (a container): forks the child left are ours to reap
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
    for stream in (child.stdin, child.stdout):
        if stream is not None:
            stream.close()
