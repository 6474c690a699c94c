"""systemd notifications (Type=notify): state changes, READY, STOPPING and watchdog pings.

    notify = Notifier.from_environment(loop)   # does nothing when systemd did not ask for it
    notify("READY=1"); stop_watchdog = start_watchdog(loop, notify); ...; notify.close()

The datagrams are sent here, without blocking, rather than by systemd-python's sd_notify: that
call blocks while systemd's queue for the daemon is full (a stalled or slow reader) and holds the
GIL meanwhile, which froze the whole daemon, stop signals included. When the queue is full, a
watchdog ping is dropped (the next one follows), and other messages (READY=1: without it systemd
kills the unit at its start timeout) wait, in order, and are sent again every RETRY_S.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)

WATCHDOG = "WATCHDOG=1"
RETRY_S = 0.2
"""How often messages that found systemd's queue full are sent again."""
WAITING_MAX = 32
"""Messages kept waiting at most; past it the oldest (a stale STATUS=) are dropped."""
MIN_WATCHDOG_INTERVAL_S = 0.05
"""Pings no closer than this, whatever WATCHDOG_USEC says (1 µs would ping on every loop turn)."""
USEC_INFINITY = 2**64 - 1
"""systemd's "no limit" for a time in microseconds; it and anything past it is no interval."""


class Notifier:
    def __init__(self, address: str | None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """`address`: $NOTIFY_SOCKET, a socket path or @abstract name; None sends nothing.
        `loop` runs the retries (without one, a message that finds the queue full is dropped)."""
        self._loop = loop
        self._waiting: collections.deque[str] = collections.deque(maxlen=WAITING_MAX)
        self._retry: asyncio.TimerHandle | None = None
        self._failures_seen: set[int | None] = set()
        self._sock: socket.socket | None = None
        self._target = ""
        if not address:
            return
        if not address.startswith(("/", "@")):  # vsock: (in virtual machines) is not supported
            log.warning("NOTIFY_SOCKET=%s: not a Unix socket; systemd will not be notified", address[:100])
            return
        self._target = "\0" + address[1:] if address.startswith("@") else address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)

    @classmethod
    def from_environment(cls, loop: asyncio.AbstractEventLoop | None = None) -> Notifier:
        return cls(os.environ.get("NOTIFY_SOCKET"), loop)

    def __call__(self, message: str) -> None:
        if self._sock is None:
            return
        if message == WATCHDOG:
            if not self._waiting:  # behind waiting messages the queue is full anyway
                self._send(message)
            return
        self._waiting.append(message)
        if self._retry is None:  # else the retry sends it, in order
            self._send_waiting()

    async def flush(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the messages still waiting to be sent: STOPPING=1."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._waiting and self._sock is not None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(RETRY_S / 2)

    def close(self) -> None:
        """Stop; what is still waiting is dropped (flush first)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._waiting.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send_waiting(self) -> None:
        self._retry = None
        while self._waiting:
            if not self._send(self._waiting[0]):
                if self._loop is not None:
                    self._retry = self._loop.call_later(RETRY_S, self._send_waiting)
                else:
                    self._waiting.clear()
                return
            self._waiting.popleft()

    def _send(self, message: str) -> bool:
        """False if systemd's queue is full (worth another try); a message that fails otherwise
        is dropped: a notify socket that is gone stays gone."""
        assert self._sock is not None
        try:
            # A path of bytes that are not UTF-8 (kept as surrogates) must not make it unsendable.
            self._sock.sendto(message.encode("utf-8", "backslashreplace"), self._target)
        except BlockingIOError as exc:
            self._failed(exc.errno, "systemd is not reading its notifications (queue full)")
            return False
        except OSError as exc:  # a vanished notify socket must not take the daemon down
            self._failed(exc.errno, str(exc))
        return True

    def _failed(self, errno: int | None, reason: str) -> None:
        # Once per kind of failure: the watchdog would repeat it every few seconds for life.
        if errno not in self._failures_seen:
            self._failures_seen.add(errno)
            log.warning("sd_notify failed: %s (not logged again for this error)", reason)


def status(text: str) -> str:
    """The STATUS= message saying `text`, on one line: a notification's fields end at a newline."""
    return "STATUS=" + text.replace("\n", " ")


def notify_once(message: str) -> None:
    """Send one message now, without an event loop (a start that fails before the loop runs)."""
    notifier = Notifier.from_environment()
    notifier(message)
    notifier.close()


def start_watchdog(loop: asyncio.AbstractEventLoop, notify: Callable[[str], None]) -> Callable[[], None]:
    """WATCHDOG=1 at half of systemd's interval, sent from the event loop (a stuck loop misses it).
    Returns the function that stops it."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    if (not (usec.isascii() and usec.isdigit()) or not 0 < int(usec) < USEC_INFINITY
            or os.environ.get("WATCHDOG_PID", str(os.getpid())) != str(os.getpid())):
        return lambda: None  # 0, infinity or garbage means no watchdog, as for sd_watchdog_enabled()
    interval = max(int(usec) / 2e6, MIN_WATCHDOG_INTERVAL_S)
    timer: asyncio.TimerHandle | None = None

    def ping() -> None:
        nonlocal timer
        notify(WATCHDOG)
        timer = loop.call_later(interval, ping)

    ping()
    return lambda: timer.cancel() if timer is not None else None
