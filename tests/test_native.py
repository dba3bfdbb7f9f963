"""The int8 kernel built on this machine (engine/native): right sums, each row's result independent of
the rows beside it (so batched decoding equals serial decoding in int8), and a clean fallback where it
cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import native
from engine.kernels import Linear, quantize_int8

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(960, 576, True), (576, 1536, False), (51, 64, True), (4099, 384, False)]  # odd output counts too


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // scale.shape[1]
    return q.double() * scale.double().repeat_interleave(group, dim=1)


def test_the_kernel_builds_here_with_vector_instructions():
    library = native.int8_library()
    assert library is not None, "a C compiler is installed by make setup: the kernel must build"
    assert native.int8_group() == 32
    assert library.cadence_int8_simd() == 1  # every CPU Cadence targets has AVX2 and FMA
    assert library.cadence_int8_has_int8_dot() == 1  # AVX2 is enough for the integer kernel
    here = native.int8_kernels_here()
    assert here[0] == "f32x8" and {"i8dot", "i16dot"} <= set(here) and ("f32x16" in here) == bool(library.cadence_int8_has16())
    kernels = native.int8_kernels()  # the faster float kernel, timed once, recorded beside the library
    assert kernels[0] == kernels[1] == native.int8_kernel() and kernels[0] in ("f32x8", "f32x16")
    if library.cadence_int8_has16():
        assert library.path.with_suffix(".int8-kernel").read_text() == kernels[0]


def test_the_integer_kernel_runs_only_where_asked(tmp_path):
    code = "from engine import native; print(' '.join(native.int8_kernels()))"
    for asked, expected in (("i8dot", "i8dot i8dot"), ("f32x8,i8dot", "f32x8 i8dot")):
        env = dict(os.environ, CADENCE_INT8_KERNEL=asked)
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.split("\n")[-2] == expected, done.stderr
    env = dict(os.environ, CADENCE_INT8_KERNEL="f64x4")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "CADENCE_INT8_KERNEL must name one or two" in done.stderr


@pytest.mark.parametrize("lanes", ["f32x8", "f32x16"])  # f32x16 is the 8-lane kernel where the CPU has no AVX-512
@pytest.mark.parametrize("out,size,with_bias", SHAPES)
def test_sums_match_the_dequantized_weights(out, size, with_bias, lanes):
    generator = torch.Generator().manual_seed(out)
    weight = torch.randn(out, size, generator=generator) * 0.05
    q, scale = quantize_int8(weight, 32)
    assert scale.shape == (out, size // 32)
    assert (dequantized(q, scale) - weight.double()).abs().max() <= scale.max() / 2 + 1e-7  # rounding, no worse
    bias = torch.randn(out, generator=generator) if with_bias else None
    for rows in (1, 2, 3, 4, 5, 8, 13):
        x = torch.randn(rows, size, generator=generator)
        y = native.int8_linear(x, q, scale, bias, lanes)
        expected = x.double() @ dequantized(q, scale).T + (bias.double() if with_bias else 0)
        assert y.dtype == torch.float32 and y.shape == (rows, out)
        assert torch.allclose(y.double(), expected, rtol=1e-4, atol=1e-4), (rows, (y.double() - expected).abs().max())


@pytest.mark.parametrize("out,size,with_bias", SHAPES[:2])
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call(out, size, with_bias):
    generator = torch.Generator().manual_seed(1)
    layer = Linear(torch.randn(out, size, generator=generator) * 0.05,
                   torch.randn(out, generator=generator) if with_bias else None, "int8")
    assert layer.native and layer.rows_rule == (1, 1 << 30)  # no padding or chunking needed
    x = torch.randn(37, size, generator=generator)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in (2, 3, 4, 5, 7, 8, 9, 16, 37):
        together = torch.cat([layer(chunk) for chunk in x.split(rows)])
        assert torch.equal(together, alone), rows
    assert torch.equal(layer(x[5:12]), alone[5:12])  # calls that start at another row
    for kernel in native.INT8_KERNELS:  # every kernel, whichever this machine runs
        solo = torch.cat([native.int8_linear(x[i : i + 1], layer.q, layer.scale, layer.bias, kernel) for i in range(37)])
        for rows in (2, 3, 4, 5, 8, 9, 16, 17, 37):
            together = torch.cat([native.int8_linear(c, layer.q, layer.scale, layer.bias, kernel) for c in x.split(rows)])
            assert torch.equal(together, solo), (kernel, rows)


@pytest.mark.parametrize("kernel,levels,closeness", [("i8dot", 127, 0.02), ("i16dot", 32767, 1e-4)])
@pytest.mark.parametrize("out,size,with_bias", SHAPES)
def test_the_integer_kernels_sum_rounded_activations_exactly(out, size, with_bias, kernel, levels, closeness):
    """i8dot (i16dot) rounds each row to int8 (int16) per 32 inputs (scale: the group's largest magnitude /
    127 (32767), to nearest even) and multiplies integers: its result is that rounding's exact product, up
    to float32 sums; int16's is within a hundredth of a percent of the float product."""
    generator = torch.Generator().manual_seed(out + 7)
    q, scale = quantize_int8(torch.randn(out, size, generator=generator) * 0.05, 32)
    bias = torch.randn(out, generator=generator) if with_bias else None
    for rows in (1, 2, 3, 4, 5, 8, 13, 17, 40):
        x = torch.randn(rows, size, generator=generator) * torch.rand(rows, 1, generator=generator) * 4
        x[0, :32] = 0  # an all-zero group rounds to zeros
        groups = x.view(rows, -1, 32)
        largest = groups.abs().amax(dim=2, keepdim=True)
        # (levels / largest as the kernel divides, in float32: torch computes a number over a tensor as a
        # reciprocal times the number, which rounds otherwise and moves 16-bit roundings by one)
        inverse = torch.full_like(largest, levels) / largest
        rounded = torch.round(groups * torch.where(largest > 0, inverse, torch.zeros_like(largest)))
        sums = torch.einsum("rgk,ogk->rog", rounded.double(), q.view(out, -1, 32).double())  # exact integers
        expected = (sums * (largest / levels).double().view(rows, 1, -1) * scale.double()[None]).sum(dim=2)
        expected = expected + (bias.double() if with_bias else 0)
        y = native.int8_linear(x, q, scale, bias, kernel)
        assert y.dtype == torch.float32 and y.shape == (rows, out)
        assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5), (rows, (y.double() - expected).abs().max())
        # ...and close to the float product: rounding to 8 bits costs about half a percent, to 16 bits next to nothing
        exact = x.double() @ dequantized(q, scale).T + (bias.double() if with_bias else 0)
        assert (y.double() - exact).norm() <= closeness * exact.norm()


