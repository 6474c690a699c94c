"""`edged synth` as a user runs it: a real process, a real WAV file, PCM on stdout."""

from __future__ import annotations

import json
import os
import pty
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from daemon_harness import as_user_without_override, edgectl

from edged.cliio import MAX_TEXT_CHARS


def _edged(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edged", *args], input=stdin, capture_output=True,
                          timeout=120)


def test_synth_writes_a_wav_file(tmp_path: Path, bundle_dir: Path) -> None:
    out = tmp_path / "out.wav"
    result = _edged("synth", "Hello from edged.", "--voice", str(bundle_dir), "-o", str(out))
    assert result.returncode == 0, result.stderr
    with wave.open(str(out)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 22050)
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    assert 0.5 < len(samples) / 22050 < 3.0
    assert np.abs(samples).max() > 3000  # speech, not silence


def test_synth_does_not_replace_a_file_it_may_not_write(tmp_path: Path, bundle_dir: Path) -> None:
    # The audio goes in by a rename, which the directory allowed: a read-only file (another
    # user's, too) was replaced, where `>` says "Permission denied".
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    kept = shared / "kept.wav"
    kept.write_bytes(b"precious")
    kept.chmod(0o444)
    if os.geteuid() == 0:
        os.chown(kept, 65534, 65534)
    command = as_user_without_override([sys.executable, "-m", "edged", "synth", "Hello.", "--voice",
                                        str(bundle_dir), "-o", str(kept)])
    result = subprocess.run(command, capture_output=True, timeout=120, check=False)
    assert result.returncode == 2 and b"Permission denied" in result.stderr, result.stderr
    assert kept.read_bytes() == b"precious" and os.listdir(shared) == ["kept.wav"]


def test_synth_raw_does_not_write_audio_to_a_terminal(bundle_dir: Path) -> None:
    leader, follower = pty.openpty()
    try:
        result = subprocess.run([sys.executable, "-m", "edged", "synth", "Hi.", "--raw", "--voice", str(bundle_dir)],
                                stdout=follower, stderr=subprocess.PIPE, timeout=120, check=False)
    finally:
        os.close(leader)
        os.close(follower)
    assert result.returncode == 2 and b"not writing audio to a terminal" in result.stderr, result.stderr


def test_synth_raw_reads_stdin_and_streams_pcm(bundle_dir: Path) -> None:
    result = _edged("synth", "-", "--raw", "--voice", str(bundle_dir), stdin="Good morning.".encode())
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) % 2 == 0 and len(result.stdout) > 22050


def test_synth_rejects_bad_utf8_on_stdin(bundle_dir: Path) -> None:
    result = _edged("synth", "-", "--raw", "--voice", str(bundle_dir), stdin=b"caf\xe9 \xff")
    assert result.returncode == 2
    assert b"not valid UTF-8" in result.stderr and result.stdout == b""


