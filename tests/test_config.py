"""Daemon settings: one tree, documented defaults, TOML and overrides, clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edged.config import (
    Settings,
    default_socket_path,
    load_settings,
    named_socket,
    override,
    socket_path,
)
from edged.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def test_packaged_config_documents_exactly_the_defaults() -> None:
    assert load_settings(REPO / "packaging" / "edged.toml", env={}) == Settings()


def test_partial_tables_keep_other_defaults(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text("[pipeline.back]\ntimeout_s = 3\n[limits]\nmax_text_chars = 500\n")
    settings = load_settings(config, env={})
    assert settings.pipeline.back.timeout_s == 3.0 and settings.pipeline.back.concurrency == 2
    assert settings.limits.max_text_chars == 500
    assert settings.pipeline.front == Settings().pipeline.front


def test_a_retired_setting_is_read_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A config file kept across an update must still start the daemon.
    config = tmp_path / "edged.toml"
    config.write_text("[pipeline.output]\nconcurrency = 16\ntimeout_s = 7\n")
    settings = load_settings(config, env={})
    assert settings.pipeline.output.timeout_s == 7.0
    assert "setting pipeline.output.concurrency is ignored" in caplog.text
    config.write_text("[pipeline.output]\nconcurency = 16\n")
    with pytest.raises(ConfigError, match="unknown setting 'pipeline.output.concurency'"):
        load_settings(config, env={})


@pytest.mark.parametrize(("text", "message"), [
    ("[pipeline]\nqueue_sise = 3\n", "unknown setting 'pipeline.queue_sise'"),
    ("[server]\ndrain_timeout_s = \"soon\"\n", "server.drain_timeout_s must be float"),
    ("[pipeline.back]\nconcurrency = 0\n", "pipeline.back.concurrency must be > 0"),
    ("[voices]\nprecision = \"fp16\"\n", "voices.precision"),
    # A path where a voice id belongs was found out only by each request (404).
    ("[openai.voice_map]\nalloy = \"../../etc\"\n", "openai.voice_map.alloy must be a voice id"),
    ("[openai]\ndefault_voice = \"/tmp/x\"\n", "openai.default_voice must be a voice id"),
    ("[voices]\npreload = [\"en US\"]\n", "voices.preload must be a voice id"),
    ("[server\n", "not valid TOML"),
    ("pipeline = 3\n", "[pipeline] must be a table"),
    ("[pipeline]\ncompute_nice = 20\n", "pipeline.compute_nice must be between 0 and 19"),
    ("[pipeline]\nqueue_size = -1\n", "pipeline.queue_size must be >= 0"),
    ("[server]\ndrain_timeout_s = nan\n", "server.drain_timeout_s must be a finite number"),
    ("[pipeline.back]\ntimeout_s = 1e-300\n", "pipeline.back.timeout_s must be at least 0.001"),
    ("[cache]\nttl_seconds = inf\n", "cache.ttl_seconds must be a finite number"),
    ("[server]\nsocket_mode = 0o7777\n", "server.socket_mode must be a file mode"),
    ("[cache]\nwrite_retry_seconds = -1\n", "[cache] write_retry_seconds must be >= 0"),
    ("[cache]\nchunk_bytes = 0\n", "[cache] chunk_bytes must be > 0"),
    ("[cache]\ndirectory = 0\n", "cache.directory must be Path"),
    ("[cache]\nttl_seconds = \"\"\n", "cache.ttl_seconds must be float"),
    ("[pipeline.back]\nconcurrency = 2000\n", "pipeline.back.concurrency must be at most 64"),  # 2,000 threads
    ("[voices]\nsearch_path = [\"voices\"]\n", "must be an absolute path"),  # relative to what?
    ("[voices]\nsearch_path = [\"\"]\n", "must be an absolute path"),
    ("[cache]\ndirectory = \"audio\"\n", "cache.directory 'audio' must be an absolute path"),  # under /
    ("[server]\nsocket = \"edged.sock\"\n", "server.socket 'edged.sock' must be an absolute path"),
    ("x = " + "[" * 500 + "]" * 500 + "\n", "nested too deeply"),  # 1 kB: a RecursionError traceback
    # Past SQLite's integers, and a NUL no path can hold: accepted, they turned the cache off later.
    ("[cache]\ndisk_bytes = 99999999999999999999999\n", "cache.disk_bytes is out of range"),
    ("[cache]\ndirectory = \"a\\u0000b\"\n", "cache.directory must not contain a NUL"),
    ("[voices]\nsearch_path = [\"/a\\u0000b\"]\n", "voices.search_path must not contain a NUL"),
    ("[openai]\nvoice_map = { Alloy = \"a\", alloy = \"b\" }\n", "differ only in case"),
    # Accepted, they made a daemon that answered everything with 431, or exited naming the voice.
    ("[limits]\nmax_header_bytes = 1\n", "limits.max_header_bytes must be at least 1024"),
    ("[voices]\nprobe_text = \"   \"\n", "voices.probe_text must have something to say"),
    ("[voices]\ndefault = \"\"\n", "voices.default must name a voice"),
])
def test_bad_config_is_refused_with_the_setting_named(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "edged.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_settings(config, env={})


def test_queue_and_arenas_are_not_bounded_like_a_niceness(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text("[pipeline]\nqueue_size = 50\n[server]\nmalloc_arenas = 32\n")
    settings = load_settings(config, env={})
    assert settings.pipeline.queue_size == 50 and settings.server.malloc_arenas == 32


def test_socket_precedence(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text('[server]\nsocket = "/from/file.sock"\n')
    assert socket_path(load_settings(config, env={})) == Path("/from/file.sock")
    env = {"EDGED_SOCKET": "/from/env.sock"}
    assert socket_path(load_settings(config, env=env)) == Path("/from/env.sock")
    assert socket_path(load_settings(config, Path("/from/flag.sock"), env=env)) == Path("/from/flag.sock")
    xdg = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    expected = "/run/edged/edged.sock" if os.geteuid() == 0 else "/run/user/1000/edged/edged.sock"
    assert default_socket_path(xdg) == Path(expected)
    assert named_socket(None, {**xdg, "EDGED_SOCKET": "/e.sock"}) == Path("/e.sock")
    assert named_socket(Path("/flag.sock"), {"EDGED_SOCKET": "/e.sock"}) == Path("/flag.sock")
    assert named_socket(None, xdg) is None
    # As cache.directory and voices.search_path: "~/x.sock" made a directory named "~" here.
    config.write_text('[server]\nsocket = "~/edged.sock"\n')
    assert socket_path(load_settings(config, env={})) == Path.home() / "edged.sock"
    assert named_socket(None, {"EDGED_SOCKET": "~/e.sock"}) == Path.home() / "e.sock"
    # Given when the daemon starts (not in a file read by a service started in /): from here.
    assert socket_path(load_settings(None, Path("flag.sock"), env={})) == Path.cwd() / "flag.sock"
    assert socket_path(load_settings(None, env={"EDGED_SOCKET": "env.sock"})) == Path.cwd() / "env.sock"


def test_override_by_dotted_name() -> None:
    settings = override(Settings(), "pipeline.output.timeout_s", 1.5)
    assert settings.pipeline.output.timeout_s == 1.5
    with pytest.raises(ConfigError, match="unknown setting"):
        override(Settings(), "pipeline.nothing", 1)


def test_empty_optional_settings_mean_none_and_a_cache_directory_may_start_with_a_tilde(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text('[cache]\nttl_seconds = 0\ndirectory = ""\n')
    settings = load_settings(config, env={})
    assert settings.cache.ttl_seconds is None and settings.cache.directory is None
    config.write_text('[cache]\ndirectory = "~/audio-cache"\n')
    assert load_settings(config, env={}).cache.resolved_directory() == Path.home() / "audio-cache"


def test_a_config_file_may_start_with_a_byte_order_mark(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_bytes("\ufeff[pipeline]\nqueue_size = 3\n".encode())
    assert load_settings(config, env={}).pipeline.queue_size == 3


def test_a_search_path_may_start_with_a_tilde(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text('[voices]\nsearch_path = ["~/voices"]\n')
    assert load_settings(config, env={}).voices.search_path == ["~/voices"]


def test_a_config_without_end_is_refused_past_a_bound(tmp_path: Path) -> None:
    # --config /dev/zero read until memory ran out.
    with pytest.raises(ConfigError, match="is over 1048576 bytes"):
        load_settings(Path("/dev/zero"), env={})


def test_a_user_daemon_takes_an_absolute_runtime_directory_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # A relative $XDG_RUNTIME_DIR (invalid, by the XDG spec) put the socket under the working directory.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # as a user: root ignores $XDG_RUNTIME_DIR
    assert default_socket_path({"XDG_RUNTIME_DIR": "/run/user/1000"}) == Path("/run/user/1000/edged/edged.sock")
    assert default_socket_path({"XDG_RUNTIME_DIR": "run/user"}) == Path("/run/edged/edged.sock")
