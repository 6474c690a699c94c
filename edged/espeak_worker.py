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

The child imports piper-tts's phonemizer module without the piper package's __init__, which would
load numpy and onnxruntime (~100 ms and ~24 MB) that phonemizing does not need.

    python -m edged.espeak_worker      # the child: one JSON request per line in, one reply per line out
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
import traceback
from collections.abc import Callable
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
CHILD = (sys.executable, "-m", "edged.espeak_worker")
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


# -- the child ------------------------------------------------------------------------------------


def _phonemizer() -> tuple[Any, Callable[[str], None]]:
    """piper-tts's EspeakPhonemizer, imported without the piper package's __init__, and the
    function with which the child selects its voice (see _set_voice_only_on_change)."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("piper")
    if spec is None or spec.submodule_search_locations is None:
        raise RuntimeError("piper-tts is not installed")
    package = types.ModuleType("piper")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["piper"] = package
    from piper import espeakbridge
    from piper.phonemize_espeak import EspeakPhonemizer

    phonemizer = EspeakPhonemizer()
    _forget_a_trailing_dot(phonemizer, espeakbridge)
    return phonemizer, _set_voice_only_on_change(espeakbridge.set_voice)


def _forget_a_trailing_dot(phonemizer: Any, bridge: Any) -> None:
    """After "Wait.." espeak-ng read its next text as starting with the word "dot". Reading an
    empty text after each drops that, for the texts a fork reads one after another (~4 us)."""
    phonemize = phonemizer.phonemize

    def phonemize_alone(voice: str, text: str) -> list[list[str]]:
        sentences = phonemize(voice, text)
        bridge.get_phonemes("")
        return sentences  # type: ignore[no-any-return]

    phonemizer.phonemize = phonemize_alone


def _set_voice_only_on_change(select_voice: Callable[[str], None]) -> Callable[[str], None]:
    """espeak-ng copies the voice on every set_voice and frees the copy only when it makes sound,
    which a phonemizer never does (speech.c DoVoiceChange); Piper's phonemize() sets the voice on
    every call, so a daemon that phonemized in place leaked ~1.3 KB per request (+13 MB per
    10,000). The child selects the voice only when it changes, before it forks, and never
    phonemizes itself. Its forks phonemize with Piper's phonemize(), which selects the voice for
    every text, as in Piper (~0.1 ms): that resets espeak-ng's state between the parts of a text
    around "[[ ]]" (a number's grouping), and its copies leak only until the fork exits."""
    selected: list[str] = []

    def set_voice(voice: str) -> None:
        if selected != [voice]:
            select_voice(voice)
            selected[:] = [voice]

    return set_voice


class _NoSuchVoice(Exception):
    """espeak-ng could not select the voice a bundle names (its espeak_voice)."""


class _Fork:
    """A fork of the child that phonemizes one request's texts, one after another (see the
    module's docstring). It is made ahead of the request, once the fork before has replied (or for
    the request, if there is none), and reaped later without blocking (`exiting` in main). A text
    still costs ~3 ms more than read in place (3.5 against 0.5 ms for a short one): the pages both
    processes write to after the fork are copied."""

    def __init__(self, phonemizer: Any, voice: str) -> None:
        self.voice = voice
        made: list[int] = []
        try:
            made += os.pipe()
            made += os.pipe()
            self.pid = os.fork()
        except OSError:  # out of descriptors, processes or memory: the caller says so; nothing kept
            for fd in made:
                os.close(fd)
            raise
        text_in, self._text_out, self._reply_in, reply_out = made
        if self.pid == 0:  # the fork never returns into the child's code, whatever happens
            status = 1
            try:
                _keep_only_fds(2, text_in, reply_out)
                _serve_request(phonemizer, voice, text_in, reply_out)
                status = 0
            except BaseException:  # noqa: BLE001 (said on stderr; the parent refuses the text)
                traceback.print_exc()
            finally:
                os._exit(status)
        os.close(text_in)
        os.close(reply_out)

    def phonemize(self, texts: list[str]) -> dict[str, Any]:
        """The sentences of each text, {"error": why} if espeak-ng refused one, {"signal": n} if
        the fork died."""
        try:
            with os.fdopen(self._text_out, "wb") as out:
                out.write(json.dumps(texts).encode("ascii"))
        except BrokenPipeError:  # it was killed while it waited: told below
            pass
        with os.fdopen(self._reply_in, "rb") as answer:
            written = answer.read()  # to the fork's closing it: it exits after (reaped later)
        try:
            return json.loads(written)  # type: ignore[no-any-return]
        except ValueError:  # nothing, or cut short: it died, or failed (out of memory, say)
            status = os.waitpid(self.pid, 0)[1]
            self.pid = 0
            if os.WIFSIGNALED(status):
                return {"signal": os.WTERMSIG(status)}
            return {"error": f"its fork failed (exit status {os.WEXITSTATUS(status)})"}

    def reap(self, wait: bool = True) -> bool:
        """Whether the fork has exited (and is reaped); without `wait`, only if it has already."""
        if self.pid:
            done, _ = os.waitpid(self.pid, 0 if wait else os.WNOHANG)
            if not done:
                return False
            self.pid = 0
        return True

    def discard(self) -> None:
        """Stop a fork that was given no text."""
        with contextlib.suppress(OSError):
            os.close(self._text_out)
            os.close(self._reply_in)
        self.reap()


def _keep_only_fds(*kept: int) -> None:
    """Close every other file descriptor. A fork holding the daemon's pipes (stdin, the replies)
    kept the daemon from seeing its child's death until the fork had read its text."""
    low = 0
    for fd in sorted(kept):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _serve_request(phonemizer: Any, voice: str, text_in: int, reply_out: int) -> None:
    """In the fork: wait for the texts, read them, reply (the caller exits, without cleanup)."""
    with os.fdopen(text_in, "rb") as incoming:
        request = incoming.read()
    if not request:  # discarded, or the child is gone
        return
    try:
        reply: dict[str, Any] = {"sentences": [phonemizer.phonemize(voice, text) for text in json.loads(request)]}
    except Exception as exc:  # noqa: BLE001 (whatever it is, the parent gets it as BadInput)
        reply = {"error": str(exc)}
    with os.fdopen(reply_out, "wb") as out:
        out.write(json.dumps(reply).encode("ascii"))


def main() -> int:
    # The daemon stops this process (closing its stdin, or SIGKILL): a Ctrl-C in a terminal or
    # systemd's SIGTERM to the whole unit must not end it while the daemon drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Replies go out on a copy of stdout; anything espeak-ng itself prints goes to stderr instead
    # of into the replies.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    phonemizer, select_voice = _phonemizer()
    fork: _Fork | None = None
    exiting: list[_Fork] = []  # forks that have replied, reaped once they have exited
    for line in sys.stdin.buffer:
        request = json.loads(line)
        if fork is not None and fork.voice != request["voice"]:
            fork.discard()
            fork = None
        reply: dict[str, Any]
        used: _Fork | None = None
        try:
            if fork is None:
                try:
                    select_voice(request["voice"])  # here, not in the fork: selecting leaks a copy each time
                except Exception as exc:  # noqa: BLE001 (the bundle's espeak_voice, not the text, is at fault)
                    raise _NoSuchVoice(str(exc)) from None
                fork = _Fork(phonemizer, request["voice"])
        except _NoSuchVoice as exc:
            reply = {"no_voice": str(exc)}
        except OSError as exc:  # no fork (out of processes or memory): not the text's fault
            reply = {"unavailable": str(exc)}
        except Exception as exc:  # noqa: BLE001 (whatever it is, the parent raises it as BadInput)
            reply = {"error": str(exc)}
        else:
            reply = fork.phonemize(request["texts"])
            used, fork = fork, None
        replies.write(json.dumps(reply).encode("ascii") + b"\n")
        replies.flush()
        if used is not None:  # the next request's fork, while the parent has the reply
            exiting.append(used)
            with contextlib.suppress(OSError):  # none now (out of processes): the next request tries
                fork = _Fork(phonemizer, used.voice)
        exiting = [done for done in exiting if not done.reap(wait=False)]
    if fork is not None:
        fork.discard()
    return 0


if __name__ == "__main__":
    sys.exit(main())
