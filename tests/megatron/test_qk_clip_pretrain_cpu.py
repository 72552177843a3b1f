"""qk-clip (``--qk-clip``, MuonClip's weight clipping) in Megatron's own ``pretrain()`` loop under
HSAP (``runtime/max_logits.py``; megatron-core's ``optimizer/qk_clip.py``).

After each optimizer step megatron-core all-reduces every attention layer's
``core_attention.current_max_attn_logits`` with MAX over DP×CP, returns the largest, and scales the
q and k rows of the heads whose maximum passed the threshold. HSAP's ranks each hold the maxima of
the pairs they computed on their head slice (``-inf`` elsewhere), so the CP 2×2 job (all-to-all and
SAP) must see the CP=1 job's maxima (recorded per step: ``cpu/record.py``), clip alike and train
alike. The clipping must act: after the first step the maxima drop to about the threshold, while
the same job logging them without clipping (``--log-max-attention-logit``) keeps them at or above
the first step's. (The losses alone would not show it: at this size the clipping moves them by ~2e-5.) bf16: megatron-core's ``clip_qk`` walks ``model.module.module`` (DDP around
Float16Module). Slow (real runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.megatron.test_pretrain_cpu import BASE, _run, root  # noqa: F401
from tests.megatron.test_pretrain_cpu_mla import MLA
from tests.megatron.test_pretrain_cpu_precision import HALF_RTOL

pytestmark = pytest.mark.timeout(1800)

THRESHOLD = 0.01
QK_CLIP = ("--bf16", "--qk-clip", "--qk-clip-threshold", str(THRESHOLD), "--qk-clip-alpha", "0.5")
LOG_ONLY = ("--bf16", "--log-max-attention-logit")


def _close(got: dict[int, float], want: dict[int, float], rtol: float) -> None:
    assert sorted(got) == sorted(want) and got, (got, want)
    for step in want:
        assert abs(got[step] - want[step]) <= rtol * abs(want[step]), (step, got[step], want[step])


def _maxima(result) -> list[list[float]]:
    """Per rank, the largest attention logit ``clip_qk`` returned after each step."""
    record = Path(result.log_dir) / "record"
    return [[json.loads(line)["max_attention_logit"] for line in path.read_text().splitlines()]
            for path in sorted(record.glob("qk-rank*.jsonl"))]


@pytest.mark.slow
def test_qk_clip_in_megatrons_loop_equals_cp1(root) -> None:  # noqa: F811
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, **BASE, extra=("--hsap-flatten", "never", *QK_CLIP))
    cp1 = _run(root, world_size=1, intra_size=1, inter_size=1, **BASE, extra=QK_CLIP)
    _close(hsap.losses, cp1.losses, HALF_RTOL["bf16"])
    _close(hsap.validation, cp1.validation, HALF_RTOL["bf16"])
    ranks, (want,) = _maxima(hsap), _maxima(cp1)
    assert len(ranks) == 4 and len(want) == BASE["steps"], (ranks, want)
    for got in ranks:  # every rank returns the MAX over the CP group: the CP=1 job's value
        _close(dict(enumerate(got)), dict(enumerate(want)), 1e-2)
    logged = _maxima(_run(root, world_size=4, intra_size=2, inter_size=2, **BASE, extra=("--hsap-flatten", "never", *LOG_ONLY)))[0]
    assert abs(logged[0] - want[0]) <= 1e-2 * abs(want[0]), (logged, want)  # the same first step
    # the first step's maxima (0.119 when written) were clipped to the threshold: the next step's
    # are about it (0.011), later ones far under the unclipped run's (0.125, 0.226, 0.319; clipped
    # 0.011, 0.055, 0.018)
    assert want[0] > 10 * THRESHOLD and want[1] < 2 * THRESHOLD, (want, logged)
    assert all(x > 0.5 * logged[0] for x in logged) and sum(want[1:]) < 0.5 * sum(logged[1:]), (want, logged)


@pytest.mark.slow
def test_qk_clip_of_multi_latent_attention_equals_cp1(root) -> None:  # noqa: F811
    """MLA's own ``clip_qk`` (q's no-RoPE and RoPE heads, kv's up-projection; d_qk 24 ≠ d_v 12):
    the CP 2×2 job's maxima and losses are the CP=1 job's, and it clips."""
    low = 0.0005  # MLA's logits start smaller here (~0.011 when written)
    extra = (*MLA, "--rope-type", "rope", "--bf16", "--qk-clip", "--qk-clip-threshold", str(low), "--qk-clip-alpha", "0.5")
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, **BASE, extra=("--hsap-flatten", "never", *extra))
    cp1 = _run(root, world_size=1, intra_size=1, inter_size=1, **BASE, extra=extra)
    _close(hsap.losses, cp1.losses, HALF_RTOL["bf16"])
    want = _maxima(cp1)[0]
    for got in _maxima(hsap):
        _close(dict(enumerate(got)), dict(enumerate(want)), 1e-2)
    assert want[0] > 10 * low and want[1] < 2 * low, want
