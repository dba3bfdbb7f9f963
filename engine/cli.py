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
import time
from pathlib import Path
from typing import Self

from engine.errors import CadenceError

AUDIO_EXTENSIONS = {".wav", ".flac", ".ogg", ".mp3", ".m4a", ".aac", ".mp4", ".mkv", ".webm", ".mov", ".opus", ".wma"}
INTERRUPT_SHUTDOWN_S = 3  # after Ctrl-C, wait at most this long for the engine thread (it is a daemon)


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


def parse_batch(text: str | None) -> str | int | None:
    """--batch: 'auto', 'off' or a width N >= 1; None (flag not given) lets the engine read CADENCE_BATCH."""
    if text is None:
        return None
    value = text.strip().lower()
    if value in ("auto", "off"):
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise CadenceError(f"--batch must be auto, off or a whole number of slots of 1 or more (got '{text}').")
    return n


def _check_model(name: str, family: str):
    """Resolve the model and check its family before anything loads, so a wrong name is a usage error."""
    from engine.models import WHISPER, resolve

    source = resolve(name)
    if source.family != family:
        kind = "a speech-to-text (Whisper)" if family == WHISPER else "a chat"
        raise CadenceError(f"{source.name} is not {kind} model.")
    return source


class _Session:
    """An engine for one command: handles are cancelled on Ctrl-C, and the engine always shuts down."""

    def __init__(self, backend: str, batch: str | int | None):
        from engine.engine import Engine

        self.engine = Engine(backend=backend, batch=batch)  # batch None: the engine reads CADENCE_BATCH
        self.handles: list = []
        self.created = time.perf_counter()
        self.first_started: float | None = None

    def width_note(self, model: str) -> str:
        """', batch width N (from ...)' for a model whose lane is loaded, else ''."""
        status = getattr(self.engine, "status", None)
        lane = (status().get("lanes") or {}).get(model) if callable(status) else None
        if not lane or "width" not in lane:
            return ""
        return f", batch width {lane['width']}" + (f" ({lane['width_from']})" if lane.get("width_from") else "")

    def submit(self, request):
        handle = self.engine.submit(request)
        self.handles.append(handle)
        return handle

    def follow(self, handle):
        """The handle's events as they arrive; notes when the first request started (its model loaded)."""
        for event in handle:
            if event.kind == "started" and self.first_started is None:
                self.first_started = time.perf_counter()
            yield event

    def elapsed(self) -> float:
        """Seconds since the first request started, so model loading is not counted."""
        return time.perf_counter() - (self.first_started or self.created)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            for handle in self.handles:
                handle.cancel()
            self.engine.shutdown(timeout=INTERRUPT_SHUTDOWN_S)
        else:
            self.engine.shutdown()


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


def _wait_transcript(session: _Session, handle, path: Path, show_progress: bool):
    """The transcript of one file (CadenceError on failure), with window progress on a terminal."""
    shown = False
    for event in session.follow(handle):
        if show_progress and event.kind == "progress" and event.total > 1:
            sys.stderr.write(f"\r{path.name}: window {event.done}/{event.total}\033[K")
            sys.stderr.flush()
            shown = True
    if shown:
        sys.stderr.write("\r\033[K")
    return handle.result()


