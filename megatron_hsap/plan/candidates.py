"""One layout's candidate search (docs/design.md §2.1, §3), called by ``plan.py``'s layout search:
placements (owner-computes, min-traffic, DistFlashAttn per document region, each rebalanced by
exact work under a few traffic budgets), staged under stage shapes and priced (a quick staged
price for each; every shape for the best, for those within ``_EXPLORE_MARGIN`` of it and for
owner-computes, the never-slower rule's reference, of which the one whose code is fastest is kept), then code generated for the cheapest
at built price, with pool-overflow retries and the owner-computes check (``_choose``)."""

from __future__ import annotations

from collections.abc import Iterator

from megatron_hsap.plan.bounds import compute_bound, placement_floor
from megatron_hsap.plan.codegen import PoolOverflow, generate, phase_rounds
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.estimate import built_price, phase_time, price_staging, staging_content
from megatron_hsap.plan.ir import Phase, Unit
from megatron_hsap.plan.placement import CostRates, Placement, min_traffic, owner_computes, region_distflash
from megatron_hsap.plan.plan_type import ChosenCandidate
from megatron_hsap.plan.rebalance import balance
from megatron_hsap.plan.schedule import BlocksByRank, StagedBlocks, StageShape, StagingError, default_shape, stage, stage_shapes
from megatron_hsap.plan.units import WorkUnit

_TRAFFIC_BUDGETS = (0.3, 0.6, 1.2)  # balanced candidates: traffic per phase vs compute time
# placements whose every stage shape is priced (the rest: the default shape only): the best quick
# price and those within _EXPLORE_MARGIN of it, at most _EXPLORE. Quick (default-shape) prices
# order placements only roughly: MagiAttention 8 GPUs 1x8 s1 put min-traffic+rebalanced@0.6 at
# 9.07 ms and region-distflash+rebalanced@0.6 at 9.15 (0.9% above), which explored to 9.12 and 8.75
_EXPLORE = 3
_EXPLORE_MARGIN = 0.03
_EXPLORE_RETRY_BLOCKS = 2000  # pool-overflow retries price every stage shape up to this many remote blocks
# owner-computes is built whenever another placement wins (its quick price can sit 10%+ above its
# built time: found by hypothesis, 4,096 tokens over P_inter 16, a first staging that overflows the
# pool and restages to a plan 11% faster); its pool-overflow restaging stops once its price is this
# far above the chosen plan's time
_OWNER_RESTAGE_STOP = 0.05
# A shape doubling another's middle stages (``StageShape.doubles``) from two or more is staged only
# when that base shape's staged price is within this of the best so far. Measured on the 1,477
# every-shape searches of the 167 Table 2 / Table 4 / MagiAttention batches and the 10 compile-budget
# batches: a doubled shape was the one kept in 3, each time with its base within 0.53% of the best;
# the rule skips 18 of the 66 stagings at 1M / P 64 and no search's result changes. From one middle
# stage to two is always staged: at 1,024 GPUs (slimpajama 1M, 8 x 128) that doubled shape is kept,
# 8.6% under its base, which sat 3.6% behind the best (docs/design.md §2.1)
_DOUBLED_MARGIN = 0.03
_DOUBLED_FROM = 2  # the fewest middle stages of a base whose doubled shape the rule may skip

_MIN_GAIN = 0.01  # a candidate whose lower bound is within 1% of the best estimate is not staged
# moving work must beat owner-computes' exact estimate by more than this to be kept: the per-rank
# estimate tracks the simulator within ~1-3% per batch (sim/estimate_accuracy.py: median 0.99-1.00
# per table), so a smaller gain may be noise. Measured on the 167 Table 2 / Table 4 / MagiAttention
# batches: 1% keeps every chosen plan no slower than owner-computes in simulation; 0 loses three
# Table 4 batches by 0.1-0.3% (docs/design.md §4)
_OWNER_MARGIN = 0.01


class Outpriced(Exception):
    """Internal: ``_choose`` stopped because every candidate left is priced above its ``give_up``
    bar (``price``: the least of them, seconds): this layout cannot win the layout choice."""

    def __init__(self, price: float):
        super().__init__(f"every candidate priced above the bar (least {price:.6g} s)")
        self.price = price


