"""The daemon's voices: found by id, loaded in parallel threads, waited for (with a bound) while loading.

A voice's manifest is read at once (it is small), so its id, version and sample rate are known
while its graphs are still loading; only synthesis has to wait for the loaded `Voice`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .bundle import MANIFEST_NAME, Manifest, read_manifest
from .cache.key import normalize_text
from .config import VoiceSettings
from .errors import BundleError, EdgedError, NotReady, UnknownVoice
from .messages import AudioFormat
from .pipeline import SynthesisRequest, lower_thread_priority
from .voices import VOICE_ID, bundles_by_id, voice_dirs

if TYPE_CHECKING:
    from .engine import Voice

log = logging.getLogger(__name__)

RETRY_LOAD_S = 10.0
"""Least time between two tries to load a voice that failed to load."""



@dataclass(frozen=True)
class VoiceInfo:
    voice_id: str
    version: str
    precision: str
    """fp32 or int8: the configured precision, else the bundle's measured default."""
    sample_rate: int
    """Hz."""
    bundle_dir: Path
    bundle_digest: str = ""
    """Manifest.audio_digest of the bundle (part of the cache key)."""

    def request(self, text: str, speed: float, format: AudioFormat) -> SynthesisRequest:
        """A synthesis of `text` by this voice, as it is installed and loaded. The text is the
        cache key's (normalize_text), so that what is spoken is what the key stands for."""
        return SynthesisRequest(normalize_text(text), self.voice_id, self.version, self.precision,
                                self.sample_rate, speed, format, bundle_digest=self.bundle_digest)