def test_synth_reads_no_more_of_stdin_than_the_longest_text(bundle_dir: Path) -> None:
    # `yes | edged synth -` once read until memory ran out; now it stops past MAX_TEXT_CHARS.
    with subprocess.Popen([sys.executable, "-m", "edged", "synth", "-", "--raw", "--voice", str(bundle_dir)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0) as proc:
        assert proc.stdin is not None and proc.stderr is not None
        block = b"hello " * 100_000
        stopped_reading = False
        try:
            for _ in range(2 * 4 * MAX_TEXT_CHARS // len(block)):  # twice the most it may read
                proc.stdin.write(block)
        except BrokenPipeError:
            stopped_reading = True
        proc.stdin.close()  # unbuffered: nothing left to write
        assert stopped_reading
        assert proc.wait(timeout=60) == 2
        assert f"longer than {MAX_TEXT_CHARS} characters".encode() in proc.stderr.read()


def test_synth_rejects_bad_utf8_in_its_argument(bundle_dir: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "edged", "synth", b"caf\xe9", "--raw", "--voice", str(bundle_dir)],
                            capture_output=True, timeout=120, check=False)
    assert result.returncode == 2 and b"not valid UTF-8" in result.stderr and result.stdout == b""


def test_synth_names_an_unknown_voice(tmp_path: Path, bundle_dir: Path) -> None:
    result = _edged("synth", "Hi.", "--voice", "no-such-voice", "-o", str(tmp_path / "x.wav"))
    assert result.returncode == 2
    assert b"unknown voice 'no-such-voice'" in result.stderr


def test_an_empty_voice_is_the_default_as_the_daemon_takes_it(tmp_path: Path, bundle_dir: Path) -> None:
    # Not "the current directory", even where that holds a bundle: this one is not the default.
    elsewhere = tmp_path / "other-voice"
    shutil.copytree(bundle_dir, elsewhere)
    manifest = json.loads((elsewhere / "manifest.json").read_text())
    (elsewhere / "manifest.json").write_text(json.dumps({**manifest, "sample_rate": 16000}))
    out = tmp_path / "x.wav"
    result = subprocess.run([sys.executable, "-m", "edged", "synth", "Hi.", "--voice", "", "-o", str(out)],
                            cwd=elsewhere, capture_output=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 22050 and wav.getnframes() > 0


def test_synth_leaves_no_onnxruntime_telemetry_behind(tmp_path: Path, bundle_dir: Path) -> None:
    # onnxruntime wrote a device id and a telemetry database under $XDG_CACHE_HOME at import.
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    env.update(HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-m", "edged", "synth", "Hi.", "--raw", "--voice", str(bundle_dir)],
                            capture_output=True, timeout=120, check=False, env=env)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "home").exists()


def test_synth_refuses_raw_and_a_file_at_once(tmp_path: Path, bundle_dir: Path) -> None:
    # -o was ignored without a word: the PCM went to stdout and no file was written.
    result = _edged("synth", "Hi.", "--raw", "-o", str(tmp_path / "x.wav"), "--voice", str(bundle_dir))
    assert result.returncode == 2 and b"not both" in result.stderr and result.stdout == b""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", [b"  ", b"\0 \0"])  # a NUL is read as a space: it was empty audio
def test_synth_refuses_empty_text(tmp_path: Path, bundle_dir: Path, text: bytes) -> None:
    result = _edged("synth", "-", "--voice", str(bundle_dir), "-o", str(tmp_path / "x.wav"), stdin=text)
    assert result.returncode == 2 and b"text is empty" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_synth_writes_into_a_fifo_in_place_and_through_a_symlink(tmp_path: Path, bundle_dir: Path) -> None:
    # Renaming a finished file over the target would replace a device or FIFO (-o /dev/null as
    # root) and a symlink: they are written in place, or through.
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    result = _edged("synth", "Into a pipe.", "--voice", str(bundle_dir), "-o", str(fifo))
    reader.join(60)
    assert result.returncode == 0, result.stderr
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert received[0][:4] == b"RIFF" and len(received[0]) > 22050
    real = tmp_path / "real.wav"
    link = tmp_path / "link.wav"
    link.symlink_to(real)
    result = _edged("synth", "Through a link.", "--voice", str(bundle_dir), "-o", str(link))
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and real.read_bytes()[:4] == b"RIFF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.wav", "pipe", "real.wav"]


def test_synth_names_an_output_it_cannot_write(tmp_path: Path, bundle_dir: Path) -> None:
    for target, message in ((tmp_path, b"is a directory"), (tmp_path / "none" / "x.wav", b"no directory")):
        result = _edged("synth", "Hi.", "--voice", str(bundle_dir), "-o", str(target))
        assert result.returncode == 2 and message in result.stderr and b"Traceback" not in result.stderr
    # A symlink loop was taken for a missing file and replaced by the audio.
    loop = tmp_path / "loop.wav"
    loop.symlink_to(loop)
    result = _edged("synth", "Hi.", "--voice", str(bundle_dir), "-o", str(loop))
    assert result.returncode == 2 and b"Too many levels of symbolic links" in result.stderr, result.stderr
    assert loop.is_symlink()
    # Names too long for the system were a traceback (from a check meant to refuse in time).
    for target in (tmp_path / ("a" * 300 + ".wav"), tmp_path / ("a" * 300) / "x.wav"):
        result = _edged("synth", "Hi.", "--voice", str(bundle_dir), "-o", str(target))
        assert result.returncode == 2 and b"File name too long" in result.stderr, result.stderr
    with open("/dev/full", "wb") as full:
        result = subprocess.run([sys.executable, "-m", "edged", "synth", "Hi.", "--raw", "--voice", str(bundle_dir)],
                                stdout=full, stderr=subprocess.PIPE, timeout=120, check=False)
    assert result.returncode == 2 and b"cannot write standard output" in result.stderr


