"""The daemon's cache figures, measured by a client: python -m tools.daemon_cache_bench [--quick] [--out FILE]

- restart: a phrase cached, the daemon killed with SIGKILL, a new one exec'd on the same cache:
  exec -> first audio byte of that phrase (requests sent as soon as the socket accepts), several
  restarts (target <= 300 ms);
- hit: cache-hit latency over the socket, one client, a fresh connection per request, p50/p99
  of time to first audio and of the whole answer (target p99 <= 5 ms);
- load: tools.loadgen's Zipf workload against a cache warmed with its phrases (target >= 800
  requests/s with p99 <= 50 ms);
- zipf: the target workload: 10,000 generated phrases, 80% of the requests on the most frequent
  20% of them (tools.loadgen --hot 0.2:0.8), cache warm. Filling the cache means synthesizing all
  10,000 once (about 1.4 GB of audio, 20-30 minutes here); --cache-dir keeps that cache for the
  next run. Unless --config is given, the disk tier is raised to 2 GiB to hold them.
- warm_yield: time to first audio of live misses (a new sentence each time) with no warm-up
  running, then while POST /v1/cache/warm works through 50 phrases (a live request every 0.25 s,
  the warm-up between them); median of each and their ratio (target: warm-up costs live requests
  at most 20%).

Uses tools.daemon_bench's daemon process and tools.loadgen's client; prints {"daemon_cache": {...}},
merged into --out FILE like tools.daemon_bench.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .daemon_bench import DaemonProcess, print_report
from .loadgen import PHRASES, generated_phrases, run_load, synthesize, zipf_exponent
from .stats import median, percentiles

PHRASE = "The front door has been open for ten minutes."
LIVE_PAUSE_S = 0.25
"""Between the live requests of the warm_yield run."""
ZIPF_CONFIG = "[cache]\ndisk_bytes = 2147483648\n"
"""10,000 prompts of 2-4 s are ~1.4 GB of PCM: more than the default 1 GiB disk tier."""


async def first_audio_after(daemon: DaemonProcess, body: dict[str, Any], timeout_s: float = 30.0) -> float:
    """Seconds from the daemon's exec to the first audio byte of `body`, retrying while the socket
    is not there yet (each try is a new connection)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        outcome = await synthesize(daemon.socket, body, timeout_s=timeout_s)
        if outcome.status == 200 and outcome.first_audio_s is not None:
            return time.perf_counter() - outcome.total_s + outcome.first_audio_s - daemon.exec_at
        await asyncio.sleep(0.001)
    raise RuntimeError(f"no audio within {timeout_s} s")


async def wait_flushed(daemon: DaemonProcess) -> None:
    for _ in range(500):
        cache = daemon.status()["cache"]
        if cache["write_queue_bytes"] == 0 and cache["in_flight"] == 0 and cache["disk_entries"]:
            return
        await asyncio.sleep(0.01)
    raise RuntimeError("the cache did not reach the disk")


def measure_restart(directory: Path, config: str, runs: int) -> dict[str, Any]:
    body = {"text": PHRASE, "format": "pcm"}
    daemon = DaemonProcess(directory, config)
    samples, states = [], []
    try:
        daemon.wait_ready()
        first = asyncio.run(synthesize(daemon.socket, body))
        asyncio.run(wait_flushed(daemon))
        for _ in range(runs):
            daemon.kill()
            daemon = DaemonProcess(directory, config)
            samples.append(asyncio.run(first_audio_after(daemon, body)) * 1000)
            states.append(daemon.health())
            outcome = asyncio.run(synthesize(daemon.socket, body))
            if outcome.audio_bytes != first.audio_bytes:
                raise RuntimeError("a restarted daemon served other audio")
    finally:
        daemon.close()
    return {"runs": runs, "exec_to_first_audio_ms_best": round(min(samples), 1),
            "exec_to_first_audio_ms_median": median(samples),
            "exec_to_first_audio_ms_max": round(max(samples), 1),
            "states_when_served": sorted({s or "?" for s in states}), "target_ms": 300}


async def measure_hits(daemon: DaemonProcess, requests: int) -> dict[str, Any]:
    body = {"text": PHRASE, "format": "pcm"}
    await synthesize(daemon.socket, body)  # cached now
    firsts, totals = [], []
    for _ in range(requests):
        outcome = await synthesize(daemon.socket, body)
        if outcome.status != 200 or outcome.first_audio_s is None:
            raise RuntimeError(f"hit failed: {outcome}")
        firsts.append(outcome.first_audio_s)
        totals.append(outcome.total_s)
    return {"requests": requests, "audio_bytes": outcome.audio_bytes, "ttfa_ms": percentiles(firsts),
            "total_ms": percentiles(totals), "target_p99_ms": 5}


def start_warm(daemon: DaemonProcess, phrases: list[str]) -> None:
    from edged.client import request

    request(daemon.socket, "POST", "/v1/cache/warm", {"phrases": phrases}).read()


def warming(daemon: DaemonProcess) -> bool:
    progress = daemon.status()["cache"]["warm"]
    return bool(progress["done"] < progress["total"])


def warm(daemon: DaemonProcess, phrases: list[str]) -> None:
    start_warm(daemon, phrases)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if not warming(daemon):
            return
        time.sleep(0.1)
    raise RuntimeError("warm-up did not finish")


