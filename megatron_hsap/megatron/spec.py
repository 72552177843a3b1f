"""The HSAP layer spec: megatron-core's GPT layer spec with two modules swapped (docs/design.md §2.3, §3).

Only ``self_attention.module`` (→ :class:`HSAPSelfAttention`, RoPE by position) and
``self_attention.submodules.core_attention`` (→ :class:`HSAPCoreAttention`) change; norms, QKV and
output projections, MLP/MoE, bias-dropout-add and the sharded-state-dict key map stay Megatron's,
so checkpoints load unchanged.

``--spec megatron_hsap.megatron.spec HSAP_LAYER_SPEC`` loads the module-level spec (Transformer
Engine's when TE imports, else the local one; ``HSAP_LOCAL_LAYER_SPEC`` forces local). megatron-core
0.19.2 passes the named object as ``transformer_layer_spec`` without calling it. The spec is only
valid with HSAP batch sharding: the core attention raises ``BatchError`` on other batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.core_attention import HSAPCoreAttention
from megatron_hsap.megatron.rotary import HSAPSelfAttention

__all__ = [
    "hsap_layer_spec",
    "swap_attention",
    "have_transformer_engine",
    "HSAP_LAYER_SPEC",
    "HSAP_LOCAL_LAYER_SPEC",
]


def have_transformer_engine() -> bool:
    """Whether megatron-core found Transformer Engine (its own import check, nothing imported here)."""
    return bool(getattr(gpt_layer_specs, "HAVE_TE", False))


def swap_attention(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a GPT ``TransformerLayer`` spec with HSAP's self-attention and core attention.

    Raises ``ConfigError`` when the layer's self-attention is not megatron-core's ``SelfAttention``
    (e.g. multi-latent attention), instead of swapping a module it was not written for.
    """
    subs = layer_spec.submodules
    attn = getattr(subs, "self_attention", None)
    if not isinstance(attn, ModuleSpec) or attn.module is not SelfAttention:
        found = getattr(attn, "module", attn)
        raise ConfigError(
            f"the layer's self_attention is {getattr(found, '__name__', found)!r}, not megatron-core's "
            "SelfAttention; HSAP swaps SelfAttention only (no MLA / custom attention yet)"
        )
    new_attn = dataclasses.replace(
        attn,
        module=HSAPSelfAttention,
        params=dict(attn.params),
        submodules=dataclasses.replace(attn.submodules, core_attention=HSAPCoreAttention),
    )
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(subs, self_attention=new_attn))


def hsap_layer_spec(config: Any = None, *, use_te: bool | None = None) -> ModuleSpec:
    """GPT ``TransformerLayer`` spec for HSAP context parallelism.

    Args:
        config: a ``TransformerConfig`` (optional): its ``qk_layernorm``, ``qk_l2_norm``,
            ``normalization``, ``num_moe_experts`` and ``moe_grouped_gemm`` select the base spec
            as Megatron's GPT builder does; ``multi_latent_attention`` is refused.
        use_te: Transformer Engine's spec (True) or the local one (False); default: TE when it is
            installed and ``config.transformer_impl`` (if given) is ``"transformer_engine"``.
    Returns:
        ``ModuleSpec`` for ``GPTModel(transformer_layer_spec=...)``.
    """
    if use_te is None:
        impl = getattr(config, "transformer_impl", "transformer_engine")
        use_te = have_transformer_engine() and impl == "transformer_engine"
    if use_te and not have_transformer_engine():
        raise ConfigError("use_te=True but Transformer Engine is not installed; pass use_te=False for the local spec")
    kwargs: dict[str, Any] = {}
    if config is not None:
        if getattr(config, "multi_latent_attention", False):
            raise ConfigError("multi-latent attention is not supported by the HSAP layer spec yet")
        kwargs = dict(
            num_experts=getattr(config, "num_moe_experts", None),
            moe_grouped_gemm=getattr(config, "moe_grouped_gemm", False),
            qk_layernorm=getattr(config, "qk_layernorm", False),
            qk_l2_norm=getattr(config, "qk_l2_norm", False),
        )
        if not use_te:
            kwargs["normalization"] = getattr(config, "normalization", None)
    if use_te:
        base = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs)
    else:
        base = gpt_layer_specs.get_gpt_layer_local_spec(**kwargs)
    return swap_attention(base)


HSAP_LOCAL_LAYER_SPEC: ModuleSpec = hsap_layer_spec(use_te=False)
HSAP_LAYER_SPEC: ModuleSpec = hsap_layer_spec(use_te=have_transformer_engine())
