"""Chat families on the batched seam (engine/families/), each on a tiny random-weight model of its
real layout (tests/tiny_models.py): greedy tokens equal transformers ``generate``, alone and at full
width (batched = serial), with drafting (n-gram, and a draft model that is the model itself) and
without; bfloat16 and int8 run and keep batched = serial; rope scaling is exact past the original
context. Other architectures are refused with one sentence, folders and GGUF files alike.
"""

from pathlib import Path

import pytest
import torch
from parity import assert_same_or_near_tie
from tiny_models import ARCHITECTURES, LONG_CONTEXT, VARIANTS, build, prompt

from engine import ChatRequest, Engine
from engine.chat.reference import ChatReference, build_messages
from engine.drafting import DepthPlanner, NgramDrafter, StepCost, build_drafter
from engine.errors import CadenceError, ModelError
from engine.families import decoder_class
from engine.kernels import precisions_on
from engine.loading import load
from engine.sampling import SamplingParams
from engine.scheduler import Lane, Sequence
from engine.seam import StepBatch

MAX_TOKENS = 24
PROMPTS = [prompt(i, words=8 + 3 * i) for i in range(6)]  # of different lengths: ragged batches


class Tiny:
    """One tiny model: its folder, loaded copy, reference decoder and transformers' greedy answers."""

    def __init__(self, folder: Path):
        self.folder, self.name = folder, str(folder)
        self.loaded = load(self.name)
        self.ref = ChatReference(self.loaded)
        self._answers: dict[tuple[str, int], list[int]] = {}

    def ids(self, text: str) -> list[int]:
        return self.ref.prompt_ids(build_messages(text))

    def generate(self, text: str, tokens: int = MAX_TOKENS) -> list[int]:
        """transformers ``generate`` (do_sample=False): the yardstick."""
        if (text, tokens) not in self._answers:
            ids = self.ids(text)
            out = self.loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                             max_new_tokens=tokens, do_sample=False, pad_token_id=3)
            self._answers[text, tokens] = out[0, len(ids):].tolist()
        return self._answers[text, tokens]

    def check(self, text: str, got: list[int], tokens: int = MAX_TOKENS) -> None:
        want = self.generate(text, tokens)
        assert len(want) == tokens  # the end-of-turn token is never chosen: the whole length is compared
        assert_same_or_near_tie(self.ref, self.ids(text), got, want)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made: dict[str, Tiny] = {}

    def get(name: str) -> Tiny:
        if name not in made:
            fields = {**ARCHITECTURES, **VARIANTS, **LONG_CONTEXT}[name]
            made[name] = Tiny(build(tmp_path_factory.mktemp(name), fields))
        return made[name]

    return get


@pytest.fixture(scope="module")
def engine():
    eng = Engine(backend="cpu", batch=4, drafter="off", precision="float32")
    yield eng
    eng.shutdown()


def _ask(engine, model: Tiny, text: str, tokens: int = MAX_TOKENS):
    return engine.submit(ChatRequest(text, model=model.name, params=SamplingParams(max_tokens=tokens)))


def _lane(decoder, drafter=None, depth: int = 3) -> Lane:
    planner = DepthPlanner(StepCost([1, 2, 4], [10.0, 10.0, 10.0]), drafter, depth) if drafter else None
    return Lane(decoder, name="t", drafter=drafter, planner=planner, drafting_state="on" if drafter else "off")


def _run(lane: Lane, model: Tiny, texts: list[str], tokens: int = MAX_TOKENS) -> list[list[int]]:
    seqs = [Sequence(model.ids(t), tokens, model.ref.stop_ids) for t in texts]
    for seq in seqs:
        lane.add(seq)
    lane.run_until_idle()
    return [s.tokens for s in seqs]