def test_the_decoder_layers_in_one_c_call_give_the_python_loops_bits(smollm):
    """SmolLM2 in int8: the embedding and first norm (cadence_embed_norm) and the layer loop in C
    (engine/native/decoder_layers.c) against the same ops one by one in Python, over steps of one and
    several slots, prompts and single tokens, every kernel."""
    from engine.families.llama import LlamaBatched
    from engine.seam import StepBatch

    decoder = LlamaBatched(smollm, width=3, precision="int8")
    assert decoder.layers_in_c

    def run(in_c: bool) -> list[torch.Tensor]:
        decoder.layers_in_c = in_c
        decoder.allocate(3)
        logits = [decoder.forward(StepBatch.build([0, 1, 2], [[1, 9690, 198, 1204, 314], [5, 6], [7, 8, 9]], [0, 0, 0]))]
        for step in range(6):
            logits.append(decoder.forward(StepBatch.build([0, 1, 2], [[100 + step], [200 + step, 3], [300]],
                                                          [5 + step, 2 + 2 * step, 3 + step])))
        logits.append(decoder.forward(StepBatch.build([1], [[42]], [14])))
        return logits

    for kernel in native.int8_kernels_here():
        decoder._c_layers.kernels = [list(native.INT8_KERNELS).index(kernel)] * 3
        monkey = native._KERNEL[:]  # the Python loop's products run this kernel too
        native._KERNEL[:] = [(kernel, kernel)]
        try:
            in_python, in_c = run(False), run(True)
        finally:
            native._KERNEL[:] = monkey
        assert all(torch.equal(a, b) for a, b in zip(in_python, in_c)), kernel


def test_per_channel_weights_are_regrouped_for_the_native_kernel():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    old = quantize_int8(weight)  # one scale per output channel, as int8 caches before version 2 held
    layer = Linear(None, None, "int8", quantized=old)
    assert layer.native and layer.scale.shape == (64, 4)
    x = torch.randn(3, 128)
    assert close(layer(x), x @ weight.T)


