"""One rank of ``megatron-hsap pretrain-cpu``: ``python -m megatron_hsap.megatron.cpu.rank <Megatron flags>``.

Installs the CUDA→CPU redirect before Megatron is imported for real, then runs the same
:func:`~megatron_hsap.megatron.pretrain_hooks.run_pretrain` a GPU job runs, with the CPU corpus's
dataset provider and loss — or, with ``--megatron-lm`` (``HSAP_CPU_MEGATRON_LM``), the checkout's
``pretrain_gpt.py`` (``pretrain_hybrid.py`` given a hybrid layer pattern) through
:func:`~megatron_hsap.megatron.megatron_lm.run_megatron_lm`, the function
``scripts/pretrain_gpt_hsap.py`` / ``scripts/pretrain_hybrid_hsap.py`` run. The rendezvous is a file store (``HSAP_CPU_STORE``): nothing listens on
a TCP port for it, and gloo is pinned to the loopback interface by the launcher.
"""

from __future__ import annotations

import os
import time


def main() -> None:
    start = time.time()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("HSAP_CPU_THREADS", "1")))
    from megatron_hsap.megatron.cpu import device

    device.install()
    from megatron_hsap.megatron.cpu import record

    record.install()
    without_te()
    from megatron_hsap.megatron.cpu.command import MEGATRON_LM_ENV

    store = dist.FileStore(os.environ["HSAP_CPU_STORE"], int(os.environ["WORLD_SIZE"]))
    checkout = os.environ.get(MEGATRON_LM_ENV)
    if checkout:  # --megatron-lm: the checkout's pretrain_gpt.py / pretrain_hybrid.py, as scripts/pretrain_*_hsap.py run them
        from megatron_hsap.megatron.megatron_lm import run_megatron_lm

        run_megatron_lm(checkout, store=store, program_start=start)
        return
    from megatron_hsap.megatron.cpu.loop import cpu_datasets_provider, cpu_loss_func, reference_forward_step
    from megatron_hsap.megatron.pretrain_hooks import run_pretrain

    run_pretrain(cpu_datasets_provider, reference_forward_step, cpu_loss_func,
                 args_defaults={}, store=store, program_start=start)


def without_te() -> None:
    """What a CPU rank without Transformer Engine substitutes before Megatron builds a model (each
    function below says what and why); nothing on a rank with TE."""
    from megatron.core.extensions import transformer_engine

    if getattr(transformer_engine, "HAVE_TE", False):
        return
    _local_hybrid_final_norm()
    _sequence_parallel_torch_norm()
    _no_te_inference_linears()
    _local_experimental_attention_backend()
    _qk_clip_without_te()


def _qk_clip_without_te() -> None:
    """Megatron's ``validate_args`` asserts Transformer Engine >= 2.9 for ``--qk-clip`` and
    ``--log-max-attention-logit`` (its own core attention takes the maxima from TE's kernel; both
    asserts ask for exactly "2.9.0", nothing else does). HSAP's core attention computes them
    itself (``runtime/max_logits.py``), so a CPU rank answers that one version query yes; a GPU run
    keeps Megatron's check."""
    from megatron.training import arguments

    real = arguments.is_te_min_version

    def is_te_min_version(version: str, check_equality: bool = True) -> bool:
        return True if version == "2.9.0" else real(version, check_equality)

    arguments.is_te_min_version = is_te_min_version


def _local_hybrid_final_norm() -> None:
    """megatron-core 0.19.2's ``HybridStack`` builds its final norm as Transformer Engine's ``TENorm``
    whatever the stack spec says (``models/hybrid/hybrid_block.py``), and ``TENorm`` raises without
    TE. On a CPU rank without TE the stack gets megatron-core's ``WrappedTorchNorm`` with the same
    arguments instead (the only model module this CPU support replaces; a GPU run with TE never
    gets here). Every run of a comparison gets the same substitution."""
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    hybrid_block.TENorm = WrappedTorchNorm


