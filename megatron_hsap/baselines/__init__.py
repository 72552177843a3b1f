"""The baselines HSAP is compared with, in one registry (tools layer: may import ``plan`` and
``runtime``; ``plan`` keeps no baseline code).

``registry``: one ``Baseline`` record per method (availability rule, flat price, simulated
schedule, CPU-executed implementation, source). ``flat``: the closed-form prices of
docs/design.md §4 (kernel calls priced with the planner's kernel model, ``kernel_blocks``) used
by ``plan-quality`` and the CPU benchmark's byte checks; ``hierarchical``: the same for the
all-to-all × ring and per-sample methods, and ``price``, the one entry point for every
closed-form price; ``windowed``: the peers under a sliding window.
"""

from __future__ import annotations

from megatron_hsap._lazy import lazy_exports

_LAZY = {
    "Baseline": "megatron_hsap.baselines.registry",
    "REGISTRY": "megatron_hsap.baselines.registry",
    "DOCUMENT_AWARE": "megatron_hsap.baselines.registry",
    "unavailable": "megatron_hsap.baselines.registry",
    "BASELINES": "megatron_hsap.baselines.flat",
    "BaselineCost": "megatron_hsap.baselines.flat",
    "price_baseline": "megatron_hsap.baselines.flat",
    "unavailable_reason": "megatron_hsap.baselines.flat",
    "HIERARCHICAL": "megatron_hsap.baselines.hierarchical",
    "price": "megatron_hsap.baselines.hierarchical",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
