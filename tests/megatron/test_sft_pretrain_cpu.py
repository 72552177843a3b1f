"""Megatron's SFT data (``--sft``) in its own ``pretrain()`` loop (``megatron-hsap pretrain-cpu --sft``).

The samples come from megatron-core's ``SFTDataset.__getitem__``, unchanged: conversations packed
into 256-token samples, the prompt turns loss-masked, ``cu_seqlens`` right-padded to ``s + 1``
entries (``megatron/cpu/sft.py`` replaces only its jsonl reader and tokenizer, which need
``datasets`` / ``transformers``). SFTDataset pads each conversation to a multiple of 2·CP for ring's
zigzag split; under HSAP the provider builds the data as at CP=1 (``pretrain_hooks.sft_data_as_cp1``),
so the reference — the same loop at CP=1 with megatron-core's local ``DotProductAttention`` and a
document-causal mask made from each batch's ``cu_seqlens`` (SFTDataset makes none) — reads the very
same samples. Same harness and tolerance as test_pretrain_cpu.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.cpu.command import CPURun, megatron_flags, reference_of
from tests.megatron.test_pretrain_cpu import BASE, RTOL, _records, _run, _same_losses, root  # noqa: F401

pytestmark = pytest.mark.timeout(1800)

SFT = dict(sft=True, **BASE)


def _micro_batches(result, ranks: range, training: bool) -> list[list[tuple[float, int]]]:
    """Per micro-batch (in order), each of ``ranks``' recorded ``(Σ loss·mask, loss tokens)``."""
    per_rank = [[(r["loss_sum"], r["tokens"]) for r in _records(result, f"losses-rank{k}.jsonl") if r["training"] == training]
                for k in ranks]
    assert len({len(x) for x in per_rank}) == 1, [len(x) for x in per_rank]
    return [list(x) for x in zip(*per_rank)]


def test_sft_flags_follow_what_sftdataset_asserts() -> None:
    hsap = megatron_flags(CPURun(sft=True))
    # SFTDataset asserts no position / mask resets and no dataloader mask; its batches carry cu_seqlens
    assert "--sft" in hsap and "--reset-position-ids" not in hsap and "--dataloader-inter-document-masking" not in hsap
    ref_run, name = reference_of(CPURun(sft=True))
    ref = megatron_flags(ref_run)
    assert name == "CP=1, local attention"
    assert "--no-create-attention-mask-in-dataloader" in ref and "--reset-attention-mask" not in ref
    with pytest.raises(ConfigError, match="drop --no-packed"):
        CPURun(sft=True, packed=False).check()
    with pytest.raises(ConfigError, match="--sft after --: give it to pretrain-cpu"):
        CPURun(extra=("--sft",)).check()
    # every pipeline stage reads an SFT batch, so PP 3 keeps the local-attention reference
    assert reference_of(CPURun(sft=True, pp=3, num_layers=3, world_size=6, intra_size=1, inter_size=2,
                               micro_batch_size=1))[1] == "CP=1, local attention"


