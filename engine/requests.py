"""Turn a chat request into a sequence on a lane, and its tokens back into events and a result.

Runs on the engine thread. The rules (chat template, stop tokens, sampling) are the reference
decoder's, so the engine's output is held to the same tokens. (Transcription requests:
:func:`engine.transcribe.start_transcription`.)
"""

from __future__ import annotations

from engine.chat_reference import build_messages
from engine.errors import RequestError
from engine.models import CHAT
from engine.scheduler import Sequence
from engine.text_stream import TextStream


def start_chat(engine, handle) -> list[Sequence]:
    from engine.engine import Event

    req = handle.request
    params = req.params.validate()
    lane = engine.lane(req.model, CHAT)
    ref = engine.reference(req.model)
    ids = req.prompt_ids or ref.prompt_ids(build_messages(req.prompt, req.system, req.history))
    if len(ids) >= lane.decoder.max_len:
        raise RequestError(f"The prompt is {len(ids)} tokens, more than the {lane.decoder.max_len} a slot holds.")
    stream = TextStream(ref.tokenizer, params.stop)

    def on_token(seq, token) -> bool:
        piece = stream.push(token)
        handle._emit(Event("delta", handle.id, text=piece, tokens=[token]))
        return stream.stopped  # a stop string ends the answer here

    def on_finish(seq):
        rest = stream.flush()
        if rest:
            handle._emit(Event("delta", handle.id, text=rest))
        # A cancelled answer is still a result: the tokens produced so far, marked "cancelled".
        result = {
            "text": stream.text if stream.stopped else ref.tokenizer.decode(seq.tokens, skip_special_tokens=True),
            "tokens": list(seq.tokens),
            "finish_reason": seq.finish_reason,
            "stats": {"prompt_tokens": len(ids), **seq.timings()},
        }
        handle._emit(Event("finished", handle.id, result=result))

    seq = Sequence(ids, params.max_tokens, ref.stop_ids, params=params, on_token=on_token, on_finish=on_finish,
                   handle=handle)
    handle._emit(Event("started", handle.id))
    lane.add(seq)
    return [seq]
