"""The estimated time of a staged plan (docs/design.md §4; its lower bounds: ``plan/bounds.py``).

Per phase: the longest path over the ranks' own programs (``plan/rank_path.py``): round ``k``
overlaps stage ``k`` on each rank's clock, a transfer starts when both ends have posted, and each
port (full duplex, per link class) carries its round's transfers as they start; the last round
returns results with nothing to hide behind.

A rank's compute in a stage is priced like the hardware charges it (``plan/block_costs.py``; the same
``KernelModel`` the simulator runs, ``plan/hardware.py``): every block at the kernel's rate for
its shape (the tile model), ``launch_s`` per varlen call (blocks reading the same inputs with the
same causality share one), FA3's backward grid and GQA dK/dV atomics where the kernel has them,
the LSE merges and fp32 accumulations of rows that receive more than one contribution (HBM bytes
/ bandwidth), and the kernel slowdown while the stage's round is in flight. ``CostRates`` without a
kernel (hand-made tests) keep the flat ``work × seconds per pair``.

``quick_price`` computes the same number straight from staged blocks (no messages, no slots) so
the planner can price many candidate stagings and generate code for the winner only.

The intra all-to-all pipelined around SAP when the heads run in chunks: ``plan/pipeline.py``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import numpy as np

from megatron_hsap.plan.block_costs import BlockCosts, BlockGroups, _arrays, block_costs, block_costs_pair
from megatron_hsap.plan.codegen import Message
from megatron_hsap.plan.ir import Phase, Unit
from megatron_hsap.plan.placement import CostRates
from megatron_hsap.plan.rank_path import path_finish, path_seconds, path_seconds_py, stack
from megatron_hsap.plan.schedule import StagedBlocks
from megatron_hsap.plan.traffic import Traffic, both_links as _both, message_traffic, same_node as _same_node, staged_traffic

__all__ = ["PhaseTime", "rows_of", "BlockCosts", "BlockGroups", "block_costs", "phase_time", "quick_price", "price_staging", "built_price",
           "staging_content"]


@dataclass(frozen=True, slots=True)
class PhaseTime:
    total: float
    compute: np.ndarray  # [stages + 1] slowest rank's compute per stage
    transfer: np.ndarray  # [stages + 1] slowest rank's transfer per round
    latency: float  # sum of round latencies
    work: np.ndarray  # [P] pairs per rank
    sent: np.ndarray  # [P] bytes
    recv: np.ndarray  # [P] bytes
    launch: float = 0.0  # kernel launches of the rank with the most (included in ``total``)


# up to this many [rank, round] cells ``price_staging`` adds the local blocks and walks the ranks'
# paths as Python loops (``_price_small``; ``_total`` the paths): fineweb 64K at 8 ranks has ~40
# cells per staging; at 64 ranks (192 cells and more, many pairs per round) numpy's per-round
# calls are the faster (measured)
_PY_CELLS = 96


def _total(comp: np.ndarray, tr: Traffic, bw: float, latency: float, nvl_bw: float,
           after: np.ndarray | None = None, exposed: bool = False, flow_bw: float = float("inf")) -> tuple[float, float]:
    """(phase seconds, exposed latency seconds) from ``[P, rounds]`` compute seconds, merges after
    each wait and the phase's ``Traffic`` (its sends per round and link: network, NVLink ports in
    parallel): the longest path over the ranks' own programs (``plan/rank_path.py``). The exposed
    latency (with ``exposed``; else 0) is what the path loses to round latencies (what every head
    chunk pays again, ``pipelined_time``); ``flow_bw``: one network transfer's cap (``CostRates.flow_bw``)."""
    bws = (bw, nvl_bw)
    if comp.size <= _PY_CELLS:  # a few dozen cells: the loop form (the same numbers, ``rank_path``)
        args = (comp.tolist(), None if after is None else after.tolist(), tr.flows.tolist(), tr.nbytes.tolist(), bws)
        path = lambda lat: path_seconds_py(*args, lat, flow_bw)  # noqa: E731
    else:
        path = lambda lat: path_seconds(comp, after, tr.flows, tr.nbytes, bws, lat, flow_bw)  # noqa: E731
    total = path(latency)
    if latency <= 0 or not exposed:
        return total, 0.0
    return total, max(total - path(0.0), 0.0)


