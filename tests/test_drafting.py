"""Drafting: greedy output equal to no drafting, sampled output distributed as without it.

Every drafter (n-gram lookup, a draft model, the shipped MTP heads) is checked token for token
against the single-stream reference, alone and at full width, for chat and Whisper; the exact
sampling rule is checked statistically on real model logits (and a broken rule must fail that
check); a drafter that is always wrong or that fails only costs speed.
"""

import json

import pytest
import torch
from parity import assert_same_or_near_tie

from engine.chat.reference import build_messages
from engine.api import parse_drafter
from engine.drafting import (
    DepthPlanner,
    Drafter,
    NgramDrafter,
    StepCost,
)
from engine import ChatRequest, Engine, TranscribeRequest
from engine.errors import CadenceError
from engine.families.llama import LlamaBatched
from engine.picking import check_draft, filtered_probs
from engine.sampling import SamplingParams
from engine.scheduler import Lane, Sequence
from engine.whisper.pipeline import transcribe_file
from engine.whisper.reference import WhisperReference

# Prompts whose answers quote or repeat their prompt (lookup drafts well) and ones that don't.
PROMPTS = [
    "Repeat this sentence exactly: The quarterly report shows that revenue grew by twelve percent.",
    "Copy this list as it is: apples, pears, plums, cherries, grapes, lemons, limes.",
    "List the numbers from one to twelve, one per line.",
    "Write a short list of five fruits, each with one sentence about it.",
    "What is the capital of France?",
    "Explain in two sentences why the sea is salty.",
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def reference_answers(chat_ref):
    out = {}
    for p in PROMPTS:
        ids = chat_ref.prompt_ids(build_messages(p))
        out[p] = (ids, chat_ref.generate(ids, SamplingParams(max_tokens=MAX_TOKENS)).tokens)
    return out


@pytest.fixture(scope="module", params=["ngram", "draft:smollm2-135m-instruct", "mtp", "auto"])
def drafting_engine(request):
    if request.param in ("mtp", "auto"):  # auto: lookup where it matches, else the shipped head
        from engine.mtp.head import head_path

        assert head_path("smollm2-135m-instruct").exists(), "the shipped MTP head for smollm2 is missing"
    # The depth is fixed: the planner follows step timings, and on a busy machine it may rightly decide
    # drafting does not pay and draft nothing (a fresh clone beside another suite did), leaving nothing to
    # check here. (A draft model as large as the model costs a step per draft, so its depth is 2.)
    depth = 2 if request.param.startswith("draft:") else 3
    eng = Engine(backend="cpu", batch=4, drafter=request.param, draft_depth=depth)
    yield eng
    eng.shutdown()


def _reference(reference_answers, prompt, max_tokens):
    """The reference's greedy answer to ``prompt`` in at most ``max_tokens`` (<= MAX_TOKENS) tokens: the first
    tokens of the module's answer, since greedy decoding picks each token from what precedes it alone (and a
    stop token ends both the same)."""
    assert max_tokens <= MAX_TOKENS
    ids, want = reference_answers[prompt]
    return ids, want[:max_tokens]


def _ask(engine, prompt, params=None):
    return engine.submit(ChatRequest(prompt, params=params or SamplingParams(max_tokens=MAX_TOKENS)))


def test_greedy_chat_with_drafting_equals_the_reference_alone_and_at_full_width(drafting_engine, chat_ref,
                                                                                 reference_answers):
    alone = _ask(drafting_engine, PROMPTS[0]).result(300)
    ids, want = reference_answers[PROMPTS[0]]
    assert_same_or_near_tie(chat_ref, ids, alone.tokens, want)
    handles = [_ask(drafting_engine, p) for p in PROMPTS]  # 6 requests on 4 slots: joins mid-flight
    drafted = 0
    for p, h in zip(PROMPTS, handles):
        got = h.result(300)
        ids, want = reference_answers[p]
        assert_same_or_near_tie(chat_ref, ids, got.tokens, want)
        drafted += got.stats["drafting"]["drafted"]
    lane = drafting_engine.status()["lanes"]["smollm2-135m-instruct"]
    assert lane["drafting"]["state"] == "on"
    assert drafted > 0 and lane["drafting"]["accepted"] > 0  # drafting really happened, and paid


def test_a_draft_model_identical_to_the_model_is_almost_always_accepted(chat_ref, reference_answers):
    eng = Engine(backend="cpu", batch="off", drafter="draft:smollm2-135m-instruct", draft_depth=4)
    try:
        got = _ask(eng, PROMPTS[3]).result(300)
    finally:
        eng.shutdown()
    ids, want = reference_answers[PROMPTS[3]]
    assert_same_or_near_tie(chat_ref, ids, got.tokens, want)
    stats = got.stats["drafting"]
    assert stats["acceptance"] >= 0.95, stats  # the same model agrees with itself (near-ties aside)
    assert stats["mean_acceptance_length"] >= 4.0, stats  # depth 4: almost 5 tokens per step


def test_greedy_whisper_with_drafting_equals_the_reference(tiny, speech):
    ref = WhisperReference(tiny)
    jobs = [("long", False), ("fox", False), ("report", False), ("long", True)]  # True: with time tokens
    wanted = [[s.tokens for s in transcribe_file(ref, speech[n], timestamps=t).segments] for n, t in jobs]
    for drafter, batch in (("ngram", 4), ("mtp", "off"), ("mtp", 4)):
        eng = Engine(backend="cpu", batch=batch, drafter=drafter, draft_depth=3)  # (depth fixed: see drafting_engine)
        try:
            handles = [eng.submit(TranscribeRequest(speech[n], model="whisper-tiny.en", timestamps=t)) for n, t in jobs]
            for (name, timed), handle, want in zip(jobs, handles, wanted):
                got = handle.result(600)
                assert [s.tokens for s in got.segments] == want, (drafter, batch, name)
            lane = eng.status()["lanes"]["whisper-tiny.en"]["drafting"]
            assert lane["state"] == "on", lane
            assert lane["drafted"] > 0, (drafter, lane)  # (the heads' own quality is tests/test_mtp.py's)
        finally:
            eng.shutdown()


def test_seeded_sampling_gives_the_same_answer_with_and_without_drafting():
    """One draw per emitted token from the sequence's own generator, drafts or not (see check_draft)."""
    params = [SamplingParams(temperature=0.7, seed=s, max_tokens=40, top_p=0.95) for s in range(4)]
    results = {}
    for drafter in ("off", "draft:smollm2-135m-instruct"):
        eng = Engine(backend="cpu", batch=4, drafter=drafter, draft_depth=3)
        try:
            handles = [eng.submit(ChatRequest(PROMPTS[i % 2], params=p)) for i, p in enumerate(params)]
            results[drafter] = [h.result(300) for h in handles]
        finally:
            eng.shutdown()
    off, on = results["off"], results["draft:smollm2-135m-instruct"]
    assert [r.tokens for r in on] == [r.tokens for r in off]
    stats = [r.stats["drafting"] for r in on]
    assert sum(s["drafted"] for s in stats) > 0 and sum(s["accepted"] for s in stats) > 0
    assert sum(s["drafted"] - s["accepted"] for s in stats) > 0  # some drafts were rejected by a sample


# ------------------------------------------------------------------------- the sampling rule
def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against ``probs`` (bins with expected < 5 pooled)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _accept_if_likely(logits, draft, params, generator, draft_probs=None):
    """A broken rule: keep the draft whenever the model gives it some chance."""
    p = filtered_probs(logits, params)
    if p[draft] > 0.01:
        return draft, True
    return int(torch.multinomial(p, 1, generator=generator)), False


def _no_residual(logits, draft, params, generator, draft_probs):
    """A broken rule: the right acceptance test, but a rejection draws from p instead of the residual."""
    p = filtered_probs(logits, params)
    q = draft_probs
    if float(torch.rand((), generator=generator)) < min(1.0, float(p[draft] / q[draft])):
        return draft, True
    return int(torch.multinomial(p, 1, generator=generator)), False


@pytest.fixture(scope="module")
def real_logits(chat_ref):
    """The model's 512 likeliest logits after a real prompt (the rule's behaviour depends on the
    distribution, not on the vocabulary's size; a short vector keeps 20,000 trials quick)."""
    ids = chat_ref.prompt_ids(build_messages("Name a colour."))
    with torch.inference_mode():
        logits = chat_ref.model(torch.tensor([ids])).logits[0, -1].float()
    return torch.sort(logits, descending=True).values[:512].clone()


def _sample_rule(rule, logits, params, draft, draft_probs, n=4000):
    """Emitted-token counts over n trials. A deterministic drafter always proposes ``draft``; a
    stochastic one (``draft_probs`` given) draws its proposal from that distribution each time."""
    g, drafter_g = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
    counts = torch.zeros(logits.numel())
    for _ in range(n):
        if draft_probs is not None:
            draft = int(torch.multinomial(draft_probs, 1, generator=drafter_g))
        token, _kept = rule(logits, draft, params, g, draft_probs)
        counts[token] += 1
    return counts


def test_speculative_sampling_keeps_the_models_distribution_and_a_broken_rule_fails(real_logits):
    params = SamplingParams(temperature=0.7, top_k=40)
    p = filtered_probs(real_logits, params)
    order = torch.argsort(p, descending=True)
    likely, unlikely = int(order[0]), int(order[5])
    # The drafter's distribution: flatter than the model's, so rejections and residuals both matter.
    q = filtered_probs(real_logits, SamplingParams(temperature=2.0, top_k=40))
    cases = [(likely, None), (unlikely, None), (None, q)]
    for draft, draft_probs in cases:
        counts = _sample_rule(check_draft, real_logits, params, draft, draft_probs)
        assert _chi_square_p(counts, p) > 1e-3, (draft, draft_probs is not None)
    # The test has teeth: wrong rules are caught.
    broken = _sample_rule(_accept_if_likely, real_logits, params, int(order[2]), None)
    assert _chi_square_p(broken, p) < 1e-6
    broken = _sample_rule(_no_residual, real_logits, params, None, q)
    assert _chi_square_p(broken, p) < 1e-6


# ------------------------------------------------------------------------- failure and waste
class _WrongDrafter(Drafter):
    """Proposes random tokens: almost never right."""

    name = "wrong"

    def __init__(self):
        self.g = torch.Generator().manual_seed(0)

    def propose(self, seqs, depths):
        return [torch.randint(1000, 40000, (d,), generator=self.g).tolist() for d in depths]


class _BrokenDrafter(Drafter):
    name = "broken"

    def __init__(self):
        self.calls = 0

    def propose(self, seqs, depths):
        self.calls += 1
        if self.calls > 2:
            raise RuntimeError("the draft head's file was damaged")
        return [[] for _ in seqs]


def _run_lane(smollm, chat_ref, drafter, prompts, depth=3):
    decoder = LlamaBatched(smollm, width=4)
    cost = StepCost([1, 2, 4], [10.0, 10.0, 10.0])
    lane = Lane(decoder, name="t", drafter=drafter, planner=DepthPlanner(cost, drafter, depth), drafting_state="on")
    seqs = []
    for p in prompts:
        ids = chat_ref.prompt_ids(build_messages(p))
        seq = Sequence(ids, 32, chat_ref.stop_ids)
        lane.add(seq)
        seqs.append((ids, seq))
    lane.run_until_idle()
    return lane, seqs


def test_an_always_wrong_drafter_costs_speed_never_correctness(smollm, chat_ref, reference_answers):
    lane, seqs = _run_lane(smollm, chat_ref, _WrongDrafter(), PROMPTS[2:6])
    for p, (ids, seq) in zip(PROMPTS[2:6], seqs):
        ref_ids, want = _reference(reference_answers, p, 32)
        assert ref_ids == ids
        assert_same_or_near_tie(chat_ref, ids, seq.tokens, want)
    assert lane.draft_counts.drafted > 50
    assert lane.draft_counts.accepted <= 2


def test_a_failing_drafter_turns_drafting_off_and_the_lane_keeps_serving(smollm, chat_ref, reference_answers):
    lane, seqs = _run_lane(smollm, chat_ref, _BrokenDrafter(), PROMPTS[4:6])
    assert lane.drafter is None
    assert lane.drafting_state.startswith("off: the broken drafter failed (RuntimeError: the draft head's file")
    for p, (ids, seq) in zip(PROMPTS[4:6], seqs):
        assert seq.finish_reason in ("stop", "length")
        ref_ids, want = _reference(reference_answers, p, 32)
        assert ref_ids == ids
        assert_same_or_near_tie(chat_ref, ids, seq.tokens, want)


# ------------------------------------------------------------------------- depth, lookup, settings
class _Seq:
    def __init__(self, acceptance):
        self.accept_ema = acceptance


def test_depth_planner_drafts_deep_when_rows_are_cheap_and_drafts_are_good():
    flat = StepCost([1, 2, 4, 8, 16], [10, 10, 10.5, 11, 20])
    planner = DepthPlanner(flat, NgramDrafter())
    good, bad = _Seq([0.9] * 8), _Seq([0.02] * 8)
    depths = planner.plan([good, bad], base_rows=2, room=[8, 8])
    assert depths[0] >= 4 and depths[1] == 0  # rows up to 8 are nearly free: the good slot takes them
    assert planner.plan([good], base_rows=1, room=[2]) == [2]  # never past the tokens left
    steep = StepCost([1, 2], [10, 20])  # every row costs a full step: drafting 0.5-likely tokens does not pay
    assert DepthPlanner(steep, NgramDrafter()).plan([_Seq([0.5] * 8)], 1, [8]) == [0]
    assert DepthPlanner(steep, NgramDrafter(), fixed_depth=3).plan([bad, good], 2, [8, 1]) == [3, 1]


def test_the_planner_counts_the_steps_where_drafting_did_not_pay_and_the_cli_says_so():
    from app.cli.common import drafting_note

    steep = DepthPlanner(StepCost([1, 2], [10, 20]), NgramDrafter())
    for _ in range(3):
        steep.plan([_Seq([0.5] * 8)], 1, [8])
    steep.plan([_Seq([0.5] * 8)], 1, [0])  # no room to draft: not a step where drafting was weighed
    assert steep.report()["considered"] == 3 and steep.report()["declined"] == 3
    assert "3 steps weighed" in steep.report()["note"]
    flat = DepthPlanner(StepCost([1, 2, 4], [10, 10, 10.5]), NgramDrafter())
    flat.plan([_Seq([0.9] * 8)], 1, [8])
    assert flat.report() == {"considered": 1, "declined": 0}
    lane = {"state": "on", "drafter": "mtp", "drafted": 0, "planner": steep.report()}
    assert drafting_note(lane) == ("drafting with mtp: nothing drafted (in 3 steps weighed here, no draft was expected "
                                   "to repay the time it adds to a step)")
    steep.plan([_Seq([0.5] * 8)], 1, [8])
    assert "note" not in DepthPlanner(StepCost([1, 2], [10, 20]), NgramDrafter()).report()  # nothing weighed yet
    assert drafting_note({**lane, "planner": flat.report()}) == "drafting with mtp: nothing drafted"
    assert drafting_note({"state": "off: no MTP head"}) == "drafting off: no MTP head"


def test_a_draft_row_costs_what_the_two_row_calibration_shows():
    widths, one_row, two_rows = [1, 2, 4, 8], [4.0, 4.5, 6.0, 9.2], [4.3, 5.1, 7.2, 11.6]
    cost = StepCost(widths, one_row, two_rows)
    assert cost.predict(8, 8) == pytest.approx(9.2)
    assert cost.row_ms(8) == pytest.approx((11.6 - 9.2) / 8)  # a verified row shares its slot's memory reads
    assert cost.predict(8, 10) == pytest.approx(9.2 + 2 * 0.3)
    assert cost.predict(3, 3) == pytest.approx(5.25)  # slots between measured widths: interpolated
    assert cost.row_ms(3) == pytest.approx((0.3 + 0.3) / 2)
    noisy = StepCost([1, 2], [10.0, 12.0], [9.5, 11.0])  # two rows measured faster than one: noise
    assert noisy.row_ms(1) == pytest.approx(0.1)  # a row never looks free
    slots_only = StepCost(widths, one_row)  # an old calibration: a row is priced like one more slot
    assert slots_only.predict(4, 5) == pytest.approx(6.0 + (9.2 - 6.0) / 4)
    for _ in range(40):  # the real steps: 8 slots cost 10% more, and drafted rows twice the curve's price
        cost.observe(8, 8, 9.2 * 1.1)
        cost.observe(8, 12, (9.2 + 4 * 2 * 0.3) * 1.1)
    assert cost.scale == pytest.approx(1.1, rel=0.02) and cost.row_scale == pytest.approx(2.0, rel=0.05)
    assert cost.predict(8, 10) == pytest.approx((9.2 + 2 * 0.6) * 1.1, rel=0.03)


def test_depth_planner_drafts_for_whisper_like_costs_once_several_drafts_repay_the_drafter_pass():
    # Whisper-like: a slot costs ~0.8 ms more, a verified draft row ~0.3 ms, the head's pass 0.5 ms.
    widths, one_row, two_rows = [1, 2, 4, 8], [4.0, 4.5, 6.0, 9.2], [4.3, 5.1, 7.2, 11.6]
    class HeadLike(NgramDrafter):
        def cost_levels(self, depth):  # one sequential pass per draft position, as an MTP head
            return depth

    slots = [_Seq([0.4] + [0.1] * 7) for _ in range(8)]
    cost = StepCost(widths, one_row, two_rows)
    cost.draft_ms = 0.5
    depths = DepthPlanner(cost, HeadLike()).plan(slots, base_rows=8, room=[8] * 8)
    assert depths == [1] * 8  # one draft each: 8 x 0.4 tokens for 2.4 + 0.5 ms on a 9.2 ms step
    priced_as_slots = StepCost(widths, one_row)
    priced_as_slots.draft_ms = 0.5
    assert DepthPlanner(priced_as_slots, HeadLike()).plan(slots, base_rows=8, room=[8] * 8) == [0] * 8
    lone = DepthPlanner(cost, HeadLike()).plan(slots[:1], base_rows=8, room=[8], slots=8)
    assert lone == [0]  # one draft alone does not repay the head's pass (0.4 token for 0.8 ms)
    hopeless = [_Seq([0.01] * 8) for _ in range(256)]  # drafts worth less than MIN_GAIN: not even tried
    wide = StepCost([1, 256], [4.0, 200.0], [4.1, 210.0])
    assert DepthPlanner(wide, NgramDrafter()).plan(hopeless, base_rows=256, room=[8] * 256) == [0] * 256


def test_ngram_lookup_proposes_what_followed_the_last_occurrence():
    seq = Sequence([5, 6, 7, 8, 9, 1, 2, 3], 10, set())
    seq.tokens = [6, 7]
    assert NgramDrafter().propose([seq], [3]) == [[8, 9, 1]]
    seq.tokens = [6, 7, 8, 4]  # [8, 4] never occurred before: no draft
    assert NgramDrafter().propose([seq], [3]) == [[]]


def test_drafter_settings_are_checked(tmp_path):
    assert parse_drafter("NGRAM") == "ngram" and parse_drafter("draft:smollm2-135m-instruct").startswith("draft:")
    with pytest.raises(CadenceError, match="Unknown drafter"):
        parse_drafter("medusa9")
    with pytest.raises(CadenceError, match="Draft depth"):
        Engine(backend="cpu", batch="off", drafter="ngram", draft_depth=99)


def test_a_draft_model_of_another_kind_is_refused_with_a_sentence():
    eng = Engine(backend="cpu", batch="off", drafter="draft:whisper-tiny.en")
    try:
        with pytest.raises(CadenceError, match="The draft model whisper-tiny.en cannot draft for smollm2"):
            _ask(eng, "Hi.").result(300)
    finally:
        eng.shutdown()


def test_drafting_shows_in_status_step_log_and_results(tmp_path):
    log = tmp_path / "steps.jsonl"
    # A fixed depth: the planner's own choice follows step timings, and on a busy machine drafting may
    # not pay at all (a fresh clone run beside another suite drafted nothing here)
    eng = Engine(backend="cpu", batch=2, drafter="ngram", draft_depth=3, step_log=log)
    try:
        got = _ask(eng, PROMPTS[1]).result(300)
        status = eng.status()
    finally:
        eng.shutdown()
    stats = got.stats["drafting"]
    assert stats["drafted"] > 0 and 0 < stats["acceptance"] <= 1
    assert stats["mean_acceptance_length"] == pytest.approx(1 + stats["accepted"] / max(1, _verifications(log)), abs=1e-3)
    lane = status["lanes"]["smollm2-135m-instruct"]["drafting"]
    assert lane["drafter"] == "ngram" and lane["drafted"] == stats["drafted"] and lane["accepted"] == stats["accepted"]
    assert lane["planner"] == {"considered": 0, "declined": 0}  # a fixed depth: the planner weighed nothing
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum(sum(line["drafted"].values()) for line in lines) == stats["drafted"]
    assert sum(sum(line["accepted"].values()) for line in lines) == stats["accepted"]
    assert sum(sum(line["tokens"].values()) for line in lines) == len(got.tokens)


def _verifications(log):
    return sum(1 for line in log.read_text().splitlines() if json.loads(line)["drafted"])


def test_running_out_of_memory_while_verifying_turns_drafting_off_and_redoes_the_step(smollm, chat_ref, caplog,
                                                                                       reference_answers):
    """Verification rows are what a lane adds by drafting: when they do not fit, the step runs again without them."""

    class _TightDecoder(LlamaBatched):
        def forward(self, batch, logit_rows=None, with_hidden=False):
            if int(batch.lengths.max()) > 1 and not bool((batch.positions[:, 0] == 0).any()):
                raise torch.OutOfMemoryError("no room for the draft rows")
            return super().forward(batch, logit_rows, with_hidden)

    decoder = _TightDecoder(smollm, width=2)
    drafter = NgramDrafter()
    lane = Lane(decoder, name="tight", drafter=drafter, planner=DepthPlanner(StepCost([1], [10.0]), drafter, 3),
                drafting_state="on")
    ids = chat_ref.prompt_ids(build_messages(PROMPTS[1]))
    seq = Sequence(ids, 32, chat_ref.stop_ids)
    lane.add(seq)
    with caplog.at_level("WARNING"):
        lane.run_until_idle()
    assert lane.drafting_state == "off: the device ran out of memory while verifying drafts"
    assert "Drafting is off on lane tight" in caplog.text
    ref_ids, want = _reference(reference_answers, PROMPTS[1], 32)
    assert ref_ids == ids
    assert_same_or_near_tie(chat_ref, ids, seq.tokens, want)


def test_cli_drafter_flag_reports_acceptance_and_rejects_unknown_drafters(tmp_path):
    from test_cli import cadence

    prompt = "Copy this list as it is: apples, pears, plums, cherries, grapes, lemons, limes."
    got = json.loads(cadence("chat", prompt, "--drafter", "ngram", "--draft-depth", "3", "--batch", "off",
                             "--max-tokens", "40", "--json", check_rc=0, data_dir=tmp_path).stdout)  # depth: as above
    off = json.loads(cadence("chat", prompt, "--drafter", "off", "--batch", "off", "--max-tokens", "40", "--json",
                             check_rc=0, data_dir=tmp_path).stdout)
    assert got["tokens"] == off["tokens"]
    assert got["stats"]["drafting"]["drafted"] > 0 and off["stats"]["drafting"]["drafted"] == 0
    bad = cadence("chat", "Hi.", "--drafter", "medusa9", check_rc=2, data_dir=tmp_path)
    assert bad.stderr.strip() == ("cadence: Unknown drafter 'medusa9': use one of auto, mtp, ngram, draft:MODEL, off.")
    bad = cadence("transcribe", "x.wav", "--draft-min-p", "2", check_rc=2, data_dir=tmp_path)
    assert "draft min-p must be at least 0 and below 1" in bad.stderr


def test_a_slot_that_stopped_drafting_tries_again_later():
    from engine.drafting import relax_acceptance

    ema = [0.0] * 8
    prior = [0.6] * 8
    cost = StepCost([1, 2, 4, 8], [10, 10.2, 10.4, 11])
    planner = DepthPlanner(cost, NgramDrafter())
    assert planner.plan([_Seq(ema)], 1, [4]) == [0]
    steps = 0
    while planner.plan([_Seq(ema)], 1, [4]) == [0]:
        relax_acceptance(ema, prior)
        steps += 1
        assert steps < 100, "a slot with a bad patch must draft again within a few dozen steps"
    assert steps >= 1
