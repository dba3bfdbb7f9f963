"""Builds resources/speech/check.ogg: the speech ``--precision auto`` checks Whisper's word error rate on.

About 50 s of known sentences spoken by espeak-ng in four voices at two speeds, 16 kHz mono,
stored as Opus (small enough to ship), with its text in resources/speech/check.txt. Run it again
only to change the clip; the shipped file is what every machine's check uses.

    python packaging/make_check_speech.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parent.parent
LINES = [
    ("en-us+f3", 140, "The quick brown fox jumps over the lazy dog, and the meeting starts at nine in the morning."),
    ("en-us+m3", 150, "Please send the quarterly report to the finance team before Friday afternoon."),
    ("en-gb+f3", 135, "The library closes early on Sundays, but the reading room stays open until six."),
    ("en-us+m1", 145, "Our train was delayed because a tree had fallen across the tracks near the river."),
    ("en-us+f3", 130, "She painted the kitchen a pale shade of green and hung new curtains by the window."),
    ("en-gb+m3", 150, "We will review the budget together next week and decide on the new hires for spring."),
    ("en-us+m3", 140, "Tomorrow will be cloudy with a chance of rain, so bring an umbrella to the office."),
    ("en-us+f2", 135, "The engineers measured every step twice before they trusted the new numbers."),
]
PAUSE_S = 0.6


def main() -> int:
    folder = ROOT / "resources" / "speech"
    folder.mkdir(parents=True, exist_ok=True)
    pieces = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (voice, rate, text) in enumerate(LINES):
            raw, wav = Path(tmp) / f"{i}.raw.wav", Path(tmp) / f"{i}.wav"
            subprocess.run(["espeak-ng", "-w", str(raw), "-v", voice, "-s", str(rate), text], check=True)
            subprocess.run(["sox", "-R", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(wav)], check=True)
            samples, _ = sf.read(wav, dtype="float32")
            pieces += [samples, np.zeros(int(16000 * PAUSE_S), dtype=np.float32)]
    audio = np.concatenate(pieces)
    sf.write(folder / "check.ogg", audio, 16000, format="OGG", subtype="OPUS")
    (folder / "check.txt").write_text(" ".join(text for _, _, text in LINES) + "\n", encoding="utf-8")
    print(f"{folder / 'check.ogg'}: {audio.size / 16000:.1f} s, {(folder / 'check.ogg').stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
