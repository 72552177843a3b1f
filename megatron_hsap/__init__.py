"""megatron-hsap: hierarchical sequence-aware context parallelism for packed batches.

Names resolve lazily (PEP 562) so that ``import megatron_hsap.plan`` (pure Python + numpy)
never imports torch, and nothing imports Megatron unless asked.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "HSAPError": "megatron_hsap.errors",
    "compile_plan": "megatron_hsap.plan",
    "Plan": "megatron_hsap.plan",
    "hsap_attn_func": "megatron_hsap.runtime",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_hsap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
