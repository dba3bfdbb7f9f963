"""Where Cadence keeps its files (per-user directories, overridable for tests)."""

from __future__ import annotations

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
