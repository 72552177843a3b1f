"""Attention dropout under SAP/HSAP (docs/design.md §2.2 "Attention dropout").

Dropout zeroes each attention probability ``P[h, i, j]`` with probability ``p`` and scales the
rest by ``1 / (1 − p)``. It commutes with SAP's blockwise evaluation: a kernel call returns its
block's ``dropout(P_b) V_b`` normalised by the block's own (undropped) LSE, and the LSE merge
rescales partials linearly, so the merged output is ``dropout(P) V`` of the whole row; backward
needs ``δ = rowsum(dO ∘ O)`` of that final output, as without dropout. What a distributed run must
get right is that every block's *backward* draws the mask its *forward* drew:

* GPU kernels (flash-attn, PyTorch's vendored FA2, Transformer Engine) draw the mask from the
  CUDA generator per call and return its state (``rng_state``, philox seed/offset); the executor
  keeps one per forward call and hands it to the backward call over the same blocks
  (:class:`CallStates`; a plan's two phases group blocks into the same calls:
  ``plan/calls.py``, checked per call here).
* The ``cpu`` kernel keys the mask on *global* coordinates instead: ``(seed, q head, q token,
  k token)`` hashed (:func:`keep_mask`), one seed per attention call of the layer. Its result is
  then independent of the plan, the CP topology and the kernel grouping — equal to a dense
  attention with the same mask (how the tests check the plumbing) and to the CP=1 run of the same
  seed in Megatron's loop.

Each CP rank draws its masks from its own generator state, as Transformer Engine's ring attention
does: Megatron seeds CP ranks alike (``tensor_parallel.model_parallel_cuda_manual_seed``), and the
caller forks Megatron's model-parallel RNG tracker around the layer so TP ranks differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron_hsap.errors import ConfigError, RuntimeMismatchError

__all__ = ["Dropout", "CallStates", "keep_mask", "check_dropout_p", "draw_seed"]

_M32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Dropout:
    """Dropout of one attention call: probability ``p`` (0 < p < 1), the ``seed`` of the ``cpu``
    kernel's position-keyed masks, and ``head_offset``: the global index of the first q head the
    executor sees (Ulysses slices and head chunks hand it a subset of the layer's heads)."""

    p: float
    seed: int
    head_offset: int = 0

    def at_heads(self, offset: int) -> Dropout:
        """The same dropout for a head slice starting ``offset`` heads further."""
        return Dropout(self.p, self.seed, self.head_offset + offset)


def check_dropout_p(p: Any) -> float:
    """``p`` as a float in ``[0, 1)``, else ``ConfigError`` naming it."""
    try:
        value = float(p)
    except (TypeError, ValueError):
        raise ConfigError(f"dropout_p={p!r}: must be a number in [0, 1)") from None
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"dropout_p={p!r}: must be in [0, 1) (1 would drop every probability)")
    return value


def draw_seed(device: torch.device) -> int:
    """A fresh seed for the ``cpu`` kernel's masks from ``device``'s default generator (one host
    read; the GPU kernels draw their own and never call this)."""
    return int(torch.randint(0, 2**62, (1,), device=device).item())


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash (Murmur3's finaliser) of int64 ``x`` in ``[0, 2^32)``; every product
    stays below 2^63, so no step relies on wrap-around."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def keep_mask(seed: int, p: float, heads: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """``[len(heads), len(rows), len(cols)]`` bool: which probabilities survive dropout ``p``,
    a pure function of ``(seed, head, row token, column token)`` (global indices, int64)."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    h = _mix(heads.to(torch.int64) * 0x9E3779B1 % (1 << 32) ^ lo)[:, None, None]
    r = _mix(rows.to(torch.int64) & _M32 ^ hi)[None, :, None]
    c = _mix(cols.to(torch.int64) & _M32 ^ 0x5BD1E995)[None, None, :]
    x = _mix(((h * 0x27D4EB2F + r) & _M32) ^ c)
    x = _mix(x ^ (c * 0x165667B1 & _M32) ^ lo)
    return x >= int(p * 2**32)


class CallStates:
    """The GPU kernels' ``rng_state`` of one forward run, by call (its ``KernelCall.blocks``), for its backward.
    Built by the executor's forward, read once by the backward; not a value (plain class)."""

    __slots__ = ("dropout", "_states")

    def __init__(self, dropout: Dropout) -> None:
        self.dropout = dropout
        self._states: dict[tuple, Any] = {}

    def put(self, key: tuple, state: Any) -> None:
        self._states[key] = state

    def get(self, key: tuple) -> Any:
        """The forward's state of the call over blocks ``key``; ``RuntimeMismatchError`` when the
        forward ran no such call (its mask could not be redrawn)."""
        try:
            return self._states[key]
        except KeyError:
            raise RuntimeMismatchError(
                f"backward kernel call over blocks {key} has no forward call over the same blocks, so its "
                "dropout mask cannot be redrawn; the plan's phases group blocks differently (a planner bug: "
                "report it, and train with attention dropout 0 meanwhile)"
            ) from None
