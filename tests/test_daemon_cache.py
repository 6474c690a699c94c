"""The audio cache inside the real daemon: hits, restarts after kill -9, invalidation, singleflight,
warm-up and the administrative routes' peer check (SO_PEERCRED)."""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import (
    LONG_TEXT,
    MEDIUM,
    OTHER_VOICE,
    Daemon,
    Reply,
    edgectl,
    install_as,
    other_voice,
    post_raw,
    read_head,
    wait_for,
)


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory, bundle_dir: Path) -> Iterator[Daemon]:
    """A daemon of this module's own: its tests clear the cache, which others must not see."""
    with Daemon(tmp_path_factory.mktemp("cached")) as running:
        yield running


def _synth(daemon: Daemon, text: str, **extra: object) -> Reply:
    reply = daemon.request("POST", "/v1/synthesize", {"text": text, "format": "pcm", **extra})
    assert reply.status == 200, reply.body[:300]
    return reply


def _flushed(daemon: Daemon) -> dict:
    """Status once every finished synthesis has reached the disk tier."""
    return wait_for(lambda: (c := daemon.status()["cache"])["write_queue_bytes"] == 0
                    and c["in_flight"] == 0 and c)


def test_second_identical_request_is_a_byte_identical_hit(cached: Daemon) -> None:
    first = _synth(cached, "A phrase for the cache test.")
    again = _synth(cached, "A phrase for the cache test.  ")  # spaces at its end do not count
    assert first.headers["x-edged-cache"] == "miss" and again.headers["x-edged-cache"] == "hit"
    assert again.body == first.body and len(first.body) > 22050
    wav = cached.request("POST", "/v1/synthesize", {"text": "A phrase for the cache test."})
    assert wav.headers["x-edged-cache"] == "hit"  # wav and pcm share the entry: the header is added on the way out
    assert wav.body[:4] == b"RIFF" and wav.body[44:] == first.body
    riff_size, = struct.unpack("<I", wav.body[4:8])
    data_size, = struct.unpack("<I", wav.body[40:44])  # a hit knows its length: no streaming header
    assert data_size == len(first.body) and riff_size == 36 + len(first.body)
    slower = _synth(cached, "A phrase for the cache test.", speed=0.8)
    assert slower.headers["x-edged-cache"] == "miss"  # the speed is part of the key


def test_bad_tag_is_refused(cached: Daemon) -> None:
    for tag in ("x" * 65, "line\nbreak", 5):
        reply = cached.request("POST", "/v1/synthesize", {"text": "Hi.", "tag": tag})
        assert reply.status == 400 and "tag" in reply.json()["error"]["message"]


