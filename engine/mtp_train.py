"""Training MTP draft heads by self-distillation from a frozen model (``cadence train-mtp``).

Data (made once, kept in a work folder under the user cache directory, resumable shard by shard):

- chat: the model's own greedy answers (batched engine, at most ``max_tokens`` each) to the prompt
  set of :mod:`engine.mtp_prompts`; the answers are then teacher-forced through the transformers
  model to get its final-norm hidden state (``last_hidden_state``) at every answer position.
- Whisper: text (the chat model's answers to the same prompt split, cut into 12-80 word pieces,
  plus the prompt set's paragraphs) spoken by espeak-ng with varied voices and speeds (at most 27 s: one
  30-s window of the engine) and transcribed greedily by the model itself (batched, with the engine's
  prompt and token suppression), keeping the decoder's ``last_hidden_state`` at every position.

Each position ``i`` of a sequence has the hidden state ``H[i]`` that emitted token ``X[i]`` (the
model's greedy choice ``G[i]``). Chain step ``j`` from position ``i`` gets ``(state, X[i+j-1])``
(the first state is ``H[i]``, later ones the head's own) and learns ``G[i+j]``; all steps train
jointly. Held-out acceptance replays greedy drafting and verification over held-out sequences,
exactly as the engine would see it: draft ``depth`` tokens, accept the longest prefix equal to the
model's greedy tokens, move on by ``accepted + 1``.

Training is seeded (initial weights and every batch follow from the seed and the step number) and
resumable: the head and its optimizer state are checkpointed as safetensors + JSON (no pickle).
"""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.errors import CadenceError
from engine.mtp import MTPHead, head_path, read_head

DATA_VERSION = 1
DEPTH = 4  # chain steps trained jointly and measured
STEP_WEIGHT = 0.8  # loss weight of chain step j is STEP_WEIGHT ** (j - 1): early drafts matter most
MIN_PS = (0.3, 0.5)  # confidence cuts whose acceptance is also reported
VOICES = ["en-us+f3", "en-us+m3", "en-us+f2", "en-us+m1", "en-gb+f3", "en-gb+m3", "en-us", "en-gb-x-rp+f4",
          "en-us+m7", "en-gb-scotland+f1"]


@dataclass
class Recipe:
    """How one model's head is trained (defaults per family; the built-in models' are what shipped)."""

    kind: str  # "chat" or "whisper"
    steps: int = 1500
    batch: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup: int = 60
    ffn_mult: float = 2.0  # MLP width / hidden size
    draft_vocab: int = 8192  # draft vocabulary size: the training targets, then the lowest ids
    max_tokens: int = 200  # chat answers
    train_clips: int = 640  # whisper
    heldout_clips: int = 96
    val_clips: int = 32
    eval_every: int = 250
    checkpoint_every: int = 100
    dropout: float = 0.0  # on the MLP's inner activations, training only
    noise: float = 0.0  # gaussian noise on the model's hidden state, relative to its RMS, training only
    bf16: bool | None = None  # bfloat16 autocast for training matmuls; None: where the CPU supports it natively

    def to_json(self) -> dict:
        return asdict(self)


RECIPES = {
    "smollm2-135m-instruct": Recipe("chat", steps=2000, draft_vocab=6144, ffn_mult=1.0),
    "whisper-tiny.en": Recipe("whisper", steps=1500, draft_vocab=4096, ffn_mult=2.0, train_clips=576, heldout_clips=64),
    "whisper-base": Recipe("whisper", steps=1500, draft_vocab=4096, ffn_mult=1.5, train_clips=256, heldout_clips=64),
}


def recipe_for(model: str) -> tuple[Recipe, object]:
    """The recipe and resolved source of a model; ModelError (one sentence) for a model that is unknown."""
    from engine.models import CHAT, resolve

    source = resolve(model)
    recipe = RECIPES.get(source.name) or Recipe("chat" if source.family == CHAT else "whisper")
    return Recipe(**recipe.to_json()), source


