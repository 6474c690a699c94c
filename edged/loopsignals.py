"""Signals handled on the event loop, and handed over to other handlers without a gap.

asyncio's add_signal_handler does the same, but its remove_signal_handler sets the signal back to
its default action, which for SIGTERM and SIGHUP is death, until the next handler is set: a
signal in that moment killed the daemon as it exited (exit by signal, its socket file left).
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable


def _noop(signum: int, frame: object) -> None:
    """The Python-level handler: the work is done on the loop, woken by the wakeup fd."""


class LoopSignals:
    """Runs `handlers[sig]()` on `loop` for each signal received, from whichever thread the
    kernel delivered it to: the C-level handler writes the signal's number to a socket the loop
    reads (signal.set_wakeup_fd), as asyncio does."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handlers: dict[int, Callable[[], None]]) -> None:
        self._loop, self._handlers = loop, handlers
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        loop.add_reader(self._reader.fileno(), self._dispatch)
        for sig in handlers:
            signal.signal(sig, _noop)  # straight from the handler before: no default action between

    def _dispatch(self) -> None:
        try:
            received = self._reader.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        for number in received:
            handler = self._handlers.get(number)
            if handler is not None:
                handler()

    def hand_over(self, set_next: Callable[[], None]) -> None:
        """`set_next()` sets the handlers for after the loop (signal.signal); then this lets go."""
        set_next()
        self._loop.remove_reader(self._reader.fileno())
        signal.set_wakeup_fd(self._previous_fd)
        self._reader.close()
        self._writer.close()
