"""The CPU stand-in of ``mamba_ssm``'s training kernel (``cpu/mamba_kernels.py``) against the
Mamba-2 recurrence computed token by token, one document at a time (an independent loop: no shared
code with the quadratic form it checks), and its gradients against the same documents run alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_hsap.megatron.cpu import mamba_kernels as mk

H, P, G, N, W = 4, 3, 2, 5, 4  # heads, head dim, groups, state size, convolution width
DOCS = (6, 9, 1, 8)  # tokens per document (one of a single token)


def _inputs(seed: int, d_has_hdim: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dim, conv = H * P, H * P + 2 * G * N
    length = sum(DOCS)
    return dict(
        zxbcdt=torch.randn(1, length, 2 * dim + 2 * G * N + H, generator=g, dtype=torch.float64),
        weight=torch.randn(conv, W, generator=g, dtype=torch.float64) * 0.5,
        bias=torch.randn(conv, generator=g, dtype=torch.float64) * 0.1,
        dt_bias=torch.randn(H, generator=g, dtype=torch.float64) * 0.5,
        A=-torch.rand(H, generator=g, dtype=torch.float64) * 2 - 0.1,
        D=torch.randn(H, P, generator=g, dtype=torch.float64) if d_has_hdim else torch.randn(H, generator=g, dtype=torch.float64),
    )


def _seq_idx() -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS)).to(torch.int32).unsqueeze(0)


def _recurrence(t: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """One document ``[lo, hi)`` by the definition: taps of earlier tokens of the document only,
    the state updated token by token from zero."""
    dim = H * P
    z, xbc, dt = torch.split(t["zxbcdt"][0, lo:hi], [dim, dim + 2 * G * N, H], dim=-1)
    conv = torch.zeros_like(xbc)
    for i in range(hi - lo):
        acc = t["bias"].clone()
        for tap in range(W):
            src = i - (W - 1 - tap)
            if src >= 0:
                acc = acc + t["weight"][:, tap] * xbc[src]
        conv[i] = acc
    conv = F.silu(conv)
    x, B, C = torch.split(conv, [dim, G * N, G * N], dim=-1)
    delta = F.softplus(dt + t["dt_bias"])
    state = torch.zeros(H, P, N, dtype=torch.float64)
    out = []
    for i in range(hi - lo):
        xs = x[i].view(H, P)
        row = []
        for h in range(H):
            grp = h // (H // G)
            b_, c_ = B[i].view(G, N)[grp], C[i].view(G, N)[grp]
            state[h] = torch.exp(delta[i, h] * t["A"][h]) * state[h] + delta[i, h] * torch.outer(xs[h], b_)
            skip = t["D"][h] if t["D"].dim() == 2 else t["D"][h].expand(P)
            row.append(state[h] @ c_ + skip * xs[h])
        out.append(torch.cat(row) * F.silu(z[i]))
    return torch.stack(out)


def _kernel(t: dict[str, torch.Tensor], seq_idx: torch.Tensor | None) -> torch.Tensor:
    return mk.mamba_split_conv1d_scan_combined(
        t["zxbcdt"], t["weight"], t["bias"], t["dt_bias"], t["A"], t["D"], chunk_size=128, seq_idx=seq_idx,
        headdim=P if t["D"].dim() == 1 else None, ngroups=G)


@pytest.mark.parametrize("d_has_hdim", [False, True])
def test_kernel_equals_recurrence_per_document(d_has_hdim: bool) -> None:
    t = _inputs(0, d_has_hdim)
    got = _kernel(t, _seq_idx())[0]
    starts = [0, *torch.cumsum(torch.tensor(DOCS), 0).tolist()]
    want = torch.cat([_recurrence(t, lo, hi) for lo, hi in zip(starts, starts[1:])])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # without seq_idx the documents run into each other: the check above can fail
    assert (_kernel(t, None)[0] - want).abs().max() > 1e-3


def test_gradients_equal_documents_run_alone() -> None:
    t = _inputs(1)
    leaves = {k: v.clone().requires_grad_(True) for k, v in t.items()}
    seed = torch.Generator().manual_seed(2)
    upstream = torch.randn(1, sum(DOCS), H * P, generator=seed, dtype=torch.float64)
    (_kernel(leaves, _seq_idx()) * upstream).sum().backward()
    alone = {k: v.clone().requires_grad_(True) for k, v in t.items()}
    lo = 0
    total = 0
    for n in DOCS:  # each document as its own sequence: its slice of zxbcdt, no seq_idx
        part = dict(alone, zxbcdt=alone["zxbcdt"][:, lo:lo + n])
        total = total + (_kernel(part, None) * upstream[:, lo:lo + n]).sum()
        lo += n
    total.backward()
    for k in t:
        torch.testing.assert_close(leaves[k].grad, alone[k].grad, rtol=1e-9, atol=1e-12)


def test_gated_rmsnorm_groups() -> None:
    g = torch.Generator().manual_seed(3)
    x, z = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g)
    norm = mk.RMSNormGated(12, eps=1e-5, group_size=4, norm_before_gate=False)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12, generator=g))
    gated = x * F.silu(z)
    want = torch.cat([part * torch.rsqrt(part.square().mean(-1, keepdim=True) + 1e-5) for part in gated.split(4, -1)], -1)
    torch.testing.assert_close(norm(x, z), want * norm.weight, rtol=1e-6, atol=1e-6)
    plain = mk.RMSNormGated(12, group_size=None)
    torch.testing.assert_close(plain(x), x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5))


def test_unused_kernel_paths_refused() -> None:
    from megatron_hsap.errors import ConfigError

    t = _inputs(4)
    with pytest.raises(ConfigError, match="return_final_states"):
        mk.mamba_split_conv1d_scan_combined(t["zxbcdt"], t["weight"], t["bias"], t["dt_bias"], t["A"], t["D"], 128,
                                            headdim=P, ngroups=G, return_final_states=True)
