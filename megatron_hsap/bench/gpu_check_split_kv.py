"""The GPU check's split-kv rows (``scripts/gpu_check.sh``, section ``executor``): what a one-rank
plan cannot show on one GPU — a document's keys split in two calls whose partials are merged as
the executor merges received blocks (``merge_into`` in fp32, forward) and whose partial gradients
are summed against the final out/lse (backward), per backend, against whole documents; and the
receive pool allocated once on the device."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron_hsap.runtime import kernels
from megatron_hsap.runtime.executor import receive_pool
from megatron_hsap.runtime.merge import merge_into

if TYPE_CHECKING:
    from megatron_hsap.bench.gpu_check import _Ctx as Ctx

__all__ = ["check_split_kv"]


def check_split_kv(ctx: Ctx) -> None:
    """What a one-rank plan cannot show on one GPU: split-kv partials of every backend merged with
    ``merge_into`` in fp32 (forward) and partial gradients summed against the final out/lse
    (backward), as the executor does with received blocks, vs the reference of whole documents;
    and the receive pool allocated once on the device."""
    from megatron_hsap.bench.gpu_check import TOL, _cu, _err, _reference  # (imports this module lazily)

    # (document length n, first query row s, split t <= s): rows [s, n) attend keys [0, t) as a
    # rectangle and keys [t, n) causally (lq = n - s <= lk = n - t, bottom-right aligned).
    docs = [(40, 25, 10), (7, 3, 3), (1, 0, 0), (30, 29, 5), (64, 0, 0)]
    backends = ["cpu"] if ctx.dry else [b for b in kernels.available_backends(ctx.device) if b != "cpu"]
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    h, hkv, d = 8, 2, 16 if ctx.dry else 128
    dev = ctx.device
    starts = [0, *np.cumsum([n for n, _, _ in docs]).tolist()]
    rows = torch.cat([torch.arange(b + s, b + n) for (n, s, _), b in zip(docs, starts)])
    keys_a = torch.cat([torch.arange(b, b + t) for (_, _, t), b in zip(docs, starts)])
    keys_b = torch.cat([torch.arange(b + t, b + n) for (n, _, t), b in zip(docs, starts)])
    lq, la, lb = [n - s for n, s, _ in docs], [t for *_, t in docs], [n - t for n, _, t in docs]
    gen = torch.Generator().manual_seed(2)
    for mag in (1.0, 8.0):
        tokens = starts[-1]
        base = [torch.randn(tokens, h, d, generator=gen) * mag, torch.randn(tokens, hkv, d, generator=gen),
                torch.randn(tokens, hkv, d, generator=gen), torch.randn(len(rows), h, d, generator=gen)]  # fmt: skip
        q_all, k, v, dout = (x.to(dtype) for x in base)
        q = q_all[rows]
        ref = _reference(q, k, v, dout, _cu(lq, torch.device("cpu")), _cu([n for n, _, _ in docs], torch.device("cpu")),
                         max(lq), max(n for n, _, _ in docs), True, d**-0.5)  # fmt: skip
        for backend in backends:
            name = f"{backend} split-kv merge {'large logits' if mag > 1 else 'gqa4'}"
            try:
                common = dict(cu_seqlens_q=_cu(lq, dev), max_seqlen_q=max(lq), softmax_scale=d**-0.5, backend=backend)
                parts = [(keys_a, dict(cu_seqlens_k=_cu(la, dev), max_seqlen_k=max(la), causal=False, **common)),
                         (keys_b, dict(cu_seqlens_k=_cu(lb, dev), max_seqlen_k=max(lb), causal=True, **common))]  # fmt: skip
                qd, kd, vd, dod = (x.to(dev) for x in (q, k, v, dout))
                out = torch.zeros(len(rows), h, d, dtype=torch.float32, device=dev)
                lse = torch.full((len(rows), h), -math.inf, dtype=torch.float32, device=dev)
                for keys, kw in parts:
                    o, lp = kernels.attn_forward(qd, kd[keys.to(dev)], vd[keys.to(dev)], **kw)
                    merge_into(out, lse, o, lp.float())
                final = out.to(dtype)
                dq = torch.zeros(qd.shape, dtype=torch.float32, device=dev)
                dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=dev) for x in (kd, vd))
                for keys, kw in parts:
                    kk = keys.to(dev)
                    g = kernels.attn_backward(dod, qd, kd[kk], vd[kk], final, lse, **kw)
                    dq += g[0]
                    dk.index_add_(0, kk, g[1])
                    dv.index_add_(0, kk, g[2])
                # keys of no document row attended (none here) would be 0 in both
                errors = [_err(out, ref[0]), _err(lse, ref[1])] + [_err(x, r) for x, r in zip((dq, dk, dv), ref[2])]
                ctx.add("executor", name, max(errors), TOL[dtype], "out/lse/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errors))
            except Exception as exc:
                ctx.fail("executor", name, exc)
    try:
        first = receive_pool(1 << 20, dev)
        again = receive_pool(1 << 16, dev)
        ok = first.device.type == dev.type and again.data_ptr() == first.data_ptr() and first.numel() >= 1 << 20
        ctx.add("executor", "receive pool allocated once on the device", math.nan, math.nan,
                "ok" if ok else f"FAILED: {first.device} {first.numel()} reused={again.data_ptr() == first.data_ptr()}")  # fmt: skip
    except Exception as exc:
        ctx.fail("executor", "receive pool allocated once on the device", exc)
