"""Megatron's expert-parallel all-to-all overlap (``--overlap-moe-expert-parallel-comm``, DeepSeek-V3's
combined 1F1B: the forward of micro-batch k+1 interleaved, layer part by layer part, with the
backward of micro-batch k) over HSAP's attention, in Megatron's own ``pretrain()`` loop.

Megatron's schedule asks the forward step for a schedule plan (``model.build_schedule_plan``)
instead of running the model; HSAP's forward step builds it with its batch in
``packed_seq_params``, so every attention part of the plan runs HSAP's (one micro-batch's attention
forward alternates with the previous one's backward; each waits its own plan's rounds). The
overlap changes the order of work, not its values: with 3 micro-batches per step (EP 2 inside CP 2×2, all-to-all dispatcher, bf16 as
Megatron requires) the losses equal the same run without the overlap, whose own equality with
the reference is ``test_pretrain_cpu.py``'s (EP 2, both dispatchers). On CPU the stand-in stream
is a ``torch.Stream`` so the schedule's ``Tensor.record_stream`` calls reach the device redirect
(``megatron/cpu/device.py``). Slow.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.megatron.test_pretrain_cpu import BASE, _run, _same_losses, root  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MOE = ("--bf16", "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--moe-token-dispatcher-type", "alltoall", "--global-batch-size", "6")


def test_expert_a2a_overlap_equals_the_same_run_without_it(root: Path) -> None:  # noqa: F811
    overlap = _run(root, world_size=4, intra_size=2, inter_size=2, extra=(*MOE, "--overlap-moe-expert-parallel-comm"), **BASE)
    plain = _run(root, world_size=4, intra_size=2, inter_size=2, extra=MOE, **BASE)
    _same_losses(overlap.losses, plain.losses)
    _same_losses(overlap.validation, plain.validation)
    log = (Path(overlap.log_dir) / "rank0.log").read_text()
    assert re.search(r"^  overlap_moe_expert_parallel_comm \.+ True$", log, re.M)
    assert "| micro-batches 3 |" in overlap.output or "| micro-batches 3 |" in log
