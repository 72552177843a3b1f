#!/usr/bin/env bash
# Install megatron-hsap with its GPU kernels (flash-attn, Transformer Engine) into an environment
# that already has a CUDA build of PyTorch.
#
#   bash scripts/install_gpu.sh                  # install: build deps, then -e '.[gpu]' without build isolation
#   bash scripts/install_gpu.sh --dry-run        # check the preconditions, print every command, install nothing
#   bash scripts/install_gpu.sh --wheel PATH     # a prebuilt flash-attn wheel instead of pip's (repeatable)
#   bash scripts/install_gpu.sh --no-te | --no-flash-attn
#
# Why not just `pip install -e '.[gpu]'`: flash-attn's and Transformer Engine's setup.py import
# torch at build time, and pip's default build isolation builds them in a fresh environment
# without torch ("No module named 'torch'", flash-attention #1920), or worse, against a torch
# freshly downloaded for another CUDA. So: install PyTorch first (from the PyTorch index that
# matches your CUDA), then this script installs the build helpers and runs pip with
# --no-build-isolation, which builds against the torch already there. flash-attn's setup.py first
# tries a prebuilt wheel for this torch/CUDA/Python (set FLASH_ATTENTION_FORCE_BUILD=TRUE to
# compile instead; MAX_JOBS bounds the compile's memory). The pins are setup.py's `gpu` extra.
#
# Environment: PYTHON (default: the repository's .venv, else python3), MAX_JOBS (default 4).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=0
WITH_FA=1
WITH_TE=1
WHEELS=()

die() { printf 'install_gpu.sh: error: %s\n' "$*" >&2; exit 1; }
say() { printf 'install_gpu.sh: %s\n' "$*"; }

while (($#)); do
    case "$1" in
    --dry-run) DRY=1 ;;
    --no-flash-attn) WITH_FA=0 ;;
    --no-te) WITH_TE=0 ;;
    --wheel)
        (($# >= 2)) || die "--wheel needs a path or URL"
        WHEELS+=("$2")
        shift
        ;;
    -h | --help)
        sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *) die "unknown argument $1 (see --help)" ;;
    esac
    shift
done

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON="python3"; fi
fi
command -v "$PYTHON" >/dev/null 2>&1 || die "no Python at PYTHON=$PYTHON"

# Run (or, on a dry run, print) one command.
step() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    if ((DRY == 0)); then
        "$@"
    fi
}

# Preconditions, checked on a dry run too: Python >= 3.12, a pip that knows --no-build-isolation
# and --dry-run (>= 22.2), setuptools >= 64 for the editable build without isolation, and torch
# >= 2.11 (with CUDA, unless this is a dry run).
"$PYTHON" - "$DRY" <<'PY' || exit 1
import sys
dry = sys.argv[1] == "1"
def fail(msg):
    sys.exit(f"install_gpu.sh: error: {msg}")
def version(text):
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit())
if sys.version_info < (3, 12):
    fail(f"Python {sys.version.split()[0]} is older than 3.12")
try:
    import pip
except ImportError:
    fail("this Python has no pip; run: python -m ensurepip")
if version(pip.__version__) < (22, 2):
    fail(f"pip {pip.__version__} is too old; run: python -m pip install -U pip")
try:
    import setuptools
except ImportError:
    setuptools = None
if setuptools is None or version(setuptools.__version__) < (64, 0):
    print("install_gpu.sh: setuptools >= 64 missing; the build-helper step installs it")
try:
    import torch
except ImportError:
    fail("PyTorch is not installed: install a CUDA build first (https://pytorch.org/get-started/locally), then rerun")
if version(torch.__version__) < (2, 11):
    fail(f"PyTorch {torch.__version__} is older than 2.11")
if torch.version.cuda is None:
    if not dry:
        fail(f"PyTorch {torch.__version__} is a CPU build: flash-attn and Transformer Engine need a CUDA build")
    print(f"install_gpu.sh: note: PyTorch {torch.__version__} is a CPU build (fine for --dry-run only)")
print(f"install_gpu.sh: Python {sys.version.split()[0]}, pip {pip.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda})")
PY

# The gpu extra's pins, read from setup.py (one definition): flash-attn and transformer-engine.
mapfile -t PINS < <(cd "$ROOT" && "$PYTHON" - <<'PY'
import ast, pathlib
tree = ast.parse(pathlib.Path("setup.py").read_text())
extras = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and any(getattr(t, "id", None) == "EXTRAS_REQUIRE" for t in n.targets))
for req in ast.literal_eval(extras)["gpu"]:
    print(req)
PY
)
((${#PINS[@]} > 0)) || die "setup.py has no gpu extra"
say "gpu extra pins: ${PINS[*]}"

export MAX_JOBS="${MAX_JOBS:-4}"
PIP=("$PYTHON" -m pip)
step "${PIP[@]}" install "setuptools>=64" wheel packaging ninja psutil einops
if ((${#WHEELS[@]})); then
    step "${PIP[@]}" install --no-deps "${WHEELS[@]}"
fi
if ((WITH_FA && WITH_TE)); then
    step "${PIP[@]}" install --no-build-isolation -e "${ROOT}[gpu]"
else
    step "${PIP[@]}" install --no-build-isolation -e "$ROOT"
    for pin in "${PINS[@]}"; do
        if [[ "$pin" == flash-attn* && WITH_FA -eq 1 ]] || [[ "$pin" == transformer-engine* && WITH_TE -eq 1 ]]; then
            step "${PIP[@]}" install --no-build-isolation "$pin"
        fi
    done
fi
# What the runtime will pick (also on a dry run: nothing is installed by it). A backend that
# does not load says why in resolve_backend's start-up message.
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - <<'PY'
import torch
from megatron_hsap.runtime.kernels import BACKENDS, _unavailable_reason
device = "cuda" if torch.cuda.is_available() else "cpu"
for name in BACKENDS:
    reason = _unavailable_reason(name, device)
    print(f"install_gpu.sh: backend {name:<10} {'available' if reason is None else 'unavailable: ' + reason}")
PY
if ((DRY)); then
    say "dry run: nothing was installed; next on the GPU machine: bash scripts/gpu_check.sh"
else
    say "done; now run: bash scripts/gpu_check.sh"
fi
