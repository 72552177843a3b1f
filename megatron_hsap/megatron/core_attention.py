"""HSAP core attention: megatron-core 0.19.2's core-attention interface over ``hsap_attn_func``.

Plugged in through the layer spec (``self_attention.submodules.core_attention``). The plan comes
with the batch (:class:`~megatron_hsap.megatron.batch.HSAPPackedSeqParams`, put there by
:func:`~megatron_hsap.megatron.batch.get_batch_on_this_cp_rank`): the layer reads host objects only
and never syncs the device. Two input formats:

- THD (``qkv_format="thd"``): q ``[t, np, hn]``, k/v ``[t, ng, hn]`` in the plan's local order,
  documents from the plan; returns ``[t, np·hn]``.
- SBHD (``qkv_format="sbhd"``): q ``[s, b, np, hn]``, k/v ``[s, b, ng, hn]``; every sample is one
  document and all samples share one layout, so the batch folds into the head axis (q head
  ``b_i·np + h`` still maps to kv head ``b_i·ng + h // (np/ng)``); the plan is compiled for
  ``cu_seqlens = [0, s]`` with ``b·np`` / ``b·ng`` heads. Returns ``[s, b, np·hn]``.

What it refuses (``ConfigError`` at construction or before any collective; ``BatchError`` for a
batch without the HSAP marker) instead of computing something else:
cross attention; attention masks other than causal / padding-causal (no_mask, padding, arbitrary,
causal_bottom_right); an explicit ``attention_mask`` tensor (the mask is implied by the documents);
``attention_bias``; a sliding window with ``right != 0``; a ``softmax_scale``
that disagrees with ``config.softmax_scale``; fp8 dot-product attention; a plan whose CP size or
topology differs from the model's groups. A plan whose head counts
or local token count differ from this layer's input, or a batch sharded for another CP rank, raises
``RuntimeMismatchError``. Multi-latent
attention runs through :mod:`megatron_hsap.megatron.mla` (k/v per q head, ``v_channels`` its own).
Sliding windows (``window_size`` / ``window_attn_skip_freq``, per layer as megatron-core decides):
the layer runs the batch plan's ``compile_on_layout`` plan, on the same token layout.

Attention sinks (``softmax_type`` "learnable" / "off-by-one"): ``softmax_offset`` is megatron-core's
own parameter — same name, ``[num_attention_heads / TP]`` per TP rank, TP-sharded on axis 0 in the
distributed checkpoint, as ``DotProductAttention`` declares it — so checkpoints load unchanged; it is
passed to ``hsap_attn_func(sinks=...)``, which merges it once per row after the last LSE merge. Each
CP rank's gradient holds its own rows' contribution; Megatron's DP×CP gradient all-reduce sums them.

Attention dropout (``config.attention_dropout``, in training only): ``hsap_attn_func(dropout_p=...)``
inside Megatron's model-parallel RNG tracker (``get_cuda_rng_tracker().fork()``, as Transformer
Engine's attention forks it), so TP ranks draw different masks and activation recomputation, which
restores the tracker's states, redraws the same ones (``runtime/dropout.py``).

qk-clip (``config.qk_clip`` / ``log_max_attention_logit``): ``current_max_attn_logits [np]``, the
attribute megatron-core's ``clip_qk`` reads, all-reduces with MAX over DP×CP and resets, holds the
maxima of ``hsap_attn_func(max_logits=...)`` since the last reset (``runtime/max_logits.py``): this
rank's pairs on its head slice, ``-inf`` on the heads other CP ranks compute.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron_hsap.megatron.windows import layer_window
from torch import Tensor

from megatron_hsap.errors import BatchError, ConfigError, RuntimeMismatchError
from megatron_hsap.megatron.batch import is_hsap_sharded
from megatron_hsap.megatron.megatron_lm import WRAPPERS
from megatron_hsap.plan import shared_layout

if TYPE_CHECKING:
    from megatron_hsap.plan import Plan

__all__ = ["HSAPCoreAttention", "SUPPORTED_MASK_TYPES", "SOFTMAX_TYPES", "require_hsap_core_attention"]

SUPPORTED_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")  # megatron-core's TransformerConfig.softmax_type

_NOT_SHARDED = (
    "HSAPCoreAttention got a batch that was not sharded by HSAP (packed_seq_params is {kind}, "
    "without the HSAP marker). Its tokens are in another layout (Megatron's zigzag or none), so "
    "attention would be computed over the wrong tokens. Shard batches with "
    f"megatron_hsap.megatron.get_batch_on_this_cp_rank ({WRAPPERS} or "
    "--context-parallel-impl hsap do it); `--spec megatron_hsap.megatron.spec HSAP_LAYER_SPEC` alone "
    "is not enough"
)


def _hsap_attn_func() -> Any:
    from megatron_hsap.runtime import hsap_attn_func  # torch-only layer; imported when first used

    return hsap_attn_func


def _per_partition(total: int, tp: int, name: str) -> int:
    if total % tp:
        raise ConfigError(f"{name}={total} is not divisible by tensor_model_parallel_size={tp}")
    return total // tp


class HSAPCoreAttention(MegatronModule):
    """Causal per-document attention over the HSAP CP group (megatron-core core attention).

    Constructor kwargs are megatron-core's (``Attention`` passes ``config, layer_number,
    attn_mask_type, attention_type, cp_comm_type, softmax_scale, pg_collection``); ``k_channels`` /
    ``v_channels`` are accepted as Transformer Engine's ``TEDotProductAttention`` does.
    ``cp_comm_type`` selects Transformer Engine's CP algorithm and is ignored: HSAP replaces it.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        del cp_comm_type
        self.layer_number = max(1, int(layer_number))
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.pg_collection = pg_collection
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)
        self.head_dim = int(k_channels or config.kv_channels)
        self.head_dim_v = int(v_channels or config.kv_channels)
        self.softmax_scale = self._resolve_scale(softmax_scale)
        tp = self._tp_size()
        self.num_heads = _per_partition(config.num_attention_heads, tp, "num_attention_heads")
        groups = config.num_query_groups or config.num_attention_heads
        self.num_kv_heads = max(1, groups // tp)
        if getattr(config, "multi_latent_attention", False):  # MLA up-projects k and v per q head
            self.num_kv_heads = self.num_heads
        self._refuse_unsupported_config()
        self._init_softmax_offset()
        # qk-clip (megatron-core's optimizer/qk_clip.py reads, all-reduces with MAX over DP×CP and
        # resets it): per q head of this TP rank, the largest scaled logit since the last reset
        self.track_max_logits = bool(getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False))
        self.current_max_attn_logits: Tensor | None = None

    # ------------------------------------------------------------------ construction checks
    def _resolve_scale(self, softmax_scale: float | None) -> float:
        cfg_scale = getattr(self.config, "softmax_scale", None)
        if softmax_scale is not None and cfg_scale is not None and not math.isclose(softmax_scale, cfg_scale, rel_tol=1e-12):
            raise ConfigError(
                f"softmax_scale={softmax_scale} disagrees with config.softmax_scale={cfg_scale}; "
                "set one of them (Megatron passes config.softmax_scale)"
            )
        scale = softmax_scale if softmax_scale is not None else cfg_scale
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies the
        # fp32 softmax input back: the same function, so the plain scale is used.
        return float(scale) if scale is not None else 1.0 / math.sqrt(self.head_dim)

    def _pg(self, name: str) -> Any:
        """Group ``name`` ("tp", "cp") of the ``pg_collection`` Megatron passed, else None (then the
        callers fall back to Megatron's global parallel state)."""
        return getattr(self.pg_collection, name, None) if self.pg_collection is not None else None

    def _tp_size(self) -> int:
        tp_group = self._pg("tp")
        if tp_group is not None:
            return int(tp_group.size())
        return int(self.config.tensor_model_parallel_size)

    def _refuse_unsupported_config(self) -> None:
        cfg = self.config
        if self.attention_type != "self":
            raise ConfigError(f"attention_type={self.attention_type!r}: HSAP supports self attention only")
        if self.attn_mask_type not in SUPPORTED_MASK_TYPES:
            raise ConfigError(
                f"attn_mask_type={self.attn_mask_type.name}: HSAP computes causal attention inside each "
                "document only (causal / padding_causal); use the causal GPT layer spec"
            )
        # sliding window of this layer (megatron/windows.py): its plan is compile_on_layout of the batch plan
        self.window_size = layer_window(cfg, self.layer_number)
        if getattr(cfg, "softmax_type", "vanilla") not in SOFTMAX_TYPES:
            raise ConfigError(f"softmax_type={cfg.softmax_type!r}: HSAP supports {', '.join(SOFTMAX_TYPES)}")
        if getattr(cfg, "multi_latent_attention", False) and getattr(cfg, "mla_down_proj_fusion", False):
            raise ConfigError(
                "mla_down_proj_fusion: HybridModel then swaps MLA for FusedMLASelfAttention, whose RoPE assumes "
                "Megatron's token layout; HSAP applies MLA's RoPE by position: set mla_down_proj_fusion=False"
            )
        if getattr(cfg, "fp8_dot_product_attention", False):
            raise ConfigError("fp8_dot_product_attention is not supported by HSAP; set TransformerConfig.fp8_dot_product_attention=False")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.num_heads} q heads per TP rank are not a multiple of {self.num_kv_heads} kv heads")

    def _init_softmax_offset(self) -> None:
        """megatron-core's ``softmax_offset`` (``DotProductAttention.__init__``): None (vanilla), a
        fixed zero logit per head (off-by-one), or a learnable ``[np]`` parameter (GPT-OSS sinks)."""
        kind = getattr(self.config, "softmax_type", "vanilla")
        if kind == "vanilla":
            self.softmax_offset = None
            return
        device = "cpu" if getattr(self.config, "use_cpu_initialization", False) else torch.cuda.current_device()
        sinks = torch.zeros(self.num_heads, device=device, dtype=self.config.params_dtype)
        if kind == "off-by-one":
            self.register_buffer("softmax_offset", sinks, persistent=False)  # not in checkpoints (as Megatron)
            return
        self.softmax_offset = torch.nn.Parameter(sinks)
        if self.config.perform_initialization:
            self.softmax_offset = self.config.init_method(self.softmax_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """The learnable ``softmax_offset`` TP-sharded on axis 0, exactly as megatron-core's
        ``DotProductAttention.sharded_state_dict`` writes it (nothing else is stored here)."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True) if getattr(self.config, "softmax_type", "vanilla") == "learnable" else {}
        tp_group = self._pg("tp")
        if tp_group is None:
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"])  # fmt: skip

    # ------------------------------------------------------------------ forward checks
    def _check_call(self, attention_mask: Tensor | None, attn_mask_type: AttnMaskType | None,
                    attention_bias: Tensor | None, packed_seq_params: Any) -> None:
        if not is_hsap_sharded(packed_seq_params):
            kind = "None" if packed_seq_params is None else type(packed_seq_params).__name__
            raise BatchError(_NOT_SHARDED.format(kind=kind))
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in SUPPORTED_MASK_TYPES:
            raise ConfigError(f"attn_mask_type={mask_type.name}: HSAP supports causal / padding_causal only")
        if attention_mask is not None:
            raise ConfigError(
                "HSAP derives the causal per-document mask from the plan; an explicit attention_mask "
                "cannot be honoured. Pass attention_mask=None (get_batch_on_this_cp_rank returns None)"
            )
        if attention_bias is not None:
            raise ConfigError("attention_bias is not supported by HSAP")

    def _tp_rank(self) -> int:
        tp_group = self._pg("tp")
        if tp_group is not None:
            return int(tp_group.rank())
        mpu = sys.modules.get("megatron.core.parallel_state")
        return int(mpu.get_tensor_model_parallel_rank()) if mpu is not None and mpu.model_parallel_is_initialized() else 0

    def _dropout(self, query: Tensor, heads: int) -> tuple[dict[str, Any], Any]:
        """(``hsap_attn_func``'s dropout arguments for this call of ``heads`` q heads, the RNG context
        to run it in): the configured probability in training, inside Megatron's model-parallel RNG
        tracker when it is set up; none in evaluation. On the CPU the ``cpu`` kernel's seed is drawn
        here, before the fork, from the CPU generator (which activation recomputation restores too):
        drawn inside, it would change the CPU generator within the CUDA fork, which Megatron warns
        about; its masks are keyed on global heads (TP rank × heads), so a TP run draws the TP=1
        run's."""
        p = self.dropout_p if self.training else 0.0
        if p == 0.0:
            return {}, contextlib.nullcontext()
        from megatron.core import tensor_parallel

        from megatron_hsap.runtime.dropout import draw_seed

        seed = draw_seed(query.device) if query.device.type == "cpu" else None  # (GPU kernels draw their own)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        drop = {"dropout_p": p, "dropout_seed": seed, "dropout_head_offset": self._tp_rank() * heads}
        return drop, tracker.fork() if tracker.is_initialized() else contextlib.nullcontext()

    def _groups(self, plan: "Plan", cp_rank: int) -> tuple[Any, Any]:
        """(intra, inter) groups for ``hsap_attn_func``: HSAP's, checked against the plan; a
        flattened ``1 × P`` or ``P × 1`` plan (plan/flatten.py) runs on their CP group alone
        (``HSAPGroups.levels_for``)."""
        from megatron_hsap.megatron import parallel_state as hsap_ps

        cp_group = self._pg("cp")
        if cp_group is None:
            mpu = sys.modules.get("megatron.core.parallel_state")
            if mpu is not None and mpu.model_parallel_is_initialized():
                cp_group = mpu.get_context_parallel_group(check_initialized=False)
        if cp_group is not None and cp_group.size() != plan.cp_size:
            raise ConfigError(
                f"the batch's plan spans {plan.cp_size} CP ranks but this model's context-parallel "
                f"group has {cp_group.size()}; compile the plan with the model's CP size"
            )
        if plan.cp_size == 1:
            return None, None
        if not hsap_ps.is_hsap_initialized():
            raise ConfigError("HSAP groups are not initialised: call initialize_hsap(intra_size, inter_size) after initialize_model_parallel")
        groups = hsap_ps.get_hsap_groups()
        return groups.levels_for(plan, cp_rank=cp_rank)

    def _check_heads(self, plan: "Plan", t: int, heads: int, kv_heads: int, what: str) -> None:
        opts = plan.options
        want_kv = opts.num_kv_heads or opts.num_heads
        if (opts.num_heads, want_kv) != (heads, kv_heads):
            raise RuntimeMismatchError(
                f"the plan was compiled for {opts.num_heads} q / {want_kv} kv heads but {what} has "
                f"{heads} / {kv_heads}; compile it with plan_kwargs_from_config(config)"
            )
        if t != plan.local_tokens:
            raise RuntimeMismatchError(
                f"{what} holds {t} tokens but the plan gives this rank {plan.local_tokens}; the batch "
                "was sharded with another plan"
            )

    def _sinks(self, query: Tensor, batch: int) -> Tensor | None:
        """``softmax_offset`` as ``[b·np]`` sink logits (SBHD folds the batch into heads: sample
        ``b_i``'s head ``h`` is head ``b_i·np + h``); on q's device, differentiable."""
        if self.softmax_offset is None:
            return None
        sinks = self.softmax_offset.to(query.device)
        return sinks.repeat(batch) if batch > 1 else sinks

    def _max_logits(self, query: Tensor, heads: int) -> dict[str, Tensor]:
        """``hsap_attn_func``'s ``max_logits`` accumulator for this call (``-inf`` per folded head),
        when qk-clip or its logging is on."""
        if not self.track_max_logits:
            return {}
        return {"max_logits": torch.full((heads,), float("-inf"), dtype=torch.float32, device=query.device)}

    def _keep_max_logits(self, ml: dict[str, Tensor], batch: int) -> None:
        """Fold this call's maxima into ``current_max_attn_logits [np]`` (SBHD: the max over the
        batch's samples, whose heads ``hsap_attn_func`` saw side by side), as Transformer Engine's
        attention does with its ``return_max_logit`` output. Heads another CP rank computes stay
        ``-inf`` here until ``clip_qk``'s MAX all-reduce."""
        if not ml:
            return
        got = ml["max_logits"].view(batch, -1).amax(dim=0)
        prev = self.current_max_attn_logits
        self.current_max_attn_logits = got if prev is None else torch.maximum(prev, got)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """THD: q ``[t, np, hn]``, k/v ``[t, ng, hn]`` → ``[t, np·hn]``.
        SBHD: q ``[s, b, np, hn]``, k/v ``[s, b, ng, hn]`` → ``[s, b, np·hn]``."""
        self._check_call(attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        plan, cp_rank = packed_seq_params.hsap_plan, int(packed_seq_params.hsap_cp_rank)
        plan = shared_layout.compile_on_layout(plan, self.window_size)  # this layer's window on the batch's layout (cached)
        fmt = packed_seq_params.qkv_format or "thd"
        if fmt == "thd":
            if query.dim() != 3:
                raise RuntimeMismatchError(f"THD query must be [t, np, hn], got {tuple(query.shape)}")
            self._check_heads(plan, query.shape[0], query.shape[1], key.shape[1], "this THD batch")
            intra, inter = self._groups(plan, cp_rank)
            drop, rng = self._dropout(query, query.shape[1])
            ml = self._max_logits(query, query.shape[1])
            with rng:
                out = _hsap_attn_func()(query, key, value, plan, intra_group=intra, inter_group=inter,
                                     softmax_scale=self.softmax_scale, sinks=self._sinks(query, 1), **drop, **ml)  # [t, np, dv]
            self._keep_max_logits(ml, 1)
            return out.reshape(out.shape[0], -1)
        if fmt == "sbhd":
            if query.dim() != 4:
                raise RuntimeMismatchError(f"SBHD query must be [s, b, np, hn], got {tuple(query.shape)}")
            s, b, heads, _ = query.shape
            self._check_heads(plan, s, b * heads, b * key.shape[2], "this SBHD batch (batch folded into heads)")
            intra, inter = self._groups(plan, cp_rank)
            # [s, b, n, d] -> [s, b·n, d]: a view; sample b_i's heads stay contiguous.
            drop, rng = self._dropout(query, b * heads)
            ml = self._max_logits(query, b * heads)
            with rng:
                out = _hsap_attn_func()(query.reshape(s, b * heads, -1), key.reshape(s, b * key.shape[2], -1),
                                     value.reshape(s, b * value.shape[2], -1), plan, intra_group=intra,
                                     inter_group=inter, softmax_scale=self.softmax_scale,
                                     sinks=self._sinks(query, b), **drop, **ml)  # [s, b·np, dv]
            self._keep_max_logits(ml, b)
            return out.reshape(s, b, -1)
        raise ConfigError(f"qkv_format={fmt!r} is not supported by HSAP; use 'thd' (packed) or 'sbhd'")


def require_hsap_core_attention(attention: Any, what: str) -> None:
    """Refuse a self-attention whose core attention is not HSAP's.

    With ``attention_backend=local`` Megatron's builder puts its own ``DotProductAttention`` into the
    spec, which would attend HSAP-sharded tokens as if they were one local sequence.
    """
    if not isinstance(attention.core_attention, HSAPCoreAttention):
        raise ConfigError(
            f"HSAP's {what} got core attention {type(attention.core_attention).__name__}, not "
            "HSAPCoreAttention (attention_backend='local' replaces it in Megatron's builder): use "
            "attention_backend auto/flash/fused with the HSAP layer spec"
        )