def close(y: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within int8's rounding: the error's norm under 2% of the result's."""
    return bool((y - expected).norm() <= 0.02 * expected.norm())


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


CHECK = ("import logging, torch; logging.basicConfig(level=logging.INFO, format='%(message)s');"
         "from engine.kernels import Linear; w = torch.randn(96, 64);"
         "layer = Linear(w, None, 'int8'); x = torch.randn(2, 64);"
         "print('native', layer.native, bool((layer(x) - x @ w.T).norm() <= 0.02 * (x @ w.T).norm()))")


def test_without_a_compiler_int8_falls_back_to_pytorchs_kernel(tmp_path):
    done = _python(CHECK, CC="/bin/false", CADENCE_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "native False True"
    assert "The int8 kernel could not be built here" in done.stderr and "Traceback" not in done.stderr
    assert not list((tmp_path / "native").glob("*.so"))


def test_native_kernels_can_be_turned_off(tmp_path):
    done = _python(CHECK, CADENCE_NATIVE="0", CADENCE_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "native False True"
    assert "Native kernels are turned off (CADENCE_NATIVE=0)." in done.stderr


def test_int8_keeps_float32_activations_wherever_the_native_kernel_runs(tmp_path):
    """With the kernel, int8's activations are float32 on every CPU (so its fused C ops run, bfloat16
    CPUs included) and Whisper's unquantized encoder takes bfloat16 where the CPU has it; without the
    kernel, bfloat16 CPUs feed PyTorch's int8 kernel bfloat16 rows."""
    from engine.kernels import activation_dtype, cpu_has_bf16, unquantized_dtype

    assert activation_dtype("int8", "cpu") == torch.float32
    assert unquantized_dtype("int8", "cpu") == (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    assert unquantized_dtype("float32", "cpu") == torch.float32
    probe = "from engine.kernels import activation_dtype; print(activation_dtype('int8', 'cpu'))"
    off = _python(probe, CADENCE_NATIVE="0", CADENCE_CACHE_DIR=str(tmp_path))
    assert off.stdout.strip() == ("torch.bfloat16" if cpu_has_bf16() else "torch.float32"), off.stderr


def test_the_library_is_built_once_per_machine_and_reused(tmp_path):
    first = _python("from engine import native; print(native.int8_library() is not None)", CADENCE_CACHE_DIR=str(tmp_path))
    built = sorted((tmp_path / "native").glob("*.so"))
    again = _python("from engine import native; print(native.int8_library() is not None)", CADENCE_CACHE_DIR=str(tmp_path))
    assert first.stdout.strip() == again.stdout.strip() == "True", first.stderr + again.stderr
    assert len(built) == 1 and sorted((tmp_path / "native").glob("*.so")) == built
    assert built[0].stat().st_mtime_ns == sorted((tmp_path / "native").glob("*.so"))[0].stat().st_mtime_ns


def test_fused_norm_and_rotary_compute_what_pytorchs_ops_do_row_by_row():
    """The int8 path's fused layer ops (engine/native/layer_ops.c): x + h with the RMS norm after it,
    and rotate_half rotary at each row's position, equal PyTorch's to float rounding, and a row gets
    the same bits alone as among others."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(3)
    rows, d, heads, dim = 9, 576, 12, 64
    x, h = torch.randn(rows, d, generator=generator), torch.randn(rows, d, generator=generator)
    weight = torch.randn(d, generator=generator)
    total, normed = native.add_rms_norm(x, h, weight, 1e-5)
    assert torch.allclose(total, x + h) and torch.allclose(normed, F.rms_norm(x + h, (d,), weight, 1e-5), atol=1e-5)
    same, alone = native.add_rms_norm(x, None, weight, 1e-5)
    assert same is x and torch.allclose(alone, F.rms_norm(x, (d,), weight, 1e-5), atol=1e-5)
    for i in range(rows):
        assert torch.equal(native.add_rms_norm(x[i : i + 1], h[i : i + 1], weight, 1e-5)[1], normed[i : i + 1])

    angles = torch.rand(40, dim // 2, generator=generator) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).contiguous(), torch.cat([angles.sin()] * 2, -1).contiguous()
    positions = torch.randint(0, 40, (rows,), generator=generator)
    qkv = torch.randn(rows, heads * dim + 3 * dim, generator=generator)  # q and k heads, then v (left alone)
    qk = qkv[:, : heads * dim].view(rows, heads, dim)
    c, s = cos[positions][:, None], sin[positions][:, None]
    expected = qk * c + torch.cat((-qk[..., dim // 2 :], qk[..., : dim // 2]), dim=-1) * s
    v = qkv[:, heads * dim :].clone()
    rotated = qkv.clone()
    native.rotary(rotated, heads, cos, sin, positions)
    assert torch.allclose(rotated[:, : heads * dim].view(rows, heads, dim), expected, atol=1e-5)
    assert torch.equal(rotated[:, heads * dim :], v)
    for i in range(rows):
        one = qkv[i : i + 1].clone()
        native.rotary(one, heads, cos, sin, positions[i : i + 1])
        assert torch.equal(one, rotated[i : i + 1])


@pytest.mark.parametrize("window", [None, 5])
def test_fused_attention_is_pytorchs_and_a_rows_result_is_its_own(window):
    """The int8 path's attention in C: the cache gets the rows' keys and values as the seam's attend
    writes them, the outputs equal its outputs to float rounding (ragged rows, grouped heads, a sliding
    window), and each row's output has the same bits whatever other rows and slots share the step."""
    from engine.seam import SlotKVCache, StepBatch, attend

    generator = torch.Generator().manual_seed(4)
    heads, kv_heads, dim = 9, 3, 64
    caches = [SlotKVCache(2, 4, kv_heads, 256, dim, torch.float32, "cpu", initial=256) for _ in range(3)]
    for tensors in zip(*(c.k + c.v for c in caches)):
        history = torch.randn(tensors[0].shape, generator=generator)
        for t in tensors:
            t.copy_(history)
    batch = StepBatch.build([0, 2, 3], [[1, 2, 3], [4], [5, 6]], [10, 40, 0])
    rows = batch.row_positions.numel()
    q, k, v = (torch.randn(rows, n, dim, generator=generator) for n in (heads, kv_heads, kv_heads))
    expected = attend(q, k, v, caches[0], 1, batch, None if window is None else batch.window_blocked(window))
    got = native.attend(q, k, v, caches[1].k[1], caches[1].v[1], batch.row_slots, batch.row_positions, window, dim ** -0.5)
    assert torch.equal(caches[0].k[1], caches[1].k[1]) and torch.equal(caches[0].v[1], caches[1].v[1])
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    for r in range(rows):  # each row alone, its slot's earlier rows of the step already written
        slot, position = batch.row_slots[r : r + 1], batch.row_positions[r : r + 1]
        one = native.attend(q[r : r + 1], k[r : r + 1], v[r : r + 1], caches[2].k[1], caches[2].v[1], slot, position,
                            window, dim ** -0.5)
        assert torch.equal(one, got[r : r + 1]), r


def test_fused_silu_gating_is_pytorchs_row_by_row():
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(5)
    gate_up = torch.randn(7, 2 * 1540, generator=generator) * 6  # 1540: a tail past the 8-lane vectors
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0])  # past where e^x over- or underflows
    gate, up = gate_up.split(1540, dim=-1)
    got = native.silu_mul(gate_up, 1540)
    assert torch.allclose(got, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(got).all()
    for i in range(7):
        assert torch.equal(native.silu_mul(gate_up[i : i + 1], 1540), got[i : i + 1])


def test_whispers_fused_attention_computes_what_pytorchs_does(tiny):
    """whisper-tiny.en in int8: its decoder's self- and cross-attention run in C, the encoder memory kept
    in float16; the logits of a ragged prompt step and a decode step over two slots' memory are
    PyTorch's over the same values, to float rounding."""
    from engine.families.whisper import WhisperBatched
    from engine.seam import StepBatch

    decoder = WhisperBatched(tiny, width=2, precision="int8")
    assert decoder._fused_attention and decoder.cross_k.dtype == torch.float16  # half the bytes a step reads
    generator = torch.Generator().manual_seed(6)
    for slot in (0, 1):
        decoder.set_memory(slot, torch.randn(1500, decoder.d_model, generator=generator))
    sot = [50257, 50362]  # <|startoftranscript|><|notimestamps|> of the English-only vocabulary
    steps = [StepBatch.build([0, 1], [sot + [400, 318, 257], sot], [0, 0]), StepBatch.build([1], [[262]], [2])]
    for batch in steps:
        got = {}
        for fused in (True, False):
            decoder._fused_attention = fused
            got[fused] = decoder.forward(batch)
        assert torch.allclose(got[True], got[False], rtol=1e-4, atol=1e-4), (got[True] - got[False]).abs().max()
        decoder._fused_attention = True


def test_attention_over_a_float16_memory_reads_it_exactly():
    """Whisper's encoder memory in float16 (int8's C path): the same results, bit for bit, as the same
    values given in float32, so only the memory's rounding differs from float32's path."""
    from engine.seam import StepBatch

    generator = torch.Generator().manual_seed(7)
    keys, values = (torch.randn(3, 6, 1536, 64, generator=generator).half() for _ in range(2))
    batch = StepBatch.build([0, 2], [[1, 2], [3]], [5, 9])
    q = torch.randn(3, 6, 64, generator=generator)
    half = native.attend_memory(q, keys, values, batch.row_slots, 1500, 0.125)
    assert torch.equal(half, native.attend_memory(q, keys.float(), values.float(), batch.row_slots, 1500, 0.125))


def test_prompt_rows_and_generated_rows_keep_their_own_kernels_whatever_shares_the_step(smollm):
    """The C layer loop runs generated tokens' rows on one kernel and prompt rows on another: a row's
    result depends on its own kind only, so a step that mixes a prompt and an answer gives each the bits
    it gets alone (batched = serial), and the generated row's bits are the generated kernel's."""
    from engine.families.llama import LlamaBatched
    from engine.seam import StepBatch

    decoder = LlamaBatched(smollm, width=2, precision="int8")
    prompt_kernel = "f32x16" if "f32x16" in native.int8_kernels_here() else "f32x8"
    decoder._c_layers.kernels = [list(native.INT8_KERNELS).index(k) for k in (prompt_kernel, "i8dot", "i16dot")]
    decoder._head_kernels = (prompt_kernel, "i16dot")  # the output layer's rows by kind too
    first = [[1, 9690, 198, 1204, 314], [5, 6, 7]]

    def run(together: bool, answer_is_generated: bool = True) -> list[torch.Tensor]:
        decoder.allocate(2)
        decoder.forward(StepBatch.build([0, 1], first, [0, 0], prompt_lengths=[5, 6]))
        # slot 0 answers (its first generated token, at 5), slot 1 reads the rest of its prompt (3..5)
        steps = [([0], [[42]], [5], [5 if answer_is_generated else 6]), ([1], [[8, 9, 10]], [3], [6])]
        if together:
            steps = [tuple(a + b for a, b in zip(*steps))]
        logits = []
        for slots, rows, starts, lengths in steps:
            batch = StepBatch.build(slots, rows, starts, prompt_lengths=lengths)
            logits.append(decoder.forward(batch))  # every row's logits
        return list(torch.cat(logits))

    alone, together = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
    assert not torch.equal(run(False, answer_is_generated=False)[0], alone[0])  # the kinds did run differently


def test_generated_rows_may_run_the_down_projection_on_16_bit_products(smollm, monkeypatch):
    """use_integer_dot(True, down=False) runs generated rows on the 8-bit integer kernel but for the MLP's
    down projection, on the 16-bit one (as the output layer's generated rows, either way): a generated
    token's logits differ from both all-float and all-8-bit products, while prompt rows keep the float
    kernel's bits whatever is asked for generated ones."""
    from engine import kernels
    from engine.families.llama import LlamaBatched
    from engine.seam import StepBatch

    monkeypatch.delenv("CADENCE_INT8_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "KEEP_4BIT", False)  # int8 weights (SmolLM2's layers are 4-bit otherwise)
    decoder = LlamaBatched(smollm, width=1, precision="int8")
    assert decoder.layers[0].down.minimum is None
    prompt = [1, 9690, 198, 1204, 314]

    def logits(*integer) -> tuple[torch.Tensor, torch.Tensor]:
        decoder.use_integer_dot(*integer)
        decoder.allocate(1)
        first = decoder.forward(StepBatch.build([0], [prompt], [0], prompt_lengths=[5]))
        return first[-1], decoder.forward(StepBatch.build([0], [[42]], [5], prompt_lengths=[5]))[0]

    floats, integers, but_down = logits(False), logits(True, True), logits(True, False)
    assert decoder.use_integer_dot(True, down=False) and decoder._c_layers.generated_kernels == ("i8dot", "i16dot")
    assert decoder._head_kernels[1] == "i16dot"
    assert decoder.use_integer_dot(True) and decoder._c_layers.generated_kernels == ("i8dot", "i8dot")
    assert decoder._head_kernels[1] == "i16dot"
    assert decoder.use_integer_dot(True, bits=16) and decoder._c_layers.generated_kernels == ("i16dot", "i16dot")
    sixteen = logits(True, True, 16)
    assert torch.equal(sixteen[0], floats[0])  # prompt rows alike here too
    assert not torch.equal(sixteen[1], but_down[1]) and not torch.equal(sixteen[1], floats[1])
    # 16-bit activations: next to float products (the bound 8-bit ones are held to, a hundred times tighter)
    assert (sixteen[1] - floats[1]).abs().max() < 0.001 * floats[1].abs().max()
    assert not decoder.use_integer_dot(False) and decoder._head_kernels is None
    assert torch.equal(floats[0], integers[0]) and torch.equal(floats[0], but_down[0])  # prompt rows alike
    assert not torch.equal(but_down[1], floats[1]) and not torch.equal(but_down[1], integers[1])
    assert (but_down[1] - floats[1]).abs().max() < 0.1 * floats[1].abs().max()  # a rounding, not another model


def test_whispers_output_layer_kernel_is_measured_once_and_recorded(monkeypatch, tmp_path):
    import engine.families.whisper as whisper
    import engine.kernels as kernels

    monkeypatch.setattr(kernels, "_row_rules_file", lambda: tmp_path / "rules.json")
    monkeypatch.delenv("CADENCE_INT8_KERNEL", raising=False)
    timed = []
    monkeypatch.setattr(whisper, "_time_output_kernels", lambda: timed.append(1) or "i16dot")
    integer = "i16dot" in native.int8_kernels_here()
    assert whisper.output_kernel() == whisper.output_kernel() == ("i16dot" if integer else None)
    assert timed == ([1] if integer else [])  # the second call (a new process too) reads the record
    if integer:
        assert '"whisper-output-i16dot-vs-float": "i16dot"' in (tmp_path / "rules.json").read_text()
        monkeypatch.setenv("CADENCE_INT8_KERNEL", "f32x8")  # kernels named by hand run as named
        assert whisper.output_kernel() is None


def test_whispers_output_layer_on_16_bit_products_gives_each_row_its_own_logits(tiny, monkeypatch):
    """int8 Whisper's output layer on the 16-bit integer kernel: a row's logits do not depend on the rows
    beside it (bit for bit), and they are the float kernel's to within its rounding, the same argmax.
    (A processor without integer kernels keeps the layer's own: checked instead.)"""
    import engine.families.whisper as whisper
    from engine.seam import StepBatch

    if "i16dot" not in native.int8_kernels_here():
        assert whisper.output_kernel() is None and whisper.WhisperBatched(tiny, precision="int8").output_kernel is None
        return
    monkeypatch.setattr(whisper, "output_kernel", lambda: "i16dot")
    decoder = whisper.WhisperBatched(tiny, width=3, precision="int8")
    assert decoder.output_kernel == "i16dot"
    generator = torch.Generator().manual_seed(8)
    for slot in range(3):
        decoder.set_memory(slot, torch.randn(1500, decoder.d_model, generator=generator))
    sot = [50257, 50362]
    together = decoder.forward(StepBatch.build([0, 1, 2], [sot + [400], sot + [318, 257], sot], [0, 0, 0]))
    float_logits = []
    for slot, tokens in zip(range(3), [sot + [400], sot + [318, 257], sot]):
        alone = decoder.forward(StepBatch.build([slot], [tokens], [0]))
        rows = slice(sum(len(t) for t in [sot + [400], sot + [318, 257], sot][:slot]), None)
        assert torch.equal(alone, together[rows][: len(tokens)])
        decoder.output_kernel = None
        float_logits.append(decoder.forward(StepBatch.build([slot], [tokens], [0])))
        decoder.output_kernel = "i16dot"
        error = (alone - float_logits[-1]).norm() / float_logits[-1].norm()
        assert error < 1e-3 and torch.equal(alone.argmax(-1), float_logits[-1].argmax(-1))
