"""Small C kernels built on the user's machine, for what PyTorch's CPU kernels do slowly.

``int8_linear.c``: the group-wise int8 weight-only matrix product int8 precision uses on CPU (see
:mod:`engine.kernels`), in 8 lanes (AVX2) and, where the processor has AVX-512, also in 16: the two
sum in different orders, so which one runs is timed once per machine and recorded beside the library
(:func:`int8_lanes`), and every run there gives the same bits; ``layer_ops.c``: the residual add with the RMS norm after it, the rotary
embedding, SiLU(gate) * up and the attention over the KV cache, fused for the same precision's float32
activations (see :mod:`engine.families.decoder`).
Both go into one library, compiled once per machine with the system C compiler and
``-march=native`` (so it uses the vector instructions this processor has, whatever they are) into the
user cache, keyed by the source, the compiler and the processor's flags, and loaded with ctypes (which
releases the GIL during each call). Its OpenMP threads are PyTorch's own: the library asks for
``libgomp.so.1``, which the loader finds already loaded from PyTorch's folder.

Where no compiler is found, or it fails, :func:`int8_library` answers None (once logged) and int8
falls back to PyTorch's per-channel kernel. ``CADENCE_NATIVE=0`` turns these kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_LOADED: list = []  # [library or None], once per process
_LANES: list[int] = []  # [8 or 16]: the int8 kernel this machine runs, once read or timed


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(compiler: str) -> Path:
    """The compiled library in the cache (built now if this source, compiler and processor have none)."""
    from engine.filelock import held
    from engine.paths import cache_dir

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES), compiler, version, " ".join(FLAGS),
                                     _cpu_flags()]).encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"cadence-native-{key}.so"
    if path.is_file():
        return path
    with held(path):  # one process compiles; another waiting here then finds the file
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
            done = subprocess.run([compiler, *FLAGS, "-o", str(partial), *map(str, SOURCES), "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                partial.unlink(missing_ok=True)
                raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output")
            os.replace(partial, path)
    return path


def int8_library():
    """The int8 kernel library (ctypes) built for this machine, or None where it cannot be built."""
    if _LOADED:
        return _LOADED[0]
    library = None
    compiler = _compiler()
    if os.environ.get("CADENCE_NATIVE", "1") == "0":
        log.info("Native kernels are turned off (CADENCE_NATIVE=0).")
    elif compiler is None:
        log.warning("No C compiler found: int8 uses PyTorch's slower per-channel kernel on this machine.")
    else:
        importlib.import_module("torch")  # loads PyTorch's OpenMP runtime first, so the library shares its threads

        try:
            path = _build(compiler)
            library = ctypes.CDLL(str(path))
            library.path = path
            for fn in (library.cadence_int8_linear, library.cadence_int8_linear16):
                fn.restype = None
                fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
            for name in ("cadence_int8_group", "cadence_int8_max_in", "cadence_int8_simd", "cadence_int8_has16"):
                getattr(library, name).restype = ctypes.c_int
            library.cadence_add_rms_norm.restype = library.cadence_rotary.restype = None
            library.cadence_add_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                                     ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
            library.cadence_silu_mul.restype = library.cadence_attend.restype = None
            for fn in (library.cadence_attend_memory_f32, library.cadence_attend_memory_f16):
                fn.restype = None
                fn.argtypes = ([ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
                               + [ctypes.c_float, ctypes.c_void_p])
            library.cadence_silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                                 ctypes.c_void_p]
            library.cadence_attend.argtypes = ([ctypes.c_void_p, ctypes.c_long] * 3 + [ctypes.c_long] * 4
                                               + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
                                               + [ctypes.c_float, ctypes.c_void_p])
            library.cadence_rotary.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                               ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("The int8 kernel could not be built here (%s): int8 uses PyTorch's per-channel kernel.", exc)
            library = None
    _LOADED.append(library)
    return library


def int8_group() -> int:
    """Inputs per int8 scale in the native kernel (0 where there is no native kernel)."""
    library = int8_library()
    return library.cadence_int8_group() if library is not None else 0


def int8_linear(x, q, scale, bias=None, lanes: int | None = None):
    """``x @ (q * scale per group).T + bias`` for float32 CPU tensors x [rows, in], q [out, in] int8,
    scale [out, in / group] float32, bias [out] or None: a new float32 [rows, out]. ``lanes``: 8 or 16
    to pick a kernel (tests, timing); None: this machine's (:func:`int8_lanes`)."""
    import torch

    library = int8_library()
    rows, out = x.shape[0], q.shape[0]
    y = torch.empty(rows, out, dtype=torch.float32)
    if rows:
        run = library.cadence_int8_linear16 if (lanes or int8_lanes()) == 16 else library.cadence_int8_linear
        run(x.data_ptr(), rows, x.shape[1], q.data_ptr(), scale.data_ptr(),
            bias.data_ptr() if bias is not None else None, out, y.data_ptr())
    return y


def int8_lanes() -> int:
    """The int8 kernel's width on this machine: 16 where the processor has AVX-512 and the 16-lane
    kernel measured faster than the 8-lane one (one decoder-sized layer at 1 and 8 rows, interleaved,
    best of 7), else 8. Recorded beside the library, so every run on this machine sums alike."""
    if _LANES:
        return _LANES[0]
    library = int8_library()
    lanes = 8
    if library is not None and library.cadence_int8_has16():
        from engine.filelock import held

        record = library.path.with_suffix(".lanes")
        with held(record):
            try:
                lanes = int(record.read_text())
            except (OSError, ValueError):
                lanes = _time_lanes()
                record.write_text(str(lanes))
        lanes = lanes if lanes in (8, 16) else 8
    _LANES.append(lanes)
    return lanes


