"""megatron-hsap: hierarchical sequence-aware context parallelism for packed batches.

Names resolve lazily (PEP 562) so that ``import megatron_hsap.plan`` (pure Python + numpy)
never imports torch, and nothing imports Megatron unless asked.
"""

from __future__ import annotations

from megatron_hsap._lazy import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "HSAPError": "megatron_hsap.errors",
    "compile_plan": "megatron_hsap.plan",
    "Plan": "megatron_hsap.plan",
    "hsap_attn_func": "megatron_hsap.runtime",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
__all__ = [*__all__, "__version__"]
