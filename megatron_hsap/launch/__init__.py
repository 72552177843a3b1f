"""Cluster launch: YAML configs → Megatron arguments and torchrun lines; the rank/topology map.

``python -m megatron_hsap.launch resolve <config>`` prints what the sbatch scripts run. Nothing
here imports torch or Megatron.
"""

from megatron_hsap.launch.arguments import launch_env, to_megatron_args, torchrun_argv
from megatron_hsap.launch.config import (
    CPImpl,
    InterLink,
    LaunchConfig,
    Recompute,
    Sharding,
    config_from_dict,
    load_config,
)
from megatron_hsap.launch.preflight import Feature, check_untested, data_problems, untested_features
from megatron_hsap.launch.topology import (
    TopologyMap,
    build_topology,
    check_topology,
    expand_nodelist,
    format_topology,
    hostnames_per_rank,
    resolve_topology,
)
from megatron_hsap.launch.torchrun import Torchrun, resolve_torchrun

__all__ = [
    "CPImpl", "InterLink", "LaunchConfig", "Recompute", "Sharding", "config_from_dict", "load_config",
    "launch_env", "to_megatron_args", "torchrun_argv", "TopologyMap", "build_topology", "check_topology",
    "expand_nodelist", "format_topology", "hostnames_per_rank", "resolve_topology",
    "Feature", "check_untested", "data_problems", "untested_features", "Torchrun", "resolve_torchrun",
]