def test_delete_by_tag_and_by_voice_makes_the_next_request_a_miss(cached: Daemon) -> None:
    _synth(cached, "Tagged one.", tag="promo")
    _synth(cached, "Untagged one.")
    assert _synth(cached, "Tagged one.").headers["x-edged-cache"] == "hit"
    dropped = cached.request("DELETE", "/v1/cache?tag=promo")
    assert dropped.status == 200 and dropped.json()["memory_dropped"] == 1
    assert dropped.json()["disk_swept"] is False  # a tag's files cannot be found: stale until read
    assert _synth(cached, "Tagged one.").headers["x-edged-cache"] == "miss"
    assert _synth(cached, "Untagged one.").headers["x-edged-cache"] == "hit"  # another tag: kept

    voice = cached.get("/v1/voices").json()["default"]
    # A voice and a tag: only that tag's audio of that voice (it was all the voice's audio).
    _synth(cached, "Tagged two.", tag="promo")
    neither = cached.request("DELETE", f"/v1/cache?voice={voice}&tag=nosuchtag")
    assert neither.status == 200 and neither.json()["memory_dropped"] == 0
    assert _synth(cached, "Untagged one.").headers["x-edged-cache"] == "hit"
    both = cached.request("DELETE", f"/v1/cache?voice={voice}&tag=promo")
    assert both.status == 200 and both.json()["memory_dropped"] == 1
    assert _synth(cached, "Tagged two.", tag="promo").headers["x-edged-cache"] == "miss"
    assert _synth(cached, "Untagged one.").headers["x-edged-cache"] == "hit"

    dropped = cached.request("DELETE", "/v1/cache", {"voice": voice})
    assert dropped.status == 200 and dropped.json()["scope"]["voice"] == voice
    assert dropped.json()["memory_dropped"] >= 2
    assert _synth(cached, "Untagged one.").headers["x-edged-cache"] == "miss"
    other = cached.request("DELETE", "/v1/cache", {"voice": "xx_XX-nobody"})
    assert other.status == 200 and other.json()["memory_dropped"] == 0
    assert _synth(cached, "Untagged one.").headers["x-edged-cache"] == "hit"
    bad = cached.request("DELETE", "/v1/cache?version=1.0.0")
    assert bad.status == 400
    # An empty or unusable filter is refused, not read as "everything".
    for bad_request in (("/v1/cache?voice=", None), ("/v1/cache?tag=", None), ("/v1/cache", {"tag": ""}),
                        ("/v1/cache", '{"voice": "\\ud800"}'), ("/v1/cache", {"version": "v\n1", "voice": voice}),
                        ("/v1/cache?tag=%ff%fe", None),  # not UTF-8: refused, not mangled into U+FFFD
                        ("/v1/cache?tag=%zz", None), ("/v1/cache?voice=a%", None),  # no escape: not taken as it is
                        ("/v1/cache?voice=x", {"voice": None}), ("/v1/cache", {"tag": None}),  # null: not "all"
                        ("/v1/cache?tag=a&tag=b", None),  # which one?
                        ("/v1/cache?voice=x", {"tag": "y"})):  # query and body: one would override
        bad = cached.request("DELETE", *bad_request)
        assert bad.status == 400 and bad.json()["error"]["code"] == "bad_request", bad_request
    assert _synth(cached, "Untagged one.").headers["x-edged-cache"] == "hit"  # nothing was dropped


