"""Batch sharding for the HSAP layout: Megatron's ``get_batch_on_this_cp_rank`` equivalent (docs/design.md §2.3).

A packed micro-batch (global ``cu_seqlens``) is compiled into a plan on the host; this CP rank
keeps the tokens ``plan.local_token_indices(cp_rank)`` names, in that order. Tokens, labels, loss
mask and position ids travel together, so every token carries its position *inside its document*
(RoPE is applied from it, not from the token's row). Padding ids (≥ T) get the pad token, loss
mask 0 and position 0. The plan rides with the batch in :class:`HSAPPackedSeqParams` (the marker
the core attention checks), so the layer never syncs the device to learn the layout.

No host stalls (issue 16 item 3): a host batch (the prefetcher hands the packed host batch on) is
indexed and gathered on the host, and everything the rank gets — tokens, labels, loss mask,
positions, the padded ``cu_seqlens`` — goes to the device in one pinned, non-blocking copy; the
fingerprint and the loss-token count are computed from the host values (no ``.item()``/``.cpu()``).

Loss: every real token sits on exactly one CP rank, so the loss is the sum over CP (and DP) ranks
of ``Σ loss_mask·loss`` divided by the global number of loss tokens (``num_loss_tokens``, known on
the host) — CP ranks act as extra data-parallel ranks (Megatron: ``--calculate-per-token-loss``;
without it, Megatron's per-micro-batch mean gets that count from ``megatron/loss.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_hsap.errors import BatchError, ConfigError
from megatron_hsap.megatron.batch_agreement import agree_before_sharding, check_consistent
from megatron_hsap.megatron.plan_worker import PlanRequest, compile_request

if TYPE_CHECKING:
    from megatron_hsap.plan import Plan

__all__ = [
    "HSAP_MARKER",
    "HSAPPackedSeqParams",
    "PackedBatch",
    "pack_micro_batch",
    "plan_kwargs_from_config",
    "plan_for_batch",
    "get_batch_on_this_cp_rank",
    "is_hsap_sharded",
    "positions_in_documents",
]

HSAP_MARKER = "megatron_hsap.batch/v1"  # what the core attention looks for


@dataclass
class HSAPPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` plus the HSAP side channel (all host objects except the position ids).

    ``cu_seqlens_q/kv`` hold the *global* padded ``cu_seqlens`` (the padding is one extra document)
    and ``max_seqlen_q/kv`` its longest document, as Megatron does for THD under CP; GPTModel sizes
    its rotary table from ``max_seqlen``. ``hsap_position_ids`` is ``[t_local]`` int64 on the
    tokens' device: position of each local token inside its document (0 for padding).
    """

    hsap_marker: str | None = None
    hsap_plan: "Plan | None" = None
    hsap_cp_rank: int | None = None
    hsap_position_ids: torch.Tensor | None = None
    hsap_num_loss_tokens: int | None = None


def is_hsap_sharded(packed_seq_params: object) -> bool:
    """True if ``packed_seq_params`` came from HSAP batch sharding (carries the marker and a plan)."""
    return (
        isinstance(packed_seq_params, HSAPPackedSeqParams)
        and packed_seq_params.hsap_marker == HSAP_MARKER
        and packed_seq_params.hsap_plan is not None
    )


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """One micro-batch as a single packed stream on the host side of the tensors.

    ``tokens``/``labels`` ``[T]`` int64, ``loss_mask`` ``[T]`` float32, ``cu_seqlens`` a numpy
    int64 array ``[n_docs + 1]`` (``cu_seqlens[-1] == T``), ``position_ids`` ``[T]`` int64 as the
    dataset gave them (None: the model gets positions inside the documents).
    """

    tokens: torch.Tensor
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    cu_seqlens: np.ndarray
    position_ids: torch.Tensor | None = None


