"""Small C kernels built on the user's machine, for what PyTorch's CPU kernels do slowly.

``int8_linear.c``: the group-wise int8 matrix product int8 precision uses on CPU (see
:mod:`engine.kernels`), in three kernels (:data:`INT8_KERNELS`): float32 activations summed in 8 lanes
(AVX2) or, where the processor has AVX-512, 16; or activations rounded to int8 per 32 inputs and
multiplied as integers (llama.cpp's Q8_0 product; for generated tokens where ``auto`` finds it within
quality bounds, :func:`int8_kernels`). ``q4_linear.c``: the same products over 4-bit weights (a scale and a
minimum per 32), for layers whose weights already are 4-bit and are kept so (:mod:`engine.kernels`). They sum
in different orders, so which float one runs is timed once per machine and recorded beside the library,
and every run there gives the same bits; ``layer_ops.c``: the residual add with the RMS norm after it, the rotary
embedding, SiLU(gate) * up and the attention over the KV cache, fused for the same precision's float32
activations (see :mod:`engine.families.decoder`); ``decoder_layers.c``: a whole step's layers of the
Llama layout in one call of those same kernels (:class:`DecoderLayers`).
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
_KERNEL: list[tuple[str, str]] = []  # [(prompt rows', generated rows' kernel)] this machine runs, once read or timed

# The int8 kernels, by the name recorded for a machine. Each sums a row alone, in an order of its own.
INT8_KERNELS = {
    "f32x8": "float32 activations, 8-lane sums",
    "f32x16": "float32 activations, 16-lane sums (AVX-512)",
    "i8dot": "activations rounded to int8 per 32 inputs, integer dot products (as llama.cpp's Q8_0)",
    "i16dot": "activations rounded to int16 per 32 inputs, integer dot products (nearly as exact as float32 activations)",
}


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
            for fn in (library.cadence_int8_linear, library.cadence_int8_linear16, library.cadence_int8_linear_int8_dot,
                       library.cadence_int8_linear_int16_dot):
                fn.restype = None
                fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
            for name in ("cadence_int8_group", "cadence_int8_max_in", "cadence_int8_simd", "cadence_int8_has16",
                         "cadence_int8_has_int8_dot"):
                getattr(library, name).restype = ctypes.c_int
            library.cadence_add_rms_norm.restype = library.cadence_rotary.restype = None
            library.cadence_add_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                                     ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
            library.cadence_embed_norm.restype = None
            library.cadence_embed_norm.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
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
            library.cadence_int8_linear_by_kind.restype = library.cadence_q4_linear.restype = None
            library.cadence_int8_linear_by_kind.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] + [
                ctypes.c_void_p] * 4 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            library.cadence_q4_linear.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] + [
                ctypes.c_void_p] * 4 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
            library.cadence_decoder_layers.restype = None
            library.cadence_decoder_layers.argtypes = ([ctypes.c_void_p] + [ctypes.c_long] * 8 + [ctypes.c_float] * 2
                                                       + [ctypes.c_void_p] + [ctypes.c_int] * 3
                                                       + [ctypes.c_void_p] * 5 + [ctypes.c_long] * 2
                                                       + [ctypes.c_void_p] * 3)
            library.cadence_decoder_layers_work.restype = library.cadence_decoder_layers_per_layer.restype = ctypes.c_long
            library.cadence_decoder_layers_work.argtypes = [ctypes.c_long] * 6
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


def int8_linear(x, q, scale, bias=None, kernel: str | None = None, minimum=None):
    """``x @ (q * scale per group).T + bias`` for float32 CPU tensors x [rows, in], q [out, in] int8,
    scale [out, in / group] float32, bias [out] or None: a new float32 [rows, out]. ``kernel``: one of
    INT8_KERNELS (tests, timing); None: this machine's (:func:`int8_kernel`). With ``minimum`` [out, in /
    group], 4-bit weights: q [out, in / 2] uint8 codes (q4_linear.c), weight = scale * code + minimum."""
    import torch

    library = int8_library()
    rows, out = x.shape[0], q.shape[0]
    y = torch.empty(rows, out, dtype=torch.float32)
    if rows and minimum is not None:
        library.cadence_q4_linear(x.data_ptr(), rows, x.shape[1], q.data_ptr(), scale.data_ptr(), minimum.data_ptr(),
                                  bias.data_ptr() if bias is not None else None, out, y.data_ptr(),
                                  list(INT8_KERNELS).index(kernel or int8_kernel()))
    elif rows:
        run = {"f32x16": library.cadence_int8_linear16, "i8dot": library.cadence_int8_linear_int8_dot,
               "i16dot": library.cadence_int8_linear_int16_dot}.get(kernel or int8_kernel(), library.cadence_int8_linear)
        run(x.data_ptr(), rows, x.shape[1], q.data_ptr(), scale.data_ptr(),
            bias.data_ptr() if bias is not None else None, out, y.data_ptr())
    return y


def int8_linear_by_kind(x, q, scale, bias, generated, kernels: tuple[str, str], minimum=None):
    """As :func:`int8_linear`, each row on its kind's kernel: ``generated`` (uint8 [rows]) 1 for a row of
    a generated token, 0 for a prompt's; ``kernels``: (prompt rows', generated rows') names in INT8_KERNELS.
    A row's result depends on its own kind only. ``minimum``: as :func:`int8_linear`."""
    import torch

    library = int8_library()
    rows, out = x.shape[0], q.shape[0]
    y = torch.empty(rows, out, dtype=torch.float32)
    if rows:
        prompt, generated_kernel = (list(INT8_KERNELS).index(kernel) for kernel in kernels)
        library.cadence_int8_linear_by_kind(x.data_ptr(), rows, x.shape[1], q.data_ptr(), scale.data_ptr(),
                                            _pointer(minimum), _pointer(bias), out, y.data_ptr(),
                                            generated.data_ptr(), prompt, generated_kernel)
    return y


