"""``--context-parallel-impl`` against the ``megatron/training/arguments.py`` shipped in the
megatron-core 0.19.2 wheel (``megatron.training`` is part of the wheel: tested for real, not on a
plain parser only)."""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.arguments import HSAPArgs, add_hsap_args, validate_hsap_args

megatron_arguments = pytest.importorskip("megatron.training.arguments")

GOOD = [
    "--context-parallel-impl", "hsap", "--context-parallel-size", "8",
    "--hierarchical-context-parallel-sizes", "4", "2", "--attention-dropout", "0.0",
    "--calculate-per-token-loss", "--num-attention-heads", "16", "--group-query-attention",
    "--num-query-groups", "4", "--tensor-model-parallel-size", "2", "--position-embedding-type", "rope",
]

MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser = megatron_arguments.add_megatron_arguments(parser)
    return add_hsap_args(parser).parse_args(argv)


def test_megatron_parser_accepts_flags_and_validation_passes() -> None:
    args = _parse(GOOD)
    assert args.context_parallel_impl == "hsap"
    assert args.hierarchical_context_parallel_sizes == [4, 2]  # Megatron's own flag, reused
    hsap = validate_hsap_args(args)
    assert hsap == HSAPArgs(intra_size=4, inter_size=2)
    assert args.spec == ["megatron_hsap.megatron.spec", "hsap_layer_spec"]  # a callable Megatron calls with its config


def test_megatron_parse_args_with_extra_args_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    # The wrapper's path: megatron.training.arguments.parse_args(extra_args_provider=add_hsap_args).
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_hsap.py", *GOOD, "--transformer-impl", "local"])
    args = megatron_arguments.parse_args(extra_args_provider=add_hsap_args)
    assert validate_hsap_args(args) == HSAPArgs(intra_size=4, inter_size=2)
    assert args.spec == ["megatron_hsap.megatron.spec", "hsap_layer_spec"]


def test_head_chunks_flag_reaches_the_plan_options() -> None:
    args = _parse(GOOD + ["--hsap-head-chunks", "1"])
    assert validate_hsap_args(args) == HSAPArgs(intra_size=4, inter_size=2) and args.hsap_head_chunks == 1
    mha = _parse(GOOD + ["--num-query-groups", "16", "--hsap-head-chunks", "2"])  # 2 q and 2 kv heads per intra rank
    assert validate_hsap_args(mha) == HSAPArgs(intra_size=4, inter_size=2)  # 2 chunks of one q and one kv head
    gqa = _parse(GOOD + ["--hsap-head-chunks", "2"])  # 2 q heads and 1 kv head per intra rank
    assert validate_hsap_args(gqa) == HSAPArgs(intra_size=4, inter_size=2)  # 2 q chunks sharing the kv head


def test_grad_wire_dtype_flag_reaches_the_plan_options() -> None:
    from megatron_hsap.megatron.pretrain_hooks import plan_flags
    from megatron_hsap.plan import compile_plan

    default = plan_flags(_parse(GOOD))
    assert "grad_wire_dtype" not in default  # the plan's own default: partial gradients in the activation dtype
    assert not compile_plan([0, 300, 1024], 2, 4, num_heads=8, num_kv_heads=4, **default).shape.fp32_grads
    flags = plan_flags(_parse(GOOD + ["--hsap-grad-wire-dtype", "fp32", "--hsap-head-chunks", "2"]))
    assert flags["grad_wire_dtype"] == "fp32" and flags["head_chunks"] == 2
    plan = compile_plan([0, 300, 1024], 2, 4, num_heads=8, num_kv_heads=4, **flags)
    assert plan.shape.fp32_grads and plan.options.grad_wire_dtype == "fp32"
    with pytest.raises(SystemExit):  # argparse names the choices
        _parse(GOOD + ["--hsap-grad-wire-dtype", "bf16"])


def test_ring_is_the_default_and_untouched() -> None:
    args = _parse(["--context-parallel-size", "2"])
    assert args.context_parallel_impl == "ring"
    assert validate_hsap_args(args) is None and args.spec is None


