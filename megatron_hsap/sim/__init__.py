"""Cluster simulator: the compiled HSAP plans and the baselines' schedules on modelled A100/H100
clusters (``engine`` runs per-rank programs on a fluid network; ``methods.run_method`` is the one
entry point; ``reproduce``/``table4``/``magi``/``scale``/``validate`` are the reproductions,
``cli`` the ``megatron-hsap simulate`` command). Pure Python + numpy (+ matplotlib, tqdm for
reports); never imports torch.
"""

from __future__ import annotations

__all__ = ["run_method", "simulate", "sim_hardware", "Cluster"]


def __getattr__(name: str):  # noqa: ANN202 - lazy re-exports (PEP 562)
    if name == "run_method":
        from megatron_hsap.sim.methods import run_method

        return run_method
    if name == "simulate":
        from megatron_hsap.sim.engine import simulate

        return simulate
    if name == "sim_hardware":
        from megatron_hsap.sim.config import sim_hardware

        return sim_hardware
    if name == "Cluster":
        from megatron_hsap.sim.cluster import Cluster

        return Cluster
    raise AttributeError(f"module 'megatron_hsap.sim' has no attribute {name!r}")
