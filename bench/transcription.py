"""Issue 5's transcription benchmark: wall time for a batch of files of mixed length (5 s to 2 min of
espeak-ng speech, known text), whisper-tiny.en and whisper-base, three engines on the same float32
weights, greedy, English forced:

- Cadence: ``Engine(backend="cpu", batch=WIDTH)``, one ``TranscribeRequest`` per file, all submitted
  at once (the engine decodes the files from disk itself).
- faster-whisper, one file after another: ``WhisperModel.transcribe`` (beam 1, temperature 0,
  no timestamps, no previous-text conditioning): fixed 30-s windows, like Cadence.
- faster-whisper ``BatchedInferencePipeline`` (batch 8, same options where it takes them). It cuts
  each file into chunks by voice activity (its default; it needs VAD or clip timestamps), so its
  windows, and its words, differ from the sequential run.

Start-up and model loading are subtracted as the issue asks: each engine transcribes BASE short
files (start-up + load + a little work) and then BASE + the batch (start-up + load + the same little
work + the batch), each run from a fresh engine / fresh model; the difference is the batch's cost
with the model loaded. One throw-away run per engine first, so that process-wide one-time costs
(oneDNN kernel generation, file cache) land in neither run.

WER is pooled over the batch's files against the text given to espeak-ng (``engine.wer``).
"same tokens" counts the files whose token ids equal faster-whisper sequential's. The encoder floor
is windows x one 30-s window's encoder time (``WhisperBatched.encode``, best of 3): however well the
decoding is batched, Cadence runs every window through the encoder once.

Caution on WER: greedy decoding without timestamps on a full 30-s window of dense speech often
stops after the first sentence or two (both Cadence's fixed windows and faster-whisper's
without_timestamps run do), so the 2-minute files lose most of their words; ``--fw-timestamps``
gives the sequential run faster-whisper's timestamp seeking.

With time tokens (what the CLI and the app decode by default): ``--engines cadence-ts,fw-batched-ts``
compares Cadence on its voice-activity windows with faster-whisper's batched pipeline, each chunk
decoded with timestamps (``without_timestamps=False``).

    .venv/bin/python bench/transcription.py [--models whisper-tiny.en,whisper-base] [--files 16]
        [--base 4] [--width 8|auto] [--fw-batch 8] [--engines cadence,cadence-fixed,fw,fw-batched]
        [--fw-timestamps] [--per-file] [--quick] [--rounds N]

Run it on a quiet machine (another PyTorch process on the same cores slows both many times over).
On a shared machine whose speed drifts from minute to minute, ``--rounds N`` runs every engine N times,
taking turns, and reports each engine's median time and the median of the rounds' speed-ups (each
round's pair ran minutes apart, not half an hour).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

# Varied sentences (no digits: espeak-ng and Whisper write numbers differently), so that the WER of
# long files is measured on words the model cannot guess from repetition.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Meetings start at nine in the morning and end before lunch.",
    "Please remember to send the quarterly report to the finance team by Friday afternoon.",
    "We will review the budget together next week and decide on the new hires for the spring.",
    "Tomorrow will be cloudy with a chance of rain, so bring an umbrella to the office.",
    "The library closes early on Sundays, but the reading room stays open until six.",
    "Our train was delayed because a tree had fallen across the tracks near the river.",
    "She painted the kitchen a pale shade of green and hung new curtains by the window.",
    "The committee approved the proposal after a long discussion about safety and cost.",
    "A small bakery on the corner sells fresh bread, croissants and apple pie every morning.",
    "He forgot his keys at home and had to wait outside until his sister came back.",
    "The museum opened a new exhibition about ancient maps and the sailors who drew them.",
    "Children played football in the park while their parents talked on the benches.",
    "The doctor recommended more sleep, less coffee and a short walk after every meal.",
    "Engineers tested the bridge for several weeks before it was opened to traffic.",
    "The garden was full of roses, tulips and a few tall sunflowers near the fence.",
    "Our neighbours are moving to a farm in the countryside at the end of the summer.",
    "The orchestra rehearsed the symphony three times before the evening concert.",
    "Please turn off the lights and close the windows when you leave the building.",
    "The new software update fixes several bugs and makes the application start faster.",
    "A strong wind blew across the harbour, and the fishing boats stayed at the pier.",
    "The students wrote essays about climate, history and the future of cities.",
    "My grandmother keeps a notebook of recipes that she collected over many years.",
    "The hotel offers a quiet room with a view of the mountains and the lake.",
    "After the storm, volunteers cleared the roads and helped repair damaged roofs.",
    "The chef added garlic, lemon and a pinch of salt before serving the fish.",
    "Our team finished the project early and celebrated with pizza in the office.",
    "The pilot announced that the plane would land twenty minutes ahead of schedule.",
    "Scientists observed a bright comet passing close to the sun last winter.",
    "The old castle on the hill attracts thousands of visitors during the holidays.",
    "He practised the piano every evening and finally played the piece without mistakes.",
    "The market sells vegetables, cheese, honey and flowers from local farms.",
    "Please check the schedule carefully, because several classes have moved to new rooms.",
    "The river flooded the lower fields, but the village itself remained dry.",
    "Our manager asked everyone to share ideas for improving customer service.",
    "The cat slept on the warm windowsill while snow fell quietly outside.",
    "Travelers should keep their passports and tickets in a safe place at all times.",
    "The bookstore hosted an author who read a chapter from her latest novel.",
    "We planted apple trees along the road and watered them during the dry months.",
    "The company plans to open a second factory near the coast next year.",
    "Lightning struck the tall oak tree, and the thunder shook the windows.",
    "The teacher explained the experiment slowly so that everyone could follow it.",
    "A friendly dog followed us along the beach all the way back to the car.",
    "The council will vote on the new parking rules at the meeting on Thursday.",
    "Fresh paint, new carpets and better lighting made the old house feel modern.",
    "The runners crossed the finish line in heavy rain, cheered on by the crowd.",
    "Please bring a warm jacket, sturdy boots and enough water for the long hike.",
    "The radio station played jazz in the evening and the news every hour.",
]

VOICES = [("en-us+f3", 130), ("en-us+m3", 150), ("en-us+f3", 140), ("en-us+m3", 135)]


# ---------------------------------------------------------------------------- speech of known text
@dataclass
class Clip:
    path: Path
    text: str
    seconds: float


def long_text(seconds: float, words_per_minute: int, rng: random.Random) -> str:
    """Sentences drawn from SENTENCES without repeating one until all were used, until about
    ``seconds`` of speech at ``words_per_minute`` (at least one sentence; the last one is the unused
    sentence whose length best fits what is missing, so short clips land near their target)."""
    want = max(1, round(seconds * words_per_minute / 60))
    pool: list[str] = []
    out: list[str] = []
    words = 0
    while want - words > 3 or not out:
        if not pool:
            pool = [s for s in SENTENCES if not out or s != out[-1]]
            rng.shuffle(pool)
        missing = want - words
        if missing < 25:  # the last sentence or two: the best fit
            pick = min(range(len(pool)), key=lambda k: abs(len(pool[k].split()) - missing))
            if out and len(pool[pick].split()) - missing > missing:  # overshooting more than it fills
                break
            sentence = pool.pop(pick)
        else:
            sentence = pool.pop()
        out.append(sentence)
        words += len(sentence.split())
    return " ".join(out)


def speak(text: str, out: Path, voice: str, rate: int) -> Path:
    """``text`` as 16 kHz mono WAV via espeak-ng and sox (as bench.common does for short clips). sox's
    resampling dithers from a random seed unless given -R: without it each run's speech differed in its
    last bits, and words near a call with it (tiny.en's WER on the batch moved by up to 0.6 points)."""
    raw = out.with_suffix(".raw.wav")
    subprocess.run(["espeak-ng", "-w", str(raw), "-v", voice, "-s", str(rate), text], check=True)
    subprocess.run(["sox", "-V1", "-R", str(raw), "-r", "16000", "-c", "1", str(out)], check=True)
    raw.unlink()
    return out


def make_clips(folder: Path, durations: list[float], seed: int, prefix: str) -> list[Clip]:
    """One clip per target duration, voices and rates taking turns. The words per minute espeak-ng
    really speaks differ from its nominal rate, so a clip more than 15% off its target is made once
    more with the text length corrected by the rate measured on the first try."""
    import soundfile

    clips = []
    for i, seconds in enumerate(durations):
        voice, rate = VOICES[i % len(VOICES)]
        path = folder / f"{prefix}{i:02d}.wav"
        wpm = rate * 1.1
        for _ in range(2):
            text = long_text(seconds, wpm, random.Random(seed * 1000 + i))
            got = soundfile.info(str(speak(text, path, voice, rate))).duration
            if abs(got - seconds) <= 0.15 * seconds:
                break
            wpm = len(text.split()) / got * 60
        clips.append(Clip(path, text, got))
    return clips


def batch_durations(n: int, shortest: float, longest: float, seed: int = 5) -> list[float]:
    """``n`` target lengths spread geometrically from shortest to longest (a folder of recordings has
    more short ones than long ones), in a shuffled order."""
    durations = list(np.geomspace(shortest, longest, n)) if n > 1 else [longest]
    random.Random(seed).shuffle(durations)
    return durations


def window_count(clips: list[Clip], windowing: str) -> int:
    """Windows over the clips, counted as Cadence cuts them ("vad" or "fixed")."""
    from engine.audio import load_audio
    from engine.whisper.pipeline import plan_windows
    from engine.whisper.features import log_mel

    return sum(len(plan_windows(log_mel(a), a, windowing)) for a in (load_audio(c.path) for c in clips))


# ---------------------------------------------------------------------------- the three engines
@dataclass
class Run:
    seconds: float
    texts: list[str] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    width: int | None = None  # Cadence: the lane width it ran at (what ``auto`` chose)


def run_cadence(model: str, paths: list[Path], width, windowing: str = "vad", timestamps: bool = False,
                precision: str = "float32") -> Run:
    from engine import Engine, TranscribeRequest

    start = time.perf_counter()
    engine = Engine(backend="cpu", batch=width, precision=precision)
    try:
        handles = [engine.submit(TranscribeRequest(audio=p, model=model, language="en", windowing=windowing,
                                                       timestamps=timestamps)) for p in paths]
        run = Run(0.0)
        for h in handles:
            try:
                t = h.result()
                run.texts.append(t.text)
                run.tokens.append([tok for s in t.segments for tok in s.tokens])
            except Exception as exc:  # noqa: BLE001 - reported in the table, the rest still count
                run.texts.append("")
                run.tokens.append([])
                run.errors.append(str(exc))
        run.seconds = time.perf_counter() - start
        run.width = engine.status()["lanes"].get(model, {}).get("width")
    finally:
        engine.shutdown()
    return run


FW_OPTIONS = dict(language="en", beam_size=1, temperature=0.0, without_timestamps=True,
                  condition_on_previous_text=False)
SEQUENTIAL_OPTIONS: dict = {}  # --fw-timestamps: the sequential run seeks by timestamps (long-form)


def run_faster_whisper(model: str, paths: list[Path], folder: Path, threads: int, batched: int,
                       timestamps: bool = False, compute_type: str = "float32") -> Run:
    """faster-whisper from a fresh model (start-up included), in a process of its own: CTranslate2's
    threads, left in this one, could slow the engines measured after it, and its users run it as a
    program of its own. ``timestamps``: the batched pipeline decodes each chunk with time tokens
    (``without_timestamps=False``)."""
    from bench.common import in_own_process

    return in_own_process(faster_whisper_run, model, paths, folder, threads, batched, timestamps, compute_type,
                          dict(SEQUENTIAL_OPTIONS))


def faster_whisper_run(model: str, paths: list[Path], folder: Path, threads: int, batched: int, timestamps: bool,
                       compute_type: str, sequential_options: dict) -> Run:
    from bench.common import faster_whisper_model

    start = time.perf_counter()
    fw = faster_whisper_model(model, folder, threads, compute_type)
    if batched:
        from faster_whisper import BatchedInferencePipeline

        pipeline = BatchedInferencePipeline(fw)

        def transcribe(p):
            return pipeline.transcribe(str(p), batch_size=batched,
                                       **{**FW_OPTIONS, "without_timestamps": not timestamps})[0]
    else:
        def transcribe(p):
            return fw.transcribe(str(p), **{**FW_OPTIONS, **sequential_options})[0]
    run = Run(0.0)
    for p in paths:
        segments = list(transcribe(p))
        run.texts.append(" ".join(s.text.strip() for s in segments))
        run.tokens.append([t for s in segments for t in s.tokens])
    run.seconds = time.perf_counter() - start
    return run


def encoder_seconds(model: str) -> float:
    """One 30-s window through Cadence's encoder (WhisperBatched.encode), best of 3 after a warm-up."""
    from bench.common import in_fresh_thread

    def work():
        from engine.families.whisper import WhisperBatched
        from engine.loading import load

        loaded = load(model, device="cpu")
        decoder = WhisperBatched(loaded)
        window = torch.zeros(1, loaded.model.config.num_mel_bins, 3000, dtype=decoder.cross_k.dtype)
        decoder.encode(window)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            decoder.encode(window)
            best = min(best, time.perf_counter() - t0)
        return best

    return in_fresh_thread(work)


# ---------------------------------------------------------------------------- engine specs
FLOAT_ENCODER = "float-encoder"  # ``@int8+float-encoder``: int8's encoder unquantized, as before engine/many_rows_int8.py


@contextlib.contextmanager
def float_encoder(asked: bool):
    """While ``asked``, Whisper's int8 encoder runs in float whatever this machine's recorded choice."""
    import engine.many_rows_int8 as many_rows_int8

    kept = dict(many_rows_int8._CHOICE)
    if asked:
        many_rows_int8._CHOICE.update({torch.float32: "float", torch.bfloat16: "float"})
    try:
        yield
    finally:
        many_rows_int8._CHOICE.clear()
        many_rows_int8._CHOICE.update(kept)


def engine_name(spec: str, width, fw_batch: int) -> str:
    """What a row of the table calls an engine spec: ``KIND[@PRECISION]`` for Cadence (KIND: cadence,
    cadence-fixed, cadence-ts; PRECISION: float32 by default, or bfloat16, int8, auto, int8+float-encoder), and fw,
    fw-batched, fw-batched-ts, each with ``-int8`` for faster-whisper's int8 compute type."""
    kind, _, precision = spec.partition("@")
    if kind.startswith("cadence"):
        how = {"cadence": "voice-activity windows", "cadence-fixed": "fixed 30-s windows",
               "cadence-ts": "voice-activity windows, timestamps"}[kind]
        return f"Cadence engine (width {width}, {how}, {precision or 'float32'})"
    int8 = kind.endswith("-int8")
    kind = kind.removesuffix("-int8")
    what = {"fw": "faster-whisper sequential",
            "fw-batched": f"faster-whisper BatchedInferencePipeline (batch {fw_batch}, VAD chunks)",
            "fw-batched-ts": f"faster-whisper BatchedInferencePipeline (batch {fw_batch}, VAD chunks, timestamps)"}[kind]
    return f"{what}, {'int8' if int8 else 'float32'}"


def run_spec(spec: str, model: str, paths: list[Path], width, folder: Path, threads: int, fw_batch: int) -> Run:
    kind, _, precision = spec.partition("@")
    if kind.startswith("cadence"):
        precision, _, encoder = precision.partition("+")
        with float_encoder(encoder == FLOAT_ENCODER):
            return run_cadence(model, paths, width, "fixed" if kind == "cadence-fixed" else "vad",
                               kind == "cadence-ts", precision or "float32")
    compute = "int8" if kind.endswith("-int8") else "float32"
    kind = kind.removesuffix("-int8")
    return run_faster_whisper(model, paths, folder / compute, threads, fw_batch if kind.startswith("fw-batched") else 0,
                              kind.endswith("-ts"), compute)


# ---------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="whisper-tiny.en,whisper-base")
    parser.add_argument("--files", type=int, default=16, help="files in the timed batch (default 16)")
    parser.add_argument("--base", type=int, default=4, help="short files run alone and subtracted (default 4)")
    parser.add_argument("--width", default="8", help="Cadence's lane width: a number or auto (default 8)")
    parser.add_argument("--fw-batch", type=int, default=8, help="BatchedInferencePipeline batch size")
    parser.add_argument("--quick", action="store_true", help="a dry run: batch files of 5 to 20 s only")
    parser.add_argument("--engines", default="cadence,cadence-fixed,fw,fw-batched",
                        help="any of cadence, cadence-fixed, fw, fw-batched, and with time tokens: cadence-ts "
                             "(voice-activity windows, the CLI's and app's default) and fw-batched-ts; Cadence's "
                             "with @PRECISION (float32 by default, bfloat16, int8, auto), faster-whisper's with "
                             "-int8 (its int8 compute type)")
    parser.add_argument("--fw-timestamps", action="store_true",
                        help="faster-whisper sequential with timestamps (its long-form seeking: windows end at the "
                             "last timestamp) instead of without_timestamps=True; the batched pipeline is unchanged")
    parser.add_argument("--per-file", action="store_true", help="also print each file's WER per engine")
    parser.add_argument("--reference", default="fw", help="the engine speed-ups and same tokens are measured against")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timed rounds, the engines taking turns in each; seconds are medians, speed-ups the median "
                             "of the rounds' ratios (with their range)")
    args = parser.parse_args()
    if args.fw_timestamps:
        SEQUENTIAL_OPTIONS["without_timestamps"] = False
    from engine.api import parse_batch
    from engine.wer import corpus_wer, wer

    width = parse_batch(args.width)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    engines = [e.strip() for e in args.engines.split(",")]
    threads = torch.get_num_threads()
    longest = 20.0 if args.quick else 120.0
    work = Path(tempfile.mkdtemp(prefix="cadence-bench-"))
    try:
        t0 = time.perf_counter()
        base = make_clips(work, [5.0] * args.base, seed=1, prefix="base")
        batch = make_clips(work, batch_durations(args.files, 5.0, longest), seed=2, prefix="file")
        speech_s = sum(c.seconds for c in batch)
        n_windows = {"cadence": window_count(batch, "vad"), "cadence-fixed": window_count(batch, "fixed")}
        n_windows["cadence-ts"] = n_windows["cadence"]
        print(f"torch {torch.__version__}, {threads} threads; Cadence width {width}; faster-whisper cpu_threads "
              f"{threads}; speech made in {time.perf_counter() - t0:.1f} s")
        print(f"faster-whisper options: {FW_OPTIONS}" + (f", sequential run: {SEQUENTIAL_OPTIONS}" if SEQUENTIAL_OPTIONS
                                                           else "") + "\n")
        print(f"Batch: {len(batch)} files, {speech_s:.0f} s of speech ({min(c.seconds for c in batch):.1f} to "
              f"{max(c.seconds for c in batch):.1f} s each), {n_windows['cadence-fixed']} fixed 30-s windows or "
              f"{n_windows['cadence']} voice-activity windows; "
              f"{sum(len(c.text.split()) for c in batch)} words of known text.")
        print(f"Subtracted: {len(base)} short files ({sum(c.seconds for c in base):.0f} s of speech) run alone. "
              f"seconds = T(start-up + load + {len(base)} + {len(batch)} files) - T(start-up + load + {len(base)} "
              "files), each from a fresh engine / model, after one throw-away run per engine.\n")

        names = {e: engine_name(e, width, args.fw_batch) for e in engines}
        rows, raw, floors, per_file = [], [], [], []
        for model in models:
            results, seconds = {}, {eng: [] for eng in engines}  # seconds: each round's batch time
            for round_ in range(args.rounds):  # the engines take turns, so a busy spell falls on all of them
                for eng in engines:
                    folder = work / f"ct2-{model}"

                    def go(paths, eng=eng, model=model, folder=folder):
                        return run_spec(eng, model, paths, width, folder, threads, args.fw_batch)

                    if round_ == 0:
                        go([base[0].path])  # throw-away: one-time costs of the process
                    small = go([c.path for c in base])
                    full = go([c.path for c in base + batch])
                    seconds[eng].append(full.seconds - small.seconds)
                    if round_ == 0:  # greedy decoding: every round gives the same words
                        results[eng] = Run(0.0, full.texts[len(base):], full.tokens[len(base):], full.errors)
                    raw.append((model, names[eng], round_ + 1, small.seconds, full.seconds))
                    at = f" at width {full.width}" if full.width is not None else ""
                    print(f"  {model} / {names[eng]}, round {round_ + 1}{at}: T(base) {small.seconds:.2f} s, "
                          f"T(base + batch) {full.seconds:.2f} s", file=sys.stderr, flush=True)
            for eng in engines:
                results[eng].seconds = statistics.median(seconds[eng])
            if args.per_file:
                per_file.append((model, {eng: [wer(c.text, t) for c, t in zip(batch, results[eng].texts)]
                                         for eng in engines}))
            reference = results.get(args.reference)
            for eng in engines:
                r = results[eng]
                speed = "—"
                if reference and r.seconds > 0:  # the median of the rounds' ratios: each round's pair ran side by side
                    ratios = [a / b for a, b in zip(seconds[args.reference], seconds[eng]) if b > 0]
                    speed = f"{statistics.median(ratios):.2f}x" + (
                        f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")
                error_rate = corpus_wer(zip([c.text for c in batch], r.texts))
                same = "—" if eng == args.reference or "-ts" in eng or not reference else \
                    f"{sum(a == b for a, b in zip(r.tokens, reference.tokens))}/{len(batch)}"
                failed = f" ({len(r.errors)} failed: {r.errors[0]})" if r.errors else ""
                rows.append(f"| {model} | {names[eng]} | {r.seconds:.2f} | {speed} | {100 * error_rate:.1f}% | "
                            f"{same}{failed} |")
            cadence_runs = [e for e in engines if e.startswith("cadence") and "@" not in e]
            if cadence_runs:
                enc = encoder_seconds(model)
                floors += [(model, names[e], enc, n_windows[e.partition("@")[0]], results[e].seconds) for e in cadence_runs]

        rounds = f", median of {args.rounds} rounds" if args.rounds > 1 else ""
        print(f"## {len(batch)} files, models loaded (start-up and load subtracted{rounds})\n")
        print(f"| model | engine | seconds | speed-up vs {names.get(args.reference, args.reference)} | WER | "
              f"same tokens as it |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
        print("\n## Raw runs (each from a fresh engine / model)\n")
        print(f"| model | engine | round | T({len(base)} files) s | T({len(base) + len(batch)} files) s |")
        print("|---|---|---|---|---|")
        for model, eng, round_, small, full in raw:
            print(f"| {model} | {eng} | {round_} | {small:.2f} | {full:.2f} |")
        for model, table in per_file:
            print(f"\n## WER per file, {model}\n")
            print("| file | seconds | " + " | ".join(names[e] for e in engines) + " |")
            print("|---|---|" + "---|" * len(engines))
            for i, c in enumerate(batch):
                print(f"| {c.path.name} | {c.seconds:.1f} | " + " | ".join(f"{100 * table[e][i]:.1f}%" for e in engines) + " |")
        if floors:
            print("\n## Encoder floor (Cadence runs each 30-s window through the encoder once)\n")
            print("| model | engine | one window's encoder (s) | windows | floor (s) | Cadence (s) | Cadence / floor |")
            print("|---|---|---|---|---|---|---|")
            for model, name, enc, count, ours in floors:
                floor = enc * count
                print(f"| {model} | {name} | {enc:.3f} | {count} | {floor:.2f} | {ours:.2f} | {ours / floor:.2f}x |")
            print("\n(Under 1.0x can only come from the subtraction: in the longer run the short files' "
                  "windows share steps with the batch's. Timings are only meaningful on a quiet machine.)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
