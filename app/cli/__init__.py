"""The ``cadence`` command line: models, transcribe, chat, gui.

``transcribe`` and ``chat`` run on the batched engine (:class:`engine.engine.Engine`): every file
or prompt is submitted at once, so they decode side by side, and results come back in input
order. Results go to stdout (JSON where asked); progress and timings go to stderr. A failure is
one sentence, never a traceback. Exit status: 0 all succeeded, 1 some inputs failed, 2 bad usage
or a model that cannot be loaded, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from app.cli.common import add_engine_flags, add_server_flags, err
from engine.errors import CadenceError


# ---------------------------------------------------------------- models
def cmd_models(args) -> int:
    from engine.models import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        mark = "yes" if r["available"] else "NO "
        default = " (default)" if r["default"] else ""
        print(f"{r['name']:<24} {r['family']:<8} available: {mark}  {r['source']}{default}")
        if not r["available"]:
            print(f"{'':<24} {r['detail']}")
    from engine.models import supported_chat_architectures

    print(f"\nAny local chat model (folder or GGUF file) of these architectures runs: {supported_chat_architectures()}.")
    return 0


# ---------------------------------------------------------------- gui
def cmd_gui(args) -> int:
    """``cadence gui [--check] [FILE ...]``: the same start as ``cadence-gui``, files queued at once."""
    from app.main import main as gui_main

    return gui_main([*(["--check"] if args.check else []), *args.files])


def build_parser() -> argparse.ArgumentParser:
    from engine.backend import BACKENDS
    from engine.formats import FORMATS
    from engine.models import DEFAULT_CHAT, DEFAULT_WHISPER

    parser = argparse.ArgumentParser(prog="cadence", description="Batched local transcription and chat.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("models", help="list the models and whether each is available here")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=cmd_models)

    from app.cli.chat import cmd_chat
    from app.cli.transcribe import add_transcript_flags, cmd_transcribe

    p = sub.add_parser("transcribe", help="transcribe audio or video files (folders are searched recursively)")
    p.add_argument("files", nargs="*", metavar="FILE")
    p.add_argument("--model", default=None, help=f"model name or path (default {DEFAULT_WHISPER}; with --server, "
                   "the first Whisper model it lists)")
    p.add_argument("--language", default=None, help="language code such as en or de (multilingual models detect it)")
    p.add_argument("--task", choices=("transcribe", "translate"), default="transcribe")
    p.add_argument("--windows", choices=("vad", "fixed"), default="vad",
                   help="vad (default): windows of up to 30 s cut where the speaker pauses, silence skipped; "
                        "fixed: every 30 s, as faster-whisper's sequential run without timestamps")
    p.add_argument("--no-timestamps", dest="timestamps", action="store_false",
                   help="one segment per window, decoded without time tokens (faster-whisper's without_timestamps); "
                        "by default the model times each phrase, so segments last a few seconds")
    p.add_argument("--format", choices=FORMATS, default=None, help="txt (default), srt, vtt or json")
    p.add_argument("--json", action="store_true", help="print one JSON list to stdout (no files unless --out DIR)")
    p.add_argument("--out", metavar="DIR", help="write one file per input into DIR ('-': print to stdout; "
                   "default: next to each input)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--resume", action="store_true", help="continue every unfinished job in the store (after a "
                   "crash or a kill), without decoding its finished windows again")
    add_transcript_flags(p)
    add_engine_flags(p, BACKENDS)
    add_server_flags(p)
    p.set_defaults(func=cmd_transcribe)

    p = sub.add_parser("chat", help="answer one prompt (streamed), or several side by side; every chat is stored")
    p.add_argument("prompt", nargs="?", default=None, metavar="PROMPT")
    p.add_argument("--prompts", metavar="FILE", default=None,
                   help="answer one prompt per non-empty line of FILE ('-' reads stdin), all at once, each in a new "
                        "conversation")
    p.add_argument("--conversation", type=int, metavar="ID", default=None,
                   help="continue stored conversation ID with PROMPT (its settings, changed by the flags given)")
    p.add_argument("--list", action="store_true", help="list the stored conversations")
    p.add_argument("--export", type=int, metavar="ID", default=None, help="print stored conversation ID")
    p.add_argument("--format", choices=("md", "json"), default=None, help="with --export: md (default) or json")
    p.add_argument("--model", default=None, help=f"model name or path (default {DEFAULT_CHAT}; with --server, the "
                   "first chat model it lists)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=None, help="longest answer in tokens (default 256)")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="1 is off (default)")
    p.add_argument("--top-k", type=int, default=None, help="0 is off (default)")
    p.add_argument("--min-p", type=float, default=None, help="0 is off (default)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="1 is off (default)")
    p.add_argument("--presence-penalty", type=float, default=None, help="-2 to 2; 0 is off (default)")
    p.add_argument("--frequency-penalty", type=float, default=None, help="-2 to 2; 0 is off (default)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="end the answer before TEXT (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true",
                   help='print {"conversation_id", "user_message_id", "message_id", "text", "tokens", "finish_reason", '
                        '"stats"} (a list of them with --prompts); with --list or --export, JSON')
    add_engine_flags(p, BACKENDS)
    add_server_flags(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("gui", help="open the desktop app; audio or video files named are queued for transcription")
    p.add_argument("files", nargs="*", metavar="FILE")
    p.add_argument("--check", action="store_true",
                   help="start the window, list the models usable offline, transcribe the FILEs and print their text, "
                        "then quit (exit status 0 when all went well; QT_QPA_PLATFORM=offscreen where there is no display)")
    p.set_defaults(func=cmd_gui)

    from app.cli.serve import add_parser as add_serve_parser
    from app.cli.train import add_parser as add_train_parser

    add_serve_parser(sub, BACKENDS)
    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except CadenceError as exc:
        err(f"cadence: {exc}")
        return 2
    except KeyboardInterrupt:
        err("cadence: interrupted.")
        return 130
    except BrokenPipeError:  # stdout closed early (| head): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
