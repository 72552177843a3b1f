"""Batch sharding for the HSAP layout: round trips, padding, positions, loss denominators.

Single-process: plans come from ``compile_plan`` (pure Python) or a hand-made fake plan with a
scrambled layout; ``check_group=False`` skips the cross-rank fingerprint (tested multi-rank in
test_gpt_equivalence). Everything here is exact integer bookkeeping: no tolerances.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsap.errors import BatchError, ConfigError
from megatron_hsap.megatron.batch import (
    HSAP_MARKER,
    HSAPPackedSeqParams,
    get_batch_on_this_cp_rank,
    is_hsap_sharded,
    pack_micro_batch,
    positions_in_documents,
)
from megatron_hsap.plan import compile_plan

PAD = 999


@dataclass(frozen=True)
class _FakeBatch:
    cu_seqlens: tuple[int, ...]
    doc_starts: np.ndarray


class FakePlan:
    """Just what batch sharding reads from a plan, with a deliberately scrambled layout."""

    def __init__(self, cu: list[int], cp_size: int, seed: int = 0) -> None:
        total = cu[-1]
        padded = -(-total // cp_size) * cp_size
        self.num_tokens, self.padded_tokens, self.cp_size = total, padded, cp_size
        self.intra_size, self.inter_size = 1, cp_size
        starts = np.unique(np.asarray(cu, dtype=np.int64))
        if padded > total:
            starts = np.append(starts, padded)
        self.batch = _FakeBatch(tuple(cu), starts)
        self._perm = np.random.default_rng(seed).permutation(padded).reshape(cp_size, -1)

    def local_token_indices(self, cp_rank: int) -> np.ndarray:
        return self._perm[cp_rank].astype(np.int64)


def _cu_from_lengths(lengths: list[int]) -> list[int]:
    return [0, *np.cumsum(lengths).tolist()]


def _batch(cu: list[int], *, loss_zero_every: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    total = cu[-1]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (1, total), generator=g)
    labels = torch.randint(0, 256, (1, total), generator=g)
    loss_mask = torch.ones(1, total)
    if loss_zero_every:
        loss_mask[0, ::loss_zero_every] = 0.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


def _expected_positions(cu: list[int]) -> np.ndarray:
    return np.concatenate([np.arange(b - a) for a, b in zip(cu[:-1], cu[1:])] or [np.zeros(0, np.int64)])


def _check_round_trip(batch: dict[str, torch.Tensor], cu: list[int], plan: object, cp_size: int) -> None:
    total = cu[-1]
    seen = np.zeros(total, dtype=np.int64)
    loss_tokens = 0
    pos_expected = _expected_positions(cu)
    for r in range(cp_size):
        out = get_batch_on_this_cp_rank(batch, plan=plan, cp_rank=r, check_group=False, pad_token_id=PAD)
        ids = plan.local_token_indices(r)
        real = ids < total
        seen[ids[real]] += 1
        tok, lab, lm, pos = (out[k][0].numpy() for k in ("tokens", "labels", "loss_mask", "position_ids"))
        assert out["tokens"].shape == (1, len(ids))
        assert (tok[real] == batch["tokens"][0].numpy()[ids[real]]).all()
        assert (lab[real] == batch["labels"][0].numpy()[ids[real]]).all()
        assert (lm[real] == batch["loss_mask"][0].numpy()[ids[real]]).all()
        assert (tok[~real] == PAD).all() and (lab[~real] == PAD).all()
        assert (lm[~real] == 0).all() and (pos[~real] == 0).all()
        assert (pos[real] == pos_expected[ids[real]]).all()
        params = out["packed_seq_params"]
        assert is_hsap_sharded(params) and params.qkv_format == "thd"
        assert params.hsap_cp_rank == r and params.hsap_plan is plan
        assert torch.equal(params.hsap_position_ids, out["position_ids"][0])
        assert out["attention_mask"] is None
        assert out["num_tokens"] == total
        assert out["num_loss_tokens"] == int(batch["loss_mask"].sum())
        loss_tokens += int(lm.sum())
    assert (seen == 1).all(), "every real token must be held by exactly one CP rank"
    assert loss_tokens == int(batch["loss_mask"].sum()), "loss tokens over ranks must equal the global count"


@settings(max_examples=40)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda ls: sum(ls) > 0),
    topo=st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (2, 4)]),
)
def test_round_trip_real_plans(lengths: list[int], topo: tuple[int, int]) -> None:
    intra, inter = topo
    cu = _cu_from_lengths(lengths)
    # A generous receive pool: this test is about token placement, not the planner's pool sizing.
    plan = compile_plan(cu, inter_size=inter, intra_size=intra, num_heads=4, num_kv_heads=2, head_dim=8,
                        pool_bytes=1 << 20)
    _check_round_trip(_batch(cu, loss_zero_every=3), cu, plan, intra * inter)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_scrambled_layout(seed: int) -> None:
    cu = [0, 5, 5, 17, 18, 40, 41]  # an empty document and length-1 documents
    plan = FakePlan(cu, cp_size=4, seed=seed)
    _check_round_trip(_batch(cu, loss_zero_every=4, seed=seed), cu, plan, 4)


def test_padding_is_one_extra_document() -> None:
    cu = [0, 3, 10]  # T = 10, P = 4 -> T' = 12, two padding tokens
    plan = compile_plan(cu, inter_size=2, intra_size=2, num_heads=4, num_kv_heads=2, head_dim=8, layout="contiguous")
    out = get_batch_on_this_cp_rank(_batch(cu), plan=plan, cp_rank=3, check_group=False, pad_token_id=PAD)
    assert plan.padded_tokens == 12
    assert out["tokens"][0, -2:].tolist() == [PAD, PAD]
    assert out["loss_mask"][0, -2:].tolist() == [0.0, 0.0]
    params = out["packed_seq_params"]
    assert params.cu_seqlens_q.tolist() == [0, 3, 10, 12]
    assert params.max_seqlen_q == 7
    # balanced layout: the padding document may land on any rank; wherever it is, it is PAD with no loss
    bal = compile_plan(cu, inter_size=2, intra_size=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       layout="balanced", layout_fallback=False)
    seen = 0
    for rank in range(4):
        part = get_batch_on_this_cp_rank(_batch(cu), plan=bal, cp_rank=rank, check_group=False, pad_token_id=PAD)
        pad = bal.local_token_indices(rank) >= 10
        seen += int(pad.sum())
        assert all(t == PAD for t in part["tokens"][0, pad].tolist())
        assert all(m == 0.0 for m in part["loss_mask"][0, pad].tolist())
    assert seen == 2


def test_positions_in_documents_skips_empty_documents() -> None:
    cu = np.array([0, 2, 2, 5])
    ids = np.array([0, 1, 2, 3, 4, 5, 6])
    assert positions_in_documents(ids, cu, 5).tolist() == [0, 1, 0, 1, 2, 0, 0]


def test_pack_micro_batch_megatron_rows() -> None:
    # GPTDataset(inter_document_masking=True) pads each row with copies of seq_length.
    s = 6
    rows = torch.tensor([[0, 2, 6, 6, 6, 6, 6], [0, 6, 6, 6, 6, 6, 6]], dtype=torch.int32)
    tokens = torch.arange(2 * s).reshape(2, s)
    packed = pack_micro_batch({"tokens": tokens, "cu_seqlens": rows})
    assert packed.cu_seqlens.tolist() == [0, 2, 6, 12]
    assert packed.tokens.tolist() == list(range(12))


def test_unpacked_batch_is_one_document_per_sample() -> None:
    tokens = torch.arange(12).reshape(3, 4)
    packed = pack_micro_batch({"tokens": tokens})
    assert packed.cu_seqlens.tolist() == [0, 4, 8, 12]


def test_sbhd_sharding_keeps_samples() -> None:
    b, s = 3, 10
    tokens = torch.arange(b * s).reshape(b, s)
    out = get_batch_on_this_cp_rank(
        {"tokens": tokens, "labels": tokens + 1}, qkv_format="sbhd", cp_rank=1, check_group=False,
        plan_kwargs=dict(inter_size=2, intra_size=1, num_heads=2, num_kv_heads=1, head_dim=8),
    )
    plan = out["plan"]
    assert plan.options.num_heads == b * 2 and plan.options.num_kv_heads == b * 1  # batch folded into heads
    ids = plan.local_token_indices(1)
    assert out["tokens"].shape == (b, len(ids))
    real = ids < s
    assert torch.equal(out["tokens"][:, torch.from_numpy(real)], tokens[:, ids[real]])
    assert out["packed_seq_params"].qkv_format == "sbhd"


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_model_position_ids_are_the_datasets_rope_rows_are_per_document(layout: str) -> None:
    """A learned absolute embedding reads the model's ``position_ids``, which Megatron takes from the
    dataset (one count over the sample without ``--reset-position-ids``); RoPE's rows stay per
    document (measured: recomputing them for the model too put an unpacked learned-position run
    9e-4 off Megatron's CP=1 loss)."""
    cu = [0, 5, 12, 20]
    batch = _batch(cu)
    batch["position_ids"] = torch.arange(20).unsqueeze(0) + 100  # not per document
    plan = compile_plan(cu, inter_size=2, intra_size=2, num_heads=4, num_kv_heads=2, head_dim=8,
                        layout=layout, layout_fallback=False)
    expected = _expected_positions(cu)
    for r in range(4):
        out = get_batch_on_this_cp_rank(batch, plan=plan, cp_rank=r, check_group=False, pad_token_id=PAD)
        ids = plan.local_token_indices(r)
        real = ids < 20
        model = out["position_ids"][0].numpy()
        assert (model[real] == ids[real] + 100).all() and (model[~real] == 0).all()
        rope = out["packed_seq_params"].hsap_position_ids.numpy()
        assert (rope[real] == expected[ids[real]]).all()
    with pytest.raises(BatchError, match="position_ids has shape"):
        pack_micro_batch({"tokens": torch.zeros(2, 6, dtype=torch.long), "position_ids": torch.zeros(1, 6)})


def test_sbhd_model_position_ids_are_the_datasets() -> None:
    b, s = 2, 10
    tokens = torch.arange(b * s).reshape(b, s)
    dataset_positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])  # reset at EODs
    out = get_batch_on_this_cp_rank(
        {"tokens": tokens, "labels": tokens + 1, "position_ids": dataset_positions}, qkv_format="sbhd", cp_rank=0,
        check_group=False, plan_kwargs=dict(inter_size=2, intra_size=1, num_heads=2, num_kv_heads=1, head_dim=8),
    )
    ids = out["plan"].local_token_indices(0)
    real = torch.from_numpy(ids < s)
    assert torch.equal(out["position_ids"][:, real], dataset_positions[:, ids[ids < s]])
    assert torch.equal(out["labels"][:, real], tokens[:, ids[ids < s]] + 1)
    assert out["packed_seq_params"].hsap_position_ids.tolist() == np.where(ids < s, ids, 0).tolist()


