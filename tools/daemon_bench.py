"""The daemon's figures, measured by a client: python -m tools.daemon_bench [--quick] [--out FILE]

- start: exec of `python -m edged serve` -> socket answering (health polled every 2 ms until it
  answers) -> READY=1 on $NOTIFY_SOCKET (what systemd waits for), best and median of several fresh
  processes, and memory at READY;
- ttfa_long: time to first audio over the socket for a long sentence, each run a new text;
- load: tools.loadgen with as many clients as the box runs syntheses at once;
- overload: a burst of 4x (running + queued) requests at once: how fast the refused ones get
  503, that nothing hangs, memory before/after, and a normal request after the burst;
- soak: a bounded loop of short requests, resident memory sampled along it (with the cache on,
  the loop measures cache hits; --no-cache makes every request a synthesis).

Prints {"daemon": {...}}; with --out FILE the section is merged into that JSON file (for example
the output of tools.bench), other sections kept.
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Self

from edged.client import UnixConnection

from .bench import TEXTS
from .loadgen import run_load, synthesize
from .procmem import read_memory
from .stats import median, percentiles

REPO = Path(__file__).resolve().parent.parent
LONG = ("When you get home this evening, please remember to water the tomatoes and the herbs on the balcony, "
        "feed the cat before seven, check whether the parcel from your sister has arrived at the front desk "
        "downstairs, call the plumber about the dripping tap in the kitchen, and, if there is still time "
        "before dinner, take the recycling out to the green bins behind the garage.")
MEDIUM = TEXTS["medium"]


@functools.cache
def _compile_edged() -> None:
    """Start-up is measured as installed, where pip has compiled the bytecode; an editable install
    under PYTHONDONTWRITEBYTECODE would compile edged at every start (~100 ms here). Once per run."""
    compileall.compile_dir(REPO / "edged", quiet=1)


class DaemonProcess:
    def __init__(self, directory: Path, config: str = "", cache_home: Path | None = None) -> None:
        self.socket = directory / "edged.sock"
        config_file = directory / "edged.toml"
        config_file.write_text(config, encoding="utf-8")
        self.log = open(directory / "edged.log", "ab")  # noqa: SIM115 (closed in stop)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        (directory / "notify.sock").unlink(missing_ok=True)  # left by a daemon run here before
        self.notify.bind(str(directory / "notify.sock"))
        # A cache of its own, removed after the run unless the caller keeps one.
        env = {**os.environ, "XDG_CACHE_HOME": str(cache_home or directory / "cache"),
               "NOTIFY_SOCKET": str(directory / "notify.sock")}
        _compile_edged()
        self.exec_at = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "edged", "serve", "--socket", str(self.socket),
                                      "--config", str(config_file)], cwd=REPO, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env)

    def health(self) -> str | None:
        connection = UnixConnection(self.socket, timeout=5)
        try:
            connection.request("GET", "/v1/health")
            return str(json.loads(connection.getresponse().read())["state"])
        except Exception:  # not up yet: any failure means "poll again"  # noqa: BLE001
            return None
        finally:
            connection.close()

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, float]:
        """Milliseconds from exec to the first answer on the socket and to READY=1 on the notify
        socket. Health is polled only until the first answer, so that polling does not take CPU
        from the rest of the start."""
        answering = ready = None
        deadline = time.perf_counter() + timeout_s
        while ready is None and time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}")
            if answering is None and self.health() is not None:
                answering = time.perf_counter()
            self.notify.settimeout(0.002 if answering is None else 0.05)
            try:
                if b"READY=1" in self.notify.recv(4096).split(b"\n"):
                    ready = time.perf_counter()
            except TimeoutError:
                pass
        if ready is None or answering is None:
            raise RuntimeError("daemon not READY in time")
        return {"answering_ms": round((answering - self.exec_at) * 1000, 1),
                "ready_ms": round((ready - self.exec_at) * 1000, 1)}

    def memory(self) -> dict[str, float]:
        return read_memory(self.proc.pid).as_dict()

    def status(self) -> dict[str, Any]:
        connection = UnixConnection(self.socket, timeout=30)
        try:
            connection.request("GET", "/v1/status")
            return dict(json.loads(connection.getresponse().read()))
        finally:
            connection.close()

    def stop(self) -> int:
        """SIGTERM and the exit code; SIGKILL if it does not exit within a minute."""
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)
        finally:
            self._release()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown at all."""
        self.proc.kill()
        self.proc.wait(10)
        self._release()

    def close(self) -> None:
        """Stopped, whatever happened before (a failed measurement, a kill)."""
        if self.proc.poll() is None:
            self.stop()
        self._release()

    def _release(self) -> None:
        self.log.close()
        self.notify.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure_start(runs: int, workdir: Path, config: str = "") -> dict[str, Any]:
    samples = []
    for i in range(runs):
        directory = workdir / f"start{i}"
        directory.mkdir()
        with DaemonProcess(directory, config) as daemon:
            figures = daemon.wait_ready()
            memory = daemon.memory()
            figures["rss_at_ready_mb"], figures["anon_at_ready_mb"] = memory["rss"], memory["anon"]
            samples.append(figures)
    ready = [s["ready_ms"] for s in samples]
    return {"runs": runs, "ready_ms_best": min(ready), "ready_ms_median": median(ready),
            "answering_ms_median": median(s["answering_ms"] for s in samples),
            "anon_at_ready_mb": samples[-1]["anon_at_ready_mb"], "rss_at_ready_mb": samples[-1]["rss_at_ready_mb"]}


