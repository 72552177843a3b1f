#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install megatron-hsap into it.
#
#   bash scripts/setup.sh                     # venv at ${HSAP_VENV:-.venv}, installs -e '.[test]'
#   bash scripts/setup.sh --find-python-only  # print the interpreter it would use, and exit
#   bash scripts/setup.sh --pins-hash         # print the hash of setup.py's dependency pins
#
# Environment:
#   HSAP_VENV          where the venv lives (default: .venv in the repository)
#   HSAP_PYTHON        use this interpreter instead of searching (must be Python >= 3.12)
#   HSAP_VENV_REPOINT  1: take over a venv whose editable install is another, still existing
#                      checkout's (refused otherwise; allowed when that checkout is gone, and in CI)
#
# The search for Python >= 3.12 runs each candidate, because a name on PATH may be a pyenv shim
# that fails unless its version is selected: python3.13, python3.12, python3 on PATH, then
# pyenv's installed versions, newest first ($(pyenv root), $PYENV_ROOT, ~/.pyenv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MIN_VERSION="3.12"
STAMP_NAME=".hsap-pins"

log() { printf 'setup.sh: %s\n' "$*" >&2; }
die() { printf 'setup.sh: error: %s\n' "$*" >&2; exit 1; }

# Succeed if interpreter $1 runs and is Python >= MIN_VERSION, setting VERSION (e.g. 3.12.1);
# otherwise fail, setting REASON (for the error message listing what was tried).
VERSION=""
REASON=""
python_version_ok() {
    local py="$1"
    VERSION=""
    if ! VERSION="$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null </dev/null)" ||
        [[ -z "$VERSION" ]]; then
        REASON="does not run (a pyenv shim for a version that is not selected?)"
        return 1
    fi
    if ! "$py" -c "import sys; sys.exit(0 if sys.version_info >= (${MIN_VERSION/./, }) else 1)" 2>/dev/null </dev/null; then
        REASON="Python $VERSION is too old"
        return 1
    fi
}

# Print the first usable interpreter (absolute path); exit 1 with the list of what was tried.
find_python() {
    local tried=() name path root version candidate
    if [[ -n "${HSAP_PYTHON:-}" ]]; then
        path="$(command -v "$HSAP_PYTHON" || true)"
        [[ -n "$path" ]] || die "HSAP_PYTHON=$HSAP_PYTHON is not an executable"
        python_version_ok "$path" || die "HSAP_PYTHON=$HSAP_PYTHON: $REASON (need Python >= $MIN_VERSION)"
        printf '%s\n' "$path"
        return 0
    fi

    for name in python3.13 python3.12 python3; do
        if ! path="$(command -v "$name")"; then
            tried+=("$name: not on PATH")
            continue
        fi
        if python_version_ok "$path"; then
            printf '%s\n' "$path"
            return 0
        fi
        tried+=("$path: $REASON")
    done

    local roots=()
    if command -v pyenv >/dev/null 2>&1 && root="$(pyenv root 2>/dev/null)" && [[ -n "$root" ]]; then
        roots+=("$root")
    fi
    roots+=("${PYENV_ROOT:-$HOME/.pyenv}" "$HOME/.pyenv")
    local seen=" "
    for root in "${roots[@]}"; do
        [[ "$seen" == *" $root "* ]] && continue
        seen+="$root "
        if [[ ! -d "$root/versions" ]]; then
            tried+=("$root/versions: no such directory")
            continue
        fi
        local found=0
        # Newest first: version-sort the directory names (3.13.0 before 3.12.1 before 3.9.18).
        while IFS= read -r version; do
            candidate="$root/versions/$version/bin/python3"
            [[ -x "$candidate" ]] || continue
            found=1
            if python_version_ok "$candidate"; then
                printf '%s\n' "$candidate"
                return 0
            fi
            tried+=("$candidate: $REASON")
        done < <(cd "$root/versions" && for d in */; do printf '%s\n' "${d%/}"; done | sort -rV)
        ((found)) || tried+=("$root/versions: no installed version has bin/python3")
    done

    {
        printf 'setup.sh: error: megatron-hsap needs Python >= %s and none was found. Tried:\n' "$MIN_VERSION"
        printf '  - %s\n' "${tried[@]}"
        printf 'Install one (e.g. "pyenv install 3.12", "uv python install 3.12", or your OS package\n'
        printf 'python3.12 with python3.12-venv), or point HSAP_PYTHON at one.\n'
    } >&2
    exit 1
}

# Hash of the dependency pins: the lines between the markers in setup.py.
pins_hash() {
    local pins
    pins="$(sed -n '/^# BEGIN PINS/,/^# END PINS/p' "$ROOT/setup.py")"
    [[ -n "$pins" ]] || die "no '# BEGIN PINS' ... '# END PINS' block in $ROOT/setup.py"
    if command -v sha256sum >/dev/null 2>&1; then
        printf '%s\n' "$pins" | sha256sum | cut -c1-16
    else
        printf '%s\n' "$pins" | shasum -a 256 | cut -c1-16
    fi
}

