"""The runtime: executes compiled plans with torch (DESIGN §2.2).

Names resolve lazily (PEP 562) so ``import megatron_hsap.runtime`` stays cheap and never pulls
in the GPU kernel libraries (they load only when a backend is selected).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "hsap_attn_func": "megatron_hsap.runtime.hsap",
    "HSAPAttention": "megatron_hsap.runtime.hsap",
    "SAPAttention": "megatron_hsap.runtime.sap",
    "check_cu_seqlens_consistent": "megatron_hsap.runtime.consistency",
    "attn_forward": "megatron_hsap.runtime.kernels",
    "attn_backward": "megatron_hsap.runtime.kernels",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_hsap.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