def _two_phases(fwd: tuple, bwd: tuple, rates: CostRates, latency: float) -> tuple[float, float]:
    """``_total`` of forward and backward ``(comp, traffic, after)``: in one pass over the rounds
    (``rank_path.stack``: the two phases are independent problems on disjoint rank sets), or,
    up to ``_PY_CELLS`` cells, ``_total``'s loop form per phase."""
    if fwd[0].size <= _PY_CELLS:  # a few dozen cells per phase: the loop form, phase by phase (the same numbers)
        return tuple(_total(comp, tr, rates.bw, latency, rates.nvl_bw, after, flow_bw=rates.flow_bw)[0]
                     for comp, tr, after in (fwd, bwd))
    parts = [(comp, after, tr.flows, tr.nbytes) for comp, tr, after in (fwd, bwd)]
    t = path_finish(*stack(parts), (rates.bw, rates.nvl_bw), latency, rates.flow_bw)
    size = fwd[0].shape[0]
    return float(t[:size].max(initial=0.0)), float(t[size:].max(initial=0.0))


def _compute(units, work_grid: np.ndarray | None, size: int, n: int, rates: CostRates, phase: Phase, sent: np.ndarray,
             recv: np.ndarray, a: np.ndarray | None = None, groups: BlockGroups | None = None) -> tuple[np.ndarray, np.ndarray | None, float]:
    """[P, n] compute seconds of ``units`` (flat when ``rates`` has no kernel), [P, n] merges after
    each wait (None when flat) and the launch seconds of the rank with the most."""
    if rates.kernel is None:
        return work_grid * (rates.sec_fwd if phase == Phase.FWD else rates.sec_bwd), None, 0.0
    bc = block_costs(_arrays(units) if a is None else a, size, n, rates, phase, groups)
    return bc.seconds(sent, recv, rates.overlap_slowdown), bc.after, float(bc.launch.max(initial=0.0))


def phase_time(units: list[Unit], msgs: list[Message] | tuple[Message, ...], size: int, sec_per_pair: float, bw: float,
               latency: float, *, rates: CostRates | None = None, phase: Phase | str = Phase.FWD,
               repeat: int = 1) -> PhaseTime:
    """The estimate of one phase of staged ``units`` and the messages codegen emitted for them.
    With ``rates`` (carrying the kernel model) compute is priced by block shape (``block_costs``);
    without it, ``work × sec_per_pair``. ``repeat``: the programs run that many times back to
    back (head chunks, ``plan/chunks.chunk_phase_times``), priced as one path over the repeated
    rounds — a rank starts its next pass when its own last round is done, not when every rank's
    is; ``total`` and ``latency`` cover every pass, the per-stage arrays one pass."""
    phase = Phase(phase)
    a, groups = rows_of(units, size, rates)
    stages = 1 + int(a[:, 1].max(initial=0))
    # pairs per [rank, stage]: ``np.bincount`` adds the blocks' (int) pairs to a float64 zero in
    # block order, the same additions as a loop of ``grid[rank, stage] += work``
    grid = np.bincount(a[:, 0] * (stages + 1) + a[:, 1], weights=a[:, 6], minlength=size * (stages + 1)).reshape(size, stages + 1)
    work = np.zeros(size, dtype=np.int64)
    np.add.at(work, a[:, 0], a[:, 6])  # exact integers
    same = _same_node(rates, size) if rates is not None else None
    tr = message_traffic(msgs, size, stages + 1, same)
    sent, recv = tr.sent, tr.recv
    nvl = rates.nvl_bw if rates is not None else 0.0
    cap = rates.flow_bw if rates is not None else float("inf")
    after = None
    if rates is not None and rates.kernel is not None:
        comp, after, launch = _compute(units, grid, size, stages + 1, rates, phase, _both(sent), _both(recv), a,
                                       groups(stages + 1) if len(a) else None)
    else:
        comp, launch = grid * sec_per_pair, 0.0
    if repeat > 1:  # the same rounds again: pass c's flows offset by c·(stages + 1) rounds
        n = stages + 1
        flows = np.concatenate([tr.flows + np.array([c * n, 0, 0, 0], dtype=tr.flows.dtype) for c in range(repeat)])
        total, lat = _total(np.tile(comp, repeat), replace(tr, flows=flows, nbytes=np.tile(tr.nbytes, repeat)), bw, latency, nvl,
                            None if after is None else np.tile(after, repeat), exposed=True, flow_bw=cap)  # fmt: skip
    else:
        total, lat = _total(comp, tr, bw, latency, nvl, after, exposed=True, flow_bw=cap)
    xfer = np.maximum(sent, recv) / (np.array([bw, nvl])[:, None, None] if sent.ndim == 3 else bw)
    return PhaseTime(
        total=total,
        compute=comp.max(axis=0),
        transfer=(xfer.max(axis=0) if xfer.ndim == 3 else xfer).max(axis=0),
        latency=lat,
        work=work,
        sent=_both(sent).sum(axis=1),
        recv=_both(recv).sum(axis=1),
        launch=launch,
    )


