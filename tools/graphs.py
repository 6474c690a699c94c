"""Cutting a Piper (VITS) graph into a front and a back graph, and saving graphs for mapping.

The cut is at the latent frames that feed the flow: `/Add_output_0` (z_p, 1 x 192 x frames, noise
already applied) and `/Cast_2_output_0` (the frame mask). Everything before is the front (text
encoder, duration predictor, alignment expansion); everything after is the back (flow + decoder),
which only ever sees frames, so it can run on windows of them.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx.utils import Extractor

FRONT_INPUTS = ["input", "input_lengths", "scales"]
LATENTS = "/Add_output_0"
FRAME_MASK = "/Cast_2_output_0"
BACK_INPUTS = ["latents", "frame_mask"]
AUDIO = "output"


class CutError(Exception):
    """The source graph cannot be cut at the expected tensors."""


def split_voice(model: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """Return (front, back); raise CutError unless the back needs nothing but the two cut tensors."""
    produced = {out for node in model.graph.node for out in node.output}
    for name in (LATENTS, FRAME_MASK):
        if name not in produced:
            raise CutError(f"source graph has no tensor {name}: not a Piper VITS export?")
    extractor = Extractor(model)
    front = extractor.extract_model(FRONT_INPUTS, [LATENTS, FRAME_MASK])
    back = extractor.extract_model([LATENTS, FRAME_MASK], [AUDIO])
    _check_closed(back)
    _check_closed(front)
    _rename_tensors(front, {LATENTS: "latents", FRAME_MASK: "frame_mask"})
    _rename_tensors(back, {LATENTS: "latents", FRAME_MASK: "frame_mask", AUDIO: "audio"})
    front.graph.name, back.graph.name = "front", "back"
    return front, back


def _check_closed(model: onnx.ModelProto) -> None:
    """Every tensor a node reads must come from the graph's inputs, initializers or other nodes."""
    graph = model.graph
    available = {""} | {i.name for i in graph.input} | {i.name for i in graph.initializer}
    available |= {out for node in graph.node for out in node.output}
    missing = {name for node in graph.node for name in node.input} - available
    if missing:
        raise CutError(f"{graph.name or 'graph'} is incomplete, it reads {sorted(missing)}")


def _rename_tensors(model: onnx.ModelProto, names: dict[str, str]) -> None:
    graph = model.graph
    for node in graph.node:
        node.input[:] = [names.get(n, n) for n in node.input]
        node.output[:] = [names.get(n, n) for n in node.output]
    for value in list(graph.input) + list(graph.output):
        value.name = names.get(value.name, value.name)


def save_mapped(model: onnx.ModelProto, path: Path) -> list[str]:
    """Save with every weight in one external-data file beside the graph, so onnxruntime maps it.

    Returns the file names written (graph, data), relative to the graph's directory.
    """
    data_name = path.name + ".data"
    (path.parent / data_name).unlink(missing_ok=True)
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=1024,
    )
    return [path.name, data_name]
