"""The resolved rank map (rank → host, intra group, inter group) and its checks. Pure Python.

Inputs are the hostname of every global rank (index = rank) and the parallel sizes. Ranks follow
Megatron's default order ``tp-cp-ep-dp-pp``: ``rank = tp + TP·(cp + CP·(dp + DP·pp))``; inside a
CP group, CP rank ``r = i·P_intra + j`` with ``i`` the inter index and ``j`` the intra index
(docs/design.md §1). The intra group of a rank is its ``P_intra`` CP neighbours (all-to-all, must share a
host: NVLink); the inter group is the ``P_inter`` ranks with the same ``j`` (P2P).

Decision on "inter groups that do not cross hosts": the config's ``parallel.inter_link`` states
where the inter (P2P) traffic runs, and the planner prices moves with that link (docs/design.md §4: a
block pays for its transfer above ≈16K tokens over InfiniBand but ≈1.6K over NVLink). So
``inter_link: ib`` with an inter group all on one host, or ``inter_link: nvlink`` with an inter
group spanning hosts, is a contradiction and raises ``ConfigError``; ``inter_link: auto`` lets the
map decide (IB when any inter group spans hosts) and only warns when inter groups disagree.
An intra group spanning hosts always raises.

The Megatron integration calls ``build_topology`` + ``check_topology`` on the all-gathered
hostnames at start-up and prints ``format_topology`` once on rank 0; the sbatch scripts run the
same check before launching, on the hostnames torchrun will produce from the node list.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_hsap.errors import ConfigError
from megatron_hsap.launch.config import InterLink
from megatron_hsap.plan.checks import positive_int
from megatron_hsap.plan.hardware import LinkClass

if TYPE_CHECKING:
    from megatron_hsap.launch.config import LaunchConfig

__all__ = [
    "RankPlacement", "TopologyMap", "build_topology", "check_topology", "format_topology",
    "expand_nodelist", "hostnames_per_rank", "resolve_topology",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlacement:
    """Where one global rank sits and which HSAP groups it belongs to."""

    rank: int
    host: str
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    inter_index: int  # i: the inter chunk (node-level position) inside the CP group
    intra_index: int  # j: position inside the intra group (which heads after the all-to-all)
    intra_group: int  # index into TopologyMap.intra_groups
    inter_group: int  # index into TopologyMap.inter_groups


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyMap:
    tensor: int
    pipeline: int
    data: int
    intra: int
    inter: int
    placements: tuple[RankPlacement, ...]
    intra_groups: tuple[tuple[int, ...], ...]  # global ranks, ordered by first rank
    inter_groups: tuple[tuple[int, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.placements)

    @property
    def context_size(self) -> int:
        return self.intra * self.inter

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.host for p in self.placements))

    def group_hosts(self, ranks: Sequence[int]) -> dict[str, tuple[int, ...]]:
        """Host → the group's ranks on it, hosts in rank order."""
        out: dict[str, list[int]] = {}
        for r in ranks:
            out.setdefault(self.placements[r].host, []).append(r)
        return {h: tuple(rs) for h, rs in out.items()}

    @property
    def link(self) -> LinkClass:
        """The inter groups' link: InfiniBand as soon as one of them spans hosts."""
        spans = any(len(self.group_hosts(g)) > 1 for g in self.inter_groups)
        return LinkClass.INFINIBAND if spans else LinkClass.NVLINK


def build_topology(hostnames: Sequence[str], *, intra: int, inter: int, tensor: int = 1,
                   pipeline: int = 1) -> TopologyMap:
    """Resolve every rank's place from ``hostnames[rank]`` and the parallel sizes."""
    world = len(hostnames)
    for name, value in (("intra", intra), ("inter", inter), ("tensor", tensor), ("pipeline", pipeline)):
        positive_int(f"{name} size", value)
    cp = intra * inter
    if world == 0 or world % (tensor * cp * pipeline):
        raise ConfigError(
            f"{world} ranks cannot hold tensor × context × pipeline = {tensor} × {cp} × {pipeline}; "
            "the hostname list must have one entry per global rank")
    data = world // (tensor * cp * pipeline)
    intra_keys: dict[tuple[int, ...], list[int]] = {}
    inter_keys: dict[tuple[int, ...], list[int]] = {}
    coords = []
    for r in range(world):
        tp, rest = r % tensor, r // tensor
        cp_rank, rest = rest % cp, rest // cp
        dp, pp = rest % data, rest // data
        i, j = divmod(cp_rank, intra)
        coords.append((tp, cp_rank, dp, pp, i, j))
        intra_keys.setdefault((pp, dp, tp, i), []).append(r)
        inter_keys.setdefault((pp, dp, tp, j), []).append(r)
    intra_groups = tuple(sorted((tuple(g) for g in intra_keys.values()), key=lambda g: g[0]))
    inter_groups = tuple(sorted((tuple(g) for g in inter_keys.values()), key=lambda g: g[0]))
    intra_of = {r: n for n, g in enumerate(intra_groups) for r in g}
    inter_of = {r: n for n, g in enumerate(inter_groups) for r in g}
    placements = tuple(
        RankPlacement(rank=r, host=str(hostnames[r]), tp_rank=tp, cp_rank=c, dp_rank=dp, pp_rank=pp,
                      inter_index=i, intra_index=j, intra_group=intra_of[r], inter_group=inter_of[r])
        for r, (tp, c, dp, pp, i, j) in enumerate(coords)
    )
    return TopologyMap(tensor=tensor, pipeline=pipeline, data=data, intra=intra, inter=inter,
                       placements=placements, intra_groups=intra_groups, inter_groups=inter_groups)


