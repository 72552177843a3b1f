"""A checkpoint moves between CP topologies (Megatron's own ``pretrain()`` loop, ``torch_dist``):
saved under HSAP 2×2 at step 2, resumed under HSAP 1×4, 4×1 or at CP=1
with megatron-core's local attention, steps 3–4 compute the losses of the uninterrupted 2×2 run
— what a user does when a run moves to more or fewer GPUs per sequence. HSAP keeps no state of
its own between steps (plans are compiled per batch), so only Megatron's state moves: parameters,
optimizer state, the data iterator's position and the RNG states.

Compared per step: each rank's ``Σ loss·mask`` of its micro-batch share, summed over the CP ranks
(the micro-batch's whole loss sum, whatever the layout; fp32, only sums reordered). Slow."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.megatron.test_pretrain_cpu import BASE, RTOL, _reference, _run, _train_sums, root  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# Megatron's DDP with its plain optimizer: megatron-core 0.19.2's distributed optimizer cannot load a
# checkpoint without Apex or Transformer Engine (``DistributedOptimizer.state_dict`` asserts one
# Adam ``step`` over a state not created yet: the CP=1 reference alone fails the same way on CPU)
SAVE = ("--ckpt-format", "torch_dist")


def _step_sums(result, ranks: int) -> list[float]:
    per_rank = [_train_sums(result, r) for r in range(ranks)]
    assert len({len(s) for s in per_rank}) == 1, per_rank
    return [sum(step) for step in zip(*per_rank)]


@pytest.fixture(scope="module")
def saved(root: Path) -> tuple[str, list[float]]:  # noqa: F811
    """The 2×2 run saved at step 2 (and stopped), and the uninterrupted 2×2 run's per-step sums."""
    full = _run(root, world_size=4, intra_size=2, inter_size=2, **BASE, extra=SAVE)
    ckpt = str(root / "ckpt-2x2")
    first = _run(root, world_size=4, intra_size=2, inter_size=2, **BASE,
                 extra=(*SAVE, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2"))
    assert sorted(first.losses) == [1, 2]
    assert (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    want = _step_sums(full, 4)
    assert _step_sums(first, 4) == pytest.approx(want[:2], rel=RTOL)
    return ckpt, want


@pytest.mark.parametrize("topology", ["1x4", "4x1", "cp1"])
def test_a_2x2_checkpoint_resumes_under_another_topology(root: Path, tmp_path: Path, saved, topology: str) -> None:  # noqa: F811
    ckpt, want = saved
    # each resume loads a copy (a resumed run saves its own checkpoint into its --save directory)
    mine = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, mine)
    extra = (*SAVE, "--load", mine, "--save", mine, "--save-interval", "100")
    if topology == "cp1":
        resumed = _reference(root, extra=extra)
        ranks = 1
    else:
        intra, inter = map(int, topology.split("x"))
        resumed = _run(root, world_size=4, intra_size=intra, inter_size=inter, **BASE, extra=extra)
        ranks = 4
    assert sorted(resumed.losses) == [3, 4], resumed.losses
    assert _step_sums(resumed, ranks) == pytest.approx(want[2:], rel=RTOL), topology
