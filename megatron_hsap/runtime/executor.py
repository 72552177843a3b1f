"""The executor: runs one inter rank's forward and backward programs of a plan (docs/design.md §2.2).

Per phase the program is a flat list ``Post(r) · Compute(s) · Wait(r) · Merge/Accumulate`` (see
``megatron_hsap.plan.ir``), prepared once per plan into typed instructions (``runtime/prepared.py``:
``PostRound``, ``ComputeCalls``, ``WaitRound``, ``MergePartial``, ``AccumulatePartial``; both phases'
``cu_seqlens`` in one asynchronous upload); this module interprets them in order, by type:

* ``Post`` — one asynchronous ``batch_isend_irecv`` (:class:`~megatron_hsap.runtime.p2p.P2PChannel`):
  sends read rows of the local tensors (global token range → local rows through the layout's
  segments) or a pool slot (results computed here for another rank); receives land in pool slots.
* ``Compute`` — the stage's varlen kernel calls (:mod:`~megatron_hsap.runtime.kernels`), exactly
  those ``plan/calls.py`` decides (consecutive local items on adjacent rows fused into one call;
  same numbers: the calls are per sequence; a *gathered* call concatenates its parts' kv slots
  into one sequence and splits dk/dv back into their result slots), the calls the simulator
  prices too.
* ``Wait`` — the round with a deadline (``HSAP_P2P_TIMEOUT_S``), raising ``CommunicationError``;
  on CUDA waited on the device (stream order), the deadline kept by the watchdog (``runtime/p2p.py``).
* ``Merge`` / ``Accumulate`` — received partials into the fp32 accumulators (overflow-safe LSE merge).

Attention dropout (:meth:`Executor.forward_dropout`, ``runtime/dropout.py``): each forward call's
kernel rng state is kept by the call's blocks and handed to the backward call over the same blocks;
the ``cpu`` kernel gets the calls' global token indices instead (its masks are keyed on them).

Before a plan's first round on its group, :func:`~megatron_hsap.runtime.handshake.agree` checks
that every peer runs the same plan (a fixed-size header per pair; cached by plan hash). The hash
is computed on the host — by the plan prefetcher's thread (``megatron/batch.py plan_for_batch``),
else when the executor is built — so the exchange before the first round only moves headers.

Slots are typed views of ONE byte tensor per device, :func:`receive_pool`, allocated once at the
largest capacity asked for and reused by every layer, step and plan that fits: every slot is dead
when a phase ends (all its rounds were waited), so layers can share it.

Wire formats (docs/design.md §4; ``HeadShape.fp32_wire``): q, kv, o, do in the activation dtype; lse, delta in
fp32; dq, dkv in fp32 unless the plan sends them in the activation dtype (``grad_wire_dtype``). KV
and DKV are two P2P operations, k rows then v rows, packed back to back in one slot.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_hsap.errors import ConfigError, RuntimeMismatchError
from megatron_hsap.plan.calls import LocalRows
from megatron_hsap.plan.chunks import chunk_shape
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.ir import ComputeItem, Phase, Send, Slot, Wire
from megatron_hsap.plan.lru import LRUCache
from megatron_hsap.runtime.dropout import CallStates, Dropout
from megatron_hsap.runtime.env import MAX_TIMEOUT_S, read_env
from megatron_hsap.runtime.handshake import agree
from megatron_hsap.runtime.kernels import attn_backward, attn_forward, attn_forward_dropout, resolve_backend
from megatron_hsap.runtime.max_logits import call_max_logits, check_max_logits, use_fused_max_logits
from megatron_hsap.runtime.merge import merge_into, use_fused_merge
from megatron_hsap.runtime.p2p import P2PChannel, Transfer, warm_up
from megatron_hsap.runtime.prepared import (AccumulatePartial, ComputeCalls, MergePartial, PostRound, Prepared,
                                            PreparedCall, WaitRound, prepare)  # fmt: skip

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = ["Executor", "PhaseStats", "executor_for", "receive_pool", "ACTIVATION_DTYPES"]

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_F32 = torch.float32
_MAX_LOGITS = "max_logits"  # the forward's accumulator key for the qk-clip maxima, beside its wires

# --------------------------------------------------------------------------- the receive pool

_POOLS: dict[str, Tensor] = {}


def receive_pool(capacity: int, device: torch.device | str) -> Tensor:
    """The receive pool of ``device``: one uint8 tensor of at least ``capacity`` bytes.

    Allocated on first use and replaced only when a plan needs more than any before (then at the
    new capacity); never per step. Contents are undefined between phases.
    """
    key = str(torch.device(device))
    pool = _POOLS.get(key)
    if pool is None or pool.numel() < capacity:
        _POOLS.pop(key, None)  # drop the old one before allocating the larger one
        pool = torch.empty(max(int(capacity), 1), dtype=torch.uint8, device=device)
        _POOLS[key] = pool
    return pool


# --------------------------------------------------------------------------- statistics


@dataclass(slots=True)
class PhaseStats:
    """What one phase did on this rank (cumulative over calls until ``reset_stats``).

    ``compute_s``: host seconds in kernels, merges and accumulations; ``comm_s``: host seconds
    posting and blocked waiting for rounds (communication not hidden behind compute); ``wall_s``:
    the whole phase. On a GPU these are host times (kernels launch asynchronously).
    """

    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    rounds: int = 0
    kernel_calls: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__slots__}


# --------------------------------------------------------------------------- the executor


@dataclass
class _Buffers:
    """The tensors one phase reads and writes, by wire (local rows) plus the pool."""

    pool: Tensor
    act: torch.dtype
    shape: HeadShape  # the heads of this call: the plan's, or one head chunk's (plan/chunks.chunk_shape)
    full: HeadShape  # the plan's: slots hold its rows; a chunk uses the first rows × its own row bytes
    local: dict[Wire, tuple[Tensor, ...]] = field(default_factory=dict)


class Executor:
    """Runs inter rank ``group``-rank's programs of ``plan`` on ``device``.

    Build it once per (plan, group, device) — :func:`executor_for` caches them — and call
    :meth:`forward` / :meth:`backward` every step. Reads ``HSAP_P2P_TIMEOUT_S`` and
    ``HSAP_ATTN_BACKEND`` (and ``HSAP_FUSED_MERGE``) here, at construction, never on the hot path.

    ``skip_rounds`` is a test-only fault injection: this rank neither posts nor waits those
    global round indices (its peers then time out).
    """

    def __init__(self, plan: "Plan", group: dist.ProcessGroup | None, device: torch.device | str, *,
                 backend: str | None = None, timeout_s: float | None = None,
                 skip_rounds: frozenset[int] = frozenset()) -> None:  # fmt: skip
        self.plan = plan
        self.group = group
        self.device = torch.device(device)
        size = plan.inter_size
        if size > 1:
            if not dist.is_available() or not dist.is_initialized():
                raise ConfigError(f"the plan spans {size} inter ranks but torch.distributed is not initialised")
            got = dist.get_world_size(group)
            if got != size:
                raise ConfigError(
                    f"the inter group has {got} ranks but the plan was compiled for inter_size={size}; "
                    f"compile the plan with inter_size={got} or pass the matching inter group"
                )
            self.rank = dist.get_rank(group)
        else:
            self.rank = 0
        env = read_env()
        self.timeout_s = env.p2p_timeout_s if timeout_s is None else float(timeout_s)
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # inf would overflow after a round is posted
            raise ConfigError(f"timeout_s={timeout_s!r} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}]")
        self.backend = resolve_backend(backend, self.device)
        self.fused_merge = use_fused_merge(self.device, env)  # one Triton launch per merge on CUDA
        self.fused_max = use_fused_max_logits(self.device, env)  # and per call's qk-clip maxima
        self.skip_rounds = frozenset(skip_rounds)
        _ = plan.hash  # host work for the handshake, here rather than before the first round
        rows = LocalRows(plan.layout.segments[self.rank])
        self._rows = rows
        base = plan.round_base
        self._fwd, self._bwd = prepare((plan.program(self.rank, Phase.FWD), plan.program(self.rank, Phase.BWD)),
                                       rows, self.device, (base[Phase.FWD], base[Phase.BWD]))  # fmt: skip
        self.stats = {Phase.FWD: PhaseStats(), Phase.BWD: PhaseStats()}
        self._positions: dict[tuple, tuple[Tensor, Tensor]] = {}  # call blocks -> global tokens (cpu dropout)

    # ------------------------------------------------------------------ public
    def expected_bytes(self, phase: Phase | str) -> tuple[int, int]:
        """(bytes sent, bytes received) the plan predicts for one call of ``phase`` on this rank."""
        prep = self._fwd if Phase(phase) is Phase.FWD else self._bwd
        return prep.expected_sent, prep.expected_recv

    def reset_stats(self) -> None:
        self.stats = {Phase.FWD: PhaseStats(), Phase.BWD: PhaseStats()}

    def forward(self, q: Tensor, k: Tensor, v: Tensor, softmax_scale: float,
                max_logits: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``q [t, h, d]``, ``k [t, hkv, d]``, ``v [t, hkv, dv]`` (this inter rank's chunk, layout
        order) -> ``out [t, h, dv]`` float32 and ``lse [t, h]`` float32 of the whole packed batch.
        ``max_logits [h]`` float32, if given, is raised in place to the largest scaled logit per
        head of the pairs this rank computes (``runtime/max_logits.py``)."""
        out, lse, _ = self._forward(q, k, v, softmax_scale, None, max_logits)
        return out, lse

    def forward_dropout(self, q: Tensor, k: Tensor, v: Tensor, softmax_scale: float,
                        dropout: Dropout, max_logits: Tensor | None = None) -> tuple[Tensor, Tensor, CallStates]:  # fmt: skip
        """:meth:`forward` with attention dropout: also the calls' kernel rng states, for
        :meth:`backward` (``lse`` is the undropped one, as the merge needs)."""
        return self._forward(q, k, v, softmax_scale, CallStates(dropout), max_logits)

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, states: CallStates | None,
                 max_logits: Tensor | None = None) -> tuple[Tensor, Tensor, CallStates | None]:  # fmt: skip
        shape = self._check(q, k, v)
        check_max_logits(max_logits, q)  # (hsap_attn_func's rule, for direct callers too)
        t, h, dv = q.shape[0], q.shape[1], v.shape[2]
        out = torch.zeros((t, h, dv), dtype=_F32, device=q.device)
        lse = torch.full((t, h), float("-inf"), dtype=_F32, device=q.device)
        buf = _Buffers(self._pool(q.device), q.dtype, shape, self.plan.shape)
        buf.local = {Wire.Q: (q.contiguous(),), Wire.KV: (k.contiguous(), v.contiguous())}
        acc = {Wire.O: out, Wire.LSE: lse}
        if max_logits is not None:
            acc[_MAX_LOGITS] = max_logits
        self._run(Phase.FWD, self._fwd, buf, acc, softmax_scale, states)
        return out, lse, states

    def backward(self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 softmax_scale: float, states: CallStates | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Gradients of the forward: ``do``/``out [t, h, dv]`` (activation dtype; ``out`` the final
        output), ``lse [t, h]`` float32 final -> float32 ``dq [t, h, d]``, ``dk``, ``dv``.
        ``states``: what :meth:`forward_dropout` returned, when the forward ran with dropout."""
        shape = self._check(q, k, v)
        if do.shape != out.shape or lse.shape != q.shape[:2]:
            raise RuntimeMismatchError(f"backward got {do.shape=} {out.shape=} {lse.shape=} for {q.shape=}")
        do, out = do.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        lse = lse.to(_F32).contiguous()
        delta = (do.float() * out.float()).sum(dim=-1)  # [t, h]: rowsum(dO ∘ O), by the owner
        dq = torch.zeros(q.shape, dtype=_F32, device=q.device)
        dk = torch.zeros(k.shape, dtype=_F32, device=q.device)
        dv = torch.zeros(v.shape, dtype=_F32, device=q.device)
        buf = _Buffers(self._pool(q.device), q.dtype, shape, self.plan.shape)
        buf.local = {
            Wire.Q: (q.contiguous(),), Wire.KV: (k.contiguous(), v.contiguous()), Wire.DO: (do,),
            Wire.LSE: (lse,), Wire.DELTA: (delta,), Wire.O: (out,),
        }  # fmt: skip
        acc = {Wire.DQ: dq, Wire.DKV: (dk, dv)}
        self._run(Phase.BWD, self._bwd, buf, acc, softmax_scale, states)
        return dq, dk, dv

    def _pool(self, device: torch.device) -> Tensor:
        """The shared receive pool; a one-rank plan has no slots and allocates none."""
        if self.plan.inter_size == 1:
            return torch.empty(0, dtype=torch.uint8, device=device)
        return receive_pool(self.plan.pool_capacity, device)

    # ------------------------------------------------------------------ checks
    def _check(self, q: Tensor, k: Tensor, v: Tensor) -> HeadShape:
        """The call's head shape: all of the plan's heads, or one of its ``plan.head_chunks`` head
        chunks (the same programs on ``h/C`` q and ``hkv/Ckv`` kv heads, docs/design.md §2.2)."""
        s, t, c = self.plan.shape, self.plan.chunk_tokens, self.plan.head_chunks
        if c > 1 and q.dim() == 3 and q.shape[1] * c == s.num_heads:
            s = chunk_shape(s, c)
        want = ((t, s.num_heads, s.head_dim), (t, s.num_kv_heads, s.head_dim), (t, s.num_kv_heads, s.head_dim_v))
        got = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
        if got != want:
            raise RuntimeMismatchError(f"executor inputs q, k, v have shapes {got}, the plan expects {want}")
        if q.dtype not in ACTIVATION_DTYPES or q.element_size() != s.dtype_bytes:
            raise RuntimeMismatchError(
                f"activations are {q.dtype} ({q.element_size()} bytes) but the plan was compiled for "
                f"dtype_bytes={s.dtype_bytes}; supported: fp32, bf16, fp16"
            )
        return s

    # ------------------------------------------------------------------ interpreter
    def _run(self, phase: Phase, prep: Prepared, buf: _Buffers, acc: dict, scale: float,
             states: CallStates | None = None) -> None:  # fmt: skip
        t_start = time.perf_counter()
        if self.plan.inter_size > 1:  # plans agree before any payload (cached per plan), then NCCL's warm-up
            agree(self.plan, self.group, "inter", phase, timeout_s=self.timeout_s, device=buf.pool.device)
            warm_up(self.group, buf.pool.device, self.timeout_s)
        chan = P2PChannel(self.group, timeout_s=self.timeout_s, phase=phase.value)
        compute_s = 0.0
        kernel_calls = rounds = 0
        fwd = phase is Phase.FWD
        for step in prep.steps:
            match step:
                case PostRound(round=rnd, stage=stage):
                    if rnd.index in self.skip_rounds:
                        continue
                    chan.post(rnd.index, self._transfers(rnd.ops, buf), stage=f"stage {stage}")
                    rounds += 1
                case WaitRound(index=index):
                    if index not in self.skip_rounds:
                        chan.wait(index)
                case ComputeCalls(calls=calls):
                    t0 = time.perf_counter()
                    for call in calls:
                        if fwd:
                            self._fwd_call(call, buf, acc, scale, states)
                        else:
                            self._bwd_call(call, buf, acc, scale, states)
                    kernel_calls += len(calls)
                    compute_s += time.perf_counter() - t0
                case MergePartial(rows=rows, tokens=n, o=o_slot, lse=lse_slot):
                    t0 = time.perf_counter()
                    o, = self._view(buf, o_slot, Wire.O, n)
                    lse, = self._view(buf, lse_slot, Wire.LSE, n)
                    merge_into(acc[Wire.O][rows], acc[Wire.LSE][rows], o, lse, fused=self.fused_merge)
                    compute_s += time.perf_counter() - t0
                case AccumulatePartial(wire=wire, rows=rows, tokens=n, src=src):
                    t0 = time.perf_counter()
                    targets = (acc[Wire.DQ],) if wire is Wire.DQ else acc[Wire.DKV]
                    for dst, part in zip(targets, self._view(buf, src, wire, n)):
                        dst[rows] += part
                    compute_s += time.perf_counter() - t0
                case _:  # pragma: no cover - prepare() makes no other step
                    raise RuntimeMismatchError(f"unknown prepared step {step!r}")
        chan.close()
        st = self.stats[phase]
        st.calls += 1
        st.bytes_sent += chan.bytes_sent
        st.bytes_recv += chan.bytes_recv
        st.rounds += rounds
        st.kernel_calls += kernel_calls
        st.compute_s += compute_s
        st.comm_s += chan.comm_s
        st.wall_s += time.perf_counter() - t_start

    def _view(self, buf: _Buffers, slot: Slot, wire: Wire, n: int) -> tuple[Tensor, ...]:
        """Typed views of ``slot`` holding ``n`` rows of ``wire`` (two for KV / DKV)."""
        s = buf.shape  # the wire's row shapes and element size: plan/costs.py (one home)
        dtype = _F32 if s.fp32_wire(wire) else buf.act
        out, off = [], slot.offset
        for row in s.row_shapes(wire):
            shape = (n, *row)
            nbytes = n * math.prod(row) * s.element_bytes(wire)
            out.append(buf.pool[off : off + nbytes].view(dtype).view(shape))
            off += nbytes
        # the slot holds n rows at the plan's shape; a head chunk uses its first n rows × its row bytes
        if n * buf.full.token_bytes(wire) != slot.nbytes or off - slot.offset > slot.nbytes or slot.end > buf.pool.numel():
            raise RuntimeMismatchError(
                f"slot {slot} for {n} rows of {wire.value} holds {slot.nbytes} bytes but the tensors "
                f"need {off - slot.offset} (pool {buf.pool.numel()} bytes): the plan was compiled for other "
                "head counts, head sizes or dtype_bytes"
            )
        return tuple(out)

    def _operand(self, buf: _Buffers, item: ComputeItem, wire: Wire, rows: slice | None) -> tuple[Tensor, ...]:
        slot = item.src(wire)
        if slot is None:
            return tuple(x[rows] for x in buf.local[wire])
        return self._view(buf, slot, wire, len(item.kv if wire is Wire.KV else item.q))

    def _kv(self, buf: _Buffers, call: PreparedCall) -> tuple[Tensor, Tensor]:
        """The call's ``k [Σnk, hkv, d]`` and ``v [Σnk, hkv, dv]``: local rows, one slot's views, or
        a gathered call's slots concatenated in item order (one copy of its kv rows)."""
        if not call.gathered:
            k, v = self._operand(buf, call.items[0], Wire.KV, call.kv_rows)
            return k, v
        parts = [self._view(buf, it.src(Wire.KV), Wire.KV, len(it.kv)) for it in call.items]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def _transfers(self, ops, buf: _Buffers) -> list[Transfer]:
        out = []
        for op in ops:
            send = isinstance(op, Send)
            slot = op.src if send else op.dst
            if slot is None:
                tensors = tuple(x[self._rows(op.tokens)] for x in buf.local[op.wire])
            else:
                tensors = self._view(buf, slot, op.wire, len(op.tokens))
            for part, x in zip(("k rows", "v rows") if len(tensors) == 2 else ("",), tensors):
                what = f"{op.wire.value}{op.tokens}" + (f" {part}" if part else "")
                out.append(Transfer(send, x, op.peer, what))
        return out

    def _positions_of(self, call: PreparedCall, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """The global token of each q row and kv row of ``call`` (the ``cpu`` kernel keys its dropout
        masks on them; the GPU kernels draw theirs per call: None)."""
        if self.backend != "cpu":
            return None, None
        key = (call.gathered, call.blocks)
        hit = self._positions.get(key)
        if hit is None or hit[0].device != device:
            qs = [call.items[0].q] if call.gathered else [it.q for it in call.items]
            ranges = lambda rs: torch.cat([torch.arange(r.start, r.stop, device=device) for r in rs])  # noqa: E731
            hit = self._positions[key] = (ranges(qs), ranges([it.kv for it in call.items]))
        return hit

    def _fwd_call(self, call: PreparedCall, buf: _Buffers, acc: dict, scale: float, states: CallStates | None) -> None:
        item = call.items[0]
        q, = self._operand(buf, item, Wire.Q, call.q_rows)
        k, v = self._kv(buf, call)
        args = dict(cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k, max_seqlen_q=call.max_q, max_seqlen_k=call.max_k,
                    causal=call.causal, softmax_scale=scale, backend=self.backend, window=call.window)
        if states is None:
            o, lse = attn_forward(q, k, v, **args)
        else:
            q_pos, k_pos = self._positions_of(call, q.device)
            o, lse, rng = attn_forward_dropout(q, k, v, **args, dropout=states.dropout, q_pos=q_pos, k_pos=k_pos)
            states.put(call.blocks, rng)
        ml = acc.get(_MAX_LOGITS)
        if ml is not None:  # qk-clip: the call's scores once more, their max per head (runtime/max_logits.py)
            torch.maximum(ml, call_max_logits(q, k, call, scale, self.fused_max), out=ml)
        o_dst, lse_dst = item.dst(Wire.O), item.dst(Wire.LSE)
        if o_dst is None:
            if call.q_rows is None:
                raise RuntimeMismatchError(f"item {item} merges locally but its q rows are not local")
            merge_into(acc[Wire.O][call.q_rows], acc[Wire.LSE][call.q_rows], o, lse, fused=self.fused_merge)
        else:
            self._view(buf, o_dst, Wire.O, len(item.q))[0].copy_(o)
            self._view(buf, lse_dst, Wire.LSE, len(item.q))[0].copy_(lse)

    def _bwd_call(self, call: PreparedCall, buf: _Buffers, acc: dict, scale: float, states: CallStates | None) -> None:
        item = call.items[0]
        q, = self._operand(buf, item, Wire.Q, call.q_rows)
        do, = self._operand(buf, item, Wire.DO, call.q_rows)
        lse, = self._operand(buf, item, Wire.LSE, call.q_rows)
        delta, = self._operand(buf, item, Wire.DELTA, call.q_rows)
        k, v = self._kv(buf, call)
        if call.q_rows is not None:
            out = buf.local[Wire.O][0][call.q_rows]
        else:
            out = _out_for_delta(do, delta, self.backend)
        drop = {}
        if states is not None:  # the mask its forward call drew (runtime/dropout.py)
            q_pos, k_pos = self._positions_of(call, q.device)
            drop = dict(dropout=states.dropout, rng_state=states.get(call.blocks), q_pos=q_pos, k_pos=k_pos)
        dq, dk, dv = attn_backward(do, q, k, v, out, lse, cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k,
                                   max_seqlen_q=call.max_q, max_seqlen_k=call.max_k, causal=call.causal,
                                   softmax_scale=scale, delta=delta, backend=self.backend,
                                   window=call.window, **drop)  # fmt: skip
        dq_dst, dkv_dst = item.dst(Wire.DQ), item.dst(Wire.DKV)
        if dq_dst is None:
            acc[Wire.DQ][call.q_rows] += dq
        else:
            self._view(buf, dq_dst, Wire.DQ, len(item.q))[0].copy_(dq)
        if dkv_dst is None:
            acc[Wire.DKV][0][call.kv_rows] += dk
            acc[Wire.DKV][1][call.kv_rows] += dv
            return
        parts = call.call.kv_parts
        for it, dk_part, dv_part in zip(call.items, dk.split(parts), dv.split(parts)):  # each part's rows to its slot
            dk_slot, dv_slot = self._view(buf, it.dst(Wire.DKV), Wire.DKV, len(it.kv))
            dk_slot.copy_(dk_part)
            dv_slot.copy_(dv_part)


def _out_for_delta(do: Tensor, delta: Tensor, backend: str) -> Tensor:
    """An ``out`` for rows whose real output stayed with their owner (only do/lse/delta travel).

    The CPU kernel takes ``delta`` as given and ignores ``out``. The GPU kernels recompute
    ``delta = rowsum(do ∘ out)`` themselves, so hand them ``out = do · delta / |do|²`` per row and
    head, whose rowsum with ``do`` is ``delta`` (rounded to the activation dtype; rows with
    ``do = 0`` have ``delta = 0`` and get ``out = 0``).
    """
    if backend == "cpu":
        return do
    d32 = do.float()
    norm = (d32 * d32).sum(dim=-1, keepdim=True)
    scale = torch.where(norm > 0, delta.unsqueeze(-1) / norm.clamp_min(torch.finfo(_F32).tiny), torch.zeros_like(norm))
    return (d32 * scale).to(do.dtype)


# --------------------------------------------------------------------------- cache

_EXECUTORS: "LRUCache[tuple, Executor]" = LRUCache(64)


def executor_for(plan: "Plan", group: dist.ProcessGroup | None, device: torch.device | str, *,
                 backend: str | None = None) -> Executor:  # fmt: skip
    """The cached :class:`Executor` of (plan, group, device, backend): programs are prepared once.

    Plans are compared by identity (``compile_plan`` caches them by their inputs)."""
    key = (plan, group, str(torch.device(device)), backend)
    ex = _EXECUTORS.get(key)
    if ex is None:
        ex = Executor(plan, group, device, backend=backend)
        _EXECUTORS.put(key, ex)
    return ex