def _describe(topo: TopologyMap, kind: str, n: int, ranks: Sequence[int]) -> str:
    hosts = ", ".join(f"{h} ({_ranges(rs)})" for h, rs in topo.group_hosts(ranks).items())
    return f"{kind} group {n} (ranks {_ranges(ranks)}) on {hosts}"


def check_topology(topo: TopologyMap, *, inter_link: InterLink | str = InterLink.AUTO,
                   gpus_per_node: int | None = None) -> tuple[str, ...]:
    """Raise ``ConfigError`` when the map contradicts the config; return warnings otherwise."""
    try:
        link = InterLink(inter_link)
    except ValueError:
        raise ConfigError(f"parallel.inter_link: {inter_link!r} is not one of "
                          f"{[m.value for m in InterLink]}") from None
    per_host: dict[str, int] = {}
    for p in topo.placements:
        per_host[p.host] = per_host.get(p.host, 0) + 1
    if gpus_per_node is not None:
        odd = {h: n for h, n in per_host.items() if n != gpus_per_node}
        if odd:
            raise ConfigError(
                f"cluster.gpus_per_node: the config says {gpus_per_node} GPUs per node but the job runs "
                f"{', '.join(f'{n} ranks on {h}' for h, n in list(odd.items())[:4])}; launch "
                f"--nproc-per-node={gpus_per_node} on every node or fix cluster.gpus_per_node")
    split = [(n, g) for n, g in enumerate(topo.intra_groups) if len(topo.group_hosts(g)) > 1]
    if split:
        shown = "; ".join(_describe(topo, "intra", n, g) for n, g in split[:4])
        raise ConfigError(
            f"{len(split)} intra (all-to-all) group(s) span hosts: {shown}. Intra groups must sit on "
            f"one NVLink node: make tensor × hsap_intra_size ({topo.tensor} × {topo.intra}) divide "
            "the GPUs per node and give every node the same number of consecutive ranks (torchrun "
            "--nproc-per-node = GPUs per node, node-major ranks)")
    if topo.inter == 1:
        return ()
    local = [(n, g) for n, g in enumerate(topo.inter_groups) if len(topo.group_hosts(g)) == 1]
    spanning = [(n, g) for n, g in enumerate(topo.inter_groups) if len(topo.group_hosts(g)) > 1]
    if link is InterLink.IB and local:
        n, g = local[0]
        raise ConfigError(
            f"parallel.inter_link: 'ib' but {len(local)} inter (P2P) group(s) never leave one host, "
            f"e.g. {_describe(topo, 'inter', n, g)}: their traffic runs over NVLink and plans priced "
            "for InfiniBand would move too little work. Set parallel.inter_link: nvlink (or auto), "
            "or spread the CP group over nodes (hsap_intra_size × tensor = GPUs per node)")
    if link is InterLink.NVLINK and spanning:
        n, g = spanning[0]
        raise ConfigError(
            f"parallel.inter_link: 'nvlink' but {len(spanning)} inter (P2P) group(s) span hosts, "
            f"e.g. {_describe(topo, 'inter', n, g)}: their traffic crosses InfiniBand. Set "
            "parallel.inter_link: ib (or auto), or fit the CP group in one node")
    if local and spanning:
        return (f"{len(spanning)} inter group(s) span hosts and {len(local)} do not; plans are "
                "priced for InfiniBand, the slower link",)
    return ()


