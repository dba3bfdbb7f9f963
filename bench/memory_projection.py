"""int8 Whisper's memory projection, both ways side by side: each window's encoder states (1500 rows)
projected into every decoder layer's cross-attention keys and values (``WhisperBatched.set_memory``),
with the decode kernels' int8 weights or with the float weights as they are
(``engine.many_rows_int8.memory_projection_way``).

    .venv/bin/python bench/memory_projection.py [--models whisper-tiny.en,whisper-base] [--rounds 7]

For each model: one int8 decoder per way, a real window (the bundled check speech's first 30 s)
encoded once, then ``set_memory`` timed for each way in turns (best of ``--rounds``), and each way's
keys and values against float32's (relative error over all layers). Prints what this machine recorded
as its way. Run on a quiet machine and record the CPU model (`lscpu`) with the figures.
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
    parser.add_argument("--models", default="whisper-tiny.en,whisper-base")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import engine.many_rows_int8 as many_rows_int8
    from bench.cpu import cpu_model
    from engine.families.whisper import WhisperBatched
    from engine.kernels import unquantized_dtype
    from engine.loading import load
    from engine.precision import check_speech
    from engine.whisper.features import log_mel, pad_window

    unquantized = unquantized_dtype("int8", torch.device("cpu"))
    print(f"# CPU: {cpu_model()}; torch {torch.__version__}, "
          f"recorded way here: {many_rows_int8.memory_projection_way(unquantized)}\n")
    print("| model | way | set_memory, ms a window | keys/values vs float32 |")
    print("|---|---|---|---|")
    samples = check_speech()[0]
    for model in args.models.split(","):
        loaded = load(model)
        window = torch.from_numpy(pad_window(log_mel(samples[:480000], loaded.model.config.num_mel_bins)))[None]
        reference = WhisperBatched(loaded, width=1, precision="float32")
        encoded = reference.encode(window.float())[0]
        reference.set_memory(0, encoded)
        decoders = {}
        for way in ("int8", "float"):
            many_rows_int8._MEMORY_WAY[unquantized] = way
            decoders[way] = WhisperBatched(loaded, width=1, precision="int8")
        many_rows_int8._MEMORY_WAY.clear()
        best = {way: float("inf") for way in decoders}
        for _ in range(args.rounds):
            for way, decoder in decoders.items():
                start = time.perf_counter()
                decoder.set_memory(0, encoded)
                best[way] = min(best[way], time.perf_counter() - start)
        exact = torch.cat([reference.cross_k[:, 0], reference.cross_v[:, 0]]).float()
        for way, decoder in decoders.items():
            got = torch.cat([decoder.cross_k[:, 0], decoder.cross_v[:, 0]]).float()
            error = ((got - exact).norm() / exact.norm()).item()
            print(f"| {model} | {way} ({decoder.memory_projection}) | {best[way] * 1000:.1f} | {error:.2e} |", flush=True)


if __name__ == "__main__":
    main()