# ---------------------------------------------------------------------------- progress
class Progress:
    """One status line on stderr (rewritten in place on a terminal, a line every few seconds otherwise)."""

    def __init__(self, stream=None, every: float = 5.0):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = every
        self.last = 0.0
        self.t0 = time.perf_counter()

    def __call__(self, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < (0.2 if self.tty else self.every):
            return
        self.last = now
        line = f"[{now - self.t0:7.1f} s] {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(f"[{time.perf_counter() - self.t0:7.1f} s] {text}\n")
        self.stream.flush()


def _quiet(*args, **kwargs) -> None:
    pass


_quiet.done = _quiet  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- data
@dataclass
class SeqData:
    """Sequences laid end to end: ``hidden[i]`` emitted ``emitted[i]`` (greedy choice ``greedy[i]``)."""

    hidden: torch.Tensor  # [N, d]
    emitted: torch.Tensor  # [N] long
    greedy: torch.Tensor  # [N] long
    lengths: torch.Tensor  # [S] long
    texts: list[str] = field(default_factory=list)

    @property
    def remaining(self) -> torch.Tensor:
        """For each position, how many positions of its sequence follow it."""
        ends = torch.cumsum(self.lengths, 0)
        seq = torch.repeat_interleave(torch.arange(len(self.lengths)), self.lengths)
        return ends[seq] - 1 - torch.arange(int(self.lengths.sum()))

    @staticmethod
    def concat(parts: list["SeqData"]) -> "SeqData":
        return SeqData(torch.cat([p.hidden for p in parts]), torch.cat([p.emitted for p in parts]),
                       torch.cat([p.greedy for p in parts]), torch.cat([p.lengths for p in parts]),
                       [t for p in parts for t in p.texts])

    def select(self, sequences: list[int]) -> "SeqData":
        """Only the given sequences, in that order."""
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        rows = torch.cat([torch.arange(int(starts[s]), int(starts[s] + self.lengths[s])) for s in sequences])
        return SeqData(self.hidden[rows], self.emitted[rows], self.greedy[rows], self.lengths[sequences].clone(),
                       [self.texts[s] for s in sequences] if self.texts else [])

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tmp = path.with_name(path.name + ".tmp")
        save_file({"hidden": self.hidden.to(torch.float16).contiguous(), "emitted": self.emitted, "greedy": self.greedy,
                   "lengths": self.lengths}, str(tmp), metadata={"texts": json.dumps(self.texts)})
        tmp.replace(path)

    @staticmethod
    def load(path: Path) -> "SeqData":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            texts = json.loads((f.metadata() or {}).get("texts", "[]"))
            t = {k: f.get_tensor(k) for k in f.keys()}
        return SeqData(t["hidden"].float(), t["emitted"], t["greedy"], t["lengths"], texts)


def work_dir(source, data_dir: str | Path | None = None) -> Path:
    """Where generated data and checkpoints live: --data-dir, else <cache>/mtp/<model>-<source key>."""
    if data_dir:
        path = Path(data_dir).expanduser()
    else:
        from engine.loading import source_key
        from engine.paths import cache_dir

        path = cache_dir() / "mtp" / f"{Path(source.name).name}-{source_key(source)}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _shards(folder: Path, prefix: str, items: list, size: int, make, progress, what: str) -> SeqData:
    """Build (or reuse) the shards of ``items`` under ``folder``; ``make(chunk)`` -> SeqData."""
    parts = []
    chunks = [items[i : i + size] for i in range(0, len(items), size)]
    tokens = 0
    for n, chunk in enumerate(chunks):
        path = folder / f"{prefix}-{n:03d}.safetensors"
        if path.is_file():
            part = SeqData.load(path)
        else:
            progress(f"{what}: shard {n + 1}/{len(chunks)} ({len(chunk)} items), {tokens} tokens so far", force=True)
            part = make(chunk, n)
            part.save(path)
        parts.append(part)
        tokens += int(part.lengths.sum())
        progress(f"{what}: {n + 1}/{len(chunks)} shards, {tokens} tokens generated", force=True)
    return SeqData.concat(parts)


def _load(source):
    from engine.loading import load

    return load(source.name if source.origin.startswith("package") else str(source.folder), device="cpu",
                dtype=torch.float32)


# ----- chat
class _ChatMaker:
    def __init__(self, source, recipe: Recipe, progress):
        self.source, self.recipe, self.progress = source, recipe, progress
        self.loaded = None
        self.engine = None

    def _ready(self):
        if self.loaded is None:
            from engine.engine import Engine

            self.loaded = _load(self.source)
            self.engine = Engine(backend="cpu", batch=16)

    def close(self):
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def __call__(self, prompts: list[str], n: int) -> SeqData:
        from engine.chat_reference import ChatReference, build_messages
        from engine.engine import ChatRequest
        from engine.sampling import SamplingParams

        self._ready()
        ref = ChatReference(self.loaded)
        eos = min(ref.stop_ids)
        ids = [ref.prompt_ids(build_messages(p)) for p in prompts]
        params = SamplingParams(max_tokens=self.recipe.max_tokens)
        t0 = time.perf_counter()
        handles = [self.engine.submit(ChatRequest(model=self.source.name, prompt_ids=i, params=params)) for i in ids]
        answers = []
        for k, h in enumerate(handles):
            r = h.result()
            answers.append(list(r["tokens"]) + ([eos] if r["finish_reason"] == "stop" else []))
            done = sum(len(a) for a in answers)
            self.progress(f"chat shard {n + 1}: {k + 1}/{len(prompts)} answers, {done} tokens "
                          f"({done / (time.perf_counter() - t0):.0f} tok/s)")
        return _teacher_force_chat(self.loaded, ids, answers, [ref.tokenizer.decode(a, skip_special_tokens=True)
                                                              for a in answers])


@torch.inference_mode()
def _teacher_force_chat(loaded, prompts: list[list[int]], answers: list[list[int]], texts: list[str]) -> SeqData:
    """Hidden states at the positions that emitted each answer token (greedy answers: emitted = greedy)."""
    model = loaded.model
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(answers[i]))
    hidden: dict[int, torch.Tensor] = {}
    for b in range(0, len(order), 8):
        rows = order[b : b + 8]
        seqs = [prompts[i] + answers[i][:-1] if answers[i] else prompts[i] for i in rows]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
        out = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for r, i in enumerate(rows):
            p = len(prompts[i])
            hidden[i] = out[r, p - 1 : p - 1 + len(answers[i])].float().clone()
    keep = [i for i in range(len(prompts)) if answers[i]]
    tokens = torch.tensor([t for i in keep for t in answers[i]], dtype=torch.long)
    return SeqData(torch.cat([hidden[i] for i in keep]), tokens, tokens.clone(),
                   torch.tensor([len(answers[i]) for i in keep], dtype=torch.long), [texts[i] for i in keep])


