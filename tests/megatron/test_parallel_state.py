"""HSAP's parallel_state extension: group layout, Megatron parity, misconfigurations, node check.

Expected layouts are written from docs/design.md §1 directly (rank r = i·P_intra + j of the CP rank
list), not from the module's helper.
"""

from __future__ import annotations

import re
import warnings

import pytest

from megatron_hsap.errors import ConfigError, HSAPError

# --------------------------------------------------------------------------- single process


def test_getter_before_init_names_the_call():
    from megatron_hsap.megatron import get_hsap_groups, is_hsap_initialized

    assert not is_hsap_initialized()
    with pytest.raises(ConfigError, match=r"initialize_hsap\(intra_size=\.\.\., inter_size=\.\.\.\)"):
        get_hsap_groups()


def test_init_without_torch_distributed_is_a_config_error():
    from megatron_hsap.megatron import initialize_hsap

    with pytest.raises(ConfigError, match="init_process_group"):
        initialize_hsap(2, 2)


def test_lazy_package_does_not_import_megatron():
    import subprocess
    import sys

    code = (
        "import sys, megatron_hsap.megatron as m; assert 'megatron.core' not in sys.modules; "
        "m.initialize_hsap; assert 'megatron.core' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


# --------------------------------------------------------------------------- multi-rank cases


def _expected(cp_ranks: list[int], intra: int, rank: int) -> tuple[list[int], list[int]]:
    """(intra members, inter members) of ``rank`` per docs/design.md §1, from first principles."""
    r = cp_ranks.index(rank)
    i, j = r // intra, r % intra
    inter = len(cp_ranks) // intra
    return [cp_ranks[i * intra + jj] for jj in range(intra)], [cp_ranks[ii * intra + j] for ii in range(inter)]


def _describe(groups) -> dict:
    """What a rank sees of its groups, plus a live all-reduce over each (proves they work)."""
    import torch
    import torch.distributed as dist

    sums = []
    for group in (groups.intra, groups.inter):
        t = torch.tensor([float(dist.get_rank())], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        sums.append(t.item())
    return dict(
        cp_rank=groups.cp_rank,
        intra_rank=groups.intra_rank,
        inter_rank=groups.inter_rank,
        intra=dist.get_process_group_ranks(groups.intra),
        inter=dist.get_process_group_ranks(groups.inter),
        intra_global=list(groups.intra_global_ranks()),
        inter_global=list(groups.inter_global_ranks()),
        sums=sums,
        topology=groups.topology,
        cp_link=groups.cp_link,
    )


def _case_layout(intra: int, inter: int, kwargs: dict) -> dict:
    import torch.distributed as dist

    from megatron_hsap.megatron import destroy_hsap, get_hsap_groups, initialize_hsap, is_hsap_initialized

    cp_ranks = kwargs.pop("cp_ranks_by_rank", {}).get(dist.get_rank())
    try:
        groups = initialize_hsap(intra, inter, cp_ranks=cp_ranks, **kwargs)
        assert get_hsap_groups() is groups and is_hsap_initialized()
        return _describe(groups)
    finally:
        destroy_hsap()


def _check_layout(results: list[dict], cp_of: dict[int, list[int]], intra: int) -> None:
    for rank, got in enumerate(results):
        cp = cp_of[rank]
        want_intra, want_inter = _expected(cp, intra, rank)
        assert got["cp_rank"] == cp.index(rank)
        assert (got["intra_rank"], got["inter_rank"]) == (cp.index(rank) % intra, cp.index(rank) // intra)
        assert got["intra"] == got["intra_global"] == want_intra, rank
        assert got["inter"] == got["inter_global"] == want_inter, rank
        assert got["sums"] == [float(sum(want_intra)), float(sum(want_inter))]
        assert got["topology"] == f"{intra}x{len(cp) // intra}"


@pytest.mark.parametrize(
    ("world", "intra", "inter"),
    [(4, 1, 4), (4, 2, 2), (4, 4, 1),
     pytest.param(8, 2, 4, marks=pytest.mark.slow), pytest.param(8, 4, 2, marks=pytest.mark.slow)],
)
def test_layout_whole_world_is_cp(gloo_pool, world, intra, inter):
    results = gloo_pool(world).run(_case_layout, intra, inter, {})
    _check_layout(results, {r: list(range(world)) for r in range(world)}, intra)


@pytest.mark.parametrize(("intra", "inter"), [(2, 1), (1, 2)])
def test_layout_with_tensor_parallel_builds_every_cp_group(gloo_pool, intra, inter):
    # TP 2 × CP 2 on 4 ranks: CP groups {0, 2} and {1, 3} (CP ranks spaced by TP, as in Megatron).
    # Each rank passes only its own CP group; groups of the other CP group must still be created.
    cp_of = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    kwargs = dict(cp_ranks_by_rank=cp_of, tp_size=2, gpus_per_node=4)
    results = gloo_pool(4).run(_case_layout, intra, inter, kwargs)
    _check_layout(results, cp_of, intra)


def _case_misconfig(intra, inter, kwargs: dict) -> str:
    """Call initialize_hsap with a bad configuration; count collectives issued before it raised."""
    import torch.distributed as dist

    from megatron_hsap.megatron import destroy_hsap, initialize_hsap

    calls: list[str] = []
    real = {name: getattr(dist, name) for name in ("all_gather_object", "new_group", "all_gather", "barrier")}

    def _spy(name):
        def call(*args, **kw):
            calls.append(name)
            return real[name](*args, **kw)

        return call

    for name in real:
        setattr(dist, name, _spy(name))
    try:
        initialize_hsap(intra, inter, **kwargs)
    except ConfigError as exc:
        return f"{exc} || collectives: {calls}"
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
        destroy_hsap()
    return "no error"


@pytest.mark.parametrize(
    ("intra", "inter", "kwargs", "pattern"),
    [
        (2, 3, {}, r"intra_size × inter_size = 2 × 3 = 6 but the context-parallel group has 4 ranks; "
                   r"change intra_size/inter_size \(--hierarchical-context-parallel-sizes"),
        (0, 4, {}, r"intra_size \(P_intra\) must be an integer >= 1, got 0"),
        (4, -1, {}, r"inter_size \(P_inter\) must be an integer >= 1"),
        (2, 2, dict(node_check="maybe"), r"node_check='maybe'; use one of \['error', 'warn', 'off'\]"),
        (4, 1, dict(tp_size=2, gpus_per_node=4, cp_ranks=[0, 1, 2, 3]),
         r"tensor-parallel size × intra_size = 2 × 4 = 8 does not divide gpus_per_node=4.*one of \[1, 2\]"),
        (4, 1, dict(gpus_per_node=6), r"1 × 4 = 4 does not divide gpus_per_node=6.*one of \[1, 2\]"),
        (2, 2, dict(cp_ranks=[3, 2, 1, 0]), r"must be distinct and ascending"),
    ],
)
def test_misconfiguration_raises_before_any_collective(gloo_pool, intra, inter, kwargs, pattern):
    pool = gloo_pool(4)
    restarts = pool.restarts
    for message in pool.run(_case_misconfig, intra, inter, kwargs):
        assert re.search(pattern, message), message
        assert message.endswith("collectives: []"), message
    assert pool.restarts == restarts  # every rank raised the same way: nothing left half-done


def _case_node_check(mode: str, hosts: list[str]) -> tuple[str, list[str], dict | None]:
    import torch.distributed as dist

    from megatron_hsap.megatron import destroy_hsap, initialize_hsap

    rank = dist.get_rank()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            groups = initialize_hsap(2, 2, node_check=mode, hostname_fn=lambda: hosts[rank])
            described = _describe(groups)
            error = ""
        except HSAPError as exc:
            described, error = None, f"{type(exc).__name__}: {exc}"
        finally:
            destroy_hsap()
    return error, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], described


def test_node_check_passes_when_intra_groups_share_a_host(gloo_pool):
    results = gloo_pool(4).run(_case_node_check, "error", ["nodeA", "nodeA", "nodeB", "nodeB"])
    assert all(error == "" and not warned and got is not None for error, warned, got in results)
    # The CP group spans two hosts, so the planner must price InfiniBand although 4 GPUs fit the
    # 8-GPUs-per-node rule (which would have said NVLink).
    assert [got["cp_link"] for _, _, got in results] == ["ib"] * 4


def test_cp_link_is_nvlink_when_the_whole_cp_group_shares_a_host(gloo_pool):
    results = gloo_pool(4).run(_case_node_check, "error", ["nodeA"] * 4)
    assert [got["cp_link"] for _, _, got in results] == ["nvlink"] * 4


def test_node_check_names_ranks_and_hosts(gloo_pool):
    # Round-robin placement: intra group {0, 1} sits on two hosts, so does {2, 3}.
    hosts = ["nodeA", "nodeB", "nodeA", "nodeB"]
    for error, _, got in gloo_pool(4).run(_case_node_check, "error", hosts):
        assert got is None
        assert error.startswith("ConfigError: 2 intra (all-to-all) group(s) span hosts")
        assert "intra group ranks [0, 1] span hosts {'nodeA': [0], 'nodeB': [1]}" in error
        assert "intra group ranks [2, 3] span hosts {'nodeA': [2], 'nodeB': [3]}" in error
        assert "Lower intra_size (P_intra = 2, first of --hierarchical-context-parallel-sizes)" in error


def test_node_check_warn_mode_warns_and_builds(gloo_pool):
    hosts = ["nodeA", "nodeA", "nodeA", "nodeB"]  # only intra group {2, 3} spans hosts
    results = gloo_pool(4).run(_case_node_check, "warn", hosts)
    for rank, (error, warned, got) in enumerate(results):
        assert error == "" and got is not None
        assert got["intra"] == [0, 1] if rank < 2 else got["intra"] == [2, 3]
        if rank < 2:
            assert warned == []  # their own group is fine
        else:
            assert len(warned) == 1 and "intra group ranks [2, 3] span hosts" in warned[0]
    off = gloo_pool(4).run(_case_node_check, "off", ["a", "b", "c", "d"])
    assert all(error == "" and not warned for error, warned, _ in off)
    assert [got["cp_link"] for _, _, got in off] == [None] * 4  # nobody looked: the count rule applies


def _case_reinit() -> list:
    from megatron_hsap.megatron import destroy_hsap, get_hsap_groups, initialize_hsap, is_hsap_initialized

    seen = []
    try:
        initialize_hsap(2, 2)
        try:
            initialize_hsap(4, 1)
        except ConfigError as exc:
            seen.append(str(exc))
        destroy_hsap()
        seen.append(is_hsap_initialized())
        destroy_hsap()  # idempotent
        seen.append(_describe(initialize_hsap(4, 1)))
        seen.append(get_hsap_groups().topology)
    finally:
        destroy_hsap()
    return seen


def test_destroy_then_reinitialise(gloo_pool):
    for rank, (double, flag, described, topo) in enumerate(gloo_pool(4).run(_case_reinit)):
        assert "already initialised (2x2); call destroy_hsap() first" in double
        assert flag is False
        assert described["intra"] == [0, 1, 2, 3] and described["inter"] == [rank]
        assert topo == "4x1"


def _case_returns_after_every_rank_connected(last_rank_delay_s: float) -> bool:
    """Whether, when ``initialize_hsap`` returns here, the last rank had finished creating its
    groups. The last rank marks that in the store only ``last_rank_delay_s`` after its own
    ``new_group`` calls returned, so a rank that does not wait for its peers returns first."""
    import time

    import torch.distributed as dist

    from megatron_hsap.megatron import destroy_hsap, initialize_hsap
    from megatron_hsap.megatron import parallel_state as ps

    store = dist.distributed_c10d._get_default_store()
    last = dist.get_rank() == dist.get_world_size() - 1
    real_create = ps._create_groups

    def slow_create(*args, **kwargs):
        out = real_create(*args, **kwargs)
        if last:
            time.sleep(last_rank_delay_s)
            store.set("hsap_test_last_rank_connected", "1")
        return out

    ps._create_groups = slow_create
    try:
        initialize_hsap(2, dist.get_world_size() // 2, node_check="off")
        seen = store.check(["hsap_test_last_rank_connected"])
        dist.barrier()  # every rank has looked before the key goes
    finally:
        ps._create_groups = real_create
        destroy_hsap()
    dist.barrier()
    if dist.get_rank() == 0:
        store.delete_key("hsap_test_last_rank_connected")
    dist.barrier()
    return seen


def test_initialize_returns_only_once_every_rank_has_its_groups(gloo_pool):
    # gloo connects a new group eagerly and each rank's new_group returns once its own pairs are
    # up; a rank that destroyed its groups at once could close a pair its slower peer was still
    # connecting (CI once failed so: "connection closed by peer"). initialize_hsap ends on a
    # barrier, so even a rank 0.3 s late is done before anyone returns.
    assert gloo_pool(4).run(_case_returns_after_every_rank_connected, 0.3) == [True] * 4


# --------------------------------------------------------------------------- with Megatron


def _case_megatron(tp: int, cp: int, intra: int, inter: int, hier: list[int] | None) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_hsap.megatron import destroy_hsap, initialize_hsap

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, hierarchical_context_parallel_sizes=hier
    )
    out: dict = {"cp_ranks": list(ps.get_context_parallel_global_ranks())}
    try:
        if hier:
            levels = ps.get_hierarchical_context_parallel_groups()
            out["megatron"] = [dist.get_process_group_ranks(g) for g in levels]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            groups = initialize_hsap(intra, inter)  # CP group and TP size read from Megatron
        out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        out["reused"] = bool(hier) and groups.intra is ps.get_hierarchical_context_parallel_groups()[0]
        out["first"] = _describe(groups)
        destroy_hsap()
        out["megatron_global_after_destroy"] = ps.get_hierarchical_context_parallel_groups(check_initialized=False)
        out["second"] = _describe(initialize_hsap(intra, inter))  # now built by HSAP itself
    finally:
        destroy_hsap()
    return out


@pytest.mark.parametrize(
    ("world", "tp", "intra", "inter"),
    [(4, 1, 2, 2), pytest.param(4, 1, 4, 1, marks=pytest.mark.slow), pytest.param(8, 2, 2, 2, marks=pytest.mark.slow)],
)
def test_matches_megatron_hierarchical_layout(gloo_pool, world, tp, intra, inter):
    cp = intra * inter
    results = gloo_pool(world).run(_case_megatron, tp, cp, intra, inter, [intra, inter])
    cp_of = {r: res["cp_ranks"] for r, res in enumerate(results)}
    for rank, res in enumerate(results):
        assert res["reused"], "Megatron's hierarchical groups have our sizes and must be reused"
        assert res["warnings"] == []
        assert res["megatron_global_after_destroy"] is None
        # Megatron's level 0 / level 1 = HSAP's intra / inter, before and after HSAP builds its own.
        assert res["first"]["intra"] == res["second"]["intra"] == res["megatron"][0]
        assert res["first"]["inter"] == res["second"]["inter"] == res["megatron"][1]
    _check_layout([r["second"] for r in results], cp_of, intra)
    if tp > 1:  # CP ranks are spaced by TP
        assert results[0]["cp_ranks"] == list(range(0, world, tp))


def test_megatron_without_hierarchical_sizes_and_mismatched_sizes(gloo_pool):
    pool = gloo_pool(4)
    plain = pool.run(_case_megatron, 1, 4, 2, 2, None)
    _check_layout([r["first"] for r in plain], {r: [0, 1, 2, 3] for r in range(4)}, 2)
    assert all(r["warnings"] == [] for r in plain)
    other = pool.run(_case_megatron, 1, 4, 2, 2, [4, 1])  # Megatron 4×1, HSAP 2×2
    for res in other:
        assert not res["reused"]
        assert len(res["warnings"]) == 1 and "HSAP builds its own groups" in res["warnings"][0]
    _check_layout([r["first"] for r in other], {r: [0, 1, 2, 3] for r in range(4)}, 2)
