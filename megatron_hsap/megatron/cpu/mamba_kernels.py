"""CPU stand-ins for the ``mamba_ssm`` kernels Megatron's ``MambaMixer`` trains with (tests and the
CPU demo only; never imported on the GPU path, where the real ``mamba_ssm`` runs).

``MambaMixer`` imports ``mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined`` (the
training kernel: causal depthwise convolution, SSD scan, gate) and
``mamba_ssm.ops.triton.layernorm_gated.RMSNorm`` at import time, and refuses to build without them.
:func:`install` registers a ``mamba_ssm`` package of the two, written in plain torch from the
state-space recurrence (Mamba-2, arXiv:2405.21060 §3):

    h_t = exp(Δ_t·A) h_{t-1} + Δ_t · x_t B_tᵀ,   y_t = h_t C_t + D·x_t,   out_t = y_t · silu(z_t)

with ``Δ = softplus(dt + dt_bias)``, and both the convolution and the state restarting at every
document (``seq_idx``: each token's document, as the CUDA kernels take it). The scan is computed in
its quadratic (attention-like) form, ``y = (L ∘ C Bᵀ)(Δ x)`` with ``L[i, j] = exp(Σ_{j<k≤i} Δ_k A)``
inside a document and 0 across documents: exact, differentiable by autograd, O(T²) per head — fine
for the few hundred tokens of a CPU run. ``tests/megatron/test_mamba_kernels.py`` holds it to the
token-by-token recurrence.
"""

from __future__ import annotations

import importlib
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.cpu.stand_in_packages import register_packages

__all__ = ["RMSNormGated", "causal_conv1d", "causal_conv1d_fn", "install", "mamba_split_conv1d_scan_combined", "ssd_scan"]

VERSION = "2.2.6"  # what the stand-in reports: the mamba_ssm release whose signatures it follows
CONV1D_VERSION = "1.5.3"  # and the causal_conv1d release (Megatron checks both before packed training)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None) -> Tensor:
    """Depthwise causal convolution that never reaches into an earlier document.

    Args:
        x: ``[b, l, c]``.
        weight: ``[c, w]`` (tap ``w - 1`` multiplies the current token).
        bias: ``[c]`` or None.
        seq_idx: ``[b, l]`` int document of each token, or None (one document per row).
    Returns:
        ``[b, l, c]`` (before the activation).
    """
    width = weight.shape[-1]
    out = x * weight[:, width - 1]
    for back in range(1, width):  # token t - back, through tap width - 1 - back
        shifted = F.pad(x, (0, 0, back, 0))[:, : x.shape[1]]
        term = shifted * weight[:, width - 1 - back]
        if seq_idx is not None:
            same = F.pad(seq_idx, (back, 0), value=-1)[:, : x.shape[1]] == seq_idx
            term = term * same.unsqueeze(-1).to(term.dtype)
        out = out + term
    return out if bias is None else out + bias


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, seq_idx: Tensor | None) -> Tensor:
    """The state-space scan (without ``D``), restarting at every document, in float32.

    Args:
        x: ``[b, l, h, p]``; dt: ``[b, l, h]`` (after softplus); A: ``[h]`` (negative);
        B, C: ``[b, l, g, n]`` (``h`` a multiple of ``g``: head ``i`` reads group ``i // (h / g)``);
        seq_idx: ``[b, l]`` or None.
    Returns:
        ``[b, l, h, p]`` in float32 (float64 for float64 ``x``).
    """
    b, l, h, _ = x.shape
    acc = _accumulator(x)
    rep = h // B.shape[2]
    Bh = B.to(acc).repeat_interleave(rep, dim=2)  # [b, l, h, n]
    Ch = C.to(acc).repeat_interleave(rep, dim=2)
    dA = dt.to(acc) * A.to(acc)  # [b, l, h]
    # seg[b, i, j, h] = Σ_{j<k≤i} dA_k, summed from k = j + 1 on (not a difference of prefix sums,
    # which would depend on the documents before: a document then scans alike wherever it sits)
    below = torch.ones(l, l, dtype=torch.bool, device=x.device).tril(-1).view(1, l, l, 1)
    seg = torch.cumsum(dA.unsqueeze(2).expand(b, l, l, h).masked_fill(~below, 0.0), dim=1)
    keep = torch.ones(l, l, dtype=torch.bool, device=x.device).tril().view(1, l, l, 1)
    if seq_idx is not None:
        keep = keep & (seq_idx.unsqueeze(2) == seq_idx.unsqueeze(1)).unsqueeze(-1)
    decay = torch.exp(torch.where(keep, seg, torch.full_like(seg, -math.inf)))
    scores = torch.einsum("bihn,bjhn->bijh", Ch, Bh) * decay  # [b, i, j, h]
    return torch.einsum("bijh,bjh,bjhp->bihp", scores, dt.to(acc), x.to(acc))