# The checkout whose megatron-hsap the venv's python imports (its editable install), or "" if none.
installed_checkout() {
    (cd / && "$1" -c 'import importlib.util as u, os
spec = u.find_spec("megatron_hsap")
print(os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))) if spec and spec.origin else "")' \
        2>/dev/null </dev/null) || true
}

# A venv holds one editable install. If it is another checkout's, installing this one re-points
# it and that clone's tests (scripts/test.sh) then refuse, or run this clone's code: two live
# clones sharing one HSAP_VENV would keep re-pointing it at each other. So take it over only when
# the other checkout is gone, when asked (HSAP_VENV_REPOINT=1), or in CI (.ci/run: a fresh clone
# in a new folder each run takes over the venv cached per pins hash); otherwise refuse with the fix.
check_venv_owner() {
    local venv="$1" owner here
    owner="$(installed_checkout "$venv/bin/python")"
    here="$(cd "$ROOT" && pwd -P)"
    if [[ -z "$owner" || "$owner" == "$here" ]]; then
        return 0
    fi
    if [[ ! -d "$owner/megatron_hsap" ]]; then
        log "taking over $venv: its editable install points at $owner, which no longer exists"
    elif [[ "${HSAP_VENV_REPOINT:-}" == 1 ]]; then
        log "taking over $venv from the checkout $owner (HSAP_VENV_REPOINT=1); run setup.sh there to point it back"
    elif [[ -n "${CI:-}" ]]; then
        log "taking over $venv from $owner (CI: this fresh clone reuses the cached venv)"
    else
        die "$venv belongs to another checkout: megatron-hsap is installed there (editable) from
  $owner, which still exists. Installing $ROOT would re-point it, and that
  clone's scripts/test.sh would then refuse to run (or run this clone's code). Either:
  - give this checkout its own venv: unset HSAP_VENV (default $ROOT/.venv) or set
    HSAP_VENV=/path/to/another-venv, or
  - take this venv over on purpose: HSAP_VENV_REPOINT=1 bash scripts/setup.sh"
    fi
}

main() {
    case "${1:-}" in
        --find-python-only) find_python; return 0 ;;
        --pins-hash) pins_hash; return 0 ;;
        -h | --help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; return 0 ;;
        "") ;;
        *) die "unknown option '$1' (try --help)" ;;
    esac

    local venv="${HSAP_VENV:-$ROOT/.venv}"
    local hash stamp py
    hash="$(pins_hash)"
    stamp="$venv/$STAMP_NAME"
    local pip_flags=(--disable-pip-version-check --no-input)
    if [[ -n "${CI:-}" ]]; then
        pip_flags+=(--progress-bar off)
    fi

    # Reuse an existing venv only if its Python is new enough; otherwise start over.
    local reuse=0
    if [[ -x "$venv/bin/python" ]]; then
        if python_version_ok "$venv/bin/python"; then
            reuse=1
            log "reusing $venv (Python $VERSION)"
        elif [[ -f "$venv/pyvenv.cfg" ]]; then
            log "removing $venv: its $REASON"
            rm -rf "$venv"
        else
            die "$venv exists but is not a usable virtual environment ($REASON); remove it or set HSAP_VENV"
        fi
    fi

    if ((reuse)); then
        check_venv_owner "$venv"  # before anything is installed into it
    fi

    if ((!reuse)); then
        py="$(find_python)"
        python_version_ok "$py"
        log "creating $venv with $py (Python $VERSION)"
        mkdir -p "$(dirname "$venv")"
        "$py" -m venv "$venv" ||
            die "'$py -m venv' failed (on Debian/Ubuntu install the python3.X-venv package)"
    fi

    local vpy="$venv/bin/python"
    cd "$ROOT"
    if ((reuse)) && [[ -f "$stamp" && "$(cat "$stamp")" == "$hash" ]]; then
        log "dependencies are current (pins $hash)"
    else
        log "installing megatron-hsap[test] into $venv (first time: a few minutes, ~5 GB for torch)"
        rm -f "$stamp"
        "$vpy" -m pip install "${pip_flags[@]}" --upgrade pip
        "$vpy" -m pip install "${pip_flags[@]}" -e '.[test]'
        printf '%s\n' "$hash" >"$stamp"
    fi
    # Point the venv at this checkout (check_venv_owner allowed it if another clone had it).
    # The venv's own setuptools (torch pulls one in) saves an isolated build env when new enough.
    local build_flags=()
    if "$vpy" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 71)' 2>/dev/null; then
        build_flags=(--no-build-isolation)
    fi
    log "installing this checkout ($ROOT) editable"
    "$vpy" -m pip install "${pip_flags[@]}" --quiet --no-deps "${build_flags[@]}" -e .

    log "done: $vpy"
    log "next: bash scripts/test.sh    then: $venv/bin/megatron-hsap --help"
}

main "$@"
