"""How fast `cadence train-mtp` makes chat data: positions (answer tokens with the hidden state that
chose each) a second, the engine keeping the hidden states as it answers (``ChatRequest.keep_hidden``,
what the command does) against answering and then teacher-forcing every answer through the
transformers model (what it did before), on the same prompts, in one run.

Each way gets a fresh engine (float32, drafting off, the given width) and answers the first PROMPTS
training prompts at the recipe's 200 tokens at most; the teacher-forced way is timed with its pass
included. Both must give the same tokens (the engine's greedy answers); their hidden states are
compared too.

    .venv/bin/python bench/mtp_data.py [--prompts 32] [--width 16] [--max-tokens 200]

Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def answers(model: str, ids: list[list[int]], width: int, max_tokens: int, keep_hidden: bool) -> tuple[list, float]:
    from engine import Engine
    from engine.api import ChatRequest
    from engine.sampling import SamplingParams

    engine = Engine(backend="cpu", batch=width, precision="float32", drafter="off")
    try:
        engine.submit(ChatRequest(model=model, prompt_ids=ids[0], params=SamplingParams(max_tokens=4))).result()
        t0 = time.perf_counter()  # (model loading and the lane's set-up left out, as in a long data run)
        handles = [engine.submit(ChatRequest(model=model, prompt_ids=i, params=SamplingParams(max_tokens=max_tokens),
                                             keep_hidden=keep_hidden)) for i in ids]
        return [h.result() for h in handles], time.perf_counter() - t0
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    from engine.calibration import device_identity
    from engine.chat.reference import ChatReference, build_messages
    from engine.loading import load
    from engine.mtp.data import _teacher_force_chat
    from engine.mtp.prompts import TRAIN_PROMPTS

    model = "smollm2-135m-instruct"
    loaded = load(model, device="cpu", dtype=torch.float32)
    ref = ChatReference(loaded)
    eos = min(ref.stop_ids)
    ids = [ref.prompt_ids(build_messages(p)) for p in TRAIN_PROMPTS[: args.prompts]]
    print(f"{device_identity('cpu')}, torch {torch.__version__}, {torch.get_num_threads()} threads; {len(ids)} "
          f"prompts, width {args.width}, at most {args.max_tokens} tokens each\n")

    kept, kept_s = answers(model, ids, args.width, args.max_tokens, keep_hidden=True)
    plain, plain_s = answers(model, ids, args.width, args.max_tokens, keep_hidden=False)
    chosen = [a.tokens + ([eos] if a.finish_reason == "stop" else []) for a in plain]
    t0 = time.perf_counter()
    forced = _teacher_force_chat(loaded, ids, chosen, [""] * len(ids))
    forced_s = time.perf_counter() - t0
    positions = sum(len(c) for c in chosen)
    same = all(a.tokens == b.tokens for a, b in zip(kept, plain))
    hidden = torch.cat([a.hidden.float() for a in kept])
    gap = (hidden - forced.hidden).abs().max().item() if hidden.shape == forced.hidden.shape else float("nan")
    print("| way | seconds | positions | positions/s |")
    print("|---|---|---|---|")
    print(f"| engine keeps the hidden states (keep_hidden) | {kept_s:.1f} | {positions} | {positions / kept_s:.0f} |")
    print(f"| engine answers, then a teacher-forced pass | {plain_s:.1f} + {forced_s:.1f} | {positions} | "
          f"{positions / (plain_s + forced_s):.0f} |")
    print(f"\nsame tokens: {same}; largest difference between the two ways' hidden states: {gap:.2e} "
          f"(their RMS is {forced.hidden.pow(2).mean().sqrt().item():.2f})")


if __name__ == "__main__":
    main()
