"""``cadence train-mtp``: train the MTP draft head of a model by self-distillation (engine.mtp.command).

Progress goes to stderr; the head is written to resources/mtp/<model>.safetensors unless --out.
Generated data and checkpoints stay in a work folder under the user cache directory (or
--data-dir), so a second run reuses the data and ``--resume`` continues an interrupted training.
"""

from __future__ import annotations

import argparse
import sys

from engine.errors import CadenceError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train-mtp", help="train a model's MTP draft head from its own outputs (self-distillation)")
    p.add_argument("--model", required=True, help="model name or path (a chat model or Whisper)")
    p.add_argument("--out", metavar="PATH", default=None,
                   help="where to write the head (default: resources/mtp/<model>.safetensors)")
    p.add_argument("--steps", type=int, default=None, help="training steps in all (default: the model's recipe)")
    p.add_argument("--seed", type=int, default=0, help="seeds the speech voices, the initial head and every batch")
    p.add_argument("--design", choices=("chain", "context"), default=None,
                   help="head design: chain (an MLP on the last position, the shipped heads) or context "
                        "(attention over the answer so far, chat models; docs/MTP.md)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint of an interrupted run")
    p.add_argument("--data-dir", metavar="DIR", default=None,
                   help="work folder for generated data and checkpoints (default: under the user cache folder)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from engine.mtp.command import train_mtp

    path, table = train_mtp(args.model, out=args.out, steps=args.steps, seed=args.seed, resume=args.resume,
                            data_dir=args.data_dir, design=args.design)
    best = table.get("depth4") or {}
    print(f"{path}  (held-out acceptance {best.get('rate', 0):.1%} of drafted tokens at depth 4, "
          f"mean acceptance length {best.get('mean_acceptance_length', 1):.2f})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train-mtp", *(sys.argv[1:] if argv is None else argv)])
    try:
        from app.cli.common import quiet_libraries

        quiet_libraries()
        return args.func(args)
    except CadenceError as exc:
        print(f"cadence: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cadence: interrupted (run again with --resume to continue).", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
