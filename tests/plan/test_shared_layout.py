"""plan/shared_layout.py: every plan of ``plans_for_windows`` holds the same tokens on the same
CP ranks as the full-attention plan it came from, its compute items tile exactly the banded
causal mask of the batch (brute force: same document, 0 <= q − k <= left) and it verifies
(docs/design.md §2.1; issue 15).

Reference: the [T', T'] banded mask built here from ``cu_seqlens`` and the window."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.ir import Compute
from megatron_hsap.plan.shared_layout import compile_on_layout


def banded(cu: list[int], padded: int, left: int) -> np.ndarray:
    bounds = np.asarray(sorted(set(cu) | {padded}))
    doc = np.searchsorted(bounds, np.arange(padded), side="right")
    d = np.arange(padded)[:, None] - np.arange(padded)[None, :]
    return (doc[:, None] == doc[None, :]) & (d >= 0) & ((d <= left) if left >= 0 else True)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=5), st.integers(2, 4), st.integers(0, 40))
def test_windowed_plans_share_the_layout_and_tile_the_band(lengths, inter, left) -> None:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    base = compile_plan(cu, inter, num_heads=4, num_kv_heads=2, head_dim=16, pool_bytes=8192)
    plans = compile_on_layout(base, (left, 0)), compile_on_layout(base, None)
    assert plans[1] is base  # its own window: the same plan
    for plan in plans:
        for c in range(base.cp_size):
            assert np.array_equal(plan.local_token_indices(c), base.local_token_indices(c))
        T = plan.padded_tokens
        got = np.zeros((T, T), dtype=np.int64)
        for prog in plan.fwd_programs:
            for ins in prog.instrs:
                if isinstance(ins, Compute):
                    for it in ins.items:
                        m = np.zeros((T, T), dtype=bool)
                        m[it.q.start : it.q.stop, it.kv.start : it.kv.stop] = True
                        m &= banded(cu, T, it.window)
                        assert it.work == int(m.sum())
                        got += m
        assert (got == banded(cu, T, plan.options.window)).all()
        plan.verify()
    windowed = plans[0]
    assert windowed.options.window_size == (left, 0)
    assert windowed.stats().total_work == int(banded(cu, windowed.padded_tokens, left).sum())
