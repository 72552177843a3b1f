"""Attention variants of current models in Megatron's own ``pretrain()`` loop: YaRN context
extension (``--position-embedding-type yarn``, the RoPE of GPT-OSS and of Qwen-style long-context
models), layers without RoPE (``--no-rope-freq``: Llama 4's and SmolLM3's interleaved NoPE
layers) and gated attention (``--attention-output-gate``: Qwen3-Next's sigmoid gate on the
attention output, projected with q by Megatron's ``linear_qkv``). megatron-core's
``YarnRotaryEmbedding`` builds the rotary table (GPTModel's and HybridModel's ``yarn`` branch) and
HSAP's ``HSAPSelfAttention`` rotates q and k by each token's position inside its document, cos and
sin scaled by YaRN's concentration factor as Megatron's own attention scales them.

Default: CP 2×2 against the CP=1 reference, whose attention is megatron-core's local one applying
its own YaRN rotation and factor (code nobody here wrote), at a scaling that bends every frequency
band (factor 4 over an original context of 64 tokens: the concentration factor is 1.139). Without
HSAP's factor (``mscale`` 1) the same comparison is 7.9e-5 apart, over the 1e-5 it must meet
(checked by mutation, 2026-12-06).

Slow, each at CP 2×2: GPT-OSS's attention recipe — YaRN, learnable sinks, a causal sliding window
every other layer — against the same loop at CP=1 under HSAP (a window makes megatron-core's local
attention mask by the window alone: ``test_pretrain_cpu_window.py``); the rest against the local
reference: a ``HybridModel`` (``*--*-``) with YaRN; every other layer without RoPE (HSAP skips the
rotation on the layers Megatron's attention skips: ``HSAPSelfAttention._layer_skips_rope``); gated
attention with μP in one run (HSAP's attention passes Megatron's gate through,
``HSAPSelfAttention.get_query_key_value_tensors``; μP's attention scale is ``config.softmax_scale``).
"""

from __future__ import annotations

import pytest

from megatron_hsap.megatron.cpu.command import compare_losses
from tests.megatron.test_pretrain_cpu import BASE, RTOL, _params, _reference, _run, _same_losses, root  # noqa: F401

pytestmark = pytest.mark.timeout(1800)

YARN = ("--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "64")


def test_yarn_in_megatrons_loop_equals_the_local_reference(root) -> None:  # noqa: F811
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, extra=YARN, **BASE)
    ref = _reference(root, extra=YARN)
    _same_losses(hsap.losses, ref.losses)
    _same_losses(hsap.validation, ref.validation)
    # the flags reach the model: YaRN trains otherwise than plain RoPE. Position handling moves
    # this 2-layer model's 4 losses little (the corpus is the running Python's standard library:
    # 1.3e-4 apart on 3.13, 7.1e-5 on 3.12; a stronger YaRN, factor 40 over 16 positions, 9.2e-5),
    # so the margin is 3x the tolerance the two runs above are held to, as for --no-rope-freq
    rope = _reference(root)
    assert compare_losses(rope.losses, ref.losses)[0] > 3 * RTOL, (rope.losses, ref.losses)


def test_yarn_is_accepted_and_other_position_types_are_refused() -> None:
    from megatron_hsap.errors import ConfigError
    from megatron_hsap.megatron.arguments import validate_hsap_args
    from tests.megatron.test_arguments import GOOD, _parse

    assert validate_hsap_args(_parse([*GOOD, "--position-embedding-type", "yarn", "--rotary-scaling-factor", "32"])) is not None
    for other in ("mrope", "relative"):
        with pytest.raises(ConfigError, match=f"--position-embedding-type {other}: HSAP supports rope, yarn"):
            validate_hsap_args(_parse([*GOOD, "--position-embedding-type", other]))


GPT_OSS_ATTENTION = (*YARN, "--softmax-type", "learnable", "--window-size", "(32,0)", "--window-attn-skip-freq", "2")


