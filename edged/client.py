"""`edgectl`: talk to a running edged over its Unix socket (standard library only, for a fast start).

    edgectl synth "Hello." -o hello.wav      # or to stdout: edgectl synth "Hello." | aplay
    edgectl status [--json]
    edgectl voices [--json]
    edgectl cache clear [--voice V [--version X]] [--tag T]   # nothing given: everything
    edgectl cache warm FILE                                   # a phrase a line, or voice<TAB>text

The socket is --socket, else $EDGED_SOCKET, else the daemon's default path.
"""

from __future__ import annotations

import argparse
import errno
import http.client
import json
import os
import re
import socket
import stat
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .cliio import (
    InputError,
    Interrupted,
    OutputError,
    check_writable,
    interrupted_by_signals,
    open_output,
    output_path,
    print_report,
    read_text,
)
from .config import default_socket_path, named_socket
from .messages import (
    CONTENT_TYPES,
    MAX_WARM_FILE_BYTES,
    MAX_WARM_PHRASES,
    Phrase,
    parse_phrase_lines,
)

CHUNK = 64 * 1024
WARM_POLL_S = 0.25
RESTART_WAIT_S = 5.0
"""How long `cache warm` asks again a daemon that stopped answering, for one restarted in its place."""
WARM_BATCH_BYTES = 1_000_000
"""Under the daemon's default body limit (limits.max_body_bytes, 1.25 MiB)."""
MAX_ERROR_BYTES = 64 * 1024
MAX_JSON_BYTES = 4 * 2**20
"""What is read of an error or a JSON answer: something else on the socket may send without end."""


class DaemonUnreachable(Exception):
    """No daemon answers on the socket; the message says why and what to do."""


class UnexpectedAnswer(Exception):
    """The daemon's answer is not what this edgectl knows (another version?)."""


