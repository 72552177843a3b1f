"""The plan search (docs/design.md §2.1, §3): ``compile_plan`` turns a packed batch into a staged,
per-rank SAP ``Plan`` (the type: ``plan/plan_type.py``) that ``verify`` can prove: each token
layout's candidates searched (``plan/candidates.py``: placements, stagings, prices, code), the
layout kept by estimated time; cached by every input."""

from __future__ import annotations

import gc
import math
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from megatron_hsap.errors import BatchError, PoolSizeError
from megatron_hsap.plan.balanced import balanced_layout, kept_layout, kv_token_cost
from megatron_hsap.plan.bounds import ideal_compute
from megatron_hsap.plan.cache import PLAN_CACHE, clear_plan_cache, fast_key
from megatron_hsap.plan.candidates import (_OVERFLOW_STEP, Outpriced, _build, _choose, _each_staging, _explores, _placements,
                                           _stage_all)
from megatron_hsap.plan.codegen import PoolOverflow
from megatron_hsap.plan.cuts import held_bytes
from megatron_hsap.plan.flatten import a2a_cannot_win, choose_topology, flat_options, flat_topologies
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import HARDWARE
from megatron_hsap.plan.layout import Batch, Layout, contiguous_layout, normalize_cu_seqlens, padded_length, validate_layout
from megatron_hsap.plan.options import (DEFAULT_POOL_CHUNKS, DEFAULT_POOL_MIN, FORCED_FLATTEN, PlanOptions, inter_rank_nodes, kv_heads_per_rank,
                                         validated_options)
from megatron_hsap.plan.options import link_of as _link_of
from megatron_hsap.plan.placement import CostRates, plan_rates
from megatron_hsap.plan.plan_type import Plan
from megatron_hsap.plan.priced import PricedLayout
from megatron_hsap.plan.schedule import BlocksByRank, stage_cap
from megatron_hsap.plan.units import build_units, clip_unit

__all__ = ["Plan", "PlanOptions", "compile_plan", "choose_layout", "clear_plan_cache", "kv_heads_per_rank", "kept_layout"]


_BUDGET_FRACTION = 0.45  # per-stage remote pool use: two stages' inputs and results live at once
# a layout's code is not generated when its prices (``_loses``) all exceed the other
# layout's built time by more than this: a staged price sits at or below the built plan's time
# (the 404 builds of the 167 benchmark batches: built / staged 1.00-1.17, median 1.07, never under
# 0.98 -- the price pours local blocks at their pre-pour kernel rate; the explored candidates'
# entries are built prices already), so such a layout would lose the comparison anyway, unless
# another stage shape or a pool-overflow restage finds a cheaper staging, which ``_loses`` tries
# too (at the staged price, under the full budget and the first overflow step). The one
# document filling the batch at P_inter >= 16 loses by 1.02-3.4x on the balanced layout and was where a compile took
# minutes (pool-overflow rebuilds of a plan that was then dropped); packed batches at 1M/P_inter 64
# lose by 2-3x on the contiguous one, whose code was built and dropped (~15% of the compile)
_LAYOUT_PRUNE = 0.05
# choose_layout: a plan that moves work must beat the other layout's owner-computes plan by this.
# Not candidates._OWNER_MARGIN (1%, one layout's candidates): with the intra all-to-all replayed
# with its SM contention (pipeline.pipelined_time) and each head chunk's SAP priced at its shape,
# the two layouts' layer estimates order them as the simulator does on all 167 benchmark batches,
# and a 1% margin kept the owner-computes layout on 9 batches whose other layout simulated
# 0.3-1.4% faster. Swept 2026-12-03 on those batches before the per-chunk pricing, kept layout
# slower in simulation: 0 -> 5, 0.05-0.1% -> 4, 0.2% -> 6, 0.5% -> 9, 1% -> 13; with 0, fineweb
# 32K 4x2 s2 kept a plan 0.16% slower than the other layout's owner-computes (estimated 0.04% faster)
_LAYOUT_OWNER_MARGIN = 0.001


