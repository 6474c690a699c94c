"""Request bodies of the HTTP contract, parsed from JSON into typed dataclasses (or BadInput).

Malformed input is refused with a message that names the field; nothing is silently defaulted
except fields that are optional in the contract.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args
from urllib.parse import parse_qs

from .bundle import NAME_MAX
from .errors import BadInput, TextTooLong
from .espeak_safety import nothing_to_read
from .untrusted_json import loads

AudioFormat = Literal["wav", "pcm"]
CONTENT_TYPES: dict[str, str] = {"wav": "audio/wav", "pcm": "application/octet-stream"}
"""The Content-Type of each audio format's answer."""
FORMATS: tuple[AudioFormat, ...] = get_args(AudioFormat)
SPEED_RANGE = (0.25, 4.0)
"""Speaking rates the engine takes (SynthesisParams); here, where edgectl can import them without
the engine, and so that a request is checked before admission."""


@dataclass(frozen=True)
class SynthesizeBody:
    """POST /v1/synthesize"""

    text: str
    voice: str | None = None
    """Voice id; None: the daemon's default voice."""
    speed: float = 1.0
    """Speaking rate; 2.0 is twice as fast."""
    format: AudioFormat = "wav"
    tag: str | None = None
    """Cache tag of the audio, for invalidation by tag (DELETE /v1/cache?tag=...)."""


@dataclass(frozen=True)
class SpeechBody:
    """POST /v1/audio/speech (OpenAI-compatible; fields edged does not use are accepted and ignored)."""

    input: str
    voice: str
    """An edged voice id, or an OpenAI voice name (alloy, nova ...) mapped by configuration."""
    speed: float = 1.0
    response_format: AudioFormat = "wav"
    """OpenAI's default is mp3, which edged does not produce; wav is the default here."""


_BROKEN_ESCAPE = re.compile("%(?![0-9A-Fa-f]{2})")


def parse_query(query_string: bytes) -> dict[str, str]:
    """The query's parameters, each given once, percent-encoded UTF-8."""
    try:
        query = query_string.decode("ascii")
        if _BROKEN_ESCAPE.search(query):  # parse_qs keeps "%zz" as it is: a typo cleared "%zz"
            raise ValueError
        pairs = parse_qs(query, keep_blank_values=True, errors="strict")
    except ValueError:  # UnicodeDecodeError is one
        raise BadInput("the query string is not percent-encoded UTF-8") from None
    for name, values in pairs.items():
        if len(values) > 1:  # which one was meant? (a clear must not guess)
            raise BadInput(f"query parameter {name[:50]!r} is given {len(values)} times")
    return {name: values[0] for name, values in pairs.items()}


def parse_json(body: bytes) -> dict[str, Any]:
    """A JSON object from a request body that must be UTF-8."""
    data = _load_json(body)
    if not isinstance(data, dict):
        raise BadInput("request body must be a JSON object")
    return data


