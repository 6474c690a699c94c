"""edgectl against the real daemon, run as a command the way a user runs it."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import REPO, Daemon, edgectl, wait_for

from edged.voices import DEFAULT_VOICE


def test_synth_writes_a_wav_file_with_real_sizes(daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "hello.wav"
    done = edgectl("synth", "Hello from the command line.", "-o", str(out), socket_path=daemon.socket)
    assert done.returncode == 0, done.stderr
    data = out.read_bytes()
    assert data[:4] == b"RIFF"
    assert int.from_bytes(data[4:8], "little") == len(data) - 8
    assert int.from_bytes(data[40:44], "little") == len(data) - 44 > 22050  # over half a second


def test_synth_streams_pcm_to_stdout_and_reads_text_from_stdin(daemon: Daemon) -> None:
    done = edgectl("synth", "-", "--format", "pcm", socket_path=daemon.socket, stdin=b"Read from stdin.")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout) > 22050 and len(done.stdout) % 2 == 0 and done.stdout[:4] != b"RIFF"


def test_status_and_voices(daemon: Daemon) -> None:
    status = edgectl("status", socket_path=daemon.socket)
    assert status.returncode == 0 and b"READY" in status.stdout
    voices = edgectl("voices", "--json", socket_path=daemon.socket)
    assert voices.returncode == 0
    listing = json.loads(voices.stdout)
    assert listing["default"] in [v["id"] for v in listing["voices"]]


@pytest.mark.parametrize("command", [["status"], ["voices", "--json"], ["cache", "clear", "--tag", "none"]])
def test_reports_that_cannot_be_written_are_said_so(daemon: Daemon, command: list[str]) -> None:
    # As for audio (exit 2, one line), not a traceback with exit 1, which means the daemon refused.
    with open("/dev/full", "wb") as full:
        done = edgectl(*command, socket_path=daemon.socket, stdout=full)
    assert done.returncode == 2, done.stderr
    assert done.stderr.decode().strip() == "edgectl: cannot write standard output: No space left on device"
    closed = edgectl(*command, socket_path=daemon.socket, stdout=None, pass_fds=(), preexec_fn=lambda: os.close(1))
    assert closed.returncode == 2 and b"standard output is closed" in closed.stderr, closed.stderr


def test_audio_is_not_asked_for_when_standard_output_cannot_take_it(daemon: Daemon) -> None:
    # A closed standard output was found only once the daemon had started the synthesis; a
    # terminal would show the samples as garbage.
    before = daemon.status()["synthesis"]
    closed = edgectl("synth", "Hi.", socket_path=daemon.socket, stdout=None, pass_fds=(),
                     preexec_fn=lambda: os.close(1))
    assert closed.returncode == 2 and b"standard output is closed" in closed.stderr, closed.stderr
    leader, follower = pty.openpty()
    try:
        terminal = edgectl("synth", "Hi.", socket_path=daemon.socket, stdout=follower)
    finally:
        os.close(leader)
        os.close(follower)
    assert terminal.returncode == 2 and b"not writing audio to a terminal" in terminal.stderr, terminal.stderr
    assert daemon.status()["synthesis"] == before  # nothing was asked of the daemon


def test_daemon_errors_are_reported(daemon: Daemon, tmp_path: Path) -> None:
    done = edgectl("synth", "Hi.", "--voice", "xx_XX-nobody", "-o", str(tmp_path / "x.wav"),
                   socket_path=daemon.socket)
    assert done.returncode == 1 and b"unknown voice" in done.stderr


def test_clear_message_when_no_daemon_runs(tmp_path: Path) -> None:
    missing = edgectl("status", socket_path=tmp_path / "none.sock")
    assert missing.returncode == 3
    assert b"edged is not running: no socket at" in missing.stderr
    stale = tmp_path / "stale.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(stale))
    sock.close()
    refused = edgectl("--socket", str(stale), "voices", socket_path=tmp_path / "ignored.sock")
    assert refused.returncode == 3
    assert b"refuses connections" in refused.stderr


def test_synth_output_errors_are_clear_and_leave_no_file(daemon: Daemon, tmp_path: Path) -> None:
    done = edgectl("synth", "Hi.", "-o", str(tmp_path), socket_path=daemon.socket)
    assert done.returncode == 2 and b"is a directory" in done.stderr and b"Traceback" not in done.stderr
    # Not seekable: the streaming header stays, and the audio arrives whole.
    piped = edgectl("synth", "Into a pipe.", "-o", "/dev/stdout", socket_path=daemon.socket)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout[:4] == b"RIFF" and len(piped.stdout) > 22050
    assert list(tmp_path.iterdir()) == []


def test_a_body_the_daemon_refuses_early_gets_its_413(daemon: Daemon) -> None:
    # The daemon answers 413 from Content-Length, before the body is read (and may close while
    # edgectl still sends it): edgectl reports that answer, not an unreachable daemon.
    done = edgectl("synth", "-", socket_path=daemon.socket, stdin=b"hello " * 400_000)
    assert done.returncode == 1 and b"body_too_large" in done.stderr, done.stderr


def test_cache_clear_with_an_empty_filter_is_refused_not_everything(daemon: Daemon) -> None:
    done = edgectl("cache", "clear", "--tag", "", socket_path=daemon.socket)
    assert done.returncode == 1 and b"bad_request" in done.stderr


def test_audio_on_standard_output_leaves_what_came_before_it(daemon: Daemon, tmp_path: Path) -> None:
    # Sizes are put into the WAV header only in a file of edgectl's own: on standard output,
    # seeking to the header's place would write over the shell's earlier output.
    out = tmp_path / "both.bin"
    out.write_bytes(b"PREFIX")
    with open(out, "r+b") as shared:
        shared.seek(0, 2)
        done = edgectl("synth", "After a prefix.", socket_path=daemon.socket, stdout=shared)
    assert done.returncode == 0, done.stderr
    data = out.read_bytes()
    assert data.startswith(b"PREFIXRIFF") and len(data) > 22050


CUT_OFF = b"<the client closed before the whole answer was sent>"


def _answer_once(path: Path, status: str, body: bytes, content_type: str = "application/json",
                 length: int | None = None) -> tuple[threading.Thread, list[bytes]]:
    """A listener of the test's own at `path`: reads one request, records its body, answers
    (with a Content-Length of `length`, the body's own by default, then closes). CUT_OFF is
    recorded after the body if the client hung up before reading the whole answer."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    received: list[bytes] = []

    def answer() -> None:
        with listener:
            connection, _ = listener.accept()
            with connection:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += connection.recv(65536)
                head, request_body = data.split(b"\r\n\r\n", 1)
                # Not `length`: that name is the answer's (it was shadowed, and every answer was empty).
                request_length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                       if line.lower().startswith(b"content-length")), 0)
                while len(request_body) < request_length:
                    request_body += connection.recv(65536)
                received.append(request_body)
                try:
                    connection.sendall(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                                       f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
                                       .encode() + body)
                except (BrokenPipeError, ConnectionResetError):
                    received.append(CUT_OFF)

    thread = threading.Thread(target=answer)
    thread.start()
    return thread, received


