"""The HSAP layer spec: megatron-core's GPT layer spec with two modules swapped (docs/design.md §2.3, §3).

Only ``self_attention.module`` (→ :class:`HSAPSelfAttention`, RoPE by position; multi-latent
attention → :class:`~megatron_hsap.megatron.mla.HSAPMLASelfAttention`, its decoupled RoPE by position)
and ``self_attention.submodules.core_attention`` (→ :class:`HSAPCoreAttention`) change; norms, QKV and
output projections, MLP/MoE, bias-dropout-add and the sharded-state-dict key map stay Megatron's,
so checkpoints load unchanged.

``HybridModel`` (megatron-core 0.19.2's successor of ``GPTModel``): :func:`hsap_hybrid_stack_spec`
swaps the same modules in the ``attention_layer`` and ``mla_layer`` of a hybrid stack spec, and the
``mamba_layer``'s mixer for :class:`~megatron_hsap.megatron.mamba.HSAPMambaMixer` (Megatron's, its
tokens reordered by the plan); ``--spec megatron_hsap.megatron.spec HSAP_HYBRID_STACK_SPEC`` (what
``--context-parallel-impl hsap`` sets with ``--hybrid-layer-pattern``) feeds it to Megatron's
``HybridModelBuilder``; the gated delta net layer's ``GatedDeltaNet`` becomes
:class:`~megatron_hsap.megatron.gdn.HSAPGatedDeltaNet` alike. DSA layers, which HSAP has not made
layout-aware, are replaced by a module that raises ``ConfigError`` when the pattern uses them,
instead of computing over HSAP's token layout as if it were Megatron's.

``--spec megatron_hsap.megatron.spec hsap_layer_spec`` (what ``--context-parallel-impl hsap`` sets)
names a callable: megatron-core 0.19.2's ``GPTModelBuilder`` calls it with the run's
``GPTModelConfig`` (and ``vp_stage``), so the base spec is the one Megatron would build. The spec is
only valid with HSAP batch sharding: the core attention raises ``BatchError`` on other batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.ssm.gated_delta_net import common as gdn_common
from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.core_attention import HSAPCoreAttention
from megatron_hsap.megatron.gdn import HSAPGatedDeltaNet
from megatron_hsap.megatron.mamba import HSAPMambaMixer
from megatron_hsap.megatron.mla import HSAPMLASelfAttention
from megatron_hsap.megatron.rotary import HSAPSelfAttention

__all__ = [
    "hsap_layer_spec",
    "hsap_hybrid_stack_spec",
    "swap_attention",
    "have_transformer_engine",
    "HSAP_LAYER_SPEC",
    "HSAP_LOCAL_LAYER_SPEC",
    "HSAP_HYBRID_STACK_SPEC",
    "HSAPUnsupportedLayer",
    "check_model_attention",
]

# megatron-core's self-attention modules and the HSAP module each is swapped for
_SWAPS = {SelfAttention: HSAPSelfAttention, MLASelfAttention: HSAPMLASelfAttention}
# every megatron-core module that reads the token layout, and HSAP's (check_model_attention)
# (every gated delta net kind: Megatron-LM main's HybridBlock builds its GatedDeltaNet2 for 'G' layers,
# bypassing the stack spec, under --experimental-attention-variant gdn2)
_LAYOUT_MODULES = {**_SWAPS, MambaMixer: HSAPMambaMixer, GatedDeltaNet: HSAPGatedDeltaNet,
                   getattr(gdn_common, "_GDNBase", GatedDeltaNet): HSAPGatedDeltaNet}


def have_transformer_engine() -> bool:
    """Whether megatron-core found Transformer Engine (its own import check, nothing imported here)."""
    return bool(getattr(gpt_layer_specs, "HAVE_TE", False))


def swap_attention(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a GPT ``TransformerLayer`` spec with HSAP's self-attention and core attention (for
    megatron-core's ``GatedDeltaNet``: HSAP's ``HSAPGatedDeltaNet``, as in a hybrid model).

    Raises ``ConfigError`` when the layer's self-attention is none of megatron-core's
    ``SelfAttention``, ``MLASelfAttention`` and ``GatedDeltaNet``, instead of swapping a module it
    was not written for.
    """
    subs = layer_spec.submodules
    attn = getattr(subs, "self_attention", None)
    if isinstance(attn, ModuleSpec) and attn.module in (GatedDeltaNet, HSAPGatedDeltaNet):
        # a GPT block's linear-attention layer (--experimental-attention-variant gated_delta_net,
        # Qwen3-Next): a TransformerLayer around the module of a hybrid model's 'G' layer
        return _swap_gdn(layer_spec)
    if not isinstance(attn, ModuleSpec) or attn.module not in _SWAPS:
        found = getattr(attn, "module", attn)
        raise ConfigError(
            f"the layer's self_attention is {getattr(found, '__name__', found)!r}, not megatron-core's "
            "SelfAttention, MLASelfAttention or GatedDeltaNet; HSAP swaps those only"
        )
    new_attn = dataclasses.replace(
        attn,
        module=_SWAPS[attn.module],
        params=dict(attn.params),
        submodules=dataclasses.replace(attn.submodules, core_attention=HSAPCoreAttention),
    )
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(subs, self_attention=new_attn))


