"""RoPE by position equals Megatron's own RoPE on each document alone.

Reference: megatron-core's ``apply_rotary_pos_emb`` (unfused, bshd path) on one unpacked document
with positions 0..n-1 and the table of megatron-core's ``RotaryEmbedding``. Ours rotates tokens of
a packed, permuted stream by their position inside their document; each document's rows must match
Megatron's result for that document alone. Same float32 ops on the same values: the tolerance only
covers a different association of ``x·cos + rot(x)·sin`` (1 ulp-level).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hsap.megatron import cpu_shims
from megatron_hsap.megatron.batch import positions_in_documents
from megatron_hsap.megatron.rotary import apply_rope_by_position, rope_freqs_at

ATOL = 1e-6  # float32, |x| ~ 1: rounding only


class _NoCP:
    """A CP group of one (Megatron looks the group up even on its non-CP path)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _megatron_rope(x: torch.Tensor, table: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    return apply_rotary_pos_emb(x, table, config=config, cp_group=_NoCP())


def _config(interleaved: bool) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                             apply_rope_fusion=False, rotary_interleaved=interleaved)


def _table(head_dim: int, length: int, *, percent: float, interleaved: bool, scaling: bool = False) -> torch.Tensor:
    rope = RotaryEmbedding(kv_channels=head_dim, rotary_percent=percent, rotary_interleaved=interleaved,
                           rope_scaling=scaling, use_cpu_initialization=True)
    with cpu_shims.cpu_shims():
        return rope.get_emb(length)  # [L, 1, 1, rot_dim]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("percent", [1.0, 0.5])
@pytest.mark.parametrize("scaling", [False, True])
def test_packed_permuted_equals_megatron_per_document(interleaved: bool, percent: float, scaling: bool) -> None:
    head_dim, heads = 16, 3
    lengths = [7, 1, 0, 12, 5]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    total = int(cu[-1])
    table = _table(head_dim, max(lengths), percent=percent, interleaved=interleaved, scaling=scaling)
    config = _config(interleaved)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(total, 1, heads, head_dim, generator=g)

    order = torch.randperm(total, generator=g)  # any local order: positions travel with the tokens
    positions = torch.from_numpy(positions_in_documents(order.numpy(), cu, total))
    ours = apply_rope_by_position(x[order], rope_freqs_at(table, positions), interleaved=interleaved)

    expected = torch.empty_like(x)
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:  # Megatron's RoPE on the document alone, rows 0..n-1 of the table
            expected[a:b] = _megatron_rope(x[a:b], table[: b - a], config)
    torch.testing.assert_close(ours, expected[order], atol=ATOL, rtol=0)


def test_single_unpacked_document_matches_megatron() -> None:
    table = _table(8, 20, percent=1.0, interleaved=False)
    x = torch.randn(20, 2, 2, 8)
    ours = apply_rope_by_position(x, rope_freqs_at(table, torch.arange(20)))
    torch.testing.assert_close(ours, _megatron_rope(x, table, _config(False)), atol=ATOL, rtol=0)


def test_position_zero_is_identity_and_mscale_scales() -> None:
    table = _table(8, 4, percent=1.0, interleaved=False)
    x = torch.randn(3, 1, 2, 8)
    zero = rope_freqs_at(table, torch.zeros(3, dtype=torch.long))
    assert torch.equal(apply_rope_by_position(x, zero), x)
    torch.testing.assert_close(apply_rope_by_position(x, zero, mscale=2.0), 2 * x)


def test_self_attention_refuses_fused_qkv_rope() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_hsap.errors import ConfigError
    from megatron_hsap.megatron.rotary import HSAPSelfAttention

    config = _config(False)
    config.fused_single_qkv_rope = True  # set after __post_init__: only the refusal is under test
    subs = get_gpt_layer_local_spec().submodules.self_attention.submodules
    with pytest.raises(ConfigError, match="fused_single_qkv_rope"):
        HSAPSelfAttention(config, subs, layer_number=1)