def cmd_transcribe(args) -> int:
    from engine.engine import TranscribeRequest
    from engine.formats import render
    from engine.models import WHISPER

    if args.json and args.format not in (None, "json"):
        raise CadenceError(f"--json prints JSON; it cannot be combined with --format {args.format}.")
    fmt = "json" if args.json else (args.format or "txt")
    batch = parse_batch(args.batch)
    source = _check_model(args.model, WHISPER)
    files = expand_inputs(args.files)
    if not files:
        raise CadenceError("No audio files were found in what was given.")
    out_dir = Path(args.out).expanduser() if args.out else None
    if out_dir:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CadenceError(f"The output folder {out_dir} cannot be created ({exc.strerror or exc}).") from None

    def target_of(path: Path) -> Path:
        return out_dir / f"{path.stem}.{fmt}"

    show_progress = sys.stderr.isatty()
    results, failed = [], 0
    with _Session(args.backend, batch) as session:
        _err(f"Transcribing {len(files)} file{'s' if len(files) != 1 else ''} with {source.name} "
             f"on {session.engine.device}...")
        handles = []
        for path in files:
            if out_dir and target_of(path).exists() and not args.overwrite:
                handles.append(None)  # refused below, without decoding it
                continue
            handles.append(session.submit(TranscribeRequest(audio=path, model=args.model, language=args.language,
                                                            task=args.task, name=str(path))))
        for path, handle in zip(files, handles):
            try:
                if handle is None:
                    raise CadenceError(f"{target_of(path)} already exists (use --overwrite to replace it).")
                transcript = _wait_transcript(session, handle, path, show_progress)
                s = transcript.stats
                _err(f"{path}: {s['tokens']} tokens in {s['seconds']:.2f} s "
                     f"({s['tok_s']} tok/s, {s['realtime_factor']}x real time)")
                entry = transcript.to_json() | {"file": str(path), "model": source.name}
                if out_dir:
                    target = target_of(path)
                    if target.exists() and not args.overwrite:  # two inputs with the same name
                        raise CadenceError(f"{target} already exists (use --overwrite to replace it).")
                    target.write_text(render(transcript, fmt), encoding="utf-8")
                    entry["output"] = str(target)
                elif fmt != "json":
                    sys.stdout.write(render(transcript, fmt))
                    sys.stdout.flush()
            except CadenceError as exc:
                failed += 1
                entry = {"file": str(path), "error": str(exc)}
                _err(f"{path}: {exc}")
            except OSError as exc:  # writing the output failed
                failed += 1
                entry = {"file": str(path), "error": f"The output for {path.name} could not be written ({exc.strerror or exc})."}
                _err(f"{path}: {entry['error']}")
            results.append(entry)
        elapsed = session.elapsed()
        note = session.width_note(args.model)
    if fmt == "json" and not out_dir:
        print(json.dumps(results, ensure_ascii=False, indent=2))
    _err(f"{len(files) - failed} of {len(files)} file{'s' if len(files) != 1 else ''} transcribed "
         f"in {elapsed:.2f} s{note}.")
    return 1 if failed else 0


# ---------------------------------------------------------------- chat
def read_prompts(where: str) -> list[str]:
    """One prompt per non-empty line of a file, or of stdin for '-'."""
    try:
        text = sys.stdin.read() if where == "-" else Path(where).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise CadenceError(f"The prompts file {where} cannot be read ({exc.strerror or exc}).") from None
    except UnicodeDecodeError:
        raise CadenceError(f"The prompts file {where} is not UTF-8 text.") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CadenceError(f"The prompts file {'(stdin)' if where == '-' else where} holds no prompts.")
    return prompts


def _chat_entry(result: dict, model: str) -> dict:
    """The engine's chat result in the CLI's schema (see README: `cadence chat --json`)."""
    stats = dict(result.get("stats") or {})
    if "seconds" not in stats:
        stats["seconds"] = stats.get("end_to_end")
    if "tok_s" not in stats:
        stats["tok_s"] = stats.get("decode_tok_s") or 0.0
    stats["model"] = model
    stats["finish_reason"] = result["finish_reason"]
    return {"text": result["text"], "tokens": list(result["tokens"]), "finish_reason": result["finish_reason"],
            "stats": stats}


def _speed_line(stats: dict) -> str:
    seconds = stats.get("seconds") or 0.0
    return (f"{stats['tokens']} tokens in {seconds:.2f} s ({stats['tok_s']} tok/s, "
            f"first token after {stats.get('time_to_first_token')} s, {stats['finish_reason']})")


