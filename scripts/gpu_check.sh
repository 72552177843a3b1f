#!/usr/bin/env bash
# The one prepared GPU check (megatron_hsap/bench/gpu_check.py): kernels of every available
# backend vs the CPU float64 reference, the executor on CUDA, multi-rank NCCL when >= 2 GPUs,
# a kernel-rate calibration (calibration.yaml for `megatron-hsap simulate --config`) and a
# per-rank kernel-time vs planned-work comparison. Needs PyTorch >= 2.11 and numpy only; runs
# from a plain copy of the tree (no install). Budget: <= 4 minutes on one H200.
#
#   bash scripts/gpu_check.sh                      # on a GPU machine
#   bash scripts/gpu_check.sh --dry-run            # on CPU: everything but the CUDA calls
#   bash scripts/gpu_check.sh --out DIR --hardware h100
#
# Environment: PYTHON (default: python3 on PATH, or the repository's .venv when present).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON="python3"; fi
fi
command -v "$PYTHON" >/dev/null 2>&1 || { echo "gpu_check.sh: error: no Python at PYTHON=$PYTHON" >&2; exit 2; }
"$PYTHON" - <<'PY' || exit 2
import sys
try:
    import numpy, torch
except ImportError as exc:
    sys.exit(f"gpu_check.sh: error: {exc}; install PyTorch (>= 2.11) and numpy first")
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
if (major, minor) < (2, 11):
    sys.exit(f"gpu_check.sh: error: PyTorch {torch.__version__} is older than 2.11")
PY
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m megatron_hsap.bench.gpu_check "$@"