def compile_plan(cu_seqlens: object, inter_size: int, intra_size: int = 1, *, num_heads: int = 32,
                 num_kv_heads: int | None = None, head_dim: int = 128, head_dim_v: int | None = None,
                 dtype_bytes: int = 2, **options: Any) -> Plan:
    """Compile the SAP plan of one packed micro-batch (deterministic, cached by every input).

    Args:
        cu_seqlens: global cumulative lengths ``[0, l0, l0+l1, ..., T]`` (ints, non-decreasing;
            repeated entries are empty documents and cost nothing).
        inter_size / intra_size: ``P_inter`` × ``P_intra`` (topology written intra×inter).
        num_heads / num_kv_heads: q and kv heads *per tensor-parallel rank* (GQA when fewer kv).
        head_dim / head_dim_v: q/k head size and v head size (MLA: 192 / 128).
        dtype_bytes: activation element size (2 for bf16/fp16, 4 for fp32).
        **options: ``pad_multiple`` (pad T to a multiple of P·pad_multiple, e.g. the TP size under
            sequence parallelism), ``layout``, ``pool_bytes`` (receive pool per rank; default 4 ×
            chunk × local heads × (d_qk + d_v) × bytes, at least 1 MiB), ``link``, ``tp_size``,
            ``gpus_per_node``, ``hardware``, ``allow_helpers``, ``placement`` ("auto" or a fixed
            start, e.g. "owner-computes" for reference), ``head_chunks`` (None: the estimate picks
            how many head chunks pipeline the intra all-to-all, ``Plan.head_chunks``; an int forces
            it), ``flatten`` ("never", "auto", "always", "all-to-all": inside one node plan the batch
            as pure SAP over all ``P`` CP ranks, or as one all-to-all over them, when estimated
            faster, ``plan/flatten.py``; the returned plan is then ``1 × P`` or ``P × 1`` with
            ``options.flattened_from = (P_intra, P_inter)``) — see
            ``PlanOptions``.

    How (docs/design.md §2.1): work units (A1 diagonals, A2–A5 rectangles) → several placements
    (owner-computes, min-traffic, DistFlashAttn per document region, each balanced by exact work
    under a few traffic budgets; ``placement.py``) → stages (``schedule.py``) → each priced with
    the docs/design.md §4 model, the cheapest estimate turned into programs with pool slots
    (``codegen.py``). The plan is never estimated slower than owner-computes.

    ``T`` not divisible by ``P·pad_multiple`` is padded at the end to the next multiple ``T'``: the
    padding tokens form one extra document (causal among themselves), have ids ≥ T in
    ``local_token_indices`` and carry no loss. Raises ``BatchError``/``ConfigError`` on bad input.
    """
    opts = validated_options(inter_size, intra_size, num_heads, num_kv_heads, head_dim, head_dim_v, dtype_bytes, options)
    key = fast_key(cu_seqlens)
    if key is not None:
        hit = PLAN_CACHE.get((key, opts))
        if hit is not None:
            return hit
    cu = normalize_cu_seqlens(cu_seqlens)
    enabled = gc.isenabled()
    gc.disable()  # compiling allocates ~10^5 small objects; cyclic collections would dominate
    try:
        topologies = flat_topologies(opts)
        if opts.flatten in FORCED_FLATTEN and topologies:
            plan = _compile_windowed(cu, flat_options(opts, topologies[0]))
        else:  # the configured plan, or a one-level one when its layer is estimated faster (plan/flatten.py)
            plan = choose_topology(*_fitting(cu, opts, [flat_options(opts, t) for t in topologies]))
    except MemoryError:
        # the batch's size, not the pool: ``schedule.stage_cap`` bounds the stages and cut blocks
        # a small ``pool_bytes`` makes (docs/enable.md §7.4)
        raise BatchError(
            f"planning a batch of T={cu[-1]} tokens ({len(cu) - 1} documents) at inter_size={opts.inter_size} ran "
            "out of host memory (the planner holds a few int64 arrays per token); split the micro-batch or use "
            "more inter ranks"
        ) from None
    finally:
        if enabled:
            gc.enable()
    PLAN_CACHE.put((cu, opts), plan)  # thread-safe: plans may be compiled on a prefetch thread
    return plan