@pytest.mark.parametrize("program", ["edged", "edgectl"])
def test_a_name_ending_in_a_slash_does_not_replace_the_file_before_it(tmp_path: Path, bundle_dir: Path,
                                                                      program: str) -> None:
    # Path("kept.wav/") is Path("kept.wav"): the audio replaced the file, where `>` says "Is a directory".
    kept = tmp_path / "kept.wav"
    kept.write_bytes(b"precious")
    for target in (f"{kept}/", f"{kept}/.", f"{tmp_path}/new.wav/"):
        if program == "edged":
            result = _edged("synth", "Hi.", "--voice", str(bundle_dir), "-o", target)
        else:  # refused before any daemon is asked
            result = edgectl("synth", "Hi.", "-o", target, socket_path=tmp_path / "none.sock")
        assert result.returncode == 2 and b"names a directory" in result.stderr, result.stderr
    assert kept.read_bytes() == b"precious" and os.listdir(tmp_path) == ["kept.wav"]


def test_serve_is_the_default_command_and_takes_its_options(tmp_path: Path) -> None:
    from edged.cli import with_default_command

    result = _edged("--config", str(tmp_path / "missing.toml"))  # parsed as serve's option
    assert result.returncode == 2 and b"cannot read config" in result.stderr
    assert with_default_command(["-v", "--socket", "s"]) == ["-v", "serve", "--socket", "s"]
    assert with_default_command([]) == ["serve"]
    assert with_default_command(["synth", "serve"]) == ["synth", "serve"]


def test_empty_path_options_mean_their_defaults() -> None:
    from edged.cli import build_parser

    # --config "" was opened as the current directory ("Is a directory").
    args = build_parser().parse_args(["serve", "--config", "", "--socket", ""])
    assert args.config is None and args.socket is None


@pytest.mark.parametrize("name", ["/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"])
def test_synth_to_dev_stdout_writes_where_it_points_without_replacing_it(tmp_path: Path, bundle_dir: Path,
                                                                         name: str) -> None:
    # The shell opened the file to append after other output: ours must follow it, untouched.
    out = tmp_path / "log.bin"
    out.write_bytes(b"PREFIX")
    with open(out, "ab") as appended:
        result = subprocess.run([sys.executable, "-m", "edged", "synth", "Hi.", "--voice", str(bundle_dir),
                                 "-o", name], stdout=appended, stderr=subprocess.PIPE, timeout=120,
                                check=False)
    assert result.returncode == 0, result.stderr
    data = out.read_bytes()
    assert data.startswith(b"PREFIXRIFF") and len(data) > 10_000


def test_a_wav_too_long_for_its_header_keeps_the_streaming_sizes(tmp_path: Path, capsys) -> None:
    # Past 4 GiB of audio (~27 h) the sizes do not fit the header's 32-bit fields: the file is
    # kept, with the streaming header's sizes, rather than lost to an error after hours of work.
    from edged.cliio import open_output
    from edged.wav import wav_header

    out = tmp_path / "long.wav"
    with open_output(out) as output:
        output.write(wav_header(22050) + b"\0" * 100)
        output.written = 44 + 2**32  # as after 4 GiB of audio, without writing them here
        output.finish_wav()
    assert out.read_bytes()[:44] == wav_header(22050)
    assert "too long for a WAV header" in capsys.readouterr().err


