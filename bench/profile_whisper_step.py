"""Where a Whisper decode step's time goes: the torch profiler over steps of the batched decoder alone.

    .venv/bin/python bench/profile_whisper_step.py [--model whisper-tiny.en] [--precision bfloat16]
                                                   [--width 16] [--rows 1] [--steps 10]

Builds the model's batched decoder in the given precision, gives every slot an encoder memory
(random states: the step's cost does not depend on them), times ``--steps`` steps of ``--rows`` new
rows per slot after a warm-up, then profiles as many and prints the ops by self CPU time, with their
shapes. It also says which dtype the encoder memory is kept in and how attention goes over it. Run
on a quiet machine and record the CPU model (`lscpu`) with the figures.
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
    parser.add_argument("--model", default="whisper-tiny.en")
    parser.add_argument("--precision", default="bfloat16")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1, help="new rows per slot (1 + drafts)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    from torch.profiler import profile

    from engine.families.whisper import WhisperBatched
    from engine.loading import load
    from engine.seam import StepBatch, attention_way

    decoder = WhisperBatched(load(args.model), width=args.width, precision=args.precision)
    memory = torch.randn(decoder.memory_len, decoder.d_model, generator=torch.Generator().manual_seed(0))
    for slot in range(args.width):
        decoder.set_memory(slot, memory.to(decoder.dtype))
    slots = list(range(args.width))
    batch = StepBatch.build(slots, [[50] * args.rows for _ in slots], [20] * args.width)

    def steps() -> None:
        for _ in range(args.steps):
            decoder.forward(batch)

    steps()  # warm-up
    start = time.perf_counter()
    steps()
    step_ms = (time.perf_counter() - start) / args.steps * 1000
    way = attention_way(torch.device("cpu"), decoder.cross_k.dtype, fixed_memory=True)
    print(f"{args.model} {args.precision}, width {args.width}, {args.rows} row(s) per slot, "
          f"{torch.get_num_threads()} threads: {step_ms:.1f} ms a step; encoder memory in "
          f"{str(decoder.cross_k.dtype).removeprefix('torch.')}, attended to the '{way}' way")
    with profile(record_shapes=True) as prof:
        steps()
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=28, max_shapes_column_width=70))


if __name__ == "__main__":
    main()
