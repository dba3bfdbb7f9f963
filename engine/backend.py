"""Which compute backends this machine has, and which one to use (PyTorch is imported only when asked)."""

from __future__ import annotations

from engine.errors import RequestError

BACKENDS = ("auto", "cpu", "cuda", "mps")


def available_backends() -> list[str]:
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():  # ROCm builds of PyTorch report through torch.cuda as well
        found.insert(0, "cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.insert(0, "mps")
    return found


def resolve_backend(name: str = "auto") -> str:
    """Turn auto/cpu/cuda/mps into a torch device string, refusing one that is absent here."""
    name = (name or "auto").lower()
    if name not in BACKENDS:
        raise RequestError(f"Unknown backend '{name}' (choose from {', '.join(BACKENDS)}).")
    present = available_backends()
    if name == "auto":
        return present[0]
    if name not in present:
        raise RequestError(f"The {name} backend is not available on this machine (available: {', '.join(present)}).")
    return name


def describe_backend(device: str) -> str:
    import torch

    if device == "cuda":
        return f"CUDA ({torch.cuda.get_device_name(0)})"
    if device == "mps":
        return "Apple Metal (MPS)"
    threads = torch.get_num_threads()
    return f"CPU ({threads} thread{'s' if threads != 1 else ''})"


DTYPE_ENV = "CADENCE_DTYPE"  # float32 | float16 | bfloat16: overrides the per-backend choice


def default_dtype(device: str, family: str):
    """The dtype the loaded (reference) model is kept in: float32 on CPU (exact against the
    references; the batched decoders choose their own precision, see engine.kernels); on a GPU half
    precision, as its users expect: float16 for Whisper (what CTranslate2 runs there), bfloat16 for
    chat models where the GPU supports it (float16 overflows in some)."""
    import os

    import torch

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    chosen = os.environ.get(DTYPE_ENV, "").strip().lower()
    if chosen:
        if chosen not in dtypes:
            raise RequestError(f"{DTYPE_ENV} must be one of {', '.join(dtypes)} (got '{chosen}').")
        return dtypes[chosen]
    if device == "cuda":
        if family == "chat" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float16
    if device == "mps":
        return torch.float16
    return torch.float32


def return_freed_memory(collect: bool = True) -> None:
    """Collect what is unreachable and hand the C allocator's free pages back to the system. glibc keeps
    freed heap pages for reuse, and PyTorch's mid-size tensors land on that heap once its mmap threshold
    has risen: without this, the float32 and int8 decoders that precision auto builds, times and drops on
    a model's first load on a machine stayed in the process's resident memory (SmolLM2, an empty cache:
    1.74-1.84 GiB after its first answer, 1.30-1.33 with this; bench/resident_memory.py --fresh-cache). Elsewhere than glibc it only collects. ``collect=False`` skips the collection of reference
    cycles (a full one takes 0.2 s once PyTorch and transformers are imported)."""
    import ctypes
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # no malloc_trim here (not glibc)
        pass
