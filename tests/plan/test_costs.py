"""plan/costs.py: ``HeadShape.token_bytes`` equals the wire formats of docs/design.md §4 written
out here element by element (activation dtype for q/kv/o/do, fp32 for lse/delta/dq/dkv; kv and
dkv are k then v), FLOPs per pair are 2·H·(d_qk + d_v) forward and 2.5× that backward, and bad
head shapes raise ``ConfigError`` naming what to change.

Reference: the tensor shapes of ``plan/ir.py``'s ``Wire`` comments, multiplied out here."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.ir import Wire


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.sampled_from([1, 2, 4]), st.integers(1, 256), st.integers(1, 256), st.sampled_from([1, 2, 4]))
def test_token_bytes_are_the_wire_formats(hkv: int, group: int, d: int, dv: int, b: int) -> None:
    h = hkv * group
    s = HeadShape(num_heads=h, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, dtype_bytes=b)
    shapes = {  # (elements per token, bytes per element)
        Wire.Q: (h * d, b), Wire.KV: (hkv * d + hkv * dv, b), Wire.O: (h * dv, b), Wire.LSE: (h, 4),
        Wire.DO: (h * dv, b), Wire.DELTA: (h, 4), Wire.DQ: (h * d, 4), Wire.DKV: (hkv * d + hkv * dv, 4),
    }
    for w, (n, e) in shapes.items():
        assert s.token_bytes(w) == n * e
        assert s.nbytes(w, 7) == 7 * n * e
    assert s.fwd_flops_per_pair == 2 * h * (d + dv)  # exact: small integers in a float
    assert s.bwd_flops_per_pair == 2.5 * s.fwd_flops_per_pair  # exact: ×2.5 of an even integer
    assert s.chunk_token_bytes == h * (d + dv) * b


def test_bad_head_shapes_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="num_kv_heads"):
        HeadShape(num_heads=6, num_kv_heads=4, head_dim=8, head_dim_v=8)
    for field in ("num_heads", "num_kv_heads", "head_dim", "head_dim_v", "dtype_bytes"):
        kw = dict(num_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=8, dtype_bytes=2)
        kw[field] = 0
        with pytest.raises(ConfigError, match=field):
            HeadShape(**kw)