def _host_cu_seqlens(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        # One host copy per micro-batch, in the batch function (never in the layer); on the GPU
        # path the tensor is already on the host unless TP broadcast moved it to the device.
        value = value.detach().to("cpu").numpy()
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":  # floats would be truncated silently (compile_plan rejects them too)
        raise BatchError(f"cu_seqlens must hold integers, got dtype {arr.dtype}; pass an int32/int64 tensor")
    return arr.astype(np.int64, copy=False)


def _merge_sample_rows(rows: np.ndarray, seq_length: int) -> np.ndarray:
    """Per-sample ``cu_seqlens`` rows (Megatron's dataset pads each row with trailing copies of
    ``seq_length``) → one global ``cu_seqlens`` over the ``b·seq_length`` packed stream."""
    merged = [0]
    for b, row in enumerate(rows):
        row = np.asarray(row, dtype=np.int64)
        if row.size == 0 or row[0] != 0:
            raise BatchError(f"cu_seqlens row {b} must start at 0, got {row[:4].tolist()}...")
        ends = np.nonzero(row == seq_length)[0]
        if ends.size == 0:
            raise BatchError(
                f"cu_seqlens row {b} never reaches seq_length={seq_length} (last entry {int(row[-1])}); "
                "each sample's documents must cover the whole sample"
            )
        valid = row[1 : ends[0] + 1]
        merged.extend((valid + b * seq_length).tolist())
    return np.asarray(merged, dtype=np.int64)


def pack_micro_batch(batch: Mapping[str, Any]) -> PackedBatch:
    """Flatten a Megatron micro-batch into one packed stream, without touching the device.

    Accepts ``tokens`` ``[b, s]`` (or ``[T]``) with optional ``labels``/``loss_mask`` of the same
    shape, and ``cu_seqlens`` as (a) absent/None: every sample is one document; (b) 1-D global
    ``[0, ..., b·s]``; (c) 2-D ``[b, n]`` per-sample rows as ``GPTDataset(inter_document_masking=
    True)`` produces (right-padded with ``s``). ``attention_mask`` is ignored (masks are implied by
    documents); ``position_ids`` are kept for the model's input, which only a learned absolute
    position embedding reads (RoPE is applied by position inside each document, as Megatron's THD
    path does, from ``cu_seqlens``).
    """
    if "tokens" not in batch or batch["tokens"] is None:
        raise BatchError("batch has no 'tokens'; HSAP shards tokens, labels, loss_mask and position ids")
    tokens = batch["tokens"]
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2:
        raise BatchError(f"tokens must be [b, s] or [T], got shape {tuple(tokens.shape)}")
    b, s = tokens.shape
    flat = {}
    for key in ("labels", "loss_mask", "position_ids"):
        value = batch.get(key)
        if value is None:
            flat[key] = None
            continue
        value = value.reshape(b, -1) if value.dim() == 1 and b == 1 else value
        if tuple(value.shape) != (b, s):
            raise BatchError(f"{key} has shape {tuple(value.shape)} but tokens have {(b, s)}")
        flat[key] = value.reshape(-1)
    cu = batch.get("cu_seqlens")
    if cu is None:
        cu_np = np.arange(0, b * s + 1, s, dtype=np.int64)  # one document per sample
    else:
        cu_np = _host_cu_seqlens(cu)
        if cu_np.ndim == 2:
            if cu_np.shape[0] != b:
                raise BatchError(f"cu_seqlens has {cu_np.shape[0]} rows but the batch has {b} samples")
            cu_np = _merge_sample_rows(cu_np, s)
        elif cu_np.ndim != 1:
            raise BatchError(f"cu_seqlens must be 1-D (global) or [b, n] (per sample), got shape {cu_np.shape}")
        if cu_np[-1] != b * s:
            raise BatchError(
                f"cu_seqlens ends at {int(cu_np[-1])} but the batch holds {b}×{s} = {b * s} tokens; "
                "cu_seqlens must cover every token of the packed stream"
            )
    loss_mask = flat["loss_mask"]
    if loss_mask is not None:
        loss_mask = loss_mask.to(torch.float32)
    return PackedBatch(tokens=tokens.reshape(-1), labels=flat["labels"], loss_mask=loss_mask, cu_seqlens=cu_np,
                       position_ids=flat["position_ids"])


def positions_in_documents(ids: np.ndarray, cu_seqlens: np.ndarray, num_tokens: int) -> np.ndarray:
    """Position of each global token id inside its document; 0 for padding ids (``>= num_tokens``).

    Empty documents (repeated ``cu_seqlens`` entries) are skipped by ``side="right"``.
    """
    real = ids < num_tokens
    doc = np.searchsorted(cu_seqlens, np.where(real, ids, 0), side="right") - 1
    pos = ids - cu_seqlens[doc]
    return np.where(real, pos, 0).astype(np.int64)


def plan_kwargs_from_config(config: Any, *, tp_size: int | None = None) -> dict[str, Any]:
    """``compile_plan`` keyword arguments for a megatron-core ``TransformerConfig``.

    Head counts are per tensor-parallel rank (docs/design.md §1); under sequence parallelism the batch is
    padded to a multiple of ``P·TP`` so every TP rank's sequence slice is whole.
    """
    tp = int(tp_size if tp_size is not None else config.tensor_model_parallel_size)
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    if heads % tp:
        raise ConfigError(f"num_attention_heads={heads} is not divisible by tensor_model_parallel_size={tp}")
    kv = max(1, groups // tp)  # Megatron gives each TP rank one kv group when groups < TP
    head_dim, head_dim_v = config.kv_channels, None
    if getattr(config, "multi_latent_attention", False):  # MLA: k/v per q head, q/k with the RoPE part
        kv, head_dim, head_dim_v = heads // tp, config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim
    dtype_bytes = 2 if (config.bf16 or config.fp16) else 4
    return dict(
        num_heads=heads // tp,
        num_kv_heads=kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype_bytes=dtype_bytes,
        pad_multiple=tp if config.sequence_parallel else 1,
        tp_size=tp,
    )


def _resolve_rank_and_sizes(cp_rank: int | None, plan: "Plan | None") -> tuple[int, Any]:
    from megatron_hsap.megatron import parallel_state as hsap_ps

    groups = hsap_ps.get_hsap_groups() if hsap_ps.is_hsap_initialized() else None
    if cp_rank is None:
        if groups is not None:
            cp_rank = groups.cp_rank
        elif plan is None or plan.cp_size == 1:
            cp_rank = 0
        else:
            raise ConfigError(
                "get_batch_on_this_cp_rank needs cp_rank=... or initialize_hsap(...) to know which "
                f"of the plan's {plan.cp_size} CP ranks this process is"
            )
    return int(cp_rank), groups


def get_batch_on_this_cp_rank(
    batch: "Mapping[str, Any] | PackedBatch",
    *,
    plan: "Plan | None" = None,
    cp_rank: int | None = None,
    config: Any = None,
    plan_kwargs: Mapping[str, Any] | None = None,
    check_group: Any = None,
    pad_token_id: int = 0,
    device: torch.device | str | None = None,
    qkv_format: str = "thd",
) -> dict[str, Any]:
    """This CP rank's share of a packed micro-batch in the plan's layout.

    Args:
        batch: ``tokens`` ``[b, s]``, optional ``labels``, ``loss_mask``, ``cu_seqlens`` (see
            :func:`pack_micro_batch`; without ``cu_seqlens`` each sample is one document).
        plan: a compiled plan for this batch's ``cu_seqlens``; compiled here when None, from
            ``plan_kwargs`` or ``config`` (:func:`plan_kwargs_from_config`) and the HSAP groups.
        cp_rank: this rank's CP rank; default from ``initialize_hsap``'s groups.
        check_group: group for ``check_cu_seqlens_consistent`` (default: Megatron's CP group,
            else the HSAP intra and inter groups); ``False`` skips the check.
        pad_token_id: token written at padding positions (their loss mask is 0 anyway).
        device: where the returned tensors go (default: the device ``tokens`` came on).
        qkv_format: ``"thd"`` (default) packs the micro-batch into one stream (``[b, s]`` without
            ``cu_seqlens`` becomes ``b`` documents). ``"sbhd"`` keeps an unpacked ``[b, s]`` batch
            (no ``cu_seqlens``; each sample one document, all sharded alike): the plan covers one
            sample with ``b×`` the heads (the core attention folds the batch into heads), tensors
            come back ``[b, s_local]``. Under GPTModel with RoPE and CP > 1 use ``"thd"``: GPTModel
            slices its rotary table the zigzag way for non-THD batches.

    Returns a dict: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (each ``[1, t_local]``;
    ``[b, s_local]`` for sbhd), ``attention_mask`` None, ``packed_seq_params``
    (:class:`HSAPPackedSeqParams`), ``num_tokens`` (real tokens T), ``num_loss_tokens`` (global
    Σ loss_mask: the loss denominator), ``plan`` and ``cp_rank``.
    """
    if qkv_format == "sbhd":
        return _sbhd_batch(batch, plan=plan, cp_rank=cp_rank, config=config, plan_kwargs=plan_kwargs,
                           check_group=check_group, pad_token_id=pad_token_id, device=device)
    if qkv_format != "thd":
        raise ConfigError(f"qkv_format={qkv_format!r}: use 'thd' (packed) or 'sbhd' (one document per sample)")
    packed = batch if isinstance(batch, PackedBatch) else pack_micro_batch(batch)
    cu = packed.cu_seqlens
    if plan is None:
        plan = _compile_for_batch(cu, config=config, plan_kwargs=plan_kwargs)
    elif tuple(int(v) for v in cu) != tuple(plan.batch.cu_seqlens):
        raise BatchError(
            "the plan was compiled for a different cu_seqlens than this batch "
            f"(plan T={plan.num_tokens}, batch T={int(cu[-1])}); compile the plan from this batch"
        )
    cp_rank, groups = _resolve_rank_and_sizes(cp_rank, plan)
    if groups is not None:
        from megatron_hsap.runtime.groups import check_plan_groups

        check_plan_groups(plan, groups)
    if not 0 <= cp_rank < plan.cp_size:
        raise ConfigError(f"cp_rank={cp_rank} out of range for a plan over {plan.cp_size} CP ranks")
    check_consistent(cu, check_group, groups, plan.cp_size)
    agree_before_sharding(plan, groups, check_group)

    num_tokens = plan.num_tokens
    ids = np.asarray(plan.local_token_indices(cp_rank), dtype=np.int64)
    real_np = ids < num_tokens
    src_device = packed.tokens.device
    out_device = torch.device(device) if device is not None else src_device
    # Gather where the batch is (the host, when it comes from the prefetcher), then move every
    # result in one pinned non-blocking copy (_to_device): no blocking copy, no host sync.
    gather_idx, real_dev = _to_device([torch.from_numpy(np.where(real_np, ids, 0)), torch.from_numpy(real_np)], src_device)

    tokens = torch.where(real_dev, packed.tokens[gather_idx], torch.full_like(gather_idx, pad_token_id))
    labels = None
    if packed.labels is not None:
        labels = torch.where(real_dev, packed.labels[gather_idx], torch.full_like(gather_idx, pad_token_id))
    if packed.loss_mask is not None:
        loss_mask = packed.loss_mask[gather_idx] * real_dev
        num_loss_tokens = _host_sum(packed.loss_mask)  # a host mask: no device sync
    else:
        loss_mask = real_dev.to(torch.float32)
        num_loss_tokens = num_tokens
    positions = torch.from_numpy(positions_in_documents(ids, cu, num_tokens))  # RoPE's rows
    # The model's position_ids feed a learned absolute embedding, which Megatron indexes by the
    # dataset's ids (restarting at each EOD only under --reset-position-ids); padding gets 0.
    given = packed.position_ids
    model_positions = None if given is None else torch.where(real_dev, given[gather_idx].to(torch.int64), 0)

    doc_lengths = np.diff(np.asarray(plan.batch.doc_starts, dtype=np.int64))
    cu_padded = torch.from_numpy(np.asarray(plan.batch.doc_starts, dtype=np.int32))
    max_seqlen = int(doc_lengths.max()) if doc_lengths.size else 1
    extra = [t for t in (labels, model_positions) if t is not None]
    moved = _to_device([tokens, loss_mask, positions, cu_padded, *extra], out_device)
    tokens, loss_mask, positions_dev, cu_padded = moved[:4]
    labels = moved[4] if labels is not None else None
    model_positions_dev = moved[-1] if model_positions is not None else positions_dev
    params = HSAPPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_padded,
        cu_seqlens_kv=cu_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        hsap_marker=HSAP_MARKER,
        hsap_plan=plan,
        hsap_cp_rank=cp_rank,
        hsap_position_ids=positions_dev,
        hsap_num_loss_tokens=num_loss_tokens,
    )
    return {
        "tokens": tokens.unsqueeze(0),
        "labels": labels.unsqueeze(0) if labels is not None else None,
        "loss_mask": loss_mask.unsqueeze(0),
        "position_ids": model_positions_dev.unsqueeze(0),
        "attention_mask": None,
        "packed_seq_params": params,
        "num_tokens": num_tokens,
        "num_loss_tokens": num_loss_tokens,
        "plan": plan,
        "cp_rank": cp_rank,
    }


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``tensors`` on ``device``: as they are when all already are, else one packed non-blocking
    upload from pinned memory (``runtime/upload.py``; never a blocking ``.to(device)`` apiece)."""
    if all(t.device == device for t in tensors):
        return tuple(tensors)
    from megatron_hsap.runtime.upload import upload

    return upload(tensors, device)


def _host_sum(loss_mask: torch.Tensor) -> int:
    # A device loss mask costs one sync here (batch function, before the step); host masks none.
    # One transfer carries the sum and the number of entries that are neither 0 nor 1.
    lm = loss_mask.double()
    total, other = torch.stack([lm.sum(), ((lm != 0) & (lm != 1)).sum().double()]).tolist()
    if other:
        raise BatchError(
            f"loss_mask must hold only 0 and 1, but {int(other)} entries hold other values (e.g. 0.5); "
            "pass a 0/1 mask (per-token loss weights are not supported by HSAP batch sharding)"
        )
    return int(total)


def plan_for_batch(batch: "Mapping[str, Any] | PackedBatch", *, config: Any = None, plan_kwargs: Mapping[str, Any] | None = None,
                   windows: Any = None) -> "Plan":
    """The plan ``get_batch_on_this_cp_rank(batch, config=..., plan_kwargs=...)`` would compile for
    this micro-batch (pure CPU work, no collective: safe on ``PlanPrefetcher``'s worker thread).
    The plans of the model's sliding windows (``windows``, default from ``config``'s layers:
    ``megatron/windows.py``) are compiled here too, on this plan's layout (``shared_layout.compile_on_layout``,
    cached), so the core attention of every layer finds its plan ready."""
    return compile_request(plan_request(batch, config=config, plan_kwargs=plan_kwargs, windows=windows))[0]


def plan_request(batch: "Mapping[str, Any] | PackedBatch", *, config: Any = None, plan_kwargs: Mapping[str, Any] | None = None,
                 windows: Any = None) -> PlanRequest:
    """What ``plan_for_batch`` compiles, as a ``PlanRequest`` a plan worker process can compile
    (``megatron/plan_worker.py``): the topology resolved here, from this process's HSAP groups."""
    packed = batch if isinstance(batch, PackedBatch) else pack_micro_batch(batch)
    if windows is None and config is not None:
        from megatron_hsap.megatron.windows import model_windows

        windows = model_windows(config)
    return PlanRequest(packed.cu_seqlens, _plan_kwargs(config=config, plan_kwargs=plan_kwargs), tuple(windows or ()))


