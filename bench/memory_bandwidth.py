"""This machine's memory read bandwidth as a decode step sees it: how fast PyTorch reads a weight-sized
buffer much larger than the caches, with the threads the engine uses.

    .venv/bin/python bench/memory_bandwidth.py [--mb 1024] [--repeats 10]

A decode step at small widths reads every weight once, so its matrix products cannot run faster than
(weight bytes) / (this bandwidth); two machines with the same CPU name can differ here by 2x. Prints
the CPU model with the figure (record both in docs/BENCHMARKS.md). Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=1024, help="buffer size in MiB (default 1024)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    from engine.calibration import device_identity

    n = args.mb * 2**20 // 4
    buffer = torch.ones(n, dtype=torch.float32)
    sums, matvec = [], []
    for _ in range(args.repeats):  # a reduction reads the buffer once, writes nothing
        t0 = time.perf_counter()
        buffer.sum()
        sums.append(time.perf_counter() - t0)
    rows = 4096
    matrix = buffer[: (n // rows) * rows].view(rows, -1)
    vector = torch.ones(matrix.shape[1], 1)
    for _ in range(args.repeats):  # one row times every weight: a width-1 decode step's matrix product
        t0 = time.perf_counter()
        matrix @ vector
        matvec.append(time.perf_counter() - t0)
    gb = n * 4 / 1e9
    print(f"# {device_identity('cpu')}, torch {torch.__version__}")
    print(f"read by a sum:                {gb / min(sums[1:]):.1f} GB/s (best of {args.repeats - 1}, {args.mb} MiB)")
    print(f"read by a matrix-vector product: {gb / min(matvec[1:]):.1f} GB/s")


if __name__ == "__main__":
    main()