async def measure_warm_yield(daemon: DaemonProcess, requests: int) -> dict[str, Any]:
    """Live misses one after another, first alone, then while a 50-phrase warm-up runs. A pause
    between live requests (as on a device) gives the warm-up time to run and be caught in flight."""
    live = iter(range(10_000))

    async def ttfa() -> float:
        await asyncio.sleep(LIVE_PAUSE_S)
        outcome = await synthesize(daemon.socket, {"text": f"{PHRASE} Live request {next(live)}.",
                                                   "format": "pcm"})
        if outcome.status != 200 or outcome.first_audio_s is None:
            raise RuntimeError(f"live request failed: {outcome}")
        return outcome.first_audio_s

    await ttfa()  # the first synthesis pays for lazy set-up
    alone = [await ttfa() for _ in range(requests)]
    start_warm(daemon, [f"Warm-up phrase number {i}, about the garden and the kitchen." for i in range(50)])
    during: list[float] = []
    while len(during) < requests and warming(daemon):
        during.append(await ttfa())
    warm_left = warming(daemon)  # the caller stops this daemon: the rest of the warm-up is cancelled
    status = daemon.status()
    progress = status["cache"]["warm"]
    if len(during) < requests // 2:
        raise RuntimeError(f"warm-up ended after {len(during)} live requests: too few to compare")
    without, with_warm = median(alone, scale=1000), median(during, scale=1000)
    return {"requests": [len(alone), len(during)], "ttfa_ms_median_without_warm": without,
            "ttfa_ms_median_with_warm": with_warm, "ratio": round(with_warm / without, 2),
            "warm_still_running_at_end": warm_left, "warm_phrases_done": progress["done"],
            "warm_runs_preempted": status["synthesis"]["background_preempted"], "target_ratio_max": 1.2}


async def fill(daemon: DaemonProcess, phrases: list[str], clients: int = 2) -> dict[str, Any]:
    """Ask for every phrase once (in order, `clients` at a time), so that each is cached."""
    todo = iter(phrases)
    cached_before = daemon.status()["cache"]["disk_entries"]
    started = time.perf_counter()
    failed = 0

    async def client() -> None:
        nonlocal failed
        for text in todo:
            outcome = await synthesize(daemon.socket, {"text": text, "format": "pcm"})
            failed += outcome.status != 200
            if outcome.status == 503:
                await asyncio.sleep(0.05)

    await asyncio.gather(*(client() for _ in range(clients)))
    await wait_flushed(daemon)
    return {"phrases": len(phrases), "disk_entries_before": cached_before, "failed": failed,
            "disk_entries_after": daemon.status()["cache"]["disk_entries"],
            "seconds": round(time.perf_counter() - started, 1)}


def measure_zipf(daemon: DaemonProcess, phrases: list[str], clients: int, requests: int) -> dict[str, Any]:
    exponent = zipf_exponent(len(phrases), 0.2, 0.8)
    filled = asyncio.run(fill(daemon, phrases))
    # The memory tier starts from the fill's order, not the workload's: one untimed run first.
    asyncio.run(run_load(daemon.socket, clients=clients, requests=requests // 4, phrases=phrases,
                         zipf=exponent, seed=2))
    before = daemon.status()["cache"]
    load = asyncio.run(run_load(daemon.socket, clients=clients, requests=requests, duration_s=120,
                                phrases=phrases, zipf=exponent))
    after = daemon.status()["cache"]
    tiers = {k: after[k] - before[k] for k in ("memory_hits", "disk_hits", "memory_misses") if k in after}
    return {"fill": filled, **load, "cache_during_run": tiers,
            "target": {"throughput_rps": 800, "total_p99_ms": 50}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.daemon_cache_bench")
    parser.add_argument("--quick", action="store_true", help="fewer restarts and requests")
    parser.add_argument("--only", nargs="*", choices=["restart", "hit", "load", "zipf", "warm_yield"])
    parser.add_argument("--phrases", type=int, default=10_000, help="generated phrases of the zipf run")
    parser.add_argument("--cache-dir", type=Path,
                        help="the zipf run's cache home, kept (filled once, reused by later runs)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients of the load run")
    parser.add_argument("--out", type=Path, help="merge the report into this JSON file")
    parser.add_argument("--config", type=Path, help="daemon configuration (TOML) for every run")
    args = parser.parse_args(argv)
    only = set(args.only or ["restart", "hit", "load", "zipf", "warm_yield"])
    config = args.config.read_text(encoding="utf-8") if args.config else ""
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="edged-cache-bench-") as tmp:
        workdir = Path(tmp)
        if "restart" in only:
            (workdir / "restart").mkdir()
            report["restart"] = measure_restart(workdir / "restart", config, 3 if args.quick else 7)
        if "zipf" in only:
            (workdir / "zipf").mkdir()
            with DaemonProcess(workdir / "zipf", config or ZIPF_CONFIG, cache_home=args.cache_dir) as daemon:
                daemon.wait_ready()
                report["zipf"] = measure_zipf(daemon, generated_phrases(args.phrases), args.clients,
                                              2000 if args.quick else 20_000)
        if "warm_yield" in only:
            (workdir / "warm").mkdir()
            with DaemonProcess(workdir / "warm", config) as daemon:
                daemon.wait_ready()
                report["warm_yield"] = asyncio.run(measure_warm_yield(daemon, 5 if args.quick else 20))
        if only & {"hit", "load"}:
            (workdir / "main").mkdir()
            with DaemonProcess(workdir / "main", config) as daemon:
                daemon.wait_ready()
                if "hit" in only:
                    report["hit"] = asyncio.run(measure_hits(daemon, 300 if args.quick else 2000))
                if "load" in only:
                    warm(daemon, PHRASES)
                    load = asyncio.run(run_load(daemon.socket, clients=args.clients,
                                                requests=2000 if args.quick else 20_000, duration_s=60))
                    report["load"] = {**load, "target": {"throughput_rps": 800, "total_p99_ms": 50}}
                    report["load"]["cache"] = {k: v for k, v in daemon.status()["cache"].items()
                                               if k in ("memory_hits", "memory_misses", "joined", "disk_hits")}
    print_report({"daemon_cache": report}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
