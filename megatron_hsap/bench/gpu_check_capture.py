"""The GPU check's CUDA graph row (``scripts/gpu_check.sh``, section ``executor``): capturing
``hsap_attn_func`` into a real CUDA graph is refused with ``ConfigError`` at the call
(``runtime/capture.py``: a graph would replay the captured batch's plan on every later batch), and
the same call runs eagerly right after (the refused capture left the stream usable). The CPU suite
can only stub the capture state (``tests/megatron/test_cuda_graphs.py``); this row is the real one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["check_capture"]


def check_capture(ctx: Any) -> None:
    """The row (see the module docstring); a dry run on the CPU has no graph to capture."""
    from megatron_hsap.errors import ConfigError
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.runtime import hsap_attn_func

    name = "1x1 plan captured in a CUDA graph (refused)"
    if ctx.device.type != "cuda":
        ctx.add("executor", name, math.nan, math.nan, "ok: no CUDA device (dry run): nothing to capture")
        return
    try:
        plan = compile_plan([0, 100, 256], 1, 1, num_heads=8, num_kv_heads=2, head_dim=128)
        gen = torch.Generator().manual_seed(9)
        q, k, v = (torch.randn(256, h, 128, generator=gen).to(torch.bfloat16).to(ctx.device) for h in (8, 2, 2))
        want = hsap_attn_func(q, k, v, plan)  # eager, before
        torch.cuda.synchronize()
        refused: ConfigError | None = None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                hsap_attn_func(q, k, v, plan)
        except ConfigError as exc:
            refused = exc
        again = hsap_attn_func(q, k, v, plan)  # eager, after
        torch.cuda.synchronize()
        if refused is None:
            ctx.add("executor", name, 1.0, 0.0, "FAILED: the capture went through (a replay would rerun this plan)")
        elif not torch.equal(again, want):
            ctx.add("executor", name, 1.0, 0.0, "FAILED: refused, but the eager call after it differs from the one before")
        else:
            ctx.add("executor", name, math.nan, math.nan, f"ok: ConfigError ({str(refused)[:60]}...); eager after it equal")
    except Exception as exc:  # report and go on
        ctx.fail("executor", name, exc)