@pytest.mark.parametrize(("given", "named"), [
    (["--hsap-layout", "contiguous"], "--hsap-layout contiguous"),
    (["--no-hsap-plan-process", "--hsap-pool-bytes", "4096"], "--hsap-pool-bytes 4096, --no-hsap-plan-process"),
    (["--hsap-dump-plan", "2", "/tmp/plans"], "--hsap-dump-plan 2 /tmp/plans"),
    (["--hsap-plan-process"], "--hsap-plan-process"),  # given at its default: still a flag the ring ignores
])
def test_hsap_flags_under_ring_are_refused_not_ignored(given: list[str], named: str) -> None:
    # the impl flag forgotten: the ring would run and ignore them
    args = _parse(["--context-parallel-size", "2", *given])
    with pytest.raises(ConfigError, match=f"^{named}: HSAP's flags, but --context-parallel-impl is ring"):
        validate_hsap_args(args)
    from megatron_hsap.megatron.arguments import drop_hsap_flags

    assert validate_hsap_args(_parse(drop_hsap_flags(["--context-parallel-size", "2", *given]))) is None
    assert validate_hsap_args(_parse(["--context-parallel-size", "2", "--hsap-layout", "balanced"])) is None  # the default


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (["--hierarchical-context-parallel-sizes", "2", "2"], "product must equal"),
        (["--hierarchical-context-parallel-sizes", "2", "2", "2"], "exactly two"),
        (["--num-attention-heads", "12"], "P_intra=4"),  # 6 heads per TP rank: 4 does not divide them
        (["--window-size", "(128,4)"], "--window-size"),  # right > 0: HSAP plans are causal
        (["--window-size", "(128,4)"], "--context-parallel-impl ring with --cp-comm-type a2a or all_gather"),  # what to do
        (["--multi-latent-attention"], "--no-rope-fusion"),  # MLA is supported; TE's fused MLA RoPE is not
        (["--multi-latent-attention", "--no-rope-fusion", "--mla-down-proj-fusion"], "--mla-down-proj-fusion"),
        (["--hybrid-layer-pattern", "D*D*"], "DSA"),
        (["--position-embedding-type", "mrope"], "position-embedding-type"),
        (["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2"], "--micro-batch-size 1"),
        (["--spec", "my.module", "MY_SPEC"], "--spec"),
        (["--hybrid-context-parallel"], "alternatives"),
        # DSA's indexer and Megatron-LM main's GatedDeltaNet2 (which its HybridBlock builds for 'G'
        # layers, bypassing the stack spec) read Megatron's token layout
        (["--experimental-attention-variant", "dsa"], "--experimental-attention-variant dsa: not supported by HSAP"),
        # a GPT model's gated delta net layers: Megatron's CP rule for their heads, and silu
        (["--experimental-attention-variant", "gated_delta_net", "--swiglu", "--linear-num-key-heads", "8"],
         "--experimental-attention-variant gated_delta_net: --linear-num-key-heads 8 must split over TP 2 x CP 8"),
        (["--experimental-attention-variant", "gated_delta_net", "--linear-num-key-heads", "32",
          "--linear-num-value-heads", "64"], "--experimental-attention-variant gated_delta_net: megatron-core convolves"),
        # 2 q heads and 1 kv head per intra rank: 2 q chunks may share the kv head, 4 cannot split 2 heads
        (["--hsap-head-chunks", "4"], r"--hsap-head-chunks 4: each intra rank holds 2 q and 1 kv heads; valid counts: \[1, 2\]"),
        (["--hsap-head-chunks", "0"], "must be >= 1"),
        (["--hsap-pool-bytes", "0"], "--hsap-pool-bytes 0: must be >= 1"),  # (read as unset before)
        (["--hsap-gpus-per-node", "0"], "--hsap-gpus-per-node 0: must be >= 1"),  # (raised at the first batch before)
        # --sft: SFTDataset's bare asserts, raised on the dataset-building ranks only (the others waited)
        (["--sft", "--no-create-attention-mask-in-dataloader", "--reset-position-ids"],
         r"^--sft: Megatron's SFTDataset asserts these off: --reset-position-ids \(drop it\) \("),
        (["--sft", "--no-create-attention-mask-in-dataloader", "--reset-attention-mask"], r"these off: --reset-attention-mask \(drop it\) \("),
        (["--sft"], r"these off: --create-attention-mask-in-dataloader \(Megatron's default: pass --no-create-attention-mask-in-dataloader\)"),
        # a worker process for plans nobody prefetches (the flag was dropped silently before)
        (["--hsap-plan-process", "--no-hsap-plan-prefetch"], "--hsap-plan-process compiles the prefetched plans .* drop one of them"),
        # the forced one-level topology replaces the all-to-all the count pins (the count was dropped)
        (["--hsap-head-chunks", "2", "--hsap-flatten", "all-to-all"], "--hsap-head-chunks 2 pins the configured all-to-all"),
        # per-sample balancing over HSAP's packed [t, 1, h] micro-batch (measured in Megatron's loop,
        # CP 2x2, micro-batch 2: 5.2e-5 off the reference; micro-batch 1: 1.8e-7)
        (MOE + ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "2"],
         r"seq_aux_loss \(coefficient 0.01\) with --micro-batch-size 2: .* use --micro-batch-size 1"),
        (MOE + ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01", "0.001",
                "--micro-batch-size", "4"], r"coefficient 0.001\) with --micro-batch-size 4"),
    ],
)
def test_refusals_name_the_flag(change: list[str], match: str) -> None:
    args = _parse(GOOD + change)
    with pytest.raises(ConfigError, match=match):
        validate_hsap_args(args)