def test_hsap_builds_the_sft_data_of_cp1() -> None:
    """SFTDataset pads each conversation to a multiple of 2·CP (ring's zigzag split needs it); under
    HSAP the provider runs with ``args.context_parallel_size`` at 1 — only with ``--sft``, restored
    after (also when the provider raises) — so it packs the conversations as a CP=1 run does, and
    those samples differ from the padded ones (the CP=4 padding is real: the check can fail)."""
    from argparse import Namespace

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from megatron_hsap.megatron.cpu.loop import _dataset_config
    from megatron_hsap.megatron.cpu.sft import sft_dataset_class
    from megatron_hsap.megatron.pretrain_hooks import sft_data_as_cp1

    seen = []
    args = Namespace(sft=True, context_parallel_size=4)
    with sft_data_as_cp1(args):
        seen.append(args.context_parallel_size)
    with pytest.raises(RuntimeError), sft_data_as_cp1(args):
        seen.append(args.context_parallel_size)
        raise RuntimeError
    plain = Namespace(sft=False, context_parallel_size=4)
    with sft_data_as_cp1(plain):
        seen.append(plain.context_parallel_size)
    assert seen == [1, 1, 4] and args.context_parallel_size == 4

    def samples(cp: int, under_hsap: bool) -> list[list[int]]:
        """Conversation lengths of each of the 4 SFT samples built at CP ``cp``, in HSAP's provider or not."""
        a = Namespace(seed=1234, seq_length=256, split="90,5,5", data_cache_path=None, reset_position_ids=False,
                      reset_attention_mask=False, eod_mask_loss=False, create_attention_mask_in_dataloader=False,
                      sft=True, context_parallel_size=cp)
        with sft_data_as_cp1(a) if under_hsap else contextlib.nullcontext():
            train = BlendedMegatronDatasetBuilder(sft_dataset_class(), [4, 0, 0], lambda: True, _dataset_config(a)).build()[0]
        out = []
        for i in range(4):
            cu = np.asarray(train[i]["cu_seqlens"], dtype=np.int64)
            out.append(np.diff(cu[: np.argmax(cu) + 1]).tolist())
        return out

    at_cp1 = samples(1, under_hsap=False)
    # (2·CP = 8 would pad them: some conversation's length is not a multiple of 8; which sample
    # holds one depends on the corpus, this Python's standard library — on 3.12 the first does not)
    assert samples(4, under_hsap=True) == at_cp1 and any(n % 8 for x in at_cp1 for n in x[:-1]), at_cp1
    padded = samples(4, under_hsap=False)  # for contrast, what a ring run at CP 4 reads
    assert padded != at_cp1 and all(n % 8 == 0 for x in padded for n in x[:-1]), padded


def test_document_causal_mask_from_padded_cu_seqlens() -> None:
    import torch

    from megatron_hsap.megatron.cpu.loop import document_causal_mask

    cu = torch.tensor([[0, 3, 5, 6, 6, 6, 6], [0, 6, 6, 6, 6, 6, 6]], dtype=torch.int32)  # SFTDataset's padding
    got = document_causal_mask(cu, 6)
    assert got.shape == (2, 1, 6, 6) and got.dtype == torch.bool
    want = np.ones((2, 6, 6), dtype=bool)  # True: masked (Megatron's convention)
    for b, docs in enumerate([[(0, 3), (3, 5), (5, 6)], [(0, 6)]]):
        for lo, hi in docs:
            for q in range(lo, hi):
                want[b, q, lo:q + 1] = False
    assert np.array_equal(got[:, 0].numpy(), want)


def test_sft_in_megatrons_loop_equals_cp1_local_attention(root: Path) -> None:  # noqa: F811
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, **SFT)
    ref = _run(root, world_size=1, reference=True, **SFT)  # the CP=1 data: HSAP builds the same
    _same_losses(hsap.losses, ref.losses)
    assert sorted(hsap.losses) == [1, 2, 3, 4]
    log = (Path(hsap.log_dir) / "rank0.log").read_text()
    assert "WARNING: no --dataloader-inter-document-masking" not in log  # --sft batches carry cu_seqlens
    # the plans saw the packed conversations: more documents than the micro-batch's 2 samples
    docs = [int(line.rsplit("documents ", 1)[1].split()[0]) for line in log.splitlines() if "| documents " in line]
    assert len(docs) == 4 and min(docs) > 2, docs
    # training: the prompt turns are loss-masked, and the CP ranks' shares add up to the reference's
    for got, want in zip(_micro_batches(hsap, range(4), True), _micro_batches(ref, range(1), True), strict=True):
        tokens = sum(t for _, t in got)
        assert tokens == want[0][1] and 0 < tokens < 2 * 256
        assert sum(loss for loss, _ in got) == pytest.approx(want[0][0], rel=RTOL)
    # validation: Megatron's SFT mean of per-rank ratios, over HSAP's CP-summed reports (below)
    _sft_validation(hsap, range(4), ref, range(1))


