"""The engine on the real bundle: streaming, laziness, parameters and refusing bad bundles."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import edged.phonemes
from edged.bundle import read_manifest
from edged.engine import EngineSettings, SynthesisParams, Voice
from edged.errors import BadInput, BundleError, UnknownVoice
from edged.voices import find_bundle
from edged.windows import Window
from tools.quantize import snr_db

REPO = Path(__file__).resolve().parent.parent

MEDIUM = "The quick brown fox jumps over the lazy dog, then it runs far away into the forest."


def _copy_bundle(bundle_dir: Path, target: Path) -> Path:
    """A bundle of symlinks to the real files, cheap to copy; files to damage are copied for real."""
    target.mkdir()
    for item in bundle_dir.iterdir():
        (target / item.name).symlink_to(item)
    return target


def _replace_with_copy(path: Path) -> None:
    real = path.resolve()
    path.unlink()
    shutil.copyfile(real, path)


def test_stream_yields_first_window_before_the_rest(voice: Voice) -> None:
    chunks = list(voice.synthesize(MEDIUM))
    streaming = voice.manifest.streaming
    assert len(chunks) > 2
    assert len(chunks[0]) == streaming.first_window * voice.manifest.hop_length * 2
    assert sum(map(len, chunks)) / 2 / voice.sample_rate > 3.0


def test_throughput_windows_decode_a_piece_at_once_with_the_same_audio(voice: Voice) -> None:
    latents = voice.front(next(voice.pieces(MEDIUM)), SynthesisParams(noise_scale=0, noise_w=0))
    assert latents.n_frames <= voice.manifest.streaming.max_window
    streamed = [voice.decode_float(latents, w) for w in voice.windows(latents)]
    at_once = [voice.decode_float(latents, w) for w in voice.windows(latents, throughput=True)]
    assert len(streamed) > 1 and len(at_once) == 1
    reference, test = np.concatenate(streamed), at_once[0]
    assert snr_db(reference, test) > 100


def test_synthesize_for_throughput_gives_one_chunk_per_piece_and_the_same_audio(voice: Voice) -> None:
    quiet = SynthesisParams(noise_scale=0, noise_w=0)
    streamed = list(voice.synthesize(MEDIUM, quiet))
    whole = list(voice.synthesize(MEDIUM, quiet, throughput=True))
    assert len(whole) == len(list(voice.pieces(MEDIUM))) < len(streamed)
    a, b = (np.frombuffer(b"".join(chunks), dtype="<i2").astype(int) for chunks in (streamed, whole))
    assert len(a) == len(b) and np.abs(a - b).max() <= 1  # float rounding may move one step


def test_speed_changes_duration(voice: Voice) -> None:
    params = SynthesisParams(noise_scale=0, noise_w=0)
    normal = sum(map(len, voice.synthesize(MEDIUM, params)))
    fast = sum(map(len, voice.synthesize(MEDIUM, SynthesisParams(speed=2.0, noise_scale=0, noise_w=0))))
    # Durations are rounded up per phoneme, so twice as fast is a little over half as long.
    assert 0.45 < fast / normal < 0.7


def test_same_text_without_noise_is_deterministic(voice: Voice) -> None:
    params = SynthesisParams(noise_scale=0, noise_w=0)
    assert b"".join(voice.synthesize("Hello there.", params)) == b"".join(
        voice.synthesize("Hello there.", params)
    )


@pytest.mark.parametrize("text", ["", "   \n"])
def test_empty_text_is_a_bad_input(voice: Voice, text: str) -> None:
    with pytest.raises(BadInput):
        list(voice.synthesize(text))


def test_punctuation_only_gives_empty_audio(voice: Voice) -> None:
    assert list(voice.synthesize("?! ... ;")) == []


@pytest.mark.parametrize("params", [{"speed": 0}, {"speed": 100}, {"noise_scale": -1}, {"noise_w": 9}])
def test_out_of_range_parameters_are_refused(params: dict) -> None:
    with pytest.raises(BadInput):
        SynthesisParams(**params)


def test_long_text_is_phonemized_lazily(voice: Voice, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks: list[int] = []
    real = edged.phonemes.ESPEAK.phonemize_each

    def counting(espeak_voice: str, texts: list[str]) -> list[list[list[str]]]:
        blocks.extend(len(text) for text in texts)
        return real(espeak_voice, texts)

    monkeypatch.setattr(edged.phonemes.ESPEAK, "phonemize_each", counting)
    text = ("This sentence is one of very many in a long text. " * 2000)[:100_000]
    stream = voice.synthesize(text)
    first = next(stream)
    stream.close()
    # One block, and the readings that confirmed where it ends: not the whole text.
    assert first and max(blocks) <= 2000 and sum(blocks) <= 4000


def test_unknown_voice_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UnknownVoice, match="no-such-voice"):
        find_bundle("no-such-voice", [tmp_path])
    with pytest.raises(UnknownVoice):
        find_bundle(str(tmp_path / "missing-dir"))


def test_voice_is_found_by_id_and_by_directory(bundle_dir: Path) -> None:
    assert find_bundle(bundle_dir.name, [bundle_dir.parent]) == bundle_dir
    assert find_bundle(str(bundle_dir)) == bundle_dir


def test_tampered_graph_is_refused_at_load(bundle_dir: Path, tmp_path: Path) -> None:
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    graph = copy / read_manifest(bundle_dir).graphs["fp32"]["back"]
    _replace_with_copy(graph)
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256"):
        Voice.load(copy, EngineSettings(precision="fp32"))


def test_tampered_weights_are_refused_at_load(bundle_dir: Path, tmp_path: Path) -> None:
    # Weights are hashed while the sessions are made: a mismatch must still refuse the voice.
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    weights = copy / (read_manifest(bundle_dir).graphs["int8"]["back"] + ".data")
    _replace_with_copy(weights)
    with weights.open("r+b") as f:
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(BundleError, match="back.int8.onnx.data fails its sha256"):
        Voice.load(copy, EngineSettings(precision="int8"))


def test_the_fixed_shape_mode_checks_the_weights_it_shares_with_the_back(bundle_dir: Path, tmp_path: Path) -> None:
    # back_fixed has no weight file of its own: the back's (the same weights) is what it reads.
    manifest = read_manifest(bundle_dir)
    fixed = manifest.graphs["fp32"]["back_fixed"]
    assert manifest.weights_file(fixed) == manifest.graphs["fp32"]["back"] + ".data"
    assert not (bundle_dir / (fixed + ".data")).exists()
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    weights = copy / manifest.weights_file(fixed)
    _replace_with_copy(weights)
    with weights.open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(BundleError, match="back.fp32.onnx.data has the wrong size"):
        Voice.load(copy, EngineSettings(precision="fp32", fixed_shape=True))


def test_truncated_weights_are_refused_at_load(bundle_dir: Path, tmp_path: Path) -> None:
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    weights = copy / (read_manifest(bundle_dir).graphs["fp32"]["front"] + ".data")
    _replace_with_copy(weights)
    with weights.open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(BundleError, match="wrong size"):
        Voice.load(copy, EngineSettings(precision="fp32"))


def test_missing_file_and_bad_manifest_are_refused(bundle_dir: Path, tmp_path: Path) -> None:
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    (copy / read_manifest(bundle_dir).graphs["fp32"]["back"]).unlink()
    with pytest.raises(BundleError, match="missing file"):
        Voice.load(copy, EngineSettings(precision="fp32"))
    (copy / "manifest.json").unlink()
    (copy / "manifest.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(BundleError, match="manifest"):
        Voice.load(copy)


def test_bundle_of_an_older_format_is_refused_with_the_way_out(bundle_dir: Path, tmp_path: Path) -> None:
    # A format 1 or 2 back graph holds the flow too: this engine would give it frames after the flow;
    # format 3 has no back_fixed graphs.
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    manifest = json.loads((copy / "manifest.json").read_text(encoding="utf-8"))
    manifest["format"] = 2
    (copy / "manifest.json").unlink()
    (copy / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(BundleError, match=r"format 2 .*rebuild it with python -m tools.build_voice"):
        Voice.load(copy)


def _with_manifest(copy: Path, edit) -> None:  # type: ignore[no-untyped-def]
    manifest = json.loads((copy / "manifest.json").read_text(encoding="utf-8"))
    edit(manifest)
    (copy / "manifest.json").unlink()
    (copy / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


def _front_graph_named(manifest: dict, name: str) -> None:  # type: ignore[type-arg]
    """The default precision's front graph listed under `name` (its weights where they were)."""
    graph = manifest["graphs"][manifest["default_precision"]]
    manifest["weights"][name] = manifest["weights"].get(graph["front"], graph["front"] + ".data")
    manifest["files"][name] = manifest["files"][graph["front"]]
    graph["front"] = name


