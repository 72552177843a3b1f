"""argparse ``type=`` callables shared by every command (``plan``, ``bench``, ``memory``,
``simulate``, ``plan-quality``, ``train-tiny``): a bad value is an argparse error — one line naming
the flag, exit status 2 — before anything runs, never a traceback or an absurd table.

Pure standard library, so any layer may import it.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

__all__ = ["positive_int", "nonnegative_int", "positive_float", "nonnegative_float", "port", "writable_file"]


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    """An integer ≥ 1."""
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
    return value


def nonnegative_int(text: str) -> int:
    """An integer ≥ 0."""
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 0")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number > 0")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number ≥ 0."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number >= 0")
    return value


def port(text: str) -> int:
    """A TCP port 1..65535."""
    value = int(_number(text, int))
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: use 1..65535")
    return value


def writable_file(text: str) -> Path:
    """An output path whose directory exists (or can be created) and is writable."""
    path = Path(text)
    parent = path.parent if str(path.parent) else Path(".")
    probe = parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    if not os.access(probe, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {probe} is not writable")
    return path