def check_model_attention(model: Any) -> None:
    """Refuse a model (or list of model chunks) holding a megatron-core self-attention or Mamba mixer
    that is not HSAP's (a key of ``_LAYOUT_MODULES`` that is not its value): it would read
    HSAP-sharded tokens as if they were Megatron's layout. Checked once per module object
    (``_hsap_attention_checked``)."""
    megatron_kinds, hsap_kinds = tuple(_LAYOUT_MODULES), tuple(_LAYOUT_MODULES.values())
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        if getattr(chunk, "_hsap_attention_checked", False):
            continue
        for name, module in chunk.named_modules():
            if isinstance(module, megatron_kinds) and not isinstance(module, hsap_kinds):
                raise ConfigError(
                    f"{name} is megatron-core's {type(module).__name__}, not HSAP's: the model builder did not use "
                    "the HSAP layer spec there (a custom model provider, or an MTP block built before "
                    "megatron_hsap.megatron.mtp.install()); build every attention layer from hsap_layer_spec and "
                    "every hybrid layer from hsap_hybrid_stack_spec")
        chunk._hsap_attention_checked = True


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
        from megatron.training.models.gpt import default_layer_spec

        return _swap_all(default_layer_spec(config, vp_stage))
    if use_te is None:
        impl = getattr(config, "transformer_impl", "transformer_engine")
        use_te = have_transformer_engine() and impl == "transformer_engine"
    if use_te and not have_transformer_engine():
        raise ConfigError("use_te=True but Transformer Engine is not installed; pass use_te=False for the local spec")
    kwargs: dict[str, Any] = {}
    if config is not None:
        kwargs = dict(
            num_experts=getattr(config, "num_moe_experts", None),
            moe_grouped_gemm=getattr(config, "moe_grouped_gemm", False),
            qk_layernorm=getattr(config, "qk_layernorm", False),
            qk_l2_norm=getattr(config, "qk_l2_norm", False),
            multi_latent_attention=getattr(config, "multi_latent_attention", False),
        )
        if not use_te:
            kwargs["normalization"] = getattr(config, "normalization", None)
    if use_te:
        base = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs)
    else:
        base = gpt_layer_specs.get_gpt_layer_local_spec(**kwargs)
    return swap_attention(base)


