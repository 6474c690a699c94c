"""Latency statistics for the benchmark tools, so that every report computes its figures alike.

Each tool keeps its own field names and rounding; these functions only take the numbers.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import numpy as np


def median(values: Iterable[float], *, scale: float = 1.0, digits: int = 1) -> float:
    """The median (the mean of the two middle values for an even count), times `scale`, rounded to `digits`."""
    return round(statistics.median(values) * scale, digits)


def percentile(values: Sequence[float], q: float, *, scale: float = 1.0, digits: int = 1) -> float:
    """The `q`th percentile, interpolated between neighbours (numpy's default), times `scale`,
    rounded to `digits`."""
    return round(float(np.percentile(values, q)) * scale, digits)


def percentiles(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p95/p99 (nearest rank) and max, in ms by default; None when there are no values."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, int(p / 100 * len(ordered) + 0.999999) - 1))] * scale, 1)

    return {"p50": rank(50), "p95": rank(95), "p99": rank(99), "max": round(ordered[-1] * scale, 1)}


def middle_and_max(values: Iterable[float]) -> tuple[float | None, float | None]:
    """p50 (nearest rank, as in `percentiles`) and the largest, rounded to 0.1; (None, None) when
    there are no values."""
    figures = percentiles(list(values), scale=1.0)
    return figures["p50"], figures["max"]
