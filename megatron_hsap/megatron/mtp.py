"""Multi-token prediction (MTP, ``--mtp-num-layers``; DeepSeek-V3) under HSAP (docs/enable.md, "MTP").

Megatron's MTP needs three things of the CP layout, and assumes the zigzag one for each:

1. **The shift.** ``multi_token_prediction.roll_tensor`` shifts token ids, positions, labels and
   loss masks one token left per depth, inside each document of a packed batch (a document's last
   token gets 0). Under CP it exchanges the two zigzag chunks' edges. :func:`roll_to_next` shifts in
   HSAP's layout instead: the successor table of the plan (``plan/next_token.py``) and one
   all-gather of each rank's run-start values over the CP group per shift (a few values per rank).
2. **The per-token weights.** ``process_mtp_loss`` with ``--calculate-per-token-loss`` weights each
   depth's loss by (loss tokens before the shifts) / (after), and without it divides by the tokens
   after the shifts, and logs Σ loss / tokens — counted on each CP rank alone, so the gradient and
   the logged MTP loss depend on how CP split the micro-batch. :func:`process_mtp_loss` counts
   over the CP group (one all-reduce of two numbers per depth): every rank uses the micro-batch's
   counts, which is what a CP=1 run computes (without per-token loss each CP rank's term is
   multiplied by CP, as ``megatron/loss.py`` does for the main loss: DDP averages over DP×CP).
3. **The MTP layer's attention.** Megatron's GPT builders make the MTP transformer layer from their
   own decoder layer spec, not the ``--spec`` one; :func:`mtp_block_spec` swaps HSAP's attention
   into it. (``HybridModel`` builds its MTP layers from its own stack spec: HSAP's already.)

:func:`install` puts the three into megatron-core (``roll_tensor`` and ``process_mtp_loss`` where
megatron-core calls them, ``get_gpt_mtp_block_spec`` where the builders look it up); each defers to
Megatron's own for batches HSAP did not shard and for runs that are not HSAP's, so a ring run in the
same process is untouched. ``spec.check_model_attention`` refuses a model with any attention that is
not HSAP's, whichever builder made it.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.batch import is_hsap_sharded
from megatron_hsap.plan.next_token import NextTokenMap, next_token_map

__all__ = ["Successors", "install", "mtp_block_spec", "process_mtp_loss", "roll_to_next", "successors"]


@dataclass(frozen=True)
class Successors:
    """A successor table with its index arrays on one device (``[n]`` int64 each; ``local_src`` is
    ``local_dst + 1``, the next local token)."""

    table: NextTokenMap
    local_dst: torch.Tensor
    local_src: torch.Tensor
    remote_dst: torch.Tensor
    remote_src: torch.Tensor
    send: torch.Tensor

    @classmethod
    def on(cls, table: NextTokenMap, device: torch.device) -> "Successors":
        """The table's indices moved to ``device`` in one packed, non-blocking copy (``runtime/upload.py``:
        pinned on CUDA, no host stall)."""
        from megatron_hsap.runtime.upload import upload

        parts = (table.local_dst, table.remote_dst, table.remote_src, table.send)
        local_dst, remote_dst, remote_src, send = upload([torch.from_numpy(np.ascontiguousarray(p)) for p in parts],
                                                         device)
        return cls(table, local_dst, local_dst + 1, remote_dst, remote_src, send)


def successors(params: Any, device: torch.device) -> Successors:
    """The successor table of the batch ``params`` (``HSAPPackedSeqParams``) describes, on ``device``;
    computed once per micro-batch and kept on it (every MTP shift of the step reads it)."""
    cached = getattr(params, "hsap_next_tokens", None)
    if cached is None or cached.send.device != device:
        table = next_token_map(params.hsap_plan, int(params.hsap_cp_rank)) if cached is None else cached.table
        cached = Successors.on(table, device)
        params.hsap_next_tokens = cached
    return cached


def _cp_group(params: Any, given: Any) -> Any:
    """The CP group whose group rank is the plan's CP rank: HSAP's own (``initialize_hsap``), else
    ``given`` (Megatron's) when its ranks line up with the plan's."""
    from megatron_hsap.megatron import parallel_state as hsap_ps

    plan, cp_rank = params.hsap_plan, int(params.hsap_cp_rank)
    if plan.cp_size == 1:
        return None
    if hsap_ps.is_hsap_initialized() and hsap_ps.get_hsap_groups().cp is not None:
        return hsap_ps.get_hsap_groups().cp
    if given is not None and dist.get_world_size(given) == plan.cp_size and dist.get_rank(given) == cp_rank:
        return given
    raise ConfigError("MTP's shift under HSAP needs the CP group (group rank = CP rank): call initialize_hsap")


def roll_to_next(tensor: torch.Tensor, where: Successors, group: Any = None) -> torch.Tensor:
    """``[..., t_local]`` → the same shape: each position gets its document successor's value (0 at a
    document's last token), as Megatron's packed-sequence ``roll_tensor(shifts=-1)`` does at CP=1.

    Every CP rank of the plan calls it together (one all-gather over ``group`` when the table says
    an exchange is needed; none for a plan whose runs all start documents)."""
    table = where.table
    if tensor.shape[-1] != table.num_local:
        raise ConfigError(f"MTP shift of a tensor with {tensor.shape[-1]} local tokens; the plan gives this rank "
                          f"{table.num_local}")
    out = torch.zeros_like(tensor)
    out[..., where.local_dst] = tensor[..., where.local_src]
    if table.exchange or table.remote_dst.size:
        wire = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor  # gloo/NCCL carry no bool
        mine = wire[..., where.send].movedim(-1, 0).contiguous()  # [slots, ...]
        if table.exchange:
            gathered = torch.empty((table.cp_size * table.send_slots, *mine.shape[1:]), dtype=mine.dtype,
                                   device=tensor.device)
            dist.all_gather_into_tensor(gathered, mine, group=group)
        else:  # one rank (or own runs only): its own run starts
            gathered = mine
        out[..., where.remote_dst] = gathered.movedim(0, -1)[..., where.remote_src].to(tensor.dtype)
    return out


# --- Megatron's entry points -------------------------------------------------------------------

def _megatron_mtp() -> Any:
    from megatron.core.transformer import multi_token_prediction

    return multi_token_prediction


def _original(fn: Any) -> Any:
    return getattr(fn, "__hsap_original__", fn)


def roll_tensor(tensor: Any, shifts: int = -1, dims: int = -1, cp_group: Any = None, packed_seq_params: Any = None) -> Any:
    """Megatron's ``roll_tensor`` signature: HSAP's shift for an HSAP-sharded batch, Megatron's otherwise.
    Returns ``(rolled, rolled.sum())`` (the sum is this rank's, as Megatron's under CP)."""
    if tensor is None or not is_hsap_sharded(packed_seq_params):
        return _original(_megatron_mtp().roll_tensor)(tensor, shifts=shifts, dims=dims, cp_group=cp_group,
                                                      packed_seq_params=packed_seq_params)
    if shifts != -1 or dims not in (-1, tensor.dim() - 1):
        raise ConfigError(f"MTP shift by {shifts} along dim {dims}: HSAP shifts one token left along the last dim")
    rolled = roll_to_next(tensor, successors(packed_seq_params, tensor.device), _cp_group(packed_seq_params, cp_group))
    return rolled, rolled.sum()


@functools.lru_cache(maxsize=1)
def _process_signature() -> inspect.Signature:
    return inspect.signature(_original(_megatron_mtp().process_mtp_loss))


def process_mtp_loss(*args: Any, **kwargs: Any) -> Any:
    """Megatron's ``process_mtp_loss`` (GPTModel's and HybridModel's post-processing), with the token counts of the
    micro-batch for an HSAP-sharded batch (module docstring, item 2); Megatron's own otherwise.

    The arithmetic is megatron-core 0.19.2's: each depth shifts labels and loss mask, computes the
    masked loss of its logits, logs Σ loss / tokens and the acceptance counts, and hangs
    ``scale · loss · original / tokens`` on the hidden states (``MTPLossAutoScaler``)."""
    mtp = _megatron_mtp()
    megatron_process = _original(mtp.process_mtp_loss)
    a = _process_signature().bind(*args, **kwargs)
    a.apply_defaults()
    p = a.arguments
    params = p["packed_seq_params"]
    if not is_hsap_sharded(params):
        return megatron_process(*args, **kwargs)
    from megatron.core import parallel_state

    config = p["config"]
    depths = int(config.mtp_num_layers)
    chunks = torch.chunk(p["hidden_states"], 1 + depths, dim=0)
    hidden = chunks[0]
    group = _cp_group(params, p["cp_group"])
    cp_size = params.hsap_plan.cp_size  # (the group's size: _cp_group checks it)
    where = successors(params, hidden.device)

    def shift(t: torch.Tensor) -> torch.Tensor:
        return roll_to_next(t, where, group)

    def over_cp(*values: torch.Tensor) -> torch.Tensor:
        both = torch.stack([v.detach().float() for v in values])
        if group is not None:
            dist.all_reduce(both, group=group)
        return both

    labels, loss_mask = p["labels"], p["loss_mask"]
    derived = labels is None
    if derived:  # RL: labels are the ids shifted once (Megatron's convention)
        if p["input_ids"] is None:
            return hidden
        labels = shift(p["input_ids"])
    output_weight = p["output_weight"]
    if config.mtp_detach_heads:
        output_weight = output_weight.detach() if output_weight is not None else p["output_layer"].weight.detach()
    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    if derived:
        loss_mask = shift(loss_mask)
    original = over_cp(loss_mask.sum())[0]
    scale = config.mtp_loss_scaling_factor / depths
    for depth in range(depths):
        logits, _ = p["output_layer"](chunks[depth + 1], weight=output_weight,
                                      runtime_gather_output=p["runtime_gather_output"])
        if p["scale_logits_fn"] is not None:
            logits = p["scale_logits_fn"](logits)
        mtp_labels, loss_mask = shift(mtp_labels), shift(loss_mask)
        loss = loss_mask * p["compute_language_model_loss"](mtp_labels, logits)
        tokens, loss_sum = over_cp(loss_mask.sum(), loss.sum())
        if p["is_training"]:
            correct, total = mtp._compute_mtp_acceptance_counts(logits, mtp_labels, loss_mask, p["output_layer"],
                                                                p["runtime_gather_output"], p["tp_group"])
            mtp.MTPLossLoggingHelper.save_metrics_to_tracker(
                loss_sum * (tokens > 0).float() / tokens.clamp(min=1), correct, total, depth, depths,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        if config.calculate_per_token_loss:
            hidden = mtp.MTPLossAutoScaler.apply(hidden, scale * loss * (original / tokens.clamp(min=1)))
        else:  # Megatron's default: DDP averages over DP×CP, so each CP rank carries CP × its share
            hidden = mtp.MTPLossAutoScaler.apply(hidden, scale * loss * cp_size / tokens.clamp(min=1))
    return hidden


def _hsap_run() -> bool:
    """Whether Megatron's arguments say this process trains with ``--context-parallel-impl hsap``."""
    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except (ImportError, AssertionError):  # no Megatron-LM loop: arguments never parsed
        return False
    return getattr(args, "context_parallel_impl", "ring") == "hsap"


def mtp_block_spec(spec_builder: Any) -> Any:
    """``get_gpt_mtp_block_spec`` wrapped: under an HSAP run, the MTP layer's transformer layer spec
    (the builder's ``spec`` argument: Megatron's decoder layer or block spec) gets HSAP's attention."""

    @functools.wraps(spec_builder)
    def wrapped(config: Any, spec: Any, *args: Any, **kwargs: Any) -> Any:
        if _hsap_run():
            from megatron_hsap.megatron.spec import _swap_all

            spec = _swap_all(spec)
        return spec_builder(config, spec, *args, **kwargs)

    wrapped.__hsap_original__ = spec_builder  # type: ignore[attr-defined]
    return wrapped


def _put(owner: Any, name: str, make: Any) -> None:
    current = getattr(owner, name, None)
    if current is not None and not hasattr(current, "__hsap_original__"):
        setattr(owner, name, make(current))


def _mark(fn: Any, original: Any) -> Any:
    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapped.__hsap_original__ = original  # type: ignore[attr-defined]
    return wrapped


# process_mtp_loss's parameters in megatron-core 0.19.2, whose arithmetic process_mtp_loss follows
_PROCESS_PARAMETERS = ("hidden_states", "labels", "loss_mask", "output_layer", "output_weight", "runtime_gather_output",
                       "is_training", "compute_language_model_loss", "config", "cp_group", "tp_group",
                       "packed_seq_params", "scale_logits_fn", "input_ids")


def install() -> None:
    """Put HSAP's MTP pieces into megatron-core (idempotent; see the module docstring). Raises
    ``ConfigError`` when megatron-core's ``process_mtp_loss`` is not the one HSAP's follows."""
    from megatron.core.models.gpt import gpt_layer_specs, gpt_model

    mtp = _megatron_mtp()
    found = tuple(_process_signature().parameters)
    if found != _PROCESS_PARAMETERS:
        raise ConfigError(f"megatron-core's process_mtp_loss takes {found}; HSAP's multi-token prediction follows "
                          f"megatron-core 0.19.2's {_PROCESS_PARAMETERS}: install megatron-core 0.19.2 or drop "
                          "--mtp-num-layers")
    _put(mtp, "roll_tensor", lambda orig: _mark(roll_tensor, orig))
    _put(gpt_model, "process_mtp_loss", lambda orig: _mark(process_mtp_loss, orig))
    from megatron.core.models.hybrid import hybrid_model  # HybridModel's MTP: inner layers from the HSAP stack spec

    _put(hybrid_model, "process_mtp_loss", lambda orig: _mark(process_mtp_loss, orig))
    _put(gpt_layer_specs, "get_gpt_mtp_block_spec", mtp_block_spec)
    builders = sys.modules.get("gpt_builders")  # a Megatron-LM checkout's model builder (core_v0.19.0)
    if builders is not None:
        _put(builders, "get_gpt_mtp_block_spec", mtp_block_spec)
