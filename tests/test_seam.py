"""The batched step's attention gives a row the same result whatever shares its step, on this machine:
a row decoded beside another slot's prompt, and drafts checked several rows at once, equal the same
rows run one at a time, to the last bit (the tokens of batched and drafted decoding rest on it)."""

import pytest
import torch

from engine.families.llama import LlamaBatched
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
