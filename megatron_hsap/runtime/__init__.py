"""The runtime: executes compiled plans with torch (docs/design.md §2.2).

Names resolve lazily (PEP 562) so ``import megatron_hsap.runtime`` stays cheap and never pulls
in the GPU kernel libraries (they load only when a backend is selected).
"""

from __future__ import annotations

from megatron_hsap._lazy import lazy_exports

_LAZY = {
    "hsap_attn_func": "megatron_hsap.runtime.hsap",
    "HSAPAttention": "megatron_hsap.runtime.hsap",
    "SAPAttention": "megatron_hsap.runtime.sap",
    "check_cu_seqlens_consistent": "megatron_hsap.runtime.consistency",
    "attn_forward": "megatron_hsap.runtime.kernels",
    "attn_backward": "megatron_hsap.runtime.kernels",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
