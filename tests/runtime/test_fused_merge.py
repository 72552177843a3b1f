"""The fused Triton merge (runtime/fused_merge.py), run by Triton's interpreter on CPU tensors,
against the eager ``merge_into`` and an independent float64 logaddexp reference."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsap.errors import ConfigError, RuntimeMismatchError
from megatron_hsap.runtime import merge as merge_mod
from megatron_hsap.runtime.env import read_env
from megatron_hsap.runtime.merge import merge_into, merge_sinks, use_fused_merge
from tests.runtime.interpreted import interpreted

NEG_INF = float("-inf")
_MOD = "megatron_hsap.runtime.fused_merge"


@pytest.fixture(scope="module")
def fm():
    """The kernel module under Triton's interpreter (``tests/runtime/interpreted.py``)."""
    yield from interpreted(_MOD, "_merge_kernel")


def _ref_merge(oa, la, op, lp):
    """Float64 definition: lse = log(e^a + e^b); o = Σ e^{lse_x - lse} o_x (an empty side weighs 0)."""
    a, b = la.double(), lp.double()
    lse = torch.logaddexp(a, b)
    safe = torch.where(lse == NEG_INF, torch.zeros_like(lse), lse)
    out = torch.exp(a - safe).unsqueeze(-1) * oa.double() + torch.exp(b - safe).unsqueeze(-1) * op.double()
    return out, lse


def _inputs(g, n, h, dv, part_dtype, scale, empty):
    oa = torch.randn(n, h, dv, generator=g)
    la = scale + 3 * torch.randn(n, h, generator=g)
    op = torch.randn(n, h, dv, generator=g).to(part_dtype)
    lp = scale + 3 * torch.randn(n, h, generator=g)
    kinds = torch.randint(0, 4, (n, h), generator=g) if empty else torch.zeros(n, h, dtype=torch.long)
    la[(kinds == 1) | (kinds == 3)] = NEG_INF  # 1: acc empty, 2: part empty, 3: both
    lp[(kinds == 2) | (kinds == 3)] = NEG_INF
    oa[kinds == 1] = 0.0  # an empty accumulator holds zeros (the executor's torch.zeros)
    oa[kinds == 3] = 0.0
    return oa, la, op, lp, kinds


def _check_against(fm, oa, la, op, lp, kinds, scale):
    fo, fl = oa.clone(), la.clone()
    fm.fused_merge_into(fo, fl, op, lp)
    eo, el = oa.clone(), la.clone()
    merge_into(eo, el, op, lp)
    ro, rl = _ref_merge(oa, la, op, lp)
    assert not fo.isnan().any() and not fl.isnan().any()
    # -inf rows, exactly: both empty stay empty and unchanged; an empty side weighs exactly 0
    both, acc_empty, part_empty = kinds == 3, kinds == 1, kinds == 2
    assert (fl[both] == NEG_INF).all() and torch.equal(fo[both], oa[both])
    assert torch.equal(fl[acc_empty], lp[acc_empty]) and torch.equal(fo[acc_empty], op[acc_empty].float())
    assert torch.equal(fl[part_empty], la[part_empty]) and torch.equal(fo[part_empty], oa[part_empty])
    # fp32 math: ulps of |lse| (1e-3 at 1e4); the weights e^{Δ} inherit that absolute error
    tol = 4e-6 * max(1.0, abs(scale) + 20)
    torch.testing.assert_close(fl.double(), rl, rtol=0, atol=tol)
    torch.testing.assert_close(fo.double(), ro, rtol=0, atol=3 * tol)
    torch.testing.assert_close(fl, el, rtol=0, atol=tol)
    torch.testing.assert_close(fo, eo, rtol=0, atol=3 * tol)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), h=st.integers(1, 5), dv=st.integers(1, 70),
       part_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       scale=st.sampled_from([0.0, 1e4, -1e4]), empty=st.booleans(), seed=st.integers(0, 2**16))  # fmt: skip
def test_fused_equals_eager_and_float64(fm, n, h, dv, part_dtype, scale, empty, seed):
    g = torch.Generator().manual_seed(seed)
    oa, la, op, lp, kinds = _inputs(g, n, h, dv, part_dtype, scale, empty)
    _check_against(fm, oa, la, op, lp, kinds, scale)