def test_text_is_sent_as_utf8_not_escapes(tmp_path: Path) -> None:
    # An emoji escaped by json.dumps takes 12 bytes; text near the daemon's limits would then be
    # refused for its body size.
    path = tmp_path / "listener.sock"
    thread, received = _answer_once(path, "400 Bad Request",
                                    b'{"error": {"code": "bad_request", "message": "seen"}}')
    done = edgectl("synth", "\U0001F600 caf\u00e9", "-o", str(tmp_path / "x.wav"), socket_path=path)
    thread.join(30)
    assert done.returncode == 1 and b"seen" in done.stderr
    assert json.loads(received[0])["text"] == "\U0001F600 caf\u00e9"
    assert "\U0001F600".encode() in received[0] and b"\\u" not in received[0]


def test_an_answer_nested_too_deep_is_reported_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "listener.sock"
    thread, _ = _answer_once(path, "500 Internal Server Error", b"[" * 100_000)
    done = edgectl("status", socket_path=path)
    thread.join(30)
    assert done.returncode == 1 and b"Traceback" not in done.stderr, done.stderr


def test_an_answer_that_is_not_audio_or_ends_short_leaves_no_file(tmp_path: Path) -> None:
    # Something other than edged on the socket: what it sends is not passed off as audio.
    out = tmp_path / "x.wav"
    for content_type, length in (("text/plain", None), ("audio/wav", 1000)):
        path = tmp_path / f"{content_type.replace('/', '-')}.sock"
        thread, _ = _answer_once(path, "200 OK", b"RIFFhello", content_type, length)
        done = edgectl("synth", "Hi.", "-o", str(out), socket_path=path)
        thread.join(30)
        assert done.returncode == 1 and b"Traceback" not in done.stderr, done.stderr
        assert not out.exists() and not list(tmp_path.glob("*.part"))


