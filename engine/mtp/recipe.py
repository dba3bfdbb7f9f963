"""How an MTP head is trained: one recipe per model (the built-in models' are what shipped)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.errors import CadenceError

DEPTH = 4  # chain steps trained jointly and measured


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
    timestamps: bool = False  # whisper: the default path's data (a voice-activity window, time tokens)
    noisy: float = 0.0  # whisper: share of clips with noise mixed in by sox (10-30 dB below the speech)
    eval_every: int = 250
    checkpoint_every: int = 100
    dropout: float = 0.0  # on the MLP's inner activations, training only
    noise: float = 0.0  # gaussian noise on the model's hidden state, relative to its RMS, training only
    soft: float = 0.0  # chain heads: weight of cross-entropy to the model's own distribution (1 - soft: its greedy token)
    regress: float = 0.0  # chain heads: weight of smooth-L1 regression of the head's features onto the model's next state
    bf16: bool | None = None  # bfloat16 autocast for training matmuls; None: where the CPU supports it natively
    design: str = "chain"  # "chain": an MLP on the last pair; "context": attention over past pairs (chat)
    corpus_passages: int = 0  # context heads: teacher-forced corpus passages added to the model's own answers
    more_prompts: bool = True  # chat: also the second batch of training prompts (engine.mtp.prompts)
    corpus_prompts: int = 0  # chat: also the model's answers to this many prompts made from corpus passages
    answer_precision: str = "auto"  # chat: the engine precision that answers the corpus prompts

    def to_json(self) -> dict:
        return asdict(self)


RECIPES = {
    "smollm2-135m-instruct": Recipe("chat", steps=3000, draft_vocab=6144, ffn_mult=1.0, corpus_prompts=21 * 128,
                                    soft=0.5, regress=1.0),
    # Whisper: draft_vocab counts text tokens; with timestamps every time token is drafted as well
    "whisper-tiny.en": Recipe("whisper", steps=2000, draft_vocab=4096, ffn_mult=2.0, train_clips=768, heldout_clips=64,
                              soft=0.5, regress=1.0, timestamps=True, noisy=0.5),
    "whisper-base": Recipe("whisper", steps=2000, draft_vocab=4096, ffn_mult=1.5, train_clips=384, heldout_clips=64,
                           soft=0.5, regress=1.0, timestamps=True, noisy=0.5),
}
# `--design context` (chat models): an attention head on the model's answers to the first prompt batch and to
# 2688 prompts made from corpus passages (docs/MTP.md, "Context heads"); the draft vocabulary stays the recipe's.
CONTEXT = dict(steps=600, batch=12 * 128, lr=1e-3, warmup=100, ffn_mult=8 / 3, noise=0.05, design="context",
               corpus_prompts=21 * 128, more_prompts=False)
DESIGNS = ("chain", "context")


def recipe_for(model: str, design: str | None = None) -> tuple[Recipe, object]:
    """The recipe and resolved source of a model (``design``: "context" for a context head, else the
    model's own); ModelError (one sentence) for a model that is unknown, CadenceError for a design
    that does not apply."""
    from engine.models import CHAT, resolve

    source = resolve(model)
    recipe = RECIPES.get(source.name) or Recipe("chat" if source.family == CHAT else "whisper")
    recipe = Recipe(**recipe.to_json())
    if design not in (None, *DESIGNS):
        raise CadenceError(f"Unknown head design '{design}' (use {' or '.join(DESIGNS)}).")
    if design == "context":
        if recipe.kind != "chat":
            raise CadenceError(f"Context heads are for chat models; {source.name} takes the chain design.")
        recipe = Recipe(**{**recipe.to_json(), **CONTEXT})
    return recipe, source