_ROWS_MEMO: list = []  # [(units as a tuple, rows, {n: BlockGroups})]: the last blocks ``phase_time`` priced


def rows_of(units, size: int, rates: CostRates | None):
    """``(_arrays(units), groups(n))`` with ``groups(n) = BlockGroups.of(rows, size, n, rates)``,
    memoised for the last blocks seen: the planner prices forward and backward of one block list
    in turn (``phase_time`` twice), and both phases share rows and groups. The memo compares the
    blocks themselves (identity, in order), so a list changed in between is never mistaken."""
    hit = _ROWS_MEMO[0] if _ROWS_MEMO else None
    if hit is None or hit[3] is not rates or hit[4] != size or len(hit[0]) != len(units) or not all(map(operator.is_, hit[0], units)):
        hit = (tuple(units), _arrays(units), {}, rates, size)
        _ROWS_MEMO[:] = [hit]
    a, cache = hit[1], hit[2]

    def groups(n: int) -> BlockGroups:
        g = cache.get(n)
        if g is None:
            g = cache[n] = BlockGroups.of(a, size, n, rates)
        return g
    return a, groups


def quick_price(units: list[Unit], size: int, rates: CostRates, latency: float,
                staging: StagedBlocks | None = None) -> tuple[float, float]:
    """(forward, backward) estimated seconds of staged ``units``; equals ``phase_time`` over the
    messages ``codegen.phase_messages`` would emit. ``staging``: the staging ``units`` were poured
    from (``StagedBlocks.units``), whose remote blocks' traffic ``_remote_prices`` keeps: local
    blocks send nothing, so it is these blocks' traffic when the round counts agree (the same
    byte sums: whole numbers, exact in any order)."""
    a = _arrays(units)
    n = 2 + int(a[:, 1].max(initial=0))
    work = None
    if rates.kernel is None:  # flat prices: pairs per [rank, stage], added in block order as a loop would
        work = np.bincount(a[:, 0] * n + a[:, 1], weights=a[:, 6], minlength=size * n).reshape(size, n)
    g = BlockGroups.of(a, size, n, rates) if rates.kernel is not None and len(a) else None
    traffic = _kept_traffic(staging, size, n, rates) if staging is not None else None
    out = []
    for phase, tr in zip((Phase.FWD, Phase.BWD), traffic or staged_traffic(a, size, n, rates)):
        comp, after, _ = _compute(units, work, size, n, rates, phase, _both(tr.sent), _both(tr.recv), a, g)
        out.append((comp, tr, after))
    return _two_phases(out[0], out[1], rates, latency)


