"""Megatron-LM ``pretrain()`` hooks for ``--context-parallel-impl hsap`` (GPU clusters).

Used by ``scripts/pretrain_gpt_hsap.py`` and by the ``patches/`` patch to ``pretrain_gpt.py``:
:func:`hsap_entry_points` turns ``pretrain_gpt``'s dataset provider and loss function into the HSAP
ones — ``initialize_hsap`` once on every rank after Megatron's initialisation, and a
``forward_step`` whose batches are sharded by :func:`~megatron_hsap.megatron.batch.
get_batch_on_this_cp_rank` (plan in ``packed_seq_params``, no attention mask). Imports
``megatron.training`` lazily: importing this module needs neither CUDA nor Megatron-LM.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Any, Callable, Iterator

__all__ = ["hsap_get_batch", "make_forward_step", "with_hsap_init", "hsap_entry_points"]


@lru_cache(maxsize=1)
def _core_config() -> Any:
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    return core_transformer_config_from_args(get_args())


def _broadcast_host_batch(batch: dict[str, Any] | None) -> dict[str, Any] | None:
    """TP rank 0 reads the data iterator; the other TP ranks get the same host tensors (``None``
    at the end of the data, so every TP rank stops together).

    One pickled object per micro-batch over the TP group: ``cu_seqlens`` stays on the host, so the
    plan is compiled without a device-to-host sync.
    """
    import torch.distributed as dist
    from megatron.core import mpu

    if mpu.get_tensor_model_parallel_world_size() == 1:
        return batch
    box = [batch]
    dist.broadcast_object_list(box, src=mpu.get_tensor_model_parallel_src_rank(),
                               group=mpu.get_tensor_model_parallel_group())
    return box[0]


def _host(batch: dict[str, Any]) -> dict[str, Any]:
    keep = ("tokens", "labels", "loss_mask", "cu_seqlens")
    return {k: (v.cpu() if hasattr(v, "cpu") else v) for k, v in batch.items() if k in keep and v is not None}


def _read_host_batch(data_iterator: Iterator[dict[str, Any]]) -> dict[str, Any] | None:
    """The next host micro-batch on every TP rank, or ``None`` when the iterator is exhausted."""
    from megatron.core import mpu

    local = None
    if mpu.get_tensor_model_parallel_rank() == 0:
        try:
            local = _host(next(data_iterator))
        except StopIteration:
            local = None
    return _broadcast_host_batch(local)


def hsap_get_batch(data_iterator: Iterator[dict[str, Any]] | None, vp_stage: int | None = None, *,
                   prefetchers: dict[int, Any] | None = None) -> dict[str, Any]:
    """This rank's HSAP share of the next micro-batch: tokens, labels, loss mask, position ids
    (``[1, t_local]`` on the GPU) and ``packed_seq_params`` with the plan.

    ``prefetchers`` (one dict per ``forward_step``, keyed by data iterator): with
    ``--hsap-plan-prefetch`` (default) the next micro-batch is read ahead and its plan compiled on a
    background thread while this one runs (``megatron/prefetch.py``)."""
    import torch
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    from megatron_hsap.errors import ConfigError
    from megatron_hsap.megatron.batch import get_batch_on_this_cp_rank, plan_for_batch, plan_kwargs_from_config
    from megatron_hsap.megatron.prefetch import PlanPrefetcher

    args = get_args()
    has_cu = bool(getattr(args, "sft", False) or getattr(args, "dataloader_inter_document_masking", False))
    plan_kwargs = plan_kwargs_from_config(_core_config())
    plan_kwargs["layout"] = getattr(args, "hsap_layout", "balanced")
    if plan_kwargs["layout"] == "balanced":
        plan_kwargs["layout_fallback"] = getattr(args, "hsap_layout_fallback", True)
    if getattr(args, "hsap_pool_bytes", None):
        plan_kwargs["pool_bytes"] = args.hsap_pool_bytes
    device = torch.cuda.current_device()
    if data_iterator is None and not is_first_or_last_pipeline_stage(vp_stage):
        if has_cu:
            raise ConfigError(
                "a middle pipeline stage needs each batch's cu_seqlens to compile the HSAP plan, but it "
                "has no data iterator; with packed documents and PP > 1 use --sft (Megatron builds the "
                "dataset on every stage) or PP = 1"
            )
        # Unpacked pretraining: every sample is one document, so the plan needs no data (and is cached).
        batch = {"tokens": torch.zeros(args.micro_batch_size, args.seq_length, dtype=torch.long)}
        return get_batch_on_this_cp_rank(batch, config=_core_config(), plan_kwargs=plan_kwargs, device=device)

    def read() -> dict[str, Any] | None:
        return _read_host_batch(data_iterator)

    def compile_(batch: dict[str, Any]) -> Any:
        return plan_for_batch(batch, config=_core_config(), plan_kwargs=plan_kwargs)

    if prefetchers is None or not getattr(args, "hsap_plan_prefetch", True):
        batch = read()
        if batch is None:
            raise StopIteration
        plan = compile_(batch)
    else:
        prefetcher = prefetchers.get(id(data_iterator))
        if prefetcher is None:
            prefetcher = prefetchers[id(data_iterator)] = PlanPrefetcher(read, compile_)
        batch, plan = next(prefetcher)
    return get_batch_on_this_cp_rank(batch, plan=plan, config=_core_config(), device=device)


def make_forward_step(loss_func: Callable[..., Any]) -> Callable[..., Any]:
    """``pretrain_gpt.forward_step`` with HSAP batch sharding; the model and ``loss_func`` are Megatron's."""

    prefetchers: dict[int, Any] = {}  # one plan prefetcher per data iterator (train, valid)

    def hsap_forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> Any:
        from megatron.training import get_timers
        from megatron.training.utils import get_attr_wrapped_model

        from megatron_hsap.errors import ConfigError

        if return_schedule_plan:
            raise ConfigError("--overlap-moe-expert-parallel-comm schedule plans are not supported with HSAP")
        timers = get_timers()
        timers("batch-generator", log_level=2).start()
        batch = hsap_get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"), prefetchers=prefetchers)
        timers("batch-generator").stop()
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       loss_mask=batch["loss_mask"], packed_seq_params=batch["packed_seq_params"])
        # loss_func returns (Σ loss·mask, local loss tokens); --calculate-per-token-loss makes
        # Megatron divide by the tokens summed over DP×CP: every real token counted once.
        return output, partial(loss_func, batch["loss_mask"], model=model)

    return hsap_forward_step


