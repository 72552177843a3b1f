"""Gated delta net layers under HSAP (``megatron_hsap/megatron/gdn.py``).

- The kernels' CPU stand-ins (``cpu/gdn_kernels.py``): the delta rule per document of
  ``cu_seqlens`` (megatron-core's plain-torch chunked form inside) against the rule written token by
  token here.
- The layer: on 4 gloo ranks, megatron-core's ``GatedDeltaNet`` at CP 4 under HSAP (its
  all-to-alls, HSAP's permutation and documents) against the same parameters at CP=1 run on each
  document alone (no packed sequence) — outputs, input gradients and every parameter's gradient
  summed over CP ranks, for the plans of ``test_mtp._plans`` (2×2, 1×4, 4×1, both layouts,
  scrambled layouts).
- The spec, the argument checks and the refusals. Megatron's loop: ``test_hybrid_ssm_pretrain_cpu.py``.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from megatron_hsap.errors import BatchError, ConfigError

GDN = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
           linear_conv_kernel_dim=4, experimental_attention_variant=None)


def _delta_rule(q, k, v, g, beta):  # noqa: ANN001, ANN202
    """One sequence ``[s, h, d]`` by the definition: S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ,
    o_t = S_tᵀ q_t / √d_k, α_t = exp(g_t)."""
    s, h, dk = k.shape
    state = torch.zeros(h, dk, v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(s):
        a = torch.exp(g[t]).view(h, 1, 1)
        decayed = a * state
        v_new = v[t] - torch.einsum("hkv,hk->hv", decayed, k[t])
        state = decayed + beta[t].view(h, 1, 1) * torch.einsum("hk,hv->hkv", k[t], v_new)
        out.append(torch.einsum("hkv,hk->hv", state, q[t]) / dk ** 0.5)
    return torch.stack(out)


def test_stand_in_delta_rule_equals_the_recurrence_per_document() -> None:
    from megatron_hsap.megatron.cpu.gdn_kernels import chunk_gated_delta_rule, l2norm

    gen = torch.Generator().manual_seed(0)
    docs = (70, 1, 5, 64)  # across the 64-token chunks, a single token, a whole chunk
    total, h, d = sum(docs), 3, 4
    q, k = (l2norm(torch.randn(1, total, h, d, generator=gen, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(1, total, h, d, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, total, h, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, total, h, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, *np.cumsum(docs)], dtype=torch.int32)
    got = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)[0][0]
    want = torch.cat([_delta_rule(q[0, a:b], k[0, a:b], v[0, a:b], g[0, a:b], beta[0, a:b])
                      for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)  # (the chunked form runs in float32)
    whole = chunk_gated_delta_rule(q, k, v, g, beta)[0][0]  # one sequence: the documents run into each other
    assert (whole.double() - want).abs().max() > 1e-3


def _params(plan, rank: int):  # noqa: ANN001, ANN202
    from megatron_hsap.megatron.batch import HSAP_MARKER, HSAPPackedSeqParams

    cu = torch.tensor(np.asarray(plan.batch.doc_starts), dtype=torch.int32)
    return HSAPPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, hsap_marker=HSAP_MARKER,
                               hsap_plan=plan, hsap_cp_rank=rank)


def _layer(config, cp_group, cls):  # noqa: ANN001, ANN202
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    subs = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear)
    pgs = ProcessGroupCollection(tp=mpu.get_tensor_model_parallel_group(), cp=cp_group)
    return cls(config, subs, layer_number=1, pg_collection=pgs)


def _layer_case() -> str:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_hsap.megatron.cpu import gdn_kernels, mamba_kernels

    mamba_kernels.install()
    gdn_kernels.install()
    from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet

    from megatron_hsap.megatron.gdn import HSAPGatedDeltaNet
    from tests.megatron.test_gpt_equivalence import _setup
    from tests.megatron.test_mamba import matches_documents_alone
    from tests.megatron.test_sinks_gpt import cpu_current_device

    rank = dist.get_rank()
    with cpu_current_device():
        config = dataclasses.replace(_setup(4), activation_func=torch.nn.functional.silu, **GDN)
        singles = [dist.new_group([r]) for r in range(4)]  # (every rank creates every group)
        torch.manual_seed(0)
        hsap = _layer(config, mpu.get_context_parallel_group(), HSAPGatedDeltaNet)
        ref = _layer(config, singles[rank], GatedDeltaNet)
        ref.load_state_dict(hsap.state_dict())
        # (the float32 chunked delta rule batched over other heads: parameter gradients to 1e-4; seen 2e-5)
        matches_documents_alone(hsap, ref, lambda layer, x, params: layer(x, None, packed_seq_params=params)[0], _params,
                                config.hidden_size, seed=200, tol=(1e-4, 1e-5), grad_tol=1e-4)
    return "ok"


def test_gated_delta_net_at_cp4_equals_each_document_alone(gloo_pool) -> None:  # noqa: ANN001
    assert gloo_pool(4).run(_layer_case, timeout=600) == ["ok"] * 4


def test_hybrid_spec_swaps_the_gated_delta_net() -> None:
    from megatron_hsap.megatron.gdn import HSAPGatedDeltaNet
    from megatron_hsap.megatron.spec import HSAP_HYBRID_STACK_SPEC, HSAPUnsupportedLayer, _local_hybrid_stack_spec, hsap_hybrid_stack_spec

    for spec in (HSAP_HYBRID_STACK_SPEC, hsap_hybrid_stack_spec(use_te=False)):
        assert spec.submodules.gdn_layer.submodules.self_attention.module is HSAPGatedDeltaNet
    base = _local_hybrid_stack_spec()
    odd = dataclasses.replace(base, submodules=dataclasses.replace(base.submodules, gdn_layer=torch.nn.Identity))
    assert hsap_hybrid_stack_spec(odd).submodules.gdn_layer.module is HSAPUnsupportedLayer


def test_gdn_arguments_checked_before_the_model_builds() -> None:
    from megatron_hsap.megatron.arguments import validate_hsap_args
    from tests.megatron.test_arguments import GOOD, _parse

    gdn = ["--hybrid-layer-pattern", "G*G-", "--swiglu"]  # defaults: 16 key, 32 value heads over TP 2 x CP 8
    assert validate_hsap_args(_parse([*GOOD, *gdn])) is not None
    with pytest.raises(ConfigError, match="pass --swiglu"):
        validate_hsap_args(_parse([*GOOD, *gdn[:2]]))
    with pytest.raises(ConfigError, match="--linear-num-key-heads 8 must split over TP 2 x CP 8"):
        validate_hsap_args(_parse([*GOOD, *gdn, "--linear-num-key-heads", "8"]))


def test_layer_refuses_batches_hsap_did_not_shard() -> None:
    from megatron_hsap.megatron.gdn import HSAPGatedDeltaNet

    layer = HSAPGatedDeltaNet.__new__(HSAPGatedDeltaNet)
    torch.nn.Module.__init__(layer)
    layer.pg_collection = types.SimpleNamespace(cp=None)  # (refused before the group is read)
    with pytest.raises(BatchError, match="not sharded by HSAP"):
        layer(torch.zeros(4, 1, 8), None, packed_seq_params=None)
    with pytest.raises(ConfigError, match="train only"):
        layer(torch.zeros(4, 1, 8), None, inference_context=object())


def test_install_refuses_another_permutation(monkeypatch) -> None:  # noqa: ANN001
    from megatron_hsap.megatron import gdn

    homes = gdn._perm_homes()  # (megatron-core 0.19.2: gdn.py; Megatron-LM main: common.py)
    assert homes, "the installed megatron-core's GatedDeltaNet.forward reaches no known permutation call"
    for home in homes:
        with monkeypatch.context() as m:
            m.setattr(home, "_build_thd_cp_a2a_perm", lambda cu_seqlens, cp_size: None)  # another signature
            with pytest.raises(ConfigError, match="install megatron-core 0.19.2 or drop the 'G' layers"):
                gdn.install()
    monkeypatch.setattr(gdn, "_perm_homes", lambda: [])  # a forward calling neither
    with pytest.raises(ConfigError, match="directly, as megatron-core 0.19.2 does, or in a2a_cp_to_hp"):
        gdn.install()


def test_install_wraps_the_call_the_forward_makes() -> None:
    """After ``install`` the permutation the forward reaches returns HSAP's order for a batch whose
    ``cu_seqlens`` carry one, and Megatron's own for any other."""
    from megatron_hsap.megatron import gdn

    gdn.install()
    gdn.install()  # (idempotent: wrapped once)
    for home in gdn._perm_homes():
        perm = home._build_thd_cp_a2a_perm
        assert perm.__hsap_original__ is not None and not hasattr(perm.__hsap_original__, "__hsap_original__")
        cu = torch.tensor([0, 8, 16])
        want = perm.__hsap_original__(cu, 2, 16)
        got = perm(cu, 2, 16)
        assert all(torch.equal(a, b) for a, b in zip(got, want))  # Megatron's batch: Megatron's permutation
        order = types.SimpleNamespace(order=torch.arange(16).flip(0), gathered_ids=torch.arange(16),
                                      seq_idx=torch.zeros(1, 16))
        cu._hsap_stream_order = order
        got = perm(cu, 2, 16)
        assert got[0] is order.order and got[1] is order.gathered_ids


def test_a_model_with_another_gated_delta_net_kind_is_refused() -> None:
    """Any module of megatron-core's gated delta net family that is not HSAP's is refused once the
    model is built (``spec.check_model_attention``): e.g. Megatron-LM main's ``GatedDeltaNet2``, which
    its ``HybridBlock`` builds for 'G' layers under gdn2 whatever the stack spec says."""
    from megatron.core.ssm.gated_delta_net import common

    from megatron_hsap.megatron.gdn import HSAPGatedDeltaNet
    from megatron_hsap.megatron.spec import check_model_attention

    class OtherKind(common._GDNBase):  # (a family member HSAP has not made layout-aware)
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)

    class Layer(torch.nn.Module):
        def __init__(self, attention: torch.nn.Module) -> None:
            super().__init__()
            self.self_attention = attention

    with pytest.raises(ConfigError, match="self_attention is megatron-core's OtherKind, not HSAP's"):
        check_model_attention(Layer(OtherKind()))
    ours = HSAPGatedDeltaNet.__new__(HSAPGatedDeltaNet)
    torch.nn.Module.__init__(ours)
    check_model_attention(Layer(ours))  # HSAP's passes
