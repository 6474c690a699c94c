"""Admission to synthesis: a bounded number at once, a bounded queue, and slots lent out by
syntheses whose clients are slow to take their audio.

    await admission.enter()          # Busy at once past the queue, or after queue_timeout_s
    slot = Slot(admission, preemption, park_after_s)
    slot.park_if_slow()              # as a chunk goes out; parks if the next is not wanted soon
    await slot.take_back()           # before more work
    slot.release()
"""

from __future__ import annotations

import asyncio
import collections
from typing import Literal

from .errors import Busy
from .preemption import Preemption


class Admission:
    """At most `capacity` syntheses at once and `queue_size` waiting; beyond that, Busy at once.

    A synthesis whose client is slow to take its audio (reading it at playback speed, say) is
    parked: its slot goes to the next request while it waits for the client, and it gets a slot
    back, before any new request, once the client wants more. So slow listeners cannot hold
    every slot idle and starve everyone else."""

    def __init__(self, capacity: int, queue_size: int, queue_timeout_s: float) -> None:
        self.capacity = capacity
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self._free = capacity
        # A freed slot is handed to the first waiter here, parked syntheses first. One mechanism
        # for both: with a semaphore for new requests, a slot it gave back on its own (a waiter
        # cancelled after being woken) could sit free while a parked synthesis waited for ever.
        self._resuming: collections.deque[asyncio.Future[None]] = collections.deque()
        """Parked syntheses waiting for a slot back: served before new requests."""
        self._entering: collections.deque[asyncio.Future[None]] = collections.deque()
        self.active = 0
        self.waiting = 0
        self.parked = 0
        self.rejected = 0

    async def enter(self) -> None:
        if not self._take_free(self._entering):
            if self.waiting >= self.queue_size:
                self.rejected += 1
                raise Busy(f"busy: {self.active} syntheses running and {self.waiting} waiting")
            self.waiting += 1
            try:
                async with asyncio.timeout(self.queue_timeout_s):
                    await self._wait_in(self._entering)
            except TimeoutError:
                self.rejected += 1
                raise Busy(f"busy: no synthesis slot within {self.queue_timeout_s:g} s") from None
            finally:
                self.waiting -= 1
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        self._free_slot()

    def park(self) -> None:
        """Give the slot up while the client is slow to take the audio."""
        self.active -= 1
        self.parked += 1
        self._free_slot()

    def forget_parked(self) -> None:
        """A parked synthesis ended (its client left) without taking a slot back."""
        self.parked -= 1

    async def resume(self) -> None:
        """Take a slot back after `park`: the first one freed, with no queue limit or timeout."""
        self.parked -= 1
        if not self._take_free(self._resuming):
            await self._wait_in(self._resuming)
        self.active += 1

    @property
    def resuming(self) -> int:
        """Parked syntheses whose client wants more, waiting for a slot."""
        return len(self._resuming)

    def _take_free(self, queue: collections.deque[asyncio.Future[None]]) -> bool:
        """Take a free slot at once, unless others wait for one before the caller."""
        if self._free and not self._resuming and not (queue is self._entering and self._entering):
            self._free -= 1
            return True
        return False

    async def _wait_in(self, queue: collections.deque[asyncio.Future[None]]) -> None:
        handed = asyncio.get_running_loop().create_future()
        queue.append(handed)
        try:
            await handed
        except asyncio.CancelledError:  # its client left, or its queue time ran out
            if handed in queue:
                queue.remove(handed)
            elif not handed.cancelled():
                self._free_slot()  # handed over as this one was cancelled: pass it on
            raise

    def _free_slot(self) -> None:
        for queue in (self._resuming, self._entering):
            while queue:
                handed = queue.popleft()
                # Done: its task was cancelled and has not yet run to take it out of the queue.
                if not handed.done():
                    handed.set_result(None)
                    return
        self._free += 1


class Slot:
    """A live synthesis's admission slot, parked (Admission.park) while its client takes more
    than `park_after_s` to want the next chunk. Parked, it is not live work either: background
    warm-up may use the CPU meanwhile (edged.preemption)."""

    def __init__(self, admission: Admission, preemption: Preemption, park_after_s: float) -> None:
        self.admission = admission
        self.preemption = preemption
        self.park_after_s = park_after_s
        self.state: Literal["held", "parked", "taking back", "released"] = "held"
        self._timer: asyncio.TimerHandle | None = None

    def park_if_slow(self) -> None:
        """Called as a chunk goes to the client."""
        self._timer = asyncio.get_running_loop().call_later(self.park_after_s, self._park)

    async def take_back(self) -> None:
        """Called before work, once the client wanted the next chunk."""
        self._cancel_timer()
        if self.state == "parked":
            self.state = "taking back"  # if cancelled in the wait, it holds no slot to give back
            self.preemption.live_started()
            await self.admission.resume()
            self.state = "held"

    def release(self) -> None:
        self._cancel_timer()
        if self.state == "released":
            return
        state, self.state = self.state, "released"
        try:
            if state == "held":
                self.admission.leave()
            elif state == "parked":
                self.admission.forget_parked()
        finally:
            if state != "parked":  # parked, it was no longer counted as live
                self.preemption.live_ended()

    def _park(self) -> None:
        self._timer = None
        self.state = "parked"
        self.admission.park()
        self.preemption.live_ended()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
