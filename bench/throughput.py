"""Aggregate and per-slot decode tok/s of the batched engine at several widths, next to
transformers ``generate`` at the same batch sizes (chat) and faster-whisper run clip after clip
(Whisper), plus the stall a joining request causes the running slots. One run, same machine,
greedy, float32.

    .venv/bin/python bench/throughput.py [--widths 1,2,4,8] [--tokens 64] [--device cpu]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from bench.analyze_steps import read_log  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

# float32 throughout: generate and faster-whisper are compared token for token in float32, and the engine's
# default (precision auto) may pick bfloat16 or int8 on this machine, which gives other tokens.
PRECISION = "float32"

PROMPTS = [
    "Explain how a bicycle works.", "Write a short story about a lighthouse keeper.",
    "What are the benefits of exercise?", "Describe the water cycle.", "Give me three tips for cooking rice.",
    "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.", "How do vaccines work?",
]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def chat_table(widths, n_tokens, device):
    from bench.common import in_fresh_thread
    from engine.chat.reference import ChatReference, build_messages
    from engine import ChatRequest, Engine
    from engine.loading import load
    from engine.sampling import SamplingParams

    loaded = load("smollm2-135m-instruct", device=device)
    ref = ChatReference(loaded)
    tok = loaded.tokenizer
    print(f"## Chat, smollm2-135m-instruct, {n_tokens} tokens per request, greedy\n")
    print("| width | Cadence aggregate tok/s | Cadence per slot tok/s | generate aggregate tok/s | ratio | same tokens |")
    print("|---|---|---|---|---|---|")
    for w in widths:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(w)]
        engine = Engine(backend=device, batch=w, precision=PRECISION)
        params = SamplingParams(max_tokens=n_tokens)
        engine.submit(ChatRequest("warm up", params=SamplingParams(max_tokens=4))).result()
        t0 = time.perf_counter()
        results = [h.result() for h in [engine.submit(ChatRequest(p, params=params)) for p in prompts]]
        wall = time.perf_counter() - t0
        engine.shutdown()
        total = sum(len(r.tokens) for r in results)
        per_slot = statistics.mean(r.stats["decode_tok_s"] or 0 for r in results)
        # transformers generate on the same prompts, left-padded, same token budget
        ids = [ref.prompt_ids(build_messages(p)) for p in prompts]
        tok.padding_side = "left"
        enc = tok([tok.decode(i) for i in ids], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        _sync(device)
        t0 = time.perf_counter()
        out = in_fresh_thread(loaded.model.generate, **enc, max_new_tokens=n_tokens, do_sample=False,
                              pad_token_id=tok.eos_token_id)
        _sync(device)
        g_wall = time.perf_counter() - t0
        rows = out[:, enc.input_ids.shape[1]:].tolist()
        g_tokens = [row[: row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
                    for row in rows]
        g_total = sum(len(r) for r in g_tokens)
        same = sum(r.tokens == g for r, g in zip(results, g_tokens))
        print(f"| {w} | {total / wall:.1f} | {per_slot:.1f} | {g_total / g_wall:.1f} | "
              f"{(total / wall) / (g_total / g_wall):.2f}x | {same}/{w} |", flush=True)


def whisper_tables(widths, device):
    from bench.common import faster_whisper_model, in_fresh_thread, speech_samples
    from engine import Engine, TranscribeRequest

    work = Path(tempfile.mkdtemp())
    clips = speech_samples(work, 8)
    seconds = sum(c.size for c in clips) / 16000
    print(f"\n## Whisper, 8 clips ({seconds:.0f} s of speech), greedy, models loaded\n")
    print("Decode only (encoder excluded), from the step log: tokens / time in decode steps.\n")
    print("| model | width | decode aggregate tok/s | per slot tok/s | mean busy slots | end to end (s) |")
    print("|---|---|---|---|---|---|")
    end_to_end = {}
    for name in ("whisper-tiny.en", "whisper-base"):
        for w in widths:
            log = work / f"{name}-{w}.jsonl"
            engine = Engine(backend=device, batch=w, precision=PRECISION)
            engine.submit(TranscribeRequest(clips[0], model=name, language="en", windowing="fixed")).result()
            engine.log_steps(log)  # the timed run only
            t0 = time.perf_counter()
            handles = [engine.submit(TranscribeRequest(c, model=name, language="en", windowing="fixed")) for c in clips]
            got = [h.result() for h in handles]
            wall = time.perf_counter() - t0
            engine.shutdown()
            steps = read_log(log)
            tokens = sum(sum(s["tokens"].values()) for s in steps)
            decode_s = sum(s["step_ms"] for s in steps) / 1000
            busy = statistics.mean(s["slots"] for s in steps)
            slot_steps = sum(s["slots"] for s in steps)
            per_slot = tokens / decode_s / busy if decode_s else 0  # each slot's share of the step rate
            end_to_end[(name, w)] = (wall, got)
            print(f"| {name} | {w} | {tokens / decode_s:.1f} | {per_slot:.1f} | {slot_steps / len(steps):.2f} | "
                  f"{wall:.2f} |", flush=True)

    print(f"\n## Whisper end to end, 8 clips, width {max(widths)} vs faster-whisper clip after clip\n")
    print("| model | faster-whisper one after another (s) | Cadence engine (s) | speed-up | same tokens |")
    print("|---|---|---|---|---|")
    for name in ("whisper-tiny.en", "whisper-base"):
        fw = faster_whisper_model(name, work / name, torch.get_num_threads())
        t0 = time.perf_counter()
        fw_tokens = in_fresh_thread(lambda: [
            [t for s in fw.transcribe(c, language="en", beam_size=1, temperature=0, without_timestamps=True,
                                      condition_on_previous_text=False)[0] for t in s.tokens] for c in clips])
        fw_s = time.perf_counter() - t0
        our_s, got = end_to_end[(name, max(widths))]
        same = [[t for s in g.segments for t in s.tokens] for g in got] == fw_tokens
        print(f"| {name} | {fw_s:.2f} | {our_s:.2f} | {fw_s / our_s:.2f}x | {same} |", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return clips


def encoder_table(device):
    """One 30-s window through Cadence's encoder and through CTranslate2's (faster-whisper), best of 3."""
    import ctranslate2
    import numpy as np

    from bench.common import faster_whisper_model, in_fresh_thread
    from engine.families.whisper import WhisperBatched
    from engine.loading import load

    work = Path(tempfile.mkdtemp())
    print("\n## Whisper encoder, one 30-s window (best of 3)\n")
    print("| model | Cadence (s) | CTranslate2 (s) |")
    print("|---|---|---|")
    for name in ("whisper-tiny.en", "whisper-base"):
        decoder = WhisperBatched(load(name, device=device))
        fw = faster_whisper_model(name, work / name, torch.get_num_threads())
        features = np.random.default_rng(0).standard_normal((1, decoder.conv1[0].shape[1], 3000)).astype(np.float32)
        window = torch.from_numpy(features).to(device)
        stored = ctranslate2.StorageView.from_array(features)

        def best(fn):
            fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        ours = in_fresh_thread(best, lambda: decoder.encode(window))
        theirs = in_fresh_thread(best, lambda: fw.model.encode(stored, to_cpu=False))
        print(f"| {name} | {ours:.3f} | {theirs:.3f} |", flush=True)
    shutil.rmtree(work, ignore_errors=True)


def stall_table(width, device):
    """A running slot's worst gap between tokens while others join, against its usual gap."""
    from bench.common import speech_samples
    from engine import ChatRequest, Engine, TranscribeRequest
    from engine.sampling import SamplingParams

    work = Path(tempfile.mkdtemp())
    clips = speech_samples(work, width)
    print(f"\n## Joining stall, width {width}\n")
    print("| lane | what joins | usual step ms (median) | worst step with joiners ms | joiner's whole preparation ms |")
    print("|---|---|---|---|---|")
    for name in ("whisper-tiny.en", "whisper-base"):
        log = work / f"stall-{name}.jsonl"
        engine = Engine(backend=device, batch=width, precision=PRECISION)
        engine.submit(TranscribeRequest(clips[0], model=name, language="en", windowing="fixed")).result()
        engine.log_steps(log)
        first = engine.submit(TranscribeRequest(clips[0], model=name, language="en"))
        next(e for e in first if e.kind == "started")
        time.sleep(0.5)  # let it decode, then the rest join
        [h.result() for h in [engine.submit(TranscribeRequest(c, model=name, language="en")) for c in clips[1:]]]
        first.result()
        engine.shutdown()
        steps = [s for s in read_log(log) if s["rows"] > s["prefill_rows"]]
        usual = statistics.median(s["step_ms"] for s in steps)
        worst = max(s["step_ms"] + s["prepare_ms"] for s in steps)
        whole = sum(s["prepare_ms"] for s in read_log(log)) / width
        print(f"| {name} | 30-s windows (encoder, layer by layer) | {usual:.1f} | {worst:.1f} | {whole:.0f} |",
              flush=True)
    log = work / "stall-chat.jsonl"
    engine = Engine(backend=device, batch=width, precision=PRECISION)
    engine.submit(ChatRequest("warm up", params=SamplingParams(max_tokens=4))).result()
    engine.log_steps(log)
    runner = engine.submit(ChatRequest(PROMPTS[0], params=SamplingParams(max_tokens=96)))
    next(e for e in runner if e.kind == "delta")
    long_prompt = " ".join(PROMPTS * 12)  # ~600 tokens: prefilled 64 rows per step beside the runner
    engine.submit(ChatRequest(f"Summarize: {long_prompt}", params=SamplingParams(max_tokens=8))).result()
    runner.result()
    engine.shutdown()
    steps = [s for s in read_log(log) if s["rows"] > s["prefill_rows"]]
    usual = statistics.median(s["step_ms"] for s in steps)
    worst = max(s["step_ms"] + s["prepare_ms"] for s in steps)
    prefill = sum(s["step_ms"] for s in read_log(log) if s["prefill_rows"] > 0)
    print(f"| smollm2-135m-instruct | a ~600-token prompt (64-row chunks) | {usual:.1f} | {worst:.1f} | "
          f"{prefill:.0f} (steps with prompt rows) |", flush=True)
    shutil.rmtree(work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", choices=("chat", "whisper", "encoder", "stall"), default=None)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads\n")
    if args.only in (None, "chat"):
        chat_table(widths, args.tokens, args.device)
    if args.only in (None, "whisper"):
        whisper_tables(widths, args.device)
    if args.only in (None, "encoder"):
        encoder_table(args.device)
    if args.only in (None, "stall"):
        stall_table(max(widths), args.device)


if __name__ == "__main__":
    main()
