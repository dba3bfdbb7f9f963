"""The ``cadence`` command line: models, transcribe, chat, gui.

Results go to stdout (JSON where asked); progress and timings go to stderr. A failure is one
sentence, never a traceback. Exit status: 0 all succeeded, 1 some inputs failed, 2 bad usage or
a model that cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engine.errors import CadenceError

AUDIO_EXTENSIONS = {".wav", ".flac", ".ogg", ".mp3", ".m4a", ".aac", ".mp4", ".mkv", ".webm", ".mov", ".opus", ".wma"}


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def _load(name: str, family: str, backend: str):
    from engine.backend import resolve_backend
    from engine.loading import load

    device = resolve_backend(backend)
    _err(f"Loading {name} on {device}...")
    loaded = load(name, family=family, device=device)
    how = "from cache" if loaded.report.from_cache else "converted and cached"
    _err(f"Loaded {loaded.source.name} in {loaded.report.seconds:.2f} s ({how}).")
    return loaded


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
    return 0


# ---------------------------------------------------------------- transcribe
def expand_inputs(items: list[str]) -> list[Path]:
    """Files as given; folders expanded recursively to their audio and video files, sorted."""
    out: list[Path] = []
    for item in items:
        p = Path(item).expanduser()
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in AUDIO_EXTENSIONS)
        else:
            out.append(p)
    return out


def cmd_transcribe(args) -> int:
    from engine.formats import render
    from engine.models import WHISPER
    from engine.transcribe import transcribe_file
    from engine.whisper_reference import WhisperReference

    loaded = _load(args.model, WHISPER, args.backend)
    decoder = WhisperReference(loaded)
    files = expand_inputs(args.files)
    if not files:
        raise CadenceError("No audio files were found in what was given.")
    out_dir = Path(args.out).expanduser() if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    results, failed = [], 0
    for path in files:
        try:
            transcript = transcribe_file(decoder, path, language=args.language, task=args.task)
            s = transcript.stats
            _err(f"{path}: {s['tokens']} tokens in {s['seconds']:.2f} s ({s['tok_s']} tok/s, {s['realtime_factor']}x real time)")
            entry = transcript.to_json() | {"model": loaded.source.name}
            if out_dir:
                target = out_dir / f"{path.stem}.{args.format}"
                if target.exists() and not args.overwrite:
                    raise CadenceError(f"{target} already exists (use --overwrite to replace it).")
                target.write_text(render(transcript, args.format), encoding="utf-8")
                entry["output"] = str(target)
            elif args.format != "json":
                sys.stdout.write(render(transcript, args.format))
        except CadenceError as exc:
            failed += 1
            entry = {"file": str(path), "error": str(exc)}
            _err(f"{path}: {exc}")
        except Exception as exc:  # a bug must not take the other files down with it
            failed += 1
            entry = {"file": str(path), "error": f"{path.name} could not be transcribed ({exc.__class__.__name__}: {exc})."}
            _err(f"{path}: {entry['error']}")
        results.append(entry)
    if args.format == "json" and not out_dir:
        print(json.dumps(results, ensure_ascii=False, indent=2))
    return 1 if failed else 0


# ---------------------------------------------------------------- chat
def cmd_chat(args) -> int:
    from engine.chat_reference import ChatReference, build_messages
    from engine.models import CHAT
    from engine.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
    ).validate()
    loaded = _load(args.model, CHAT, args.backend)
    reference = ChatReference(loaded)
    prompt_ids = reference.prompt_ids(build_messages(args.prompt, args.system))

    def stream(_token: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = reference.generate(prompt_ids, params, on_token=None if args.json else stream)
    result.stats["model"] = loaded.source.name
    result.stats["finish_reason"] = result.finish_reason
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens, "stats": result.stats}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    s = result.stats
    _err(f"{s['tokens']} tokens in {s['seconds']:.2f} s ({s['tok_s']} tok/s, first token after {s['time_to_first_token']} s)")
    return 0


# ---------------------------------------------------------------- gui
def cmd_gui(args) -> int:
    from app.main import main as gui_main

    return gui_main([])


def build_parser() -> argparse.ArgumentParser:
    from engine.backend import BACKENDS
    from engine.formats import FORMATS
    from engine.models import DEFAULT_CHAT, DEFAULT_WHISPER

    parser = argparse.ArgumentParser(prog="cadence", description="Batched local transcription and chat.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("models", help="list the models and whether each is available here")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("transcribe", help="transcribe audio or video files (folders are searched recursively)")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--model", default=DEFAULT_WHISPER, help=f"model name or path (default {DEFAULT_WHISPER})")
    p.add_argument("--language", default=None, help="language code such as en or de (multilingual models detect it)")
    p.add_argument("--task", choices=("transcribe", "translate"), default="transcribe")
    p.add_argument("--format", choices=FORMATS, default="txt")
    p.add_argument("--out", metavar="DIR", help="write one file per input into DIR instead of printing")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.set_defaults(func=cmd_transcribe)

    p = sub.add_parser("chat", help="answer one prompt, streamed")
    p.add_argument("prompt")
    p.add_argument("--model", default=DEFAULT_CHAT, help=f"model name or path (default {DEFAULT_CHAT})")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help='print {"text", "tokens", "stats"}')
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("gui", help="open the desktop app")
    p.set_defaults(func=cmd_gui)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        return args.func(args)
    except CadenceError as exc:
        _err(f"cadence: {exc}")
        return 2
    except KeyboardInterrupt:
        _err("cadence: interrupted.")
        return 130


if __name__ == "__main__":
    sys.exit(main())
