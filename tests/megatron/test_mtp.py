"""Multi-token prediction under HSAP (``megatron_hsap/megatron/mtp.py``).

- The shift: on 4 gloo ranks, each rank's HSAP-sharded tensor shifted by ``roll_tensor`` (HSAP's,
  one all-gather per shift) equals Megatron's own packed-sequence ``roll_tensor`` at CP=1 applied
  to the whole batch and then sharded (``_roll_tensor_packed_seq``: inside each document, 0 at a
  document's last token) — for plans at 2×2, 1×4 and 4×1, both layouts, a scrambled layout, two
  and three shifts in a row, int64 / float / bool tensors, ``[1, t]`` and ``[b, t]``.
- The spec: Megatron's MTP block spec gets HSAP's attention only in an HSAP run.
- The model check: a model with a megatron-core self-attention is refused by name.
- Megatron's loop: ``tests/megatron/test_pretrain_cpu_mtp.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_hsap.errors import ConfigError
from tests.megatron.test_batch import FakePlan

_CASES = [  # (documents' lengths, (intra, inter), layout)
    ([37, 1, 90, 5, 64, 3], (2, 2), "balanced"),
    ([37, 1, 90, 5, 64, 3], (2, 2), "contiguous"),
    ([200], (1, 4), "balanced"),
    ([13, 29, 0, 71, 7, 2, 44], (1, 4), "balanced"),
    ([13, 29, 0, 71, 7, 2, 44], (4, 1), "balanced"),
    ([64, 64, 64, 64], (1, 4), "contiguous"),  # whole documents per rank: no exchange at all
]


def _plans() -> list:
    from megatron_hsap.plan import compile_plan

    plans = []
    for lengths, (intra, inter), layout in _CASES:
        cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        plans.append(compile_plan(cu, inter_size=inter, intra_size=intra, num_heads=8, num_kv_heads=8, head_dim=8,
                                  pool_bytes=1 << 20, layout=layout, flatten="never"))
    plans += [FakePlan([0, 5, 5, 17, 18, 40, 41], cp_size=4, seed=s) for s in (0, 1)]
    return plans


def _params(plan, rank: int):  # noqa: ANN001, ANN202
    from megatron_hsap.megatron.batch import HSAP_MARKER, HSAPPackedSeqParams

    return HSAPPackedSeqParams(qkv_format="thd", hsap_marker=HSAP_MARKER, hsap_plan=plan, hsap_cp_rank=rank)


def _megatron_shifted(x: torch.Tensor, cu: list[int], times: int) -> torch.Tensor:
    """Megatron's own CP=1 packed-sequence shift, ``times`` times, of a ``[..., T]`` tensor."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    from megatron_hsap.megatron.mtp import _original

    params = PackedSeqParams(cu_seqlens_q=torch.tensor(cu))
    for _ in range(times):
        x, _ = _original(roll_tensor)(x, shifts=-1, dims=-1, packed_seq_params=params)
    return x


def _shift_case() -> str:
    import torch.distributed as dist

    from megatron_hsap.megatron.mtp import roll_tensor

    rank = dist.get_rank()
    for i, plan in enumerate(_plans()):
        T, cu = plan.num_tokens, list(plan.batch.cu_seqlens)
        ids = np.asarray(plan.local_token_indices(rank), dtype=np.int64)
        real = torch.from_numpy(ids < T)
        gen = torch.Generator().manual_seed(i)
        whole = {"ids": torch.randint(1, 1000, (1, T), generator=gen),
                 "mask": torch.rand(1, T, generator=gen).round(),
                 "flag": torch.rand(1, T, generator=gen) > 0.3,
                 "rows": torch.randn(3, T, generator=gen)}
        for name, x in whole.items():
            local = torch.zeros(x.shape[0], ids.size, dtype=x.dtype)
            local[:, real] = x[:, torch.from_numpy(ids[ids < T])]
            for times in (1, 2, 3):
                want = _megatron_shifted(x.clone(), cu, times)[:, torch.from_numpy(ids[ids < T])]
                got = local
                for _ in range(times):
                    got, total = roll_tensor(got, -1, -1, cp_group=dist.group.WORLD, packed_seq_params=_params(plan, rank))
                assert got.dtype == x.dtype and got.shape == local.shape
                assert torch.equal(got[:, real], want), (i, name, times, rank)
                assert torch.equal(total, got.sum())
    return "ok"


def test_shift_equals_megatrons_cp1_packed_shift(gloo_pool) -> None:  # noqa: ANN001
    assert gloo_pool(4).run(_shift_case, timeout=600) == ["ok"] * 4


