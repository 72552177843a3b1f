"""Attention sinks in Megatron's own ``pretrain()`` loop (``megatron-hsap pretrain-cpu ... --
--softmax-type learnable``): HSAP 1×2 against the CP=1 reference run, whose core attention is
megatron-core's local ``DotProductAttention`` with its own ``SoftmaxOne`` sink column and its own
``softmax_offset`` parameter — code nobody here wrote. Same harness and tolerance as
test_pretrain_cpu (1e-5 relative: fp32, only sums reordered); slow (two real training runs).
"""

from __future__ import annotations

import pytest

from tests.megatron.test_pretrain_cpu import BASE, _params, _reference, _run, _same_losses, root  # noqa: F401

pytestmark = pytest.mark.timeout(1800)


@pytest.mark.slow
@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
def test_sinks_in_megatrons_loop_equal_cp1_local_attention(root, softmax_type: str) -> None:  # noqa: F811
    extra = ("--softmax-type", softmax_type)
    hsap = _run(root, world_size=2, intra_size=1, inter_size=2, **BASE, extra=extra)
    ref = _reference(root, extra=extra)
    params = _params(hsap)
    assert params == _params(ref)  # Megatron's parameter names and shapes, softmax_offset included
    assert any(name.endswith("softmax_offset") for name in params) == (softmax_type == "learnable"), sorted(params)
    _same_losses(hsap.losses, ref.losses)
