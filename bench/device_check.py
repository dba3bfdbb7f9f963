"""The engine's invariants and throughput table on a GPU (run by bench/device_check.sh).

Models: the real configs and tokenizers of whisper-base and SmolLM2-135M-Instruct with seeded
random weights (see bench/prepare_device_check.py for why). Exactness runs in float32 with TF32
off, where the near-tie rule (gap < 1e-3) means something; then each precision the GPU offers
(bfloat16, int8) is checked for batched = serial and timed at a few widths; the width tables run
in bfloat16.

    python3 bench/device_check.py --assets .device --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

PROMPTS = [
    "Explain how a bicycle works.", "Write a short story about a lighthouse keeper.",
    "What are the benefits of exercise?", "Describe the water cycle.", "Give me three tips for cooking rice.",
    "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.", "How do vaccines work?",
]
LINES: list[str] = []
DEVICE = "cuda"
THROUGHPUT_PRECISION = "bfloat16"  # set to float32 for a CPU dry run where bfloat16 is missing


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def random_models(assets: Path, work: Path) -> dict[str, Path]:
    """Seeded random weights in each carried config's shape, saved as transformers folders."""
    from transformers import AutoConfig, AutoModelForCausalLM, WhisperForConditionalGeneration

    out = {}
    for folder in sorted((assets / "models").iterdir()):
        target = work / folder.name
        shutil.copytree(folder, target, dirs_exist_ok=True)
        config = AutoConfig.from_pretrained(folder)
        torch.manual_seed(0)
        if config.model_type == "whisper":
            model = WhisperForConditionalGeneration(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(target, safe_serialization=True)
        out[folder.name] = target
    return out


def near_tie_gap(ref, prompt_ids: list[int], got: list[int], want: list[int]) -> float | None:
    """None when equal, else the reference's top-2 logit gap at the first differing token."""
    if got == want:
        return None
    i = next(i for i, (a, b) in enumerate(zip(got + [-1], want + [-2])) if a != b)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids + want[:i]], device=ref.device)
        top2 = torch.topk(ref.model(ids).logits[0, -1].float(), 2).values
    return float(top2[0] - top2[1])


def exactness(models: dict[str, Path], clips: list[np.ndarray]) -> bool:
    from engine.chat.reference import ChatReference, build_messages
    from engine import ChatRequest, Engine, TranscribeRequest
    from engine.loading import load
    from engine.sampling import SamplingParams

    os.environ["CADENCE_DTYPE"] = "float32"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ok = True
    chat, whisper = str(models["smollm2-135m-instruct"]), str(models["whisper-base"])
    on = Engine(backend=DEVICE, batch=8, precision="float32")
    off = Engine(backend=DEVICE, batch="off", precision="float32")
    try:
        params = SamplingParams(max_tokens=48)
        say("## Exactness on the GPU (float32, random weights in the real shapes)\n")
        alone = [off.submit(ChatRequest(p, model=chat, params=params)).result(600).tokens for p in PROMPTS]
        single = on.submit(ChatRequest(PROMPTS[0], model=chat, params=params)).result(600).tokens
        say(f"- chat N=1 exact (batching on vs off): {single == alone[0]}")
        ok &= single == alone[0]
        together = [h.result(600).tokens for h in [on.submit(ChatRequest(p, model=chat, params=params))
                                                      for p in PROMPTS]]
        ref = ChatReference(load(chat, device=DEVICE, dtype=torch.float32))
        gaps = [near_tie_gap(ref, ref.prompt_ids(build_messages(p)), t, a)
                for p, t, a in zip(PROMPTS, together, alone)]
        bad = [g for g in gaps if g is not None and g >= 1e-3]
        say(f"- chat batched = serial, 8 prompts: {gaps.count(None)}/8 identical, "
            f"{len(gaps) - gaps.count(None) - len(bad)} near-ties, {len(bad)} real differences {bad}")
        ok &= not bad
        seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32)
        s_alone = off.submit(ChatRequest("Tell me about owls.", model=chat, params=seeded)).result(600).tokens
        crowd = [on.submit(ChatRequest(p, model=chat, params=SamplingParams(temperature=1.0, seed=i, max_tokens=32)))
                 for i, p in enumerate(PROMPTS[:5])]
        s_batch = on.submit(ChatRequest("Tell me about owls.", model=chat, params=seeded)).result(600).tokens
        [h.result(600) for h in crowd]
        say(f"- seeded sampling alone = in a batch: {s_alone == s_batch}")
        ok &= s_alone == s_batch
        w_alone = [off.submit(TranscribeRequest(c, model=whisper, language="en")).result(600) for c in clips]
        w_batch = [h.result(600) for h in [on.submit(TranscribeRequest(c, model=whisper, language="en"))
                                           for c in clips]]
        same = sum([s.tokens for s in a.segments] == [s.tokens for s in b.segments] for a, b in zip(w_alone, w_batch))
        say(f"- whisper batched = serial, {len(clips)} clips: {same}/{len(clips)} identical token for token")
        ok &= same == len(clips)
    finally:
        on.shutdown()
        off.shutdown()
        os.environ.pop("CADENCE_DTYPE", None)
    return ok


