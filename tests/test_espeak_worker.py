"""espeak-ng runs in a child process: a text that crashes or stalls it is refused, the caller lives on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import wait_for

from edged.errors import BadInput, BundleError, NotReady
from edged.espeak_worker import EspeakProcess

CRASHES_ESPEAK = "esness" + "ness" * 70
"""A long word of a repeated suffix: espeak-ng 1.52 (in piper-tts 1.8) segfaults on it (found by fuzzing)."""


@pytest.fixture
def espeak() -> Iterator[EspeakProcess]:
    process = EspeakProcess()
    yield process
    process.close()


def test_a_text_that_crashes_espeak_is_refused_and_the_next_one_is_read(espeak: EspeakProcess) -> None:
    before = espeak.phonemize("en-us", "The water is warm.")
    child = espeak._child
    with pytest.raises(BadInput, match="crashed"):
        espeak.phonemize("en-us", CRASHES_ESPEAK)
    assert espeak.restarts == 0 and espeak._child is child  # only the fork that read it died
    assert espeak.phonemize("en-us", "The water is warm.") == before


@pytest.mark.parametrize(("first", "then"), [
    ("4547568\ts", "9/20/20189,506,995 every!"),  # grouped as "twenty million" after it, not "billion"
    ("Wait..", "Paul walked home?"),  # began with the word "dot"
])
def test_a_text_is_read_as_if_it_were_the_first(espeak: EspeakProcess, first: str, then: str) -> None:
    # espeak-ng keeps state from one text to the next: one client's text changed another's.
    alone = espeak.phonemize("en-us", then)
    espeak.phonemize("en-us", first)
    assert espeak.phonemize("en-us", then) == alone


def test_texts_read_in_one_fork_lose_a_trailing_dot_between_them(espeak: EspeakProcess) -> None:
    # One fork reads the three texts that confirm a long text's cut, or the parts of a text
    # around [[ ]]: there the dot that "Wait.." leaves is dropped between texts.
    alone = espeak.phonemize("en-us", "Paul walked home?")
    assert espeak.phonemize_each("en-us", ["Wait..", "Paul walked home?"])[1] == alone


def test_a_stalled_espeak_is_stopped_and_replaced(espeak: EspeakProcess) -> None:
    espeak.start()
    stalled = espeak._child
    assert stalled is not None
    espeak.timeout_s = 0.2  # the reply cannot come in time: the text takes espeak-ng ~1 s
    with pytest.raises(BadInput, match="took over"):
        espeak.phonemize("en-us", "The water is warm and the sky is clear. " * 6000)
    assert espeak.restarts == 1
    # The child and the fork that was reading are both gone (a fork left would read on).
    assert _running_in_group(stalled.pid) == []
    espeak.timeout_s = 30.0
    assert espeak.phonemize("en-us", "The water is warm.")[0][-1] == "."


def test_an_unknown_espeak_voice_is_the_bundles_fault(espeak: EspeakProcess) -> None:
    # Not the text's (it was a 400): the voice comes from the bundle's manifest.
    with pytest.raises(BundleError, match="espeak-ng has no voice 'xx-nonexistent'"):
        espeak.phonemize("xx-nonexistent", "Hello.")
    assert espeak.restarts == 0  # the child said so; it did not die


def test_the_child_stays_lean(espeak: EspeakProcess) -> None:
    espeak.start()
    assert espeak.phonemize("en-us", "Hello.")
    pid = espeak._child.pid  # type: ignore[union-attr]
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "espeakbridge" in maps and "onnxruntime" not in maps and "numpy" not in maps


def test_a_child_killed_between_texts_is_replaced(espeak: EspeakProcess) -> None:
    before = espeak.phonemize("en-us", "The water is warm.")
    child = espeak._child
    assert child is not None
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert espeak.phonemize("en-us", "The water is warm.") == before
    assert espeak.restarts == 1 and espeak._child is not child


def test_the_child_outlives_a_sigterm_to_the_whole_service(espeak: EspeakProcess) -> None:
    # systemd stops a unit by SIGTERM to all its processes; the daemon then drains, using espeak-ng.
    espeak.phonemize("en-us", "Hello.")
    child = espeak._child
    assert child is not None
    os.kill(child.pid, signal.SIGTERM)
    time.sleep(0.2)
    assert espeak.phonemize("en-us", "Still here.") and espeak._child is child and espeak.restarts == 0


def _kill_mid_text(espeak: EspeakProcess, text: str) -> tuple[list, list]:
    """Ask for `text` with the child stopped, SIGKILL it while the call waits: (results, errors)."""
    espeak.timeout_s = 30.0
    child = espeak._child
    assert child is not None
    os.kill(child.pid, signal.SIGSTOP)
    results: list = []
    errors: list = []

    def ask() -> None:
        try:
            results.append(espeak.phonemize("en-us", text))
        except Exception as exc:  # noqa: BLE001 (the test looks at it)
            errors.append(exc)

    thread = threading.Thread(target=ask)
    thread.start()
    time.sleep(0.3)  # the call has written its text and waits for the reply
    os.kill(child.pid, signal.SIGKILL)
    thread.join(30)
    return results, errors


def test_a_child_killed_from_outside_mid_text_is_replaced_and_the_text_read(espeak: EspeakProcess) -> None:
    # The OOM killer or an operator, not the text: the caller must not get a 400 for it.
    before = espeak.phonemize("en-us", "The water is warm.")
    results, errors = _kill_mid_text(espeak, "The water is warm.")
    assert errors == [] and results == [before]
    assert espeak.restarts == 1


def test_a_text_that_crashes_espeak_is_not_asked_twice(espeak: EspeakProcess) -> None:
    espeak.phonemize("en-us", "Hello.")
    with pytest.raises(BadInput, match="crashed"):
        espeak.phonemize("en-us", CRASHES_ESPEAK)
    assert espeak.restarts == 0  # SIGSEGV is the text's doing: not asked again
    # A child killed again on the second try: 503, try later (still not the text's fault).
    espeak.timeout_s = 30.0
    running = espeak._running

    def stopped_then_killed() -> subprocess.Popen[bytes]:
        child = running()
        os.kill(child.pid, signal.SIGSTOP)
        threading.Timer(0.2, os.kill, (child.pid, signal.SIGKILL)).start()
        return child

    espeak._running = stopped_then_killed  # type: ignore[method-assign]
    with pytest.raises(NotReady, match="killed twice"):
        espeak.phonemize("en-us", "Hello.")
    assert espeak.restarts == 2


def _open_fds(pid: int) -> int:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:  # gone
        return 0


def _running_in_group(group: int) -> list[int]:
    """Processes of a process group that have not ended (zombies wait for their reaper)."""
    found = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, check=False).stdout.split()
    running = []
    for pid in found:
        try:
            if Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                running.append(int(pid))
        except FileNotFoundError:
            continue
    return running


def _forks_with_fds(espeak: EspeakProcess, count: int) -> list[int]:
    """The child's forks holding `count` descriptors: 3 for the one kept ready for the next text
    (its two pipes and stderr), 2 for one reading a text (its reply pipe and stderr). One that has
    replied holds fewer while it exits, or none as a zombie."""
    child = espeak._child
    assert child is not None
    forks = [int(pid) for pid in Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split()]
    return [pid for pid in forks if _open_fds(pid) == count]


def _ready_fork(espeak: EspeakProcess) -> int:
    """The pid of the fork the child keeps ready for the next text (made after its reply)."""
    ready = wait_for(lambda: _forks_with_fds(espeak, 3), timeout=30, interval=0.01)
    assert len(ready) == 1
    return ready[0]


def test_a_ready_fork_killed_from_outside_costs_only_itself(espeak: EspeakProcess) -> None:
    # Writing the next text to it failed with a broken pipe, which killed the child (a restart,
    # a traceback in the log).
    before = espeak.phonemize("en-us", "The water is warm.")
    child = espeak._child
    os.kill(_ready_fork(espeak), signal.SIGKILL)
    time.sleep(0.2)  # gone before the next text comes
    assert espeak.phonemize("en-us", "The water is warm.") == before
    assert espeak._child is child and espeak.restarts == 0


def test_a_fork_whose_child_was_killed_ends_and_the_text_is_read_again(espeak: EspeakProcess) -> None:
    # The fork reading a long text outlived its child; its reply failed (broken pipe) and, as
    # Python code, it went on into the child's loop: a second "child" answered the daemon
    # "could not read the text: Broken pipe" (400) and read its requests.
    espeak.timeout_s = 30.0
    espeak.start()
    child = espeak._child
    assert child is not None
    text = "The water is warm and the sky is clear. " * 6000  # ~1 s for espeak-ng
    results: list = []
    thread = threading.Thread(target=lambda: results.append(espeak.phonemize("en-us", text)))
    thread.start()  # the child's first text: its first fork was made where errors were caught
    # The child may still be starting (start() does not wait; slow under load): wait for the fork
    # to hold the text, not a fixed time.
    wait_for(lambda: _forks_with_fds(espeak, 2), timeout=30, interval=0.01)
    os.kill(child.pid, signal.SIGKILL)  # the child alone, not its group
    thread.join(60)
    assert len(results) == 1 and len(results[0]) == 6000  # asked again of a new child, and read
    # The old fork ends once it has finished its reading (~1 s; a fixed 1.5 s wait failed under
    # load); gone wrong, it lives on as a second child, waiting for requests.
    deadline = time.monotonic() + 30
    while _running_in_group(child.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running_in_group(child.pid) == []


FORK_FAILS = """
import errno, os, sys
real_fork, calls = os.fork, [0]
def fork():  # the 2nd and 3rd forks fail, as under a process limit
    calls[0] += 1
    if calls[0] in (2, 3):
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
    return real_fork()
