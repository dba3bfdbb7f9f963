"""The few kernels a lean decode step needs, chosen per backend.

Decoding multiplies every weight matrix by a handful of rows (1 per busy slot, more while
prefilling or verifying drafts). PyTorch's default CPU path for that (MKL sgemm through
``F.linear``) is slow for small row counts on some CPUs: 2 rows cost twice 1 row. oneDNN with the
weight reordered once into its blocked layout serves 1 to 8 rows in about the time of one, and
gives each row the same result whatever the other rows are, so batched decoding stays equal to
serial decoding. On other backends (CUDA, MPS) or dtypes, ``F.linear`` is already the right call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_ROWS = 64  # the row count oneDNN tunes the packed layout for; results do not depend on it


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """``y = x @ weight.T + bias`` with the weight prepared once for the backend's best kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.bias = bias.detach().contiguous() if bias is not None else None
        self.packed = None
        if _can_pack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)
            except RuntimeError:  # an oneDNN build without this reorder: plain linear works everywhere
                self.packed = None
        self.weight = None if self.packed is not None else weight

    @classmethod
    def fused(cls, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None) -> "Linear":
        """One matrix for several projections of the same input (q/k/v, gate/up): one weight read."""
        bias = None
        if biases is not None and any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        return cls(torch.cat(weights), bias)

    @classmethod
    def of(cls, module: torch.nn.Linear) -> "Linear":
        return cls(module.weight, module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

