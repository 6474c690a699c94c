"""Load generator for a running edged: python -m tools.loadgen [--socket PATH] [--clients N] ...

N concurrent clients send synthesis requests over the Unix socket, choosing phrases from a list
with a Zipf distribution (a few phrases very often, most rarely, as prompts on a device are), until
`--requests` have been sent or `--duration` seconds have passed, whichever comes first. Prints one
JSON object: throughput, errors by status, and p50/p95/p99 of time to first audio and of total
time, all measured here, by the client. `run_load()` gives the same dict to tools.daemon_bench,
whose JSON joins tools.bench's.

HTTP is spoken with h11 (a dependency of uvicorn), so that the first audio bytes are timed as
they arrive, not when a client library hands over the whole body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11

from .stats import percentiles

PHRASES = [
    "Your timer is done.",
    "The front door is open.",
    "You have a new message.",
    "The washing machine has finished.",
    "Battery low, please connect the charger.",
    "Good morning. It is seven o'clock.",
    "The kettle has boiled.",
    "Motion detected in the garden.",
    "Your parcel has been delivered to the front desk.",
    "It will rain this afternoon, so take an umbrella with you.",
    "The oven has reached two hundred degrees.",
    "Reminder: the bins go out tonight.",
    "The temperature in the living room is twenty one degrees.",
    "Someone is at the door.",
    "The dishwasher needs more salt.",
    "Your meeting with the dentist starts in fifteen minutes, on the second floor.",
    "All windows are closed and the alarm is set.",
    "The freezer door has been open for five minutes.",
    "Playback paused.",
    "Welcome home.",
]


@dataclass(frozen=True)
class Outcome:
    status: int
    """HTTP status; 0 when the connection failed or broke off."""
    first_audio_s: float | None
    """From sending the request to the first audio bytes (after any WAV header)."""
    total_s: float
    audio_bytes: int
    error: str = ""


async def synthesize(socket_path: Path, body: dict[str, Any], route: str = "/v1/synthesize",
                     timeout_s: float = 120.0) -> Outcome:
    """One request on a fresh connection, timed from just before it is sent."""
    header_bytes = 44 if body.get("format", body.get("response_format", "wav")) == "wav" else 0
    payload = json.dumps(body).encode("utf-8")
    started = time.perf_counter()
    status, first, received = 0, None, 0
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(str(socket_path))
            conn = h11.Connection(h11.CLIENT)
            writer.write(conn.send(h11.Request(method="POST", target=route, headers=[
                ("Host", "edged"), ("Content-Type", "application/json"),
                ("Content-Length", str(len(payload))), ("Connection", "close")])))
            writer.write(conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
            await writer.drain()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    received += len(event.data)
                    if first is None and received > header_bytes and status == 200:
                        first = time.perf_counter() - started
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
    except (OSError, h11.ProtocolError, TimeoutError) as exc:
        return Outcome(0, first, time.perf_counter() - started, received, f"{type(exc).__name__}: {exc}")
    finally:
        if writer is not None:
            writer.close()
    return Outcome(status, first, time.perf_counter() - started, max(0, received - header_bytes))


def zipf_weights(n: int, exponent: float) -> list[float]:
    return [1.0 / (rank ** exponent) for rank in range(1, n + 1)]


def zipf_exponent(n: int, top_fraction: float, share: float) -> float:
    """The Zipf exponent over `n` phrases that sends `share` of the requests to the most frequent
    `top_fraction` of them (0.2, 0.8: the "80/20" workload)."""
    top = max(1, round(n * top_fraction))
    low, high = 0.0, 10.0
    for _ in range(60):  # bisection: the top's share grows with the exponent
        middle = (low + high) / 2
        weights = zipf_weights(n, middle)
        low, high = (middle, high) if sum(weights[:top]) / sum(weights) < share else (low, middle)
    return round((low + high) / 2, 4)


def generated_phrases(count: int) -> list[str]:
    """`count` distinct short prompts, the same on every run ("Order 17 is ready at counter 3.")."""
    templates = ["Order {n} is ready at counter {c}.", "Parcel {n} has arrived at the front desk.",
                 "Room {n} is free until {c} o'clock.", "Bus {n} leaves from stop {c} in five minutes.",
                 "Table {n} would like to pay."]
    return [templates[i % len(templates)].format(n=i // len(templates) + 1, c=i % 9 + 1) for i in range(count)]


async def run_load(socket_path: Path, clients: int = 4, requests: int = 200, duration_s: float = 60.0,
                   phrases: list[str] | None = None, zipf: float = 1.1, seed: int = 1,
                   audio_format: str = "pcm", sample_rate: int = 22050,
                   busy_pause_s: float = 0.05) -> dict[str, Any]:
    """`clients` concurrent clients until `requests` are sent or `duration_s` has passed; a client
    refused with 503 pauses `busy_pause_s` before its next request."""
    phrases = phrases or PHRASES
    rng = random.Random(seed)
    weights = zipf_weights(len(phrases), zipf)
    outcomes: list[Outcome] = []
    sent = 0
    started = time.perf_counter()
    deadline = started + duration_s

    async def client() -> None:
        nonlocal sent
        while sent < requests and time.perf_counter() < deadline:
            sent += 1
            text = rng.choices(phrases, weights)[0]
            outcome = await synthesize(socket_path, {"text": text, "format": audio_format})
            outcomes.append(outcome)
            if outcome.status == 503:
                await asyncio.sleep(busy_pause_s)

    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    ok = [o for o in outcomes if o.status == 200 and not o.error]
    busy = [o for o in outcomes if o.status == 503]
    statuses = Counter(str(o.status) for o in outcomes if o.status != 200 or o.error)
    audio_s = sum(o.audio_bytes for o in ok) / 2 / sample_rate
    return {
        "clients": clients, "requests": len(outcomes), "ok": len(ok), "errors": dict(statuses),
        "duration_s": round(elapsed, 2),
        "throughput_rps": round(len(ok) / elapsed, 2) if elapsed else None,
        "audio_s_per_s": round(audio_s / elapsed, 2) if elapsed else None,
        "ttfa_ms": percentiles([o.first_audio_s for o in ok if o.first_audio_s is not None]),
        "total_ms": percentiles([o.total_s for o in ok]),
        "busy_ms": percentiles([o.total_s for o in busy]),
        "zipf": zipf, "phrases": len(phrases),
    }


def positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return int(value)


def hot_share(value: str) -> tuple[float, float]:
    """--hot FRACTION:SHARE, both strictly between 0 and 1."""
    try:
        fraction, share = (float(part) for part in value.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not FRACTION:SHARE, e.g. 0.2:0.8") from None
    if not (0 < fraction < 1 and 0 < share < 1):
        raise argparse.ArgumentTypeError("FRACTION and SHARE must be between 0 and 1")
    return fraction, share


def default_socket() -> Path:
    from edged.config import default_socket_path

    return default_socket_path(os.environ)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.loadgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", type=Path, default=None, help="daemon socket (default: as edgectl)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=200, help="stop after this many requests")
    parser.add_argument("--duration", type=float, default=60.0, help="... or after this many seconds")
    parser.add_argument("--phrases", type=Path, help="phrase list, one per line (default: built in)")
    parser.add_argument("--generated", type=positive_int, metavar="N", help="use N generated phrases instead of a list")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent over the phrase list")
    parser.add_argument("--hot", metavar="FRACTION:SHARE", type=hot_share,
                        help="instead of --zipf: the exponent that sends SHARE of the requests to the top "
                             "FRACTION of the phrases (0.2:0.8 is the 80/20 workload)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--format", choices=["wav", "pcm"], default="pcm")
    args = parser.parse_args(argv)
    phrases = None
    if args.phrases:
        phrases = [line.strip() for line in args.phrases.read_text(encoding="utf-8").splitlines() if line.strip()]
    elif args.generated:
        phrases = generated_phrases(args.generated)
    exponent = args.zipf
    if args.hot:
        exponent = zipf_exponent(len(phrases or PHRASES), *args.hot)
    report = asyncio.run(run_load(args.socket or default_socket(), args.clients, args.requests, args.duration,
                                  phrases, exponent, args.seed, args.format))
    json.dump({"loadgen": report}, sys.stdout, indent=2)
    print()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
