"""Issue 18's benchmarks: what telling speakers apart costs, and how far live captions trail speech.

1. Speakers: the 16-file batch of bench/transcription.py (5 s to 2 min of espeak-ng speech, mixed
   lengths), whisper-tiny.en, Cadence with timestamps at width 8, from one warmed engine: wall time
   with ``speakers="off"``, then with ``speakers="auto"`` (voice prints on their own thread beside
   decoding; the transcript finishes when both are done), alternated A/B/A/B. Also the voice prints
   and clustering alone, one file after another, on an idle engine. The goal: diarization adds
   under 15% to the batch (WhisperX users report 80-90% of their run time going to it).
2. Live captions: the same engine busy with 8 files of the batch (each one that finishes replaced by
   the next, so 8 transcribe throughout) while a recording of alternating voices is fed in real time (10-ms blocks, as PortAudio delivers them); for each caption, the delay
   from the moment the recording reached the end of its window to the moment its text arrived.

    .venv/bin/python bench/speakers_live.py [--files 16] [--width 8] [--rounds 2] [--quick]
                                            [--part both|speakers|captions]

Run it on a quiet machine: another process on the same cores slows every figure many times over.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.transcription import batch_durations, make_clips, speak  # noqa: E402

DIALOGUE = [
    ("en-us+f3", "Good morning everyone, thanks for joining the call today."),
    ("en-us+m3", "Thanks for having me, I have the quarterly numbers ready to share."),
    ("en-us+f3", "Great, let us start with the sales figures for the month of March."),
    ("en-us+m3", "Sales grew by twelve percent compared to February, mostly in the north."),
    ("en-us+f3", "That is excellent news for the whole team, well done."),
    ("en-us+m3", "We also signed two new customers and hired three engineers."),
]


MODEL = "whisper-tiny.en"  # set from --model


def batch_seconds(engine, paths, speakers) -> float:
    from engine import TranscribeRequest

    t0 = time.perf_counter()
    handles = [engine.submit(TranscribeRequest(str(p), model=MODEL, language="en", timestamps=True, speakers=speakers))
               for p in paths]
    for h in handles:
        h.result(3600)
    return time.perf_counter() - t0


def speakers_cost(engine, paths, rounds: int) -> None:
    from engine.audio import load_audio
    from engine.speakers import diarize

    batch_seconds(engine, paths[:2], "auto")  # warm: the model, the voice encoder, the kernels
    off, auto = [], []
    for _ in range(rounds):
        off.append(batch_seconds(engine, paths, "off"))
        auto.append(batch_seconds(engine, paths, "auto"))
    alone = 0.0
    for p in paths:
        samples = load_audio(p)
        t0 = time.perf_counter()
        diarize(samples, "auto")
        alone += time.perf_counter() - t0
    best_off, best_auto = min(off), min(auto)
    print(f"speakers off:  {', '.join(f'{s:.2f}' for s in off)} s (best {best_off:.2f})")
    print(f"speakers auto: {', '.join(f'{s:.2f}' for s in auto)} s (best {best_auto:.2f})")
    print(f"added by telling speakers apart: {100 * (best_auto - best_off) / best_off:.1f}% of the batch's time")
    print(f"voice prints + clustering alone, file after file: {alone:.2f} s = {100 * alone / best_off:.1f}% "
          f"of the batch's transcription time")


def dialogue_48k(folder: Path) -> np.ndarray:
    import soundfile as sf

    parts = []
    for i, (voice, line) in enumerate(DIALOGUE):
        path = speak(line, folder / f"turn{i}.wav", voice, 150)
        samples, rate = sf.read(path, dtype="float32")
        parts += [samples, np.zeros(int(0.6 * rate), np.float32)]
    audio = np.concatenate(parts)
    import soxr

    return soxr.resample(audio, 16000, 48000).astype(np.float32)


def caption_delay(engine, first_paths, busy_paths, recording: np.ndarray) -> None:
    from engine import LiveTranscribeRequest, TranscribeRequest
    def transcribe(path):
        return engine.submit(TranscribeRequest(str(path), model=MODEL, language="en", timestamps=True))

    busy = [transcribe(p) for p in first_paths]
    replaced = 0  # a file that finishes is replaced by the next, so 8 are transcribing until the recording ends
    live = engine.submit(LiveTranscribeRequest(model=MODEL, language="en", timestamps=True))
    block, rate = 480, 48000
    arrivals = []  # (seconds since the recording started, event), taken as each event arrives

    def listen():
        for event in live:
            arrivals.append((time.perf_counter() - started, event))

    listener = threading.Thread(target=listen, daemon=True)
    started = time.perf_counter()
    listener.start()
    for at in range(0, len(recording), block):  # real time
        live.feed(recording[at : at + block].reshape(-1, 1), rate)
        for i, handle in enumerate(busy):
            if handle.ended:
                busy[i] = transcribe(busy_paths[(len(busy) + replaced) % len(busy_paths)])
                replaced += 1
        ahead = started + (at + block) / rate - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)
    live.stop()
    listener.join(600)
    delays = []
    for arrived, event in arrivals:
        if event.kind == "progress" and event.window is not None and event.segments:
            heard = max(s.end for s in event.segments)  # where the window's speech ended, seconds in
            delays.append(arrived - heard)
            print(f"  caption {event.index} at {arrived:.2f} s: {event.text[:50]!r} {delays[-1]:.2f} s after its speech")
    for h in busy:
        h.cancel()
    if delays:
        print(f"live captions with {len(busy)} files transcribing throughout ({replaced} finished and were replaced): "
              f"median delay {statistics.median(delays):.2f} s, longest {max(delays):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="whisper-tiny.en")
    parser.add_argument("--quick", action="store_true", help="a dry run: 4 files of 5 to 15 s, one round")
    parser.add_argument("--part", choices=("both", "speakers", "captions"), default="both")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each figure shows as it is measured, also into a file
    if args.quick:
        args.files, args.rounds = 4, 1
    global MODEL
    MODEL = args.model
    from engine import Engine

    work = Path(tempfile.mkdtemp(prefix="cadence-bench-"))
    clips = make_clips(work, batch_durations(args.files, 5.0, 15.0 if args.quick else 120.0), seed=2, prefix="file")
    paths = [c.path for c in clips]
    print(f"{len(paths)} files, {sum(c.seconds for c in clips):.0f} s of speech; {args.model}, width {args.width}")
    engine = Engine(backend="cpu", batch=args.width, precision="float32", drafter="off")
    try:
        if args.part != "captions":
            speakers_cost(engine, paths, args.rounds)
        if args.part == "speakers":
            return
        busy = sorted(paths, key=lambda p: -next(c.seconds for c in clips if c.path == p))
        caption_delay(engine, busy[:8], busy, dialogue_48k(work))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
