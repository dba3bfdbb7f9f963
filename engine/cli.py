"""The ``cadence`` command line: models, transcribe, chat, gui.

``transcribe`` and ``chat`` run on the batched engine (:class:`engine.engine.Engine`): every file
or prompt is submitted at once, so they decode side by side, and results come back in input
order. Results go to stdout (JSON where asked); progress and timings go to stderr. A failure is
one sentence, never a traceback. Exit status: 0 all succeeded, 1 some inputs failed, 2 bad usage
or a model that cannot be loaded, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Self

from engine.errors import CadenceError

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
    """--batch: the engine's rule (auto, off or N >= 1); None (flag not given) lets the engine read CADENCE_BATCH."""
    from engine.engine import parse_batch as engine_parse_batch

    if text is None:
        return None
    try:
        return engine_parse_batch(text)
    except CadenceError as exc:
        raise CadenceError(f"--batch: {exc}") from None


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

    def __init__(self, backend: str, batch: str | int | None, drafting: dict | None = None):
        from engine.engine import Engine

        # batch None: the engine reads CADENCE_BATCH; drafter None: CADENCE_DRAFTER
        self.engine = Engine(backend=backend, batch=batch, **(drafting or {}))
        self.handles: list = []
        self.created = time.perf_counter()
        self.first_started: float | None = None

    def width_note(self, model: str) -> str:
        """', batch width N (from ...)' for a model whose lane is loaded, else ''."""
        lane = self.engine.status()["lanes"].get(model)
        if not lane:
            return ""
        return f", batch width {lane['width']} ({lane['width_from']}), {drafting_note(lane['drafting'])}"

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
            from engine.audio import audio_files

            out += audio_files(p)
        else:
            out.append(p)
    return out


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


SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "stop", "seed", "max_tokens")


def _chat_entry(reply, model: str) -> dict:
    """A finished answer in the CLI's schema (see README: `cadence chat --json`)."""
    result = reply.result
    stats = dict(result.get("stats") or {})
    if "seconds" not in stats:
        stats["seconds"] = stats.get("end_to_end")
    if "tok_s" not in stats:
        stats["tok_s"] = stats.get("decode_tok_s") or 0.0
    stats["model"] = model
    stats["finish_reason"] = result["finish_reason"]
    stats.setdefault("dropped_turns", reply.dropped_turns)
    return {"conversation_id": reply.conversation_id, "user_message_id": reply.user_message_id,
            "message_id": reply.message_id, "text": result["text"], "tokens": list(result["tokens"]),
            "finish_reason": result["finish_reason"], "stats": stats}


def _failed_entry(reply, error: str) -> dict:
    """A failed answer: its ids when it was stored (as failed), just the sentence when nothing was kept."""
    if reply is None or reply.rejected:
        return {"error": error}
    return {"conversation_id": reply.conversation_id, "user_message_id": reply.user_message_id,
            "message_id": reply.message_id, "error": error}


def drafting_note(drafting: dict) -> str:
    """'drafting with ngram: 61% of 230 drafts accepted' or 'drafting off (why)'."""
    if drafting.get("state") != "on":
        return f"drafting {drafting.get('state', 'off')}"
    if not drafting.get("drafted"):
        return f"drafting with {drafting['drafter']}: nothing drafted"
    return (f"drafting with {drafting['drafter']}: {drafting['acceptance']:.0%} of {drafting['drafted']} drafts accepted, "
            f"{drafting['mean_acceptance_length']} tokens per check")


def _speed_line(stats: dict) -> str:
    seconds = stats.get("seconds") or 0.0
    dropped = stats.get("dropped_turns") or 0
    return (f"{stats['tokens']} tokens in {seconds:.2f} s ({stats['tok_s']} tok/s, "
            f"first token after {stats.get('time_to_first_token')} s, {stats['finish_reason']})"
            + (f"; {stats['drafting']['acceptance']:.0%} of {stats['drafting']['drafted']} drafted tokens accepted"
               if (stats.get("drafting") or {}).get("drafted") else "")
            + (f"; {dropped} earlier turn{'s' if dropped != 1 else ''} left out to fit the context" if dropped else ""))


def _list_conversations(store, as_json: bool) -> int:
    rows = store.list()
    if as_json:
        print(json.dumps(rows, ensure_ascii=False, indent=2))
        return 0
    if not rows:
        _err(f"No conversations are stored yet (store: {store.path}).")
        return 0
    print(f"{'ID':>5}  {'UPDATED':<16}  {'MSGS':>4}  {'MODEL':<24}  TITLE")
    for r in rows:
        updated = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["updated"]))
        print(f"{r['id']:>5}  {updated:<16}  {r['messages']:>4}  {r['model']:<24}  {r['title']}")
    return 0


