"""int8's layer ops in C (engine/native/layer_ops.c) against PyTorch's, side by side on one decoder.

    .venv/bin/python bench/fused_ops.py [--widths 1,8,16] [--tokens 48] [--repeats 4]

Chat: SmolLM2-135M-Instruct in int8 (the native kernel, float32 activations), greedy continuations of
"Write a long story about ..." prompts at each width, the same decoder run with its fused ops on and off
in turn (``_fused_ops``: residual add + RMS norm, rotary, SiLU gating, attention), so a machine drifting
in speed moves both alike; ms per step (the prompt's prefill included, as bench/profile_step.py counts)
and whether the greedy tokens are the same. Whisper: the precision check's transcript of the bundled
clip (encoder and decoder) with the decoder's attention in C and in PyTorch, tiny.en and base.
Prints the CPU model first; run on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def chat(widths: list[int], tokens: int, repeats: int) -> None:
    from engine.chat.reference import ChatReference, build_messages
    from engine.families.llama import LlamaBatched
    from engine.loading import load
    from engine.precision import _greedy

    loaded = load("smollm2-135m-instruct")
    ref = ChatReference(loaded)
    decoder = LlamaBatched(loaded, precision="int8")
    assert decoder._fused_ops, "int8 runs on the native kernel here (a C compiler is needed)"
    print("\n| width | PyTorch's ops, ms a step | fused in C, ms a step | speed-up | same greedy tokens |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for width in widths:
            ids = [ref.prompt_ids(build_messages(f"Write a long story about topic {i}.")) for i in range(width)]
            times, outs = {True: [], False: []}, {}
            for _ in range(repeats + 1):  # the first round warms up and is dropped
                for fused in (False, True):
                    decoder._fused_ops = fused
                    t0 = time.perf_counter()
                    outs[fused] = _greedy(decoder, ids, tokens)
                    times[fused].append((time.perf_counter() - t0) / tokens * 1e3)
            off, on = (statistics.median(times[f][1:]) for f in (False, True))
            same = sum(a == b for x, y in zip(outs[True], outs[False]) for a, b in zip(x, y))
            print(f"| {width} | {off:.1f} | {on:.1f} | {off / on:.2f}x | {same}/{tokens * width} |")


def whisper(repeats: int) -> None:
    from engine.families.whisper import WhisperBatched
    from engine.loading import load
    from engine.precision import check_speech, whisper_transcript
    from engine.whisper.reference import WhisperReference

    samples, _ = check_speech()
    print("\n| model | PyTorch's attention, s | in C, s | speed-up | same words |")
    print("|---|---|---|---|---|")
    for name in ("whisper-tiny.en", "whisper-base"):
        loaded = load(name)
        ref = WhisperReference(loaded)
        decoder = WhisperBatched(loaded, precision="int8")
        times, words = {True: [], False: []}, {}
        with torch.inference_mode():
            for _ in range(repeats):
                for fused in (False, True):
                    decoder._fused_attention = fused
                    t0 = time.perf_counter()
                    words[fused] = whisper_transcript(decoder, ref, samples)
                    times[fused].append(time.perf_counter() - t0)
        off, on = (statistics.median(times[f]) for f in (False, True))
        print(f"| {name} | {off:.2f} | {on:.2f} | {off / on:.2f}x | {'yes' if words[True] == words[False] else 'no'} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="1,8,16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    from engine.calibration import device_identity
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    print(f"{device_identity('cpu')}, torch {torch.__version__}")
    chat([int(w) for w in args.widths.split(",")], args.tokens, args.repeats)
    whisper(max(1, args.repeats - 1))


if __name__ == "__main__":
    main()
