"""The real daemon in a subprocess on a temporary socket, and small clients to talk to it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import pytest

from edged.bundle import MANIFEST_NAME, read_manifest
from edged.client import DaemonUnreachable, UnixConnection

REPO = Path(__file__).resolve().parent.parent
OTHER_VOICE = "en_US-other-medium"

SENTENCE = ("When you get home this evening, please remember to water the tomatoes and the herbs on the "
            "balcony, feed the cat before seven, and check whether the parcel from your sister has arrived.")
MEDIUM = ("The parcel you ordered on Monday was left with your neighbour at number twelve, "
          "because nobody was home, and she will keep it for you until the weekend.")
"""About five seconds of audio."""
LONG_TEXT = " ".join([SENTENCE] * 12)
"""About three minutes of audio: long enough that a stream is still running when a test acts."""


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Daemon:
    def __init__(self, directory: Path, config: str = "", env: dict[str, str] | None = None) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.socket = directory / "run" / "edged.sock"
        self.config = directory / "edged.toml"
        self.config.write_text(config, encoding="utf-8")
        self.log = directory / "edged.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def cache_dir(self) -> Path:
        """The audio cache's directory: private to this test directory (the default location
        under $XDG_CACHE_HOME, pointed here), so a daemon restarted on it finds its cache."""
        return self.directory / "xdg-cache" / "edged"

    def start(self) -> Daemon:
        env = dict(os.environ if self.env is None else self.env)
        env.pop("CACHE_DIRECTORY", None)
        env["XDG_CACHE_HOME"] = str(self.cache_dir.parent)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "edged", "serve", "--socket", str(self.socket), "--config", str(self.config)],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        return self

    def __enter__(self) -> Self:
        """Started and READY; stopped on leaving, where SIGTERM must end it with exit code 0."""
        self.start()
        try:
            self.wait_state("READY")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        code = self.stop()
        if exc_type is None:  # else the test's own failure is the one to report
            assert code == 0, f"exit code {code} on SIGTERM:\n{self.log_text()}"

    def wait_state(self, state: str = "READY", timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                health = self.get("/v1/health").json()
                if health["state"] == state:
                    return health
            except (OSError, DaemonUnreachable):
                pass
            time.sleep(0.02)
        raise AssertionError(f"daemon not {state} after {timeout} s:\n{self.log_text()}")

    def request(self, method: str, path: str, body: bytes | str | dict[str, Any] | None = None,
                headers: dict[str, str] | None = None, timeout: float = 60.0) -> Reply:
        if isinstance(body, dict):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode("utf-8")
        connection = UnixConnection(self.socket, timeout=timeout)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
        finally:
            connection.close()

    def get(self, path: str) -> Reply:
        return self.request("GET", path)

    def status(self) -> dict[str, Any]:
        return self.get("/v1/status").json()

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        sock.connect(str(self.socket))
        return sock

    def stop(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon did not stop on SIGTERM:\n{self.log_text()}") from None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def post_raw(body: bytes | dict[str, Any], path: str = "/v1/synthesize") -> bytes:
    """A request written by hand, for a client that behaves badly on purpose (a dict is sent as JSON)."""
    if isinstance(body, dict):
        body = json.dumps(body).encode("utf-8")
    return (f"POST {path} HTTP/1.1\r\nHost: edged\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def read_head(sock: socket.socket) -> tuple[int, bytes]:
    """The status of a response and its body when it has a Content-Length (an error); for a
    streamed one, whatever body bytes came with its headers."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock, data)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    while length and len(rest) < int(length.group(1)):  # the body may come in a later packet
        rest += _recv(sock, data + rest)
    return int(head.split(b" ", 2)[1]), rest


def _recv(sock: socket.socket, so_far: bytes) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise AssertionError(f"connection closed early: {so_far[:300]!r}")
    return chunk


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def install_as(voices: Path, bundle_dir: Path, voice_id: str, manifest_id: str | None = None,
               skip: tuple[str, ...] = ()) -> Path:
    """The default bundle installed again as `voices/voice_id`: its files linked (but those in
    `skip`), its manifest a copy naming `manifest_id` (default: `voice_id`). Returns the bundle."""
    bundle = voices / voice_id
    bundle.mkdir(parents=True, exist_ok=True)
    for file in bundle_dir.iterdir():
        if file.name not in (MANIFEST_NAME, *skip) and not (bundle / file.name).exists():
            (bundle / file.name).symlink_to(file)
    manifest = json.loads((bundle_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    (bundle / MANIFEST_NAME).write_text(json.dumps({**manifest, "voice_id": manifest_id or voice_id}),
                                        encoding="utf-8")
    return bundle


def default_graph(bundle_dir: Path, graph: str) -> str:
    """The file name of the bundle's `graph` ("front" or "back") at its default precision: the one
    a load opens and checks. The builder picks that precision by measuring int8 on the building
    machine (fp32 where int8 loses), so a test that damages a graph must damage this one."""
    manifest = read_manifest(bundle_dir)
    return manifest.graphs[manifest.default_precision][graph]


def other_voice(root: Path, bundle_dir: Path) -> Path:
    """The default bundle installed a second time as OTHER_VOICE under root/voices (a daemon loads
    it on first use only); returns that voices directory."""
    install_as(root / "voices", bundle_dir, OTHER_VOICE)
    return root / "voices"


def edgectl(*args: str, socket_path: Path, stdin: bytes | None = None, **run: Any) -> subprocess.CompletedProcess[bytes]:
    """edgectl as a user runs it ($EDGED_SOCKET pointing at `socket_path`); `run` goes to subprocess.run."""
    env = {**os.environ, "EDGED_SOCKET": str(socket_path)}  # honoured when --socket is not given
    options: dict[str, Any] = {"timeout": 60, "stderr": subprocess.PIPE, **run}
    options.setdefault("stdout", subprocess.PIPE)
    return subprocess.run([sys.executable, "-c", "import sys; from edged.client import main; sys.exit(main())",
                           *args], check=False, cwd=REPO, env=env, input=stdin, **options)


def as_user_without_override(command: list[str]) -> list[str]:
    """`command` run so that file permissions bind it: as it is for a user, and for root through
    setpriv without the capabilities that override them (the test is skipped without setpriv)."""
    if os.geteuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run as root without CAP_DAC_OVERRIDE")
    caps = "-dac_override,-dac_read_search,-fowner"
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps, *command]
