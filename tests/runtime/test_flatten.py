"""A flattened plan (``plan/flatten.py``: a ``P_intra × P_inter`` batch planned as pure SAP over all
``P`` CP ranks, ``1 × P``, or as one all-to-all over them, ``P × 1``) runs on the whole CP group,
against the float64 reference, on CPU gloo.

Every configured topology other than the flattened one at world 4 and 8, the three ways a caller
names its groups (explicit intra/inter plus ``cp_group``, ``initialize_hsap``'s, the world by
default), MHA, GQA and kv heads replicated by the all-to-all: out, dq, dk, dv equal
``tests/reference.py``, the executor's P2P bytes equal the plan's, and the all-to-all moves
nothing (``1 × P``) or Ulysses' volume over the CP group (``P × 1``). A one-level configured
topology's one group serves as the CP group, and so does the CP group handed in the one level the
plan runs on (what ``HSAPGroups.levels_for`` gives, without ``cp_group=``). A flattened plan handed explicit two-level HSAP
groups without the CP group is refused by name on every rank before any collective.
"""

from __future__ import annotations

import pytest

from tests.runtime import cases

TOPOLOGIES = {4: [(2, 2), (4, 1)], 8: [(2, 4), (4, 2), (8, 1)]}
TOKENS = {4: 128, 8: 256}


def _specs(world: int, topologies: list[tuple[int, int]], flatten: str) -> list[dict]:
    """Per configured topology: the three ways of naming groups (MHA, GQA, kv replicated by the
    all-to-all) and the CP group handed as the plan's one level (``groups="levels"``); and, at a
    configured ``1 × P``, its one inter group alone (no ``cp_group=``)."""
    total = TOKENS[world]
    specs = []
    for n, (intra, inter) in enumerate(topologies):
        for groups, kv in (("explicit", 8), ("initialize", 2), ("default", 1)):
            cu = [0, 5, total // 2 + 1, total - 2] if groups == "explicit" else [0, 17, 40, 41, total // 2, total]
            specs.append(cases.build_spec(cu, intra=intra, inter=inter, heads=8, kv_heads=kv, dim=8, seed=n,
                                          groups=groups, flatten=flatten, layout="balanced"))
        specs.append(cases.build_spec([0, 11, total - 7, total], intra=intra, inter=inter, heads=8, kv_heads=4, dim=8,
                                      seed=n, groups="levels", flatten=flatten))
        if intra == 1:  # the configured 1 x P's inter group is its CP group: no cp_group= needed
            specs.append(cases.build_spec([0, 9, total], intra=1, inter=inter, heads=8, kv_heads=4, dim=8, seed=n,
                                          flatten=flatten, one_group=True))
    return specs


A2A_TOPOLOGIES = {4: [(1, 4), (2, 2)], 8: [(1, 8), (2, 4), (4, 2)]}


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("flatten", ["always", "all-to-all"])
def test_flattened_plans_equal_the_reference(gloo_pool, flatten, world):
    """1 x P ("always", from every other topology) and P x 1 ("all-to-all") against the reference."""
    specs = _specs(world, (TOPOLOGIES if flatten == "always" else A2A_TOPOLOGIES)[world], flatten)
    results = gloo_pool(world).run(cases.run_cases, specs, timeout=900)
    for i, spec in enumerate(specs):
        plan = cases.compile_for(spec)
        assert plan.options.flattened_from == (spec["intra"], spec["inter"]), "the plan under test must be the flattened one"
        plan.verify()
        per_rank = [r[i] for r in results]
        if flatten == "always":
            assert (plan.intra_size, plan.inter_size) == (1, world)
            assert [r["inter_rank"] for r in per_rank] == list(range(world)), "CP rank = the flat plan's inter rank"
        else:
            assert (plan.intra_size, plan.inter_size, plan.chosen.fwd.messages, plan.chosen.bwd.messages) == (world, 1, (), ())
        cases.check_against_reference(spec, per_rank)
        # 1 x P: P2P bytes = the plan's, the all-to-all moved nothing; P x 1: no P2P byte, the
        # all-to-all moved Ulysses' volume over the CP group
        cases.check_bytes(spec, per_rank)


def _refused(spec: dict) -> dict:
    """Run a flattened plan with explicit HSAP groups and no CP group: the error, per rank."""
    import torch

    from megatron_hsap.errors import ConfigError
    from megatron_hsap.runtime import hsap_attn_func

    plan = cases.compile_for(spec)
    intra, inter = cases.make_groups(spec["intra"], spec["inter"])
    t = plan.local_tokens
    q = torch.zeros(t, spec["heads"], spec["dim"])
    k = torch.zeros(t, spec["kv_heads"], spec["dim"])
    try:
        hsap_attn_func(q, k, k, plan, intra_group=intra, inter_group=inter)
    except ConfigError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.parametrize(("flatten", "how"), [("always", "pure SAP"), ("all-to-all", "one all-to-all (Ulysses)")])
def test_flattened_plan_without_the_cp_group_is_refused_by_name(gloo_pool, flatten, how):
    spec = cases.build_spec([0, 30, 128], intra=2, inter=2, heads=8, kv_heads=8, dim=8, flatten=flatten)
    for r in gloo_pool(4).run(_refused, spec, timeout=300):
        assert r["error"] and "cp_group=" in r["error"] and f"runs as {how} over all 4" in r["error"], r
        assert "flattened from 2x2" in r["error"], r


def _cp_groups_of_a_split_world(_: object) -> dict:
    """World 8 as two CP groups of 4 (2x2 each): the CP group initialize_hsap builds for flattened plans."""
    import torch
    import torch.distributed as dist

    from megatron_hsap.megatron.parallel_state import destroy_hsap, initialize_hsap

    rank = dist.get_rank()
    mine = list(range(0, 4)) if rank < 4 else list(range(4, 8))
    groups = initialize_hsap(2, 2, cp_ranks=mine, node_check="off")
    try:
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=groups.cp)
        return {"cp_rank": groups.cp_rank, "group_rank": dist.get_rank(groups.cp), "size": dist.get_world_size(groups.cp),
                "sum": float(x.item())}
    finally:
        destroy_hsap()


