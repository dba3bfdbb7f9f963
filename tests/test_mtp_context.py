"""Context draft heads (engine/mtp/context_head.py): drafting from per-sequence caches equals the
windowed training path, the file keeps the design, training learns a rule only context can see and
is seeded and resumable, and the corpus passages keep their held-out split."""

from __future__ import annotations

import torch

from engine.mtp.context_head import ContextHead, HeadCache
from engine.mtp.context_training import train_context_head
from engine.mtp.data import SeqData
from engine.mtp.head import MTPHead, read_head
from engine.mtp.recipe import Recipe
from engine.mtp.replay import calibrate, measure
from engine.mtp.training import load_checkpoint, save_checkpoint, train_head

D, V = 64, 300
VOCAB = torch.arange(0, V, 3)  # a draft vocabulary of 100 ids


def _matrices(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)


def _head(seed: int = 0) -> ContextHead:
    torch.manual_seed(seed)
    embed, lm_head = _matrices()
    return ContextHead("toy-model", D, V, VOCAB, ffn=96).bind(embed, lm_head)


def _two_back_data(n_seqs: int = 16, length: int = 48, seed: int = 0) -> SeqData:
    """Sequences where each token repeats the token two before it (x[i+1] = x[i-1]), and each
    hidden state carries only its own token (the output matrix's row, so it is also the greedy token
    there): the last pair alone cannot tell the next token."""
    g = torch.Generator().manual_seed(seed)
    _, lm_head = _matrices()
    tokens = []
    for _ in range(n_seqs):
        seq = [int(VOCAB[i]) for i in torch.randint(len(VOCAB), (2,), generator=g)]
        while len(seq) < length:
            seq.append(seq[-2])
        tokens += seq
    x = torch.tensor(tokens)
    hidden = 0.5 * lm_head[x] + 0.05 * torch.randn(len(tokens), D, generator=g)
    assert torch.equal((hidden @ lm_head.T).argmax(-1), x)
    return SeqData(hidden, x, x.clone(), torch.full((n_seqs,), length))


def _recipe(**kw) -> Recipe:
    settings = dict(batch=4 * 128, lr=3e-3, warmup=5, eval_every=10_000, checkpoint_every=10_000, noise=0.0,
                    design="context")
    return Recipe("chat", **{**settings, **kw})


def test_drafts_from_caches_equal_the_windowed_training_path():
    head = _head().eval()
    g = torch.Generator().manual_seed(3)
    T = 11
    hidden, tokens = torch.randn(2, T, D, generator=g), torch.randint(0, V, (2, T), generator=g)
    caches = [HeadCache(), HeadCache()]
    for b in range(2):  # the pairs arrive over two steps, as a sequence's accepted tokens do
        caches[b].add(hidden[b, :6], tokens[b, :6].tolist())
    early, _ = head.draft_cached(caches, 1)
    for b in range(2):
        caches[b].add(hidden[b, 6:], tokens[b, 6:].tolist())
    drafts, probs = head.draft_cached(caches, 3)
    assert drafts.shape == (2, 3) and bool(torch.isin(drafts, VOCAB).all()) and bool(((probs > 0) & (probs <= 1)).all())
    with torch.no_grad():
        chain = [drafts[:, j : j + 1].expand(2, T) for j in range(2)]  # each chain step fed the previous draft
        us = head.forward_window(hidden, tokens, 3, chain)
    window = torch.stack([head.vocab_ids[head.logits(u[:, T - 1]).argmax(-1)] for u in us], 1)
    assert torch.equal(window, drafts)
    assert torch.equal(head.vocab_ids[head.logits(us[0][:, 5]).argmax(-1)], early[:, 0])
    # one sequence alone drafts what it drafted beside the other
    alone = HeadCache()
    alone.add(hidden[1], tokens[1].tolist())
    assert torch.equal(head.draft_cached([alone], 3)[0][0], drafts[1])


def test_file_keeps_the_design_and_drafts(tmp_path):
    head = _head()
    head.temperature.fill_(1.3)
    back = read_head(head.save(tmp_path / "c.safetensors", dtype=torch.float32))
    assert isinstance(back, ContextHead) and back.config()["design"].startswith("context")
    assert back.ffn == 96 and abs(float(back.temperature) - 1.3) < 1e-6
    for name, p in head.named_parameters():
        assert torch.equal(p, getattr(back, name)), name
    back.bind(*_matrices())
    hidden, tokens = torch.randn(5, D), torch.randint(0, V, (5,)).tolist()
    caches = [HeadCache(), HeadCache()]
    for c in caches:
        c.add(hidden, tokens)
    assert torch.equal(head.eval().draft_cached(caches[:1], 3)[0], back.draft_cached(caches[1:], 3)[0])