def test_other_batches_keep_megatrons_shift() -> None:
    """A batch HSAP did not shard (no marker): Megatron's own shift, unchanged."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor as megatron_roll

    from megatron_hsap.megatron.mtp import _original, roll_tensor

    x = torch.arange(12).reshape(2, 6)
    got, total = roll_tensor(x, -1, -1)
    want, want_total = _original(megatron_roll)(x, -1, -1)
    assert torch.equal(got, want) and torch.equal(total, want_total)


def test_shift_refuses_what_it_cannot_do() -> None:
    from megatron_hsap.megatron.mtp import roll_tensor, roll_to_next, successors

    plan = FakePlan([0, 8], cp_size=1)
    params = _params(plan, 0)
    with pytest.raises(ConfigError, match="one token left"):
        roll_tensor(torch.zeros(1, 8), -2, -1, packed_seq_params=params)
    with pytest.raises(ConfigError, match="5 local tokens; the plan gives this rank 8"):
        roll_to_next(torch.zeros(1, 5), successors(params, torch.device("cpu")))
    order = plan.local_token_indices(0)  # scrambled: successors sit elsewhere on the one rank
    got, _ = roll_tensor(torch.from_numpy(order).double().view(1, 8), -1, -1, packed_seq_params=params)  # no group
    want = np.where(order + 1 < 8, order + 1, 0)
    assert got.view(-1).tolist() == want.astype(float).tolist()


def _mtp_attention_case() -> list[tuple[str, str]]:
    """The MTP block spec's attention modules under an HSAP run's arguments, then a ring run's."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import global_vars

    from megatron_hsap.megatron import mtp

    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, mtp_num_layers=2,
                               use_cpu_initialization=True)
    import sys
    import types

    checkout = types.ModuleType("gpt_builders")  # a Megatron-LM checkout's builder, imported before HSAP's hooks
    checkout.get_gpt_mtp_block_spec = mtp._original(gpt_layer_specs.get_gpt_mtp_block_spec)
    sys.modules["gpt_builders"] = checkout
    try:
        mtp.install()
        mtp.install()  # idempotent: wrapped once
    finally:
        del sys.modules["gpt_builders"]
    for owner in (gpt_layer_specs, checkout):
        assert owner.get_gpt_mtp_block_spec.__hsap_original__.__module__ == gpt_layer_specs.__name__
    found = []
    saved = global_vars._GLOBAL_ARGS
    try:
        for impl in ("hsap", "ring"):
            global_vars._GLOBAL_ARGS = type("Args", (), {"context_parallel_impl": impl})()
            spec = gpt_layer_specs.get_gpt_mtp_block_spec(config, gpt_layer_specs.get_gpt_layer_local_spec(),
                                                          use_transformer_engine=False)
            assert len(spec.layer_specs) == 2
            for layer in spec.layer_specs:
                attn = layer.submodules.mtp_model_layer.submodules.self_attention
                found.append((attn.module.__name__, attn.submodules.core_attention.__name__))
    finally:
        global_vars._GLOBAL_ARGS = saved
    return found


def test_mtp_layers_get_hsap_attention_in_hsap_runs_only(gloo_pool) -> None:  # noqa: ANN001
    hsap = [("HSAPSelfAttention", "HSAPCoreAttention")] * 2
    ring = [("SelfAttention", "DotProductAttention")] * 2
    assert gloo_pool(2).run(_mtp_attention_case, timeout=300) == [hsap + ring] * 2


def test_model_with_megatrons_attention_is_refused_by_name() -> None:
    from megatron.core.transformer.attention import SelfAttention

    from megatron_hsap.megatron.spec import check_model_attention

    class Stub(torch.nn.Module):
        pass

    model, inner = Stub(), Stub()
    inner.self_attention = SelfAttention.__new__(SelfAttention)
    torch.nn.Module.__init__(inner.self_attention)
    model.mtp = inner
    with pytest.raises(ConfigError, match=r"mtp\.self_attention is megatron-core's SelfAttention"):
        check_model_attention(model)
    check_model_attention(Stub())  # nothing to refuse


def test_install_refuses_another_process_mtp_loss(monkeypatch) -> None:  # noqa: ANN001
    """HSAP's ``process_mtp_loss`` follows megatron-core 0.19.2's arithmetic: a megatron-core whose
    function takes other parameters is named instead of being half-followed."""
    import inspect

    from megatron_hsap.megatron import mtp

    def other(hidden_states, labels, loss_mask, output_layer, config, mtp_loss_weights=None):  # noqa: ANN001, ANN202
        return hidden_states

    monkeypatch.setattr(mtp, "_process_signature", lambda: inspect.signature(other))
    with pytest.raises(ConfigError, match=r"process_mtp_loss takes .*'mtp_loss_weights'.* install megatron-core 0.19.2"):
        mtp.install()