def _skippable(shp: StageShape) -> bool:
    """Whether the doubled-shape rule applies to ``shp``: it doubles a base of at least
    ``_DOUBLED_FROM`` middle stages (one middle stage doubled to two is always staged)."""
    return shp.doubles > 0 and len(StageShape(shp.doubles, shp.end_weight).middle) >= _DOUBLED_FROM


def _each_staging(split: BlocksByRank, rates: CostRates, latency: float, budget: float, *, explore: bool = True) -> Iterator[tuple[float, StagedBlocks]]:
    """``split`` staged under the default shape only, or with ``explore`` under every end-stage
    weight at the fewest stages, then twice as many stages: ``(staged price, staging)`` pairs in
    that order, lazily (a caller that needs only one price under a bar stops at it).
    ``schedule.stage`` and ``price_staging`` memoise on the split, so asking again under the same
    budget stages nothing twice."""
    shapes = stage_shapes(split, rates, budget)
    if not shapes:
        return  # (more stages than ``schedule.stage_cap`` under this budget)
    fewest = min(s.stages for s in shapes)
    first = [default_shape(shapes)] if not explore else [s for s in shapes if s.stages == fewest]
    least, staged = float("inf"), False  # the least price yielded so far; whether any was
    priced: dict[tuple[int, float], float] = {}  # (stages, end weight) of the plain shapes staged -> price
    for shp in first + ([s for s in shapes if s.stages > fewest] if explore else []):
        if shp.stages > fewest and not staged:
            return  # (no shape at the fewest stages staged: more stages cannot either)
        # _DOUBLED_MARGIN: doubling the middle stages of a shape this far behind does not win
        base = priced.get((shp.doubles, shp.end_weight)) if _skippable(shp) else None
        if base is not None and base > least * (1 + _DOUBLED_MARGIN):
            continue
        try:
            st = stage(split, rates, shp, budget)
        except StagingError:
            continue
        t = price_staging(st, split.size, rates, latency)
        least, staged = min(least, t), True
        if not shp.ring_fill:
            priced[(shp.stages, shp.end_weight)] = t
        yield t, st


def _stagings(split: BlocksByRank, rates: CostRates, latency: float, budget: float, *, explore: bool = True) -> list[tuple[float, StagedBlocks]]:
    """Every staging of ``_each_staging``, cheapest first (ties: in the order staged); empty when
    ``split`` needs more than ``schedule.stage_cap`` stages under ``budget``."""
    out = list(_each_staging(split, rates, latency, budget, explore=explore))
    if not out:
        return []
    best = out[0]  # the first tried wins ties within 1e-12 (summation order)
    for x in out:
        if x[0] < best[0] * (1 - 1e-12):
            best = x
    return [best, *sorted((x for x in out if x is not best), key=lambda x: x[0])]


def _best_staging(split: BlocksByRank, rates: CostRates, latency: float, budget: float, *,
                  explore: bool = True) -> tuple[float, StagedBlocks] | None:
    """The staging of ``split`` to build and its price: with ``explore``, the stage shape whose
    code is fastest (``estimate.built_price``: the local blocks poured, as code generation will),
    found lazily — the shapes in staged-price order, each built-priced while its staged price is
    under the best built price so far (a staged price sits 0-17% under the built one, never
    under 0.98 of it). Else the default shape at its staged price (the quick price that ranks
    the placements). The staged price alone picked shapes whose code ran up to 12% slower than
    another shape's: with the built price, 33 of the 167 Table 2 / Table 4 / MagiAttention
    batches simulate 1-11% faster, 10 slower by 0.1-1.0% (docs/design.md §2.1). None when no
    shape stages ``split`` within ``schedule.stage_cap`` (a pool far below the default)."""
    got = _stagings(split, rates, latency, budget, explore=explore)
    if not got:
        return None
    return _fastest(got, split.size, rates, latency) if explore else got[0]


