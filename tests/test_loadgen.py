"""tools.loadgen against the real daemon: counts, percentiles, Zipf choice."""

from __future__ import annotations

import asyncio

from daemon_harness import Daemon

from tools.loadgen import generated_phrases, run_load, zipf_exponent, zipf_weights
from tools.stats import percentiles


def test_percentiles_are_nearest_rank() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1 .. 100 ms
    assert percentiles(values) == {"p50": 50.0, "p95": 95.0, "p99": 99.0, "max": 100.0}
    assert percentiles([])["p50"] is None


def test_zipf_weights_fall_with_rank() -> None:
    weights = zipf_weights(4, 1.0)
    assert weights == [1.0, 0.5, 1 / 3, 0.25]


def test_the_80_20_exponent_sends_80_percent_to_the_top_fifth() -> None:
    exponent = zipf_exponent(10_000, 0.2, 0.8)
    weights = zipf_weights(10_000, exponent)
    assert abs(sum(weights[:2000]) / sum(weights) - 0.8) < 1e-4
    assert 0.9 < exponent < 1.0  # plain Zipf 1.0 would send 83.6% there


def test_generated_phrases_are_distinct_and_stable() -> None:
    phrases = generated_phrases(10_000)
    assert len(set(phrases)) == 10_000
    assert phrases[:3] == generated_phrases(3)


def test_loadgen_is_bounded_and_reports_client_side_timings(daemon: Daemon) -> None:
    report = asyncio.run(run_load(daemon.socket, clients=2, requests=6, duration_s=60))
    assert report["requests"] == 6 and report["ok"] == 6 and report["errors"] == {}
    ttfa, total = report["ttfa_ms"], report["total_ms"]
    assert 0 < ttfa["p50"] <= ttfa["p95"] <= ttfa["p99"] <= ttfa["max"]
    assert ttfa["p50"] <= total["p50"]
    assert report["audio_s_per_s"] > 0