# ---------------------------------------------------------------- every family, exact
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_equals_transformers_generate_alone_and_at_full_width(engine, tiny, name):
    model = tiny(name)
    alone = _ask(engine, model, PROMPTS[0]).result(300)
    model.check(PROMPTS[0], alone.tokens)
    handles = [_ask(engine, model, text) for text in PROMPTS]  # 6 answers on 4 slots: joins mid-flight
    for text, handle in zip(PROMPTS, handles):
        model.check(text, handle.result(300).tokens)
    lane = engine.status()["lanes"][model.name]
    assert lane["architecture"] == name and lane["family"] == "chat" and lane["width"] == 4


@pytest.mark.parametrize("name", list(ARCHITECTURES) + list(VARIANTS))
def test_logits_equal_transformers(tiny, name):
    """Logits, not only the best token (soft-capping the logits never changes which is best): a prompt,
    then a few steps, against the model's own forward pass."""
    model = tiny(name)
    decoder = decoder_class(model.loaded)(model.loaded, width=1)
    ids = model.ids(PROMPTS[2])
    answer = model.generate(PROMPTS[2])[:6]
    batch = StepBatch.build([0], [ids], [0])
    ours = [decoder.forward(batch)]
    for i, token in enumerate(answer[:-1]):
        ours.append(decoder.forward(StepBatch.build([0], [[token]], [len(ids) + i])))
    with torch.inference_mode():
        want = model.loaded.model(torch.tensor([ids + answer[:-1]])).logits[0]
    got = torch.cat(ours)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=0, atol=2e-4 * float(want.abs().max())), float((got - want).abs().max())


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_drafting_leaves_the_tokens_unchanged(tiny, name):
    model = tiny(name)
    Decoder = decoder_class(model.loaded)
    ngram = NgramDrafter(min_n=1)  # down to single tokens: random weights repeat few longer n-grams
    drafted = {}
    lane = _lane(Decoder(model.loaded, width=4), ngram)
    for text, got in zip(PROMPTS, _run(lane, model, PROMPTS)):
        model.check(text, got)
    drafted["ngram"] = lane.draft_counts.drafted
    # a draft model that is the model itself, built as the engine builds one (its family picked the same way)
    decoder = Decoder(model.loaded, width=4)
    itself, state = build_drafter(f"draft:{model.name}", model.name, model.loaded, decoder, "cpu", 4)
    assert state == "on" and itself.decoder.architecture == name
    lane = _lane(decoder, itself, depth=2)
    for text, got in zip(PROMPTS, _run(lane, model, PROMPTS)):
        model.check(text, got)
    drafted["itself"] = lane.draft_counts.drafted
    assert drafted["ngram"] > 0 and drafted["itself"] > 0, drafted
    assert lane.draft_counts.accepted >= 0.9 * lane.draft_counts.drafted  # the model agrees with itself


REDUCED = precisions_on("cpu")[1:]  # what this processor offers beyond float32 (int8 at least)


@pytest.mark.parametrize("i, name", list(enumerate(ARCHITECTURES)))
def test_reduced_precisions_run_and_keep_batched_equal_to_serial(tiny, i, name):
    """Each family in one reduced precision, taking turns (bfloat16, int8, ...), so that every
    precision this processor offers runs several families' layers, at half the cost of all pairs."""
    precision = REDUCED[i % len(REDUCED)]
    model = tiny(name)
    Decoder = decoder_class(model.loaded)
    texts = PROMPTS[:5]
    serial = [_run(_lane(Decoder(model.loaded, width=1, precision=precision)), model, [t])[0] for t in texts]
    batched = _run(_lane(Decoder(model.loaded, width=4, precision=precision)), model, texts)
    assert batched == serial
    assert all(len(tokens) == MAX_TOKENS for tokens in batched)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_int8s_fused_layer_ops_compute_what_pytorchs_ops_do(tiny, name):
    """int8 on the native kernel runs its residual adds, norms and rotary in C (engine/native/
    layer_ops.c): the logits of a ragged prefill and a decode step are PyTorch's, to float rounding,
    in every family's layout (q/k norms, Gemma's extra norms, a partly rotated head)."""
    model = tiny(name)
    decoder = decoder_class(model.loaded)(model.loaded, width=3, precision="int8")
    assert decoder._fused_ops  # tiny layers fit the native kernel, which make setup builds
    ids = [model.ids(text) for text in PROMPTS[:3]]
    steps = [StepBatch.build([0, 1, 2], ids, [0, 0, 0]),
             StepBatch.build([0, 2], [[5], [7]], [len(ids[0]), len(ids[2])])]
    for batch in steps:
        got = {}
        for fused in (True, False):
            decoder._fused_ops = fused
            got[fused] = decoder.forward(batch)
        assert torch.allclose(got[True], got[False], rtol=1e-4, atol=1e-4), (got[True] - got[False]).abs().max()
        decoder._fused_ops = True  # the decode step reads the cache the fused prefill wrote


