"""The larger Whisper models by name (small, medium, large-v3, turbo): listed with size and whether
present; each real configuration's shape (as a tiny random-weight model) loads from the models
folder by name, gets its 80 or 128 mel bands, and decodes batched exactly as one at a time."""

import pytest
from whisper_shapes import LAYERS, build

from engine import TranscribeRequest
from engine.errors import ModelError
from engine.loading import load
from engine.models import list_models, resolve
from engine.whisper.pipeline import plan_transcription
from engine.whisper.reference import WhisperReference
from engine.whisper.sizes import SIZES
from engine.audio import load_audio


def test_the_larger_models_are_listed_with_size_and_presence():
    rows = {r["name"]: r for r in list_models()}
    for name, size in SIZES.items():
        row = rows[name]
        assert row["size"] == size.size_text and row["family"] == "whisper"
        assert row["present"] == row["available"]
    assert rows["whisper-large-v3"]["size"] == "3.1 GB" and rows["whisper-tiny.en"]["size"].endswith("MB")


@pytest.mark.parametrize("bands", [80, 128])
def test_mel_filters_match_whispers_own_for_80_and_128_bands(bands):
    import numpy as np
    from transformers import WhisperFeatureExtractor

    from engine.whisper.features import mel_filters

    theirs = WhisperFeatureExtractor(feature_size=bands).mel_filters.T
    assert mel_filters(bands).shape == (bands, 201) and np.abs(mel_filters(bands) - theirs).max() < 1e-7


def test_a_larger_model_that_is_not_here_says_where_to_put_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = next(n for n, r in ((r["name"], r) for r in list_models()) if n in SIZES and not r["present"])
    with pytest.raises(ModelError, match="is not on this machine"):
        resolve(name)


@pytest.mark.parametrize("name", list(SIZES))
def test_each_shape_loads_by_name_and_decodes_batched_as_serial(name, engine4, engine_off, speech):
    build(name, resolve("whisper-base").folder)
    loaded = load(name)
    cfg = loaded.model.config
    assert loaded.source.name == name and cfg.num_mel_bins == SIZES[name].mel_bins
    assert (cfg.encoder_layers, cfg.decoder_layers) == LAYERS[name]
    ref = WhisperReference(loaded)
    assert ref.tok.multilingual and ("yue" in ref.tok.languages) == (cfg.num_mel_bins == 128)
    plan = plan_transcription(ref, load_audio(speech["fox"]), language="en")
    assert plan.spans[0][2].shape == (SIZES[name].mel_bins, 3000)
    clips = [speech[n] for n in ("fox", "report", "budget", "long")]
    # One engine after the other: transformers' loading is not safe on two threads at once.
    batched = [h.result(600) for h in [engine4.submit(TranscribeRequest(c, model=name, language="en",
                                                                        timestamps=False)) for c in clips]]
    serial = [h.result(600) for h in [engine_off.submit(TranscribeRequest(c, model=name, language="en",
                                                                          timestamps=False)) for c in clips]]
    for got, want in zip(batched, serial):
        assert [t for x in got.segments for t in x.tokens] == [t for x in want.segments for t in x.tokens]
    assert sum(t.stats["tokens"] for t in batched) > 20  # it decoded something
