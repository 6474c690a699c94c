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
    p50, p95, p99 = np.percentile(values, [50, 95, 99], method="inverted_cdf")  # nearest rank
    return {"p50": round(float(p50) * scale, 1), "p95": round(float(p95) * scale, 1),
            "p99": round(float(p99) * scale, 1), "max": round(max(values) * scale, 1)}


def middle_and_max(values: Iterable[float]) -> tuple[float | None, float | None]:
    """p50 (nearest rank, as in `percentiles`) and the largest, rounded to 0.1; (None, None) when
    there are no values."""
    figures = percentiles(list(values), scale=1.0)
    return figures["p50"], figures["max"]
