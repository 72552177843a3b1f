"""What a CPU run records for its tests (``HSAP_CPU_RECORD=DIR``): parameters and FLOP counts.

Test instrumentation of the CPU command only. ``params-rank{R}.json``: every parameter's name and
shape on rank R, as Megatron built the model. ``flops-rank{R}.jsonl``: one line per call of Megatron's
``num_floating_point_operations`` (the TFLOP/s line's numerator) with the packed-sequence statistics
Megatron passed it and the result, so a test can check the statistics against the batches' lengths.
``sp-grads-rank{R}.jsonl``: after each call of Megatron's ``finalize_model_grads``, the float64 sum
of each gradient of a parameter marked ``sequence_parallel`` (the norms under sequence parallelism,
summed over TP there), so a test can check TP peers hold the same gradients.
``tied-rank{R}.jsonl``: at the same point, the float64 sums of the gradient and of the weight of each
parameter Megatron marks ``shared_embedding`` (the word embedding tied to the output layer across
pipeline stages), so a test can check the first and last stage hold one matrix.
``qk-rank{R}.jsonl``: the largest attention logit megatron-core's ``clip_qk`` returns after each
optimizer step (``--qk-clip`` / ``--log-max-attention-logit``: the MAX over DP×CP, before clipping).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["install", "record_params", "record_loss"]

_DONE: set[str] = set()


def _dir() -> Path | None:
    path = os.environ.get("HSAP_CPU_RECORD")
    return Path(path) if path else None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def record_params(model: Any) -> None:
    """Write the model's parameter names and shapes once per process (no-op unless recording)."""
    out = _dir()
    if out is None or "params" in _DONE or model is None:
        return
    _DONE.add("params")
    chunks = model if isinstance(model, (list, tuple)) else [model]
    names = {f"{i}.{name}": list(p.shape) for i, chunk in enumerate(chunks) for name, p in chunk.named_parameters()}
    (out / f"params-rank{_rank()}.json").write_text(json.dumps(names, sort_keys=True))


def record_loss(loss: Any, num_tokens: Any, training: bool) -> None:
    """Append one micro-batch's local ``Σ loss·mask`` and token count (no-op unless recording)."""
    out = _dir()
    if out is None:
        return
    with open(out / f"losses-rank{_rank()}.jsonl", "a") as f:
        f.write(json.dumps({"loss_sum": float(loss), "tokens": int(num_tokens), "training": bool(training)}) + "\n")


def install() -> None:
    """Wrap Megatron's FLOP count (called by ``train`` once per iteration) to record its inputs, and its
    ``finalize_model_grads`` to record the sequence-parallel gradients."""
    out = _dir()
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    from megatron.training import training

    original = training.num_floating_point_operations

    def num_floating_point_operations(args: Any, batch_size: Any, seqlen_squared_sum_in_batch: Any = None,
                                      total_real_tokens_in_batch: Any = None) -> Any:
        result = original(args, batch_size, seqlen_squared_sum_in_batch=seqlen_squared_sum_in_batch,
                          total_real_tokens_in_batch=total_real_tokens_in_batch)
        with open(out / f"flops-rank{_rank()}.jsonl", "a") as f:
            f.write(json.dumps({"batch_size": int(batch_size), "seqlen_squared_sum": seqlen_squared_sum_in_batch,
                                "total_real_tokens": total_real_tokens_in_batch, "flops": float(result)}) + "\n")
        return result

    training.num_floating_point_operations = num_floating_point_operations
    finalize = training.finalize_model_grads  # what ``train`` installs as the config's finalize function

    def finalize_model_grads(model: Any, *args: Any, **kwargs: Any) -> Any:
        result = finalize(model, *args, **kwargs)
        sums = [float(getattr(p, "main_grad", p.grad).double().sum()) for chunk in model for p in chunk.parameters()
                if getattr(p, "sequence_parallel", False)]
        with open(out / f"sp-grads-rank{_rank()}.jsonl", "a") as f:
            f.write(json.dumps({"sequence_parallel_grads": sums}) + "\n")
        tied = [[float(getattr(p, "main_grad", p.grad).double().sum()), float(p.detach().double().sum())]
                for chunk in model for p in chunk.parameters() if getattr(p, "shared_embedding", False)]
        with open(out / f"tied-rank{_rank()}.jsonl", "a") as f:
            f.write(json.dumps({"shared_embedding": tied}) + "\n")
        return result

    training.finalize_model_grads = finalize_model_grads
    clip = training.clip_qk  # qk-clip / --log-max-attention-logit, after each optimizer step

    def clip_qk(model: Any, *args: Any, **kwargs: Any) -> Any:
        result = clip(model, *args, **kwargs)
        with open(out / f"qk-rank{_rank()}.jsonl", "a") as f:
            f.write(json.dumps({"max_attention_logit": float(result)}) + "\n")
        return result

    training.clip_qk = clip_qk
