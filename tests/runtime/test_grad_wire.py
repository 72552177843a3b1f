"""Partial gradients on the wire in the activation dtype (``grad_wire_dtype="activation"``, the
default; ``plan/costs.py`` ``GRAD_WIRES``) or in fp32: the plan's dq / dkv messages and slots take
that element size, the executor sends them so, and the sums it accumulates in fp32 still match the
float64 reference within the bf16 tolerance; bytes sent equal the plan's, per rank and phase.

On a GPU the kernels return dq, dk, dv in the activation dtype already (``runtime/kernels.py``),
so there the choice changes bytes, not values; on CPU the kernel's fp32 partials are rounded to
bf16 before they travel, which the bf16 tolerance covers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.costs import GRAD_WIRES, HeadShape
from megatron_hsap.plan.ir import Wire
from tests.runtime import cases

GQA = dict(heads=8, kv_heads=2, dim=8)
MLA = dict(heads=4, kv_heads=4, dim=12, dim_v=8)


def _check(gloo_pool, world: int, specs: list[dict]) -> None:
    results = gloo_pool(world).run(cases.run_cases, specs, timeout=900)
    for i, spec in enumerate(specs):
        per_rank = [r[i] for r in results]
        plan = cases.compile_for(spec)
        wire = spec.get("grad_wire") or "activation"
        assert plan.options.grad_wire_dtype == wire and plan.shape.fp32_grads == (wire == "fp32")
        plan.verify()
        cases.check_against_reference(spec, per_rank)
        cases.check_bytes(spec, per_rank)


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_sap_with_activation_dtype_gradients_matches_the_reference(gloo_pool, layout: str) -> None:
    rng = np.random.default_rng(7)
    total = 128
    specs = [
        cases.build_spec(cases.random_packing(total, rng), inter=4, dtype="bfloat16", seed=1, layout=layout,
                         grad_wire="activation", **GQA),
        cases.build_spec([0, total], inter=4, dtype="bfloat16", seed=2, layout=layout, grad_wire="activation", **MLA),
        # a small pool: slots of the halved gradient rows are reused
        cases.build_spec(cases.random_packing(total, rng), inter=4, dtype="bfloat16", seed=3, layout=layout,
                         pool_bytes=4096, grad_wire="activation", **GQA),
        # fp32 activations: the option changes nothing on the wire (4-byte elements either way)
        cases.build_spec([0, 40, total], inter=4, seed=4, layout=layout, grad_wire="activation", **GQA),
        # the fp32 wire, asked for: bf16 activations with fp32 partial gradients
        cases.build_spec(cases.random_packing(total, rng), inter=4, dtype="bfloat16", seed=6, layout=layout,
                         grad_wire="fp32", **GQA),
        cases.build_spec([0, total], inter=4, dtype="bfloat16", seed=8, layout=layout, grad_wire="fp32", **MLA),
    ]
    _check(gloo_pool, 4, specs)


def test_hsap_head_chunks_with_activation_dtype_gradients(gloo_pool) -> None:
    # 2 x 2 with two head chunks: each chunk's SAP sends its dq / dkv in bf16 (runtime/hsap.py)
    rng = np.random.default_rng(11)
    specs = [cases.build_spec(cases.random_packing(128, rng), intra=2, inter=2, dtype="bfloat16", seed=5,
                              grad_wire="activation", **GQA)]
    specs[0]["head_chunks"] = 2
    _check(gloo_pool, 4, specs)


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_gradient_messages_carry_activation_elements(dtype_bytes: int) -> None:
    # every backward result message: its rows × the wire's elements × the element size the option
    # names, read from the shape's row tensors (not from token_bytes)
    cu = [0, 300, 900, 1000, 2048]
    kw = dict(num_heads=8, num_kv_heads=2, head_dim=64, dtype_bytes=dtype_bytes, hardware="h100")
    for wire_dtype, elem in (("fp32", 4), ("activation", dtype_bytes)):
        plan = compile_plan(cu, 4, grad_wire_dtype=wire_dtype, **kw)
        results = [m for m in plan.chosen.bwd.messages if m.wire in GRAD_WIRES]
        assert results, "the batch must move some work (else nothing to check)"
        for m in results:
            rows = m.tokens.stop - m.tokens.start
            elements = sum(math.prod(r) for r in plan.shape.row_shapes(m.wire))
            assert m.nbytes == rows * elements * elem, (wire_dtype, m)
        for m in plan.chosen.bwd.messages:  # the other wires keep their formats
            if m.wire in (Wire.LSE, Wire.DELTA):
                assert m.nbytes == (m.tokens.stop - m.tokens.start) * plan.shape.num_heads * 4


def test_head_shape_gradient_formats() -> None:
    s = HeadShape(num_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=6, dtype_bytes=2)
    act = HeadShape(num_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=6, dtype_bytes=2, fp32_grads=False)
    assert (s.token_bytes(Wire.DQ), act.token_bytes(Wire.DQ)) == (4 * 8 * 4, 4 * 8 * 2)
    assert (s.token_bytes(Wire.DKV), act.token_bytes(Wire.DKV)) == (2 * (8 + 6) * 4, 2 * (8 + 6) * 2)
    for w in (Wire.Q, Wire.KV, Wire.O, Wire.DO, Wire.LSE, Wire.DELTA):
        assert s.token_bytes(w) == act.token_bytes(w)
    assert act.fp32_wire(Wire.LSE) and not act.fp32_wire(Wire.DQ) and s.fp32_wire(Wire.DKV)
    with pytest.raises(ConfigError, match="fp32_grads"):
        HeadShape(num_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=6, fp32_grads=1)


def test_unknown_gradient_wire_dtype_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="grad_wire_dtype='bf16' is unknown.*'fp32', 'activation'"):
        compile_plan([0, 64], 2, grad_wire_dtype="bf16")


def test_the_default_wire_is_left_out_of_the_hash() -> None:
    # the default ("activation") is left out of the plan hash, so plans it does not change (fp32
    # activations) keep the hashes they had when fp32 was the default; the other value names a
    # different plan
    from megatron_hsap.plan.fingerprint import plan_hash

    cu = [0, 500, 2048]
    a = compile_plan(cu, 4, hardware="h100")
    b = compile_plan(cu, 4, hardware="h100", grad_wire_dtype="fp32")
    c = compile_plan(cu, 4, hardware="h100", grad_wire_dtype="activation")
    assert plan_hash(a) == plan_hash(c) != plan_hash(b)
    assert not a.shape.fp32_grads and b.shape.fp32_grads


def test_the_balanced_layout_does_not_depend_on_the_gradient_wire() -> None:
    # the layout's kv price stays the fp32 one (plan.py): priced with the halved gradient rows it
    # split more documents, and its plans were estimated up to 13% slower (Table 4 slimpajama 32K
    # 1x8 s2, 2.46 against 2.16 ms)
    from megatron_hsap.plan.workloads import pack_batches

    cu = [int(x) for x in pack_batches("slimpajama", 32768, 1, 2)[0]]
    kw = dict(num_heads=32, num_kv_heads=32, head_dim=128, hardware="a100", layout="balanced", layout_fallback=False)
    fp32 = compile_plan(cu, 8, **kw)
    act = compile_plan(cu, 8, grad_wire_dtype="activation", **kw)
    assert act.layout.segments == fp32.layout.segments
    assert act.chosen.time <= fp32.chosen.time  # the same layout, cheaper gradient returns