async def measure_ttfa_long(socket: Path, runs: int) -> dict[str, Any]:
    firsts, totals = [], []
    for i in range(runs):  # a different text each time (never served from a cache), its end only:
        # in front, "Note 3." was a sentence of its own, and its first audio was measured
        outcome = await synthesize(socket, {"text": f"{LONG} Note {i + 1}.", "format": "pcm"})
        if outcome.status != 200 or outcome.first_audio_s is None:
            raise RuntimeError(f"long request failed: {outcome}")
        firsts.append(outcome.first_audio_s * 1000)
        totals.append(outcome.total_s * 1000)
    audio_s = outcome.audio_bytes / 2 / 22050
    return {"runs": runs, "audio_s": round(audio_s, 1), "ttfa_ms_median": median(firsts),
            "ttfa_ms_min": round(min(firsts), 1), "ttfa_ms_max": round(max(firsts), 1),
            "total_ms_median": median(totals)}


async def measure_overload(daemon: DaemonProcess, sustained_s: float) -> dict[str, Any]:
    """A burst of 4x (running + queued) requests at once, then as many closed-loop clients for
    `sustained_s` seconds (each pausing 50 ms after a 503), then one ordinary request."""
    status = daemon.status()
    capacity = status["admission"]["capacity"] + status["admission"]["queue_size"]
    burst = 4 * capacity
    before = daemon.memory()
    started = time.perf_counter()
    outcomes = await asyncio.wait_for(asyncio.gather(*(
        synthesize(daemon.socket, {"text": f"{MEDIUM} Number {i}.", "format": "pcm"}) for i in range(burst)
    )), timeout=300)
    burst_s = time.perf_counter() - started
    after_burst = daemon.memory()
    refused = [o.total_s for o in outcomes if o.status == 503]
    served = [o for o in outcomes if o.status == 200]
    sustained = await asyncio.wait_for(run_load(daemon.socket, clients=burst, requests=1_000_000,
                                                duration_s=sustained_s), timeout=sustained_s + 300)
    after_sustained = daemon.memory()
    normal = await synthesize(daemon.socket, {"text": "Back to normal service.", "format": "pcm"})
    return {
        "burst": {"requests": burst, "served": len(served), "refused_503": len(refused),
                  "other": len(outcomes) - len(served) - len(refused),
                  "refused_latency_ms": percentiles(refused),
                  "served_total_ms": percentiles([o.total_s for o in served]), "seconds": round(burst_s, 2)},
        "sustained": {k: sustained[k] for k in ("clients", "requests", "ok", "errors", "duration_s",
                                                "ttfa_ms", "busy_ms")},
        "anon_mb": {"before": before["anon"], "after_burst": after_burst["anon"],
                    "after_sustained": after_sustained["anon"]},
        "after": {"status": normal.status, "ttfa_ms": round((normal.first_audio_s or 0) * 1000, 1)},
    }


