"""The full matrix of pipelined head chunks (issue 14 item 1; the fast subset is
``test_head_chunks.py``): every 4- and 8-rank topology (intra×inter 1×4, 2×2, 4×1, 1×8, 2×4, 4×2,
8×1) × MHA, GQA and GQA with replicated kv heads × ``head_chunks`` 1, 2 and the most the heads
allow × random packings, contiguous and balanced layouts, fp32 and bf16 — each against the
float64 reference, the plan's bytes, and one chunk (1e-6 relative in fp32; bf16 results are
rounded once per chunk result exactly as with one chunk, so they are compared to the reference
only).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime import cases
from tests.runtime.test_head_chunks import TOKENS, chunk_specs, check_chunk_group

TOPOLOGIES = {4: [(1, 4), (2, 2), (4, 1)], 8: [(1, 8), (2, 4), (4, 2), (8, 1)]}
# MHA; GQA; GQA with kv heads replicated at P_intra > 2 (1 kv head per rank at P_intra >= 2: the
# largest count's q chunks share it, plan/chunks.py)
HEADS = [(16, 16), (16, 8), (8, 2)]


def _groups(world: int, seed: int, layout: str, dtype: str, packings: int) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    out = []
    for intra, inter in TOPOLOGIES[world]:
        for h, hkv in HEADS:
            for n in range(packings):
                cu = cases.random_packing(TOKENS[world], rng)
                out.append(chunk_specs(cu, intra, inter, h, hkv, seed=n, layout=layout, dtype=dtype))
    return out


def _run(gloo_pool, world: int, groups: list[list[dict]], compare: bool = True) -> None:
    pool = gloo_pool(world)
    for start in range(0, len(groups), 6):
        batch = groups[start : start + 6]
        flat = [s for g in batch for s in g]
        results = pool.run(cases.run_cases, flat, timeout=1200)
        i = 0
        for g in batch:
            per = [[r[i + n] for r in results] for n in range(len(g))]
            if compare:
                check_chunk_group(g, per)
            else:
                for spec, per_rank in zip(g, per):
                    cases.check_against_reference(spec, per_rank)
                    cases.check_bytes(spec, per_rank)
            i += len(g)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("world", [4, 8])
def test_head_chunks_full_matrix(gloo_pool, world, layout):
    _run(gloo_pool, world, _groups(world, 300 + world, layout, "float32", packings=2))


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_head_chunks_bf16(gloo_pool, world):
    _run(gloo_pool, world, _groups(world, 400 + world, "contiguous", "bfloat16", packings=1), compare=False)
