"""Load a resolved model into memory, converting and caching foreign formats as safetensors.

CTranslate2 Whisper and GGUF models are converted once into a transformers folder under the
user cache directory, keyed by the source files' identity (path, size, modification time) and the
converter version, so the second load reads plain safetensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import ModelError
from engine.models import (
    CHAT,
    CTRANSLATE2,
    GGUF,
    GGUF_CHAT_ARCHITECTURES,
    TRANSFORMERS,
    WHISPER,
    ModelSource,
    resolve,
    supported_chat_architectures,
)
from engine.filelock import held
from engine.paths import cache_dir

log = logging.getLogger(__name__)
# 2: a GGUF chat model keeps its tied output weights as model.embed_tokens.weight (was lm_head.weight)
CONVERTER_VERSION = 2


@dataclass
class LoadReport:
    seconds: float
    from_cache: bool
    cache_path: str | None


@dataclass
class LoadedModel:
    source: ModelSource
    model: torch.nn.Module
    tokenizer: object  # WhisperTokenizer for Whisper, a transformers tokenizer for chat
    report: LoadReport
    extra: dict = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.source.family


def source_key(source: ModelSource) -> str:
    h = hashlib.sha256(f"{source.format}:{CONVERTER_VERSION}".encode())
    for path in source.identity_files():
        st = path.stat()
        h.update(f"|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def converted_dir(source: ModelSource) -> Path:
    """One folder per source file identity, whatever name the model was asked for by."""
    return cache_dir() / "converted" / f"{source.format}-{source_key(source)}"


def _build_atomically(target: Path, build, manifest: dict) -> None:
    """Run ``build(tmp_folder)`` and move the folder into place only when it completed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        (tmp / "complete").write_text(json.dumps(manifest, indent=2))
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _convert_ct2_whisper(source: ModelSource, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import WhisperConfig

    from engine.whisper.ct2 import convert_to_transformers, read_ct2_model
    from engine.whisper.tokens import WhisperTokenizer

    ct2 = read_ct2_model(list(source.weights))
    fields, state = convert_to_transformers(ct2)
    tok = WhisperTokenizer.from_folder(source.folder, vocab_size=fields["vocab_size"])
    config = WhisperConfig(
        **fields,
        decoder_start_token_id=tok.sot,
        bos_token_id=tok.eot,
        eos_token_id=tok.eot,
        pad_token_id=tok.eot,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "config.json"):
        if (source.folder / name).is_file():
            shutil.copy(source.folder / name, out / ("ct2_" + name if name == "config.json" else name))


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_architecture(path: Path) -> str:
    """The ``general.architecture`` a GGUF file names, read from its header alone (the metadata
    before it is skipped, the tensors are never read)."""
    import struct

    def unreadable(why: str) -> ModelError:
        return ModelError(f"{path} could not be read as a GGUF chat model ({why}).")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size

            def read(n: int) -> bytes:
                if n > size - f.tell():
                    raise EOFError("the file ends before its header does")
                return f.read(n)

            def number(fmt: str):
                return struct.unpack("<" + fmt, read(struct.calcsize(fmt)))[0]

            def skip(kind: int) -> None:
                if kind in _GGUF_SCALARS:
                    read(_GGUF_SCALARS[kind])
                elif kind == _GGUF_STRING:
                    read(number("Q"))
                elif kind == _GGUF_ARRAY:
                    item, count = number("I"), number("Q")
                    if item in _GGUF_SCALARS:
                        read(_GGUF_SCALARS[item] * count)
                    else:
                        for _ in range(count):
                            skip(item)
                else:
                    raise ValueError(f"unknown value type {kind}")

            if read(4) != b"GGUF":
                raise unreadable("it does not start with GGUF")
            version = number("I")
            if version not in (2, 3):
                raise unreadable(f"GGUF version {version} is not one Cadence reads")
            number("Q")  # tensors
            for _ in range(number("Q")):  # metadata entries
                key, kind = read(number("Q")).decode("utf-8"), number("I")
                if key == "general.architecture" and kind == _GGUF_STRING:
                    return read(number("Q")).decode("utf-8")
                skip(kind)
    except (OSError, ValueError, EOFError, UnicodeDecodeError, struct.error) as exc:
        raise unreadable(f"{exc.__class__.__name__}: {exc}") from exc
    raise unreadable("it names no architecture")


_GGUF_PATCH = threading.Lock()  # one conversion at a time patches the gguf module (each process has its own)


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within this block, each GGUF file is parsed once and gguf's tensor-name map built once per
    architecture. transformers parses the file for the tokenizer, the config and the weights (2-3 s each
    for SmolLM2's 49k-token vocabulary on a 2-core machine) and builds the name map again for every
    module of the model (397 times, 4 s). SmolLM2's conversion took 17.6 s before, 11.9 s after (beside a
    running test suite, AMD EPYC, 2 cores). Both are only read, so sharing them changes nothing in the
    converted folder (checked byte for byte)."""
    import gguf as gguf_py

    real_reader, real_map = gguf_py.GGUFReader, gguf_py.get_tensor_name_map
    readers: dict[tuple, object] = {}
    maps: dict[tuple, object] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = real_map(arch, n_blocks)
        return maps[arch, n_blocks]

    with _GGUF_PATCH:
        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader, name_map
        try:
            yield
        finally:
            gguf_py.GGUFReader, gguf_py.get_tensor_name_map = real_reader, real_map



def _convert_gguf_chat(source: ModelSource, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = source.weights[0]
    architecture = gguf_architecture(gguf)  # refused before anything is converted
    if architecture not in GGUF_CHAT_ARCHITECTURES:
        raise ModelError(f"{gguf.name} is a GGUF of the '{architecture}' architecture, which Cadence cannot run: "
                         f"chat GGUF files must be one of {', '.join(GGUF_CHAT_ARCHITECTURES)} "
                         f"(the engine runs {supported_chat_architectures()}).")
    try:
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:
        raise ModelError(f"{gguf} could not be read as a GGUF chat model ({exc.__class__.__name__}: {exc}).") from exc
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    state = model.state_dict()
    if model.config.tie_word_embeddings:  # one tensor under two names: kept as the embedding, as transformers
        state.pop("lm_head.weight", None)  # saves it, so every reader (vLLM too) ties the output back to it
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


def _transformers_folder(source: ModelSource, foreign_format: str, convert, kind: str) -> tuple[Path, bool]:
    """A transformers folder for ``source`` (converted once from ``foreign_format``), and whether
    it was ready without converting."""
    if source.format == TRANSFORMERS:
        return source.folder, True
    if source.format != foreign_format:
        raise ModelError(f"{source.name} is a {source.format} model, not {kind}.")
    target = converted_dir(source)
    if (target / "complete").is_file():
        return target, True
    with held(target):  # another process converting the same model: wait for it and use its folder
        if (target / "complete").is_file():
            return target, True
        log.info("Converting %s into %s (first load only)", source.name, target)
        manifest = {"converter": CONVERTER_VERSION, "name": source.name, "origin": source.origin,
                    "files": [str(p) for p in source.identity_files()]}
        _build_atomically(target, lambda tmp: convert(source, tmp), manifest)
    return target, False


def load_whisper(source: ModelSource, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    from transformers import WhisperForConditionalGeneration

    from engine.whisper.tokens import WhisperTokenizer

    t0 = time.perf_counter()
    folder, cached = _transformers_folder(source, CTRANSLATE2, _convert_ct2_whisper, "a Whisper model")
    try:
        model = WhisperForConditionalGeneration.from_pretrained(str(folder), dtype=dtype)
    except Exception as exc:
        raise ModelError(f"{source.name} could not be loaded as Whisper ({exc.__class__.__name__}).") from exc
    model.to(device).eval()
    tok = WhisperTokenizer.from_folder(folder, vocab_size=model.config.vocab_size)
    report = LoadReport(time.perf_counter() - t0, cached, str(folder) if folder != source.folder else None)
    return LoadedModel(source, model, tok, report)


def load_chat(source: ModelSource, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    folder, cached = _transformers_folder(source, GGUF, _convert_gguf_chat, "a chat model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    except Exception as exc:
        raise ModelError(f"{source.name} could not be loaded as a chat model ({exc.__class__.__name__}).") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"{source.name} has no chat template, so it cannot hold a conversation.")
    model.to(device).eval()
    report = LoadReport(time.perf_counter() - t0, cached, str(folder) if folder != source.folder else None)
    return LoadedModel(source, model, tokenizer, report)


def load(name_or_path: str, family: str | None = None, device: str = "cpu",
         dtype: torch.dtype | None = None) -> LoadedModel:
    """Resolve and load a model; ``family`` (WHISPER or CHAT) checks it is the kind wanted; the
    dtype defaults to the backend's (float32 on CPU, half precision on a GPU)."""
    from engine.backend import default_dtype

    source = resolve(name_or_path)
    if family and source.family != family:
        kind = "a speech-to-text (Whisper)" if family == WHISPER else "a chat"
        raise ModelError(f"{source.name} is not {kind} model.")
    dtype = dtype or default_dtype(device, source.family)
    loader = load_whisper if source.family == WHISPER else load_chat
    return loader(source, device, dtype)


__all__ = ["LoadedModel", "LoadReport", "load", "load_whisper", "load_chat", "converted_dir", "CHAT", "WHISPER"]
