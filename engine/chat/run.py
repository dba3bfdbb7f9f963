"""Turn a chat request into a sequence on a lane, and its tokens back into events and a result.

Runs on the engine thread. The rules (chat template, stop tokens, sampling) are the reference
decoder's, so the engine's output is held to the same tokens. (Transcription requests:
:class:`engine.whisper.run.TranscriptionRun`.)

Fitting the context (here because the tokenizer and the slot length live on the engine thread):
the prompt gets at most ``max_len - room`` tokens of a slot, where ``room`` keeps space for the
answer: its max tokens, but at most half the slot (the lane still stops any answer at the slot's
end). When system prompt + history + message are longer, the oldest turns of the history are
left out (never the system prompt) and :class:`~engine.api.PromptFitting` says how many; when the
system prompt and the message alone are too long, the request fails with a sentence. A
:class:`DocumentChatRequest` also carries a long text (a transcript) for its system prompt,
which is cut between parts to fit.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.api import ChatAnswer, ChatStarted, Delta, DocumentChatRequest, Finished, Handle, PromptFitting
from engine.chat.reference import ChatReference, build_messages
from engine.errors import RequestError
from engine.scheduler import Sequence
from engine.text_stream import TextStream

DOCUMENT_SHARE = 0.75  # a document's system prompt + first message take at most this share of the prompt budget
MAX_CHARS_PER_TOKEN = 16  # no tokenizer packs more natural text into one token: bounds the document search


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


class ChatRun:
    """One chat request on its model's lane (engine thread): the prompt fitted to a slot, one sequence,
    and its tokens turned into events and a :class:`ChatAnswer`."""

    def __init__(self, handle: Handle, lane, reference: ChatReference):
        self.handle, self.lane, self.ref = handle, lane, reference

    def fit(self, params) -> tuple[list[int], PromptFitting]:
        """The prompt ids and how they were fitted (RequestError when they cannot fit)."""
        req, ref = self.handle.request, self.ref
        max_len = self.lane.decoder.max_len
        if req.prompt_ids:  # given ids bypass the template and the fitting
            ids = list(req.prompt_ids)
            if len(ids) >= max_len:
                raise RequestError(f"The prompt is {len(ids)} tokens, more than the {max_len} a slot holds.")
            return ids, PromptFitting(prompt_tokens=len(ids))
        fitting = PromptFitting()
        budget = prompt_budget(max_len, params.max_tokens)
        system = req.system
        if isinstance(req, DocumentChatRequest) and req.system_for is not None:
            system, fitting.document_parts = fit_document(ref.prompt_ids, req, budget)
            fitting.system = system
        ids, fitting.dropped_turns = fit_history(ref.prompt_ids, system, req.history, req.prompt, budget)
        fitting.prompt_tokens = len(ids)
        return ids, fitting

    def start(self) -> list[Sequence]:
        handle = self.handle
        params = handle.request.params.validate()
        ids, fitting = self.fit(params)
        stream = TextStream(self.ref.tokenizer, params.stop)

        def on_token(seq, token) -> bool:
            handle.emit(Delta(handle.id, text=stream.push(token), tokens=[token]))
            return stream.stopped  # a stop string ends the answer here

        def on_finish(seq):
            rest = stream.flush()
            if rest:
                handle.emit(Delta(handle.id, text=rest))
            # The text is what was streamed (a half-written character at the end is left out, never U+FFFD).
            stats = {"prompt_tokens": len(ids), "dropped_turns": fitting.dropped_turns, **seq.timings()}
            answer = ChatAnswer(text=stream.text, tokens=list(seq.tokens), finish_reason=seq.finish_reason,
                                stats=stats, fitting=fitting,
                                hidden=torch.stack(seq.hidden_rows) if seq.hidden_rows else None)
            handle.emit(Finished(handle.id, answer=answer))

        seq = Sequence(ids, params.max_tokens, self.ref.stop_ids, params=params, on_token=on_token,
                       on_finish=on_finish, handle=handle, hidden_rows=[] if handle.request.keep_hidden else None)
        handle.emit(ChatStarted(handle.id, fitting=fitting))
        self.lane.add(seq)
        return [seq]