def _fitting(cu: tuple[int, ...], opts: PlanOptions, flat: list[PlanOptions]) -> list[Plan]:
    """``flatten="auto"``'s plans, the configured one first: those whose candidates fit the pool
    (one topology's may need more stages than ``schedule.stage_cap`` under it while another's fit:
    a one-level SAP plan holds all heads per rank, an all-to-all none); the configured topology's
    ``PoolSizeError`` when none does. The one-all-to-all plan is not compiled when a plan compiled
    before it is already as fast as its all-to-alls alone (``flatten.a2a_cannot_win``): it could
    not be kept."""
    try:
        plans, failed = [_compile_windowed(cu, opts)], None
    except PoolSizeError as e:
        plans, failed = [], e
    for o in flat:
        if plans and a2a_cannot_win(o, _head_shape(o), padded_length(cu[-1], _pad_multiple(o)) // (o.inter_size * o.intra_size),
                                    HARDWARE[o.hardware], min(p.layer_time for p in plans)):
            continue
        try:
            plans.append(_compile_windowed(cu, o))
        except PoolSizeError:
            pass
    if failed is not None and not plans:
        raise failed
    return plans


def _pad_multiple(opts: PlanOptions) -> int:
    """The batch is padded at the end to a multiple of this: every CP rank (× ``pad_multiple``) holds as many tokens."""
    return opts.inter_size * opts.intra_size * opts.pad_multiple


def _head_shape(opts: PlanOptions) -> HeadShape:
    """The heads one intra rank holds between the all-to-alls (per TP rank): what its plan moves and prices."""
    return HeadShape(
        num_heads=opts.num_heads // opts.intra_size,
        num_kv_heads=kv_heads_per_rank(opts.num_heads, opts.num_kv_heads or opts.num_heads, opts.intra_size),
        head_dim=opts.head_dim,
        head_dim_v=opts.head_dim_v or opts.head_dim,
        dtype_bytes=opts.dtype_bytes,
        fp32_grads=opts.grad_wire_dtype == "fp32",
    )


def _default_pool(chunk_tokens: int, shape: HeadShape) -> int:
    """The receive pool without ``pool_bytes``: ``DEFAULT_POOL_CHUNKS`` inter chunks of q/k/v rows, at
    least ``DEFAULT_POOL_MIN`` (docs/design.md §2.1)."""
    return max(DEFAULT_POOL_CHUNKS * chunk_tokens * shape.chunk_token_bytes, DEFAULT_POOL_MIN)


def _compile_windowed(cu: tuple[int, ...], opts: PlanOptions) -> Plan:
    """``_compile_uncached``, and under a window never estimated slower than the full plan clipped
    to it (``no_slower_than_full``)."""
    plan = _compile_uncached(cu, opts)
    return no_slower_than_full(plan) if opts.window_size is not None else plan


def _compile_uncached(cu: tuple[int, ...], opts: PlanOptions) -> Plan:
    """The plan of ``cu`` under ``opts`` (no cache); every layout staged on the way is released
    (``PricedLayout.release``) before it returns."""
    staged: list[PricedLayout] = []
    try:
        return _search(cu, opts, staged)
    finally:
        for p in staged:
            p.release()


