"""Byte and FLOP prices of the plan IR (docs/design.md §4 wire formats and FLOP counts)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.checks import positive_int
from megatron_hsap.plan.ir import Wire

__all__ = ["HeadShape", "FP32_BYTES", "FP32_WIRES", "GRAD_WIRES", "GRAD_WIRE_DTYPES", "DEFAULT_GRAD_WIRE_DTYPE",
           "BWD_FLOP_FACTOR"]

FP32_BYTES = 4
FP32_WIRES = frozenset({Wire.LSE, Wire.DELTA, Wire.DQ, Wire.DKV})  # the wires sent in fp32 (docs/design.md §4)
# the partial gradients: HSAP plans send them in the activation dtype by default
# (``PlanOptions.grad_wire_dtype="activation"``, ``HeadShape.fp32_grads`` False), or in fp32. The
# GPU kernels return them in the activation dtype (``runtime/kernels.py``: flash-attn, aten and TE
# allocate dq, dk, dv like q), so an fp32 wire would carry those very values at twice the bytes;
# TE's P2P ring sends its dkv in kv.dtype too. Accumulation stays fp32 either way. A bare
# ``HeadShape`` keeps fp32 partials: the baselines that send them so (MagiAttention) price with it.
GRAD_WIRES = frozenset({Wire.DQ, Wire.DKV})
GRAD_WIRE_DTYPES = ("fp32", "activation")
DEFAULT_GRAD_WIRE_DTYPE = "activation"
BWD_FLOP_FACTOR = 2.5  # backward FLOPs = 2.5 × forward (docs/design.md §4)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadShape:
    """Heads one inter group works on: ``num_heads`` q heads and ``num_kv_heads`` kv heads *per
    rank after the intra all-to-all* (H / P_intra; kv heads replicated when P_intra > Hkv)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype_bytes: int = 2
    fp32_grads: bool = True  # dq / dkv partials sent in fp32 (else in the activation dtype; ``GRAD_WIRES``)

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "head_dim_v", "dtype_bytes"):
            positive_int(name, getattr(self, name))
        if not isinstance(self.fp32_grads, bool):
            raise ConfigError(f"fp32_grads={self.fp32_grads!r} must be True or False")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "GQA needs every kv head shared by the same number of q heads"
            )

    def row_shapes(self, wire: Wire) -> tuple[tuple[int, ...], ...]:
        """The tensor shape of one token row of ``wire``: one, or k then v for KV / DKV (packed
        back to back in one message and slot)."""
        h, hkv, d, dv = self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim_v
        if wire is Wire.KV or wire is Wire.DKV:
            return ((hkv, d), (hkv, dv))
        if wire is Wire.Q or wire is Wire.DQ:
            return ((h, d),)
        if wire is Wire.O or wire is Wire.DO:
            return ((h, dv),)
        if wire is Wire.LSE or wire is Wire.DELTA:
            return ((h,),)
        raise ConfigError(f"unknown wire {wire!r}; use a plan.ir.Wire member")

    def fp32_wire(self, wire: Wire) -> bool:
        """Whether ``wire`` travels (and sits in the pool) in fp32: lse and delta always, the
        partial gradients unless ``fp32_grads`` is off; the rest in the activation dtype."""
        return wire in FP32_WIRES and (self.fp32_grads or wire not in GRAD_WIRES)

    def element_bytes(self, wire: Wire) -> int:
        """Bytes of one element of ``wire`` (``fp32_wire``: fp32, else the activations')."""
        return FP32_BYTES if self.fp32_wire(wire) else self.dtype_bytes

    def token_elements(self, wire: Wire) -> int:
        """Elements one token row of ``wire`` holds (k and v together for KV / DKV)."""
        return sum(math.prod(s) for s in self.row_shapes(wire))

    def token_bytes(self, wire: Wire) -> int:
        """Bytes one token row of ``wire`` occupies on the wire and in the pool."""
        return self.token_elements(wire) * self.element_bytes(wire)

    def nbytes(self, wire: Wire, tokens: int) -> int:
        return self.token_bytes(wire) * tokens

    @property
    def fwd_flops_per_pair(self) -> float:
        """2·H·(d_qk + d_v) FLOPs per unmasked (q, k) pair in forward."""
        return 2.0 * self.num_heads * (self.head_dim + self.head_dim_v)

    @property
    def bwd_flops_per_pair(self) -> float:
        return BWD_FLOP_FACTOR * self.fwd_flops_per_pair

    @property
    def chunk_token_bytes(self) -> int:
        """Per-token bytes of the default pool unit: local heads × (d_qk + d_v) × activation bytes."""
        return self.num_heads * (self.head_dim + self.head_dim_v) * self.dtype_bytes
