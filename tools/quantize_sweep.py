"""The experiment behind tools.quantize.CHOSEN: quantize each graph every way in SWEEP and measure
each against fp32 (the other graph stays fp32).

    python -m tools.quantize --sweep [--methods Percentile Entropy] [--write]

Timings are medians of interleaved runs in one process; on a box shared with other work they wander
(compare speedups within a run, not milliseconds across runs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx

from . import graphs
from .build_voice import default_source, optimize_offline
from .quantize import (
    CHOSEN,
    FLOW,
    FRONT_KEEP,
    LAST_STAGE,
    SWEEP_FILE,
    Variant,
    VoiceFacts,
    calibration_feeds,
    quantize_graph,
)
from .quantize_report import measure

SWEEP: dict[str, tuple[Variant, ...]] = {
    "front": (
        Variant(),
        Variant(activations="u8"),
        Variant(keep_fp32=("/dp/",), activations="u8"),
        Variant(keep_fp32=FRONT_KEEP),
        Variant(keep_fp32=FRONT_KEEP, activations="u8"),
        Variant(keep_fp32=FRONT_KEEP + FLOW, activations="u8"),
        Variant(keep_fp32=FRONT_KEEP, per_channel=False, activations="u8"),
        Variant(op_types=("Conv", "MatMul"), activations="u8"),
        Variant(keep_fp32=FRONT_KEEP, quant_format="QOperator", activations="u8"),
        Variant(keep_fp32=FRONT_KEEP, reduce_range=True, activations="u8"),
        Variant(keep_fp32=FRONT_KEEP, dedicated_pairs=False, activations="u8"),
    ),
    "back": (
        Variant(),
        Variant(per_channel=False),
        Variant(quant_format="QOperator"),
        Variant(reduce_range=True),
        Variant(activations="u8"),
        Variant(dedicated_pairs=False),
        Variant(op_types=()),
        Variant(op_types=("Conv", "ConvTranspose", "LeakyRelu")),
        Variant(keep_fp32=("/dec/conv_post",)),
        Variant(keep_fp32=("/dec/conv_post", "/dec/resblocks.8")),
        Variant(keep_fp32=LAST_STAGE),
    ),
}


def sweep(methods: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Measure every SWEEP variant, and CHOSEN calibrated with each of `methods`; one row each."""
    model_path, config_path = default_source()
    facts = VoiceFacts.from_config(json.loads(config_path.read_text(encoding="utf-8")))
    rows = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        fp32, models = {}, {}
        for name, model in zip(("front", "back"), graphs.split_voice(onnx.load(str(model_path))),
                               strict=True):
            raw = tmp / f"{name}.raw.onnx"
            graphs.save_mapped(model, raw)
            optimize_offline(raw, tmp / f"{name}.fp32.onnx")
            fp32[name], models[name] = tmp / f"{name}.fp32.onnx", onnx.load(str(raw))
        feeds = calibration_feeds(models["front"], facts)
        for name, variants in SWEEP.items():
            extra = tuple(Variant(**{**CHOSEN[name].__dict__, "method": m}) for m in methods)
            for n, variant in enumerate(variants + extra):
                started = time.perf_counter()
                target = tmp / f"{name}.{n}.onnx"
                # Ranges depend only on the op types and the method: calibrate once for each.
                cache = tmp / f"{name}.{'+'.join(variant.op_types)}.{variant.method}.json"
                quantize_graph(models[name], feeds[name], variant, target, cache)
                seconds = time.perf_counter() - started
                figures = measure({"fp32": fp32, "int8": {**fp32, name: target}}, facts, runs=25)
                rows.append(_row(name, variant, figures, seconds))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _row(graph: str, variant: Variant, figures: dict[str, Any], seconds: float) -> dict[str, Any]:
    ms, quality = figures["speed_ms"], figures["quality"]
    keys = ("back_lsd_db", "back_snr_db") if graph == "back" else ("front_lsd_db",)
    return {"graph": graph, "variant": variant.label,
            "fp32_ms": ms[f"{graph}.fp32"], "int8_ms": ms[f"{graph}.int8"],
            "speedup": round(ms[f"{graph}.fp32"] / ms[f"{graph}.int8"], 2),
            **{k: quality[k] for k in keys}, "quantize_s": round(seconds, 1)}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'graph':6} {'variant':90} {'fp32 ms':>8} {'int8 ms':>8} {'x':>5}  quality (dB)")
    for r in rows:
        quality = ", ".join(f"{k.removesuffix('_db')} {v}" for k, v in r.items() if k.endswith("_db"))
        print(f"{r['graph']:6} {r['variant']:90} {r['fp32_ms']:8.1f} {r['int8_ms']:8.1f} "
              f"{r['speedup']:5.2f}  {quality}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.quantize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="try every variant, print a table")
    parser.add_argument("--methods", nargs="*", default=(), choices=("Percentile", "Entropy"),
                        help="also try the chosen variants with these (slow) calibration methods")
    parser.add_argument("--write", action="store_true",
                        help=f"save the table as tools/{SWEEP_FILE.name}, which the builder's report cites")
    args = parser.parse_args(argv)
    if not args.sweep:
        parser.print_help()
        return 2
    rows = sweep(tuple(args.methods))
    print_table(rows)
    if args.write:
        SWEEP_FILE.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0
