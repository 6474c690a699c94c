"""Background synthesis (cache warm-up) that gives the CPU back to live requests at once.

A background call starts only while no live synthesis runs or waits. When a live one arrives, the
onnxruntime run a background call has in flight is stopped through its RunOptions' terminate flag
(onnxruntime checks it between graph nodes, so within a few milliseconds) and the call is made
again once the live syntheses are done. Waiting for a background window to finish instead cost live
requests a quarter of their time to first audio (tools.daemon_cache_bench --only warm_yield).

A live request that comes to wait for a background synthesis's audio (the same phrase, joined in
the cache) promotes it: it runs as live work, neither waiting nor stopped, until the last such
request has left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import onnxruntime as ort

    from .pipeline import Stage

T = TypeVar("T")


class Background:
    """One background synthesis's standing."""

    def __init__(self) -> None:
        self.promoted = asyncio.Event()
        """Set when a live request waits for this synthesis's audio."""
        self.run_options: ort.RunOptions | None = None
        """Of its onnxruntime run in flight, if that run may be stopped."""
        self.live_listeners = 0
        """Live requests waiting for its audio: it is promoted while there are any."""
        self.ever_promoted = False


class Preemption:
    def __init__(self) -> None:
        self._live = 0
        """Live syntheses running or waiting for admission."""
        self.preempted = 0
        """Background runs stopped for a live request (each is made again later)."""
        self.promoted = 0
        """Background syntheses made live because a live request waited for their audio (each once)."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._background_runs: set[ort.RunOptions] = set()

    def live_started(self) -> None:
        self._live += 1
        self._idle.clear()
        for run_options in self._background_runs:
            run_options.terminate = True

    def live_ended(self) -> None:
        self._live -= 1
        if self._live == 0:
            self._idle.set()

    def promote(self, background: Background) -> None:
        """From now on `background` runs as live work: at once, and its run in flight is not stopped."""
        background.live_listeners += 1
        if background.promoted.is_set():
            return
        background.promoted.set()
        self.promoted += not background.ever_promoted
        background.ever_promoted = True
        if background.run_options is not None:
            self._background_runs.discard(background.run_options)

    def demote(self, background: Background) -> None:
        """A live request that waited for `background`'s audio left: with none left, it is background
        work again: its run in flight is stopped if live work is about, and it waits for live work."""
        background.live_listeners -= 1
        if background.live_listeners == 0:
            background.promoted.clear()
            if background.run_options is not None:
                self._background_runs.add(background.run_options)
                background.run_options.terminate = self._live > 0

    async def run(self, stage: Stage, fn: Callable[..., T], *args: object, background: Background) -> T:
        """`fn(*args, run_options)` in `stage` while no live synthesis is about, as often as it is
        stopped for one; at once and to its end once `background` is promoted."""
        import onnxruntime as ort  # loaded with the first voice already
        from onnxruntime.capi.onnxruntime_pybind11_state import Fail

        while True:
            # Checked again after each wait: live work may have come back in the turns between
            # idle being set and this task running (a parked synthesis taking its slot back).
            while not background.promoted.is_set() and not self._idle.is_set():
                await _first_of(self._idle, background.promoted)
            run_options = ort.RunOptions()
            background.run_options = run_options  # (demote may make it stoppable)
            if not background.promoted.is_set():
                self._background_runs.add(run_options)
            try:
                return await stage.run(fn, *args, run_options)
            except asyncio.CancelledError:
                # Nobody wants it now (a warm-up abandoned, the daemon stopping): stop the run in
                # its thread too, which otherwise held its stage's slot and the CPU to its end.
                run_options.terminate = True
                raise
            except Fail:
                # Only onnxruntime's own failure can be the stop; anything else (a text espeak-ng
                # refused, a stage timeout) is the call's answer even if a stop was asked meanwhile.
                if not run_options.terminate:
                    raise
                self.preempted += 1
            finally:
                background.run_options = None
                self._background_runs.discard(run_options)


async def _first_of(*events: asyncio.Event) -> None:
    """Return once any of `events` is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
