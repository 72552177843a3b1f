"""Stages (DESIGN §2.1 step 3): order each rank's placed blocks so communication hides behind
compute.

Stage 0 computes only *local* blocks (inputs already on the rank). Round ``k`` is posted at the
start of stage ``k`` and carries the inputs of stage ``k + 1`` and the results of stage ``k − 1``;
so every remote block gets a stage ≥ 1. Remote blocks are packed into stages with balanced
compute (blocks computed for another rank first, so their results start travelling early), and
local blocks are then poured into the stages by water-filling — split by rows where needed — so
every stage of a rank carries about the same compute and the per-stage maximum over ranks
stays close to each rank's total / stages.
"""

from __future__ import annotations

import numpy as np

from megatron_hsap.plan.ir import TokenRange, Unit
from megatron_hsap.plan.placement import Prices
from megatron_hsap.plan.units import causal_work

__all__ = ["assign_stages", "remote_bytes", "split_rows"]

_MIN_SPLIT_ROWS = 16  # never cut a local block into slivers thinner than this


def is_local(u: Unit) -> bool:
    return u.rank == u.q_owner == u.kv_owner


def remote_bytes(u: Unit, pr: Prices) -> float:
    """Pool bytes the computing rank needs for ``u`` in backward (the larger phase)."""
    total = 0.0
    if u.rank != u.q_owner:
        total += len(u.q) * (pr.q_bwd + pr.dq)
    if u.rank != u.kv_owner:
        total += len(u.kv) * (pr.kv + pr.dkv)
    return total


def _result_bytes(u: Unit, pr: Prices) -> list[tuple[int, float]]:
    """(owner, bytes) of the backward partial results ``u`` sends home (the larger phase)."""
    out = []
    if u.rank != u.q_owner:
        out.append((u.q_owner, len(u.q) * pr.dq))
    if u.rank != u.kv_owner:
        out.append((u.kv_owner, len(u.kv) * pr.dkv))
    return out


def split_rows(u: Unit, m: int) -> tuple[Unit, Unit]:
    """Split ``u`` before global q row ``m``: causal blocks keep bottom-right alignment."""
    assert u.q.start < m < u.q.stop
    first_kv = TokenRange(u.kv.start, m) if u.causal else u.kv
    a = Unit(u.doc, TokenRange(u.q.start, m), first_kv, u.causal, u.q_owner, u.kv_owner, u.rank, u.stage)
    b = Unit(u.doc, TokenRange(m, u.q.stop), u.kv, u.causal, u.q_owner, u.kv_owner, u.rank, u.stage)
    return a, b


def _split_cols(u: Unit, m: int) -> tuple[Unit, Unit]:
    assert not u.causal and u.kv.start < m < u.kv.stop
    a = Unit(u.doc, u.q, TokenRange(u.kv.start, m), False, u.q_owner, u.kv_owner, u.rank, u.stage)
    b = Unit(u.doc, u.q, TokenRange(m, u.kv.stop), False, u.q_owner, u.kv_owner, u.rank, u.stage)
    return a, b