def test_gdn2_of_megatron_lm_main_is_refused() -> None:
    # (megatron-core 0.19.2's parser has no gdn2; Megatron-LM main's sets the same attribute)
    hybrid = ["--hybrid-layer-pattern", "G*G-", "--swiglu", "--linear-num-key-heads", "16", "--linear-num-value-heads", "32"]
    args = _parse(GOOD + hybrid)
    args.experimental_attention_variant = "gdn2"
    with pytest.raises(ConfigError, match="--experimental-attention-variant gdn2: not supported by HSAP"):
        validate_hsap_args(args)
    args = _parse(GOOD + hybrid + ["--experimental-attention-variant", "gated_delta_net"])
    assert validate_hsap_args(args) is not None  # (a hybrid model's 'G' layers are that variant)
    gpt = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4", "--swiglu",
           "--linear-num-key-heads", "16", "--linear-num-value-heads", "32"]
    assert validate_hsap_args(_parse(GOOD + gpt)) is not None  # GPTModel's gated delta net layers (Qwen3-Next)


@pytest.mark.parametrize("change", [["--sft", "--no-create-attention-mask-in-dataloader"],
                                    ["--sft", "--dataloader-inter-document-masking"]])  # (Megatron then turns the mask off)
def test_sft_with_what_sftdataset_asserts_off_is_accepted(change: list[str]) -> None:
    assert validate_hsap_args(_parse(GOOD + change)) is not None


@pytest.mark.parametrize(("change", "process"), [
    ([], True),  # not given: on
    (["--hsap-plan-process"], True),
    (["--no-hsap-plan-process"], False),
    (["--no-hsap-plan-prefetch"], True),  # (no worker is started without prefetch)
    (["--no-hsap-plan-process", "--no-hsap-plan-prefetch"], False),  # redundant, not contradictory
])
def test_plan_process_flag_resolves_to_on_unless_turned_off(change: list[str], process: bool) -> None:
    args = _parse(GOOD + change)
    assert args.hsap_plan_process is (None if not change or change == ["--no-hsap-plan-prefetch"] else process)
    validate_hsap_args(args)
    assert args.hsap_plan_process is process


@pytest.mark.parametrize("change", [
    ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "1"],
    ["--moe-router-load-balancing-type", "seq_aux_loss", "--micro-batch-size", "2"],  # coefficient 0: off
    ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "2"],
    ["--moe-router-load-balancing-type", "global_aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01", "0",
     "--micro-batch-size", "2"],
])
def test_moe_balancing_that_hsap_computes_as_megatron_is_accepted(change: list[str]) -> None:
    assert validate_hsap_args(_parse(GOOD + MOE + change)) is not None


# Megatron's validate_args asserts these without a message; run_pretrain names them first
BARE_IN_MEGATRON = [
    (["--hierarchical-context-parallel-sizes", "2", "2"], "--hierarchical-context-parallel-sizes 2 2: the product must equal --context-parallel-size 8"),
    (["--cp-comm-type", "a2a+p2p"], r"--cp-comm-type a2a\+p2p selects Transformer Engine's"),
]
_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "128", "--max-position-embeddings", "128",
          "--micro-batch-size", "1", "--lr", "1e-4", "--train-iters", "1", "--transformer-impl", "local"]


