"""Megatron's own ``pretrain()`` loop on CPU with other precisions, positions and sharding: bf16 and
fp16, unpacked samples and learned absolute positions, Megatron-FSDP ZeRO-3 (the GPT-30B configs'
layer, ``--model gpt``) and ZeRO-2. Each HSAP run against the same flags at CP=1, as in
``test_pretrain_cpu.py`` (whose cached runs, fixture and helpers these share). All slow-marked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_hsap.megatron.cpu.command import compare_losses
from tests.megatron.test_pretrain_cpu import BASE, RTOL, _reference, _run, _same_losses, root  # noqa: F401

pytestmark = pytest.mark.timeout(1800)


# Half precision rounds every activation, so HSAP's merges (in float32) and Megatron's local softmax
# round differently. Measured over these 4 steps: bf16 1.5e-5 relative (3.2e-5 over 6), while bf16
# itself moves the losses 1.5e-4 off the float32 run: 6e-5 tells the two apart with 4x room;
# fp16 (finer mantissa) 4.6e-6 over its 2 logged steps.
HALF_RTOL = {"bf16": 6e-5, "fp16": 5e-5}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_in_megatrons_loop_equals_the_reference(root: Path, precision: str) -> None:  # noqa: F811
    """``--bf16`` / ``--fp16`` (Megatron's Float16Module, float32 main grads), CP 2×2 against the local
    reference in the same precision. fp16 starts its loss scale at 1024: with per-token loss sums the
    first updates overflow and Megatron skips them (no lm loss logged), so both runs must skip the
    same iterations — the CP ranks agree on the overflow — and equal each other after."""
    extra = ("--bf16",) if precision == "bf16" else ("--fp16", "--initial-loss-scale", "1024")
    sizes = dict(BASE, steps=6) if precision == "fp16" else BASE
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, extra=extra, **sizes)
    ref = _reference(root, extra=extra, **({"steps": 6} if precision == "fp16" else {}))
    log = (Path(hsap.log_dir) / "rank0.log").read_text()
    dtype = "torch.bfloat16" if precision == "bf16" else "torch.float16"
    assert re.search(rf"^  params_dtype \.+ {re.escape(dtype)}$", log, re.M)
    if precision == "fp16":
        assert "number of skipped iterations:   1" in hsap.output and sorted(hsap.losses) == [5, 6]
    worst, why = compare_losses(hsap.losses, ref.losses)
    assert not why and worst <= HALF_RTOL[precision], (worst, why, hsap.losses, ref.losses)
    if precision == "bf16":  # the run computed in bf16: its losses moved off the float32 ones
        fp32 = _reference(root).losses
        assert max(abs(ref.losses[i] - fp32[i]) / fp32[i] for i in fp32) > 10 * RTOL


@pytest.mark.slow
@pytest.mark.parametrize("packed,positions", [(False, "rope"), (False, "learned_absolute"), (True, "learned_absolute")],
                         ids=["unpacked-rope", "unpacked-learned", "packed-learned"])
def test_positions_and_unpacked_samples_equal_the_reference(root: Path, packed: bool, positions: str) -> None:  # noqa: F811
    """Unpacked samples attend across their documents while ``--reset-position-ids`` restarts the
    dataset's position ids at each EOD; a learned absolute embedding reads those ids, RoPE does not
    (megatron-core's GPTModel builds its table from the sequence length). Measured before the
    fixes: unpacked RoPE 3.3e-3 off (the reference applied the per-document mask), unpacked learned
    positions 9.0e-4 (HSAP gave the model positions counted over the sample)."""
    extra = ("--position-embedding-type", positions)
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, packed=packed, extra=extra, **BASE)
    ref = _reference(root, packed=packed, extra=extra)
    _same_losses(hsap.losses, ref.losses)
    _same_losses(hsap.validation, ref.validation)
    if not packed:  # the documents' boundaries matter to this model: the packed run differs
        packed_ref = _reference(root, extra=extra)
        # (over the steps: the corpus is the running Python's standard library, and on 3.12's the
        # step-2 loss alone moved 6.1e-4 / 5.3e-4, rope / learned, under the 1e-3 once asked there)
        assert compare_losses(packed_ref.losses, ref.losses)[0] > 30 * RTOL, (packed_ref.losses, ref.losses)


FSDP = ("--use-distributed-optimizer", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_megatron_fsdp_zero3_with_the_gpt30b_configs_layer_equals_the_reference(root: Path, precision: str) -> None:  # noqa: F811
    """What configs/base/gpt30b_64gpu.yaml runs, at CPU size: the GPT layer (LayerNorm, GeLU, biases,
    MHA, tied embeddings), Megatron-FSDP ZeRO-3 over the 4 DP×CP ranks with overlapped gradient
    reduce and parameter gather, full recompute; against the same flags at CP=1 (FSDP over one
    rank). fp32: equal. bf16 (the configs' precision): Megatron-FSDP's backward hooks allocate its
    bf16 gradient buckets on ``torch.device("cuda")``, which crashed every CPU rank until the
    redirect covered backward hooks; the GPT layer in bf16 puts HSAP 1.1e-4 off the reference with
    or without FSDP (bf16 rounding: DDP and the distributed optimizer differ by 2e-5 alone), so 3e-4."""
    extra = (*FSDP, "--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
             "--overlap-param-gather", "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1", *(("--bf16",) if precision == "bf16" else ()))
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, model="gpt", extra=extra, **BASE)
    ref = _reference(root, model="gpt", extra=extra)
    log = (Path(hsap.log_dir) / "rank0.log").read_text()
    assert "Setting up Megatron-FSDP" in log
    assert re.search(r"^  data_parallel_sharding_strategy \.+ optim_grads_params$", log, re.M)
    if precision == "fp32":
        _same_losses(hsap.losses, ref.losses)
        _same_losses(hsap.validation, ref.validation)
        llama = _reference(root, extra=extra)  # --model gpt builds another model
        assert abs(llama.losses[1] - ref.losses[1]) > 100 * RTOL * ref.losses[1]
    else:
        for got, want in ((hsap.losses, ref.losses), (hsap.validation, ref.validation)):
            worst, why = compare_losses(got, want)
            assert not why and worst <= 3e-4, (worst, got, want)


@pytest.mark.slow
def test_megatron_fsdp_zero2_over_dp2_cp4_equals_the_reference(root: Path) -> None:  # noqa: F811
    """Megatron-FSDP ZeRO-2 (optimizer state and gradients sharded) over DP 2 × CP 2×2 (world 8),
    fp32, against the same flags at DP 2, CP=1."""
    extra = (*FSDP, "--data-parallel-sharding-strategy", "optim_grads")
    hsap = _run(root, world_size=8, intra_size=2, inter_size=2, extra=extra, **BASE)
    ref = _run(root, world_size=2, reference=True, extra=extra, **BASE)
    assert "Setting up Megatron-FSDP" in (Path(hsap.log_dir) / "rank0.log").read_text()
    _same_losses(hsap.losses, ref.losses)
    _same_losses(hsap.validation, ref.validation)
