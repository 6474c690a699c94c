"""Cutting a Piper (VITS) graph into a front and a back graph (and the back_fixed variant), and
saving graphs for mapping.

The cut is at the decoder's input, `/Mul_7_output_0`: the flow's output times the frame mask
(1 x 192 x frames). Everything before it is the front (text encoder, duration predictor,
alignment expansion, noise, and the flow), run once per piece; everything after it is the back
(the HiFi-GAN decoder), which only ever sees frames, so it can run on windows of them.

The flow is in the front (the first design put it in the back): run on windows, it needed ~32 frames
of context each way where the decoder needs 12; and in int8, two overlapping flow runs do not give
the same frames (a value near a rounding step falls either way), which was heard as clicks at window
joins. Run once per piece, it is computed once and the windows join exactly.

The fixed-shape mode runs the back at one input shape, so a piece shorter than it is padded; the
`back_fixed` graph (`mask_padding`) takes a frame mask with which it zeroes the padding at the
input of every convolution, as the unsplit decoder's own zero padding does at a sentence's end.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
from onnx.utils import Extractor

from edged.engine import BACK_INPUTS, FRAME_MASK, FRONT_INPUTS

DECODER_INPUT = "/Mul_7_output_0"
DECODER_FIRST_NODE = "/dec/conv_pre/Conv"
AUDIO = "output"
CONVS = ("Conv", "ConvTranspose")
SAME_LENGTH = frozenset({"Add", "Div", "LeakyRelu", "Mul", "Sub", "Tanh"})
"""Elementwise ops of the decoder: their output has the length of their input."""


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
    front = extractor.extract_model(list(FRONT_INPUTS), [DECODER_INPUT])
    back = extractor.extract_model([DECODER_INPUT], [AUDIO])
    _check_closed(back, "back")
    _check_closed(front, "front")
    (latents,) = BACK_INPUTS
    _rename_tensors(front, {DECODER_INPUT: latents})
    _rename_tensors(back, {DECODER_INPUT: latents, AUDIO: "audio"})
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


def mask_padding(back: onnx.ModelProto) -> onnx.ModelProto:
    """The back graph with a FRAME_MASK input by which it zeroes, past a window's frames, the input
    of every Conv and ConvTranspose, each at its layer's rate (samples per frame).

    Padded with zero frames alone, the decoder is not exact: conv_pre's bias and every later layer
    make the padding nonzero, where the unsplit decoder sees zeros at each conv (its own padding).
    Rates are found by walking the graph from its input: a ConvTranspose multiplies its input's rate
    by its stride, and the walk refuses (CutError) an op it cannot follow in front of a conv.
    """
    opset = next((o.version for o in back.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:  # Unsqueeze takes its axes as an input from opset 13 on
        raise CutError(f"the back graph's opset {opset} is older than 13")
    rates = _rates(back.graph)
    masked = onnx.ModelProto()
    masked.CopyFrom(back)
    graph = masked.graph
    graph.input.append(onnx.helper.make_tensor_value_info(FRAME_MASK, onnx.TensorProto.FLOAT, [1, 1, "frames"]))
    convs = [n for n in graph.node if n.op_type in CONVS]
    if not convs:
        raise CutError("the back graph has no convolutions: not a Piper decoder?")
    nodes = _rate_masks(graph, {rates[conv.input[0]] for conv in convs})
    masked_names: dict[str, str] = {}  # a tensor read by several convs is masked once
    for node in graph.node:
        if node.op_type in CONVS:
            source = node.input[0]
            if source not in masked_names:
                masked_names[source] = f"{source}_masked"
                nodes.append(onnx.helper.make_node("Mul", [source, _mask_name(rates[source])], [masked_names[source]],
                                                   name=f"/mask/Mul_{len(masked_names)}"))
            node.input[0] = masked_names[source]
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.name = "back_fixed"
    return masked


def context_frames(back: onnx.GraphProto) -> int:
    """Frames of context a window needs on each side for the audio it keeps to be the unsplit
    decoder's: the decoder's receptive field, rounded up (11.1 frames back and 10.1 ahead for
    en_US-joe-medium: 12). Found by walking the graph, as the rates are: each convolution widens
    what a sample depends on by its kernel's reach at its rate, an elementwise op by its widest input."""
    rates = _rates(back)
    reach: dict[str, tuple[float, float]] = {name: (0.0, 0.0) for name in _latent_inputs(back)}
    for node in back.node:
        found = [reach[t] for t in node.input if t in reach]
        if not found:
            continue
        behind, ahead = max(b for b, _ in found), max(a for _, a in found)
        if node.op_type in CONVS:
            a = _attributes(node)
            (kernel,), (dilation,) = a["kernel_shape"], a.get("dilations", [1])
            span, pad, rate = dilation * (kernel - 1), a.get("pads", [0, 0])[0], rates[node.input[0]] or 1
            if node.op_type == "Conv":  # output sample j reads inputs j - pad ... j - pad + span
                behind, ahead = behind + pad / rate, ahead + (span - pad) / rate
            else:  # ConvTranspose: output o is made of inputs (o + pad - span) / stride ... (o + pad) / stride
                stride = _stride(node) * rate
                behind, ahead = behind + (span - pad) / stride, ahead + pad / stride
        reach.update((out, (behind, ahead)) for out in node.output)
    return math.ceil(max(reach[back.output[0].name]) - 1e-9)


def audio_rate_nodes(back: onnx.GraphProto) -> set[str]:
    """Names of the decoder's nodes whose output is at the audio rate (after its last upsampling):
    resblocks 6-8 and conv_post in a medium voice, 9-11 and conv_post in a high one."""
    rates = _rates(back)
    top = _highest(rates)
    return {node.name for node in back.node if any(rates.get(out) == top for out in node.output)}


