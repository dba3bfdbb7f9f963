"""int8 products for many rows (engine.many_rows_int8): Whisper's encoder on 8-bit integer products.

Each window is rounded on its own (batched = serial), each row by its own scale (an outlier row does
not blur the others), and the words of the bundled check speech stay within auto's bound of float32's."""

import pytest
import torch
from conftest import file_restored

import engine.many_rows_int8 as many_rows_int8
from engine.many_rows_int8 import ManyRowsInt8Linear, engines_here

ENGINES = engines_here()


@pytest.mark.parametrize("engine", ENGINES)
def test_each_window_is_rounded_alone_and_each_row_by_its_own_scale(engine):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=generator) * 0.1
    bias = torch.randn(96, generator=generator)
    layer = ManyRowsInt8Linear(weight, bias, engine)
    windows = torch.randn(3, 40, 64, generator=generator)
    windows[1, 7] *= 300  # one loud row in the second window
    together = layer(windows)
    assert together.shape == (3, 40, 96) and together.dtype == torch.float32
    for i in range(3):  # a window's result does not depend on the windows beside it, bit for bit
        assert torch.equal(together[i], layer(windows[i]))
        assert torch.equal(together[i : i + 1], layer(windows[i : i + 1]))  # a batch of one window too
    exact = windows @ weight.T + bias
    error = (together - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert error.max() < 0.03  # every row, the quiet rows beside the loud one included
    assert error[1].max() < 0.03 and error[1, 7] < 0.03


@pytest.mark.parametrize("engine", ENGINES)
def test_rows_at_the_top_of_the_range_do_not_overflow(engine):
    """An AVX2 kernel sums pairs of 8-bit products in 16 bits (vpmaddubsw), which 8-bit inputs overflow
    (a row of 512 ones gave 4.0, not 512): REDUCE_RANGE keeps inputs to 7 bits, so they cannot."""
    weights = [torch.ones(16, 512), torch.ones(16, 512)]
    weights[1][:, ::2] = -1
    rows = torch.ones(3, 512)
    rows[1] = -1
    rows[2, ::2] = -1
    for weight in weights:
        got, exact = ManyRowsInt8Linear(weight, None, engine)(rows), rows @ weight.T
        assert torch.allclose(got, exact, rtol=0.02, atol=1e-3), (got[:, 0], exact[:, 0])


def test_the_choice_is_measured_once_and_recorded(monkeypatch, tmp_path):
    import engine.kernels as kernels

    monkeypatch.setattr(kernels, "_row_rules_file", lambda: tmp_path / "rules.json")
    monkeypatch.setattr(many_rows_int8, "_CHOICE", {})
    timed = []
    monkeypatch.setattr(many_rows_int8, "_time_engines", lambda dtype: timed.append(dtype) or "float")
    assert many_rows_int8.encoder_int8_engine() is None and many_rows_int8.encoder_int8_engine() is None
    monkeypatch.setattr(many_rows_int8, "_CHOICE", {})  # a new process reads the record
    assert many_rows_int8.encoder_int8_engine() is None
    assert timed == ([torch.float32] if ENGINES else [])
    if ENGINES:
        assert '"many-rows-int8-vs-float32": "float"' in (tmp_path / "rules.json").read_text()


@pytest.mark.parametrize("engine", ENGINES)
def test_whisper_int8_encoder_keeps_windows_apart_and_the_words(tiny, monkeypatch, engine):
    from engine.families.whisper import WhisperBatched
    from engine.precision import MAX_WER_RISE, check_speech, whisper_transcript
    from engine.wer import wer
    from engine.whisper.features import log_mel, pad_window
    from engine.whisper.reference import WhisperReference

    monkeypatch.setattr(many_rows_int8, "_CHOICE", {torch.float32: engine})
    decoder = WhisperBatched(tiny, width=4, precision="int8")
    assert decoder.encoder_int8 == engine
    assert isinstance(decoder.encoder_layers[0].fc1, ManyRowsInt8Linear)
    samples, text = check_speech()
    windows = torch.stack([torch.from_numpy(pad_window(log_mel(samples[i * 480000:(i + 1) * 480000], 80)))
                           for i in range(2)]).float()
    together = decoder.encode(windows)
    assert torch.equal(together[1], decoder.encode(windows[1:])[0])
    exact = WhisperBatched(tiny, width=4, precision="float32").encode(windows)
    assert ((together - exact).norm() / exact.norm()) < 0.1
    reference = WhisperReference(tiny)
    float_words = wer(text, whisper_transcript(WhisperBatched(tiny, width=4, precision="float32"), reference, samples))
    assert wer(text, whisper_transcript(decoder, reference, samples)) <= float_words + MAX_WER_RISE


@pytest.mark.parametrize("engine", ENGINES[:1])
def test_auto_keeps_int8_with_a_float_encoder_where_the_integer_one_misses_the_words(tiny, speech, monkeypatch, engine):
    """Where Whisper's words on the encoder's integer products fall outside auto's bound, auto measures int8
    again with its encoder in float, records that, and the engine's lane is built so."""
    import json

    import engine.precision as precision
    from engine import Engine, TranscribeRequest
    from engine.calibration import device_identity
    from engine.families.whisper import WhisperBatched
    from engine.loading import source_key
    from engine.precision import _cache_file, choose_precision
    from engine.whisper.reference import WhisperReference

    monkeypatch.setattr(many_rows_int8, "_CHOICE", {torch.float32: engine})
    text = precision.check_speech()[1]
    monkeypatch.setattr(precision, "whisper_transcript",  # the integer encoder "hears" nothing here
                        lambda decoder, reference, samples: "" if getattr(decoder, "encoder_int8", None) else text)
    key = "int8-encoder-words-" + source_key(tiny.source)
    choice = choose_precision(tiny, WhisperReference(tiny), lambda p, **kw: WhisperBatched(tiny, precision=p, **kw),
                              key, use_cache=False)
    entry = choice.candidates["int8"]
    assert entry["qualifies"] and entry["float_encoder"] and entry["int8_encoder_wer"] == 1.0 and entry["wer"] == 0.0
    assert "int8_encoder" not in entry
    if choice.chosen == "int8":
        assert "its encoder in float: on 8-bit integer products the check speech read 100.0%" in choice.why
    monkeypatch.setattr(precision, "whisper_transcript", lambda decoder, reference, samples: text)
    again = choose_precision(tiny, WhisperReference(tiny), lambda p, **kw: WhisperBatched(tiny, precision=p, **kw),
                             key, use_cache=False)  # the words hold on integer products: they are kept, and said
    assert again.candidates["int8"]["int8_encoder"] == engine and "float_encoder" not in again.candidates["int8"]
    if again.chosen == "int8":
        assert "(its encoder on 8-bit integer products)" in again.why
    path = _cache_file(source_key(tiny.source), device_identity("cpu"))  # what the engine reads for tiny.en
    with file_restored(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**choice.to_json(), "chosen": "int8"}))
        served = Engine(backend="cpu", batch=2, drafter="off", precision="auto")
        try:
            assert "fox" in served.submit(TranscribeRequest(speech["fox"])).result(600).text.lower()
            decoder = served._lanes["whisper-tiny.en"].decoder
            assert decoder.precision == "int8" and decoder.encoder_int8 is None
            assert not isinstance(decoder.encoder_layers[0].fc1, ManyRowsInt8Linear)
        finally:
            served.shutdown()


