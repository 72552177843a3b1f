"""Which ``torchrun`` a launch runs: the one of the Python environment the launcher runs in.

A bare ``torchrun`` is whatever comes first on ``PATH``: on a login or compute node that may be
another environment's (another torch, no megatron-hsap), or nothing at all. The sbatch scripts
run the launcher as ``$HSAP_PYTHON -m megatron_hsap.launch``, so ``sys.executable`` *is* the chosen
environment, and :func:`resolve_torchrun` picks, in this order:

1. an explicit command (``--torchrun`` / ``$HSAP_TORCHRUN``, split like a shell word list; a bare
   name is looked up on ``PATH``);
2. ``torchrun`` next to the interpreter (``<venv>/bin/torchrun``; the interpreter path is not
   resolved through symlinks, since a venv's ``python`` links to the base interpreter);
3. ``<python> -m torch.distributed.run`` (what the ``torchrun`` script runs), when torch is
   importable there.

The dry run prints the choice and why (``# torchrun: ...``). Whether torch is importable is found
with ``importlib.util.find_spec`` for the launcher's own interpreter: torch is not imported.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
from dataclasses import dataclass

from megatron_hsap.errors import ConfigError

__all__ = ["Torchrun", "resolve_torchrun"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Torchrun:
    """The resolved command (``argv`` prefix), where it came from, and a problem if unusable."""

    argv: tuple[str, ...]
    source: str  # "explicit", "next to python", "python -m"
    problem: str | None = None  # set when the command cannot run here; exec refuses, dry runs warn

    def describe(self) -> str:
        return f"{shlex.join(self.argv)} ({self.source})"

    def require(self) -> None:
        """Raise :class:`ConfigError` (with the fix) when this command cannot run."""
        if self.problem:
            raise ConfigError(self.problem)


def _torch_importable(python: str) -> bool:
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        return importlib.util.find_spec("torch") is not None
    return os.path.exists(python)  # another interpreter: cannot tell without running it


def resolve_torchrun(explicit: str | None = None, *, python: str | None = None) -> Torchrun:
    """The ``torchrun`` command for ``python`` (default: this interpreter); see the module doc.

    ``explicit`` is ``--torchrun`` / ``$HSAP_TORCHRUN`` (``None`` or empty: resolve). Never raises:
    an unusable result carries ``problem`` (call :meth:`Torchrun.require` before executing it).
    """
    python = python or sys.executable
    if explicit and explicit.strip():
        argv = tuple(shlex.split(explicit))
        exe = argv[0]
        found = shutil.which(exe) if os.sep not in exe else (exe if os.access(exe, os.X_OK) else None)
        problem = None
        if found is None:
            problem = (f"HSAP_TORCHRUN / --torchrun {explicit!r}: {exe} is not an executable "
                       f"{'on PATH' if os.sep not in exe else 'file'}; give an absolute path, or unset "
                       f"it to use the torchrun of {python}")
        return Torchrun(argv=argv, source="explicit: HSAP_TORCHRUN or --torchrun", problem=problem)
    beside = os.path.join(os.path.dirname(os.path.abspath(python)), "torchrun")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return Torchrun(argv=(beside,), source=f"next to {python}")
    problem = None
    if not _torch_importable(python):
        problem = (f"torch is not installed for {python} (no torchrun next to it either): run the "
                   "launcher with the Python of the training environment (HSAP_PYTHON=/path/to/venv/"
                   "bin/python) or set HSAP_TORCHRUN=/path/to/torchrun")
    return Torchrun(argv=(python, "-m", "torch.distributed.run"), source=f"no torchrun next to {python}",
                    problem=problem)
