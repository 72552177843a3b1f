"""``compile_plan``: a packed batch → a staged, per-rank SAP plan that ``verify()`` can prove
(docs/design.md §2.1, §3), chosen by estimated time among several placements; cached by every input."""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

import numpy as np

from megatron_hsap.errors import BatchError, ConfigError
from megatron_hsap.plan.cache import PLAN_CACHE, clear_plan_cache, fast_key
from megatron_hsap.plan.codegen import Message, PhaseCode, PoolOverflow, generate
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.estimate import PhaseTime, compute_bound, phase_time, price_staging
from megatron_hsap.plan.hardware import HARDWARE, Hardware, LinkClass, link_class_for
from megatron_hsap.plan.ir import Compute, Phase, Program, TokenRange, Unit
from megatron_hsap.plan.layout import Batch, Layout, contiguous_layout, normalize_cu_seqlens, validate_layout
from megatron_hsap.plan.balanced import balanced_layout, kept_layout
from megatron_hsap.plan.options import DEFAULT_POOL_CHUNKS, DEFAULT_POOL_MIN, PlanOptions, kv_heads_per_rank, validated_options
from megatron_hsap.plan.placement import Placement, Prices, min_traffic, owner_computes, region_distflash
from megatron_hsap.plan.rebalance import balance
from megatron_hsap.plan.schedule import Split, StageShape, Staging, StagingError, default_shape, stage, stage_shapes
from megatron_hsap.plan.units import Piece, WorkUnit, build_units

__all__ = ["Plan", "PlanOptions", "compile_plan", "clear_plan_cache", "kv_heads_per_rank", "kept_layout"]

@dataclass(frozen=True, slots=True)
class _Candidate:
    name: str
    units: tuple[Unit, ...]
    fwd: PhaseCode
    bwd: PhaseCode
    fwd_time: PhaseTime
    bwd_time: PhaseTime
    budget: float

    @property
    def time(self) -> float:
        return self.fwd_time.total + self.bwd_time.total