def _no_te_inference_linears() -> None:
    """Megatron-LM's main branch (0.20 pre-release, 2026-08) asks every MTP layer whether its
    projection is an inference-optimised linear (``tensor_parallel.inference_layers.
    is_inference_column_parallel_linear``, an ``isinstance`` over subclasses of Transformer Engine's
    linears); without TE those base classes are megatron-core's ``MagicMock`` stand-ins, so the
    ``isinstance`` raises ``TypeError`` and no MTP model builds on a CPU rank, with HSAP or without.
    Without TE no module is one of them: the question gets its answer, False. (megatron-core 0.19.2
    has no such call; a GPU run with TE never gets here.)"""
    try:
        from megatron.core.tensor_parallel import inference_layers
        from megatron.core.transformer import multi_token_prediction
    except ImportError:
        return
    if not hasattr(inference_layers, "is_inference_column_parallel_linear") or isinstance(
            getattr(inference_layers, "InferenceColumnParallelLinear", None), type):
        return

    def is_inference_column_parallel_linear(module: object) -> bool:
        del module
        return False

    for owner in (inference_layers, multi_token_prediction):
        if hasattr(owner, "is_inference_column_parallel_linear"):
            owner.is_inference_column_parallel_linear = is_inference_column_parallel_linear


def _local_experimental_attention_backend() -> None:
    """megatron-core's GPT block spec for experimental attention variants (gated delta net layers
    every few layers, ``--experimental-attention-variant gated_delta_net``) asserts Transformer
    Engine (``_get_backend_spec_provider``). On a CPU rank without TE it gets megatron-core's local
    modules instead, with a local norm-then-projection for the one TE module the gated delta net
    layer needs (``column_parallel_layer_norm_linear``: TE fuses the layer's input norm into its
    ``in_proj``, so its spec has no separate input norm). Every run of a comparison gets the same
    substitution; a GPU run with TE never gets here."""
    import dataclasses

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class NormThenColumnParallelLinear(ColumnParallelLinear):
        """TE's ``LayerNormColumnParallelLinear`` as two local modules: the config's norm, then the projection."""

        def __init__(self, input_size: int, output_size: int, *, config: object, **kwargs: object) -> None:
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm = WrappedTorchNorm(config=config, hidden_size=input_size, eps=config.layernorm_epsilon)

        def forward(self, input_: object, *args: object, **kwargs: object) -> object:
            return super().forward(self.layer_norm(input_), *args, **kwargs)

    class Local(LocalSpecProvider):
        def column_parallel_layer_norm_linear(self) -> type:
            return NormThenColumnParallelLinear

    def self_attention(config: object, backend: object = None) -> ModuleSpec:
        """The standard attention layers' module: the local GPT layer's (its norm stays a separate module)."""
        attn = gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=config.qk_layernorm, qk_l2_norm=config.qk_l2_norm, normalization=config.normalization,
            multi_latent_attention=config.multi_latent_attention).submodules.self_attention
        return dataclasses.replace(attn, metainfo={**attn.metainfo, "fuse_input_layernorm": False})

    specs._get_backend_spec_provider = lambda config: Local()
    specs._get_self_attention_module_spec = self_attention


def _sequence_parallel_torch_norm() -> None:
    """Sequence parallelism on CPU ranks. megatron-core's ``WrappedTorchNorm`` (its norm without TE
    or apex) asserts ``sequence_parallel`` off: under it each TP rank normalises its own slice of
    the sequence, so a norm weight's gradient is that slice's part, to be summed over TP — which
    Megatron's ``finalize_model_grads`` does for every parameter marked ``sequence_parallel``
    (``_allreduce_non_tensor_model_parallel_grads``), and apex's ``FusedLayerNorm``
    (``fusions/fused_layer_norm.py``) and TE's norms mark theirs. On a CPU rank without TE the torch
    norm is built as before and its parameters marked the same way (every run of a comparison gets
    it; at TP=1 Megatron turns sequence parallelism off, so the reference is untouched)."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build = WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,  # noqa: ANN001, ANN202
            normalization="LayerNorm"):
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        plain = copy.copy(config)  # (no __post_init__ again: the config is Megatron's, validated)
        plain.sequence_parallel = False
        norm = build(cls, plain, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(new)


if __name__ == "__main__":
    main()
