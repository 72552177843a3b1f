"""Megatron's own ``pretrain()`` loop on CPU with a full / sliding-window layer pattern
(``--window-size (32,0) --window-attn-skip-freq 2``: layer 1 windowed, layer 2 full).

megatron-core's local ``DotProductAttention`` cannot be the reference here: with ``window_size``
set it replaces the dataloader's per-document mask by a plain sliding-window mask
(``megatron/core/fusions/fused_softmax.py``, ``forward_torch_softmax``). So the loop under HSAP CP
1×2 is compared with the same loop at CP=1 (HSAP's attention on one rank: no sharding, no P2P);
that the CP=1 attention equals an independent float64 windowed reference is shown by
``tests/megatron/test_gpt_window.py`` and ``tests/runtime/test_window.py``. A run without the
window must differ, so the flags are seen to reach the attention.
"""

from __future__ import annotations

import math

import pytest

from megatron_hsap.megatron.cpu.command import CPURun, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

RTOL = 1e-5  # fp32; HSAP only reorders sums across CP ranks (see test_pretrain_cpu.py)
WINDOW = ("--window-size", "(32,0)", "--window-attn-skip-freq", "2")
BASE = dict(steps=3, eval_interval=3, eval_iters=1)


def _losses(tmp_path, name, **kwargs):
    result = run(CPURun(log_dir=str(tmp_path / name), **BASE, **kwargs))
    assert result.returncode == 0, result.output[-6000:]
    assert result.losses and all(math.isfinite(v) for v in result.losses.values())
    return result.losses


def test_windowed_layers_in_megatrons_loop_equal_cp1(tmp_path):
    cp2 = _losses(tmp_path, "cp2", world_size=2, intra_size=1, inter_size=2, extra=WINDOW)
    cp1 = _losses(tmp_path, "cp1", world_size=1, intra_size=1, inter_size=1, extra=WINDOW)
    full = _losses(tmp_path, "full", world_size=2, intra_size=1, inter_size=2)
    assert sorted(cp2) == sorted(cp1) == sorted(full)
    for step in cp1:
        assert abs(cp2[step] - cp1[step]) <= RTOL * abs(cp1[step]), (step, cp2, cp1)
    assert max(abs(full[s] - cp1[s]) / abs(cp1[s]) for s in cp1) > 10 * RTOL, "the window must change the losses"
