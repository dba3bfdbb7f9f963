"""What every ``cadence`` command shares: messages on stderr, the engine session, engine flags."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Self

from engine.errors import CadenceError

INTERRUPT_SHUTDOWN_S = 3  # after Ctrl-C, wait at most this long for the engine thread (it is a daemon)


def err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def parse_batch(text: str | None) -> str | int | None:
    """--batch: the engine's rule (auto, off or N >= 1); None (flag not given) lets the engine read CADENCE_BATCH."""
    from engine.api import parse_batch as engine_parse_batch

    if text is None:
        return None
    try:
        return engine_parse_batch(text)
    except CadenceError as exc:
        raise CadenceError(f"--batch: {exc}") from None


def check_model(name: str, family: str):
    """Resolve the model and check its family before anything loads, so a wrong name is a usage error."""
    from engine.models import WHISPER, resolve

    source = resolve(name)
    if source.family != family:
        kind = "a speech-to-text (Whisper)" if family == WHISPER else "a chat"
        raise CadenceError(f"{source.name} is not {kind} model.")
    return source


class Session:
    """An engine for one command (this computer's, or a server's with ``server`` = (url, key)): handles are
    cancelled on Ctrl-C, and the engine always shuts down."""

    def __init__(self, backend: str, batch: str | int | None, options: dict | None = None,
                 server: tuple[str, str | None] | None = None):
        if server is not None:
            from engine.remote import RemoteEngine

            self.engine = RemoteEngine(*server)
        else:
            from engine import Engine

            quiet_libraries()  # before anything imports transformers
            # batch None: the engine reads CADENCE_BATCH; drafter None: CADENCE_DRAFTER; precision None: CADENCE_PRECISION
            self.engine = Engine(backend=backend, batch=batch, **(options or {}))
        self.handles: list = []
        self.created = time.perf_counter()
        self.first_started: float | None = None

    def width_note(self, model: str) -> str:
        """', batch width N (from ...)' for a model whose lane is loaded, else ''."""
        lane = self.engine.status()["lanes"].get(model)
        if not lane:
            return ""
        return (f", batch width {lane['width']} ({lane['width_from']}), {lane['precision']} "
                f"({'auto' if lane['precision_from'] == 'auto' else 'as asked'}), {drafting_note(lane['drafting'])}")

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


class NoSession:
    """What a command holds in place of a Session when everything it was given was refused before
    an engine was needed: nothing started, nothing to shut down."""

    def __init__(self):
        self.handles: list = []

    def width_note(self, model: str) -> str:
        return ""

    def elapsed(self) -> float:
        return 0.0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        pass


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


def drafting_note(drafting: dict) -> str:
    """'drafting with ngram: 61% of 230 drafts accepted' or 'drafting off (why)'."""
    if drafting.get("state") != "on":
        return f"drafting {drafting.get('state', 'off')}"
    if not drafting.get("drafted"):
        why = (drafting.get("planner") or {}).get("note")
        return f"drafting with {drafting['drafter']}: nothing drafted" + (f" ({why})" if why else "")
    return (f"drafting with {drafting['drafter']}: {drafting['acceptance']:.0%} of {drafting['drafted']} drafts accepted, "
            f"{drafting['mean_acceptance_length']} tokens per check")


def add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=None, metavar="URL",
                   help="answer on a server instead of this computer: another Cadence (cadence serve), vLLM or "
                        "llama.cpp's server, e.g. http://gpu-box:8000 (default: $CADENCE_SERVER)")
    p.add_argument("--api-key", default=None, help="the server's API key (default: $CADENCE_API_KEY)")


def remote_server(args) -> tuple[str, str | None] | None:
    """(url, api key) when the command runs on a server (--server or CADENCE_SERVER), else None. The flags
    that set up this computer's engine are refused with it: the server runs its own."""
    from engine.remote import server_url

    url = args.server or os.environ.get("CADENCE_SERVER") or None
    if not url:
        return None
    local = [flag for flag, value in (("--batch", args.batch), ("--drafter", args.drafter),
                                      ("--draft-depth", args.draft_depth), ("--precision", args.precision),
                                      ("--context", args.context)) if value is not None]
    local += ["--backend"] if args.backend != "auto" else []
    if local:
        raise CadenceError(f"{local[0]} sets up the engine on this computer; with --server the server runs its own.")
    return server_url(url), args.api_key or os.environ.get("CADENCE_API_KEY") or None


def remote_model(server: tuple[str, str | None], asked: str | None, whisper: bool) -> str:
    """The model to ask a server for: the one named, else the first it lists of the kind wanted (a name with
    'whisper' in it for speech)."""
    if asked:
        return asked
    from engine.remote import RemoteEngine

    names = RemoteEngine(*server, retries=0).models()
    fitting = [n for n in names if ("whisper" in n.lower()) == whisper]
    if not fitting:
        kind = "Whisper" if whisper else "chat"
        raise CadenceError(f"The server at {server[0]} lists no {kind} model ({', '.join(names) or 'none at all'}); "
                           "name one with --model.")
    return fitting[0]


def add_engine_flags(p: argparse.ArgumentParser, backends, auto_width: str = "measured for this machine") -> None:
    p.add_argument("--batch", default=None, metavar="auto|off|N",
                   help=f"slots decoded together: auto ({auto_width}), off (one at a time, the exact "
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
    p.add_argument("--precision", default=None, metavar="auto|float32|bfloat16|int8",
                   help="weights and arithmetic: auto (the fastest this machine runs within quality bounds, measured "
                        "once per model), float32 (the reference), bfloat16 (where the processor has bfloat16 "
                        "instructions) or int8 (weight-only) (default: $CADENCE_PRECISION, else auto)")
    p.add_argument("--context", default=None, metavar="auto|N",
                   help="tokens per chat slot (prompt and answer): auto (the model's context, as far as memory "
                        "allows at the batch width) or at most N (default: $CADENCE_CONTEXT, else auto)")


def engine_options(args) -> dict:
    """The engine's drafting, precision and context arguments from the command line (their spelling and
    limits checked here, before torch and the models load: a mistyped flag is answered at once)."""
    from engine.api import check_draft_limits, parse_context, parse_drafter, parse_precision

    def checked(flag: str, value, parse):
        if value is None:
            return None
        try:
            return parse(value)
        except CadenceError as exc:
            raise CadenceError(f"{flag}: {exc}") from None

    if args.drafter is not None:
        parse_drafter(args.drafter)
    check_draft_limits(args.draft_depth, args.draft_min_p)
    return {"drafter": args.drafter, "draft_depth": args.draft_depth, "draft_min_p": args.draft_min_p,
            "precision": checked("--precision", args.precision, parse_precision),
            "context": checked("--context", args.context, parse_context)}
