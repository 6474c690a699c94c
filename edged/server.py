"""`edged serve`: the socket, the HTTP server, the engine's lifecycle and signals.

    serve(config_file, socket_path) -> exit code

Start-up is ordered for a fast READY: the socket is bound first (so clients can connect and ask
/v1/health at once), the voices start loading in threads, and only then is the HTTP layer
imported, while they load. Shutdown (SIGTERM/SIGINT): tell systemd (STOPPING=1) -> stop accepting
-> let in-flight requests finish within `drain_timeout_s` (a second signal cuts that short) ->
cancel the rest -> exit 0. The daemon waits on events; only the watchdog and notifications that
systemd has not taken yet run on timers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import fcntl
import functools
import logging
import os
import resource
import signal
import socket
import stat
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from .admin import admin_group_missing
from .config import Settings, load_settings, socket_path
from .daemon import Daemon, State
from .errors import AlreadyRunning, ConfigError, EdgedError
from .files import identity
from .loopsignals import LoopSignals
from .sdnotify import Notifier, notify_once, start_watchdog, status

if TYPE_CHECKING:
    from .engine import Voice

log = logging.getLogger(__name__)

BACKLOG = 128
M_ARENA_MAX = -8
"""glibc's mallopt parameter number (malloc.h)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
OTHER_SIGNALS = {
    signal.SIGHUP: "SIGHUP: reload is not supported yet",
    signal.SIGUSR1: "SIGUSR1 ignored: edged has no use for it",  # "reopen your logs", by habit
    signal.SIGUSR2: "SIGUSR2 ignored: edged has no use for it",
}
"""Signals whose default action (death, the socket file left) would be a crash: logged instead."""
NOTIFY_FLUSH_S = 1.0
"""How long the exit waits for notifications systemd has not taken yet (STOPPING=1)."""
MAX_SOCKET_PATH = 107
"""Bytes of a Unix socket's path (sun_path is 108, with the terminating NUL)."""


@dataclass
class Listener:
    sock: socket.socket
    path: Path | None
    """The socket file we created and must remove; None when systemd owns the socket."""
    lock: IO[str] | None = None
    """Held (flock) for the daemon's life: a second daemon on the same path sees it and stops."""
    bound: tuple[int, int] | None = None
    """(device, inode) of the socket file as bound (files.identity)."""

    def close(self) -> None:
        self.sock.close()
        # Only if the file there is still ours: with its directory removed and made again, another
        # daemon may have bound the path since (and would be cut off from its clients).
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            if self.path is not None and identity(self.path) == self.bound:
                self.path.unlink()
        if self.lock is not None:
            self.lock.close()


def serve(config_file: Path | None = None, socket_path: Path | None = None) -> int:
    try:
        # Read before the handlers below: a config that never ends (a FIFO) can still be stopped.
        settings = load_settings(config_file, socket_path)
        early_stop = threading.Event()
        _signals_outside_the_loop(early_stop)
        return _serve(settings, early_stop)
    except EdgedError as exc:  # before the event loop ran: a bad config, a socket in use, an unknown voice
        notify_once(status(f"STOPPED: {exc}"))  # systemctl status shows why, as for _run's failures
        raise
    finally:
        # The stop is done. CPython sets its handlers back to the default as the interpreter
        # shuts down (~0.1 s more here), where a second stop signal would then kill the process:
        # a second SIGTERM gave exit -15 instead of 0.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _signals_outside_the_loop(early_stop: threading.Event) -> None:
    """Before the event loop runs and after it ends, a SIGTERM or SIGINT must still mean "stop
    cleanly" (`early_stop`), not death by signal, and the OTHER_SIGNALS nothing (as in _run)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: early_stop.set())
    for sig in OTHER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _serve(settings: Settings, early_stop: threading.Event) -> int:
    if logging.getLogger().level > logging.INFO:
        logging.getLogger("edged").setLevel(logging.INFO)
    _limit_malloc_arenas(settings.server.malloc_arenas)  # before any thread starts
    _raise_open_files_limit()
    listener = open_listener(settings)
    if admin_group_missing(settings.server.admin_group):
        log.warning("server.admin_group %r is not a group on this system: only root and the daemon's "
                    "user may clear or warm the cache", settings.server.admin_group)
    daemon = Daemon(settings)
    try:
        default_load = daemon.start_loading()  # threads: the engine imports and loads while the HTTP layer imports
        code = asyncio.run(_run(daemon, listener, early_stop, default_load))
    finally:
        listener.close()
        daemon.close()
    stuck = daemon.registry.loads_running()
    if stuck:
        # A load blocked in a read (a hung disk, a FIFO) cannot be stopped, and the threads it
        # runs in (the registry's, and the engine's that open sessions in parallel) would be
        # waited for at exit: everything else is closed and flushed by now, so leave without it.
        log.warning("voice load of %s still running at exit; not waiting for it", ", ".join(stuck))
        logging.shutdown()
        os._exit(code)
    return code


def open_listener(settings: Settings) -> Listener:
    """The socket systemd passed us, else our own: parent directory made, a stale socket file
    replaced, a live daemon's socket left alone (AlreadyRunning), mode set before anyone connects."""
    if os.environ.get("LISTEN_FDS"):
        from systemd.daemon import listen_fds

        try:
            fds = listen_fds()
            if fds:
                return Listener(_activated_socket(fds), None)
        except OSError as exc:  # a LISTEN_FDS inherited by mistake, or its descriptor closed
            raise ConfigError(f"socket activation ($LISTEN_FDS={os.environ['LISTEN_FDS'][:20]!r}): "
                              f"{exc.strerror}") from None
    path = socket_path(settings)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError(f"socket path {path} is too long: a Unix socket path has at most "
                          f"{MAX_SOCKET_PATH} bytes")
    if path.name in ("", ".", ".."):
        raise ConfigError(f"socket path {str(path)!r} names a directory, not a socket file")
    _refuse_a_non_socket(path)  # before the lock file is made beside it
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot use socket directory {path.parent}: {exc.strerror}") from None
    lock = _open_lock(path.with_name(path.name + ".lock"))
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise AlreadyRunning(f"another edged is running on {path}") from None
    try:
        _remove_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # no moment where the socket is open to everyone
        try:
            sock.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, settings.server.socket_mode)
        sock.listen(BACKLOG)
        bound = identity(path)
    except OSError as exc:  # a directory we may not write in (its lock file left by root), ...
        lock.close()
        raise ConfigError(f"cannot use socket {path}: {exc.strerror or exc}") from None
    except BaseException:
        lock.close()
        raise
    log.info("listening on %s", path)
    return Listener(sock, path, lock, bound)


