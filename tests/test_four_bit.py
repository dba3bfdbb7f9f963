"""Weights that already are 4-bit (SmolLM2's layers, converted from the registry's Q4_1 GGUF) kept so under
int8 precision: stored only where they give back every float32 weight bit for bit, their products right
in both ways (float activations for prompt rows, int16-rounded ones for generated rows), each row's result
independent of the rows beside it, and the model's own layers read that way, from the cache too."""

from __future__ import annotations

import pytest
import torch

from engine import native
from engine.kernels import dequantize_q4, quantize_q4_exact


def four_bit_weight(out: int, size: int, seed: int) -> torch.Tensor:
    """A weight of the Q4_1 kind: per 32 inputs, scale * code + minimum, scale and minimum in half precision
    (as a GGUF stores them), computed in float32 as the converter does."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, size // 32, 32), generator=generator).float()
    codes[..., 0], codes[..., 1] = 0, 15  # (Q4_1 sets scale and minimum from each group's range)
    scale = (torch.rand(out, size // 32, 1, generator=generator) * 0.01 + 1e-4).half().float()
    minimum = (-torch.rand(out, size // 32, 1, generator=generator) * 0.08).half().float()
    return (codes * scale + minimum).reshape(out, size)


def test_only_weights_that_are_4_bit_are_kept_so_and_they_come_back_exactly(smollm):
    layer = smollm.model.model.layers[3]
    for weight in (layer.self_attn.q_proj.weight, layer.mlp.down_proj.weight, four_bit_weight(96, 128, 1)):
        parts = quantize_q4_exact(weight)
        assert parts is not None
        codes, scale, minimum = parts
        assert codes.dtype == torch.uint8 and codes.shape == (weight.shape[0], weight.shape[1] // 2)
        assert scale.shape == minimum.shape == (weight.shape[0], weight.shape[1] // 32)
        assert scale.dtype == minimum.dtype == torch.float16  # the GGUF's own half floats, 0.625 bytes a weight
        assert torch.equal(dequantize_q4(*parts), weight.detach().float())
    # float weights, an int8 grid (the output layer is Q8_0), and a width the kernel's blocks do not divide
    assert quantize_q4_exact(torch.randn(64, 128)) is None
    assert quantize_q4_exact(smollm.model.model.embed_tokens.weight[:256]) is None
    assert quantize_q4_exact(four_bit_weight(8, 96, 2)) is None
    # 4-bit, but with a float32 scale no half float holds: not kept (it would not come back exactly)
    codes = torch.randint(0, 16, (8, 4, 32), generator=torch.Generator().manual_seed(3)).float()
    codes[..., 0], codes[..., 1] = 0, 15
    odd = codes * (2.0 ** -10 * (1 + 2.0 ** -15))  # exact in float32 (20 bits), not in a half float (11)
    assert torch.equal(odd / odd.amax(dim=2, keepdim=True) * 15, codes)
    assert quantize_q4_exact(odd.reshape(8, 128)) is None
    assert quantize_q4_exact((codes * 2.0 ** -10).reshape(8, 128)) is not None  # the same with a half float scale


def rounded(x: torch.Tensor, levels: int) -> torch.Tensor:
    """Rows rounded as the integer kernels round them: per 32 inputs to integers in [-levels, levels] (scale:
    the group's largest magnitude / levels, to nearest even), given back in float."""
    groups = x.view(x.shape[0], -1, 32)
    largest = groups.abs().amax(dim=2, keepdim=True)
    inverse = torch.full_like(largest, levels) / largest  # (as the kernel divides: see tests/test_native.py)
    integers = torch.round(groups * torch.where(largest > 0, inverse, torch.zeros_like(largest)))
    return (integers.double() * (largest / levels).double()).view_as(x)


@pytest.mark.parametrize("out,size,with_bias", [(960, 576, True), (576, 1536, False), (51, 64, True)])
def test_4_bit_products_are_the_float_products_and_each_rows_own(out, size, with_bias):
    weight = four_bit_weight(out, size, out)
    codes, scale, minimum = quantize_q4_exact(weight)
    generator = torch.Generator().manual_seed(size)
    bias = torch.randn(out, generator=generator) if with_bias else None
    x = torch.randn(40, size, generator=generator) * torch.rand(40, 1, generator=generator) * 4
    x[0, :32] = 0  # an all-zero group rounds to zeros
    bias_part = bias.double() if with_bias else 0
    exact = x.double() @ weight.double().T + bias_part
    # float activations: float32 sums of the exact weights; rows rounded to int16 (int8): the exact product of
    # that rounding up to float32 sums, within a hundredth of a percent (about half a percent) of the float one
    for kernel, levels, closeness in (("f32x8", 0, 1e-6), ("i16dot", 32767, 1e-4), ("i8dot", 127, 0.02)):
        y = native.int8_linear(x, codes, scale, bias, kernel, minimum=minimum)
        assert y.shape == (40, out) and (y.double() - exact).norm() <= closeness * exact.norm(), kernel
        if levels:
            expected = rounded(x, levels) @ weight.double().T + bias_part
            assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5), (kernel, (y.double() - expected).abs().max())
        for rows in (1, 2, 3, 5, 8, 13, 17):  # the same bits whatever rows share the call
            assert torch.equal(torch.cat([native.int8_linear(c, codes, scale, bias, kernel, minimum=minimum)
                                          for c in x.split(rows)]), y), (kernel, rows)


