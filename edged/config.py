"""The daemon's settings: one dataclass tree with documented defaults and units.

The same tree is filled from the TOML file (`edged serve --config FILE`, sections named like the
fields below), then from the environment and the command line through `override()`, which takes
dotted names ("server.socket"), so that no option list is written twice. The documented default
file is packaging/edged.toml; tests check that it matches these defaults.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cache.settings import CacheSettings
from .errors import ConfigError
from .voices import DEFAULT_VOICE, VOICE_ID

log = logging.getLogger(__name__)

OPENAI_PCM_RATE = 24000
"""Hz of OpenAI's response_format "pcm" (raw samples, no header to say otherwise)."""
OPENAI_VOICE_NAMES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
    "marin", "cedar",
)
"""Voice names of the OpenAI speech API; those that are not edged voice ids map to a default."""


@dataclass
class ServerSettings:
    socket: str = ""
    """Unix socket path (absolute). Empty: $EDGED_SOCKET, else $XDG_RUNTIME_DIR/edged/edged.sock (non-root)
    or /run/edged/edged.sock (root). A socket passed by systemd takes precedence over all."""
    socket_mode: int = 0o660
    """Permissions of the socket file: owner and group may connect."""
    max_connections: int = 64
    """Requests on connections beyond this many (or beyond this many requests in progress) are
    answered 503 busy at once: a bound on what a flood of clients can hold. Past 4 times this
    many open connections, the oldest idle one (or else the new one) is closed."""
    header_timeout_s: float = 10.0
    """A connection that has not sent complete request headers within this time is closed."""
    body_timeout_s: float = 10.0
    """Time allowed to receive a request body once its headers are in (else 408)."""
    keep_alive_s: float = 5.0
    """Idle keep-alive connections are closed after this time."""
    drain_timeout_s: float = 10.0
    """On SIGTERM, in-flight requests get this long to finish before they are cancelled."""
    retry_after_s: int = 1
    """Value of the Retry-After header of 503 answers (seconds)."""
    malloc_arenas: int = 2
    """glibc malloc arenas (mallopt M_ARENA_MAX); 0 leaves glibc's default of 8 per core.
    With the default, resident memory stepped up by ~5 MB some 2,000 requests into a steady
    loop (memory freed in one thread's arena is not reused by another); with 2 it stayed flat."""
    admin_group: str = "edged"
    """Peers (SO_PEERCRED) in this group, root, or the daemon's own user may call the
    administrative routes (cache invalidation and warm-up); everyone else who can connect gets 403."""


@dataclass
class LimitSettings:
    max_text_chars: int = 100_000
    """Longer text is refused with 413."""
    max_body_bytes: int = 1_310_720
    """Request bodies over this are refused with 413: room for max_text_chars characters even if a
    client escapes each as a JSON surrogate pair (12 bytes, as Python's json.dumps does for emoji)."""
    max_header_bytes: int = 16_384
    """A request line and headers over this are refused with 431 and the connection closed
    (the HTTP parser itself has no limit)."""


@dataclass
class StageSettings:
    concurrency: int
    """Calls of this stage that may run at the same time (threads for blocking stages)."""
    timeout_s: float
    """Longest wait for a slot plus run of one call; then the request fails with 503 timeout."""


@dataclass(frozen=True)
class OutputSettings:
    timeout_s: float = 20.0
    """Longest stall of one write to a client: a client that stops reading is cut off after it,
    and its synthesis slot freed. Writes share no slots: each waits only for its own client (a
    bound on them let clients that stopped reading hold up everyone else's audio). What a
    connection buffers is bounded by flow control, and connections by server.max_connections."""