def test_every_empty_pattern_and_wide_heads(fm):
    # all four kinds present, dv over one 256-column block (the kernel loops over dv)
    g = torch.Generator().manual_seed(3)
    oa, la, op, lp, _ = _inputs(g, 4, 3, 300, torch.bfloat16, 0.0, False)
    kinds = torch.tensor([[0, 1, 2], [3, 0, 1], [2, 3, 0], [1, 2, 3]])
    la[(kinds == 1) | (kinds == 3)] = NEG_INF
    lp[(kinds == 2) | (kinds == 3)] = NEG_INF
    oa[(kinds == 1) | (kinds == 3)] = 0.0
    _check_against(fm, oa, la, op, lp, kinds, 0.0)


def test_tiny_weight_keeps_log1p_precision(fm):
    # lse_b - lse_a = -20: log1p(e^-20) = 2e-9 is lost by log(1 + x) but not by the kernel
    oa, op = torch.ones(1, 1, 1), torch.ones(1, 1, 1)
    la, lp = torch.zeros(1, 1), torch.full((1, 1), -20.0)
    fm.fused_merge_into(oa, la, op, lp)
    assert la.item() == pytest.approx(2.061153622438558e-09, rel=1e-5)


def test_executor_strided_pattern(fm):
    """What the executor passes: row slices of the whole [t, h, dv] accumulators, parts as typed
    views of a byte pool at an offset, a kernel's lse as a transposed [h, n] buffer; and a head
    slice (non-contiguous rows) of the accumulator. Rows outside the slice stay untouched."""
    g = torch.Generator().manual_seed(7)
    t, h, dv, n, r0 = 11, 3, 24, 5, 4
    out = torch.randn(t, h, dv, generator=g)
    lse = torch.randn(t, h, generator=g)
    pool = torch.zeros(64 + n * h * dv * 2, dtype=torch.uint8)
    op = pool[64 : 64 + n * h * dv * 2].view(torch.bfloat16).view(n, h, dv)
    op.copy_(torch.randn(n, h, dv, generator=g))
    lp = torch.randn(h, n, generator=g).t()  # strides (1, n)
    assert not lp.is_contiguous()
    ro, rl = _ref_merge(out[r0 : r0 + n], lse[r0 : r0 + n], op, lp)
    before_o, before_l = out.clone(), lse.clone()
    fm.fused_merge_into(out[r0 : r0 + n], lse[r0 : r0 + n], op, lp)
    torch.testing.assert_close(out[r0 : r0 + n].double(), ro, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse[r0 : r0 + n].double(), rl, rtol=0, atol=1e-5)
    keep = torch.ones(t, dtype=torch.bool)
    keep[r0 : r0 + n] = False
    assert torch.equal(out[keep], before_o[keep]) and torch.equal(lse[keep], before_l[keep])
    # a head slice: out[:, 1:3] has strides (h*dv, dv, 1) over 2 heads
    part, lse_part = op[:1, :2].expand(t, 2, dv), lse[:, :2].clone()  # part's row stride 0
    ro, rl = _ref_merge(out[:, 1:3], lse[:, 1:3], part, lse_part)
    before_o = out.clone()
    fm.fused_merge_into(out[:, 1:3], lse[:, 1:3], part, lse_part)
    torch.testing.assert_close(out[:, 1:3].double(), ro, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse[:, 1:3].double(), rl, rtol=0, atol=1e-5)
    assert torch.equal(out[:, 0], before_o[:, 0])


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
def test_fused_sinks(fm, sink_dtype):
    g = torch.Generator().manual_seed(11)
    n, h, dv = 6, 4, 10
    out, lse = torch.randn(n, h, dv, generator=g), 1e4 + torch.randn(n, h, generator=g)
    lse[0, :2] = NEG_INF
    out[0, :2] = 0.0
    sinks = (1e4 + torch.randn(h, generator=g)).to(sink_dtype)
    sinks[1] = NEG_INF  # no sink on head 1: row 0 head 1 has neither keys nor sink
    fo, fl = out.clone(), lse.clone()
    fm.fused_merge_sinks(fo, fl, sinks)
    eo, el = out.clone(), lse.clone()
    merge_sinks(eo, el, sinks)
    s = sinks.double().expand(n, h)
    ro, rl = _ref_merge(out, lse, torch.zeros_like(out), s)
    assert not fo.isnan().any() and fl[0, 1] == NEG_INF and torch.equal(fo[0, 1], out[0, 1])
    torch.testing.assert_close(fl.double(), rl, rtol=0, atol=4e-3)
    torch.testing.assert_close(fo.double(), ro, rtol=0, atol=1e-2)
    torch.testing.assert_close(fl, el, rtol=0, atol=4e-3)
    torch.testing.assert_close(fo, eo, rtol=0, atol=1e-2)


