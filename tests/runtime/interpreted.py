"""A Triton kernel module imported under Triton's interpreter, for the CPU tests of the CUDA-only
kernels (``runtime/fused_merge.py``, ``runtime/fused_max_logits.py``)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest


def interpreted(name: str, kernel: str) -> Iterator[ModuleType]:
    """Module ``name`` imported afresh with ``TRITON_INTERPRET=1`` (Triton 3.x reads it when
    ``triton.jit`` decorates, ``triton/runtime/jit.py``), its ``kernel`` checked to be interpreted;
    whatever was in ``sys.modules`` before is put back afterwards. Use it as a fixture's body."""
    triton = pytest.importorskip("triton")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    before = sys.modules.pop(name, None)
    mod = importlib.import_module(name)
    assert triton.knobs.runtime.interpret and type(getattr(mod, kernel)).__name__ == "InterpretedFunction"
    yield mod
    mp.undo()
    sys.modules.pop(name, None)
    if before is not None:
        sys.modules[name] = before