def cmd_chat(args) -> int:
    from engine.engine import ChatRequest
    from engine.models import CHAT
    from engine.sampling import SamplingParams

    if args.prompt is not None and args.prompts is not None:
        raise CadenceError("Give either a PROMPT or --prompts FILE, not both.")
    if args.prompt is None and args.prompts is None:
        raise CadenceError("Give a PROMPT, or --prompts FILE with one prompt per line ('-' reads stdin).")
    if args.prompt is not None and not args.prompt.strip():
        raise CadenceError("The prompt is empty.")
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=list(args.stop or []), seed=args.seed,
        max_tokens=args.max_tokens,
    ).validate()
    batch = parse_batch(args.batch)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    single = args.prompt is not None
    source = _check_model(args.model, CHAT)

    entries: list[dict] = []
    failed = 0
    streamed = False
    try:
        with _Session(args.backend, batch) as session:
            _err(f"Answering {len(prompts)} prompt{'s' if len(prompts) != 1 else ''} with {source.name} "
                 f"on {session.engine.device}...")
            handles = [session.submit(ChatRequest(prompt=p, system=args.system, model=args.model, params=params))
                       for p in prompts]
            for number, handle in enumerate(handles, 1):
                if not args.json and not single:  # a header before each answer, a blank line between
                    sys.stdout.write(("" if number == 1 else "\n") + f"### Prompt {number}\n")
                for event in session.follow(handle):  # without --json, stream the answer as it comes
                    if event.kind == "delta" and event.text and not args.json:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
                        streamed = True
                try:
                    entry = _chat_entry(handle.result(), source.name)
                except CadenceError as exc:
                    failed += 1
                    entries.append({"error": str(exc)})
                    _err(str(exc) if single else f"Prompt {number}: {exc}")
                    continue
                entries.append(entry)
                if not args.json:
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                    streamed = False
                _err(_speed_line(entry["stats"]) if single else f"Prompt {number}: {_speed_line(entry['stats'])}")
            elapsed = session.elapsed()
            note = session.width_note(args.model)
    except KeyboardInterrupt:
        if streamed:
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    if args.json:
        if not single:
            print(json.dumps(entries, ensure_ascii=False))
        elif not failed:
            print(json.dumps(entries[0], ensure_ascii=False))
    if not single:
        total = sum(e["stats"]["tokens"] for e in entries if "stats" in e)
        _err(f"{len(prompts) - failed} of {len(prompts)} prompts answered, {total} tokens in {elapsed:.2f} s "
             f"({total / elapsed if elapsed > 0 else 0.0:.1f} tok/s together{note}).")
    return 1 if failed else 0


# ---------------------------------------------------------------- gui
def cmd_gui(args) -> int:
    from app.main import main as gui_main

    return gui_main([])


def _add_engine_flags(p: argparse.ArgumentParser, backends) -> None:
    p.add_argument("--batch", default=None, metavar="auto|off|N",
                   help="slots decoded together: auto (measured for this machine), off (one at a time, the exact "
                        "single-stream path) or N (default: $CADENCE_BATCH, else auto)")
    p.add_argument("--backend", choices=backends, default="auto")


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
    p.add_argument("--format", choices=FORMATS, default=None, help="txt (default), srt, vtt or json")
    p.add_argument("--json", action="store_true", help="the same as --format json")
    p.add_argument("--out", metavar="DIR", help="write one file per input into DIR instead of printing")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    _add_engine_flags(p, BACKENDS)
    p.set_defaults(func=cmd_transcribe)

    p = sub.add_parser("chat", help="answer one prompt (streamed), or several side by side")
    p.add_argument("prompt", nargs="?", default=None, metavar="PROMPT")
    p.add_argument("--prompts", metavar="FILE", default=None,
                   help="answer one prompt per non-empty line of FILE ('-' reads stdin), all at once")
    p.add_argument("--model", default=DEFAULT_CHAT, help=f"model name or path (default {DEFAULT_CHAT})")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="1 is off (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 is off (default)")
    p.add_argument("--min-p", type=float, default=0.0, help="0 is off (default)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 is off (default)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="-2 to 2; 0 is off (default)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="-2 to 2; 0 is off (default)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="end the answer before TEXT (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true",
                   help='print {"text", "tokens", "finish_reason", "stats"} (a list of them with --prompts)')
    _add_engine_flags(p, BACKENDS)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("gui", help="open the desktop app")
    p.set_defaults(func=cmd_gui)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _quiet_libraries()
        return args.func(args)
    except CadenceError as exc:
        _err(f"cadence: {exc}")
        return 2
    except KeyboardInterrupt:
        _err("cadence: interrupted.")
        return 130
    except BrokenPipeError:  # stdout closed early (| head): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
