"""A context-aware draft head (EAGLE-style): one small decoder layer with causal self-attention over
the past (hidden state, token) pairs of the sequence, so it sees what was said, not only the last
position.

Pair ``t`` is the model's final-norm hidden state ``h_t`` at the position that emitted token ``x_t``
(``x_t`` itself is the token the model was fed next). One layer:

    z_t = fc([rmsnorm(h_t); rmsnorm(embed[x_t])])                         2d -> d
    a_t = z_t + o(attention(q(rmsnorm(z_t)), k/v(rmsnorm(z_<=t))))       rotary positions, causal
    u_t = a_t + down(silu(gate(rmsnorm(a_t))) * up(rmsnorm(a_t)))         gated-SiLU MLP

``u_t`` predicts the model's next hidden state ``h_{t+1}`` (regressed in training), so the draft is
``argmax(lm_head[vocab_ids] @ u_t)``; chained, ``(u_t, draft)`` is the next pair, attending to the
real pairs and the chain's own earlier pairs. Keys and values of real pairs are kept per sequence
(:class:`HeadCache`, at most ``window`` of them), so each step computes only its new pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import CadenceError
from engine.mtp.head_file import attach_matrices, save_head

EPS = 1e-6
HEAD_DIM = 64
WINDOW = 256  # real pairs a sequence's cache keeps (the oldest are dropped)
CHAIN_ROOM = 8  # draft chain steps a cache has room for after its real pairs
INFERENCE_PRECISION = "int8"  # the head's matrices when drafting: a quarter of float32's bytes per row
PARAMS = ("norm_h", "norm_e", "fc", "norm_a", "qkv", "o", "norm_m", "gate_up", "down")


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [..., T, HEAD_DIM] at integer positions [T] (or broadcastable)."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angle = positions.to(torch.float32)[..., None] * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def flat_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear over the last dimension as one matrix product (a strided [B, T, d] input would
    otherwise take a slow batched path)."""
    return F.linear(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])


class HeadCache:
    """One sequence's keys and values of its real pairs (the newest ``WINDOW`` of them), the position
    of the next pair, and the pairs not yet run through the head. Keys and values live in buffers
    with room for a draft chain after them, written in place (the oldest are moved out now and then,
    not on every step)."""

    __slots__ = ("k", "v", "length", "next_position", "pending_h", "pending_x")
    CAPACITY = 2 * WINDOW + CHAIN_ROOM

    def __init__(self):
        self.k = self.v = None  # [heads, CAPACITY, HEAD_DIM]; the first `length` rows are real pairs
        self.length = 0
        self.next_position = 0
        self.pending_h: list[torch.Tensor] = []
        self.pending_x: list[int] = []

    def add(self, hidden: torch.Tensor, tokens: list[int]) -> None:
        """Real pairs to take in at the next draft: hidden [n, d] and the tokens they emitted. A sequence
        that goes long without drafting keeps only its newest WINDOW pending pairs (older ones would
        be out of the window anyway, and so are the keys already held)."""
        self.pending_h.append(hidden)
        self.pending_x.extend(tokens)
        extra = len(self.pending_x) - WINDOW
        if extra > 0:
            h = torch.cat(self.pending_h)[extra:]
            self.pending_h, self.pending_x = [h], self.pending_x[extra:]
            self.next_position += extra
            self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [heads, n, HEAD_DIM] of new real pairs."""
        n = k.shape[1]
        if n >= WINDOW:
            k, v, n = k[:, -WINDOW:], v[:, -WINDOW:], WINDOW
        if self.k is None:
            self.k = k.new_zeros((k.shape[0], self.CAPACITY, k.shape[2]))
            self.v = torch.zeros_like(self.k)
        if self.length + n > 2 * WINDOW:  # keep the newest WINDOW - n, at the front
            keep = WINDOW - n
            self.k[:, :keep] = self.k[:, self.length - keep : self.length].clone()
            self.v[:, :keep] = self.v[:, self.length - keep : self.length].clone()
            self.length = keep
        self.k[:, self.length : self.length + n] = k
        self.v[:, self.length : self.length + n] = v
        self.length += n

    def keys(self, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest WINDOW real pairs' keys and values, plus ``extra`` chain rows written after them."""
        start = max(0, self.length - WINDOW)
        return self.k[:, start : self.length + extra], self.v[:, start : self.length + extra]