class HSAPUnsupportedLayer(MegatronModule):
    """Stands in a hybrid stack spec for a layer kind HSAP has not made layout-aware: building it
    (the hybrid pattern uses the layer) raises :class:`ConfigError` naming the layer symbol."""

    def __init__(self, config: Any, *args: Any, layer_kind: str = "", symbol: str = "", reason: str = "", **kwargs: Any) -> None:
        del args, kwargs
        raise ConfigError(
            f"--hybrid-layer-pattern uses {layer_kind} layers ('{symbol}'): {reason}. HSAP supports "
            "attention ('*'), MLA ('+'), Mamba ('M'), gated delta net ('G'), MLP ('-') and MoE ('E') layers of HybridModel; use --context-parallel-impl ring "
            "for this pattern"
        )


_UNSUPPORTED_HYBRID = {
    "dsa_layer": ("DSA (sparse MLA)", "D", "its indexer attends by Megatron's token order, not HSAP's layout"),
}


def _local_hybrid_stack_spec(normalization: str = "RMSNorm") -> ModuleSpec:
    """megatron-core's hybrid stack spec built from its local (non-TE) GPT modules: an attention
    layer (norm + self-attention), an MLA layer, an MLP layer (norm + MLP), an MoE layer (norm +
    megatron-core's ``MoELayer`` with local experts), a Mamba layer (norm + Megatron's
    ``MambaMixer``) and a gated delta net layer (norm + ``GatedDeltaNet``), their projections local
    in place of TE's norm-fused one, for CPU runs."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec_for_backend,
    )
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    def local(mla: bool) -> Any:
        return gpt_layer_specs.get_gpt_layer_local_submodules(normalization=normalization, multi_latent_attention=mla)

    def attention_only(subs: Any) -> ModuleSpec:
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=subs.input_layernorm, self_attention=subs.self_attention, self_attn_bda=subs.self_attn_bda))  # fmt: skip

    gpt = local(False)
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda))  # fmt: skip
    # MoE ('E'): as megatron-core's hybrid stack spec builds it (its expert count is a placeholder: the
    # layer reads --num-experts from the config), with local experts in place of TE's grouped GEMM
    moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp_bda=gpt.mlp_bda,
        mlp=get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False)))  # fmt: skip
    # multi-token prediction (a pattern "main/mtp/..."): megatron-core's MTP layer spec (norms, projection)
    # from local modules; no inner layer spec: the MTP layer builds the stack's layers, as in its hybrid spec
    mtp_layer = get_mtp_layer_spec_for_backend(mtp_model_layer_spec=None, backend=LocalSpecProvider())
    mtp = ModuleSpec(module=MultiTokenPredictionBlock, submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer]))
    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=gpt.input_layernorm, mamba_bda=gpt.self_attn_bda,
        mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))))  # fmt: skip
    gdn = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm, self_attn_bda=gpt.self_attn_bda,
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=gpt.input_layernorm, out_proj=RowParallelLinear))))  # fmt: skip
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=attention_only(gpt), mla_layer=attention_only(local(True)), mlp_layer=mlp,
        moe_layer=moe, mamba_layer=mamba, gdn_layer=gdn, mtp_block_spec=mtp))  # fmt: skip


def _swap_mamba(layer: Any) -> ModuleSpec:
    """A hybrid stack's Mamba layer spec with :class:`HSAPMambaMixer` as its mixer; a layer that is
    not megatron-core's ``MambaLayer`` around its ``MambaMixer`` becomes a refusing stand-in."""
    mixer = getattr(getattr(layer, "submodules", None), "mixer", None)
    if not (isinstance(layer, ModuleSpec) and layer.module is MambaLayer and isinstance(mixer, ModuleSpec)
            and mixer.module in (MambaMixer, HSAPMambaMixer)):
        found = getattr(mixer, "module", mixer)
        return ModuleSpec(module=HSAPUnsupportedLayer, params=dict(
            layer_kind="Mamba", symbol="M", reason=f"the stack spec's Mamba layer mixes with {getattr(found, '__name__', found)!r}, "
            "not megatron-core's MambaMixer inside its MambaLayer, the one HSAP reorders for"))  # fmt: skip
    new_mixer = dataclasses.replace(mixer, module=HSAPMambaMixer)
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mixer=new_mixer))


