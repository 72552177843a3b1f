"""HybridModel (megatron-core 0.19.2's successor of GPTModel) under HSAP, built by Megatron's own
``HybridModel`` / ``HybridStack`` from :func:`hsap_hybrid_stack_spec`.

Here the pattern is attention and MLP layers (``*-*-``; DSA ``D`` layers are refused by the HSAP
spec, tested below; Mamba ``M`` and gated delta net ``G`` layers: ``test_mamba.py``, ``test_gdn.py``). The reference is the same stack built from megatron-core's modules at CP=1 with the
float64 core attention of test_sinks_gpt (1e-5 relative over 5 Adam steps, reason there).
``HybridStack`` hard-codes Transformer Engine's ``TENorm`` as its final norm; without TE both runs
use megatron-core's ``WrappedTorchNorm`` there (``test_sinks_gpt.local_final_norm``).
"""

from __future__ import annotations

import pytest

from tests.megatron.test_sinks_gpt import check_equal_to_cp1

PATTERN = "*-*-"  # attention, MLP, attention, MLP: 4 layers


def test_hybrid_attention_mlp_2x2_matches_cp1() -> None:
    got = check_equal_to_cp1((2, 2), {"num_layers": 4}, model="hybrid", pattern=PATTERN)
    assert any("self_attention.linear_qkv" in n for n in got["names"])
    assert any("mlp.linear_fc1" in n for n in got["names"])


@pytest.mark.slow
def test_hybrid_with_sinks_1x4_matches_cp1() -> None:
    check_equal_to_cp1((1, 4), {"num_layers": 4, "softmax_type": "learnable"}, model="hybrid", pattern=PATTERN)


def test_hybrid_spec_swaps_attention_and_refuses_dsa() -> None:
    from megatron_hsap.megatron.core_attention import HSAPCoreAttention
    from megatron_hsap.megatron.mla import HSAPMLASelfAttention
    from megatron_hsap.megatron.rotary import HSAPSelfAttention
    from megatron_hsap.megatron.spec import HSAP_HYBRID_STACK_SPEC, HSAPUnsupportedLayer, hsap_hybrid_stack_spec

    for spec in (HSAP_HYBRID_STACK_SPEC, hsap_hybrid_stack_spec(use_te=False)):
        subs = spec.submodules
        attn = subs.attention_layer.submodules.self_attention
        assert attn.module is HSAPSelfAttention and attn.submodules.core_attention is HSAPCoreAttention
        mla = subs.mla_layer.submodules.self_attention
        assert mla.module is HSAPMLASelfAttention and mla.submodules.core_attention is HSAPCoreAttention
    assert hsap_hybrid_stack_spec(use_te=False).submodules.dsa_layer.module is HSAPUnsupportedLayer


def dsa_pattern_case() -> str:
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_hsap.errors import ConfigError
    from megatron_hsap.megatron.spec import hsap_hybrid_stack_spec
    from tests.megatron.test_sinks_gpt import _config, local_final_norm

    config = _config(1, {"num_layers": 2})
    try:
        with local_final_norm():
            HybridModel(config=config, hybrid_stack_spec=hsap_hybrid_stack_spec(use_te=False), vocab_size=64,
                        max_sequence_length=32, hybrid_layer_pattern="D-", position_embedding_type="rope")  # fmt: skip
    except ConfigError as e:
        return str(e)
    return "built"


def test_hybrid_pattern_with_dsa_is_refused_by_name() -> None:
    from tests.distributed import get_pool

    msg = get_pool(1).run(dsa_pattern_case, timeout=300)[0]
    assert "DSA (sparse MLA) layers ('D')" in msg and "--context-parallel-impl ring" in msg


def test_arguments_hybrid_pattern_selects_the_hybrid_stack_spec() -> None:
    """``--hybrid-layer-pattern``: Megatron's HybridModelBuilder gets HSAP's stack spec object (it
    does not call ``--spec``), through Megatron's own importer."""
    from megatron.core.transformer.spec_utils import import_module

    from megatron_hsap.megatron.arguments import validate_hsap_args
    from megatron_hsap.megatron.spec import HSAP_HYBRID_STACK_SPEC
    from tests.megatron.test_arguments import GOOD, _parse

    args = _parse(GOOD + ["--hybrid-layer-pattern", "*-+-E"])
    assert validate_hsap_args(args) is not None
    assert args.spec == ["megatron_hsap.megatron.spec", "HSAP_HYBRID_STACK_SPEC"]
    assert import_module(args.spec) is HSAP_HYBRID_STACK_SPEC


