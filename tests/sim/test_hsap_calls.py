"""sim/hsap.py prices exactly the runtime's kernel calls (plan/calls.py, docs/design.md §2.2).

Property: on every simulated rank the workload holds one ``compute`` span per kernel call that
``plan/calls.py`` decides (× the head chunks, each chunk runs the SAP program once), and each pays
one launch: raising the launch cost by L raises the rank's compute seconds by exactly L × calls.
The runtime side of the same count is tests/runtime/test_executor.py."""

from __future__ import annotations


import pytest

from megatron_hsap.plan.calls import call_counts
from megatron_hsap.plan.hardware import KernelCurve
from megatron_hsap.sim.cluster import Cluster
from megatron_hsap.sim.config import KernelModel, SimHardware
from megatron_hsap.sim.engine import Busy
from megatron_hsap.sim.hsap import hsap_workload
from tests.configured import compile_plan  # the configured topology (flatten="never")


def _toy(launch_s: float) -> SimHardware:
    return SimHardware(name="toy", kernel=KernelModel(fwd_peak=4.0, bwd_peak=10.0,
                       curve=KernelCurve(half_rate_tokens=1e-12, launch_s=launch_s)),
                       nvlink_bw=1.0, ib_bw=0.25, nvlink_latency=0.5, ib_latency=1.0, hbm_bw=1e30,
                       dense_peak_flops=1.0)  # fmt: skip


CASES = [  # (cu_seqlens, inter, intra, options)
    ([0, 17, 60, 61, 128], 4, 1, {"pool_bytes": 16384}),
    ([*range(0, 40, 2), 64], 2, 1, {}),  # many short local documents: fused calls
    ([0, 900, 1000, 3100, 3200, 4096], 4, 2, {"num_heads": 8, "num_kv_heads": 4, "head_chunks": 2}),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"plan{i}")
def test_sim_prices_the_plans_kernel_calls(case: int) -> None:
    cu, inter, intra, options = CASES[case]
    plan = compile_plan(cu, inter, intra, **{"num_heads": 4, "head_dim": 8, **options})
    chunks = plan.head_chunks if intra > 1 else 1
    if case == 2:
        assert chunks == 2
    for phase in ("fwd", "bwd"):
        want = tuple(n * chunks for n in call_counts(plan, phase))
        secs = {}
        for launch in (0.0, 3.0):
            work, _ = hsap_workload(plan, Cluster(hw=_toy(launch), intra_size=intra, inter_size=inter), phase)
            spans = [[i for i in prog if isinstance(i, Busy) and i.kind == "compute"] for prog in work.programs]
            assert tuple(len(s) for s in spans) == want
            secs[launch] = [sum(i.seconds for i in s) for s in spans]
        items = sum(len(ins.items) for prog in plan.fwd_programs for ins in prog.instrs if hasattr(ins, "items"))
        assert sum(want) > 0 and (case != 1 or sum(want) < items * chunks)  # case 1 does fuse
        for r, n in enumerate(want):
            assert secs[3.0][r] - secs[0.0][r] == pytest.approx(3.0 * n, rel=1e-9)  # one launch per call


@pytest.mark.parametrize("hardware", ["h100", "a100"])
def test_estimate_and_simulator_charge_each_rank_the_same_compute(hardware: str) -> None:
    """Two computations of a rank's compute in one phase agree to rounding: the estimate's
    closed form over the staged blocks (``block_costs``: calls from ``BlockGroups``, gathered
    calls as one block plus their kv copy, merges by rows covered twice) and the simulator's
    walk over the programs' kernel calls (``plan/calls.py``; kernels, grids, GQA accumulation,
    local merges, kv gathers), NCCL slowdown off in both. On balanced plans that gather."""
    import dataclasses as dc

    import numpy as np

    from megatron_hsap.plan.block_costs import block_costs
    from megatron_hsap.plan.estimate import _arrays
    from megatron_hsap.plan.hardware import HARDWARE
    from megatron_hsap.plan.placement import CostRates
    from megatron_hsap.plan.calls import program_calls
    from megatron_hsap.sim.config import sim_hardware

    cu = [0, 1500, 1600, 4000, 4100, 6000, 8192]
    plan = compile_plan(cu, 8, 1, num_heads=8, num_kv_heads=2, head_dim=64, dtype_bytes=2, hardware=hardware,
                        layout="balanced", layout_fallback=False)  # fmt: skip
    gathered = sum(c.gathered for r in range(8) for st in program_calls(plan.program(r, "fwd"), plan.layout.segments[r])
                   for c in st)  # fmt: skip
    assert gathered >= 2  # not vacuous
    segments = tuple(tuple((s.tokens.start, s.local_start) for s in segs) for segs in plan.layout.segments)
    rates = CostRates.of(plan.shape, HARDWARE[hardware], 1.0, segments=segments)
    a = _arrays(plan.chosen.units)
    n = 1 + int(a[:, 1].max())
    sim_hw = dc.replace(sim_hardware(hardware), overlap_slowdown=0.0)
    for phase in ("fwd", "bwd"):
        bc = block_costs(a, 8, n, rates, phase)
        est = (bc.kernel + bc.fixed).sum(axis=1)
        work, _ = hsap_workload(plan, Cluster(hw=sim_hw, intra_size=1, inter_size=8), phase)
        sim = [sum(i.seconds for i in prog if isinstance(i, Busy) and (i.kind == "compute" or i.label in ("merge local", "gather kv")))
               for prog in work.programs]  # fmt: skip
        np.testing.assert_allclose(est, sim, rtol=1e-9)  # why: the same terms, summed in another order
