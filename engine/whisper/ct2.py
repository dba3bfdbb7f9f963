"""Read a CTranslate2 Whisper ``model.bin`` and convert it to transformers' Whisper layout.

The format (binary version 6, spec ``WhisperSpec``) is a flat list of named tensors followed by
aliases. Everything the transformers config needs is derived from the tensors themselves.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from engine.errors import ModelError

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: None}  # 5 = bf16


@dataclass
class Ct2Model:
    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str]

    def get(self, name: str) -> np.ndarray:
        return self.variables[self.aliases.get(name, name)]


def _read_exact(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ModelError(f"{path} is truncated: it is not a complete CTranslate2 model file.")
    return data


def _read_name(f: BinaryIO, path: Path) -> str:
    (length,) = struct.unpack("<H", _read_exact(f, 2, path))
    return _read_exact(f, length, path).rstrip(b"\0").decode("utf-8")


class _ConcatenatedFile:
    """Read several files as one stream (a model.bin shipped split into parts)."""

    def __init__(self, paths: list[Path]):
        self._files = [open(p, "rb") for p in paths]
        self._index = 0

    def read(self, n: int) -> bytes:
        chunks = []
        while n > 0 and self._index < len(self._files):
            chunk = self._files[self._index].read(n)
            if not chunk:
                self._index += 1
                continue
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self._files:
            f.close()


def read_ct2_model(path: str | Path | list[Path]) -> Ct2Model:
    """Parse a CTranslate2 ``model.bin`` (or its parts, in order).

    Raises ModelError with one clear sentence on bad input.
    """
    parts = [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]
    path = parts[0] if len(parts) == 1 else Path(", ".join(str(p) for p in parts))
    try:
        with _ConcatenatedFile(parts) as f:
            (version,) = struct.unpack("<I", _read_exact(f, 4, path))
            if version != 6:
                raise ModelError(
                    f"{path} is not a CTranslate2 model of a supported version (found {version}, expected 6)."
                )
            spec = _read_name(f, path)
            (revision,) = struct.unpack("<I", _read_exact(f, 4, path))
            (count,) = struct.unpack("<I", _read_exact(f, 4, path))
            if count > 100_000:
                raise ModelError(f"{path} is corrupt: it claims {count} tensors.")
            variables: dict[str, np.ndarray] = {}
            for _ in range(count):
                name = _read_name(f, path)
                (rank,) = struct.unpack("<B", _read_exact(f, 1, path))
                dims = struct.unpack(f"<{rank}I", _read_exact(f, 4 * rank, path)) if rank else ()
                (dtype_code,) = struct.unpack("<B", _read_exact(f, 1, path))
                (nbytes,) = struct.unpack("<I", _read_exact(f, 4, path))
                raw = _read_exact(f, nbytes, path)
                if dtype_code == 5:  # bfloat16: widen through the upper half of float32
                    arr = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
                elif dtype_code in _DTYPES:
                    arr = np.frombuffer(raw, dtype=_DTYPES[dtype_code])
                else:
                    raise ModelError(f"{path} is corrupt: tensor {name!r} has unknown type {dtype_code}.")
                expected = int(np.prod(dims)) if dims else 1
                if arr.size != expected:
                    raise ModelError(f"{path} is corrupt: tensor {name!r} has the wrong size.")
                variables[name] = arr.reshape(dims)
            (n_alias,) = struct.unpack("<I", _read_exact(f, 4, path))
            aliases = {}
            for _ in range(n_alias):
                alias = _read_name(f, path)
                aliases[alias] = _read_name(f, path)
            if f.read(1):
                raise ModelError(f"{path} is corrupt: unexpected data after the last tensor.")
    except OSError as exc:
        raise ModelError(f"Cannot read {path}: {exc.strerror or exc}.") from exc
    except (UnicodeDecodeError, struct.error, ValueError) as exc:
        raise ModelError(f"{path} is not a valid CTranslate2 model file.") from exc
    if spec != "WhisperSpec":
        raise ModelError(f"{path} holds a CTranslate2 {spec!r} model, not a Whisper model.")
    return Ct2Model(spec=spec, revision=revision, variables=variables, aliases=aliases)


def _layers(model: Ct2Model, prefix: str) -> int:
    pattern = re.compile(rf"^{prefix}/layer_(\d+)/")
    found = {int(m.group(1)) for name in model.variables if (m := pattern.match(name))}
    return max(found) + 1 if found else 0


def _t(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr).astype(np.float32))


def whisper_config_dict(model: Ct2Model) -> dict:
    """Derive the transformers WhisperConfig fields from the tensors."""
    embed = model.get("decoder/embeddings/weight")
    vocab, d_model = embed.shape
    conv1 = model.get("encoder/conv1/weight")
    return {
        "vocab_size": int(vocab),
        "d_model": int(d_model),
        "num_mel_bins": int(conv1.shape[1]),
        "encoder_layers": _layers(model, "encoder"),
        "decoder_layers": _layers(model, "decoder"),
        "encoder_attention_heads": int(model.get("encoder/num_heads")),
        "decoder_attention_heads": int(model.get("decoder/num_heads")),
        "encoder_ffn_dim": int(model.get("encoder/layer_0/ffn/linear_0/weight").shape[0]),
        "decoder_ffn_dim": int(model.get("decoder/layer_0/ffn/linear_0/weight").shape[0]),
        "max_source_positions": int(model.get("encoder/position_encodings/encodings").shape[0]),
        "max_target_positions": int(model.get("decoder/position_encodings/encodings").shape[0]),
        "tie_word_embeddings": True,
    }


def _split_qkv(sd, src: str, dst: str, model: Ct2Model) -> None:
    w = model.get(f"{src}/linear_0/weight")
    b = model.get(f"{src}/linear_0/bias")
    d = w.shape[1]
    if w.shape[0] != 3 * d:
        raise ModelError(f"Unexpected fused attention shape {w.shape} in {src}.")
    if np.any(b[d : 2 * d] != 0):
        raise ModelError(f"{src} has a non-zero key bias, which Whisper does not have.")
    sd[f"{dst}.q_proj.weight"], sd[f"{dst}.k_proj.weight"], sd[f"{dst}.v_proj.weight"] = (
        _t(w[:d]), _t(w[d : 2 * d]), _t(w[2 * d :]))
    sd[f"{dst}.q_proj.bias"], sd[f"{dst}.v_proj.bias"] = _t(b[:d]), _t(b[2 * d :])


def _linear(sd, src: str, dst: str, model: Ct2Model, bias: bool = True) -> None:
    sd[f"{dst}.weight"] = _t(model.get(f"{src}/weight"))
    if bias:
        sd[f"{dst}.bias"] = _t(model.get(f"{src}/bias"))


def _norm(sd, src: str, dst: str, model: Ct2Model) -> None:
    sd[f"{dst}.weight"] = _t(model.get(f"{src}/gamma"))
    sd[f"{dst}.bias"] = _t(model.get(f"{src}/beta"))


def convert_to_transformers(model: Ct2Model) -> tuple[dict, dict[str, torch.Tensor]]:
    """Return (config fields, transformers state dict) in float32. ``proj_out`` is tied, so absent."""
    cfg = whisper_config_dict(model)
    sd: dict[str, torch.Tensor] = {}
    _linear(sd, "encoder/conv1", "model.encoder.conv1", model)
    _linear(sd, "encoder/conv2", "model.encoder.conv2", model)
    for side in ("encoder", "decoder"):
        sd[f"model.{side}.embed_positions.weight"] = _t(model.get(f"{side}/position_encodings/encodings"))
        _norm(sd, f"{side}/layer_norm", f"model.{side}.layer_norm", model)
        for i in range(cfg[f"{side}_layers"]):
            src, dst = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            _split_qkv(sd, f"{src}/self_attention", f"{dst}.self_attn", model)
            _linear(sd, f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj", model)
            _norm(sd, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm", model)
            if side == "decoder":
                _linear(sd, f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj", model)
                kv_w = model.get(f"{src}/attention/linear_1/weight")
                kv_b = model.get(f"{src}/attention/linear_1/bias")
                d = kv_w.shape[1]
                if np.any(kv_b[:d] != 0):
                    raise ModelError(f"{src} has a non-zero cross-attention key bias.")
                sd[f"{dst}.encoder_attn.k_proj.weight"] = _t(kv_w[:d])
                sd[f"{dst}.encoder_attn.v_proj.weight"] = _t(kv_w[d:])
                sd[f"{dst}.encoder_attn.v_proj.bias"] = _t(kv_b[d:])
                _linear(sd, f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj", model)
                _norm(sd, f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm", model)
            _linear(sd, f"{src}/ffn/linear_0", f"{dst}.fc1", model)
            _linear(sd, f"{src}/ffn/linear_1", f"{dst}.fc2", model)
            _norm(sd, f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm", model)
    sd["model.decoder.embed_tokens.weight"] = _t(model.get("decoder/embeddings/weight"))
    return cfg, sd