# --- HybridModel in Megatron's own pretrain() loop (megatron-hsap pretrain-cpu) -------------------
# Megatron-LM's pretrain_hybrid.py builds the model config with hybrid_config_from_args, so
# HybridModelBuilder builds the model; run_pretrain does the same when --hybrid-layer-pattern is
# set. "*--*-" (attention, MLP, MLP, attention, MLP) is no GPT stack. The reference is the same loop
# at CP=1 with megatron-core's local modules (REFERENCE_HYBRID_STACK_SPEC: local DotProductAttention,
# the dataloader's per-document mask). HybridStack's TENorm final norm is WrappedTorchNorm in both
# runs on CPU (cpu/rank.py). Tolerance as test_pretrain_cpu (1e-5 relative).
LOOP_PATTERN = "*--*-"
_REFERENCE_SPEC = ("--spec", "megatron_hsap.megatron.cpu.reference_spec", "REFERENCE_HYBRID_STACK_SPEC")


def test_reference_hybrid_stack_spec_is_megatrons_local_stack() -> None:
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import import_module

    spec = import_module(list(_REFERENCE_SPEC[1:]))  # what hybrid_config_from_args does with --spec
    assert spec.module is HybridStack
    attn = spec.submodules.attention_layer.submodules.self_attention
    assert attn.module is SelfAttention and attn.submodules.core_attention is DotProductAttention
    # MoE layers ('E'): megatron-core's MoETransformerLayer around its MoELayer (an IdentityOp before
    # 2026-12-06, which HybridStack's forward could not run: found by pretrain-cpu with "M*E-")
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    moe = spec.submodules.moe_layer
    assert moe.module is MoETransformerLayer and moe.submodules.mlp.func is MoELayer


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_hybrid_model_in_megatrons_loop_equals_cp1_local_attention(tmp_path) -> None:
    import json
    import math
    from pathlib import Path

    from megatron_hsap.megatron.cpu.command import CPURun, run

    base = dict(steps=3, eval_interval=3, eval_iters=1)
    results = {}
    # the reference's --spec (megatron-core's local hybrid stack) is added by megatron_flags
    for name, kw in {"ref": dict(world_size=1, reference=True, extra=("--hybrid-layer-pattern", LOOP_PATTERN)),
                     "1x2": dict(world_size=2, intra_size=1, inter_size=2, extra=("--hybrid-layer-pattern", LOOP_PATTERN)),
                     "2x2": dict(world_size=4, intra_size=2, inter_size=2, extra=("--hybrid-layer-pattern", LOOP_PATTERN))}.items():  # fmt: skip
        log = tmp_path / name
        result = run(CPURun(log_dir=str(log), **base, **kw), record_dir=str(log / "record"))
        assert result.returncode == 0, result.output[-6000:]
        results[name] = (result, json.loads(Path(log / "record" / "params-rank0.json").read_text()))
    ref, ref_params = results["ref"]
    assert "HybridModel: pp_rank=0/1" in (tmp_path / "ref" / "rank0.log").read_text()  # HybridModelBuilder built it
    assert any(".decoder.layers.4.mlp." in n for n in ref_params)  # 5 layers: the pattern's
    assert any(".decoder.layers.3.self_attention." in n for n in ref_params)
    for name in ("1x2", "2x2"):
        got, params = results[name]
        assert params == ref_params  # the same parameters as Megatron's own local stack
        assert sorted(got.losses) == sorted(ref.losses) == [1, 2, 3]
        for step, want in ref.losses.items():
            assert math.isfinite(got.losses[step]) and abs(got.losses[step] - want) <= 1e-5 * abs(want), (name, step)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_hybrid_mla_model_in_megatrons_loop_2x2_equals_cp1(tmp_path) -> None:
    """MLA layers ('+') of a HybridModel in Megatron's loop (Megatron refuses '*' and '+' in one
    model: "Not supported to have both Attention and MLA/DSA in one model"). The CP=1 run is HSAP on
    one rank: megatron-core's local attention cannot build MLA (see test_pretrain_cpu_mla.py)."""
    import math

    from megatron_hsap.megatron.cpu.command import CPURun, run
    from tests.megatron.test_pretrain_cpu_mla import _mla

    extra = ("--hybrid-layer-pattern", "+--+-", *_mla("yarn"))
    runs = {}
    for name, kw in {"cp1": dict(world_size=1, intra_size=1, inter_size=1),
                     "2x2": dict(world_size=4, intra_size=2, inter_size=2)}.items():  # fmt: skip
        result = run(CPURun(log_dir=str(tmp_path / name), steps=3, eval_interval=3, eval_iters=1, extra=extra, **kw))
        assert result.returncode == 0, result.output[-6000:]
        runs[name] = result
    log = (tmp_path / "2x2" / "rank0.log").read_text()
    assert "layers='+--+-'" in log and "linear_kv_down_proj" in log  # HybridModel with MLA layers
    want, got = runs["cp1"].losses, runs["2x2"].losses
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in want:
        assert math.isfinite(got[step]) and abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)
