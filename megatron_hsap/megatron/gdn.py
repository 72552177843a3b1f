"""Gated delta net layers (``G`` in ``--hybrid-layer-pattern``: Qwen3-Next's linear attention)
under HSAP (docs/enable.md, "Mamba and gated delta net layers").

megatron-core's ``GatedDeltaNet`` (``ssm/gated_delta_net``) parallelises over CP as Mamba does: an
all-to-all from sequence-split to head-split over the CP group, then, for packed sequences, one
gather putting the rows in stream order (``_build_thd_cp_a2a_perm``, which inverts Transformer
Engine's zigzag split of every document) and its inverse before the all-to-all back; the kernels
take the stream's ``cu_seqlens``. It also asks every document's length to be a multiple of the CP
size (``_resolve_cu_seqlens``: zigzag halves), with a host sync.

:class:`HSAPGatedDeltaNet` keeps all of it but the two layout rules: the permutation is the plan's
(:class:`~megatron_hsap.megatron.mamba.StreamOrder`: the CP ranks' local token lists and their
inverse) and the documents are the padded stream's (any lengths; no sync). The batch's
``cu_seqlens`` tensor carries its stream order to megatron-core's permutation call
(``_hsap_stream_order``, set per micro-batch); :func:`install` points that call at HSAP's for such
tensors and at Megatron's for every other.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from megatron.core.ssm.gated_delta_net import common as megatron_common
from megatron.core.ssm.gated_delta_net import gdn as megatron_gdn
from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
from torch import Tensor

from megatron_hsap.errors import BatchError, ConfigError
from megatron_hsap.megatron.mamba import checked_stream_order

__all__ = ["HSAPGatedDeltaNet", "install"]
_PERM_PARAMETERS = ("cu_seqlens", "cp_size", "t_global")  # megatron-core's (0.19.2, main), which HSAP's replaces


def _perm(original: Any, cu_seqlens: Tensor, cp_size: int, t_global: int) -> tuple[Tensor, Tensor]:
    """``(index, inverse)``: the stream position → gathered row map and its inverse, HSAP's for a
    batch HSAP sharded (its ``cu_seqlens`` carries the order), else Megatron's."""
    order = getattr(cu_seqlens, "_hsap_stream_order", None)
    if order is None:
        return original(cu_seqlens, cp_size, t_global)
    if order.order is None or order.order.numel() != t_global:
        raise BatchError(f"a gated delta net layer gathered {t_global} tokens over CP {cp_size}, but the HSAP "
                         f"plan's padded stream has {order.seq_idx.shape[1]}")
    return order.order, order.gathered_ids


def _perm_homes() -> list[Any]:
    """The megatron-core modules whose namespace the packed-sequence permutation call of
    ``GatedDeltaNet.forward`` resolves ``_build_thd_cp_a2a_perm`` in: ``gdn`` itself, where
    megatron-core 0.19.2's forward calls it, or ``common``, where Megatron-LM's main branch (0.20
    pre-release, 2026-08) moved the call, into ``a2a_cp_to_hp``, which forward calls. Empty when
    neither is so (another layout HSAP does not know)."""
    forward = getattr(GatedDeltaNet.forward, "__code__", None)
    names = forward.co_names if forward is not None else ()
    homes = []
    if "_build_thd_cp_a2a_perm" in names:
        homes.append(megatron_gdn)
    to_hp = getattr(megatron_common, "a2a_cp_to_hp", None)
    if "a2a_cp_to_hp" in names and "_build_thd_cp_a2a_perm" in getattr(getattr(to_hp, "__code__", None), "co_names", ()):
        homes.append(megatron_common)
    return homes


def install() -> None:
    """Point megatron-core's packed-sequence CP permutation of the gated delta net at HSAP's for HSAP
    batches (idempotent). Raises ``ConfigError`` when megatron-core's is not the one HSAP follows."""
    homes = _perm_homes()
    current = [getattr(m, "_build_thd_cp_a2a_perm", None) for m in homes]
    originals = [getattr(f, "__hsap_original__", f) for f in current]  # (wrapped before: its original)
    if not homes or any(f is None or tuple(inspect.signature(f).parameters) != _PERM_PARAMETERS for f in originals):
        raise ConfigError("megatron-core's GatedDeltaNet.forward does not permute packed sequences through "
                          f"_build_thd_cp_a2a_perm{_PERM_PARAMETERS} (directly, as megatron-core 0.19.2 does, or in "
                          "a2a_cp_to_hp, as Megatron-LM's main branch does), which HSAP's gated delta net follows: "
                          "install megatron-core 0.19.2 or drop the 'G' layers")
    for module, f, original in zip(homes, current, originals):
        if f is original:
            module._build_thd_cp_a2a_perm = _wrapped(original)


def _wrapped(original: Any) -> Any:
    """``original`` taking HSAP's permutation for HSAP batches (``_perm``)."""
    @functools.wraps(original)
    def wrapped(cu_seqlens: Tensor, cp_size: int, t_global: int) -> tuple[Tensor, Tensor]:
        return _perm(original, cu_seqlens, cp_size, t_global)

    wrapped.__hsap_original__ = original  # type: ignore[attr-defined]
    return wrapped


class HSAPGatedDeltaNet(GatedDeltaNet):
    """Megatron's ``GatedDeltaNet`` on HSAP-sharded batches (module docstring): the same parameters,
    projections, kernels and all-to-alls; the tokens reordered by the plan. Refuses batches HSAP
    did not shard and inference."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        install()
        super().__init__(config, *args, **kwargs)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, inference_context: Any = None,
                packed_seq_params: Any = None, sequence_len_offset: Any = None, *, inference_params: Any = None,
                **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """``hidden_states`` ``[t_local / TP, 1, h]`` (sequence parallel) or ``[t_local, 1, h]``;
        returns Megatron's ``(out, out_bias)``."""
        order = checked_stream_order("gated delta net", packed_seq_params, self.pg_collection.cp, hidden_states.device,
                                     inference=inference_context is not None or inference_params is not None)
        for cu in (packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv):
            cu._hsap_stream_order = order  # (read by megatron-core's permutation call: install())
        return super().forward(hidden_states, attention_mask, packed_seq_params=packed_seq_params,
                               sequence_len_offset=sequence_len_offset, **kwargs)

    def _resolve_cu_seqlens(self, cu_seqlens_padded: Tensor | None, cu_seqlens_actual: Tensor | None,
                            total_seq_len: int, name: str, cp_size: int = 1) -> Tensor:
        """The padded stream's ``cu_seqlens`` as they are (HSAP's documents need no length rule, and
        the plan knows the total: no host sync); Megatron's rule for other batches."""
        cu = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens_actual
        order = getattr(cu, "_hsap_stream_order", None)
        if order is None:
            return super()._resolve_cu_seqlens(cu_seqlens_padded, cu_seqlens_actual, total_seq_len, name, cp_size)
        if order.seq_idx.shape[1] != total_seq_len:
            raise BatchError(f"gated delta net: {name} covers {order.seq_idx.shape[1]} tokens, the layer "
                             f"{total_seq_len}")
        return cu