def test_megatron_asserts_the_sizes_product_without_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    # why run_pretrain checks first: Megatron's own message is empty
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 8)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's rule for CP > 1
    args = _parse(GOOD + _MODEL + BARE_IN_MEGATRON[0][0])
    args.rank, args.world_size = 0, 16
    with pytest.raises(AssertionError) as err:
        megatron_arguments.validate_args(args, {})
    assert str(err.value) == ""


# and a CUDA graph that would replay one batch's plan (megatron/cuda_graphs.py): refused before Megatron starts
@pytest.mark.parametrize(("change", "match"), BARE_IN_MEGATRON + [
    (["--enable-cuda-graph"], "--cuda-graph-impl local without --cuda-graph-modules")])
def test_run_pretrain_names_them_before_megatron_validates(monkeypatch: pytest.MonkeyPatch, change: list[str], match: str) -> None:
    from megatron_hsap.megatron import pretrain_hooks

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_hsap.py", *GOOD, *_MODEL, *change])

    def megatron_validation(*_a: object, **_k: object) -> None:
        raise AssertionError("Megatron's validation ran before HSAP's check")

    def datasets(*_a: object) -> None:  # (run_pretrain marks it distributed, as pretrain_gpt.py does)
        return None

    monkeypatch.setattr(megatron_arguments, "parse_and_validate_args", megatron_validation)
    with pytest.raises(ConfigError, match=match):
        pretrain_hooks.run_pretrain(datasets, lambda *a: None, lambda *a: None)
    # the same namespace passes both checks without the change (so the check is what refused it)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_hsap.py", *GOOD, *_MODEL])
    with pytest.raises(AssertionError, match="Megatron's validation ran"):
        pretrain_hooks.run_pretrain(datasets, lambda *a: None, lambda *a: None)


def test_either_loss_normalisation_is_accepted() -> None:
    # megatron/loss.py hands Megatron's default normalisation the micro-batch's token count
    without = _parse([a for a in GOOD if a != "--calculate-per-token-loss"])
    assert not without.calculate_per_token_loss
    assert validate_hsap_args(without) == validate_hsap_args(_parse(GOOD))


def test_sizes_derived_from_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = [a for a in GOOD]
    i = argv.index("--hierarchical-context-parallel-sizes")
    del argv[i : i + 3]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    hsap = validate_hsap_args(_parse(argv))
    # TP=2 on 8 GPUs per node leaves room for P_intra <= 4; 4 divides the 8 q heads per TP rank
    # and is a multiple of the 2 kv heads per TP rank.
    assert (hsap.intra_size, hsap.inter_size, hsap.derived_sizes) == (4, 2, True)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match="--hierarchical-context-parallel-sizes"):
        validate_hsap_args(_parse(argv))


def test_plain_parser_gets_the_same_flags() -> None:
    args = add_hsap_args(argparse.ArgumentParser()).parse_args(
        ["--context-parallel-impl", "hsap", "--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"]
    )
    args.calculate_per_token_loss = True
    assert validate_hsap_args(args) == HSAPArgs(intra_size=2, inter_size=2)


# ----------------------------------------------------------------------------- patches/
PATCH = Path(__file__).resolve().parents[2] / "patches" / "megatron-lm-core_v0.19.0-context-parallel-impl.patch"
PATCHED_ARGV = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--train-iters", "10", "--lr", "1e-4", "--transformer-impl", "local", "--position-embedding-type", "rope",
    "--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2", "--attention-dropout", "0.0",
]


def _patched_arguments_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The wheel's megatron/training/arguments.py (== core_v0.19.0's) with the patch applied."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is needed to apply the patch")
    target = tmp_path / "megatron" / "training" / "arguments.py"
    target.parent.mkdir(parents=True)
    shutil.copy(megatron_arguments.__file__, target)
    subprocess.run([git, "apply", "--include=megatron/training/arguments.py", str(PATCH)], cwd=tmp_path, check=True)
    spec = importlib.util.spec_from_file_location("megatron.training._hsap_patched_arguments", target)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "megatron.training"  # its function-level relative imports resolve
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "get_device_arch_version", lambda: 10)  # the only CUDA query on this path
    return module


