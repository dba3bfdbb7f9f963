"""What the benchmarks share: known speech made with espeak-ng, and faster-whisper on our weights."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Meetings start at nine in the morning and end before lunch.",
    "Please remember to send the quarterly report to the finance team by Friday afternoon.",
    "We will review the budget numbers together next week and decide on the new hires for the spring.",
    "Tomorrow will be cloudy with a chance of rain in the afternoon, so bring an umbrella to the office.",
]


def speech_samples(folder: Path, count: int) -> list:
    """``count`` clips of 16 kHz mono speech, cycling through TEXTS."""
    from engine.audio import load_audio

    clips = []
    for i in range(count):
        raw, out = folder / f"speech{i}.raw.wav", folder / f"speech{i}.wav"
        subprocess.run(["espeak-ng", "-w", str(raw), "-v", "en-us+f3", "-s", "130", TEXTS[i % len(TEXTS)]],
                       check=True)
        subprocess.run(["sox", "-R", str(raw), "-r", "16000", "-c", "1", str(out)], check=True)
        clips.append(load_audio(out))
    return clips


def faster_whisper_model(name: str, folder: Path, threads: int, compute_type: str = "float32"):
    """faster-whisper on the same weights as Cadence (model parts joined into one model.bin), computing in
    ``compute_type`` (float32, or int8: what its CPU users run)."""
    from faster_whisper import WhisperModel

    from engine.models import resolve

    source = resolve(name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "model.bin", "wb") as out:
        for part in source.weights:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
    for file in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(source.folder / file, folder / file)
    return WhisperModel(str(folder), device="cpu", compute_type=compute_type, cpu_threads=threads)


def in_own_process(fn, *args):
    """Run ``fn(*args)`` in a fresh Python process and return its result (``fn`` at a module's top level).

    For a baseline that brings its own threads: llama.cpp's OpenMP pool, run in the benchmark's
    process, lingered and slowed every Cadence engine measured after it (an Intel Xeon, 2 cores:
    int8 at N=8 301 tok/s before one llama.cpp run, 185 after). Users run the two as separate programs.
    """
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def in_fresh_thread(fn, *args, **kwargs):
    """Run ``fn`` on a new thread and return its result.

    PyTorch's OpenMP pool belongs to the thread that first runs parallel work. When the main thread
    has run matrix products (transformers ``generate``, say) its pool lingers and slows a later
    engine thread by about a quarter on this 2-core machine, so the baselines run on a thread of
    their own, like the engine does.
    """
    import threading

    box = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
