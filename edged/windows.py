"""Which latent frames each run of the back graph (the decoder) decodes, and which of them it keeps.

A window keeps frames [keep_start, keep_end) and is given to the decoder as [in_start, in_end),
that is with up to `context` frames on each side; what lies outside the kept frames is cut from
the audio. The decoder's receptive field is small: with 12 frames of context the joined windows
match one whole-sentence decode to >100 dB SNR (tools.eval_quality).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    keep_start: int
    keep_end: int
    in_start: int
    in_end: int
    pad: int = 0
    """Frames appended after in_end so that a fixed-shape graph gets its one shape (zeros, which the
    graph's frame mask marks as padding: edged.engine.back_feed)."""

    def __post_init__(self) -> None:
        if not (self.in_start <= self.keep_start < self.keep_end <= self.in_end):
            raise ValueError(f"inconsistent window {self}")

    @property
    def in_frames(self) -> int:
        return self.in_end - self.in_start + self.pad


def growing_windows(
    n_frames: int, first: int, largest: int, context: int, growth: int = 8, produced: int = 0,
) -> list[Window]:
    """Windows of `first` frames, then `growth` times larger each time, up to `largest`.

    The first window is small so that audio starts early; later ones grow because every window
    pays for its context again, and by then the client has audio buffered (the decoder runs many
    times faster than real time: 16 frames are 186 ms of audio, 128 frames decode in ~40 ms).
    Growing 8 times rather than 4 makes a 1 s prompt two windows (16 + 90 frames) instead of three
    (16 + 64 + 26): 9-13% less time in all (in process, alternating runs), with no measurable
    change on longer texts. A tail shorter than the context joins the window before it.

    A later piece of the same text, after `produced` frames, starts as large as that audio: the
    client has it buffered, so small windows would only cost context again.
    """
    windows = []
    start, size = 0, min(largest, max(first, produced))
    while start < n_frames:
        end = min(n_frames, start + size)
        if n_frames - end < context:
            end = n_frames
        windows.append(Window(start, end, max(0, start - context), min(n_frames, end + context)))
        start, size = end, min(size * growth, largest)
    return windows


def fixed_windows(n_frames: int, window: int, context: int) -> list[Window]:
    """Windows whose input is always `window + 2 * context` frames, the form an NPU compiler needs.

    Where a piece's edge leaves no context, the input slides inward instead of padding; only a
    piece shorter than the input shape is padded at its end, and the back_fixed graph masks that
    padding at every layer, so that the audio is the unsplit decoder's.
    """
    shape = window + 2 * context
    if n_frames <= shape:
        return [Window(0, n_frames, 0, n_frames, pad=shape - n_frames)]
    windows = [Window(0, shape - context, 0, shape)]
    start = shape - context
    while start < n_frames:
        end = min(n_frames, start + window)
        in_start = min(start - context, n_frames - shape)
        windows.append(Window(start, end, in_start, in_start + shape))
        start = end
    return windows
