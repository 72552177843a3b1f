"""The successor table of multi-token prediction's shift (``plan/next_token.py``), checked against
the definition: a token's successor is the next global id when it lies in the same document (the
padding one included), else none. Each rank's table is applied to the global ids themselves, with
the all-gather done by hand (every rank's ids at its ``send`` positions, in rank order), over real
plans and a scrambled layout (runs of one token, out of order, successors on the same rank)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsap.errors import PlanError
from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.next_token import next_token_map
from tests.megatron.test_batch import FakePlan, _cu_from_lengths


def _successors_by_table(plan) -> list[np.ndarray]:  # noqa: ANN001
    """Each rank's local ids shifted by its table; -1 where the table gives nothing (a document's end)."""
    tables = [next_token_map(plan, r) for r in range(plan.cp_size)]
    ids = [np.asarray(plan.local_token_indices(r), dtype=np.int64) for r in range(plan.cp_size)]
    gathered = np.concatenate([x[t.send] for x, t in zip(ids, tables)])
    out = []
    for x, t in zip(ids, tables):
        got = np.full(x.size, -1, dtype=np.int64)
        got[t.local_dst] = x[t.local_dst + 1]
        got[t.remote_dst] = gathered[t.remote_src]
        out.append(got)
    return out


def _check(plan) -> None:  # noqa: ANN001
    starts = np.asarray(plan.batch.doc_starts, dtype=np.int64)
    for r, got in enumerate(_successors_by_table(plan)):
        ids = np.asarray(plan.local_token_indices(r), dtype=np.int64)
        end = starts[np.searchsorted(starts, ids, side="right")]
        want = np.where(ids + 1 < end, ids + 1, -1)
        assert np.array_equal(got, want), (r, ids, got, want)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 50), min_size=1, max_size=9).filter(lambda ls: sum(ls) > 0),
       topo=st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (2, 4), (4, 2)]),
       layout=st.sampled_from(["balanced", "contiguous"]))
def test_successor_table_of_real_plans(lengths: list[int], topo: tuple[int, int], layout: str) -> None:
    intra, inter = topo
    plan = compile_plan(_cu_from_lengths(lengths), inter_size=inter, intra_size=intra, num_heads=8, num_kv_heads=8,
                        head_dim=8, pool_bytes=1 << 20, layout=layout)
    _check(plan)


@pytest.mark.parametrize("seed", range(6))
def test_successor_table_of_a_scrambled_layout(seed: int) -> None:
    plan = FakePlan([0, 5, 5, 17, 18, 40, 41], cp_size=4, seed=seed)  # empty and one-token documents, padding
    _check(plan)
    assert next_token_map(plan, 0).exchange  # successors sit on other ranks


def test_no_exchange_when_every_run_starts_a_document() -> None:
    """Four documents on four ranks, whole: nothing crosses a rank, so no rank calls the all-gather."""
    plan = compile_plan([0, 64, 128, 192, 256], inter_size=4, intra_size=1, num_heads=8, num_kv_heads=8, head_dim=8,
                        pool_bytes=1 << 20, layout="contiguous")
    tables = [next_token_map(plan, r) for r in range(4)]
    assert not any(t.exchange for t in tables) and all(t.remote_dst.size == 0 for t in tables)
    _check(plan)
    one_doc = compile_plan([0, 256], inter_size=4, intra_size=1, num_heads=8, num_kv_heads=8, head_dim=8,
                           pool_bytes=1 << 20, layout="contiguous")
    assert all(next_token_map(one_doc, r).exchange for r in range(4))  # every rank holds the same answer
    _check(one_doc)


def test_errors_name_the_problem() -> None:
    plan = FakePlan([0, 8], cp_size=2)
    with pytest.raises(PlanError, match="cp_rank=2 out of range"):
        next_token_map(plan, 2)
    plan._perm = np.array([[0, 1, 2, 3], [3, 5, 6, 7]])  # token 3 twice, token 4 nowhere
    with pytest.raises(PlanError, match="exactly once"):
        next_token_map(plan, 0)
