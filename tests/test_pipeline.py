"""The pipeline without a daemon: stage limits and timeouts, admission, and how it plans windows."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
from pipeline_helpers import request_for, slot_held

from edged.config import StageSettings
from edged.engine import Voice
from edged.errors import Busy, StageTimeout
from edged.pipeline import Admission, Stage
from edged.preemption import Background


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


def test_requests_planned_while_others_queue_are_decoded_for_throughput(voice: Voice) -> None:
    text = "Your timer is done."
    first_window_bytes = voice.manifest.streaming.first_window * voice.manifest.hop_length * 2

    async def chunks(stream: AsyncIterator[bytes]) -> list[bytes]:
        return [chunk async for chunk in stream]

    async def scenario() -> None:
        pipeline, holder = await slot_held(voice, queue_size=2, text=text)
        queued_first = asyncio.create_task(chunks(pipeline.synthesize_stream(request_for(voice, text))))
        queued_last = asyncio.create_task(chunks(pipeline.synthesize_stream(request_for(voice, text))))
        while pipeline.admission.waiting < 2:
            await asyncio.sleep(0.001)
        await holder.aclose()
        # The first queued request is planned while the other still waits: one window for its
        # one piece. The last one is planned with nobody waiting: a small first window again.
        assert len(await queued_first) == 1
        alone = await queued_last
        assert len(alone) > 1 and len(alone[0]) == first_window_bytes
        # Nobody waits on a background synthesis's first audio either.
        assert len(await chunks(pipeline.synthesize_stream(request_for(voice, text), Background()))) == 1
        pipeline.close()

    asyncio.run(scenario())


def test_a_request_given_up_while_queued_is_counted_as_cancelled(voice: Voice) -> None:
    async def scenario() -> None:
        pipeline, holder = await slot_held(voice, queue_size=2)
        queued = asyncio.create_task(anext(pipeline.synthesize_stream(request_for(voice, "Queued."))))
        while pipeline.admission.waiting < 1:
            await asyncio.sleep(0.001)
        queued.cancel()  # its client hung up
        with pytest.raises(asyncio.CancelledError):
            await queued
        await holder.aclose()
        counts = pipeline.counts
        assert (counts.cancelled, counts.completed, counts.failed) == (2, 0, 0)  # the holder, too
        assert pipeline.admission.waiting == 0 and pipeline.admission.active == 0
        pipeline.close()

    asyncio.run(scenario())
