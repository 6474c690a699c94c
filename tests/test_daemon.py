"""The daemon's HTTP contract, against the real daemon process on a temporary socket."""

from __future__ import annotations

import contextlib
import io
import json
import select
import socket
import struct
import threading
import time
import wave
from pathlib import Path

import pytest
from daemon_harness import LONG_TEXT, OTHER_VOICE, SENTENCE, Daemon, other_voice, post_raw, read_head, wait_for

SHORT = "Hello there, this is a test."


def _samples(body: bytes, header: bool) -> int:
    return (len(body) - (44 if header else 0)) // 2


def test_health_and_status_report_ready(daemon: Daemon) -> None:
    assert daemon.get("/v1/health").json()["state"] == "READY"
    status = daemon.status()
    assert status["state"] == "READY"
    assert set(status["stages"]) == {"text", "front", "back", "output"}
    assert status["admission"]["capacity"] >= 1
    assert status["process"]["anon_mb"] > 0


def test_voices_lists_the_default_voice_with_its_providers(daemon: Daemon) -> None:
    listing = daemon.get("/v1/voices").json()
    voice = next(v for v in listing["voices"] if v["id"] == listing["default"])
    assert voice["state"] == "loaded"
    assert voice["sample_rate"] == 22050
    assert voice["providers"]["front"] and voice["providers"]["back"]