def chat_parts(source, recipe: Recipe, folder: Path, progress,
               parts: tuple[str, ...] = ("first", "more", "val", "held")) -> dict[str, SeqData]:
    """A chat model's answers to the given parts of the prompt set: first, more (training), val, held."""
    from engine.mtp_prompts import HELD_OUT_PROMPTS, MORE_TRAIN_PROMPTS, TRAIN_PROMPTS, VALIDATION_PROMPTS

    table = {"first": ("chat-train", TRAIN_PROMPTS, "chat training data"),
             "more": ("chat-more", MORE_TRAIN_PROMPTS, "more chat training data"),
             "val": ("chat-val", VALIDATION_PROMPTS, "chat validation data"),
             "held": ("chat-heldout", HELD_OUT_PROMPTS, "chat held-out data")}
    maker = _ChatMaker(source, recipe, progress)
    try:
        return {part: _shards(folder, table[part][0], table[part][1], 48, maker, progress, table[part][2])
                for part in parts}
    finally:
        maker.close()


def chat_data(source, recipe: Recipe, folder: Path, progress) -> tuple[SeqData, SeqData, SeqData]:
    """(training, validation, held-out) answers of a chat model to the prompt set."""
    from engine.mtp_prompts import TRAIN_PROMPTS, mentions_held_out

    parts = chat_parts(source, recipe, folder, progress)
    first = parts["first"]
    if len(first.lengths) == len(TRAIN_PROMPTS):  # every prompt answered: leave out those naming held-out topics
        first = first.select([i for i, p in enumerate(TRAIN_PROMPTS) if not mentions_held_out(p)])
    return SeqData.concat([first, parts["more"]]), parts["val"], parts["held"]


