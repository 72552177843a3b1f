"""Which hardware constants the planner prices a Megatron run with (docs/design.md §4).

GPU model from the device name (``torch.cuda.get_device_name``), GPUs per node from the launcher
(``LOCAL_WORLD_SIZE``, set by torchrun and SLURM's launcher), ``--hsap-hardware`` /
``--hsap-gpus-per-node`` overriding both. The choice is printed once in the start-up banner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.hardware import HARDWARE, hardware_for_device

__all__ = ["RunHardware", "run_hardware", "resolve_hardware"]

DEFAULT = "a100"


@dataclass(frozen=True, slots=True)
class RunHardware:
    """The constant set's name, GPUs per node, and where each came from (for the banner)."""

    name: str
    gpus_per_node: int
    source: str


def resolve_hardware(*, flag: str | None, device_name: str | None, flag_gpus: int | None,
                     local_world_size: str | None) -> RunHardware:
    """Pure rule: an explicit flag wins, then the device name, then the A100 default."""
    if flag is not None:
        if flag not in HARDWARE:
            raise ConfigError(f"--hsap-hardware {flag}: choose one of {sorted(HARDWARE)}")
        name, why = flag, "--hsap-hardware"
    elif device_name and (found := hardware_for_device(device_name)) is not None:
        name, why = found, f"device {device_name!r}"
    else:
        name = DEFAULT
        why = f"default: device {device_name!r} unknown, pass --hsap-hardware" if device_name else "default: no GPU"
    if flag_gpus is not None:
        if flag_gpus < 1:
            raise ConfigError(f"--hsap-gpus-per-node {flag_gpus}: must be >= 1")
        gpus, gwhy = flag_gpus, "--hsap-gpus-per-node"
    elif local_world_size and local_world_size.isdigit() and int(local_world_size) > 0:
        gpus, gwhy = int(local_world_size), "LOCAL_WORLD_SIZE"
    else:
        gpus, gwhy = HARDWARE[name].gpus_per_node, "default"
    return RunHardware(name=name, gpus_per_node=gpus, source=f"{why}; GPUs per node from {gwhy}")


def run_hardware(args: Any) -> RunHardware:
    """The run's constants from Megatron's ``args`` and the environment (cached on ``args``)."""
    cached = getattr(args, "_hsap_hardware", None)
    if cached is not None:
        return cached
    import torch

    device_name = None
    if torch.cuda.is_available():
        try:
            device_name = torch.cuda.get_device_name()
        except (RuntimeError, AssertionError):
            device_name = None
    hw = resolve_hardware(flag=getattr(args, "hsap_hardware", None), device_name=device_name,
                          flag_gpus=getattr(args, "hsap_gpus_per_node", None),
                          local_world_size=os.environ.get("LOCAL_WORLD_SIZE"))
    args._hsap_hardware = hw
    return hw
