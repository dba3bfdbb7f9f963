"""The batched engine: exact against the single-stream reference, alone and batched.

Invariants: N=1 exact; batched = serial (different lengths, joins in mid-flight, a cancellation);
seeded sampling independent of the batch. A mismatch is accepted only at a floating-point
near-tie (gap between the two best reference logits below 1e-3) at the first differing token.
"""

import pytest
from parity import assert_same_or_near_tie

from engine.chat.reference import build_messages
from engine import ChatRequest, TranscribeRequest
from engine.errors import CadenceError
from engine.sampling import SamplingParams
from engine.whisper.pipeline import transcribe_file
from engine.whisper.reference import WhisperReference

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn rain.",
    "List three fruits that are red.",
    "Explain in two sentences why the sea is salty.",
    "Name a famous painter.",
    "Give me a tip for sleeping better.",
]


def test_single_request_is_exact_with_batching_on_and_off(engine4, engine_off, chat_ref):
    ids = chat_ref.prompt_ids(build_messages(PROMPTS[1]))
    want = chat_ref.generate(ids, SamplingParams(max_tokens=32)).tokens
    on = engine4.submit(ChatRequest(PROMPTS[1], params=SamplingParams(max_tokens=32))).result(300)
    off = engine_off.submit(ChatRequest(PROMPTS[1], params=SamplingParams(max_tokens=32))).result(300)
    assert on.tokens == off.tokens  # the same kernels alone: byte-identical
    assert_same_or_near_tie(chat_ref, ids, on.tokens, want)  # and the transformers yardstick


def test_batched_chat_equals_serial_with_joins_and_a_cancellation(engine4, chat_ref):
    params = SamplingParams(max_tokens=40)
    handles = [engine4.submit(ChatRequest(p, params=params)) for p in PROMPTS]
    doomed = engine4.submit(ChatRequest("Write a very long essay about the history of Rome.",
                                        params=SamplingParams(max_tokens=200)))
    for event in doomed:  # cancel once it is decoding beside the others
        if event.kind == "delta" and len(event.tokens):
            doomed.cancel()
            break
    results = [h.result(600) for h in handles]
    assert doomed.result(600).finish_reason == "cancelled"
    for prompt, result in zip(PROMPTS, results):
        ids = chat_ref.prompt_ids(build_messages(prompt))
        want = chat_ref.generate(ids, params).tokens
        assert_same_or_near_tie(chat_ref, ids, result.tokens, want)
        stats = result.stats
        assert stats["tokens"] == len(result.tokens)
        assert stats["time_to_first_token"] is not None and stats["end_to_end"] >= stats["time_to_first_token"]


def test_seeded_sampling_does_not_depend_on_the_batch(engine4, engine_off):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24)
    alone = engine_off.submit(ChatRequest("Tell me about dragons.", params=params)).result(300)
    crowd = [engine4.submit(ChatRequest(p, params=SamplingParams(temperature=0.8, seed=i, max_tokens=24)))
             for i, p in enumerate(PROMPTS[:3])]
    together = engine4.submit(ChatRequest("Tell me about dragons.", params=params)).result(300)
    for h in crowd:
        h.result(300)
    assert alone.tokens == together.tokens


def test_batched_whisper_equals_the_reference(engine4, tiny, speech):
    ref = WhisperReference(tiny)
    names = ["long", "fox", "report", "budget"]
    handles = [engine4.submit(TranscribeRequest(speech[n])) for n in names]
    for name, handle in zip(names, handles):
        got = handle.result(600)
        want = transcribe_file(ref, speech[name])
        assert [s.tokens for s in got.segments] == [s.tokens for s in want.segments], name
        assert [(s.start, s.end) for s in got.segments] == [(s.start, s.end) for s in want.segments]


