"""``megatron-hsap launch <command>`` (= ``python -m megatron_hsap.launch``): what the sbatch scripts call.

Commands:
  validate CONFIG...            check configs, print one summary line each
  hostnames NODELIST            expand a SLURM node list (one host per line)
  topology CONFIG --nodes L     check the rank map torchrun will produce on nodes L, print it
  resolve CONFIG [...] [-- X]   print the torchrun line of one node (--node-rank) or of all
                                nodes (--all-nodes); X is appended to the Megatron arguments
                                (--for-launch: refuse what exec would refuse)
  exec CONFIG [...] [-- X]      replace this process by that torchrun (node rank from
                                --node-rank or $SLURM_NODEID); srun runs this on every node

With ``--nodes`` (a SLURM node list such as ``node[01-08]`` or comma-separated hosts, node rank =
position), resolve and exec first check the config against the allocation and the rank map
(``resolve_topology``); resolve prints the map as ``#`` comments. Both also set what the config
needs in the environment (``launch_env``; resolve prints ``export`` lines). Errors in the config
or the allocation print ``error: ...`` and exit with status 2, before anything is launched.

torchrun is the one of this interpreter's environment (``launch/torchrun.py``: ``--torchrun`` /
``$HSAP_TORCHRUN``, else ``torchrun`` next to this Python, else ``python -m torch.distributed.run``);
resolve prints which, and the link the planner prices (docs/design.md §4: NVLink when the CP group
TP × P_intra × P_inter fits one node, else InfiniBand). Every command prints the config's untested features (``launch/preflight.py``)
and refuses a config whose ``untested:`` list does not name exactly those. A launch (exec,
``resolve --for-launch``) refuses placeholder data paths (``"<fill in: ...>"``) and, on the node,
dataset and tokenizer files that do not exist; a dry run only warns.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence

from megatron_hsap.argtypes import HelpFormatter, link_line, nonnegative_int, port, positive_int
from megatron_hsap.errors import ConfigError
from megatron_hsap.launch.arguments import launch_env, to_megatron_args, torchrun_argv
from megatron_hsap.launch.config import CPImpl, LaunchConfig, load_config
from megatron_hsap.launch.loader import with_megatron_args
from megatron_hsap.launch.preflight import check_untested, data_problems, placeholder_keys, untested_notice
from megatron_hsap.launch.topology import (
    expand_nodelist,
    format_topology,
    hostnames_per_rank,
    resolve_topology,
)
from megatron_hsap.launch.torchrun import Torchrun, resolve_torchrun

DEFAULT_PORT = 29500


def _nodes(value: str | None) -> list[str]:
    if not value:
        return []
    return [h for part in value.replace("\n", " ").split() for h in expand_nodelist(part)]


def _parser(prog: str = "megatron-hsap launch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check configs", formatter_class=HelpFormatter)
    v.add_argument("configs", nargs="+", help="launch config YAML files")
    h = sub.add_parser("hostnames", help="expand a SLURM node list", formatter_class=HelpFormatter)
    h.add_argument("nodelist", help="e.g. node[01-04]")
    for name, text in (("topology", "check and print the rank map"), ("resolve", "print torchrun lines"),
                       ("exec", "exec torchrun for this node")):
        p = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        p.add_argument("config", help="launch config YAML")
        p.add_argument("--nodes", required=name == "topology",
                       help="SLURM node list or host,host,..." + ("" if name == "topology" else " (default: none, no map check)"))
        p.add_argument("--gpus-on-node", type=positive_int,
                       help="GPUs SLURM gave each node ($SLURM_GPUS_ON_NODE; default: not checked)")
        if name == "topology":
            p.add_argument("--full", action="store_true", help="one row per rank even for large jobs")
            continue
        p.add_argument("--nnodes", type=positive_int, help="nodes in the job (default: --nodes count, else the config's)")
        p.add_argument("--node-rank", type=nonnegative_int,
                       help="this node's rank (default: 0 for resolve; exec: $SLURM_NODEID)")
        p.add_argument("--master-addr", help="rendezvous host (default: the first of --nodes)")
        p.add_argument("--master-port", type=port, default=DEFAULT_PORT, help="rendezvous port")
        p.add_argument("--entry", help="training script (default: the config's entry)")
        p.add_argument("--repo", help="directory a relative entry is resolved against (default: the working directory)")
        p.add_argument("--torchrun", default=None,
                       help="torchrun command (default: torchrun next to this Python, else "
                       "'python -m torch.distributed.run'; the sbatch scripts pass $HSAP_TORCHRUN)")
        if name == "resolve":
            p.add_argument("--all-nodes", action="store_true", help="a '# host' comment + line per node")
            p.add_argument("--format", choices=("torchrun", "args", "json"), default="torchrun",
                           help="torchrun lines, or only the Megatron arguments (shell words or JSON)")
            p.add_argument("--for-launch", action="store_true",
                           help="refuse what exec refuses: placeholder or missing data, no torchrun")
    return parser


def _link(cfg: LaunchConfig) -> str:
    """The link the planner prices this config with (the one rule, ``argtypes.link_line``)."""
    p = cfg.parallel
    if p.cp_impl is not CPImpl.HSAP:
        return f"{p.cp_impl.value} context parallelism (no HSAP plans)"
    return link_line(intra=p.hsap_intra_size, inter=p.hsap_inter_size, tp=p.tensor,
                     gpus_per_node=cfg.cluster.gpus_per_node)


def _check_allocation(cfg: LaunchConfig, nodes: list[str], gpus_on_node: int | None, nnodes: int | None,
                      *, show: bool) -> None:
    """The config against the allocation and the node-major rank map torchrun will produce."""
    if gpus_on_node is not None and gpus_on_node != cfg.cluster.gpus_per_node:
        raise ConfigError(f"cluster.gpus_per_node: the config says {cfg.cluster.gpus_per_node} but SLURM "
                          f"gave {gpus_on_node} GPUs per node")
    if nnodes is not None and nodes and nnodes != len(nodes):
        raise ConfigError(f"SLURM_NNODES={nnodes} but the node list names {len(nodes)} host(s)")
    if not nodes:
        return
    if len(nodes) != cfg.cluster.nnodes:
        shown = ",".join(nodes[:4]) + (",..." if len(nodes) > 4 else "")
        raise ConfigError(f"cluster.nnodes: the config is for {cfg.cluster.nnodes} node(s) but the job "
                          f"has {len(nodes)} ({shown}); submit with --nodes={cfg.cluster.nnodes} or pick "
                          "the config for this allocation")
    topo, warnings = resolve_topology(cfg, hostnames_per_rank(nodes, cfg.cluster.gpus_per_node))
    if show:
        print("\n".join(f"# {line}" for line in format_topology(topo, max_rank_rows=16).splitlines()))
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)


def _preflight(cfg: LaunchConfig, torchrun: Torchrun | None, *, strict: bool) -> None:
    """Refuse (``strict``: a launch) or warn (a dry run) about data and torchrun; untested features
    must be acknowledged either way."""
    check_untested(cfg)
    problems = data_problems(cfg, check_files=strict)
    if torchrun is not None and torchrun.problem:
        problems.append(torchrun.problem)
    if strict and problems:
        raise ConfigError(f"{cfg.source or cfg.name} cannot be launched: " + "; ".join(problems))
    for problem in problems:
        print(f"warning: {problem} (a launch refuses this)", file=sys.stderr)


def _argv(cfg: LaunchConfig, ns: argparse.Namespace, nodes: list[str], node_rank: int,
          extra: Sequence[str], torchrun: Torchrun) -> list[str]:
    nnodes = ns.nnodes or len(nodes) or cfg.cluster.nnodes
    master = ns.master_addr or (nodes[0] if nodes else None)
    if master is None:
        if nnodes > 1:
            raise ConfigError("--master-addr (or --nodes) is needed for a multi-node launch")
        master = "localhost"
    entry = ns.entry or cfg.entry
    if ns.repo and not os.path.isabs(entry):
        entry = os.path.join(ns.repo, entry)
    return torchrun_argv(cfg, node_rank=node_rank, master_addr=master, master_port=ns.master_port,
                         nnodes=nnodes, entry=entry, torchrun=torchrun.argv, extra=extra)


def _run(ns: argparse.Namespace, extra: list[str]) -> int:
    if ns.command == "validate":
        for path in ns.configs:
            cfg = load_config(path)
            check_untested(cfg)
            print(cfg.summary())
            print(f"  {untested_notice(cfg)}")
            print(f"  {_link(cfg)}")
            keys = placeholder_keys(cfg)
            if keys:
                print(f"  to fill in before a launch (placeholders): {', '.join(keys)}")
        return 0
    if ns.command == "hostnames":
        print("\n".join(expand_nodelist(ns.nodelist)))
        return 0
    # the arguments after `--` join megatron_args: checked, preflighted and passed on as they are
    cfg, extra = with_megatron_args(load_config(ns.config), extra), []
    nodes = _nodes(ns.nodes)
    if ns.command == "topology":
        _check_allocation(cfg, nodes, ns.gpus_on_node, None, show=False)
        topo, _ = resolve_topology(cfg, hostnames_per_rank(nodes, cfg.cluster.gpus_per_node))
        print(format_topology(topo, max_rank_rows=10**9 if ns.full else 16))
        return 0
    show = ns.command == "resolve" and ns.all_nodes and ns.format == "torchrun"
    strict = ns.command == "exec" or ns.for_launch
    torchrun = resolve_torchrun(ns.torchrun)
    _preflight(cfg, torchrun if ns.command == "exec" or ns.format == "torchrun" else None, strict=strict)
    _check_allocation(cfg, nodes, ns.gpus_on_node, ns.nnodes, show=show)
    env = launch_env(cfg, os.environ)
    if ns.command == "exec":
        rank = ns.node_rank if ns.node_rank is not None else os.environ.get("SLURM_NODEID")
        if rank is None:
            raise ConfigError("exec needs --node-rank or $SLURM_NODEID (run it under srun)")
        try:
            rank = int(rank)
        except ValueError:
            raise ConfigError(f"$SLURM_NODEID={rank!r} is not a node rank (an integer)") from None
        argv = _argv(cfg, ns, nodes, rank, extra, torchrun)
        print(f"[megatron-hsap launch] node rank {rank}: {untested_notice(cfg)}", file=sys.stderr)
        print(f"[megatron-hsap launch] node rank {rank}: torchrun {torchrun.describe()}", file=sys.stderr)
        print(f"[megatron-hsap launch] node rank {rank}: {_link(cfg)}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvpe(argv[0], argv, dict(os.environ, **env))
    if ns.format != "torchrun":
        args = to_megatron_args(cfg, extra)
        print(json.dumps(args) if ns.format == "json" else shlex.join(args))
        return 0
    ranks = range(ns.nnodes or len(nodes) or cfg.cluster.nnodes) if ns.all_nodes else [ns.node_rank or 0]
    lines = [(rank, _argv(cfg, ns, nodes, rank, extra, torchrun)) for rank in ranks]  # (errors before any line)
    print(f"# {untested_notice(cfg)}")
    print(f"# torchrun: {torchrun.describe()}")
    print(f"# {_link(cfg)}")
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
    for rank, argv in lines:
        if ns.all_nodes:
            print(f"# {nodes[rank] if nodes else f'node {rank}'} (node rank {rank})")
        print(shlex.join(argv))
    return 0


def main(argv: Sequence[str] | None = None, *, prog: str = "megatron-hsap launch") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    ns = _parser(prog).parse_args(argv)
    try:
        return _run(ns, extra)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(prog="python -m megatron_hsap.launch"))
