"""The HSAP layer spec: megatron-core's GPT layer spec with two modules swapped (docs/design.md §2.3, §3).

Only ``self_attention.module`` (→ :class:`HSAPSelfAttention`, RoPE by position) and
``self_attention.submodules.core_attention`` (→ :class:`HSAPCoreAttention`) change; norms, QKV and
output projections, MLP/MoE, bias-dropout-add and the sharded-state-dict key map stay Megatron's,
so checkpoints load unchanged.

``--spec megatron_hsap.megatron.spec hsap_layer_spec`` (what ``--context-parallel-impl hsap`` sets)
names a callable: megatron-core 0.19.2's ``GPTModelBuilder`` calls it with the run's
``GPTModelConfig`` (and ``vp_stage``), so the base spec is the one Megatron would build. The spec is
only valid with HSAP batch sharding: the core attention raises ``BatchError`` on other batches.
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


def _swap_all(spec: Any) -> Any:
    """Swap attention in a layer spec, or in every layer of a block spec (MoE / mixed layers)."""
    if isinstance(spec, ModuleSpec):
        return swap_attention(spec)
    layers = getattr(spec, "layer_specs", None)
    if layers is None:
        raise ConfigError(f"Megatron built a {type(spec).__name__} layer spec; HSAP can swap a ModuleSpec or a "
                          "block spec's layer_specs only")
    return dataclasses.replace(spec, layer_specs=[swap_attention(layer) for layer in layers])


def hsap_layer_spec(config: Any = None, vp_stage: int | None = None, *, use_te: bool | None = None) -> Any:
    """GPT layer spec for HSAP context parallelism: Megatron's own, with attention and RoPE swapped.

    Megatron's ``GPTModelBuilder`` calls it with its ``GPTModelConfig`` (``--spec
    megatron_hsap.megatron.spec hsap_layer_spec``, set by ``--context-parallel-impl hsap``): the base
    spec is Megatron's ``default_layer_spec(config, vp_stage)``, so QK layernorm / L2 norm, MoE
    (a block spec, every layer swapped), TE or local modules, the TE op fuser and activation
    options carry over exactly as Megatron builds them without HSAP.

    Args:
        config: a ``GPTModelConfig`` (Megatron's builder), or a ``TransformerConfig`` (own model
            builders): its ``qk_layernorm``, ``qk_l2_norm``, ``normalization``, ``num_moe_experts``
            and ``moe_grouped_gemm`` select the base spec; None gives the plain local/TE layer.
        vp_stage: virtual pipeline stage (Megatron passes it; selects the block spec's layers).
        use_te: for a ``TransformerConfig`` or no config only: Transformer Engine's spec (True) or
            the local one (False); default TE when installed and ``transformer_impl`` asks for it.
    Returns:
        ``ModuleSpec`` (or a block spec for MoE) for ``GPTModel(transformer_layer_spec=...)``.
    """
    transformer = getattr(config, "transformer", None)
    if transformer is not None:  # Megatron's GPTModelConfig
        if getattr(transformer, "multi_latent_attention", False):
            raise ConfigError("--multi-latent-attention is not supported by the HSAP layer spec yet")
        from megatron.training.models.gpt import default_layer_spec

        return _swap_all(default_layer_spec(config, vp_stage))
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


# For code that builds GPTModel itself without a config (a plain layer: no QK norm, no MoE). Megatron's
# `--spec` names `hsap_layer_spec`, which Megatron calls with the run's config; `validate_hsap_args`
# rewrites `--spec megatron_hsap.megatron.spec HSAP_LAYER_SPEC` to it so no config option is dropped.
HSAP_LOCAL_LAYER_SPEC: ModuleSpec = hsap_layer_spec(use_te=False)
HSAP_LAYER_SPEC: ModuleSpec = hsap_layer_spec(use_te=have_transformer_engine())
