"""Multi-token prediction (``--mtp-num-layers``) in Megatron's own ``pretrain()`` loop on CPU.

The reference is the CP=1 local-attention loop of ``test_pretrain_cpu.py`` with MTP's shifts inside
each document, by Megatron's own packed-sequence ``roll_tensor`` at CP 1 (``cpu/loop.py``
``_mtp_shifts_inside_documents``; without it Megatron would shift the reference's ``[b, s]`` rows
across documents). Both the lm loss and every depth's logged MTP loss are compared. The MTP loss is
held to 2e-6 (measured equal to the 7 digits Megatron prints): Megatron's own per-rank token counts
(what ``mtp.process_mtp_loss`` replaces) leave the lm loss within ``RTOL`` (7.0e-6 over 6 steps at
2×2, depth 1) but put the logged MTP loss 1.0e-5 off from the first step.
"""

from __future__ import annotations

import pytest

from tests.megatron.test_pretrain_cpu import _params, _reference, _run, _same_losses, root  # noqa: F401

pytestmark = pytest.mark.timeout(1800)

BASE = dict(steps=4, eval_interval=2, eval_iters=1)
MTP_RTOL = 2e-6


def _same_mtp(got, want, depths: int) -> None:  # noqa: ANN001
    assert sorted(got.mtp_losses) == list(range(1, depths + 1)), got.mtp_losses
    assert sorted(want.mtp_losses) == sorted(got.mtp_losses), want.mtp_losses
    for depth, losses in want.mtp_losses.items():
        assert sorted(got.mtp_losses[depth]) == sorted(losses) and losses
        for step, value in losses.items():
            assert abs(got.mtp_losses[depth][step] - value) <= MTP_RTOL * abs(value), (depth, step, got.mtp_losses[depth][step], value)


def _mtp(depths: int, *more: str) -> tuple[str, ...]:
    return ("--mtp-num-layers", str(depths), *more)


def test_mtp_two_depths_at_2x2_equal_cp1(root) -> None:  # noqa: F811
    extra = _mtp(2)
    ref = _reference(root, extra=extra)
    got = _run(root, world_size=4, intra_size=2, inter_size=2, **BASE, extra=extra)
    _same_losses(got.losses, ref.losses)
    _same_losses(got.validation, ref.validation)
    _same_mtp(got, ref, 2)  # both depths logged by both runs


@pytest.mark.slow
@pytest.mark.parametrize("topology", [(1, 4), (4, 1)])
def test_mtp_flattened_topologies_equal_cp1(root, topology) -> None:  # noqa: F811, ANN001
    extra = _mtp(1)
    ref = _reference(root, extra=extra)
    got = _run(root, world_size=4, intra_size=topology[0], inter_size=topology[1], **BASE, extra=extra)
    _same_losses(got.losses, ref.losses)
    _same_mtp(got, ref, 1)


@pytest.mark.slow
def test_mtp_with_tp2_sequence_parallel_equal_cp1(root) -> None:  # noqa: F811
    extra = _mtp(1, "--sequence-parallel")
    ref = _reference(root, extra=_mtp(1))
    got = _run(root, world_size=8, tp=2, intra_size=2, inter_size=2, **BASE, extra=extra)
    _same_losses(got.losses, ref.losses)
    _same_mtp(got, ref, 1)


@pytest.mark.slow
def test_mtp_on_the_last_pipeline_stage_equals_pp2_reference(root) -> None:  # noqa: F811
    extra = _mtp(1)
    ref = _run(root, world_size=2, pp=2, reference=True, micro_batch_size=1, **BASE, extra=extra)
    got = _run(root, world_size=8, pp=2, intra_size=2, inter_size=2, micro_batch_size=1, **BASE, extra=extra)
    _same_losses(got.losses, ref.losses)
    _same_mtp(got, ref, 1)


@pytest.mark.slow
def test_mtp_with_sft_data_equal_cp1(root) -> None:  # noqa: F811
    extra = _mtp(1)
    ref = _reference(root, sft=True, extra=extra)
    got = _run(root, world_size=4, intra_size=2, inter_size=2, sft=True, **BASE, extra=extra)
    _same_losses(got.losses, ref.losses)
    _same_mtp(got, ref, 1)


@pytest.mark.slow
def test_mtp_with_sliding_windows_equal_hsap_at_cp1(root) -> None:  # noqa: F811
    """Windows on every other layer (the MTP layers count their own layers from 1, as megatron-core
    numbers them, so each takes its decoder namesake's window); the reference is HSAP at CP=1, as
    for every windowed model (a window replaces the local attention's document mask)."""
    extra = _mtp(2, "--window-size", "64,0", "--window-attn-skip-freq", "2")
    ref = _run(root, world_size=1, intra_size=1, inter_size=1, **BASE, extra=extra)
    got = _run(root, world_size=4, intra_size=2, inter_size=2, **BASE, extra=extra)
    _same_losses(got.losses, ref.losses)
    _same_mtp(got, ref, 2)


@pytest.mark.slow
def test_mtp_with_experts_split_over_cp_equal_cp1(root) -> None:  # noqa: F811
    """DeepSeek-style: MoE layers (the MTP layer's too) with experts split over the CP group, DP 2 × CP
    2×2, micro-batch 1, so the reference (experts split alike over 2 data-parallel ranks) runs the same
    micro-batches; Megatron weights MTP's loss per micro-batch (``reference_of`` refuses a split that
    changes them)."""
    extra = _mtp(1, "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2")
    ref = _run(root, world_size=2, reference=True, micro_batch_size=1, **BASE, extra=extra)
    got = _run(root, world_size=8, intra_size=2, inter_size=2, micro_batch_size=1, **BASE, extra=extra)
    _same_losses(got.losses, ref.losses)
    _same_mtp(got, ref, 1)


@pytest.mark.slow
def test_mtp_in_a_hybrid_model_equals_cp1(root) -> None:  # noqa: F811
    """``HybridModel`` takes its MTP depths from the pattern (after ``/``); their layers come from the
    stack spec, so HSAP's run builds them from HSAP's and the reference from megatron-core's local one."""
    extra = _mtp(1, "--hybrid-layer-pattern", "*-*-/*-")
    ref = _reference(root, extra=extra)
    got = _run(root, world_size=4, intra_size=2, inter_size=2, **BASE, extra=extra)
    assert any(".mtp.layers.0.mtp_model_layer.layers.0.self_attention." in name for name in _params(got)), sorted(_params(got))
    _same_losses(got.losses, ref.losses)
    _same_mtp(got, ref, 1)