class ContextHead(torch.nn.Module):
    def __init__(self, model: str, hidden: int, vocab_size: int, vocab_ids: torch.Tensor, ffn: int | None = None,
                 meta: dict | None = None):
        super().__init__()
        d = hidden
        if d % HEAD_DIM:
            raise CadenceError(f"A context draft head needs a hidden size divisible by {HEAD_DIM} (got {d}).")
        self.model, self.hidden, self.vocab_size = model, d, vocab_size
        self.heads = d // HEAD_DIM
        self.ffn = ffn or 2 * d
        self.meta = dict(meta or {})
        self.register_buffer("vocab_ids", torch.as_tensor(vocab_ids, dtype=torch.long).clone())
        self.register_buffer("temperature", torch.ones(1))
        self.norm_h = torch.nn.Parameter(torch.ones(d))
        self.norm_e = torch.nn.Parameter(torch.ones(d))
        self.fc = torch.nn.Parameter(torch.empty(d, 2 * d))
        self.norm_a = torch.nn.Parameter(torch.ones(d))
        self.qkv = torch.nn.Parameter(torch.empty(3 * d, d))
        self.o = torch.nn.Parameter(torch.empty(d, d))
        self.norm_m = torch.nn.Parameter(torch.ones(d))
        self.gate_up = torch.nn.Parameter(torch.empty(2 * self.ffn, d))
        self.down = torch.nn.Parameter(torch.empty(d, self.ffn))
        for w in (self.fc, self.qkv, self.o, self.gate_up, self.down):
            torch.nn.init.normal_(w, std=w.shape[1] ** -0.5)
        with torch.no_grad():
            self.o.mul_(0.5)
            self.down.mul_(0.5)
        self.embed: torch.Tensor | None = None
        self.out_rows: torch.Tensor | None = None
        self._fast: dict | None = None

    def config(self) -> dict:
        return {"hidden": self.hidden, "vocab_size": self.vocab_size, "ffn": self.ffn, "heads": self.heads,
                "draft_vocab": int(self.vocab_ids.numel()), "window": WINDOW,
                "design": "context: fc([norm h; norm e]) + one decoder layer (causal attention over past pairs)"}

    def save(self, path, dtype: torch.dtype = torch.float16):
        return save_head(self, PARAMS, path, dtype)

    def bind(self, embed: torch.Tensor, lm_head: torch.Tensor, prepare: bool = True) -> "ContextHead":
        attach_matrices(self, embed, lm_head)
        return self.prepare() if prepare else self

    def prepare(self, precision: str = INFERENCE_PRECISION) -> "ContextHead":
        """Ready the matrices for drafting with the engine's kernels in ``precision`` (rows independent
        of their batch mates); again after the weights change. Training mode uses the plain weights."""
        from engine.kernels import Linear

        with torch.no_grad():
            self._fast = {name: Linear(getattr(self, name).detach().clone(), precision=precision)
                          for name in ("fc", "qkv", "o", "gate_up", "down")}
            self._fast["out"] = Linear(self.out_rows, precision=precision)
        return self

    def _mat(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x @ matrix.T over the last dimension: the prepared kernel when drafting, else the plain weight."""
        if self._fast is not None and not self.training:
            return self._fast[name](x).to(x.dtype)
        return flat_linear(x, self.out_rows if name == "out" else getattr(self, name))

    # ------------------------------------------------------------------ pieces
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.to(w.dtype), (self.hidden,), w, EPS)

    def fuse(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """z for pairs (h [..., d], tokens [...])."""
        e = F.embedding(tokens, self.embed)
        return self._mat("fc", torch.cat([self._norm(h, self.norm_h), self._norm(e, self.norm_e)], dim=-1))

    def project(self, z: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [..., heads, T, HEAD_DIM] of z [..., T, d] (rotary applied to q and k)."""
        q, k, v = self._mat("qkv", self._norm(z, self.norm_a)).split(self.hidden, dim=-1)
        shape = z.shape[:-1] + (self.heads, HEAD_DIM)
        q, k, v = (t.reshape(shape).transpose(-2, -3) for t in (q, k, v))
        return rotary(q, positions), rotary(k, positions), v

    def finish(self, z: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """u from z [..., T, d] and the attention's output [..., heads, T, HEAD_DIM]."""
        a = z + self._mat("o", attended.transpose(-2, -3).reshape(z.shape))
        gate, up = self._mat("gate_up", self._norm(a, self.norm_m)).split(self.ffn, dim=-1)
        return a + self._mat("down", F.silu(gate) * up)

    def logits(self, u: torch.Tensor) -> torch.Tensor:
        logits = self._mat("out", u.to(self.out_rows.dtype))
        return logits if self.training else logits / self.temperature

    # ------------------------------------------------------------------ training: whole windows at once
    def forward_window(self, h: torch.Tensor, tokens: torch.Tensor, depth: int = 1,
                       chain_tokens: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Teacher-forced chain over windows: h [B, T, d], tokens [B, T]. Step 1 at pair t attends to
        pairs <= t; step j > 1 takes (u of step j-1 at t, chain_tokens[j-2][:, t]) and attends to the
        real pairs <= t and its own chain's earlier steps at t. Returns u per step, each [B, T, d]."""
        B, T, _ = h.shape
        pos = torch.arange(T, device=h.device)
        z = self.fuse(h, tokens)
        q, k, v = self.project(z, pos)
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        u = self.finish(z, F.scaled_dot_product_attention(q, k, v, attn_mask=causal))
        out, ks, vs = [u], [k], [v]
        eye = torch.eye(T, dtype=torch.bool, device=h.device)
        for j in range(1, depth):
            zj = self.fuse(u, chain_tokens[j - 1])
            qj, kj, vj = self.project(zj, pos + j)
            ks.append(kj)
            vs.append(vj)
            mask = torch.cat([causal] + [eye] * j, dim=1)
            u = self.finish(zj, F.scaled_dot_product_attention(qj, torch.cat(ks, -2), torch.cat(vs, -2),
                                                               attn_mask=mask))
            out.append(u)
        return out

    # ------------------------------------------------------------------ drafting with per-sequence caches
    def _take_in(self, caches: list[HeadCache]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Run every cache's pending real pairs through the layer: their keys and values join the cache;
        returns u of each sequence's last pair [B, d] (its step-1 prediction)."""
        zs, counts = [], []
        for c in caches:
            h = torch.cat(c.pending_h).to(self.fc.dtype)
            zs.append(self.fuse(h, torch.tensor(c.pending_x, device=h.device)))
            counts.append(h.shape[0])
        z = torch.cat(zs)
        positions = torch.cat([torch.arange(c.next_position, c.next_position + n, device=z.device)
                               for c, n in zip(caches, counts)])
        q, k, v = self.project(z, positions)  # [heads, N, HEAD_DIM]
        last_q, last_z, at = [], [], 0
        for c, n in zip(caches, counts):
            c.append(k[:, at : at + n], v[:, at : at + n])
            c.next_position += n
            c.pending_h, c.pending_x = [], []
            last_q.append(q[:, at + n - 1])
            last_z.append(z[at + n - 1])
            at += n
        return torch.stack(last_z), last_q

    def _attend(self, qs: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """One query per sequence [heads, HEAD_DIM] over its own keys [heads, T, HEAD_DIM]: [B, heads, 1, HEAD_DIM]."""
        return torch.stack([F.scaled_dot_product_attention(q[:, None], k, v) for q, k, v in zip(qs, keys, values)])

    @torch.inference_mode()
    def draft_cached(self, caches: list[HeadCache], depth: int) -> tuple[torch.LongTensor, torch.Tensor]:
        """Drafts [B, depth] (full-vocabulary ids) and their probabilities for sequences whose caches hold
        their real pairs (pending ones are taken in first, so every cache must have at least one)."""
        if any(not c.pending_x for c in caches):
            raise CadenceError("A context draft head needs each sequence's newest pair before drafting.")
        depth = min(depth, CHAIN_ROOM)
        z, qs = self._take_in(caches)
        kv = [c.keys() for c in caches]
        u = self.finish(z[:, None], self._attend(qs, [k for k, _ in kv], [v for _, v in kv]))[:, 0]
        picks, probs = [], []
        for j in range(depth):
            p = torch.softmax(self.logits(u).float(), dim=-1)
            best, index = p.max(dim=-1)
            picks.append(index)
            probs.append(best)
            if j + 1 == depth:
                break
            zj = self.fuse(u, self.vocab_ids[index])
            positions = torch.tensor([c.next_position - 1 + j + 1 for c in caches], device=u.device)
            q, k, v = self.project(zj[:, None], positions[:, None, None])  # [B, heads, 1, HEAD_DIM]
            for b, c in enumerate(caches):  # the chain's rows go after the real pairs, not counted as real
                c.k[:, c.length + j : c.length + j + 1] = k[b]
                c.v[:, c.length + j : c.length + j + 1] = v[b]
            kv = [c.keys(j + 1) for c in caches]
            u = self.finish(zj[:, None], self._attend([q[b, :, 0] for b in range(len(caches))],
                                                      [k for k, _ in kv], [v for _, v in kv]))[:, 0]
        picks_t = torch.stack(picks, 1)
        return self.vocab_ids[picks_t], torch.stack(probs, 1)


__all__ = ["ContextHead", "HeadCache", "WINDOW", "rotary"]
