"""CTranslate2 -> transformers Whisper conversion: shapes, tied output, key bias, bad files."""

import struct

import numpy as np
import pytest
import torch

from engine.whisper.ct2 import convert_to_transformers, read_ct2_model, whisper_config_dict
from engine.errors import ModelError
from engine.models import resolve


@pytest.fixture(scope="module")
def tiny_ct2():
    return read_ct2_model(list(resolve("whisper-tiny.en").weights))


def test_tiny_config_is_derived_from_tensors(tiny_ct2):
    cfg = whisper_config_dict(tiny_ct2)
    assert cfg["vocab_size"] == 51864 and cfg["d_model"] == 384
    assert cfg["encoder_layers"] == 4 and cfg["decoder_layers"] == 4
    assert cfg["encoder_attention_heads"] == 6 and cfg["decoder_attention_heads"] == 6
    assert cfg["encoder_ffn_dim"] == 1536 and cfg["num_mel_bins"] == 80
    assert cfg["max_source_positions"] == 1500 and cfg["max_target_positions"] == 448
    assert tiny_ct2.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}


def test_base_is_read_from_its_two_parts():
    ct2 = read_ct2_model(list(resolve("whisper-base").weights))
    cfg = whisper_config_dict(ct2)
    assert (cfg["vocab_size"], cfg["d_model"], cfg["encoder_layers"], cfg["decoder_layers"]) == (51865, 512, 6, 6)
    assert cfg["encoder_attention_heads"] == 8


def test_fused_qkv_is_split_and_key_bias_dropped(tiny_ct2):
    _, sd = convert_to_transformers(tiny_ct2)
    fused = tiny_ct2.get("decoder/layer_1/self_attention/linear_0/weight").astype(np.float32)
    fused_b = tiny_ct2.get("decoder/layer_1/self_attention/linear_0/bias")
    assert np.all(fused_b[384:768] == 0)  # the key slice of the bias is zero in the source
    prefix = "model.decoder.layers.1.self_attn"
    assert torch.equal(sd[f"{prefix}.k_proj.weight"], torch.from_numpy(fused[384:768]))
    assert torch.equal(sd[f"{prefix}.v_proj.weight"], torch.from_numpy(fused[768:]))
    assert f"{prefix}.k_proj.bias" not in sd and f"{prefix}.q_proj.bias" in sd
    cross = tiny_ct2.get("decoder/layer_0/attention/linear_1/weight").astype(np.float32)
    assert torch.equal(sd["model.decoder.layers.0.encoder_attn.v_proj.weight"], torch.from_numpy(cross[384:]))
    assert all(t.dtype == torch.float32 for t in sd.values())


def test_nonzero_key_bias_is_refused(tiny_ct2):
    name = "encoder/layer_0/self_attention/linear_0/bias"
    original = tiny_ct2.variables[name]
    bad = original.copy()
    bad[400] = 1.0
    tiny_ct2.variables[name] = bad
    try:
        with pytest.raises(ModelError, match="key bias"):
            convert_to_transformers(tiny_ct2)
    finally:
        tiny_ct2.variables[name] = original


def test_loaded_model_ties_output_to_embeddings(tiny, base):
    for loaded in (tiny, base):
        m = loaded.model
        assert m.proj_out.weight.data_ptr() == m.model.decoder.embed_tokens.weight.data_ptr()
        assert m.model.encoder.embed_positions.weight.shape[0] == 1500


def test_encoder_positions_keep_the_stored_values(tiny, tiny_ct2):
    stored = torch.from_numpy(tiny_ct2.get("encoder/position_encodings/encodings").astype(np.float32))
    assert torch.equal(tiny.model.model.encoder.embed_positions.weight, stored)


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"", "truncated"),
        (struct.pack("<I", 5) + b"\0" * 20, "supported version"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "version"),
    ],
)
def test_bad_model_files_give_one_sentence(tmp_path, payload, message):
    path = tmp_path / "model.bin"
    path.write_bytes(payload)
    with pytest.raises(ModelError, match=message):
        read_ct2_model(path)


def test_truncated_real_model_is_refused(tmp_path):
    data = resolve("whisper-tiny.en").weights[0].read_bytes()
    path = tmp_path / "model.bin"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="truncated"):
        read_ct2_model(path)
