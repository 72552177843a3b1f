#!/usr/bin/env bash
# Run the test suite with the project's venv (create it first: bash scripts/setup.sh).
#
#   bash scripts/test.sh                 # fast tests: -m "not slow"
#   bash scripts/test.sh --slow          # every test, slow multi-process ones included
#   bash scripts/test.sh --slow-only     # only the slow-marked tests (CI runs them after the default suite)
#   bash scripts/test.sh -k pool -x      # any other argument goes to pytest
#
# Environment: HSAP_VENV (default .venv in the repository), CI (adds a durations report).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HSAP_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

die() { printf 'test.sh: error: %s\n' "$*" >&2; exit 1; }

[[ -x "$PY" ]] || die "no virtual environment at $VENV; run: bash scripts/setup.sh (or set HSAP_VENV)"

# The tests must exercise the installed (editable) package of THIS checkout, not another clone's.
installed="$(cd / && "$PY" -c 'import importlib.util as u, os
spec = u.find_spec("megatron_hsap")
print(os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))) if spec and spec.origin else "")' 2>/dev/null)" || installed=""
if [[ -z "$installed" ]]; then
    die "megatron-hsap is not installed in $VENV; run: bash scripts/setup.sh"
elif [[ "$installed" != "$(cd "$ROOT" && pwd -P)" ]]; then
    die "$VENV has megatron-hsap installed from $installed, not from $ROOT; run: bash scripts/setup.sh"
fi

marker=(-m "not slow")
args=()
for arg in "$@"; do
    if [[ "$arg" == "--slow" ]]; then
        marker=()
    elif [[ "$arg" == "--slow-only" ]]; then
        marker=(-m "slow")
    else
        args+=("$arg")
    fi
done
if [[ -n "${CI:-}" ]]; then
    args=(--durations=15 "${args[@]}")
fi

# No path given: pytest collects testpaths (tests/) from pyproject.toml.
cd "$ROOT"
rc=0
"$PY" -m pytest "${marker[@]}" "${args[@]}" || rc=$?
if ((rc == 5)); then
    echo "test.sh: no tests were collected (marker/selection: ${marker[*]:-all} ${args[*]}); treating as success"
    exit 0
fi
exit "$rc"