def _fit(u: Unit, budget: float, pr: Prices) -> list[Unit]:
    """Cut a remote block until each part's pool bytes fit ``budget``: along the side that
    travels (q rows when it runs away from its q owner, kv columns on the q owner)."""
    need = remote_bytes(u, pr)
    if need <= budget:
        return [u]
    if u.rank == u.q_owner and not u.causal:
        n = len(u.kv)
        parts = min(n, int(np.ceil(need / budget)))
        edges = np.linspace(u.kv.start, u.kv.stop, parts + 1).round().astype(np.int64)
        out, rest = [], u
        for e in edges[1:-1].tolist():
            a, rest = _split_cols(rest, e)
            out.append(a)
        return out + [rest]
    n = len(u.q)
    if n == 1:
        return [u]  # cannot cut further; the allocator reports if the pool is too small
    a, b = split_rows(u, u.q.start + n // 2)
    return _fit(a, budget, pr) + _fit(b, budget, pr)


def _pour(units: list[Unit], budgets: list[float], pr_sec: float) -> list[Unit]:
    """Distribute local blocks over stages ``0..len(budgets)-1`` by compute budget (seconds)."""
    out: list[Unit] = []
    stage = 0
    left = budgets[0] if budgets else 0.0
    last = len(budgets) - 1
    queue = list(units)
    while queue:
        u = queue.pop(0)
        cost = u.work * pr_sec
        while stage < last and left <= 0:
            stage += 1
            left = budgets[stage]
        if stage == last or cost <= left * 1.0001:
            out.append(_with_stage(u, stage))
            left -= cost
            continue
        m = _rows_for_work(u, left / pr_sec)
        if m - u.q.start < _MIN_SPLIT_ROWS or u.q.stop - m < _MIN_SPLIT_ROWS:
            if left >= cost / 2:  # closer to fit whole here than in the next stage
                out.append(_with_stage(u, stage))
                left -= cost
            else:
                queue.insert(0, u)
                stage += 1
                left = budgets[stage]
            continue
        a, b = split_rows(u, m)
        out.append(_with_stage(a, stage))
        queue.insert(0, b)
        stage += 1
        left = budgets[stage]
    return out


def _rows_for_work(u: Unit, work: float) -> int:
    """Largest row cut ``m`` whose head part has at most ``work`` pairs (binary search)."""
    lo, hi = u.q.start, u.q.stop
    while hi - lo > 1:
        mid = (lo + hi) // 2
        head = causal_work(TokenRange(u.q.start, mid), TokenRange(u.kv.start, mid) if u.causal else u.kv, u.causal)
        if head <= work:
            lo = mid
        else:
            hi = mid
    return lo


def _with_stage(u: Unit, stage: int) -> Unit:
    return Unit(u.doc, u.q, u.kv, u.causal, u.q_owner, u.kv_owner, u.rank, stage)


def assign_stages(placed: list[Unit], size: int, pr: Prices, budget: float) -> list[Unit]:
    """Give every placed block a stage (splitting blocks as needed); see the module docstring.

    ``budget``: pool bytes one rank may use for the remote blocks of one stage."""
    sec = pr.sec_fwd + pr.sec_bwd
    local: list[list[Unit]] = [[] for _ in range(size)]
    remote: list[list[Unit]] = [[] for _ in range(size)]
    for u in placed:
        (local if is_local(u) else remote)[u.rank].append(u)
    for r in range(size):
        parts = [p for u in remote[r] for p in _fit(u, budget, pr)]
        # results for other ranks first (they travel back in the next round), biggest first
        parts.sort(key=lambda u: (u.rank == u.q_owner, -u.work, u.q.start, u.kv.start))
        remote[r] = parts
    counts = [len(x) for x in remote]
    target = max(counts) if counts else 0
    staged: list[Unit] = []
    stage_load = [[0.0] for _ in range(size)]  # compute seconds per stage, stage 0 first
    # Results a rank receives in one round are pool bytes too: cap them per (owner, round).
    incoming: dict[tuple[int, int], float] = {}
    for r in range(size):
        parts = remote[r]
        if not parts:
            continue
        total = sum(u.work for u in parts)
        stages = max(1, min(len(parts), target))
        k, acc, used, loads = 1, 0.0, 0.0, [0.0, 0.0]
        for i, u in enumerate(parts):
            b = remote_bytes(u, pr)
            back = _result_bytes(u, pr)
            boundary = total * k / stages
            if acc > 0 and (used + b > budget or acc >= boundary * 0.999 or len(parts) - i <= stages - k):
                k, used = k + 1, 0.0
            while any(0.0 < incoming.get((o, k + 1), 0.0) and incoming[(o, k + 1)] + nb > budget for o, nb in back):
                k, used = k + 1, 0.0
            while len(loads) <= k:
                loads.append(0.0)
            for o, nb in back:
                incoming[(o, k + 1)] = incoming.get((o, k + 1), 0.0) + nb
            staged.append(_with_stage(u, k))
            acc += u.work
            used += b
            loads[k] += u.work * sec
        stage_load[r] = loads
    last = max(len(x) for x in stage_load)
    for r in range(size):
        loads = stage_load[r] + [0.0] * (last - len(stage_load[r]))
        work = sum(u.work for u in local[r]) * sec
        budgets = _water_fill(loads, work)
        units = sorted(local[r], key=lambda u: (u.q.start, u.kv.start))
        staged.extend(_pour(units, budgets, sec))
    staged.sort(key=lambda u: (u.stage, u.rank, u.q.start, u.kv.start))
    return staged


def _water_fill(loads: list[float], amount: float) -> list[float]:
    """Budgets x_k ≥ 0 with Σx = amount minimising max(load_k + x_k)."""
    n = len(loads)
    if amount <= 0:
        return [0.0] * n
    arr = np.asarray(loads, dtype=float)
    srt = np.sort(arr)
    level = srt[-1] + (amount - (srt[-1] * n - srt.sum())) / n
    for i in range(1, n + 1):
        lvl = (amount + srt[:i].sum()) / i
        if i == n or lvl <= srt[i]:
            level = lvl
            break
    return np.maximum(level - arr, 0.0).tolist()
