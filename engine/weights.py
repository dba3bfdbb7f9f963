"""A model's weight matrices in the chosen precision, the way a family's decoder asks for them.

int8 weights are made once per model file (symmetric, in the layout this machine's int8 kernel reads:
groups of 32 inputs per scale, or one scale per output channel; see :mod:`engine.kernels`) and kept as
one safetensors file in the user cache directory (``quantized/<model key>-int8-v5.safetensors``),
so later loads read them instead of quantizing again. float32 and bfloat16 are plain conversions
of the loaded weights and are not cached. Where the native kernel runs, a matrix whose weights already
are 4-bit (a model converted from a Q4_1 GGUF: a scale and a minimum per 32 inputs, both half floats) is
kept in that form instead, which gives back its float32 weights exactly in 0.625 bytes a weight against
int8's 1.125 (``auto`` times both forms on the model and keeps the faster).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from engine import kernels
from engine.kernels import Linear, int8_group, quantize_int8, quantize_q4_exact
from engine.paths import cache_dir

log = logging.getLogger(__name__)
INT8_VERSION = 5  # 2: group-wise scales where the native kernel runs; 3: weights that already are 4-bit kept so;
# 4: their scales and minimums as half floats; 5: their codes a group to a nibble of each byte


def int8_cache_path(loaded, keep_4bit: bool = True) -> Path:
    from engine.loading import source_key

    kind = "" if keep_4bit else "-without-4-bit"  # (the two never share a file)
    return cache_dir() / "quantized" / f"{source_key(loaded.source)}-int8-v{INT8_VERSION}{kind}.safetensors"


class WeightPrep:
    """Builds a decoder's :class:`~engine.kernels.Linear` layers in ``precision``; for int8, reads and
    fills the model's quantized-weight cache (call :meth:`save` once every layer is built). ``keep_4bit``
    (int8): keep weights that already are 4-bit so (None: engine.kernels.KEEP_4BIT)."""

    def __init__(self, loaded, precision: str = "float32", keep_4bit: bool | None = None):
        self.precision = precision
        self.keep_4bit = kernels.KEEP_4BIT if keep_4bit is None else keep_4bit
        self.path = int8_cache_path(loaded, self.keep_4bit) if precision == "int8" else None
        self.stored: dict[str, torch.Tensor] = {}
        self.made: dict[str, torch.Tensor] = {}
        if self.path is not None and self.path.is_file():
            from safetensors.torch import load_file

            try:
                self.stored = load_file(str(self.path))
            except Exception as exc:  # a damaged cache file is made again
                log.warning("The int8 weight cache %s could not be read (%s); quantizing again.", self.path, exc)
                self.stored = {}

    @property
    def from_cache(self) -> bool:
        return bool(self.stored) and not self.made

    def _int8(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, scale) int8, or (codes, scale, minimum) for a weight that already is 4-bit."""
        group = int8_group(weight.shape[1], weight.device)
        out, size = weight.shape
        if group and weight.device.type == "cpu" and self.keep_4bit:
            names = (f"{name}.codes", f"{name}.code_scale", f"{name}.minimum")
            parts = tuple(self.stored.get(key) for key in names)
            if all(p is not None for p in parts) and [tuple(p.shape) for p in parts] == \
                    [(out, size // 2), (out, size // 32), (out, size // 32)]:
                return parts
            if f"{name}.q" not in self.stored:  # not known to be int8 yet
                parts = quantize_q4_exact(weight)
                if parts is not None:
                    self.made.update(zip(names, parts))
                    return parts
        q, scale = self.stored.get(f"{name}.q"), self.stored.get(f"{name}.scale")
        layout = (out, size // group) if group else (out,)
        if q is None or scale is None or tuple(q.shape) != tuple(weight.shape) or tuple(scale.shape) != layout:
            q, scale = quantize_int8(weight, group)
            self.made[f"{name}.q"], self.made[f"{name}.scale"] = q, scale
        # The cache is read onto the CPU: a GPU's layer would otherwise be built there (and run the CPU kernel).
        return q.to(weight.device), scale.to(weight.device)

    def linear(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
               invariant: bool = True) -> Linear:
        """``invariant``: see :class:`~engine.kernels.Linear` (False for layers always called with the same rows)."""
        if self.precision == "int8":
            return Linear(None, bias, "int8", quantized=self._int8(name, weight.detach()), invariant=invariant)
        return Linear(weight, bias, self.precision, invariant=invariant)

    def fused(self, name: str, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None,
              invariant: bool = True) -> Linear:
        """One matrix for several projections of the same input (q/k/v, gate/up): one weight read."""
        bias = None
        if biases is not None and any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        return self.linear(name, torch.cat([w.detach() for w in weights]), bias, invariant)

    def of(self, name: str, module: torch.nn.Linear, invariant: bool = True) -> Linear:
        return self.linear(name, module.weight, module.bias, invariant)

    def save(self) -> None:
        """Write newly quantized weights into the cache (atomically; a failure only costs the next load time)."""
        if self.path is None or not self.made:
            return
        from safetensors.torch import save_file

        tensors = {k: v.detach().to("cpu").contiguous() for k, v in {**self.stored, **self.made}.items()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            save_file(tensors, str(tmp), metadata={"format": "cadence-int8", "version": str(INT8_VERSION)})
            tmp.replace(self.path)
        except OSError as exc:
            log.warning("The int8 weight cache %s could not be written (%s).", self.path, exc)