def test_synthesize_streams_wav_in_chunks(daemon: Daemon) -> None:
    reply = daemon.request("POST", "/v1/synthesize", {"text": SHORT})
    assert reply.status == 200
    assert reply.headers["content-type"] == "audio/wav"
    assert reply.headers["transfer-encoding"] == "chunked"
    assert reply.headers["x-edged-sample-rate"] == "22050"
    assert reply.headers["x-edged-cache"] == "miss"
    assert reply.body[:4] == b"RIFF" and reply.body[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", reply.body[24:28])[0] == 22050
    seconds = _samples(reply.body, header=True) / 22050
    assert 1.0 < seconds < 4.0
    pcm = memoryview(reply.body[44:]).cast("h")
    assert max(abs(s) for s in pcm) > 1000  # speech, not silence


def test_a_text_with_nothing_to_say_is_a_wav_that_says_it_holds_no_audio(daemon: Daemon) -> None:
    # Its header said "streaming" (sizes 0xFFFFFFFF): Python's wave module took that for ~2^31
    # frames, though the daemon knew there was no audio before it wrote the header.
    for _ in range(2):  # the second one asked again (nothing is stored for it)
        reply = daemon.request("POST", "/v1/synthesize", {"text": "?!"})
        assert reply.status == 200 and len(reply.body) == 44
        with wave.open(io.BytesIO(reply.body)) as wav:
            assert wav.getnframes() == 0 and wav.getframerate() == 22050
        assert struct.unpack("<I", reply.body[4:8])[0] == 36


def test_options_in_the_query_string_are_refused_not_ignored(daemon: Daemon) -> None:
    # "?format=pcm&voice=x" was ignored: WAV of the default voice, and the client never told.
    reply = daemon.request("POST", "/v1/synthesize?format=pcm&voice=nobody", {"text": SHORT})
    assert reply.status == 400 and "query" in reply.json()["error"]["message"]
    azure = daemon.request("POST", "/v1/audio/speech?api-version=2025-01-01", {"input": SHORT, "voice": "alloy"})
    assert azure.status == 200 and azure.body[:4] == b"RIFF"


def test_a_text_of_nul_characters_is_empty_as_a_text_of_spaces_is(daemon: Daemon) -> None:
    for text in (" \t", "\x00", " \x00\n"):
        reply = daemon.request("POST", "/v1/synthesize", {"text": text})
        assert reply.status == 400 and reply.json()["error"]["message"] == "field 'text' is empty", text


def test_pcm_format_is_headerless_and_speed_shortens_it(daemon: Daemon) -> None:
    normal = daemon.request("POST", "/v1/synthesize", {"text": SHORT, "format": "pcm"})
    fast = daemon.request("POST", "/v1/synthesize", {"text": SHORT, "format": "pcm", "speed": 2.0})
    assert normal.status == fast.status == 200
    assert normal.headers["content-type"] == "application/octet-stream"
    assert normal.body[:4] != b"RIFF" and len(normal.body) % 2 == 0
    assert len(fast.body) < 0.7 * len(normal.body)


def test_openai_speech_maps_openai_voice_names_to_the_default(daemon: Daemon) -> None:
    reply = daemon.request("POST", "/v1/audio/speech",
                           {"model": "tts-1", "input": SHORT, "voice": "alloy", "response_format": "wav"})
    assert reply.status == 200
    assert reply.headers["x-edged-voice"] == daemon.get("/v1/voices").json()["default"]
    assert reply.body[:4] == b"RIFF"
    unknown = daemon.request("POST", "/v1/audio/speech", {"input": SHORT, "voice": "not-a-voice"})
    assert unknown.status == 404 and unknown.json()["error"]["code"] == "unknown_voice"
    mp3 = daemon.request("POST", "/v1/audio/speech", {"input": SHORT, "voice": "nova", "response_format": "mp3"})
    assert mp3.status == 400 and "response_format" in mp3.json()["error"]["message"]
    # OpenAI's pcm is 24 kHz with nothing to say so: this voice's 22,050 Hz would play 9% fast.
    pcm = daemon.request("POST", "/v1/audio/speech", {"input": SHORT, "voice": "nova", "response_format": "pcm"})
    assert pcm.status == 400 and "24000 Hz" in pcm.json()["error"]["message"]
    events = daemon.request("POST", "/v1/audio/speech", {"input": SHORT, "voice": "nova", "stream_format": "sse"})
    assert events.status == 400 and "stream_format" in events.json()["error"]["message"]
    # OpenAI's SDKs send null for an argument given as None: not given, as for "voice" elsewhere.
    nulls = daemon.request("POST", "/v1/audio/speech", {"input": SHORT, "voice": "nova", "speed": None,
                                                         "response_format": None, "stream_format": None})
    assert nulls.status == 200 and nulls.body[:4] == b"RIFF", nulls.body[:200]


def test_openai_voice_names_are_mapped_whatever_their_case(tmp_path: Path, bundle_dir: Path) -> None:
    voices = other_voice(tmp_path, bundle_dir)
    config = f'[voices]\nsearch_path = ["{voices}"]\n[openai]\nvoice_map = {{ alloy = "{OTHER_VOICE}" }}\n'
    with Daemon(tmp_path / "d", config) as daemon:
        for name in ("alloy", "Alloy", "ALLOY"):
            reply = daemon.request("POST", "/v1/audio/speech", {"input": SHORT, "voice": name})
            assert reply.status == 200 and reply.headers["x-edged-voice"] == OTHER_VOICE


def test_an_openai_voice_that_is_not_installed_is_named_at_start(tmp_path: Path) -> None:
    # A typo in the map was only seen as each of its requests' 404.
    with Daemon(tmp_path, '[openai]\nvoice_map = { alloy = "xx_XX-typo" }\n') as daemon:
        assert "openai.voice_map.alloy names a voice its requests cannot have: unknown voice 'xx_XX-typo'" \
            in daemon.log_text()


BAD_INPUT = [
    ("empty text", b'{"text": ""}', 400, "bad_request"),
    ("blank text", b'{"text": "  \\n "}', 400, "bad_request"),
    ("malformed JSON", b'{"text": "hi"', 400, "bad_request"),
    ("not an object", b'["hi"]', 400, "bad_request"),
    ("a field given twice", b'{"text": "", "text": "hi"}', 400, "bad_request"),
    ("missing field", b'{"voice": "en_US-joe-medium"}', 400, "bad_request"),
    ("text not a string", b'{"text": 5}', 400, "bad_request"),
    ("unknown field", b'{"text": "hi", "volume": 3}', 400, "bad_request"),
    ("bad UTF-8", b'{"text": "caf\xe9"}', 400, "bad_request"),
    ("lone surrogate", b'{"text": "a\\ud800b"}', 400, "bad_request"),
    ("speed out of range", b'{"text": "hi", "speed": 9}', 400, "bad_request"),
    ("bad format", b'{"text": "hi", "format": "mp3"}', 400, "bad_request"),
    ("unknown voice", b'{"text": "hi", "voice": "xx_XX-nobody"}', 404, "unknown_voice"),
    ("path as voice", b'{"text": "hi", "voice": "../models/en_US-joe-medium"}', 404, "unknown_voice"),
    ("text over the limit", json.dumps({"text": "a" * 100_001}).encode(), 413, "text_too_long"),
    ("body over the limit", b'{"text": "' + b"a" * 1_400_000 + b'"}', 413, "body_too_large"),
    ("number of 5,000 digits", b'{"text": "hi", "speed": 1' + b"0" * 5000 + b"}", 400, "bad_request"),
    ("nesting too deep", b"[" * 100_000, 400, "bad_request"),
]


@pytest.mark.parametrize(("body", "status", "code"), [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT])
def test_bad_input_gets_its_status_and_a_json_error(daemon: Daemon, body: bytes, status: int, code: str) -> None:
    reply = daemon.request("POST", "/v1/synthesize", body, {"Content-Type": "application/json"})
    assert reply.status == status
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert error["code"] == code and error["message"]


def test_texts_that_crashed_espeak_are_spoken(daemon: Daemon) -> None:
    # Each segfaulted espeak-ng as it was (tests/test_phonemes.py has more); what still would only
    # costs espeak-ng's own process (tests/test_espeak_worker.py), counted here.
    for text in ("The " + "ness" * 71 + " is here.", "k . e . m . u . " * 25):
        reply = daemon.request("POST", "/v1/synthesize", {"text": text, "format": "pcm"})
        assert reply.status == 200 and len(reply.body) > 22050
    assert daemon.status()["synthesis"]["espeak_restarts"] == 0
    assert "edged_espeak_restarts_total 0.0" in daemon.get("/metrics").body.decode()


def test_an_error_quotes_a_huge_value_cut_short(daemon: Daemon) -> None:
    reply = daemon.request("POST", "/v1/synthesize", {"text": "hi", "format": "x" * 500_000})
    assert reply.status == 400 and len(reply.body) < 500


def test_wrong_method_and_unknown_route(daemon: Daemon) -> None:
    wrong = daemon.request("GET", "/v1/synthesize")
    assert wrong.status == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    missing = daemon.get("/v1/nothing-here")
    assert missing.status == 404 and missing.json()["error"]["code"] == "not_found"


def test_head_is_answered_wherever_get_is(daemon: Daemon) -> None:
    # Health probes and `curl -I` use HEAD; RFC 9110 asks for it wherever GET is.
    for path in ("/v1/health", "/v1/status", "/metrics"):
        head, get = daemon.request("HEAD", path), daemon.get(path)
        assert head.status == 200 and head.body == b""
        assert head.headers["content-type"] == get.headers["content-type"]
    wrong = daemon.request("PUT", "/v1/health")
    assert wrong.status == 405 and wrong.headers["allow"] == "GET, HEAD"


def test_websocket_upgrades_are_answered_as_plain_http_without_logging(daemon: Daemon) -> None:
    for _ in range(3):
        reply = daemon.request("GET", "/v1/health", headers={"Connection": "Upgrade", "Upgrade": "websocket"})
        assert reply.status == 200
    assert "upgrade" not in daemon.log_text().lower()


def test_metrics_are_prometheus_text(daemon: Daemon) -> None:
    daemon.request("POST", "/v1/synthesize", {"text": SHORT})
    reply = daemon.get("/metrics")
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
    text = reply.body.decode()
    for needle in ('edged_requests_total{route="/v1/synthesize",status="200"}',
                   'edged_queue_length{stage="back"}', 'edged_queue_length{stage="admission"}',
                   'edged_time_to_first_audio_seconds_bucket{cache="miss"',
                   'edged_resident_memory_bytes{kind="anon"}', 'edged_resident_memory_bytes{kind="file"}',
                   'edged_voice_provider{', "edged_threads ", "edged_gc_pause_seconds_count",
                   "edged_synthesis_cancelled_total", "process_cpu_seconds_total"):
        assert needle in text, needle


def test_trickling_headers_do_not_block_others_and_are_cut_off(daemon: Daemon) -> None:
    slow = daemon.connect()
    slow.sendall(b"POST /v1/synthesize HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest
    idle = daemon.connect()  # connects and sends nothing at all
    started = time.monotonic()
    reply = daemon.request("POST", "/v1/synthesize", {"text": "Still served."})
    assert reply.status == 200 and len(reply.body) > 44
    for sock in (slow, idle):  # closed by the daemon after header_timeout_s (1 s here)
        sock.settimeout(10)
        assert sock.recv(1024) == b""
        sock.close()
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("request_bytes, then", [
    (b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n", b"\r\n"),  # a blank line, which HTTP says to ignore
    (b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n", b"x"),  # answered unread
])
def test_input_that_begins_no_request_is_held_to_the_header_deadline(daemon: Daemon, request_bytes: bytes,
                                                                     then: bytes) -> None:
    # uvicorn stops its keep-alive clock at any input: a byte after an answer held the connection
    # for good, and 65 such clients left every other one a 503 busy.
    with daemon.connect() as sock:
        sock.sendall(request_bytes)
        read_head(sock)
        sock.sendall(then)
        sock.settimeout(10)
        started = time.monotonic()
        assert sock.recv(1024) == b""  # closed after header_timeout_s (1 s here)
    assert time.monotonic() - started < 5


def test_a_request_asking_to_upgrade_is_answered_and_nothing_after_it_is_run(daemon: Daemon) -> None:
    # llhttp ends an upgrade request at its headers: `curl --http2` got "malformed JSON" for its
    # body, and a body sent in a later packet was run as a request of its own.
    upgrade = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"
    health = b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n"
    before = _requests_counted(daemon, "/v1/health", 200)
    with daemon.connect() as sock:
        sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n" + upgrade + b"\r\n")
        assert read_head(sock)[0] == 200
        sock.sendall(health)
        assert _read_to_end(sock) == b""  # closed after its answer; the next request never run
    assert _requests_counted(daemon, "/v1/health", 200) == before + 1
    with daemon.connect() as sock:
        request = post_raw(health)
        head, body = request.split(b"\r\n\r\n", 1)
        sock.sendall(head + b"\r\n" + upgrade + b"\r\n")
        status, answer = read_head(sock)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed with the refusal
            sock.sendall(body)
        assert status == 400 and "upgrade" in json.loads(answer)["error"]["message"]
        assert _read_to_end(sock) == b""
    assert _requests_counted(daemon, "/v1/health", 200) == before + 1


def test_body_that_does_not_arrive_gets_408(daemon: Daemon) -> None:
    with daemon.connect() as sock:
        sock.sendall(post_raw(b'{"text": "hello"}')[:-5])  # headers promise 5 more bytes
        status, body = read_head(sock)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert sock.recv(1024) == b""  # the request was never whole: the connection is closed


def test_audio_is_not_sent_chunked_to_an_http10_client(daemon: Daemon) -> None:
    # Chunked encoding is forbidden towards HTTP/1.0 (RFC 9112): a JSON 505 instead; monitoring,
    # which has a length, is answered.
    with daemon.connect() as sock:
        sock.sendall(post_raw(b'{"text": "hello"}').replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        status, body = read_head(sock)
    assert status == 505 and json.loads(body)["error"]["code"] == "http_version_not_supported"
    with daemon.connect() as sock:
        sock.sendall(b"GET /v1/health HTTP/1.0\r\n\r\n")
        status, body = read_head(sock)
    assert status == 200 and json.loads(body)["state"] == "READY"


@pytest.mark.parametrize("version", [b"2.0", b"0.9", b"3.0", b"1.2"])
@pytest.mark.parametrize("request_line", [b"GET /v1/health", b"POST /v1/synthesize", b"GET /nowhere"])
def test_versions_other_than_http1_are_refused_on_every_route(daemon: Daemon, version: bytes, request_line: bytes) -> None:
    # Answering "HTTP/1.1 200" to an HTTP/2.0 request would claim a protocol we do not speak; a
    # later 1.x is answered as 1.1 (RFC 9110 2.5). httptools refused 3.0 or 1.2 as malformed (400).
    with daemon.connect() as sock:
        sock.sendall(request_line + b" HTTP/" + version + b"\r\nContent-Length: 0\r\n\r\n")
        status, body = read_head(sock)
    if version == b"1.2":
        assert status != 505 and b"malformed HTTP request" not in body
    else:
        assert status == 505 and json.loads(body)["error"]["code"] == "http_version_not_supported"


def test_headers_without_end_are_cut_off_at_the_limit(daemon: Daemon) -> None:
    # httptools buffers headers without limit: 400 MB of them once grew the daemon by 400 MB.
    with daemon.connect() as sock:
        sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed while sending
            for _ in range(64):
                sock.sendall(b"X-Filler: " + b"a" * 8000 + b"\r\n")
        status, body = read_head(sock)
    assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
    assert daemon.get("/v1/health").status == 200


def test_headers_after_a_pipelined_request_in_the_same_read_are_held_to_the_limit(daemon: Daemon) -> None:
    with daemon.connect() as sock:
        first = b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n"
        lines = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"a" * 1000) for i in range(150))  # never ends
        sock.sendall(first + b"GET /v1/health HTTP/1.1\r\nHost: x\r\n" + lines)
        data = _read_to_end(sock)
    # The first request's answer, then the refusal, then the end.
    assert data.startswith(b"HTTP/1.1 200 ") and data.index(b"HTTP/1.1 431 ") > 0
    assert data.rstrip().endswith(b"}") and b"headers_too_large" in data


def test_complete_headers_over_the_limit_are_refused_and_under_it_served(daemon: Daemon) -> None:
    for filler, expected in ((100_000, 431), (17_000, 431), (15_000, 200)):  # the limit is 16 KiB
        with daemon.connect() as sock:  # one write: the headers end in the read that brings them
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * filler + b"\r\n\r\n")
            status, _ = read_head(sock)
        assert status == expected, filler


CHUNKED_SYNTHESIZE = b"POST /v1/synthesize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(("request_bytes", "route"), [
    (b"GARBAGE\r\n\r\n", "other"),
    (b"GET /v1/health HTTP/1.1\r\nHost x\r\n\r\n", "other"),
    (b"POST /v1/synthesize HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", "other"),
    # Headers read, the body broken: counted once, under its route (it was also counted as a 499,
    # a client that left, by the app that was reading the body).
    (CHUNKED_SYNTHESIZE + b"zz\r\n", "/v1/synthesize"),
    (CHUNKED_SYNTHESIZE + b'5\r\n{"tex\r\nZZZ\r\n', "/v1/synthesize"),
    # A route that answers without reading the body: counted as the 400 the client got, not 200.
    (b"GET /v1/voices HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "/v1/voices"),
])
def test_requests_the_parser_rejects_get_a_json_400(daemon: Daemon, request_bytes: bytes, route: str) -> None:
    counted_before = {key: _requests_counted(daemon, *key)
                      for key in [(route, 400), (route, 200), ("/v1/synthesize", 499)]}
    with daemon.connect() as sock:
        sock.sendall(request_bytes)
        status, body = read_head(sock)
        assert status == 400 and json.loads(body)["error"]["code"] == "bad_request"
        assert sock.recv(1024) == b""
    deadline = time.monotonic() + 10  # the app counts once it has seen the close
    while _requests_counted(daemon, route, 400) == counted_before[(route, 400)] and time.monotonic() < deadline:
        time.sleep(0.01)
    counted = {key: _requests_counted(daemon, *key) for key in counted_before}
    assert counted == {**counted_before, (route, 400): counted_before[(route, 400)] + 1}


@pytest.mark.parametrize(("header", "status", "code"), [
    (b"Transfer-Encoding: gzip, chunked", 501, "coding_not_implemented"),
    (b"Content-Encoding: gzip", 415, "unsupported_content_encoding"),
])
def test_a_body_in_a_coding_not_undone_is_refused_not_read_as_plain(daemon: Daemon, header: bytes, status: int,
                                                                    code: str) -> None:
    # Both were read as a plain body: a client sending real gzip was told its JSON was malformed.
    body = b'{"text": "Hi."}'
    chunked = b"chunked" in header
    framing = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if chunked else body
    length = b"" if chunked else b"Content-Length: %d\r\n" % len(body)
    with daemon.connect() as sock:
        sock.sendall(b"POST /v1/synthesize HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n" + length + b"\r\n" + framing)
        answer, body_read = read_head(sock)
        assert answer == status and json.loads(body_read)["error"]["code"] == code
        assert sock.recv(1024) == b""  # the body was not read: the connection cannot go on
    identity = b"Content-Encoding: identity\r\nContent-Length: %d\r\n\r\n" % len(body)
    with daemon.connect() as sock:
        sock.sendall(b"POST /v1/synthesize HTTP/1.1\r\nHost: x\r\n" + identity + body)
        assert read_head(sock)[0] == 200


def test_a_broken_body_queued_behind_a_whole_request_is_counted(daemon: Daemon) -> None:
    # The broken request is dropped unrun behind the whole one; its 400 went uncounted.
    before = {key: _requests_counted(daemon, *key) for key in [("/v1/voices", 200), ("other", 400)]}
    with daemon.connect() as sock:
        sock.sendall(b"GET /v1/voices HTTP/1.1\r\nHost: x\r\n\r\n" + CHUNKED_SYNTHESIZE + b"zz\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 400" in data
    assert {key: _requests_counted(daemon, *key) for key in before} == {key: n + 1 for key, n in before.items()}


def _requests_counted(daemon: Daemon, route: str, status: int) -> float:
    needle = f'edged_requests_total{{route="{route}",status="{status}"}} '
    lines = [line for line in daemon.get("/metrics").body.decode().splitlines() if line.startswith(needle)]
    return float(lines[0].split()[-1]) if lines else 0.0


PIPELINED_HEALTH = b"GET /v1/health HTTP/1.1\r\nHost: edged\r\n"


@pytest.mark.parametrize("pipelined", [b"", PIPELINED_HEALTH + b"\r\n"], ids=["alone", "pipelined"])
def test_client_disconnect_stops_its_synthesis(daemon: Daemon, pipelined: bytes) -> None:
    # A request pipelined after the audio one made uvicorn tell only that request of the hang-up.
    before = daemon.status()["synthesis"]
    sock = daemon.connect()
    sock.sendall(post_raw({"text": LONG_TEXT, "format": "pcm"}) + pipelined)
    status, _ = read_head(sock)
    assert status == 200
    sock.close()  # hang up after the first audio; the rest would be ~3 minutes of speech

    def stopped() -> dict | None:
        status = daemon.status()
        synthesis = status["synthesis"]
        done = synthesis["cancelled"] > before["cancelled"] and status["admission"]["active"] == 0
        return synthesis if done else None

    after = wait_for(stopped, timeout=10)
    assert after["disconnects"] == before["disconnects"] + 1
    time.sleep(0.5)  # no window is decoded after the cancellation
    assert daemon.status()["synthesis"]["windows"] == after["windows"]
    # The whole text needs ~60 windows; hanging up after the first leaves most undone.
    assert after["windows"] - before["windows"] < 20


def test_a_pipelined_request_still_sending_its_headers_does_not_cut_the_running_stream(daemon: Daemon) -> None:
    # Its header deadline (1 s here) used to run while the audio before it was still streaming.
    with daemon.connect() as sock:
        sock.sendall(post_raw({"text": LONG_TEXT, "format": "pcm"}) + PIPELINED_HEALTH)
        status, _ = read_head(sock)
        assert status == 200
        sock.settimeout(5)
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            assert sock.recv(65536), "the stream was cut"
            time.sleep(0.05)  # read at a modest pace: the stream outlasts the header deadline
    # Hung up: its synthesis ends before the next test counts cancellations.
    wait_for(lambda: daemon.status()["admission"]["active"] == 0, timeout=10)


def test_hanging_up_on_a_cached_answer_is_counted_and_logs_nothing(daemon: Daemon) -> None:
    # A hit's chunks are at hand: the rest of the answer was written into the dead connection,
    # with an asyncio warning per write (~30 here), and counted as served (200), not as a hang-up.
    body = {"text": SENTENCE * 3, "format": "pcm"}
    assert daemon.request("POST", "/v1/synthesize", body).status == 200  # now cached (~2 MB)
    before, log_lines = daemon.status()["synthesis"]["disconnects"], len(daemon.log_text().splitlines())
    for _ in range(10):
        with daemon.connect() as sock:
            sock.sendall(post_raw(body))
            assert sock.recv(10).startswith(b"HTTP/1.1 ")
    wait_for(lambda: daemon.status()["synthesis"]["disconnects"] == before + 10, timeout=10)
    assert len(daemon.log_text().splitlines()) - log_lines <= 10


def test_requests_the_parser_refuses_are_answered_without_a_log_line_each(daemon: Daemon) -> None:
    log_lines = len(daemon.log_text().splitlines())
    for _ in range(20):
        with daemon.connect() as sock:
            sock.sendall(b"\x16\x03\x01 HTTP/1.1\r\n\r\n")
            status, _ = read_head(sock)
            assert status == 400
    assert len(daemon.log_text().splitlines()) == log_lines


def test_client_that_never_reads_is_cut_off_without_buffering(daemon: Daemon) -> None:
    before = daemon.status()["synthesis"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(str(daemon.socket))
    sock.sendall(post_raw({"text": LONG_TEXT, "format": "pcm"}))
    # Never read: the daemon's writes stall, and after the output timeout (1.5 s here) it gives up.
    after = wait_for(lambda: (s := daemon.status())["synthesis"]["write_stalls"] > before["write_stalls"]
                     and s["admission"]["active"] == 0 and s["synthesis"], timeout=15)
    assert after["cancelled"] == before["cancelled"] + 1
    received = 0
    sock.settimeout(10)
    while chunk := sock.recv(65536):
        received += len(chunk)
    sock.close()
    # What was buffered is bounded by socket buffers and one window, far from the full stream
    # (LONG_TEXT is ~5 MB of audio in ~84 windows; how many windows fit in the buffers depends on
    # the random durations and the piece layout, so the bound is half the stream, not a tight one).
    assert received < 2_000_000
    assert after["windows"] - before["windows"] < 42


def test_a_client_that_stops_reading_holds_up_no_other_clients_writes(tmp_path: Path) -> None:
    # Writes to clients once shared the output stage's slots (16): as many clients that stopped
    # reading held them all, and everyone else's audio waited until the stall timeout cut them off.
    # One slot here makes one such client enough (the setting is now only warned about).
    config = "[pipeline]\npark_after_s = 0.1\n\n[pipeline.output]\nconcurrency = 1\ntimeout_s = 60\n"
    with Daemon(tmp_path / "d", config) as daemon:
        stalled = daemon.connect()
        stalled.sendall(post_raw({"text": LONG_TEXT, "format": "pcm"}))
        assert read_head(stalled)[0] == 200
        # Never read on: its writes stall once the socket buffers are full.
        wait_for(lambda: daemon.status()["stages"]["output"]["running"] == 1, timeout=15)
        time.sleep(0.5)
        assert daemon.status()["stages"]["output"]["running"] == 1
        with daemon.connect() as other:
            other.settimeout(10)
            other.sendall(post_raw({"text": SHORT, "format": "pcm"}))
            data = _read_to_end_or_answer(other)
        assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"\r\n0\r\n\r\n")
        assert daemon.status()["synthesis"]["write_stalls"] == 0  # the stalled one is still held
        stalled.close()
    assert "setting pipeline.output.concurrency is ignored" in daemon.log_text()


def _read_to_end_or_answer(sock: socket.socket) -> bytes:
    """One chunked answer, read until its last chunk (the connection stays open)."""
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_synthesis_threads_run_nicer_than_the_event_loop(daemon: Daemon) -> None:
    daemon.request("POST", "/v1/synthesize", {"text": SHORT})  # the stage threads exist now
    assert daemon.proc is not None
    nice = {}
    for task in (Path("/proc") / str(daemon.proc.pid) / "task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        nice[int(task.name)] = int(fields[16])  # field 19 of stat: nice
    assert nice[daemon.proc.pid] == 0  # the main thread runs the event loop
    assert sum(1 for n in nice.values() if n == 10) >= 4  # stage threads and onnxruntime's pools


def _read_to_end(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionResetError):  # closed with bytes of ours unread: after all its data
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_a_client_that_half_closes_after_its_request_gets_its_answer(daemon: Daemon) -> None:
    # nc -N and socat shut their sending side once the request is out: that is no hang-up.
    with daemon.connect() as sock:
        sock.sendall(post_raw({"text": SHORT, "format": "pcm"}))
        sock.shutdown(socket.SHUT_WR)
        data = _read_to_end(sock)  # the daemon closes once it has answered
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert body.endswith(b"\r\n0\r\n\r\n") and len(body) > 22050 * 2  # whole, over a second of audio


def test_a_client_that_half_closes_before_its_body_is_sent_is_gone(daemon: Daemon) -> None:
    before = daemon.status()["synthesis"]["completed"]
    with daemon.connect() as sock:
        sock.sendall(post_raw({"text": SHORT})[:-5])  # the body's last bytes will never come
        sock.shutdown(socket.SHUT_WR)
        assert _read_to_end(sock) == b""  # closed at once, nothing synthesized
    assert daemon.status()["synthesis"]["completed"] == before


def test_a_client_that_closes_right_after_its_request_costs_no_window(daemon: Daemon) -> None:
    # Closed altogether (not only its sending side): a hang-up at once, not at the first write.
    before = daemon.status()["synthesis"]
    with daemon.connect() as sock:
        sock.sendall(post_raw({"text": LONG_TEXT, "format": "pcm"}))
    after = wait_for(lambda: (s := daemon.status())["admission"]["active"] == 0
                     and s["synthesis"]["disconnects"] > before["disconnects"] and s["synthesis"])
    assert after["windows"] == before["windows"]


def test_a_half_closed_client_is_answered_its_whole_requests_and_not_an_incomplete_one(daemon: Daemon) -> None:
    # nc -N with a file whose last request is cut short: the whole one before it is still answered.
    with daemon.connect() as sock:
        sock.sendall(post_raw({"text": SHORT, "format": "pcm"}) + post_raw({"text": SHORT})[:-5])
        sock.shutdown(socket.SHUT_WR)
        data = _read_to_end(sock)
    assert data.count(b"HTTP/1.1 ") == 1 and data.startswith(b"HTTP/1.1 200")
    assert data.endswith(b"\r\n0\r\n\r\n") and len(data) > 22050 * 2


@pytest.mark.parametrize("text", [
    LONG_TEXT,  # ~5 MB of audio: far more than the socket's buffer holds
    "The parcel you ordered on Monday was left with your neighbour at number twelve because nobody "
    "was home.",  # ~230 kB: a little more than the socket's buffer holds (~210 kB)
])
def test_a_client_that_never_reads_does_not_keep_its_connection(daemon: Daemon, text: str) -> None:
    # Its stream is cut after the output timeout (1.5 s here); its socket must be let go too: a
    # plain close waits for the client to read what is buffered, and so held it for ever.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(str(daemon.socket))
        sock.sendall(post_raw({"text": text, "format": "pcm"}))
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLHUP)  # raised once the daemon closes its end
        assert wait_for(lambda: poller.poll(0), timeout=15)  # while this one stays open, unread


@pytest.mark.parametrize("stop_sending", ["half-close", "garbage"])
def test_a_client_that_stops_sending_and_then_closes_leaves_the_queue_at_once(tmp_path: Path, stop_sending: str) -> None:
    # The daemon stops reading from such a client, so reading could not tell it hung up.
    config = "[pipeline]\nmax_active = 1\npark_after_s = 30\n\n[cache]\nenabled = false\n"
    with Daemon(tmp_path / "d", config) as daemon:
        streaming = daemon.connect()
        streaming.sendall(post_raw({"text": LONG_TEXT, "format": "pcm"}))
        assert read_head(streaming)[0] == 200
        queued = daemon.connect()
        queued.sendall(post_raw({"text": SHORT}))
        if stop_sending == "half-close":
            queued.shutdown(socket.SHUT_WR)
        else:
            queued.sendall(b"\x16\x03\x01 not HTTP\r\n\r\n")
        wait_for(lambda: daemon.status()["admission"]["waiting"] == 1, timeout=5)
        queued.close()
        # At once: not after park_after_s (30 s), whatever the load on the machine running this.
        assert wait_for(lambda: daemon.status()["admission"]["waiting"] == 0, timeout=10)
        assert daemon.status()["admission"]["active"] == 1  # the stream before it still runs
        streaming.close()


@pytest.mark.parametrize("unreadable", [
    b"\x16\x03\x01 not HTTP\r\n\r\n",
    b"POST /v1/synthesize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"te\r\nZZZ\r\n",
], ids=["garbage", "bad-chunk"])
@pytest.mark.parametrize("half_close", [False, True], ids=["open", "half-closed"])
def test_whole_requests_before_bytes_the_parser_cannot_read_are_answered(
        daemon: Daemon, unreadable: bytes, half_close: bool) -> None:
    # The 400 for the unreadable bytes was all the client got: the requests before were dropped.
    # (Then, behind a request whose body broke off, the 400 never came, and the connection
    # closed only after keep_alive_s, 5 s here; and a client that half-closed got no 400.)
    with daemon.connect() as sock:
        sock.settimeout(3)
        sock.sendall(post_raw({"text": SENTENCE, "format": "pcm"}) + b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n"
                     + unreadable)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        data = _read_to_end(sock)
    audio, health, refusal = data.split(b"\r\n0\r\n\r\nHTTP/1.1 ")[0], *data.rsplit(b"HTTP/1.1 ", 2)[1:]
    assert audio.startswith(b"HTTP/1.1 200 ") and len(audio) > 22050  # the answers, the refusal, the end
    assert health.startswith(b"200 ") and json.loads(health.split(b"\r\n\r\n", 1)[1])["state"] == "READY"
    assert refusal.startswith(b"400 ") and json.loads(refusal.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "bad_request"


def test_bytes_after_the_unreadable_ones_do_not_change_the_refusal(daemon: Daemon) -> None:
    # Reading resumed after the first answer: more bytes were taken for headers over the limit (431).
    medium = post_raw({"text": "The parcel you ordered on Monday was left with your neighbour at number "
                                "twelve because nobody was home.", "format": "pcm"})
    with daemon.connect() as sock:
        sock.sendall(medium * 2 + b"\x16\x03\x01 not HTTP\r\n\r\n")

        def more_bytes() -> None:
            with contextlib.suppress(OSError):  # the daemon closes with them unread
                sock.sendall(b"x" * (4 << 20))

        sender = threading.Thread(target=more_bytes)
        sender.start()
        data = _read_to_end(sock)
        sender.join()
    assert data.count(b"HTTP/1.1 200 ") == 2 and b"HTTP/1.1 400 " in data and b"HTTP/1.1 431" not in data


def test_garbage_behind_a_stream_is_refused_after_the_stream(daemon: Daemon) -> None:
    # The 400 for bytes the parser cannot read was written into the middle of the chunked audio.
    with daemon.connect() as sock:
        sock.sendall(post_raw({"text": SENTENCE, "format": "pcm"}))
        assert read_head(sock)[0] == 200
        sock.sendall(b"\x16\x03\x01 not HTTP\r\n\r\n")
        data = _read_to_end(sock)
    # The stream whole (it ends with its last chunk), then the refusal.
    stream, refusal = data.split(b"\r\n0\r\n\r\nHTTP/1.1 400 ")
    assert len(stream) > 22050 and b"HTTP/1.1" not in stream and b"bad_request" in refusal