def _search(cu: tuple[int, ...], opts: PlanOptions, staged: list[PricedLayout]) -> Plan:
    """``_compile_uncached``'s layout search; each ``PricedLayout`` it makes is appended to ``staged``."""
    shape = _head_shape(opts)
    size = opts.inter_size
    batch = Batch.build(cu, _pad_multiple(opts))
    if opts.layout == "contiguous":
        return _compile_on(contiguous_layout(batch, size, opts.intra_size), batch, shape, opts)

    hw = HARDWARE[opts.hardware]
    rates = CostRates.of(shape, hw, hw.bandwidth(_link_of(opts)))
    # any layout: every document whole at its own kernel rate, perfectly spread (docs/design.md §4)
    bound = ideal_compute(np.diff(batch.doc_starts), batch.doc_work(opts.window), size, rates)
    # Code is generated only for a layout that can still be kept: a layout whose best staged
    # price is over _LAYOUT_PRUNE above the other's built time would lose the choice anyway
    # (a staged price sits at or below the built time: _LAYOUT_PRUNE). The contiguous plan is built first
    # when it may be within 1% of the bound (then nothing can gain more); else after the balanced one.
    # The contiguous layout is staged and priced only when a decision needs its exact price:
    # ``con.floor`` (≤ that price) settles each comparison below whenever it falls on the far side.
    contiguous = con = None
    con_failed: PoolSizeError | None = None  # the contiguous layout's candidates do not fit the pool
    if opts.layout_fallback:
        con = _price_on(contiguous_layout(batch, size, opts.intra_size), batch, shape, opts, lazy=True)
        staged.append(con)
        if (kept_layout(con.floor / (1 + _LAYOUT_PRUNE), None, bound) == "contiguous"
                and np.isfinite(con.exact().price)  # (inf: nothing stages within the stage cap)
                and kept_layout(con.exact().price / (1 + _LAYOUT_PRUNE), None, bound) == "contiguous"):
            contiguous, con_failed = _built(con)
            if contiguous is not None and kept_layout(contiguous.chosen.time, None, bound) == "contiguous":
                return contiguous  # already within 1% of the compute bound: no layout can gain more
    # the layout's kv price is calibrated on fp32 gradient rows (balanced.py's flat model): priced
    # with the cheaper rows of grad_wire_dtype="activation" it split more documents and its plans
    # were estimated up to 13% slower (slimpajama 32K, 1x8 s2); the wires alone change below
    layout_rates = rates if shape.fp32_grads else CostRates.of(replace(shape, fp32_grads=True), hw, rates.bw)
    # inter ranks sharing a node split documents among themselves over NVLink (node_prices.NodePrices)
    local = kv_token_cost(replace(layout_rates, bw=hw.nvlink_bw))
    bal_layout = balanced_layout(batch, size, opts.intra_size, kv_token_cost(layout_rates), opts.window,
                                 inter_rank_nodes(opts, _link_of(opts)), local)
    if con is not None and bal_layout.segments == con.layout.segments:
        # the same tokens on every rank (always so on one inter rank, e.g. a batch flattened to one
        # all-to-all): one plan under either name, built once; the layout rule names it (a tie
        # keeps the balanced one) (tests/plan/test_one_inter_rank.py)
        plan = contiguous if contiguous is not None else _build_on(con)
        _ = plan.layer_time  # estimated once: the renamed plan carries it
        return choose_layout(plan, plan.renamed(bal_layout), bound)
    bal = _price_on(bal_layout, batch, shape, opts, lazy=True)
    staged.append(bal)
    bal.exact()
    if con is None:
        return _build_on(bal)
    if (contiguous is None and con_failed is None and bal.price > _past(con.floor)
            and bal.price > _past(con.exact().price)):
        # prune the balanced layout against the contiguous plan's built time only: a staged
        # price can sit below it (25% where a pool overflow restages: table4 fineweb 16K 1x8 s1)
        contiguous, con_failed = _built(con)
    # a layout is pruned against the other's built *layer* time (choose_layout compares whole
    # layers; with an intra all-to-all it can swamp a SAP gap: Table 4 slimpajama 16K 4x2 s0's
    # contiguous SAP is 8% above the balanced one, its layer 0.4% below, 1.4% below in
    # simulation); a layer takes at least its SAP, and at P_intra = 1 it is its SAP
    if contiguous is not None and _loses(bal, contiguous.layer_time):
        return contiguous
    balanced, bal_failed, contiguous, con_failed = _against_contiguous(bal, con, contiguous, con_failed)
    if balanced is None and bal_failed is None:
        return contiguous  # the balanced layout was priced past it
    if balanced is None:  # the other layout's plan, if it fits (under a small pool)
        if contiguous is not None:
            return contiguous
        if con_failed is not None:
            raise bal_failed
        return _build_on(con)
    if contiguous is None:
        layer = balanced.layer_time
        if con_failed is not None or con.floor > _past(layer) or _loses(con.exact(), layer):
            return balanced
        try:
            contiguous, _ = _built(con, _bar(balanced))
        except Outpriced:
            return balanced
        if contiguous is None:
            return balanced
    return choose_layout(contiguous, balanced, bound)