# ---------------------------------------------------------------- rope scaling, long context
@pytest.mark.parametrize("name, limit", [("llama3-rope", 256), ("qwen2-yarn", 192), ("phi4-mini-longrope", 256)])
def test_rope_scaling_is_exact_past_the_original_context(engine, tiny, name, limit):
    """Llama 3 scaling (original 32), YaRN by 4 (original 48, so 192 positions) and longrope with a
    partly rotated head (original 48): answers run to ~130 positions, against transformers. (The prompts
    fit the original context: transformers prefills a longer one with longrope's long factors throughout.)"""
    model = tiny(name)
    tokens = 110
    texts = [prompt(10 + i, words=8) for i in range(3)]
    handles = [_ask(engine, model, text, tokens) for text in texts]
    for text, handle in zip(texts, handles):
        got = handle.result(300).tokens
        assert len(model.ids(text)) < 48 and len(model.ids(text)) + len(got) > 120
        model.check(text, got, tokens)
    lane = engine.status()["lanes"][model.name]
    assert lane["context_limit"] == limit and lane["context"] == limit and lane["context_from"] == "the model"


def test_slot_length_comes_from_the_model_bounded_by_memory(tiny, monkeypatch):
    from engine import calibration
    from engine.seam import MIN_SLOT_LENGTH

    model = tiny("llama")  # Llama 3.2's layout: 131072 positions
    decoder = decoder_class(model.loaded)(model.loaded, width=1)
    assert decoder.context_limit == 131072
    per_position = decoder.slot_bytes_at(128) - decoder.slot_bytes_at(64)
    per_position //= 64
    room = 64 * 1024 * per_position  # memory for 64 Ki positions in the lane's share
    monkeypatch.setattr(calibration, "device_memory", lambda device, free=False: int(room / calibration.MEMORY_SHARE))
    assert calibration.slot_length(decoder, 1) == (65536, calibration.slot_length(decoder, 1)[1])
    assert calibration.slot_length(decoder, 1)[1].startswith("memory: 1 slots")
    assert calibration.slot_length(decoder, 4)[0] == 16384  # four slots share it
    assert calibration.slot_length(decoder, 256)[0] == MIN_SLOT_LENGTH  # never below
    assert calibration.slot_length(decoder, 4, asked=3000) == (3000, "asked")
    monkeypatch.setattr(calibration, "device_memory", lambda device, free=False: 10 * 2**40)
    assert calibration.slot_length(decoder, 8) == (131072, "the model")
    assert calibration.slot_length(decoder, 8, asked=10**6) == (131072, "the model")


def test_a_lane_takes_its_share_of_the_memory_still_free_not_of_the_whole_machine():
    """Lanes made one after another (and engines in other processes) share what is free, so they never
    promise more than the machine has: on Linux the CPU's free figure is MemAvailable, below the total, and
    the whole memory (which the cached calibration's widths are bounded by) is the total."""
    import os

    from engine.calibration import device_memory

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < device_memory("cpu", free=True) < total == device_memory("cpu")


