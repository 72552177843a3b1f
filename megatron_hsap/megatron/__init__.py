"""Megatron-core integration: the only sub-package that imports megatron-core.

Names resolve lazily (PEP 562), so ``import megatron_hsap.megatron`` imports neither
megatron-core nor the modules below until a name is used.
"""

from __future__ import annotations

from megatron_hsap._lazy import lazy_exports

_LAZY = {
    "initialize_hsap": "megatron_hsap.megatron.parallel_state",
    "get_hsap_groups": "megatron_hsap.megatron.parallel_state",
    "is_hsap_initialized": "megatron_hsap.megatron.parallel_state",
    "destroy_hsap": "megatron_hsap.megatron.parallel_state",
    "hsap_layer_spec": "megatron_hsap.megatron.spec",
    "hsap_hybrid_stack_spec": "megatron_hsap.megatron.spec",
    "get_batch_on_this_cp_rank": "megatron_hsap.megatron.batch",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
