"""Choosing a model's precision on this machine: ``--precision auto``.

Every precision this device offers (:func:`engine.kernels.precisions_on`) is measured on the model
itself, once per model file, device and PyTorch version (cached like the width calibration):

- quality against float32, on the model's own check set:
  chat: top-1 agreement with float32's greedy tokens, teacher-forced over a fixed prompt set,
  at least :data:`MIN_AGREEMENT`;
  Whisper: the word error rate on the bundled speech (resources/speech/check.ogg, 159 s and 390
  words of espeak-ng speech in two voices, known text) at most :data:`MAX_WER_RISE` points above
  float32's (a word is 0.26 points of it: on the first clip, 119 words, one word was 0.84 and no
  precision that changed a single word could pass);
- speed: chat, tokens/s at widths 1 and 8 (their geometric mean: one person's answer and a
  batch count alike); Whisper, the time a 30-s window costs (its encoder pass plus about
  :data:`TOKENS_PER_WINDOW` tokens at width 8).

``auto`` picks the fastest precision within the quality bounds (float32 always qualifies), and
says why in ``Engine.status()`` and the app's engine panel. float32 is timed again after the
others: where its two speeds differ by more than ``engine.calibration.UNSTEADY`` times, the machine
was busy while measuring (another program, a test suite), so the choice serves this run but is not
kept, and the next start measures again (a choice once made under load stayed, slower than
bfloat16 undrafted).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.api import PRECISION_ENV, parse_precision  # noqa: F401 - the names callers look for here
from engine.calibration import steady
from engine.kernels import precisions_on
from engine.filelock import held
from engine.paths import cache_dir, write_json
from engine.seam import StepBatch

CHOICE_VERSION = 15  # 2: Whisper's encoder memory kept in bfloat16 (its speed and words changed); 3: a longer check clip; 4: group-wise int8; 5: int8 layer ops and attention in C; 6: its Whisper memory in float16; 7: int8 with float32 activations on bfloat16 CPUs too, 16 lanes where AVX-512 wins; 8: int8 chat may run generated tokens on integer products (engine.native); 9: or all but the MLP's down projection; 10: 16-bit integer products (the output layer's generated rows; the down projection's, or all), the fastest way that qualifies; 11: weights that already are 4-bit kept so; 12: their scales and minimums in half floats; 13: and 8-bit integer products of their own; 14: Whisper int8's encoder on 8-bit integer products where they are faster (engine.many_rows_int8); 15: and its cross-attention memory projected in float where that is as fast
MIN_AGREEMENT = 0.97  # chat: share of positions whose top-1 token equals float32's
MAX_WER_RISE = 0.005  # Whisper: word error rate at most this much above float32's (0.5 points)
CHECK_TOKENS = 48  # chat: greedy tokens per check prompt
TOKENS_PER_WINDOW = 40  # Whisper: typical tokens decoded per 30-s window of speech
RESOURCES = Path(__file__).resolve().parent.parent / "resources" / "speech"
CHECK_PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the sea at night.",
    "What are three good habits for learning a new language?",
    "Summarize the plot of a detective story in four sentences.",
    "List five fruits and say one thing about each.",
    "Why do leaves change colour in autumn?",
    "Give me a recipe for a simple tomato soup.",
    "Describe the water cycle to a ten-year-old.",
    "What is the difference between weather and climate?",
    "Write a polite email asking a colleague to review a report.",
    "How does a bicycle stay upright when it moves?",
    "Tell me a short story about a lost key.",
]


@dataclass
class PrecisionChoice:
    """What ``auto`` measured for one model on one device, and what it chose."""

    model: str
    device: str
    chosen: str = "float32"
    why: str = ""
    candidates: dict = field(default_factory=dict)  # precision -> quality, speed and whether it qualified
    seconds: float = 0.0
    steady: bool = True  # False: float32's speed moved by more than UNSTEADY while measuring (not cached)
    from_cache: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def _cache_file(model_key: str, device: str, folder: str = "precision") -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{model_key}-{device}")
    return cache_dir() / folder / f"v{CHOICE_VERSION}-torch{torch.__version__}-{safe}.json"


# ---------------------------------------------------------------------------- chat
def _greedy(decoder, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy continuations of every prompt at once (each in its own slot), ``new`` tokens each."""
    slots = list(range(len(prompts)))
    decoder.allocate(len(prompts), max(len(p) for p in prompts) + new + 1)
    lengths = [len(p) for p in prompts]  # rows past them are generated tokens, as the engine's steps say
    batch = StepBatch.build(slots, prompts, [0] * len(prompts), device=decoder.device, prompt_lengths=lengths)
    outs = [[t] for t in decoder.forward(batch, batch.last_rows()).argmax(-1).tolist()]
    for _ in range(new - 1):
        batch = StepBatch.build(slots, [[o[-1]] for o in outs], [len(p) + len(o) - 1 for p, o in zip(prompts, outs)],
                                device=decoder.device, prompt_lengths=lengths)
        for o, t in zip(outs, decoder.forward(batch, batch.last_rows()).argmax(-1).tolist()):
            o.append(t)
    return outs