def test_smollm2s_layers_run_on_their_4_bit_weights_and_reload_from_the_cache(smollm):
    from engine.families.llama import LlamaBatched
    from engine.seam import StepBatch

    built = LlamaBatched(smollm, width=2, precision="int8")
    for layer in built.layers:
        for linear in (layer.qkv, layer.out, layer.gate_up, layer.down):
            assert linear.minimum is not None and linear.q.dtype == torch.uint8
    assert built.lm_head.minimum is None  # the output layer is int8's
    again = LlamaBatched(smollm, width=2, precision="int8")  # from the quantized cache written above
    assert again.weights_from_cache
    reference = smollm.model.model.layers[0].mlp.gate_proj.weight
    assert torch.equal(dequantize_q4(again.layers[0].gate_up.q, again.layers[0].gate_up.scale,
                                     again.layers[0].gate_up.minimum)[: reference.shape[0]], reference.float())
    for decoder in (built, again):
        decoder.use_integer_dot(True, bits=16)
    batch = StepBatch.build([0, 1], [[1, 9690, 198], [1, 504]], [0, 0], prompt_lengths=[3, 2])
    assert torch.equal(built.forward(batch), again.forward(batch))


def test_auto_keeps_the_4_bit_layers_where_they_are_faster_and_qualify():
    from engine.precision import _keep_4bit_or_not

    def entry(alone, wide, qualifies=True, four_bit=None, agreement=None):
        return {"tok_s": {1: alone, 8: wide}, "score": (alone * wide) ** 0.5,
                "agreement": agreement or (1.0 if qualifies else 0.9), "qualifies": qualifies,
                **({"four_bit": four_bit} if four_bit else {})}

    kept = _keep_4bit_or_not(entry(150, 330, four_bit="120/120"), entry(115, 360))
    assert kept["keep_4bit"] and kept["tok_s"] == {1: 150, 8: 330} and kept["other_4bit_way"]["tok_s"] == {1: 115, 8: 360}
    rounded = _keep_4bit_or_not(entry(120, 300, four_bit="120/120"), entry(118, 400))
    assert not rounded["keep_4bit"] and rounded["tok_s"] == {1: 118, 8: 400} and rounded["four_bit"] == "120/120"
    assert not _keep_4bit_or_not(entry(150, 330, False, "120/120"), entry(115, 360))["keep_4bit"]
    # rounded weights agree less with float32: they must be faster by more than the margin, not by noise
    assert _keep_4bit_or_not(entry(120, 300, four_bit="120/120"), entry(118, 400, agreement=0.988))["keep_4bit"]
    assert not _keep_4bit_or_not(entry(100, 250, four_bit="120/120"), entry(118, 400, agreement=0.988))["keep_4bit"]
