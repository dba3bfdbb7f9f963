"""Training an MTP head on :class:`~engine.mtp.data.SeqData`.

Each position ``i`` of a sequence has the hidden state ``H[i]`` that emitted token ``X[i]`` (the
model's greedy choice ``G[i]``). Chain step ``j`` from position ``i`` gets ``(state, X[i+j-1])``
(the first state is ``H[i]``, later ones the head's own) and learns ``G[i+j]``; all steps train
jointly. Training is seeded (initial weights and every batch follow from the seed and the step
number) and resumable: the head and its optimizer state are checkpointed as safetensors + JSON
(no pickle).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.errors import CadenceError
from engine.mtp.data import SeqData
from engine.mtp.head import MTPHead, new_head
from engine.mtp.optim import apply_gradients, cosine_lr
from engine.mtp.progress import quiet
from engine.mtp.recipe import DEPTH, Recipe
from engine.mtp.replay import measure

STEP_WEIGHT = 0.8  # loss weight of chain step j is STEP_WEIGHT ** (j - 1): early drafts matter most


# ---------------------------------------------------------------------------- vocabulary
def draft_vocabulary(data: SeqData, size: int, always: list[int], vocab_size: int) -> torch.Tensor:
    """``size`` tokens: every target token of the training data, most frequent first, plus ``always``; the
    rest filled with the lowest ids not yet in (byte-pair vocabularies number their tokens in merge order,
    so low ids are the common ones the data happened to miss)."""
    counts = torch.bincount(data.greedy, minlength=vocab_size)
    order = sorted(range(len(counts)), key=lambda t: (-int(counts[t]), t))
    chosen = list(dict.fromkeys(always))
    chosen += [t for t in order[:size] if counts[t] > 0 and t not in chosen][: max(0, size - len(chosen))]
    taken = set(chosen)
    chosen += [t for t in range(vocab_size) if t not in taken][: max(0, size - len(chosen))]
    return torch.tensor(sorted(chosen), dtype=torch.long)


# ---------------------------------------------------------------------------- training
def _batch(data: SeqData, rem: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor, to_draft: torch.Tensor, depth: int):
    """Inputs and targets of the chain from positions ``idx``: (hidden, [tokens_j], [targets_j]); -1: no target."""
    N = data.emitted.numel()
    inputs, targets, states = [], [], []
    for j in range(1, depth + 1):
        inputs.append(data.emitted[torch.clamp(idx + j - 1, max=N - 1)])
        t = to_draft[data.greedy[torch.clamp(idx + j, max=N - 1)]]
        targets.append(torch.where(rem[idx] >= j, t, torch.full_like(t, -1)))
        states.append(data.hidden[torch.clamp(idx + j, max=N - 1)])  # the model's own state where target j is chosen
    return data.hidden[idx], inputs, targets, states


def chain_loss(head: MTPHead, hidden, inputs, targets, noise: float = 0.0, states=None, soft: float = 0.0,
               regress: float = 0.0) -> tuple[torch.Tensor, list[float]]:
    """Cross-entropy to the model's greedy token at each chain step (weighted ``STEP_WEIGHT ** j``); with
    ``states`` (the model's hidden state where each target is chosen), ``soft`` mixes in cross-entropy to
    the model's own distribution over the draft vocabulary there, and ``regress`` adds smooth-L1 regression
    of the head's output features onto that state (scaled by its RMS)."""
    h = hidden
    if noise:
        h = h + noise * h.pow(2).mean(-1, keepdim=True).sqrt() * torch.randn_like(h)
    total, weight, accs = 0.0, 0.0, []
    for j, (tok, tgt) in enumerate(zip(inputs, targets)):
        h = head.step(h, tok)
        features = head.features(h)
        logits = F.linear(features, head.out_rows)
        valid = tgt >= 0
        if bool(valid.any()):
            w = STEP_WEIGHT ** j
            loss = F.cross_entropy(logits[valid], tgt[valid])
            if states is not None and (soft or regress):
                teacher = states[j][valid]
                if soft:
                    with torch.no_grad():
                        p = torch.softmax(F.linear(teacher, head.out_rows), -1)
                    loss = (1 - soft) * loss - soft * (p * torch.log_softmax(logits[valid], -1)).sum(-1).mean()
                if regress:
                    scale = teacher.pow(2).mean(-1, keepdim=True).sqrt()
                    loss = loss + regress * F.smooth_l1_loss(features[valid] / scale, teacher / scale)
            total = total + w * loss
            weight += w
            accs.append(float((logits[valid].argmax(-1) == tgt[valid]).float().mean()))
    return total / max(weight, 1e-9), accs


def use_bf16(recipe: Recipe) -> bool:
    if recipe.bf16 is not None:
        return recipe.bf16
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _lr(recipe: Recipe, step: int, steps: int) -> float:
    return cosine_lr(recipe.lr, recipe.warmup, step, steps, 0.1)


def _optimizer(head: MTPHead, recipe: Recipe) -> torch.optim.Optimizer:
    decay = [head.fc, head.gate_up, head.down]
    rest = [head.norm_h, head.norm_e, head.norm_z, head.norm_out, head.bias_out]
    return torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))


