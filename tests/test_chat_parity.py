"""The reference chat decoder: greedy equals transformers generate; sampling is seeded and checked."""

import pytest
import torch

from engine.chat.reference import ChatReference, build_messages
from engine.errors import RequestError
from engine.sampling import SamplingParams

PROMPTS = [
    ("You are a helpful assistant.", "What is the capital of France?"),
    (None, "Write a haiku about autumn rain."),
    ("You answer in one sentence.", "Explain why the sky is blue."),
    (None, "List three fruits that are red."),
]


@pytest.fixture(scope="module")
def chat(smollm):
    return ChatReference(smollm)


@pytest.mark.parametrize("system, prompt", PROMPTS)
def test_greedy_equals_transformers_generate(chat, smollm, system, prompt):
    ids = chat.prompt_ids(build_messages(prompt, system))
    result = chat.generate(ids, SamplingParams(max_tokens=40))
    expected = smollm.model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=40, do_sample=False, pad_token_id=smollm.tokenizer.eos_token_id,
    )[0, len(ids):].tolist()
    if result.finish_reason == "stop":
        assert expected[-1] in chat.stop_ids
        expected = expected[:-1]
    assert result.tokens == expected
    assert result.text.strip()


def test_chat_template_is_applied(chat):
    ids = chat.prompt_ids(build_messages("Hello there", "Be brief."))
    text = chat.tokenizer.decode(ids)
    assert "Be brief." in text and "Hello there" in text and text.rstrip().endswith("assistant")


def test_seeded_sampling_is_reproducible_and_seed_dependent(chat):
    ids = chat.prompt_ids(build_messages("Tell me a story about a dragon."))
    a = chat.generate(ids, SamplingParams(temperature=0.9, seed=7, max_tokens=24))
    b = chat.generate(ids, SamplingParams(temperature=0.9, seed=7, max_tokens=24))
    others = {tuple(chat.generate(ids, SamplingParams(temperature=0.9, seed=s, max_tokens=24)).tokens) for s in (1, 2, 3)}
    assert a.tokens == b.tokens
    assert len(others | {tuple(a.tokens)}) > 1


def test_max_tokens_is_honoured(chat):
    ids = chat.prompt_ids(build_messages("Count from one to one hundred in words."))
    result = chat.generate(ids, SamplingParams(max_tokens=5))
    assert len(result.tokens) == 5 and result.finish_reason == "length"


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(temperature=-1), "Temperature"),
        (SamplingParams(top_p=1.5), "top-p"),
        (SamplingParams(top_k=-2), "top-k"),
        (SamplingParams(max_tokens=0), "max tokens"),
    ],
)
def test_invalid_sampling_values_are_refused(chat, params, message):
    ids = chat.prompt_ids(build_messages("Hi"))
    with pytest.raises(RequestError, match=message):
        chat.generate(ids, params)


def test_empty_message_is_refused(chat):
    with pytest.raises(RequestError, match="empty"):
        chat.prompt_ids(build_messages("   "))