@dataclass(frozen=True, eq=False)
class Plan:
    """A compiled SAP plan for one packed micro-batch. Immutable; share it freely."""

    options: PlanOptions
    batch: Batch
    layout: Layout
    shape: HeadShape
    hardware: Hardware
    link: LinkClass
    pool_capacity: int
    pieces: tuple[Piece, ...]
    work_units: tuple[WorkUnit, ...]
    chosen: _Candidate
    alternatives: dict[str, float] = field(default_factory=dict)  # candidate name -> estimated time
    owner_time: float = 0.0

    # --- sizes -------------------------------------------------------------------------
    @property
    def key(self) -> tuple:
        return (self.batch.cu_seqlens, self.options)

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens

    @property
    def padded_tokens(self) -> int:
        return self.batch.padded_tokens

    @property
    def inter_size(self) -> int:
        return self.options.inter_size

    @property
    def intra_size(self) -> int:
        return self.options.intra_size

    @property
    def cp_size(self) -> int:
        return self.options.inter_size * self.options.intra_size

    @property
    def chunk_tokens(self) -> int:
        """Tokens per inter rank (after the intra all-to-all)."""
        return self.layout.chunk_tokens

    @property
    def local_tokens(self) -> int:
        """Tokens per CP rank before the intra all-to-all."""
        return self.layout.chunk_tokens // self.options.intra_size

    # --- programs ------------------------------------------------------------------------
    @property
    def fwd_programs(self) -> tuple[Program, ...]:
        return self.chosen.fwd.programs

    @property
    def bwd_programs(self) -> tuple[Program, ...]:
        return self.chosen.bwd.programs

    @functools.cached_property
    def head_chunks(self) -> int:
        """Head chunks pipelining the intra all-to-all (``options.head_chunks`` or the estimate's; ``plan/chunks.py``)."""
        from megatron_hsap.plan.chunks import resolve_head_chunks

        return resolve_head_chunks(self)

    @functools.cached_property
    def hash(self) -> int:
        """128-bit identity of the programs (``plan/fingerprint.py``): equal on every node that
        compiled the same inputs; the runtime's pre-round handshake compares it."""
        from megatron_hsap.plan.fingerprint import plan_hash

        return plan_hash(self)

    def program(self, inter_rank: int, phase: Phase | str) -> Program:
        if isinstance(inter_rank, bool) or not isinstance(inter_rank, Integral) or not 0 <= inter_rank < self.inter_size:
            raise ConfigError(
                f"inter rank {inter_rank!r} is out of range: this plan has inter ranks 0..{self.inter_size - 1} "
                f"(inter_size={self.inter_size})"
            )
        phase = Phase(phase)
        progs = self.fwd_programs if phase is Phase.FWD else self.bwd_programs
        return progs[inter_rank]

    def units(self) -> tuple[Unit, ...]:
        """Placed and staged blocks (identical in forward and backward)."""
        return self.chosen.units

    def local_token_indices(self, cp_rank: int) -> np.ndarray:
        """Global token ids (int64) CP rank ``cp_rank = i·P_intra + j`` holds, in local order.
        Ids ≥ ``num_tokens`` are padding (batch sharding fills them with a pad token)."""
        return self.layout.local_token_indices(cp_rank)

    def compute_units(self) -> list[tuple[int, int, TokenRange, TokenRange, bool]]:
        """Forward blocks as ``(inter_rank, stage, q_range, kv_range, causal)``, in program order."""
        out = []
        for prog in self.fwd_programs:
            for ins in prog.instrs:
                if isinstance(ins, Compute):
                    out.extend((prog.rank, ins.stage, it.q, it.kv, it.causal) for it in ins.items)
        return out

    def messages(self) -> list[tuple[int, int, int, str, TokenRange]]:
        """``(round, src_inter_rank, dst_inter_rank, tensor_name, token_range)``: forward rounds
        first, then backward rounds in the same numbering."""
        fwd = [(m.round, m.src, m.dst, m.wire.value, m.tokens) for m in self.chosen.fwd.messages]
        base = self.chosen.fwd.rounds
        bwd = [(base + m.round, m.src, m.dst, m.wire.value, m.tokens) for m in self.chosen.bwd.messages]
        return fwd + bwd

    def raw_messages(self, phase: Phase | str) -> tuple[Message, ...]:
        return (self.chosen.fwd if Phase(phase) is Phase.FWD else self.chosen.bwd).messages

    @property
    def round_base(self) -> dict[Phase, int]:
        return {Phase.FWD: 0, Phase.BWD: self.chosen.fwd.rounds}

    # --- quality -------------------------------------------------------------------------
    def verify(self) -> None:
        """Prove the plan correct by symbolic execution; raises ``PlanError`` on any violation."""
        from megatron_hsap.plan.verify import verify_plan

        verify_plan(self)

    def dump(self, rank: int, phase: Phase | str = Phase.FWD) -> str:
        """The rank's instruction list in the paper's syntax (Table 1)."""
        from megatron_hsap.plan.dump import dump_program

        return dump_program(self, rank, Phase(phase))

    def with_window(self, window_size: object) -> "Plan":
        """This batch's plan under another sliding window (``None``: full causal) on THIS plan's
        token layout, so a model mixing full and windowed layers shards its batch once
        (``plan/shared_layout.py``)."""
        from megatron_hsap.plan.shared_layout import compile_on_layout

        return compile_on_layout(self, window_size)

    def stats(self) -> dict[str, Any]:
        from megatron_hsap.plan.stats import plan_stats

        return plan_stats(self)

    def peak_bytes(self, *, num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
                   head_dim_v: int | None = None, dtype_bytes: int | None = None) -> dict[str, int]:
        from megatron_hsap.plan.stats import peak_bytes

        return peak_bytes(self, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          head_dim_v=head_dim_v, dtype_bytes=dtype_bytes)


_BUDGET_FRACTION = 0.45  # per-stage remote pool use: two stages' inputs and results live at once
_TRAFFIC_BUDGETS = (0.3, 0.6, 1.2)  # balanced candidates: traffic per phase vs compute time
_EXPLORE = 1  # placements whose every stage shape is priced (the rest: the default shape only)
_EXPLORE_RETRY_BLOCKS = 2000  # pool-overflow retries price every stage shape up to this many remote blocks
_OWNER_RECHECK = 0.05  # build owner-computes exactly when the chosen plan is within 5% of its quick price
_MIN_GAIN = 0.01  # a candidate whose lower bound is within 1% of the best estimate is not staged