MANIFEST_DAMAGE = {
    "files not a table": (lambda m: m.update(files=[]), "files must map"),
    "file entry without size": (lambda m: m["files"]["back.int8.onnx"].pop("size"), "files must map"),
    "file outside the bundle": (lambda m: m["files"].update({"../x.onnx": m["files"]["back.int8.onnx"]}),
                                "plain file names"),
    # Opening it raised ENAMETOOLONG through the load: a traceback from `edged synth`.
    "file name too long for a file": (lambda m: _front_graph_named(m, "a" * 300 + ".onnx"), "at most 255 bytes"),
    "graph outside the bundle": (lambda m: m["graphs"]["int8"].update(front="/etc/passwd"), "graphs must name"),
    "graph without back": (lambda m: m["graphs"]["int8"].pop("back"), "graphs must name"),
    "graph without back_fixed": (lambda m: m["graphs"]["fp32"].pop("back_fixed"), "graphs must name"),
    "data file not listed": (lambda m: m["files"].pop("back.int8.onnx.data"), "weight files listed"),
    "shared weights not listed": (lambda m: m["weights"].update({"back_fixed.int8.onnx": "elsewhere.data"}),
                                  "weight files listed"),
    "weights as a list": (lambda m: m.update(weights=["back.int8.onnx.data"]), "weights must map"),
    "inference without scales": (lambda m: m.update(inference={}), "inference must hold"),
    # noise_w 10 stretched a sentence past the box's memory: the killer ended the process.
    "noise_w past a request's": (lambda m: m["inference"].update(noise_w=10), "noise_w between 0 and 2"),
    "sample rate as text": (lambda m: m.update(sample_rate="22050"), "sample_rate"),
    "sample rate 0": (lambda m: m.update(sample_rate=0), "sample_rate"),
    "hop length 0": (lambda m: m.update(hop_length=0), "hop_length"),
    "id map without Piper's markers": (lambda m: m.update(phoneme_id_map={"a": [5]}), "markers"),
    "phoneme id past any table": (lambda m: m["phoneme_id_map"].update({"a": [2**64]}), "ids under"),
    # 3,000 ids for one phoneme: a request took seconds and 1.5 GB.
    "phoneme id list thousands long": (lambda m: m["phoneme_id_map"].update({"a": [5] * 3000}), "lists of 1 to 8 ids"),
    "window of 0 frames": (lambda m: m["streaming"].update(first_window=0), "at least one frame"),
    "huge context": (lambda m: m["streaming"].update(context=10**9), "streaming.context"),
    "unknown default precision": (lambda m: m.update(default_precision="fp16"), "default_precision"),
    # A client names them to clear the voice's cached audio, in at most 64 printable characters.
    "voice id too long to name": (lambda m: m.update(voice_id="en_US-" + "x" * 60), "voice_id must be printable"),
    "version with a control": (lambda m: m.update(version="1.0\x1f0"), "version must be printable"),
}


