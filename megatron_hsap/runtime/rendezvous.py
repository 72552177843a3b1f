"""Local multi-process runs rendezvous on loopback only (issue 18, Deliver 3).

``torch.distributed.TCPStore``'s master binds every interface (``*:PORT``, measured with
``ss -ltnp`` on torch 2.13) even when given ``127.0.0.1``: on a shared machine a client through
the external address can set keys the ranks read. Local runs — the test pool, ``train-tiny``,
``bench``, ``pretrain-cpu`` — therefore rendezvous through a :class:`torch.distributed.FileStore`
in a private temporary directory (nothing listens for it), and gloo's pair sockets are pinned to
the loopback interface (``GLOO_SOCKET_IFNAME=lo``; they then bind ``127.0.0.1``).

The one helper pair::

    store_path = new_local_store()                 # parent: a fresh file in a 0700 temp dir
    ...spawn ranks, hand them store_path...
    init_local_process_group(rank, world, store_path, timeout_s=300)   # each rank

``loopback_env(rank, world)`` gives the environment entries of a local rank (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``GLOO_SOCKET_IFNAME=lo``); a launcher that starts ranks
as subprocesses passes them the store path itself (``pretrain-cpu``: ``HSAP_CPU_STORE``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile

from megatron_hsap.argtypes import port
from megatron_hsap.errors import ConfigError
from megatron_hsap.runtime.env import MAX_TIMEOUT_S

__all__ = ["new_local_store", "remove_local_store", "loopback_env", "init_local_process_group", "check_port"]

def check_port(value: object, name: str = "MASTER_PORT") -> int:
    """A TCP port number 1..65535 (the rule of ``argtypes.port``); :class:`ConfigError` naming ``name``."""
    try:
        return port(str(value).strip())
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{name}={value!r}: {exc}") from None


def new_local_store(prefix: str = "hsap-local-") -> str:
    """Path of a not-yet-existing store file in a fresh private (0700) temporary directory."""
    return os.path.join(tempfile.mkdtemp(prefix=prefix), "store")


def remove_local_store(path: str) -> None:
    """Delete the store's directory (after every rank has joined or exited)."""
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def loopback_env(rank: int, world_size: int, *, local_world_size: int | None = None) -> dict[str, str]:
    """Environment entries of one local rank (merge them into ``os.environ`` or a subprocess env)."""
    env = {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size or world_size), "MASTER_ADDR": "127.0.0.1",
    }  # fmt: skip
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pair sockets: loopback only
    return env


def init_local_process_group(rank: int, world_size: int, store_path: str, *,
                             timeout_s: float = 300.0, backend: str = "gloo") -> None:  # fmt: skip
    """``init_process_group`` over a file store on this machine; nothing listens beyond loopback.

    ``timeout_s`` becomes the default group's timeout (and so HSAP's groups', which inherit the
    job's timeout). Raises :class:`ConfigError` before any rendezvous on a bad argument.
    """
    import torch.distributed as dist

    path = store_path
    if not path:
        raise ConfigError("init_local_process_group needs a store path; create one with new_local_store()")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank!r} is out of range for world_size={world_size}")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ConfigError(f"timeout_s={timeout_s!r} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    os.environ.update(loopback_env(rank, world_size))
    store = dist.FileStore(path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