def price_staging(st: StagedBlocks, size: int, rates: CostRates, latency: float) -> float:
    """Forward + backward estimated seconds of a staging, its local blocks counted by budget
    (pouring them splits at row granularity, which moves a stage's work by at most one row)."""
    # a staging priced again (``schedule.stage`` returns the same object for the same split and
    # shape: the planner's quick price of a split's default shape, then its every-shape search)
    key = ("price", id(st))
    hit = st.memo.get(key) if st.memo is not None else None
    if hit is not None and hit[0] is st and hit[1] is rates and hit[2] == (size, latency):
        return hit[3]
    # another staging of the split equal to one priced before (about one in six: two stage shapes
    # often cut and fill alike, e.g. ``ring_fill`` or another end weight changing no block): the
    # price is a function of the stage count, the remote blocks' ``_arrays`` rows (all that
    # ``_remote_prices`` reads of them), the local budgets and remote work per [rank, stage] and
    # the local blocks (``_local_rates``; one tuple per split), so equal keys give equal prices
    a = _arrays(st.remote)
    same = ("price-of", *staging_content(st, a))
    hit = st.memo.get(same) if st.memo is not None else None
    if hit is not None and hit[0] is st.local and hit[1] is rates and hit[2] == (size, latency):
        t = hit[3]
    else:
        t = _price_staging(st, size, rates, latency, a)
        if st.memo is not None:
            st.memo[same] = (st.local, rates, (size, latency), t)
    if st.memo is not None:
        st.memo[key] = (st, rates, (size, latency), t)
        st.memo[("content", id(st))] = (st, same[1:])
    return t


def staging_content(st: StagedBlocks, a: np.ndarray | None = None) -> tuple:
    """What a staging's prices are functions of besides its split's local blocks (``st.local``):
    stage count, remote rows (``_arrays``: ranges, owners, rank, stage and work determine a remote
    block, in the order priced), local budgets and remote work per [rank, stage], and the thinnest
    pour (the local blocks poured by these budgets, ``StagedBlocks.units``)."""
    hit = st.memo.get(("content", id(st))) if st.memo is not None and a is None else None
    if hit is not None and hit[0] is st:
        return hit[1]
    a = _arrays(st.remote) if a is None else a
    return (st.stages, a.tobytes(), st.local_budget.tobytes(), st.remote_work.tobytes(), st.min_rows)


def built_price(st: StagedBlocks, size: int, rates: CostRates, latency: float) -> float:
    """Forward + backward estimated seconds of a staging with its local blocks poured
    (``StagedBlocks.units``): ``quick_price`` of its blocks, which equals the time of the plan code
    generation builds from it (``phase_time`` over its messages) when its slots fit the pool.
    ``price_staging`` is the cheaper rank order of many stagings; it prices local blocks at their
    pre-pour kernel rate with their merges spread by budget, and sits 0-17% under this (median 7%,
    the 404 builds of the 167 benchmark batches). Memoised on the staging."""
    key = ("built", id(st))
    hit = st.memo.get(key) if st.memo is not None else None
    if hit is not None and hit[0] is st and hit[1] is rates and hit[2] == (size, latency):
        return hit[3]
    # a staging equal to one built-priced before pours the same blocks in the same order
    # (``staging_content``): 41 of 111 built prices at fineweb 64K / P_inter 8
    same = ("built-of", *staging_content(st)) if st.memo is not None else None
    hit = st.memo.get(same) if same is not None else None
    if hit is not None and hit[0] is st.local and hit[1] is rates and hit[2] == (size, latency):
        t = hit[3]
    else:
        t = sum(quick_price(st.units(), size, rates, latency, st))
        if same is not None:
            st.memo[same] = (st.local, rates, (size, latency), t)
    if st.memo is not None:
        st.memo[key] = (st, rates, (size, latency), t)
    return t


