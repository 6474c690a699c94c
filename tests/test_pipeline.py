"""Pipeline building blocks: stage limits and timeouts, admission, without a daemon."""

from __future__ import annotations

import asyncio
import threading

import pytest

from edged.config import StageSettings
from edged.errors import Busy, StageTimeout
from edged.pipeline import Admission, Stage


def test_stage_timeout_frees_its_slot_only_when_the_thread_ends() -> None:
    async def scenario() -> None:
        stage = Stage("back", StageSettings(concurrency=1, timeout_s=0.1))
        release = threading.Event()
        with pytest.raises(StageTimeout, match="back stage"):
            await stage.run(release.wait)
        assert stage.running == 1 and stage.timeouts == 1  # the call is still in its thread
        release.set()
        assert await stage.run(lambda: 42) == 42  # the slot came back once the thread ended
        assert stage.running == 0
        stage.close()

    asyncio.run(scenario())


def test_stage_limits_concurrency() -> None:
    async def scenario() -> None:
        stage = Stage("front", StageSettings(concurrency=2, timeout_s=5))
        lock = threading.Lock()
        inside = peak = 0

        def work() -> None:
            nonlocal inside, peak
            with lock:
                inside += 1
                peak = max(peak, inside)
            threading.Event().wait(0.05)
            with lock:
                inside -= 1

        await asyncio.gather(*(stage.run(work) for _ in range(6)))
        assert peak == 2 and stage.calls == 6
        stage.close()

    asyncio.run(scenario())


def test_admission_queues_then_refuses_at_once() -> None:
    async def scenario() -> None:
        admission = Admission(capacity=1, queue_size=1, queue_timeout_s=5)
        await admission.enter()
        waiter = asyncio.create_task(admission.enter())
        await asyncio.sleep(0)
        assert admission.waiting == 1
        with pytest.raises(Busy):
            await admission.enter()  # no await on anything: refused at once
        admission.leave()
        await waiter
        assert admission.active == 1 and admission.rejected == 1
        admission.leave()

    asyncio.run(scenario())


def test_admission_queue_timeout_is_busy() -> None:
    async def scenario() -> None:
        admission = Admission(capacity=1, queue_size=4, queue_timeout_s=0.05)
        await admission.enter()
        with pytest.raises(Busy, match="no synthesis slot"):
            await admission.enter()
        assert admission.waiting == 0

    asyncio.run(scenario())