def test_a_context_head_learns_what_the_last_pair_cannot_tell(tmp_path):
    # many short sequences, so that copying generalises and memorising pairs does not
    data, held = _two_back_data(n_seqs=300, length=12), _two_back_data(n_seqs=6, seed=1)
    embed, lm_head = _matrices()
    head = train_context_head(_head(), data, _recipe(), 0, 300)
    chain = train_head(None, data, None, Recipe("chat", batch=256, lr=3e-3, warmup=5, eval_every=10_000,
                                                checkpoint_every=10_000, bf16=False), 0, 300, None,
                       embed=embed, lm_head=lm_head, model="toy-model", vocab_ids=VOCAB)
    context_rate, chain_rate = measure(head, held, 1)["rate"], measure(chain, held, 1)["rate"]
    assert context_rate > 0.5 and chain_rate < 0.1, (context_rate, chain_rate)
    temperature, info = calibrate(head, held)
    assert 0.5 <= temperature <= 3.5 and info["brier"] <= info["brier_at_1"]


def test_training_is_seeded_and_resumes_from_its_checkpoint(tmp_path):
    data = _two_back_data()
    whole = train_context_head(_head(), data, _recipe(), 0, 8)
    again = train_context_head(_head(), data, _recipe(), 0, 8)
    saved = []
    train_context_head(_head(), data, _recipe(checkpoint_every=2), 0, 8, stop_after=4,
                       checkpoint=lambda h, o, s: saved.append(s) or save_checkpoint(tmp_path, h, o, s, {}))
    head, opt, start, _ = load_checkpoint(tmp_path, _recipe())
    assert saved == [2, 4] and start == 4 and isinstance(head, ContextHead) and not isinstance(head, MTPHead)
    embed, lm_head = _matrices()
    resumed = train_context_head(head.bind(embed, lm_head), data, _recipe(), 0, 8, start, opt)
    for name, p in whole.named_parameters():
        assert torch.equal(p, getattr(again, name)), name
        assert torch.equal(p, getattr(resumed, name)), name


def test_corpus_splits_are_fixed_by_title():
    from engine.mtp.corpus import Passage

    a = Passage("dictionary", "glacier", "a large body of ice")
    assert a.held_out == Passage("dictionary", "glacier", "other text").held_out  # the title decides
    titles = [Passage("dictionary", f"word{i}", "") for i in range(2000)]
    share = sum(p.held_out for p in titles) / len(titles)
    assert 0.01 < share < 0.04


def test_corpus_prompts_are_fixed_by_the_seed_and_never_name_a_held_out_or_validation_topic(monkeypatch):
    from engine.mtp import corpus

    words = [f"word{i}" for i in range(20)] + ["glaciers", "lighthouses"]  # a held-out and a validation topic
    made = [corpus.Passage("dictionary", w, "a meaning") for w in words]
    made.append(corpus.Passage("python-source", "double in tools", "def double(x):\n    return 2 * x"))
    monkeypatch.setattr(corpus, "passages", lambda held_out=False: list(made))
    prompts = corpus.corpus_prompts(0)
    assert prompts == corpus.corpus_prompts(0) and prompts != corpus.corpus_prompts(1)
    assert not any("glacier" in p.lower() or "lighthouse" in p.lower() for p in prompts)
    assert len(prompts) >= 15 and any("def double(x)" in p for p in prompts)
    assert corpus.corpus_prompts(0, 3) == prompts[:3]


def test_a_long_sequence_keeps_its_newest_window_of_pairs():
    from engine.mtp.context_head import WINDOW

    head = _head(seed=2).eval()
    g = torch.Generator().manual_seed(4)
    n = 2 * WINDOW + 90
    hidden, tokens = torch.randn(n, D, generator=g), torch.randint(0, V, (n,), generator=g)
    cache = HeadCache()
    for a in range(0, n, 37):  # pairs arrive a few at a time; the buffer moves its oldest out now and then
        cache.add(hidden[a : a + 37], tokens[a : a + 37].tolist())
        head.draft_cached([cache], 2)
    assert cache.next_position == n and cache.length <= 2 * WINDOW
    cache.add(hidden[-1:], tokens[-1:].tolist())  # the newest pair again, drafted from now
    drafts, probs = head.draft_cached([cache], 1)
    with torch.no_grad():  # the same newest WINDOW pairs from position 0: rotary positions are relative
        last = torch.cat([hidden[-(WINDOW - 1):], hidden[-1:]])[None], torch.cat([tokens[-(WINDOW - 1):], tokens[-1:]])[None]
        p = torch.softmax(head.logits(head.forward_window(*last)[0][0, -1]), -1)
    assert int(head.vocab_ids[p.argmax()]) == int(drafts[0, 0])
    assert abs(float(p.max()) - float(probs[0, 0])) < 1e-4


