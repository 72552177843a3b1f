"""``hsap_attn_func``: Ulysses inside the intra group, SAP across the inter group (paper §3.3, docs/design.md §1).

Rank ``(i, j)`` (CP rank ``i·P_intra + j``) holds ``[t_local, H, d]`` rows of inter chunk ``i``.

1. sequence → heads all-to-all over the intra group (kv heads replicated first when
   ``P_intra > Hkv``): every rank of node ``i`` now holds the whole chunk ``i`` for ``H/P_intra``
   heads, exactly the rows the plan's layout gives inter rank ``i``;
2. the SAP plan runs over the inter group (ranks ``{i·P_intra + j}`` for fixed ``j``) on that head
   slice — the ``P_intra`` inter groups run the same plan side by side;
3. heads → sequence all-to-all back. Backward mirrors it: dO to heads, SAP backward, dq/dk/dv
   back (in the activation dtype, as Ulysses sends them; replicated kv gradients summed in fp32).

The three steps are pipelined over ``plan.head_chunks`` head chunks (docs/design.md §2.2 "Head
chunks", :func:`_pipeline`): while SAP runs chunk ``k``, chunk ``k+1``'s all-to-all and chunk
``k−1``'s return are in flight; one chunk is the sequence above. Chunks finer than the kv heads
share a kv chunk (``plan/chunks.py``): k, v go to heads once, with its first q chunk; dk, dv are
summed over its q chunks in fp32 and return once, after its last.

``P_intra = 1`` is pure SAP (:class:`~megatron_hsap.runtime.sap.SAPAttention`, no all-to-all);
``P_inter = 1`` is pure Ulysses with local attention (the plan has no P2P).

Attention sinks (``sinks [H]``, GPT-OSS / megatron-core ``softmax_offset``) enter each row's softmax
once, after its last LSE merge (:func:`~megatron_hsap.runtime.merge.merge_sinks`). Under Ulysses a
rank holds heads ``[j·H/P, (j+1)·H/P)`` of the whole inter chunk and merges those heads' sinks; its
sink gradient is non-zero on those heads only and covers only the rows it computed, so the
contributions of all CP ranks sum to the full gradient (Megatron's DP×CP gradient all-reduce does
that sum; HSAP reduces nothing).

Every check runs before the first collective and raises on every rank alike (same inputs, same
plan), so a misconfiguration never leaves some ranks waiting in an all-to-all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_hsap.errors import BatchError, ConfigError, RuntimeMismatchError
from megatron_hsap.plan.flatten import flattened_what
from megatron_hsap.plan.ir import Phase
from megatron_hsap.plan.lru import LRUCache
from megatron_hsap.plan.options import kv_head_chunks
from megatron_hsap.runtime.consistency import fingerprint_mismatch
from megatron_hsap.runtime.capture import refuse_graph_capture
from megatron_hsap.runtime.dropout import CallStates, Dropout, check_dropout_p, draw_seed
from megatron_hsap.runtime.env import read_env
from megatron_hsap.runtime.executor import ACTIVATION_DTYPES, Executor, executor_for
from megatron_hsap.runtime.groups import registered_groups
from megatron_hsap.runtime.handshake import agree
from megatron_hsap.runtime.max_logits import Maxima, check_max_logits
from megatron_hsap.runtime.merge import check_sinks, sink_grad
from megatron_hsap.runtime.sap import SAPAttention, sap_forward
from megatron_hsap.runtime.ulysses import (Exchange, chunked_send, expand_kv_for_intra, issue_exchange, sum_kv_grad_for_intra,
                                           unchunk_returned)  # fmt: skip

if TYPE_CHECKING:
    from megatron_hsap.plan.plan import Plan

__all__ = ["hsap_attn_func", "HSAPAttention", "HSAPRunner", "runner_for"]

@dataclass(eq=False)
class HSAPRunner:
    """Everything one rank needs to run a plan: its executor (inter group), the intra group, and
    counters of the intra all-to-all: bytes this rank sent (``a2a_bytes_sent[phase]``, equal to
    ``plan/chunks.a2a_bytes_sent(plan)`` per call whatever the chunk count) and host seconds spent
    issuing and waiting it (``a2a_s[phase]``: the part not hidden behind SAP)."""

    plan: "Plan"
    executor: Executor
    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None
    debug: bool
    a2a_bytes_sent: dict[Phase, int] = field(default_factory=lambda: {Phase.FWD: 0, Phase.BWD: 0})
    a2a_s: dict[Phase, float] = field(default_factory=lambda: {Phase.FWD: 0.0, Phase.BWD: 0.0})

    @property
    def intra_size(self) -> int:
        return self.plan.intra_size

    def head_slice(self, num_heads: int) -> slice:
        """The q heads this rank holds between the all-to-alls (``seq_to_heads``' slice)."""
        if self.intra_size == 1:
            return slice(0, num_heads)
        per = num_heads // self.intra_size
        j = dist.get_rank(self.intra)
        return slice(j * per, (j + 1) * per)

    def reset_stats(self) -> None:
        self.executor.reset_stats()
        self.a2a_bytes_sent = {Phase.FWD: 0, Phase.BWD: 0}
        self.a2a_s = {Phase.FWD: 0.0, Phase.BWD: 0.0}

    def exchange(self, recv: Tensor, send: Tensor, phase: Phase, stage: str) -> Exchange:
        """Issue one intra all-to-all of ``send`` into ``recv`` (asynchronous), counting the bytes
        this rank sends: all but its own ``1/P`` block."""
        t0 = time.perf_counter()
        self.a2a_bytes_sent[phase] += send.numel() * send.element_size() * (self.intra_size - 1) // self.intra_size
        x = issue_exchange(recv, send, self.intra, timeout_s=self.timeout_s, stage=stage)
        self.a2a_s[phase] += time.perf_counter() - t0
        return x

    def wait(self, x: Exchange, phase: Phase) -> Tensor:
        """Wait one exchange under the deadline (``Exchange.wait``); host seconds into ``a2a_s``."""
        t0 = time.perf_counter()
        out = x.wait()
        self.a2a_s[phase] += time.perf_counter() - t0
        return out

    @property
    def timeout_s(self) -> float:
        """Deadline of every collective this runner issues (``HSAP_P2P_TIMEOUT_S``, read once)."""
        return self.executor.timeout_s

    def agree_intra(self, device: torch.device) -> None:
        """The intra group's plan handshake before the first all-to-all (cached per plan)."""
        if self.intra_size > 1:
            agree(self.plan, self.intra, "intra", Phase.FWD, timeout_s=self.timeout_s, device=device)

    def check_batch(self) -> None:
        """Debug mode: fingerprint the plan's cu_seqlens over the whole CP group (nested over the
        intra then the inter group, so that every rank sees every fingerprint) and raise if any differ."""
        report = fingerprint_mismatch(self.plan.batch.cu_seqlens, (self.intra, self.inter), timeout_s=self.timeout_s)
        if report is not None:
            raise BatchError(f"HSAP_DEBUG: the ranks run plans of different batches: {report}")


_RUNNERS: "LRUCache[tuple, HSAPRunner]" = LRUCache(64)


def _runner(plan: "Plan", intra: dist.ProcessGroup | None, inter: dist.ProcessGroup | None,
            device: torch.device | str) -> HSAPRunner:  # fmt: skip
    key = (plan, intra, inter, str(torch.device(device)))
    runner = _RUNNERS.get(key)
    if runner is None:  # reads HSAP_DEBUG (and the executor its variables) once, here
        runner = HSAPRunner(plan, executor_for(plan, inter, device), intra, inter, read_env().debug)
        _RUNNERS.put(key, runner)
    return runner


def runner_for(plan: "Plan", *, intra_group: dist.ProcessGroup | None = None,
               inter_group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
               cp_group: dist.ProcessGroup | None = None) -> HSAPRunner:  # fmt: skip
    """The cached :class:`HSAPRunner` :func:`hsap_attn_func` uses for these arguments (same group
    defaults): its ``executor.stats`` and ``a2a_bytes_sent`` say what the calls moved."""
    intra, inter = _resolve_groups(plan, intra_group, inter_group, cp_group)
    return _runner(plan, intra, inter, device)


@dataclass(frozen=True, eq=False)
class Stream:
    """One tensor's all-to-alls over the head chunks (``_pipeline``): ``recv [n, P, t, hc, d]``,
    ``n = C/per`` slices, slice ``i`` serving q chunks ``[i·per, (i+1)·per)`` (``per`` = 1: q, o,
    dO, dq; ``C/Ckv``: k, v, dk, dv when q chunks share a kv chunk); ``send`` alike for an
    exchange to heads, None for a return (its sends are ``compute``'s results)."""

    send: Tensor | None
    recv: Tensor
    per: int = 1
    name: str = ""


def _pipeline(runner: HSAPRunner, phase: Phase, ins: Sequence[Stream], backs: Sequence[Stream],
              compute: Callable[[int], Sequence[Tensor | None]]) -> None:  # fmt: skip
    """Run ``compute(c)`` for every head chunk ``c < C = plan.head_chunks`` with the intra
    all-to-alls pipelined around it (docs/design.md §2.2).

    ``ins``: slice ``i`` of each stream is exchanged (``send[i]`` -> ``recv[i]``) before its first
    q chunk ``i·per`` computes — a kv slice once, with the first q chunk that uses it.
    ``compute(c)`` returns one result ``[P·t, hc, d]`` per stream of ``backs``, or None where a
    stream's slice is not complete after chunk ``c`` (dk, dv summed over a kv slice's q chunks);
    a result is returned into ``backs[i].recv[c // per]`` after its slice's last q chunk. While
    chunk ``c`` computes, chunk ``c+1``'s all-to-all (issued first) and chunk ``c−1``'s return are
    in flight on the intra group; chunk ``c`` starts once its own all-to-alls are waited. Every
    exchange issued is waited: in issue order at the end on success; on an error, each still
    pending one within one shared deadline (``timeout_s``), its own failure suppressed, then the
    error propagates — no exchange is left in flight.
    """
    chunks = runner.plan.head_chunks
    issued: list[Exchange] = []

    def issue(c: int, pairs: Sequence[tuple[Tensor, Tensor, str]], side: str) -> list[Exchange]:
        xs = [runner.exchange(recv, send, phase, f"{phase} {side}, tensor {i + 1}/{len(pairs)} of head chunk "
                              f"{c + 1}/{chunks} ({name}), [P, t, heads, d] = {list(send.shape)} per rank")
              for i, (send, recv, name) in enumerate(pairs)]  # fmt: skip
        issued.extend(xs)
        return xs

    def take(c: int) -> list[Exchange]:  # the slices whose first q chunk is c
        return issue(c, [(x.send[c // x.per], x.recv[c // x.per], x.name) for x in ins if c % x.per == 0], "to heads")

    def give_back(c: int, results: Sequence[Tensor | None]) -> None:
        issue(c, [(r.view(b.recv.shape[1:]), b.recv[c // b.per], b.name) for r, b in zip(results, backs) if r is not None],
              "return")  # fmt: skip

    try:
        arriving = take(0)
        results: Sequence[Tensor | None] = ()
        for c in range(chunks):
            for x in arriving:
                runner.wait(x, phase)
            if c + 1 < chunks:
                arriving = take(c + 1)
            if c:
                give_back(c - 1, results)
            results = compute(c)
        give_back(chunks - 1, results)
        for x in issued:
            if not x.done:
                runner.wait(x, phase)
    except BaseException:
        deadline = time.perf_counter() + runner.timeout_s
        for x in issued:
            if not x.done:
                x.timeout_s = max(deadline - time.perf_counter(), 1e-3)
                try:
                    x.wait()
                except Exception:  # noqa: BLE001 - the error that matters is the one propagating
                    pass
        raise


class HSAPAttention(torch.autograd.Function):
    """``HSAPAttention.apply(q, k, v, runner, softmax_scale, sinks) -> out`` (a2a, SAP, a2a back,
    pipelined over ``plan.head_chunks`` head chunks, kv over ``Ckv`` kv chunks); ``sinks`` ``[H]``
    or None (this rank merges and differentiates its head slice only)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, runner: HSAPRunner, scale: float, sinks: Tensor | None = None,
                dropout: Dropout | None = None, maxima: Maxima | None = None) -> Tensor:  # fmt: skip
        p, chunks, t = runner.intra_size, runner.plan.head_chunks, q.shape[0]
        kv_chunks = kv_head_chunks(chunks, runner.plan.shape.num_kv_heads)
        per = chunks // kv_chunks  # q chunks per kv chunk
        # [C, P, t, hc, d] (k, v: [Ckv, ...]): one copy each; slice c receives the whole inter chunk for its heads
        sends = [chunked_send(q, p, chunks)] + [chunked_send(expand_kv_for_intra(x, p), p, kv_chunks) for x in (k, v)]
        recvs = [torch.empty_like(x) for x in sends]
        heads = runner.head_slice(q.shape[1])
        hc, dv = sends[0].shape[3], v.shape[2]
        back = q.new_empty((chunks, p, t, hc, dv))  # [c, s] = my rows of head chunk c of slice s
        outs: list[Tensor] = []
        lses: list[Tensor] = []
        states: list[CallStates | None] = []

        def compute(c: int) -> list[Tensor]:
            qc = recvs[0][c].view(p * t, *recvs[0].shape[3:])  # [t·P, hc, d]
            kc, vc = (r[c // per].view(p * t, *r.shape[3:]) for r in recvs[1:])  # [t·P, hkv/Ckv, d]
            sinks_c = None if sinks is None else sinks[heads][c * hc : (c + 1) * hc]
            drop_c = None if dropout is None else dropout.at_heads(heads.start + c * hc)  # global q heads
            ml_c = None if maxima is None else maxima.out[heads][c * hc : (c + 1) * hc]  # (a view: raised in place)
            oc, lse, st = sap_forward(runner.executor, qc, kc, vc, scale, sinks_c, drop_c, ml_c)
            outs.append(oc)
            lses.append(lse)
            states.append(st)
            return [oc]

        ins = [Stream(sends[0], recvs[0], 1, "q"), Stream(sends[1], recvs[1], per, "k"), Stream(sends[2], recvs[2], per, "v")]
        _pipeline(runner, Phase.FWD, ins, [Stream(None, back, 1, "o")], compute)
        ctx.save_for_backward(*recvs, sinks, *outs, *lses)
        ctx.runner, ctx.scale, ctx.num_kv_heads, ctx.heads, ctx.chunks = runner, scale, k.shape[1], heads, chunks
        ctx.per, ctx.states = per, states
        return unchunk_returned(back)  # [t, H, dv]

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors
        chunks, per = ctx.chunks, ctx.per
        (qh, kh, vh, sinks), outs, lses = saved[:4], saved[4 : 4 + chunks], saved[4 + chunks :]
        runner: HSAPRunner = ctx.runner
        p, t = runner.intra_size, dout.shape[0]
        send = chunked_send(dout.to(qh.dtype), p, chunks)  # [C, P, t, hc, dv]
        recv = torch.empty_like(send)
        backs = [torch.empty_like(x) for x in (qh, kh, vh)]  # dq, dk, dv: the shapes of q, k, v
        hc = qh.shape[3]
        want_dsinks = sinks is not None and ctx.needs_input_grad[5]
        dsinks_h = torch.zeros(chunks * hc, dtype=sinks.dtype, device=sinks.device) if want_dsinks else None
        dkv: list[Tensor] = []  # fp32 dk, dv of the current kv chunk, summed over its q chunks

        def compute(c: int) -> list[Tensor | None]:
            doc = recv[c].view(p * t, *recv.shape[3:])
            qc = qh[c].view(p * t, *qh.shape[3:])
            kc, vc = (x[c // per].view(p * t, *x.shape[3:]) for x in (kh, vh))
            if dsinks_h is not None:
                dsinks_h[c * hc : (c + 1) * hc] = sink_grad(doc, outs[c], lses[c], sinks[ctx.heads][c * hc : (c + 1) * hc])
            dq, dk, dv = runner.executor.backward(doc, qc, kc, vc, outs[c], lses[c], ctx.scale, ctx.states[c])  # float32
            if c % per == 0:
                dkv[:] = [dk, dv]
            else:
                dkv[0].add_(dk)
                dkv[1].add_(dv)
            last = (c + 1) % per == 0  # dk, dv of a kv chunk return once, after its last q chunk
            return [dq.to(qh.dtype), *((dkv[0].to(kh.dtype), dkv[1].to(vh.dtype)) if last else (None, None))]

        _pipeline(runner, Phase.BWD, [Stream(send, recv, 1, "do")],
                  [Stream(None, backs[0], 1, "dq"), Stream(None, backs[1], per, "dk"), Stream(None, backs[2], per, "dv")], compute)
        dq = unchunk_returned(backs[0])
        # Replicated kv heads: their gradients come back in the activation dtype, summed in fp32.
        dk = sum_kv_grad_for_intra(unchunk_returned(backs[1]).float(), ctx.num_kv_heads).to(kh.dtype)
        dv = sum_kv_grad_for_intra(unchunk_returned(backs[2]).float(), ctx.num_kv_heads).to(vh.dtype)
        dsinks = None
        if dsinks_h is not None:
            dsinks = torch.zeros_like(sinks)  # [H]: my heads' rows only; other heads are other ranks'
            dsinks[ctx.heads] = dsinks_h
        return dq, dk, dv, None, None, dsinks, None, None


# --------------------------------------------------------------------------- validation


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _resolve_groups(plan: "Plan", intra: dist.ProcessGroup | None, inter: dist.ProcessGroup | None,
                    cp: dist.ProcessGroup | None = None) -> tuple[Any, Any]:  # fmt: skip
    """Explicit groups, else HSAP's initialised groups (``HSAPGroups.levels_for``), else the world
    for a 1×P or P×1 plan. A flattened plan (``plan/flatten.py``) runs on its CP group:
    ``(None, CP group)`` as ``1 × P``, ``(CP group, None)`` as ``P × 1`` (``_flat_levels``)."""
    if plan.options.flattened_from is not None:
        return _flat_levels(plan, intra, inter, cp)
    p_intra, p_inter = plan.intra_size, plan.inter_size
    if intra is None and inter is None:
        if p_intra * p_inter == 1:
            return None, None
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                f"the plan spans {plan.cp_size} CP ranks ({p_intra}x{p_inter}, intra×inter) but "
                "torch.distributed is not initialised"
            )
        groups = registered_groups()  # what initialize_hsap registered (runtime/groups.py)
        if groups is not None:
            return groups.levels_for(plan)
        if p_intra == 1:
            return None, dist.group.WORLD
        if p_inter == 1:
            return dist.group.WORLD, None
        raise ConfigError(
            f"a {p_intra}x{p_inter} (intra×inter) plan needs intra_group= and inter_group=, or "
            "megatron_hsap.megatron.initialize_hsap(intra_size, inter_size) beforehand"
        )
    for name, group, size in (("intra_group", intra, p_intra), ("inter_group", inter, p_inter)):
        if group is None and size > 1:
            raise ConfigError(f"{name} is None but the plan has {name[:5]}_size={size}; pass both groups")
    return intra, inter


def _flat_levels(plan: "Plan", intra: Any, inter: Any, cp: Any) -> tuple[Any, Any]:
    """``(intra, inter)`` of a flattened plan (``_resolve_groups``): its one level is the CP group,
    ``(None, CP)`` at ``1 × P``, ``(CP, None)`` at ``P × 1``. The CP group: ``cp``; else the one group given
    that spans all P CP ranks (the levels ``HSAPGroups.levels_for`` gives, or a one-level configured
    topology's group; group rank = CP rank), size-1 groups aside; else the registered groups'
    levels, or the world when it is the CP group. No collective."""
    a, b = plan.options.flattened_from  # type: ignore[misc]
    what = flattened_what(plan)

    def one_level(group: Any) -> tuple[Any, Any]:
        return (None, group) if plan.intra_size == 1 else (group, None)

    if cp is not None:
        return one_level(cp)
    if intra is not None or inter is not None:
        given = [g for g in (intra, inter) if g is not None and _size(g) > 1]
        if len(given) == 1 and _size(given[0]) == plan.cp_size:
            return one_level(given[0])
        raise ConfigError(f"{what}; pass cp_group= (the CP group, group rank = CP rank) with the HSAP groups, "
                          "or compile with flatten='never'")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(f"{what} but torch.distributed is not initialised")
    groups = registered_groups()
    if groups is not None:
        return groups.levels_for(plan)  # checked: the groups it was flattened from, with their CP group
    if dist.get_world_size() == plan.cp_size:
        return one_level(dist.group.WORLD)
    raise ConfigError(f"{what}; call initialize_hsap({a}, {b}) beforehand or pass cp_group=")


def _validate(q: Tensor, k: Tensor, v: Tensor, plan: "Plan", intra: Any, inter: Any,
              softmax_scale: float | None) -> float:  # fmt: skip
    """Check tensors and groups against the plan (no collective); return the softmax scale."""
    o = plan.options
    h, hkv = o.num_heads, o.num_kv_heads or o.num_heads
    d, dv = o.head_dim, o.head_dim_v or o.head_dim
    t = plan.local_tokens
    for name, x, want in (("q", q, (t, h, d)), ("k", k, (t, hkv, d)), ("v", v, (t, hkv, dv))):
        if not isinstance(x, Tensor):
            raise RuntimeMismatchError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != want:
            raise RuntimeMismatchError(
                f"{name} has shape {tuple(x.shape)} but the plan expects {list(want)} = [t_local, heads, "
                f"head_dim] (t_local={t} tokens of this CP rank, num_heads={h}, num_kv_heads={hkv}, "
                f"head_dim={d}, head_dim_v={dv}); shard the batch with this plan's local_token_indices "
                "or compile the plan with the model's head counts and sizes"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeMismatchError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if q.dtype not in ACTIVATION_DTYPES:
        raise RuntimeMismatchError(f"activations are {q.dtype}; HSAP supports {[str(x) for x in ACTIVATION_DTYPES]}")
    if q.element_size() != o.dtype_bytes:
        raise RuntimeMismatchError(
            f"activations are {q.dtype} ({q.element_size()} bytes) but the plan was compiled with "
            f"dtype_bytes={o.dtype_bytes}; compile it with dtype_bytes={q.element_size()}"
        )
    if not (q.device == k.device == v.device):
        raise RuntimeMismatchError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device})")
    if q.device.type == "meta":
        raise RuntimeMismatchError(
            "q, k, v are on the meta device (shapes without data); HSAP attention needs real tensors "
            "(build the model on cpu/cuda, or skip attention during meta-device initialisation)"
        )
    for name, group, size in (("intra", intra, plan.intra_size), ("inter", inter, plan.inter_size)):
        got = 1 if group is None else _size(group)
        if got != size:
            raise ConfigError(
                f"the {name} group has {got} ranks but the plan was compiled for {name}_size={size} "
                f"({plan.intra_size}x{plan.inter_size}, intra×inter); compile the plan for the groups' "
                f"sizes or pass the matching {name}_group"
            )
    if softmax_scale is None:
        return d**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not 0 < softmax_scale < math.inf:
        raise ConfigError(f"softmax_scale must be a finite number > 0 (default head_dim ** -0.5), got {softmax_scale!r}")
    return float(softmax_scale)


def hsap_attn_func(q: Tensor, k: Tensor, v: Tensor, plan: "Plan", *, intra_group: dist.ProcessGroup | None = None,
                   inter_group: dist.ProcessGroup | None = None, softmax_scale: float | None = None,
                   sinks: Tensor | None = None, cp_group: dist.ProcessGroup | None = None, dropout_p: float = 0.0,
                   dropout_seed: int | None = None, dropout_head_offset: int = 0,
                   max_logits: Tensor | None = None) -> Tensor:  # fmt: skip
    """Document-causal attention of a packed batch over the ``P_intra × P_inter`` CP group.

    Args:
        q: ``[t_local, H, d]``; k: ``[t_local, Hkv, d]``; v: ``[t_local, Hkv, d_v]`` — this CP
            rank's tokens in the plan's layout order (``plan.local_token_indices(cp_rank)``).
        plan: ``compile_plan(cu_seqlens, inter_size, intra_size, num_heads=H, num_kv_heads=Hkv,
            head_dim=d, head_dim_v=d_v, dtype_bytes=q.element_size())``, the same on every rank.
        intra_group / inter_group: default to ``initialize_hsap``'s groups when initialised,
            else the world for a ``1×P`` (pure SAP) or ``P×1`` (pure Ulysses) plan, else none for
            a ``1×1`` plan (no torch.distributed needed).
        softmax_scale: default ``d ** -0.5``.
        sinks: optional ``[H]`` per-query-head sink logits (GPT-OSS convention: softmax over
            ``[scores, sink]``, the sink column contributing no value; megatron-core's
            ``softmax_offset``). Merged once per row after all partials; its gradient (through
            autograd) holds only this CP rank's rows' contribution — sum it over the CP group
            (Megatron's DP×CP gradient all-reduce does).
        cp_group: the whole CP group (group rank = CP rank), for a plan ``compile_plan`` flattened
            to ``1 × P`` or ``P × 1`` (``flatten="auto"``/``"always"``/``"all-to-all"``,
            ``plan/flatten.py``); defaults to the one group of a one-level configured topology
            (``1 × P``: ``inter_group``, ``P × 1``: ``intra_group``), else ``initialize_hsap``'s,
            else the world when it is the CP group.
        dropout_p: attention dropout probability in ``[0, 1)`` (pass 0 outside training). The GPU
            kernels draw each call's mask from the CUDA generator (fork Megatron's RNG tracker
            around the call, as its attention does) and backward redraws it from the call's state.
        dropout_seed: the ``cpu`` kernel's mask seed (its masks are keyed on global head and token
            indices, so equal seeds give equal masks on any plan and topology); default: drawn from
            the default generator of q's device. Ignored by the GPU kernels.
        dropout_head_offset: the global index of q's first head for those masks (e.g. the tensor-
            parallel rank × heads per rank, so that TP ranks draw other masks and a TP run draws
            the TP=1 run's). Ignored by the GPU kernels.
        max_logits: optional float32 ``[H]`` accumulator for qk-clip (``runtime/max_logits.py``),
            raised in place to the largest ``softmax_scale · q·k`` per head over the pairs this CP
            rank computes (masked pairs and sinks excluded); a MAX all-reduce over the CP group
            gives every head's value for the whole batch (megatron-core's ``clip_qk`` does one).
    Returns:
        ``out [t_local, H, d_v]`` in ``q.dtype``; differentiable w.r.t. q, k, v and sinks.

    Raises ``RuntimeMismatchError`` / ``ConfigError`` before any collective when tensors, groups
    or the plan do not match, or when a CUDA graph is capturing (``runtime/capture.py``).
    """
    refuse_graph_capture(q.device, "hsap_attn_func")  # (a graph would replay this batch's plan: runtime/capture.py)
    intra, inter = _resolve_groups(plan, intra_group, inter_group, cp_group)
    scale = _validate(q, k, v, plan, intra, inter, softmax_scale)
    check_sinks(sinks, q)
    check_max_logits(max_logits, q)
    maxima = None if max_logits is None else Maxima(max_logits)
    p = check_dropout_p(dropout_p)
    runner = _runner(plan, intra, inter, q.device)
    dropout = None
    if p > 0:
        seed = dropout_seed
        if seed is None and runner.executor.backend == "cpu":  # (the GPU kernels draw their own)
            seed = draw_seed(q.device)
        dropout = Dropout(p, int(seed or 0), int(dropout_head_offset))
    if runner.debug:
        runner.check_batch()
    runner.agree_intra(q.device)  # the inter group's handshake runs in the executor, before its first round
    if plan.intra_size == 1:
        return SAPAttention.apply(q, k, v, runner.executor, scale, sinks, dropout, maxima)
    return HSAPAttention.apply(q, k, v, runner, scale, sinks, dropout, maxima)
