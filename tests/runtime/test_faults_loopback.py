"""Local runs listen on loopback only (issue 18, Deliver 3): the test pool's ranks (and the test
process that spawned them) hold no listening TCP socket on a non-loopback address while a case
runs HSAP attention, and the rendezvous helper refuses bad arguments before any rendezvous.

Sockets are read from ``/proc`` (this process's and each rank's file descriptors matched with
``/proc/net/tcp{,6}`` entries in state LISTEN), so the check sees exactly the sockets these
processes own, not other engineers' processes on the machine.
"""

from __future__ import annotations

import ipaddress
import os
import sys

import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.runtime.rendezvous import check_port, init_local_process_group, loopback_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

_LISTEN = "0A"


def _decode(hex_addr: str) -> str:
    """``/proc/net/tcp`` address (little-endian hex words) to text."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket in LISTEN state owned by process ``pid``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == _LISTEN and inode in inodes:
                addr, port = local.split(":")
                out.append((_decode(addr), int(port, 16)))
    return out


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def case_listening_during_attention() -> list[tuple[str, int]]:
    """Run a 1×2 HSAP forward/backward (P2P + handshake), then list this rank's listening sockets."""
    import torch

    from megatron_hsap.plan import compile_plan
    from megatron_hsap.runtime import hsap_attn_func
    from tests.runtime.cases import make_groups

    plan = compile_plan([0, 9, 32], 2, 1, num_heads=2, head_dim=4, dtype_bytes=4)
    _, inter = make_groups(1, 2)
    x = torch.randn(plan.local_tokens, 2, 4, requires_grad=True)
    hsap_attn_func(x, x, x, plan, inter_group=inter).sum().backward()
    return listening_sockets(os.getpid())


def test_no_listening_socket_beyond_loopback_during_a_run(gloo_pool):
    per_rank = gloo_pool(2).run(case_listening_during_attention, timeout=60)
    for rank, socks in enumerate(per_rank):
        assert socks, f"rank {rank}: gloo's pair listener should be visible (the check would be vacuous)"
        outside = [s for s in socks if not _is_loopback(s[0])]
        assert not outside, f"rank {rank} listens beyond loopback: {outside}"
    parent = [s for s in listening_sockets(os.getpid()) if not _is_loopback(s[0])]
    assert not parent, f"the test process listens beyond loopback: {parent}"


def test_proc_reader_sees_a_wildcard_listener():
    """The reader itself: a socket bound to every interface is reported as non-loopback."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        found = dict((p, a) for a, p in listening_sockets(os.getpid()))
        assert found.get(port) == "0.0.0.0" and not _is_loopback(found[port])


def test_rendezvous_helper_refuses_bad_arguments(tmp_path):
    store = str(tmp_path / "store")
    env = loopback_env(1, 2)
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo" and env["RANK"] == "1"
    with pytest.raises(ConfigError, match="needs a store path"):
        init_local_process_group(0, 2, "")
    with pytest.raises(ConfigError, match="rank 2 is out of range for world_size=2"):
        init_local_process_group(2, 2, store)
    with pytest.raises(ConfigError, match="timeout_s=inf must be a finite number"):
        init_local_process_group(0, 2, store, timeout_s=float("inf"))
    with pytest.raises(ConfigError, match=r"MASTER_PORT='99999': '99999' is not a port: use 1\.\.65535"):
        check_port("99999")
    assert check_port(" 29500") == 29500
    assert not os.path.exists(store)  # refused before any rendezvous
