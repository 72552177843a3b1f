"""``megatron/loss.py``: Megatron's default loss normalisation (no ``--calculate-per-token-loss``)
under HSAP, through the arithmetic megatron-core 0.19.2 applies to what the loss function returns
(``schedules.forward_step_calc_loss``: divide by the returned count and the micro-batch count; DDP:
average the gradients over DP×CP). The loop-level check against CP=1 is
``test_sft_pretrain_cpu.test_megatrons_default_loss_normalisation_equals_cp1`` (slow)."""

from __future__ import annotations

import pytest
import torch

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.loss import micro_batch_mean


def _pretrain_gpt_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt.loss_func's arithmetic (core_v0.19.0): Σ loss·mask, the rank's tokens, a report."""
    losses, mask = output_tensor.view(-1).double(), loss_mask.view(-1).double()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.double().view(1)])}


def _megatron_default(loss: torch.Tensor, count: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """What Megatron's schedule makes of one rank's ``(loss, count)`` without per-token loss."""
    return loss / torch.clamp(count, min=1) / micro_batches


def test_each_cp_rank_gets_the_micro_batch_count_and_cp_times_its_sum() -> None:
    # one micro-batch of 4 CP ranks holding 5, 0, 17 and 2 loss tokens (whole documents: a rank may hold none)
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 17, 2]
    shards = []
    for n in counts:
        mask = torch.zeros(24)
        mask[torch.randperm(24, generator=gen)[:n]] = 1.0
        shards.append((mask.view(1, -1), torch.rand(1, 24, generator=gen, dtype=torch.float64) * 8))
    total = sum(counts)
    cp1_mean = sum(float((loss.view(-1) * mask.view(-1)).sum()) for mask, loss in shards) / total

    outputs = [micro_batch_mean(lambda out, m=mask: _pretrain_gpt_loss(m, out), total, len(shards), loss)
               for mask, loss in shards]
    for (mask, loss), (got, count, report) in zip(shards, outputs, strict=True):
        assert count.dtype == torch.int32 and count.dim() == 0 and int(count) == total
        plain = _pretrain_gpt_loss(mask, loss)
        assert float(got) == pytest.approx(len(shards) * float(plain[0]), rel=1e-15)
        assert torch.equal(report["lm loss"], plain[2]["lm loss"])  # the log's [Σ loss, rank tokens] kept
    # DDP averages the ranks' gradients over CP: the average of what the schedule computes
    averaged = sum(float(_megatron_default(got, count, 1)) for got, count, _ in outputs) / len(shards)
    assert averaged == pytest.approx(cp1_mean, rel=1e-12)
    # the rank's own count, which Megatron's schedule would divide by, gives another number
    own = sum(float(_megatron_default(*_pretrain_gpt_loss(mask, loss)[:2], 1)) for mask, loss in shards) / len(shards)
    assert abs(own - cp1_mean) > 0.05 * cp1_mean


def test_the_gradient_is_the_cp1_means() -> None:
    """The same through autograd: the CP ranks' gradients averaged equal the CP=1 mean's gradient."""
    x = torch.linspace(-1, 1, 12, dtype=torch.float64).view(1, 12)
    mask = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1, 1, 0, 1], dtype=torch.float64).view(1, 12)
    cut = [0, 2, 9, 12]  # three CP ranks: 2, 7 and 3 tokens, 2, 5 and 1 loss tokens
    w = torch.zeros(1, 12, dtype=torch.float64, requires_grad=True)
    ((x + w) ** 2 * mask).sum().div(mask.sum()).backward()
    want, w.grad = w.grad.clone(), None
    for lo, hi in zip(cut, cut[1:]):
        out = (x[:, lo:hi] + w[:, lo:hi]) ** 2
        got, count, _ = micro_batch_mean(lambda o, m=mask[:, lo:hi]: _pretrain_gpt_loss(m, o), int(mask.sum()), 3, out)
        (_megatron_default(got, count, 1) / 3).backward()  # / 3: DDP's average over the CP group
    assert torch.allclose(w.grad, want, rtol=1e-14, atol=0)


def test_a_loss_function_without_the_token_count_is_named() -> None:
    with pytest.raises(ConfigError, match="returned 2 values.*--calculate-per-token-loss"):
        micro_batch_mean(lambda out: (out.sum(), {}), 4, 2, torch.ones(1, 3))
