from pathlib import Path

RESOURCES = Path(__file__).resolve().parent.parent / "resources"


def icon_path() -> Path:
    return RESOURCES / "cadence.svg"