def test_batched_whisper_with_an_initial_prompt_equals_the_reference(engine4, tiny, speech):
    """The initial prompt rides ahead of every window, timestamps and word alignment included."""
    ref, prompt = WhisperReference(tiny), "Kwik Braun Phocks, Finance Team."
    names = ["long", "fox"]
    handles = [engine4.submit(TranscribeRequest(speech[n], timestamps=True, words=True, initial_prompt=prompt))
               for n in names]
    for name, handle in zip(names, handles):
        got = handle.result(600)
        want = transcribe_file(ref, speech[name], timestamps=True, words=True, initial_prompt=prompt)
        assert [s.tokens for s in got.segments] == [s.tokens for s in want.segments], name
        assert [[(w.start, w.end) for w in s.words] for s in got.segments] == \
            [[(w.start, w.end) for w in s.words] for s in want.segments]
    assert "Phocks" in handles[1].result().text


def test_kept_hidden_states_are_the_ones_behind_each_token(engine4, smollm, chat_ref):
    """ChatRequest.keep_hidden (the MTP heads' training data): with three answers batched and drafting
    as shipped, each answer carries one hidden state per token (plus the stop token's), each of them
    the state that chose its token, as a teacher-forced pass through the transformers model gives it;
    answers without it carry none, and the record of an answer leaves it out."""
    import torch

    from engine.mtp.data import _teacher_force_chat

    params = SamplingParams(max_tokens=24)
    prompts = PROMPTS[:3]
    handles = [engine4.submit(ChatRequest(p, params=params, keep_hidden=True)) for p in prompts]
    plain = engine4.submit(ChatRequest(prompts[0], params=params)).result(300)
    answers = [h.result(300) for h in handles]
    assert plain.hidden is None and "hidden" not in answers[0].to_json()
    assert answers[0].tokens == plain.tokens  # keeping them changes nothing else
    eos = min(chat_ref.stop_ids)
    ids = [chat_ref.prompt_ids(build_messages(p)) for p in prompts]
    chosen = [a.tokens + ([eos] if a.finish_reason == "stop" else []) for a in answers]
    assert any(a.finish_reason == "stop" for a in answers) and any(a.finish_reason == "length" for a in answers)
    forced = _teacher_force_chat(smollm, ids, chosen, [""] * 3)
    at = 0
    for answer, tokens in zip(answers, chosen):
        hidden = answer.hidden.float()
        assert hidden.shape == (len(tokens), smollm.model.config.hidden_size)
        with torch.no_grad():
            assert (hidden @ smollm.model.lm_head.weight.T).argmax(-1).tolist() == tokens
        want = forced.hidden[at : at + len(tokens)]
        assert torch.allclose(hidden, want, rtol=1e-3, atol=1e-3), (hidden - want).abs().max()
        at += len(tokens)


def test_events_stream_in_order(engine4):
    handle = engine4.submit(ChatRequest("Say hello.", params=SamplingParams(max_tokens=8)))
    kinds = [e.kind for e in handle]
    assert kinds[0] == "started" and kinds[-1] == "finished" and "delta" in kinds


def test_bad_requests_fail_with_a_sentence_and_the_engine_keeps_serving(engine4, tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio at all" * 10)
    with pytest.raises(CadenceError, match="not audio"):
        engine4.submit(TranscribeRequest(bad)).result(60)
    with pytest.raises(CadenceError, match="Temperature"):
        engine4.submit(ChatRequest("hi", params=SamplingParams(temperature=-1))).result(60)
    with pytest.raises(CadenceError, match="Unknown model"):
        engine4.submit(ChatRequest("hi", model="no-such-model")).result(60)
    ok = engine4.submit(ChatRequest("Name a color.", params=SamplingParams(max_tokens=4))).result(300)
    assert ok.tokens


def test_lane_reports_bounded_cache_memory(engine4):
    lane = engine4._lanes["smollm2-135m-instruct"]
    assert lane.width == 4
    assert 0 < lane.decoder.cache_bytes < 4 * 2**30


def test_cancelled_transcription_fails_once_and_the_engine_forgets_it(engine4, speech):
    handle = engine4.submit(TranscribeRequest(speech["long"]))  # two windows
    for event in handle:
        if event.kind == "started":
            handle.cancel()
            break
    with pytest.raises(CadenceError, match="cancelled"):
        handle.result(300)
    ok = engine4.submit(TranscribeRequest(speech["fox"])).result(300)
    assert "fox" in ok.text.lower()
    assert handle.events.empty()  # no second terminal event arrived after the first
    assert not engine4._work  # ended requests hold no sequences (nor their logits)
