"""int8 products for many rows (engine.many_rows_int8): Whisper's encoder on 8-bit integer products.

Each window is rounded on its own (batched = serial), each row by its own scale (an outlier row does
not blur the others), and the words of the bundled check speech stay within auto's bound of float32's."""

import pytest
import torch

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
    exact = windows @ weight.T + bias
    error = (together - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert error.max() < 0.03  # every row, the quiet rows beside the loud one included
    assert error[1].max() < 0.03 and error[1, 7] < 0.03


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
