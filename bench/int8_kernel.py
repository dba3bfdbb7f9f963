"""Every matrix product of one SmolLM2-135M decode step, per kernel, at several row counts.

    .venv/bin/python bench/int8_kernel.py [--rows 1,8,16,32] [--repeats 5] [--kinds float32,bfloat16,...]

The model's own weights (30 layers' q/k/v, out, gate/up and down, and the 49152-row lm_head: 538 MB
in float32, so a step reads from memory, not cache), through engine.kernels.Linear in each way this
machine can run them: float32 (oneDNN's packed layout), bfloat16 (where the CPU has it), int8 with
the native kernel built here (engine/native: groups of 32 inputs per scale; "int8 native f32x8",
"... f32x16" (AVX-512 only) or "... i8dot" force one of its kernels, engine.native.INT8_KERNELS; plain
"int8 native" runs the one this machine chose), and int8 with PyTorch's per-channel
kernel (the fallback where no compiler is found). Prints the CPU model with the figures; run on a quiet machine.
Kernels alternate within each repeat, so a machine drifting in speed moves them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def layers(kind: str, weights: list[torch.Tensor]):
    from engine import kernels
    from engine.kernels import Linear

    if kind in ("float32", "bfloat16"):
        return [Linear(w, precision=kind) for w in weights]
    if kind.startswith("int8 native"):
        return [Linear(w, precision="int8") for w in weights]
    native_group = kernels.int8_group  # int8, PyTorch's per-channel kernel: what int8 runs where
    kernels.int8_group = lambda *_: 0   # engine/native cannot be built (no compiler)
    try:
        return [Linear(w, precision="int8") for w in weights]
    finally:
        kernels.int8_group = native_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,16,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kinds", default="float32,int8 native,int8 per-channel (PyTorch)")
    args = parser.parse_args()
    from engine import native
    from engine.calibration import device_identity
    from engine.loading import load

    print(f"{device_identity('cpu')}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    model = load("smollm2-135m-instruct", device="cpu").model
    weights = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
                    attn.o_proj.weight.detach(), torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
                    mlp.down_proj.weight.detach()]
    weights.append(model.lm_head.weight.detach())
    kinds = args.kinds.split(",")
    with torch.inference_mode():
        built = {kind: layers(kind, weights) for kind in kinds}
        del model
        rows = [int(r) for r in args.rows.split(",")]
        times = {(kind, n): [] for kind in kinds for n in rows}
        for n in rows:
            inputs = {size: torch.randn(n, size) for size in {w.shape[1] for w in weights}}
            for _ in range(args.repeats + 1):  # the first round warms caches and is dropped
                for kind in kinds:
                    if kind.split()[-1] in native.INT8_KERNELS:  # that kernel, whatever this machine chose
                        native._KERNEL[:] = [(kind.split()[-1],) * 2]
                    t0 = time.perf_counter()
                    for layer in built[kind]:
                        layer(inputs[layer.in_features])
                    times[(kind, n)].append(time.perf_counter() - t0)
        print(f"\nms for one step's matrix products (median of {args.repeats}):")
        print("| kernel | " + " | ".join(f"{n} rows" for n in rows) + " |")
        print("|---|" + "---|" * len(rows))
        for kind in kinds:
            cells = [f"{statistics.median(times[(kind, n)][1:]) * 1e3:.1f}" for n in rows]
            print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