@dataclass
class PipelineSettings:
    max_active: int = 2
    """Syntheses admitted at once (not counting those parked for a slow client, see park_after_s):
    the box has 2 cores and each back run uses both."""
    queue_size: int = 4
    """Requests that may wait for admission; past this the answer is 503 busy at once."""
    queue_timeout_s: float = 10.0
    """A request waiting longer than this for admission gets 503 busy."""
    park_after_s: float = 0.25
    """A synthesis whose client has not asked for the next chunk after this long gives its slot
    to the next request until it does, and then gets one back before any new request: slow
    listeners (reading at playback speed) cannot hold every slot idle. A window is decoded in
    ~0.1 s; a client reading at playback speed takes seconds per window."""
    loading_wait_s: float = 5.0
    """A request for a voice that is still loading waits this long, then gets 503 not_ready."""
    compute_nice: int = 10
    """Niceness of the synthesis threads (espeak-ng, onnxruntime and their pools); the event loop
    keeps normal priority, so refusals, health and status stay fast while synthesis fills both
    cores. Measured under a 4x overload: 503 p50 5 ms with 10, 13 ms with 0. 0 turns it off."""
    text: StageSettings = field(default_factory=lambda: StageSettings(1, 5.0))
    """Text -> phoneme ids (espeak-ng is process-wide and serialized anyway)."""
    front: StageSettings = field(default_factory=lambda: StageSettings(1, 10.0))
    """Phoneme ids -> latent frames, one piece per call."""
    back: StageSettings = field(default_factory=lambda: StageSettings(2, 10.0))
    """Latent frames -> PCM, one window per call."""
    output: OutputSettings = field(default_factory=OutputSettings)
    """Writing a chunk to the client."""


@dataclass
class VoiceSettings:
    default: str = DEFAULT_VOICE
    """Voice used when a request names none; READY waits for it."""
    preload: list[str] = field(default_factory=list)
    """Other voices loaded at start, in parallel with the default one."""
    load_on_demand: bool = True
    """Load an installed voice on its first request (else only preloaded voices answer)."""
    search_path: list[str] = field(default_factory=list)
    """Directories searched for bundles by voice id before the usual places ($EDGED_VOICES,
    the repository's models/, /var/lib/edged/voices, /usr/share/edged/voices)."""
    precision: str = ""
    """fp32 or int8; empty takes each bundle's recorded choice."""
    verify: bool = True
    """Check graph files against the manifest's sha256 before loading."""
    probe_text: str = "Ready."
    """The first window of this phrase is synthesized at load (espeak-ng and both graphs run), so
    READY means the voice answers; empty: skip."""


@dataclass
class OpenAISettings:
    default_voice: str = ""
    """Voice for OpenAI voice names (alloy, nova ...) that are not edged voice ids; empty: the
    daemon's default voice."""
    voice_map: dict[str, str] = field(default_factory=dict)
    """Explicit name -> edged voice id mappings, checked first. Names are matched whatever their
    case, as OpenAI's are (kept lower-cased)."""

    def __post_init__(self) -> None:
        lowered = {name.lower(): voice for name, voice in self.voice_map.items()}
        if len(lowered) < len(self.voice_map):
            raise ValueError("voice_map names two aliases that differ only in case")
        self.voice_map = lowered


@dataclass(frozen=True)
class CacheConfig(CacheSettings):
    """[cache]: the cache library's own settings (see edged/cache/settings.py) plus the daemon's.
    In TOML, directory = "" means the default ($CACHE_DIRECTORY under systemd, else
    $XDG_CACHE_HOME/edged) and ttl_seconds = 0 means no expiry."""

    enabled: bool = True
    """False: every request is synthesized (no cache is opened)."""
    warm_file: str = ""
    """A phrase list (one a line, optionally "voice<TAB>text"; # starts a comment line) synthesized
    at start-up, at low priority, for phrases not cached yet; empty: none."""


@dataclass
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    voices: VoiceSettings = field(default_factory=VoiceSettings)
    openai: OpenAISettings = field(default_factory=OpenAISettings)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        check(self)


MAX_CONFIG_BYTES = 1024 * 1024
"""Far above any real configuration file."""


