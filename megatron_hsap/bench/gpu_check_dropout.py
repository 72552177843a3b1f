"""The GPU check's attention-dropout rows (``scripts/gpu_check.sh``, section ``executor``).

A GPU kernel's dropout mask cannot be read back through the adapters, so the rows check what the
runtime relies on by identities that hold for any mask (``runtime/dropout.py``):

* **redraw** — out is linear in V for a fixed mask, so ``Σ dV ∘ V = Σ dO ∘ O`` exactly when the
  backward applies the forward's mask. With ``dO = O`` the right side is ``Σ O²`` (no cancellation),
  and a backward on another mask gives ``Σ O ∘ O'`` instead, tens of percent away at p = 0.25;
  rounding keeps the identity to ~2^-9 in bf16. Per backend on the kernel cases, and through a
  one-rank plan (``hsap_attn_func``: the executor's per-call rng states over several calls).
* **mean** — averaged over 256 independent masks the output approaches the dropout-free one (the
  ``1/(1-p)`` scaling: without it the mean sits a factor ``1-p`` low, 25% at p = 0.25).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_hsap.runtime import kernels
from megatron_hsap.runtime.dropout import Dropout

__all__ = ["check_dropout"]

P = 0.25
DRAWS = 256
REDRAW_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
MEAN_TOL = 0.1  # relative L2 of the 256-draw mean (the short rows dominate: 0.035 on the dry run)


def _redraw_error(out: torch.Tensor, v: torch.Tensor, dv: torch.Tensor) -> float:
    """|Σ dV∘V − Σ O²| / Σ O² for a backward fed ``dO = O``."""
    rhs = float((out.double() ** 2).sum())
    return abs(float((dv.double() * v.double()).sum()) - rhs) / max(rhs, 1e-30)


def _kernel_rows(ctx: Any, lens_q: list[int], lens_k: list[int], cu: Any) -> None:
    backends = ["cpu"] if ctx.dry else [b for b in kernels.available_backends(ctx.device) if b != "cpu"]
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    d = 16 if ctx.dry else 128
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype).to(ctx.device) for t, h in ((tq, 8), (tk, 2), (tk, 2)))
    args = dict(cu_seqlens_q=cu(lens_q, ctx.device), cu_seqlens_k=cu(lens_k, ctx.device), max_seqlen_q=max(lens_q),
                max_seqlen_k=max(lens_k), causal=True, softmax_scale=d**-0.5)  # fmt: skip
    for backend in backends:
        name = f"{backend} {str(dtype).removeprefix('torch.')} dropout {P} gqa4 causal"
        try:
            plain, _ = kernels.attn_forward(q, k, v, **args, backend=backend)
            drop = Dropout(P, seed=11)
            out, lse, state = kernels.attn_forward_dropout(q, k, v, **args, dropout=drop, backend=backend)
            _, _, dv = kernels.attn_backward(out, q, k, v, out, lse, **args, backend=backend, dropout=drop, rng_state=state)
            redraw = _redraw_error(out, v, dv)
            total = torch.zeros_like(plain, dtype=torch.float64)
            for i in range(DRAWS):  # GPU: fresh philox offsets per call; cpu: a seed per draw
                total += kernels.attn_forward_dropout(q, k, v, **args, dropout=Dropout(P, seed=1000 + i), backend=backend)[0].double()
            mean = float((total / DRAWS - plain.double()).norm() / plain.double().norm())
            ctx.add("executor", name + " (redraw)", redraw, REDRAW_TOL[dtype], f"Σ dV∘V vs Σ O²; O ≠ O_nodrop: {not torch.equal(out, plain)}")
            if torch.equal(out, plain):  # dropout did nothing: the redraw identity proves nothing
                ctx.add("executor", name + " (applied)", 1.0, 0.0, "FAILED: the output equals the dropout-free one")
            ctx.add("executor", name + f" (mean of {DRAWS})", mean, MEAN_TOL, "relative L2 vs dropout-free")
        except Exception as exc:  # report and go on
            ctx.fail("executor", name, exc)


def _plan_rows(ctx: Any) -> None:
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.runtime import hsap_attn_func

    dtype = torch.float32 if ctx.dry else torch.bfloat16
    d = 16 if ctx.dry else 128
    cu = [0, 1, 2, 40, 41, 300] if ctx.dry else [0, 1, 2, 40, 300, 301, 1024, 4096]
    name = f"1x1 plan T={cu[-1]} dropout {P} (redraw per call)"
    try:
        plan = compile_plan(cu, 1, 1, num_heads=8, num_kv_heads=2, head_dim=d,
                            dtype_bytes=torch.tensor([], dtype=dtype).element_size())  # fmt: skip
        gen = torch.Generator().manual_seed(6)
        t = plan.padded_tokens
        q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype).to(ctx.device).requires_grad_(True) for h in (8, 2, 2))
        out = hsap_attn_func(q, k, v, plan, dropout_p=P, dropout_seed=3)
        out.backward(out.detach())
        ctx.add("executor", name, _redraw_error(out.detach(), v.detach(), v.grad), REDRAW_TOL[dtype], "Σ dV∘V vs Σ O²")
    except Exception as exc:
        ctx.fail("executor", name, exc)


def check_dropout(ctx: Any) -> None:
    """The dropout rows (see the module docstring)."""
    from megatron_hsap.bench.gpu_check import LENS_K, LENS_Q, _cu

    _kernel_rows(ctx, LENS_Q, LENS_K, _cu)
    _plan_rows(ctx)
