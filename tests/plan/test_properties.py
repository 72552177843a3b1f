"""Property tests (hypothesis): thousands of random packings compile and verify, and a plan is
never estimated slower than leaving every block with its q owner.

The packings cover P_inter 1–16, P_intra 1–4, 1–300 documents, documents of length 1, one
document spanning everything, boundaries exactly on chunk edges, empty documents (repeated
``cu_seqlens`` entries), T not divisible by P, GQA, small receive pools, and both token layouts
(the balanced one forced as well as with its fallback to contiguous).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.configured import compile_plan  # the configured topology (flatten="never")
from megatron_hsap.errors import PoolSizeError
from megatron_hsap.plan.options import DEFAULT_POOL_MIN
from megatron_hsap.plan.plan import _LAYOUT_OWNER_MARGIN

HEADS = 12  # divisible by every P_intra 1–4
KV_FOR_INTRA = {1: [12, 4, 1], 2: [12, 6, 2, 1], 3: [12, 6, 3, 1], 4: [12, 4, 2, 1]}


@st.composite
def packings(draw, max_tokens: int = 4096):
    """(cu_seqlens, P_inter, P_intra, options) of one random packed batch."""
    P = draw(st.integers(1, 16))
    intra = draw(st.integers(1, 4))
    T = draw(st.one_of(st.integers(1, 64), st.integers(1, max_tokens)))
    kind = draw(st.sampled_from(["random", "random", "ones", "one", "edges", "empty"]))
    if kind == "one":
        cu = [0, T]
    elif kind == "ones":  # many documents of length 1, then the rest
        n = draw(st.integers(1, min(T, 300)))
        cu = list(range(n)) + [T]
    else:
        n = draw(st.integers(1, 300))
        cuts = draw(st.lists(st.integers(0, T), min_size=n - 1, max_size=n - 1))
        if kind == "edges":  # every chunk edge of the padded batch is a document boundary
            mult = P * intra
            padded = -(-T // mult) * mult
            cuts += [k * padded // P for k in range(1, P) if k * padded // P <= T]
        if kind == "empty":  # repeated entries: empty documents
            cuts += cuts[: len(cuts) // 2] + [T, 0]
        cu = [0, *sorted(cuts), T]
    options = dict(num_heads=HEADS, num_kv_heads=draw(st.sampled_from(KV_FOR_INTRA[intra])), head_dim=8)
    if draw(st.booleans()):
        options["head_dim_v"] = 4  # MLA-like value size
    pool = draw(st.sampled_from([None, None, None, 16384, 65536]))
    if pool:
        options["pool_bytes"] = pool
    if draw(st.integers(0, 9)) == 0:
        options["pad_multiple"] = 2
    layout = draw(st.sampled_from(["contiguous", "balanced", "balanced-forced"]))
    if layout != "contiguous":
        options.update(layout="balanced", layout_fallback=layout == "balanced")
    return cu, P, intra, options


def _compile_and_verify(case) -> None:
    cu, P, intra, options = case
    try:
        plan = compile_plan(cu, P, intra, **options)
    except PoolSizeError:
        # only an explicit pool far below the default may be refused (past schedule.stage_cap:
        # tests/plan/test_stage_cap.py); the batch itself must compile under the default pool
        assert options.get("pool_bytes", DEFAULT_POOL_MIN) * 16 <= DEFAULT_POOL_MIN, options
        options = {k: v for k, v in options.items() if k != "pool_bytes"}
        plan = compile_plan(cu, P, intra, **options)
    plan.verify()
    assert plan.padded_tokens % (P * intra) == 0 and plan.padded_tokens >= cu[-1]
    s = plan.stats()
    assert s.pool_peak_bytes <= plan.pool_capacity
    assert sum(s.work_per_rank) == plan.batch.total_work()
    ids = np.concatenate([plan.local_token_indices(r) for r in range(P * intra)])
    np.testing.assert_array_equal(np.sort(ids), np.arange(plan.padded_tokens))


# 150 examples in the default suite (300 took 91 s of its 15 minutes on 2 cores); the 2,000 of the
# slow suite took 316 s alone and crossed the 900 s hang guard on a loaded 2-core machine (a count,
# not a budget: it gets its own guard)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packings())
def test_random_packings_compile_and_verify(case) -> None:
    _compile_and_verify(case)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packings())
def test_random_packings_compile_and_verify_2000(case) -> None:
    _compile_and_verify(case)


@st.composite
def realistic(draw):
    """Batches at sizes where moving work can pay (full heads, long documents)."""
    P = draw(st.sampled_from([2, 3, 4, 8, 16]))
    T = draw(st.sampled_from([4096, 16384, 65536]))
    mean = draw(st.sampled_from([300, 2000, 10000, T]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = np.maximum(1, rng.lognormal(np.log(mean), 1.0, size=4 * T // mean + 2).astype(np.int64))
    ends = np.cumsum(lengths)
    cu = [0, *[int(e) for e in ends if e < T], T]
    heads = draw(st.sampled_from([(32, 32), (32, 8)]))
    link = draw(st.sampled_from([None, "nvlink", "ib"]))
    return cu, P, heads, link


# 40 examples per layout in the default suite (80 took 110 s of its 15 minutes on 2 cores), 200 in
# the slow suite (``..._200`` below): the same property, more batches
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=realistic())
# found by hypothesis: owner-computes' other stage shapes were skipped on a flat-rate bound that is
# no bound under InfiniBand (node-local pairs at NVLink rate): 7.678 ms chosen vs 7.442 alone
@example(case=([0, 1309, 2000, 2844, 4086, 5173, 5511, 6421, 7732, 12904, 14228, 14378, 16046, 16384], 16, (32, 32), "ib"))
# found by hypothesis: the traffic bound priced node-local pairs at the NIC's rate (a 4.94 ms
# "bound" over a 4.82 ms estimate that moves them over NVLink, as the hardware does)
@example(case=([0, 2267, 4019, 7813, 10034, 11204, 14075, 16384], 16, (32, 32), None))
# found by hypothesis: owner-computes was built only when the chosen plan came within 5% of its
# quick price (0.912 ms), though built alone it overflows the pool, restages and runs 0.820 ms
# against the chosen region-distflash plan's 0.847
@example(case=([0, 3377, 4096], 16, (32, 8), "nvlink"))
def test_never_worse_than_owner_computes(case, layout: str) -> None:
    _never_worse_than_owner_computes(case, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=realistic())
def test_never_worse_than_owner_computes_200(case, layout: str) -> None:
    _never_worse_than_owner_computes(case, layout)


def _never_worse_than_owner_computes(case, layout: str) -> None:
    # the planner's guarantee, per layout (the balanced one forced; the choice between layouts
    # is test_balanced_never_worse_than_contiguous's)
    cu, P, (h, hkv), link = case
    kw = dict(num_heads=h, num_kv_heads=hkv, head_dim=128, link=link, layout=layout, layout_fallback=False)
    auto = compile_plan(cu, P, **kw)
    owner = compile_plan(cu, P, placement="owner-computes", **kw)
    assert owner.stats().placement == "owner-computes"
    # exact float comparison of two sums of the same kind of terms; 1e-12 absorbs summation order
    assert auto.stats().estimated_time_s <= owner.stats().estimated_time_s * (1 + 1e-12)
    assert auto.stats().estimated_time_s >= auto.stats().lower_bound_s * (1 - 1e-12)


# 25 examples in the default suite (50 took 47 s), 120 in the slow suite (``..._120`` below)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(realistic())
# found by hypothesis: the balanced layout was pruned on its staged price (49.8 ms, over the
# contiguous plan's 46.3 ms by more than plan._LAYOUT_PRUNE), but that staging overflows the pool
# and restages to a plan built at 44.2 ms (plan._loses now prices the first restage)
@example(([0, 15548, 55509, 65536], 16, (32, 8), None))
def test_balanced_never_worse_than_contiguous(case) -> None:
    _balanced_never_worse_than_contiguous(case)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(realistic())
def test_balanced_never_worse_than_contiguous_120(case) -> None:
    _balanced_never_worse_than_contiguous(case)


def _balanced_never_worse_than_contiguous(case) -> None:
    cu, P, (h, hkv), link = case
    kw = dict(num_heads=h, num_kv_heads=hkv, head_dim=128, link=link)
    balanced = compile_plan(cu, P, layout="balanced", **kw)
    contiguous = compile_plan(cu, P, layout="contiguous", **kw)
    forced = compile_plan(cu, P, layout="balanced", layout_fallback=False, **kw)
    assert forced.layout.name == "balanced" and contiguous.layout.name == "contiguous"
    # never worse than the paper's layout, except by the owner-computes margin: a plan that moves
    # work must beat the other layout's owner-computes plan by _LAYOUT_OWNER_MARGIN (plan.py)
    assert balanced.chosen.time <= contiguous.chosen.time * (1 + _LAYOUT_OWNER_MARGIN)
    # 1.01: not a tolerance — the planner's own rule (within 1% of the compute bound, docs/design.md §2.1)
    if contiguous.chosen.time <= contiguous.stats().compute_bound_s * 1.01:
        # within 1% of the compute bound no layout can gain more: the balanced compile is skipped
        assert balanced.layout.name == "contiguous" and balanced.chosen.time == contiguous.chosen.time
        return
    # otherwise the kept plan is exactly the better of the two, the mover charged the margin when the
    # other is owner-computes (same numbers, no tolerance needed)
    c, b = contiguous.chosen, forced.chosen
    cs, bs = c.time, b.time
    if c.name == "owner-computes" and b.name != "owner-computes":
        bs *= 1 + _LAYOUT_OWNER_MARGIN
    elif b.name == "owner-computes" and c.name != "owner-computes":
        cs *= 1 + _LAYOUT_OWNER_MARGIN
    assert balanced.layout.name == ("balanced" if bs <= cs else "contiguous")
    assert balanced.chosen.time == (b.time if balanced.layout.name == "balanced" else c.time)
