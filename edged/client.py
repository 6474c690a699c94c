"""`edgectl`: talk to a running edged over its Unix socket (standard library only, for a fast start).

    edgectl synth "Hello." -o hello.wav      # or to stdout: edgectl synth "Hello." | aplay
    edgectl status [--json]
    edgectl voices [--json]

The socket is --socket, else $EDGED_SOCKET, else the daemon's default path.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, BinaryIO

from .config import default_socket_path

CHUNK = 64 * 1024


class DaemonUnreachable(Exception):
    """No daemon answers on the socket; the message says why and what to do."""


class DaemonError(Exception):
    """The daemon answered with an error ({"error": {"code", "message"}})."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{message} ({status} {code})")
        self.status = status
        self.code = code


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float | None = 60.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.path))
        except FileNotFoundError:
            sock.close()
            raise DaemonUnreachable(f"edged is not running: no socket at {self.path} "
                                    "(start it with `edged serve` or `systemctl start edged`)") from None
        except ConnectionRefusedError:
            sock.close()
            raise DaemonUnreachable(f"edged is not running: {self.path} refuses connections "
                                    "(a stale socket left by a daemon that stopped?)") from None
        except PermissionError:
            sock.close()
            raise DaemonUnreachable(f"no permission to use {self.path} "
                                    "(join the daemon's group, or run as its user)") from None
        except OSError as exc:
            sock.close()
            raise DaemonUnreachable(f"cannot connect to {self.path}: {exc.strerror or exc}") from None
        self.sock = sock


def request(path: Path, method: str, url: str, body: Any = None) -> http.client.HTTPResponse:
    """Send one request; raise DaemonError for an error status (the body is consumed then)."""
    connection = UnixConnection(path)
    data = None if body is None else json.dumps(body).encode("utf-8")
    headers = {"Content-Type": "application/json"} if data is not None else {}
    try:
        connection.request(method, url, body=data, headers=headers)
        response = connection.getresponse()
    except (http.client.HTTPException, ConnectionError, TimeoutError) as exc:
        raise DaemonUnreachable(f"edged at {path} did not answer: {exc or type(exc).__name__}") from None
    if response.status >= 400:
        raw = response.read()
        try:
            error = json.loads(raw)["error"]
            raise DaemonError(response.status, error["code"], error["message"])
        except (ValueError, KeyError, TypeError):
            raise DaemonError(response.status, "http", raw.decode("utf-8", "replace").strip()) from None
    return response


def get_json(path: Path, url: str) -> Any:
    return json.loads(request(path, "GET", url).read())


# -- commands -----------------------------------------------------------------------------------

def _synth(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    body: dict[str, Any] = {"text": text, "format": args.format, "speed": args.speed}
    if args.voice:
        body["voice"] = args.voice
    if args.output is None and sys.stdout.isatty():
        print("edgectl: not writing audio to a terminal; give -o FILE or redirect stdout", file=sys.stderr)
        return 2
    response = request(args.socket, "POST", "/v1/synthesize", body)
    if args.output is None:
        _copy(response, sys.stdout.buffer)
        return 0
    with open(args.output, "wb") as out:
        size = _copy(response, out)
        if args.format == "wav" and size >= 44:
            _fix_wav_sizes(out, size)
    return 0


def _copy(response: http.client.HTTPResponse, out: BinaryIO) -> int:
    """Copy audio as it arrives (so a player on stdout starts at once); returns the byte count."""
    size = 0
    while chunk := response.read1(CHUNK):
        out.write(chunk)
        out.flush()
        size += len(chunk)
    return size


def _fix_wav_sizes(out: BinaryIO, size: int) -> None:
    """A streamed WAV header carries no sizes; a finished file can have the real ones."""
    out.seek(4)
    out.write((size - 8).to_bytes(4, "little"))
    out.seek(40)
    out.write((size - 44).to_bytes(4, "little"))


def _status(args: argparse.Namespace) -> int:
    status = get_json(args.socket, "/v1/status")
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    admission, synthesis = status["admission"], status["synthesis"]
    process = status.get("process", {})
    print(f"state      {status['state']} (edged {status['version']}, pid {status['pid']}, "
          f"up {status['uptime_s']:.0f} s)")
    for voice in status["voices"]:
        print(f"voice      {_voice_line(voice)}")
    print(f"requests   {admission['active']}/{admission['capacity']} running, "
          f"{admission['waiting']}/{admission['queue_size']} waiting, {admission['rejected']} refused busy")
    print(f"synthesis  {synthesis['completed']} completed, {synthesis['cancelled']} cancelled, "
          f"{synthesis['failed']} failed")
    if process:
        print(f"memory     {process.get('rss_mb', 0):.0f} MiB resident "
              f"({process.get('anon_mb', 0):.0f} anonymous, {process.get('file_mb', 0):.0f} file), "
              f"{process.get('threads', 0):.0f} threads")
    return 0


def _voices(args: argparse.Namespace) -> int:
    listing = get_json(args.socket, "/v1/voices")
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    for voice in listing["voices"]:
        print(_voice_line(voice))
    return 0


def _voice_line(voice: dict[str, Any]) -> str:
    line = f"{voice['id']} {voice['version']} {voice['sample_rate']} Hz {voice['state']}"
    if voice.get("default"):
        line += " (default)"
    if voice.get("providers"):
        line += f" {voice.get('precision', '')} " + ", ".join(f"{g}={p}" for g, p in voice["providers"].items())
    return line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgectl", description="Control a running edged.")
    parser.add_argument("--socket", type=Path, default=None,
                        help="daemon socket (default: $EDGED_SOCKET, else the daemon's default path)")
    commands = parser.add_subparsers(dest="command", required=True)

    synth = commands.add_parser("synth", help="synthesize TEXT to a file or stdout")
    synth.add_argument("text", help="text to speak, or - to read it from stdin")
    synth.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    synth.add_argument("--voice", help="voice id (default: the daemon's)")
    synth.add_argument("--speed", type=float, default=1.0, help="speaking rate (2.0 = twice as fast)")
    synth.add_argument("--format", choices=["wav", "pcm"], default="wav", help="pcm: 16-bit mono, no header")
    synth.set_defaults(run=_synth)

    status = commands.add_parser("status", help="the daemon's state, voices, queues and memory")
    status.add_argument("--json", action="store_true", help="the raw /v1/status JSON")
    status.set_defaults(run=_status)

    voices = commands.add_parser("voices", help="installed voices")
    voices.add_argument("--json", action="store_true", help="the raw /v1/voices JSON")
    voices.set_defaults(run=_voices)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.socket is None:
        args.socket = default_socket_path(os.environ)
    try:
        return int(args.run(args))
    except DaemonUnreachable as exc:
        print(f"edgectl: {exc}", file=sys.stderr)
        return 3
    except DaemonError as exc:
        print(f"edgectl: {exc}", file=sys.stderr)
        return 1
    except http.client.HTTPException as exc:  # e.g. IncompleteRead: the stream broke off
        print(f"edgectl: the daemon's answer broke off: {exc!r}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130