def _fastest(got: list[tuple[float, StagedBlocks]], size: int, rates: CostRates, latency: float) -> tuple[float, StagedBlocks]:
    """Of stagings ``got`` (``(staged price, staging)``, cheapest first), the one of least built
    price and that price, built-pricing them in order while a staged price is under the best."""
    best: tuple[float, StagedBlocks] | None = None
    for t, st in got:
        if best is not None and t >= best[0]:
            break
        b = built_price(st, size, rates, latency)
        if best is None or b < best[0] * (1 - 1e-12):
            best = (b, st)
    assert best is not None
    return best


def _build(name: str, units: list[Unit], size: int, shape: HeadShape, capacity: int, rates: CostRates, latency: float, budget: float) -> ChosenCandidate:
    """Messages, programs, slots and exact prices of one staged placement (``PoolOverflow`` if the
    slots do not fit)."""
    units = sorted(units, key=Unit.program_key)
    # backward first: it holds more (q with do, lse and delta; fp32 partials), so it is the phase
    # that overflows (179 of 809 builds of the 167 benchmark batches; forward never did),
    # and an overflow then costs its slot fit alone, not forward's whole code too
    bwd = generate(units, Phase.BWD, size, shape, capacity, phase_rounds(units))
    fwd = generate(units, Phase.FWD, size, shape, capacity, 0)
    ft = phase_time(units, fwd.messages, size, rates.sec_fwd, rates.bw, latency, rates=rates, phase=Phase.FWD)
    bt = phase_time(units, bwd.messages, size, rates.sec_bwd, rates.bw, latency, rates=rates, phase=Phase.BWD)
    return ChosenCandidate(name, tuple(units), fwd, bwd, ft, bt, budget)


def _placements(units: list[WorkUnit], size: int, rates: CostRates, allow_helpers: bool) -> dict[str, Placement]:
    owner = owner_computes(units, size, rates)
    out = {"owner-computes": owner}
    if size == 1 or not units:
        return out
    mt = min_traffic(units, size, rates, owner.base)
    starts = [owner]
    if mt.home != owner.home:
        out["min-traffic"] = mt
        starts.append(mt)
    chunks: dict[int, set[int]] = {}
    for u in units:
        chunks.setdefault(u.doc, set()).update((u.q_owner, u.kv_owner))
    rd = region_distflash(units, size, rates, owner.base) if max(map(len, chunks.values()), default=0) >= 3 else owner
    if (rd.home, rd.bands) != (owner.home, owner.bands) and (rd.home, rd.bands) != (mt.home, mt.bands):
        out["region-distflash"] = rd
        starts.append(rd)
    ideal = compute_bound(sum(u.work for u in units), size, rates.sec_fwd, rates.sec_bwd)
    for start in starts:
        base = start.flat_time_bound()
        if base <= ideal * (1 + _MIN_GAIN):
            continue  # already within 1% of perfect balance (a balanced layout): moving cannot pay
        for beta in sorted(_TRAFFIC_BUDGETS, reverse=True):
            pl = balance(start, traffic_budget=beta, allow_helpers=allow_helpers, name=f"{start.name}+rebalanced@{beta:g}")
            if pl.flat_time_bound() >= base * (1 - _MIN_GAIN):
                break  # the most permissive budget barely helps: stricter ones help even less
            out[pl.name] = pl
    return out


def _price(placements: dict[str, Placement], size: int, rates: CostRates, latency: float, budget: float,
           forced: str) -> dict[str, tuple[float, BlocksByRank, StagedBlocks]]:
    """Stage and price the placements: each under its default shape, in order of ``Placement.flat_time_bound``
    (flat rates: the likely order), skipping those whose ``bounds.placement_floor`` (a lower bound of
    every staging's price) cannot beat the best price by 1%; then (``_explore``) every shape for
    the best one, those within ``_EXPLORE_MARGIN`` of it and owner-computes.

    The flat bound once pruned here too, but it is no bound of the kernel-priced estimate: a whole
    4K × 4K block runs above the flat rate. On one 64K document over 16 ranks (Table 2, InfiniBand)
    it put region-distflash (flat 51.7 ms) above owner-computes rebalanced's staged 46.5 ms, so the
    DistFlashAttn-like placement was never staged."""
    order = sorted(placements, key=lambda n: (placements[n].flat_time_bound(), n != forced, n != "owner-computes", n))
    priced: dict[str, tuple[float, BlocksByRank, StagedBlocks]] = {}
    seen: set[tuple] = set()
    best_t = float("inf")
    for name in order:
        pl = placements[name]
        if name != "owner-computes" and placement_floor(pl, rates) >= best_t * (1 - _MIN_GAIN):
            continue
        if forced != "auto" and name != forced:
            continue
        key = (tuple(pl.home), tuple(map(tuple, pl.bands)))
        if key in seen:
            continue
        seen.add(key)
        split = BlocksByRank.of(pl.placed(), size)
        got = _best_staging(split, rates, latency, budget, explore=False)
        if got is None:
            continue  # more stages than the cap under this pool: not a candidate
        t, st = got
        priced[name] = (t, split, st)
        best_t = min(best_t, t)
    return priced


