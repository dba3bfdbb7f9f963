"""MTP draft heads: a small chain head on the model's own hidden state that drafts the next tokens.

One step of the chain (EAGLE / DeepSeek-MTP style), from the model's final-norm hidden state ``h``
at the position that emitted token ``x``:

    z  = fc([rmsnorm(h); rmsnorm(embed[x])])          2d -> d
    h' = z + down(silu(gate(rmsnorm(z))) * up(rmsnorm(z)))   a gated-SiLU MLP of width ``ffn``
    p  = softmax((rmsnorm(h') * w + b  @  lm_head[vocab_ids].T) / temperature)

The drafted token is the argmax of ``p`` over the draft vocabulary (the most frequent tokens of
the training data, as full-vocabulary ids); the next step runs on ``(h', drafted token)``. The
temperature is fitted after training on validation text, so ``p`` is an honest confidence for
``--draft-min-p``. The
model's frozen token embedding and output matrix are reused (given to :meth:`MTPHead.bind`), not
stored, so a head file holds only the head's own weights: a few MB of safetensors whose
metadata names the model, its sizes, the head's configuration, how it was trained and its
held-out acceptance. Heads are trained by ``cadence train-mtp`` (:mod:`engine.mtp.command`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.errors import CadenceError
from engine.kernels import Linear
from engine.mtp.head_file import FORMAT, FORMAT_VERSION, attach_matrices, save_head

RESOURCE_DIR = Path(__file__).resolve().parents[2] / "resources" / "mtp"
EPS = 1e-6
PARAMS = ("norm_h", "norm_e", "fc", "norm_z", "gate_up", "down", "norm_out", "bias_out")


class MTPHead(torch.nn.Module):
    """A chain draft head for one model. Create it, :meth:`bind` the model's frozen matrices, then
    :meth:`draft` (or train it through :meth:`step` and :meth:`logits`)."""

    def __init__(self, model: str, hidden: int, vocab_size: int, vocab_ids: torch.Tensor, ffn: int | None = None,
                 meta: dict | None = None):
        super().__init__()
        d = hidden
        self.model = model
        self.hidden = d
        self.vocab_size = vocab_size
        self.ffn = ffn or 2 * d
        self.meta = dict(meta or {})  # recipe, held-out acceptance: kept in the file's metadata
        self.register_buffer("vocab_ids", torch.as_tensor(vocab_ids, dtype=torch.long).clone())
        self.register_buffer("temperature", torch.ones(1))  # calibrates the probabilities (set after training)
        self.norm_h = torch.nn.Parameter(torch.ones(d))
        self.norm_e = torch.nn.Parameter(torch.ones(d))
        self.fc = torch.nn.Parameter(torch.empty(d, 2 * d))
        self.norm_z = torch.nn.Parameter(torch.ones(d))
        self.gate_up = torch.nn.Parameter(torch.empty(2 * self.ffn, d))
        self.down = torch.nn.Parameter(torch.empty(d, self.ffn))
        self.norm_out = torch.nn.Parameter(torch.ones(d))
        self.bias_out = torch.nn.Parameter(torch.zeros(d))
        for w in (self.fc, self.gate_up, self.down):
            torch.nn.init.normal_(w, std=w.shape[1] ** -0.5)
        with torch.no_grad():
            self.down.mul_(0.5)
        self.embed: torch.Tensor | None = None  # bound, frozen: [V, d]
        self.out_rows: torch.Tensor | None = None  # bound, frozen: lm_head[vocab_ids], [K, d]
        self._fast: dict | None = None
        self.dropout = 0.0  # training only

    # ------------------------------------------------------------------ binding
    def config(self) -> dict:
        return {"hidden": self.hidden, "vocab_size": self.vocab_size, "ffn": self.ffn,
                "draft_vocab": int(self.vocab_ids.numel()), "design": "chain: fc([norm h; norm e]) + gated-SiLU MLP"}

    def bind(self, embed: torch.Tensor, lm_head: torch.Tensor, prepare: bool = True) -> "MTPHead":
        """Attach the model's frozen token embedding [V, d] and output matrix [V, d]; with ``prepare``,
        ready the weights for :meth:`draft` (kernels chosen for the backend). Bind again after the
        head's weights change."""
        attach_matrices(self, embed, lm_head)
        if prepare:
            with torch.no_grad():
                self._fast = {"fc": Linear(self.fc.detach().clone()), "gate_up": Linear(self.gate_up.detach().clone()),
                              "down": Linear(self.down.detach().clone()), "out": Linear(self.out_rows)}
        return self

    def _check_bound(self) -> None:
        if self.embed is None:
            raise CadenceError(f"The draft head for {self.model} is not bound to its model yet.")

    # ------------------------------------------------------------------ the chain
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.to(w.dtype), (self.hidden,), w, EPS)

    def step(self, h: torch.Tensor, tokens: torch.Tensor, fast: bool = False) -> torch.Tensor:
        """One chain step: the head's next state h' [B, d] from hidden [B, d] and the tokens [B] it emitted."""
        lin = self._fast if fast else None
        e = F.embedding(tokens, self.embed)
        x = torch.cat([self._norm(h, self.norm_h), self._norm(e, self.norm_e)], dim=-1)
        z = lin["fc"](x) if lin else F.linear(x, self.fc)
        n = self._norm(z, self.norm_z)
        gate, up = (lin["gate_up"](n) if lin else F.linear(n, self.gate_up)).split(self.ffn, dim=-1)
        m = F.silu(gate) * up
        if self.training and self.dropout:
            m = F.dropout(m, self.dropout, True)
        return z + (lin["down"](m) if lin else F.linear(m, self.down))

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """The vector the output rows read (trained towards the model's next hidden state): rmsnorm(h') * w + b."""
        return self._norm(h, self.norm_out) + self.bias_out

    def logits(self, h: torch.Tensor, fast: bool = False) -> torch.Tensor:
        """Logits over the draft vocabulary [B, K] from a head state [B, d]."""
        o = self.features(h)
        logits = self._fast["out"](o) if fast else F.linear(o, self.out_rows)
        return logits if self.training else logits / self.temperature

    def chain(self, hidden: torch.Tensor, tokens: torch.Tensor, depth: int,
              fast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy chain of ``depth`` steps; (draft-vocabulary indices [B, depth], their probabilities)."""
        self._check_bound()
        h, tok = hidden.to(self.norm_h.dtype), tokens
        picks, probs = [], []
        for _ in range(depth):
            h = self.step(h, tok, fast)
            p = torch.softmax(self.logits(h, fast).float(), dim=-1)
            best, index = p.max(dim=-1)
            picks.append(index)
            probs.append(best)
            tok = self.vocab_ids[index]
        if not picks:
            return tokens.new_zeros((tokens.shape[0], 0)), hidden.new_zeros((tokens.shape[0], 0), dtype=torch.float32)
        return torch.stack(picks, 1), torch.stack(probs, 1)

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, tokens: torch.LongTensor, depth: int) -> tuple[torch.LongTensor, torch.Tensor]:
        """hidden [B, d]: the model's final-norm hidden state at the position that emitted ``tokens`` [B].
        Runs the chain ``depth`` steps greedily for all B rows at once; returns the drafted full-vocabulary
        ids [B, depth] and the head's probability of each [B, depth] (float32)."""
        self._check_bound()
        picks, probs = self.chain(hidden, tokens.to(self.vocab_ids.device).long(), depth, fast=self._fast is not None)
        return self.vocab_ids[picks], probs

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        return save_head(self, PARAMS, path, dtype)


def new_head(design: str, model: str, hidden: int, vocab_size: int, vocab_ids, ffn: int | None, meta=None):
    """A head of the design its file or checkpoint names ("chain", the default, or "context")."""
    if design.startswith("context"):
        from engine.mtp.context_head import ContextHead

        return ContextHead(model, hidden, vocab_size, vocab_ids, ffn, meta=meta)
    return MTPHead(model, hidden, vocab_size, vocab_ids, ffn, meta=meta)


def head_path(model: str) -> Path:
    """Where the shipped head of ``model`` lives: resources/mtp/<model>.safetensors."""
    return RESOURCE_DIR / f"{Path(model).name}.safetensors"


def read_head(path: str | Path) -> MTPHead:
    """A head from its file, whatever model it was trained for; CadenceError for anything else."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise CadenceError(f"{path.name} is not a Cadence draft head.")
            if int(meta.get("format_version", 0)) > FORMAT_VERSION:
                raise CadenceError(f"{path.name} is a draft head of a newer format than this Cadence reads.")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CadenceError(f"The draft head {path} cannot be read ({exc}).") from None
    try:
        config = json.loads(meta["config"])
        hidden, vocab_size = int(meta["hidden"]), int(meta["vocab_size"])
        extra = {k: v for k, v in meta.items() if k not in ("format", "format_version", "model", "hidden",
                                                              "vocab_size", "config")}
        for k, v in extra.items():
            try:
                extra[k] = json.loads(v)
            except ValueError:
                pass
        head = new_head(config.get("design", "chain"), meta["model"], hidden, vocab_size, tensors["vocab_ids"],
                        config["ffn"], meta=extra)
        with torch.no_grad():
            for name, _ in head.named_parameters():
                getattr(head, name).copy_(tensors[name].float())
            if "temperature" in tensors:
                head.temperature.copy_(tensors["temperature"].float().reshape(1))
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CadenceError(f"The draft head {path} is damaged or incomplete ({exc.__class__.__name__}: {exc}).") from None
    return head.eval().requires_grad_(False)


def load_head(model: str, path: Path | None = None) -> MTPHead | None:
    """The draft head for ``model`` (its shipped file unless ``path``), None when there is none;
    CadenceError for a file that is not a head or belongs to another model."""
    path = Path(path) if path is not None else head_path(model)
    if not path.is_file():
        return None
    head = read_head(path)
    if head.model != Path(model).name:
        raise CadenceError(f"The draft head {path.name} was trained for {head.model}, not for {model}.")
    return head


__all__ = ["MTPHead", "head_path", "load_head", "read_head"]
