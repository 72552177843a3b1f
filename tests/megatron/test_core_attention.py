"""HSAP core attention: refusals (single process) and numerics against float64 per-document
attention at CP=1 (THD and SBHD). Multi-rank numerics live in test_gpt_equivalence."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hsap.errors import BatchError, ConfigError, RuntimeMismatchError
from megatron_hsap.megatron.batch import HSAPPackedSeqParams, get_batch_on_this_cp_rank
from megatron_hsap.megatron.core_attention import HSAPCoreAttention
from megatron_hsap.plan import compile_plan
from tests.reference import reference_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _config(**overrides: object) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
                use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    base.update(overrides)
    return TransformerConfig(**base)


def _attn(config: TransformerConfig | None = None, **kwargs: object) -> HSAPCoreAttention:
    args = dict(config=config or _config(), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    args.update(kwargs)
    return HSAPCoreAttention(**args)


def _qkv(t: int, *, batch: int | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lead = (t,) if batch is None else (t, batch)
    return (torch.randn(*lead, HEADS, HEAD_DIM, generator=g), torch.randn(*lead, KV_HEADS, HEAD_DIM, generator=g),
            torch.randn(*lead, KV_HEADS, HEAD_DIM, generator=g))


def _params(cu: list[int]) -> HSAPPackedSeqParams:
    plan = compile_plan(cu, inter_size=1, intra_size=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype_bytes=4)
    batch = {"tokens": torch.zeros(1, cu[-1], dtype=torch.long), "cu_seqlens": torch.tensor(cu)}
    return get_batch_on_this_cp_rank(batch, plan=plan, cp_rank=0, check_group=False)["packed_seq_params"]


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "params",
    [None, PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8]), cu_seqlens_kv=torch.tensor([0, 8]))],
    ids=["no-params", "megatron-params"],
)
def test_refuses_batch_not_sharded_by_hsap(params: PackedSeqParams | None) -> None:
    q, k, v = _qkv(8)
    with pytest.raises(BatchError, match="not sharded by HSAP"):
        _attn()(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)


def test_refuses_marker_forged_without_plan() -> None:
    params = dataclasses.replace(_params([0, 8]), hsap_plan=None)
    q, k, v = _qkv(8)
    with pytest.raises(BatchError):
        _attn()(q, k, v, None, packed_seq_params=params)


@pytest.mark.parametrize(
    ("config_kw", "attn_kw", "match"),
    [
        ({}, {"attention_type": "cross"}, "self attention only"),
        ({}, {"attn_mask_type": AttnMaskType.no_mask}, "no_mask"),
        ({}, {"attn_mask_type": AttnMaskType.padding}, "padding"),
        ({}, {"attn_mask_type": AttnMaskType.arbitrary}, "arbitrary"),
        ({"window_size": (16, 4)}, {}, "right=4"),  # windows are planned; only causal ones (right 0)
        ({"softmax_scale": 0.5}, {"softmax_scale": 0.25}, "disagrees"),
    ],
)
def test_refuses_configs_it_cannot_honour(config_kw: dict, attn_kw: dict, match: str) -> None:
    try:
        config = _config(**config_kw)
    except (AssertionError, ValueError) as exc:  # Megatron itself rejects the combination first
        pytest.skip(f"TransformerConfig rejects {config_kw}: {exc}")
    with pytest.raises(ConfigError, match=match):
        _attn(config, **attn_kw)


def test_forward_refusals_happen_before_any_computation() -> None:
    params = _params([0, 3, 8])
    q, k, v = _qkv(8)
    attn = _attn()
    with pytest.raises(ConfigError, match="attention_mask"):
        attn(q, k, v, torch.ones(1, 1, 8, 8, dtype=torch.bool), packed_seq_params=params)
    with pytest.raises(ConfigError, match="attention_bias"):
        attn(q, k, v, None, attention_bias=torch.zeros(1), packed_seq_params=params)
    with pytest.raises(ConfigError, match="no_mask"):
        attn(q, k, v, None, attn_mask_type=AttnMaskType.no_mask, packed_seq_params=params)
    with pytest.raises(RuntimeMismatchError, match="tokens"):
        attn(*_qkv(6), None, packed_seq_params=params)


def test_configured_dropout_runs_in_training_only() -> None:
    """Training: the layer runs ``hsap_attn_func`` with the configured dropout (outside Megatron's
    RNG tracker here: the ``cpu`` kernel's seed comes from the default generator, so a reset
    generator repeats the masks); evaluation: no dropout."""
    from megatron_hsap.runtime import hsap_attn_func

    params = _params([0, 3, 8])
    q, k, v = _qkv(8)
    base = _attn()(q, k, v, None, packed_seq_params=params).reshape(8, HEADS, HEAD_DIM)
    attn = _attn(_config(attention_dropout=0.5))
    assert torch.equal(attn.eval()(q, k, v, None, packed_seq_params=params).reshape(8, HEADS, HEAD_DIM), base)
    attn.train()
    torch.manual_seed(3)
    got = attn(q, k, v, None, packed_seq_params=params).reshape(8, HEADS, HEAD_DIM)
    torch.manual_seed(3)
    want = hsap_attn_func(q, k, v, params.hsap_plan, dropout_p=0.5)
    assert torch.equal(got, want) and not torch.allclose(got, base)


# ----------------------------------------------------------------------------- numerics at CP=1
# fp32 kernels vs a float64 reference: 1e-5 covers fp32 accumulation over <= 40 keys.
ATOL = 1e-5


def _reference_thd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
    doc = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(zip(cu[:-1], cu[1:]))])
    out, _ = reference_attention(q, k, v, pos, pos, doc, doc, scale)
    return out


def test_thd_matches_float64_reference_at_cp1() -> None:
    cu = [0, 5, 5, 17, 18, 40]
    params = _params(cu)
    q, k, v = (x.requires_grad_() for x in _qkv(40))
    out = _attn()(q, k, v, None, attn_mask_type=AttnMaskType.padding_causal, packed_seq_params=params)
    assert out.shape == (40, HEADS * HEAD_DIM)
    ref = _reference_thd(q, k, v, cu, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.double(), ref.reshape(40, -1), atol=ATOL, rtol=0)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref.reshape(40, -1), (q, k, v), g.double())
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b.double(), atol=ATOL, rtol=0)


def test_sbhd_is_one_document_per_sample_at_cp1() -> None:
    b, s = 3, 12
    sharded = get_batch_on_this_cp_rank(
        {"tokens": torch.zeros(b, s, dtype=torch.long)}, qkv_format="sbhd", cp_rank=0, check_group=False,
        plan_kwargs=dict(inter_size=1, intra_size=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype_bytes=4),
    )
    q, k, v = _qkv(s, batch=b)
    out = _attn()(q, k, v, None, packed_seq_params=sharded["packed_seq_params"])
    assert out.shape == (s, b, HEADS * HEAD_DIM)
    for i in range(b):
        ref = _reference_thd(q[:, i], k[:, i], v[:, i], [0, s], HEAD_DIM**-0.5)
        torch.testing.assert_close(out[:, i].double(), ref.reshape(s, -1), atol=ATOL, rtol=0)


def _sbhd_case(b: int, s: int, intra: int, inter: int) -> dict[str, list]:
    """Pool case: SBHD core attention on this rank's rows; returns rows, output and input grads."""
    import torch.distributed as dist

    from megatron_hsap.megatron.parallel_state import destroy_hsap, initialize_hsap

    initialize_hsap(intra_size=intra, inter_size=inter, node_check="off")
    try:
        q, k, v = _qkv(s, batch=b, seed=3)  # the same global tensors on every rank
        sharded = get_batch_on_this_cp_rank(
            {"tokens": torch.zeros(b, s, dtype=torch.long)}, qkv_format="sbhd",
            plan_kwargs=dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype_bytes=4),
        )
        plan, rank = sharded["plan"], dist.get_rank()
        ids = torch.from_numpy(plan.local_token_indices(rank))
        real = ids < s
        rows = ids.clamp(max=s - 1)
        local = [x[rows].clone().requires_grad_() for x in (q, k, v)]  # padding rows: any finite values
        out = _attn()(*local, None, packed_seq_params=sharded["packed_seq_params"])
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
        grads = torch.autograd.grad(out, local, g)
        return {"ids": ids[real].tolist(), "out": out[real].tolist(), "g": g[real].tolist(),
                "grads": [x[real].tolist() for x in grads]}
    finally:
        destroy_hsap()


