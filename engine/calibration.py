"""Choosing a lane's batch width by measuring this machine.

On a model's first load with batching on ``auto``, time one decode step at widths 1, 2, 4, 8, 16
and on (32, 64, ... while a width still qualifies), as far as memory allows, each slot holding a typical
history. Aggregate speed is width / step time; a slot's own speed is 1 / step time. The chosen
width maximizes aggregate speed among the widths where each slot keeps at least half of its
single-stream speed (the *interactive* rule: the app, where one person waits on each answer). A server
asks for the *throughput* rule instead: widths are measured on while each doubling still adds
THROUGHPUT_GAIN of aggregate speed (up to the memory bound), and the chosen width is the last that
did: the near-best aggregate at the narrowest width that reaches it (Whisper lanes always, whatever the
engine's rule: their slots are windows of files; see :func:`lane_rule`). Each width is also timed with one more row per slot (a draft being verified):
what a draft row costs differs by family (Whisper's slots each read 1500 positions of encoder
memory, which the slot's extra rows share), and the drafting planner prices rows with it. The curve
is cached per model file, device and PyTorch version, so later loads start at once (a throughput load
measures on from a cached curve that stopped short); the choice is made from it by the rule asked for.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from engine.filelock import held
from engine.paths import cache_dir, write_json
from engine.seam import ATTENTION_BLOCK, MIN_SLOT_LENGTH, BatchedDecoder, StepBatch

CALIBRATION_VERSION = 11  # 2: each width also timed with 2 rows per slot; 3: Whisper's encoder memory in bfloat16; 4: group-wise int8; 5: int8 layer ops and attention in C; 6: its Whisper memory in float16; 7: int8's 16-bit integer products; 8: 4-bit weights kept so; 9: their scales in half floats; 10: their 8-bit integer products; 11: int8 Whisper's output layer on 16-bit products
WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ALWAYS_MEASURED = 16  # widths up to this are always measured (memory permitting)
HISTORY = 128  # cache positions each slot holds while its step is timed
WARMUP_STEPS = 2
TIMED_STEPS = 7
MIN_SLOT_SHARE = 0.5  # interactive rule: each slot keeps at least this share of single-stream speed
THROUGHPUT_GAIN = 1.1  # throughput rule: a wider lane must add at least this factor of aggregate speed
WIDTH_RULES = ("interactive", "throughput")
MEMORY_SHARE = 0.25  # at most this share of the device's (free) memory goes to one lane's caches
# The first width is timed again after the rest (and precision's float32 likewise): apart by more than this
# factor, the machine was busy while measuring, and the result serves this run but is not kept.
UNSTEADY = 1.5


@dataclass
class Calibration:
    model: str
    device: str
    widths: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    verify_ms: list[float] = field(default_factory=list)  # the same widths with 2 rows per slot
    chosen: int = 1
    rule: str = "interactive"  # the rule that chose it (see choose_width)
    memory_limit_width: int = 0  # the widest lane the memory share allows at the model's full length
    seconds: float = 0.0  # how long measuring took
    steady: bool = True  # False: the first width's step moved by more than UNSTEADY while measuring (not kept)
    from_cache: bool = False

    @property
    def aggregate_tok_s(self) -> list[float]:
        return [round(w * 1000 / ms, 1) for w, ms in zip(self.widths, self.step_ms)]

    @property
    def per_slot_tok_s(self) -> list[float]:
        return [round(1000 / ms, 1) for ms in self.step_ms]

    def to_json(self) -> dict:
        out = asdict(self)
        out["aggregate_tok_s"] = self.aggregate_tok_s
        out["per_slot_tok_s"] = self.per_slot_tok_s
        return out


def device_identity(device: torch.device | str) -> str:
    """What the measurement depends on: the processor (or GPU) and the threads PyTorch uses."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "mps":
        return f"mps:{platform.machine()}"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"cpu:{name}:{torch.get_num_threads()}threads"