def optimizer_for(head, recipe: Recipe) -> torch.optim.Optimizer:
    if hasattr(head, "forward_window"):
        from engine.mtp.context_training import optimizer

        return optimizer(head, recipe)
    return _optimizer(head, recipe)


def save_checkpoint(folder: Path, head: MTPHead, opt: torch.optim.Optimizer, step: int, info: dict) -> None:
    """Head + optimizer state as safetensors, the rest as JSON (written atomically, never pickled)."""
    from safetensors.torch import save_file

    names = {id(p): n for n, p in head.named_parameters()}
    tensors = {f"head.{n}": p.detach().clone() for n, p in head.named_parameters()}
    tensors["head.vocab_ids"] = head.vocab_ids.clone()
    steps = {}
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if state:
                n = names[id(p)]
                tensors[f"opt.{n}.exp_avg"] = state["exp_avg"].clone()
                tensors[f"opt.{n}.exp_avg_sq"] = state["exp_avg_sq"].clone()
                steps[n] = float(state["step"])
    tmp = folder / "checkpoint.safetensors.tmp"
    save_file(tensors, str(tmp))
    meta = {"step": step, "opt_steps": steps, "head": {"model": head.model, "hidden": head.hidden,
                                                      "vocab_size": head.vocab_size, "ffn": head.ffn,
                                                      "design": head.config()["design"]}, **info}
    (folder / "checkpoint.json.tmp").write_text(json.dumps(meta, indent=1))
    tmp.replace(folder / "checkpoint.safetensors")
    (folder / "checkpoint.json.tmp").replace(folder / "checkpoint.json")


def load_checkpoint(folder: Path, recipe: Recipe) -> tuple[MTPHead, torch.optim.Optimizer, int, dict] | None:
    from safetensors.torch import load_file

    if not (folder / "checkpoint.json").is_file() or not (folder / "checkpoint.safetensors").is_file():
        return None
    meta = json.loads((folder / "checkpoint.json").read_text())
    t = load_file(str(folder / "checkpoint.safetensors"))
    h = meta["head"]
    head = new_head(h.get("design", "chain"), h["model"], h["hidden"], h["vocab_size"], t["head.vocab_ids"], h["ffn"])
    with torch.no_grad():
        for n, p in head.named_parameters():
            p.copy_(t[f"head.{n}"])
    opt = optimizer_for(head, recipe)
    for n, p in head.named_parameters():
        if f"opt.{n}.exp_avg" in t:
            opt.state[p] = {"step": torch.tensor(meta["opt_steps"][n]), "exp_avg": t[f"opt.{n}.exp_avg"].clone(),
                            "exp_avg_sq": t[f"opt.{n}.exp_avg_sq"].clone()}
    return head, opt, int(meta["step"]), meta


def resume_from(folder: Path, recipe: Recipe):
    """The checkpoint in ``folder`` to resume (None when there is none); CadenceError when it holds a
    head of another design than the recipe's (both designs keep their checkpoint in the work folder)."""
    loaded = load_checkpoint(folder, recipe)
    if loaded is not None and loaded[0].config()["design"].split(":")[0] != recipe.design:
        found = loaded[0].config()["design"].split(":")[0]
        raise CadenceError(f"The checkpoint in {folder} is of a {found} head, not a {recipe.design} head; "
                           f"resume with --design {found}, or train from the start without --resume.")
    return loaded


