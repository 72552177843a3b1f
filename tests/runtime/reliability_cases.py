"""Reliability cases the gloo pool runs on every rank (pickled by reference): cu_seqlens that
disagree across ranks, the debug layer, a rank that skips a round (timeouts), bad input refused
before any collective, P2P misuse, pool reuse; and a collective counter. The exactness cases and
their helpers are in ``tests/runtime/cases.py``."""

from __future__ import annotations

from typing import Any

import torch

from tests.runtime.cases import compile_for, make_groups, run_one


class _CountCollectives:
    """Replace torch.distributed's communication entry points by counters (restored on exit)."""

    NAMES = ("batch_isend_irecv", "all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor",
             "barrier", "isend", "irecv", "send", "recv")  # fmt: skip

    def __enter__(self) -> list[str]:
        import torch.distributed as dist

        self.saved = {n: getattr(dist, n) for n in self.NAMES}
        self.calls: list[str] = []
        for n in self.NAMES:
            setattr(dist, n, lambda *a, _n=n, **kw: self.calls.append(_n))
        return self.calls

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        for n, fn in self.saved.items():
            setattr(dist, n, fn)


def case_consistency(cu_by_rank: list[Any]) -> str:
    """``check_cu_seqlens_consistent`` with this rank's entry; the error message (or "ok"), after
    proving the default group is still usable (no rank left waiting)."""
    import torch.distributed as dist

    from megatron_hsap.errors import BatchError
    from megatron_hsap.runtime import check_cu_seqlens_consistent

    try:
        check_cu_seqlens_consistent(cu_by_rank[dist.get_rank()], None)
        result = "ok"
    except BatchError as exc:
        result = f"BatchError: {exc}"
    t = torch.ones(1)
    dist.all_reduce(t)
    return result + f" | after: {int(t.item())}"


def case_debug_layer(cu_by_rank: list[list[int]], intra: int, inter: int) -> str:
    """``HSAP_DEBUG=1``: the layer fingerprints its plan's batch first; ranks with different
    batches raise ``BatchError`` before any all-to-all or P2P."""
    import os

    import torch.distributed as dist

    from megatron_hsap.errors import BatchError
    from megatron_hsap.runtime import hsap_attn_func

    rank = dist.get_rank()
    spec = dict(cu=cu_by_rank[rank], intra=intra, inter=inter, heads=8, kv_heads=8, dim=8, dim_v=8, dtype="float32")
    plan = compile_for(spec)
    groups = make_groups(intra, inter)
    q = torch.randn(plan.local_tokens, 8, 8)
    old = os.environ.get("HSAP_DEBUG")
    os.environ["HSAP_DEBUG"] = "1"
    real_a2a, real_p2p = dist.all_to_all_single, dist.batch_isend_irecv
    calls: list[str] = []
    dist.all_to_all_single = lambda *a, **kw: calls.append("a2a")
    dist.batch_isend_irecv = lambda *a, **kw: calls.append("p2p")
    try:
        hsap_attn_func(q, q, q, plan, intra_group=groups[0], inter_group=groups[1])
        result = "no error"
    except BatchError as exc:
        result = f"BatchError: {exc}"
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = real_a2a, real_p2p
        os.environ.pop("HSAP_DEBUG") if old is None else os.environ.__setitem__("HSAP_DEBUG", old)
    return f"{result} | data calls: {calls}"


def case_timeout(cu: list[int], skip_rank: int, skip_round: int, timeout_s: float) -> str:
    """Rank ``skip_rank`` neither posts nor waits round ``skip_round`` (test-only hook); every rank
    runs forward on a fresh group (destroyed after the case, pending operations with it)."""
    import torch.distributed as dist

    from megatron_hsap.errors import CommunicationError
    from megatron_hsap.runtime.executor import Executor

    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)), backend="gloo")
    spec = dict(cu=cu, intra=1, inter=world, heads=8, kv_heads=8, dim=8, dim_v=8, dtype="float32")
    plan = compile_for(spec)
    skip = frozenset({skip_round}) if rank == skip_rank else frozenset()
    ex = Executor(plan, group, "cpu", timeout_s=timeout_s, skip_rounds=skip)
    x = torch.randn(plan.local_tokens, 8, 8)
    try:
        ex.forward(x, x, x, 0.35)
        result = "ok"
    except CommunicationError as exc:
        result = f"CommunicationError: {exc}"
    if rank == skip_rank:
        # Stay alive past the peers' deadline: a skipping rank that returns early tears its sockets
        # down, and the peers would see "connection closed" instead of the timeout under test.
        import time

        time.sleep(2 * timeout_s + 1)
    return result