def test_initialize_hsap_builds_each_cp_group_for_flattened_plans(gloo_pool):
    results = gloo_pool(8).run(_cp_groups_of_a_split_world, None, timeout=300)
    for rank, r in enumerate(results):
        assert r["group_rank"] == r["cp_rank"] == rank % 4 and r["size"] == 4, r
        assert r["sum"] == (6.0 if rank < 4 else 22.0), r  # only its own CP group's members


def test_levels_for_names_the_groups_each_plan_runs_on() -> None:
    """``HSAPGroups.levels_for``: the configured groups for a plan of their topology, the CP group as
    the one level of a flattened plan (``1 × P``: inter, ``P × 1``: intra), refused by name when the
    groups carry no CP group, are of another topology, or the batch was sharded for another rank.
    Host-only: the groups are stand-ins, nothing is exchanged."""
    from dataclasses import replace

    from megatron_hsap.errors import ConfigError, RuntimeMismatchError
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.runtime.groups import HSAPGroups

    intra, inter, cp = object(), object(), object()
    groups = HSAPGroups(intra=intra, inter=inter, intra_size=2, inter_size=2, cp_rank=3, intra_rank=1, inter_rank=1, cp=cp)
    cu = [0, 40, 100, 128]
    plans = {f: compile_plan(cu, 2, intra_size=2, num_heads=8, num_kv_heads=4, head_dim=8, flatten=f)
             for f in ("never", "always", "all-to-all")}
    assert [p.options.flattened_from for p in plans.values()] == [None, (2, 2), (2, 2)]
    assert groups.levels_for(plans["never"]) == (intra, inter)
    assert groups.levels_for(plans["always"]) == (None, cp)
    assert groups.levels_for(plans["all-to-all"], cp_rank=3) == (cp, None)
    with pytest.raises(ConfigError, match=r"runs as one all-to-all \(Ulysses\) over all 4 CP ranks.*no CP group"):
        replace(groups, cp=None).levels_for(plans["all-to-all"])
    other = HSAPGroups(intra=intra, inter=inter, intra_size=1, inter_size=4, cp_rank=3, intra_rank=0, inter_rank=3, cp=cp)
    with pytest.raises(ConfigError, match="flattened from 2x2 but the HSAP groups are 1x4"):
        other.levels_for(plans["always"])
    with pytest.raises(RuntimeMismatchError, match="sharded for CP rank 0 but this is CP rank 3"):
        groups.levels_for(plans["never"], cp_rank=0)