def load_settings(config_file: Path | None = None, socket_path: Path | None = None,
                  env: typing.Mapping[str, str] | None = None) -> Settings:
    """Defaults <- TOML file <- environment ($EDGED_SOCKET) <- command line (--socket)."""
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    if config_file is not None:
        import tomllib

        try:  # a FIFO is fine (--config <(generate)); /dev/zero would fill memory
            with open(config_file, "rb") as file:
                raw = file.read(MAX_CONFIG_BYTES + 1)
            if len(raw) > MAX_CONFIG_BYTES:
                raise ConfigError(f"config {config_file} is over {MAX_CONFIG_BYTES} bytes")
            data = tomllib.loads(raw.decode("utf-8-sig"))  # a BOM is fine
        except OSError as exc:
            raise ConfigError(f"cannot read config {config_file}: {exc.strerror}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{config_file}: not valid TOML: {exc}") from None
        except RecursionError:  # tomllib recurses per level of nesting: [[[[...]]]] of 1 kB
            raise ConfigError(f"{config_file}: not valid TOML: nested too deeply") from None
    settings = build(Settings, data, "")
    socket_path = named_socket(socket_path, env)
    if socket_path is not None:  # given where it starts: relative to the directory it starts in
        settings = override(settings, "server.socket", os.path.abspath(socket_path.expanduser()))
    return settings


def override(settings: Settings, dotted: str, value: Any) -> Settings:
    """A copy of `settings` with one field (named like "pipeline.queue_size") replaced."""
    data = dataclasses.asdict(settings)
    *parents, name = dotted.split(".")
    node = data
    for part in parents:
        if not isinstance(node.get(part), dict):
            raise ConfigError(f"unknown setting {dotted!r}")
        node = node[part]
    if name not in node:
        raise ConfigError(f"unknown setting {dotted!r}")
    node[name] = value
    return build(Settings, data, "")


def socket_path(settings: Settings, env: typing.Mapping[str, str] | None = None) -> Path:
    """Where to bind when systemd passed no socket (the contract's order)."""
    if settings.server.socket:
        return Path(settings.server.socket).expanduser()  # as cache.directory and search_path
    return default_socket_path(env)


def named_socket(given: Path | None, env: typing.Mapping[str, str]) -> Path | None:
    """The socket the caller names, before any config file's: --socket (`given`), else $EDGED_SOCKET."""
    if given is None and env.get("EDGED_SOCKET"):
        return Path(env["EDGED_SOCKET"]).expanduser()
    return given


def default_socket_path(env: typing.Mapping[str, str] | None = None) -> Path:
    """The socket nobody named: root's in /run, another user's in $XDG_RUNTIME_DIR."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if os.geteuid() != 0 and os.path.isabs(runtime):  # a relative one is invalid (XDG): ignored
        return Path(runtime) / "edged" / "edged.sock"
    return Path("/run/edged/edged.sock")


# -- building and checking the tree ----------------------------------------------------------

def build(cls: type, data: Any, where: str, base: Any = None) -> Any:
    """`base` (default: `cls()`) with the values of `data` (plain TOML values) put in; unknown keys
    and wrong types are refused with the setting's dotted name. Tables may be partial."""
    if not isinstance(data, dict):
        raise ConfigError(f"[{where}] must be a table")
    base = cls() if base is None else base
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for name in sorted(set(data) - known):
        if _join(where, name) not in RETIRED:
            raise ConfigError(f"unknown setting {_join(where, name)!r}")
        log.warning("setting %s is ignored: %s", _join(where, name), RETIRED[_join(where, name)])
    values = {name: _value(hints[name], data[name], _join(where, name), getattr(base, name))
              for name in data if name in known}
    try:
        return dataclasses.replace(base, **values)
    except ValueError as exc:  # a settings class that checks itself (CacheSettings)
        raise ConfigError(f"[{where}] {exc}") from None