@pytest.mark.parametrize(("edit", "message"), MANIFEST_DAMAGE.values(), ids=MANIFEST_DAMAGE.keys())
def test_a_damaged_manifest_is_refused_naming_the_field(bundle_dir: Path, tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    _with_manifest(copy, edit)
    with pytest.raises(BundleError, match=f"malformed manifest: .*{message}"):
        Voice.load(copy)


def test_graphs_in_each_others_place_are_refused_at_load(bundle_dir: Path, tmp_path: Path) -> None:
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    _with_manifest(copy, lambda m: m["graphs"]["int8"].update(front="back.int8.onnx", back="front.int8.onnx"))
    with pytest.raises(BundleError, match="graph inputs"):
        Voice.load(copy, EngineSettings(precision="int8"))


def test_a_back_without_the_frame_mask_is_refused_for_the_fixed_shape(bundle_dir: Path, tmp_path: Path) -> None:
    # The fixed-shape mode feeds a frame mask, which only back_fixed takes.
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    _with_manifest(copy, lambda m: m["graphs"]["int8"].update(back_fixed="back.int8.onnx"))
    Voice.load(copy, EngineSettings(precision="int8"))  # growing windows do not open it
    with pytest.raises(BundleError, match=r"graph inputs \('latents',\) are not the expected"):
        Voice.load(copy, EngineSettings(precision="int8", fixed_shape=True))


def test_a_graph_onnxruntime_cannot_read_is_a_bundle_error(bundle_dir: Path, tmp_path: Path) -> None:
    # Checksums prove only that the files are those the manifest lists.
    from edged.bundle import file_digest

    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    graph = copy / "back.int8.onnx"
    graph.unlink()
    graph.write_bytes(b"not a graph")
    _with_manifest(copy, lambda m: m["files"].update({"back.int8.onnx": file_digest(graph)}))
    with pytest.raises(BundleError, match="onnxruntime cannot load it"):
        Voice.load(copy, EngineSettings(precision="int8"))


FOUND_AT_SYNTHESIS = {
    # Within the manifest's bound but past the front graph's embedding table (256 ids here).
    "phoneme id the graph has no row for": (lambda m: m["phoneme_id_map"].update({"^": [60000]}),
                                            "front graph failed"),
    # The trim of each window counts samples by the manifest's hop: 512 for the graph's 256
    # played garbled audio, silently.
    "hop length not the graph's": (lambda m: m.update(hop_length=512), "hop_length 512 is not the graph's"),
    # The bundle's fault, not the text's (it was a 400).
    "espeak voice espeak-ng has not": (lambda m: m.update(espeak_voice="xx-bogus"),
                                       "espeak-ng has no voice 'xx-bogus'"),
}


@pytest.mark.parametrize(("edit", "message"), FOUND_AT_SYNTHESIS.values(), ids=FOUND_AT_SYNTHESIS.keys())
def test_a_manifest_the_graphs_belie_is_a_bundle_error_when_used(  # type: ignore[no-untyped-def]
        bundle_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str], edit, message: str) -> None:
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    _with_manifest(copy, edit)
    voice = Voice.load(copy)
    with pytest.raises(BundleError, match=message):
        list(voice.synthesize("A cat."))
    # Said once, by edged: onnxruntime's own copy of the error went to stderr unformatted (in the
    # journal, without a priority: filed as info).
    assert "onnxruntime" not in capfd.readouterr().err