def _best_staging(split: Split, pr: Prices, lat: float, budget: float, *, explore: bool = True) -> tuple[float, Staging]:
    """Stage ``split`` and keep the lowest price: the default shape only (a quick first price to
    rank placements), or with ``explore`` every end-stage weight at the fewest stages, then twice
    as many stages at the best weight."""
    shapes = stage_shapes(split, pr, budget)
    fewest = min(s.stages for s in shapes)
    first = [default_shape(shapes)] if not explore else [s for s in shapes if s.stages == fewest]
    best: tuple[float, Staging, StageShape] | None = None

    def consider(shp: StageShape) -> None:
        nonlocal best
        try:
            st = stage(split, pr, shp, budget)
        except StagingError:
            return
        t = price_staging(st, split.size, pr, lat)
        if best is None or t < best[0] * (1 - 1e-12):
            best = (t, st, shp)

    for shp in first:
        consider(shp)
    if explore and best is not None:
        for shp in shapes:
            if shp.stages > fewest:
                consider(shp)
    assert best is not None
    return best[0], best[1]


def _build(name: str, units: list[Unit], size: int, shape: HeadShape, capacity: int, pr: Prices, lat: float, budget: float) -> _Candidate:
    """Messages, programs, slots and exact prices of one staged placement (``PoolOverflow`` if the
    slots do not fit)."""
    units = sorted(units, key=lambda u: (u.rank, u.stage, u.rank == u.q_owner, u.q.start, u.kv.start))
    fwd = generate(units, Phase.FWD, size, shape, capacity, 0)
    bwd = generate(units, Phase.BWD, size, shape, capacity, fwd.rounds)
    ft = phase_time(units, fwd.messages, size, pr.sec_fwd, pr.bw, lat)
    bt = phase_time(units, bwd.messages, size, pr.sec_bwd, pr.bw, lat)
    return _Candidate(name, tuple(units), fwd, bwd, ft, bt, budget)


def _placements(units: list[WorkUnit], size: int, pr: Prices, allow_helpers: bool) -> dict[str, Placement]:
    owner = owner_computes(units, size, pr)
    out = {"owner-computes": owner}
    if size == 1 or not units:
        return out
    mt = min_traffic(units, size, pr, owner.base)
    starts = [owner]
    if mt.home != owner.home:
        out["min-traffic"] = mt
        starts.append(mt)
    chunks: dict[int, set[int]] = {}
    for u in units:
        chunks.setdefault(u.doc, set()).update((u.q_owner, u.kv_owner))
    rd = region_distflash(units, size, pr, owner.base) if max(map(len, chunks.values()), default=0) >= 3 else owner
    if (rd.home, rd.bands) != (owner.home, owner.bands) and (rd.home, rd.bands) != (mt.home, mt.bands):
        out["region-distflash"] = rd
        starts.append(rd)
    ideal = compute_bound(sum(u.work for u in units), size, pr.sec_fwd, pr.sec_bwd)
    for start in starts:
        base = start.surrogate()
        if base <= ideal * (1 + _MIN_GAIN):
            continue  # already within 1% of perfect balance (a balanced layout): moving cannot pay
        for beta in sorted(_TRAFFIC_BUDGETS, reverse=True):
            pl = balance(start, traffic_budget=beta, allow_helpers=allow_helpers, name=f"{start.name}+balanced@{beta:g}")
            if pl.surrogate() >= base * (1 - _MIN_GAIN):
                break  # the most permissive budget barely helps: stricter ones help even less
            out[pl.name] = pl
    return out


