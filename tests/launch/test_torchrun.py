"""Which torchrun the launcher runs: explicit, next to the interpreter (symlinks not followed),
or ``python -m torch.distributed.run`` — checked on fake interpreter directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.launch import torchrun as torchrun_mod
from megatron_hsap.launch.torchrun import resolve_torchrun


def _exe(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_torchrun_next_to_the_interpreter_of_a_venv(tmp_path: Path) -> None:
    # A venv's python is a symlink to the base interpreter: the venv's bin/ decides, not the target's.
    base = _exe(tmp_path / "base" / "bin" / "python3")
    _exe(tmp_path / "base" / "bin" / "torchrun")  # another environment's torchrun: not this one
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(base)
    mine = _exe(tmp_path / "venv" / "bin" / "torchrun")
    got = resolve_torchrun(python=str(venv_python))
    assert got.argv == (str(mine),) and got.problem is None
    assert got.describe() == f"{mine} (next to {venv_python})"


def test_falls_back_to_python_dash_m(tmp_path: Path) -> None:
    python = _exe(tmp_path / "env" / "bin" / "python")
    got = resolve_torchrun(python=str(python))
    assert got.argv == (str(python), "-m", "torch.distributed.run") and got.problem is None
    got.require()


def test_python_dash_m_torch_distributed_run_is_what_torchrun_runs() -> None:
    # The fallback command is real: this interpreter's torch answers it (torchrun's own --help).
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--nproc-per-node" in out.stdout.replace("_", "-")


def test_no_torch_and_no_torchrun_is_refused_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = _exe(tmp_path / "bare" / "bin" / "python3")
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.setattr(torchrun_mod.importlib.util, "find_spec", lambda name: None)
    got = resolve_torchrun()
    assert got.argv == (str(python), "-m", "torch.distributed.run")
    with pytest.raises(ConfigError, match="torch is not installed for .*HSAP_PYTHON=.*HSAP_TORCHRUN"):
        got.require()


def test_explicit_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = _exe(tmp_path / "bin" / "my-torchrun")
    assert resolve_torchrun(str(mine)).argv == (str(mine),)
    got = resolve_torchrun(f"{sys.executable} -m torch.distributed.run")  # a command with arguments
    assert got.argv == (sys.executable, "-m", "torch.distributed.run") and got.problem is None
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert resolve_torchrun("my-torchrun").problem is None  # a bare name: looked up on PATH
    for missing in ("no-such-torchrun", str(tmp_path / "nope" / "torchrun")):
        got = resolve_torchrun(missing)
        with pytest.raises(ConfigError, match="HSAP_TORCHRUN / --torchrun .* is not an executable"):
            got.require()
    assert resolve_torchrun("  ").source.startswith(("next to", "no torchrun"))  # empty: resolve