def device_memory(device: torch.device | str, free: bool = False) -> int:
    """The device's memory: a GPU's free memory; on CPU the machine's whole memory, or with ``free`` what
    Linux says is available now (MemAvailable: free memory and caches it can drop). A new lane's caches take
    their share of the free memory, so lanes made one after another (and engines in other processes) never
    promise more than the machine has (a quarter of the total each did: two test workers with two lanes
    each held 19 GB of a 24-GB machine between them); the calibration, cached per machine, bounds its widths
    by the whole memory, not by what happened to be free when it ran."""
    device = torch.device(device)
    if device.type == "cuda":
        free_bytes, _total = torch.cuda.mem_get_info(device)
        return free_bytes
    if free:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass  # no /proc/meminfo (macOS, Windows): the whole memory, below
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def slot_length(decoder: BatchedDecoder, width: int, asked: int | None = None) -> tuple[int, str]:
    """Positions per slot for a lane of ``width`` slots, and where that comes from: the model's own
    context (or ``asked``, if less), as far as ``width`` slots of it fit in the lane's memory share
    (MEMORY_SHARE of the device's memory free when the lane is made), but never below MIN_SLOT_LENGTH (nor above the model's).
    The width is chosen first (for speed, with each slot at MIN_SLOT_LENGTH, see :func:`calibrate`),
    then each slot gets what the memory left allows: on a machine with room, the model's whole context."""
    limit = decoder.context_limit
    wanted = min(limit, asked) if asked else limit
    free = device_memory(decoder.device, free=True)
    per_slot = int(free * MEMORY_SHARE) // max(width, 1)
    fixed = decoder.slot_bytes_at(0)  # what a slot holds whatever its length (Whisper's encoder memory)
    per_block = max(decoder.slot_bytes_at(ATTENTION_BLOCK) - fixed, 1)
    fits = max(per_slot - fixed, 0) // per_block * ATTENTION_BLOCK
    if wanted <= fits:
        return wanted, "asked" if asked and asked < limit else "the model"
    floor = min(wanted, MIN_SLOT_LENGTH)
    return max(fits, floor), f"memory: {width} slots in {MEMORY_SHARE:.0%} of {_gib(free)} free"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def lane_rule(family: str, engine_rule: str) -> str:
    """The rule batching 'auto' picks a lane's width by: a chat lane the engine's (the app's interactive:
    each reader's answer stays quick); a Whisper lane throughput whatever the engine's, since its slots are
    windows of files, work for the whole batch rather than tokens someone reads as they come (a step costs
    only the rows in it, so a live recording alone in a wide lane runs as fast as in a narrow one)."""
    return "throughput" if family == "whisper" else engine_rule


def choose_width(widths: list[int], step_ms: list[float], limit: int | None = None, rule: str = "interactive") -> int:
    """The width a lane runs at, from its measured curve, at most ``limit``.

    ``interactive`` (the app): the widest aggregate among the widths keeping each slot at
    MIN_SLOT_SHARE of its single-stream speed. ``throughput`` (a server): walking up the widths, a
    wider one is taken when its aggregate is at least THROUGHPUT_GAIN times the one taken so far."""
    if rule not in WIDTH_RULES:
        raise ValueError(f"unknown width rule {rule!r}")
    single = 1000 / step_ms[0]
    best, best_aggregate = widths[0], 0.0
    for w, ms in zip(widths, step_ms):
        if limit and w > limit:
            continue
        aggregate = w * 1000 / ms
        if rule == "throughput":
            if aggregate >= THROUGHPUT_GAIN * best_aggregate:
                best, best_aggregate = w, aggregate
        elif 1000 / ms >= MIN_SLOT_SHARE * single and aggregate > best_aggregate:
            best, best_aggregate = w, aggregate
    return best


def _measure_on(result: Calibration, rule: str) -> bool:
    """Whether the next width is worth measuring after the widths in ``result``."""
    if not result.widths:
        return True
    width, ms = result.widths[-1], result.step_ms[-1]
    if width < ALWAYS_MEASURED or 1000 / ms >= MIN_SLOT_SHARE * 1000 / result.step_ms[0]:
        return True  # slots are still above half speed (the interactive rule's range)
    if rule != "throughput":
        return False  # slots are below half speed now; wider only gets slower per slot
    earlier = [w * 1000 / t for w, t in zip(result.widths[:-1], result.step_ms[:-1])]
    return width * 1000 / ms >= THROUGHPUT_GAIN * max(earlier, default=0.0)  # still gaining


