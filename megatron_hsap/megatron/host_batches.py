"""Reading Megatron's data iterator for HSAP (``pretrain_hooks.hsap_get_batch``): TP rank 0 reads
and packs the host micro-batch, the other TP ranks receive it (``cu_seqlens`` stays on the host, so
the plan compiles without a device sync); the plan prefetcher's reader keeps Megatron's step replay
intact (``RecordingReader``). Imports Megatron lazily, like ``pretrain_hooks``.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

__all__ = ["RecordingReader", "read_direct", "replaying"]


def _broadcast_host_batch(batch: Any) -> Any:
    """TP rank 0 reads the data iterator; the other TP ranks get the same host batch (``None`` at
    the end of the data, so every TP rank stops together).

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


def _pack(batch: dict[str, Any]) -> Any:
    """The host side of one micro-batch, packed once (the plan and the sharding both read it)."""
    from megatron_hsap.megatron.batch import pack_micro_batch

    keep = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens")  # position ids: a learned embedding's
    host = {k: (v.cpu() if hasattr(v, "cpu") else v) for k, v in batch.items() if k in keep and v is not None}
    return pack_micro_batch(host)


def replaying() -> bool:
    """Whether Megatron's rerun state machine is re-running this step (the same on every rank:
    the decision to rerun is reduced over the world)."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    return get_rerun_state_machine().state in (RerunState.RERUNNING_IN_PLACE, RerunState.RERUNNING_FROM_CHECKPOINT)


class RecordingReader:
    """Reads micro-batches for the plan prefetcher without breaking Megatron's step replay.

    Megatron wraps data iterators in ``RerunDataIterator``, which saves every micro-batch read
    during an iteration so a re-run (NaN or spiky loss) replays them. A read-ahead would save the
    next iteration's first batch into this one. So the prefetcher reads the *underlying* iterator,
    and a batch is saved into the wrapper's list when it is handed to the step — exactly what the
    wrapper saves without prefetch (a shallow copy, only while the rerun mode is enabled).
    """

    def __init__(self, data_iterator: Iterator[dict[str, Any]] | None) -> None:
        self.wrapper = data_iterator if hasattr(data_iterator, "saved_microbatches") else None
        self.source = self.wrapper.iterable if self.wrapper is not None else data_iterator

    def read(self) -> tuple[Any, Any] | None:
        """``(raw batch, packed host batch)`` on TP rank 0, the broadcast packed batch elsewhere."""
        from megatron.core import mpu

        raw = packed = None
        if mpu.get_tensor_model_parallel_rank() == 0:
            try:
                raw = next(self.source)
            except StopIteration:
                raw = None
            packed = _pack(raw) if raw is not None else None
        packed = _broadcast_host_batch(packed)
        return None if packed is None else (raw, packed)

    def consumed(self, raw: Any) -> None:
        from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

        if self.wrapper is not None and raw is not None and get_rerun_state_machine().get_mode() != RerunMode.DISABLED:
            self.wrapper.saved_microbatches.append(copy.copy(raw))


def read_direct(data_iterator: Iterator[dict[str, Any]] | None) -> Any:
    """The next packed host micro-batch on every TP rank through the iterator itself (replays and
    evaluation), or ``None`` at the end of the data."""
    from megatron.core import mpu

    packed = None
    if mpu.get_tensor_model_parallel_rank() == 0:
        try:
            packed = _pack(next(data_iterator))
        except StopIteration:
            packed = None
    return _broadcast_host_batch(packed)