def test_sbhd_matches_reference_across_cp_ranks(gloo_pool) -> None:  # noqa: ANN001
    b, s = 2, 11  # 11 tokens over 4 ranks: one padding token at the end of every sample
    results = gloo_pool(4).run(_sbhd_case, b, s, 2, 2, timeout=300)
    q, k, v = (x.double().requires_grad_() for x in _qkv(s, batch=b, seed=3))
    ref = torch.stack([_reference_thd(q[:, i], k[:, i], v[:, i], [0, s], HEAD_DIM**-0.5) for i in range(b)], 1)
    ref = ref.reshape(s, b, -1)  # [s, b, np·hn]
    out = torch.zeros(s, b, HEADS * HEAD_DIM, dtype=torch.float64)
    g = torch.zeros_like(out)
    got_grads = [torch.zeros_like(x) for x in (q, k, v)]
    for r in results:
        ids = torch.tensor(r["ids"])
        out[ids] = torch.tensor(r["out"], dtype=torch.float64)
        g[ids] = torch.tensor(r["g"], dtype=torch.float64)
        for acc, part in zip(got_grads, r["grads"]):
            acc[ids] = torch.tensor(part, dtype=torch.float64)
    assert sorted(i for r in results for i in r["ids"]) == list(range(s))  # every token once
    torch.testing.assert_close(out, ref.detach(), atol=ATOL, rtol=0)
    for got, want in zip(got_grads, torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def _dense_max_logits(q: torch.Tensor, k: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    """``[np]`` float64: per q head, the largest scaled logit over document-causal pairs."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    best = torch.full((q.shape[1],), float("-inf"), dtype=torch.float64)
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b]) * scale
            best = torch.maximum(best, s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(1, 2)))
    return best


@pytest.mark.parametrize("flag", ["qk_clip", "log_max_attention_logit"])
def test_max_attention_logits_for_qk_clip(flag: str) -> None:
    """``current_max_attn_logits [np]`` (what megatron-core's ``clip_qk`` reads) is the per-head
    maximum over every call since its reset, THD and SBHD (the max over the samples folded into
    the head axis); unset without the flags."""
    cu = [0, 5, 5, 17, 18, 40]
    attn = _attn(_config(**{flag: True}))
    assert attn.current_max_attn_logits is None
    q, k, v = _qkv(40, seed=1)
    attn(q, k, v, None, packed_seq_params=_params(cu))
    want = _dense_max_logits(q, k, cu, HEAD_DIM**-0.5)
    torch.testing.assert_close(attn.current_max_attn_logits.double(), want, rtol=1e-6, atol=1e-6)
    q2, k2, v2 = _qkv(40, seed=2)
    attn(q2 * 3, k2, v2, None, packed_seq_params=_params(cu))  # a second micro-batch: the max of both
    both = torch.maximum(want, _dense_max_logits(q2 * 3, k2, cu, HEAD_DIM**-0.5))
    torch.testing.assert_close(attn.current_max_attn_logits.double(), both, rtol=1e-6, atol=1e-6)
    b, s = 3, 12
    sbhd = _attn(_config(**{flag: True}))
    sharded = get_batch_on_this_cp_rank(
        {"tokens": torch.zeros(b, s, dtype=torch.long)}, qkv_format="sbhd", cp_rank=0, check_group=False,
        plan_kwargs=dict(inter_size=1, intra_size=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype_bytes=4),
    )
    q, k, v = _qkv(s, batch=b, seed=3)
    sbhd(q, k, v, None, packed_seq_params=sharded["packed_seq_params"])
    want = torch.stack([_dense_max_logits(q[:, i], k[:, i], [0, s], HEAD_DIM**-0.5) for i in range(b)]).amax(0)
    torch.testing.assert_close(sbhd.current_max_attn_logits.double(), want, rtol=1e-6, atol=1e-6)
    plain = _attn()
    plain(q2, k2, v2, None, packed_seq_params=_params(cu))
    assert plain.current_max_attn_logits is None
