"""``cadence train-mtp``: train a model's MTP draft head by self-distillation from the frozen model.

Data (:mod:`engine.mtp.data`), training (:mod:`engine.mtp.training`), held-out acceptance
(:mod:`engine.mtp.replay`), and the head file (:mod:`engine.mtp.head`), with progress on stderr.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engine.errors import CadenceError
from engine.mtp.data import DATA_VERSION, SeqData, chat_data, corpus_data, load_frozen, work_dir
from engine.mtp.speech_data import whisper_data
from engine.mtp.head import head_path, read_head
from engine.mtp.progress import Progress
from engine.mtp.recipe import recipe_for
from engine.mtp.replay import acceptance_table, calibrate, format_table
from engine.mtp.training import draft_vocabulary, train_head, use_bf16


# ---------------------------------------------------------------------------- the command
def model_matrices(source, times: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The frozen token embedding, output matrix and end-of-text ids of a model (loaded on CPU, float32),
    and with ``times`` a Whisper model's time tokens (<|0.00|> to <|30.00|>; else none)."""
    loaded = load_frozen(source)
    embed, lm_head, always = matrices_of(loaded)
    times_ids = list(range(loaded.tokenizer.no_timestamps + 1, embed.shape[0])) if times else []
    return embed, lm_head, always, times_ids


def matrices_of(loaded) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    hf = loaded.model
    source = loaded.source
    if source.family == "whisper":
        return hf.model.decoder.embed_tokens.weight.detach(), hf.proj_out.weight.detach(), [loaded.tokenizer.eot]
    eos = hf.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach(), eos


def train_mtp(model: str, out: str | Path | None = None, steps: int | None = None, seed: int = 0, resume: bool = False,
              data_dir: str | Path | None = None, progress=None, design: str | None = None) -> tuple[Path, dict]:
    """The whole of ``cadence train-mtp``: data (made or reused), training, held-out acceptance, the head file."""
    progress = progress or Progress()
    recipe, source = recipe_for(model, design)
    steps = steps or recipe.steps
    if steps < 1:
        raise CadenceError(f"--steps must be at least 1 (got {steps}).")
    folder = work_dir(source, data_dir)
    t0 = time.perf_counter()
    progress(f"{source.name}: data and checkpoints in {folder}", force=True)
    if recipe.kind == "chat":
        train, val, held = chat_data(source, recipe, folder, progress)
        if recipe.corpus_passages:
            train = SeqData.concat([train, corpus_data(source, folder, seed, recipe.corpus_passages, progress)])
    else:
        train, val, held = whisper_data(source, recipe, folder, seed, progress)
    data_s = time.perf_counter() - t0
    sizes = {"train_sequences": len(train.lengths), "train_positions": int(train.lengths.sum()),
             "val_sequences": len(val.lengths), "val_positions": int(val.lengths.sum()),
             "heldout_sequences": len(held.lengths), "heldout_positions": int(held.lengths.sum())}
    progress.done(f"data: {sizes['train_sequences']} training sequences ({sizes['train_positions']} positions), "
                  f"{sizes['val_sequences']} validation ({sizes['val_positions']}), {sizes['heldout_sequences']} "
                  f"held-out ({sizes['heldout_positions']}), {data_s:.0f} s")
    embed, lm_head, always, times = model_matrices(source, times=recipe.timestamps)
    # with timestamps every time token is drafted, beside the recipe's count of the likeliest others
    vocab_ids = draft_vocabulary(train, recipe.draft_vocab + len(times), always + times, embed.shape[0])
    coverage = float(torch.isin(held.greedy, vocab_ids).float().mean())
    progress.done(f"draft vocabulary: {vocab_ids.numel()} tokens, covering {coverage:.1%} of held-out targets")
    t1 = time.perf_counter()
    if recipe.design == "context":
        head = _train_context(train, val, recipe, seed, steps, folder, resume, progress, embed, lm_head,
                              source.name, vocab_ids)
    else:
        head = train_head(None, train, val, recipe, seed, steps, folder, resume, progress, embed, lm_head,
                          source.name, vocab_ids)
    temperature, calibration = calibrate(head, val)
    head.temperature.fill_(temperature)
    train_s = time.perf_counter() - t1
    progress.done(f"trained {steps} steps in {train_s:.0f} s; temperature {temperature} fitted on validation")
    path = Path(out) if out else head_path(source.name)
    flag = " --design context" if recipe.design == "context" else ""
    head.meta = {"recipe": {"command": f"cadence train-mtp --model {source.name}{flag} --steps {steps} --seed {seed}",
                            "seed": seed, "steps": steps, **recipe.to_json(), "data_version": DATA_VERSION, **sizes,
                            "data_seconds_this_run": round(data_s), "train_seconds": round(train_s),
                            "torch": torch.__version__, "bf16_training": use_bf16(recipe),
                            "heldout_target_coverage": round(coverage, 4), "calibration": calibration}}
    head.save(path)
    shipped = read_head(path).bind(embed, lm_head)  # measured as stored (half-precision weights), engine kernels
    table = acceptance_table(shipped, held, fast=True)
    head.meta["heldout"] = _rounded(table)
    head.meta["validation"] = _rounded(acceptance_table(shipped, val, fast=True))
    head.save(path)
    progress.done(f"held-out acceptance of {path}:\n{format_table(table)}")
    return path, table


def _train_context(train, val, recipe, seed, steps, folder, resume, progress, embed, lm_head, model, vocab_ids):
    """A context head trained from scratch (or resumed from the checkpoint in ``folder``)."""
    from engine.mtp.context_head import ContextHead
    from engine.mtp.context_training import train_context_head
    from engine.mtp.replay import measure
    from engine.mtp.training import resume_from, save_checkpoint

    start, opt = 0, None
    loaded = resume_from(folder, recipe) if resume else None
    if loaded is not None:
        head, opt, start, _ = loaded
        progress(f"resuming from step {start}", force=True)
    else:
        torch.manual_seed(seed)
        d = train.hidden.shape[1]
        head = ContextHead(model, d, embed.shape[0], vocab_ids, max(8, int(round(recipe.ffn_mult * d / 8)) * 8))
    head.bind(embed, lm_head)

    def evaluate(h) -> str:
        m = measure(h, val, limit=2500)
        return (f"validation acceptance at depth {m['depth']}: {m['rate']:.1%} of drafts, mean length "
                f"{m['mean_acceptance_length']:.2f}, first draft {m['per_position'][0]:.1%}")

    def checkpoint(h, o, step):
        save_checkpoint(folder, h, o, step, {"seed": seed, "steps": steps})

    return train_context_head(head, train, recipe, seed, steps, start, opt, progress, evaluate, checkpoint)


def _rounded(table: dict) -> dict:
    out = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out[k] = {kk: (round(vv, 4) if isinstance(vv, float) else [round(x, 4) for x in vv] if isinstance(vv, list)
                           else vv) for kk, vv in v.items()}
        else:
            out[k] = round(v, 4) if isinstance(v, float) else v
    return out


