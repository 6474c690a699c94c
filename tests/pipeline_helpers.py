"""A pipeline over the real voice, without a daemon or its registry."""

from __future__ import annotations

from edged.engine import Voice
from edged.pipeline import SynthesisRequest


class Loaded:
    """The pipeline's voice source, with one voice already loaded."""

    def __init__(self, voice: Voice) -> None:
        self._voice = voice

    async def voice(self, voice_id: str, wait_s: float) -> Voice:
        return self._voice


def request_for(voice: Voice, text: str) -> SynthesisRequest:
    return SynthesisRequest(text, voice.voice_id, voice.manifest.version, voice.precision, voice.sample_rate)
