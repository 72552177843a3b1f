"""Stand-in packages for GPU-only kernels on CPU ranks (``cpu/mamba_kernels.py``: ``mamba_ssm`` and
``causal_conv1d``; ``cpu/gdn_kernels.py``: ``fla``): modules made in ``sys.modules`` so that
megatron-core's imports of them succeed. A test-and-demo shim, never imported on the GPU path."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

__all__ = ["register_packages"]


def register_packages(roots: tuple[str, ...], contents: dict[str, dict[str, Any]]) -> bool:
    """Put stand-in modules in ``sys.modules``: each of ``contents`` (a dotted name → its attributes)
    with every parent package, linked as attributes. Nothing when any of ``roots`` is already
    imported or installed (a real package is never shadowed). Returns whether it registered."""
    if any(root in sys.modules or importlib.util.find_spec(root) is not None for root in roots):
        return False
    names = sorted({".".join(name.split(".")[:i + 1]) for name in contents for i in range(name.count(".") + 1)})
    modules = {name: types.ModuleType(name) for name in names}
    for name, attrs in contents.items():
        for attr, value in attrs.items():
            setattr(modules[name], attr, value)
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
        sys.modules[name] = module
    return True
