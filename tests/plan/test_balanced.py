"""The document-aware balanced layout (issue: beyond the paper)."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsap.plan.balanced import balanced_layout, piece_work
from megatron_hsap.plan.layout import Batch, contiguous_layout, validate_layout
from megatron_hsap.plan.units import build_units
from megatron_hsap.plan.workloads import pack_batches


def _owner_imbalance(batch: Batch, layout) -> float:
    _, units = build_units(batch, layout)
    work = np.zeros(layout.inter_size)
    for u in units:
        work[u.q_owner] += u.work
    return float(work.max() / work.mean())


def test_piece_work_matches_brute_force() -> None:
    # rows a..b-1 of a document starting at s attend keys s..row: counted by hand
    for s, a, b in [(0, 0, 5), (3, 7, 12), (10, 10, 11)]:
        assert piece_work(s, a, b) == sum(r - s + 1 for r in range(a, b))


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=60),
    inter=st.integers(1, 12),
    intra=st.sampled_from([1, 2, 4]),
)
def test_every_token_once_and_equal_tokens(lengths: list[int], inter: int, intra: int) -> None:
    cu = np.concatenate([[0], np.cumsum(lengths)])
    batch = Batch.build(cu, inter * intra)
    layout = balanced_layout(batch, inter, intra)
    validate_layout(layout, batch.padded_tokens)  # every token exactly once, dense local rows
    ids = np.concatenate([layout.local_token_indices(r) for r in range(inter * intra)])
    assert np.array_equal(np.sort(ids), np.arange(batch.padded_tokens))
    assert {len(layout.local_token_indices(r)) for r in range(inter * intra)} == {batch.padded_tokens // (inter * intra)}


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=40),
    nodes=st.integers(2, 4),
    per_node=st.sampled_from([2, 4, 8]),
    token_cost=st.sampled_from([0.0, 50.0, 5e3, 1e6]),
    local_share=st.sampled_from([0.0, 0.1, 1.0]),
)
def test_node_aware_layout_keeps_every_token_once(lengths: list[int], nodes: int, per_node: int, token_cost: float,
                                                  local_share: float) -> None:
    """With inter ranks sharing nodes (``node_prices.NodePrices``: per-node rank sets, mixed kv prices)
    the layout is still a permutation of the batch with equal tokens per rank, whatever the two
    prices (kv free inside a node, or as dear as across)."""
    inter = nodes * per_node
    cu = np.concatenate([[0], np.cumsum(lengths)])
    batch = Batch.build(cu, inter)
    node = tuple(r // per_node for r in range(inter))
    layout = balanced_layout(batch, inter, 1, token_cost, -1, node, token_cost * local_share)
    validate_layout(layout, batch.padded_tokens)
    ids = np.concatenate([layout.local_token_indices(r) for r in range(inter)])
    assert np.array_equal(np.sort(ids), np.arange(batch.padded_tokens))
    assert {len(layout.local_token_indices(r)) for r in range(inter)} == {batch.padded_tokens // inter}


def test_deterministic() -> None:
    cu = pack_batches("fineweb", 1 << 16, 1, 3)[0]
    batch = Batch.build(cu, 8)
    assert balanced_layout(batch, 8, 1) == balanced_layout(batch, 8, 1)


def test_one_document_is_split_head_tail() -> None:
    batch = Batch.build([0, 64], 4)
    layout = balanced_layout(batch, 4, 1)
    # rank j holds head piece j and tail piece j: 8 tokens from the front, 8 from the back
    held = [[(s.tokens.start, s.tokens.stop) for s in segs] for segs in layout.segments]
    assert held == [[(0, 8), (56, 64)], [(8, 16), (48, 56)], [(16, 24), (40, 48)], [(24, 40)]]
    # why abs=0.02: the issue's 1.02 balance target (here it is exact: every rank holds 520 of the 2080 pairs)
    assert _owner_imbalance(batch, layout) == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("workload", ["fineweb", "slimpajama", "ultrachat", "sharegpt", "full"])
@pytest.mark.parametrize("tokens,inter", [(1 << 16, 8), (1 << 18, 8), (1 << 18, 64), (1 << 20, 64)])
def test_balances_work_to_the_issue_target(workload: str, tokens: int, inter: int) -> None:
    for cu in pack_batches(workload, tokens, 2, 0):
        batch = Batch.build(cu, inter)
        contiguous = _owner_imbalance(batch, contiguous_layout(batch, inter, 1))
        balanced = _owner_imbalance(batch, balanced_layout(batch, inter, 1))
        # owner-computes imbalance before any SAP move, work-only layout (token_cost 0): the issue's
        # target is 1.02 (measured ≤ 1.018 at these points; 1.03 at 64K over 64 ranks, not tested)
        # why + 1e-9: work.max() / work.mean() in floats; a real miss is at least one pair over the mean
        assert balanced <= min(contiguous, 1.02) + 1e-9, (workload, tokens, inter, contiguous, balanced)


def test_split_only_when_it_pays_for_its_traffic() -> None:
    # one document of 3 ranks' worth of work among short ones, P = 4: work alone splits it; when a
    # moved kv token costs more than the work a split saves, it stays whole (and only documents
    # longer than a rank's tokens are cut)
    cu = np.concatenate([[0], np.cumsum([3000] + [40] * 225)])
    batch = Batch.build(cu, 4)
    cheap = balanced_layout(batch, 4, 1, token_cost=0.0)
    dear = balanced_layout(batch, 4, 1, token_cost=1e6)
    holders = lambda lay: {r for r, segs in enumerate(lay.segments) for s in segs if s.tokens.start < 3000}  # noqa: E731
    assert len(holders(cheap)) >= 2 and _owner_imbalance(batch, cheap) < 1.05
    assert len(holders(dear)) == 1 and _owner_imbalance(batch, dear) > 1.5
    long_doc = Batch.build([0, 5000, 5400, 6000], 4)  # 5000 tokens > 1500 per rank: must be cut
    assert len({r for r, segs in enumerate(balanced_layout(long_doc, 4, 1, token_cost=1e6).segments)
                for s in segs if s.tokens.start < 5000}) >= 4


@pytest.mark.parametrize("token_cost", [0.0, 40.0, 2177.28])
@pytest.mark.parametrize("projected", [False, True])
def test_split_search_bound_only_skips_losers(monkeypatch, token_cost: float, projected: bool) -> None:
    # the early stop of the per-document split search (balanced._WiderBound.cannot_win, a lower bound
    # on every wider split) must give exactly the assignment of the search that tries every split count
    import megatron_hsap.plan.balanced as bal

    fired = []
    bound = bal._WiderBound.cannot_win

    def spy(self, best, k):
        r = bound(self, best, k)
        fired.append(r)
        return r

    for workload, tokens, inter in (("fineweb", 1 << 16, 8), ("sharegpt", 1 << 17, 16), ("slimpajama", 1 << 16, 4)):
        for cu in pack_batches(workload, tokens, 2, 11):
            batch = Batch.build(cu, inter)
            args = (batch.doc_starts, np.diff(batch.doc_starts), batch.doc_work(-1).astype(float), None, inter,
                    batch.padded_tokens // inter, projected, token_cost)
            monkeypatch.setattr(bal._WiderBound, "cannot_win", spy)
            held, cost = bal._assign(*args)
            monkeypatch.setattr(bal._WiderBound, "cannot_win", lambda self, best, k: False)
            held_all, cost_all = bal._assign(*args)
            assert held == held_all
            assert cost.tobytes() == cost_all.tobytes()
    if token_cost > 1000:
        assert any(fired), "the bound never stopped a search: the test checks nothing"


def test_small_documents_are_not_shredded_head_tail_over_many_ranks() -> None:
    """``_SLIVER_RANKS``: a small document whose split had to be widened for want of room, past 8
    ranks, is cut contiguously over the largest rooms (one piece per rank), not head–tail into
    1–2-token slivers (each a kernel call per earlier piece on its rank). The 1,024-GPU scale batch
    (slimpajama 1M over 8 x 128, GQA 64:8 over InfiniBand) had three 26–37-token documents head–tail
    over 12–13 ranks in 23–25 pieces before the rule."""
    from megatron_hsap.plan.balanced import _MIN_PIECE, _SLIVER_RANKS, kv_token_cost
    from megatron_hsap.plan.costs import HeadShape
    from megatron_hsap.plan.hardware import HARDWARE, LinkClass
    from megatron_hsap.plan.placement import CostRates

    cu = pack_batches("slimpajama", 1 << 20, 1, 0)[0]
    shape = HeadShape(num_heads=8, num_kv_heads=1, head_dim=128, head_dim_v=128, dtype_bytes=2)
    hw = HARDWARE["h100"]
    rates = CostRates.of(shape, hw, hw.bandwidth(LinkClass.INFINIBAND))
    batch = Batch.build(tuple(int(x) for x in cu), 128 * 8)
    layout = balanced_layout(batch, 128, 8, kv_token_cost(rates))  # as compile_plan
    validate_layout(layout, batch.padded_tokens)
    pieces: dict[int, list[int]] = {}
    for r, segs in enumerate(layout.segments):
        for s in segs:
            pieces.setdefault(int(np.searchsorted(cu, s.tokens.start, side="right") - 1), []).append(r)
    lengths = np.diff(cu)
    widened = {d: ranks for d, ranks in pieces.items()
               if len(set(ranks)) > max(_SLIVER_RANKS, int(lengths[d]) // (2 * _MIN_PIECE))}
    assert widened  # the batch still has documents over many ranks (small rooms at the end)...
    for d, ranks in widened.items():  # ...but each as one contiguous piece per rank
        assert len(ranks) == len(set(ranks)), (d, int(lengths[d]), len(set(ranks)), len(ranks))


def test_inter_ranks_sharing_a_node_split_documents_among_themselves() -> None:
    """``node_prices.NodePrices``: with 16 inter ranks on two 8-GPU nodes over InfiniBand (Table 2's SP 16),
    a split document's kv between ranks of one node is priced at NVLink rate, so the layout splits
    the long documents inside one node instead of leaving them whole (priced at the NIC, a split
    cost more than the imbalance: pair imbalance 2.28 on this batch, every rank's kv at 25 GB/s).
    Checked against the simulator, which executes the plan: the default plan of Table 2's slimpajama
    128K seed 0 simulated 11.89 ms before (Megatron's dynamic CP, which keeps a long sample's ring in
    one node, 10.24 ms); with the node-aware layout 6.93 ms."""
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.sim.config import sim_hardware
    from megatron_hsap.sim.methods import full_shape, run_method

    cu = pack_batches("slimpajama", 128 * 1024, 1, 0)[0]
    plan = compile_plan(cu, 16, 1, num_heads=16, num_kv_heads=16, head_dim=128, dtype_bytes=2, hardware="a100")
    assert plan.options.layout == "balanced" and plan.layout.name == "balanced"
    lengths = np.diff(cu)
    node_of = {r: r // 8 for r in range(16)}
    split = {}
    for r, segs in enumerate(plan.layout.segments):
        for s in segs:
            d = int(np.searchsorted(cu, s.tokens.start, side="right") - 1)
            split.setdefault(d, set()).add(r)
    long_docs = [d for d in np.argsort(-lengths)[:3].tolist() if len(split[d]) > 1]
    assert long_docs, "the longest documents are split"
    for d in long_docs:  # each over ranks of one node
        assert len({node_of[r] for r in split[d]}) == 1, (d, int(lengths[d]), sorted(split[d]))
    assert plan.stats().imbalance < 1.3
    hw = sim_hardware("a100")
    shape = full_shape(16, 16)
    ours = run_method("hsap", cu, hw=hw, intra=1, inter=16, shape=shape)
    dynamic_cp = run_method("hybrid_cp", cu, hw=hw, intra=1, inter=16, shape=shape)
    assert ours is not None and dynamic_cp is not None
    assert ours.seconds < 0.8 * dynamic_cp.seconds, (ours.seconds, dynamic_cp.seconds)