# ----- whisper
def speech_pieces(text: str, rng: random.Random) -> list[str]:
    """Plain sentences of an answer, grouped into pieces of 12 to about 80 words (code and markup left out)."""
    text = re.sub(r"```.*?(```|$)", " ", text, flags=re.S)
    lines = []
    for line in text.splitlines():
        if re.search(r"[{}=;<>\[\]_\\|]|def |return |\w\(|\)\s*$", line):
            continue
        line = re.sub(r"^\s*(#+|\*+|-|\d+[.)])\s*", "", line)
        line = line.replace("**", "").replace("`", "").replace("*", "")
        if line.strip():
            lines.append(line.strip())
    sentences = [s for s in re.split(r"(?<=[.!?:])\s+", " ".join(lines)) if s]
    pieces, words = [], []
    limit = rng.randint(40, 80)
    for s in sentences:
        w = s.split()
        if words and len(words) + len(w) > limit:
            pieces.append(words)
            words, limit = [], rng.randint(40, 80)
        words += w[:80]
    if words:
        pieces.append(words)
    out = []
    for p in pieces:
        piece = " ".join(p)
        if len(p) >= 12 and sum(c.isascii() for c in piece) > 0.98 * len(piece) and re.search(r"[a-zA-Z]{3}", piece):
            out.append(piece)
    return out


SPLITS = {"train": 0, "heldout": 1, "val": 2}


def speech_texts(split: str, seed: int, count: int, progress) -> list[str]:
    """``count`` pieces of English text for speech of one split (train, val, heldout): the default chat
    model's answers to that split's prompts (the first batch of training prompts for train) and the
    split's paragraphs; the chat model's data is made first when missing."""
    from engine.models import DEFAULT_CHAT
    from engine.mtp_prompts import texts_for_speech

    recipe, source = recipe_for(DEFAULT_CHAT)
    progress(f"speech text: {DEFAULT_CHAT}'s answers to the {split} prompts", force=True)
    part = {"train": "first", "val": "val", "heldout": "held"}[split]
    answers = chat_parts(source, recipe, work_dir(source), progress, (part,))[part].texts
    rng = random.Random(seed * 7919 + SPLITS[split])
    pieces = []
    for text in answers + (texts_for_speech(split == "heldout") if split != "val" else []):
        pieces += speech_pieces(text, rng)
    rng.shuffle(pieces)
    return pieces[:count]


def synthesize(text: str, out: Path, voice: str, rate: int) -> Path:
    raw = out.with_suffix(".raw.wav")
    try:
        subprocess.run(["espeak-ng", "-w", str(raw), "-v", voice, "-s", str(rate), text], check=True,
                       capture_output=True)
        subprocess.run(["sox", str(raw), "-r", "16000", "-c", "1", str(out)], check=True, capture_output=True)
    except FileNotFoundError as exc:
        raise CadenceError(f"Training a Whisper draft head needs espeak-ng and sox installed ({exc.filename} "
                           "was not found).") from None
    finally:
        raw.unlink(missing_ok=True)
    return out


