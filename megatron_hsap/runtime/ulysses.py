"""Ulysses all-to-all inside the intra group: sequence-sharded ↔ head-sharded (paper §3.3).

Before attention, rank ``(i, j)`` holds ``[t_local, H, d]`` for its ``j``-th slice of inter chunk
``i``; :func:`seq_to_heads` turns that into ``[t_local·P_intra, H/P_intra, d]``: the whole inter
chunk ``i`` (rows of intra ranks ``0..P_intra-1`` concatenated in intra-rank order) for head slice
``j``. :func:`heads_to_seq` is its inverse. Both are autograd functions whose backward is the other
direction, so q, k, v and the output can go through them inside a model.

GQA: ``H`` must be divisible by ``P_intra``; kv heads either split too (``Hkv % P_intra == 0``) or,
when ``P_intra > Hkv``, are replicated to ``P_intra`` heads first (:func:`expand_kv_for_intra`:
each kv head repeated ``P_intra/Hkv`` times, contiguously) so head slice ``j`` gets exactly the kv
head its q heads use; the replication's backward sums the copies' gradients.

Every exchange is one ``all_to_all_single`` on one contiguous buffer (one copy to build it on the
sequence side, one copy out of it on the way back); no other copies.

Head chunks (``plan.head_chunks``, ``runtime/hsap.py``): :func:`chunked_send` lays a sequence-side
tensor out as ``[C, P, t, h/(P·C), d]`` in the same one copy, so chunk ``c``'s all-to-all sends
the contiguous ``[c]`` (head chunk ``c`` of every destination's slice; k and v in ``Ckv`` kv
chunks when q chunks share a kv head); :func:`issue_exchange`
issues it asynchronously and :meth:`Exchange.wait` waits it under the deadline;
:func:`unchunk_returned` is the one copy back to ``[t, h, d]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_hsap.errors import CommunicationError, ConfigError, RuntimeMismatchError
from megatron_hsap.plan.checks import divisors, positive_int
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.options import kv_heads_per_rank, valid_intra_sizes
from megatron_hsap.runtime.p2p import group_ranks, wait_collective
from megatron_hsap.runtime.watchdog import WATCHDOG

__all__ = [
    "seq_to_heads",
    "heads_to_seq",
    "valid_intra_sizes",
    "check_heads_for_intra",
    "kv_heads_for_intra",
    "expand_kv_for_intra",
    "sum_kv_grad_for_intra",
    "a2a_bytes",
    "ulysses_bytes",
    "Exchange",
    "issue_exchange",
    "chunked_send",
    "unchunk_returned",
]


# --------------------------------------------------------------------------- head arithmetic


def check_heads_for_intra(num_heads: int, num_kv_heads: int, intra_size: int) -> None:
    """Raise :class:`ConfigError` (listing the valid sizes) unless the heads split over ``intra_size``.

    Valid: ``H % P == 0`` and either ``Hkv % P == 0`` (kv heads split) or ``P % Hkv == 0`` (kv heads
    replicated ``P/Hkv`` times). Anything else would hand some rank q heads of two kv groups.
    """
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("intra_size", intra_size)):
        positive_int(name, value)
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
            "GQA needs every kv head shared by the same number of q heads"
        )
    valid = valid_intra_sizes(num_heads, num_kv_heads)
    if intra_size not in valid:
        raise ConfigError(
            f"intra_size (P_intra) = {intra_size} cannot split num_heads={num_heads}, "
            f"num_kv_heads={num_kv_heads} (per tensor-parallel rank) across the intra group; "
            f"valid intra sizes: {valid}"
        )


def kv_heads_for_intra(num_kv_heads: int, intra_size: int) -> int:
    """kv heads exchanged by the all-to-all: ``P`` × the kv heads per intra rank
    (``plan/options.kv_heads_per_rank``), i.e. ``Hkv`` when ``P | Hkv``, ``P`` when ``Hkv | P``."""
    positive_int("num_kv_heads", num_kv_heads)
    positive_int("intra_size", intra_size)
    try:  # the rule's home; any multiple of both stands for num_heads (its split is check_heads_for_intra's)
        per_rank = kv_heads_per_rank(num_kv_heads * intra_size, num_kv_heads, intra_size)
    except ConfigError:
        raise ConfigError(
            f"intra_size (P_intra) = {intra_size} neither divides nor is a multiple of "
            f"num_kv_heads={num_kv_heads}; valid intra sizes: the divisors {divisors(num_kv_heads)} "
            f"or multiples of {num_kv_heads} (that also divide num_heads)"
        ) from None
    return per_rank * intra_size


def expand_kv_for_intra(kv: torch.Tensor, intra_size: int) -> torch.Tensor:
    """Replicate kv heads for the all-to-all when ``P_intra > Hkv``; identity otherwise.

    ``kv [t, Hkv, d] -> [t, Hkv_x, d]`` with ``Hkv_x = kv_heads_for_intra(Hkv, P_intra)``; head
    ``g`` becomes heads ``g·r .. g·r + r - 1`` (``r = Hkv_x / Hkv``), so after the split head slice
    ``j`` holds kv head ``j // r``, the one q heads ``[j·H/P, (j+1)·H/P)`` use. Autograd sums the
    ``r`` copies' gradients back (the backward of ``expand``).
    """
    t, hkv, d = kv.shape
    hx = kv_heads_for_intra(hkv, intra_size)
    if hx == hkv:
        return kv
    r = hx // hkv
    return kv.unsqueeze(2).expand(t, hkv, r, d).reshape(t, hx, d)


def sum_kv_grad_for_intra(dkv: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Backward of :func:`expand_kv_for_intra` without autograd: ``[t, Hkv_x, d] -> [t, Hkv, d]``."""
    t, hx, d = dkv.shape
    if hx == num_kv_heads:
        return dkv
    if hx % num_kv_heads:
        raise RuntimeMismatchError(f"{hx=} replicated kv heads is not a multiple of {num_kv_heads=}")
    return dkv.reshape(t, num_kv_heads, hx // num_kv_heads, d).sum(dim=2)


# --------------------------------------------------------------------------- byte counts


def a2a_bytes(tokens: int, heads: int, head_dim: int, intra_size: int, dtype_bytes: int = 2) -> int:
    """Bytes one rank sends (= receives) in one :func:`seq_to_heads` / :func:`heads_to_seq` call.

    ``tokens, heads`` describe the sequence side ``[t_local, h, d]``; the rank keeps ``1/P`` of
    its tensor and sends the other ``(P-1)/P``.
    """
    if heads % intra_size:
        raise ConfigError(f"{heads=} not divisible by intra_size={intra_size}; valid: {divisors(heads)}")
    return tokens * (heads // intra_size) * (intra_size - 1) * head_dim * dtype_bytes


def ulysses_bytes(
    tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intra_size: int,
    *,
    head_dim_v: int | None = None,
    dtype_bytes: int = 2,
) -> dict[str, int]:
    """Intra-group bytes one rank sends for one attention layer (kv replication counted).

    Forward: q, k, v to heads, o back. Backward: dO to heads; dq, dk, dv back (the exchanged q, k,
    v, o are kept for backward, so nothing is re-sent). Returns ``{"fwd", "bwd", "total"}``.
    """
    dv = head_dim if head_dim_v is None else head_dim_v
    check_heads_for_intra(num_heads, num_kv_heads, intra_size)
    hx = kv_heads_for_intra(num_kv_heads, intra_size)
    p, b = intra_size, dtype_bytes
    q = a2a_bytes(tokens, num_heads, head_dim, p, b)
    k = a2a_bytes(tokens, hx, head_dim, p, b)
    v = a2a_bytes(tokens, hx, dv, p, b)
    o = a2a_bytes(tokens, num_heads, dv, p, b)
    fwd, bwd = q + k + v + o, o + q + k + v  # bwd: dO, then dq, dk, dv (same shapes)
    return {Phase.FWD: fwd, Phase.BWD: bwd, "total": fwd + bwd}


# --------------------------------------------------------------------------- all-to-all


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _all_to_all(recv: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float | None,
                stage: str) -> None:  # fmt: skip
    """One ``all_to_all_single``; with ``timeout_s`` and CPU tensors (gloo) it has that deadline
    (``CommunicationError``). On CUDA (NCCL) it stays stream-ordered: a host-side deadline would
    block the host until the exchange finished (no launch-ahead); NCCL's watchdog enforces the
    group's timeout instead, which HSAP's groups take from the job (``groups.job_timeout``)."""
    if timeout_s is None or send.device.type != "cpu":
        dist.all_to_all_single(recv, send, group=group)
        return
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    wait_collective(work, timeout_s=timeout_s, collective="Ulysses all_to_all_single", stage=stage, group=group,
                    cpu=send.device.type == "cpu")


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float | None = None) -> torch.Tensor:
    """``[t, h, d] -> [t·P, h/P, d]`` (no autograd)."""
    p = _group_size(group)
    if x.dim() != 3:
        raise RuntimeMismatchError(f"seq_to_heads expects [t_local, heads, head_dim], got shape {tuple(x.shape)}")
    if p == 1:
        return x
    t, h, d = x.shape
    if h % p:
        raise ConfigError(
            f"{h} heads cannot be split over an intra group of {p} ranks; "
            f"valid intra sizes (P_intra): {divisors(h)}"
        )
    # Chunk for destination j = head slice j of all my rows: [P, t, h/P, d], one copy.
    send = x.reshape(t, p, h // p, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    _all_to_all(recv, send, group, timeout_s, f"sequence to heads, [{t}, {h}, {d}] per rank")
    # recv[s] = source rank s's rows for my head slice: concatenating in rank order is a view.
    return recv.view(p * t, h // p, d)


def _heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float | None = None) -> torch.Tensor:
    """``[t·P, h/P, d] -> [t, h, d]`` (no autograd)."""
    p = _group_size(group)
    if y.dim() != 3:
        raise RuntimeMismatchError(f"heads_to_seq expects [t_local·P, heads/P, head_dim], got shape {tuple(y.shape)}")
    if p == 1:
        return y
    n, hp, d = y.shape
    if n % p:
        raise RuntimeMismatchError(f"heads_to_seq got {n} rows, not a multiple of the intra size {p}")
    t = n // p
    # Row block s goes back to rank s; the buffer is y itself when y is contiguous.
    send = y.reshape(p, t, hp, d).contiguous()
    recv = torch.empty_like(send)
    _all_to_all(recv, send, group, timeout_s, f"heads to sequence, [{n}, {hp}, {d}] per rank")
    # recv[s] = my rows for head slice s -> [t, P, h/P, d], one copy.
    return recv.transpose(0, 1).reshape(t, p * hp, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float | None) -> torch.Tensor:
        ctx.group, ctx.timeout_s = group, timeout_s
        return _seq_to_heads(x, group, timeout_s)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _heads_to_seq(grad, ctx.group, ctx.timeout_s), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float | None) -> torch.Tensor:
        ctx.group, ctx.timeout_s = group, timeout_s
        return _heads_to_seq(y, group, timeout_s)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _seq_to_heads(grad, ctx.group, ctx.timeout_s), None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None = None, *, timeout_s: float | None = None) -> torch.Tensor:
    """Sequence-sharded to head-sharded over ``group`` (the intra group; ``None`` = world).

    ``x [t_local, h, d] -> [t_local·P, h/P, d]``: rows are the group ranks' rows concatenated in
    group-rank order, heads are slice ``[rank·h/P, (rank+1)·h/P)``. Every rank must pass the same
    ``t_local, h, d`` (a mismatch is not detectable without another collective). Differentiable;
    backward is :func:`heads_to_seq`. Raises :class:`ConfigError` listing the valid intra sizes when
    ``P`` does not divide ``h`` (for kv heads call :func:`expand_kv_for_intra` first).
    ``timeout_s``: deadline of each all-to-all (forward and backward), ``CommunicationError`` naming
    it and its stage on expiry; None blocks under the group's own timeout.
    """
    if _group_size(group) == 1:
        return x
    return _SeqToHeads.apply(x, group, timeout_s)


