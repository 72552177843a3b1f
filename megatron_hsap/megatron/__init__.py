"""Megatron-core integration: the only sub-package that imports megatron-core.

Names resolve lazily (PEP 562), so ``import megatron_hsap.megatron`` imports neither
megatron-core nor the modules below until a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "initialize_hsap": "megatron_hsap.megatron.parallel_state",
    "get_hsap_groups": "megatron_hsap.megatron.parallel_state",
    "is_hsap_initialized": "megatron_hsap.megatron.parallel_state",
    "destroy_hsap": "megatron_hsap.megatron.parallel_state",
    "hsap_layer_spec": "megatron_hsap.megatron.spec",
    "get_batch_on_this_cp_rank": "megatron_hsap.megatron.batch",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_hsap.megatron' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