def _plan_kwargs(*, config: Any, plan_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``compile_plan``'s keyword arguments: ``plan_kwargs``, then ``config``'s, then the topology of
    this process's HSAP groups."""
    from megatron_hsap.megatron import parallel_state as hsap_ps

    kwargs: dict[str, Any] = dict(plan_kwargs or {})
    if config is not None:
        for key, value in plan_kwargs_from_config(config).items():
            kwargs.setdefault(key, value)
    if "inter_size" not in kwargs or "intra_size" not in kwargs:
        if not hsap_ps.is_hsap_initialized():
            raise ConfigError(
                "cannot compile the plan: pass plan=..., plan_kwargs with inter_size/intra_size, "
                "or call initialize_hsap(intra_size, inter_size) first"
            )
        groups = hsap_ps.get_hsap_groups()
        kwargs.setdefault("inter_size", groups.inter_size)
        kwargs.setdefault("intra_size", groups.intra_size)
    if "num_heads" not in kwargs:
        raise ConfigError("cannot compile the plan without head counts: pass config=TransformerConfig or plan_kwargs")
    return kwargs


def _compile_for_batch(cu: np.ndarray, *, config: Any, plan_kwargs: Mapping[str, Any] | None) -> "Plan":
    from megatron_hsap.plan import compile_plan

    return compile_plan(cu, **_plan_kwargs(config=config, plan_kwargs=plan_kwargs))


def _sbhd_batch(batch: Mapping[str, Any], *, plan: "Plan | None", cp_rank: int | None, config: Any,
                plan_kwargs: Mapping[str, Any] | None, check_group: Any, pad_token_id: int,
                device: torch.device | str | None) -> dict[str, Any]:
    """Unpacked ``[b, s]`` batch, every sample one document sharded by the same layout."""
    if batch.get("cu_seqlens") is not None:
        raise BatchError("qkv_format='sbhd' is for unpacked batches (one document per sample); packed batches use 'thd'")
    tokens = batch["tokens"]
    if tokens.dim() != 2:
        raise BatchError(f"qkv_format='sbhd' needs tokens [b, s], got shape {tuple(tokens.shape)}")
    b, s = tokens.shape
    cu = np.asarray([0, s], dtype=np.int64)
    if plan is None:
        kwargs: dict[str, Any] = dict(plan_kwargs or {})
        if config is not None:
            for key, value in plan_kwargs_from_config(config).items():
                kwargs.setdefault(key, value)
        if "num_heads" not in kwargs:
            raise ConfigError("cannot compile the plan without head counts: pass config=TransformerConfig or plan_kwargs")
        heads = kwargs["num_heads"]
        kv_heads = kwargs.get("num_kv_heads") or heads
        kwargs.update(num_heads=heads * b, num_kv_heads=kv_heads * b)  # the batch folds into the heads
        plan = _compile_for_batch(cu, config=None, plan_kwargs=kwargs)
    elif tuple(plan.batch.cu_seqlens) != (0, s):
        raise BatchError(f"an sbhd plan must be compiled for cu_seqlens=[0, {s}] (one sample), got T={plan.num_tokens}")
    cp_rank, groups = _resolve_rank_and_sizes(cp_rank, plan)
    # Fingerprint the sample count too: ranks with different b would mismatch shapes in the a2a.
    check_consistent(np.arange(0, b * s + 1, s, dtype=np.int64), check_group, groups, plan.cp_size)
    agree_before_sharding(plan, groups, check_group)
    ids = np.asarray(plan.local_token_indices(cp_rank), dtype=np.int64)
    real_np = ids < s
    src = tokens.device
    out_device = torch.device(device) if device is not None else src
    idx, real = _to_device([torch.from_numpy(np.where(real_np, ids, 0)), torch.from_numpy(real_np)], src)

    def take(x: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.where(real, x[:, idx], torch.full_like(x[:, idx], fill))

    loss_mask = batch.get("loss_mask")
    if loss_mask is None:
        loss_mask = torch.ones(b, s, dtype=torch.float32, device=src)
    labels = batch.get("labels")
    num_loss_tokens = _host_sum(loss_mask)
    got = [take(tokens, pad_token_id), take(loss_mask.to(torch.float32), 0.0), torch.from_numpy(np.where(real_np, ids, 0))]
    given = batch.get("position_ids")  # the model input (a learned embedding reads it), as in the thd path
    extra = [t for t in (labels, given) if t is not None]
    got = _to_device([*got, *[take(t, pad_token_id if t is labels else 0) for t in extra]], out_device)
    positions = got[2]
    model_positions = got[-1] if given is not None else positions.unsqueeze(0).expand(b, -1)
    params = HSAPPackedSeqParams(
        qkv_format="sbhd",
        max_seqlen_q=plan.padded_tokens,
        max_seqlen_kv=plan.padded_tokens,
        hsap_marker=HSAP_MARKER,
        hsap_plan=plan,
        hsap_cp_rank=cp_rank,
        hsap_position_ids=positions,
        hsap_num_loss_tokens=num_loss_tokens,
    )
    return {
        "tokens": got[0],
        "labels": got[3] if labels is not None else None,
        "loss_mask": got[1],
        "position_ids": model_positions,
        "attention_mask": None,
        "packed_seq_params": params,
        "num_tokens": b * s,
        "num_loss_tokens": params.hsap_num_loss_tokens,
        "plan": plan,
        "cp_rank": cp_rank,
    }
