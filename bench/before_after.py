"""Quick speed figures of one checkout, to compare two side by side in one session (a change's
before and after): chat decode in float32 and int8 at 1 and 8 streams, and Whisper on 16 short clips.

Chat: SmolLM2-135M-Instruct, 8 "Write a long story about ..." prompts, 64 new tokens, greedy,
drafting off, one warmed engine of width 8; tok/s end to end (prefill included). Whisper:
whisper-tiny.en with timestamps on the suite's four English clips four times over, width 8, best of 3.

    .venv/bin/python bench/before_after.py [CHECKOUT]   # default: this one

Run it for each checkout one right after the other, on a quiet machine, with the same Python.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
CHECKOUT = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else HERE
sys.path.insert(0, str(CHECKOUT))
sys.path.insert(1, str(HERE / "tests"))  # the suite's speech clips (espeak-ng)

PROMPTS = [f"Write a long story about {t}." for t in
           ("a cat", "the sea", "a robot", "a city", "winter", "a train", "a garden", "the moon")]


def chat() -> None:
    from engine import ChatRequest, Engine, SamplingParams

    for precision in ("float32", "int8"):
        engine = Engine(backend="cpu", batch=8, drafter="off", precision=precision)
        try:
            engine.submit(ChatRequest("Hi", params=SamplingParams(max_tokens=4))).result(600)
            for n in (1, 8):
                for timed in (False, True):  # the first round warms this width
                    start = time.perf_counter()
                    handles = [engine.submit(ChatRequest(p, params=SamplingParams(max_tokens=64))) for p in PROMPTS[:n]]
                    results = [h.result(600) for h in handles]
                    wall = time.perf_counter() - start
                if timed:
                    first = sum(r.stats["time_to_first_token"] for r in results) / n
                    print(f"chat {precision} N={n}: {sum(len(r.tokens) for r in results) / wall:.1f} tok/s, "
                          f"first token {first:.2f} s")
        finally:
            engine.shutdown()


def whisper() -> None:
    import tempfile

    from conftest import SPEECH, synthesize

    from engine import Engine, TranscribeRequest

    folder = Path(tempfile.mkdtemp(prefix="cadence-bench-"))
    clips = [synthesize(text, folder / f"{name}.wav", voice, rate)
             for name, (voice, rate, text) in SPEECH.items() if name != "german"] * 4
    engine = Engine(backend="cpu", batch=8, drafter="off", precision="float32")
    try:
        engine.submit(TranscribeRequest(clips[0], model="whisper-tiny.en", timestamps=True)).result(600)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            handles = [engine.submit(TranscribeRequest(c, model="whisper-tiny.en", timestamps=True)) for c in clips]
            for h in handles:
                h.result(600)
            best = min(best, time.perf_counter() - start)
        print(f"whisper-tiny.en, 16 clips, timestamps, width 8: best of 3 {best:.2f} s")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    print(f"checkout: {CHECKOUT}")
    chat()
    whisper()
