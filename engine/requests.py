"""Turn a request into sequences on a lane, and their tokens back into events and a result.

Runs on the engine thread. Chat: one sequence. Transcription: one sequence per 30-second
window, all queued at once, so windows of one long file (and of many files) share the slots.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from engine.audio import SAMPLE_RATE, load_audio
from engine.chat_reference import ChatReference, build_messages
from engine.errors import CadenceError, RequestError
from engine.models import CHAT, WHISPER
from engine.scheduler import Sequence
from engine.transcribe import LOGPROB_THRESHOLD, NO_SPEECH_THRESHOLD
from engine.transcript import Segment, Transcript
from engine.whisper_features import FRAMES_PER_SECOND, WINDOW_FRAMES, log_mel, pad_window, windows
from engine.whisper_reference import WhisperReference


def start_chat(engine, handle) -> list[Sequence]:
    from engine.engine import Event

    req = handle.request
    params = req.params.validate()
    lane = engine.lane(req.model, CHAT)
    ref = ChatReference(engine.loaded(req.model))
    ids = req.prompt_ids or ref.prompt_ids(build_messages(req.prompt, req.system, req.history))
    if len(ids) >= lane.decoder.max_len:
        raise RequestError(f"The prompt is {len(ids)} tokens, more than the {lane.decoder.max_len} a slot holds.")
    tokenizer = ref.tokenizer

    def on_token(seq, token):
        handle._emit(Event("delta", handle.id, text=tokenizer.decode([token]), tokens=[token]))

    def on_finish(seq):
        if seq.finish_reason == "cancelled" and not seq.tokens:
            pass
        result = {
            "text": tokenizer.decode(seq.tokens, skip_special_tokens=True),
            "tokens": list(seq.tokens),
            "finish_reason": seq.finish_reason,
            "stats": {"prompt_tokens": len(ids), **seq.timings()},
        }
        handle._emit(Event("finished", handle.id, result=result))

    seq = Sequence(ids, params.max_tokens, ref.stop_ids, params=params, on_token=on_token, on_finish=on_finish)
    seq.handle = handle
    handle._emit(Event("started", handle.id))
    lane.add(seq)
    return [seq]


def start_transcription(engine, handle) -> list[Sequence]:
    from engine.engine import Event

    req = handle.request
    lane = engine.lane(req.model, WHISPER)
    loaded = engine.loaded(req.model)
    ref = WhisperReference(loaded)
    tok = ref.tok
    name = req.name or (str(req.audio) if not isinstance(req.audio, np.ndarray) else "audio")
    samples = req.audio if isinstance(req.audio, np.ndarray) else load_audio(req.audio)
    if samples.size < SAMPLE_RATE // 10:
        raise CadenceError(f"{name} is too short to transcribe ({samples.size / SAMPLE_RATE:.2f} s).")
    language = req.language
    if not tok.multilingual:
        if language not in (None, "en") or req.task == "translate":
            raise RequestError(f"{loaded.source.name} is English-only.")
        language = "en"
    elif language is not None and language not in tok.languages:
        raise RequestError(f"Unknown language code '{language}'.")
    t0 = time.perf_counter()
    features = log_mel(samples, loaded.model.config.num_mel_bins)
    if language is None:
        language, _ = ref.detect_language(ref.encode(pad_window(features[:, :WINDOW_FRAMES])))
    prompt = tok.sot_sequence(language, req.task) + [tok.no_timestamps]
    spans = list(windows(features))
    duration = samples.size / SAMPLE_RATE
    done: dict[int, Sequence] = {}
    suppress = torch.tensor(tok.suppressed_tokens())
    begin = torch.tensor(tok.begin_suppress)
    handle._emit(Event("started", handle.id, total=len(spans)))

    def prepare(index):
        def _prepare(seq, slot):
            window = torch.from_numpy(spans[index][2])[None].to(lane.decoder.cross_k.device,
                                                                 lane.decoder.cross_k.dtype)
            lane.decoder.set_memory(slot, lane.decoder.encode(window)[0])
        return _prepare

    def on_finish(seq):
        done[seq.window] = seq
        if seq.finish_reason == "cancelled":
            if len(done) == len(spans) or not handle._final:
                handle._emit(Event("failed", handle.id, message=f"{name}: transcription was cancelled."))
            return
        handle._emit(Event("progress", handle.id, done=len(done), total=len(spans),
                           text=tok.decode(seq.tokens).strip()))
        if len(done) < len(spans):
            return
        segments, n_tokens = [], 0
        for index, (seek, size, _) in enumerate(spans):
            s = done[index]
            n_tokens += len(s.tokens)
            no_speech = float(torch.softmax(s.probe_logits, -1)[tok.no_speech])
            avg_logprob = s.logprob_sum / (len(s.tokens) + 1)
            if no_speech > NO_SPEECH_THRESHOLD and avg_logprob <= LOGPROB_THRESHOLD:
                continue
            text = tok.decode(s.tokens).strip()
            if text:
                segments.append(Segment(seek / FRAMES_PER_SECOND, min((seek + size) / FRAMES_PER_SECOND, duration),
                                        text, list(s.tokens)))
        seconds = time.perf_counter() - t0
        transcript = Transcript(name, " ".join(s.text for s in segments), language, duration, segments, {
            "tokens": n_tokens, "seconds": round(seconds, 3),
            "tok_s": round(n_tokens / seconds, 1) if seconds > 0 else 0.0,
            "realtime_factor": round(duration / seconds, 1) if seconds > 0 else 0.0,
        })
        handle._emit(Event("finished", handle.id, result=transcript))

    seqs = []
    for index in range(len(spans)):
        seq = Sequence(list(prompt), lane.decoder.max_len - len(prompt), {tok.eot}, suppress=suppress,
                       begin_suppress=begin, prepare=prepare(index), on_finish=on_finish,
                       probe_row=prompt.index(tok.sot))
        seq.window = index
        seq.handle = handle
        lane.add(seq)
        seqs.append(seq)
    return seqs
