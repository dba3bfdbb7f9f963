"""int8 products for layers called with many rows at once: Whisper's encoder (1500 rows a window).

Decode steps multiply a weight by a handful of rows and wait on memory, which engine.kernels' int8
kernels serve by reading a quarter of the bytes. The encoder is the other way round: 1500 rows a
window keep the weights in cache, so it waits on arithmetic, and only a kernel that multiplies in
8-bit integers (more products per instruction than float32's fused multiply-add) makes it faster.
PyTorch's quantized engines (fbgemm, oneDNN) have such a kernel for a linear layer whose weight is
int8 per output channel and whose input is rounded to 8 bits per call (``quantized::linear_dynamic``).

Their input rounding is one scale for the whole call, which Whisper's activations do not bear (a few
rows reach 100x the others: base's words moved by 2-3 points on the check speech). So each row is
first divided by its own largest magnitude and the output row multiplied back, which makes the
rounding per row (as CTranslate2 does for faster-whisper's int8): the same check speech then reads
within 0.5 points of float32 for tiny.en and base. Each window's rows are one call of their own, so
a window's result does not depend on the windows encoded beside it (batched = serial).

Whether this pays is a property of the processor (on a Zen 1 EPYC PyTorch's int8 products were no
faster than float32; on a Zen 3 about 1.7x): :func:`encoder_int8_engine` times it against the float
layer once per machine and records the answer beside the kernels' row rules.

The decoder's projection of a window into its cross-attention keys and values (also 1500 rows, once a
window) has a choice of its own, :func:`memory_projection_way`: int8 weights on the decode kernels
(engine.kernels' int8 ``Linear``, made for a step's few rows) or the float weights as they are. On a Zen 3
EPYC the float32 product was 1.7-2.3x faster there, and rounded nothing beyond float32.
"""

from __future__ import annotations

import time
import warnings

import torch

MARGIN = 1.15  # int8 rounds more than float: it must be this much faster to be used
REDUCE_RANGE = True  # 7-bit inputs: an AVX2 kernel's pairwise 16-bit sums (vpmaddubsw) cannot saturate
_ENGINES = ("fbgemm", "onednn")
_CHOICE: dict[torch.dtype, str] = {}  # this process's reading of the recorded choices


def engines_here() -> list[str]:
    """The quantized engines this PyTorch offers (none where a later release has dropped them: PyTorch
    2.13 marks its quantized tensors deprecated; the encoder then stays in float)."""
    try:
        supported = torch.backends.quantized.supported_engines
        torch.ops.quantized.linear_dynamic, torch.ops.quantized.linear_prepack  # noqa: B018 (present?)
    except (AttributeError, RuntimeError):
        return []
    return [e for e in _ENGINES if e in supported]


class ManyRowsInt8Linear:
    """``y = x @ weight.T + bias`` for x [..., rows, in] (any float dtype; y float32), through ``engine``'s
    int8 product. Each 2-D slice x[i] (a window) is rounded and multiplied on its own; 2-D x is one slice."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, engine: str):
        weight = weight.detach().float().cpu()
        self.out_features, self.in_features = weight.shape
        scale = (weight.abs().amax(1) / 127).clamp(min=1e-12).double()
        with warnings.catch_warnings():  # quantized tensors are deprecated past the pinned PyTorch (see engines_here)
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(weight, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = engine  # the packed weight belongs to the engine it was packed by
        try:
            self.packed = torch.ops.quantized.linear_prepack(q, None)
        finally:
            torch.backends.quantized.engine = previous
        self.engine = engine
        self.bias = bias.detach().float().cpu() if bias is not None else None

    def _slice(self, x: torch.Tensor) -> torch.Tensor:
        size = x.abs().amax(1, keepdim=True).clamp(min=1e-12)  # each row's largest magnitude
        y = torch.ops.quantized.linear_dynamic((x / size).contiguous(), self.packed, REDUCE_RANGE)
        y.mul_(size)
        return y.add_(self.bias) if self.bias is not None else y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if x.dim() == 2:
            return self._slice(x)
        slices = x.reshape(-1, *x.shape[-2:])
        if slices.shape[0] == 1:  # one window: its result as it comes, not copied into a stack of one
            return self._slice(slices[0]).reshape(*x.shape[:-1], self.out_features)
        y = torch.stack([self._slice(s) for s in slices])
        return y.reshape(*x.shape[:-1], self.out_features)


def best_times(ways: dict, rounds: int = 4) -> dict[str, float]:
    """Each way's best of ``rounds`` calls, in seconds; the ways take turns, so a busy moment falls on all."""
    best = {way: float("inf") for way in ways}
    with torch.inference_mode():
        for _ in range(rounds):
            for way, run in ways.items():
                start = time.perf_counter()
                run()
                best[way] = min(best[way], time.perf_counter() - start)
    return best


