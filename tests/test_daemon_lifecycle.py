"""The daemon's life: socket hygiene, loading, overload, SIGTERM (each test runs its own daemon)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from daemon_harness import (
    LONG_TEXT,
    MEDIUM,
    OTHER_VOICE,
    REPO,
    Daemon,
    Reply,
    as_user_without_override,
    default_graph,
    install_as,
    other_voice,
    post_raw,
    read_head,
    wait_for,
)


def test_socket_is_made_private_and_a_live_daemon_is_not_taken_over(tmp_path: Path, bundle_dir: Path) -> None:
    with Daemon(tmp_path / "a") as first:
        assert stat.S_IMODE(first.socket.stat().st_mode) == 0o660
        second = Daemon(tmp_path / "b")
        second.socket = first.socket
        second.start()
        assert second.proc is not None and second.proc.wait(30) == 2
        assert "another edged is running" in second.log_text()
        assert first.get("/v1/health").json()["state"] == "READY"  # still ours, still serving
    assert not first.socket.exists()  # removed on stop


def test_a_daemon_stopping_leaves_a_socket_bound_after_its_own(tmp_path: Path, bundle_dir: Path) -> None:
    # Its directory removed (a clean-up of /run) and a second daemon started on the same path:
    # the first one's exit removed the second's socket, and the second's clients lost it.
    with Daemon(tmp_path / "a") as first:
        shutil.rmtree(first.socket.parent)
        second = Daemon(tmp_path / "b")
        second.socket = first.socket
        with second:
            assert first.stop() == 0
            assert second.get("/v1/health").status == 200
        assert not second.socket.exists()  # its own is removed on stop


def test_a_fifo_where_the_lock_file_goes_is_refused_not_waited_on(tmp_path: Path) -> None:
    # Anyone who may write in the socket's directory could make one: the start blocked opening
    # it for good, and SIGTERM could not stop it.
    daemon = Daemon(tmp_path)
    daemon.socket.parent.mkdir()
    os.mkfifo(daemon.socket.with_name("edged.sock.lock"))
    daemon.start()
    assert daemon.proc is not None and daemon.proc.wait(30) == 2
    assert "edged.sock.lock exists and is not a regular file" in daemon.log_text()


def test_stale_socket_file_is_replaced(tmp_path: Path, bundle_dir: Path) -> None:
    daemon = Daemon(tmp_path)
    daemon.socket.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(daemon.socket))  # a socket file nobody listens on, as a crash leaves it
    stale.close()
    daemon.start()
    try:
        daemon.wait_state("READY")
        assert daemon.get("/v1/health").status == 200
    finally:
        assert daemon.stop() == 0


def test_requests_for_a_loading_voice_wait_a_bounded_time_then_get_503(tmp_path: Path, bundle_dir: Path) -> None:
    # A second installed voice (the same bundle under another id) loads on its first request;
    # loading takes far longer than the 1 ms that requests may wait here.
    voices = other_voice(tmp_path, bundle_dir)
    config = f'[pipeline]\nloading_wait_s = 0.001\n[voices]\nsearch_path = ["{voices}"]\n'
    with Daemon(tmp_path / "d", config) as daemon:
        body = {"text": "Hello.", "voice": OTHER_VOICE}
        reply = daemon.request("POST", "/v1/synthesize", body)
        assert reply.status == 503 and reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "not_ready"
        voices_listed = {v["id"]: v["state"] for v in daemon.get("/v1/voices").json()["voices"]}
        assert voices_listed[OTHER_VOICE] in ("loading", "loaded")
        wait_for(lambda: daemon.request("POST", "/v1/synthesize", body).status == 200, timeout=30, interval=0.2)


def test_overload_is_refused_at_once_and_service_resumes(tmp_path: Path, bundle_dir: Path) -> None:
    with Daemon(tmp_path, "[pipeline]\nmax_active = 1\nqueue_size = 1\n") as daemon:
        statuses = []
        with contextlib.ExitStack() as closing:
            clients = [closing.enter_context(daemon.connect()) for _ in range(8)]
            for i, sock in enumerate(clients):  # 8 requests at once against room for 1 running + 1 waiting
                text = f"{MEDIUM} Copy {i}."  # distinct: identical ones would share one synthesis (the cache)
                sock.sendall(post_raw({"text": text, "format": "pcm"}))
            for sock in clients:
                status, body = read_head(sock)
                statuses.append(status)
                if status == 503:
                    assert json.loads(body)["error"]["code"] == "busy"
        assert sorted(statuses) == [200, 200] + [503] * 6
        status = daemon.status()
        assert status["admission"]["rejected"] == 6
        # After the burst (the two admitted streams were dropped by their clients) all is normal.
        reply = daemon.request("POST", "/v1/synthesize", {"text": "Back to normal."})
        assert reply.status == 200 and len(reply.body) > 44


def test_connections_over_the_limit_get_a_json_busy_and_service_resumes(tmp_path: Path, bundle_dir: Path) -> None:
    with Daemon(tmp_path, "[server]\nmax_connections = 2\n") as daemon:
        with contextlib.ExitStack() as closing:
            idle = [closing.enter_context(daemon.connect()) for _ in range(2)]  # connected, silent
            wait_for(lambda: daemon.request("GET", "/v1/voices").status == 503)
            reply = daemon.request("GET", "/v1/voices")
            assert reply.headers["content-type"].startswith("application/json")
            assert reply.json()["error"]["code"] == "busy" and "retry-after" in reply.headers
            # Its supervisor can still ask how it is doing, refusals counted.
            assert daemon.request("GET", "/v1/health").status == 200
            status = daemon.request("GET", "/v1/status").json()
            assert status["state"] == "READY" and status["admission"]["connections_refused"] >= 2
            assert "edged_connections_refused_total" in daemon.request("GET", "/metrics").body.decode()
            assert len(idle) == 2
        wait_for(lambda: daemon.request("GET", "/v1/voices").status == 200)  # once they are gone


def test_sigterm_finishes_inflight_requests_and_exits_0(tmp_path: Path, bundle_dir: Path) -> None:
    daemon = Daemon(tmp_path).start()
    daemon.wait_state("READY")
    replies: list[Reply] = []
    started = threading.Event()

    def long_request() -> None:
        started.set()
        replies.append(daemon.request("POST", "/v1/synthesize", {"text": MEDIUM * 2, "format": "pcm"}))

    worker = threading.Thread(target=long_request)
    worker.start()
    started.wait()
    wait_for(lambda: daemon.status()["admission"]["active"] == 1)
    assert daemon.stop() == 0
    worker.join(30)
    # The request in flight got all of its audio (an incomplete chunked body would have raised).
    assert replies and replies[0].status == 200
    assert len(replies[0].body) / 2 / 22050 > 10
    assert not daemon.socket.exists()
    assert "DRAINING" in daemon.log_text()


def test_sighup_while_the_daemon_exits_does_not_kill_it(tmp_path: Path, bundle_dir: Path) -> None:
    # The loop's handlers were removed before the exit ended: a SIGHUP (reload, not built yet) in
    # those milliseconds got the default action, death, and the socket file was left behind.
    daemon = Daemon(tmp_path).start()
    daemon.wait_state("READY")
    assert daemon.proc is not None
    stop_hups = threading.Event()

    def hangups() -> None:
        while not stop_hups.is_set() and daemon.proc is not None and daemon.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(daemon.proc.pid, signal.SIGHUP)
            time.sleep(0.0005)

    sender = threading.Thread(target=hangups)
    sender.start()
    try:
        assert daemon.stop() == 0, daemon.log_text()
    finally:
        stop_hups.set()
        sender.join()
    assert not daemon.socket.exists()


def test_signals_edged_has_no_use_for_are_logged_not_fatal(tmp_path: Path, bundle_dir: Path) -> None:
    # SIGUSR1 ("reopen your logs", by habit) killed it, leaving its socket file behind.
    with Daemon(tmp_path) as daemon:
        assert daemon.proc is not None
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            os.kill(daemon.proc.pid, sig)
        wait_for(lambda: all(f"{name} " in daemon.log_text() or f"{name}:" in daemon.log_text()
                             for name in ("SIGUSR1", "SIGUSR2", "SIGHUP")))
        assert daemon.get("/v1/health").status == 200


def test_requests_left_at_the_drain_timeout_are_cancelled_without_error_logs(tmp_path: Path, bundle_dir: Path) -> None:
    daemon = Daemon(tmp_path, "[server]\ndrain_timeout_s = 0.3\n").start()
    daemon.wait_state("READY")
    replies: list[Reply | BaseException] = []

    def long_request() -> None:
        try:
            replies.append(daemon.request("POST", "/v1/synthesize", {"text": LONG_TEXT, "format": "pcm"}))
        except Exception as exc:  # noqa: BLE001 (the cut-off stream is the expected outcome)
            replies.append(exc)

    worker = threading.Thread(target=long_request)
    worker.start()
    wait_for(lambda: daemon.status()["admission"]["active"] == 1)
    assert daemon.stop() == 0
    worker.join(30)
    # Stopped before its first audio: a JSON 503; after: its stream is cut off (never complete).
    (reply,) = replies
    if isinstance(reply, Reply):
        assert reply.status == 503 and reply.json()["error"]["code"] == "not_ready", reply
    log_text = daemon.log_text()
    assert "cancelling 1 request(s)" in log_text
    assert "ERROR" not in log_text and "Traceback" not in log_text, log_text


def test_socket_path_too_long_is_a_clear_error(tmp_path: Path, bundle_dir: Path) -> None:
    daemon = Daemon(tmp_path)
    daemon.socket = tmp_path / ("d" * 120) / "edged.sock"
    daemon.start()
    assert daemon.proc is not None and daemon.proc.wait(60) == 2
    assert "is too long" in daemon.log_text() and "Traceback" not in daemon.log_text()
    assert not daemon.socket.parent.exists()


def test_a_socket_it_may_not_bind_is_a_clear_error(tmp_path: Path) -> None:
    # A directory the daemon may not write in, with the lock file a root daemon left there: the
    # bind's EACCES was a traceback.
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "edged.sock.lock").touch(mode=0o666)
    command = as_user_without_override([sys.executable, "-m", "edged", "serve", "--socket",
                                        str(directory / "edged.sock")])
    if os.geteuid() == 0:  # root writes anywhere: serve as root without that power
        os.chown(directory, 65534, 65534)
    directory.chmod(0o555)
    result = subprocess.run(command, cwd=REPO, capture_output=True, timeout=60, check=False)
    assert result.returncode == 2 and b"cannot use socket" in result.stderr, result.stderr
    assert b"Permission denied" in result.stderr and b"Traceback" not in result.stderr


def test_socket_directory_is_created(tmp_path: Path, bundle_dir: Path) -> None:
    daemon = Daemon(tmp_path)
    daemon.socket = tmp_path / "deep" / "er" / "edged.sock"
    daemon.start()
    try:
        daemon.wait_state("READY")
        assert stat.S_ISSOCK(os.stat(daemon.socket).st_mode)
    finally:
        assert daemon.stop() == 0


def test_daemon_exits_non_zero_when_its_default_voice_cannot_load(tmp_path: Path, bundle_dir: Path) -> None:
    voices = tmp_path / "voices"
    broken = voices / "xx_XX-broken"
    broken.mkdir(parents=True)
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    (broken / "manifest.json").write_text(json.dumps({**manifest, "voice_id": "xx_XX-broken"}))
    for name in json.loads((bundle_dir / "manifest.json").read_text())["files"]:
        (broken / name).write_bytes(b"damaged")  # wrong size: refused by the manifest check
    config = f'[voices]\ndefault = "xx_XX-broken"\nsearch_path = ["{voices}"]\n'
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    daemon = Daemon(tmp_path / "d", config)
    daemon.log.touch()
    journal = daemon.log.stat()  # its standard error, as systemd names the journal's stream
    daemon.env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
                  "JOURNAL_STREAM": f"{journal.st_dev}:{journal.st_ino}"}
    daemon.start()
    assert daemon.proc is not None and daemon.proc.wait(60) == 1
    # Each line carries its priority for journald (else all were filed as info).
    assert "\n<3>ERROR edged.server: the default voice" in daemon.log_text()
    assert "\n<6>INFO edged.daemon: state NEW -> LOADING" in "\n" + daemon.log_text()
    # systemctl status shows the last one: the reason, not "STOPPED" alone.
    statuses = _statuses_sent(notify)
    assert statuses[-1].startswith("STATUS=STOPPED: the default voice (voices.default = 'xx_XX-broken') "
                                   "cannot answer: "), statuses
    assert "default voice (voices.default = 'xx_XX-broken') cannot answer" in daemon.log_text()
    assert "wrong size" in daemon.log_text()
    assert daemon.log_text().count("voice failed to load") == 1  # not loaded again for READY
    assert not daemon.socket.exists()


def test_a_start_that_fails_before_serving_says_why_to_systemd(tmp_path: Path) -> None:
    # Refused before the event loop runs: an unknown default voice (the commonest failed start,
    # a typo) and a bad setting. Each exits 2 and leaves its reason as the last STATUS=.
    for name, config, reason in [
        ("missing", '[voices]\ndefault = "xx_XX-nobody"\n', "STATUS=STOPPED: unknown voice 'xx_XX-nobody'"),
        ("config", '[server]\nmax_connections = "many"\n', "STATUS=STOPPED: "),
    ]:
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(tmp_path / f"{name}.notify"))
        daemon = Daemon(tmp_path / name, config)
        daemon.env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / f"{name}.notify")}
        daemon.start()
        assert daemon.proc is not None and daemon.proc.wait(60) == 2
        statuses = _statuses_sent(notify)
        assert statuses and statuses[-1].startswith(reason), statuses
        assert "\n" not in statuses[-1]
        assert statuses[-1].removeprefix("STATUS=STOPPED: ") in daemon.log_text()


def test_a_reason_naming_a_path_that_is_not_utf8_still_reaches_systemd(tmp_path: Path) -> None:
    # Python keeps such bytes as surrogates, which str.encode() refuses: the notification was a
    # traceback (exit 1) instead of the one line and exit 2.
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    config = os.fsencode(tmp_path) + b"/\xff.toml"  # no such file
    done = subprocess.run([sys.executable, "-m", "edged", "serve", "--config", config],
                          env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")},
                          capture_output=True, timeout=60, check=False)
    assert done.returncode == 2 and b"Traceback" not in done.stderr, done.stderr
    statuses = _statuses_sent(notify)
    assert statuses and statuses[-1].startswith("STATUS=STOPPED: cannot read config ") and "\\udcff" in statuses[-1]


def _statuses_sent(notify: socket.socket) -> list[str]:
    """The STATUS= lines of every notification waiting on `notify` (which is closed after)."""
    statuses = []
    with notify:
        notify.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                statuses += [m for m in notify.recv(4096).decode().split("\n") if m.startswith("STATUS=")]
    return statuses


def test_systemd_notify_ready_watchdog_and_stopping(tmp_path: Path, bundle_dir: Path) -> None:
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(30)
    env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000"}
    with notify:
        daemon = Daemon(tmp_path / "d", env=env).start()
        try:
            messages: list[str] = []
            while "READY=1" not in messages:
                messages.append(notify.recv(4096).decode())
            assert "STATUS=LOADING" in messages and "WATCHDOG=1" in messages
            assert daemon.get("/v1/health").json()["state"] == "READY"
        finally:
            assert daemon.stop() == 0
        while "STOPPING=1" not in messages:
            messages.append(notify.recv(4096).decode())


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="needs systemd-socket-activate")
def test_socket_passed_by_systemd_is_served_and_left_in_place(tmp_path: Path, bundle_dir: Path) -> None:
    path = tmp_path / "activated.sock"
    log = open(tmp_path / "edged.log", "wb")  # noqa: SIM115
    # The activator listens, and on the first connection execs the daemon with LISTEN_FDS=1.
    proc = subprocess.Popen(["systemd-socket-activate", "-l", str(path), sys.executable, "-m", "edged", "serve"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(path.exists)
        daemon = Daemon(tmp_path / "client")
        daemon.socket, daemon.proc = path, proc
        daemon.wait_state("READY")
        assert daemon.request("POST", "/v1/synthesize", {"text": "Activated."}).status == 200
        assert daemon.stop() == 0
        assert path.exists()  # systemd's socket, not ours to remove
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def _free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="needs systemd-socket-activate")
@pytest.mark.parametrize("passed", ["datagram", "tcp", "two"])
def test_a_socket_passed_by_systemd_that_edged_cannot_serve_alone_is_refused(
        tmp_path: Path, bundle_dir: Path, passed: str) -> None:
    # A TCP socket (ListenStream=8080) would have put the API on the network; a datagram one was a
    # traceback; of two sockets only the first was served and clients of the other hung.
    first, second, port = tmp_path / "a.sock", tmp_path / "b.sock", _free_tcp_port()
    listen = {"datagram": ["-d", "-l", str(first)], "tcp": ["-l", f"127.0.0.1:{port}"],
              "two": ["-l", str(first), "-l", str(second)]}[passed]
    proc = subprocess.Popen(["systemd-socket-activate", *listen, sys.executable, "-m", "edged", "serve"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def triggered() -> bool:  # the activator starts the daemon on the first client
            kind = socket.SOCK_DGRAM if passed == "datagram" else socket.SOCK_STREAM
            family = socket.AF_INET if passed == "tcp" else socket.AF_UNIX
            with socket.socket(family, kind) as client:
                try:
                    client.connect(("127.0.0.1", port) if passed == "tcp" else str(first))
                    client.send(b"GET /v1/health HTTP/1.1\r\n\r\n")
                except OSError:
                    return False
            return True

        wait_for(triggered)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 2, output.decode()
        assert b"edged: " in output and b"Traceback" not in output
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_passed_fd_that_is_no_socket_is_refused(tmp_path: Path) -> None:
    # As from a socket unit with ListenFIFO=; exec keeps the shell's pid, which LISTEN_PID names.
    os.mkfifo(tmp_path / "fifo")
    result = subprocess.run(["sh", "-c", f'LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" -m edged serve 3<>"{tmp_path}/fifo"',
                             sys.executable], cwd=REPO, capture_output=True, timeout=60, check=False)
    assert result.returncode == 2 and b"not a listening Unix stream socket" in result.stderr
    assert b"Traceback" not in result.stderr


@pytest.mark.parametrize("listen_fds", ["1", "abc"], ids=["fd closed", "garbage"])
def test_a_listen_fds_that_names_nothing_is_a_clear_error(tmp_path: Path, listen_fds: str) -> None:
    # A LISTEN_FDS inherited by mistake: fd 3 is closed here (subprocess closes it), or the value
    # is no number. Both were a traceback and exit 1.
    result = subprocess.run(["sh", "-c", f'LISTEN_PID=$$ LISTEN_FDS={listen_fds} exec "$0" -m edged serve',
                             sys.executable], cwd=REPO, capture_output=True, timeout=60, check=False)
    assert result.returncode == 2 and b"socket activation" in result.stderr, result.stderr
    assert b"Traceback" not in result.stderr


def test_a_socket_path_that_names_no_socket_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    # "." was a ValueError traceback; a regular file was refused, but its ".lock" was left beside it.
    taken = tmp_path / "taken"
    taken.write_text("not a socket")
    for path, message in ((".", f"{tmp_path} exists and is not a socket"),  # "." is the directory it starts in
                          (str(taken), "exists and is not a socket")):
        result = subprocess.run([sys.executable, "-m", "edged", "serve", "--socket", path], cwd=tmp_path,
                                capture_output=True, timeout=60, check=False)
        assert result.returncode == 2 and message.encode() in result.stderr, result.stderr
        assert b"Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_stop_signals_until_the_very_end_still_exit_cleanly(tmp_path: Path, bundle_dir: Path) -> None:
    # CPython sets its signal handlers back to the default as the interpreter shuts down: a
    # second SIGTERM in the last ~0.1 s killed the daemon (exit -15 instead of 0).
    daemon = Daemon(tmp_path).start()
    daemon.wait_state("READY")
    assert daemon.proc is not None
    deadline = time.monotonic() + 30
    while daemon.proc.poll() is None and time.monotonic() < deadline:
        daemon.proc.send_signal(signal.SIGTERM)
        time.sleep(0.005)
    assert daemon.stop() == 0, daemon.log_text()


def test_open_connections_are_capped_and_monitoring_still_gets_in(tmp_path: Path, bundle_dir: Path) -> None:
    # Clients holding silent sockets must not use up the daemon's file descriptors (its cache,
    # its espeak-ng pipes): past 4 x max_connections the oldest idle connection is closed.
    with Daemon(tmp_path, "[server]\nmax_connections = 2\n") as daemon:
        assert daemon.proc is not None
        fd_dir = Path(f"/proc/{daemon.proc.pid}/fd")
        before = len(list(fd_dir.iterdir()))
        with contextlib.ExitStack() as closing:
            silent = [closing.enter_context(daemon.connect()) for _ in range(30)]
            assert daemon.request("GET", "/v1/health").status == 200
            assert len(list(fd_dir.iterdir())) - before <= 8
            for sock in silent:
                sock.settimeout(5)
            closed = sum(1 for sock in silent[:20] if _closed_by_peer(sock))
            assert closed >= 20, "the oldest silent connections were not closed"
        wait_for(lambda: daemon.request("GET", "/v1/voices").status == 200)


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("together", [False, True])
def test_a_second_stop_signal_cuts_the_drain_short(tmp_path: Path, bundle_dir: Path, together: bool) -> None:
    with Daemon(tmp_path, "[server]\ndrain_timeout_s = 60\n[cache]\nenabled = false\n") as daemon, \
            daemon.connect() as stalled:
        # A client that stopped reading: its request would hold the drain for its whole 60 s.
        stalled.sendall(post_raw({"text": LONG_TEXT, "format": "pcm"}))
        assert read_head(stalled)[0] == 200
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)
        if not together:  # else both arrive before the loop handles the first (kill -TERM; kill -INT)
            wait_for(lambda: "DRAINING" in daemon.log_text())
        started = time.monotonic()
        daemon.proc.send_signal(signal.SIGINT)
        assert daemon.proc.wait(20) == 0
        assert time.monotonic() - started < 10  # not the 60 s drain
        assert "second stop signal" in daemon.log_text()


# 400 digits made int(usec) / 2e6 an OverflowError and the daemon a traceback at start.
@pytest.mark.parametrize("usec", ["0", "\u0663\u0663", "abc", "9" * 400, str(2**64 - 1)])
def test_a_zero_or_garbage_watchdog_interval_means_no_watchdog(tmp_path: Path, bundle_dir: Path, usec: str) -> None:
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(30)
    env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": usec}
    with notify, Daemon(tmp_path / "d", env=env) as daemon:
        messages: list[str] = []
        while "READY=1" not in messages:
            messages.append(notify.recv(4096).decode())
        notify.settimeout(0.5)
        with contextlib.suppress(TimeoutError):
            while True:
                messages.append(notify.recv(4096).decode())
        assert "WATCHDOG=1" not in messages
        assert daemon.get("/v1/health").status == 200


def test_a_notify_socket_that_fails_is_logged_once(tmp_path: Path, bundle_dir: Path) -> None:
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "missing.sock"), "WATCHDOG_USEC": "100000"}
    with Daemon(tmp_path / "d", env=env) as daemon:
        time.sleep(1.0)  # ~20 watchdog pings, each failing
        assert daemon.get("/v1/health").status == 200
        assert daemon.log_text().count("sd_notify failed") == 1


def test_a_notify_socket_nobody_reads_does_not_stop_the_daemon(tmp_path: Path, bundle_dir: Path) -> None:
    # Once the kernel's queue for a reader that does not read is full, sd_notify blocked, holding
    # the GIL: health stopped answering and SIGTERM could not stop the daemon.
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stalled, \
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as filler:
        stalled.bind(str(tmp_path / "notify.sock"))
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:  # fill its queue, whatever net.unix.max_dgram_qlen is
                filler.sendto(b"X-FILLER=1", str(tmp_path / "notify.sock"))
        env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "100000"}
        with Daemon(tmp_path / "d", env=env) as daemon:
            time.sleep(0.5)
            assert daemon.request("GET", "/v1/health", timeout=5).status == 200
            assert "not reading its notifications" in daemon.log_text()
            stalled.settimeout(10)
            messages = []
            while "READY=1" not in messages:  # kept and sent again once systemd reads
                messages.append(stalled.recv(4096).decode())
            with contextlib.suppress(BlockingIOError):
                while True:  # full again when the daemon stops
                    filler.sendto(b"X-FILLER=1", str(tmp_path / "notify.sock"))
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            while "STOPPING=1" not in messages:  # the exit waits a little for systemd to read it
                messages.append(stalled.recv(4096).decode())
            assert daemon.proc.wait(10) == 0


@pytest.mark.parametrize("cache", ["true", "false"])
def test_a_client_that_reads_slowly_does_not_keep_others_waiting(tmp_path: Path, bundle_dir: Path,
                                                                  cache: str) -> None:
    # One slot: a client that takes its audio slowly lends the slot out between chunks, so another
    # request is answered long before the queue timeout would refuse it. With the cache on, the
    # synthesis used to run to its end at full speed, to be stored whole, holding the slot.
    config = f"[cache]\nenabled = {cache}\n[pipeline]\nmax_active = 1\nqueue_timeout_s = 5.0\n"
    with Daemon(tmp_path, config) as daemon, daemon.connect() as slow:
        body = json.dumps({"text": LONG_TEXT, "format": "pcm"}).encode()
        slow.sendall(post_raw(body))
        status, _ = read_head(slow)
        assert status == 200
        wait_for(lambda: daemon.status()["admission"]["parked"] == 1)  # it stopped reading
        started = time.monotonic()
        reply = daemon.request("POST", "/v1/synthesize", {"text": "Meanwhile.", "format": "pcm"})
        assert reply.status == 200 and time.monotonic() - started < 4
        slow.settimeout(30)
        rest = b""
        while not rest.endswith(b"\r\n0\r\n\r\n"):  # it reads the rest: the stream goes on to its end
            rest += slow.recv(1 << 16)
        wait_for(lambda: daemon.status()["synthesis"]["completed"] == 2)


def test_a_config_that_never_ends_can_still_be_stopped(tmp_path: Path) -> None:
    # A FIFO with no writer blocks the read; SIGTERM must end the daemon, not resume the read.
    fifo = tmp_path / "edged.toml"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "edged", "serve", "--socket", str(tmp_path / "s.sock"),
                             "--config", str(fifo)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        assert proc.poll() is None  # still reading its configuration
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) != 0
    finally:
        proc.kill()
        proc.wait()


def test_a_voice_load_stuck_in_a_read_does_not_keep_the_daemon_alive(tmp_path: Path, bundle_dir: Path) -> None:
    # A graph file that never answers (a FIFO here; a hung disk in the field): the load cannot be
    # stopped, but SIGTERM must still end the daemon.
    voices = tmp_path / "voices"
    back = default_graph(bundle_dir, "back")
    stuck = install_as(voices, bundle_dir, "xx_XX-stuck", skip=(back,))
    os.mkfifo(stuck / back)
    config = f'[voices]\ndefault = "xx_XX-stuck"\nsearch_path = ["{voices}"]\nverify = false\n'
    daemon = Daemon(tmp_path / "d", config).start()
    daemon.wait_state("LOADING")
    assert daemon.stop(timeout=20) == 0
    assert "still running at exit" in daemon.log_text()



def test_the_connection_cap_never_drops_audio_still_being_sent(tmp_path: Path, bundle_dir: Path) -> None:
    # A cached answer is handed to the transport at once: "complete" for uvicorn while its bytes
    # still wait for a client that reads slowly. Making room must not close that connection.
    with Daemon(tmp_path, "[server]\nmax_connections = 3\n") as daemon:
        body = json.dumps({"text": LONG_TEXT, "format": "pcm"}).encode()
        whole = daemon.request("POST", "/v1/synthesize", json.loads(body)).body  # now cached
        with daemon.connect() as reader, contextlib.ExitStack() as closing:
            reader.sendall(post_raw(body))
            time.sleep(0.5)  # the hit is handed over, most of it still unsent
            for _ in range(14):  # over the cap of 12: room is made among the idle ones
                closing.enter_context(daemon.connect())
            reader.settimeout(30)
            data = b""
            while not data.endswith(b"\r\n0\r\n\r\n"):
                chunk = reader.recv(1 << 16)
                assert chunk, "the connection was closed before the end of its audio"
                data += chunk
        assert len(data) > len(whole)