def _explore(priced: dict[str, tuple[float, BlocksByRank, StagedBlocks]], rates: CostRates, latency: float, budget: float,
             owner_floor: float = 0.0) -> float | None:
    """Price every stage shape of the best quick price, of the next ones within ``_EXPLORE_MARGIN``
    of it (``_EXPLORE`` in all) and of owner-computes, in place. Returns
    ``owner_floor`` when owner-computes' search is deferred to ``_choose`` (its floor, a lower
    bound of any staging and any built plan of it, is above the best price: then it is searched
    only if a pool overflow lifts the other prices to its floor, or to check the chosen plan), else None."""
    # ties (placements whose stagings price the same) go to owner-computes
    top = sorted(priced, key=lambda n: (priced[n][0], n != "owner-computes"))[:_EXPLORE]
    top = [n for n in top if priced[n][0] <= priced[top[0]][0] * (1 + _EXPLORE_MARGIN)]
    for name in top:
        _explore_one(priced, name, rates, latency, budget)
    if "owner-computes" in priced and "owner-computes" not in top:
        # the chosen plan is never estimated slower than owner-computes compiled alone (which prices
        # every shape); flat_time_bound is no bound on the hardware-priced estimate (node-local pairs
        # at NVLink rate under InfiniBand, kernel peak above the flat rate), but ``price_floor`` is
        if owner_floor > min(v[0] for v in priced.values()):
            return owner_floor
        _explore_one(priced, "owner-computes", rates, latency, budget)
    return None


def _explore_one(priced: dict[str, tuple[float, BlocksByRank, StagedBlocks]], name: str, rates: CostRates, latency: float,
                 budget: float) -> float:
    """Every stage shape of ``name``'s split: its entry becomes the one whose code is fastest, at
    its built price (in place; the shapes include the default one its quick price staged, so
    the entry's code is never slower); returns that price."""
    _, split, _ = priced[name]
    got = _best_staging(split, rates, latency, budget)
    assert got is not None  # its default shape staged under this budget (``_price``)
    priced[name] = (got[0], split, got[1])
    return got[0]


def _explores(split: BlocksByRank) -> bool:
    """Whether a pool-overflow retry stages ``split`` under every shape: only for moderate plans;
    with thousands of small remote blocks (≤ 1K tokens per rank) each retry re-staged them all
    (tens of seconds)."""
    return sum(map(len, split.remote)) <= _EXPLORE_RETRY_BLOCKS


def _restage(split: BlocksByRank, rates: CostRates, latency: float, budget: float) -> tuple[float, StagedBlocks] | None:
    """Stage again under a shrunk pool budget (a pool-overflow retry; ``_explores``); None past
    ``schedule.stage_cap``."""
    return _best_staging(split, rates, latency, budget, explore=_explores(split))


_MIN_STAGE_BUDGET = 64  # bytes: below this per-stage pool budget a pool-overflow retry gives up
# a pool-overflow retry shrinks the per-stage budget by a quarter, not a half: a staging overflows
# by tens of % (first-fit fragmentation, received results beside two stages' slots), and halving
# doubled the stages of whole-block plans (one document, Table 2 SP 4 16K: 1.08x DistFlashAttn
# instead of 0.98x; SP 8 64K 1.00x instead of 0.97x). Measured: halving after a first 0.75 step
# lost more (SP 8 32K 0.78x)
_OVERFLOW_STEP = 0.75