def _accumulator(x: Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (the tests' exact checks)."""
    return torch.promote_types(x.dtype, torch.float32)


def mamba_split_conv1d_scan_combined(
    zxbcdt: Tensor, conv1d_weight: Tensor, conv1d_bias: Tensor | None, dt_bias: Tensor, A: Tensor, D: Tensor,
    chunk_size: int, initial_states: Tensor | None = None, seq_idx: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")), return_final_states: bool = False, activation: str = "silu",
    rmsnorm_weight: Tensor | None = None, rmsnorm_eps: float = 1e-6, outproj_weight: Tensor | None = None,
    outproj_bias: Tensor | None = None, headdim: int | None = None, ngroups: int = 1, norm_before_gate: bool = True,
    state_dtype: torch.dtype | None = None,
) -> Tensor:
    """``mamba_ssm``'s training kernel (same parameters) as Megatron's ``MambaMixer._ssm_training``
    calls it: ``zxbcdt`` ``[b, l, 2·d + 2·g·n + h]`` split into ``z, xBC, dt``; ``xBC`` convolved
    (inside documents) and activated; the scan; ``+ D·x``; gated by ``silu(z)``. Returns ``[b, l, d]``
    in ``zxbcdt``'s dtype. The fused norm / output projection, initial and final states (which
    Megatron's training path does not use) are refused."""
    del chunk_size, state_dtype, norm_before_gate, rmsnorm_eps  # (tiling and state precision: CUDA only)
    unused = {"initial_states": initial_states is not None, "return_final_states": return_final_states,
              "rmsnorm_weight": rmsnorm_weight is not None, "outproj_weight": outproj_weight is not None,
              "outproj_bias": outproj_bias is not None, f"activation={activation!r}": activation != "silu"}
    if any(unused.values()):
        raise ConfigError(f"the CPU stand-in of mamba_split_conv1d_scan_combined does not implement "
                          f"{', '.join(k for k, v in unused.items() if v)} (Megatron's MambaMixer training path uses none)")
    nheads = A.shape[0]
    if D.dim() == 1:
        if headdim is None:
            raise ConfigError("mamba_split_conv1d_scan_combined: a per-head D needs headdim")
    else:
        headdim = D.shape[1]
    dim = nheads * headdim
    dstate = (zxbcdt.shape[-1] - 2 * dim - nheads) // ngroups // 2
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = F.silu(causal_conv1d(xBC, conv1d_weight, conv1d_bias, seq_idx))
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    b, l = x.shape[:2]
    x = x.reshape(b, l, nheads, headdim)
    acc = _accumulator(x)
    delta = F.softplus(dt.to(acc) + dt_bias.to(acc))
    if dt_limit != (0.0, float("inf")):
        delta = delta.clamp(*dt_limit)
    y = ssd_scan(x, delta, A, B.reshape(b, l, ngroups, dstate), C.reshape(b, l, ngroups, dstate), seq_idx)
    skip = D.to(acc).view(1, 1, nheads, -1)  # (per head: [h, 1]; per channel: [h, p])
    y = (y + x.to(acc) * skip).reshape(b, l, dim)
    return (y * F.silu(z.to(acc))).to(zxbcdt.dtype)


def mamba_chunk_scan_combined(*args: Any, state_dtype: torch.dtype | None = None, **kwargs: Any) -> Tensor:
    """Megatron calls this in inference and in the non-memory-efficient path only, neither of which
    HSAP runs; the stand-in refuses it."""
    raise ConfigError("the CPU stand-in of mamba_ssm has no mamba_chunk_scan_combined (inference / "
                      "--disable-mamba-mem-eff-path); it trains through mamba_split_conv1d_scan_combined")


def causal_conv1d_fn(x: Tensor, weight: Tensor, bias: Tensor | None = None, seq_idx: Tensor | None = None,
                     initial_states: Tensor | None = None, return_final_states: bool = False,
                     final_states_out: Tensor | None = None, activation: str | None = None) -> Tensor:
    """``causal_conv1d.causal_conv1d_fn``: ``x`` ``[b, c, l]`` convolved by :func:`causal_conv1d`,
    then ``silu`` when ``activation`` is ``"silu"``/``"swish"``. Initial / final states are refused."""
    if initial_states is not None or return_final_states or final_states_out is not None:
        raise ConfigError("the CPU stand-in of causal_conv1d_fn takes no initial or final states")
    out = causal_conv1d(x.transpose(1, 2), weight, bias, seq_idx).transpose(1, 2)
    return F.silu(out) if activation in ("silu", "swish") else out


def causal_conv1d_varlen_states(*args: Any, **kwargs: Any) -> Tensor:
    """Inference only (the final convolution states of each request); refused on CPU."""
    raise ConfigError("the CPU stand-in of causal_conv1d has no causal_conv1d_varlen_states (inference)")


class RMSNormGated(nn.Module):
    """``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``: an RMS norm per group of ``group_size``
    channels (the whole row when None), optionally gated by ``silu(z)`` before or after it."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None, norm_before_gate: bool = True,
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        """``x``, ``z``: ``[..., hidden_size]``; returns ``x``'s shape and dtype (computed in float32)."""
        out = x.to(_accumulator(x))
        if z is not None and not self.norm_before_gate:
            out = out * F.silu(z.to(out.dtype))
        size = self.group_size or out.shape[-1]
        grouped = out.unflatten(-1, (-1, size))
        out = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + self.eps)).flatten(-2) * self.weight.to(out.dtype)
        if z is not None and self.norm_before_gate:
            out = out * F.silu(z.to(out.dtype))
        return out.to(x.dtype)


def install() -> None:
    """Register the stand-in ``mamba_ssm`` and ``causal_conv1d`` packages (idempotent); real ones are
    left alone. megatron-core's ``ssm.mamba_mixer`` reads the kernels at import; imported before,
    it is run again."""
    if not register_packages(("mamba_ssm", "causal_conv1d"), {
        "mamba_ssm": {"__version__": VERSION},
        "mamba_ssm.ops.triton.ssd_combined": {"mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined,
                                              "mamba_chunk_scan_combined": mamba_chunk_scan_combined},
        "mamba_ssm.ops.triton.layernorm_gated": {"RMSNorm": RMSNormGated},
        "causal_conv1d": {"__version__": CONV1D_VERSION, "causal_conv1d_fn": causal_conv1d_fn},
        "causal_conv1d.causal_conv1d_varlen": {"causal_conv1d_varlen_states": causal_conv1d_varlen_states},
    }):
        return
    mixer = sys.modules.get("megatron.core.ssm.mamba_mixer")
    if mixer is not None and not mixer.HAVE_MAMBA_SSM:
        # imported before the stand-in (it read the kernels as missing): run its module again; classes
        # made from it before (HSAP's mixer, the specs') read the same module namespace, now complete
        importlib.reload(mixer)
