"""Background synthesis (cache warm-up) that gives the CPU back to live requests at once.

A background call starts only while no live synthesis runs or waits. When a live one arrives, the
onnxruntime run a background call has in flight is stopped through its RunOptions' terminate flag
(onnxruntime checks it between graph nodes, so within a few milliseconds) and the call is made
again once the live syntheses are done. Waiting for a background window to finish instead cost live
requests a quarter of their time to first audio (tools.daemon_cache_bench --only warm_yield).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import onnxruntime as ort

    from .pipeline import Stage

T = TypeVar("T")


class Preemption:
    def __init__(self) -> None:
        self._live = 0
        """Live syntheses running or waiting for admission."""
        self.preempted = 0
        """Background runs stopped for a live request (each is made again later)."""
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

    async def run(self, stage: Stage, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args, run_options)` in `stage` while no live synthesis is about, as often as it is
        stopped for one."""
        import onnxruntime as ort  # loaded with the first voice already

        while True:
            await self._idle.wait()
            run_options = ort.RunOptions()
            self._background_runs.add(run_options)
            try:
                return await stage.run(fn, *args, run_options)
            except Exception:
                if not run_options.terminate:
                    raise
                self.preempted += 1
            finally:
                self._background_runs.discard(run_options)