def test_odd_answers_and_answers_without_end_are_reported_not_a_traceback(tmp_path: Path) -> None:
    # Another server on the socket: odd types, and answers larger than anything edged sends
    # (edgectl stops reading them, which the listener sees as a hang-up before its answer ended).
    huge = b'"' + b"x" * (16 * 2**20) + b'"'
    cases = [
        ("status", "200 OK", b'{"state": "READY", "version": "9", "pid": 1, "uptime_s": "soon", "admission": {}, "synthesis": {}}', b"Unknown format"),
        ("voices", "200 OK", b'{"voices": [{"id": "v", "version": "1", "state": "loaded", "providers": ["cpu"]}]}',
         b"AttributeError"),
        ("status", "200 OK", huge, b"answered over 4 MiB"),
        ("voices", "500 Internal Server Error", huge, b"(500 http)"),
    ]
    for n, (command, status, body, expected) in enumerate(cases):
        path = tmp_path / f"{n}.sock"
        thread, received = _answer_once(path, status, body)
        done = edgectl(command, socket_path=path)
        thread.join(30)
        assert done.returncode == 1 and b"Traceback" not in done.stderr, done.stderr[-2000:]
        assert expected in done.stderr, done.stderr[-2000:]
        assert (received[-1] == CUT_OFF) == (body is huge)


def test_a_socket_path_that_is_a_file_or_a_directory_is_named_so(daemon: Daemon, tmp_path: Path) -> None:
    regular = tmp_path / "edged.sock"
    regular.write_text("", encoding="utf-8")
    for path, kind in ((regular, b"a regular file"), (tmp_path, b"a directory")):
        done = edgectl("--socket", str(path), "voices", socket_path=daemon.socket)
        assert done.returncode == 3 and f"{path} is ".encode() + kind + b", not a socket" in done.stderr, done.stderr
    # An empty --socket (an unset variable in a script) is not given: $EDGED_SOCKET is used.
    empty = edgectl("--socket", "", "voices", socket_path=daemon.socket)
    assert empty.returncode == 0, empty.stderr