def test_concurrent_identical_requests_are_synthesized_once(cached: Daemon) -> None:
    text = f"{MEDIUM} Said only once."
    before = cached.status()
    replies: list[Reply] = []
    threads = [threading.Thread(target=lambda: replies.append(_synth(cached, text))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    after = cached.status()
    assert len(replies) == 4 and len({r.body for r in replies}) == 1
    assert after["synthesis"]["completed"] - before["synthesis"]["completed"] == 1
    joined = after["cache"]["joined"] - before["cache"]["joined"]
    hits = sum(r.headers["x-edged-cache"] == "hit" for r in replies)
    assert joined + hits == 3
    assert "edged_cache_joined_total" in cached.get("/metrics").body.decode()


def test_warm_up_fills_the_cache_and_reports_progress(cached: Daemon) -> None:
    phrases = ["Warm phrase one.", {"text": "Warm phrase two."}, "?!"]
    lookups = ("memory_hits", "memory_misses", "disk_hits", "disk_misses", "joined")
    before = cached.status()["cache"]
    reply = cached.request("POST", "/v1/cache/warm", {"phrases": phrases})
    assert reply.status == 202 and reply.json()["queued"] == 3
    target = reply.json()["warm"]["total"]
    wait_for(lambda: cached.status()["cache"]["warm"]["done"] >= target, timeout=30)
    warmed = cached.status()["cache"]
    # The hit ratio is the requests': warm-up's own lookups are not counted in it.
    assert {k: warmed[k] for k in lookups} == {k: before[k] for k in lookups}
    assert warmed["warm"]["synthesized"] - before["warm"]["synthesized"] == 2
    assert warmed["warm"]["empty"] - before["warm"]["empty"] == 1  # "?!": nothing to say, nothing stored
    for text in ("Warm phrase one.", "Warm phrase two."):
        assert _synth(cached, text).headers["x-edged-cache"] == "hit"
    assert cached.status()["cache"]["memory_hits"] == warmed["memory_hits"] + 2
    metrics = cached.get("/metrics").body.decode()
    assert f"edged_cache_warm_done_total {float(target)}" in metrics  # counters: they only go up
    assert f"edged_cache_warm_requested_total {float(target)}" in metrics
    assert f"edged_cache_warm_synthesized_total {float(warmed['warm']['synthesized'])}" in metrics
    assert 'edged_cache_lookups_total{result="hit",tier="memory"}' in metrics
    unknown = cached.request("POST", "/v1/cache/warm", '["fine", {"text": "x", "voice": "xx_XX-nobody"}, '
                             '{"text": "y", "voice": "xx_XX-nobody"}, {"text": "z", "voice": "yy_YY-nobody"}]')
    assert unknown.status == 404
    message = unknown.json()["error"]["message"]  # each unknown voice named once, in one answer
    assert message.startswith("phrase 1: unknown voice 'xx_XX-nobody'") and "'yy_YY-nobody' (phrase 3)" in message
    assert message.count("xx_XX-nobody") == 1
    nothing = cached.request("POST", "/v1/cache/warm", '["fine", "\\u0000"]')  # refused now, not failed later
    assert nothing.status == 400 and nothing.json()["error"]["message"] == "phrase 1: field 'text' is empty"
    aside = cached.request("POST", "/v1/cache/warm?voice=xx_XX-nobody", '["fine"]')  # not ignored: refused
    assert aside.status == 400 and "query" in aside.json()["error"]["message"]


def test_a_request_for_a_phrase_being_warmed_does_not_wait_behind_live_work(cached: Daemon) -> None:
    # A live synthesis that stays about: its client asks for minutes of audio and never reads them.
    stalled = cached.connect()
    stalled.sendall(post_raw({"text": LONG_TEXT, "format": "pcm"}))
    try:
        wait_for(lambda: cached.status()["admission"]["active"] == 1)
        phrase = "Warmed while another client holds a synthesis."
        assert cached.request("POST", "/v1/cache/warm", {"phrases": [phrase]}).status == 202
        wait_for(lambda: cached.status()["cache"]["in_flight"] == 2)  # the warm-up waits its turn
        assert _synth(cached, phrase).headers["x-edged-cache"] == "miss"  # joined the warm-up
        status = cached.status()
        assert status["admission"]["active"] == 1  # answered while the other synthesis is still about
        assert status["synthesis"]["background_promoted"] >= 1
    finally:
        stalled.close()


def test_a_warm_up_is_background_work_again_once_the_live_request_that_joined_it_left(
        tmp_path: Path, bundle_dir: Path) -> None:
    # Promoted for the live request that joined it, it must yield to live work again when that
    # request leaves: the next live request stops its run in flight (background_preempted).
    with Daemon(tmp_path / "d") as daemon:
        assert daemon.request("POST", "/v1/cache/warm", {"phrases": [LONG_TEXT]}).status == 202
        wait_for(lambda: daemon.status()["cache"]["in_flight"] == 1)
        with daemon.connect() as joined:
            joined.sendall(post_raw({"text": LONG_TEXT, "format": "pcm"}))
            assert read_head(joined)[0] == 200
            assert daemon.status()["synthesis"]["background_promoted"] == 1  # it joined the warm-up
        wait_for(lambda: daemon.status()["admission"]["active"] == 0)  # the hang-up was seen
        stopped = daemon.status()["synthesis"]["background_preempted"]
        # A live request stops the warm-up's run if one is in flight as it comes (not between two).
        for attempt in range(5):
            _synth(daemon, f"Live request number {attempt + 1} after the listener left.")
            if daemon.status()["synthesis"]["background_preempted"] > stopped:
                break
        else:
            pytest.fail("the warm-up was never stopped for live requests: it stayed promoted")
        assert daemon.status()["cache"]["warm"]["done"] == 0  # still under way
        warm = wait_for(lambda: (w := daemon.status()["cache"]["warm"])["done"] == 1 and w, timeout=60)
        assert warm["synthesized"] == 1


def test_a_warm_up_that_joined_a_refused_live_request_waits_its_turn(tmp_path: Path, bundle_dir: Path) -> None:
    config = "[pipeline]\nmax_active = 1\nqueue_timeout_s = 0.5\n"
    with Daemon(tmp_path / "d", config) as daemon:
        holder = daemon.connect()  # holds the only slot, and never reads
        holder.sendall(post_raw({"text": LONG_TEXT, "format": "pcm"}))
        phrase = "Warmed after a refused live request."
        try:
            wait_for(lambda: daemon.status()["admission"]["active"] == 1)
            queued = daemon.connect()
            queued.sendall(post_raw({"text": phrase}))
            wait_for(lambda: daemon.status()["admission"]["waiting"] == 1)
            assert daemon.request("POST", "/v1/cache/warm", {"phrases": [phrase]}).status == 202
            assert read_head(queued)[0] == 503  # no slot within 0.5 s; the warm-up had joined it
            queued.close()
        finally:
            holder.close()
        warm = wait_for(lambda: (w := daemon.status()["cache"]["warm"])["done"] == 1 and w, timeout=30)
        assert warm["synthesized"] == 1 and warm["failed"] == 0
        assert _synth(daemon, phrase).headers["x-edged-cache"] == "hit"


def test_status_has_a_cache_block(cached: Daemon) -> None:
    block = cached.status()["cache"]
    assert block["open"] and block["disk_state"] == "ok"
    assert Path(block["directory"]) == cached.cache_dir


def test_hit_after_kill_9_and_restart_needs_no_voice(tmp_path: Path, bundle_dir: Path) -> None:
    # The other voice is loaded on demand only, and a request may wait 1 ms for it: a miss gets 503.
    voices = other_voice(tmp_path, bundle_dir)
    config = f'[pipeline]\nloading_wait_s = 0.001\n[voices]\nsearch_path = ["{voices}"]\n'
    text = "Served from disk after a crash."
    first = Daemon(tmp_path / "d", config).start()
    try:
        first.wait_state("READY")
        body = {"text": text, "voice": OTHER_VOICE, "format": "pcm"}
        wait_for(lambda: first.request("POST", "/v1/synthesize", body).status == 200, timeout=30, interval=0.2)
        original = first.request("POST", "/v1/synthesize", body)
        assert original.headers["x-edged-cache"] == "hit"
        assert _flushed(first)["disk_entries"] >= 1
    finally:
        assert first.proc is not None
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
    with Daemon(tmp_path / "d", config) as second:
        reply = second.request("POST", "/v1/synthesize", body)
        assert reply.status == 200 and reply.headers["x-edged-cache"] == "hit"
        assert reply.body == original.body
        states = {v["id"]: v["state"] for v in second.get("/v1/voices").json()["voices"]}
        assert states[OTHER_VOICE] == "installed"  # never loaded: the hit did not need it
        miss = second.request("POST", "/v1/synthesize", {**body, "text": "Not cached."})
        assert miss.status == 503 and miss.json()["error"]["code"] == "not_ready"


def test_the_same_voice_at_another_precision_is_not_served_from_the_cache(tmp_path: Path, bundle_dir: Path) -> None:
    text = "Cached at one precision."
    with Daemon(tmp_path / "d", '[voices]\nprecision = "int8"\n') as first:
        int8 = _synth(first, text)
        assert _flushed(first)["disk_entries"] >= 1
    with Daemon(tmp_path / "d", '[voices]\nprecision = "fp32"\n') as second:
        fp32 = _synth(second, text)
        assert fp32.headers["x-edged-cache"] == "miss" and fp32.body != int8.body
        assert _synth(second, text).headers["x-edged-cache"] == "hit"


def test_configured_warm_file_is_warmed_at_start(tmp_path: Path, bundle_dir: Path) -> None:
    phrases = tmp_path / "phrases.txt"
    # The third phrase is over the API's text limit (50 characters here): refused, not spoken.
    # Written with a BOM, as some editors do: it was part of the first phrase's key.
    phrases.write_text("Warmed at start.\nAlso warmed at start.\n" + "Far too long. " * 10 + "\n", encoding="utf-8-sig")
    config = f'[cache]\nwarm_file = "{phrases}"\n[limits]\nmax_text_chars = 50\nmax_body_bytes = 4096\n'
    with Daemon(tmp_path / "d", config) as daemon:
        warm = wait_for(lambda: (w := daemon.status()["cache"]["warm"])["done"] == 3 and w, timeout=30)
        assert warm == {"total": 3, "done": 3, "synthesized": 2, "empty": 0, "failed": 1}
        assert _synth(daemon, "Warmed at start.").headers["x-edged-cache"] == "hit"
        assert _synth(daemon, "Also warmed at start.").headers["x-edged-cache"] == "hit"
        assert "over the limit of 50" in daemon.log_text()


def test_a_warm_up_phrase_too_long_to_cache_is_given_up_not_counted_as_warmed(tmp_path: Path, bundle_dir: Path) -> None:
    # It was synthesized to its end for nothing, and counted as synthesized.
    config = "[cache]\nmax_entry_bytes = 100000\n"  # ~2 s of audio
    with Daemon(tmp_path / "d", config) as daemon:
        reply = daemon.request("POST", "/v1/cache/warm", {"phrases": [MEDIUM]})
        assert reply.status == 202
        warm = wait_for(lambda: (w := daemon.status()["cache"]["warm"])["done"] == 1 and w, timeout=30)
        assert (warm["synthesized"], warm["failed"]) == (0, 1)
        assert "will not be stored" in daemon.log_text()


def test_a_warm_up_does_not_keep_a_live_synthesis_going_once_its_listener_left(
        tmp_path: Path, bundle_dir: Path) -> None:
    # The warm-up joined a live request's synthesis of the same text; when that client hung up,
    # the synthesis went on for the warm-up alone, in the live request's slot and with its
    # priority: a new live request waited for all of it (or got 503 after the queue timeout).
    # A queue timeout far under the long text's synthesis: were its slot kept, the next request
    # would get 503.
    config = "[pipeline]\nmax_active = 1\nqueue_timeout_s = 1.5\n"
    with Daemon(tmp_path / "d", config) as daemon:
        with daemon.connect() as first:
            first.sendall(post_raw({"text": LONG_TEXT, "format": "pcm"}))
            status, _ = read_head(first)
            assert status == 200
            assert daemon.request("POST", "/v1/cache/warm", {"phrases": [LONG_TEXT]}).status == 202
            # The warm-up joins the synthesis under way if it comes in time (tests/test_cache.py
            # checks the joined case itself); either way the slot must not stay taken.
            time.sleep(0.3)
        reply = daemon.request("POST", "/v1/synthesize", {"text": "Hello.", "format": "pcm"})
        assert reply.status == 200
        # The warm-up asks again, with a synthesis of its own in the background.
        warm = wait_for(lambda: (w := daemon.status()["cache"]["warm"])["done"] == 1 and w, timeout=60)
        assert warm["synthesized"] == 1


def test_a_phrase_warmed_twice_does_not_cut_a_live_listener(tmp_path: Path, bundle_dir: Path) -> None:
    # The first warm-up gave up its synthesis (too long to cache) to the live request that joined
    # it; the second made its own. When the first ended, it removed the second's record, failed
    # with a KeyError, and the live listener's answer broke off.
    config = "[cache]\nmax_entry_bytes = 1000000\n"
    with Daemon(tmp_path / "d", config) as daemon:
        assert daemon.request("POST", "/v1/cache/warm", {"phrases": [LONG_TEXT, LONG_TEXT]}).status == 202
        reply = daemon.request("POST", "/v1/synthesize", {"text": LONG_TEXT, "format": "pcm"}, timeout=120)
        assert reply.status == 200 and len(reply.body) > 4_000_000
        warm = wait_for(lambda: (w := daemon.status()["cache"]["warm"])["done"] == 2 and w, timeout=60)
        assert warm["failed"] == 2 and warm["synthesized"] == 0
        assert "Traceback" not in daemon.log_text()


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_warm_file_that_is_no_regular_file_is_refused_at_start(tmp_path: Path, bundle_dir: Path,
                                                                 kind: str) -> None:
    # A FIFO blocked start-up for good (no READY, no SIGTERM); /dev/zero filled memory; a
    # directory was reported as "Is a directory: 12" (the descriptor, not the path).
    path = {"fifo": tmp_path / "fifo", "device": Path("/dev/zero"), "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with Daemon(tmp_path / "d", f'[cache]\nwarm_file = "{path}"\n') as daemon:
        assert daemon.status()["cache"]["warm"]["total"] == 0
        assert "not a regular file" in daemon.log_text()


@pytest.mark.parametrize("bound", ["phrases", "characters"])
def test_a_warm_file_longer_than_the_queue_is_cut_not_fatal(tmp_path: Path, bundle_dir: Path, bound: str) -> None:
    from edged.cacheservice import MAX_WARM_CHARS, MAX_WARM_QUEUE

    if bound == "phrases":
        lines, fit = [f"Phrase {i}." for i in range(MAX_WARM_QUEUE + 1)], MAX_WARM_QUEUE
    else:  # phrases as long as a request may be, more characters in all than the queue holds
        line = ("Words and more words. " * 4545).strip()
        fit = MAX_WARM_CHARS // len(line)
        lines = [line] * (fit + 10)
    phrases = tmp_path / "phrases.txt"
    phrases.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with Daemon(tmp_path / "d", f'[cache]\nwarm_file = "{phrases}"\n') as daemon:
        assert daemon.status()["cache"]["warm"]["total"] == fit
        assert f"warming the first {fit}" in daemon.log_text()


# -- administrative routes: only root or the admin group (SO_PEERCRED) ----------------------------

def _as_nobody(socket_path: Path, method: str, path: str, groups: tuple[int, ...] = ()) -> dict:
    """One request from a forked child that became uid/gid 65534, with supplementary `groups`,
    before connecting (the kernel records the peer's credentials at connect time). The interpreter cannot be exec'd as nobody
    here (its directory is private to root), hence a fork that uses only the socket module."""
    body = b'{"phrases": ["Hi."]}' if method == "POST" else b""
    raw = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
           "Connection: close\r\n\r\n").encode() + body
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, no pytest machinery
        code = 1
        try:
            os.setgroups(list(groups))
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(20)
                sock.connect(str(socket_path))
                sock.sendall(raw)
                while chunk := sock.recv(65536):
                    os.write(write_end, chunk)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    data = b""
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    head, _, rest = data.partition(b"\r\n\r\n")
    return {"status": int(head.split()[1]), "body": rest.decode(errors="replace")}


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
@pytest.mark.parametrize(("admin_group", "groups", "allowed"), [
    ("edged", (), False),
    ("nogroup", (), True),  # its primary group
    ("users", (100,), True),  # a supplementary group, as systemd's SupplementaryGroups= gives it
    ("users", (), False),
])
def test_admin_routes_need_root_or_the_admin_group(bundle_dir: Path, admin_group: str, groups: tuple[int, ...],
                                                   allowed: bool) -> None:
    # A world-reachable socket in a world-traversable directory, so that uid 65534 can connect.
    root = Path(tempfile.mkdtemp(prefix="edged-peer-"))
    try:
        root.chmod(0o755)
        config = f'[server]\nsocket_mode = 0o666\nadmin_group = "{admin_group}"\n'
        with Daemon(root, config) as daemon:
            health = _as_nobody(daemon.socket, "GET", "/v1/health")
            assert health["status"] == 200  # ordinary calls are open to whoever can connect
            for method, path in (("DELETE", "/v1/cache"), ("POST", "/v1/cache/warm")):
                answer = _as_nobody(daemon.socket, method, path, groups)
                if allowed:
                    assert answer["status"] in (200, 202), answer
                else:
                    assert answer["status"] == 403, answer
                    assert json.loads(answer["body"])["error"]["code"] == "forbidden"
            assert daemon.request("DELETE", "/v1/cache").status == 200  # root always may
            # "edged" is not a group on the test machine: said at start, not found out at a 403.
            missing = admin_group == "edged" and "edged" not in {g.gr_name for g in grp.getgrall()}
            assert ("server.admin_group 'edged' is not a group" in daemon.log_text()) == missing
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_edgectl_cache_warm_and_clear(cached: Daemon, tmp_path: Path) -> None:
    voice = cached.get("/v1/voices").json()["default"]
    phrases = tmp_path / "phrases.txt"
    phrases.write_text(f"Edgectl warm one.\n\n# a comment\n{voice}\tEdgectl warm two.\n", encoding="utf-8")
    warm = edgectl("cache", "warm", str(phrases), socket_path=cached.socket)
    assert warm.returncode == 0, warm.stderr
    assert b"2/2" in warm.stderr
    assert _synth(cached, "Edgectl warm two.").headers["x-edged-cache"] == "hit"
    clear = edgectl("cache", "clear", "--voice", voice, socket_path=cached.socket)
    assert clear.returncode == 0, clear.stderr
    # A voice's entries on disk are stale now (dropped when read); a version's are deleted at once.
    assert f"cleared voice {voice}: ".encode() in clear.stdout and b"stale on disk" in clear.stdout
    assert _synth(cached, "Edgectl warm two.").headers["x-edged-cache"] == "miss"
    version = cached.get("/v1/voices").json()["voices"][0]["version"]
    clear = edgectl("cache", "clear", "--voice", voice, "--version", version, socket_path=cached.socket)
    assert clear.returncode == 0, clear.stderr
    assert re.search(rb"\d+ deleted on disk", clear.stdout), clear.stdout


def test_a_voice_rebuilt_under_the_same_version_is_not_served_its_old_audio(tmp_path: Path, bundle_dir: Path) -> None:
    # The builder writes version 1.0.0 every time: the key holds the bundle's audio digest too.
    voices = other_voice(tmp_path, bundle_dir)
    config = f'[voices]\nsearch_path = ["{voices}"]\n'
    body = {"text": "The same words, another voice build.", "voice": OTHER_VOICE, "format": "pcm"}
    with Daemon(tmp_path / "d", config) as first:
        original = first.request("POST", "/v1/synthesize", body)
        assert original.status == 200 and first.request("POST", "/v1/synthesize", body).headers["x-edged-cache"] == "hit"
        _flushed(first)
    manifest_path = voices / OTHER_VOICE / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["inference"]["length_scale"] = 1.5  # a rebuild that speaks more slowly, same version
    manifest_path.write_text(json.dumps(manifest))
    with Daemon(tmp_path / "d", config) as second:
        rebuilt = second.request("POST", "/v1/synthesize", body)
        assert rebuilt.status == 200 and rebuilt.headers["x-edged-cache"] == "miss"
        assert len(rebuilt.body) > len(original.body) * 1.3


def test_edgectl_warms_more_than_one_request_holds_and_counts_only_its_failures(tmp_path: Path) -> None:
    # The warm file's unknown voice fails at start: that failure is not edgectl's.
    warm_file = tmp_path / "start.txt"
    warm_file.write_text("xx_XX-nobody\tNever warmed.\n", encoding="utf-8")
    with Daemon(tmp_path / "d", f'[cache]\nwarm_file = "{warm_file}"\n') as daemon:
        wait_for(lambda: daemon.status()["cache"]["warm"]["failed"] == 1)
        phrases = tmp_path / "phrases.txt"  # over the 10,000 phrases one request may carry
        phrases.write_text("A phrase warmed many times.\n" * 12_000, encoding="utf-8")
        warm = edgectl("cache", "warm", str(phrases), socket_path=daemon.socket, timeout=120)
        assert warm.returncode == 0, warm.stderr
        assert b"12000/12000 phrases, 0 failed" in warm.stderr


def test_a_voice_replaced_before_its_first_load_never_caches_under_the_old_bundle(
        tmp_path: Path, bundle_dir: Path) -> None:
    # A field update by rename after the voice was listed (its facts read) but before it loaded:
    # the audio of the new bundle must not be stored under the old bundle's key, from where a
    # rollback to the old bundle would have served it. The facts are read again once the manifest
    # changed (it was a 503 "replaced" once); a replacement between that reading and the load is
    # test_pipeline's.
    voices = tmp_path / "voices"
    old = install_as(voices, bundle_dir, "xx_XX-updated")
    new = install_as(tmp_path / "staging", bundle_dir, "xx_XX-updated")
    manifest = json.loads((new / "manifest.json").read_text())
    slower = {**manifest["inference"], "length_scale": 1.5}
    (new / "manifest.json").write_text(json.dumps({**manifest, "version": "2.0.0", "inference": slower}))
    config = f'[voices]\nsearch_path = ["{voices}"]\n'
    body = {"text": "Updated in the field.", "voice": "xx_XX-updated", "format": "pcm"}
    with Daemon(tmp_path / "d", config) as daemon:
        listed = {v["id"]: v for v in daemon.get("/v1/voices").json()["voices"]}
        assert listed["xx_XX-updated"]["version"] == "1.0.0"
        old.rename(tmp_path / "previous")
        new.rename(old)
        reply = daemon.request("POST", "/v1/synthesize", body)
        assert reply.status == 200 and reply.headers["x-edged-cache"] == "miss"
        again = daemon.request("POST", "/v1/synthesize", body)
        assert again.headers["x-edged-cache"] == "hit" and again.body == reply.body
        listed = {v["id"]: v for v in daemon.get("/v1/voices").json()["voices"]}
        assert listed["xx_XX-updated"]["version"] == "2.0.0"
    old.rename(tmp_path / "rolled-back")
    (tmp_path / "previous").rename(old)
    with Daemon(tmp_path / "d", config) as daemon:
        reply = daemon.request("POST", "/v1/synthesize", body)
        assert reply.status == 200 and reply.headers["x-edged-cache"] == "miss"
