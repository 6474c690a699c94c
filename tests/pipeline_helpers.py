"""A pipeline over the real voice, without a daemon or its registry."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from edged.config import PipelineSettings
from edged.engine import Voice
from edged.pipeline import Pipeline, SynthesisRequest


class Loaded:
    """The pipeline's voice source, with one voice already loaded."""

    def __init__(self, voice: Voice) -> None:
        self._voice = voice

    async def voice(self, voice_id: str, wait_s: float) -> Voice:
        return self._voice


def request_for(voice: Voice, text: str) -> SynthesisRequest:
    return SynthesisRequest(text, voice.voice_id, voice.manifest.version, voice.precision, voice.sample_rate,
                            bundle_digest=voice.manifest.audio_digest)


async def slot_held(voice: Voice, queue_size: int, text: str = "Your timer is done.",
                    park_after_s: float = 3600) -> tuple[Pipeline, AsyncGenerator[bytes, None]]:
    """A pipeline with one admission slot, taken by a live synthesis of `text` that has yielded
    its first chunk: it holds the slot until it is closed, unless its client (the caller) stays
    away for `park_after_s` (then the synthesis is parked)."""
    pipeline = Pipeline(PipelineSettings(max_active=1, queue_size=queue_size, park_after_s=park_after_s),
                        Loaded(voice))
    holder = pipeline.synthesize_stream(request_for(voice, text))
    await anext(holder)
    return pipeline, holder
