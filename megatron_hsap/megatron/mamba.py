"""Mamba layers (``M`` in ``--hybrid-layer-pattern``: Nemotron-H and other hybrid models) under HSAP
(docs/enable.md, "Mamba and gated delta net layers").

Megatron's Mamba context parallelism (``ssm/mamba_context_parallel.py``) turns each Mamba layer's
activations from sequence-split to head-split with an all-to-all over the CP group, so every rank
scans all tokens for its share of the heads, and back after the scan. Between the two it reorders
the gathered rows from Transformer Engine's zigzag layout to the packed stream's order
(``_undo_attention_load_balancing``; for THD through TE's ``thd_get_partitioned_indices``) and back
(``_redo_attention_load_balancing``), and the scan restarts at each document by
``packed_seq_params.seq_idx``. Both assume Megatron's layout; under HSAP's they would scan tokens
out of order, silently.

HSAP keeps Megatron's all-to-alls — every CP rank holds as many tokens (``chunk_tokens /
P_intra``), so the equal split holds — and replaces the two reorders by its layout's: CP rank
``r`` holds ``plan.local_token_indices(r)``, so the gathered rows are those lists concatenated
(:class:`StreamOrder`), put in stream order by one gather with the inverse permutation and back
by one gather with the lists. ``seq_idx`` is each token's document over the padded stream (the
padding is a document of its own). :class:`HSAPMambaMixer` (the HSAP hybrid spec's mixer)
computes these once per micro-batch, kept on the batch's ``packed_seq_params``, and checks its CP
group is the plan's; :func:`install` points megatron-core's two reorder functions at HSAP's for
HSAP batches (Megatron's own run for every other batch).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core.ssm import mamba_context_parallel as mcp
from megatron.core.ssm.mamba_mixer import MambaMixer
from torch import Tensor

from megatron_hsap.errors import BatchError, ConfigError
from megatron_hsap.megatron.batch import is_hsap_sharded
from megatron_hsap.megatron.megatron_lm import HYBRID, SCRIPTS
from megatron_hsap.runtime.capture import refuse_graph_capture
from megatron_hsap.runtime.upload import upload

__all__ = ["HSAPMambaMixer", "StreamOrder", "checked_stream_order", "install", "stream_order"]

# the reorder functions' parameters in megatron-core 0.19.2, which HSAP's replace
_REORDER_PARAMETERS = ("input_", "cp_size", "packed_seq_params")


@dataclass(frozen=True)
class StreamOrder:
    """How one micro-batch's tokens sit in a Mamba layer's gathered rows, on one device.

    ``gathered_ids`` ``[T_pad]`` int64: the stream position of gathered row ``g`` (CP ranks' local
    token lists concatenated in CP rank order; None at CP 1, where the rows are the stream);
    ``order`` ``[T_pad]`` int64: the gathered row of each stream position (its inverse);
    ``seq_idx`` ``[1, T_pad]`` int32: each stream position's document, the padding last.
    """

    gathered_ids: Tensor | None
    order: Tensor | None
    seq_idx: Tensor

    @classmethod
    def of(cls, plan: Any, device: torch.device) -> "StreamOrder":
        """The plan's order on ``device`` in one packed non-blocking upload (``runtime/upload.py``)."""
        starts = np.asarray(plan.batch.doc_starts, dtype=np.int64)  # the padded stream's documents
        seq_idx = np.repeat(np.arange(starts.size - 1, dtype=np.int32), np.diff(starts))
        parts = [seq_idx]
        if plan.cp_size > 1:
            ids = np.concatenate([np.asarray(plan.local_token_indices(r), dtype=np.int64) for r in range(plan.cp_size)])
            if ids.size != seq_idx.size:
                raise BatchError(f"the plan's CP ranks hold {ids.size} tokens in all but its padded stream has "
                                 f"{seq_idx.size}: the plan is not one of this batch")
            order = np.empty_like(ids)
            order[ids] = np.arange(ids.size, dtype=np.int64)
            parts += [ids, order]
        moved = upload([torch.from_numpy(p) for p in parts], device)
        gathered, order_dev = (moved[1], moved[2]) if len(moved) == 3 else (None, None)
        return cls(gathered, order_dev, moved[0].unsqueeze(0))


def stream_order(params: Any, device: torch.device) -> StreamOrder:
    """The :class:`StreamOrder` of the batch ``params`` (``HSAPPackedSeqParams``) describes, on
    ``device``: computed once per micro-batch and kept on it (every Mamba layer reads it)."""
    cached = getattr(params, "hsap_stream_order", None)
    if cached is None or cached.seq_idx.device != device:
        cached = StreamOrder.of(params.hsap_plan, device)
        params.hsap_stream_order = cached
    return cached


