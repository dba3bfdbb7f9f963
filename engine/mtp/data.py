"""Data for MTP heads: what the frozen model emits, with its hidden state at every position.

- chat: the model's own greedy answers (batched engine in float32, at most ``max_tokens`` each) to
  the prompt set of :mod:`engine.mtp.prompts`, with the final-norm hidden state the engine computed
  at every answer position as it chose the token there (``ChatRequest.keep_hidden``: no second pass);
  and, where the recipe asks (``corpus_prompts``), its answers to prompts made from corpus passages
  (:func:`engine.mtp.corpus.corpus_prompts`), from an engine in the precision it drafts beside.
- Whisper (:mod:`engine.mtp.speech_data`): text (the chat model's answers to the same prompt split, cut into 12-80 word pieces,
  plus the prompt set's paragraphs) spoken by espeak-ng with varied voices and speeds (at most 27 s: one
  30-s window of the engine), some with sox's noise mixed in, and transcribed greedily by the model
  itself (batched, with the engine's prompt, token suppression and, on the default path the recipe
  asks for, its voice-activity window and time-token rules), keeping the decoder's
  ``last_hidden_state`` at every position.

Made once and kept in a work folder under the user cache directory, resumable shard by shard.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import CadenceError
from engine.mtp.recipe import Recipe, recipe_for

DATA_VERSION = 1



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


def load_frozen(source):
    """The model, loaded on the CPU in float32 (the teacher every head learns from)."""
    from engine.loading import load

    return load(source.name if source.origin.startswith("package") else str(source.folder), device="cpu",
                dtype=torch.float32)


# ----- chat
class _ChatMaker:
    def __init__(self, source, recipe: Recipe, progress, width: int = 16, precision: str = "float32"):
        self.source, self.recipe, self.progress, self.width, self.precision = source, recipe, progress, width, precision
        self.loaded = None
        self.engine = None

    def _ready(self):
        if self.loaded is None:
            from engine.engine import Engine

            self.loaded = load_frozen(self.source)
            # the teacher's own greedy answers, and the hidden states behind them (drafting off: verified
            # drafts would give the same tokens and states, at more rows a step)
            self.engine = Engine(backend="cpu", batch=self.width, precision=self.precision, drafter="off")

    def close(self):
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = self.loaded = None  # a later call starts afresh

    def __call__(self, prompts: list[str], n: int) -> SeqData:
        from engine.chat.reference import ChatReference, build_messages
        from engine.api import ChatRequest
        from engine.sampling import SamplingParams

        self._ready()
        ref = ChatReference(self.loaded)
        eos = min(ref.stop_ids)
        ids = [ref.prompt_ids(build_messages(p)) for p in prompts]
        params = SamplingParams(max_tokens=self.recipe.max_tokens)
        t0 = time.perf_counter()
        handles = [self.engine.submit(ChatRequest(model=self.source.name, prompt_ids=i, params=params,
                                                  keep_hidden=True)) for i in ids]
        answers, hidden = [], []
        for k, h in enumerate(handles):
            r = h.result()
            answers.append(list(r.tokens) + ([eos] if r.finish_reason == "stop" else []))
            hidden.append(r.hidden.float())  # a row per answer token, the stop token's included
            done = sum(len(a) for a in answers)
            self.progress(f"chat shard {n + 1}: {k + 1}/{len(prompts)} answers, {done} tokens "
                          f"({done / (time.perf_counter() - t0):.0f} tok/s)")
        keep = [i for i, a in enumerate(answers) if a]
        tokens = torch.tensor([t for i in keep for t in answers[i]], dtype=torch.long)
        return SeqData(torch.cat([hidden[i] for i in keep]), tokens, tokens.clone(),
                       torch.tensor([len(answers[i]) for i in keep], dtype=torch.long),
                       [ref.tokenizer.decode(answers[i], skip_special_tokens=True) for i in keep])


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


class _CorpusMaker:
    """Teacher-forced passes over corpus conversations (:mod:`engine.mtp.corpus`): each passage is the
    assistant's answer; the model's hidden state at every answer position, the corpus token it was
    fed next (``emitted``) and its own greedy choice there (``greedy``)."""

    def __init__(self, source, max_tokens: int):
        self.source, self.max_tokens, self.loaded = source, max_tokens, None

    def __call__(self, items: list[tuple[str, str]], n: int) -> SeqData:
        from engine.chat.reference import ChatReference, build_messages

        if self.loaded is None:
            self.loaded = load_frozen(self.source)
        ref = ChatReference(self.loaded)
        eos = min(ref.stop_ids)
        prompts, answers = [], []
        for question, answer in items:
            prompts.append(ref.prompt_ids(build_messages(question)))
            ids = ref.tokenizer.encode(answer, add_special_tokens=False)
            answers.append(ids[: self.max_tokens] if len(ids) > self.max_tokens else ids + [eos])
        data = _teacher_force_chat(self.loaded, prompts, answers, [a for _, a in items])
        data.greedy = greedy_of(self.loaded.model.lm_head.weight, data.hidden)
        return data


@torch.inference_mode()
def greedy_of(lm_head: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The model's greedy token at each position from its final-norm hidden states."""
    return torch.cat([(hidden[b : b + 1024] @ lm_head.T).argmax(-1) for b in range(0, hidden.shape[0], 1024)])