def chat_agreement(candidate, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """Share of answer positions where ``candidate``'s top-1 token, given float32's answer so far
    (teacher-forced), equals float32's."""
    rows = [p + a[:-1] for p, a in zip(prompts, answers)]
    candidate.allocate(len(rows), max(len(r) for r in rows) + 1)
    batch = StepBatch.build(list(range(len(rows))), rows, [0] * len(rows), device=candidate.device,
                            prompt_lengths=[len(p) for p in prompts])  # the answer's rows read as generated
    wanted, offset = [], 0
    for p, r in zip(prompts, rows):
        wanted += range(offset + len(p) - 1, offset + len(r))
        offset += len(r)
    picks = candidate.forward(batch, torch.tensor(wanted, device=candidate.device)).argmax(-1).tolist()
    expected = [t for a in answers for t in a]
    return sum(p == e for p, e in zip(picks, expected)) / max(len(expected), 1)


# How much faster a way of integer products must be to win over one that agrees more with float32: a timing
# moves by 5-10% on a busy machine, and a way that agrees less changes answers (on a Zen 3 EPYC SmolLM2's
# 8-bit way, 99.1% top-1 agreement, wrote 1 of 8 stories as float32 does, its 16-bit way all 8), so it
# must be clearly faster, not faster within noise.
EXACTNESS_MARGIN = 0.15
# int8 chat's ways of running generated tokens on integer products: name -> (use_integer_dot's down, bits)
INTEGER_WAYS = {
    "8-bit": (True, 8),
    "8-bit but the down projection": (False, 8),  # its inputs' outliers on 16-bit products
    "16-bit": (True, 16),
}


def four_bit_products(decoder) -> str | None:
    """"k/n": how many of the decoder's layer products read weights kept in their own 4-bit form (int8
    precision, engine.kernels.quantize_q4_exact); None where none does."""
    from engine.kernels import Linear

    linears = [m for layer in getattr(decoder, "layers", []) for m in vars(layer).values() if isinstance(m, Linear)]
    kept = sum(m.minimum is not None for m in linears)
    return f"{kept}/{len(linears)}" if kept else None


def _better(way: dict, than: dict) -> bool:
    """Whether one qualifying way of integer products beats another: the less exact (lower agreement) must be
    faster by more than EXACTNESS_MARGIN, the more exact need only not be slower by as much."""
    if way["agreement"] == than["agreement"]:
        return way["score"] > than["score"]
    if way["agreement"] < than["agreement"]:
        return way["score"] > than["score"] * (1 + EXACTNESS_MARGIN)
    return way["score"] * (1 + EXACTNESS_MARGIN) >= than["score"]


def _chat_entry(decoder, precision: str, prompts: list[list[int]], answers: list[list[int]]) -> dict:
    """A chat candidate's quality and speed. int8 tries generated tokens on each way of integer
    products (where the decoder has them, INTEGER_WAYS) and keeps the fastest that qualifies, one that
    agrees less only where it is faster by more than EXACTNESS_MARGIN (:func:`_better`); where none
    qualifies, it measures int8 without them. ``integer_agreements`` records every way's agreement,
    ``integer_tok_s`` each qualifying way's speed."""
    if precision == "float32":
        return {"agreement": 1.0, "qualifies": True, **chat_speed(decoder)}
    kept = four_bit_products(decoder)
    integer = {"four_bit": kept} if kept else {}
    if precision == "int8" and decoder.use_integer_dot(True):
        best, agreements = None, {}
        for way, (down, bits) in INTEGER_WAYS.items():
            decoder.use_integer_dot(True, down=down, bits=bits)
            agreements[way] = round(chat_agreement(decoder, prompts, answers), 4)
        qualified = [way for way, quality in agreements.items() if quality >= MIN_AGREEMENT]
        speeds = _interleaved_speeds(decoder, qualified)
        for way in qualified:
            entry = {"agreement": agreements[way], "qualifies": True, "integer_dot": True, "integer_way": way,
                     **speeds[way]}
            best = entry if best is None or _better(entry, best) else best
        if best is not None:
            decoder.use_integer_dot(True, *INTEGER_WAYS[best["integer_way"]])
            return {**best, **integer, "integer_agreements": agreements,
                    "integer_tok_s": {way: speeds[way]["tok_s"] for way in qualified}}
        decoder.use_integer_dot(False)
        integer.update({"integer_dot": False, "integer_agreements": agreements})
    quality = chat_agreement(decoder, prompts, answers)
    return {"agreement": round(quality, 4), "qualifies": quality >= MIN_AGREEMENT, **integer, **chat_speed(decoder)}


def _keep_4bit_or_not(kept: dict, rounded: dict) -> dict:
    """int8 chat's entry: with the model's 4-bit layers kept so (``kept``, exact weights) or rounded to int8
    (``rounded``); where both qualify, rounded only if it agrees as well or is faster by more than
    EXACTNESS_MARGIN (:func:`_better`); ``keep_4bit`` says which, ``other_4bit_way`` what the other measured.
    The engine builds the lane as recorded."""
    use_kept = kept["qualifies"] and (not rounded["qualifies"] or not _better(rounded, kept))
    chosen, other = (kept, rounded) if use_kept else (rounded, kept)
    return {**chosen, "keep_4bit": use_kept, "four_bit": kept["four_bit"],
            "other_4bit_way": {"tok_s": other["tok_s"], "agreement": other["agreement"]}}


def chat_speed(decoder, repeats: int = 3) -> dict:
    """Tok/s at widths 1 and 8 (each the best of ``repeats`` timings: a busy machine's slow moments left out)."""
    from engine.calibration import time_step

    return _speed_entry({w: min(time_step(decoder, w) for _ in range(repeats)) for w in (1, 8)})


def _speed_entry(ms: dict) -> dict:
    tok_s = {w: round(w * 1000 / m, 1) for w, m in ms.items()}
    return {"step_ms": {w: round(m, 3) for w, m in ms.items()}, "tok_s": tok_s,
            "score": round(math.sqrt(tok_s[1] * tok_s[8]), 2)}


def _interleaved_speeds(decoder, ways: list[str]) -> dict:
    """chat_speed of each way of integer products, the ways taking turns step by step
    (engine.calibration.time_steps_in_turn). The decoder is left on no way in particular (the caller sets
    the chosen one)."""
    from engine.calibration import time_steps_in_turn

    setups = [lambda way=way: decoder.use_integer_dot(True, *INTEGER_WAYS[way]) for way in ways]
    ms = {w: time_steps_in_turn(decoder, w, setups) for w in (1, 8)} if ways else {}
    return {way: _speed_entry({w: ms[w][i] for w in (1, 8)}) for i, way in enumerate(ways)}


ASKED_INT8_WAY = "16-bit"  # int8 asked for by name: the way whose products stay as close as float activations'


def asked_int8_way(decoder, model_key: str) -> dict:
    """int8 chat asked for by name (not ``auto``): its generated tokens run on 16-bit integer products
    where those are faster on this machine than float activations. Their products differ from float
    activations' by about 5e-5 of a product (the 8-bit ways' by 1e-2, which is why only auto, with its
    agreement check, may pick those). Timed once per model file and machine at widths 1 and 8, cached;
    the entry says which way runs and the timings behind it. {} where the decoder has no integer kernels."""
    from engine.calibration import device_identity

    path = _cache_file(model_key, device_identity(decoder.device), folder="int8-asked")
    with held(path):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # not measured yet (or a damaged file): measured now
        if not decoder.use_integer_dot(True, *INTEGER_WAYS[ASKED_INT8_WAY]):
            return {}
        integer = chat_speed(decoder)
        decoder.use_integer_dot(False)
        floats = chat_speed(decoder)
        faster = integer["score"] > floats["score"]
        entry = {"integer_dot": faster, "integer_way": ASKED_INT8_WAY if faster else None,
                 "tok_s": {ASKED_INT8_WAY: [integer["tok_s"][1], integer["tok_s"][8]],  # alone, at width 8
                           "float activations": [floats["tok_s"][1], floats["tok_s"][8]]}}
        write_json(path, entry)
        return entry


def asked_int8_why(entry: dict) -> str:
    """What ``asked_int8_way``'s entry means for the status line: which way generated tokens run and the
    timings that chose it ('' where nothing was timed)."""
    if "tok_s" not in entry:
        return ""
    ran, other = ((entry["integer_way"], "float activations") if entry["integer_dot"]
                  else ("float activations", ASKED_INT8_WAY))
    name = {ASKED_INT8_WAY: f"{ASKED_INT8_WAY} integer products"}
    alone, wide = entry["tok_s"][ran]
    return (f"; generated tokens on {name.get(ran, ran)}, the faster here ({alone:.0f} tok/s alone, {wide:.0f}"
            f" at width 8; {name.get(other, other)}: {entry['tok_s'][other][0]:.0f} and "
            f"{entry['tok_s'][other][1]:.0f})")


# ---------------------------------------------------------------------------- Whisper
def check_speech() -> tuple[object, str]:
    """The bundled check speech (16 kHz samples) and its text."""
    from engine.audio import load_audio

    return load_audio(RESOURCES / "check.ogg"), (RESOURCES / "check.txt").read_text(encoding="utf-8").strip()


def whisper_transcript(decoder, reference, samples) -> str:
    """Greedy text of ``samples`` in the default path's voice-activity windows, every window a slot of
    ``decoder``, with the reference decoder's prompt (English, no timestamps) and token suppression."""
    from engine.whisper.features import log_mel
    from engine.whisper.pipeline import plan_windows

    tok = reference.tok
    feats = log_mel(samples, reference.model.config.num_mel_bins)
    spans = [w for _, _, w in plan_windows(feats, samples, "vad")]
    prompt = tok.sot_sequence("en" if tok.multilingual else None) + [tok.no_timestamps]
    decoder.allocate(len(spans), decoder.max_len)
    for slot, window in enumerate(spans):
        encoded = decoder.encode(torch.from_numpy(window)[None].to(decoder.device, decoder.dtype))
        decoder.set_memory(slot, encoded[0])
    slots = list(range(len(spans)))
    texts: list[list[int]] = [[] for _ in spans]
    live = set(slots)
    rows, starts = [list(prompt)] * len(spans), [0] * len(spans)
    while live and len(prompt) + max(len(t) for t in texts) < decoder.max_len - 1:
        order = sorted(live)
        batch = StepBatch.build(order, [rows[s] for s in order], [starts[s] for s in order], device=decoder.device)
        logits = decoder.forward(batch, batch.last_rows()).float()
        logits[:, reference.suppress] = -float("inf")
        for i, s in enumerate(order):
            if not texts[s]:
                logits[i, reference.begin_suppress] = -float("inf")
            token = int(logits[i].argmax())
            starts[s] += len(rows[s])
            if token == tok.eot:
                live.discard(s)
                continue
            texts[s].append(token)
            rows[s] = [token]
    return " ".join(tok.decode(t).strip() for t in texts)


def _whisper_entry(decoder, reference, samples, text: str, base_wer: float, precision: str) -> dict:
    from engine.wer import wer as word_error_rate

    wer = base_wer if precision == "float32" else word_error_rate(text, whisper_transcript(decoder, reference, samples))
    entry = {"wer": round(wer, 4), "qualifies": wer <= base_wer + MAX_WER_RISE,
             **whisper_speed(decoder, reference.model.config.num_mel_bins)}
    if getattr(decoder, "encoder_int8", None):
        entry["int8_encoder"] = decoder.encoder_int8  # the quantized engine its encoder's products ran on
    return entry


def whisper_speed(decoder, mel_bins: int) -> dict:
    from engine.calibration import time_step

    window = torch.zeros(1, mel_bins, 3000, dtype=decoder.dtype, device=decoder.device)
    decoder.encode(window)  # warm
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        decoder.encode(window)
        times.append((time.perf_counter() - t0) * 1000)
    encode_ms = min(times)
    step_ms = time_step(decoder, 8)
    window_ms = encode_ms + TOKENS_PER_WINDOW * step_ms / 8
    return {"encode_ms": round(encode_ms, 2), "step_ms_8": round(step_ms, 3), "window_ms": round(window_ms, 2),
            "score": round(1000 / window_ms, 3)}


# ---------------------------------------------------------------------------- the choice
def choose_precision(loaded, reference, build, model_key: str, use_cache: bool = True) -> PrecisionChoice:
    """Measure each precision this device offers on ``loaded`` (``build(precision)`` makes its batched
    decoder; ``reference``: the model's reference decoder, for prompts and rules) and pick the fastest
    within the quality bounds. Cached per model file, device and PyTorch version."""
    from engine.calibration import device_identity

    identity = device_identity(loaded.model.device if hasattr(loaded.model, "device") else torch.device("cpu"))
    if os.environ.get("CADENCE_INT8_KERNEL"):  # int8 on kernels asked for by name: a choice of its own
        identity += "-int8-" + os.environ["CADENCE_INT8_KERNEL"].replace(",", "-")
    path = _cache_file(model_key, identity)
    with held(path):  # one process measures at a time; the next reads its choice
        return _choose(loaded, reference, build, identity, path, use_cache)


def _choose(loaded, reference, build, identity: str, path: Path, use_cache: bool) -> PrecisionChoice:
    from engine.wer import wer as word_error_rate

    device = loaded.model.device if hasattr(loaded.model, "device") else torch.device("cpu")
    if use_cache and path.is_file():
        try:
            return PrecisionChoice(**{**json.loads(path.read_text()), "from_cache": True})
        except (ValueError, TypeError):
            pass  # a damaged cache file is measured again
    t0 = time.perf_counter()
    choice = PrecisionChoice(model=loaded.source.name, device=identity)
    chat = loaded.family == "chat"
    with torch.inference_mode():
        base = build("float32")
        if chat:
            from engine.chat.reference import build_messages

            prompts = [reference.prompt_ids(build_messages(p)) for p in CHECK_PROMPTS]
            answers = _greedy(base, prompts, CHECK_TOKENS)
        else:
            samples, text = check_speech()
            base_wer = word_error_rate(text, whisper_transcript(base, reference, samples))
        for precision in precisions_on(device):
            decoder = base if precision == "float32" else build(precision)
            if chat:
                entry = _chat_entry(decoder, precision, prompts, answers)
                if entry.get("four_bit"):  # int8 with 4-bit layers kept so: against every layer rounded to int8
                    del decoder
                    decoder = build(precision, keep_4bit=False)
                    entry = _keep_4bit_or_not(entry, _chat_entry(decoder, precision, prompts, answers))
            else:
                entry = _whisper_entry(decoder, reference, samples, text, base_wer, precision)
                if not entry["qualifies"] and getattr(decoder, "encoder_int8", None):  # its encoder in float, then
                    del decoder
                    decoder = build(precision, float_encoder=True)
                    entry = {**_whisper_entry(decoder, reference, samples, text, base_wer, precision),
                             "float_encoder": True, "int8_encoder_wer": entry["wer"]}
            choice.candidates[precision] = entry
            del decoder
        again = (chat_speed(base) if chat else whisper_speed(base, loaded.model.config.num_mel_bins))["score"]
    first = choice.candidates["float32"]["score"]
    choice.steady = steady(first, again)
    qualified = {p: e for p, e in choice.candidates.items() if e["qualifies"]}
    choice.chosen = max(qualified, key=lambda p: qualified[p]["score"])
    choice.why = _why(choice, chat)
    if not choice.steady:
        moved = (f"{first:.0f} then {again:.0f} tok/s" if chat
                 else f"a 30-s window in {1000 / first:.0f} then {1000 / again:.0f} ms")
        choice.why += f" Measured while the machine was busy (float32: {moved}): not kept, the next start measures again."
    choice.seconds = round(time.perf_counter() - t0, 2)
    if choice.steady:
        write_json(path, choice.to_json())
    return choice


def _why(choice: PrecisionChoice, chat: bool) -> str:
    """One sentence: what was chosen, how much faster, and what was left out for quality."""
    best = choice.candidates[choice.chosen]
    base = choice.candidates["float32"]
    speed = (f"{best['tok_s'][1]:.0f} tok/s alone, {best['tok_s'][8]:.0f} at width 8" if chat
             else f"{best['window_ms']:.0f} ms a 30-s window")
    notes = []
    if best.get("int8_encoder"):
        notes.append("its encoder on 8-bit integer products")
    if best.get("float_encoder"):
        notes.append(f"its encoder in float: on 8-bit integer products the check speech read {best['int8_encoder_wer']:.1%}"
                     f" against float32's {base['wer']:.1%}")
    if best.get("four_bit"):  # (measured just now: tok/s keyed by width)
        other = best["other_4bit_way"]["tok_s"]
        other_speed = f"{other[1]:.0f} and {other[8]:.0f} tok/s"
        notes.append(f"{best['four_bit']} layer products on the model's own 4-bit weights (rounded to int8: {other_speed})"
                     if best["keep_4bit"] else f"its 4-bit layers rounded to int8, faster here (kept: {other_speed})")
    if best.get("integer_dot"):
        faster = {w: t for w, t in best.get("integer_tok_s", {}).items()
                  if w != best["integer_way"] and t[1] > best["tok_s"][1]}  # passed over: they agree less
        notes.append(f"generated tokens on {best['integer_way']} integer products"
                     + "".join(f", not {w} ({t[1]:.0f} tok/s alone, top-1 agreement "
                               f"{best['integer_agreements'][w]:.1%}: not {EXACTNESS_MARGIN:.0%} faster)"
                               for w, t in faster.items()))
    way = f" ({'; '.join(notes)})" if notes else ""
    parts = [f"{choice.chosen}{way}: the fastest within quality bounds ({speed}"
             + (f", {best['score'] / base['score']:.2f}x float32)" if choice.chosen != "float32" else ")")]
    for precision, entry in choice.candidates.items():
        short = {way: a for way, a in entry.get("integer_agreements", {}).items() if a < MIN_AGREEMENT}
        if short:
            parts.append(f"{precision} with " + ", ".join(f"{way} integer products (top-1 agreement {a:.1%})"
                                                          for way, a in short.items())
                         + f" left out (< {MIN_AGREEMENT:.0%})")
        if not entry["qualifies"]:
            measure = (f"top-1 agreement {entry['agreement']:.1%} < {MIN_AGREEMENT:.0%}" if chat
                       else f"word error rate {entry['wer']:.1%} vs {base['wer']:.1%}")
            parts.append(f"{precision} left out ({measure})")
    return "; ".join(parts) + "."