def _against_contiguous(bal: PricedLayout, con: PricedLayout, contiguous: Plan | None, con_failed: PoolSizeError | None
                        ) -> tuple[Plan | None, PoolSizeError | None, Plan | None, PoolSizeError | None]:
    """``_built(bal)`` with its pool-overflow retries stopped once it cannot beat the contiguous
    layout (``candidates.Outpriced``): past ``_LAYOUT_PRUNE`` over the contiguous plan's time, or,
    that plan not built yet, over its floor, then its staged price (each a bound to know whether
    that plan must be built: a balanced layout priced past the contiguous staged price leaves it
    unpruned, so ``_search`` would build it anyway). Searched again under the next bar when one
    stops it (its stagings and overflows are memoised on the splits). Returns ``(balanced,
    bal_failed, contiguous, con_failed)``, the contiguous plan or its error as they now stand;
    ``balanced`` and ``bal_failed`` both None when the contiguous plan wins."""
    def tightening():  # the contiguous layout's bounds, each computed when the last one was passed
        yield _bar(None, con.floor)
        yield _bar(None, con.exact().price)

    bars = tightening() if contiguous is None and con_failed is None else iter(())
    bar = next(bars, None)
    if bar is None:
        bar = _bar(contiguous)  # (inf when the contiguous layout does not fit)
    while True:
        try:
            balanced, bal_failed = _built(bal, bar)
            return balanced, bal_failed, contiguous, con_failed
        except Outpriced as out:
            bar = next(bars, None)
            if bar is not None and out.price <= bar:
                continue  # (a bar it is not past yet: search on)
            if contiguous is None and con_failed is None:
                contiguous, con_failed = _built(con)
            if contiguous is not None and out.price > _bar(contiguous):
                return None, None, contiguous, con_failed
            bar = _bar(contiguous)


def _built(p: PricedLayout, give_up: float = math.inf) -> tuple[Plan, None] | tuple[None, PoolSizeError]:
    """``_build_on(p, give_up)``, or its ``PoolSizeError``: under a small pool one layout's candidates
    may all need more stages than the cap while the other layout's fit (``_search`` keeps that one).
    ``candidates.Outpriced`` passes through."""
    try:
        return _build_on(p, give_up), None
    except PoolSizeError as e:
        return None, e


def _past(seconds: float) -> float:
    """The layout prune's threshold: ``_LAYOUT_PRUNE`` over ``seconds`` (another layout's time or a
    bound of it), past which a layout loses the layout choice."""
    return seconds * (1 + _LAYOUT_PRUNE)


def _bar(other: Plan | None, floor: float | None = None) -> float:
    """The price (seconds) past which a layout loses to the other one, the bar of every give-up
    (``candidates.Outpriced``): ``_past`` the other layout's built plan's layer time, or, that plan
    not built yet, ``_past`` a ``floor`` of it; ``inf`` with neither."""
    if other is not None:
        return _past(other.layer_time)
    return math.inf if floor is None else _past(floor)


def _loses(p: PricedLayout, other: float) -> bool:
    """The layout prune: whether staged layout ``p`` cannot come within ``_LAYOUT_PRUNE`` of the
    other layout's built time ``other`` (seconds), so its code need not be generated.

    Its least staged price decides first; above the threshold, its candidates are restaged: every
    shape under the full budget and under the first pool-overflow budget of ``candidates._choose``'s
    retry, cheapest candidate first, until one staging comes within the threshold (then the layout
    is kept: the question is only whether one does, so the rest are never staged; on a fineweb 64K /
    P_inter 8 batch this cut the prune's 168 stagings to 2). Staging again under a smaller budget
    changes the stage counts tried, and the price is not monotone in them. Found by hypothesis (cu
    [0, 15548, 55509, 65536], P_inter 16, GQA 32/8): the balanced layout's min-traffic staged at
    49.8 ms (7 stages) overflows the pool and restages to 43.8 ms (8 stages), built 44.2 ms, under
    the contiguous plan's 46.3 ms; priced without the restage, the balanced layout was pruned. A
    staging that overflows is followed by the next stage shape under the same budget when that is
    cheaper (``candidates._build_or_halve``), so every shape under the full budget is priced too.
    Only the first overflow step is priced: each further step cuts more blocks, and the prune
    exists to skip code generation that loses."""
    limit = _past(other)
    if p.price <= limit:
        return False
    full = p.capacity * _BUDGET_FRACTION
    for _, split, _ in sorted(p.priced.values(), key=lambda v: v[0]):
        for b in (full, full * _OVERFLOW_STEP):
            if any(t <= limit for t, _ in _each_staging(split, p.rates, p.latency, b, explore=_explores(split))):
                return False
    return True


