"""The pipeline without a daemon: stage limits and timeouts, admission, and how it plans windows."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncGenerator, AsyncIterator

import pytest
from pipeline_helpers import Loaded, request_for, slot_held

from edged.admission import Admission
from edged.config import PipelineSettings, StageSettings
from edged.engine import Voice
from edged.errors import BadInput, Busy, NotReady, StageTimeout
from edged.pipeline import Pipeline, Stage
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


def test_a_slot_freed_as_a_resuming_client_leaves_goes_to_the_next() -> None:
    # The resuming synthesis's task was cancelled (its client left); before it ran to take itself
    # out of the queue, another freed its slot: handing it to the cancelled one raised, and the
    # slot was lost for good (every later request 503 busy).
    async def scenario() -> None:
        admission = Admission(capacity=1, queue_size=4, queue_timeout_s=0.5)
        await admission.enter()
        admission.park()  # a slow listener lends its slot out...
        await admission.enter()  # ...to another request
        resuming = asyncio.create_task(admission.resume())  # the listener wants more: it waits
        await asyncio.sleep(0)
        assert admission.resuming == 1
        resuming.cancel()  # its client leaves, and in the same turn the other request ends
        admission.leave()
        with contextlib.suppress(asyncio.CancelledError):
            await resuming
        await admission.enter()  # the slot is there for a new request
        assert (admission.active, admission.resuming, admission.parked) == (1, 0, 0)

    asyncio.run(scenario())


def test_a_slot_freed_as_a_queued_request_leaves_goes_to_a_resuming_one() -> None:
    # The freed slot woke a queued request, which was cancelled in the same turn (its client left)
    # as a parked synthesis asked for its slot back: the slot went back to the queue's semaphore,
    # free, while the parked synthesis waited for it, for ever on an idle daemon.
    async def scenario() -> None:
        admission = Admission(capacity=1, queue_size=4, queue_timeout_s=30)
        await admission.enter()
        queued = asyncio.create_task(admission.enter())
        await asyncio.sleep(0)
        admission.park()  # the slot goes to the queued request...
        queued.cancel()  # ...which leaves in the same turn
        async with asyncio.timeout(2):
            await admission.resume()  # and the parked synthesis wants more
        with contextlib.suppress(asyncio.CancelledError):
            await queued
        assert (admission.active, admission.waiting, admission.resuming, admission.parked) == (1, 0, 0, 0)
        with pytest.raises(Busy):  # the one slot is held: a new request waits, then is refused
            admission.queue_timeout_s = 0.05
            await admission.enter()

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


def test_a_request_made_from_another_bundle_than_the_one_loaded_is_refused(voice: Voice) -> None:
    # Its cache key was made from the facts of a bundle replaced before the voice loaded: the
    # audio of the loaded one would be stored under the other's key.
    async def scenario() -> None:
        pipeline = Pipeline(PipelineSettings(), Loaded(voice))
        stale = dataclasses.replace(request_for(voice, "Replaced."), voice_version="0.9.0")
        with pytest.raises(NotReady, match="was replaced while this request was made"):
            await anext(pipeline.synthesize_stream(stale))
        assert pipeline.counts.windows == 0
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


LONG_ENOUGH = ("The parcel you ordered on Monday was left with your neighbour at number twelve because nobody "
               "was home, and the driver took a photo of it on the doorstep. ") * 3
"""Several windows of audio: a stream that still has chunks to give after its first."""


async def _parked(voice: Voice) -> tuple[Pipeline, AsyncGenerator[bytes, None]]:
    """A one-slot pipeline whose live synthesis gave its first chunk and is parked: its client
    has not asked for more."""
    pipeline, slow = await slot_held(voice, queue_size=4, text=LONG_ENOUGH, park_after_s=0.05)
    await asyncio.sleep(0.2)  # the slow client takes its time with the first chunk
    assert pipeline.admission.parked == 1
    return pipeline, slow


def test_a_slow_client_lends_its_slot_and_gets_one_back_first(voice: Voice) -> None:
    # A client reading at playback speed must not hold the box's only slot idle: while it has not
    # asked for its next chunk, another request is served; when it asks, it goes before new ones.
    async def scenario() -> None:
        pipeline, slow = await _parked(voice)
        assert pipeline.admission.active == 0
        order: list[str] = []

        async def drain(name: str, text: str) -> None:
            async for _ in pipeline.synthesize_stream(request_for(voice, text)):
                pass
            order.append(name)

        other = asyncio.create_task(drain("other", "Meanwhile, another request."))
        await asyncio.sleep(0)
        # The slow client asks for more while `other` runs, and a new request queues behind it.
        more = asyncio.create_task(anext(slow))
        await asyncio.sleep(0.05)
        assert pipeline.admission.resuming == 1 and pipeline.admission.parked == 0
        newer = asyncio.create_task(drain("newer", "A request that came later."))
        await asyncio.wait_for(more, 30)
        order.append("slow")
        await asyncio.wait_for(asyncio.gather(other, newer), 60)
        assert order == ["other", "slow", "newer"]
        async for _ in slow:
            pass
        assert pipeline.admission.active == 0 and pipeline.admission.parked == 0
        assert pipeline.counts.completed == 3
        pipeline.close()

    asyncio.run(scenario())


def test_a_parked_synthesis_whose_client_leaves_gives_back_nothing(voice: Voice) -> None:
    async def scenario() -> None:
        pipeline, slow = await _parked(voice)
        await slow.aclose()  # it hung up while parked: no slot to give back
        assert pipeline.admission.active == 0 and pipeline.admission.parked == 0
        async for _ in pipeline.synthesize_stream(request_for(voice, "Still one slot.")):
            pass
        assert pipeline.admission.active == 0 and pipeline.counts.cancelled == 1
        pipeline.close()

    asyncio.run(scenario())


def test_a_parked_synthesis_at_its_text_end_ends_without_a_slot(voice: Voice) -> None:
    # A slow client that has had all its audio must not wait for a slot (behind another whole
    # synthesis) only to learn that the text has ended.
    async def scenario() -> None:
        pipeline, short = await slot_held(voice, queue_size=4, park_after_s=0.05)
        await anext(short)  # its last chunk (a 1 s prompt is two windows); then the client is slow
        await asyncio.sleep(0.2)
        assert pipeline.admission.parked == 1

        async def drain() -> None:
            async for _ in pipeline.synthesize_stream(request_for(voice, LONG_ENOUGH)):
                pass

        other = asyncio.create_task(drain())
        await asyncio.sleep(0.05)
        assert pipeline.admission.active == 1  # the other synthesis has the only slot
        assert [chunk async for chunk in short] == []
        assert not other.done(), "the end of the parked stream waited for the other synthesis"
        assert pipeline.admission.parked == 0 and pipeline.counts.completed == 1
        await asyncio.wait_for(other, 60)
        pipeline.close()

    asyncio.run(scenario())


def test_every_window_decoded_reaches_the_client_before_a_text_error(voice: Voice,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The next piece is read before a piece's last chunk goes out; when that read fails (here
    # espeak-ng stalls on the text's second block), the chunk already made is still sent first.
    from edged.espeak_worker import ESPEAK

    text = "This sentence is one of many. " * 100  # 3,000 characters: espeak-ng reads two blocks

    async def scenario() -> None:
        pipeline = Pipeline(PipelineSettings(), Loaded(voice))
        stream = pipeline.synthesize_stream(request_for(voice, text))
        received = [await anext(stream)]  # the first block has been read
        monkeypatch.setattr(ESPEAK, "timeout_s", 1e-6)  # and the second will stall
        with pytest.raises(BadInput):
            async for chunk in stream:
                received.append(chunk)
        assert len(received) == pipeline.counts.windows > 20
        pipeline.close()

    asyncio.run(scenario())


def test_a_parked_synthesis_lets_background_work_run(voice: Voice) -> None:
    # A client listening at playback speed for minutes must not stop cache warm-up meanwhile.
    async def scenario() -> None:
        pipeline, slow = await _parked(voice)
        warmed = [chunk async for chunk in pipeline.synthesize_stream(
            request_for(voice, "Warmed while the listener listens."), Background())]
        assert sum(map(len, warmed)) > voice.sample_rate  # done while the live stream was parked
        async for _ in slow:
            pass
        assert pipeline.counts.completed == 2 and pipeline.admission.parked == 0
        pipeline.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
