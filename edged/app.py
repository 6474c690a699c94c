"""The HTTP application (ASGI): routing, request parsing, errors, and streaming audio to the client.

A synthesis answer starts only once its first audio exists, so that everything that can go wrong
before it (busy, not ready, bad text) is still a proper JSON error with its status. While audio
streams, the client's connection is watched: if it hangs up, the synthesis task is cancelled
before its next window; if it stops reading, the output stage's timeout cuts it off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict

from .admin import require_admin
from .asgi import (
    REFUSED_STATUS,
    ClientGone,
    Receive,
    Scope,
    Send,
    read_body,
    send_body,
    send_error,
    send_json,
    wait_disconnect,
)
from .cacheservice import CacheService
from .config import OPENAI_PCM_RATE, OPENAI_VOICE_NAMES
from .daemon import CacheStatus, Daemon, PcmStream
from .errors import (
    BadInput,
    Busy,
    CodingNotImplemented,
    CompressedBody,
    EdgedError,
    HttpVersionNotSupported,
    MethodNotAllowed,
    NotFound,
    NotReady,
    StageTimeout,
    UnknownVoice,
)
from .messages import (
    CONTENT_TYPES,
    Phrase,
    cache_scope,
    parse_json,
    parse_query,
    speech_body,
    synthesize_body,
    warm_body,
)
from .metrics import Metrics
from .pipeline import SynthesisRequest
from .wav import wav_header

log = logging.getLogger(__name__)

MONITORING = frozenset({"/v1/health", "/v1/status", "/metrics"})
"""Cheap routes answered even past the connection limit: a box full of clients (or of idle
connections) must still tell its supervisor how it is doing."""

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class WriteStalled(Exception):
    """The client stopped reading its audio for longer than the output stage allows."""


class App:
    def __init__(self, daemon: Daemon, metrics: Metrics, over_limit: Callable[[], bool]) -> None:
        self.daemon = daemon
        self.settings = daemon.settings
        self.metrics = metrics
        self.over_limit = over_limit
        """True while the server holds more connections or requests than it may (this one counted)."""
        self.routes: dict[str, dict[str, Handler]] = {
            "/v1/health": {"GET": self.health},
            "/v1/status": {"GET": self.status},
            "/v1/voices": {"GET": self.voices},
            "/v1/synthesize": {"POST": self.synthesize},
            "/v1/audio/speech": {"POST": self.speech},
            "/metrics": {"GET": self.metrics_text},
            "/v1/cache": {"DELETE": self.cache_clear},
            "/v1/cache/warm": {"POST": self.cache_warm},
        }
        for methods in self.routes.values():  # HEAD wherever GET is (RFC 9110); uvicorn sends no body
            if "GET" in methods:
                methods["HEAD"] = methods["GET"]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        status = 500

        response_started = False

        async def tracked_send(message: dict[str, object]) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status = int(message["status"])  # type: ignore[call-overload]
                response_started = True
            await send(message)

        try:
            if self.over_limit() and path not in MONITORING:
                self.daemon.connections_refused += 1
                raise Busy(f"too many connections (limit {self.settings.server.max_connections})")
            _require_http1(scope)
            _require_plain_body(scope)
            methods = self.routes.get(path)
            if methods is None:
                raise NotFound(f"no route {path[:200]!r}")
            handler = methods.get(scope["method"])
            if handler is None:
                allow = ", ".join(methods).encode()
                error = MethodNotAllowed(f"{scope['method']} is not allowed on {path}; use {allow.decode()}")
                await send_error(tracked_send, error, self.settings.server.retry_after_s, [(b"allow", allow)])
            else:
                await handler(scope, receive, tracked_send)
        except ClientGone:
            status = 499  # nginx's "client closed request", for the metrics only
        except EdgedError as error:
            await send_error(tracked_send, error, self.settings.server.retry_after_s)
        except asyncio.CancelledError:  # the drain timeout ran out: the daemon is stopping
            if not response_started:
                await send_error(tracked_send, NotReady("the daemon is stopping"), self.settings.server.retry_after_s)
            raise
        except Exception:  # a bug: the client still gets the contract's shape, the log the trace
            log.exception("%s %s failed", scope["method"], path[:200])
            if not response_started:
                await send_error(tracked_send, EdgedError("internal error"), self.settings.server.retry_after_s)
            else:
                raise  # the response has begun: uvicorn closes the connection
        finally:
            # What the client got, if the HTTP layer refused its body (and closed) before our answer.
            status = scope.get(REFUSED_STATUS, status)
            self.metrics.count_request(path if path in self.routes else "other", status)

    # -- simple routes ----------------------------------------------------------------------------

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.daemon.health())

    async def status(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.daemon.status())

    async def voices(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"default": self.settings.voices.default,
                                    "voices": self.daemon.registry.describe()})

    async def metrics_text(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, content_type = self.metrics.render()
        await send_body(send, 200, body, content_type)

    # -- the cache (administrative) ------------------------------------------------------------------

    async def cache_clear(self, scope: Scope, receive: Receive, send: Send) -> None:
        """DELETE /v1/cache[?voice=V&version=X&tag=T] (or the same as a JSON body): drop entries."""
        require_admin(scope.get("edged.peer"), self.settings.server.admin_group)
        raw = await self._body(scope, receive)
        query = parse_query(scope.get("query_string", b""))
        body = parse_json(raw) if raw.strip() else {}
        if query and body:  # one would silently override the other
            raise BadInput("give the scope in the query or in the body, not both")
        target = cache_scope(query or body)
        service = self._cache_service()
        dropped = await service.invalidate(target.voice, target.version, target.tag)
        await send_json(send, 200, dropped)

    async def cache_warm(self, scope: Scope, receive: Receive, send: Send) -> None:
        """POST /v1/cache/warm: queue phrases; the missing ones are synthesized at low priority.
        Answers at once (202) with the progress, which /v1/status and /metrics follow."""
        require_admin(scope.get("edged.peer"), self.settings.server.admin_group)
        _require_no_query(scope)
        phrases = warm_body(await self._body(scope, receive), self.settings.limits.max_text_chars)
        service = self._cache_service()
        self._check_warm_voices(phrases)
        service.add_warm(phrases)
        await send_json(send, 202, {"queued": len(phrases), "warm": asdict(service.warm)})

    def _check_warm_voices(self, phrases: list[Phrase]) -> None:
        """Refuse the phrases now if one names a voice that is not installed (else each of them
        failed later, one by one). Faults are named by phrase, as the body's others are (edgectl
        turns the first into a line of its file); every unknown voice is named at once."""
        first_phrase: dict[str, int] = {}  # each voice named, and the first phrase naming it
        for i, phrase in enumerate(phrases):
            first_phrase.setdefault(phrase.voice or self.settings.voices.default, i)
        unknown: list[tuple[int, str, UnknownVoice]] = []
        for name, i in first_phrase.items():
            try:
                self.daemon.registry.info(name)
            except UnknownVoice as exc:
                unknown.append((i, name, exc))
            except EdgedError as exc:  # a bundle that cannot be read
                raise type(exc)(f"phrase {i}: {exc}") from None
        if unknown:
            (i, _, error), *others = unknown
            also = ", ".join(f"{name[:100]!r} (phrase {j})" for j, name, _ in others[:5])
            more = f" and {len(others) - 5} more" if len(others) > 5 else ""
            raise UnknownVoice(f"phrase {i}: {error}" + (f"; also unknown: {also}{more}" if others else ""))

    def _cache_service(self) -> CacheService:
        service = self.daemon.cache
        if not self.settings.cache.enabled:
            raise NotFound("the audio cache is disabled in the configuration ([cache] enabled)")
        if service is None or service.audio is None:
            raise NotReady("the audio cache could not be opened (see the log)")
        return service

    # -- synthesis ----------------------------------------------------------------------------------

    async def synthesize(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived_at = time.perf_counter()
        _require_streaming(scope)
        _require_no_query(scope)
        body = synthesize_body(await self._json(scope, receive), self.settings.limits.max_text_chars)
        info = self.daemon.registry.info(body.voice or self.settings.voices.default)
        request = info.request(body.text, body.speed, body.format)
        await self._stream_audio(receive, send, request, "/v1/synthesize", arrived_at, body.tag)

    async def speech(self, scope: Scope, receive: Receive, send: Send) -> None:
        """OpenAI's POST /v1/audio/speech: {"input", "voice", "response_format", "speed"}."""
        arrived_at = time.perf_counter()
        _require_streaming(scope)
        body = speech_body(await self._json(scope, receive), self.settings.limits.max_text_chars)
        info = self.daemon.registry.info(self._openai_voice(body.voice))
        if body.response_format == "pcm" and info.sample_rate != OPENAI_PCM_RATE:
            # A client would play it at 24 kHz: 9% fast and high for a 22,050 Hz voice.
            raise BadInput(f"response_format \"pcm\" is raw {OPENAI_PCM_RATE} Hz audio in OpenAI's API; this "
                           f"voice speaks at {info.sample_rate} Hz: ask for \"wav\" (its header carries the "
                           "rate), or use /v1/synthesize with \"format\": \"pcm\"")
        request = info.request(body.input, body.speed, body.response_format)
        await self._stream_audio(receive, send, request, "/v1/audio/speech", arrived_at)

    def _openai_voice(self, name: str) -> str:
        """An explicit mapping, else an edged voice id, else (for OpenAI's names) the default voice."""
        openai = self.settings.openai
        mapped = openai.voice_map.get(name.lower())  # its names are lower-cased: "Alloy" is "alloy"
        if mapped is not None:
            return mapped
        try:
            return self.daemon.registry.info(name).voice_id
        except UnknownVoice:
            if name.lower() in OPENAI_VOICE_NAMES:
                return openai.default_voice or self.settings.voices.default
            raise

    async def _json(self, scope: Scope, receive: Receive) -> dict[str, object]:
        return parse_json(await self._body(scope, receive))

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        return await read_body(scope, receive, self.settings.limits.max_body_bytes,
                               self.settings.server.body_timeout_s)

    async def _stream_audio(self, receive: Receive, send: Send, request: SynthesisRequest,
                            route: str, arrived_at: float, tag: str | None = None) -> None:
        """Stream the audio of `request`, cancelling its synthesis if the client hangs up."""
        cache_status, chunks = await self.daemon.audio_for(request, tag)
        streaming = asyncio.create_task(self._send_audio(send, request, cache_status, chunks, route, arrived_at))
        hangup = asyncio.create_task(wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({streaming, hangup}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is cancelling this request (drain timeout)
            streaming.cancel()
            hangup.cancel()
            raise
        hangup.cancel()
        if streaming not in done:
            self.daemon.disconnects += 1
            streaming.cancel()
            log.debug("client hung up; its stream stopped")  # counted; a line each would flood the log
        try:
            await streaming
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            raise ClientGone from None

    async def _send_audio(self, send: Send, request: SynthesisRequest, cache_status: CacheStatus,
                          chunks: PcmStream, route: str, arrived_at: float) -> None:
        async with contextlib.aclosing(chunks):  # closing it frees the synthesis slot at once
            try:
                first = await anext(chunks, None)
            except EdgedError as error:
                await send_error(send, error, self.settings.server.retry_after_s)
                return
            if request.format == "wav":  # with the first audio: a client's first bytes hold sound
                # A cache hit knows its length, and so does a text with nothing to say (no
                # audio at all); a synthesis under way gets the streaming header.
                size = 0 if first is None else getattr(chunks, "known_size", None)
                first = wav_header(request.sample_rate, size) + (first or b"")
            headers = [
                (b"content-type", CONTENT_TYPES[request.format].encode()),
                (b"x-edged-sample-rate", str(request.sample_rate).encode()),
                (b"x-edged-cache", cache_status.encode()),
                (b"x-edged-voice", request.voice_id.encode()),
            ]
            try:
                await self._write(send, {"type": "http.response.start", "status": 200, "headers": headers})
                if first:  # None or b"": no audio (pcm)
                    await self._write(send, {"type": "http.response.body", "body": first, "more_body": True})
                first_audio = time.perf_counter() - arrived_at
                async for chunk in chunks:
                    await self._write(send, {"type": "http.response.body", "body": chunk, "more_body": True})
                await self._write(send, {"type": "http.response.body", "body": b""})
            except WriteStalled:
                # Returning with the response incomplete makes the HTTP layer close the connection.
                self.daemon.write_stalls += 1
                log.warning("client stopped reading for %g s; stream cut off",
                            self.daemon.pipeline.output.timeout_s)
                return
            except EdgedError as error:  # a stage failed mid-stream: the status is sent already
                log.warning("synthesis failed mid-stream, connection closed: %s", error)
                return
        self.metrics.observe_audio(route, cache_status, first_audio, time.perf_counter() - arrived_at)

    async def _write(self, send: Send, message: dict[str, object]) -> None:
        try:
            await self.daemon.pipeline.output.wait(send(message))
        except StageTimeout:
            raise WriteStalled from None
        # A hit's chunks are at hand and a write that fails does not suspend: without this turn
        # of the loop, a client that hung up would not be noticed before the whole answer was
        # written into its dead connection (asyncio logging a warning for every write).
        await asyncio.sleep(0)


def _require_http1(scope: Scope) -> None:
    """httptools parses any version number ("HTTP/2.0", "HTTP/9.9"); only 1.x is HTTP/1 (a
    higher minor version is answered as 1.1, RFC 9110 2.5)."""
    if not str(scope.get("http_version", "")).startswith("1."):
        raise HttpVersionNotSupported(f"HTTP/{scope.get('http_version')} is not spoken here: use HTTP/1.1")


def _require_plain_body(scope: Scope) -> None:
    """The parser undoes chunked framing and nothing else: a body sent gzipped would be read as
    if it were plain, and the client told its JSON is malformed (or, worse, that it was fine)."""
    for name, value in scope["headers"]:
        text = value.decode("latin-1")
        codings = {c.strip().lower() for c in text.split(",")} - {""}
        if name == b"transfer-encoding" and codings - {"chunked"}:
            raise CodingNotImplemented(f"transfer coding {text[:100]!r} is not implemented: send the "
                                       "body plain, or chunked")
        if name == b"content-encoding" and codings - {"identity"}:
            raise CompressedBody(f"content encoding {text[:100]!r} is not supported: send the body "
                                 "uncompressed")


def _require_no_query(scope: Scope) -> None:
    """edged's own POST routes take their options in the JSON body: "?format=pcm" or "?voice=x"
    was ignored, and the client got other audio than it asked for without being told.
    (/v1/audio/speech ignores one: Azure's OpenAI clients add "?api-version=".)"""
    if scope.get("query_string"):
        raise BadInput(f"{scope['path']} takes no query parameters: put them in the JSON body")


def _require_streaming(scope: Scope) -> None:
    """Audio goes out as it is made, in chunked encoding: HTTP/1.1 only (RFC 9112 forbids
    chunked encoding towards an HTTP/1.0 client)."""
    if scope.get("http_version") == "1.0":
        raise HttpVersionNotSupported("audio is streamed with chunked encoding: send the request as HTTP/1.1")