def _value(hint: Any, value: Any, where: str, current: Any) -> Any:
    if not dataclasses.is_dataclass(hint):  # a leaf: its values, or a list's or table's
        _check_plain(value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value],
                     where)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # "X | None": TOML has no null
        inner = next(h for h in typing.get_args(hint) if h is not type(None))
        # None is written "" for a path or text, 0 for a number.
        empty = "" if inner in (str, Path) else 0
        if value is None or (value == empty and type(value) is not bool):
            return None
        hint = inner
    if hint is Path and isinstance(value, (str, Path)):
        return Path(value)
    if dataclasses.is_dataclass(hint):
        return build(typing.cast(type, hint), value, where, current)
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings")
        return list(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"{where} must be a table of strings")
        return dict(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, not {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool, float) and type(value) is hint:
        return value
    raise ConfigError(f"{where} must be {getattr(hint, '__name__', hint)}, not {value!r}")


def _check_plain(values: Any, where: str) -> None:
    for item in values:
        if isinstance(item, str) and "\0" in item:  # no path or name holds one; os calls refuse it
            raise ConfigError(f"{where} must not contain a NUL character")
        if type(item) is int and not -(1 << 63) <= item < 1 << 63:  # TOML's range; SQLite's too
            raise ConfigError(f"{where} is out of range: {str(item)[:40]}")


RETIRED = {
    "pipeline.output.concurrency": "writes to clients no longer share slots (see pipeline.output.timeout_s)",
}
"""Settings of earlier versions: a config file kept across an update is read with a warning."""


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


MIN_SECONDS = 0.001
"""Shortest time a *_s setting takes."""
MAX_STAGE_THREADS = 64
"""Far above what 2 cores use; a typo like 2000 would start 2,000 threads."""
MIN_HEADER_BYTES = 1024
"""A request line and the headers curl or an HTTP library sends fit in far less."""


def check(settings: Settings) -> None:
    """Limits that must be positive, and the precision name."""
    for path, value in _leaves(settings, ""):
        if path.startswith("cache."):
            continue  # CacheSettings checks its own values
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if path.endswith("compute_nice"):
                if not 0 <= value <= 19:
                    raise ConfigError(f"{path} must be between 0 and 19")  # niceness steps
            elif path.endswith(("queue_size", "malloc_arenas")):
                if value < 0:
                    raise ConfigError(f"{path} must be >= 0")
            elif value <= 0:
                raise ConfigError(f"{path} must be > 0")
            if path.endswith("_s") and value < MIN_SECONDS:  # 1e-300 passed "> 0": nothing could finish
                raise ConfigError(f"{path} must be at least {MIN_SECONDS:g} (seconds)")
            if path.endswith(".concurrency") and value > MAX_STAGE_THREADS:
                raise ConfigError(f"{path} must be at most {MAX_STAGE_THREADS} (each call runs in a thread "
                                  "of its own, started with the daemon)")
    for entry in settings.voices.search_path:
        if not Path(entry).expanduser().is_absolute():
            raise ConfigError(f"voices.search_path entry {entry!r} must be an absolute path")
    # Relative would mean relative to wherever the daemon started: / under systemd.
    for name, path in (("cache.directory", settings.cache.directory), ("server.socket", settings.server.socket)):
        if path and not Path(path).expanduser().is_absolute():
            raise ConfigError(f"{name} {str(path)!r} must be an absolute path")
    if not 0o001 <= settings.server.socket_mode <= 0o777:
        raise ConfigError("server.socket_mode must be a file mode between 0o001 and 0o777")
    if settings.voices.precision not in ("", "fp32", "int8"):
        raise ConfigError("voices.precision must be fp32, int8 or empty")
    if settings.limits.max_body_bytes < settings.limits.max_text_chars:
        raise ConfigError("limits.max_body_bytes must be at least limits.max_text_chars")
    if settings.limits.max_header_bytes < MIN_HEADER_BYTES:  # else every request, health too, is a 431
        raise ConfigError(f"limits.max_header_bytes must be at least {MIN_HEADER_BYTES}")
    if settings.voices.probe_text and not settings.voices.probe_text.strip():
        raise ConfigError("voices.probe_text must have something to say, or be empty (no probe)")
    if not settings.voices.default:  # passed the check below, then stopped the start as "unknown voice ''"
        raise ConfigError(f"voices.default must name a voice (built in: {DEFAULT_VOICE})")
    for path, voice in named_voices(settings):  # a path or a typo here would only be found out by each request
        if voice and not VOICE_ID.fullmatch(voice):
            raise ConfigError(f"{path} must be a voice id (letters, digits, '.', '_', '-'), not {voice[:80]!r}")


def named_voices(settings: Settings) -> list[tuple[str, str]]:
    """(setting, voice id) of every setting that names a voice; "" where none is named."""
    named = [("voices.default", settings.voices.default), ("openai.default_voice", settings.openai.default_voice)]
    named += [("voices.preload", voice) for voice in settings.voices.preload]
    return named + [(f"openai.voice_map.{name}", voice) for name, voice in settings.openai.voice_map.items()]


def _leaves(node: Any, where: str) -> typing.Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, _join(where, f.name))
        else:
            yield _join(where, f.name), value

