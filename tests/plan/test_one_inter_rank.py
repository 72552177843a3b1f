"""Two shortcuts of the layout search (plan/plan.py) that must not change any plan:

- one inter rank (``P_intra × 1``, e.g. a batch flattened to one all-to-all): the contiguous and
  balanced layouts hold the same tokens, so the search builds one plan and the layout rule only
  names it; compiled apart, the two layouts' plans cost the same to the picosecond and hash alike
  but for the name;
- the layout prune (``plan._loses``) restages lazily and stops at the first staging within its
  threshold: its answer must equal the exhaustive definition (every staging of every candidate
  under the full and the first overflow budget).

Counts and picoseconds only, no timing."""

from __future__ import annotations

from dataclasses import replace

import pytest

import megatron_hsap.plan.plan as search
from megatron_hsap.plan.balanced import _ps
from megatron_hsap.plan.cache import clear_plan_cache
from megatron_hsap.plan.candidates import _OVERFLOW_STEP, _explores, _stagings
from megatron_hsap.plan.workloads import pack_batches
from tests.configured import compile_plan  # the configured topology (flatten="never")
from tests.plan.plan_regression_cases import ir_hash

GQA = dict(num_heads=32, num_kv_heads=8, head_dim=128)
MLA = dict(num_heads=16, num_kv_heads=16, head_dim=192, head_dim_v=128)


@pytest.mark.parametrize("workload, tokens, intra, heads, window", [
    ("fineweb", 32768, 8, GQA, None),
    ("ultrachat", 16384, 4, GQA, (1024, 0)),
    ("slimpajama", 32768, 2, MLA, None),
    ("fineweb", 8192, 4, MLA, (512, 0)),
])
def test_one_inter_rank_builds_one_plan_which_both_layouts_compile_to(
        monkeypatch: pytest.MonkeyPatch, workload: str, tokens: int, intra: int, heads: dict, window) -> None:
    for cu in pack_batches(workload, tokens, 2, 3):
        kw = dict(heads, window_size=window)
        clear_plan_cache()
        con = compile_plan(cu, 1, intra, layout="contiguous", **kw)
        bal = compile_plan(cu, 1, intra, layout="balanced", layout_fallback=False, **kw)
        # the reference: both layouts compiled on their own
        assert _ps(con.chosen.time) == _ps(bal.chosen.time)
        assert _ps(con.layer_time) == _ps(bal.layer_time)
        built: list[object] = []
        real = search._build_on
        monkeypatch.setattr(search, "_build_on", lambda p, *a: built.append(p.layout) or real(p, *a))
        clear_plan_cache()
        auto = compile_plan(cu, 1, intra, layout="balanced", **kw)
        monkeypatch.setattr(search, "_build_on", real)
        assert con.layout.segments == bal.layout.segments  # one rank holds every token either way
        # one plan built, named by the layout rule (under a window, one more: the full-causal plan it
        # must never be slower than, plan.no_slower_than_full)
        assert len(built) == 1 + (window is not None), built
        if auto.stats().layout == "balanced":  # a tie keeps the balanced layout
            assert auto.layout == bal.layout and _ps(auto.layer_time) == _ps(bal.layer_time)
        else:  # the contiguous plan within 1% of the compute bound
            assert auto.layout == con.layout and _ps(auto.layer_time) == _ps(con.layer_time)
            assert 100 * _ps(con.layer_time) <= 101 * _ps(auto.stats().kernel_ideal_s)
        # the same IR: layout, units and both phases' programs (not the options: fallback off above)
        assert ir_hash(auto) == ir_hash(bal if auto.stats().layout == "balanced" else con)


def _exhaustive_price(p: search.PricedLayout) -> float:
    """The reference the lazy prune must agree with: the least of ``p``'s price and every staging
    of each candidate under the full budget and the first overflow budget."""
    full = p.capacity * search._BUDGET_FRACTION
    return min(p.price, *(_stagings(split, p.rates, p.latency, b, explore=_explores(split))[0][0]
                          for _, split, _ in p.priced.values() for b in (full, full * _OVERFLOW_STEP)))


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_lazy_layout_prune_answers_as_the_exhaustive_one(layout: str) -> None:
    cu = pack_batches("fineweb", 65536, 1, 12345)[0]
    clear_plan_cache()
    plan = compile_plan(cu, 8, **GQA, hardware="a100", layout=layout, layout_fallback=False)
    lowest = _exhaustive_price(search._price_on(plan.layout, plan.batch, plan.shape, plan.options))
    stop = 1 + search._LAYOUT_PRUNE
    for other in (lowest / stop * 0.999, lowest / stop * 1.001, lowest, lowest * 2, lowest / 2):
        fresh = search._price_on(plan.layout, plan.batch, plan.shape, plan.options)  # nothing memoised
        assert search._loses(fresh, other) == (lowest > other * stop), other
        fresh.release()


def test_lazy_layout_prune_stops_at_the_first_staging_within_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    # fineweb 64K / P_inter 8 seed 12345, batch 0: the contiguous plan is built first and the
    # balanced layout's restaging finds a price within the threshold at once; the exhaustive prune
    # staged every shape of every candidate under two budgets (168 stagings)
    cu = pack_batches("fineweb", 65536, 1, 12345)[0]
    import megatron_hsap.plan.candidates as candidates

    counts = {"prune": 0, "all": 0}
    real = candidates.stage
    in_prune = [False]

    def stage(*args, **kwargs):
        counts["all"] += 1
        counts["prune"] += in_prune[0]
        return real(*args, **kwargs)

    real_loses = search._loses

    def loses(p, other):
        in_prune[0] = True
        try:
            return real_loses(p, other)
        finally:
            in_prune[0] = False

    monkeypatch.setattr(candidates, "stage", stage)
    monkeypatch.setattr(search, "_loses", loses)
    clear_plan_cache()
    plan = compile_plan(cu, 8, **GQA, hardware="a100", layout="balanced")
    assert plan.stats().layout == "contiguous"
    assert 0 < counts["prune"] <= 4, counts
    assert counts["all"] < 80, counts


def test_renamed_carries_the_estimates_and_refuses_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron_hsap.plan.chunks as chunks
    from megatron_hsap.errors import ConfigError
    from megatron_hsap.plan.layout import contiguous_layout

    cu = pack_batches("fineweb", 16384, 1, 5)[0]
    clear_plan_cache()
    plan = compile_plan(cu, 1, 4, **GQA, layout="contiguous")
    layer = plan.layer_time
    calls = [0]
    real = chunks.choose_head_chunks_timed
    monkeypatch.setattr(chunks, "choose_head_chunks_timed", lambda p: calls.__setitem__(0, calls[0] + 1) or real(p))
    other = plan.renamed(replace(plan.layout, name="balanced"))
    assert other.layout.name == "balanced" and other.layer_time == layer and other.head_chunks == plan.head_chunks
    assert calls[0] == 0  # carried over, not estimated again
    fresh = replace(plan, layout=other.layout)  # the reference: estimated from scratch
    assert fresh.layer_time == layer and calls[0] == 1
    two = compile_plan(cu, 2, 2, **GQA, layout="contiguous")
    with pytest.raises(ConfigError, match="holds other tokens"):
        plan.renamed(contiguous_layout(two.batch, 2, 2))
