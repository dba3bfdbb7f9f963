"""Where a chat decode step's time goes: the torch profiler over greedy steps of the decoder alone.

    .venv/bin/python bench/profile_step.py [--precision bfloat16] [--width 8] [--steps 32]
                                           [--integer-dot off|8-bit|8-bit-but-the-down-projection|16-bit]

Builds SmolLM2's batched decoder in the given precision, decodes ``--width`` prompts together (one
warm-up run, one timed run of 64 steps), then profiles ``--steps`` steps and prints the ops by self
CPU time. ``--integer-dot`` (int8 where the layer loop runs in C) runs generated tokens on integer
products, one of auto's ways (engine.precision.INTEGER_WAYS). Run on a quiet machine and record the CPU model (`lscpu`) with the figures.
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
    parser.add_argument("--precision", default="bfloat16")
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    from engine.precision import INTEGER_WAYS

    ways = {way.replace(" ", "-"): setting for way, setting in INTEGER_WAYS.items()}
    parser.add_argument("--integer-dot", choices=("off", *ways), default="off")
    args = parser.parse_args()

    from engine.chat.reference import ChatReference, build_messages
    from engine.families.llama import LlamaBatched
    from engine.loading import load
    from engine.precision import _greedy

    loaded = load("smollm2-135m-instruct")
    ref = ChatReference(loaded)
    ids = [ref.prompt_ids(build_messages(f"Write a long story about topic {i}.")) for i in range(args.width)]
    decoder = LlamaBatched(loaded, precision=args.precision)
    if args.integer_dot != "off" and not decoder.use_integer_dot(True, *ways[args.integer_dot]):
        raise SystemExit("--integer-dot needs int8 with the layer loop in C and CADENCE_INT8_KERNEL unset.")
    with torch.inference_mode():
        _greedy(decoder, ids, 16)  # warm-up
        t0 = time.perf_counter()
        _greedy(decoder, ids, 64)
        elapsed = time.perf_counter() - t0
        print(f"{args.precision} (integer products: {args.integer_dot}), width {args.width}, {torch.get_num_threads()} threads: "
              f"{elapsed / 64 * 1000:.1f} ms a step (prefill included), {64 * args.width / elapsed:.0f} tok/s")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _greedy(decoder, ids, args.steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))


if __name__ == "__main__":
    main()