def choose_layout(contiguous: Plan, balanced: Plan, bound: float) -> Plan:
    """The plan ``layout="balanced"`` with its fallback ships, of the two layouts' plans of one
    batch (``bound``: ``bounds.ideal_compute`` of the batch, ``PlanStats.kernel_ideal_s``)."""
    # The balanced layout must never lose to the paper's: on the batch where its split documents
    # cost more traffic than the balance saves, keep the contiguous layout (the plan carries its
    # layout, so batch sharding follows whichever was kept; stats().layout says which).
    # compared as whole layers: with P_intra > 1 the intra all-to-all pipelined with SAP at each
    # plan's head-chunk count (SAP alone kept a balanced plan 2.7% slower in simulation than
    # owner-computes on the contiguous layout, ultrachat 16K 4x2 s2); and a plan that moves work
    # must beat the other layout's owner-computes plan by _LAYOUT_OWNER_MARGIN
    c_s, b_s = contiguous.layer_time, balanced.layer_time  # SAP plus the pipelined all-to-all (Plan.layer_time)
    c_own, b_own = (p.chosen.name == "owner-computes" for p in (contiguous, balanced))
    if c_own and not b_own:
        b_s *= 1 + _LAYOUT_OWNER_MARGIN
    elif b_own and not c_own:
        c_s *= 1 + _LAYOUT_OWNER_MARGIN
    return balanced if kept_layout(c_s, b_s, bound) == "balanced" else contiguous


def _price_on(layout: Layout, batch: Batch, shape: HeadShape, opts: PlanOptions, *, lazy: bool = False) -> PricedLayout:
    """Units, placements and staged prices of ``batch`` on ``layout`` (no code yet); ``lazy``:
    staging and pricing wait for ``PricedLayout.exact``."""
    size = opts.inter_size
    validate_layout(layout, batch.padded_tokens)
    hw = HARDWARE[opts.hardware]
    link = _link_of(opts)
    capacity = opts.pool_bytes or _default_pool(layout.chunk_tokens, shape)
    rates = plan_rates(shape, hw, link, opts, layout.segment_starts())
    latency = hw.latency(link)
    pieces, units = build_units(batch, layout, opts.window)
    placements = _placements(units, size, rates, opts.allow_helpers)
    if opts.placement != "auto":
        placements = {n: pl for n, pl in placements.items() if n in (opts.placement, "owner-computes")}
        if opts.placement not in placements:  # min-traffic equals owner-computes on this batch
            placements[opts.placement] = placements["owner-computes"]
    stager = partial(_stage_all, size=size, rates=rates, latency=latency, budget=capacity * _BUDGET_FRACTION,
                     forced=opts.placement)
    p = PricedLayout(layout, batch, shape, opts, link, capacity, rates, latency, tuple(pieces), tuple(units),
                     placements, stager)
    return p if lazy else p.exact()


def _build_on(p: PricedLayout, give_up: float = math.inf) -> Plan:
    """Generate the code of ``p``'s lowest price (``_choose``: pool-overflow retries, the
    owner-computes recheck, ``Outpriced`` once every candidate is priced past ``give_up``) and
    assemble the ``Plan``."""
    p.exact()
    # a copy: _choose drops and re-prices candidates as it retries, and ``p.price`` must not move
    best, alternatives, owner_time = _choose(dict(p.priced), p.opts.inter_size, p.shape, p.capacity, p.rates, p.latency,
                                             p.capacity * _BUDGET_FRACTION, p.owner_deferred, give_up)
    if best is None:
        raise _pool_too_small(p)
    return Plan(
        options=p.opts,
        batch=p.batch,
        layout=p.layout,
        shape=p.shape,
        hardware=HARDWARE[p.opts.hardware],
        link=p.link,
        pool_capacity=p.capacity,
        pieces=p.pieces,
        work_units=p.units,
        chosen=best,
        alternatives=alternatives,
        owner_time=owner_time,
    )


