"""The GPU check's qk-clip rows (``scripts/gpu_check.sh``, section ``executor``; ``runtime/max_logits.py``).

* **values** — a one-rank plan's ``hsap_attn_func(..., max_logits=)`` on the device against the
  largest allowed scaled logit per head computed densely in float64 (bf16 inputs are exact there;
  the pass scores in fp32, so the error is fp32 rounding of a dot product of 128 terms);
* **cost** — the forward's time with the maxima over the time without (median of 10 each, after a
  warm-up): the extra ``q·kᵀ`` pass, which the CPU suite cannot time. Reported, no bound.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

__all__ = ["check_max_logits"]

VALUE_TOL = 1e-4  # relative to the largest |logit| (fp32 sums of 128 bf16 products)


def _dense_max(q: torch.Tensor, k: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    """``[H]`` float64: per head, the largest ``scale · q·k`` over document-causal pairs."""
    h = q.shape[1]
    k = k.double().repeat_interleave(h // k.shape[1], 1)
    best = torch.full((h,), -math.inf, dtype=torch.float64, device=q.device)
    for a, b in zip(cu[:-1], cu[1:]):
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b]) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1), -math.inf)
        best = torch.maximum(best, s.amax(dim=(1, 2)))
    return best


def _median_s(fn: Any, device: torch.device, n: int = 10) -> float:
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2]


def check_max_logits(ctx: Any) -> None:
    """The rows (see the module docstring)."""
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.runtime import hsap_attn_func

    dtype = torch.float32 if ctx.dry else torch.bfloat16
    d = 16 if ctx.dry else 128
    cu = [0, 1, 2, 40, 41, 300] if ctx.dry else [0, 1, 2, 40, 300, 301, 1024, 4096, 8192]
    name = f"1x1 plan T={cu[-1]} max logits for qk-clip"
    try:
        plan = compile_plan(cu, 1, 1, num_heads=8, num_kv_heads=2, head_dim=d,
                            dtype_bytes=torch.tensor([], dtype=dtype).element_size())  # fmt: skip
        gen = torch.Generator().manual_seed(8)
        t = plan.padded_tokens
        q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype).to(ctx.device) for h in (8, 2, 2))
        cu_all = cu + ([t] if t > cu[-1] else [])  # padding: one more document
        ml = torch.full((8,), -math.inf, dtype=torch.float32, device=ctx.device)
        with torch.no_grad():
            hsap_attn_func(q, k, v, plan, max_logits=ml)
            want = _dense_max(q, k, cu_all, d**-0.5)
            err = float((ml.double() - want).abs().max() / want.abs().max())
            ctx.add("executor", name + " (values)", err, VALUE_TOL, "vs float64 dense per head")
            plain = _median_s(lambda: hsap_attn_func(q, k, v, plan), ctx.device)
            with_ml = _median_s(lambda: hsap_attn_func(q, k, v, plan, max_logits=ml), ctx.device)
        ctx.add("executor", name + " (cost)", math.nan, math.nan,
                f"ok: forward {with_ml * 1e3:.2f} ms with the maxima vs {plain * 1e3:.2f} ms without ({with_ml / plain:.2f}x)")
    except Exception as exc:  # report and go on
        ctx.fail("executor", name, exc)
