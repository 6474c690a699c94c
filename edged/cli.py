"""The `edged` command: `edged serve` runs the daemon, `edged synth` speaks without one."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from . import logs
from .cliio import (
    InputError,
    Interrupted,
    OutputError,
    check_writable,
    interrupted_by_signals,
    open_output,
    output_path,
    read_text,
)
from .errors import BadInput, EdgedError


def _synth(args: argparse.Namespace) -> int:
    from .engine import EngineSettings, SynthesisParams, Voice
    from .voices import find_bundle
    from .wav import wav_header

    if args.raw and args.output is not None:
        raise BadInput("give -o FILE.wav or --raw (PCM on stdout), not both")
    output = None if args.raw else args.output
    if not args.raw and output is None:
        raise BadInput("give -o FILE.wav, or --raw for PCM on stdout")
    check_writable(output)  # before reading stdin or loading the voice
    text = read_text(args.text)
    params = SynthesisParams(speed=args.speed)
    settings = EngineSettings(precision=args.precision, fixed_shape=args.fixed_shape)
    voice = Voice.load(find_bundle(args.voice), settings)
    chunks = voice.synthesize(text, params, throughput=not args.raw)  # a WAV file is used whole
    with interrupted_by_signals(), open_output(output) as out:
        if not args.raw:
            out.write(wav_header(voice.sample_rate))
        for pcm in chunks:
            out.write(pcm)
        if not args.raw:
            out.finish_wav()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .server import serve

    return serve(config_file=args.config, socket_path=args.socket)


def build_parser() -> argparse.ArgumentParser:
    from .voices import DEFAULT_VOICE

    parser = argparse.ArgumentParser(prog="edged", description="Streaming text-to-speech daemon.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    commands = parser.add_subparsers(dest="command")

    serve = commands.add_parser("serve", help="run the daemon (the default)")
    serve.add_argument("--config", type=_path_or_default, help="TOML configuration file")
    serve.add_argument("--socket", type=_path_or_default, help="Unix socket path to listen on")
    serve.set_defaults(run=_serve)

    synth = commands.add_parser("synth", help="synthesize in this process, without a daemon")
    synth.add_argument("text", help="text to speak, or - to read it from stdin")
    synth.add_argument("-o", "--output", type=output_path, help="WAV file to write")
    synth.add_argument("--raw", action="store_true", help="16-bit PCM to stdout as it is produced")
    synth.add_argument("--voice", type=lambda text: text or DEFAULT_VOICE, default=DEFAULT_VOICE,
                       help="voice id or bundle directory")  # "": the default, as the daemon takes it
    synth.add_argument("--precision", choices=["fp32", "int8"], help="default: the bundle's choice")
    synth.add_argument("--speed", type=float, default=1.0, help="speaking rate (2.0 = twice as fast)")
    synth.add_argument("--fixed-shape", action="store_true",
                       help="decode at one window shape only, as an NPU needs (the same audio in fp32; "
                            "in int8, within its rounding)")
    synth.set_defaults(run=_synth)
    return parser


def _path_or_default(text: str) -> Path | None:
    """An empty option means its default, as an empty setting in the config file does."""
    return Path(text) if text else None


COMMANDS = ("serve", "synth")


def with_default_command(argv: list[str]) -> list[str]:
    """`edged [-v] [serve's options]` runs the daemon: "serve" is put where the command goes."""
    lead = 0
    while lead < len(argv) and argv[lead] in ("-v", "--verbose"):
        lead += 1
    if lead < len(argv) and argv[lead] in (*COMMANDS, "-h", "--help"):
        return argv
    return [*argv[:lead], "serve", *argv[lead:]]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(with_default_command(sys.argv[1:] if argv is None else argv))
    logs.setup(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return int(args.run(args))
    except (EdgedError, InputError, OutputError) as exc:
        print(f"edged: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except Interrupted as exc:
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130
