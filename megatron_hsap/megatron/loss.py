"""How the loss of an HSAP-sharded micro-batch reaches Megatron's schedule (docs/enable.md §2).

Megatron's loss functions return ``(Σ loss·mask, loss tokens, report)`` over the rank's own tokens.
Under HSAP every real token sits on exactly one CP rank, and ranks hold different numbers of loss
tokens (whole documents, not zigzag halves), so both of Megatron's normalisations need the
micro-batch's count, not the rank's:

* ``--calculate-per-token-loss``: Megatron sums the counts over DP×CP and divides the summed
  gradients by them (``finalize_model_grads``) — already the global per-token mean; nothing to do.
* Megatron's default (each micro-batch's mean loss, averaged over micro-batches and DP ranks):
  the schedule divides the rank's loss by its own count (``forward_step_calc_loss``) and DDP
  averages gradients over DP×CP (``gradient_scaling_factor = 1 / dp_cp_size``), which is the
  micro-batch's mean only when every CP rank holds the same number of loss tokens (zigzag
  halves, roughly; not even exactly under ring CP once a loss mask differs between the halves).
  :func:`micro_batch_mean` hands the schedule ``CP · Σ loss·mask`` over the micro-batch's count
  (``num_loss_tokens``, summed on the host from the whole micro-batch before sharding): averaged
  over the CP ranks, ``Σ_cp Σ loss·mask / N`` — exactly the CP=1 mean, with no collective.

:func:`evaluation_report` sums the SFT evaluation report over the CP group (below).
"""

from __future__ import annotations

from typing import Any, Callable

from megatron_hsap.errors import ConfigError

__all__ = ["micro_batch_mean", "evaluation_report"]


def micro_batch_mean(loss_func: Callable[..., Any], num_loss_tokens: int, cp_size: int, output_tensor: Any) -> tuple[Any, Any, Any]:
    """``loss_func(output_tensor)`` as Megatron's default normalisation needs it under HSAP (module
    docstring): ``(cp_size · Σ loss·mask, num_loss_tokens as a 0-d int tensor, report)``; the
    report (``[Σ loss, local tokens]`` pairs, summed over DP×CP by Megatron for the log) is kept.

    ``output_tensor``: the model's per-token losses, ``[1, t_local]``; ``num_loss_tokens``: the
    micro-batch's loss tokens over all CP ranks. The count is made on the loss's device by a fill
    (no host-to-device copy, no stream sync)."""
    import torch

    outputs = loss_func(output_tensor)
    if len(outputs) != 3:
        raise ConfigError(
            f"the loss function returned {len(outputs)} values; HSAP needs Megatron's (Σ loss·mask, loss tokens, "
            "report) form to normalise a micro-batch whose CP ranks hold different numbers of loss tokens: "
            "return the masked loss sum and its token count, or pass --calculate-per-token-loss")
    loss, _, report = outputs
    count = torch.full((), int(num_loss_tokens), dtype=torch.int, device=loss.device)
    return loss * cp_size, count, report


def evaluation_report(loss_func: Callable[..., Any], output_tensor: Any) -> Any:
    """``loss_func``'s result with each ``[Σ loss, tokens]`` report summed over the CP group.

    Megatron's evaluation with ``--sft`` (``training.evaluate``, megatron-core 0.19.2) divides each
    rank's report by its own tokens and averages the ratios over the DP×CP ranks: meant per
    micro-batch, it is per CP rank's share of one, so it depends on how CP splits the loss tokens —
    under HSAP, whose ranks hold whole conversations, a rank may hold few or none (its ratio counts
    as 0). Summed over the CP group first, every CP rank reports its micro-batch's own per-token
    loss, and the figure is the CP=1 one. The loss and token count (no backward in evaluation) are
    left as they are; every CP rank of the stage that computes the loss calls this in the same order."""
    import torch
    from megatron.core import parallel_state

    outputs = loss_func(output_tensor)
    if len(outputs) != 3 or parallel_state.get_context_parallel_world_size() == 1:
        return outputs  # (a loss function without the token count: Megatron does not apply its SFT mean to it)
    loss, num_tokens, report = outputs
    group = parallel_state.get_context_parallel_group()
    for key, value in report.items():
        if isinstance(value, torch.Tensor) and value.numel() == 2:
            value = value.clone()
            torch.distributed.all_reduce(value, group=group)
            report[key] = value
    return loss, num_tokens, report
