"""Drafting: acceptance and speed with and without each drafter, on inputs never used for training.

Chat: the held-out prompts of the MTP prompt set (engine.mtp.prompts.HELD_OUT_PROMPTS), greedy and
temperature 0.7 (seeded), at widths 1 and 4 / 8; chat about a transcript (questions whose answers
quote it), at widths 1 and 4. Whisper: espeak-ng speech of the held-out texts and of the
transcription benchmark's sentences, greedy, at widths 1 and 4. For every (model, width) the
drafters run one after another in the same process, each on a fresh engine after one warm-up
request, so the ratios compare like with like.

Reported per run: tokens, wall seconds, aggregate tok/s, speed-up over no drafting, drafted
tokens, acceptance rate, mean acceptance length (1 + accepted / verifying steps), and whether
every answer's tokens equal the run without drafting (they must, near-ties aside; seeded sampled
answers too, since a sampled token is drawn once per position whether or not a draft was made).

    .venv/bin/python bench/drafting.py                     # everything (~10 min on 2 cores)
    .venv/bin/python bench/drafting.py --only chat --widths 1 --drafters off,mtp,mtp@0.3,mtp@0.5
    .venv/bin/python bench/drafting.py --only chat --widths 1 --drafters off,mtp/1,mtp/1~old --head old=OLD.safetensors

A drafter is NAME[/DEPTH][@MIN_P][~HEAD]: a fixed draft depth (--draft-depth), a minimum head
probability (--draft-min-p), and an MTP head file given by --head HEAD=PATH instead of the shipped one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import re
from contextlib import contextmanager

from engine.api import ChatAnswer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "out"


def _run(engine, requests) -> tuple[float, list]:
    start = time.perf_counter()
    handles = [engine.submit(r) for r in requests]
    results = [h.result(1800) for h in handles]
    return time.perf_counter() - start, results


def _tokens(result) -> list[int]:
    if isinstance(result, ChatAnswer):
        return result.tokens
    return [t for s in result.segments for t in s.tokens]


def _drafting(result) -> dict:
    return result.stats["drafting"]


HEADS: dict[str, Path] = {}  # --head LABEL=PATH
PRECISION: str | None = None  # --precision; None: CADENCE_PRECISION, else auto
_SPEC = re.compile(r"^(?P<name>[^/@~]+)(?:/(?P<depth>\d+))?(?:@(?P<min_p>[0-9.]+))?(?:~(?P<head>\w+))?$")


def parse_drafter(spec: str) -> dict:
    """'mtp/2@0.3~old' -> drafter mtp, depth 2, min p 0.3, head file HEADS['old']."""
    m = _SPEC.match(spec)
    if m is None or (m["head"] and m["head"] not in HEADS):
        raise SystemExit(f"Cannot read the drafter {spec!r}: write NAME[/DEPTH][@MIN_P][~HEAD], HEAD given by --head.")
    return {"drafter": m["name"], "draft_depth": int(m["depth"]) if m["depth"] else None,
            "draft_min_p": float(m["min_p"] or 0), "head": HEADS.get(m["head"]) if m["head"] else None}


@contextmanager
def _head_file(path: Path | None):
    """The engine reads MTP heads through engine.mtp.head.head_path: point it at ``path`` meanwhile."""
    import engine.mtp.head as head_module

    shipped = head_module.head_path
    if path is not None:
        head_module.head_path = lambda model: path
    try:
        yield
    finally:
        head_module.head_path = shipped


def measure(model: str, width: int, drafters: list[str], requests_for, warmup, sampling: str = "greedy") -> list[dict]:
    """One row per drafter: the same requests on a fresh engine each."""
    from engine import Engine

    rows, baseline = [], None
    for drafter in drafters:
        spec = parse_drafter(drafter)
        with _head_file(spec["head"]):
            engine = Engine(backend="cpu", batch=width, precision=PRECISION, drafter=spec["drafter"],
                            draft_depth=spec["draft_depth"], draft_min_p=spec["draft_min_p"])
            try:
                engine.submit(warmup).result(600)  # load, calibrate, warm the kernels
                seconds, results = _run(engine, requests_for())
                lane = engine.status()["lanes"][model]["drafting"]
            finally:
                engine.shutdown()
        tokens = [_tokens(r) for r in results]
        n = sum(len(t) for t in tokens)
        drafted = sum(_drafting(r)["drafted"] for r in results)
        accepted = sum(_drafting(r)["accepted"] for r in results)
        row = {"model": model, "width": width, "sampling": sampling, "drafter": drafter, "state": lane["state"], "tokens": n,
               "seconds": round(seconds, 3), "tok_s": round(n / seconds, 1), "drafted": drafted, "accepted": accepted,
               "acceptance": round(accepted / drafted, 3) if drafted else None,
               "mean_acceptance_length": lane["mean_acceptance_length"],
               "acceptance_by_position": lane["acceptance_by_position"]}
        if baseline is None:
            baseline = (tokens, n / seconds)
            row["speedup"], row["same_tokens"] = 1.0, f"{len(tokens)}/{len(tokens)}"
        else:
            row["speedup"] = round(row["tok_s"] / baseline[1], 2)
            row["same_tokens"] = f"{sum(a == b for a, b in zip(tokens, baseline[0]))}/{len(tokens)}"
        rows.append(row)
        print(_line(row), flush=True)
    return rows


HEADER = ("| model | width | sampling | drafter | tokens | s | tok/s | speed-up | drafted | acceptance | "
          "mean acc. length | same tokens |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def _line(r: dict) -> str:
    acc = f"{r['acceptance']:.1%}" if r["acceptance"] is not None else "-"
    return (f"| {r['model']} | {r['width']} | {r.get('sampling', 'greedy')} | {r['drafter']} | {r['tokens']} | "
            f"{r['seconds']:.2f} | {r['tok_s']} | {r['speedup']}x | {r['drafted']} | {acc} | "
            f"{r['mean_acceptance_length'] or '-'} | {r['same_tokens']} |")


def chat_rows(widths, drafters, prompts: int, max_tokens: int) -> list[dict]:
    from engine import ChatRequest
    from engine.models import DEFAULT_CHAT
    from engine.mtp.prompts import HELD_OUT_PROMPTS
    from engine.sampling import SamplingParams

    held = HELD_OUT_PROMPTS[:prompts]
    warmup = ChatRequest("Say hello.", params=SamplingParams(max_tokens=8))
    rows = []
    for temperature in (0.0, 0.7):
        for width in widths:
            def requests(t=temperature):
                return [ChatRequest(p, params=SamplingParams(max_tokens=max_tokens, temperature=t,
                                                             seed=i if t else None))
                        for i, p in enumerate(held)]
            rows += measure(DEFAULT_CHAT, width, drafters, requests, warmup,
                            "greedy" if temperature == 0 else f"t={temperature}")
    return rows


QUESTIONS = [
    "Summarize this transcript in three sentences.",
    "Quote the sentences that mention the meeting, word for word.",
    "List every place mentioned in the transcript.",
    "What was said about the weather? Quote it.",
]


def transcript_rows(widths, drafters, max_tokens: int) -> list[dict]:
    """Chat about a transcript (the request the app sends for "chat about this transcript"): answers
    quote their prompt, which is where n-gram lookup should shine."""
    import random

    from bench.transcription import long_text
    from engine.chat.answering import transcript_context
    from engine.models import DEFAULT_CHAT
    from engine.chat.run import DocumentChatRequest
    from engine.sampling import SamplingParams

    text = long_text(150, 150, random.Random(11))  # about 2.5 minutes of meeting-like speech, as transcribed
    parts, system_for, _ = transcript_context({"text": text})
    warmup = DocumentChatRequest("Say hello.", params=SamplingParams(max_tokens=8), parts=parts, system_for=system_for)
    print(f"Transcript chat: {len(text.split())} words of transcript, {len(QUESTIONS)} questions", flush=True)
    rows = []
    for width in widths:
        def requests():
            return [DocumentChatRequest(q, params=SamplingParams(max_tokens=max_tokens), parts=parts, system_for=system_for)
                    for q in QUESTIONS]
        rows += measure(DEFAULT_CHAT, width, drafters, requests, warmup, "greedy, transcript")
    return rows


def whisper_rows(models, widths, drafters, work: Path) -> list[dict]:
    from bench.transcription import batch_durations, make_clips, speak
    from engine.audio import load_audio
    from engine import TranscribeRequest
    from engine.mtp.prompts import texts_for_speech

    voices = [("en-us+f3", 130), ("en-us+m3", 150), ("en-gb+f2", 140), ("en-us+m7", 160)]
    clips = [load_audio(speak(text, work / f"held{i}.wav", *voices[i % len(voices)]))
             for i, text in enumerate(texts_for_speech(held_out=True))]
    # and the transcription benchmark's sentences (never seen in training), 15 to 60 s per clip
    clips += [load_audio(c.path) for c in make_clips(work, batch_durations(6, 15.0, 60.0, seed=9), seed=3, prefix="b")]
    print(f"Whisper speech: {len(clips)} held-out clips, {sum(len(c) for c in clips) / 16000:.0f} s", flush=True)
    rows = []
    for model in models:
        # the default path of the app and `cadence transcribe`: voice-activity windows, timestamps
        warmup = TranscribeRequest(clips[0][:16000 * 3], model=model, language="en", timestamps=True)
        for width in widths:
            for r in measure(model, width, drafters,
                             lambda m=model: [TranscribeRequest(c, model=m, language="en", timestamps=True)
                                              for c in clips], warmup):
                rows.append(r)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("chat", "transcript", "whisper"), default=None)
    parser.add_argument("--widths", default="1,4,8", help="chat widths (Whisper: 1 and 4 unless --whisper-widths)")
    parser.add_argument("--whisper-widths", default="1,4")
    parser.add_argument("--drafters", default="off,ngram,mtp,auto",
                        help="the first is the baseline; NAME[/DEPTH][@MIN_P][~HEAD], e.g. mtp@0.5, mtp/1~old")
    parser.add_argument("--head", action="append", default=[], metavar="LABEL=PATH",
                        help="an MTP head file that drafters ending in ~LABEL use instead of the shipped one")
    parser.add_argument("--precision", default=None, help="the engines' precision (auto, float32, int8, ...; "
                        "default: CADENCE_PRECISION, else auto)")
    parser.add_argument("--models", default="whisper-tiny.en,whisper-base")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    import torch

    global PRECISION
    PRECISION = args.precision
    for item in args.head:
        label, _, path = item.partition("=")
        if not path or not Path(path).is_file():
            raise SystemExit(f"--head wants LABEL=PATH of a head file; {item!r} is not one.")
        HEADS[label] = Path(path)
    drafters = [d.strip() for d in args.drafters.split(",")]
    for d in drafters:
        parse_drafter(d)  # a misspelt drafter stops here, not after minutes of other rows
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, precision {PRECISION or 'default'}\n\n"
          f"{HEADER}", flush=True)
    rows = []
    if args.only in (None, "chat"):
        rows += chat_rows([int(w) for w in args.widths.split(",")], drafters, args.prompts, args.max_tokens)
    if args.only in (None, "transcript"):
        rows += transcript_rows([1, 4], drafters, args.max_tokens)
    if args.only in (None, "whisper"):
        with tempfile.TemporaryDirectory(prefix="cadence-drafting-") as work:
            rows += whisper_rows([m.strip() for m in args.models.split(",")],
                                 [int(w) for w in args.whisper_widths.split(",")], drafters, Path(work))
    print("\n" + HEADER)
    for r in rows:
        print(_line(r))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "drafting.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
