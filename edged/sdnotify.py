"""systemd notifications (Type=notify): state changes, READY, STOPPING and watchdog pings.

    notify = Notifier.from_environment()   # does nothing when systemd did not ask for it
    notify("READY=1"); stop_watchdog = start_watchdog(loop, notify)

The datagrams are sent here, without blocking, rather than by systemd-python's sd_notify: that
call blocks while systemd's queue for the daemon is full (a stalled or slow reader) and holds the
GIL meanwhile, which froze the whole daemon, stop signals included. A message that finds the
queue full is dropped (and logged once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)

MIN_WATCHDOG_INTERVAL_S = 0.05
"""Pings no closer than this, whatever WATCHDOG_USEC says (1 µs would ping on every loop turn)."""


class Notifier:
    def __init__(self, address: str | None) -> None:
        """`address`: $NOTIFY_SOCKET, a socket path or @abstract name; None sends nothing."""
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
    def from_environment(cls) -> Notifier:
        return cls(os.environ.get("NOTIFY_SOCKET"))

    def __call__(self, message: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto(message.encode(), self._target)
        except BlockingIOError as exc:
            self._failed(exc.errno, "systemd is not reading its notifications (queue full); dropped")
        except OSError as exc:  # a vanished notify socket must not take the daemon down
            self._failed(exc.errno, str(exc))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _failed(self, errno: int | None, reason: str) -> None:
        # Once per kind of failure: the watchdog would repeat it every few seconds for life.
        if errno not in self._failures_seen:
            self._failures_seen.add(errno)
            log.warning("sd_notify failed: %s (not logged again for this error)", reason)


def start_watchdog(loop: asyncio.AbstractEventLoop, notify: Callable[[str], None]) -> Callable[[], None]:
    """WATCHDOG=1 at half of systemd's interval, sent from the event loop (a stuck loop misses it).
    Returns the function that stops it."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    if (not (usec.isascii() and usec.isdigit()) or int(usec) == 0
            or os.environ.get("WATCHDOG_PID", str(os.getpid())) != str(os.getpid())):
        return lambda: None  # 0 or garbage means no watchdog, as for sd_watchdog_enabled()
    interval = max(int(usec) / 2e6, MIN_WATCHDOG_INTERVAL_S)
    timer: asyncio.TimerHandle | None = None

    def ping() -> None:
        nonlocal timer
        notify("WATCHDOG=1")
        timer = loop.call_later(interval, ping)

    ping()
    return lambda: timer.cancel() if timer is not None else None