def _price(placements: dict[str, Placement], size: int, pr: Prices, lat: float, budget: float,
           forced: str) -> dict[str, tuple[float, Split, Staging]]:
    """Stage and price the placements: each under its default shape, in order of the surrogate
    (a lower bound of the staged estimate), skipping those whose bound cannot beat the best price
    by 1%; then every shape for the best one (and for owner-computes while its bound says it
    could still win)."""
    order = sorted(placements, key=lambda n: (placements[n].surrogate(), n != forced, n != "owner-computes", n))
    priced: dict[str, tuple[float, Split, Staging]] = {}
    seen: set[tuple] = set()
    best_t = float("inf")
    for name in order:
        pl = placements[name]
        if name != "owner-computes" and pl.surrogate() >= best_t * (1 - _MIN_GAIN):
            continue
        if forced != "auto" and name != forced:
            continue
        key = (tuple(pl.home), tuple(map(tuple, pl.bands)))
        if key in seen:
            continue
        seen.add(key)
        split = Split.of(pl.placed(), size)
        t, st = _best_staging(split, pr, lat, budget, explore=False)
        priced[name] = (t, split, st)
        best_t = min(best_t, t)
    top = sorted(priced, key=lambda n: priced[n][0])[:_EXPLORE]
    if "owner-computes" in priced and placements["owner-computes"].surrogate() < priced[top[0]][0]:
        top.append("owner-computes")
    for name in dict.fromkeys(top):
        t0, split, _ = priced[name]
        t, st = _best_staging(split, pr, lat, budget)
        if t < t0:
            priced[name] = (t, split, st)
    return priced


def _restage(split: Split, pr: Prices, lat: float, budget: float) -> tuple[float, Staging]:
    """Stage again under a halved pool budget (a pool-overflow retry). Every shape is explored only
    for moderate plans: with thousands of small remote blocks (≤ 1K tokens per rank) each halving
    re-staged them all (tens of seconds)."""
    return _best_staging(split, pr, lat, budget, explore=sum(map(len, split.remote)) <= _EXPLORE_RETRY_BLOCKS)


def _choose(priced: dict[str, tuple[float, Split, Staging]], size: int, shape: HeadShape, capacity: int, pr: Prices,
            lat: float, budget: float) -> tuple[_Candidate | None, dict[str, float], float]:
    """Generate code for the lowest price; if its slots do not fit the pool, halve its per-stage
    budget and let it compete again. Returns (chosen, prices, owner-computes time); the chosen
    plan's exact time never exceeds owner-computes'."""
    alternatives = {n: v[0] for n, v in priced.items()}
    budgets = {n: budget for n in priced}
    best: _Candidate | None = None
    while priced:
        name = min(priced, key=lambda n: (priced[n][0], n != "owner-computes"))
        _, split, st = priced[name]
        try:
            best = _build(name, st.units(), size, shape, capacity, pr, lat, budgets[name])
            break
        except PoolOverflow:
            budgets[name] /= 2
            if budgets[name] < 64:
                del priced[name]
                continue
            t, st = _restage(split, pr, lat, budgets[name])
            priced[name] = (t, split, st)
            alternatives[name] = t
    owner_time = alternatives.get("owner-computes", float("nan"))
    if best is not None and best.name == "owner-computes":
        owner_time = best.time
    elif best is not None and "owner-computes" in priced and best.time >= owner_time * (1 - _OWNER_RECHECK):
        # quick prices count local blocks by budget (owner-computes' by up to a few % high);
        # close to owner-computes, compare exact times
        _, split, st = priced["owner-computes"]
        oc_budget = budgets["owner-computes"]
        while oc_budget >= 64:  # as above: halve the per-stage budget until its slots fit the pool
            try:
                oc = _build("owner-computes", st.units(), size, shape, capacity, pr, lat, oc_budget)
            except PoolOverflow:
                oc_budget /= 2
                _, st = _restage(split, pr, lat, oc_budget)
                continue
            owner_time = oc.time
            if oc.time <= best.time:
                best = oc
            break
    return best, alternatives, owner_time


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
            it) — see ``PlanOptions``.

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
        plan = _compile_cached(cu, opts)
        if opts.window_size is not None:  # never estimated slower than the full plan clipped to the window
            from megatron_hsap.plan.shared_layout import no_slower_than_full

            plan = no_slower_than_full(plan)
    except MemoryError:
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


compile_plan.cache_clear = clear_plan_cache  # type: ignore[attr-defined]


