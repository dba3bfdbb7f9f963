"""Aggregate and per-slot decode tok/s of the batched engine at several widths, next to
transformers ``generate`` at the same batch sizes (chat) and faster-whisper run clip after clip
(Whisper). One run, same machine, greedy, float32.

    .venv/bin/python bench/throughput.py [--widths 1,2,4,8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

PROMPTS = [
    "Explain how a bicycle works.", "Write a short story about a lighthouse keeper.",
    "What are the benefits of exercise?", "Describe the water cycle.", "Give me three tips for cooking rice.",
    "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.", "How do vaccines work?",
]


def chat_table(widths, n_tokens):
    from engine.chat_reference import ChatReference, build_messages
    from engine.engine import ChatRequest, Engine
    from engine.loading import load
    from engine.sampling import SamplingParams

    loaded = load("smollm2-135m-instruct")
    ref = ChatReference(loaded)
    tok = loaded.tokenizer
    print(f"## Chat, smollm2-135m-instruct, {n_tokens} tokens per request, greedy\n")
    print("| width | Cadence aggregate tok/s | per slot tok/s | generate aggregate tok/s | ratio |")
    print("|---|---|---|---|---|")
    for w in widths:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(w)]
        engine = Engine(backend="cpu", batch=w)
        params = SamplingParams(max_tokens=n_tokens)
        engine.submit(ChatRequest("warm up", params=SamplingParams(max_tokens=4))).result()
        t0 = time.perf_counter()
        results = [h.result() for h in [engine.submit(ChatRequest(p, params=params)) for p in prompts]]
        wall = time.perf_counter() - t0
        engine.shutdown()
        total = sum(len(r["tokens"]) for r in results)
        per_slot = sum(r["stats"]["decode_tok_s"] or 0 for r in results) / w
        # transformers generate on the same prompts, left-padded, same token budget
        ids = [ref.prompt_ids(build_messages(p)) for p in prompts]
        tok.padding_side = "left"
        texts = [tok.decode(i) for i in ids]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        out = loaded.model.generate(**enc, max_new_tokens=n_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        g_wall = time.perf_counter() - t0
        g_total = sum(int((row != tok.eos_token_id).sum()) for row in out[:, enc.input_ids.shape[1]:])
        print(f"| {w} | {total / wall:.1f} | {per_slot:.1f} | {g_total / g_wall:.1f} | "
              f"{(total / wall) / (g_total / g_wall):.2f}x |")


def whisper_table(width):
    from bench.common import faster_whisper_model, speech_samples
    from engine.engine import Engine, TranscribeRequest

    work = Path(tempfile.mkdtemp())
    clips = speech_samples(work, 8)
    print(f"\n## Whisper, 8 clips ({sum(c.size for c in clips) / 16000:.0f} s of speech), greedy, models loaded\n")
    print("| model | faster-whisper one after another (s) | Cadence engine, width "
          f"{width} (s) | speed-up | same tokens |")
    print("|---|---|---|---|---|")
    for name in ("whisper-tiny.en", "whisper-base"):
        fw = faster_whisper_model(name, work / name, torch.get_num_threads())
        t0 = time.perf_counter()
        fw_tokens = [[t for s in fw.transcribe(c, language="en", beam_size=1, temperature=0, without_timestamps=True,
                                               condition_on_previous_text=False)[0] for t in s.tokens] for c in clips]
        fw_s = time.perf_counter() - t0
        engine = Engine(backend="cpu", batch=width)
        engine.submit(TranscribeRequest(clips[0], model=name, language="en")).result()
        t0 = time.perf_counter()
        got = [h.result() for h in [engine.submit(TranscribeRequest(c, model=name, language="en")) for c in clips]]
        our_s = time.perf_counter() - t0
        engine.shutdown()
        same = [[t for s in g.segments for t in s.tokens] for g in got] == fw_tokens
        print(f"| {name} | {fw_s:.2f} | {our_s:.2f} | {fw_s / our_s:.2f}x | {same} |")
    shutil.rmtree(work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    chat_table(widths, args.tokens)
    whisper_table(max(widths))


if __name__ == "__main__":
    main()
