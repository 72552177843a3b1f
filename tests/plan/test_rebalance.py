"""plan/rebalance.py: ``balance`` keeps the placement exact (its pieces still tile every block's
pairs, total work unchanged), never raises the placement's flat-rate time bound (max over ranks of
Σ_phase max(compute, transfer), the load it balances) above its start's, keeps
moves on the q/kv owners when ``allow_helpers=False``, and with a generous traffic budget brings
one long document over P ranks within 5% of ``tau = total / P`` (docs/design.md §2.1
step 2).

Reference: the block masks and checks of ``test_placement.py`` (independent brute force)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import LinkClass
from megatron_hsap.plan.placement import CostRates, owner_computes
from megatron_hsap.plan.rebalance import balance
from tests.plan.test_placement import HW, PR, STARTS, cases, check_placement, setup


@settings(max_examples=15, deadline=None)
@given(cases, st.sampled_from([0.3, 1.2]), st.booleans())
def test_balance_is_exact_and_never_worse(case, budget, helpers) -> None:
    batch, units = setup(*case)
    for start in STARTS:
        pl0 = start(units, case[1], PR)
        pl = balance(pl0, traffic_budget=budget, allow_helpers=helpers)
        check_placement(pl, batch, units, helpers=helpers)
        assert sum(pl.work) == sum(pl0.work)  # exact: integer pair counts in floats
        # why 1e-9: the bound sums float seconds in another order after moves; a real regression is far larger
        assert pl.flat_time_bound() <= pl0.flat_time_bound() * (1 + 1e-9)
        assert pl0.work == start(units, case[1], PR).work  # the start is copied, not changed


def test_one_long_document_is_balanced_near_tau() -> None:
    # Llama-sized heads: compute per pair large enough that moved rows hide behind it
    big = CostRates.of(HeadShape(num_heads=32, num_kv_heads=8, head_dim=128, head_dim_v=128), HW,
                    HW.bandwidth(LinkClass.INFINIBAND))
    batch, units = setup([16384], 4, "contiguous")
    start = owner_computes(units, 4, big)
    pl = balance(start, traffic_budget=1.2)
    tau = sum(pl.work) / 4
    assert sum(pl.work) == sum(start.work)
    assert max(start.work) / tau > 1.7  # the contiguous start is badly skewed (7/4 = 1.75)
    assert max(pl.work) / tau < 1.05  # why: the donor loop stops at tau·(1 + tol) and band cuts are whole rows
    assert pl.flat_time_bound() < 0.7 * start.flat_time_bound()

    # tiny heads: the same moves cannot hide behind compute, so the traffic cap forbids them
    batch, units = setup([4096], 4, "contiguous")
    assert balance(owner_computes(units, 4, PR), traffic_budget=1.2).work == owner_computes(units, 4, PR).work


@settings(max_examples=25, deadline=None)
@given(cases, st.data())
def test_rank_delta_is_bit_identical_to_the_full_delta(case, data) -> None:
    # _rank_delta prices one receiver before the full delta (a compile-time fast path): it must
    # give every rank exactly the bits Placement.delta gives it, or plans would change.
    # Reference: Placement.delta itself, on rebalanced starts (blocks with heads and bands on helpers).
    from megatron_hsap.plan.placement import _ZERO, _normalise
    from megatron_hsap.plan.rebalance import _rank_delta

    batch, units = setup(*case)
    size = case[1]
    for start in STARTS:
        pl = balance(start(units, size, PR), traffic_budget=data.draw(st.sampled_from([0.3, 5.0])))
        for i, u in enumerate(units):
            home = pl.home[i]
            m = data.draw(st.integers(u.q.start, home))
            h = data.draw(st.integers(0, size - 1))
            kept = data.draw(st.booleans())  # shed into a new band, or replace every band by one
            bands = pl.bands[i] + [(m, home, h)] if kept else [(m, u.q.stop, h)]
            full = pl.delta(i, m, bands)
            nh, nb = _normalise(u, m, bands)
            for r in range(size):
                assert _rank_delta(pl, i, nh, nb, r) == full.get(r, (0.0, _ZERO))


_LLAMA = HeadShape(num_heads=32, num_kv_heads=8, head_dim=128, head_dim_v=128)
# tiny heads (every helper refused), Llama heads over InfiniBand and over NVLink (helpers take rows)
_RATES = (PR, CostRates.of(_LLAMA, HW, HW.bandwidth(LinkClass.INFINIBAND)), CostRates.of(_LLAMA, HW, HW.bandwidth(LinkClass.NVLINK)))


def _with_and_without_bound(monkeypatch, pl0, budget):
    import megatron_hsap.plan.rebalance as rb

    fired = []
    bound = rb._helpers_cannot_hide

    def spy(*a):
        r = bound(*a)
        fired.append(r)
        return r

    monkeypatch.setattr(rb, "_helpers_cannot_hide", spy)
    got = balance(pl0, traffic_budget=budget)
    monkeypatch.setattr(rb, "_helpers_cannot_hide", lambda *a: False)
    want = balance(pl0, traffic_budget=budget)
    monkeypatch.setattr(rb, "_helpers_cannot_hide", bound)
    return got, want, fired


# (monkeypatch is set explicitly in every example, so sharing it across examples is safe)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.tuples(st.lists(st.integers(1, 600), min_size=1, max_size=6), st.integers(2, 4),
                 st.sampled_from(["contiguous", "balanced"])), st.sampled_from([0.3, 1.2, 5.0]), st.sampled_from(_RATES))
def test_skipped_head_sheds_are_the_ones_shed_would_refuse(monkeypatch, case, budget, rates) -> None:
    # balance skips, unpriced, head sheds whose rows no helper could hide (_helpers_cannot_hide, a
    # compile-time bound): the placement must be exactly the one of the search that prices every
    # candidate. Reference: balance with the bound switched off.
    _, units = setup(*case)
    for start in STARTS:
        got, want, _ = _with_and_without_bound(monkeypatch, start(units, case[1], rates), budget)
        assert (got.home, got.bands, got.work, got.traffic) == (want.home, want.bands, want.work, want.traffic)


@pytest.mark.parametrize("budget", [0.3, 0.6])
def test_the_skip_bound_fires_and_keeps_the_placement_on_a_packed_batch(monkeypatch, budget) -> None:
    # the test above checks little unless the bound both skips candidates and leaves others to
    # succeed: on fineweb 64K over 8 contiguous ranks (Llama heads, NVLink, the planner's budgets)
    # it skips some, helpers still take rows, and every placement is the fully priced one
    from megatron_hsap.plan.workloads import pack_batches

    rates = _RATES[2]
    cu = pack_batches("fineweb", 1 << 16, 1, 12345)[0]
    _, units = setup(np.diff(cu).tolist(), 8, "contiguous")
    skipped = helped = 0
    for start in STARTS:
        got, want, fired = _with_and_without_bound(monkeypatch, start(units, 8, rates), budget)
        skipped += sum(fired)
        helped += sum(1 for i, u in enumerate(units) for _, _, h in want.bands[i] if h not in (u.q_owner, u.kv_owner))
        assert (got.home, got.bands, got.work, got.traffic) == (want.home, want.bands, want.work, want.traffic)
    assert skipped > 10 and helped > 0, (skipped, helped)