def cmd_chat(args) -> int:
    from engine.conversations import Conversations, check_message, sampling_params
    from engine.models import CHAT, DEFAULT_CHAT

    store_modes = [flag for flag, on in (("--list", args.list), ("--export", args.export is not None)) if on]
    if store_modes:
        if len(store_modes) > 1:
            raise CadenceError("Give either --list or --export ID, not both.")
        if args.prompt is not None or args.prompts is not None or args.conversation is not None:
            raise CadenceError(f"{store_modes[0]} reads the store; it cannot be combined with a prompt, "
                               "--prompts or --conversation.")
    if args.format is not None and args.export is None:
        raise CadenceError("--format goes with --export ID (md or json).")
    if args.list:
        return _list_conversations(Conversations(), args.json)
    if args.export is not None:
        if args.json and args.format not in (None, "json"):
            raise CadenceError(f"--json exports JSON; it cannot be combined with --format {args.format}.")
        sys.stdout.write(Conversations().export(args.export, "json" if args.json else (args.format or "md")))
        sys.stdout.flush()
        return 0

    if args.prompt is not None and args.prompts is not None:
        raise CadenceError("Give either a PROMPT or --prompts FILE, not both.")
    if args.prompt is None and args.prompts is None:
        raise CadenceError("Give a PROMPT, or --prompts FILE with one prompt per line ('-' reads stdin).")
    if args.conversation is not None and args.prompts is not None:
        raise CadenceError("--conversation continues one conversation with one PROMPT; it cannot take --prompts.")
    if args.prompt is not None:
        check_message(args.prompt)
    flags = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    store = Conversations()  # no engine yet: everything is checked before a model loads
    conversation = store.get(args.conversation) if args.conversation is not None else None
    if conversation is not None:  # flags given change the conversation's settings from this turn on
        params = sampling_params(dataclasses.asdict(conversation.params) | flags)
        model = args.model or conversation.model
    else:
        params = sampling_params(flags)
        model = args.model or DEFAULT_CHAT
    batch = parse_batch(args.batch)
    source = _check_model(model, CHAT)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    single = args.prompt is not None
    if conversation is not None and (flags or args.system is not None or args.model):
        store.update(conversation.id, model=args.model, system=args.system, params=params if flags else None)

    entries: list[dict] = []
    failed = 0
    streamed = False
    try:
        with _Session(args.backend, batch, drafting_flags(args)) as session:
            conversations = Conversations(session.engine, store.path)
            try:
                _err(f"Answering {len(prompts)} prompt{'s' if len(prompts) != 1 else ''} with {source.name} "
                     f"on {session.engine.device}...")
                replies: list = []
                for prompt in prompts:  # every prompt is submitted before any answer is read
                    try:
                        if conversation is not None:
                            replies.append(conversations.send(conversation.id, prompt))
                        else:
                            replies.append(conversations.start(prompt, model=model, system=args.system, params=params))
                    except CadenceError as exc:
                        if single:
                            raise
                        replies.append(exc)
                for number, reply in enumerate(replies, 1):
                    if not args.json and not single:  # a header before each answer, a blank line between
                        sys.stdout.write(("" if number == 1 else "\n") + f"### Prompt {number}\n")
                    try:
                        if isinstance(reply, CadenceError):
                            raise reply
                        for text in reply:  # without --json, stream the answer as it comes
                            if not args.json:
                                sys.stdout.write(text)
                                sys.stdout.flush()
                                streamed = True
                        reply.wait()
                    except CadenceError as exc:
                        failed += 1
                        entries.append(_failed_entry(None if isinstance(reply, CadenceError) else reply, str(exc)))
                        _err(str(exc) if single else f"Prompt {number}: {exc}")
                        if streamed:
                            sys.stdout.write("\n")
                            streamed = False
                        continue
                    entry = _chat_entry(reply, source.name)
                    entries.append(entry)
                    if not args.json:
                        sys.stdout.write("\n")
                        sys.stdout.flush()
                        streamed = False
                    _err(_speed_line(entry["stats"]) if single else f"Prompt {number}: {_speed_line(entry['stats'])}")
                started = [r.started_at for r in replies if not isinstance(r, CadenceError) and r.started_at]
                session.first_started = min(started) if started else None
                elapsed = session.elapsed()
                note = session.width_note(model)
            except KeyboardInterrupt:
                conversations.close("stopped", timeout=INTERRUPT_SHUTDOWN_S)  # partial answers kept as stopped
                raise
            finally:
                conversations.close()
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
    p.add_argument("--drafter", default=None, metavar="auto|mtp|ngram|draft:MODEL|off",
                   help="how tokens are drafted ahead and checked in the same step: auto (the model's MTP head, else "
                        "n-gram lookup), mtp, ngram, draft:MODEL (a smaller model with the same tokenizer) or off "
                        "(default: $CADENCE_DRAFTER, else auto); output is the same either way")
    p.add_argument("--draft-depth", type=int, default=None, metavar="N",
                   help="draft N tokens per slot and step (default: chosen per slot, each step)")
    p.add_argument("--draft-min-p", type=float, default=0.0, metavar="P",
                   help="skip MTP drafts the head gives less than probability P (default 0)")


def drafting_flags(args) -> dict:
    """The engine's drafting arguments from the command line."""
    return {"drafter": args.drafter, "draft_depth": args.draft_depth, "draft_min_p": args.draft_min_p}


def build_parser() -> argparse.ArgumentParser:
    from engine.backend import BACKENDS
    from engine.formats import FORMATS
    from engine.models import DEFAULT_CHAT, DEFAULT_WHISPER

    parser = argparse.ArgumentParser(prog="cadence", description="Batched local transcription and chat.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("models", help="list the models and whether each is available here")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=cmd_models)

    from engine.cli_transcribe import cmd_transcribe

    p = sub.add_parser("transcribe", help="transcribe audio or video files (folders are searched recursively)")
    p.add_argument("files", nargs="*", metavar="FILE")
    p.add_argument("--model", default=DEFAULT_WHISPER, help=f"model name or path (default {DEFAULT_WHISPER})")
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
    _add_engine_flags(p, BACKENDS)
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
    p.add_argument("--model", default=None, help=f"model name or path (default {DEFAULT_CHAT})")
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
    _add_engine_flags(p, BACKENDS)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("gui", help="open the desktop app")
    p.set_defaults(func=cmd_gui)

    from engine.cli_train import add_parser as add_train_parser

    add_train_parser(sub)
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
