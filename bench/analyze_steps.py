"""Summarize an engine step log and draw it.

Record one with ``CADENCE_STEP_STATS=steps.jsonl cadence chat --prompts prompts.txt`` (or any run
of the engine), then::

    .venv/bin/python bench/analyze_steps.py steps.jsonl [--out DIR]

Prints, per lane: steps, busy slots, rows, step time percentiles, tokens per second over the
log's span, and the longest stall a decoding slot saw (its step plus the preparation of joining
windows run in the same step). Writes PNGs into DIR (default: next to the log): step time and
busy slots over time, the step-time histogram, and each slot's tokens per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def read_log(path: Path) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                print(f"{path}:{number}: not a JSON line, skipped", file=sys.stderr)
    return records


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize(records: list[dict]) -> dict[str, dict]:
    lanes: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        lanes[r["lane"]].append(r)
    out = {}
    for lane, steps in lanes.items():
        step_ms = [s["step_ms"] for s in steps]
        tokens = sum(sum(s["tokens"].values()) for s in steps)
        span = steps[-1]["t"] - steps[0]["t"] + steps[-1]["step_ms"] / 1000 if len(steps) > 1 else step_ms[0] / 1000
        decoding = [s for s in steps if s["rows"] > s["prefill_rows"]]  # some slot was decoding
        stalls = [s["step_ms"] + s["prepare_ms"] for s in decoding]
        out[lane] = {
            "steps": len(steps),
            "width": max(s["width"] for s in steps),
            "mean_busy_slots": round(statistics.mean(s["slots"] for s in steps), 2),
            "mean_rows": round(statistics.mean(s["rows"] for s in steps), 2),
            "prefill_rows": sum(s["prefill_rows"] for s in steps),
            "tokens": tokens,
            "tok_s": round(tokens / span, 1) if span > 0 else None,
            "step_ms_p50": round(percentile(step_ms, 0.5), 2),
            "step_ms_p95": round(percentile(step_ms, 0.95), 2),
            "step_ms_max": round(max(step_ms), 2),
            "prepare_ms_total": round(sum(s["prepare_ms"] for s in steps), 1),
            "max_stall_ms": round(max(stalls), 2) if stalls else None,
        }
    return out


def slot_rates(steps: list[dict], window: int = 10) -> dict[int, tuple[list[float], list[float]]]:
    """Per slot: (times, tokens per second over the last ``window`` steps)."""
    t0 = steps[0]["t"]
    rates: dict[int, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for i in range(len(steps)):
        chunk = steps[max(0, i - window + 1) : i + 1]
        seconds = chunk[-1]["t"] - chunk[0]["t"] + chunk[0]["step_ms"] / 1000
        for slot in steps[i]["tokens"]:
            count = sum(s["tokens"].get(slot, 0) for s in chunk)
            times, values = rates[int(slot)]
            times.append(steps[i]["t"] - t0)
            values.append(count / seconds if seconds > 0 else 0.0)
    return rates


def plot(records: list[dict], out: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        lanes[r["lane"]].append(r)
    written = []
    out.mkdir(parents=True, exist_ok=True)

    def save(fig, name: str) -> Path:
        fig.tight_layout()
        path = out / f"{stem}-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    t0 = min(r["t"] for r in records)
    for lane, steps in lanes.items():
        times = [s["t"] - t0 for s in steps]
        ax1.plot(times, [s["step_ms"] + s["prepare_ms"] for s in steps], lw=0.8, label=f"{lane} (with preparation)")
        ax1.plot(times, [s["step_ms"] for s in steps], lw=0.8, label=f"{lane} forward + choice")
        ax2.step(times, [s["slots"] for s in steps], where="post", lw=0.8, label=lane)
    ax1.set_ylabel("step ms")
    ax1.legend(fontsize=7)
    ax2.set_ylabel("busy slots")
    ax2.set_xlabel("seconds")
    ax2.legend(fontsize=7)
    written.append(save(fig, "timeline"))

    fig, ax = plt.subplots(figsize=(8, 4))
    for lane, steps in lanes.items():
        ax.hist([s["step_ms"] for s in steps], bins=40, alpha=0.6, label=lane)
    ax.set_xlabel("step ms")
    ax.set_ylabel("steps")
    ax.legend(fontsize=7)
    written.append(save(fig, "step-ms"))

    fig, axes = plt.subplots(len(lanes), 1, figsize=(10, 3 * len(lanes)), squeeze=False)
    for ax, (lane, steps) in zip(axes[:, 0], lanes.items()):
        for slot, (times, values) in sorted(slot_rates(steps).items()):
            ax.plot(times, values, lw=0.8, label=f"slot {slot}")
        ax.set_title(lane, fontsize=9)
        ax.set_ylabel("tok/s")
        ax.legend(fontsize=6, ncol=4)
    axes[-1, 0].set_xlabel("seconds")
    written.append(save(fig, "slots"))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: the log's folder)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    if not args.log.is_file():
        print(f"No step log at {args.log}.", file=sys.stderr)
        return 2
    records = read_log(args.log)
    if not records:
        print(f"{args.log} has no steps.", file=sys.stderr)
        return 2
    summary = summarize(records)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for lane, s in summary.items():
            print(f"{lane}: " + ", ".join(f"{k} {v}" for k, v in s.items()), flush=True)
    for path in plot(records, args.out or args.log.parent, args.log.stem):
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
