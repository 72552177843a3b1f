"""The CP=1 reference GPT for the equivalence tests: independent of everything HSAP wrote.

- Core attention: per-document causal attention in float64 via ``tests.reference`` (dense mask
  from the documents of Megatron's own ``PackedSeqParams.cu_seqlens_q``), cast back to fp32.
- RoPE: megatron-core's own ``SelfAttention`` THD path, which is exact at CP=1 (it restarts the
  table at every document of ``cu_seqlens``).
- Batches: flattened with megatron-core's ``flatten_batch_for_packed_sequences``; positions are
  the dataset's own per-document ``position_ids``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import flatten_batch_for_packed_sequences

from tests.reference import reference_attention


class ReferenceCoreAttention(MegatronModule):
    """Float64 dense-mask per-document attention with megatron-core's core-attention interface."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        # megatron-core's own per-layer rule for sliding windows (keys at most `left` back)
        from megatron.core.transformer.utils import is_layer_window_attention

        window = getattr(config, "window_size", None)
        on = is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number)
        self.window_left = int(window[0]) if on else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        """q ``[t, np, hn]``, k/v ``[t, ng, hn]`` (THD) → ``[t, np·hn]``."""
        cu = packed_seq_params.cu_seqlens_q.tolist()
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
        doc = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(zip(cu[:-1], cu[1:]))])
        out, _ = reference_attention(query, key, value, pos, pos, doc, doc, self.scale, self.window_left)
        return out.to(query.dtype).reshape(query.shape[0], -1)


def reference_layer_spec() -> Any:
    """megatron-core's local GPT layer spec with only the core attention replaced."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    attn = spec.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=ReferenceCoreAttention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))


def reference_inputs(batch: dict[str, torch.Tensor]) -> tuple[dict[str, Any], int, int]:
    """Megatron-style THD inputs for one micro-batch; returns (inputs, real tokens, loss tokens)."""
    flat = flatten_batch_for_packed_sequences({k: v.clone() for k, v in batch.items()})
    cu = flat["cu_seqlens"].reshape(-1).to(torch.int32)
    lengths = cu[1:] - cu[:-1]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=int(lengths.max()), max_seqlen_kv=int(lengths.max()))
    inputs = {
        "tokens": flat["tokens"], "labels": flat["labels"], "loss_mask": flat["loss_mask"],
        "position_ids": flat["position_ids"], "packed_seq_params": params,
    }
    return inputs, int(flat["tokens"].numel()), int(flat["loss_mask"].sum())
