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


def test_a_ragged_step_batch_holds_each_rows_slot_position_kind_and_mask():
    """Two sequences, three rows and one, in slots 2 and 0: the padded layout, the real rows in order,
    which rows are generated tokens, and the mask (a row sees its own position and those before it)."""
    batch = StepBatch.build([2, 0], [[5, 6, 7], [8]], [10, 4], prompt_lengths=[12, 0])
    assert batch.tokens.tolist() == [[5, 6, 7], [8, 0, 0]] and batch.lengths.tolist() == [3, 1]
    assert batch.positions.tolist() == [[10, 11, 12], [4, 5, 6]]
    assert batch.valid.tolist() == [[True, True, True], [True, False, False]]
    assert not batch.uniform and batch.first_slot is None and batch.kv_len == 64
    assert batch.row_slots.tolist() == [2, 2, 2, 0] and batch.row_positions.tolist() == [10, 11, 12, 4]
    assert batch.generated.tolist() == [0, 0, 1, 1]
    assert batch.flat(batch.tokens).tolist() == [5, 6, 7, 8] and batch.last_rows().tolist() == [2, 3]
    assert batch.blocked.shape == (2, 1, 3, 64)
    assert batch.blocked[0, 0, 1].tolist() == [i > 11 for i in range(64)]
    windowed = batch.window_blocked(2)  # a row at p sees p - 1 and p
    assert windowed[0, 0, 2].tolist() == [not 11 <= i <= 12 for i in range(64)]
    even = StepBatch.build([1, 2], [[3], [4]], [0, 70])
    assert even.uniform and even.first_slot == 1 and even.kv_len == 128 and even.generated is None
    assert even.row_positions.tolist() == [0, 70] and even.flat(even.tokens).tolist() == [3, 4]
