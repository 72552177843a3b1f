"""RoPE by each token's position inside its document (docs/design.md §2.3).

Megatron applies rotary embeddings in ``Attention.forward`` and, for THD under CP, assumes
Transformer Engine's zigzag layout (chunks ``r`` and ``2P-1-r`` of every document). HSAP's layout
is different (contiguous inter chunks), so :class:`HSAPSelfAttention` applies RoPE itself: it takes
the rotary table GPTModel computes (``[L, 1, 1, rot_dim]``, angle of position ``p`` in row ``p``,
including Megatron's ``rotary_percent``, ``rotary_base``, interpolation and Llama-3 scaling, or
YaRN's ``YarnRotaryEmbedding`` under ``--position-embedding-type yarn``), picks row
``position_ids[i]`` for local token ``i`` (positions come with the batch in
:class:`~megatron_hsap.megatron.batch.HSAPPackedSeqParams`), and rotates q and k right after the
QKV projection, cos and sin scaled by YaRN's concentration factor as Megatron's attention scales
them (``Attention._yarn_concentration_factor``: 1 without YaRN; GPTModel drops the factor its YaRN
table returns and leaves it to the attention). Everything else is Megatron's ``SelfAttention``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from megatron_hsap.errors import BatchError, ConfigError
from megatron_hsap.megatron.batch import is_hsap_sharded
from megatron_hsap.megatron.megatron_lm import WRAPPERS

__all__ = ["HSAPSelfAttention", "apply_rope_by_position", "rope_freqs_at"]

_NOT_SHARDED = (
    "this batch was not sharded by HSAP (packed_seq_params lacks the HSAP marker): the HSAP layer "
    "spec only works with megatron_hsap.megatron.get_batch_on_this_cp_rank, which puts the plan and "
    f"per-token positions in packed_seq_params. Use {WRAPPERS} or "
    "--context-parallel-impl hsap; --spec alone keeps Megatron's zigzag batch sharding"
)


def rope_freqs_at(table: Tensor, positions: Tensor) -> Tensor:
    """Rows of a rotary table at given positions.

    Args:
        table: ``[L, 1, 1, rot_dim]`` angles (row ``p`` = position ``p``), as GPTModel passes them.
        positions: ``[t]`` int64 position of each token inside its document.
    Returns:
        ``[t, 1, 1, rot_dim]`` angles, one row per token.
    """
    return table.index_select(0, positions.to(device=table.device, dtype=torch.long))


def _rotate_pairs(x: Tensor, interleaved: bool) -> Tensor:
    """The 90° partner of every rotated pair: ``(x1, x2) -> (-x2, x1)``.

    Non-interleaved pairs are ``(i, i + r/2)`` (GPT-NeoX / Llama halves); interleaved pairs are
    ``(2i, 2i+1)`` (GPT-J), matching how the table repeats each angle (``cat`` vs ``repeat``).
    """
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((-odd, even), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope_by_position(x: Tensor, freqs: Tensor, *, interleaved: bool = False, mscale: float = 1.0) -> Tensor:
    """Rotate the first ``rot_dim`` channels of ``x`` by per-token angles.

    Args:
        x: ``[t, b, h, d]`` queries or keys (``b`` may be 1 for THD).
        freqs: ``[t, 1, 1, rot_dim]`` angles (``rot_dim <= d``, even); channels past ``rot_dim`` pass
            through unchanged (``rotary_percent < 1``).
        interleaved: Megatron's ``rotary_interleaved``.
        mscale: YaRN's concentration factor (1.0 otherwise), multiplies cos and sin.
    Returns:
        ``[t, b, h, d]`` in ``x``'s dtype.
    """
    rot_dim = freqs.shape[-1]
    if rot_dim > x.shape[-1] or rot_dim % 2:
        raise ConfigError(f"rotary table has {rot_dim} channels but heads have {x.shape[-1]}; need an even count <= head dim")
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    cos = (torch.cos(freqs) * mscale).to(x.dtype)
    sin = (torch.sin(freqs) * mscale).to(x.dtype)
    rotated = rot * cos + _rotate_pairs(rot, interleaved) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


class HSAPSelfAttention(SelfAttention):
    """Megatron ``SelfAttention`` that applies RoPE by per-token position ids (HSAP layout).

    Same constructor and forward as ``SelfAttention``; the rotary table passed to ``forward`` is
    consumed here (the base class receives ``rotary_pos_emb=None``). Refuses, with
    :class:`ConfigError`, what it cannot honour: ``fused_single_qkv_rope`` (fuses Megatron's
    positional RoPE into the QKV split), inference contexts (KV caches: HSAP is for training) and
    multimodal RoPE; with a rotary table but no HSAP-sharded batch it raises :class:`BatchError`.
    """

    def __init__(
        self,
        config: Any,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
    ) -> None:
        if getattr(config, "fused_single_qkv_rope", False):
            raise ConfigError(
                "fused_single_qkv_rope applies RoPE by row index inside the fused QKV split; HSAP needs "
                "RoPE by position inside each document: set TransformerConfig.fused_single_qkv_rope=False"
            )
        if getattr(config, "mrope_section", None):
            raise ConfigError("multimodal RoPE (mrope_section) is not supported by HSAP yet; use position_embedding_type='rope'")
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

        require_hsap_core_attention(self, "self-attention")

        # Per-forward state: set in forward(), read in get_query_key_value_tensors(), cleared after.
        self._hsap_rope: tuple[Tensor | None, Tensor | None] | None = None

    def _layer_skips_rope(self) -> bool:
        freq = self.config.no_rope_freq
        return bool(freq[self.layer_number - 1]) if freq else False

    def _per_token_freqs(self, rotary_pos_emb: Any, packed_seq_params: Any) -> tuple[Tensor | None, Tensor | None] | None:
        if rotary_pos_emb is None or self._layer_skips_rope():
            return None
        if not is_hsap_sharded(packed_seq_params):
            raise BatchError(_NOT_SHARDED)
        positions = packed_seq_params.hsap_position_ids
        tables = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
        need = int(packed_seq_params.max_seqlen_q or 0)
        out: list[Tensor | None] = []
        for table in tables:
            if table is None:
                out.append(None)
                continue
            if table.dim() != 4 or table.shape[0] < need:
                # GPTModel slices its table the zigzag way when qkv_format is not "thd" under CP.
                raise BatchError(
                    f"rotary table has {table.shape[0]} rows but documents reach {need} tokens: the "
                    "model sliced it for another layout. HSAP needs the full table: pass THD batches "
                    "(qkv_format='thd') from get_batch_on_this_cp_rank"
                )
            out.append(rope_freqs_at(table, positions))
        return out[0], out[1]

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None,
        key_value_states: Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: Tensor | tuple[Tensor, Tensor] | None = None,
        rotary_pos_cos: Tensor | None = None,
        rotary_pos_sin: Tensor | None = None,
        rotary_pos_cos_sin: Tensor | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``SelfAttention.forward`` with RoPE by position: ``hidden_states`` ``[t, 1, h]`` (THD)
        or ``[s, b, h]``; returns ``(output [.., h], bias)``."""
        if inference_context is not None or inference_params is not None:
            raise ConfigError("HSAP attention is for training; inference with KV caches is not supported")
        if rotary_pos_cos is not None or rotary_pos_sin is not None or rotary_pos_cos_sin is not None:
            raise ConfigError("precomputed rotary cos/sin (flash decode / flashinfer) is not supported by HSAP")
        self._hsap_rope = self._per_token_freqs(rotary_pos_emb, packed_seq_params)
        try:
            return super().forward(
                hidden_states,
                attention_mask,
                key_value_states=key_value_states,
                rotary_pos_emb=None,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
            )
        finally:
            self._hsap_rope = None

    def get_query_key_value_tensors(
        self,
        hidden_states: Tensor,
        key_value_states: Tensor | None = None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ) -> Any:
        """Megatron's projection, then RoPE by position on q ``[t, b, np, hn]`` and k ``[t, b, ng, hn]``."""
        out = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
        )
        if self._hsap_rope is None:
            return out
        if not split_qkv:
            raise ConfigError("HSAP RoPE needs split q/k/v (fused_single_qkv_rope must be off)")
        query, key, *rest = out
        q_freqs, k_freqs = self._hsap_rope
        interleaved, mscale = self.config.rotary_interleaved, self._yarn_concentration_factor
        if q_freqs is not None:
            query = apply_rope_by_position(query, q_freqs, interleaved=interleaved, mscale=mscale)
        if k_freqs is not None:
            key = apply_rope_by_position(key, k_freqs, interleaved=interleaved, mscale=mscale)
        return (query, key, *rest)
