"""Host tensors to the device in ONE asynchronous copy (issue 16 item 3).

A plan's per-kernel-call ``cu_seqlens`` and a micro-batch's sharded tokens, labels, loss mask,
positions and padded ``cu_seqlens`` are all known on the host before the step. Copying each with
``torch.tensor(..., device=cuda)`` or ``.to(cuda)`` costs one synchronous copy apiece (from
pageable memory: the host waits for each, and the first drains the stream). :func:`upload` packs
them back to back into one byte buffer — pinned when the target is CUDA — and moves it with one
``non_blocking=True`` copy on the current stream; the results are typed views of the one device
buffer, so later kernels on that stream see the data without any host wait. PyTorch's caching
host allocator keeps the pinned buffer alive until the copy is done.

On a CPU target the views are of the packed host buffer (same values and dtypes: the CPU path's
numbers and bytes are unchanged). :func:`upload_count` counts the copies (tests check that a plan's
metadata is uploaded once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["upload", "upload_count"]

_ALIGN = 16  # bytes: every view starts aligned for any dtype (and vectorised kernel loads)
_COUNT = {"uploads": 0}


def upload_count() -> int:
    """Packed copies :func:`upload` made in this process."""
    return _COUNT["uploads"]


def upload(tensors: Sequence[Tensor], device: torch.device | str) -> tuple[Tensor, ...]:
    """``tensors`` (host, any dtypes and shapes) as views of one buffer on ``device``, in order.

    One packed copy, asynchronous from pinned memory on CUDA; on CPU no copy beyond the packing.
    A tensor already on ``device`` is packed too (a device-side copy: still no host sync).
    """
    device = torch.device(device)
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    cuda = device.type == "cuda"
    host = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=cuda and torch.cuda.is_available())
    on_device = []
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t.device.type != "cpu":
            on_device.append(i)
            continue
        nbytes = t.numel() * t.element_size()
        if nbytes:
            host[off : off + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    buf = host.to(device, non_blocking=True) if device.type != "cpu" else host
    _COUNT["uploads"] += 1
    out = []
    for t, off in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        view = buf[off : off + nbytes].view(t.dtype).view(t.shape)
        out.append(view)
    for i in on_device:
        out[i].copy_(tensors[i], non_blocking=True)
    return tuple(out)