def _sft_validation(hsap, ranks: range, ref, ref_ranks: range) -> None:
    """Megatron's SFT validation loss (``training.evaluate`` with ``args.sft``) averages each
    DP×CP rank's own per-token loss; HSAP sums each micro-batch's report over the CP group first
    (``loss.evaluation_report``), so the figure is the CP=1 one: at every pass HSAP's
    per-rank shares (``ranks``: the last stage's, as recorded before that sum) add up to the
    reference's loss, HSAP logs the reference's figure, and the mean of the shares' own ratios —
    what Megatron would log without the sum — is another number."""
    passes = _micro_batches(hsap, ranks, False)
    ref_passes = _micro_batches(ref, ref_ranks, False)
    logged = [hsap.validation[2], hsap.validation[4], hsap.final_validation, hsap.final_test]
    ref_logged = [ref.validation[2], ref.validation[4], ref.final_validation, ref.final_test]
    assert len(passes) == len(ref_passes) == 4
    apart = []
    for got, (want,), value, ref_value in zip(passes, ref_passes, logged, ref_logged, strict=True):
        assert sum(t for _, t in got) == want[1]
        assert sum(loss for loss, _ in got) / want[1] == pytest.approx(want[0] / want[1], rel=RTOL)
        assert ref_value == pytest.approx(want[0] / want[1], rel=RTOL)
        assert value == pytest.approx(ref_value, rel=RTOL)
        apart.append(abs(np.mean([loss / max(t, 1) for loss, t in got]) - ref_value) / ref_value)
    assert max(apart) > 100 * RTOL, apart  # (the per-rank mean is off: the sum is needed)


@pytest.mark.slow
def test_sft_over_pipeline_3_with_cp_1x2_equals_the_reference_at_pp_3(root: Path) -> None:  # noqa: F811
    """HSAP's answer to packed data with a middle pipeline stage (its error for PP > 2 without
    ``--sft`` says so): Megatron builds the SFT data on every stage, so the middle stage compiles
    its plans from its own batches' ``cu_seqlens``. Equal to local attention at PP 3, whose
    middle stage masks by the same batches."""
    sizes = dict(pp=3, num_layers=3, micro_batch_size=1, **SFT)
    hsap = _run(root, world_size=6, intra_size=1, inter_size=2, **sizes)
    ref = _run(root, world_size=3, reference=True, **sizes)
    _same_losses(hsap.losses, ref.losses)
    # Megatron's rank order (tp-cp-ep-dp-pp): the last stage is ranks 4-5 (its CP pair), 2 at CP=1
    _sft_validation(hsap, range(4, 6), ref, range(2, 3))


@pytest.mark.slow
def test_megatrons_default_loss_normalisation_equals_cp1(root: Path) -> None:  # noqa: F811
    """Without ``--calculate-per-token-loss`` Megatron trains on each micro-batch's mean loss; HSAP's
    CP ranks hold different numbers of loss tokens (the SFT prompt turns are masked, conversations
    stay whole), so the forward step hands Megatron the micro-batch's count (``megatron/loss.py``)
    and MTP's depth loss is scaled alike (``mtp.process_mtp_loss``). DP 2 × CP 2×2 with two
    micro-batches per DP rank equals the CP=1 reference under the same normalisation, lm and MTP
    loss. Measured on 2026-12-07 with the rank's own count instead: 1.1e-3 (lm) and 2.9e-3 (MTP)
    apart; 0.0 / 4.5e-7 with it. The per-token reference is another training (the normalisation
    is what the check sees)."""
    from tests.megatron.test_pretrain_cpu_mtp import _same_mtp

    sizes = dict(per_token_loss=False, global_batch_size=8, extra=("--mtp-num-layers", "1"), **SFT)
    hsap = _run(root, world_size=8, intra_size=2, inter_size=2, **sizes)
    ref = _run(root, world_size=1, reference=True, **sizes)
    _same_losses(hsap.losses, ref.losses)
    _same_mtp(hsap, ref, 1)
    per_token = _run(root, world_size=1, reference=True, **{**sizes, "per_token_loss": True})
    # (2.7e-4 apart over the 4 steps, measured)
    assert max(abs(per_token.losses[s] - v) / v for s, v in ref.losses.items()) > 10 * RTOL
