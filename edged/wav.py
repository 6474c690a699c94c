"""WAV headers for 16-bit mono PCM, including one for a stream whose length is not yet known."""

from __future__ import annotations

import struct
from typing import BinaryIO

STREAMING_SIZE = 0xFFFFFFFF
"""Size field of a header written before the audio's length is known (what ffmpeg and sox do)."""


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """RIFF/WAVE header for 16-bit mono PCM; `data_bytes` None (not known yet) writes the
    streaming header's maximum sizes."""
    if data_bytes is None:
        riff_size = data_bytes = STREAMING_SIZE
    else:
        riff_size = 36 + data_bytes
    return (
        b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data" + struct.pack("<I", data_bytes)
    )


MAX_DATA_BYTES = STREAMING_SIZE - 36
"""The most audio (~27 hours at 22,050 Hz) whose size a WAV header can hold."""


def write_sizes(wav: BinaryIO, data_bytes: int) -> bool:
    """Put the real sizes into a header written as streaming, once the audio is complete.
    False (and the streaming sizes left) if they do not fit the header's 32-bit fields."""
    if data_bytes > MAX_DATA_BYTES:
        return False
    wav.seek(4)
    wav.write(struct.pack("<I", 36 + data_bytes))
    wav.seek(40)
    wav.write(struct.pack("<I", data_bytes))
    return True
