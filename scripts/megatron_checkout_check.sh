#!/usr/bin/env bash
# Run megatron-hsap's Megatron tests against a Megatron-LM checkout's own `megatron` package (core
# and training) instead of the installed megatron-core wheel: does HSAP still work, unchanged, on
# the Megatron that users tracking Megatron-LM's main branch (or the next release) run?
#
#   bash scripts/megatron_checkout_check.sh MEGATRON_LM_DIR              # tests/megatron, slow included
#   bash scripts/megatron_checkout_check.sh MEGATRON_LM_DIR -m "not slow" # pytest arguments after it
#   bash scripts/megatron_checkout_check.sh MEGATRON_LM_DIR tests/megatron/test_mla.py  # other tests
#
# The checkout is not modified: its `megatron` folder is copied to a scratch directory, which goes
# first on PYTHONPATH (every rank that pretrain-cpu starts inherits it). Megatron builds its C++
# dataset index helpers with `make` at start-up; the copy gets the installed wheel's prebuilt module
# instead when the checkout's helpers.cpp is the wheel's (else the script stops and says so), and
# no Makefile, so megatron_hsap.megatron.pretrain_hooks uses the prebuilt one as with the wheel.
# Measured results go in docs/enable.md ("Newer Megatron-LM"). Needs the venv (scripts/setup.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HSAP_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
die() { printf 'megatron_checkout_check.sh: error: %s\n' "$*" >&2; exit 1; }

[[ $# -ge 1 ]] || die "usage: bash scripts/megatron_checkout_check.sh MEGATRON_LM_DIR [pytest args...]"
SRC="$(cd "$1" && pwd)" || die "no such directory: $1"
shift
[[ -d "$SRC/megatron/core" && -d "$SRC/megatron/training" ]] || die "$SRC has no megatron/core and megatron/training: give a Megatron-LM checkout"
[[ -x "$PY" ]] || die "no virtual environment at $VENV; run: bash scripts/setup.sh (or set HSAP_VENV)"

WHEEL="$(cd / && "$PY" -c 'import megatron.core, os; print(os.path.dirname(megatron.core.__file__))')"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/hsap-megatron-XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
cp -r "$SRC/megatron" "$SCRATCH/megatron"
DS="$SCRATCH/megatron/core/datasets"
cmp -s "$WHEEL/datasets/helpers.cpp" "$DS/helpers.cpp" \
    || die "the checkout's megatron/core/datasets/helpers.cpp differs from the installed wheel's: build its helpers for $("$PY" -V) first"
cp "$WHEEL"/datasets/helpers_cpp*.so "$DS/"
rm -f "$DS/Makefile"

version="$(cd / && PYTHONPATH="$SCRATCH" "$PY" -c 'import megatron.core.package_info as p; print(p.__version__)')"
commit="$(git -C "$SRC" log -1 --format='%h %ad' --date=short 2>/dev/null || echo 'not a git checkout')"
printf 'megatron_checkout_check.sh: megatron %s from %s (%s) instead of the wheel at %s\n' "$version" "$SRC" "$commit" "$WHEEL"

cd "$ROOT"
args=("$@")
paths=(tests/megatron)
for a in "${args[@]}"; do [[ "$a" == tests* ]] && paths=(); done  # (a test path given: only those)
PYTHONPATH="$SCRATCH:$ROOT" OPENBLAS_NUM_THREADS=1 "$PY" -m pytest -q -p no:cacheprovider -rfE "${paths[@]}" "${args[@]}"
