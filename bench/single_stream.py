"""Load times (cold / cached) and single-stream speed of each model, next to the usual tools.

Cadence's exact reference decoders against faster-whisper (Whisper, same float32 weights, greedy)
and transformers ``generate`` (chat, greedy), measured in one run on this machine.

    .venv/bin/python bench/single_stream.py [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
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
    "Explain how a bicycle works to a ten year old.",
    "Write a short story about a lighthouse keeper.",
]


def timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="cadence-bench-"))
    os.environ["CADENCE_CACHE_DIR"] = str(work / "cache")

    from bench.common import faster_whisper_model, speech_samples
    from engine.chat.reference import ChatReference, build_messages
    from engine.loading import load
    from engine.sampling import SamplingParams
    from engine.whisper.pipeline import transcribe_samples
    from engine.whisper.reference import WhisperReference

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("## Load times (s)\n\n| model | cold (convert + cache) | cached |\n|---|---|---|")
    loaded = {}
    for name in ("whisper-tiny.en", "whisper-base", "smollm2-135m-instruct"):
        cold = load(name).report.seconds
        cached = min(load(name).report.seconds for _ in range(2))
        loaded[name] = load(name)
        print(f"| {name} | {cold:.2f} | {cached:.2f} |")

    clips = speech_samples(work, 4)
    audio_s = sum(c.size for c in clips) / 16000
    print(f"\n## Whisper, {len(clips)} clips, {audio_s:.1f} s of speech, greedy, float32, best of {args.repeats}\n")
    print("| model | engine | seconds | tokens | tok/s | same tokens as faster-whisper |\n|---|---|---|---|---|---|")
    for name in ("whisper-tiny.en", "whisper-base"):
        fw = faster_whisper_model(name, work / f"fw-{name}", torch.get_num_threads())
        ref = WhisperReference(loaded[name])

        def run_fw():
            return [[t for s in fw.transcribe(c, beam_size=1, temperature=0, without_timestamps=True,
                                              condition_on_previous_text=False, language="en")[0] for t in s.tokens]
                    for c in clips]

        def run_ours():
            return [[t for s in transcribe_samples(ref, c, language="en", windowing="fixed").segments
                     for t in s.tokens] for c in clips]

        fw_tokens, fw_s = min((timed(run_fw) for _ in range(args.repeats)), key=lambda r: r[1])
        our_tokens, our_s = min((timed(run_ours) for _ in range(args.repeats)), key=lambda r: r[1])
        n = sum(map(len, fw_tokens))
        print(f"| {name} | faster-whisper | {fw_s:.2f} | {n} | {n / fw_s:.1f} | — |")
        m = sum(map(len, our_tokens))
        print(f"| {name} | Cadence reference | {our_s:.2f} | {m} | {m / our_s:.1f} | {our_tokens == fw_tokens} |")

    print(f"\n## Chat (smollm2-135m-instruct), {args.tokens} new tokens, greedy, float32, best of {args.repeats}\n")
    print("| prompt | engine | decode tok/s | same tokens as generate |\n|---|---|---|---|")
    chat = loaded["smollm2-135m-instruct"]
    ref = ChatReference(chat)
    for prompt in PROMPTS:
        ids = ref.prompt_ids(build_messages(prompt))
        x = torch.tensor([ids])

        def run_generate():
            return chat.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens,
                                       min_new_tokens=args.tokens, do_sample=False,
                                       pad_token_id=chat.tokenizer.eos_token_id)[0, len(ids):].tolist()

        def prefill():
            with torch.inference_mode():
                chat.model(x)

        _, prefill_s = min((timed(prefill) for _ in range(args.repeats)), key=lambda r: r[1])
        gen_tokens, gen_s = min((timed(run_generate) for _ in range(args.repeats)), key=lambda r: r[1])
        gen_rate = len(gen_tokens) / max(gen_s - prefill_s, 1e-9)
        results = [ref.generate(ids, SamplingParams(max_tokens=args.tokens)) for _ in range(args.repeats)]
        best = max(results, key=lambda r: r.stats["tok_s"])
        same = best.tokens == gen_tokens[: len(best.tokens)]
        print(f"| {prompt[:40]} | transformers generate | {gen_rate:.1f} | — |")
        print(f"| {prompt[:40]} | Cadence reference | {best.stats['tok_s']:.1f} | {same} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
