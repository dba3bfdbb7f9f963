"""The larger Whisper models by name: small, medium, large-v3 and large-v3-turbo.

No registry package ships their weights, so each is found, in this order, in a folder of its
name under ``<data folder>/models/`` (a transformers or CTranslate2 Whisper folder a person put
there), in the hub download cache, or downloaded from the hub where a network exists. large-v3 and
turbo read 128 mel bands (the front end follows ``num_mel_bins``); turbo has a 4-layer decoder
under large-v3's 32-layer encoder. Listing them never downloads anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelError
from engine.paths import cache_dir, data_dir


@dataclass(frozen=True)
class WhisperSize:
    name: str
    hub_id: str
    parameters: str  # what a person reads: "244 M"
    download_bytes: int  # the weights' size on the hub (safetensors)
    mel_bins: int
    encoder_layers: int
    decoder_layers: int
    description: str

    @property
    def size_text(self) -> str:
        gb = self.download_bytes / 1e9
        return f"{gb:.1f} GB" if gb >= 1 else f"{self.download_bytes / 1e6:.0f} MB"


SIZES: dict[str, WhisperSize] = {
    s.name: s
    for s in (
        WhisperSize("whisper-small", "openai/whisper-small", "244 M", 967_000_000, 80, 12, 12,
                    "Whisper small, multilingual"),
        WhisperSize("whisper-medium", "openai/whisper-medium", "769 M", 3_060_000_000, 80, 24, 24,
                    "Whisper medium, multilingual"),
        WhisperSize("whisper-large-v3", "openai/whisper-large-v3", "1550 M", 3_090_000_000, 128, 32, 32,
                    "Whisper large-v3, multilingual, 128 mel bands"),
        WhisperSize("whisper-large-v3-turbo", "openai/whisper-large-v3-turbo", "809 M", 1_620_000_000, 128, 32, 4,
                    "Whisper large-v3-turbo: large-v3's encoder, a 4-layer decoder"),
    )
}


def models_dir() -> Path:
    """Where a person may put model folders by name (``<data folder>/models/whisper-large-v3``)."""
    return data_dir() / "models"


def local_folder(name: str) -> Path | None:
    folder = models_dir() / name
    return folder if (folder / "model.bin").is_file() or (folder / "config.json").is_file() else None


def hub_cached(size: WhisperSize) -> bool:
    """Whether the hub download cache holds the model (no network is touched)."""
    snapshots = cache_dir() / "hub" / f"models--{size.hub_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any((s / "config.json").is_file() for s in snapshots.iterdir())


def present(name: str) -> bool:
    return local_folder(name) is not None or hub_cached(SIZES[name])


def locate(name: str, path_source, offline_alternatives: str):
    """The ModelSource of a larger Whisper by name (``path_source`` reads a folder); ModelError when it is
    neither here nor downloadable."""
    size = SIZES[name]
    folder = local_folder(name)
    if folder is None:
        from engine.hub import download_from_hub

        try:
            folder = download_from_hub(size.hub_id, offline_alternatives)
        except ModelError as exc:
            raise ModelError(f"{name} is not on this machine (put its folder at {models_dir() / name}, or "
                             f"connect to the network to download {size.hub_id}, {size.size_text}). {exc}") from None
    source = path_source(folder)
    if source.family != "whisper":
        raise ModelError(f"{folder} does not hold a Whisper model, so it cannot stand for {name}.")
    from dataclasses import replace

    return replace(source, name=name, origin=f"{name} from {folder}")


def rows() -> list[dict]:
    """The larger models for the model list: size, and whether they are here."""
    out = []
    for size in SIZES.values():
        here = present(size.name)
        out.append({
            "name": size.name, "family": "whisper", "format": "transformers", "source": f"hub {size.hub_id}",
            "description": f"{size.description} ({size.parameters} parameters)", "available": here,
            "detail": str(local_folder(size.name) or "in the hub download cache") if here else
            f"not downloaded ({size.size_text}); put its folder at {models_dir() / size.name} or download it "
            f"with a network", "default": False, "size": size.size_text, "present": here,
        })
    return out
