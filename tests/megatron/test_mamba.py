"""Mamba layers under HSAP (``megatron_hsap/megatron/mamba.py``).

- The mixer: on 4 gloo ranks, megatron-core's ``MambaMixer`` at CP 4 under HSAP (its all-to-alls,
  HSAP's reorder and ``seq_idx``) against the same parameters in a CP=1 ``MambaMixer`` run on each
  document alone (no packed sequence: nothing of HSAP's, and no ``seq_idx`` to trust) — outputs,
  input gradients and every parameter's gradient (summed over CP ranks, as Megatron's gradient
  reduction does), for plans at 2×2, 1×4 and 4×1, both layouts and scrambled layouts
  (``test_mtp._plans``). Kernels: the CPU stand-in (``test_mamba_kernels.py``).
- The spec, the argument checks and the refusals.
- Megatron's loop: ``test_hybrid_ssm_pretrain_cpu.py``.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from megatron_hsap.errors import BatchError, ConfigError

MAMBA = dict(mamba_head_dim=8, mamba_num_groups=4, mamba_state_dim=16)  # 16 heads of 8 over hidden 64


def _mixer(config, cp_group, tp_group):  # noqa: ANN001, ANN202
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_hsap.megatron.mamba import HSAPMambaMixer

    subs = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
    pgs = ProcessGroupCollection(tp=tp_group, cp=cp_group)
    return HSAPMambaMixer, subs, pgs


def matches_documents_alone(hsap, ref, run, params_of, hidden: int, *, seed: int, tol: tuple[float, float],  # noqa: ANN001
                            grad_tol: float) -> None:
    """On each gloo rank of a CP 4 group: for every plan of ``test_mtp._plans``, the HSAP layer
    ``hsap`` on this rank's tokens (padding rows zero; ``run(layer, x, params)`` → ``[t, 1, h]``
    with ``params_of(plan, rank)``) against ``ref`` (the same parameters at CP 1) run on each
    document alone with no packed sequence: outputs and input gradients to ``tol`` (rtol, atol),
    every parameter's gradient summed over CP ranks (Megatron's gradient reduction) to
    ``grad_tol`` of its largest entry (float32 sums in another order)."""
    import torch.distributed as dist

    from tests.megatron.test_mtp import _plans

    rank = dist.get_rank()
    for i, plan in enumerate(_plans()):
        T = plan.num_tokens
        gen = torch.Generator().manual_seed(seed + i)
        x = torch.randn(T, 1, hidden, generator=gen)
        upstream = torch.randn(T, 1, hidden, generator=gen)
        xr = x.clone().requires_grad_(True)
        ref.zero_grad()
        cu = list(plan.batch.cu_seqlens)
        want = torch.cat([run(ref, xr[a:b], None) for a, b in zip(cu[:-1], cu[1:]) if b > a])
        (want * upstream).sum().backward()
        ids = torch.from_numpy(np.asarray(plan.local_token_indices(rank), dtype=np.int64))
        real = ids < T
        xl = torch.zeros(ids.numel(), 1, hidden)
        xl[real] = x[ids[real]]
        xl.requires_grad_(True)
        hsap.zero_grad()
        got = run(hsap, xl, params_of(plan, rank))
        (got[real] * upstream[ids[real]]).sum().backward()
        torch.testing.assert_close(got[real], want.detach()[ids[real]], rtol=tol[0], atol=tol[1], msg=f"plan {i} outputs")
        torch.testing.assert_close(xl.grad[real], xr.grad[ids[real]], rtol=tol[0], atol=tol[1], msg=f"plan {i} input grads")
        for (name, p), (_, q) in zip(hsap.named_parameters(), ref.named_parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            scale = float(q.grad.abs().max())
            torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=grad_tol * scale, msg=f"plan {i} {name}")


def _mixer_case() -> str:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.ssm.mamba_mixer import MambaMixer

    from megatron_hsap.megatron.cpu import mamba_kernels

    mamba_kernels.install()
    from tests.megatron.test_gpt_equivalence import _setup
    from tests.megatron.test_mtp import _params
    from tests.megatron.test_sinks_gpt import cpu_current_device

    rank = dist.get_rank()
    with cpu_current_device():
        config = dataclasses.replace(_setup(4), **MAMBA)
        singles = [dist.new_group([r]) for r in range(4)]  # (every rank creates every group)
        hsap_cls, subs, pgs = _mixer(config, mpu.get_context_parallel_group(), mpu.get_tensor_model_parallel_group())
        torch.manual_seed(0)
        hsap = hsap_cls(config, subs, d_model=config.hidden_size, layer_number=1, pg_collection=pgs)
        _, _, one = _mixer(config, singles[rank], mpu.get_tensor_model_parallel_group())
        ref = MambaMixer(config, subs, d_model=config.hidden_size, layer_number=1, pg_collection=one)
        ref.load_state_dict(hsap.state_dict())
        assert hsap.cp.cp_size == 4 and ref.cp.cp_size == 1
        matches_documents_alone(hsap, ref, lambda layer, x, params: layer(x, packed_seq_params=params)[0], _params,
                                config.hidden_size, seed=100, tol=(1e-5, 1e-6), grad_tol=1e-5)
    return "ok"


def test_mamba_mixer_at_cp4_equals_each_document_alone(gloo_pool) -> None:  # noqa: ANN001
    assert gloo_pool(4).run(_mixer_case, timeout=600) == ["ok"] * 4


def test_hybrid_spec_swaps_the_mamba_mixer() -> None:
    from megatron.core.ssm.mamba_layer import MambaLayer

    from megatron_hsap.megatron.mamba import HSAPMambaMixer
    from megatron_hsap.megatron.spec import HSAP_HYBRID_STACK_SPEC, HSAPUnsupportedLayer, hsap_hybrid_stack_spec

    for spec in (HSAP_HYBRID_STACK_SPEC, hsap_hybrid_stack_spec(use_te=False)):
        layer = spec.submodules.mamba_layer
        assert layer.module is MambaLayer and layer.submodules.mixer.module is HSAPMambaMixer
    # a stack whose Mamba layer is not megatron-core's MambaLayer around its MambaMixer: refused when built
    from megatron_hsap.megatron.spec import _local_hybrid_stack_spec

    base = _local_hybrid_stack_spec()
    odd = dataclasses.replace(base, submodules=dataclasses.replace(base.submodules, mamba_layer=torch.nn.Identity))
    assert hsap_hybrid_stack_spec(odd).submodules.mamba_layer.module is HSAPUnsupportedLayer


def test_model_with_megatrons_mamba_mixer_is_refused_by_name() -> None:
    from megatron.core.ssm.mamba_mixer import MambaMixer

    from megatron_hsap.megatron.spec import check_model_attention

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixer = MambaMixer.__new__(MambaMixer)
            torch.nn.Module.__init__(self.mixer)

    with pytest.raises(ConfigError, match="mixer is megatron-core's MambaMixer, not HSAP's"):
        check_model_attention(Layer())


def test_mamba_arguments_checked_before_the_model_builds() -> None:
    from megatron_hsap.megatron.arguments import validate_hsap_args
    from tests.megatron.test_arguments import GOOD, _parse

    mamba = ["--hybrid-layer-pattern", "M*M-", "--hidden-size", "512"]  # 16 heads of 64, 8 groups: TP 2 x CP 8
    ok = _parse([*GOOD, *mamba])
    assert validate_hsap_args(ok) is not None and ok.spec[1] == "HSAP_HYBRID_STACK_SPEC"
    with pytest.raises(ConfigError, match="their 8 heads .* must split over TP 2 x CP 8"):
        validate_hsap_args(_parse([*GOOD, *mamba, "--mamba-head-dim", "128"]))
    for groups in ("3", "6"):  # not a multiple of TP; 3 per TP rank, which CP 8 is no multiple of
        with pytest.raises(ConfigError, match=f"--mamba-num-groups {groups}"):
            validate_hsap_args(_parse([*GOOD, *mamba, "--mamba-num-groups", groups]))
    with pytest.raises(ConfigError, match="drop --disable-mamba-mem-eff-path"):
        validate_hsap_args(_parse([*GOOD, *mamba, "--disable-mamba-mem-eff-path"]))


def test_mixer_refuses_batches_hsap_did_not_shard() -> None:
    from megatron_hsap.megatron.mamba import HSAPMambaMixer

    mixer = HSAPMambaMixer.__new__(HSAPMambaMixer)
    torch.nn.Module.__init__(mixer)
    mixer.pg_collection = types.SimpleNamespace(cp=None)  # (refused before the group is read)
    with pytest.raises(BatchError, match="not sharded by HSAP"):
        mixer(torch.zeros(4, 1, 8), packed_seq_params=None)
    with pytest.raises(ConfigError, match="train only"):
        mixer(torch.zeros(4, 1, 8), inference_context=object())


def test_install_refuses_another_mamba_context_parallel(monkeypatch) -> None:  # noqa: ANN001
    from megatron.core.ssm import mamba_context_parallel as mcp

    from megatron_hsap.megatron import mamba

    def other(input_, cp_size, packed_seq_params=None, extra=None):  # noqa: ANN001, ANN202
        return input_

    monkeypatch.setattr(mcp, "_undo_attention_load_balancing", other)
    with pytest.raises(ConfigError, match="megatron-core 0.19.2"):
        mamba.install()


def test_stream_order_inverts_the_layout() -> None:
    from megatron_hsap.megatron.mamba import StreamOrder
    from tests.megatron.test_batch import FakePlan

    plan = FakePlan([0, 5, 5, 17, 18, 40, 41], cp_size=4, seed=3)  # 41 tokens padded to 44
    order = StreamOrder.of(plan, torch.device("cpu"))
    gathered = np.concatenate([plan.local_token_indices(r) for r in range(4)])
    assert order.gathered_ids.tolist() == gathered.tolist()
    assert order.gathered_ids[order.order].tolist() == list(range(44))
    assert order.seq_idx.tolist() == [[0] * 5 + [1] * 12 + [2] + [3] * 22 + [4] + [5] * 3]
    one = StreamOrder.of(FakePlan([0, 3, 8], cp_size=1), torch.device("cpu"))
    assert one.order is None and one.seq_idx.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
