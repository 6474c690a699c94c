"""Cutting a Piper (VITS) graph into a front and a back graph, and saving graphs for mapping.

The cut is at the latent frames that feed the flow: `/Add_output_0` (z_p, 1 x 192 x frames, noise
already applied) and `/Cast_2_output_0` (the frame mask). Everything before is the front (text
encoder, duration predictor, alignment expansion); everything after is the back (flow + decoder),
which only ever sees frames, so it can run on windows of them.

The back has a third input, `trim` (int64 [2]): frames to drop at the start and at the end of the
flow's output before the decoder. The flow's receptive field is about 32 frames each way, the
decoder's a few: a window is given 32 frames of context on each side, but the decoder (most of the
cost) only needs 12 of them (`edged.windows`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
from onnx.utils import Extractor

FRONT_INPUTS = ["input", "input_lengths", "scales"]
LATENTS = "/Add_output_0"
FRAME_MASK = "/Cast_2_output_0"
TRIM = "trim"
DECODER_FIRST_NODE = "/dec/conv_pre/Conv"
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
    _trim_decoder_input(back)
    front.graph.name, back.graph.name = "front", "back"
    return front, back


def _trim_decoder_input(back: onnx.ModelProto) -> None:
    """Let the `trim` input cut frames off the flow's output before the decoder reads it."""
    graph = back.graph
    first = [node for node in graph.node if node.name == DECODER_FIRST_NODE]
    if not first:
        raise CutError(f"source graph has no node {DECODER_FIRST_NODE}: not a Piper VITS export?")
    frames = first[0].input[0]
    trimmed = frames + "_trimmed"
    readers = [i for i, node in enumerate(graph.node) if frames in node.input]
    if any(not graph.node[i].name.startswith("/dec/") for i in readers):
        raise CutError(f"{frames} is read outside the decoder: cannot trim it for the decoder alone")
    for i in readers:
        graph.node[i].input[:] = [trimmed if name == frames else name for name in graph.node[i].input]
    make = onnx.helper.make_node
    graph.initializer.extend([onnx.numpy_helper.from_array(np.array([i], np.int64), f"trim/{i}")
                              for i in range(4)])
    nodes = [
        make("Shape", [frames], ["trim/shape"], name="/trim/Shape"),
        make("Slice", ["trim/shape", "trim/2", "trim/3"], ["trim/n_frames"], name="/trim/Frames"),
        make("Slice", [TRIM, "trim/0", "trim/1"], ["trim/start"], name="/trim/Start"),
        make("Slice", [TRIM, "trim/1", "trim/2"], ["trim/at_end"], name="/trim/AtEnd"),
        make("Sub", ["trim/n_frames", "trim/at_end"], ["trim/end"], name="/trim/End"),
        make("Slice", [frames, "trim/start", "trim/end", "trim/2"], [trimmed], name="/trim/Slice"),
    ]
    for offset, node in enumerate(nodes):  # before the first reader: graphs are in topological order
        graph.node.insert(readers[0] + offset, node)
    graph.input.append(onnx.helper.make_tensor_value_info(TRIM, onnx.TensorProto.INT64, [2]))


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
