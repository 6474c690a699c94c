"""Window plans: every frame kept exactly once, context within bounds, one shape in fixed mode."""

from __future__ import annotations

import pytest

from edged.windows import Window, fixed_windows, growing_windows


def _assert_covers(windows: list[Window], n_frames: int) -> None:
    kept = [f for w in windows for f in range(w.keep_start, w.keep_end)]
    assert kept == list(range(n_frames))
    for w in windows:
        assert 0 <= w.in_start <= w.keep_start < w.keep_end <= w.in_end <= n_frames


@pytest.mark.parametrize("n_frames", [1, 31, 32, 33, 100, 1000, 1777])
def test_growing_windows_cover_every_frame_once(n_frames: int) -> None:
    windows = growing_windows(n_frames, first=32, largest=256, context=32)
    _assert_covers(windows, n_frames)
    sizes = [w.keep_end - w.keep_start for w in windows]
    # A tail shorter than the context joins the window before it.
    assert sizes[0] == (n_frames if n_frames < 64 else 32)
    assert all(s < 256 + 32 for s in sizes)
    for w in windows:
        assert w.keep_start - w.in_start == min(32, w.keep_start)
        assert w.in_end - w.keep_end == min(32, n_frames - w.keep_end)


def test_a_short_prompt_is_two_windows() -> None:
    # A 1 s prompt (106 frames) was three (16 + 64 + 26), each running its context again.
    windows = growing_windows(106, first=16, largest=256, context=12)
    assert [w.keep_end - w.keep_start for w in windows] == [16, 90]


def test_a_later_piece_starts_as_large_as_the_audio_before_it() -> None:
    windows = growing_windows(1000, first=16, largest=512, context=32, produced=134)
    _assert_covers(windows, 1000)
    assert [w.keep_end - w.keep_start for w in windows] == [134, 512, 354]
    assert growing_windows(1000, 16, 512, 32, produced=5000)[0].keep_end == 512
    assert growing_windows(1000, 16, 512, 32, produced=0) == growing_windows(1000, 16, 512, 32)


@pytest.mark.parametrize("n_frames", [1, 50, 127, 128, 129, 200, 1000, 1777])
def test_fixed_windows_have_one_input_shape(n_frames: int) -> None:
    windows = fixed_windows(n_frames, window=64, context=32)
    _assert_covers(windows, n_frames)
    assert {w.in_frames for w in windows} == {128}
    assert all(w.pad == 0 for w in windows) or len(windows) == 1


def test_a_window_that_would_cut_the_wrong_audio_is_refused() -> None:
    with pytest.raises(ValueError, match="inconsistent window"):
        Window(40, 100, 8, 92)  # keeps frames it is not given
    with pytest.raises(ValueError, match="inconsistent window"):
        Window(4, 60, 8, 92)
    with pytest.raises(ValueError, match="inconsistent window"):
        Window(40, 40, 8, 92)  # keeps nothing