def test_cache_warm_reads_utf8_with_a_byte_order_mark_whatever_the_locale(
        daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Standard input was read in the locale's encoding: in a Latin-1 one, the BOM some editors
    # write became "\u00ef\u00bb\u00bf", the first line's voice was unknown and the whole batch refused.
    monkeypatch.setenv("PYTHONIOENCODING", "latin-1")  # as a non-UTF-8 locale sets it
    text = f"\ufeff{DEFAULT_VOICE}\tA phrase after a byte order mark.\n".encode()
    phrases = tmp_path / "bom.txt"
    phrases.write_bytes(text)
    for source, stdin in ((str(phrases), None), ("-", text)):
        done = edgectl("cache", "warm", source, socket_path=daemon.socket, stdin=stdin)
        assert done.returncode == 0, done.stderr
        assert b"warming 1/1 phrases, 0 failed" in done.stderr
    closed = edgectl("cache", "warm", "-", socket_path=daemon.socket, preexec_fn=lambda: os.close(0))
    assert closed.returncode == 2 and b"edgectl: standard input is closed" in closed.stderr, closed.stderr


@pytest.fixture(scope="module")
def odd_daemon(tmp_path_factory: pytest.TempPathFactory, bundle_dir: Path) -> Iterator[Daemon]:
    """A daemon with an invalid bundle in its search path and a short text limit."""
    root = tmp_path_factory.mktemp("odd")
    (root / "voices" / "en_US-bad-medium").mkdir(parents=True)
    (root / "voices" / "en_US-bad-medium" / "manifest.json").write_text('{"voice_id": "x"}', encoding="utf-8")
    config = f'[voices]\nsearch_path = ["{root / "voices"}"]\n[limits]\nmax_text_chars = 50\n'
    with Daemon(root / "d", config) as running:
        yield running


def test_an_invalid_bundle_is_listed_with_its_error(odd_daemon: Daemon) -> None:
    # /v1/voices lists it without a version or sample rate; that was a KeyError for both commands.
    for command in ("voices", "status"):
        done = edgectl(command, socket_path=odd_daemon.socket)
        assert done.returncode == 0, done.stderr
        assert re.search(rb"en_US-bad-medium invalid: \S", done.stdout), done.stdout
        assert DEFAULT_VOICE.encode() in done.stdout
    # Warm-up names the phrase whose voice it is, as it names an unknown voice's.
    warm = odd_daemon.request("POST", "/v1/cache/warm", {"phrases": ["Hi.", {"text": "Hi.", "voice": "en_US-bad-medium"}]})
    assert warm.status == 500 and warm.json()["error"]["message"].startswith("phrase 1: "), warm.body


def test_cache_warm_names_the_line_of_a_refused_phrase(odd_daemon: Daemon, tmp_path: Path) -> None:
    # The daemon names a phrase by its index in its batch (of at most 10,000), and blank and
    # comment lines are not phrases: edgectl names the line of the file, and says what was queued.
    lines = ["# greetings", "", *["Hi."] * 10_003, "", "Far too long for this daemon. " * 3]
    phrases = tmp_path / "phrases.txt"
    phrases.write_text("\n".join(lines) + "\n", encoding="utf-8")
    done = edgectl("cache", "warm", str(phrases), socket_path=odd_daemon.socket)
    assert done.returncode == 1, done.stderr
    assert f"line {len(lines)}: text has {len(lines[-1].strip())} characters".encode() in done.stderr, done.stderr
    assert b"the 10000 phrases of the lines before were queued already" in done.stderr


def _activated(directory: Path, listener: socket.socket) -> Daemon:
    """A daemon started on `listener` as systemd passes a socket (LISTEN_FDS=1): daemons started
    in turn serve the same socket, which stays open across a restart, as under socket activation."""
    daemon = Daemon(directory)
    env = {**os.environ, "XDG_CACHE_HOME": str(daemon.cache_dir.parent)}
    env.pop("CACHE_DIRECTORY", None)
    fd = listener.fileno()
    # The socket moved to fd 3 and exec'd, which keeps the pid that LISTEN_PID names.
    start = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.environ.update(LISTEN_PID=str(os.getpid()), "
             "LISTEN_FDS='1'); os.execv(sys.executable, [sys.executable, '-m', 'edged', 'serve', '--config', sys.argv[2]])")
    with open(daemon.log, "ab") as log:
        daemon.proc = subprocess.Popen([sys.executable, "-c", start, str(fd), str(daemon.config)],
                                       cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(fd,))
    daemon.socket = Path(listener.getsockname())
    return daemon


@pytest.mark.parametrize("socket_kept", [True, False], ids=["socket-activated", "own-socket"])
def test_cache_warm_stops_when_the_daemon_restarts(tmp_path: Path, bundle_dir: Path, socket_kept: bool) -> None:
    # The new daemon's warm-up counts start at 0 and never reach the old one's: edgectl polled
    # forever. Under socket activation the socket stays open across the restart; else the new
    # daemon binds the path again, which edgectl waits a little for.
    phrases = tmp_path / "phrases.txt"
    phrases.write_text("".join(f"Phrase number {n} to warm up.\n" for n in range(200)), encoding="utf-8")
    outcome: list[subprocess.CompletedProcess[bytes]] = []

    def warm(path: Path) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):  # killed then: `outcome` stays empty
            outcome.append(edgectl("cache", "warm", str(phrases), socket_path=path, timeout=40))

    with contextlib.ExitStack() as stack:
        if socket_kept:
            listener = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            listener.bind(str(tmp_path / "edged.sock"))
            listener.listen(64)

        def start(name: str) -> Daemon:
            if socket_kept:
                daemon = _activated(tmp_path / name, listener)
            else:
                daemon = Daemon(tmp_path / name)
                daemon.socket = tmp_path / "run" / "edged.sock"
                daemon.start()
            stack.callback(daemon.stop)
            return daemon

        first = start("first")
        first.wait_state("READY")
        warming = threading.Thread(target=warm, args=(first.socket,))
        warming.start()
        wait_for(lambda: first.status()["cache"]["warm"]["total"] == 200, timeout=30)
        assert first.stop() == 0
        second = start("second")
        warming.join(20)  # the new daemon answers its status while it loads its voice
        assert outcome and outcome[0].returncode == 1, outcome
        assert b"the daemon restarted; the warm-up was lost" in outcome[0].stderr
        second.wait_state("READY")
        assert second.stop() == 0


def test_cache_warm_names_the_line_of_a_phrase_for_an_unknown_voice(odd_daemon: Daemon, tmp_path: Path) -> None:
    phrases = tmp_path / "phrases.txt"
    phrases.write_text("Hi.\n# a comment\nnope\tHello.\n", encoding="utf-8")
    done = edgectl("cache", "warm", str(phrases), socket_path=odd_daemon.socket)
    assert done.returncode == 1, done.stderr
    assert f"{phrases} line 3: unknown voice 'nope'".encode() in done.stderr, done.stderr


def test_cache_warm_refuses_an_endless_file_instead_of_reading_it_all(tmp_path: Path) -> None:
    # /dev/zero (or `yes | edgectl cache warm -`) was read until memory ran out.
    done = edgectl("cache", "warm", "/dev/zero", socket_path=tmp_path / "no-daemon.sock")
    assert done.returncode == 2 and b"over 67108864 bytes" in done.stderr and b"Traceback" not in done.stderr