def int8_kernels_here() -> list[str]:
    """The int8 kernels this processor runs as themselves (16 lanes need AVX-512, the integer ones AVX2)."""
    library = int8_library()
    if library is None:
        return []
    integer = library.cadence_int8_has_int8_dot()
    return ["f32x8"] + ["f32x16"] * library.cadence_int8_has16() + ["i8dot", "i16dot"] * integer


def int8_kernels() -> tuple[str, str]:
    """The int8 kernels this machine runs by default (names in INT8_KERNELS): one for prompt rows (and
    rows of unknown kind), one for rows of generated tokens. Both are the faster float kernel over a
    decoder's layers at 1 and 8 rows (interleaved, best of 7), recorded beside the library so every run
    here sums alike. The integer kernel decodes faster but rounds the activations: a decoder runs its
    generated rows on it only where ``auto`` measured it within quality bounds for that model
    (:meth:`DecoderLayers.integer_dot`, engine.precision), or where ``CADENCE_INT8_KERNEL`` asks: one
    name for both kinds, or ``PROMPT,GENERATED`` (e.g. ``f32x16,i8dot``); not recorded."""
    if _KERNEL:
        return _KERNEL[0]
    here = int8_kernels_here()
    kernels = ("f32x8", "f32x8")
    asked = [name.strip() for name in os.environ.get("CADENCE_INT8_KERNEL", "").split(",") if name.strip()]
    if asked:
        if len(asked) > 2 or not set(asked) <= set(here):
            raise RuntimeError(f"CADENCE_INT8_KERNEL must name one or two of this processor's int8 kernels "
                               f"({', '.join(here)}), as KERNEL or PROMPT,GENERATED.")
        kernels = (asked[0], asked[-1])
    elif "f32x16" in here:
        from engine.filelock import held

        record = int8_library().path.with_suffix(".int8-kernel")
        with held(record):
            try:
                kernel = record.read_text().strip()
            except OSError:
                kernel = ""
            if kernel not in ("f32x8", "f32x16"):
                kernel = _time_kernels(["f32x8", "f32x16"])
                record.write_text(kernel)
        kernels = (kernel, kernel)
    _KERNEL.append(kernels)
    return kernels


def int8_kernel() -> str:
    """The int8 kernel for rows whose kind the caller does not give (every product outside
    :class:`DecoderLayers`): the prompt rows' kernel of :func:`int8_kernels`."""
    return int8_kernels()[0]


