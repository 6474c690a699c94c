"""The daemon's voices as installed: named by their directories, listed even when unusable,
and loaded again once a failed bundle is whole."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import os
import shutil
from pathlib import Path

import onnxruntime
import pytest
from daemon_harness import default_graph, install_as

from edged import registry
from edged.config import CacheConfig, Settings, VoiceSettings
from edged.daemon import Daemon
from edged.bundle import read_manifest
from edged.errors import BundleError, UnknownVoice
from edged.registry import VoiceRegistry


def _registry(voices: Path) -> VoiceRegistry:
    return VoiceRegistry(VoiceSettings(search_path=[str(voices)], probe_text=""))


def test_a_bundle_under_another_name_is_refused_and_listed_as_invalid(tmp_path: Path, bundle_dir: Path) -> None:
    # A copy named "alias" holding another voice id would be a second copy of that voice in memory
    # and in the cache, out of reach of invalidation by its id.
    voices = tmp_path / "voices"
    install_as(voices, bundle_dir, "alias", manifest_id="en_US-joe-medium")
    (voices / "garbled").mkdir()
    (voices / "garbled" / "manifest.json").write_text("{not json")
    voices_registry = _registry(voices)
    with pytest.raises(BundleError, match="named by its voice id"):
        voices_registry.info("alias")
    listed = {v["id"]: v for v in voices_registry.describe()}
    assert listed["alias"]["state"] == "invalid" and "named by its voice id" in listed["alias"]["error"]
    assert listed["garbled"]["state"] == "invalid" and "manifest" in listed["garbled"]["error"]
    voices_registry.close()


def test_a_directory_whose_name_is_no_voice_id_is_not_listed(tmp_path: Path) -> None:
    # A name in bytes that are not UTF-8 could not be written into /v1/status's JSON: every
    # status and voices call was a 500.
    voices = tmp_path / "voices"
    voices.mkdir()
    for name in (b"x\xff", b"with space"):
        bundle = voices / os.fsdecode(name)
        bundle.mkdir()
        (bundle / "manifest.json").write_text("{}")
    voices_registry = _registry(voices)
    listed = voices_registry.describe()
    json.dumps(listed, ensure_ascii=False).encode("utf-8")
    assert not {v["id"] for v in listed} & {"x\udcff", "with space"}
    voices_registry.close()


def test_a_refused_manifest_is_read_again_only_once_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Status calls list every installed voice: a bad manifest (up to 1 MiB) was parsed for each.
    voices = tmp_path / "voices"
    (voices / "garbled").mkdir(parents=True)
    manifest = voices / "garbled" / "manifest.json"
    manifest.write_text("{not json")
    reads: list[Path] = []
    monkeypatch.setattr(registry, "read_manifest", lambda bundle: reads.append(bundle) or read_manifest(bundle))
    voices_registry = _registry(voices)
    for _ in range(3):
        listed = {v["id"]: v for v in voices_registry.describe()}
        assert listed["garbled"]["state"] == "invalid" and "manifest" in listed["garbled"]["error"]
    assert reads.count(voices / "garbled") == 1
    manifest.write_text("[]")  # replaced: read again, and refused for what it now is
    listed = {v["id"]: v for v in voices_registry.describe()}
    assert reads.count(voices / "garbled") == 2 and "not a JSON object" in listed["garbled"]["error"]
    voices_registry.close()


def test_a_voice_that_failed_to_load_is_tried_again_once_whole(tmp_path: Path, bundle_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    voices = tmp_path / "voices"
    bundle = install_as(voices, bundle_dir, "xx_XX-copied")
    back = default_graph(bundle_dir, "back")
    kept = bundle / back
    kept.rename(tmp_path / back)  # a copy that has not finished

    async def scenario() -> None:
        voices_registry = _registry(voices)
        with pytest.raises(BundleError, match="missing file"):
            await voices_registry.voice("xx_XX-copied", 30)
        (tmp_path / back).rename(kept)  # the copy finishes
        with pytest.raises(BundleError, match="missing file"):  # not at once: each try hashes MBs
            await voices_registry.voice("xx_XX-copied", 30)
        monkeypatch.setattr(registry, "RETRY_LOAD_S", 0.0)
        voice = await voices_registry.voice("xx_XX-copied", 30)
        assert voice.voice_id == "xx_XX-copied"
        voices_registry.close()

    asyncio.run(scenario())


def test_a_voice_that_failed_to_load_holds_no_sessions(tmp_path: Path, bundle_dir: Path) -> None:
    # Weights that fail their sha256 are found while the sessions are made: the failed load's
    # error kept those sessions (~50 MB, and their threads) until the next try, if ever.
    voices = tmp_path / "voices"
    weights = default_graph(bundle_dir, "back") + ".data"
    bundle = install_as(voices, bundle_dir, "xx_XX-damaged", skip=(weights,))
    damaged = bytearray((bundle_dir / weights).read_bytes())
    damaged[len(damaged) // 2] ^= 1
    (bundle / weights).write_bytes(damaged)
    sessions_before = _live_sessions()

    async def scenario() -> None:
        voices_registry = _registry(voices)
        with pytest.raises(BundleError, match="sha256"):
            await voices_registry.voice("xx_XX-damaged", 30)
        assert {v["id"]: v["state"] for v in voices_registry.describe()}["xx_XX-damaged"] == "failed"
        assert _live_sessions() == sessions_before
        voices_registry.close()

    asyncio.run(scenario())


def test_ready_waits_for_the_default_voices_first_load_not_a_new_one(tmp_path: Path, bundle_dir: Path) -> None:
    # A default voice that failed before the daemon asked whether it was ready was loaded again
    # (its tens of MB hashed twice, its error logged twice).
    voices = tmp_path / "voices"
    install_as(voices, bundle_dir, "xx_XX-broken", skip=(default_graph(bundle_dir, "front"),))
    settings = Settings(voices=VoiceSettings(default="xx_XX-broken", search_path=[str(voices)], probe_text=""),
                        cache=CacheConfig(enabled=False))
    daemon = Daemon(settings)
    try:
        first = daemon.start_loading()
        concurrent.futures.wait([first])
        with pytest.raises(BundleError, match="missing file"):
            asyncio.run(daemon.until_ready(first))
        assert daemon.registry.loads_running() == [] and daemon.registry._loads["xx_XX-broken"] is first
    finally:
        daemon.close()


def _live_sessions() -> int:
    gc.collect()
    return sum(isinstance(o, onnxruntime.InferenceSession) for o in gc.get_objects())


def test_the_first_of_two_bundles_with_one_id_is_used_and_the_other_named(
        tmp_path: Path, bundle_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    install_as(first, bundle_dir, "xx_XX-twin")
    install_as(second, bundle_dir, "xx_XX-twin")
    voices_registry = VoiceRegistry(VoiceSettings(search_path=[str(first), str(second)], probe_text=""))
    with caplog.at_level("WARNING", logger="edged.registry"):
        assert voices_registry.info("xx_XX-twin").bundle_dir == first / "xx_XX-twin"
    assert str(second / "xx_XX-twin") in caplog.text
    listed = {v["id"]: v for v in voices_registry.describe()}
    assert listed["xx_XX-twin"]["directory"] == str(first / "xx_XX-twin")
    voices_registry.close()


def test_a_voice_loaded_on_a_retry_is_described_by_the_bundle_it_loaded(
        tmp_path: Path, bundle_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Replaced between a failed load and its retry: the version and cache digest are the new
    # bundle's, not those read before (else its audio would be cached under the old key).
    voices = tmp_path / "voices"
    broken = install_as(voices, bundle_dir, "xx_XX-swapped")
    (broken / default_graph(bundle_dir, "back")).unlink()
    monkeypatch.setattr(registry, "RETRY_LOAD_S", 0.0)

    async def scenario() -> None:
        voices_registry = _registry(voices)
        old = voices_registry.info("xx_XX-swapped")
        with pytest.raises(BundleError):
            await voices_registry.voice("xx_XX-swapped", 30)
        fixed = install_as(tmp_path / "staging", bundle_dir, "xx_XX-swapped")
        manifest = json.loads((fixed / "manifest.json").read_text())
        slower = {**manifest["inference"], "length_scale": 1.2}
        (fixed / "manifest.json").write_text(json.dumps({**manifest, "version": "2.0.0", "inference": slower}))
        shutil.rmtree(broken)
        fixed.rename(broken)  # installed by rename, as the builder does
        await voices_registry.voice("xx_XX-swapped", 30)
        new = voices_registry.info("xx_XX-swapped")
        assert (old.version, new.version) == ("1.0.0", "2.0.0")
        assert new.bundle_digest != old.bundle_digest
        voices_registry.close()

    asyncio.run(scenario())


def test_a_voice_whose_probe_failed_is_described_afresh(tmp_path: Path, bundle_dir: Path) -> None:
    # The facts of a loaded bundle were kept before its probe synthesis ran: when the probe
    # failed, they outlived the failure, and a bundle put in its place was described by them.
    import numpy as np

    from edged.bundle import file_digest

    voices = tmp_path / "voices"
    broken = install_as(voices, bundle_dir, "xx_XX-probed", skip=("back.fp32.onnx.data",))
    weights = broken / "back.fp32.onnx.data"
    weights.write_bytes((bundle_dir / "back.fp32.onnx.data").read_bytes())
    with weights.open("r+b") as f:  # a megabyte of weights in the middle made NaN
        f.seek(weights.stat().st_size // 2)
        f.write(np.full(1 << 18, np.nan, dtype=np.float32).tobytes())
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["files"]["back.fp32.onnx.data"] = file_digest(weights)
    (broken / "manifest.json").write_text(json.dumps(manifest))

    async def scenario() -> None:
        voices_registry = VoiceRegistry(VoiceSettings(search_path=[str(voices)], precision="fp32"))
        with pytest.raises(BundleError, match="NaN"):
            await voices_registry.voice("xx_XX-probed", 30)
        fixed = install_as(tmp_path / "staging", bundle_dir, "xx_XX-probed")
        good = json.loads((fixed / "manifest.json").read_text())
        (fixed / "manifest.json").write_text(json.dumps({**good, "version": "2.0.0"}))
        shutil.rmtree(broken)
        fixed.rename(broken)
        assert voices_registry.info("xx_XX-probed").version == "2.0.0"
        voices_registry.close()

    asyncio.run(scenario())


def test_a_bundle_replaced_moved_or_removed_before_its_first_use_is_read_again(tmp_path: Path,
                                                                               bundle_dir: Path) -> None:
    # Once listed, a voice's facts were kept until its first load: /v1/voices went on showing the
    # old version, and a request then met a 503 (replaced), or a 500 naming a directory that was
    # gone (moved, removed) instead of the voice where it now is, or a 404.
    first, second = tmp_path / "first", tmp_path / "second"
    installed = install_as(first, bundle_dir, "xx_XX-updated")
    voices_registry = VoiceRegistry(VoiceSettings(search_path=[str(first), str(second)], probe_text=""))
    assert {v["id"]: v for v in voices_registry.describe()}["xx_XX-updated"]["version"] == "1.0.0"
    update = install_as(tmp_path / "staging", bundle_dir, "xx_XX-updated")
    manifest = json.loads((update / "manifest.json").read_text())
    (update / "manifest.json").write_text(json.dumps({**manifest, "version": "2.0.0"}))
    shutil.rmtree(installed)
    update.rename(installed)  # a field update, by rename
    assert {v["id"]: v for v in voices_registry.describe()}["xx_XX-updated"]["version"] == "2.0.0"
    second.mkdir()
    installed.rename(second / "xx_XX-updated")
    assert voices_registry.info("xx_XX-updated").bundle_dir == second / "xx_XX-updated"
    shutil.rmtree(second / "xx_XX-updated")
    with pytest.raises(UnknownVoice):
        voices_registry.info("xx_XX-updated")
    voices_registry.close()


def test_a_manifest_that_is_a_fifo_or_a_directory_is_listed_as_invalid(tmp_path: Path) -> None:
    # Opening a FIFO waits for a writer: the status call listing it never returned, and the daemon
    # answered nothing more (the listing runs on its event loop).
    voices = tmp_path / "voices"
    for name in ("piped", "nested"):
        (voices / name).mkdir(parents=True)
    os.mkfifo(voices / "piped" / "manifest.json")
    (voices / "nested" / "manifest.json").mkdir()
    voices_registry = _registry(voices)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        listed = {v["id"]: v for v in pool.submit(voices_registry.describe).result(timeout=10)}
    for name in ("piped", "nested"):
        assert listed[name]["state"] == "invalid"
        assert "manifest.json is not a regular file" in listed[name]["error"]
    voices_registry.close()
