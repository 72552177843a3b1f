"""Section ``merge`` of the GPU check (``bench/gpu_check.py``): the fused Triton LSE merge.

1. exactness: ``runtime/fused_merge.py`` against the eager ``merge_into`` on the device and the
   float64 definition (logaddexp), bf16 / fp16 / fp32 parts, ``-inf`` rows on either and both
   sides, |lse| ~ 1e4, the executor's row-slice pattern, and the sinks variant.
2. bytes: both merges timed (CUDA events, median of 10) on one large merge and expressed as HBM
   bytes per output element at the bandwidth of a plain fp32 copy (8 bytes per element) measured
   on the same tensors: the pricing assumes 10 (fused) and 18 (eager) — ``plan/hardware.py``
   MERGE_FWD_BYTES / MERGE_FWD_BYTES_EAGER — and ``Hardware.hbm_bw`` for the bandwidth. Written
   to ``merge.csv``. The row fails when the fused merge is not faster than the eager one.

On the dry run (CPU) the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set
before its module is imported) at small sizes, and the timing is skipped; without Triton the
section says so and passes (CPU users need not have it).
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import sys
from typing import Any

import torch

__all__ = ["check_fused_merge"]

NEG_INF = float("-inf")


def _kernel_module(dry: bool) -> Any:
    if dry and "megatron_hsap.runtime.fused_merge" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton.jit decorates, i.e. at import
    from megatron_hsap.runtime import fused_merge

    return fused_merge


def _inputs(n: int, h: int, dv: int, dtype: torch.dtype, mag: float, dev: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    oa, op = torch.randn(n, h, dv, generator=g), torch.randn(n, h, dv, generator=g).to(dtype)
    la, lp = mag + 3 * torch.randn(n, h, generator=g), mag + 3 * torch.randn(n, h, generator=g)
    kind = torch.randint(0, 4, (n, h), generator=g)  # 1: acc empty, 2: part empty, 3: both
    la[(kind == 1) | (kind == 3)] = NEG_INF
    lp[(kind == 2) | (kind == 3)] = NEG_INF
    oa[(kind == 1) | (kind == 3)] = 0.0
    return [x.to(dev) for x in (oa, la, op, lp)]


def _reference(oa, la, op, lp):
    a, b = la.double().cpu(), lp.double().cpu()
    lse = torch.logaddexp(a, b)
    safe = torch.where(lse == NEG_INF, torch.zeros_like(lse), lse)
    out = torch.exp(a - safe)[..., None] * oa.double().cpu() + torch.exp(b - safe)[..., None] * op.double().cpu()
    return out, lse


def _exactness(ctx: Any, fm: Any, err: Any) -> None:
    from megatron_hsap.runtime.merge import merge_into, merge_sinks

    dev = ctx.device
    n, h, dv = (13, 3, 40) if ctx.dry else (1031, 32, 128)  # odd row counts: the masks matter
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for mag in (0.0, 1e4):
            name = f"fused merge {str(dtype).removeprefix('torch.')} {'|lse|~1e4' if mag else 'lse~N(0,3)'}"
            try:
                oa, la, op, lp = _inputs(n + 6, h, dv, dtype, mag, dev, seed=len(ctx.rows))
                rows = slice(2, 2 + n)  # the executor's pattern: rows of the whole accumulators
                ref = _reference(oa[rows], la[rows], op[rows], lp[rows])
                fo, fl = oa.clone(), la.clone()
                fm.fused_merge_into(fo[rows], fl[rows], op[rows], lp[rows])
                eo, el = oa.clone(), la.clone()
                merge_into(eo[rows], el[rows], op[rows], lp[rows])
                untouched = torch.equal(fo[:2], oa[:2]) and torch.equal(fl[n + 2 :], la[n + 2 :])
                errors = [err(fo[rows], ref[0]), err(fl[rows], ref[1]), err(fo, eo), err(fl, el)]
                if not untouched or bool(fo.isnan().any()):
                    errors.append(math.inf)
                tol = 4e-3 if mag else 1e-5  # fp32 ulps of |lse| (1e-3 at 1e4) enter the weights
                ctx.add("merge", name, max(errors), tol, "out/lse vs fp64, out/lse vs eager " +
                        " ".join(f"{e:.1e}" for e in errors[:4]))  # fmt: skip
            except Exception as exc:
                ctx.fail("merge", name, exc)
    name = "fused sinks merge |lse|~1e4"
    try:
        oa, la, _, _ = _inputs(n, h, dv, torch.float32, 1e4, dev, seed=99)
        sinks = (1e4 + torch.randn(h)).to(dev)
        sinks[0] = NEG_INF
        ref = _reference(oa, la, torch.zeros_like(oa), sinks.expand(n, h))
        fo, fl = oa.clone(), la.clone()
        fm.fused_merge_sinks(fo, fl, sinks)
        eo, el = oa.clone(), la.clone()
        merge_sinks(eo, el, sinks)
        errors = [err(fo, ref[0]), err(fl, ref[1]), err(fo, eo), err(fl, el)]
        ctx.add("merge", name, max(errors), 4e-3, "out/lse vs fp64, out/lse vs eager " + " ".join(f"{e:.1e}" for e in errors))
    except Exception as exc:
        ctx.fail("merge", name, exc)


def _time_ms(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _bytes_per_element(ctx: Any, fm: Any) -> None:
    from megatron_hsap.plan.hardware import MERGE_FWD_BYTES, MERGE_FWD_BYTES_EAGER
    from megatron_hsap.runtime.merge import merge_into

    name = "fused merge HBM bytes per element"
    if ctx.dry:
        ctx.add("merge", name, math.nan, math.nan, "ok: skipped on the dry run (timing needs a GPU)")
        return
    try:
        n, h, dv = 32768, 32, 128  # 134M elements: 512 MiB fp32 accumulator, 256 MiB bf16 part
        oa, la, op, lp = _inputs(n, h, dv, torch.bfloat16, 0.0, ctx.device, seed=5)
        elems = n * h * dv
        dst = torch.empty_like(oa)
        copy_ms = _time_ms(lambda: dst.copy_(oa))
        bw = 8 * elems / (copy_ms * 1e-3)  # read 4 + write 4
        fused_ms = _time_ms(lambda: fm.fused_merge_into(oa, la, op, lp))
        eager_ms = _time_ms(lambda: merge_into(oa, la, op, lp, fused=False))
        fused_b, eager_b = fused_ms * 1e-3 * bw / elems, eager_ms * 1e-3 * bw / elems
        with open(ctx.out / "merge.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["rows", "heads", "dv", "copy_ms", "copy_bw", "fused_ms", "fused_bytes", "eager_ms", "eager_bytes",
                        "priced_fused", "priced_eager"])  # fmt: skip
            w.writerow([n, h, dv, copy_ms, bw, fused_ms, fused_b, eager_ms, eager_b, MERGE_FWD_BYTES, MERGE_FWD_BYTES_EAGER])
        ok = fused_ms < eager_ms
        ctx.add("merge", name, math.nan, math.nan,
                f"{'ok' if ok else 'FAILED: fused not faster'}: fused {fused_ms:.3f} ms = {fused_b:.1f} B/elem "
                f"(priced {MERGE_FWD_BYTES:g}), eager {eager_ms:.3f} ms = {eager_b:.1f} B/elem (priced "
                f"{MERGE_FWD_BYTES_EAGER:g}), at the fp32 copy's {bw / 1e12:.2f} TB/s; {n}x{h}x{dv} bf16 part")  # fmt: skip
    except Exception as exc:
        ctx.fail("merge", name, exc)


def check_fused_merge(ctx: Any) -> None:
    """The ``merge`` section (``ctx``: gpu_check's ``_Ctx``)."""
    from megatron_hsap.bench.gpu_check import _err

    if importlib.util.find_spec("triton") is None:
        ctx.add("merge", "fused merge", math.nan, math.nan, "ok: skipped, Triton not installed (the eager merge runs)")
        return
    try:
        fm = _kernel_module(ctx.dry)
    except Exception as exc:
        ctx.fail("merge", "import runtime/fused_merge.py", exc)
        return
    _exactness(ctx, fm, _err)
    _bytes_per_element(ctx, fm)