def _time_kernels(kernels: list[str]) -> str:
    import time

    import torch

    generator = torch.Generator().manual_seed(0)
    layers = [(torch.randint(-127, 128, (1536, 576), generator=generator, dtype=torch.int8),
               torch.rand(1536, 576 // int8_group(), generator=generator) * 0.01) for _ in range(6)]  # beyond L2
    rows = [torch.randn(n, 576, generator=generator) for n in (1, 8)]
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(7):
        for kernel in best:
            start = time.perf_counter()
            for x in rows:
                for q, scale in layers:
                    int8_linear(x, q, scale, kernel=kernel)
            best[kernel] = min(best[kernel], time.perf_counter() - start)
    log.info("int8 kernels (6 layers at 1 and 8 rows): %s",
             ", ".join(f"{kernel} {seconds * 1e3:.2f} ms" for kernel, seconds in best.items()))
    return min(best, key=best.get)


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


def embed_norm(tokens, table, weight, eps: float):
    """(x, rms_norm(x) * weight) for x the rows of ``table`` [vocab, d] (float32, contiguous) at ``tokens``
    (int64 [rows]): the same values as F.embedding, then :func:`add_rms_norm`, in one call."""
    import torch

    tokens = tokens.contiguous()
    x = torch.empty(tokens.shape[0], table.shape[1], dtype=torch.float32)
    normed = torch.empty_like(x)
    int8_library().cadence_embed_norm(tokens.data_ptr(), tokens.shape[0], table.data_ptr(), table.shape[1],
                                      weight.data_ptr(), eps, x.data_ptr(), normed.data_ptr())
    return x, normed


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


class DecoderLayers:
    """A decoder's layers (engine.families.decoder, Llama layout, int8 on the native kernel) run in one C
    call a step (decoder_layers.c): the same kernels, in the same order, as the Python loop, without its
    per-call costs. The weights' addresses are gathered once, the caches' every step."""

    def __init__(self, decoder):
        import torch

        library = int8_library()
        self.library = library  # (the decoder is not kept: it holds this object, and is passed to each call)
        self.per_layer = library.cadence_decoder_layers_per_layer()
        layers = decoder.layers
        self.pointers = (ctypes.c_void_p * (self.per_layer * len(layers)))()
        for i, layer in enumerate(layers):
            entries = []
            for linear in (layer.qkv, layer.out, layer.gate_up, layer.down):
                entries += [linear.q.data_ptr(), linear.scale.data_ptr(), _pointer(linear.minimum), _pointer(linear.bias)]
            following = layers[i + 1].input_norm.data_ptr() if i + 1 < len(layers) else None
            entries += [layer.ffn_norm.data_ptr(), following, None, None]
            self.pointers[i * self.per_layer : (i + 1) * self.per_layer] = entries
        self.windows = torch.tensor([layer.window or 0 for layer in layers], dtype=torch.long)
        prompt, generated = (list(INT8_KERNELS).index(kernel) for kernel in int8_kernels())
        self.kernels = [prompt, generated, generated]  # prompt rows', generated rows', generated rows' in down

    def _point_at_cache(self, cache) -> None:
        """The layers' key and value caches' addresses, read again every step (a cache grows by moving)."""
        n = self.per_layer
        self.pointers[n - 2 :: n] = [k.data_ptr() for k in cache.k]
        self.pointers[n - 1 :: n] = [v.data_ptr() for v in cache.v]

    def __call__(self, d, x, normed, batch, table_rows):
        """Every layer over the step's rows: x [R, d] (the stream entering layer 0, float32, updated in
        place) and ``normed`` its input norm; returns x after the last layer. Rows of generated tokens
        (``batch.generated``) run on the generated rows' kernel, the others on the prompt rows'. ``d``:
        the decoder this was made for."""
        import torch

        self._point_at_cache(d.cache)
        rows = x.shape[0]
        work = torch.empty(self.library.cadence_decoder_layers_work(rows, d.hidden, d.heads, d.kv_heads, d.head_dim,
                                                                    d._ffn), dtype=torch.float32)
        cos, sin = d.tables[d._rope_kinds[0]]
        slots, positions = batch.row_slots.contiguous(), batch.row_positions.contiguous()
        cache_k = d.cache.k[0]
        self.library.cadence_decoder_layers(
            self.pointers, len(d.layers), self.windows.data_ptr(), rows, d.hidden, d.heads, d.kv_heads, d.head_dim,
            d._ffn, d.eps, d.scale or d.head_dim ** -0.5, _pointer(batch.generated), *self.kernels,
            cos.data_ptr(), sin.data_ptr(),
            table_rows.data_ptr(), slots.data_ptr(), positions.data_ptr(), cache_k.stride(0), cache_k.stride(1),
            x.data_ptr(), normed.data_ptr(), work.data_ptr())
        return x

    def integer_dot(self, on: bool, down: bool = True, bits: int = 8) -> bool:
        """Run generated tokens' rows on an integer kernel (on) or on the prompt rows' kernel; whether they
        now run on one. ``bits``: 8 rounds their activations to int8 (i8dot), 16 to int16 (i16dot: about as
        fast, and next to float's results); ``down`` False runs the MLP's down projection on i16dot whatever
        ``bits`` says (its inputs carry the outliers that rounding to int8 loses most on). Where
        ``CADENCE_INT8_KERNEL`` names the kernels, those stay."""
        here = int8_kernels_here()
        names = list(INT8_KERNELS)
        if not os.environ.get("CADENCE_INT8_KERNEL") and "i8dot" in here:
            first = names.index("i8dot" if bits == 8 else "i16dot")
            self.kernels[1] = first if on else self.kernels[0]
            self.kernels[2] = (first if down else names.index("i16dot")) if on else self.kernels[0]
        return names[self.kernels[1]] in ("i8dot", "i16dot")

    @property
    def generated_kernels(self) -> tuple[str, str]:
        """The kernels generated rows run on: (in every product but the down projection, in it)."""
        names = list(INT8_KERNELS)
        return names[self.kernels[1]], names[self.kernels[2]]


def _pointer(tensor):
    return tensor.data_ptr() if tensor is not None else None