def samples_per_frame(back: onnx.GraphProto) -> int:
    """Audio samples the decoder makes of one latent frame, the voice's hop length."""
    return _highest(_rates(back))


def _highest(rates: dict[str, int | None]) -> int:
    return max(rate for rate in rates.values() if rate is not None)


def phoneme_table_size(model: onnx.ModelProto) -> int | None:
    """Rows of the text encoder's embedding table, which the phoneme ids index (None: not found)."""
    tables = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[1:] == [FRONT_INPUTS[0]] and node.input[0] in tables:
            return int(tables[node.input[0]].dims[0])
    return None


def _rates(graph: onnx.GraphProto) -> dict[str, int | None]:
    """Samples per frame of every tensor computed from the decoder's latent frames (None: not
    followed). The frame mask of back_fixed is taken as a constant: it keeps lengths."""
    rates: dict[str, int | None] = dict.fromkeys(_latent_inputs(graph), 1)
    for node in graph.node:
        found = [rates[t] for t in node.input if t in rates]
        if not found:
            continue  # computed from constants alone
        rate = found[0] if None not in found and len(set(found)) == 1 else None
        if node.op_type in CONVS:
            if rates.get(node.input[0]) is None or len(found) != 1:
                raise CutError(f"cannot follow the frame rate to {node.name}'s input: not a Piper decoder?")
            rate *= _stride(node)
        elif node.op_type not in SAME_LENGTH:
            rate = None
        rates.update((out, rate) for out in node.output)
    return rates


def _latent_inputs(graph: onnx.GraphProto) -> list[str]:
    """The inputs the decoder's tensors are computed from: not its weights, nor back_fixed's frame
    mask (taken as a constant: it keeps lengths)."""
    constants = {i.name for i in graph.initializer} | {FRAME_MASK}
    return [i.name for i in graph.input if i.name not in constants]


def _stride(node: onnx.NodeProto) -> int:
    """How many samples of output a Conv or ConvTranspose makes of one of input: 1 or its stride.

    CutError unless its output has exactly that many per input sample (lengths frames x rate)."""
    a = _attributes(node)
    if (len(a.get("kernel_shape", [])) != 1 or a.get("auto_pad", b"NOTSET") != b"NOTSET"
            or "output_shape" in a):
        raise CutError(f"{node.name}: not a 1-D convolution with its kernel and pads given")
    (kernel,), (dilation,) = a["kernel_shape"], a.get("dilations", [1])
    (stride,), pads = a.get("strides", [1]), sum(a.get("pads", [0, 0]))
    if node.op_type == "Conv":
        keeps = stride == 1 and pads == dilation * (kernel - 1)
    else:  # output (L - 1) * stride + dilation * (kernel - 1) + 1 + output_padding - pads = L * stride
        keeps = dilation * (kernel - 1) + 1 + a.get("output_padding", [0])[0] - pads == stride
    if not keeps:
        raise CutError(f"{node.name}: its output is not its input's length times its stride")
    return stride


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    return {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}


def _rate_masks(graph: onnx.GraphProto, rates: set[int]) -> list[onnx.NodeProto]:
    """Nodes making the frame mask at each rate but 1: every frame's value repeated `rate` times
    (Unsqueeze, Expand, Reshape: fixed shapes, ops an NPU compiler takes)."""
    def const(name: str, values: list[int]) -> str:
        graph.initializer.append(onnx.numpy_helper.from_array(np.array(values, dtype=np.int64), name))
        return name

    if rates == {1}:
        return []
    nodes = [onnx.helper.make_node("Unsqueeze", [FRAME_MASK, const("/mask/axes", [3])], ["/mask/frames"],
                                   name="/mask/Unsqueeze")]
    flat = const("/mask/flat", [1, 1, -1])
    for rate in sorted(rates - {1}):
        repeated = f"/mask/repeated_{rate}"
        nodes += [onnx.helper.make_node("Expand", ["/mask/frames", const(f"/mask/repeat_{rate}", [1, 1, 1, rate])],
                                        [repeated], name=f"/mask/Expand_{rate}"),
                  onnx.helper.make_node("Reshape", [repeated, flat], [_mask_name(rate)], name=f"/mask/Reshape_{rate}")]
    return nodes


def _mask_name(rate: int) -> str:
    return FRAME_MASK if rate == 1 else f"/mask/rate_{rate}"


def share_weights(graph: Path, other: Path) -> bool:
    """Make `graph` read its weights from `other`'s data file, and delete its own, if both data
    files are the same bytes and each weight of `graph` lies where `other` has it (back_fixed and
    back: the same weights, saved alike). False, and nothing changed, otherwise."""
    own_data, other_data = graph.with_name(graph.name + ".data"), other.with_name(other.name + ".data")
    if own_data.read_bytes() != other_data.read_bytes():
        return False
    model, reference = (onnx.load(str(path), load_external_data=False) for path in (graph, other))

    def spot(tensor: onnx.TensorProto) -> dict[str, str]:  # offset and length in its file
        return {k: v for k, v in _placement(tensor).items() if k != "location"}

    theirs = {t.name: spot(t) for t in reference.graph.initializer
              if _placement(t).get("location") == other_data.name}
    external = [t for t in model.graph.initializer if _placement(t)]
    if any(theirs.get(t.name) != spot(t) for t in external):
        return False
    for tensor in external:
        next(e for e in tensor.external_data if e.key == "location").value = other_data.name
    graph.write_bytes(model.SerializeToString())
    own_data.unlink()
    return True


def _placement(tensor: onnx.TensorProto) -> dict[str, str]:
    """Where an initializer's bytes are (location, offset, length); {} if they are in the graph."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return {}
    return {entry.key: entry.value for entry in tensor.external_data}


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
