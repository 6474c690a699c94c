"""The child process of edged.espeak_worker: piper-tts's phonemizer, reading each request in a fork.

One JSON request per line in ({"voice", "texts"}), one reply per line out: {"sentences": [...]}
(the phonemes of each sentence of each text), or {"error"}, {"signal"} (the fork died on the
text), {"no_voice"} or {"unavailable"} (no fork could be made). Why a fork per request, and what
the parent does with each reply, is in edged.espeak_worker.

The child imports piper-tts's phonemizer module without the piper package's __init__, which would
load numpy and onnxruntime (~100 ms and ~24 MB) that phonemizing does not need.

    python -m edged.espeak_child
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any


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
