#!/usr/bin/env bash
# The engine's invariants and throughput table on a GPU machine, in well under 8 minutes.
#
# Here (once): .venv/bin/python bench/prepare_device_check.py   -> .device/ (7.5 MiB, git-ignored)
# There:       bash bench/device_check.sh                        (carry .device)
#
# The GPU machine has Python with PyTorch, transformers, tokenizers, safetensors and numpy but no
# network: the missing pure-Python packages (platformdirs, silero-vad) come as wheels in .device/wheels.
# Results: stdout, and $OUT/device_check.md when $OUT is set (else bench/out/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -d .device ]; then
  echo "Missing .device/: run '.venv/bin/python bench/prepare_device_check.py' first and carry .device." >&2
  exit 2
fi
SITE=/tmp/cadence-site
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .device/wheels/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
OUT_DIR=${OUT:-bench/out}
mkdir -p "$OUT_DIR"
timeout 450 $PY bench/device_check.py --assets .device --out "$OUT_DIR" "$@"
