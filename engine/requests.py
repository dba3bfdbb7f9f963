"""Turn a request into sequences on a lane, and their tokens back into events and a result.

Runs on the engine thread. Chat: one sequence. Transcription: one sequence per 30-second
window, all queued at once, so windows of one long file (and of many files) share the slots.
The rules (chat template, suppression, silence skipping, segment assembly) are the reference
decoders', so the engine's output is held to the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.audio import load_audio
from engine.chat_reference import build_messages
from engine.errors import RequestError
from engine.models import CHAT, WHISPER
from engine.scheduler import Sequence
from engine.text_stream import TextStream
from engine.transcribe import assemble_transcript, plan_transcription
from engine.whisper_reference import WindowResult


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


def start_transcription(engine, handle) -> list[Sequence]:
    from engine.engine import Event

    req = handle.request
    lane = engine.lane(req.model, WHISPER)
    ref = engine.reference(req.model)
    decoder = lane.decoder
    name = str(req.audio) if not isinstance(req.audio, np.ndarray) else (req.name or "audio")
    samples = req.audio if isinstance(req.audio, np.ndarray) else load_audio(req.audio)
    plan = plan_transcription(ref, samples, req.language, req.task, req.name or name)
    results: dict[int, WindowResult] = {}
    handle._emit(Event("started", handle.id, total=len(plan.spans)))

    def prepare(seq, slot):  # on joining a slot: encode this window into the slot's cross-attention memory,
        # one encoder layer per step while other slots decode (a generator the lane advances)
        window = torch.from_numpy(plan.spans[seq.index][2])[None].to(decoder.device, decoder.cross_k.dtype)
        encoded = yield from decoder.encode_in_steps(window)
        decoder.set_memory(slot, encoded[0])

    def on_finish(seq):
        if handle._final is not None:  # the request already failed or was cancelled
            return
        if seq.finish_reason == "cancelled":
            handle._emit(Event("failed", handle.id, message=f"{plan.name}: transcription was cancelled."))
            return
        results[seq.index] = WindowResult(seq.tokens, ref.no_speech_probability(seq.probe_logits),
                                          seq.logprob_sum / (len(seq.tokens) + 1))
        handle._emit(Event("progress", handle.id, done=len(results), total=len(plan.spans),
                           text=ref.tok.decode(seq.tokens).strip()))
        if len(results) == len(plan.spans):
            ordered = [results[i] for i in range(len(plan.spans))]
            handle._emit(Event("finished", handle.id, result=assemble_transcript(plan, ref.tok, ordered)))

    seqs = []
    for index in range(len(plan.spans)):
        seq = Sequence(list(plan.prompt), decoder.max_len - len(plan.prompt), {ref.tok.eot},
                       suppress=ref.suppress, begin_suppress=ref.begin_suppress, prepare=prepare,
                       on_finish=on_finish, probe_row=plan.prompt.index(ref.tok.sot), track_logprob=True,
                       handle=handle, index=index)
        lane.add(seq)
        seqs.append(seq)
    return seqs
