"""Stage-shape census: what each family of ``schedule.stage_shapes`` buys, the evidence behind
keeping the every-shape search whole (docs/design.md §2.1 step 3, "Why every shape stays").

Compiles the batches of ``tests.plan.plan_identity``'s sets and, in every every-shape search
(``candidates._fastest`` over a split's stagings), built-prices *every* staging (the search itself
stops early), so each search yields the fastest built price of each shape. Then, for each family
of shapes, how much slower the search's result would be had the family never been staged:

    python -m tests.plan.shape_census [--sets bench budget] [--jobs 2]

About 20 s for ``bench budget`` and 90 s for ``grid window scale onedoc`` on 2 cores. Also
reports how often one placement's winning shape is the next explored placement's winner in the
same compile (a search seeded by it would otherwise have to be re-proved). A tool, not a test:
it changes no plan (the extra built prices are memoised pure functions) and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from tests.plan.plan_identity import DEFAULT_SETS, SETS, _init, jobs

# (label, the shapes a search keeps without the family); a shape is (stages, end weight, ring fill, doubles)
FAMILIES = (
    ("ring fill", lambda s: not s[2]),
    ("doubled middle stages", lambda s: s[3] == 0),
    ("two stages", lambda s: s[0] != 2),
    ("end weight 0.25", lambda s: s[1] != 0.25),
    ("end weight 0.5", lambda s: s[1] != 0.5),
    ("end weight 1 (not two stages)", lambda s: s[1] != 1.0 or s[0] == 2),
    ("ring fill at end weight 1", lambda s: not (s[2] and s[1] == 1.0)),
)

_SEARCHES: list = []  # per worker: the searches of the plan being compiled


def _watch() -> None:
    """Record each every-shape search: per staging its shape, staged and built price, and the pick."""
    import megatron_hsap.plan.candidates as candidates

    shapes: dict[int, tuple] = {}
    stage, fastest = candidates.stage, candidates._fastest

    def staged(split, rates, shp, budget):
        st = stage(split, rates, shp, budget)
        shapes[id(st)] = (shp.stages, shp.end_weight, shp.ring_fill, shp.doubles)
        return st

    def searched(got, size, rates, latency):
        best = fastest(got, size, rates, latency)
        _SEARCHES.append([(shapes.get(id(st)), t, candidates.built_price(st, size, rates, latency), st is best[1])
                          for t, st in got])
        return best

    candidates.stage, candidates._fastest = staged, searched


def _init_worker(tree: str) -> None:
    _init(tree)
    _watch()


def _one(job: tuple[str, list[int], int, dict]) -> tuple[str, list]:
    from megatron_hsap.plan.plan import clear_plan_cache, compile_plan

    name, cu, P, kw = job
    _SEARCHES.clear()
    clear_plan_cache()
    try:
        compile_plan(cu, P, **kw)
    except Exception:  # (an error is plan_identity's business: no searches to count here)
        return name, []
    return name, [s for s in _SEARCHES if len(s) > 1]


def census(searches: list[list]) -> list[str]:
    """The report lines of ``searches`` (each a list of ``(shape, staged, built, picked)``)."""
    n_st = sum(map(len, searches))
    lines = [f"{len(searches)} every-shape searches, {n_st} stagings",
             "| without | stagings left | searches slower | > 0.5% | largest loss |", "|---|---|---|---|---|"]
    for label, keep in FAMILIES:
        losses, left = [], 0
        for rows in searches:
            kept = [b for s, _, b, _ in rows if s is not None and keep(s)]
            left += len(kept)
            best = min(b for _, _, b, _ in rows)
            losses.append(min(kept) / best - 1 if kept else float("inf"))
        worst = max(losses, default=0.0)
        lines.append(f"| {label} | {left} / {n_st} | {sum(x > 1e-12 for x in losses)} | {sum(x > 0.005 for x in losses)} | "
                     + ("every shape of some search" if worst == float("inf") else f"{100 * worst:.1f}%") + " |")
    return lines


def seeded(per_plan: list[list[list]]) -> str:
    """How often a compile's previous search's winning shape wins the next search too."""
    same = tried = absent = 0
    for plan in per_plan:
        for prev, rows in zip(plan, plan[1:]):
            won = next(s for s, _, _, p in prev if p)
            pick = next(s for s, _, _, p in rows if p)
            here = [b for s, _, b, _ in rows if s is not None and won is not None and s[:3] == won[:3]]
            tried += 1
            absent += not here
            same += pick is not None and won is not None and pick[:3] == won[:3]
    return f"the previous search's winning shape won the next search in {same} of {tried} ({absent} did not offer it)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", default=["bench", "budget"], choices=[s for s in SETS if s in DEFAULT_SETS])
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    tree = os.getcwd()
    _init(tree)
    with ProcessPoolExecutor(args.jobs, initializer=_init_worker, initargs=(tree,)) as ex:
        got = dict(ex.map(_one, jobs(tuple(args.sets)), chunksize=1))
    print(f"{len(got)} plans ({' '.join(args.sets)})")
    print("\n".join(census([s for plan in got.values() for s in plan])))
    print(seeded(list(got.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