class VoiceRegistry:
    def __init__(self, settings: VoiceSettings, compute_nice: int = 0) -> None:
        self.settings = settings
        self.search = [Path(p).expanduser() for p in settings.search_path] + voice_dirs()
        for directory in self.search[:len(settings.search_path)]:
            if not directory.is_dir():
                log.warning("voices.search_path entry %s is not a directory; no voices there", directory)
        self._infos: dict[str, tuple[tuple[object, ...], VoiceInfo]] = {}
        """Facts read from the manifests of voices not loaded (yet), with each manifest's identity
        then: a bundle replaced, moved or removed before its first use is read again."""
        self._loaded_infos: dict[str, VoiceInfo] = {}
        """Facts of the bundles loaded: final (a voice is loaded once)."""
        self._warned_hidden: set[str] = set()
        self._refused: dict[str, tuple[tuple[object, ...], str]] = {}
        """Why each unusable bundle was refused, with its manifest's identity then: status calls
        list every installed voice, and need not parse a bad manifest (up to 1 MiB) each time."""
        self._loads: dict[str, concurrent.futures.Future[Voice]] = {}
        self._failed_at: dict[str, float] = {}
        """When each voice's latest load failed (time.monotonic)."""
        self._lock = threading.Lock()
        self._closing = False
        # Two loader threads: loads overlap (sha256 and onnxruntime release the GIL) on 2 cores.
        # onnxruntime's pool threads, started while a session is made, inherit the loader's priority.
        self._loader = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix="edged-load", initializer=lower_thread_priority, initargs=(compute_nice,))

    def info(self, voice_id: str) -> VoiceInfo:
        """What is known of an installed voice without loading it (id, version, sample rate,
        precision, digest); UnknownVoice if there is none, BundleError if its bundle is invalid."""
        info = self._loaded_infos.get(voice_id)
        if info is not None:
            return info
        if not VOICE_ID.fullmatch(voice_id):
            raise UnknownVoice(f"unknown voice {voice_id[:100]!r}: not a voice id")
        found = bundles_by_id(voice_id, self.search)
        if not found:
            raise UnknownVoice(f"unknown voice {voice_id!r}: no bundle with that id is installed")
        bundle = found[0]  # the first in the search path
        identity = _identity(bundle / MANIFEST_NAME)
        known = self._infos.get(voice_id)
        if known is not None and identity is not None and known[0] == identity:
            return known[1]
        hidden = [other for other in found[1:] if other.resolve() != bundle.resolve()]
        if hidden and voice_id not in self._warned_hidden:  # once: status calls ask again and again
            self._warned_hidden.add(voice_id)
            log.warning("voice %s: using %s; also found in %s, not used", voice_id, bundle,
                        ", ".join(map(str, hidden)))
        refused = self._refused.get(voice_id)
        if refused is not None and refused[0] == identity:
            raise BundleError(refused[1])
        try:
            info = self._info_of(voice_id, bundle, read_manifest(bundle))
        except BundleError as exc:
            if identity is not None:
                self._refused[voice_id] = (identity, str(exc))
            raise
        self._refused.pop(voice_id, None)
        if identity is not None:
            self._infos[voice_id] = (identity, info)
        return info

    def _info_of(self, voice_id: str, bundle: Path, manifest: Manifest) -> VoiceInfo:
        if manifest.voice_id != voice_id:  # a copy under another name would be a second voice
            raise BundleError(f"{bundle} holds voice {manifest.voice_id!r}: a bundle's directory must be "
                              "named by its voice id")
        return VoiceInfo(voice_id, manifest.version, self.settings.precision or manifest.default_precision,
                         manifest.sample_rate, bundle, manifest.audio_digest)

    def load(self, voice_id: str) -> concurrent.futures.Future[Voice]:
        """Start loading a voice (once; again after a failure); the future holds the loaded Voice
        or its error."""
        with self._lock:
            future = self._loads.get(voice_id)
            if future is None or (future.done() and future.exception() is not None):
                future = self._loader.submit(self._load, self.info(voice_id))
                future.add_done_callback(functools.partial(self._after_failure, voice_id))
                self._loads[voice_id] = future
            return future

    async def voice(self, voice_id: str, wait_s: float) -> Voice:
        """The loaded voice, waiting up to `wait_s` seconds while it loads (then NotReady)."""
        future = self._loads.get(voice_id)
        if future is None:
            if not self.settings.load_on_demand:
                self.info(voice_id)  # UnknownVoice first if it is not installed at all
                raise UnknownVoice(f"voice {voice_id!r} is installed but not loaded by this daemon")
            future = self.load(voice_id)
        elif self._may_retry(voice_id, future):
            future = self.load(voice_id)
        if not future.done():
            waiting = asyncio.wrap_future(future)
            waiting.add_done_callback(_retrieve)  # its error is raised from `future` below
            done, _ = await asyncio.wait([waiting], timeout=wait_s)
            if not done:
                raise NotReady(f"voice {voice_id!r} is still loading")
        return future.result()

    def _may_retry(self, voice_id: str, future: concurrent.futures.Future[Voice]) -> bool:
        """A failed load is tried again on demand (a bundle may have been half-copied), but not
        more often than every RETRY_LOAD_S: each try checks tens of MB of weights."""
        return (self.settings.load_on_demand and future.done() and future.exception() is not None
                and time.monotonic() - self._failed_at.get(voice_id, 0.0) >= RETRY_LOAD_S)

    def loaded(self) -> dict[str, Voice]:
        return {vid: f.result() for vid, f in list(self._loads.items()) if f.done() and not f.exception()}

    def describe(self) -> list[dict[str, Any]]:
        """Every installed voice (by id), with its load state, precision and providers."""
        ids = set(self._loads)
        for root in self.search:
            try:
                # Only names that can be asked for: a directory named in bytes that are not
                # UTF-8 could not even be written into the JSON answer.
                ids.update(p.parent.name for p in root.glob(f"*/{MANIFEST_NAME}") if VOICE_ID.fullmatch(p.parent.name))
            except OSError:
                continue
        voices = []
        for voice_id in sorted(ids):
            try:
                info = self.info(voice_id)
            except EdgedError as exc:  # installed but unusable: say so, and why
                voices.append({"id": voice_id, "state": "invalid", "error": str(exc)})
                continue
            entry: dict[str, Any] = {
                "id": voice_id, "version": info.version, "sample_rate": info.sample_rate,
                "default": voice_id == self.settings.default, "state": "installed",
                "directory": str(info.bundle_dir),  # the first of the search path that holds it
            }
            future = self._loads.get(voice_id)
            if future is not None:
                if not future.done():
                    entry["state"] = "loading"
                elif future.exception() is not None:
                    entry["state"] = "failed"
                    entry["error"] = str(future.exception())
                else:
                    voice = future.result()
                    entry.update(state="loaded", precision=voice.precision, providers=voice.providers)
            voices.append(entry)
        return voices

    def loads_running(self) -> list[str]:
        """Voices whose load has not finished."""
        return [voice_id for voice_id, future in list(self._loads.items()) if not future.done()]

    def close(self) -> None:
        self._closing = True
        self._loader.shutdown(wait=False, cancel_futures=True)

    def _after_failure(self, voice_id: str, future: concurrent.futures.Future[Voice]) -> None:
        if future.cancelled() or future.exception() is None:
            return
        # The bundle may be replaced before the retry: its facts (version, digest: the cache
        # key's) are read again by the next request, before its key is made.
        self._infos.pop(voice_id, None)
        self._failed_at[voice_id] = time.monotonic()
        if self._closing:  # a load cut short by the daemon's exit (its pools are shut down)
            log.info("voice load stopped at exit: %s", future.exception())
        else:
            log.error("voice failed to load: %s", future.exception())
        _forget_frames(future.exception())

    def _load(self, info: VoiceInfo) -> Voice:
        from .engine import EngineSettings, Voice

        voice = Voice.load(info.bundle_dir, EngineSettings(precision=self.settings.precision or None,  # type: ignore[arg-type]
                                                           verify=self.settings.verify))
        loaded = self._info_of(info.voice_id, info.bundle_dir, voice.manifest)
        if self.settings.probe_text:
            # The first window of a probe phrase runs espeak-ng and both graphs: the voice can
            # answer. Only one window: the rest would prove nothing more and delay READY.
            for _ in voice.synthesize(self.settings.probe_text):
                break
        # The bundle may have been replaced since its facts were read (a field update before the
        # voice's first use): from now on they are those of the bundle loaded (and answering).
        self._loaded_infos[info.voice_id] = loaded
        return voice


def _forget_frames(error: BaseException | None) -> None:
    """Drop the local variables of the frames that `error` (and its causes) went through: the
    failed future keeps the error until the next try, and those frames held the sessions already
    made (~50 MB and their threads) or the whole voice whose probe failed."""
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _retrieve(future: asyncio.Future[Voice]) -> None:
    if not future.cancelled():
        future.exception()


def _identity(manifest: Path) -> tuple[object, ...] | None:
    """What changes when a manifest is replaced or rewritten; None if it cannot be looked at."""
    try:
        info = manifest.stat()
    except OSError:
        return None
    return (str(manifest), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
