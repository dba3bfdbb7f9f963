"""Where Cadence keeps its files (per-user directories, overridable for tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """Converted model weights and calibration results: safe to delete, rebuilt on demand."""
    root = os.environ.get("CADENCE_CACHE_DIR")
    path = Path(root) if root else Path(platformdirs.user_cache_dir("cadence", appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    """The user's data: job store, conversations, recordings."""
    root = os.environ.get("CADENCE_DATA_DIR")
    path = Path(root) if root else Path(platformdirs.user_data_dir("cadence", appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data) -> None:
    """``data`` as indented JSON at ``path``, whole or not at all: written beside it under this process's
    own name, then renamed over it, so a reader (or another process writing the same cache) never sees
    half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