def test_the_longest_name_a_file_may_have_is_written(tmp_path: Path, bundle_dir: Path) -> None:
    # The file written before it takes the target's place was named after it, 15 bytes longer:
    # a legal name of 241-255 bytes could not be written.
    target = tmp_path / ("a" * 251 + ".wav")
    result = _edged("synth", "Hi.", "--voice", str(bundle_dir), "-o", str(target))
    assert result.returncode == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == [target.name] and target.read_bytes()[:4] == b"RIFF"


def test_an_output_that_cannot_take_the_targets_place_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    # os.replace refused (another user's file in a sticky /tmp; here: the target became a
    # directory while the audio was written).
    from edged.cliio import OutputError, open_output

    out = tmp_path / "x.wav"
    with pytest.raises(OutputError, match="cannot write"), open_output(out) as output:
        output.write(b"RIFF")
        out.mkdir()
        (out / "inside").touch()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.wav"]


LONGER = "This sentence goes on for a while, clause after clause, so that two runs overlap in time. " * 3


def _whole_wav(path: Path) -> int:
    """Frames of a WAV file whose header sizes match the file (not two audios mixed)."""
    with wave.open(str(path)) as wav:
        frames = wav.getnframes()
    assert 44 + 2 * frames == path.stat().st_size
    return frames


def test_two_runs_writing_one_file_leave_one_whole_wav(tmp_path: Path, bundle_dir: Path) -> None:
    # Both used to write one `out.wav.part`: a traceback, and a file of two audios mixed.
    out = tmp_path / "same.wav"
    runs = [subprocess.Popen([sys.executable, "-m", "edged", "synth", text, "--voice", str(bundle_dir), "-o", str(out)],
                             stderr=subprocess.PIPE) for text in (LONGER, "Other text. " + LONGER)]
    for run in runs:
        _, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, stderr
    assert _whole_wav(out) > 22050
    assert [p.name for p in tmp_path.iterdir()] == ["same.wav"]


def test_the_file_written_is_new_and_keeps_the_targets_mode(tmp_path: Path, bundle_dir: Path) -> None:
    # A symlink planted where the old code made its temporary file was followed, its target overwritten.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "s.wav.part").symlink_to(victim)
    private = tmp_path / "s.wav"
    private.write_bytes(b"")
    private.chmod(0o600)
    result = _edged("synth", "Secret.", "--voice", str(bundle_dir), "-o", str(private))
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "precious" and _whole_wav(private) > 0
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    fresh = tmp_path / "new.wav"
    assert _edged("synth", "New.", "--voice", str(bundle_dir), "-o", str(fresh)).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask


def test_a_full_device_is_one_line_of_error(tmp_path: Path, bundle_dir: Path) -> None:
    result = _edged("synth", "Hello.", "--voice", str(bundle_dir), "-o", "/dev/full")
    assert result.returncode == 2 and b"No space left" in result.stderr
    assert b"Traceback" not in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_leaves_no_partial_file(tmp_path: Path, bundle_dir: Path, signum: int) -> None:
    out = tmp_path / "cut.wav"
    # Its default action, whatever this run inherited: under nohup the command keeps SIGHUP ignored.
    run = subprocess.Popen([sys.executable, "-m", "edged", "synth", LONGER * 4, "--voice", str(bundle_dir),
                            "-o", str(out)], stderr=subprocess.PIPE,
                           preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL))  # noqa: PLW1509
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".part") for p in tmp_path.iterdir()):  # writing has begun
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    run.send_signal(signum)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 128 + signum and b"Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_the_newline_that_ends_piped_text_is_not_part_of_it() -> None:
    # `echo "Your timer is done." | edgectl synth -` sent "...done.\n", which missed the cache
    # entry of the same words (a warm file's line, or the text given as an argument).
    for piped, text in ((b"Your timer is done.\n", "Your timer is done."), (b"Two lines.\r\n", "Two lines."),
                        (b"Kept.\n\n", "Kept.\n")):
        result = subprocess.run([sys.executable, "-c", "from edged.cliio import read_text; print(repr(read_text('-')))"],
                                input=piped, capture_output=True, timeout=60, check=True)
        assert result.stdout.decode().strip() == repr(text)
