"""Multi-latent attention (DeepSeek-V2/V3) under HSAP: RoPE of the decoupled part by position (docs/design.md §2.3).

megatron-core's ``MLASelfAttention`` applies RoPE to the decoupled ``qk_pos_emb_head_dim`` channels
of q and k itself, inside ``get_query_key_value_tensors``; for packed (THD) batches it does so with
``cu_seqlens``, assuming Transformer Engine's zigzag CP layout — wrong for HSAP's layout, where a
rank's rows are contiguous pieces of documents. :class:`HSAPMLASelfAttention` keeps every projection,
norm and parameter of Megatron's class (checkpoints load unchanged) and changes only where the
angles come from: the MLA rotary module's own table (``RotaryEmbedding`` for ``rope_type="rope"``,
``YarnRotaryEmbedding`` for ``"yarn"``, whose rows depend on the position alone, with YaRN's
concentration factor ``mscale``) is read at each token's position inside its document
(:func:`~megatron_hsap.megatron.rotary.rope_freqs_at`), and Megatron's row-wise (non-THD) RoPE path
applies it, MLA's interleaving included. The value head size stays ``v_head_dim`` (HSAP plans carry
``head_dim_v``): Megatron's THD workaround that pads v to the q head size is skipped.

Refused (``ConfigError``): ``apply_rope_fusion`` (TE's fused MLA RoPE slices by CP rank the zigzag
way), latent caching and inference contexts (HSAP is for training), experimental attention variants
(DSA) and core attentions other than :class:`HSAPCoreAttention`; a batch not sharded by HSAP raises
``BatchError``.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from torch import Tensor

from megatron_hsap.errors import BatchError, ConfigError
from megatron_hsap.megatron.batch import is_hsap_sharded
from megatron_hsap.megatron.megatron_lm import WRAPPERS
from megatron_hsap.megatron.rotary import rope_freqs_at

__all__ = ["HSAPMLASelfAttention", "MLA_ROPE_TYPES"]

MLA_ROPE_TYPES = ("rope", "yarn")  # megatron-core's MLATransformerConfig.rope_type values

_NOT_SHARDED = (
    "MLA under HSAP needs a batch sharded by megatron_hsap.megatron.get_batch_on_this_cp_rank "
    "(packed_seq_params carries the plan and each token's position inside its document); this one "
    f"lacks the HSAP marker. Use {WRAPPERS} or --context-parallel-impl hsap"
)


class HSAPMLASelfAttention(MLASelfAttention):
    """megatron-core ``MLASelfAttention`` with the decoupled RoPE applied by per-token position.

    Same constructor, parameters and forward as ``MLASelfAttention``; the HSAP layer spec swaps it
    in for ``MLASelfAttention`` (``--multi-latent-attention``)."""

    def __init__(
        self,
        config: Any,
        submodules: MLASelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
    ) -> None:
        rope_type = getattr(config, "rope_type", "rope")
        if rope_type not in MLA_ROPE_TYPES:
            raise ConfigError(f"--rope-type {rope_type}: HSAP's MLA applies RoPE by position for {', '.join(MLA_ROPE_TYPES)} only")
        if getattr(config, "apply_rope_fusion", False):
            raise ConfigError(
                "apply_rope_fusion: Transformer Engine's fused MLA RoPE assumes the zigzag CP layout; HSAP "
                "applies MLA's RoPE by position: pass --no-rope-fusion (TransformerConfig.apply_rope_fusion=False)"
            )
        if getattr(config, "cache_mla_latents", False):
            raise ConfigError("cache_mla_latents is for inference; HSAP attention is for training: set it False")
        if getattr(config, "experimental_attention_variant", None) is not None:
            raise ConfigError(
                f"experimental_attention_variant={config.experimental_attention_variant!r} (e.g. DSA) is not "
                "supported by HSAP's MLA; unset it"
            )
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            pp_layer_offset=pp_layer_offset,
            name=name,
        )
        from megatron_hsap.megatron.core_attention import require_hsap_core_attention

        require_hsap_core_attention(self, "MLA")

    def _angles_by_position(self, packed_seq_params: Any) -> Any:
        """What MLA's rotary module returns, one row per local token: ``[t, 1, 1, rot]`` angles
        (and YaRN's ``mscale`` for ``rope_type="yarn"``)."""
        need = int(packed_seq_params.max_seqlen_q or 0) or int(packed_seq_params.hsap_position_ids.max()) + 1
        table = self.rotary_pos_emb(need, packed_seq=True)  # packed_seq: the whole table, no CP slicing
        if self.config.rope_type == "yarn":
            emb, mscale = table
            return rope_freqs_at(emb, packed_seq_params.hsap_position_ids), mscale
        return rope_freqs_at(table, packed_seq_params.hsap_position_ids)

    def get_query_key_value_tensors(
        self,
        hidden_states: Tensor,
        key_value_states: Tensor | None = None,
        position_ids: Tensor | None = None,
        packed_seq_params: Any = None,
        inference_context: Any = None,
        *,
        inference_params: Any = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Megatron's down/up projections with RoPE by position. ``hidden_states`` ``[t, 1, h]``
        (THD) or ``[s, b, h]``; returns q ``[t, np, dqk + drope]``, k likewise, v ``[t, np, dv]``
        (``[s, b, np, ·]`` for SBHD) and the compressed q / kv."""
        if inference_context is not None or inference_params is not None:
            raise ConfigError("HSAP attention is for training; inference with KV caches is not supported")
        if not is_hsap_sharded(packed_seq_params):
            raise BatchError(_NOT_SHARDED)
        angles = self._angles_by_position(packed_seq_params)
        rope = self.rotary_pos_emb
        # Megatron's call of the rotary module inside the projection now yields the per-token rows;
        # with packed_seq_params=None it takes its row-wise path (no cu_seqlens, no zigzag slicing).
        rope.forward = lambda *args, **kwargs: angles
        try:
            query, key, value, q_compressed, kv_compressed = super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, None, None
            )
        finally:
            del rope.forward  # back to the class's forward
        if (packed_seq_params.qkv_format or "thd") == "thd":  # [t, 1, ...] -> [t, ...] as Megatron's THD path
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            q_compressed, kv_compressed = q_compressed.squeeze(1), kv_compressed.squeeze(1)
        return query, key, value, q_compressed, kv_compressed

    def _run_core_attention(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                            packed_seq_params: Any = None, attn_mask_type: Any = None, **extra_kwargs: Any) -> Tensor:  # fmt: skip
        """HSAP core attention with v at its own head size (no pad to the q head size)."""
        return self.core_attention(
            query, key, value, attention_mask, packed_seq_params=packed_seq_params,
            attn_mask_type=attn_mask_type if attn_mask_type is not None else self.attn_mask_type, **extra_kwargs,
        )  # fmt: skip