def _open_lock(path: Path) -> IO[str]:
    """The lock file beside the socket, which anyone who may write in a shared directory could
    have made first: a FIFO there blocked the start for good (signals too), a symlink was
    followed. (Read-write: a FIFO opened write-only without a reader fails with a cryptic ENXIO.)"""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot use lock file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"lock file {path} exists and is not a regular file; not using it")
    return os.fdopen(fd, "r+", encoding="ascii")


def _activated_socket(fds: list[int]) -> socket.socket:
    """The one listening Unix stream socket systemd passed. A TCP socket would put the API on the
    network, out of reach of the socket's file mode and of the admin peer check."""
    from systemd.daemon import is_socket_unix

    if len(fds) != 1:
        raise ConfigError(f"systemd passed {len(fds)} sockets; edged serves one (one ListenStream= path)")
    if not is_socket_unix(fds[0], socket.SOCK_STREAM, listening=1):
        raise ConfigError("what systemd passed is not a listening Unix stream socket (ListenStream= with a path)")
    return socket.socket(fileno=fds[0])


def _refuse_a_non_socket(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"{path} exists and is not a socket; not replacing it")


def _remove_stale(path: Path) -> None:
    _refuse_a_non_socket(path)  # again, under the lock
    if not os.path.lexists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        log.info("removing stale socket %s", path)
        path.unlink()
        return
    except OSError as exc:
        raise AlreadyRunning(f"{path} is in use ({exc.strerror}); not replacing it") from None
    finally:
        probe.close()
    raise AlreadyRunning(f"a daemon is answering on {path}; not taking it over")


async def _run(daemon: Daemon, listener: Listener, early_stop: threading.Event,
               default_load: concurrent.futures.Future[Voice]) -> int:
    loop = asyncio.get_running_loop()
    notify = Notifier.from_environment(loop)
    failure: list[str] = []  # why the start failed: systemctl status shows it with the state
    notify(status(daemon.state.value))
    daemon.on_state.append(lambda state: notify(status(": ".join([state.value, *failure]))))
    stop, stop_now = asyncio.Event(), asyncio.Event()

    def stop_signal() -> None:  # the first asks for a drain, a second to cut it short
        (stop_now if stop.is_set() else stop).set()

    # Until configuration reload exists (SIGHUP), a reload must not kill the daemon.
    signals = LoopSignals(loop, {**dict.fromkeys(STOP_SIGNALS, stop_signal),
                                 **{sig: functools.partial(log.warning, said) for sig, said in OTHER_SIGNALS.items()}})
    if early_stop.is_set():
        stop.set()

    # The cache is open before the first request is served (it needs no model, so the first
    # request can already be a hit). Its disk tier opens on the cache's writer thread while the
    # HTTP layer (uvicorn, prometheus_client) is imported here; all of it while the voices load.
    opening = asyncio.create_task(daemon.open_cache())
    await asyncio.sleep(0)  # the task runs up to its disk work, which proceeds in its thread
    from .httpserver import start_http

    await opening
    http = await start_http(daemon, listener.sock)
    stop_watchdog = start_watchdog(loop, notify)
    exit_code = 0
    ready = asyncio.create_task(daemon.until_ready(default_load))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.exception() is not None:
            failure.append(f"the default voice (voices.default = {daemon.settings.voices.default!r}) "
                           f"cannot answer: {ready.exception()}")
            log.error("%s", failure[0])
            exit_code = 1
        elif ready.done():
            notify("READY=1")
            log.info("READY after %.0f ms", (daemon.ready_after_s or 0) * 1000)
            await stopping
        daemon.set_state(State.DRAINING)
        notify("STOPPING=1")
        await http.drain(daemon.settings.server.drain_timeout_s, cut_short=stop_now)
    finally:
        await daemon.close_cache()  # after the drain: its queued disk writes are flushed
        ready.cancel()
        stopping.cancel()
        stop_watchdog()
        http.close()
        daemon.set_state(State.STOPPED)
        await notify.flush(NOTIFY_FLUSH_S)  # signals are still ours meanwhile: a second is no kill
        notify.close()
        signals.hand_over(lambda: _signals_outside_the_loop(early_stop))
    return exit_code


def _raise_open_files_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard one (systemd's default soft limit is 1024): with the
    connection cap (edged.httpserver) the daemon's own files, cache and espeak-ng pipes among
    them, cannot run out because clients hold sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _limit_malloc_arenas(arenas: int) -> None:
    """mallopt(M_ARENA_MAX) where the C library is glibc; $MALLOC_ARENA_MAX, if set, wins."""
    if arenas <= 0 or os.environ.get("MALLOC_ARENA_MAX") or sys.platform != "linux":
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    if mallopt(M_ARENA_MAX, arenas) != 1:
        log.warning("mallopt(M_ARENA_MAX, %d) failed", arenas)