def per_precision(models: dict[str, Path], clips: list[np.ndarray], widths: list[int]) -> bool:
    """Each precision the device offers: batched = serial (chat and Whisper) and chat speed by width."""
    from engine import ChatRequest, Engine, TranscribeRequest
    from engine.kernels import precisions_on
    from engine.sampling import SamplingParams

    chat, whisper = str(models["smollm2-135m-instruct"]), str(models["whisper-base"])
    params = SamplingParams(max_tokens=48)
    say("\n## Per precision: batched = serial, and chat speed (64 tokens a request)\n")
    say("| precision | chat, 8 prompts identical | whisper, clips identical | " +
        " | ".join(f"chat tok/s N={w}" for w in widths) + " |")
    say("|---|---|---|" + "---|" * len(widths))
    ok = True
    for precision in precisions_on(DEVICE):
        off = Engine(backend=DEVICE, batch="off", precision=precision)
        on = Engine(backend=DEVICE, batch=8, precision=precision)
        try:
            alone = [off.submit(ChatRequest(p, model=chat, params=params)).result(600).tokens for p in PROMPTS]
            together = [h.result(600).tokens for h in [on.submit(ChatRequest(p, model=chat, params=params))
                                                          for p in PROMPTS]]
            chat_same = sum(a == b for a, b in zip(alone, together))
            w_alone = [off.submit(TranscribeRequest(c, model=whisper, language="en")).result(600) for c in clips]
            w_batch = [h.result(600) for h in [on.submit(TranscribeRequest(c, model=whisper, language="en"))
                                               for c in clips]]
            w_same = sum([s.tokens for s in a.segments] == [s.tokens for s in b.segments]
                         for a, b in zip(w_alone, w_batch))
        finally:
            off.shutdown()
            on.shutdown()
        ok &= precision != "float32" or (chat_same == len(PROMPTS) and w_same == len(clips))
        rates = []
        for w in widths:
            engine = Engine(backend=DEVICE, batch=w, precision=precision)
            try:
                engine.submit(ChatRequest("warm up", model=chat, params=SamplingParams(max_tokens=4))).result(600)
                t0 = time.perf_counter()
                done = [h.result(600) for h in [engine.submit(ChatRequest(PROMPTS[i % len(PROMPTS)], model=chat,
                                                                          params=SamplingParams(max_tokens=64)))
                                                for i in range(w)]]
                rates.append(sum(len(r.tokens) for r in done) / (time.perf_counter() - t0))
            finally:
                engine.shutdown()
        say(f"| {precision} | {chat_same}/{len(PROMPTS)} | {w_same}/{len(clips)} | " +
            " | ".join(f"{r:.1f}" for r in rates) + " |")
    return ok