def checked_stream_order(kind: str, params: Any, cp_group: Any, device: torch.device, *, inference: bool) -> StreamOrder:
    """The checks an HSAP scan layer (``kind``: Mamba, gated delta net) makes before Megatron's
    forward — training only, not captured into a CUDA graph (``runtime/capture.py``), a batch HSAP
    sharded, the layer's CP group the plan's — then the batch's :class:`StreamOrder` on ``device``."""
    if inference:
        raise ConfigError(f"HSAP's {kind} layers train only (no inference context)")
    refuse_graph_capture(device, f"HSAP's {kind} layer")  # (its token order is the batch's plan's)
    if not is_hsap_sharded(params):
        raise BatchError(f"this batch was not sharded by HSAP (packed_seq_params lacks the HSAP marker): HSAP's {kind} "
                         f"layers reorder tokens by the HSAP plan; use {SCRIPTS[HYBRID]} (these layers are a hybrid "
                         "model's) or --context-parallel-impl hsap")
    plan = params.hsap_plan
    size, rank = cp_group.size(), cp_group.rank()
    if size != plan.cp_size or (size > 1 and rank != params.hsap_cp_rank):
        raise ConfigError(f"this {kind} layer's CP group (rank {rank} of {size}) is not the HSAP plan's (rank "
                          f"{params.hsap_cp_rank} of {plan.cp_size}): build the model with the CP group HSAP's parallel "
                          "state made")
    return stream_order(params, device)


def _undo(original: Any, input_: Tensor, cp_size: int, packed_seq_params: Any = None) -> Tensor:
    """Gathered rows ``[T_pad, b, d]`` → stream order (HSAP batches; else Megatron's)."""
    if not is_hsap_sharded(packed_seq_params):
        return original(input_, cp_size, packed_seq_params)
    return input_.index_select(0, _order(packed_seq_params, input_).order)


def _redo(original: Any, input_: Tensor, cp_size: int, packed_seq_params: Any = None) -> Tensor:
    """Stream order ``[T_pad, b, d]`` → gathered rows, CP rank ``r``'s at ``r·T_pad/P`` (HSAP
    batches; else Megatron's), for the all-to-all back."""
    if not is_hsap_sharded(packed_seq_params):
        return original(input_, cp_size, packed_seq_params)
    return input_.index_select(0, _order(packed_seq_params, input_).gathered_ids)


def _order(params: Any, rows: Tensor) -> StreamOrder:
    order = stream_order(params, rows.device)
    if order.order is None or rows.shape[0] != order.order.numel():
        raise BatchError(f"a Mamba layer gathered {rows.shape[0]} tokens over the CP group, but the HSAP plan's "
                         f"padded stream has {order.seq_idx.shape[1]} at CP {params.hsap_plan.cp_size}")
    return order


def _bind(fn: Any, original: Any) -> Any:
    @functools.wraps(original)
    def wrapped(input_: Tensor, cp_size: int, packed_seq_params: Any = None) -> Tensor:
        return fn(original, input_, cp_size, packed_seq_params)

    wrapped.__hsap_original__ = original  # type: ignore[attr-defined]
    return wrapped


def install() -> None:
    """Point megatron-core's Mamba CP reorders at HSAP's for HSAP batches (idempotent). Raises
    ``ConfigError`` when megatron-core's Mamba context parallelism is not the one HSAP follows
    (megatron-core 0.19.2: ``pre_conv_ssm`` / ``post_conv_ssm`` reorder through these functions)."""
    calls = {"pre_conv_ssm": "_undo_attention_load_balancing", "post_conv_ssm": "_redo_attention_load_balancing"}
    for method, name in calls.items():
        fn = getattr(mcp, name, None)
        code = getattr(getattr(mcp.MambaContextParallel, method, None), "__code__", None)
        params = tuple(inspect.signature(getattr(fn, "__hsap_original__", fn)).parameters) if fn is not None else ()
        if code is None or name not in code.co_names or params != _REORDER_PARAMETERS:
            raise ConfigError(f"megatron-core's MambaContextParallel.{method} does not reorder through {name}{_REORDER_PARAMETERS} "
                              "as megatron-core 0.19.2 does, which HSAP's Mamba layers follow: install megatron-core "
                              "0.19.2 or drop the Mamba layers ('M') from --hybrid-layer-pattern")
    for name, fn in (("_undo_attention_load_balancing", _undo), ("_redo_attention_load_balancing", _redo)):
        current = getattr(mcp, name)
        if not hasattr(current, "__hsap_original__"):
            setattr(mcp, name, _bind(fn, current))


class HSAPMambaMixer(MambaMixer):
    """Megatron's ``MambaMixer`` on HSAP-sharded batches: the same parameters, projections, kernels
    and all-to-alls; the tokens reordered by the plan and each document scanned alone (module
    docstring). Refuses batches HSAP did not shard, inference and the non-memory-efficient path
    (which takes no packed sequences)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        if not getattr(config, "use_mamba_mem_eff_path", True):
            raise ConfigError("HSAP's Mamba layers train through megatron-core's memory-efficient Mamba path (the "
                              "other takes no packed sequences): drop --disable-mamba-mem-eff-path")
        install()
        super().__init__(config, *args, **kwargs)

    def forward(self, hidden_states: Tensor, inference_context: Any = None, *, inference_params: Any = None,
                packed_seq_params: Any = None) -> Any:
        """``hidden_states`` ``[t_local / TP, 1, h]`` (sequence parallel) or ``[t_local, 1, h]``;
        returns Megatron's ``(out, out_bias)``."""
        order = checked_stream_order("Mamba", packed_seq_params, self.pg_collection.cp, hidden_states.device,
                                     inference=inference_context is not None or inference_params is not None)
        packed_seq_params.seq_idx = order.seq_idx  # (Megatron's scan reads it after the all-to-all)
        return super().forward(hidden_states, packed_seq_params=packed_seq_params)
