"""Precision: every kernel keeps rows independent, every precision keeps the engine's invariants
(batched = serial, drafting = no drafting, seeded sampling the same at any width), int8 weights
reload from their cache unchanged, a precision the machine lacks is refused in one sentence, and
``auto`` measures, picks and records its choice."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import SHIPPED_UNSTEADY, file_restored

from engine import ChatRequest, Engine, TranscribeRequest
from engine.errors import CadenceError, RequestError
from engine.kernels import Linear, check_precision, precisions_on
from engine.sampling import SamplingParams

PROMPTS = ["Name three rivers in Europe.", "Write one sentence about owls.", "What is 12 times 7?",
           "List two colours and a fruit."]
OFFERED = precisions_on("cpu")
REDUCED = [p for p in OFFERED if p != "float32"]


@pytest.mark.parametrize("precision", OFFERED)
def test_every_kernel_gives_a_row_the_same_result_whatever_shares_its_call(precision):
    torch.manual_seed(0)
    for out_features, in_features in ((64, 1536), (96, 576), (48, 384)):  # the inner sizes of the default models
        layer = Linear(torch.randn(out_features, in_features) / in_features ** 0.5, torch.randn(out_features), precision)
        x = torch.randn(70, in_features)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
        for rows in (2, 3, 8, 17, 32, 33, 64, 70):
            assert torch.equal(layer(x[:rows]), alone[:rows]), (precision, in_features, rows)


def test_row_rules_are_measured_once_per_machine_and_kept_across_runs(monkeypatch, tmp_path):
    import engine.kernels as kernels

    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_ROW_RULES", {})
    key = ("float32", 7, 5, torch.float32, "cpu", False, False, False)
    measured = []
    assert kernels.known_row_rule(key, lambda: measured.append(1) or (2, 64)) == (2, 64)
    [recorded] = (tmp_path / "kernels").glob("rows-*.json")
    assert list(json.loads(recorded.read_text()).values()) == [[2, 64]]

    monkeypatch.setattr(kernels, "_ROW_RULES", {})  # a new run: the file answers, nothing is measured
    assert kernels.known_row_rule(key, lambda: pytest.fail("measured again")) == (2, 64)
    # A layer built afterwards probes its own shape once and keeps the file's other rules.
    layer = Linear(torch.randn(9, 11), None, "float32")
    assert len(json.loads(recorded.read_text())) == 2 and layer.rows_rule[0] >= 1

    recorded.write_text("{not json")  # a damaged file is measured again and rewritten whole
    monkeypatch.setattr(kernels, "_ROW_RULES", {})
    assert kernels.known_row_rule(key, lambda: (1, 32)) == (1, 32)
    assert json.loads(recorded.read_text()) == {"|".join(map(str, key)): [1, 32]}
    assert measured == [1]


def _answers(engine, params) -> list[list[int]]:
    handles = [engine.submit(ChatRequest(p, params=params)) for p in PROMPTS]
    return [h.result(600).tokens for h in handles]


@pytest.fixture(scope="module", params=REDUCED)
def reduced_engines(request):
    """A serial engine and a width-4 engine with drafting, both in one reduced precision."""
    serial = Engine(backend="cpu", batch="off", drafter="off", precision=request.param)
    batched = Engine(backend="cpu", batch=4, drafter="ngram", draft_depth=3, precision=request.param)
    yield request.param, serial, batched
    serial.shutdown()
    batched.shutdown()


def test_batched_and_drafted_chat_equal_serial_token_for_token(reduced_engines):
    precision, serial, batched = reduced_engines
    greedy = SamplingParams(max_tokens=24)
    alone = _answers(serial, greedy)
    together = _answers(batched, greedy)
    assert together == alone, precision
    lane = batched.status()["lanes"]["smollm2-135m-instruct"]
    assert lane["precision"] == precision and lane["drafting"]["drafted"] > 0  # drafts were checked
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11)
    assert _answers(batched, seeded) == _answers(serial, seeded), precision


def test_batched_whisper_equals_serial_in_each_precision(reduced_engines, speech):
    precision, serial, batched = reduced_engines
    clips = [speech[n] for n in ("fox", "report", "budget")]
    one = [serial.submit(TranscribeRequest(c, model="whisper-tiny.en", timestamps=True)).result(600) for c in clips]
    handles = [batched.submit(TranscribeRequest(c, model="whisper-tiny.en", timestamps=True)) for c in clips]
    many = [h.result(600) for h in handles]
    assert [[s.tokens for s in t.segments] for t in many] == [[s.tokens for s in t.segments] for t in one], precision
    assert "fox" in one[0].text.lower()


def test_int8_weights_are_made_once_and_reload_unchanged(smollm):
    from engine.families.llama import LlamaBatched
    from engine.seam import StepBatch
    from engine.weights import int8_cache_path

    path = int8_cache_path(smollm)
    path.unlink(missing_ok=True)
    first = LlamaBatched(smollm, precision="int8")
    assert path.is_file() and not first.weights_from_cache
    again = LlamaBatched(smollm, precision="int8")
    assert again.weights_from_cache
    assert torch.equal(first.layers[3].gate_up.q, again.layers[3].gate_up.q)
    batch = StepBatch.build([0], [[1, 9690, 198, 1204, 314]], [0])
    assert torch.equal(first.forward(batch), again.forward(batch))


def test_a_precision_the_machine_lacks_is_refused_in_one_sentence(monkeypatch):
    with pytest.raises(RequestError, match=r"^Unknown precision 'float8' \(use auto, float32, bfloat16, int8\)\.$"):
        check_precision("float8", "cpu")
    import engine.kernels as kernels

    monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: False)  # the processor answers "no bfloat16"
    assert kernels.precisions_on("cpu") == ["float32", "int8"]
    with pytest.raises(RequestError, match=r"^bfloat16 is not offered here: this processor has no bfloat16 "
                                           r"instructions \(use float32 or int8\)\.$"):
        Engine(backend="cpu", precision="bfloat16")
    with pytest.raises(CadenceError, match="Precision must be auto, float32, bfloat16, int8"):
        Engine(backend="cpu", precision="fast")


def test_auto_measures_picks_and_records_its_choice(tiny, speech):
    from engine.families.whisper import WhisperBatched
    from engine.loading import source_key
    from engine.paths import cache_dir
    from engine.precision import choose_precision
    from engine.whisper.reference import WhisperReference

    reference = WhisperReference(tiny)
    choice = choose_precision(tiny, reference, lambda p, **kw: WhisperBatched(tiny, precision=p, **kw),
                              source_key(tiny.source))
    assert set(choice.candidates) == set(OFFERED) and choice.chosen in OFFERED
    assert choice.candidates["float32"]["qualifies"]
    best = max((p for p, e in choice.candidates.items() if e["qualifies"]), key=lambda p: choice.candidates[p]["score"])
    assert choice.chosen == best and re.match(rf"{choice.chosen}( \(.+\))?: the fastest within quality bounds", choice.why)
    stored = list((cache_dir() / "precision").glob("*.json"))
    assert any(json.loads(p.read_text())["chosen"] == choice.chosen for p in stored)
    assert choose_precision(tiny, reference, lambda p, **kw: WhisperBatched(tiny, precision=p, **kw),
                            source_key(tiny.source)).from_cache
    engine = Engine(backend="cpu", batch=2, precision="auto")
    try:
        assert "fox" in engine.submit(TranscribeRequest(speech["fox"])).result(600).text.lower()
        lane = engine.status()["lanes"]["whisper-tiny.en"]
        assert lane["precision"] == choice.chosen and lane["precision_from"] == "auto"
        assert lane["precision_why"] == choice.why and lane["calibration"]["widths"]
    finally:
        engine.shutdown()


def test_a_choice_measured_while_the_machine_got_busy_serves_but_is_not_kept(tiny, monkeypatch):
    """float32 is timed before and after the others; when the machine slows down in between (here: its second
    timing scored as a machine ten times slower), the choice is used but not cached, and says why. (Only the
    timings matter here: every precision is given the check speech's own text, so none is left out for its
    words and the check's transcriptions, the test above's, are not decoded again.)"""
    import engine.calibration
    import engine.precision
    from engine.calibration import device_identity
    from engine.families.whisper import WhisperBatched
    from engine.loading import source_key
    from engine.precision import _cache_file, choose_precision
    from engine.whisper.reference import WhisperReference

    measure, timed = engine.precision.whisper_speed, []

    def slower_the_second_time(decoder, mel_bins):
        entry = measure(decoder, mel_bins)
        timed.append(decoder.precision)
        if decoder.precision == "float32" and timed.count("float32") == 2:
            entry = {**entry, "score": entry["score"] / 10}
        return entry

    monkeypatch.setattr(engine.precision, "whisper_speed", slower_the_second_time)
    text = engine.precision.check_speech()[1]
    monkeypatch.setattr(engine.precision, "whisper_transcript", lambda decoder, reference, samples: text)
    monkeypatch.setattr(engine.calibration, "UNSTEADY", SHIPPED_UNSTEADY)  # (the suite keeps every choice)
    key = "busy-" + source_key(tiny.source)
    choice = choose_precision(tiny, WhisperReference(tiny), lambda p, **kw: WhisperBatched(tiny, precision=p, **kw), key)
    assert timed[0] == timed[-1] == "float32" and timed.count("float32") == 2
    assert not choice.steady and choice.chosen in OFFERED
    assert "Measured while the machine was busy (float32: a 30-s window in" in choice.why
    assert not _cache_file(key, device_identity(torch.device("cpu"))).exists()


def test_int8_chat_keeps_integer_products_for_generated_tokens_only_where_they_qualify(smollm):
    """auto's int8 chat candidate tries generated tokens on each way of integer products (where the CPU
    has them) and keeps the fastest at 97% top-1 agreement with float32; the entry says what it measured."""
    from engine import native
    from engine.chat.reference import ChatReference, build_messages
    from engine.families.llama import LlamaBatched
    from engine.precision import INTEGER_WAYS, MIN_AGREEMENT, _chat_entry, _greedy

    reference = ChatReference(smollm)
    prompts = [reference.prompt_ids(build_messages(p)) for p in PROMPTS[:3]]
    answers = _greedy(LlamaBatched(smollm, precision="float32"), prompts, 16)
    decoder = LlamaBatched(smollm, precision="int8")
    entry = _chat_entry(decoder, "int8", prompts, answers)
    assert "i8dot" in native.int8_kernels_here() and "integer_dot" in entry  # every AVX2 CPU has it
    kept, products = entry["four_bit"].split("/")  # SmolLM2's layers, from a Q4_1 GGUF, keep their 4-bit weights
    assert kept == products == str(4 * len(decoder.layers))
    agreements = entry["integer_agreements"]
    assert set(agreements) == set(INTEGER_WAYS)
    # 16-bit activations round 256 times finer than 8-bit ones: at least as close to float32
    assert agreements["16-bit"] >= agreements["8-bit"]
    qualified = [way for way, a in agreements.items() if a >= MIN_AGREEMENT]
    assert entry["integer_dot"] == bool(qualified)
    if qualified:  # the lane runs the way recorded, which qualified
        way = entry["integer_way"]
        assert way in qualified and entry["agreement"] == agreements[way] and entry["qualifies"]
        down, bits = INTEGER_WAYS[way]
        first = "i8dot" if bits == 8 else "i16dot"
        assert decoder._c_layers.generated_kernels == (first, first if down else "i16dot")
    else:
        assert decoder._c_layers.generated_kernels[0] not in ("i8dot", "i16dot")
    assert entry["tok_s"][1] > 0 and entry["tok_s"][8] > 0
    if qualified:  # every qualifying way timed, the chosen one's figures among them
        assert set(entry["integer_tok_s"]) == set(qualified) and entry["integer_tok_s"][way] == entry["tok_s"]
    # Greedy answers with generated tokens on each way of integer products: each prompt alone equals all at once.
    for down, bits in INTEGER_WAYS.values():
        decoder.use_integer_dot(True, down=down, bits=bits)
        together = _greedy(decoder, prompts, 12)
        assert together == [_greedy(decoder, [p], 12)[0] for p in prompts], (down, bits)


def test_a_less_exact_way_of_integer_products_wins_only_by_more_than_the_margin():
    from engine.precision import EXACTNESS_MARGIN, _better

    exact, rough = {"agreement": 1.0, "score": 100.0}, {"agreement": 0.98}
    assert not _better({**rough, "score": 100.0 * (1 + EXACTNESS_MARGIN) - 0.1}, exact)  # noise-sized gain: no
    assert _better({**rough, "score": 100.0 * (1 + EXACTNESS_MARGIN) + 0.1}, exact)
    assert _better(exact, {**rough, "score": 100.0 * (1 + EXACTNESS_MARGIN) - 0.1})  # a tie goes to the exact one
    assert not _better(exact, {**rough, "score": 100.0 * (1 + EXACTNESS_MARGIN) + 0.1})
    assert _better({"agreement": 1.0, "score": 101.0}, exact) and not _better({"agreement": 1.0, "score": 99.0}, exact)


@pytest.mark.parametrize("way,keep_4bit", [("8-bit but the down projection", True), ("16-bit", False)])
def test_an_auto_choice_with_integer_products_reaches_the_lane(smollm, monkeypatch, way, keep_4bit):
    """The engine runs what auto recorded: an int8 choice whose entry has integer_dot gets a lane whose
    generated rows run on the integer kernels of the way recorded, its 4-bit layers kept so or rounded to
    int8 as recorded, and its status says so."""
    from engine import native
    from engine.calibration import device_identity
    from engine.loading import source_key
    from engine.precision import PrecisionChoice, _cache_file

    monkeypatch.delenv("CADENCE_INT8_KERNEL", raising=False)
    entry = {"agreement": 0.98, "qualifies": True, "integer_dot": True, "integer_way": way,
             "integer_agreements": {"8-bit": 0.96, "8-bit but the down projection": 0.975, "16-bit": 0.98},
             "tok_s": {"1": 100.0, "8": 300.0}, "keep_4bit": keep_4bit, "four_bit": "120/120",
             "step_ms": {"1": 10.0, "8": 26.0}, "score": 3.0}
    float32 = {"agreement": 1.0, "qualifies": True, "tok_s": {"1": 20.0, "8": 100.0}, "step_ms": {"1": 50.0, "8": 80.0},
               "score": 1.0}
    choice = PrecisionChoice(model="smollm2-135m-instruct", device=device_identity("cpu"), chosen="int8",
                             why="int8 (generated tokens on integer products): recorded by this test.",
                             candidates={"float32": float32, "int8": entry})
    path = _cache_file(source_key(smollm.source), device_identity("cpu"))
    with file_restored(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(choice.to_json()))
        engine = Engine(backend="cpu", batch=2, drafter="off", precision="auto")
        try:
            answer = engine.submit(ChatRequest(PROMPTS[2], params=SamplingParams(max_tokens=8))).result(600)
            assert answer.tokens
            lane = engine.status()["lanes"]["smollm2-135m-instruct"]
            assert lane["precision"] == "int8" and lane["precision_why"] == choice.why
            decoder = engine._lanes["smollm2-135m-instruct"].decoder
            assert decoder._c_layers.generated_kernels == (("i8dot", "i16dot") if way.startswith("8")
                                                           else ("i16dot", "i16dot"))
            assert decoder._head_kernels == (native.int8_kernel(), "i16dot")  # the output layer's generated rows
            assert all((layer.gate_up.minimum is not None) == keep_4bit for layer in decoder.layers)
        finally:
            engine.shutdown()


def test_int8_asked_by_name_runs_generated_tokens_on_16_bit_products_where_those_are_faster(smollm, monkeypatch):
    """int8 asked for by name (no agreement check, so none of the 8-bit ways): its generated tokens run on
    16-bit integer products where they time faster here than float activations, measured once and cached;
    the lane runs what the record says, and its status says which way ran and why."""
    import engine.precision as precision
    from engine import native
    from engine.calibration import device_identity
    from engine.families.llama import LlamaBatched
    from engine.loading import source_key
    from engine.precision import _cache_file, asked_int8_way

    monkeypatch.delenv("CADENCE_INT8_KERNEL", raising=False)
    key = source_key(smollm.source)
    path = _cache_file(key, device_identity("cpu"), folder="int8-asked")
    kept = path.read_text() if path.is_file() else None
    path.unlink(missing_ok=True)
    try:
        measured = asked_int8_way(LlamaBatched(smollm, width=8, precision="int8"), key)
        (alone, wide), (f_alone, f_wide) = measured["tok_s"]["16-bit"], measured["tok_s"]["float activations"]
        assert min(alone, wide, f_alone, f_wide) > 0
        assert measured["integer_dot"] == (alone * wide > f_alone * f_wide)
        assert measured["integer_way"] == ("16-bit" if measured["integer_dot"] else None)
        assert json.loads(path.read_text()) == measured

        def timed_again(decoder):
            raise AssertionError("measured again despite the record")

        monkeypatch.setattr(precision, "chat_speed", timed_again)
        assert asked_int8_way(LlamaBatched(smollm, precision="int8"), key) == measured  # from the record

        for faster in (True, False):  # what the record says runs, both ways
            numbers = {"16-bit": [100.0, 300.0], "float activations": [50.0, 200.0]}
            if not faster:
                numbers = {"16-bit": [50.0, 200.0], "float activations": [100.0, 300.0]}
            path.write_text(json.dumps({"integer_dot": faster, "integer_way": "16-bit" if faster else None,
                                        "tok_s": numbers}))
            engine = Engine(backend="cpu", batch=2, drafter="off", precision="int8")
            try:
                assert engine.submit(ChatRequest(PROMPTS[2], params=SamplingParams(max_tokens=8))).result(600).tokens
                lane = engine.status()["lanes"]["smollm2-135m-instruct"]
                decoder = engine._lanes["smollm2-135m-instruct"].decoder
                assert lane["precision"] == "int8" and lane["precision_from"] == "argument"
                if faster:
                    assert decoder._c_layers.generated_kernels == ("i16dot", "i16dot")
                    assert decoder._head_kernels == (native.int8_kernel(), "i16dot")
                    assert lane["precision_why"] == ("int8, as asked; 120/120 layer products on the model's own 4-bit "
                                                     "weights; generated tokens on 16-bit integer products, the "
                                                     "faster here (100 tok/s alone, 300 at width 8; float activations: "
                                                     "50 and 200)")
                else:
                    assert decoder._c_layers.generated_kernels[0] not in ("i8dot", "i16dot")
                    assert decoder._head_kernels is None
                    assert lane["precision_why"] == ("int8, as asked; 120/120 layer products on the model's own 4-bit "
                                                     "weights; generated tokens on float activations, the faster "
                                                     "here (100 tok/s alone, 300 at width 8; 16-bit integer products: "
                                                     "50 and 200)")
            finally:
                engine.shutdown()
    finally:
        if kept is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(kept)
