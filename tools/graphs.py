"""Cutting a Piper (VITS) graph into a front and a back graph, and saving graphs for mapping.

The cut is at the decoder's input, `/Mul_7_output_0`: the flow's output times the frame mask
(1 x 192 x frames). Everything before it is the front (text encoder, duration predictor,
alignment expansion, noise, and the flow), run once per piece; everything after it is the back
(the HiFi-GAN decoder), which only ever sees frames, so it can run on windows of them.

The flow is in the front (DESIGN.md puts it in the back): run on windows, it needed ~32 frames of
context each way where the decoder needs 12; and in int8, two overlapping flow runs do not give
the same frames (a value near a rounding step falls either way), which was heard as clicks at
window joins. Run once per piece, it is computed once and the windows join exactly.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx.utils import Extractor

FRONT_INPUTS = ["input", "input_lengths", "scales"]
DECODER_INPUT = "/Mul_7_output_0"
DECODER_FIRST_NODE = "/dec/conv_pre/Conv"
AUDIO = "output"


class CutError(Exception):
    """The source graph cannot be cut at the expected tensors."""


def split_voice(model: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """Return (front, back); raise CutError unless the back needs nothing but the decoder's input."""
    if any(i.name == "sid" for i in model.graph.input):  # the decoder would read the speaker too
        raise CutError("a voice of several speakers (its model takes a speaker id, 'sid'): edged "
                       "speaks voices of one speaker only")
    readers = [node.name for node in model.graph.node if DECODER_INPUT in node.input]
    if readers != [DECODER_FIRST_NODE]:
        raise CutError(f"{DECODER_INPUT} is not the decoder's input alone (read by {readers}): "
                       "not a Piper VITS export?")
    if DECODER_INPUT not in {v.name for v in model.graph.value_info}:
        # Exports by newer torch carry no shapes of inner tensors, which the extractor needs.
        model = onnx.shape_inference.infer_shapes(model)
    extractor = Extractor(model)
    front = extractor.extract_model(FRONT_INPUTS, [DECODER_INPUT])
    back = extractor.extract_model([DECODER_INPUT], [AUDIO])
    _check_closed(back, "back")
    _check_closed(front, "front")
    _rename_tensors(front, {DECODER_INPUT: "latents"})
    _rename_tensors(back, {DECODER_INPUT: "latents", AUDIO: "audio"})
    front.graph.name, back.graph.name = "front", "back"
    return front, back


def _check_closed(model: onnx.ModelProto, name: str) -> None:
    """Every tensor a node reads must come from the graph's inputs, initializers or other nodes."""
    graph = model.graph
    available = {""} | {i.name for i in graph.input} | {i.name for i in graph.initializer}
    available |= {out for node in graph.node for out in node.output}
    missing = {name for node in graph.node for name in node.input} - available
    if missing:
        raise CutError(f"the {name} graph cut from the voice is incomplete: it reads {sorted(missing)}")


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