def _pool_too_small(p: PricedLayout) -> PoolSizeError:
    """The error of a layout none of whose candidates fits its pool. Cut finer, a staging needs
    more stages, and the planner stops at ``schedule.stage_cap`` (each stage is a round of
    latency; past it a small pool cost minutes of compile: docs/enable.md §7.4). Names the least
    pool any placement could stage in within the cap when the pool is under it (a lower bound:
    uncut blocks, no slot fragmentation), else the default."""
    size = p.opts.inter_size
    cap = stage_cap(size)
    held = min(max(held_bytes(rem, p.rates) for rem in BlocksByRank.of(pl.placed(), size).remote)
               for pl in p.placements.values())
    need = int(held / (cap - 2) / _BUDGET_FRACTION) + 1
    default = _default_pool(p.layout.chunk_tokens, p.shape)
    flat = p.opts.flattened_from
    where = f"inter_size={size}" + (f", flattened from {flat[0]}x{flat[1]}" if flat else "")
    head = f"pool_bytes={p.capacity} is too small for this batch (T={p.batch.padded_tokens} tokens, {where})"
    fix = f"leave it unset (this batch's default: {default} bytes)"
    if need > p.capacity:
        return PoolSizeError(
            f"{head}: a rank's remote inputs and results ({held / 2**20:.1f} MiB under the placement that moves least) "
            f"would take more than {cap} stages per layer, the planner's cap (each stage is a round of latency); raise "
            f"pool_bytes (--hsap-pool-bytes) to at least {need} bytes or {fix}")
    return PoolSizeError(
        f"{head}: every staging that fits it overflows the pool's slots, and cut finer it would take more than {cap} "
        f"stages per layer, the planner's cap (each stage is a round of latency), or not one token row fits a stage; "
        f"raise pool_bytes (--hsap-pool-bytes) or {fix}")


def _compile_on(layout: Layout, batch: Batch, shape: HeadShape, opts: PlanOptions) -> Plan:
    """The plan of ``batch`` on ``layout``."""
    p = _price_on(layout, batch, shape, opts)
    try:
        return _build_on(p)
    finally:
        p.release()


def _with_clipped(plan: Plan, full: Plan) -> Plan:
    """``plan`` (windowed), or the full-causal plan ``full`` with every staged block clipped to
    ``plan``'s window when that is estimated faster: clipping only removes work and bytes, so a
    windowed plan is never estimated slower than the full-causal plan of its batch."""
    left = plan.options.window
    units = [c for u in full.chosen.units if (c := clip_unit(replace(u, window=left), left)) is not None]
    hw, link = full.hardware, full.link
    rates = plan_rates(full.shape, hw, link, full.options, full.layout.segment_starts())
    try:
        cand = _build(full.chosen.name, units, full.inter_size, full.shape, full.pool_capacity,
                      rates, hw.latency(link), full.chosen.budget)
    except PoolOverflow:  # (slots only shrink; first-fit could still differ)
        return plan
    if cand.time >= plan.chosen.time:
        return plan
    pieces, work_units = build_units(full.batch, full.layout, left)
    return replace(plan, layout=full.layout, pool_capacity=full.pool_capacity, pieces=tuple(pieces),
                   work_units=tuple(work_units), chosen=cand,
                   alternatives={**plan.alternatives, f"{cand.name} (full plan clipped)": cand.time})


def no_slower_than_full(plan: Plan) -> Plan:
    """A freshly compiled windowed ``plan`` against its batch's full-causal plan (compiled, or
    found in ``compile_plan``'s cache) clipped to the window; the faster of the two."""
    opts = replace(plan.options, window_size=None)
    key = (plan.batch.cu_seqlens, opts)
    full = PLAN_CACHE.get(key)
    if full is None:
        try:
            full = _compile_uncached(plan.batch.cu_seqlens, opts)
        except PoolSizeError:
            # the full-causal plan needs more than the pool gives (``_pool_too_small``: more stages
            # than the cap; the window's moves far less): the windowed plan is the only one
            return plan
        PLAN_CACHE.put(key, full)
    return _with_clipped(plan, full)