def test_weights_that_give_nan_are_reported_not_played(bundle_dir: Path, tmp_path: Path) -> None:
    from edged.bundle import file_digest

    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    weights = copy / "back.fp32.onnx.data"
    _replace_with_copy(weights)
    with weights.open("r+b") as f:  # a megabyte of weights in the middle made NaN
        f.seek(weights.stat().st_size // 2)
        f.write(np.full(1 << 18, np.nan, dtype=np.float32).tobytes())
    _with_manifest(copy, lambda m: m["files"].update({"back.fp32.onnx.data": file_digest(weights)}))
    voice = Voice.load(copy, EngineSettings(precision="fp32"))
    with pytest.raises(BundleError, match="NaN"):
        list(voice.synthesize("Hello."))


def _second_output(model) -> None:  # type: ignore[no-untyped-def]
    model.graph.output.append(model.graph.output[0])  # the frames twice


def _frames_without_batch(model) -> None:  # type: ignore[no-untyped-def]
    import onnx

    output = model.graph.output[0]
    model.graph.node.append(onnx.helper.make_node("Squeeze", [output.name, "batch_axis"], ["squeezed"]))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0], dtype=np.int64), "batch_axis"))
    model.graph.output.remove(output)
    model.graph.output.append(onnx.helper.make_tensor_value_info("squeezed", onnx.TensorProto.FLOAT, None))


@pytest.mark.parametrize(("edit", "message"), [(_second_output, "2 outputs, not one"),
                                               (_frames_without_batch, "not float32 \\(1, channels, frames\\)")],
                         ids=["second output", "frames without batch"])
def test_a_front_graph_of_another_shape_is_a_bundle_error(bundle_dir: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                          edit, message: str) -> None:
    import onnx

    from edged.bundle import file_digest

    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    graph = copy / "front.int8.onnx"
    model = onnx.load(str(graph.resolve()), load_external_data=False)
    edit(model)
    graph.unlink()
    onnx.save(model, str(graph))
    _replace_with_copy(copy / "front.int8.onnx.data")  # onnxruntime follows no link out of the bundle
    _with_manifest(copy, lambda m: m["files"].update({"front.int8.onnx": file_digest(graph)}))
    with pytest.raises(BundleError, match=message):  # at load, or at the first text
        list(Voice.load(copy, EngineSettings(precision="int8")).synthesize("Hello."))


def test_a_manifest_nested_past_the_parser_is_a_bundle_error(bundle_dir: Path, tmp_path: Path) -> None:
    # A RecursionError once reached /v1/status (500 for every client) through the voice listing.
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    (copy / "manifest.json").unlink()
    (copy / "manifest.json").write_text("[" * 200_000 + "]" * 200_000, encoding="utf-8")
    with pytest.raises(BundleError, match="nested too deeply"):
        Voice.load(copy)
    (copy / "manifest.json").write_text(" " * (1 << 20) + "{}", encoding="utf-8")
    with pytest.raises(BundleError, match="manifest.json is over"):
        Voice.load(copy)


def test_a_voice_name_too_long_for_a_file_name_is_unknown(tmp_path: Path) -> None:
    with pytest.raises(UnknownVoice):
        find_bundle("a" * 300)