def with_hsap_init(provider: Any, hsap: Any) -> Any:
    """Run ``initialize_hsap`` once, on every rank, right after Megatron's initialisation.

    Megatron calls a dataset provider marked ``is_distributed`` on every rank before training,
    after ``initialize_model_parallel`` — the one point where a world collective is safe.
    """
    from megatron_hsap.megatron.parallel_state import initialize_hsap, is_hsap_initialized

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not is_hsap_initialized():
            initialize_hsap(intra_size=hsap.intra_size, inter_size=hsap.inter_size, node_check=hsap.node_check)
        return provider(*args, **kwargs)

    wrapped.is_distributed = True  # type: ignore[attr-defined]
    return wrapped


def hsap_entry_points(args: Any, datasets_provider: Any, loss_func: Callable[..., Any]) -> tuple[Any, Any]:
    """``(datasets_provider, forward_step)`` for ``pretrain()`` under ``--context-parallel-impl hsap``.

    Validates the arguments (sets ``args.spec`` to the HSAP layer spec when none was given; call it
    before building the model config) and raises ``ConfigError`` for ``ring``.
    """
    from megatron_hsap.errors import ConfigError
    from megatron_hsap.megatron.arguments import validate_hsap_args

    hsap = getattr(args, "hsap", None) or validate_hsap_args(args)
    if hsap is None:
        raise ConfigError("hsap_entry_points is for --context-parallel-impl hsap")
    args.hsap = hsap
    return with_hsap_init(datasets_provider, hsap), make_forward_step(loss_func)