def test_errors_name_the_problem() -> None:
    cu = [0, 4, 8]
    plan = compile_plan(cu, inter_size=2, intra_size=1, num_heads=2, head_dim=8)
    with pytest.raises(BatchError, match="different cu_seqlens"):
        get_batch_on_this_cp_rank(_batch([0, 8]), plan=plan, cp_rank=0, check_group=False)
    with pytest.raises(ConfigError, match="cp_rank"):
        get_batch_on_this_cp_rank(_batch(cu), plan=plan, check_group=False)
    with pytest.raises(ConfigError, match="out of range"):
        get_batch_on_this_cp_rank(_batch(cu), plan=plan, cp_rank=2, check_group=False)
    with pytest.raises(BatchError, match="covers|cover"):
        pack_micro_batch({"tokens": torch.zeros(1, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 5])})
    with pytest.raises(ConfigError, match="check_group"):
        get_batch_on_this_cp_rank(_batch(cu), plan=plan, cp_rank=0)  # nobody to compare with


def test_marker_is_required() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    assert not is_hsap_sharded(None)
    assert not is_hsap_sharded(PackedSeqParams(qkv_format="thd"))
    assert not is_hsap_sharded(HSAPPackedSeqParams(qkv_format="thd", hsap_plan=object()))
    assert is_hsap_sharded(HSAPPackedSeqParams(qkv_format="thd", hsap_plan=object(), hsap_marker=HSAP_MARKER))


def _shard_mismatched(cu_by_rank: list[list[int]]) -> str:
    """Pool case: every rank shards its own batch; rank r's cu_seqlens is ``cu_by_rank[r]``."""
    import torch.distributed as dist

    from megatron_hsap.megatron.parallel_state import destroy_hsap, initialize_hsap

    cu = cu_by_rank[dist.get_rank()]
    initialize_hsap(intra_size=2, inter_size=2, node_check="off")
    try:
        get_batch_on_this_cp_rank(_batch(cu), plan_kwargs=dict(num_heads=4, num_kv_heads=2, head_dim=8))
    except BatchError as exc:
        return f"BatchError: {exc}"
    finally:
        destroy_hsap()
    return "ok"


def test_ranks_with_different_batches_fail_together_instead_of_hanging(gloo_pool) -> None:  # noqa: ANN001
    same = [[0, 5, 12, 20]] * 4
    assert gloo_pool(4).run(_shard_mismatched, same, timeout=300) == ["ok"] * 4
    differ = [[0, 5, 12, 20], [0, 5, 12, 20], [0, 6, 12, 20], [0, 5, 12, 20]]
    results = gloo_pool(4).run(_shard_mismatched, differ, timeout=300)
    assert all(r.startswith("BatchError") for r in results), results