class _WhisperMaker:
    def __init__(self, loaded, seed: int, progress=_quiet, language: str = "en"):
        from engine.whisper_reference import WhisperReference

        self.loaded = loaded
        self.ref = WhisperReference(self.loaded)
        self.seed, self.progress, self.language = seed, progress, language

    def __call__(self, items: list[tuple[int, str]], n: int) -> SeqData:
        from engine.audio import load_audio
        from engine.transcribe import plan_transcription

        windows, prompt, texts = [], None, []
        with tempfile.TemporaryDirectory(prefix="cadence-mtp-") as tmp:
            for k, (index, text) in enumerate(items):
                rng = random.Random(self.seed * 1_000_003 + index)
                voice, rate = rng.choice(VOICES), rng.randrange(120, 176, 5)
                text = " ".join(text.split()[: int(rate * 0.45)])  # at most 27 s: one window
                wav = synthesize(text, Path(tmp) / f"{k}.wav", voice, rate)
                plan = plan_transcription(self.ref, load_audio(wav), self.language, "transcribe", wav.name,
                                          windowing="fixed")
                prompt = plan.prompt
                windows.append(torch.from_numpy(plan.spans[0][2]))
                texts.append(f"{voice} {rate}: {text}")
                self.progress(f"speech shard {n + 1}: {k + 1}/{len(items)} clips spoken")
        parts = []
        for b in range(0, len(windows), 8):
            parts.append(self._decode(torch.stack(windows[b : b + 8]), prompt))
            self.progress(f"speech shard {n + 1}: {min(b + 8, len(windows))}/{len(windows)} clips transcribed, "
                          f"{sum(int(p.lengths.sum()) for p in parts)} tokens")
        data = SeqData.concat(parts)
        data.texts = texts
        return data

    @torch.inference_mode()
    def _decode(self, feats: torch.Tensor, prompt: list[int], max_new: int = 160) -> SeqData:
        """Greedy transcription of B windows at once (the engine's rules), keeping each position's hidden state."""
        model, ref = self.loaded.model, self.ref
        B = feats.shape[0]
        enc = model.model.encoder(input_features=feats).last_hidden_state
        ids = torch.tensor([prompt] * B)
        out = model.model.decoder(input_ids=ids, encoder_hidden_states=enc, use_cache=True)
        cache, h = out.cache, out.last_hidden_state[:, -1]
        hiddens, tokens = [], []
        done = torch.zeros(B, dtype=torch.bool)
        lengths = torch.zeros(B, dtype=torch.long)
        for step in range(max_new):
            logits = model.proj_out(h).float()
            logits[:, ref.suppress] = -float("inf")
            if step == 0:
                logits[:, ref.begin_suppress] = -float("inf")
            tok = logits.argmax(-1)
            hiddens.append(h.float().clone())
            tokens.append(tok)
            lengths += (~done).long()
            done |= tok == ref.tok.eot
            if bool(done.all()):
                break
            out = model.model.decoder(input_ids=tok[:, None], encoder_hidden_states=enc, cache=cache, use_cache=True)
            cache, h = out.cache, out.last_hidden_state[:, -1]
        H, T = torch.stack(hiddens, 1), torch.stack(tokens, 1)  # [B, steps, d], [B, steps]
        keep = [r for r in range(B) if lengths[r] > 1]
        return SeqData(torch.cat([H[r, : lengths[r]] for r in keep]), torch.cat([T[r, : lengths[r]] for r in keep]),
                       torch.cat([T[r, : lengths[r]] for r in keep]), lengths[keep].clone())


def whisper_data(source, recipe: Recipe, folder: Path, seed: int, progress) -> tuple[SeqData, SeqData, SeqData]:
    """(training, validation, held-out) speech of a Whisper model, transcribed by itself."""
    maker = None
    out = []
    for split, count in (("train", recipe.train_clips), ("val", recipe.val_clips), ("heldout", recipe.heldout_clips)):
        prefix = f"speech-{split}"
        if all((folder / f"{prefix}-{n:03d}.safetensors").is_file() for n in range(math.ceil(count / 32))):
            items = [(0, "")] * count  # every shard is there: no text needed
        else:
            items = [(i + (SPLITS[split] << 20), t) for i, t in enumerate(speech_texts(split, seed, count, progress))]

        def make(chunk, n):
            nonlocal maker
            if maker is None:
                maker = _WhisperMaker(_load(source), seed, progress)
            return maker(chunk, n)

        out.append(_shards(folder, prefix, items, 32, make, progress, f"speech {split} data"))
    return out[0], out[1], out[2]


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
    inputs, targets = [], []
    for j in range(1, depth + 1):
        inputs.append(data.emitted[torch.clamp(idx + j - 1, max=N - 1)])
        t = to_draft[data.greedy[torch.clamp(idx + j, max=N - 1)]]
        targets.append(torch.where(rem[idx] >= j, t, torch.full_like(t, -1)))
    return data.hidden[idx], inputs, targets


