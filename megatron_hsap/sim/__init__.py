"""Cluster simulator: the compiled HSAP plans and the baselines' schedules on modelled A100/H100
clusters (``engine`` runs per-rank programs on a fluid network; ``methods.run_method`` is the one
entry point; ``schedules``/``collectives``/``double_ring`` are the baselines' schedules, whose
records live in ``megatron_hsap.baselines.registry``). Reproductions: ``reproduce`` (Tables 2, 3),
``table4``, ``magi`` (MagiAttention's protocol, batches from ``protocols``), ``calibrate`` (the
constants against published figures), ``validate``, ``scale``, ``layouts``, ``gantt``; ``tune``
chooses one topology per run, ``report`` writes the README regions from ``results/*.csv``, and
``cli`` is ``megatron-hsap simulate``. Pure Python + numpy (+ matplotlib, tqdm for reports);
never imports torch.
"""

from __future__ import annotations

from megatron_hsap._lazy import lazy_exports

_LAZY = {
    "run_method": "megatron_hsap.sim.methods",
    "simulate": "megatron_hsap.sim.engine",
    "sim_hardware": "megatron_hsap.sim.config",
    "Cluster": "megatron_hsap.sim.cluster",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
