"""Prometheus metrics (GET /metrics), in a registry of the daemon's own.

Events (requests, latencies, GC pauses) are counted as they happen; everything that is a state of
the daemon (queue lengths per stage, memory, threads, providers) is read from the daemon when
scraped, so it is never counted twice and never stale. prometheus_client is imported when the
metrics are built, not at module import.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .daemon import Daemon

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Seconds; dense around the 50-150 ms that time to first audio should take."""
GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class Metrics:
    def __init__(self, daemon: Daemon) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Histogram,
            disable_created_metrics,
        )
        from prometheus_client.process_collector import ProcessCollector

        disable_created_metrics()  # *_created series only double the output here

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("edged_requests", "HTTP requests by route and status.",
                                ["route", "status"], registry=self.registry)
        self.first_audio = Histogram(
            "edged_time_to_first_audio_seconds",
            "From the request's arrival to its first audio bytes sent; by cache tier (hit ratio).",
            ["route", "cache"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.total = Histogram("edged_synthesis_seconds", "From the request's arrival to its last audio sent.",
                               ["route", "cache"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.gc_pause = Histogram("edged_gc_pause_seconds", "Pauses of the Python garbage collector.",
                                  ["generation"], buckets=GC_BUCKETS, registry=self.registry)
        ProcessCollector(registry=self.registry)  # CPU seconds, open fds, virtual memory
        self.registry.register(_DaemonCollector(daemon))
        # Children made now: the callback must not create any (labels() would take a lock that
        # the interrupted thread may hold, since a collection can start inside any allocation).
        self._gc_children = {g: self.gc_pause.labels(str(g)) for g in range(3)}
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def observe_audio(self, route: str, cache: str, first_audio_s: float, total_s: float) -> None:
        self.first_audio.labels(route, cache).observe(first_audio_s)
        self.total.labels(route, cache).observe(total_s)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started and info.get("generation") in self._gc_children:
            self._gc_children[info["generation"]].observe(time.perf_counter() - self._gc_started)


class _DaemonCollector:
    """The daemon's state, read at scrape time."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from .daemon import State, process_figures
        from .espeak_worker import ESPEAK

        daemon = self.daemon
        pipeline = daemon.pipeline
        state = GaugeMetricFamily("edged_state", "1 for the engine's current state.", labels=["state"])
        for s in State:
            state.add_metric([s.value], 1.0 if daemon.state is s else 0.0)
        yield state

        admission = pipeline.admission
        queue = GaugeMetricFamily("edged_queue_length", "Requests waiting, per stage (admission included).",
                                  labels=["stage"])
        running = GaugeMetricFamily("edged_stage_running", "Calls running, per stage.", labels=["stage"])
        calls = CounterMetricFamily("edged_stage_calls", "Calls started, per stage.", labels=["stage"])
        timeouts = CounterMetricFamily("edged_stage_timeouts", "Calls over their stage timeout.", labels=["stage"])
        queue.add_metric(["admission"], admission.waiting)
        running.add_metric(["admission"], admission.active)
        for stage in pipeline.stages:
            queue.add_metric([stage.name], stage.waiting)
            running.add_metric([stage.name], stage.running)
            calls.add_metric([stage.name], stage.calls)
            timeouts.add_metric([stage.name], stage.timeouts)
        parked = GaugeMetricFamily("edged_syntheses_parked",
                                   "Syntheses waiting for a slow client, their admission slot given up.")
        parked.add_metric([], admission.parked)
        resuming = GaugeMetricFamily("edged_syntheses_resuming",
                                     "Parked syntheses whose client wants more, waiting for a slot.")
        resuming.add_metric([], admission.resuming)
        yield from (queue, running, calls, timeouts, parked, resuming)

        counts = pipeline.counts
        for name, value, doc in (
            ("edged_busy_rejections", admission.rejected,
             "Requests refused with 503 busy by admission (queue full, or no slot in time)."),
            ("edged_connections_refused", daemon.connections_refused,
             "Requests refused with 503 busy at the server's connection limit."),
            ("edged_synthesis_completed", counts.completed, "Syntheses streamed to their end."),
            ("edged_synthesis_cancelled", counts.cancelled, "Syntheses stopped early (hang-up, stalled reader)."),
            ("edged_synthesis_failed", counts.failed, "Syntheses that failed with an error."),
            ("edged_windows_decoded", counts.windows, "Back-graph windows decoded."),
            ("edged_background_preempted", pipeline.preemption.preempted,
             "Warm-up graph runs stopped for a live request (and made again later)."),
            ("edged_background_promoted", pipeline.preemption.promoted,
             "Warm-up syntheses made live because a live request waited for the same phrase."),
            ("edged_espeak_restarts", ESPEAK.restarts,
             "espeak-ng processes lost (died or stalled on a text, which was refused, or exited) and started again."),
            ("edged_client_disconnects", daemon.disconnects, "Streams whose client hung up."),
            ("edged_write_stalls", daemon.write_stalls, "Streams cut off because the client stopped reading."),
        ):
            yield CounterMetricFamily(name, doc, value=value)

        figures = process_figures()
        memory = GaugeMetricFamily("edged_resident_memory_bytes", "Resident memory by kind.", labels=["kind"])
        for kind in ("rss", "anon", "file"):
            if kind in figures:
                memory.add_metric([kind], figures[kind])
        yield memory
        if "threads" in figures:
            yield GaugeMetricFamily("edged_threads", "Threads of the process.", value=figures["threads"])

        providers = GaugeMetricFamily("edged_voice_provider", "Execution provider serving each graph.",
                                      labels=["voice", "version", "precision", "graph", "provider"])
        for voice_id, voice in daemon.registry.loaded().items():
            for graph, provider in voice.providers.items():
                providers.add_metric([voice_id, voice.manifest.version, voice.precision, graph, provider], 1.0)
        yield providers
        if daemon.cache is not None and daemon.cache.audio is not None:
            yield from _cache_metrics(daemon.cache.describe())


def _cache_metrics(c: dict[str, Any]) -> Iterator[Any]:
    """The audio cache's counters (AudioCache.stats()) and warm-up progress, per tier."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    lookups = CounterMetricFamily("edged_cache_lookups", "Cache lookups by tier and result "
                                  "(hit ratio per tier = hit / (hit + miss)).", labels=["tier", "result"])
    size = GaugeMetricFamily("edged_cache_bytes", "Bytes held, per tier.", labels=["tier"])
    entries = GaugeMetricFamily("edged_cache_entries", "Entries held, per tier.", labels=["tier"])
    evictions = CounterMetricFamily("edged_cache_evictions", "Entries evicted for room, per tier.",
                                    labels=["tier"])
    for tier in ("memory", "disk"):
        lookups.add_metric([tier, "hit"], c[f"{tier}_hits"])
        lookups.add_metric([tier, "miss"], c[f"{tier}_misses"])
        size.add_metric([tier], c[f"{tier}_bytes"])
        entries.add_metric([tier], c[f"{tier}_entries"])
        evictions.add_metric([tier], c[f"{tier}_evictions"])
    yield from (lookups, size, entries, evictions)
    state = GaugeMetricFamily("edged_cache_disk_state", "1 for the disk tier's current state.", labels=["state"])
    for name in ("ok", "paused", "off"):
        state.add_metric([name], 1.0 if c["disk_state"] == name else 0.0)
    yield state
    failures = CounterMetricFamily("edged_cache_disk_write_failures", "Disk writes that failed, by reason.",
                                   labels=["reason"])
    for reason, count in c["disk_store_failures"].items():
        failures.add_metric([reason], count)
    yield failures
    warm = c["warm"]
    for name, value, doc in (
        ("edged_cache_disk_writes_skipped", c["disk_store_skipped"], "Disk writes skipped (queue full, disk paused, entry larger than the tier)."),
        ("edged_cache_corrupt_dropped", c["disk_corrupt_dropped"], "Disk entries dropped as corrupt."),
        ("edged_cache_disk_recoveries", c["disk_recoveries"], "Corrupted cache databases moved aside and rebuilt."),
        ("edged_cache_joined", c["joined"], "Requests that joined an identical synthesis under way."),
        ("edged_cache_stale_dropped", c["stale_dropped"], "Entries dropped as expired or invalidated."),
        ("edged_cache_not_stored", c["not_stored"], "Finished syntheses not stored (too long, invalidated)."),
        ("edged_cache_warm_requested", warm["total"], "Warm-up phrases asked for."),
        ("edged_cache_warm_done", warm["done"], "Warm-up phrases handled."),
        ("edged_cache_warm_synthesized", warm["synthesized"], "Warm-up phrases synthesized (not cached already)."),
        ("edged_cache_warm_empty", warm["empty"], "Warm-up phrases with nothing to pronounce (nothing stored)."),
        ("edged_cache_warm_failed", warm["failed"], "Warm-up phrases that failed."),
    ):
        yield CounterMetricFamily(name, doc, value=value)
    yield GaugeMetricFamily("edged_cache_in_flight", "Syntheses under way through the cache.", value=c["in_flight"])
    yield GaugeMetricFamily("edged_cache_write_queue_bytes", "Audio waiting for the disk writer.",
                            value=c["write_queue_bytes"])
    yield GaugeMetricFamily("edged_cache_stream_buffer_bytes", "Audio held for the streams of syntheses being cached.",
                            value=c["stream_buffer_bytes"])
