"""Prepare what bench/device_check.sh needs on a bare GPU machine that cannot reach the network.

Writes ``.device/`` (ignored by git, carried to the machine, under the 64 MiB a call may carry):
- ``wheels/``: the pure-Python dependencies the GPU image lacks (platformdirs; silero-vad, which the
  default transcription path's voice-activity windows need), at the versions installed here;
- ``models/whisper-base/`` and ``models/smollm2-135m-instruct/``: each model's config and
  tokenizer without weights. The check fills them with seeded random weights there: the real
  weights (whisper-tiny.en alone is 75 MB in float16) do not fit in what a call carries. Step
  times depend on shapes, not values, so the throughput table is the real models'; the
  exactness checks (N=1 exact, batched = serial) run on those random weights;
- ``speech.npz``: 8 espeak-ng clips at 16 kHz.

    .venv/bin/python bench/prepare_device_check.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    import numpy as np

    from bench.common import speech_samples
    from engine.loading import load

    out = ROOT / ".device"
    shutil.rmtree(out, ignore_errors=True)
    (out / "models").mkdir(parents=True)
    from importlib.metadata import version

    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--dest", str(out / "wheels"), "platformdirs", f"silero-vad=={version('silero-vad')}"], check=True)

    for name in ("whisper-base", "smollm2-135m-instruct"):
        loaded = load(name)
        folder = Path(loaded.report.cache_path or loaded.source.folder)
        target = out / "models" / name
        target.mkdir()
        for f in folder.iterdir():  # config, generation config, tokenizer, chat template: no weights
            if f.suffix in (".json", ".txt", ".jinja"):
                shutil.copy(f, target / f.name)

    with tempfile.TemporaryDirectory() as work:
        clips = speech_samples(Path(work), 8)
    np.savez_compressed(out / "speech.npz", *clips)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")
    return 0 if size < 64 * 2**20 else 1


if __name__ == "__main__":
    sys.exit(main())