def _swap_gdn(layer: Any) -> ModuleSpec:
    """A hybrid stack's gated delta net layer spec with :class:`HSAPGatedDeltaNet` as its
    self-attention; a layer around anything but megatron-core's ``GatedDeltaNet`` becomes a refusing stand-in."""
    attn = getattr(getattr(layer, "submodules", None), "self_attention", None)
    if not (isinstance(layer, ModuleSpec) and isinstance(attn, ModuleSpec) and attn.module in (GatedDeltaNet, HSAPGatedDeltaNet)):
        found = getattr(attn, "module", attn)
        return ModuleSpec(module=HSAPUnsupportedLayer, params=dict(
            layer_kind="gated delta net", symbol="G", reason=f"the stack spec's gated delta net layer mixes with "
            f"{getattr(found, '__name__', found)!r}, not megatron-core's GatedDeltaNet, the one HSAP reorders for"))  # fmt: skip
    new_attn = dataclasses.replace(attn, module=HSAPGatedDeltaNet)
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=new_attn))


def hsap_hybrid_stack_spec(base: ModuleSpec | None = None, *, use_te: bool | None = None,
                           normalization: str = "RMSNorm") -> ModuleSpec:  # fmt: skip
    """A ``HybridModel`` stack spec with HSAP attention: Megatron's own, with the attention and MLA
    layers swapped (:func:`swap_attention`), the Mamba mixer and the gated delta net swapped
    (:class:`HSAPMambaMixer`, :class:`HSAPGatedDeltaNet`) and the layers HSAP cannot run refused.

    Args:
        base: a hybrid stack spec (``ModuleSpec(HybridStack, HybridStackSubmodules)``); default
            megatron-core's ``hybrid_stack_spec`` (Transformer Engine modules) with ``use_te``, else
            the same layers from megatron-core's local modules (``normalization`` for their norms).
        use_te: default: Transformer Engine when installed.
    Returns:
        ``ModuleSpec`` for ``HybridModel(hybrid_stack_spec=...)`` / ``--spec``.
    """
    if base is None:
        use_te = have_transformer_engine() if use_te is None else use_te
        if use_te and not have_transformer_engine():
            raise ConfigError("use_te=True but Transformer Engine is not installed; pass use_te=False for local modules")
        if use_te:
            from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

            base = hybrid_stack_spec
        else:
            base = _local_hybrid_stack_spec(normalization)
    subs = base.submodules
    changes: dict[str, Any] = {}
    for name in ("attention_layer", "mla_layer"):
        layer = getattr(subs, name, None)
        if isinstance(layer, ModuleSpec):
            changes[name] = swap_attention(layer)
    changes["mamba_layer"] = _swap_mamba(getattr(subs, "mamba_layer", None))
    changes["gdn_layer"] = _swap_gdn(getattr(subs, "gdn_layer", None))
    for name, (kind, symbol, reason) in _UNSUPPORTED_HYBRID.items():  # always: an IdentityOp default would skip the layer
        changes[name] = ModuleSpec(module=HSAPUnsupportedLayer, params=dict(layer_kind=kind, symbol=symbol, reason=reason))
    return dataclasses.replace(base, submodules=dataclasses.replace(subs, **changes))


# For code that builds GPTModel itself without a config (a plain layer: no QK norm, no MoE). Megatron's
# `--spec` names `hsap_layer_spec`, which Megatron calls with the run's config; `validate_hsap_args`
# rewrites `--spec megatron_hsap.megatron.spec HSAP_LAYER_SPEC` to it so no config option is dropped.
HSAP_LOCAL_LAYER_SPEC: ModuleSpec = hsap_layer_spec(use_te=False)
HSAP_LAYER_SPEC: ModuleSpec = hsap_layer_spec(use_te=have_transformer_engine())
# Megatron's HybridModelBuilder takes `--spec` as the stack spec itself (it does not call it).
HSAP_HYBRID_STACK_SPEC: ModuleSpec = hsap_hybrid_stack_spec()