def _price_staging(st: StagedBlocks, size: int, rates: CostRates, latency: float, a: np.ndarray | None = None) -> float:
    n = st.stages + 1
    work = np.zeros((size, n))
    work[:, : st.stages] = st.remote_work + st.local_budget
    tf, tb, costs = _remote_prices(st, size, n, rates, a)
    if rates.kernel is None:
        return sum(_two_phases((work * rates.sec_fwd, tf, None), (work * rates.sec_bwd, tb, None), rates, latency))
    if size * n <= _PY_CELLS:
        return _price_small(st, size, n, rates, latency, ((Phase.FWD, tf, costs[0]), (Phase.BWD, tb, costs[1])))
    out = []
    for phase, tr, bc in ((Phase.FWD, tf, costs[0]), (Phase.BWD, tb, costs[1])):
        spp, fixed_local = _local_rates(st, size, rates, phase)
        kern = bc.kernel.copy()
        kern[:, : st.stages] += st.local_budget * spp[:, None]
        fixed = bc.fixed.copy()
        share = st.local_budget / np.maximum(st.local_budget.sum(axis=1, keepdims=True), 1e-300)
        fixed[:, : st.stages] += share * fixed_local[:, None]
        # pouring puts each rank's local blocks into every stage with a budget: ~one call per stage
        fixed[:, : st.stages] += (st.local_budget > 0) * rates.kernel.launch_s
        comp = BlockCosts(kern, fixed, bc.launch, bc.after).seconds(_both(tr.sent), _both(tr.recv), rates.overlap_slowdown)
        out.append((comp, tr, bc.after))
    return sum(_two_phases(out[0], out[1], rates, latency))


def _price_small(st: StagedBlocks, size: int, n: int, rates: CostRates, latency: float, phases) -> float:
    """``_price_staging``'s kernel-model branch on Python lists: each cell gets the same
    operations in the same order as the array expressions there (the local kernel seconds, the
    local merges by budget share, a launch per stage with a budget, the slowdown beside a round
    in flight), the row sums of budgets from the same numpy reduction, and each phase's path from
    ``rank_path.path_seconds_py`` (the same recurrence as ``path_seconds``)."""
    s_n = st.stages
    lb = st.local_budget.tolist()
    denom = np.maximum(st.local_budget.sum(axis=1), 1e-300).tolist()
    launch_s, slow = rates.kernel.launch_s, rates.overlap_slowdown
    totals = []
    for phase, tr, bc in phases:
        spp, fixed_local = (x.tolist() for x in _local_rates(st, size, rates, phase))
        kern, fixed = bc.kernel.tolist(), bc.fixed.tolist()
        for r in range(size):
            kr, fr, br, sp, fl, d = kern[r], fixed[r], lb[r], spp[r], fixed_local[r], denom[r]
            for k in range(s_n):
                b = br[k]
                kr[k] = kr[k] + b * sp
                fr[k] = fr[k] + b / d * fl
                fr[k] = fr[k] + (launch_s if b > 0 else 0.0)
        if slow > 0:
            busy = ((_both(tr.sent) > 0) | (_both(tr.recv) > 0)).tolist()
            comp = [[kv * (1.0 + slow * (1.0 if on else 0.0)) + fv for kv, fv, on in zip(kr, fr, br)]
                    for kr, fr, br in zip(kern, fixed, busy)]
        else:
            comp = [[kv + fv for kv, fv in zip(kr, fr)] for kr, fr in zip(kern, fixed)]
        totals.append(path_seconds_py(comp, bc.after.tolist(), tr.flows.tolist(), tr.nbytes.tolist(), (rates.bw, rates.nvl_bw), latency,
                                      rates.flow_bw))
    return sum(totals)


def _remote_prices(st: StagedBlocks, size: int, n: int, rates: CostRates, a: np.ndarray | None = None) -> tuple:
    """``(traffic fwd, traffic bwd, (block costs fwd, bwd))`` of a staging's
    remote blocks (costs ``()`` without a kernel model), shared through ``st.memo`` by the stagings
    of one split with the same remote blocks (``schedule.stage``; callers copy before adding)."""
    key = st.memo_key
    if key is not None:
        hit = st.memo.get(key)
        if hit is not None and hit[0] is rates and hit[1] == size:
            return hit[2]
    if a is None:
        a = _arrays(st.remote)
    tf, tb = staged_traffic(a, size, n, rates)
    costs: tuple = ()
    if rates.kernel is not None:
        costs = block_costs_pair(a, size, n, rates)
    out = (tf, tb, costs)
    if key is not None:
        st.memo[key] = (rates, size, out)
    return out