def test_the_memory_projection_way_is_measured_once_and_recorded(monkeypatch, tmp_path):
    import engine.kernels as kernels

    monkeypatch.setattr(kernels, "_row_rules_file", lambda: tmp_path / "rules.json")
    monkeypatch.setattr(many_rows_int8, "_MEMORY_WAY", {})
    way = many_rows_int8.memory_projection_way()  # measured here, for real
    assert way in ("int8", "float")
    monkeypatch.setattr(many_rows_int8, "_MEMORY_WAY", {})  # a new process reads the record, measuring nothing
    monkeypatch.setattr(many_rows_int8, "_time_memory_projection", lambda dtype: pytest.fail("measured twice"))
    assert many_rows_int8.memory_projection_way() == way
    assert f'"memory-projection-int8-vs-float32": "{way}"' in (tmp_path / "rules.json").read_text()


@pytest.mark.parametrize("way", ["float", "int8"])
def test_int8_whisper_projects_each_window_into_its_memory_the_recorded_way(tiny, monkeypatch, way):
    """A window's cross-attention keys and values (1500 rows once a window) come from the float weights as
    they are where the decode kernels' int8 is no faster there, exactly as the float layer gives them."""
    from engine.families.whisper import WhisperBatched
    from engine.kernels import Linear, precision_of, unquantized_dtype

    monkeypatch.setattr(many_rows_int8, "_MEMORY_WAY", {unquantized_dtype("int8", torch.device("cpu")): way})
    decoder = WhisperBatched(tiny, width=2, precision="int8")
    layer = tiny.model.model.decoder.layers[0].encoder_attn
    assert (decoder.layers[0].cross_kv.q is None) == (way == "float")
    encoded = torch.randn(1500, tiny.model.config.d_model, generator=torch.Generator().manual_seed(1))
    decoder.set_memory(1, encoded)
    assert layer.k_proj.bias is None  # Whisper's keys have no bias
    weight = torch.cat([layer.k_proj.weight, layer.v_proj.weight]).detach()
    bias = torch.cat([torch.zeros(layer.v_proj.out_features), layer.v_proj.bias.detach()])
    if way == "float":
        assert decoder.memory_projection == precision_of(unquantized_dtype("int8", torch.device("cpu")))
        exact = Linear(weight, bias, decoder.memory_projection, invariant=False)(encoded)
    else:
        assert decoder.memory_projection == "int8"
        exact = decoder.layers[0].cross_kv(encoded)  # the int8 layer itself: here only where its rows land is checked
    k = exact.view(1500, 2, decoder.heads, decoder.head_dim)[:, 0].transpose(0, 1)
    assert torch.equal(decoder.cross_k[0, 1, :, :1500], k.to(decoder.cross_k.dtype))
    assert not decoder.cross_k[0, 0].any()  # the other slot untouched