def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None = None, *, timeout_s: float | None = None) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: ``y [t_local·P, h/P, d] -> [t_local, h, d]``. Differentiable."""
    if _group_size(group) == 1:
        return y
    return _HeadsToSeq.apply(y, group, timeout_s)


# --------------------------------------------------------------------------- head chunks, asynchronous


def chunked_send(x: torch.Tensor, p: int, chunks: int) -> torch.Tensor:
    """``x [t, h, d] -> [C, P, t, h/(P·C), d]`` (one copy): ``[c, s]`` holds head chunk ``c`` of
    destination ``s``'s head slice ``[s·h/P, (s+1)·h/P)``, so ``[c]`` is chunk ``c``'s send buffer
    (``C = 1``: :func:`seq_to_heads`' buffer). The receive side of chunk ``c`` is
    ``[P, t, h/(P·C), d]`` = ``[t·P, h/(P·C), d]`` rows in source-rank order, as :func:`seq_to_heads`."""
    t, h, d = x.shape
    if h % (p * chunks):
        raise ConfigError(f"{h} heads cannot be split over an intra group of {p} ranks in {chunks} head chunks")
    return x.reshape(t, p, chunks, h // (p * chunks), d).permute(2, 1, 0, 3, 4).contiguous()


def unchunk_returned(y: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`chunked_send` on the returned rows: ``[C, P, t, hc, d] -> [t, P·C·hc, d]``
    (``[c, s]`` = my rows of head chunk ``c`` of slice ``s``; one copy, as :func:`heads_to_seq`)."""
    c, p, t, hc, d = y.shape
    return y.permute(2, 1, 0, 3, 4).reshape(t, p * c * hc, d)


@dataclass(eq=False)
class Exchange:
    """One issued ``all_to_all_single`` (:func:`issue_exchange`): ``recv`` is valid after :meth:`wait`.

    Holds both buffers until waited. :meth:`wait` has the deadline ``timeout_s`` (counted from the
    wait): gloo (CPU) waits on the host and raises :class:`CommunicationError` naming ``stage``; on
    CUDA the stream waits (the host runs ahead) and the process watchdog (``runtime/watchdog.py``)
    keeps the deadline, as for P2P rounds. Waiting twice is a no-op."""

    work: Any
    recv: torch.Tensor
    send: torch.Tensor
    group: dist.ProcessGroup | None
    timeout_s: float | None
    stage: str
    done: bool = False

    def wait(self) -> torch.Tensor:
        if self.done:
            return self.recv
        self.done = True
        cpu = self.send.device.type == "cpu"
        if self.timeout_s is None:
            self.work.wait()
        elif cpu:
            wait_collective(self.work, timeout_s=self.timeout_s, collective="Ulysses all_to_all_single",
                            stage=self.stage, group=self.group, cpu=True)  # fmt: skip
        else:
            WATCHDOG.check()
            self.work.wait()  # the current stream waits for the exchange; returns at once
            WATCHDOG.watch((self.work,), time.perf_counter() + self.timeout_s, self._late, self.group)
        return self.recv

    def _late(self) -> CommunicationError:  # on the watchdog thread, at the deadline
        return CommunicationError(
            f"Ulysses all_to_all_single ({self.stage}) on group of global ranks {group_ranks(self.group)} did not "
            f"complete within {self.timeout_s:g} s (device-waited; watchdog). Likely cause: a peer never issued "
            "it (it raised before this point, or is dead). This process group cannot be reused after this error."
        )


def issue_exchange(recv: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None, *,
                   timeout_s: float | None, stage: str) -> Exchange:  # fmt: skip
    """Issue ``all_to_all_single(recv, send)`` on ``group`` asynchronously (equal splits: block
    ``s`` of ``send`` goes to group rank ``s``, block ``s`` of ``recv`` comes from it)."""
    if not (send.is_contiguous() and recv.is_contiguous()) or send.shape != recv.shape:
        raise RuntimeMismatchError(f"exchange buffers must be contiguous and alike: {tuple(send.shape)} -> {tuple(recv.shape)}")
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return Exchange(work, recv, send, group, timeout_s, stage)
