"""Sampling rules per slot: penalties, min-p and stop strings are honoured in the batched path.

Each penalty test runs four differently configured requests in one batch and holds each to the
single-stream reference decoder run with the same settings; a batched path that dropped (or
mixed up) any slot's penalties would give the unpenalized answer, which differs.
"""

import pytest
import torch
from parity import assert_same_or_near_tie

from engine.chat.reference import build_messages
from engine import ChatRequest
from engine.errors import CadenceError
from engine.picking import TokenPicker, pick_token
from engine.sampling import SamplingParams
from engine.text_stream import TextStream

REPEAT = "Repeat the word hello five times."

PENALIZED = [
    SamplingParams(max_tokens=24, repetition_penalty=1.3),
    SamplingParams(max_tokens=24, presence_penalty=1.5),
    SamplingParams(max_tokens=24, frequency_penalty=1.0),
    SamplingParams(max_tokens=24, repetition_penalty=1.1, frequency_penalty=0.5),
]


def test_every_slot_honours_its_own_penalties(engine4, chat_ref):
    ids = chat_ref.prompt_ids(build_messages(REPEAT))
    plain = chat_ref.generate(ids, SamplingParams(max_tokens=24)).tokens
    handles = [engine4.submit(ChatRequest(REPEAT, params=p)) for p in PENALIZED]
    for params, handle in zip(PENALIZED, handles):
        got = handle.result(300).tokens
        want = chat_ref.generate(ids, params).tokens
        assert want != plain, f"{params} should change this answer"
        assert_same_or_near_tie(chat_ref, ids, got, want, params)


def test_stop_string_ends_the_answer_in_its_slot_only(engine4, chat_ref):
    numbers = "List the numbers from one to ten, one per line."
    stopped = engine4.submit(ChatRequest(numbers, params=SamplingParams(max_tokens=40, stop=["3."])))
    beside = engine4.submit(ChatRequest(numbers, params=SamplingParams(max_tokens=40)))
    deltas, result = [], None
    for event in stopped:
        if event.kind == "delta":
            deltas.append(event.text)
        elif event.kind == "finished":
            result = event.answer
    full = beside.result(300)
    assert result.finish_reason == "stop"
    assert result.text == full.text[: full.text.index("3.")]  # ends just before the stop string
    assert "".join(deltas) == result.text  # streamed text never showed the stop string
    assert full.finish_reason == "length" and "3." in full.text  # the other slot went on


def test_reference_decoder_honours_stop_strings(chat_ref):
    ids = chat_ref.prompt_ids(build_messages(REPEAT))
    result = chat_ref.generate(ids, SamplingParams(max_tokens=24, stop=[", hello,"]))
    assert result.finish_reason == "stop" and result.text == "Hello"


def test_text_stream_holds_back_partial_characters_and_stop_prefixes(smollm):
    tok = smollm.tokenizer
    text = "Café ☕ costs 3 euros. END of story"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, stop=["END"])
    pieces = [stream.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert stream.stopped and stream.text == "Café ☕ costs 3 euros. "
    assert "".join(pieces) + stream.flush() == stream.text
    plain = TextStream(tok)
    assert "".join(plain.push(t) for t in ids) + plain.flush() == text


def test_min_p_removes_unlikely_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, min_p=0.4, seed=0)  # keeps p >= 0.2: tokens 0 and 1
    g = params.generator()
    drawn = {pick_token(logits, params, g) for _ in range(400)}
    assert drawn == {0, 1}
    loose = SamplingParams(temperature=1.0, seed=0)
    g = loose.generator()
    assert {pick_token(logits, loose, g) for _ in range(400)} == {0, 1, 2, 3}


def test_penalties_count_the_output():
    picker = TokenPicker(SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), prompt=[0])
    logits = torch.zeros(4)
    picker.penalize(logits)
    for token in (2, 2, 3):
        picker.observe(token)
    assert picker.penalize(logits).tolist() == [0.0, 0.0, -2.0, -1.5]
    rep = TokenPicker(SamplingParams(repetition_penalty=2.0), prompt=[0, 1])
    assert rep.penalize(torch.tensor([4.0, -4.0, 4.0, -4.0])).tolist() == [2.0, -8.0, 4.0, -4.0]


def test_seeded_sampling_with_every_rule_does_not_depend_on_the_batch(engine4, engine_off):
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.3, frequency_penalty=0.2, seed=77, max_tokens=24)
    alone = engine_off.submit(ChatRequest("Tell me about owls.", params=params)).result(300)
    crowd = [engine4.submit(ChatRequest(REPEAT, params=SamplingParams(temperature=1.0, seed=i, max_tokens=24)))
             for i in range(3)]
    together = engine4.submit(ChatRequest("Tell me about owls.", params=params)).result(300)
    for h in crowd:
        h.result(300)
    assert alone.tokens == together.tokens


@pytest.mark.parametrize("field,value,words", [
    ("min_p", 1.5, "min-p"), ("repetition_penalty", 0, "repetition penalty"),
    ("presence_penalty", 3, "presence penalty"), ("frequency_penalty", -5, "frequency penalty"),
    ("stop", [""], "Stop strings"), ("top_k", -1, "top-k"),
])
def test_invalid_sampling_values_get_a_sentence(engine4, field, value, words):
    with pytest.raises(CadenceError, match=words):
        engine4.submit(ChatRequest("hi", params=SamplingParams(**{field: value}))).result(60)


def test_streamed_text_equals_a_full_decode_over_a_long_answer(smollm):
    """The incremental decode gives exactly the text of decoding all tokens at once."""
    tok = smollm.tokenizer
    text = " ".join(["Naïve café ☕ costs 3.5 €, don't   stop; 東京 ok!"] * 40)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tok)
    streamed = "".join(stream.push(t) for t in ids) + stream.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=True) == text


def test_the_fast_argmax_picks_what_torch_argmax_picks():
    """Greedy's argmax goes through NumPy for CPU float32 rows: the same index as torch.argmax for ties
    (the first), NaN (counted largest), all -inf, strided rows and other dtypes."""
    from engine.picking import argmax

    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(49152, generator=g) for _ in range(20)]
    tie = torch.zeros(100)
    tie[[7, 3, 50]] = 2.0
    nan = torch.randn(100, generator=g)
    nan[[40, 9]] = float("nan")
    rows += [tie, nan, torch.full((64,), -float("inf")), torch.randn(8, 300, generator=g)[:, 5]]
    rows += [torch.randn(300, generator=g).to(torch.bfloat16)]
    for row in rows:
        assert argmax(row) == int(torch.argmax(row))
    assert argmax(tie) == 3 and argmax(nan) == 9