def _time_lanes() -> int:
    import time

    import torch

    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (1536, 576), generator=generator, dtype=torch.int8)
    scale = torch.rand(1536, 576 // int8_group(), generator=generator) * 0.01
    rows = [torch.randn(n, 576, generator=generator) for n in (1, 8)]
    best = {8: float("inf"), 16: float("inf")}
    for _ in range(7):
        for lanes in best:
            start = time.perf_counter()
            for x in rows:
                for _ in range(4):
                    int8_linear(x, q, scale, lanes=lanes)
            best[lanes] = min(best[lanes], time.perf_counter() - start)
    log.info("int8 kernel: 8 lanes %.2f ms, 16 lanes %.2f ms (a layer at 1 and 8 rows, 4 times)",
             best[8] * 1e3, best[16] * 1e3)
    return 16 if best[16] < best[8] else 8


def int8_fits(in_features: int) -> bool:
    """Whether the native kernel takes a layer with this many inputs."""
    library = int8_library()
    return (library is not None and in_features % library.cadence_int8_group() == 0
            and in_features <= library.cadence_int8_max_in())


def add_rms_norm(x, h, weight, eps: float):
    """(x + h, rms_norm(x + h) * weight) for float32 CPU rows x, h [rows, d] (contiguous), weight [d];
    with h None, (x, rms_norm(x) * weight). New tensors; x and h are left as they are."""
    import torch

    x, h = x.contiguous(), h.contiguous() if h is not None else None
    rows, d = x.shape
    y = torch.empty_like(x)
    total = torch.empty_like(x) if h is not None else x
    int8_library().cadence_add_rms_norm(x.data_ptr(), h.data_ptr() if h is not None else None, rows, d,
                                        weight.data_ptr(), eps, total.data_ptr(), y.data_ptr())
    return total, y


def rotary(x, heads: int, cos, sin, table_rows) -> None:
    """Rotates, in place, the first ``heads`` heads of every row of x [rows, >= heads * dim] (float32,
    rows contiguous inside) by the tables cos, sin [positions, dim] at each row's ``table_rows`` (int64)."""
    dim = cos.shape[1]
    int8_library().cadence_rotary(x.data_ptr(), x.shape[0], x.stride(0), heads, dim, cos.data_ptr(),
                                  sin.data_ptr(), table_rows.data_ptr())


def _heads_packed(t):
    """t [R, heads, D] with each row's heads side by side (the row stride may be anything)."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def attend(q, k, v, cache_k, cache_v, row_slots, row_positions, window: int | None, scale: float):
    """Causal self-attention of a step's rows (float32 CPU): q [R, H, D], k and v [R, Hkv, D], written
    into cache_k, cache_v [slots, Hkv, positions, D] (contiguous) at each row's slot and position
    (int64 [R]) first; a row sees its slot's positions up to its own (the last ``window`` of them
    where given). Returns [R, H * D]. Each (row, head) is computed alone (engine/native/layer_ops.c)."""
    import torch

    rows, heads, dim = q.shape
    q, k, v = _heads_packed(q), _heads_packed(k), _heads_packed(v)
    row_slots, row_positions = row_slots.contiguous(), row_positions.contiguous()  # one slot's rows: stride 0
    out = torch.empty(rows, heads * dim, dtype=torch.float32)
    int8_library().cadence_attend(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                  rows, heads, k.shape[1], dim, row_slots.data_ptr(), row_positions.data_ptr(),
                                  cache_k.data_ptr(), cache_v.data_ptr(), cache_k.stride(0), cache_k.stride(1),
                                  window or 0, scale, out.data_ptr())
    return out


def silu_mul(gate_up, f: int):
    """SiLU(gate) * up for float32 CPU rows gate_up [R, >= 2f] (gate, then up; rows contiguous inside):
    a new [R, f]."""
    import torch

    out = torch.empty(gate_up.shape[0], f, dtype=torch.float32)
    int8_library().cadence_silu_mul(gate_up.data_ptr(), gate_up.shape[0], f, gate_up.stride(0), out.data_ptr())
    return out


def attend_memory(q, memory_k, memory_v, row_slots, length: int, scale: float):
    """Attention of a step's rows (float32 CPU) q [R, H, D] over the first ``length`` positions of their
    slots' fixed memory memory_k, memory_v [slots, H, positions, D] (contiguous; float32, or float16 read
    as such and summed in float32): Whisper's cross-attention. Returns [R, H * D], each (row, head)
    computed alone (engine/native/layer_ops.c)."""
    import torch

    rows, heads, dim = q.shape
    q, row_slots = _heads_packed(q), row_slots.contiguous()
    out = torch.empty(rows, heads * dim, dtype=torch.float32)
    library = int8_library()
    run = library.cadence_attend_memory_f16 if memory_k.dtype == torch.float16 else library.cadence_attend_memory_f32
    run(q.data_ptr(), q.stride(0), rows, heads, dim, row_slots.data_ptr(), memory_k.data_ptr(), memory_v.data_ptr(),
        memory_k.stride(0), memory_k.stride(1), length, scale, out.data_ptr())
    return out
