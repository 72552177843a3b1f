"""The HSAP layer spec swaps exactly two modules and loads through Megatron's ``--spec`` importer."""

from __future__ import annotations

import dataclasses

import pytest
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.core_attention import HSAPCoreAttention
from megatron_hsap.megatron.rotary import HSAPSelfAttention
from megatron_hsap.megatron.spec import HSAP_LAYER_SPEC, HSAP_LOCAL_LAYER_SPEC, hsap_layer_spec, swap_attention


def test_swap_changes_only_attention_module_and_core_attention() -> None:
    base = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    swapped = swap_attention(base)
    assert swapped.module is base.module
    for field in dataclasses.fields(base.submodules):
        if field.name != "self_attention":
            assert getattr(swapped.submodules, field.name) is getattr(base.submodules, field.name), field.name
    old, new = base.submodules.self_attention, swapped.submodules.self_attention
    assert old.module is SelfAttention and new.module is HSAPSelfAttention
    assert new.params == old.params
    for field in dataclasses.fields(old.submodules):
        want = HSAPCoreAttention if field.name == "core_attention" else getattr(old.submodules, field.name)
        assert getattr(new.submodules, field.name) is want, field.name
    # The input spec is untouched (specs are shared module-level objects in Megatron).
    assert base.submodules.self_attention.module is SelfAttention


def test_module_level_spec_loads_like_megatron_spec_flag() -> None:
    # `--spec megatron_hsap.megatron.spec HSAP_LAYER_SPEC`: megatron-core 0.19.2 passes the object.
    assert import_module(["megatron_hsap.megatron.spec", "HSAP_LAYER_SPEC"]) is HSAP_LAYER_SPEC
    assert HSAP_LAYER_SPEC.submodules.self_attention.module is HSAPSelfAttention
    assert HSAP_LOCAL_LAYER_SPEC.submodules.self_attention.submodules.core_attention is HSAPCoreAttention


def test_config_selects_base_spec_options() -> None:
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, qk_layernorm=True,
                            normalization="RMSNorm", use_cpu_initialization=True)
    spec = hsap_layer_spec(cfg, use_te=False)
    base = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    assert repr(spec.submodules.self_attention.submodules.q_layernorm) == repr(base.submodules.self_attention.submodules.q_layernorm)
    assert repr(spec.submodules.input_layernorm) == repr(base.submodules.input_layernorm)


def test_refusals() -> None:
    if not gpt_layer_specs.HAVE_TE:
        with pytest.raises(ConfigError, match="Transformer Engine is not installed"):
            hsap_layer_spec(use_te=True)
    local = gpt_layer_specs.get_gpt_layer_local_spec()
    other = dataclasses.replace(local, submodules=dataclasses.replace(  # an attention HSAP was not written for
        local.submodules, self_attention=dataclasses.replace(local.submodules.self_attention, module=HSAPCoreAttention)))
    with pytest.raises(ConfigError, match="SelfAttention, MLASelfAttention or GatedDeltaNet"):
        swap_attention(other)


def test_config_with_qk_l2_norm_gets_megatron_s_l2_norm() -> None:
    # QK L2 norm: the spec follows the config as Megatron's own builder does (the norms are
    # Megatron's; HSAP swaps only the attention module and the core attention)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, qk_l2_norm=True,
                            use_cpu_initialization=True)
    spec = hsap_layer_spec(cfg, use_te=False)
    base = gpt_layer_specs.get_gpt_layer_local_spec(qk_l2_norm=True)
    plain = gpt_layer_specs.get_gpt_layer_local_spec()
    got, want = spec.submodules.self_attention.submodules, base.submodules.self_attention.submodules
    for norm in ("q_layernorm", "k_layernorm"):
        assert repr(getattr(got, norm)) == repr(getattr(want, norm)), norm
        assert repr(getattr(want, norm)) != repr(getattr(plain.submodules.self_attention.submodules, norm)), norm
    assert got.core_attention is HSAPCoreAttention


def test_a_gpt_block_s_gated_delta_net_layer_gets_hsap_s() -> None:
    """``--experimental-attention-variant gated_delta_net`` (Qwen3-Next as a GPTModel): megatron-core's
    block spec puts ``GatedDeltaNet`` in a TransformerLayer; the swap gives it HSAP's, submodules kept."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megatron_hsap.megatron.gdn import HSAPGatedDeltaNet

    subs = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=IdentityOp, out_proj=RowParallelLinear)
    layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=subs, metainfo={"fuse_input_layernorm": True})))
    swapped = swap_attention(layer)
    assert swapped.submodules.self_attention.module is HSAPGatedDeltaNet
    assert swapped.submodules.self_attention.submodules == subs and swapped.module is TransformerLayer
    assert layer.submodules.self_attention.module is GatedDeltaNet  # (a copy: megatron-core's spec untouched)