async def measure_soak(daemon: DaemonProcess, requests: int, sample_every: int) -> dict[str, Any]:
    samples: list[tuple[int, float, float]] = []
    failures = 0
    started = time.perf_counter()
    for i in range(1, requests + 1):
        outcome = await synthesize(daemon.socket, {"text": "Okay.", "format": "pcm"})
        failures += outcome.status != 200
        if i % sample_every == 0:
            memory = daemon.memory()
            samples.append((i, memory["rss"], memory["anon"]))
    warm = samples[0]
    return {
        "requests": requests, "failures": failures, "seconds": round(time.perf_counter() - started, 1),
        "rss_after_warmup_mb": warm[1], "rss_end_mb": samples[-1][1],
        "rss_growth_mb": round(samples[-1][1] - warm[1], 1), "anon_growth_mb": round(samples[-1][2] - warm[2], 1),
        "rss_max_mb": max(s[1] for s in samples),
        "samples": [{"after": n, "rss_mb": r, "anon_mb": a} for n, r, a in samples],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.daemon_bench")
    parser.add_argument("--quick", action="store_true", help="fewer runs, a 1,000-request soak")
    parser.add_argument("--soak", type=int, help="requests in the soak loop (default 10000; quick: 1000)")
    parser.add_argument("--only", nargs="*", choices=["start", "ttfa", "load", "overload", "soak"])
    parser.add_argument("--out", type=Path, help="merge the report into this JSON file")
    parser.add_argument("--config", type=Path, help="daemon configuration (TOML) for every run")
    parser.add_argument("--no-cache", action="store_true",
                        help="disable the audio cache, so every request is synthesized")
    args = parser.parse_args(argv)
    only = set(args.only or ["start", "ttfa", "load", "overload", "soak"])
    soak_requests = args.soak or (1000 if args.quick else 10_000)
    config = args.config.read_text(encoding="utf-8") if args.config else ""
    if args.no_cache:
        config += "\n[cache]\nenabled = false\n"
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="edged-bench-") as tmp:
        workdir = Path(tmp)
        if "start" in only:
            report["start"] = measure_start(3 if args.quick else 7, workdir, config)
        (workdir / "main").mkdir()
        daemon = DaemonProcess(workdir / "main", config)
        try:
            daemon.wait_ready()
            if "ttfa" in only:
                report["ttfa_long"] = asyncio.run(measure_ttfa_long(daemon.socket, 5 if args.quick else 11))
            if "load" in only:
                capacity = daemon.status()["admission"]["capacity"]
                report["load"] = asyncio.run(run_load(daemon.socket, clients=capacity,
                                                      requests=100 if args.quick else 400, duration_s=120))
            if "overload" in only:
                report["overload"] = asyncio.run(measure_overload(daemon, 5 if args.quick else 20))
            if "soak" in only:
                report["soak"] = asyncio.run(measure_soak(daemon, soak_requests, max(1, soak_requests // 20)))
        finally:
            report["exit_code_on_sigterm"] = daemon.stop()
    report["cache"] = not args.no_cache
    print_report({"daemon": report}, args.out)
    return 0


def print_report(output: dict[str, Any], out: Path | None) -> None:
    """Print the report as JSON and, with --out, merge it into that file (e.g. tools.bench's JSON)."""
    if out is not None:
        merged = json.loads(out.read_text()) if out.exists() else {}
        merged.update(output)
        out.write_text(json.dumps(merged, indent=2) + "\n")
    json.dump(output, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    sys.exit(main())
