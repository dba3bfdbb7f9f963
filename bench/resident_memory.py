"""The engine's resident memory once a model has loaded and answered: what a person's machine gives
Cadence for one chat model, precision auto (which builds, times and drops float32 and int8 decoders
on a model's first load on a machine, then reads its choice from the cache).

    .venv/bin/python bench/resident_memory.py [--model smollm2-135m-instruct] [--fresh-cache]

Prints the CPU model and the process's resident memory (VmRSS, Linux) after the first answer.
``--fresh-cache`` uses an empty cache folder, so precision auto and the width calibration measure.
To compare two checkouts, copy this file into the other one's bench/ and run both on the same machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def resident_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--fresh-cache", action="store_true")
    args = parser.parse_args()
    if args.fresh_cache:
        os.environ["CADENCE_CACHE_DIR"] = tempfile.mkdtemp(prefix="cadence-memory-")

    from bench.cpu import cpu_model  # imports torch and transformers, which the engine loads anyway
    from engine import ChatRequest, Engine
    from engine.sampling import SamplingParams

    print(f"# {cpu_model()}, {os.cpu_count()} CPUs")
    engine = Engine(backend="cpu")
    t0 = time.perf_counter()
    engine.submit(ChatRequest("Say hi.", model=args.model, params=SamplingParams(max_tokens=8))).result(900)
    print(f"{args.model}: {resident_gib():.2f} GiB resident after loading and a first answer "
          f"({time.perf_counter() - t0:.1f} s{', cache fresh' if args.fresh_cache else ''})")
    engine.shutdown()


if __name__ == "__main__":
    main()
