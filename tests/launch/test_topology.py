"""The rank map against an independent reference, and its checks on fake hostname lists.

Reference: Megatron's construction written out with numpy — ranks ``arange(world)`` reshaped to
``[pp, dp, cp, tp]`` (order ``tp-cp-ep-dp-pp``, tp fastest) give the CP groups, and
``create_hierarchical_groups``' ``"(l s u) -> (l u) s"`` rearrangement gives level 0 (intra) and
level 1 (inter).
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.launch import (
    build_topology,
    check_topology,
    config_from_dict,
    expand_nodelist,
    format_topology,
    hostnames_per_rank,
    resolve_topology,
)
from megatron_hsap.launch.config import InterLink
from megatron_hsap.plan.hardware import LinkClass


def _reference_groups(world: int, tp: int, pp: int, intra: int, inter: int) -> tuple[set, set]:
    cp = intra * inter
    dp = world // (tp * pp * cp)
    grid = np.arange(world).reshape(pp, dp, cp, tp)
    intra_groups, inter_groups = set(), set()
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                ranks = grid[p, d, :, t]
                for level, (s, u) in enumerate(((intra, 1), (inter, intra))):
                    l_ = cp // (s * u)
                    blocks = ranks.reshape(l_, s, u).transpose(0, 2, 1).reshape(-1, s)
                    (intra_groups, inter_groups)[level].update(tuple(int(x) for x in b) for b in blocks)
    return intra_groups, inter_groups


@pytest.mark.parametrize(("world", "tp", "pp", "intra", "inter"),
                         [(64, 1, 1, 8, 8), (64, 2, 1, 4, 8), (32, 2, 2, 2, 2), (16, 1, 1, 1, 16), (8, 1, 1, 8, 1)])
def test_groups_match_megatron_layout(world: int, tp: int, pp: int, intra: int, inter: int) -> None:
    topo = build_topology(hostnames_per_rank([f"n{i}" for i in range(world // 8)], 8),
                          intra=intra, inter=inter, tensor=tp, pipeline=pp)
    want_intra, want_inter = _reference_groups(world, tp, pp, intra, inter)
    assert set(topo.intra_groups) == want_intra
    assert set(topo.inter_groups) == want_inter
    for pl in topo.placements:  # every rank's indices point at the groups that hold it
        assert topo.intra_groups[pl.intra_group][pl.intra_index] == pl.rank
        assert topo.inter_groups[pl.inter_group][pl.inter_index] == pl.rank


def test_good_8x8_map() -> None:
    nodes = [f"node{i:02d}" for i in range(1, 9)]
    topo = build_topology(hostnames_per_rank(nodes, 8), intra=8, inter=8)
    assert check_topology(topo, inter_link=InterLink.IB, gpus_per_node=8) == ()
    assert topo.link is LinkClass.INFINIBAND
    r10 = topo.placements[10]  # node02, third GPU: inter chunk 1, heads slice 2
    assert (r10.host, r10.inter_index, r10.intra_index) == ("node02", 1, 2)
    assert [len(topo.group_hosts(g)) for g in topo.intra_groups] == [1] * 8
    assert [len(topo.group_hosts(g)) for g in topo.inter_groups] == [8] * 8
    text = format_topology(topo)
    assert text.splitlines()[0].startswith("HSAP topology: 64 ranks on 8 host(s)")
    assert len(text.splitlines()) == 2 + 64  # header, column names, one row per rank
    assert len(format_topology(topo, max_rank_rows=16).splitlines()) == 1 + 8  # one row per host


def test_intra_group_across_two_hosts_names_ranks_and_hosts() -> None:
    # 4 GPUs per host but intra 8: intra group 0 = ranks 0-7 on hostA (0-3) and hostB (4-7).
    hosts = hostnames_per_rank(["hostA", "hostB", "hostC", "hostD"], 4)
    topo = build_topology(hosts, intra=8, inter=2)
    with pytest.raises(ConfigError) as info:
        check_topology(topo)
    msg = str(info.value)
    assert "intra group 0 (ranks 0-7) on hostA (0-3), hostB (4-7)" in msg
    assert "intra group 1 (ranks 8-15) on hostC (8-11), hostD (12-15)" in msg


def test_inter_group_on_one_host_contradicts_ib() -> None:
    # 16 ranks on 2 hosts, CP 8 = 2x4 with DP 2: every CP group, and so every inter group, stays
    # inside one host: with nnodes > 1 a config that says "ib" is wrong about its own traffic.
    topo = build_topology(hostnames_per_rank(["a", "b"], 8), intra=2, inter=4)
    with pytest.raises(ConfigError, match=r"parallel.inter_link: 'ib'.*inter group 0 \(ranks 0,2,4,6\) on a"):
        check_topology(topo, inter_link="ib")
    assert check_topology(topo, inter_link="nvlink") == ()
    assert check_topology(topo, inter_link="auto") == () and topo.link is LinkClass.NVLINK


def test_inter_group_across_hosts_contradicts_nvlink() -> None:
    topo = build_topology(hostnames_per_rank(["a", "b"], 8), intra=8, inter=2)
    with pytest.raises(ConfigError, match="parallel.inter_link: 'nvlink'"):
        check_topology(topo, inter_link="nvlink")


def test_mixed_inter_groups_warn_under_auto() -> None:
    # 6 GPUs per host, CP 4 = 2x2: CP group 0 (ranks 0-3) on host a, CP group 1 (4-7) across a and b.
    topo = build_topology(hostnames_per_rank(["a", "b"], 6)[:12], intra=2, inter=2)
    warnings = check_topology(topo, inter_link="auto")
    assert len(warnings) == 1 and "priced for InfiniBand" in warnings[0]
    assert topo.link is LinkClass.INFINIBAND


def test_host_with_wrong_gpu_count() -> None:
    topo = build_topology(["a"] * 8 + ["b"] * 4 + ["c"] * 4, intra=4, inter=4)
    with pytest.raises(ConfigError, match="cluster.gpus_per_node: .* 4 ranks on b"):
        check_topology(topo, gpus_per_node=8)


def test_resolve_topology_from_config() -> None:
    cfg = config_from_dict({
        "model": {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 16, "vocab_size": 1000},
        "parallel": {"tensor": 2, "hsap_intra_size": 4, "hsap_inter_size": 2, "inter_link": "ib"},
        "cluster": {"nnodes": 2, "gpus_per_node": 8},
        "training": {"seq_length": "16K"},
        "data": {"mock": True},
    })
    topo, warnings = resolve_topology(cfg, hostnames_per_rank(["x", "y"], 8))
    assert warnings == () and topo.tensor == 2 and topo.data == 1
    assert topo.intra_groups[0] == (0, 2, 4, 6)  # CP ranks spaced by TP
    with pytest.raises(ConfigError, match="16 ranks"):
        resolve_topology(cfg, ["x"] * 8)


@pytest.mark.parametrize(("expr", "hosts"), [
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("node[01-02,07],gpu5", ["node01", "node02", "node07", "gpu5"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
    ("single", ["single"]),
])
def test_expand_nodelist(expr: str, hosts: list[str]) -> None:
    assert expand_nodelist(expr) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node]1[", "node[3-1]", "node[a-b]", ""])
def test_expand_nodelist_errors(bad: str) -> None:
    with pytest.raises(ConfigError):
        expand_nodelist(bad)