def _require_corpora() -> None:
    from engine.mtp.corpus import missing_sources

    missing = missing_sources()
    if missing:
        raise CadenceError(f"Training this draft head reads installed documentation; install the Debian packages "
                           f"{', '.join(sorted(missing.values()))} first (`make mtp-corpora`).")


def corpus_data(source, folder: Path, seed: int, count: int | None, progress, held_out: bool = False,
                max_tokens: int = 320) -> SeqData:
    """Teacher-forced corpus conversations of one split (``count`` passages, all when None)."""
    from engine.mtp.corpus import conversations

    _require_corpora()
    items = conversations(seed, count, held_out)
    prefix = "corpus-heldout" if held_out else "corpus-train"
    return _shards(folder, prefix, items, 256, _CorpusMaker(source, max_tokens), progress,
                   f"corpus {'held-out' if held_out else 'training'} passages")


def chat_parts(source, recipe: Recipe, folder: Path, progress,
               parts: tuple[str, ...] = ("first", "more", "val", "held")) -> dict[str, SeqData]:
    """A chat model's answers to the given parts of the prompt set: first, more (training), val, held, and
    corpus (``recipe.corpus_prompts`` prompts made from corpus passages, :func:`engine.mtp.corpus.corpus_prompts`).
    Validation and held-out answers come from a float32 engine at width 16 (the reference acceptance is
    measured against); the corpus prompts' from one in ``recipe.answer_precision`` at width 32 (the
    precision the engine verifies drafts in; many more answers), in shards of 128."""
    from engine.mtp.prompts import HELD_OUT_PROMPTS, MORE_TRAIN_PROMPTS, TRAIN_PROMPTS, VALIDATION_PROMPTS

    table = {"first": ("chat-train", TRAIN_PROMPTS, "chat training data"),
             "more": ("chat-more", MORE_TRAIN_PROMPTS, "more chat training data"),
             "val": ("chat-val", VALIDATION_PROMPTS, "chat validation data"),
             "held": ("chat-heldout", HELD_OUT_PROMPTS, "chat held-out data")}
    maker = _ChatMaker(source, recipe, progress)
    try:
        out = {part: _shards(folder, table[part][0], table[part][1], 48, maker, progress, table[part][2])
               for part in parts if part != "corpus"}
    finally:
        maker.close()  # before the corpus prompts' engine starts: one engine in memory at a time
    if "corpus" in parts:
        from engine.mtp.corpus import corpus_prompts

        _require_corpora()  # the prompts come from every source: without one they would silently differ
        prompts = corpus_prompts(0, recipe.corpus_prompts)  # fixed, like the prompt set: shards serve any --seed
        maker = _ChatMaker(source, recipe, progress, width=32, precision=recipe.answer_precision)
        try:
            out["corpus"] = _shards(folder, f"chat-corpus-{recipe.answer_precision}", prompts, 128, maker, progress,
                                    "answers to corpus prompts")
        finally:
            maker.close()
    return out


def chat_data(source, recipe: Recipe, folder: Path, progress) -> tuple[SeqData, SeqData, SeqData]:
    """(training, validation, held-out) answers of a chat model to the prompt set."""
    from engine.mtp.prompts import TRAIN_PROMPTS, mentions_held_out

    wanted = (("first", "val", "held") + (("more",) if recipe.more_prompts else ())
              + (("corpus",) if recipe.corpus_prompts else ()))
    parts = chat_parts(source, recipe, folder, progress, wanted)
    first = parts["first"]
    if len(first.lengths) == len(TRAIN_PROMPTS):  # every prompt answered: leave out those naming held-out topics
        first = first.select([i for i, p in enumerate(TRAIN_PROMPTS) if not mentions_held_out(p)])
    train = [first] + [parts[k] for k in ("more", "corpus") if k in parts]
    return SeqData.concat(train), parts["val"], parts["held"]


def speech_prefix(recipe: Recipe, split: str) -> str:
    """The shard name of a split's speech: data on the default path (voice-activity window, time tokens,
    some noise) is kept apart from the earlier data without times."""
    return f"speech-ts-{split}" if recipe.timestamps else f"speech-{split}"


def chat_sample(loaded, prompts: list[str], max_tokens: int = 64) -> SeqData:
    """A few greedy answers of a loaded chat model (single-stream reference decoder), with hidden states."""
    from engine.chat.reference import ChatReference, build_messages
    from engine.sampling import SamplingParams

    ref = ChatReference(loaded)
    ids, answers = [], []
    for p in prompts:
        ids.append(ref.prompt_ids(build_messages(p)))
        r = ref.generate(ids[-1], SamplingParams(max_tokens=max_tokens))
        answers.append(list(r.tokens) + ([min(ref.stop_ids)] if r.finish_reason == "stop" else []))
    return _teacher_force_chat(loaded, ids, answers, [""] * len(prompts))


def load_heldout(model: str, data_dir: str | Path | None = None, split: str = "heldout") -> SeqData | None:
    """The held-out (or "val") data of a model made by an earlier ``train-mtp`` run (None when there is none)."""
    recipe, source = recipe_for(model)
    folder = work_dir(source, data_dir)
    if recipe.kind == "chat":
        prefix = {"heldout": "chat-heldout", "val": "chat-val"}[split]
    else:
        prefix = speech_prefix(recipe, split)
    paths = sorted(folder.glob(f"{prefix}-*.safetensors"))
    return SeqData.concat([SeqData.load(p) for p in paths]) if paths else None
