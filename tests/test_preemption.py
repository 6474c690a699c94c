"""Background synthesis (warm-up) stops its onnxruntime run for a live request and makes it again."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import Fail
from pipeline_helpers import request_for, slot_held

from edged.config import StageSettings
from edged.engine import SynthesisParams, Voice
from edged.errors import BadInput
from edged.pipeline import Stage
from edged.preemption import Background, Preemption
from edged.windows import Window

LONG = ("When you get home this evening, please water the tomatoes on the balcony, feed the cat before "
        "seven, and call the plumber about the dripping tap in the kitchen.")


async def _until(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.001)


def test_a_live_request_stops_the_background_run_which_is_made_again_whole(voice: Voice) -> None:
    ids = next(voice.pieces(LONG))
    latents = voice.front(ids, SynthesisParams(noise_scale=0.0, noise_w=0.0))
    window = Window(0, latents.n_frames, 0, latents.n_frames)  # one long run: easy to catch in flight
    reference = voice.decode(latents, window)

    async def scenario() -> None:
        preemption = Preemption()
        stage = Stage("back", StageSettings(concurrency=1, timeout_s=30))
        background = asyncio.create_task(preemption.run(stage, voice.decode, latents, window,
                                                         background=Background()))
        await _until(lambda: stage.running == 1)
        preemption.live_started()
        await _until(lambda: preemption.preempted == 1)
        await asyncio.sleep(0.05)
        assert not background.done()  # waits while the live synthesis is about
        assert stage.running == 0
        preemption.live_ended()
        assert await background == reference
        assert preemption.preempted == 1
        stage.close()

    asyncio.run(scenario())


def test_an_abandoned_background_run_is_stopped_in_its_thread(voice: Voice) -> None:
    # Cancelled (a warm-up nobody waits for, the daemon stopping), its onnxruntime run went on in
    # its thread to the end, holding the stage's slot and the CPU from live work.
    ids = next(voice.pieces(LONG))
    latents = voice.front(ids, SynthesisParams(noise_scale=0.0, noise_w=0.0))
    window = Window(0, latents.n_frames, 0, latents.n_frames)
    outcome: list[str] = []

    def decode(run_options: object) -> None:
        try:
            voice.decode(latents, window, run_options)  # type: ignore[arg-type]
            outcome.append("finished")
        except Fail:
            outcome.append("stopped")

    async def scenario() -> None:
        preemption = Preemption()
        stage = Stage("back", StageSettings(concurrency=1, timeout_s=30))
        background = asyncio.create_task(preemption.run(stage, decode, background=Background()))
        await _until(lambda: stage.running == 1)
        background.cancel()
        await _until(lambda: stage.running == 0)
        assert outcome == ["stopped"]
        stage.close()

    asyncio.run(scenario())


def test_background_work_waits_for_live_work_that_came_back_before_it_woke() -> None:
    # Live work ended and began again in one turn (a parked synthesis taking its slot back):
    # the background run woke to the first and ran beside the second, not to be stopped.
    ran: list[bool] = []

    async def scenario() -> None:
        preemption = Preemption()
        stage = Stage("back", StageSettings(concurrency=1, timeout_s=30))
        preemption.live_started()
        background = asyncio.create_task(preemption.run(stage, lambda run_options: ran.append(True),
                                                         background=Background()))
        await asyncio.sleep(0.05)  # waiting for live work to end
        preemption.live_ended()
        preemption.live_started()
        await asyncio.sleep(0.05)
        assert ran == [] and not background.done()
        preemption.live_ended()
        await asyncio.wait_for(background, 10)
        assert ran == [True]
        stage.close()

    asyncio.run(scenario())


def test_an_error_of_edged_is_not_taken_for_a_stop() -> None:
    # A text espeak-ng refuses while a live request arrives must fail the warm-up, not be made again
    # (made again, the spent piece generator would end it early and the cache keep a cut-off phrase).
    started = threading.Event()

    def refused(run_options: object) -> None:
        started.set()
        while not run_options.terminate:  # type: ignore[attr-defined]
            time.sleep(0.001)
        raise BadInput("espeak-ng refused it")

    async def scenario() -> None:
        preemption = Preemption()
        stage = Stage("text", StageSettings(concurrency=1, timeout_s=30))
        task = asyncio.create_task(preemption.run(stage, refused, background=Background()))
        await _until(started.is_set)
        preemption.live_started()
        with pytest.raises(BadInput):
            await asyncio.wait_for(task, 10)
        assert preemption.preempted == 0
        preemption.live_ended()
        stage.close()

    asyncio.run(scenario())


def test_background_synthesis_takes_no_slot_and_waits_for_live_ones(voice: Voice) -> None:
    async def scenario() -> None:
        pipeline, live = await slot_held(voice, queue_size=0)
        background_chunks: list[bytes] = []

        async def run_background() -> None:
            async for chunk in pipeline.synthesize_stream(request_for(voice, "Warmed in the background."), Background()):
                background_chunks.append(chunk)

        background = asyncio.create_task(run_background())
        await asyncio.sleep(0.3)
        assert background_chunks == [] and not background.done()
        assert pipeline.admission.active == 1  # the background synthesis took no slot
        async for _ in live:
            pass
        await asyncio.wait_for(background, 30)
        assert sum(map(len, background_chunks)) > voice.sample_rate // 2  # half a second at least
        assert pipeline.counts.completed == 2
        pipeline.close()

    asyncio.run(scenario())


def test_a_promoted_background_synthesis_runs_while_live_ones_do(voice: Voice) -> None:
    async def scenario() -> None:
        pipeline, live = await slot_held(voice, queue_size=0, text=LONG)
        background = Background()
        chunks: list[bytes] = []

        async def run_background() -> None:
            async for chunk in pipeline.synthesize_stream(request_for(voice, "Wanted now."), background):
                chunks.append(chunk)

        task = asyncio.create_task(run_background())
        await asyncio.sleep(0.3)
        assert chunks == []  # waits for the live one
        pipeline.preemption.promote(background)
        pipeline.preemption.promote(background)  # counted once
        await asyncio.wait_for(task, 30)  # finishes while the live synthesis is still about
        assert sum(map(len, chunks)) > voice.sample_rate // 2
        assert pipeline.preemption.promoted == 1
        await live.aclose()
        pipeline.close()

    asyncio.run(scenario())


def test_a_background_synthesis_whose_live_listener_left_waits_again(voice: Voice) -> None:
    # Promoted for a live request that joined it, it stayed promoted after that request left:
    # it kept running beside live work, unstoppable, for nobody waiting.
    async def scenario() -> None:
        pipeline, live = await slot_held(voice, queue_size=0, text=LONG)
        background = Background()
        chunks: list[bytes] = []

        async def run_background() -> None:
            async for chunk in pipeline.synthesize_stream(request_for(voice, LONG), background):
                chunks.append(chunk)

        task = asyncio.create_task(run_background())
        pipeline.preemption.promote(background)  # a live request joins...
        while len(chunks) < 2:
            await asyncio.sleep(0.01)
        pipeline.preemption.demote(background)  # ...and leaves: its run in flight is stopped
        await asyncio.sleep(0.05)  # a window finished just before may still be handed over
        made = len(chunks)
        await asyncio.sleep(0.5)
        assert len(chunks) == made and not task.done()  # it waits for the live synthesis again
        await live.aclose()
        await asyncio.wait_for(task, 60)  # and goes on once that has ended
        assert len(chunks) > made
        pipeline.close()

    asyncio.run(scenario())