def _kept_traffic(st: StagedBlocks, size: int, n: int, rates: CostRates) -> tuple[Traffic, Traffic] | None:
    """The (forward, backward) traffic of ``st``'s remote blocks over ``n`` rounds if
    ``_remote_prices`` kept it on the split's memo, else None."""
    hit = st.memo.get(st.memo_key) if st.memo_key is not None else None
    if hit is None or hit[0] is not rates or hit[1] != size or n != st.stages + 1:
        return None
    return hit[2][0], hit[2][1]


_LOCAL_MEMO: dict[int, tuple[object, CostRates, dict[Phase, tuple[np.ndarray, np.ndarray]]]] = {}


def _local_rates(st: StagedBlocks, size: int, rates: CostRates, phase: Phase) -> tuple[np.ndarray, np.ndarray]:
    """``_local_rates_of`` memoised on the staging's local blocks (every staging of one split shares
    the same tuple; the memo holds it, so an identity check is safe); both phases at once (they
    share the blocks' rows and groups)."""
    hit = _LOCAL_MEMO.get(id(st.local))
    if hit is None or hit[0] is not st.local or hit[1] is not rates:
        if len(_LOCAL_MEMO) >= 8:
            _LOCAL_MEMO.clear()
        hit = _LOCAL_MEMO[id(st.local)] = (st.local, rates, _local_rates_of(st, size, rates))
    return hit[2][phase]


def _local_rates_of(st: StagedBlocks, size: int, rates: CostRates) -> dict[Phase, tuple[np.ndarray, np.ndarray]]:
    """Per phase and rank: kernel seconds per pair of its local blocks (their shapes before
    pouring) and their merge seconds (launches excluded: pouring decides the calls).

    Memoised per rank on its local blocks in ``rates.local_memo`` (by identity: the placements of one compile share the
    blocks they leave untouched, ``Placement.placed``; the memo holds them, so their ids stay
    theirs): a rank's two numbers depend on its own blocks alone (``block_costs`` sums per
    [rank, stage] cell, calls never fuse across ranks, merged rows are counted per rank), so the
    ranks not memoised are priced together (``_local_rates_batch``) and each keeps its own."""
    memo = rates.local_memo  # one compile's (CostRates.local_memo)
    keys = [(size, r, tuple(map(id, loc))) for r, loc in enumerate(st.local)]
    missing = [r for r, loc in enumerate(st.local) if loc and keys[r] not in memo]
    if missing:
        got = _local_rates_batch([u for r in missing for u in st.local[r]], size, rates)
        for r in missing:
            memo[keys[r]] = (st.local[r], {ph: (float(got[ph][0][r]), float(got[ph][1][r])) for ph in got})
    out = {}
    for phase in (Phase.FWD, Phase.BWD):
        spp = np.full(size, rates.sec_fwd if phase == Phase.FWD else rates.sec_bwd)
        fixed = np.zeros(size)
        for r, loc in enumerate(st.local):
            if loc:
                spp[r], fixed[r] = memo[keys[r]][1][phase]
        out[phase] = spp, fixed
    return out


def _local_rates_batch(locs: list[Unit], size: int, rates: CostRates) -> dict[Phase, tuple[np.ndarray, np.ndarray]]:
    """``_local_rates_of``'s numbers for the ranks of ``locs`` (non-empty), in one pass."""
    a = _arrays(locs)
    a[:, 1] = 0  # one stage: the merge and kernel totals per rank
    groups = BlockGroups.of(a, size, 1)  # calls by global contiguity: launches are dropped below
    w = np.bincount(a[:, 0], weights=a[:, 6], minlength=size)
    has = w > 0
    out = {}
    for phase in (Phase.FWD, Phase.BWD):
        spp = np.full(size, rates.sec_fwd if phase == Phase.FWD else rates.sec_bwd)
        bc = block_costs(a, size, 1, rates, phase, groups)
        spp[has] = bc.kernel[has, 0] / w[has]
        out[phase] = spp, bc.fixed[:, 0] - bc.launch
    return out