def test_twelve_frames_of_context_make_exact_joins(bundle_dir: Path) -> None:
    voice = Voice.load(bundle_dir, EngineSettings(precision="fp32"))
    latents = voice.front(next(iter(voice.pieces("The heating comes on at six."))),
                          SynthesisParams(noise_scale=0, noise_w=0))
    assert latents.n_frames > 90
    wide = voice.decode_float(latents, Window(40, 60, 8, 92)).astype(np.float64)

    def snr(window: Window) -> float:
        kept = voice.decode_float(latents, window)
        assert len(kept) == 20 * voice.manifest.hop_length
        return snr_db(wide, kept)

    assert voice.manifest.streaming.context == 12
    assert snr(Window(40, 60, 28, 72)) > 100  # exact, not merely close
    assert snr(Window(40, 60, 36, 64)) < 80  # 4 frames are not enough: the check can tell


@pytest.mark.parametrize("name", ["garbage", "not a voice id"])
def test_the_builder_answers_bad_input_in_one_line(tmp_path: Path, name: str) -> None:
    model = tmp_path / f"{name}.onnx"
    model.write_bytes(b"not an onnx model")
    Path(f"{model}.json").write_text("{}")
    done = subprocess.run([sys.executable, "-m", "tools.build_voice", "--onnx", str(model), "--out",
                           str(tmp_path / "out")], cwd=REPO, capture_output=True, timeout=120, check=False)
    assert done.returncode == 2 and b"Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out" / name).exists() and not list((tmp_path / "out").glob(".*"))


def _fp32_under_int8_names(bundle_dir: Path, target: Path, version: str) -> Path:
    """Another bundle of the same voice, its audio other: the fp32 graphs under the int8 names."""
    copy = _copy_bundle(bundle_dir, target)
    manifest = json.loads((copy / "manifest.json").read_text(encoding="utf-8"))
    for name in ("front", "back"):
        for suffix in (".onnx", ".onnx.data"):
            int8, fp32 = f"{name}.int8{suffix}", f"{name}.fp32{suffix}"
            (copy / int8).unlink()
            (copy / int8).symlink_to(bundle_dir / fp32)
            manifest["files"][int8] = manifest["files"][fp32]
    manifest["version"] = version
    _with_manifest(copy, lambda m: m.update(manifest))
    return copy


def test_a_bundle_installed_while_a_voice_loads_is_loaded_whole(
        bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The builder installs a bundle by exchanging directories. A load that had read the old
    # manifest and opened the new graphs mixed the two bundles, or failed their checks.
    import edged.engine
    from tools.build_voice import _exchange

    installed = _copy_bundle(bundle_dir, tmp_path / "voice")
    incoming = _fp32_under_int8_names(bundle_dir, tmp_path / ".voice+new", "9.0.0")
    open_session, opened, one_at_a_time = edged.engine.open_session, [], threading.Lock()

    def install_then_open(path: Path, settings):  # type: ignore[no-untyped-def]
        with one_at_a_time:  # the graphs are opened in two threads
            if not opened:  # the install lands as the first graph is opened
                assert _exchange(installed, incoming)
            opened.append(path)
        return open_session(path, settings)

    monkeypatch.setattr(edged.engine, "open_session", install_then_open)
    quiet = SynthesisParams(noise_scale=0, noise_w=0)
    loaded = Voice.load(installed, EngineSettings(precision="int8"))
    monkeypatch.setattr(edged.engine, "open_session", open_session)
    alone = Voice.load(installed, EngineSettings(precision="int8"))
    assert loaded.manifest.version == alone.manifest.version == "9.0.0"
    assert b"".join(loaded.synthesize("Hello there.", quiet)) == b"".join(alone.synthesize("Hello there.", quiet))


def test_an_unreadable_bundle_file_is_a_bundle_error(bundle_dir: Path, tmp_path: Path) -> None:
    # An OSError from reading it was a traceback: a 500 "internal" from the daemon.
    copy = _copy_bundle(bundle_dir, tmp_path / "bundle")
    _replace_with_copy(copy / "back.int8.onnx.data")
    (copy / "back.int8.onnx.data").chmod(0)
    script = ("import sys; from pathlib import Path; from edged.engine import EngineSettings, Voice\n"
              "from edged.errors import BundleError\n"
              "try: Voice.load(Path(sys.argv[1]), EngineSettings(precision='int8'))\n"
              "except BundleError as e: print(e); sys.exit(3)\n")
    # Without the capability to read any file, as the daemon's own user has not.
    done = subprocess.run(["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                           "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c", script, str(copy)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "cannot read back.int8.onnx.data: Permission denied" in done.stdout