def test_a_sequence_that_does_not_draft_for_long_holds_one_window_of_pairs():
    from engine.mtp.context_head import WINDOW

    head = _head(seed=5).eval()
    g = torch.Generator().manual_seed(6)
    n = WINDOW + 300
    hidden, tokens = torch.randn(n, D, generator=g), torch.randint(0, V, (n,), generator=g)
    quiet, busy = HeadCache(), HeadCache()
    busy.add(hidden[:40], tokens[:40].tolist())
    head.draft_cached([busy], 1)
    quiet.add(hidden[:40], tokens[:40].tolist())
    for a in range(40, n, 20):  # one drafts every few pairs, the other never until the end
        quiet.add(hidden[a : a + 20], tokens[a : a + 20].tolist())
        busy.add(hidden[a : a + 20], tokens[a : a + 20].tolist())
        head.draft_cached([busy], 1)
    assert len(quiet.pending_x) == WINDOW and quiet.next_position == n - WINDOW
    busy.add(hidden[-1:], tokens[-1:].tolist())
    quiet.add(hidden[-1:], tokens[-1:].tolist())
    (a, pa), (b, pb) = head.draft_cached([busy], 2), head.draft_cached([quiet], 2)
    assert torch.equal(a, b) and torch.allclose(pa, pb, atol=1e-4)  # both see the newest WINDOW pairs


def test_the_context_design_is_for_chat_models_and_named_in_one_sentence():
    import pytest

    from engine.errors import CadenceError
    from engine.mtp.recipe import recipe_for

    recipe, _ = recipe_for("smollm2-135m-instruct", "context")
    assert recipe.design == "context" and recipe.corpus_prompts > 0
    assert recipe_for("smollm2-135m-instruct")[0].design == "chain"  # what shipped
    for model, design, words in (("whisper-tiny.en", "context", "chat models"), ("smollm2-135m-instruct", "tree", "Unknown")):
        with pytest.raises(CadenceError) as err:
            recipe_for(model, design)
        assert words in str(err.value) and "\n" not in str(err.value)


def test_resuming_a_checkpoint_of_the_other_design_is_refused_in_one_sentence(tmp_path):
    import pytest

    from engine.errors import CadenceError
    from engine.mtp.training import resume_from

    data = _two_back_data(n_seqs=4)
    train_context_head(_head(), data, _recipe(checkpoint_every=2), 0, 2,
                       checkpoint=lambda h, o, s: save_checkpoint(tmp_path, h, o, s, {}))
    assert resume_from(tmp_path, _recipe())[2] == 2
    with pytest.raises(CadenceError) as err:
        resume_from(tmp_path, Recipe("chat"))  # a chain run in the same work folder
    assert "context head" in str(err.value) and "--design context" in str(err.value) and "\n" not in str(err.value)


def test_greedy_answers_with_a_context_head_equal_the_reference_alone_and_at_full_width(tmp_path, monkeypatch,
                                                                                       chat_ref):
    """The engine drafting with a context head (per-sequence caches fed after every step) gives the
    reference decoder's greedy tokens, for one request alone and for four at once."""
    import engine.mtp.head as heads
    from engine import Engine
    from engine.api import ChatRequest
    from engine.chat.reference import build_messages
    from engine.sampling import SamplingParams

    torch.manual_seed(0)  # an untrained head drafts nearly always wrong: every draft is verified away
    path = ContextHead("smollm2-135m-instruct", 576, 49152, torch.arange(0, 49152, 8), 256).save(tmp_path / "c.safetensors")
    monkeypatch.setattr(heads, "head_path", lambda model: path)
    prompts = ["Name three colors.", "Explain rain in one sentence.", "Say hello in French.", "Count to five."]
    params = SamplingParams(max_tokens=24)
    expected = [list(chat_ref.generate(chat_ref.prompt_ids(build_messages(p)), params).tokens) for p in prompts]
    eng = Engine(backend="cpu", batch=4, drafter="mtp", draft_depth=3)
    try:
        alone = eng.submit(ChatRequest(prompt=prompts[0], params=params)).result(600)
        together = [h.result(600) for h in [eng.submit(ChatRequest(prompt=p, params=params)) for p in prompts]]
    finally:
        eng.shutdown()
    assert list(alone.tokens) == expected[0]
    assert [list(r.tokens) for r in together] == expected
    assert sum(r.stats["drafting"]["drafted"] for r in together) > 0  # the head did draft
