"""``cadence chat``: answer one prompt (streamed) or many side by side; every chat is stored."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from app.cli.common import (
    INTERRUPT_SHUTDOWN_S,
    Session,
    check_model,
    engine_options,
    err,
    parse_batch,
    remote_model,
    remote_server,
)
from engine.errors import CadenceError

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
    answer = reply.result
    stats = dict(answer.stats)
    if "seconds" not in stats:
        stats["seconds"] = stats.get("end_to_end")
    if "tok_s" not in stats:
        stats["tok_s"] = stats.get("decode_tok_s") or 0.0
    stats["model"] = model
    stats["finish_reason"] = answer.finish_reason
    stats.setdefault("dropped_turns", reply.dropped_turns)
    return {"conversation_id": reply.conversation_id, "user_message_id": reply.user_message_id,
            "message_id": reply.message_id, "text": answer.text, "tokens": list(answer.tokens),
            "finish_reason": answer.finish_reason, "stats": stats}


def _failed_entry(reply, error: str) -> dict:
    """A failed answer: its ids when it was stored (as failed), just the sentence when nothing was kept."""
    if reply is None or reply.rejected:
        return {"error": error}
    return {"conversation_id": reply.conversation_id, "user_message_id": reply.user_message_id,
            "message_id": reply.message_id, "error": error}


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
        err(f"No conversations are stored yet (store: {store.path}).")
        return 0
    print(f"{'ID':>5}  {'UPDATED':<16}  {'MSGS':>4}  {'MODEL':<24}  TITLE")
    for r in rows:
        updated = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["updated"]))
        print(f"{r['id']:>5}  {updated:<16}  {r['messages']:>4}  {r['model']:<24}  {r['title']}")
    return 0


def cmd_chat(args) -> int:
    from engine.chat.answering import Conversations
    from engine.chat.store import check_message, sampling_params
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
        model = args.model
    server = remote_server(args)
    batch = parse_batch(args.batch)
    engine_opts = engine_options(args)
    if server is not None:  # the server knows its own models
        model = remote_model(server, model, whisper=False)
    else:
        model = check_model(model or DEFAULT_CHAT, CHAT).name
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    single = args.prompt is not None
    if conversation is not None and (flags or args.system is not None or args.model):
        store.update(conversation.id, model=args.model, system=args.system, params=params if flags else None)

    entries: list[dict] = []
    failed = 0
    streamed = False
    try:
        with Session(args.backend, batch, engine_opts, server) as session:
            conversations = Conversations(session.engine, store.path)
            try:
                err(f"Answering {len(prompts)} prompt{'s' if len(prompts) != 1 else ''} with {model} "
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
                        err(str(exc) if single else f"Prompt {number}: {exc}")
                        if streamed:
                            sys.stdout.write("\n")
                            streamed = False
                        continue
                    entry = _chat_entry(reply, model)
                    entries.append(entry)
                    if not args.json:
                        sys.stdout.write("\n")
                        sys.stdout.flush()
                        streamed = False
                    err(_speed_line(entry["stats"]) if single else f"Prompt {number}: {_speed_line(entry['stats'])}")
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
        err(f"{len(prompts) - failed} of {len(prompts)} prompts answered, {total} tokens in {elapsed:.2f} s "
             f"({total / elapsed if elapsed > 0 else 0.0:.1f} tok/s together{note}).")
    return 1 if failed else 0