@pytest.mark.slow
def test_gpt_oss_attention_recipe_in_megatrons_loop_equals_cp1(root) -> None:  # noqa: F811
    """YaRN + learnable sinks + a sliding window every other layer, CP 2×2 against CP=1 under HSAP."""
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, extra=GPT_OSS_ATTENTION, **BASE)
    cp1 = _run(root, world_size=1, intra_size=1, inter_size=1, extra=GPT_OSS_ATTENTION, **BASE)
    _same_losses(hsap.losses, cp1.losses)
    _same_losses(hsap.validation, cp1.validation)
    yarn_only = _reference(root, extra=YARN)  # the sinks and the window change the model
    assert compare_losses(yarn_only.losses, cp1.losses)[0] > 10 * RTOL


@pytest.mark.slow
def test_yarn_in_a_hybrid_model_equals_the_local_reference(root) -> None:  # noqa: F811
    extra = ("--hybrid-layer-pattern", "*--*-", *YARN)
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, extra=extra, **BASE)
    ref = _reference(root, extra=extra)
    _same_losses(hsap.losses, ref.losses)


@pytest.mark.slow
def test_layers_without_rope_equal_the_local_reference(root) -> None:  # noqa: F811
    extra = ("--no-rope-freq", "2")  # Megatron's 1:N ratio: every second layer skips RoPE
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, extra=extra, **BASE)
    ref = _reference(root, extra=extra)
    _same_losses(hsap.losses, ref.losses)
    rope = _reference(root)  # the flag reaches the model: 6.7e-5 apart over these 4 steps (2 layers)
    assert compare_losses(rope.losses, ref.losses)[0] > 3 * RTOL, (rope.losses, ref.losses)


@pytest.mark.slow
def test_gated_attention_with_mup_equals_the_local_reference(root) -> None:  # noqa: F811
    """Gated attention and μP (``--use-mup``: megatron-core sets ``config.softmax_scale`` to
    √d_base / d, which HSAP's core attention reads as Megatron's does) in one run."""
    gate = ("--attention-output-gate",)
    extra = (*gate, "--use-mup", "--mup-base-hidden-size", "32")
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, extra=extra, **BASE)
    ref = _reference(root, extra=extra)
    _same_losses(hsap.losses, ref.losses)
    for other in (_reference(root), _reference(root, extra=gate)):  # each flag changes the model
        assert compare_losses(other.losses, ref.losses)[0] > 10 * RTOL, (other.losses, ref.losses)


# Qwen3-Next's layout as a GPTModel: gated delta net (linear attention) layers with a softmax attention
# layer every second one (megatron-core's experimental GPT block spec)
QWEN3_NEXT = ("--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
              "--linear-num-key-heads", "4", "--linear-num-value-heads", "8", "--linear-key-head-dim", "8",
              "--linear-value-head-dim", "8", "--swiglu")


@pytest.mark.slow
def test_gpt_gated_delta_net_layers_in_megatrons_loop_equal_cp1(root) -> None:  # noqa: F811
    """GPTModel with gated delta net layers (``--experimental-attention-variant gated_delta_net``, the
    layers HSAP's spec swaps for ``HSAPGatedDeltaNet`` as in a hybrid model) at CP 2×2 (two-level
    plans: ``--hsap-flatten never``) equal CP=1 under HSAP. On CPU the block spec's TE modules are
    local ones (``cpu/rank.py``), in both runs. Measured 2026-12-07: 2.0e-7; with Megatron's own
    permutation in place of the plan's the run dies (its zigzag halves of short documents are 0)."""
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, extra=(*QWEN3_NEXT, "--hsap-flatten", "never"), **BASE)
    cp1 = _run(root, world_size=1, intra_size=1, inter_size=1, extra=QWEN3_NEXT, **BASE)
    _same_losses(hsap.losses, cp1.losses)
    _same_losses(hsap.validation, cp1.validation)
    names = _params(hsap)
    assert any(n.endswith("layers.0.self_attention.A_log") for n in names)  # layer 1: gated delta net
    assert any(n.endswith("layers.1.self_attention.linear_qkv.weight") for n in names)  # layer 2: softmax attention