def _validate_patched(module: ModuleType, argv: list[str]) -> argparse.Namespace:
    args = module.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)
    args.rank, args.world_size = 0, 8
    return module.validate_args(args)


def test_patch_adds_flag_and_megatron_validate_args_runs_hsap_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _patched_arguments_module(tmp_path, monkeypatch)
    args = _validate_patched(module, PATCHED_ARGV + ["--context-parallel-impl", "hsap", "--calculate-per-token-loss"])
    assert args.hsap == HSAPArgs(intra_size=2, inter_size=2)
    assert args.spec == ["megatron_hsap.megatron.spec", "hsap_layer_spec"]
    assert _validate_patched(module, PATCHED_ARGV + ["--context-parallel-impl", "hsap"]).hsap == args.hsap  # either loss normalisation
    # attention dropout runs under HSAP (runtime/dropout.py), Megatron's default 0.1 included
    args = _validate_patched(module, PATCHED_ARGV + ["--context-parallel-impl", "hsap", "--attention-dropout", "0.1"])
    assert args.hsap == HSAPArgs(intra_size=2, inter_size=2) and args.attention_dropout == 0.1
    # named before Megatron's own bare assert on the sizes' product (its message is empty)
    with pytest.raises(ConfigError, match="the product must equal --context-parallel-size 8"):
        _validate_patched(module, PATCHED_ARGV + ["--context-parallel-impl", "hsap", "--calculate-per-token-loss",
                                                  "--context-parallel-size", "8"])
    with pytest.raises(AssertionError, match="^$"):  # ring: Megatron's own check, unchanged
        _validate_patched(module, PATCHED_ARGV + ["--context-parallel-size", "8"])
    # a forgotten --context-parallel-impl hsap: the ring would ignore HSAP's flags (parse_args adds them)
    args = add_hsap_args(module.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))).parse_args(
        PATCHED_ARGV + ["--hsap-layout", "contiguous"])
    args.rank, args.world_size = 0, 8
    with pytest.raises(ConfigError, match="--hsap-layout contiguous: HSAP's flags, but --context-parallel-impl is ring"):
        module.validate_args(args)
    ring = _validate_patched(module, PATCHED_ARGV)  # default: Megatron unchanged
    assert ring.context_parallel_impl == "ring" and not hasattr(ring, "hsap") and ring.spec is None
    # add_hsap_args on top of the patched parser must not clash over --context-parallel-impl.
    parser = add_hsap_args(module.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    assert parser.parse_args(["--context-parallel-impl", "hsap"]).context_parallel_impl == "hsap"


def test_patched_parse_args_registers_hsap_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The patch-only path (plain pretrain_gpt.py): Megatron's own parse_args knows --hsap-*, and an
    # entry point that adds them again (scripts/pretrain_gpt_hsap.py) does not clash.
    module = _patched_arguments_module(tmp_path, monkeypatch)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *PATCHED_ARGV, "--hsap-layout", "contiguous",
                                      "--hsap-hardware", "h200"])
    args = module.parse_args()
    assert (args.hsap_layout, args.hsap_hardware) == ("contiguous", "h200")
    assert module.parse_args(extra_args_provider=add_hsap_args).hsap_layout == "contiguous"


def test_module_level_spec_names_become_the_callable_and_local_backend_is_refused() -> None:
    for name in ("HSAP_LAYER_SPEC", "HSAP_LOCAL_LAYER_SPEC"):
        args = _parse([*GOOD, "--spec", "megatron_hsap.megatron.spec", name])
        validate_hsap_args(args)
        assert args.spec == ["megatron_hsap.megatron.spec", "hsap_layer_spec"]  # built from the config
    args = _parse([*GOOD, "--attention-backend", "local"])
    with pytest.raises(ConfigError, match="--attention-backend local"):
        validate_hsap_args(args)
    args = _parse([*GOOD, "--hsap-dump-plan", "0", "/tmp/x"])
    with pytest.raises(ConfigError, match="ITER must be"):
        validate_hsap_args(args)