def test_fused_rejects_what_it_cannot_merge(fm):
    acc, lse = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    with pytest.raises(RuntimeMismatchError, match="float32"):
        fm.fused_merge_into(acc.double(), lse.double(), acc, lse)
    with pytest.raises(RuntimeMismatchError, match="does not match"):
        fm.fused_merge_into(acc, lse, torch.zeros(2, 3, 5), lse)
    with pytest.raises(RuntimeMismatchError, match="lse_part fp32"):
        fm.fused_merge_into(acc, lse, acc, lse.double())
    with pytest.raises(RuntimeMismatchError, match=r"\[h\]"):
        fm.fused_merge_sinks(acc, lse, torch.zeros(4))


# --------------------------------------------------------------------------- dispatch


def test_cpu_tensors_take_the_eager_path(monkeypatch):
    """``fused=True`` on CPU tensors never reaches the kernel module and is bit-identical."""
    stub = types.ModuleType(_MOD)

    def _boom(*_a):
        raise AssertionError("the fused kernel was called for CPU tensors")

    stub.fused_merge_into = stub.fused_merge_sinks = _boom
    monkeypatch.setitem(sys.modules, _MOD, stub)
    g = torch.Generator().manual_seed(5)
    oa, la, op, lp, _ = _inputs(g, 7, 2, 9, torch.bfloat16, 0.0, True)
    a, b = (oa.clone(), la.clone()), (oa.clone(), la.clone())
    merge_into(*a, op, lp, fused=True)
    merge_into(*b, op, lp)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    merge_sinks(*a, torch.zeros(2), fused=True)


def test_fusable_tensors_reach_the_kernel(monkeypatch):
    calls = []
    stub = types.ModuleType(_MOD)
    stub.fused_merge_into = lambda *a: calls.append("merge")
    stub.fused_merge_sinks = lambda *a: calls.append("sinks")
    monkeypatch.setitem(sys.modules, _MOD, stub)
    monkeypatch.setattr(merge_mod, "_kernel_takes", lambda *a: True)  # as if on CUDA
    acc, lse = torch.zeros(1, 1, 1), torch.zeros(1, 1)
    merge_into(acc, lse, acc, lse, fused=True)
    merge_sinks(acc, lse, torch.zeros(1), fused=True)
    merge_into(acc, lse, acc, lse, fused=False)
    assert calls == ["merge", "sinks"]


def test_env_switch_and_device_decide():
    has_triton = importlib.util.find_spec("triton") is not None
    assert read_env({}).fused_merge and not read_env({"HSAP_FUSED_MERGE": "0"}).fused_merge
    with pytest.raises(ConfigError, match="HSAP_FUSED_MERGE"):
        read_env({"HSAP_FUSED_MERGE": "maybe"})
    assert not use_fused_merge("cpu", read_env({}))
    assert use_fused_merge("cuda", read_env({})) == has_triton  # a device name needs no GPU
    assert not use_fused_merge("cuda:1", read_env({"HSAP_FUSED_MERGE": "off"}))


def test_importing_the_runtime_does_not_import_triton():
    code = ("import sys, megatron_hsap, megatron_hsap.runtime.executor, megatron_hsap.runtime.sap, "
            "megatron_hsap.runtime.merge; assert 'triton' not in sys.modules, 'triton imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