def init_head(model: str, data: SeqData, vocab_ids: torch.Tensor, vocab_size: int, recipe: Recipe, seed: int) -> MTPHead:
    torch.manual_seed(seed)
    d = data.hidden.shape[1]
    head = MTPHead(model, d, vocab_size, vocab_ids, max(8, int(round(recipe.ffn_mult * d / 8)) * 8))
    with torch.no_grad():  # the output norm starts at the scale and offset of the model's own hidden states
        sample = data.hidden[:: max(1, data.hidden.shape[0] // 20000)]
        head.norm_out.copy_(sample.std(0).clamp_min(1e-3))
        head.bias_out.copy_(sample.mean(0))
    return head


def train_head(head: MTPHead | None, train: SeqData, held: SeqData | None, recipe: Recipe, seed: int, steps: int,
               folder: Path | None = None, resume: bool = False, progress=quiet, embed=None, lm_head=None,
               model: str = "", vocab_ids: torch.Tensor | None = None, stop_after: int | None = None) -> MTPHead:
    """Train (or, with ``resume``, continue from the checkpoint in ``folder``) for ``steps`` steps in all.
    Each step's batch depends only on the seed and the step number, so a resumed run ends where an
    uninterrupted one would. ``stop_after`` stops early (tests: an interrupted run)."""
    start, opt = 0, None
    loaded = resume_from(folder, recipe) if (resume and folder is not None) else None
    if loaded is not None:
        head, opt, start, _ = loaded
        progress(f"resuming from step {start}", force=True)
    if head is None:
        head = init_head(model, train, vocab_ids, embed.shape[0], recipe, seed)
    head.train().requires_grad_(True)
    head.dropout = recipe.dropout
    head.bind(embed, lm_head, prepare=False)
    opt = opt or _optimizer(head, recipe)
    rem = train.remaining
    pool = torch.nonzero(rem >= 1).flatten()
    to_draft = torch.full((max(head.vocab_size, int(train.greedy.max()) + 1),), -1, dtype=torch.long)
    to_draft[head.vocab_ids] = torch.arange(head.vocab_ids.numel())
    bf16 = use_bf16(recipe)
    loss_avg = None
    t0 = time.perf_counter()
    for step in range(start, steps):
        if stop_after is not None and step >= stop_after:
            break
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = pool[torch.randint(len(pool), (recipe.batch,), generator=g)]
        hidden, inputs, targets, states = _batch(train, rem, pool, idx, to_draft, DEPTH)
        for group in opt.param_groups:
            group["lr"] = _lr(recipe, step, steps)
        torch.manual_seed(seed * 1_000_003 + step)  # noise and dropout: from the step too
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, accs = chain_loss(head, hidden, inputs, targets, recipe.noise, states, recipe.soft, recipe.regress)
        loss_avg = apply_gradients(head, opt, loss, loss_avg)
        done = step + 1
        note = ""
        if held is not None and (done % recipe.eval_every == 0 or done == steps):
            m = measure(head, held, DEPTH, limit=2500)
            note = (f", held-out (validation) acceptance at depth {DEPTH}: {m['rate']:.1%} of drafts, mean length "
                    f"{m['mean_acceptance_length']:.2f}, first draft {m['per_position'][0]:.1%}")
            progress(f"step {done}/{steps}: loss {loss_avg:.3f}{note}", force=True)
        rate = (done - start) / (time.perf_counter() - t0)
        progress(f"step {done}/{steps}: loss {loss_avg:.3f}, batch accuracy by chain step "
                 f"{' '.join(f'{a:.2f}' for a in accs)} ({rate:.1f} steps/s){note}")
        if folder is not None and (done % recipe.checkpoint_every == 0 or done == steps):
            save_checkpoint(folder, head, opt, done, {"seed": seed, "steps": steps})
    head.eval().requires_grad_(False)
    return head