def _compile_cached(cu: tuple[int, ...], opts: PlanOptions) -> Plan:
    hkv_total = opts.num_kv_heads or opts.num_heads
    hkv = kv_heads_per_rank(opts.num_heads, hkv_total, opts.intra_size)
    shape = HeadShape(
        num_heads=opts.num_heads // opts.intra_size,
        num_kv_heads=hkv,
        head_dim=opts.head_dim,
        head_dim_v=opts.head_dim_v or opts.head_dim,
        dtype_bytes=opts.dtype_bytes,
    )
    size = opts.inter_size
    batch = Batch.build(cu, size * opts.intra_size * opts.pad_multiple)
    if opts.layout == "contiguous":
        return _compile_on(contiguous_layout(batch, size, opts.intra_size), batch, shape, opts)

    hw = HARDWARE[opts.hardware]
    pr = Prices.of(shape, hw, hw.bandwidth(_link_of(opts)))
    contiguous = None
    bound = compute_bound(batch.total_work(opts.window), size, pr.sec_fwd, pr.sec_bwd)  # any layout
    if opts.layout_fallback:
        contiguous = _compile_on(contiguous_layout(batch, size, opts.intra_size), batch, shape, opts)
        if kept_layout(contiguous.chosen.time, None, bound) == "contiguous":
            return contiguous  # already within 1% of the compute bound: no layout can gain more
    # pairs of attention one token's kv costs to move (forward kv, backward kv and dkv back)
    token_cost = (2 * pr.kv + pr.dkv) / pr.bw / (pr.sec_fwd + pr.sec_bwd)
    balanced = _compile_on(balanced_layout(batch, size, opts.intra_size, token_cost, opts.window), batch, shape, opts)
    if contiguous is None:
        return balanced
    # The balanced layout must never lose to the paper's: on the batch where its split documents
    # cost more traffic than the balance saves, keep the contiguous layout (the plan carries its
    # layout, so batch sharding follows whichever was kept; stats()["layout"] says which).
    return balanced if kept_layout(contiguous.chosen.time, balanced.chosen.time, bound) == "balanced" else contiguous


def _link_of(opts: PlanOptions) -> LinkClass:
    """The inter group's link class: given, or derived from the CP world size (docs/design.md §4)."""
    if opts.link:
        return LinkClass(opts.link)
    return link_class_for(opts.tp_size * opts.intra_size * opts.inter_size, opts.gpus_per_node)


def _compile_on(layout: Layout, batch: Batch, shape: HeadShape, opts: PlanOptions) -> Plan:
    size = opts.inter_size
    validate_layout(layout, batch.padded_tokens)
    hw = HARDWARE[opts.hardware]
    link = _link_of(opts)
    capacity = opts.pool_bytes or max(DEFAULT_POOL_CHUNKS * layout.chunk_tokens * shape.chunk_token_bytes, DEFAULT_POOL_MIN)
    pr = Prices.of(shape, hw, hw.bandwidth(link))
    lat = hw.latency(link)
    pieces, units = build_units(batch, layout, opts.window)
    placements = _placements(units, size, pr, opts.allow_helpers)
    if opts.placement != "auto":
        placements = {n: pl for n, pl in placements.items() if n in (opts.placement, "owner-computes")}
        if opts.placement not in placements:  # min-traffic equals owner-computes on this batch
            placements[opts.placement] = placements["owner-computes"]
    budget = capacity * _BUDGET_FRACTION
    priced = _price(placements, size, pr, lat, budget, opts.placement)
    best, alternatives, owner_time = _choose(priced, size, shape, capacity, pr, lat, budget)
    if best is None:
        raise ConfigError(
            f"pool_bytes={capacity} cannot hold the slots of even one token row per stage; raise pool_bytes "
            f"(default {DEFAULT_POOL_CHUNKS} × chunk × heads × (d_qk + d_v) × bytes)"
        )
    return Plan(
        options=opts,
        batch=batch,
        layout=layout,
        shape=shape,
        hardware=hw,
        link=link,
        pool_capacity=capacity,
        pieces=tuple(pieces),
        work_units=tuple(units),
        chosen=best,
        alternatives=alternatives,
        owner_time=owner_time,
    )