def chain_loss(head: MTPHead, hidden, inputs, targets, noise: float = 0.0) -> tuple[torch.Tensor, list[float]]:
    h = hidden
    if noise:
        h = h + noise * h.pow(2).mean(-1, keepdim=True).sqrt() * torch.randn_like(h)
    total, weight, accs = 0.0, 0.0, []
    for j, (tok, tgt) in enumerate(zip(inputs, targets)):
        h = head.step(h, tok)
        logits = head.logits(h)
        valid = tgt >= 0
        if bool(valid.any()):
            w = STEP_WEIGHT ** j
            total = total + w * F.cross_entropy(logits[valid], tgt[valid])
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
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _optimizer(head: MTPHead, recipe: Recipe) -> torch.optim.Optimizer:
    decay = [head.fc, head.gate_up, head.down]
    rest = [head.norm_h, head.norm_e, head.norm_z, head.norm_out, head.bias_out]
    return torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))


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
                                                      "vocab_size": head.vocab_size, "ffn": head.ffn}, **info}
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
    head = MTPHead(h["model"], h["hidden"], h["vocab_size"], t["head.vocab_ids"], h["ffn"])
    with torch.no_grad():
        for n, p in head.named_parameters():
            p.copy_(t[f"head.{n}"])
    opt = _optimizer(head, recipe)
    for n, p in head.named_parameters():
        if f"opt.{n}.exp_avg" in t:
            opt.state[p] = {"step": torch.tensor(meta["opt_steps"][n]), "exp_avg": t[f"opt.{n}.exp_avg"].clone(),
                            "exp_avg_sq": t[f"opt.{n}.exp_avg_sq"].clone()}
    return head, opt, int(meta["step"]), meta


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
               folder: Path | None = None, resume: bool = False, progress=_quiet, embed=None, lm_head=None,
               model: str = "", vocab_ids: torch.Tensor | None = None, stop_after: int | None = None) -> MTPHead:
    """Train (or, with ``resume``, continue from the checkpoint in ``folder``) for ``steps`` steps in all.
    Each step's batch depends only on the seed and the step number, so a resumed run ends where an
    uninterrupted one would. ``stop_after`` stops early (tests: an interrupted run)."""
    start, opt = 0, None
    loaded = load_checkpoint(folder, recipe) if (resume and folder is not None) else None
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
        hidden, inputs, targets = _batch(train, rem, pool, idx, to_draft, DEPTH)
        for group in opt.param_groups:
            group["lr"] = _lr(recipe, step, steps)
        torch.manual_seed(seed * 1_000_003 + step)  # noise and dropout: from the step too
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, accs = chain_loss(head, hidden, inputs, targets, recipe.noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        value = float(loss.detach())
        loss_avg = value if loss_avg is None else 0.95 * loss_avg + 0.05 * value
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


# ---------------------------------------------------------------------------- acceptance
@torch.no_grad()
def all_chains(head: MTPHead, data: SeqData, depth: int, fast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's greedy chain from every position: drafted full-vocabulary ids [N, depth] and probabilities."""
    picks, probs = [], []
    for b in range(0, data.emitted.numel(), 2048):
        p, q = head.chain(data.hidden[b : b + 2048], data.emitted[b : b + 2048], depth, fast=fast)
        picks.append(head.vocab_ids[p])
        probs.append(q)
    return torch.cat(picks), torch.cat(probs)


def replay(drafts: torch.Tensor, probs: torch.Tensor, data: SeqData, depth: int, min_p: float = 0.0) -> dict:
    """Greedy drafting and verification replayed over each sequence, as the engine runs it: from position i
    draft up to ``depth`` tokens (stopping before one whose probability is below ``min_p``), accept the
    longest prefix equal to the model's greedy tokens, continue at i + accepted + 1."""
    G = data.greedy.tolist()
    D, P = drafts[:, :depth].tolist(), probs[:, :depth].tolist()
    steps = drafted = accepted = drafts_made = 0
    at_pos = [0] * depth
    start = 0
    for n in data.lengths.tolist():
        i = 0
        while i < n - 1:
            k_max = min(depth, n - 1 - i)
            row, prow = D[start + i], P[start + i]
            k_draft = 0
            while k_draft < k_max and prow[k_draft] >= min_p:
                k_draft += 1
            k = 0
            while k < k_draft and row[k] == G[start + i + 1 + k]:
                at_pos[k] += 1
                k += 1
            steps += 1
            drafted += k_draft
            accepted += k
            drafts_made += k_draft > 0
            i += k + 1
        start += n
    return {"depth": depth, "min_p": min_p, "steps": steps, "drafts": drafts_made, "drafted": drafted,
            "accepted": accepted, "rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts_made if drafts_made else 1.0,
            "tokens_per_step": (steps + accepted) / steps if steps else 1.0,
            "per_position": [a / drafts_made if drafts_made else 0.0 for a in at_pos]}


@torch.no_grad()
def calibrate(head: MTPHead, data: SeqData, depth: int = DEPTH) -> tuple[float, dict]:
    """The temperature that makes the head's confidence in its drafts honest on ``data`` (least squared error
    between the drafted token's probability and whether the model's greedy token equals it; step k counts
    only where steps 1..k-1 were right, as in drafting), and the error before and after."""
    grid = [round(0.5 + 0.1 * i, 2) for i in range(31)]  # 0.5 .. 3.5
    errors = torch.zeros(len(grid), dtype=torch.float64)
    rem = data.remaining
    count = 0
    was = head.temperature.clone()
    head.temperature.fill_(1.0)
    N = data.emitted.numel()
    for b in range(0, N, 2048):
        idx = torch.arange(b, min(N, b + 2048))
        h, tok = data.hidden[idx], data.emitted[idx]
        alive = rem[idx] >= 1
        for k in range(1, depth + 1):
            h = head.step(h, tok)
            logits = head.logits(h).float()
            best = logits.argmax(-1)
            tok = head.vocab_ids[best]
            right = (tok == data.greedy[torch.clamp(idx + k, max=N - 1)]) & alive
            if bool(alive.any()):
                z = logits[alive] - logits[alive].max(-1, keepdim=True).values
                for g, t in enumerate(grid):
                    p = 1.0 / torch.exp(z / t).sum(-1)
                    errors[g] += float(((p - right[alive].float()) ** 2).sum())
                count += int(alive.sum())
            alive = right & (rem[idx] >= k + 1)
    head.temperature.copy_(was)
    best = int(errors.argmin())
    return grid[best], {"brier_at_1": round(float(errors[grid.index(1.0)]) / max(count, 1), 4),
                        "brier": round(float(errors[best]) / max(count, 1), 4), "temperature": grid[best]}


def _subset(data: SeqData, limit: int | None) -> SeqData:
    if limit is None or int(data.lengths.sum()) <= limit:
        return data
    keep = int(torch.searchsorted(torch.cumsum(data.lengths, 0), torch.tensor(limit)).item()) + 1
    n = int(data.lengths[:keep].sum())
    return SeqData(data.hidden[:n], data.emitted[:n], data.greedy[:n], data.lengths[:keep], data.texts[:keep])


def measure(head: MTPHead, data: SeqData, depth: int = DEPTH, min_p: float = 0.0, limit: int | None = None,
            fast: bool = False) -> dict:
    data = _subset(data, limit)
    drafts, probs = all_chains(head, data, depth, fast)
    return replay(drafts, probs, data, depth, min_p)


def acceptance_table(head: MTPHead, data: SeqData, fast: bool = False) -> dict:
    """Held-out acceptance at depths 1..DEPTH, and at DEPTH drafting only while the head's probability is at
    least each of MIN_PS."""
    drafts, probs = all_chains(head, data, DEPTH, fast)
    table = {f"depth{d}": replay(drafts, probs, data, d) for d in range(1, DEPTH + 1)}
    for min_p in MIN_PS:
        table[f"depth{DEPTH}_min_p{min_p}"] = replay(drafts, probs, data, DEPTH, min_p)
    at = torch.nonzero(data.remaining >= 1).flatten()  # the first draft at every position, not only replayed ones
    table["first_draft_all_positions"] = float((drafts[at, 0] == data.greedy[at + 1]).float().mean()) if len(at) else 0.0
    table["positions"] = int(data.lengths.sum())
    table["sequences"] = int(len(data.lengths))
    return table


def format_table(table: dict) -> str:
    lines = ["drafting               rate   mean length  tokens/step  per position"]
    for key, m in table.items():
        if not isinstance(m, dict):
            continue
        name = f"depth {m['depth']}" + (f", min p {m['min_p']}" if m["min_p"] else "")
        lines.append(f"{name:<20} {m['rate']:7.1%} {m['mean_acceptance_length']:12.2f} {m['tokens_per_step']:12.2f}  "
                     + " ".join(f"{p:.2f}" for p in m["per_position"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the command
def model_matrices(source) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The frozen token embedding, output matrix and end-of-text ids of a model (loaded on CPU, float32)."""
    return matrices_of(_load(source))


def matrices_of(loaded) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    hf = loaded.model
    source = loaded.source
    if source.family == "whisper":
        return hf.model.decoder.embed_tokens.weight.detach(), hf.proj_out.weight.detach(), [loaded.tokenizer.eot]
    eos = hf.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach(), eos


def train_mtp(model: str, out: str | Path | None = None, steps: int | None = None, seed: int = 0, resume: bool = False,
              data_dir: str | Path | None = None, progress=None) -> tuple[Path, dict]:
    """The whole of ``cadence train-mtp``: data (made or reused), training, held-out acceptance, the head file."""
    progress = progress or Progress()
    recipe, source = recipe_for(model)
    steps = steps or recipe.steps
    if steps < 1:
        raise CadenceError(f"--steps must be at least 1 (got {steps}).")
    folder = work_dir(source, data_dir)
    t0 = time.perf_counter()
    progress(f"{source.name}: data and checkpoints in {folder}", force=True)
    if recipe.kind == "chat":
        train, val, held = chat_data(source, recipe, folder, progress)
    else:
        train, val, held = whisper_data(source, recipe, folder, seed, progress)
    data_s = time.perf_counter() - t0
    sizes = {"train_sequences": len(train.lengths), "train_positions": int(train.lengths.sum()),
             "val_sequences": len(val.lengths), "val_positions": int(val.lengths.sum()),
             "heldout_sequences": len(held.lengths), "heldout_positions": int(held.lengths.sum())}
    progress.done(f"data: {sizes['train_sequences']} training sequences ({sizes['train_positions']} positions), "
                  f"{sizes['val_sequences']} validation ({sizes['val_positions']}), {sizes['heldout_sequences']} "
                  f"held-out ({sizes['heldout_positions']}), {data_s:.0f} s")
    embed, lm_head, always = model_matrices(source)
    vocab_ids = draft_vocabulary(train, recipe.draft_vocab, always, embed.shape[0])
    coverage = float(torch.isin(held.greedy, vocab_ids).float().mean())
    progress.done(f"draft vocabulary: {vocab_ids.numel()} tokens, covering {coverage:.1%} of held-out targets")
    t1 = time.perf_counter()
    head = train_head(None, train, val, recipe, seed, steps, folder, resume, progress, embed, lm_head,
                      source.name, vocab_ids)
    temperature, calibration = calibrate(head, val)
    head.temperature.fill_(temperature)
    train_s = time.perf_counter() - t1
    progress.done(f"trained {steps} steps in {train_s:.0f} s; temperature {temperature} fitted on validation")
    path = Path(out) if out else head_path(source.name)
    head.meta = {"recipe": {"command": f"cadence train-mtp --model {source.name} --steps {steps} --seed {seed}",
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


def _rounded(table: dict) -> dict:
    out = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out[k] = {kk: (round(vv, 4) if isinstance(vv, float) else [round(x, 4) for x in vv] if isinstance(vv, list)
                           else vv) for kk, vv in v.items()}
        else:
            out[k] = round(v, 4) if isinstance(v, float) else v
    return out


def chat_sample(loaded, prompts: list[str], max_tokens: int = 64) -> SeqData:
    """A few greedy answers of a loaded chat model (single-stream reference decoder), with hidden states."""
    from engine.chat_reference import ChatReference, build_messages
    from engine.sampling import SamplingParams

    ref = ChatReference(loaded)
    ids, answers = [], []
    for p in prompts:
        ids.append(ref.prompt_ids(build_messages(p)))
        r = ref.generate(ids[-1], SamplingParams(max_tokens=max_tokens))
        answers.append(list(r.tokens) + ([min(ref.stop_ids)] if r.finish_reason == "stop" else []))
    return _teacher_force_chat(loaded, ids, answers, [""] * len(prompts))


def speech_sample(loaded, texts: list[str], seed: int = 0) -> SeqData:
    """Speech of a few texts, transcribed greedily by a loaded Whisper model, with hidden states."""
    return _WhisperMaker(loaded, seed)([(i, t) for i, t in enumerate(texts)], 0)


def load_heldout(model: str, data_dir: str | Path | None = None, split: str = "heldout") -> SeqData | None:
    """The held-out (or "val") data of a model made by an earlier ``train-mtp`` run (None when there is none)."""
    recipe, source = recipe_for(model)
    folder = work_dir(source, data_dir)
    if recipe.kind == "chat":
        prefix = {"heldout": "chat-heldout", "val": "chat-val"}[split]
    else:
        prefix = f"speech-{split}"
    paths = sorted(folder.glob(f"{prefix}-*.safetensors"))
    return SeqData.concat([SeqData.load(p) for p in paths]) if paths else None
