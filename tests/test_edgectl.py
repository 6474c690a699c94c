"""edgectl against the real daemon, run as a command the way a user runs it."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

from daemon_harness import Daemon, edgectl


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


def _answer_once(path: Path, status: str, body: bytes, content_type: str = "application/json",
                 length: int | None = None) -> tuple[threading.Thread, list[bytes]]:
    """A listener of the test's own at `path`: reads one request, records its body, answers
    (with a Content-Length of `length`, the body's own by default, then closes)."""
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
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                while len(request_body) < length:
                    request_body += connection.recv(65536)
                received.append(request_body)
                connection.sendall(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                                   f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
                                   .encode() + body)

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