def test_an_asked_context_bounds_the_slot_and_the_cache_grows_with_use(tiny):
    model = tiny("qwen3")
    eng = Engine(backend="cpu", batch=2, drafter="off", precision="float32", context=600)
    try:
        first = _ask(eng, model, PROMPTS[1]).result(300)
        lane = eng.status()["lanes"][model.name]
        assert (lane["context"], lane["context_limit"], lane["context_from"]) == (600, 40960, "asked")
        small = lane["cache_bytes"]
        long_text = next(t for t in (prompt(3, words=n) for n in range(150, 400, 5)) if len(model.ids(t)) > 520)
        got = _ask(eng, model, long_text, tokens=40).result(300)  # past the first 512 positions held
        model.check(long_text, got.tokens, 40)
        assert eng.status()["lanes"][model.name]["cache_bytes"] > small  # grown with the history
        with pytest.raises(CadenceError, match="more than the 600 a slot holds"):
            eng.submit(ChatRequest("x", model=model.name, prompt_ids=model.ids(prompt(4, words=700)))).result(60)
        model.check(PROMPTS[1], first.tokens)
    finally:
        eng.shutdown()


# ---------------------------------------------------------------- refusals
def _gpt2_folder(folder: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel
    from tiny_models import save_tokenizer

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512)).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def test_other_architectures_are_refused_with_the_supported_list(tmp_path, engine):
    from engine.models import resolve

    gpt2 = _gpt2_folder(tmp_path / "gpt2")
    with pytest.raises(ModelError) as refused:
        resolve(str(gpt2))
    sentence = str(refused.value)
    assert "'gpt2' (GPT2LMHeadModel)" in sentence and "cannot run" in sentence
    for name in ARCHITECTURES:
        assert name in sentence
    assert "llama (Llama 3.x, SmolLM2)" in sentence and sentence.endswith("Whisper.") and "\n" not in sentence
    with pytest.raises(CadenceError, match="'gpt2'"):
        engine.submit(ChatRequest("hello", model=str(gpt2))).result(60)
    assert str(gpt2) not in engine.status()["lanes"]

    import json

    config = json.loads((gpt2 / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForSequenceClassification"])
    (gpt2 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="Qwen2ForSequenceClassification.*without a language-model head"):
        resolve(str(gpt2))


def test_a_gguf_of_another_architecture_is_refused_before_converting(tmp_path):
    import gguf

    from engine.loading import converted_dir, gguf_architecture
    from engine.models import resolve

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_uint32("gpt2.context_length", 64)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_architecture(path) == "gpt2"
    with pytest.raises(ModelError) as refused:
        load(str(path))
    assert str(refused.value).startswith("tiny-gpt2.gguf is a GGUF of the 'gpt2' architecture, which Cadence cannot run")
    assert "llama, qwen2, qwen3, gemma3, gemma2, phi3" in str(refused.value)
    assert not converted_dir(resolve(str(path))).exists()  # nothing was converted
    assert gguf_architecture(resolve("smollm2-135m-instruct").weights[0]) == "llama"


def test_models_listing_names_the_supported_architectures(capsys):
    import argparse
    import json

    from app.cli import cmd_models

    assert cmd_models(argparse.Namespace(json=True)) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    chat, whisper = rows["smollm2-135m-instruct"], rows["whisper-tiny.en"]
    assert {"name", "family", "format", "source", "description", "available", "detail", "default"} <= set(chat)
    assert chat["architecture"] == "llama" and set(chat["supported_architectures"]) == set(ARCHITECTURES)
    assert whisper["architecture"] == "whisper" and whisper["supported_architectures"] == ["whisper"]
    assert cmd_models(argparse.Namespace(json=False)) == 0
    assert "qwen3 (Qwen3)" in capsys.readouterr().out
