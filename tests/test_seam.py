"""The batched step's attention gives a row the same result whatever shares its step, on this machine:
a row decoded beside another slot's prompt, and drafts checked several rows at once, equal the same
rows run one at a time, to the last bit (the tokens of batched and drafted decoding rest on it)."""

import pytest
import torch

from engine.families.llama import LlamaBatched
from engine.kernels import precisions_on
from engine.seam import StepBatch, attention_way

PROMPT = [1, 9690, 198, 1204, 314, 5, 77, 123, 456, 789, 1011, 42]
OTHER = [1, 9690, 198, 2222, 333, 44, 55, 66, 77]
DRAFTS = [7, 8, 9, 10]


def _logits(model, slots, rows, starts) -> torch.Tensor:
    out = model.forward(StepBatch.build(slots, rows, starts))
    return out.reshape(-1, out.shape[-1])


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_rows_are_the_same_whatever_shares_their_step(smollm, precision):
    alone = LlamaBatched(smollm, width=1, max_len=256, precision=precision)
    shared = LlamaBatched(smollm, width=2, max_len=256, precision=precision)
    for model in (alone, shared):
        model.forward(StepBatch.build([0], [PROMPT], [0]))
    one_by_one = [_logits(alone, [0], [[t]], [len(PROMPT) + i])[0] for i, t in enumerate(DRAFTS)]
    first_beside_a_prompt = _logits(shared, [0, 1], [[DRAFTS[0]], OTHER], [len(PROMPT), 0])[0]
    assert torch.equal(first_beside_a_prompt, one_by_one[0]), attention_way(torch.device("cpu"), torch.float32)
    rest_at_once = _logits(shared, [0], [DRAFTS[1:]], [len(PROMPT) + 1])
    assert all(torch.equal(rest_at_once[i], one_by_one[i + 1]) for i in range(len(DRAFTS) - 1))


WHISPER_PROMPT = [50257, 50362, 383, 2068, 7586]  # <|startoftranscript|><|notimestamps|> The quick brown


@pytest.mark.parametrize("precision", [p for p in ("float32", "bfloat16") if p in precisions_on("cpu")])
def test_whisper_rows_over_the_encoder_memory_are_the_same_whatever_shares_their_step(tiny, precision):
    """Cross-attention over the encoder memory, kept in bfloat16 where a way keeps rows independent of
    their batch for it (it never changes length): a slot's rows decoded alone equal the same rows decoded
    beside another slot's prompt, and several drafts checked at once."""
    from engine.families.whisper import WhisperBatched, memory_dtype

    alone = WhisperBatched(tiny, width=1, precision=precision)
    shared = WhisperBatched(tiny, width=3, precision=precision)
    kept = memory_dtype(precision, torch.device("cpu"))
    assert alone.cross_k.dtype == shared.cross_k.dtype == kept
    if precision == "bfloat16":  # the memory in the activations' dtype exactly where a way holds for it
        held = attention_way(torch.device("cpu"), torch.bfloat16, fixed_memory=True) != "fused"
        assert (kept == torch.bfloat16) == held
    g = torch.Generator().manual_seed(3)
    memories = [torch.randn(1500, alone.d_model, generator=g).to(alone.dtype) for _ in range(3)]
    alone.set_memory(0, memories[0])
    for slot, memory in enumerate(memories):
        shared.set_memory(slot, memory)
    for model in (alone, shared):
        model.forward(StepBatch.build([0], [WHISPER_PROMPT], [0]))
    one_by_one = [_logits(alone, [0], [[t]], [len(WHISPER_PROMPT) + i])[0] for i, t in enumerate(DRAFTS)]
    beside = _logits(shared, [0, 1, 2], [[DRAFTS[0]], WHISPER_PROMPT[:3], WHISPER_PROMPT], [len(WHISPER_PROMPT), 0, 0])
    assert torch.equal(beside[0], one_by_one[0])
    rest_at_once = _logits(shared, [0], [DRAFTS[1:]], [len(WHISPER_PROMPT) + 1])
    assert all(torch.equal(rest_at_once[i], one_by_one[i + 1]) for i in range(len(DRAFTS) - 1))