def resolve_topology(cfg: LaunchConfig, hostnames: Sequence[str]) -> tuple[TopologyMap, tuple[str, ...]]:
    """Build the map of ``cfg`` on ``hostnames`` and check it against the config."""
    if len(hostnames) != cfg.world_size:
        raise ConfigError(
            f"cluster: the config needs {cfg.world_size} ranks (nnodes {cfg.cluster.nnodes} × "
            f"gpus_per_node {cfg.cluster.gpus_per_node}) but {len(hostnames)} hostnames were given")
    p = cfg.parallel
    topo = build_topology(hostnames, intra=p.hsap_intra_size, inter=p.hsap_inter_size,
                          tensor=p.tensor, pipeline=p.pipeline)
    warnings = check_topology(topo, inter_link=p.inter_link, gpus_per_node=cfg.cluster.gpus_per_node)
    return topo, warnings


def format_topology(topo: TopologyMap, *, max_rank_rows: int = 128) -> str:
    """The map as text: one row per rank, or one row per host above ``max_rank_rows`` ranks."""
    head = (f"HSAP topology: {topo.world_size} ranks on {len(topo.hosts)} host(s); TP {topo.tensor} "
            f"PP {topo.pipeline} DP {topo.data} CP {topo.context_size} = {topo.intra}x{topo.inter} "
            f"(intra×inter); inter groups run over {topo.link.value}")
    lines = [head]
    if topo.world_size <= max_rank_rows:
        width = max(len(h) for h in topo.hosts)
        lines.append(f"{'rank':>5}  {'host':<{width}}  tp  cp  dp  pp  intra group (j)  inter group (i)")
        for p in topo.placements:
            lines.append(f"{p.rank:>5}  {p.host:<{width}}  {p.tp_rank:>2}  {p.cp_rank:>2}  {p.dp_rank:>2}  "
                         f"{p.pp_rank:>2}  {p.intra_group:>11} ({p.intra_index})  "
                         f"{p.inter_group:>11} ({p.inter_index})")
        return "\n".join(lines)
    by_host: dict[str, list[RankPlacement]] = {}
    for p in topo.placements:
        by_host.setdefault(p.host, []).append(p)
    for host, ps in by_host.items():
        lines.append(f"{host}: ranks {_ranges([p.rank for p in ps])}; intra groups "
                     f"{_ranges(sorted({p.intra_group for p in ps}))}; inter groups "
                     f"{_ranges(sorted({p.inter_group for p in ps}))}")
    return "\n".join(lines)


def _ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` → ``"0-2,5,7-8"``."""
    out, vals = [], list(values)
    for _, run in itertools.groupby(enumerate(vals), key=lambda t: t[1] - t[0]):
        block = [v for _, v in run]
        out.append(str(block[0]) if len(block) == 1 else f"{block[0]}-{block[-1]}")
    return ",".join(out)


# --------------------------------------------------------------------------- node lists


def expand_nodelist(expr: str) -> list[str]:
    """Expand a SLURM host list (``node[01-03,07],gpu-a[1-2]-b[3-4]``) in SLURM's order.

    The fallback when ``scontrol show hostnames`` is unavailable (dry runs, tests). Zero padding
    follows the lower bound (``[01-10]`` → ``01 … 10``), as SLURM does.
    """
    items, depth, start = [], 0, 0
    for pos, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"node list {expr!r}: unbalanced ']' at position {pos}")
        elif ch == "," and depth == 0:
            items.append(expr[start:pos])
            start = pos + 1
    if depth:
        raise ConfigError(f"node list {expr!r}: unbalanced '['")
    items.append(expr[start:])
    hosts: list[str] = []
    for item in (s.strip() for s in items):
        if not item:
            continue
        parts = re.split(r"(\[[^\]]*\])", item)
        choices = [_expand_brackets(p, expr) if p.startswith("[") else [p] for p in parts]
        hosts.extend("".join(c) for c in itertools.product(*choices))
    if not hosts:
        raise ConfigError(f"node list {expr!r} names no host")
    return hosts


def _expand_brackets(group: str, expr: str) -> list[str]:
    out = []
    for rng in group[1:-1].split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", rng)
        if not m:
            raise ConfigError(f"node list {expr!r}: cannot read range {rng!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"node list {expr!r}: range {rng!r} runs backwards")
        out.extend(str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1))
    return out


def hostnames_per_rank(nodes: Sequence[str], gpus_per_node: int) -> list[str]:
    """torchrun's node-major placement: node ``n`` runs ranks ``[n·G, (n+1)·G)``."""
    return [n for n in nodes for _ in range(gpus_per_node)]
