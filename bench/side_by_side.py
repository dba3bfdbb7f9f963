"""Chat decode of two checkouts and llama.cpp side by side, in interleaved rounds, each run in a fresh
process: the figures behind a change's before and after at one width, where one run of bench/cpu.py
moves by 5-10% with the machine.

    .venv/bin/python bench/side_by_side.py OLD_CHECKOUT [--streams 1] [--rounds 3] [--tokens 128]

Each round runs this checkout, OLD_CHECKOUT (e.g. a `git worktree` of the commit before) and llama.cpp
(the registry's Q4_1 GGUF, as bench/cpu.py), one after the other, with bench/cpu.py's own drivers
(``cadence_decode`` as shipped: precision and drafting auto; ``llama_cpp_decode``): decode tok/s,
prefill excluded. Run it on a quiet machine and record the CPU model (`lscpu`) with the figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run_one(checkout: Path, engine: str, streams: int, tokens: int) -> float:
    """One measurement in a fresh process, with ``checkout``'s engine and bench/cpu.py."""
    code = (
        "import sys, os\n"
        f"sys.path[:0] = [{str(checkout / 'bench')!r}, {str(checkout)!r}]\n"
        f"os.chdir({str(checkout)!r})\n"
        "import cpu\n"
        f"n, tokens = {streams}, {tokens}\n"
        + ("from engine.chat.reference import ChatReference, build_messages\n"
           "from engine.loading import load\n"
           "ref = ChatReference(load(cpu.CHAT))\n"
           "ids = [ref.prompt_ids(build_messages(p)) for p in cpu.prompts(n)]\n"
           "print('TOK_S', cpu.llama_cpp_decode(n, tokens, ids))\n" if engine == "llama.cpp" else
           "print('TOK_S', cpu.cadence_decode(n, tokens, 'auto', 'auto')[0])\n")
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("TOK_S")), None)
    if line is None:
        raise SystemExit(f"{engine} at {checkout} failed:\n{out.stderr[-2000:]}")
    return float(line.split()[1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("old", type=Path, help="the other checkout (the change's before)")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    runs = [("this checkout", HERE), (f"{args.old}", args.old.resolve()), ("llama.cpp", HERE)]
    table = {name: [] for name, _ in runs}
    for r in range(args.rounds):
        for name, checkout in runs:
            tok_s = run_one(checkout, "llama.cpp" if name == "llama.cpp" else "cadence", args.streams, args.tokens)
            table[name].append(tok_s)
            print(f"  round {r + 1}: {name}: {tok_s:.1f} tok/s", flush=True)
    print(f"\n## Chat decode tok/s, {args.streams} stream(s), {args.tokens} tokens, as shipped, side by side\n")
    print("| run | " + " | ".join(f"round {r + 1}" for r in range(args.rounds)) + " | vs llama.cpp, each round |")
    print("|---|" + "---|" * (args.rounds + 1))
    for name, values in table.items():
        ratios = " / ".join(f"{v / l:.2f}x" for v, l in zip(values, table["llama.cpp"]))
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {ratios} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