def case_bad_input(kind: str) -> str:
    """One wrong argument to ``hsap_attn_func`` on every rank of world 4; the error and the number
    of collectives issued before it (must be 0)."""
    import torch.distributed as dist

    from megatron_hsap.errors import HSAPError
    from megatron_hsap.runtime import hsap_attn_func

    intra, inter = (1, 2) if kind == "world_size" else (2, 2)
    spec = dict(cu=[0, 10, 64], intra=intra, inter=inter, heads=8, kv_heads=2, dim=8, dim_v=8, dtype="float32")
    plan = compile_for(spec)
    t = plan.local_tokens
    q, k, v = torch.randn(t, 8, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    intra_g, inter_g = make_groups(2, 2)
    kwargs = {"intra_group": intra_g, "inter_group": inter_g}
    if kind == "t_local":
        q = q[1:]
    elif kind == "heads":
        q = torch.randn(t, 4, 8)
    elif kind == "kv_heads":
        k = v = torch.randn(t, 8, 8)
    elif kind == "head_dim_v":
        v = torch.randn(t, 2, 4)
    elif kind == "dtype":
        q, k, v = (x.bfloat16() for x in (q, k, v))
    elif kind == "mixed_dtype":
        k = k.half()
    elif kind == "device":
        k = k.to("meta")
    elif kind == "world_size":  # a 1×2 plan handed the world (4 ranks) as its inter group
        kwargs = {"inter_group": dist.group.WORLD}
    elif kind == "missing_group":
        kwargs = {"inter_group": inter_g}
    with _CountCollectives() as calls:
        try:
            hsap_attn_func(q, k, v, plan, **kwargs)
            result = "no error"
        except HSAPError as exc:
            result = f"{type(exc).__name__}: {exc}"
    return f"{result} | collectives: {len(calls)}"


def case_p2p_misuse() -> list[str]:
    """Post twice, wait the wrong round, leave a round open: each raises ``RuntimeMismatchError``."""
    import torch.distributed as dist

    from megatron_hsap.errors import RuntimeMismatchError
    from megatron_hsap.runtime.p2p import P2PChannel, Transfer

    rank = dist.get_rank()
    peer = 1 - rank
    chan = P2PChannel(None, timeout_s=30)
    got = torch.zeros(3)
    ops = [Transfer(True, torch.full((3,), float(rank)), peer, "x"), Transfer(False, got, peer, "x")]
    out = []
    chan.post(0, ops)
    for bad in (lambda: chan.post(1, ops), lambda: chan.wait(1), chan.close,
                lambda: P2PChannel(None, timeout_s=30).post(0, [Transfer(True, torch.zeros(4, 2).t(), peer, "y")])):
        try:
            bad()
            out.append("no error")
        except RuntimeMismatchError as exc:
            out.append(str(exc))
    chan.wait(0)
    chan.close()
    out.append(f"received {got.tolist()} bytes {chan.bytes_sent}/{chan.bytes_recv}")
    return out


def case_pool_reuse(specs: list[dict], repeats: int) -> list[tuple[int, int]]:
    """Run each spec ``repeats`` times; after each call, the receive pool's (address, bytes)."""
    from megatron_hsap.runtime.executor import receive_pool

    seen = []
    for spec in specs:
        for _ in range(repeats):
            run_one(spec)
            pool = receive_pool(1, "cpu")
            seen.append((pool.data_ptr(), pool.numel()))
    return seen