def _build_or_halve(name: str, split: BlocksByRank, st: StagedBlocks, budget: float, size: int, shape: HeadShape, capacity: int,
                    rates: CostRates, latency: float) -> tuple[ChosenCandidate | None, float, StagedBlocks, float]:
    """One pool-overflow step (both searches of ``_choose`` use it): build ``st``'s code; if its
    slots overflow the pool, the next staging is the faster (built price) of the fastest other
    stage shape under the same per-stage ``budget`` that has not overflowed, and ``split``
    restaged under the budget shrunk by ``_OVERFLOW_STEP``. Shrinking first lost plans: the shape
    that overflowed was one of several at that budget, and another may fit with fewer stages than
    any restage (Table 4 slimpajama 32K 1x8 s0 simulates 12.33 ms instead of 12.65; full 16K 1x8
    s0 9.62 instead of 9.91). A staging that overflowed is marked on its split's memo, so it is
    never offered again.
    Returns ``(candidate, price, staging, budget)``: the built candidate, or ``None`` with the
    next staging, its built price and its budget (nothing left: price ``inf`` and budget 0, once
    every shape under this budget overflowed and a smaller one falls below ``_MIN_STAGE_BUDGET``
    or needs more stages than ``schedule.stage_cap``)."""
    # a staging's slots either fit the pool or not: a fact about its blocks (``estimate.staging_content``:
    # the same blocks poured alike give the same code), kept on its split's memo: a search run again
    # skips its build, and so does a restaging under a smaller budget that cuts and fills exactly
    # as before (one 1M-token document at 8x64: 5 of 8 overflowing builds of owner-computes, under
    # budgets 121M down to 38M bytes, were one staging)
    gone: set = set() if st.memo is None else st.memo.setdefault(("overflow", capacity), set())
    if not _overflowed(st, gone):
        try:
            return _build(name, st.units(), size, shape, capacity, rates, latency, budget), float("nan"), st, budget
        except PoolOverflow:
            gone.add(staging_content(st))
    rest = [(t, o) for t, o in _stagings(split, rates, latency, budget, explore=_explores(split)) if not _overflowed(o, gone)]
    same = _fastest(rest, size, rates, latency) if rest else None
    smaller = budget * _OVERFLOW_STEP
    got = _restage(split, rates, latency, smaller) if smaller >= _MIN_STAGE_BUDGET else None
    if got is None:  # under the smallest budget, or past the stage cap: only this budget's shapes are left
        return (None, same[0], same[1], budget) if same is not None else (None, float("inf"), st, 0.0)
    restaged = got[1]
    t = built_price(restaged, size, rates, latency)
    if same is not None and same[0] < t:
        return None, same[0], same[1], budget
    return None, t, restaged, smaller


def _overflowed(st: StagedBlocks, gone: set) -> bool:
    """Whether ``st``'s code is known to overflow the pool (``gone``: the ``staging_content`` of
    each staging whose build overflowed, ``_build_or_halve``)."""
    return bool(gone) and staging_content(st) in gone


