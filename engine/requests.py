"""Turn a chat request into a sequence on a lane, and its tokens back into events and a result.

Runs on the engine thread. The rules (chat template, stop tokens, sampling) are the reference
decoder's, so the engine's output is held to the same tokens. (Transcription requests:
:func:`engine.transcribe.start_transcription`.)

Fitting the context (here because the tokenizer and the slot length live on the engine thread):
the prompt gets at most ``max_len - room`` tokens of a slot, where ``room`` keeps space for the
answer: its max tokens, but at most half the slot (the lane still stops any answer at the slot's
end). When system prompt + history + message are longer, the oldest turns of the history are
left out (never the system prompt) and the result says how many (``dropped_turns``); when the
system prompt and the message alone are too long, the request fails with a sentence. A
:class:`DocumentChatRequest` also carries a long text (a transcript) for its system prompt,
which is cut between parts to fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.chat_reference import build_messages
from engine.engine import ChatRequest
from engine.errors import RequestError
from engine.models import CHAT
from engine.scheduler import Sequence
from engine.text_stream import TextStream

DOCUMENT_SHARE = 0.75  # a document's system prompt + first message take at most this share of the prompt budget
MAX_CHARS_PER_TOKEN = 16  # no tokenizer packs more natural text into one token: bounds the document search


@dataclass
class DocumentChatRequest(ChatRequest):
    """A chat request whose system prompt holds a long document, cut to fit: ``system_for(n)`` is the
    system prompt with the first ``n`` of the document's ``parts`` (so ``system_for(parts)`` is
    uncut). The largest ``n`` whose prompt takes at most :data:`DOCUMENT_SHARE` of the budget is
    used, leaving room for the turns that follow; the ``started`` event and the result report the
    system prompt chosen and ``n``."""

    parts: int = 0
    system_for: Callable[[int], str] | None = None


def prompt_budget(max_len: int, max_tokens: int) -> int:
    """Prompt tokens a slot of ``max_len`` takes, keeping room for the answer (at most half the slot)."""
    return max_len - min(max_tokens, max_len // 2)


def split_turns(history: list[dict]) -> list[list[dict]]:
    """History as turns: each starts with a user message and holds the replies that follow it."""
    turns: list[list[dict]] = []
    for message in history:
        if message.get("role") == "user" or not turns:
            turns.append([])
        turns[-1].append(message)
    return turns


def fit_history(render: Callable[[list[dict]], list[int]], system: str | None, history: list[dict], prompt: str,
                budget: int) -> tuple[list[int], int]:
    """The prompt ids with the fewest oldest turns left out so that at most ``budget`` tokens remain,
    and how many turns were left out. RequestError when the system prompt and the message alone
    do not fit."""
    turns = split_turns(history)
    tried: dict[int, list[int]] = {}

    def ids_without(k: int) -> list[int]:
        if k not in tried:
            tried[k] = render(build_messages(prompt, system, [m for turn in turns[k:] for m in turn]))
        return tried[k]

    if len(ids_without(0)) <= budget:
        return ids_without(0), 0
    alone = ids_without(len(turns))
    if len(alone) > budget:
        what = "The message and the system prompt come" if system else "The message comes"
        raise RequestError(f"{what} to {len(alone)} tokens, more than the {budget} this model takes with room "
                           f"for the answer; shorten it (or lower max tokens).")
    lo, hi = 1, len(turns)  # the prompt only shrinks as more turns are left out: the fewest that fit
    while lo < hi:
        mid = (lo + hi) // 2
        if len(ids_without(mid)) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return ids_without(lo), lo


def fit_document(render: Callable[[list[dict]], list[int]], request: DocumentChatRequest, budget: int) -> tuple[str, int]:
    """The system prompt with as many of the document's parts as fit in ``DOCUMENT_SHARE`` of the
    budget (with the request's message), and that number."""
    share = int(budget * DOCUMENT_SHARE)

    def fits(n: int) -> bool:
        return len(render(build_messages(request.prompt, request.system_for(n)))) <= share

    def most(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
        """The largest n in [lo, hi] with ok(n), given ok only turns false as n grows (lo if none)."""
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # Parts beyond this many characters cannot fit whatever the tokenizer: no need to tokenize them.
    hi = most(0, request.parts, lambda n: len(request.system_for(n)) <= share * MAX_CHARS_PER_TOKEN)
    lo = most(0, hi, fits)
    if lo == 0 and request.parts:
        raise RequestError(f"Not even the start of the document fits beside the message in the {share} tokens "
                           f"this model leaves for it; shorten the message.")
    return request.system_for(lo), lo


def start_chat(engine, handle) -> list[Sequence]:
    from engine.engine import Event

    req = handle.request
    params = req.params.validate()
    lane = engine.lane(req.model, CHAT)
    ref = engine.reference(req.model)
    max_len = lane.decoder.max_len
    fitted: dict = {}
    if req.prompt_ids:  # given ids bypass the template and the fitting
        ids = list(req.prompt_ids)
        if len(ids) >= max_len:
            raise RequestError(f"The prompt is {len(ids)} tokens, more than the {max_len} a slot holds.")
    else:
        budget = prompt_budget(max_len, params.max_tokens)
        system = req.system
        if isinstance(req, DocumentChatRequest) and req.system_for is not None:
            system, fitted["document_parts"] = fit_document(ref.prompt_ids, req, budget)
            fitted["system"] = system
        ids, fitted["dropped_turns"] = fit_history(ref.prompt_ids, system, req.history, req.prompt, budget)
    fitted["prompt_tokens"] = len(ids)
    stream = TextStream(ref.tokenizer, params.stop)

    def on_token(seq, token) -> bool:
        piece = stream.push(token)
        handle._emit(Event("delta", handle.id, text=piece, tokens=[token]))
        return stream.stopped  # a stop string ends the answer here

    def on_finish(seq):
        rest = stream.flush()
        if rest:
            handle._emit(Event("delta", handle.id, text=rest))
        # A cancelled answer is still a result: the tokens produced so far, marked "cancelled". The text is
        # what was streamed (a half-written character at the end is left out, never shown as U+FFFD).
        result = {
            "text": stream.text,
            "tokens": list(seq.tokens),
            "finish_reason": seq.finish_reason,
            "stats": {"prompt_tokens": len(ids), **seq.timings()},
            **{k: v for k, v in fitted.items() if k != "prompt_tokens"},
        }
        if "dropped_turns" in fitted:
            result["stats"]["dropped_turns"] = fitted["dropped_turns"]
        handle._emit(Event("finished", handle.id, result=result))

    seq = Sequence(ids, params.max_tokens, ref.stop_ids, params=params, on_token=on_token, on_finish=on_finish,
                   handle=handle)
    handle._emit(Event("started", handle.id, result=dict(fitted)))  # how the prompt was fitted
    lane.add(seq)
    return [seq]
