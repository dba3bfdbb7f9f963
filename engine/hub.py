"""Download a model from the Hugging Face hub, with progress; fail at once when offline."""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import ModelError
from engine.paths import cache_dir

_ALLOW = ["*.json", "*.safetensors", "*.txt", "*.model", "*.gguf", "model.bin", "*.tiktoken"]


def download_from_hub(repo_id: str, offline_alternatives: str = "") -> Path:
    """Return a local folder holding ``repo_id``'s files (from the local cache when already there).
    ``offline_alternatives`` names the models that work offline, for the sentence when the hub cannot
    be reached."""

    def _offline_error(repo_id: str, why: str) -> ModelError:
        alternatives = f" Models that work offline: {offline_alternatives}." if offline_alternatives else ""
        return ModelError(f"Cannot download '{repo_id}': {why}.{alternatives}")

    try:
        import huggingface_hub
        from huggingface_hub.errors import RepositoryNotFoundError
        from huggingface_hub.utils import enable_progress_bars
    except ImportError as exc:  # pragma: no cover - a dependency of transformers
        raise _offline_error(repo_id, "huggingface_hub is not installed") from exc
    target = cache_dir() / "hub"
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, cache_dir=target, local_files_only=True,
                                                      allow_patterns=_ALLOW))
    except Exception:  # not cached yet: fall through to a download
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes"}:
        raise _offline_error(repo_id, "HF_HUB_OFFLINE is set")
    try:
        huggingface_hub.model_info(repo_id, timeout=10)
    except RepositoryNotFoundError as exc:
        raise ModelError(f"The hub has no model named '{repo_id}' (or it is private).") from exc
    except Exception as exc:  # network down, DNS failure, refused, timed out
        raise _offline_error(repo_id, "the model hub cannot be reached from this machine") from exc
    try:
        # A progress bar per file on stderr, even where a front end silenced library progress bars.
        enable_progress_bars()
        return Path(huggingface_hub.snapshot_download(repo_id, cache_dir=target, allow_patterns=_ALLOW))
    except Exception as exc:
        raise ModelError(f"Downloading '{repo_id}' failed: {exc.__class__.__name__}.") from exc
