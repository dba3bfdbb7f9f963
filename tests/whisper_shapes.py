"""Tiny random-weight Whisper models with the shape of each larger real one (vocabulary, mel bands,
the encoder-to-decoder layer ratio), built where Cadence looks for models by name, since the real
weights cannot be downloaded here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from engine.whisper.sizes import SIZES, models_dir

LAYERS = {"whisper-small": (2, 2), "whisper-medium": (2, 2), "whisper-large-v3": (2, 2),
          "whisper-large-v3-turbo": (8, 1)}  # turbo keeps its 32:4 ratio


def _tokenizer(base_folder: Path, out: Path, vocab_size: int) -> None:
    """whisper-base's tokenizer; for the 51866-token vocabulary of large-v3, with <|yue|> added after the
    other languages and the special tokens after it moved up by one, as in the real one."""
    data = json.loads((base_folder / "tokenizer.json").read_text())
    if vocab_size == 51866:
        added = []
        for token in data["added_tokens"]:
            if token["content"] == "<|translate|>":
                added.append({**token, "content": "<|yue|>", "id": token["id"]})
            if token["id"] >= 50358:
                token = {**token, "id": token["id"] + 1}
            added.append(token)
        data["added_tokens"] = added
    (out / "tokenizer.json").write_text(json.dumps(data))


def build(name: str, base_folder: Path) -> Path:
    """The tiny model for ``name`` in the models folder (built once per session)."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    folder = models_dir() / name
    if (folder / "config.json").is_file():
        return folder
    size = SIZES[name]
    vocab = 51866 if size.mel_bins == 128 else 51865
    encoder_layers, decoder_layers = LAYERS[name]
    config = WhisperConfig(vocab_size=vocab, num_mel_bins=size.mel_bins, d_model=64, encoder_layers=encoder_layers,
                           decoder_layers=decoder_layers, encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=1500,
                           max_target_positions=448, decoder_start_token_id=50258, bos_token_id=50257,
                           eos_token_id=50257, pad_token_id=50257, begin_suppress_tokens=None, suppress_tokens=None)
    torch.manual_seed(sum(map(ord, name)))
    model = WhisperForConditionalGeneration(config).eval()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    _tokenizer(base_folder, tmp, vocab)
    (tmp / "generation_config.json").write_text(json.dumps({"alignment_heads": [[decoder_layers - 1, 0],
                                                                                [decoder_layers - 1, 2]]}))
    tmp.rename(folder)
    return folder
