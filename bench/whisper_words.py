"""Where Cadence's words part from faster-whisper's (issue 15's word-error bound).

The 16-file batch of ``bench/transcription.py`` (espeak-ng speech, known text), whisper-tiny.en by
default, greedy, English, with time tokens on both sides:

- faster-whisper sequential with its timestamp seeking (each window after the first starts where the
  last whole phrase ended), float32 and int8, each in a fresh process: int8 ``--repeats`` times, once
  over the files alone in that order and once after the benchmark's four short files (what
  ``bench/transcription.py`` times), so the spread of int8's own words shows;
- Cadence's default path (voice-activity windows, timestamps) in float32 and in the given precisions.

Per file: its length, Cadence's windows, each run's WER; below, the files whose words differ from
faster-whisper float32's. Words only: the seconds printed are whole runs (start-up included) and mean
nothing beside another job.

    .venv/bin/python bench/whisper_words.py [--model whisper-tiny.en] [--precisions auto] [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.transcription import (  # noqa: E402
    SEQUENTIAL_OPTIONS,
    batch_durations,
    make_clips,
    run_cadence,
    run_faster_whisper,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="whisper-tiny.en")
    parser.add_argument("--precisions", default="auto", help="Cadence's precisions besides float32 (comma-separated)")
    parser.add_argument("--repeats", type=int, default=2, help="faster-whisper int8 runs over the files alone")
    args = parser.parse_args()
    from engine.audio import load_audio
    from engine.wer import corpus_wer
    from engine.whisper.features import log_mel
    from engine.whisper.pipeline import plan_windows

    SEQUENTIAL_OPTIONS["without_timestamps"] = False  # faster-whisper's long-form seeking
    work = Path(tempfile.mkdtemp(prefix="cadence-words-"))
    base = make_clips(work, [5.0] * 4, seed=1, prefix="base")
    batch = make_clips(work, batch_durations(16, 5.0, 120.0), seed=2, prefix="file")
    paths, refs = [c.path for c in batch], [c.text for c in batch]
    folder = work / f"ct2-{args.model}"
    runs: dict[str, list[str]] = {}

    def record(name: str, texts: list[str], seconds: float) -> None:
        runs[name] = texts
        print(f"{name}: WER {corpus_wer(zip(refs, texts)):.2%} ({seconds:.1f} s)", flush=True)

    t0 = time.perf_counter()
    fw = run_faster_whisper(args.model, paths, folder, 2, 0, False, "float32")
    record("fw float32", fw.texts, time.perf_counter() - t0)
    for i in range(args.repeats):
        t0 = time.perf_counter()
        record(f"fw int8 #{i + 1}", run_faster_whisper(args.model, paths, folder, 2, 0, False, "int8").texts,
               time.perf_counter() - t0)
    t0 = time.perf_counter()
    after = run_faster_whisper(args.model, [c.path for c in base] + paths, folder, 2, 0, False, "int8")
    record("fw int8 after 4 short files", after.texts[len(base):], time.perf_counter() - t0)
    for precision in ["float32"] + [p.strip() for p in args.precisions.split(",") if p.strip() not in ("", "float32")]:
        t0 = time.perf_counter()
        record(f"Cadence {precision}", run_cadence(args.model, paths, 8, "vad", True, precision).texts,
               time.perf_counter() - t0)

    names = list(runs)
    print(f"\n## WER per file, {args.model} (voice-activity windows: Cadence's windows of the file)\n")
    print("| file | seconds | windows | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for i, clip in enumerate(batch):
        audio = load_audio(clip.path)
        windows = len(plan_windows(log_mel(audio), audio, "vad"))
        print(f"| {clip.path.name} | {clip.seconds:.1f} | {windows} | "
              + " | ".join(f"{corpus_wer([(refs[i], runs[n][i])]):.1%}" for n in names) + " |")
    print("\nFiles whose words differ from faster-whisper float32's:")
    for name in names[1:]:
        differ = [batch[i].path.stem for i, (a, b) in enumerate(zip(runs[name], runs["fw float32"])) if a != b]
        print(f"- {name}: {len(differ)} of {len(batch)}" + (f" ({', '.join(differ)})" if differ else ""))


if __name__ == "__main__":
    main()
