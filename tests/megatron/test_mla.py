"""Multi-latent attention (megatron-core's ``MLASelfAttention``, d_qk ≠ d_v) under HSAP.

- A tiny MLA GPT (q 8 + 4 RoPE channels, v 6, kv_lora_rank 16) trains identically under HSAP
  and at CP=1 (5 Adam steps, 1e-5 relative: see test_sinks_gpt). The reference is megatron-core's
  own MLA at CP=1 — its THD RoPE restarts at every document there — with a float64 core attention.
- RoPE by position: for rope and YaRN, HSAP's per-token angles are rows of MLA's own rotary table
  at each token's position inside its document (YaRN with its concentration factor ``mscale``).
- Refusals: TE's fused MLA RoPE, MLA latent caching, a batch not sharded by HSAP.
"""

from __future__ import annotations

import pytest
import torch

from tests.megatron.test_sinks_gpt import MLA_FIELDS, check_equal_to_cp1, cpu_current_device


def test_mla_gpt_2x2_matches_cp1() -> None:
    got = check_equal_to_cp1((2, 2), {"mla": True})
    assert any("linear_kv_down_proj" in n for n in got["names"]), "the model must be MLA"


@pytest.mark.slow
def test_mla_gpt_with_sinks_1x4_matches_cp1() -> None:
    check_equal_to_cp1((1, 4), {"mla": True, "softmax_type": "learnable"})


@pytest.mark.slow
def test_mla_gpt_4x1_matches_cp1() -> None:
    check_equal_to_cp1((4, 1), {"mla": True})  # Ulysses: 4 heads, one per rank


def _mla_attention(rope_type: str, **extra):
    """An ``HSAPMLASelfAttention`` on one process (CP=1 groups), local modules."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_hsap.megatron import cpu_shims
    from megatron_hsap.megatron.spec import swap_attention

    cpu_shims.install()
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel()
    fields = {**MLA_FIELDS, "rope_type": rope_type, **extra}
    fields.pop("multi_latent_attention")
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                params_dtype=torch.float32, apply_rope_fusion=False, rotary_scaling_factor=4.0,
                original_max_position_embeddings=16)  # fmt: skip
    config = MLATransformerConfig(**{**base, **fields})
    spec = swap_attention(get_gpt_layer_local_spec(multi_latent_attention=True)).submodules.self_attention
    from megatron.core.transformer.spec_utils import build_module

    return build_module(spec, config=config, layer_number=1), config


def rope_by_position_case(rope_type: str) -> dict:
    """Pool case (1 rank): HSAP's per-token angles vs rows of MLA's own table."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    # YaRN's get_emb moves its buffers to torch.cuda.current_device(); on CPU that device is "cpu"
    with cpu_current_device():
        attn, _ = _mla_attention(rope_type)
        positions = torch.tensor([0, 1, 2, 0, 1, 5, 3, 0])  # per-token positions inside documents
        batch = type("Sharded", (), {"max_seqlen_q": 9, "hsap_position_ids": positions})()
        got = attn._angles_by_position(batch)
        table = attn.rotary_pos_emb(9, packed_seq=True)
    if rope_type == "yarn":
        assert isinstance(attn.rotary_pos_emb, YarnRotaryEmbedding)
        (emb, mscale), (got_emb, got_mscale) = table, got
        return {"equal": torch.equal(got_emb, emb[positions]), "mscale": float(got_mscale), "want_mscale": float(mscale),
                "distinct": bool((emb[1] != emb[2]).any())}  # fmt: skip
    return {"equal": torch.equal(got, table[positions]), "mscale": 1.0, "want_mscale": 1.0, "distinct": bool((table[1] != table[2]).any())}


@pytest.mark.parametrize("rope_type", ["rope", "yarn"])
def test_rope_by_position_reads_mlas_own_table(rope_type: str) -> None:
    from tests.distributed import get_pool

    r = get_pool(1).run(rope_by_position_case, rope_type, timeout=300)[0]
    assert r["equal"] and r["distinct"]
    assert r["mscale"] == r["want_mscale"]
    if rope_type == "yarn":
        assert r["mscale"] != 1.0  # rotary_scaling_factor 4 with mscale 1, mscale_all_dim 0: concentration > 1


def refusal_case(extra: dict) -> str:
    from megatron_hsap.errors import ConfigError

    try:
        extra = dict(extra)
        with cpu_current_device():
            _mla_attention(extra.pop("rope_type", "rope"), **extra)
    except ConfigError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize(
    "extra, match",
    [({"apply_rope_fusion": True, "rope_type": "yarn"}, "--no-rope-fusion"), ({"cache_mla_latents": True}, "cache_mla_latents")],
)
def test_mla_refusals(extra: dict, match: str) -> None:
    from tests.distributed import get_pool

    assert match in get_pool(1).run(refusal_case, extra, timeout=300)[0]


def unsharded_case() -> str:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_hsap.errors import BatchError

    with cpu_current_device():
        attn, config = _mla_attention("rope")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
                             cu_seqlens_kv=torch.tensor([0, 4], dtype=torch.int32), max_seqlen_q=4, max_seqlen_kv=4)  # fmt: skip
    try:
        attn(torch.zeros(4, 1, config.hidden_size), None, packed_seq_params=params)
    except BatchError as e:
        return str(e)
    return "ran"


def test_mla_refuses_batches_not_sharded_by_hsap() -> None:
    from tests.distributed import get_pool

    assert "HSAP marker" in get_pool(1).run(unsharded_case, timeout=300)[0]


@pytest.mark.parametrize("extra", [[], ["--rope-type", "rope"], ["--rope-type", "yarn"]])
def test_arguments_accept_mla(extra: list[str]) -> None:
    from megatron_hsap.megatron.arguments import validate_hsap_args
    from tests.megatron.test_arguments import GOOD, _parse

    args = _parse(GOOD + ["--multi-latent-attention", "--no-rope-fusion", *extra])
    assert validate_hsap_args(args) is not None and args.spec == ["megatron_hsap.megatron.spec", "hsap_layer_spec"]