def _load_json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:  # a byte order mark is no JSON, but PowerShell and Notepad write one (RFC 8259: may ignore it)
        return loads(text.removeprefix("\ufeff"), object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise BadInput(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError:  # a number of thousands of digits; nesting too deep
        raise BadInput("malformed JSON: a number too long or nesting too deep") from None


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: {"text": "Hi.", "text": ""} is not guessed at."""
    data = dict(pairs)
    if len(data) < len(pairs):
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        raise BadInput(f"malformed JSON: field {_shown(repeated)} is given more than once")
    return data


def synthesize_body(data: dict[str, Any], max_text_chars: int) -> SynthesizeBody:
    _no_unknown(data, ("text", "voice", "speed", "format", "tag"))
    return SynthesizeBody(
        text=_text(data, "text", max_text_chars),
        voice=_optional_str(data, "voice"),
        speed=_speed(data),
        format=_format(data, "format"),
        tag=_tag(data.get("tag")),
    )


def speech_body(data: dict[str, Any], max_text_chars: int) -> SpeechBody:
    voice = _openai_voice(data)
    if _given(data, "stream_format", "audio") != "audio":  # it would change the answer's shape
        raise BadInput(f"stream_format {_shown(data['stream_format'])} is not supported; the audio is "
                       "streamed as it is made (\"audio\")")
    return SpeechBody(
        input=_text(data, "input", max_text_chars),
        voice=voice,
        speed=_speed(data),
        response_format=_format(data, "response_format"),
    )


def _openai_voice(data: dict[str, Any]) -> str:
    """OpenAI's voice, required (its API has no default voice): a name, or a custom voice given
    as {"id": "..."} (its SDKs take both)."""
    given = data.get("voice")
    if given is None:
        raise BadInput("missing field 'voice'")
    if isinstance(given, dict) and set(given) == {"id"}:
        given = given["id"]
    if not isinstance(given, str):
        raise BadInput("field 'voice' must be a string or {\"id\": string}")
    if not given:
        raise BadInput("field 'voice' is empty")
    return given


def _no_unknown(data: dict[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise BadInput(f"unknown field {_shown(unknown[0])} (known: {', '.join(known)})")


def _text(data: dict[str, Any], name: str, max_chars: int) -> str:
    if name not in data:
        raise BadInput(f"missing field {name!r}")
    text = data[name]
    if not isinstance(text, str):
        raise BadInput(f"field {name!r} must be a string")
    if len(text) > max_chars:
        raise TextTooLong(f"{name} has {len(text)} characters; the limit is {max_chars}")
    if nothing_to_read(text):  # a NUL is read as a space
        raise BadInput(f"field {name!r} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate from a JSON \\ud800 escape
        raise BadInput(f"field {name!r} has an invalid character at {exc.start}") from None
    return text


def _given(data: dict[str, Any], name: str, default: Any) -> Any:
    """The field's value; `default` if it is missing or null (OpenAI's SDKs send null for an
    argument given as None)."""
    value = data.get(name)
    return default if value is None else value


def _optional_str(data: dict[str, Any], name: str) -> str | None:
    value = data.get(name)
    if value is not None and not isinstance(value, str):
        raise BadInput(f"field {name!r} must be a string")
    return value or None


def _speed(data: dict[str, Any]) -> float:
    speed = _given(data, "speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        raise BadInput("field 'speed' must be a number")
    low, high = SPEED_RANGE
    if not low <= speed <= high:
        raise BadInput(f"field 'speed' must be between {low} and {high}")
    return float(speed)


def _format(data: dict[str, Any], name: str) -> AudioFormat:
    value = _given(data, name, "wav")
    if value not in FORMATS:
        raise BadInput(f"field {name!r} must be one of {', '.join(FORMATS)}, not {_shown(value)}")
    return cast(AudioFormat, value)


# -- the cache's administrative calls ------------------------------------------------------------

TAG_MAX = NAME_MAX
MAX_WARM_PHRASES = 10_000
MAX_WARM_FILE_BYTES = 64 * 1024 * 1024
"""A phrase file (the daemon's warm_file, or edgectl's): more is refused rather than read into memory."""


@dataclass(frozen=True)
class CacheScope:
    """DELETE /v1/cache: what to drop; nothing given means everything."""

    voice: str | None = None
    version: str | None = None
    tag: str | None = None


@dataclass(frozen=True)
class Phrase:
    """One phrase of a warm-up (POST /v1/cache/warm, or the configured warm_file)."""

    text: str
    voice: str | None = None
    """Voice id; None: the daemon's default voice."""
    line: int = 0
    """Its line in a phrase list (parse_phrase_lines), for messages; 0 otherwise."""


def cache_scope(data: dict[str, Any]) -> CacheScope:
    _no_unknown(data, ("voice", "version", "tag"))
    for name in ("voice", "version", "tag"):
        if name in data and data[name] in ("", None):  # else "not given": it would clear everything
            raise BadInput(f"{name!r} is empty; leave it out to clear every {name}")
    scope = CacheScope(*(_tag(data.get(name), name) for name in ("voice", "version", "tag")))
    if scope.version is not None and scope.voice is None:
        raise BadInput("'version' needs 'voice'")
    return scope


def warm_body(body: bytes, max_text_chars: int) -> list[Phrase]:
    """{"phrases": [{"text", "voice"?} | "text", ...]} or a bare JSON list of them."""
    data = _load_json(body)
    if isinstance(data, list):
        data = {"phrases": data}
    elif not isinstance(data, dict):
        raise BadInput("request body must be a JSON object or list")
    _no_unknown(data, ("phrases",))
    items = data.get("phrases")
    if not isinstance(items, list):
        raise BadInput("'phrases' must be a list")
    if len(items) > MAX_WARM_PHRASES:
        raise BadInput(f"at most {MAX_WARM_PHRASES} phrases at once")
    phrases = []
    for i, item in enumerate(items):
        entry = {"text": item} if isinstance(item, str) else item
        if not isinstance(entry, dict):
            raise BadInput(f"phrase {i} must be a string or an object")
        try:
            _no_unknown(entry, ("text", "voice"))
            phrases.append(Phrase(_text(entry, "text", max_text_chars), _optional_str(entry, "voice")))
        except (BadInput, TextTooLong) as exc:  # which of thousands of phrases it was
            raise type(exc)(f"phrase {i}: {exc}") from None
    return phrases


def _shown(value: Any) -> str:
    """A client's value as quoted in an error message: cut short, the client sent it."""
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:80] + "..."


def _tag(value: Any, name: str = "tag") -> str | None:
    """A cache tag, or a voice or version naming cache entries: a short printable string."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > TAG_MAX or not value.isprintable():
        raise BadInput(f"{name!r} must be a printable string of at most {TAG_MAX} characters")
    return value


def parse_phrase_lines(text: str) -> list[Phrase]:
    """A phrase list: one phrase a line, optionally "voice<TAB>text"; blank lines and lines
    starting with # are skipped."""
    phrases = []
    for number, line in enumerate(text.removeprefix("\ufeff").splitlines(), 1):  # a BOM is no text
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        voice, tab, rest = line.partition("\t")
        # Spaces and tabs around a phrase are layout; other whitespace (a no-break space) is text.
        phrases.append(Phrase(rest.strip(" \t"), voice.strip() or None, number) if tab
                       else Phrase(line.strip(" \t"), line=number))
    return phrases