def _time_engines(float_dtype: torch.dtype) -> str:
    """The fastest way to multiply a Whisper-base-sized layer at 1500 rows here: "float" (in
    ``float_dtype``, the encoder's otherwise) or an engine."""
    from engine.kernels import Linear, precision_of

    generator = torch.Generator().manual_seed(0)
    shapes = [(2048, 512), (512, 2048)]  # fc1, fc2 of whisper-base
    layers = {"float": [Linear(torch.randn(o, i, generator=generator) * 0.05, None, precision_of(float_dtype),
                               invariant=False)
                        for o, i in shapes]}
    for engine in engines_here():
        layers[engine] = [ManyRowsInt8Linear(torch.randn(o, i, generator=generator) * 0.05, None, engine)
                          for o, i in shapes]
    inputs = [torch.randn(1500, i, generator=generator).to(float_dtype) for _, i in shapes]
    best = best_times({way: (lambda pair=pair: [layer(x) for layer, x in zip(pair, inputs)])
                        for way, pair in layers.items()})
    fastest = min((w for w in best if w != "float"), key=best.get, default=None)
    return fastest if fastest is not None and best["float"] >= MARGIN * best[fastest] else "float"


def encoder_int8_engine(float_dtype: torch.dtype = torch.float32) -> str | None:
    """The quantized engine Whisper's encoder runs its int8 layers on, on this CPU; None where its float
    layers (in ``float_dtype``) are as fast. Measured once per machine and recorded."""
    if float_dtype not in _CHOICE:
        from engine.kernels import recorded_choice

        ways = {"float", *engines_here()}
        name = f"many-rows-int8-vs-{str(float_dtype).removeprefix('torch.')}"
        _CHOICE[float_dtype] = (recorded_choice(name, lambda: _time_engines(float_dtype), lambda v: v in ways)
                                if len(ways) > 1 else "float")
    return None if _CHOICE[float_dtype] == "float" else _CHOICE[float_dtype]


def _time_memory_projection(float_dtype: torch.dtype) -> str:
    """"int8" where the decode kernels' int8 layer is at least MARGIN faster than the float one (in
    ``float_dtype``) on 1500 rows of whisper-base's cross-attention key/value projection here, else "float"."""
    from engine.kernels import Linear, precision_of

    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(1024, 512, generator=generator) * 0.05, torch.randn(1024, generator=generator)
    layers = {"float": Linear(weight, bias, precision_of(float_dtype), invariant=False),
              "int8": Linear(weight, bias, "int8", invariant=False)}
    x = torch.randn(1500, 512, generator=generator).to(float_dtype)
    best = best_times({way: (lambda layer=layer: layer(x)) for way, layer in layers.items()})
    return "int8" if best["float"] >= MARGIN * best["int8"] else "float"


_MEMORY_WAY: dict[torch.dtype, str] = {}


def memory_projection_way(float_dtype: torch.dtype = torch.float32) -> str:
    """How int8 Whisper projects a window's encoder states into its cross-attention keys and values on this
    CPU: "int8" (the decode kernels' int8 weights) or "float" (the weights unquantized, in ``float_dtype``).
    Measured once per machine and recorded."""
    if float_dtype not in _MEMORY_WAY:
        from engine.kernels import recorded_choice

        name = f"memory-projection-int8-vs-{str(float_dtype).removeprefix('torch.')}"
        _MEMORY_WAY[float_dtype] = recorded_choice(name, lambda: _time_memory_projection(float_dtype),
                                                   lambda v: v in ("int8", "float"))
    return _MEMORY_WAY[float_dtype]