def _choose(priced: dict[str, tuple[float, BlocksByRank, StagedBlocks]], size: int, shape: HeadShape, capacity: int, rates: CostRates,
            latency: float, budget: float, owner_floor: float | None = None,
            give_up: float = float("inf")) -> tuple[ChosenCandidate | None, dict[str, float], float]:
    """Generate code for the lowest price; if its slots do not fit the pool, stage it again
    (``_build_or_halve``: another shape under the same per-stage budget or the budget shrunk by
    ``_OVERFLOW_STEP``) and let it compete again. Returns (chosen, prices, owner-computes time); the chosen
    plan's exact time never exceeds owner-computes'. ``owner_floor``: owner-computes' every-shape
    search was deferred (``_explore``) and this floor bounds its staged and built times from below;
    the search runs here once the floor no longer rules owner-computes out.

    The candidates compete on ``estimate.built_price`` (their stagings with the local blocks
    poured: the time their code will have if it fits the pool), not on the staged price that chose
    each one's stage shape, which sits 0-17% under it by how many local blocks pouring cuts, so its
    order is off wherever two candidates are that close (measured on the 167 benchmark batches:
    13 chosen plans 1-6% faster, none slower). Lazily, best first: a candidate's built price is
    computed when its staged price comes first (a staged price is taken as a lower bound of its
    built price: never under 0.98 of it in those batches' 404 builds).

    ``give_up`` (seconds): the other layout's time, past which this layout loses the layout choice
    (``plan._search``); once the cheapest candidate left is priced above it (staged or built, and
    owner-computes' deferred floor above it too), raises ``Outpriced`` instead of restaging on: a
    pool overflow raises a price step by step (one 1M-token document at 8x128: 13 restagings of
    the balanced layout, 18 of its 25 s compile, for a plan 36% slower than the contiguous one)."""
    alternatives = {n: v[0] for n, v in priced.items()}
    budgets = {n: budget for n in priced}
    deferred = owner_floor if "owner-computes" in priced else None
    built: set[str] = set()  # candidates whose entry in ``priced`` is their built price

    def reprice(name: str, st: StagedBlocks) -> None:
        """``name``'s entry becomes ``st`` at its built price."""
        t = built_price(st, size, rates, latency)
        priced[name] = (t, priced[name][1], st)
        alternatives[name] = t
        built.add(name)

    def search_owner() -> None:
        nonlocal deferred
        # never built yet: the full budget; the search leaves its fastest shape at its built price
        _explore_one(priced, "owner-computes", rates, latency, budget)
        reprice("owner-computes", priced["owner-computes"][2])
        deferred = None

    best: ChosenCandidate | None = None
    while priced:
        name = min(priced, key=lambda n: (priced[n][0], n != "owner-computes"))
        if deferred is not None and (name == "owner-computes" or deferred <= priced[name][0]):
            search_owner()  # its searched price could come first (ties go to owner-computes)
            continue
        if priced[name][0] > give_up:
            raise Outpriced(priced[name][0])  # (a deferred owner-computes: its floor is above this)
        if name not in built:
            reprice(name, priced[name][2])
            continue
        _, split, st = priced[name]
        best, t, st, budgets[name] = _build_or_halve(name, split, st, budgets[name], size, shape, capacity, rates, latency)
        if best is not None:
            break
        if budgets[name] < _MIN_STAGE_BUDGET:
            del priced[name]
            continue
        priced[name] = (t, split, st)  # the restaged staging at its built price
        alternatives[name] = t
    if best is not None and best.name != "owner-computes" and deferred is not None and deferred <= best.time * (1 + _OWNER_MARGIN):
        search_owner()  # the check below needs its searched staging; else its built time > best's margin
    owner_time = alternatives.get("owner-computes", float("nan"))
    if best is not None and best.name == "owner-computes":
        owner_time = best.time
    elif best is not None and "owner-computes" in priced and deferred is None:
        # compare exact times: a quick price counts local blocks by budget and stages under the full
        # pool budget (owner-computes compiled alone may overflow, restage and come out faster)
        _, split, st = priced["owner-computes"]
        oc_budget = budgets["owner-computes"]
        while oc_budget >= _MIN_STAGE_BUDGET:  # as above, until its slots fit the pool
            oc, t, st, oc_budget = _build_or_halve("owner-computes", split, st, oc_budget, size, shape, capacity, rates, latency)
            if oc is not None:
                owner_time = oc.time
                if oc.time <= best.time * (1 + _OWNER_MARGIN):
                    best = oc
                break
            if t >= best.time * (1 + _OWNER_RESTAGE_STOP):
                # restaged under a shrunk budget, owner-computes is no longer within the stop's
                # 5%: stop (each shrink cuts more blocks; one 1M document spent ~40 s here)
                owner_time = t
                break
    return best, alternatives, owner_time


def _stage_all(placements: dict[str, Placement], *, size: int, rates: CostRates, latency: float, budget: float,
               forced: str) -> tuple[dict[str, tuple[float, BlocksByRank, StagedBlocks]], float | None]:
    """A layout's placements staged and priced (``PricedLayout.exact``): ``_price``, then
    ``_explore``; with owner-computes' floor when its search was deferred (else None)."""
    priced = _price(placements, size, rates, latency, budget, forced)
    owner = placements.get("owner-computes")
    floor = placement_floor(owner, rates) if owner is not None else 0.0
    return priced, _explore(priced, rates, latency, budget, floor)