os.fork = fork
from edged.espeak_child import main
sys.exit(main())
"""


def test_a_fork_that_cannot_be_made_refuses_one_text_and_keeps_nothing_open() -> None:
    # Out of processes (EAGAIN): the fork made ahead after a reply, then the one made for the next
    # request, fail. That request is refused (not as bad input); the child lives on, without the
    # pipes of either.
    child = subprocess.Popen([sys.executable, "-c", FORK_FAILS], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert child.stdin is not None and child.stdout is not None

    def ask(text: str) -> dict:
        child.stdin.write(json.dumps({"voice": "en-us", "texts": [text]}).encode() + b"\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        return json.loads(child.stdout.readline())  # type: ignore[union-attr]

    def open_fds_settle_at(count: int) -> bool:  # forks are made after the reply: wait for them
        return wait_for(lambda: len(os.listdir(f"/proc/{child.pid}/fd")) == count, timeout=5, interval=0.01)

    own = 4  # stdin, stdout, stderr and the copy of stdout that replies go out on
    try:
        first = ask("The water is warm.")
        assert "Resource temporarily unavailable" in ask("The water is warm.")["unavailable"]  # 503 in the parent
        assert open_fds_settle_at(own)  # neither fork that failed keeps its pipes
        assert ask("The water is warm.") == first
        assert child.poll() is None
        assert open_fds_settle_at(own + 2)  # its ends of the pipes of the fork made ahead
    finally:
        child.stdin.close()
        child.wait(10)
        child.stdout.close()


def test_a_text_that_gets_no_fork_is_not_ready_rather_than_bad_input() -> None:
    espeak = EspeakProcess(command=(sys.executable, "-c", FORK_FAILS))
    try:
        first = espeak.phonemize("en-us", "The water is warm.")
        with pytest.raises(NotReady, match="could not start reading"):
            espeak.phonemize("en-us", "The water is warm.")
        assert espeak.phonemize("en-us", "The water is warm.") == first
        assert espeak.restarts == 0
    finally:
        espeak.close()
