"""HSAP (Ulysses inside the intra group × SAP across the inter group) against the float64 reference.

Topologies are written intra×inter: world 4 runs 1×4, 2×2, 4×1 and world 8 runs 1×8, 2×4, 4×2,
8×1, with MHA and GQA (H 8; Hkv 8, 2, 1 — kv heads replicated when P_intra > Hkv). Every case
checks out, dq, dk, dv against ``tests/reference.py`` (fp32: 1e-5 × max(1, |ref|max)), the
executor's P2P bytes against the plan, and the intra all-to-all bytes against Ulysses' volume
(``ulysses_bytes``, kv replication counted). The degenerate topologies are compared with the
methods they reduce to, on the same inputs: P×1 with hand-written Ulysses + one varlen call, 1×P
with ``SAPAttention`` — bit for bit (no reduction is reordered). The balanced layout (forced, no
fallback) runs on every topology too: its permutation must pass through the all-to-all unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime import cases

TOPOLOGIES = {4: [(1, 4), (2, 2), (4, 1)], 8: [(1, 8), (2, 4), (4, 2), (8, 1)]}
KV_HEADS = (8, 2, 1)
TOKENS = {4: 128, 8: 256}


def _check(gloo_pool, world: int, specs: list[dict]) -> None:
    results = gloo_pool(world).run(cases.run_cases, specs, timeout=900)
    for i, spec in enumerate(specs):
        per_rank = [r[i] for r in results]
        plan = cases.compile_for(spec)
        assert plan.layout.name == spec["layout"], "the layout under test must be the one that ran"
        plan.verify()
        cases.check_against_reference(spec, per_rank)
        cases.check_bytes(spec, per_rank)


def _specs(world: int, per_topology: int, seed: int, layout: str = "contiguous") -> list[dict]:
    rng = np.random.default_rng(seed)
    total = TOKENS[world]
    specs = []
    for intra, inter in TOPOLOGIES[world]:
        for n in range(per_topology):
            cu = cases.random_packing(total, rng) if n else [0, 5, total // 2 + 1, total - 2]
            kv = KV_HEADS[(n + intra) % len(KV_HEADS)]
            specs.append(cases.build_spec(cu, intra=intra, inter=inter, heads=8, kv_heads=kv, dim=8, seed=n, layout=layout))
    return specs


@pytest.mark.parametrize("world", [4, 8])
def test_hsap_balanced_layout(gloo_pool, world):
    """The balanced layout's permutation through the intra all-to-all and the inter plan."""
    _check(gloo_pool, world, _specs(world, per_topology=2, seed=50 + world, layout="balanced"))


@pytest.mark.parametrize("world", [4, 8])
def test_hsap_topologies(gloo_pool, world):
    specs = _specs(world, per_topology=2, seed=world)
    # the groups of megatron_hsap.megatron.parallel_state, and the world default of 1×P / P×1 plans
    total = TOKENS[world]
    specs.append(cases.build_spec([0, 9, total], intra=2, inter=world // 2, kv_heads=1, seed=7, groups="initialize"))
    specs.append(cases.build_spec([0, total // 3, total], intra=1, inter=world, kv_heads=2, seed=8, groups="default"))
    specs.append(cases.build_spec([0, total // 3, total], intra=world, inter=1, kv_heads=2, seed=9, groups="default"))
    _check(gloo_pool, world, specs)


@pytest.mark.parametrize("world", [4, 8])
def test_degenerate_topologies_equal_sap_and_ulysses(gloo_pool, world):
    total = TOKENS[world]
    pool = gloo_pool(world)
    for intra, inter, kv in ((world, 1, 2), (1, world, 8), (world, 1, 8)):
        spec = cases.build_spec([0, 3, 3, total // 2 + 5, total - 1], intra=intra, inter=inter, kv_heads=kv, seed=11)
        for r in pool.run(cases.run_degenerate, spec, timeout=600):
            assert r["max_abs_diff"] == [0.0] * 4, (intra, inter, kv, r)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("world", [4, 8])
def test_hsap_random_packings(gloo_pool, world, layout):
    specs = _specs(world, per_topology=10, seed=100 + world, layout=layout)
    for start in range(0, len(specs), 10):
        _check(gloo_pool, world, specs[start : start + 10])