def steady(first: float, again: float) -> bool:
    """Whether two timings of the same thing, before and after a measurement, say the machine stayed
    about as busy throughout (within UNSTEADY of each other)."""
    return max(first, again) <= UNSTEADY * min(first, again)


def time_step(decoder: BatchedDecoder, width: int, rows_per_slot: int = 1) -> float:
    """Median milliseconds of one decode step with ``width`` busy slots of HISTORY positions, each
    with ``rows_per_slot`` new rows (more than one: a draft being verified)."""
    return time_steps_in_turn(decoder, width, [lambda: None], rows_per_slot, TIMED_STEPS)[0]


def time_steps_in_turn(decoder: BatchedDecoder, width: int, setups: list, rows_per_slot: int = 1,
                       steps: int = 3 * TIMED_STEPS) -> list[float]:
    """Median milliseconds of one decode step (as :func:`time_step`) for each of ``setups`` (functions that
    set the decoder one way), the ways taking turns step by step: ways a few percent apart compared over
    the same moments of a busy machine, whose speed moves by more than that within seconds."""
    decoder.allocate(width, HISTORY + (WARMUP_STEPS + steps) * rows_per_slot + 1)
    slots = list(range(width))
    every_row = torch.arange(width * rows_per_slot, device=decoder.device)
    times: list[list[float]] = [[] for _ in setups]
    for i in range(WARMUP_STEPS + steps):
        batch = StepBatch.build(slots, [[1] * rows_per_slot] * width, [HISTORY + i * rows_per_slot] * width,
                                device=decoder.device, prompt_lengths=[0] * width)  # decoding: generated rows
        for setup, taken in zip(setups, times):  # (each way writes the same cache positions in turn)
            setup()
            if decoder.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = decoder.forward(batch, every_row)
            logits.argmax(-1).tolist()  # the token choice, and on a GPU the wait for the result
            taken.append((time.perf_counter() - t0) * 1000)
    return [statistics.median(taken[WARMUP_STEPS:]) for taken in times]


def _cache_file(model_key: str, device: str):
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{model_key}-{device}")
    return cache_dir() / "calibration" / f"v{CALIBRATION_VERSION}-torch{torch.__version__}-{safe}.json"


def calibrate(decoder: BatchedDecoder, model: str, model_key: str, use_cache: bool = True,
              rule: str = "interactive") -> Calibration:
    """The measured curve for this model on this device (cached) and the width ``rule`` chooses from it."""
    device = device_identity(decoder.device)
    path = _cache_file(model_key, device)
    with held(path):  # one process measures this machine at a time; the next reads its result
        return _calibrate(decoder, model, device, path, use_cache, rule)


def _calibrate(decoder: BatchedDecoder, model: str, device: str, path, use_cache: bool, rule: str) -> Calibration:
    result = None
    if use_cache and path.exists():
        try:
            data = json.loads(path.read_text())
            for derived in ("aggregate_tok_s", "per_slot_tok_s", "rule"):
                data.pop(derived, None)
            result = Calibration(**{**data, "from_cache": True})
        except (ValueError, TypeError):
            result = None  # a damaged cache file is measured again
    if result is None:
        limit = max(1, int(device_memory(decoder.device) * MEMORY_SHARE) // max(decoder.slot_bytes, 1))
        result = Calibration(model=model, device=device, memory_limit_width=limit)
    measured = len(result.widths)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for width in WIDTHS[measured:]:
            if (width > result.memory_limit_width and width > 1) or not _measure_on(result, rule):
                break
            result.widths.append(width)
            result.step_ms.append(round(time_step(decoder, width), 3))
            result.verify_ms.append(round(time_step(decoder, width, rows_per_slot=2), 3))
    result.rule = rule
    result.chosen = choose_width(result.widths, result.step_ms, result.memory_limit_width, rule)
    if len(result.widths) > measured:  # measured now (all of it, or on from a cached curve): saved for next time
        with torch.inference_mode():
            again = time_step(decoder, result.widths[0])
        result.steady = steady(result.step_ms[0], again)
        result.seconds = round(result.seconds + time.perf_counter() - t0, 2)
        result.from_cache = False
        if not result.steady:
            return result  # measured while the machine was busy: the next start measures again
        write_json(path, result.to_json())
    return result