class DaemonError(Exception):
    """The daemon answered with an error ({"error": {"code", "message"}})."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{message} ({status} {code})")
        self.status = status
        self.code = code
        self.message = message


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float | None = 60.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.path))
        except OSError as exc:
            sock.close()
            raise DaemonUnreachable(_why_unreachable(self.path, exc)) from None
        self.sock = sock


def _why_unreachable(path: Path, exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return (f"edged is not running: no socket at {path} "
                "(start it with `edged serve` or `systemctl start edged`)")
    if isinstance(exc, PermissionError):
        return f"no permission to use {path} (join the daemon's group, or run as its user)"
    if exc.errno in (errno.ECONNREFUSED, errno.ENOTSOCK):
        try:  # a wrong --socket (a file, a directory) is refused like a daemon's stale socket
            mode = path.stat().st_mode
        except OSError:
            mode = stat.S_IFSOCK
        if not stat.S_ISSOCK(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "a special file"
            return f"{path} is {kind}, not a socket (give the daemon's socket with --socket or $EDGED_SOCKET)"
        if exc.errno == errno.ECONNREFUSED:
            return (f"edged is not answering: {path} refuses connections "
                    "(the daemon is stopping, or stopped and left its socket)")
    return f"cannot connect to {path}: {exc.strerror or exc}"


def _json_bytes(body: Any) -> bytes:
    """UTF-8, not \\u escapes: an emoji is 4 bytes instead of 12 (the daemon limits bytes too).
    Lone surrogates (from arguments that were not UTF-8) are escaped, for the daemon to refuse."""
    try:
        return json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(body).encode("ascii")


def request(path: Path, method: str, url: str, body: Any = None) -> http.client.HTTPResponse:
    """Send one request; raise DaemonError for an error status (the body is consumed then)."""
    connection = UnixConnection(path)
    data = None if body is None else _json_bytes(body)
    headers = {"Content-Type": "application/json"} if data is not None else {}
    try:
        try:
            connection.request(method, url, body=data, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon may have refused the request early (413) and closed: read its answer
        response = connection.getresponse()
    except (http.client.HTTPException, ConnectionError, TimeoutError) as exc:
        raise DaemonUnreachable(f"edged at {path} did not answer: {exc or type(exc).__name__}") from None
    if response.status >= 400:
        raw = response.read(MAX_ERROR_BYTES)  # past it, the text is cut short like a non-JSON one
        try:
            error = json.loads(raw)["error"]
            raise DaemonError(response.status, error["code"], error["message"])
        except (ValueError, KeyError, TypeError, RecursionError):
            raise DaemonError(response.status, "http", raw.decode("utf-8", "replace").strip()[:500]) from None
    return response


def get_json(path: Path, url: str, method: str = "GET", body: Any = None) -> Any:
    raw = request(path, method, url, body).read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise UnexpectedAnswer(f"{url} answered over {MAX_JSON_BYTES >> 20} MiB; not reading more")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise UnexpectedAnswer(f"{url} did not answer JSON: {raw[:200]!r}") from None


# -- commands -----------------------------------------------------------------------------------

def _synth(args: argparse.Namespace) -> int:
    check_writable(args.output)  # before the daemon does the work
    body: dict[str, Any] = {"text": read_text(args.text), "format": args.format, "speed": args.speed}
    if args.voice is not None:
        body["voice"] = args.voice
    response = request(args.socket, "POST", "/v1/synthesize", body)
    content_type = response.getheader("content-type", "")
    if content_type != CONTENT_TYPES[args.format]:
        raise UnexpectedAnswer(f"the answer is {content_type or 'untyped'}, not {args.format} audio")
    with open_output(args.output) as out:
        # Copied as it arrives, so that a player reading standard output starts at once.
        while chunk := response.read1(CHUNK):
            out.write(chunk)
        if response.length:  # a body of known length that ended short (edged streams chunked)
            raise http.client.IncompleteRead(b"", response.length)
        if args.format == "wav":
            out.finish_wav()
    return 0


def _status(args: argparse.Namespace) -> int:
    status = get_json(args.socket, "/v1/status")
    print_report([json.dumps(status, indent=2)] if args.json else _status_lines(status))
    return 0


def _status_lines(status: dict[str, Any]) -> list[str]:
    admission, synthesis = status["admission"], status["synthesis"]
    process = status.get("process", {})
    lines = [(f"state      {status['state']} (edged {status['version']}, pid {status['pid']}, "
              f"up {status['uptime_s']:.0f} s)")]
    lines += [f"voice      {_voice_line(voice)}" for voice in status["voices"]]
    lines.append(f"requests   {admission['active']}/{admission['capacity']} running, "
                 f"{admission['waiting']}/{admission['queue_size']} waiting, {admission['rejected']} refused busy")
    lines.append(f"synthesis  {synthesis['completed']} completed, {synthesis['cancelled']} cancelled, "
                 f"{synthesis['failed']} failed")
    if process:
        lines.append(f"memory     {process.get('rss_mb', 0):.0f} MiB resident "
                     f"({process.get('anon_mb', 0):.0f} anonymous, {process.get('file_mb', 0):.0f} file), "
                     f"{process.get('threads', 0):.0f} threads")
    cache = status.get("cache", {})
    if cache.get("open"):
        lines.append(f"cache      memory {cache['memory_hits']} hits / {cache['memory_misses']} misses, "
                     f"{cache['memory_bytes'] / 2**20:.1f} MiB; disk {cache['disk_state']} {cache['disk_hits']} hits, "
                     f"{cache['disk_entries']} entries, {cache['disk_bytes'] / 2**20:.1f} MiB; "
                     f"warm {cache['warm']['done']}/{cache['warm']['total']}")
    elif "cache" in status:
        lines.append("cache      off")
    return lines


def _voices(args: argparse.Namespace) -> int:
    listing = get_json(args.socket, "/v1/voices")
    print_report([json.dumps(listing, indent=2)] if args.json else [_voice_line(v) for v in listing["voices"]])
    return 0


def _voice_line(voice: dict[str, Any]) -> str:
    line = voice["id"]
    if "version" in voice:  # an invalid bundle has none (nor a sample rate): only its error
        line += f" {voice['version']} {voice.get('sample_rate', '?')} Hz"
    line += f" {voice.get('state', '?')}"
    if voice.get("default"):
        line += " (default)"
    if voice.get("providers"):
        line += f" {voice.get('precision', '')} " + ", ".join(f"{g}={p}" for g, p in voice["providers"].items())
    if voice.get("error"):
        line += f": {voice['error']}"
    return line


def _cache_clear(args: argparse.Namespace) -> int:
    scope = {k: v for k, v in (("voice", args.voice), ("version", args.version), ("tag", args.tag))
             if v is not None}
    url = "/v1/cache" + (f"?{urllib.parse.urlencode(scope)}" if scope else "")
    result = get_json(args.socket, url, "DELETE")
    what = ", ".join(f"{k} {v}" for k, v in scope.items()) or "everything"
    cleared_all = result.get("scope", {}).get("all")
    if scope and cleared_all:
        what += " (the daemon cleared everything: too many scopes were cleared one by one)"
    swept = result.get("disk_swept")
    on_disk = f"{result['disk_dropped']} deleted on disk" if swept else "stale on disk (removed when next read)"
    print_report([f"cleared {what}: {result['memory_dropped']} in memory, {on_disk}"
                  + ("" if result.get("persisted", True) else " (not persisted: holds until restart)")])
    return 0


def _cache_warm(args: argparse.Namespace) -> int:
    from_stdin = str(args.file) == "-"
    if from_stdin and sys.stdin is None:  # started with it closed (<&-)
        raise InputError("standard input is closed")
    try:  # bytes, whatever the locale: UTF-8 (a byte order mark is dropped by parse_phrase_lines)
        with sys.stdin.buffer if from_stdin else args.file.open("rb") as stream:
            raw = stream.read(MAX_WARM_FILE_BYTES + 1)  # /dev/zero or `yes` would fill memory
        if len(raw) > MAX_WARM_FILE_BYTES:
            raise ValueError(f"over {MAX_WARM_FILE_BYTES} bytes")
        phrases = parse_phrase_lines(raw.decode("utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        print(f"edgectl: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    if not phrases:
        print("edgectl: no phrases to warm", file=sys.stderr)
        return 2
    pid = get_json(args.socket, "/v1/status")["pid"]
    start, failed_before, target = _queue_phrases(args.socket, args.file, phrases)
    return _follow_warm_up(args.socket, pid, start, failed_before, target, len(phrases))


def _queue_phrases(path: Path, file: Path, phrases: list[Phrase]) -> tuple[int, int, int]:
    """Send the phrases in batches; the daemon's warm-up figures before them (total, failed) and
    the total that means they are all done."""
    entries = [{"text": p.text, **({"voice": p.voice} if p.voice else {})} for p in phrases]
    start = failed_before = target = None
    sent = 0
    for batch in _warm_batches(entries):
        try:
            answer = _queue_warm(path, batch)
        except DaemonError as exc:  # errors name a file's line, not an index in a batch
            where = re.match(r"phrase (\d+): ", exc.message)
            message = exc.message
            if where and sent + int(where[1]) < len(phrases):
                message = f"{file} line {phrases[sent + int(where[1])].line}: {message[where.end():]}"
            if sent:
                message += f"; the {sent} phrases of the lines before were queued already"
            raise DaemonError(exc.status, exc.code, message) from None
        sent += len(batch)
        if start is None:  # the daemon's warm-up progress before ours
            start, failed_before = answer["warm"]["total"] - answer["queued"], answer["warm"]["failed"]
        target = answer["warm"]["total"]
    assert start is not None and target is not None and failed_before is not None
    return start, failed_before, target


def _follow_warm_up(path: Path, pid: int, start: int, failed_before: int, target: int, phrases: int) -> int:
    """Show progress until the daemon has done `target` phrases; 1 if any of ours failed."""
    tty, unreachable_since = sys.stderr.isatty(), None
    while True:
        try:
            status = get_json(path, "/v1/status")
            unreachable_since = None
        except DaemonUnreachable as exc:  # stopping: a restarted daemon is told by its pid, give it time
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > RESTART_WAIT_S:
                raise DaemonUnreachable(f"{exc}; the warm-up was lost") from None
            time.sleep(WARM_POLL_S)
            continue
        # A new daemon (socket activation keeps the socket across a restart) never reaches our target.
        if status["pid"] != pid or status["cache"]["warm"]["total"] < target:
            print("\n" * tty + "edgectl: the daemon restarted; the warm-up was lost", file=sys.stderr)
            return 1
        warm = status["cache"]["warm"]
        done, failed = min(max(warm["done"] - start, 0), phrases), warm["failed"] - failed_before
        if tty or warm["done"] >= target:
            print(f"\rwarming {done}/{phrases} phrases, {failed} failed", end="", file=sys.stderr, flush=True)
        if warm["done"] >= target:
            print(file=sys.stderr)
            return 1 if failed else 0
        time.sleep(WARM_POLL_S)


def _queue_warm(path: Path, batch: list[dict[str, str]]) -> Any:
    while True:
        try:
            return get_json(path, "/v1/cache/warm", "POST", {"phrases": batch})
        except DaemonError as exc:
            if exc.code != "busy":  # e.g. not_ready (no cache): asking again would not help
                raise
            time.sleep(WARM_POLL_S)  # the daemon's warm-up queue is full: wait for room


def _warm_batches(entries: list[dict[str, str]]) -> Iterator[list[dict[str, str]]]:
    """Requests the daemon takes: at most MAX_WARM_PHRASES phrases and WARM_BATCH_BYTES each."""
    batch: list[dict[str, str]] = []
    size = 0
    for entry in entries:
        entry_size = len(_json_bytes(entry)) + 1
        if batch and (len(batch) == MAX_WARM_PHRASES or size + entry_size > WARM_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry_size
    if batch:
        yield batch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgectl", description="Control a running edged.")
    parser.add_argument("--socket", default=None,
                        help="daemon socket (default: $EDGED_SOCKET, else the daemon's default path)")
    commands = parser.add_subparsers(dest="command", required=True)

    synth = commands.add_parser("synth", help="synthesize TEXT to a file or stdout")
    synth.add_argument("text", help="text to speak, or - to read it from stdin")
    synth.add_argument("-o", "--output", type=output_path, help="file to write (default: stdout)")
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

    cache = commands.add_parser("cache", help="clear or warm the daemon's audio cache (root, the daemon's user or admin group)")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True)
    clear = cache_commands.add_parser("clear", help="drop cached audio: of a voice, a version, a tag, or all")
    clear.add_argument("--voice", help="only this voice id's audio")
    clear.add_argument("--version", help="only this version of --voice")
    clear.add_argument("--tag", help="only audio requested with this tag (with --voice: of that voice)")
    clear.set_defaults(run=_cache_clear)
    warm = cache_commands.add_parser("warm", help="synthesize the phrases of FILE that are not cached yet")
    warm.add_argument("file", type=Path, help="a phrase a line (or voice<TAB>text; # starts a comment line); - for stdin")
    warm.set_defaults(run=_cache_warm)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # An empty --socket (an unset variable in a script) means not given, not the current directory.
    args.socket = named_socket(Path(args.socket) if args.socket else None, os.environ) or default_socket_path(os.environ)
    try:
        with interrupted_by_signals():
            return int(args.run(args))
    except DaemonUnreachable as exc:
        print(f"edgectl: {exc}", file=sys.stderr)
        return 3
    except DaemonError as exc:
        print(f"edgectl: {exc}", file=sys.stderr)
        return 1
    except (InputError, OutputError) as exc:
        print(f"edgectl: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # whoever read our standard output went away
        return 0
    except (http.client.HTTPException, ConnectionError, TimeoutError) as exc:  # e.g. IncompleteRead
        print(f"edgectl: the daemon's answer broke off: {exc!r}", file=sys.stderr)
        return 1
    except (UnexpectedAnswer, KeyError, TypeError, ValueError, AttributeError) as exc:  # another edged version, or not edged
        print(f"edgectl: unexpected answer from the daemon: {exc!r}", file=sys.stderr)
        return 1
    except Interrupted as exc:
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130