def throughput(models: dict[str, Path], clips: list[np.ndarray], widths: list[int], out: Path) -> None:
    from bench.analyze_steps import read_log
    from engine.chat.reference import ChatReference, build_messages
    from engine import ChatRequest, Engine, TranscribeRequest
    from engine.loading import load
    from engine.sampling import SamplingParams

    chat, whisper = str(models["smollm2-135m-instruct"]), str(models["whisper-base"])
    say(f"\n## Chat throughput, SmolLM2-135M shape, {THROUGHPUT_PRECISION}, 64 tokens per request\n")
    say("| width | Cadence aggregate tok/s | per slot tok/s | generate aggregate tok/s | ratio |")
    say("|---|---|---|---|---|")
    loaded = load(chat, device=DEVICE)
    ref, tok = ChatReference(loaded), loaded.tokenizer
    params = SamplingParams(max_tokens=64)
    base_rate = None
    for w in widths:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(w)]
        engine = Engine(backend=DEVICE, batch=w, precision=THROUGHPUT_PRECISION)
        engine.submit(ChatRequest("warm up", model=chat, params=SamplingParams(max_tokens=4))).result(600)
        t0 = time.perf_counter()
        results = [h.result(600) for h in [engine.submit(ChatRequest(p, model=chat, params=params)) for p in prompts]]
        wall = time.perf_counter() - t0
        engine.shutdown()
        rate = sum(len(r.tokens) for r in results) / wall
        per_slot = statistics.mean(r.stats["decode_tok_s"] or 0 for r in results)
        tok.padding_side = "left"
        enc = tok([tok.decode(ref.prompt_ids(build_messages(p))) for p in prompts], return_tensors="pt",
                  padding=True, add_special_tokens=False).to(DEVICE)
        sync()
        t0 = time.perf_counter()
        gen = loaded.model.generate(**enc, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                    pad_token_id=tok.eos_token_id)
        sync()
        g_rate = (gen.shape[1] - enc.input_ids.shape[1]) * w / (time.perf_counter() - t0)
        base_rate = base_rate or rate
        say(f"| {w} | {rate:.1f} ({rate / base_rate:.2f}x N=1) | {per_slot:.1f} | {g_rate:.1f} | {rate / g_rate:.2f}x |")

    say(f"\n## Whisper decode throughput, whisper-base shape, {THROUGHPUT_PRECISION} (decode steps only, from the step log)\n")
    say("| width | decode aggregate tok/s | vs N=1 | mean busy slots | end to end (s) |")
    say("|---|---|---|---|---|")
    base_rate = None
    for w in widths:
        log = out / f"whisper-steps-{w}.jsonl"
        engine = Engine(backend=DEVICE, batch=w, precision=THROUGHPUT_PRECISION)
        engine.submit(TranscribeRequest(clips[0], model=whisper, language="en")).result(600)
        engine.log_steps(log)
        batch = [clips[i % len(clips)] for i in range(max(w, len(clips)))]
        t0 = time.perf_counter()
        [h.result(600) for h in [engine.submit(TranscribeRequest(c, model=whisper, language="en")) for c in batch]]
        wall = time.perf_counter() - t0
        engine.shutdown()
        steps = read_log(log)
        tokens = sum(sum(s["tokens"].values()) for s in steps)
        rate = tokens / (sum(s["step_ms"] for s in steps) / 1000)
        base_rate = base_rate or rate
        say(f"| {w} | {rate:.1f} | {rate / base_rate:.2f}x | {statistics.mean(s['slots'] for s in steps):.2f} | "
            f"{wall:.2f} |")

    say("\n## Calibration on this GPU\n")
    engine = Engine(backend=DEVICE, batch="auto", precision=THROUGHPUT_PRECISION)
    engine.submit(ChatRequest("hi", model=chat, params=SamplingParams(max_tokens=2))).result(600)
    engine.submit(TranscribeRequest(clips[0], model=whisper, language="en")).result(600)
    for model, lane in engine.status()["lanes"].items():
        c = lane["calibration"]
        say(f"- {Path(model).name}: chosen width {c['chosen']} (measured in {c['seconds']} s); widths {c['widths']}; "
            f"aggregate tok/s {c['aggregate_tok_s']}; per slot {c['per_slot_tok_s']}")
    engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--assets", type=Path, default=ROOT / ".device")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--widths", default="1,2,4,8,16,32,64")
    parser.add_argument("--device", default="cuda", help="cpu only for a dry run of the script itself")
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--precision-widths", default="1,8,32")
    parser.add_argument("--throughput-precision", default="bfloat16")
    args = parser.parse_args()
    global DEVICE, THROUGHPUT_PRECISION
    DEVICE, THROUGHPUT_PRECISION = args.device, args.throughput_precision
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("No CUDA device: this check is for a GPU machine.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CADENCE_CACHE_DIR", str(args.out / "cache"))
    os.environ.setdefault("CADENCE_DATA_DIR", str(args.out / "data"))
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE
    say(f"# Device check: {name}, torch {torch.__version__}\n")
    t0 = time.perf_counter()
    with np.load(args.assets / "speech.npz") as data:
        clips = [data[k] for k in data.files][: args.clips]
    models = random_models(args.assets, Path("/tmp/cadence-device-models"))
    ok = exactness(models, clips)
    ok &= per_precision(models, clips, [int(w) for w in args.precision_widths.split(",")])
    throughput(models, clips, [int(w) for w in args.widths.split(",")], args.out)
    say(f"\nInvariants {'hold' if ok else 'FAILED'}; total {time.perf_counter() - t0:.0f} s")
    (args.out / "device_check.md").write_text("\n".join(LINES) + "\n")
    (args.out / "device_check.json").write_text(json.dumps({"invariants_hold": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
