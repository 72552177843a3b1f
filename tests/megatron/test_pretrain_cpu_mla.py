"""Multi-latent attention in Megatron's own ``pretrain()`` loop on CPU (``megatron-hsap pretrain-cpu
... -- --multi-latent-attention ...``): q and kv LoRA ranks, a no-RoPE qk head of 16 plus a
decoupled RoPE head of 8 (d_qk 24 ≠ d_v 12), ``--rope-type yarn`` (MLA's default, with
``--rotary-scaling-factor 4``: YaRN's frequencies and ``mscale`` differ from plain RoPE) and
``--rope-type rope``.

The reference is the same loop at CP=1 under HSAP (one rank: no sharding, no P2P, RoPE by position
inside the document). megatron-core's local ``DotProductAttention`` cannot be the reference here:
it takes no ``k_channels`` / ``v_channels``, so Megatron cannot build MLA without Transformer
Engine (``TypeError: DotProductAttention.__init__() got an unexpected keyword argument
'k_channels'``). That HSAP's CP=1 MLA equals megatron-core's own MLA with a float64 core attention
is shown by ``tests/megatron/test_mla.py`` (tiny GPT, 5 steps). Same tolerance as
``test_pretrain_cpu.py`` (1e-5 relative: fp32, only sums reordered; measured equal to the 7 digits
Megatron prints).
"""

from __future__ import annotations

import pytest

from megatron_hsap.megatron.cpu.command import CPURun, megatron_flags
from tests.megatron.test_pretrain_cpu import _params, _run, _same_losses, root  # noqa: F401

pytestmark = pytest.mark.timeout(1800)

BASE = dict(steps=3, eval_interval=3, eval_iters=1)
MLA = ("--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--rotary-scaling-factor", "4",
       "--mscale", "1.0", "--mscale-all-dim", "0.0")  # fmt: skip


def _mla(rope_type: str) -> tuple[str, ...]:
    return (*MLA, "--rope-type", rope_type)


def test_mla_run_drops_gqa_flags_megatron_refuses() -> None:
    """Megatron asserts "Group query attention is mutually exclusive with multi latent attention":
    the CPU model's ``--group-query-attention --num-query-groups 2`` go when MLA is asked for."""
    flags = megatron_flags(CPURun(extra=_mla("yarn")))
    assert "--multi-latent-attention" in flags
    assert "--group-query-attention" not in flags and "--num-query-groups" not in flags
    plain = megatron_flags(CPURun())
    assert plain[plain.index("--num-query-groups") + 1] == "2"


def test_mla_run_flags_pass_hsap_validation() -> None:
    """The MLA command line parses with Megatron's own parser and HSAP's validation accepts it
    (``--no-rope-fusion`` is among the CPU fusion-off flags)."""
    import argparse

    from megatron.training import arguments as megatron_arguments

    from megatron_hsap.megatron.arguments import add_hsap_args, validate_hsap_args

    parser = megatron_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = add_hsap_args(parser).parse_args(megatron_flags(CPURun(extra=_mla("yarn"))))
    assert args.multi_latent_attention and not args.apply_rope_fusion and args.rope_type == "yarn"
    assert (args.qk_head_dim + args.qk_pos_emb_head_dim, args.v_head_dim) == (24, 12)  # d_qk ≠ d_v
    hsap = validate_hsap_args(args)
    assert (hsap.intra_size, hsap.inter_size) == (2, 2)
    assert args.spec == ["megatron_hsap.megatron.spec", "hsap_layer_spec"]


def _check_model(result) -> None:  # noqa: ANN001
    names = _params(result)
    for part in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj"):
        assert any(part in n for n in names), (part, sorted(names))  # megatron-core's MLA was built


@pytest.mark.slow
def test_mla_yarn_in_megatrons_loop_cp2_and_2x2_equal_cp1(root) -> None:  # noqa: F811
    cp1 = _run(root, world_size=1, intra_size=1, inter_size=1, **BASE, extra=_mla("yarn"))
    cp2 = _run(root, world_size=2, intra_size=1, inter_size=2, **BASE, extra=_mla("yarn"))
    cp4 = _run(root, world_size=4, intra_size=2, inter_size=2, **BASE, extra=_mla("yarn"))
    _check_model(cp1)
    assert _params(cp2) == _params(cp1) == _params(cp4)
    _same_losses(cp2.losses, cp1.losses)
    _same_losses(cp4.losses, cp1.losses)
    _same_losses(cp4.validation, cp1.validation)


@pytest.mark.slow
def test_mla_rope_in_megatrons_loop_2x2_equals_cp1_and_differs_from_yarn(root) -> None:  # noqa: F811
    cp1 = _run(root, world_size=1, intra_size=1, inter_size=1, **BASE, extra=_mla("rope"))
    cp4 = _run(root, world_size=4, intra_size=2, inter_size=2, **BASE, extra=_mla("rope"))
    _check_model(cp4)
    _same_losses(cp4.losses, cp1.losses)
    yarn = _run(root, world_size=1, intra_size=1, inter_size=1, **BASE, extra=_mla("yarn"))  # cached when run above
    # The rope type reaches MLA's rotary module: YaRN (scaling factor 4, mscale ≈ 1.14 on the 8 RoPE
    # channels) trains differently. Only slightly in 3 steps at init scale (measured ≈ 4e-6 relative,
    # 20× the CP runs' differences), so only "not the same run" is asserted.
    assert yarn.losses != cp1.losses, (yarn.losses, cp1.losses)
