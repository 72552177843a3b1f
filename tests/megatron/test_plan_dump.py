"""``--hsap-dump-plan ITER DIR`` in the training loop (``pretrain_hooks._observe``): the plan is
written once, at iteration ITER, and a folder that cannot be written is a warning, not a crash of
rank 0 (which would leave every other rank waiting in its next collective)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_hsap.megatron.pretrain_hooks import _observe
from megatron_hsap.plan import compile_plan


def _args(out: Path, iteration: int) -> SimpleNamespace:
    # Megatron's curr_iteration counts finished iterations: iteration + 1 is the one running
    return SimpleNamespace(curr_iteration=iteration, hsap_metrics=False, hsap_dump_plan=["2", str(out)])


def test_the_dump_is_written_once_at_its_iteration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = compile_plan([0, 300, 1024], 2, 2, num_heads=8, num_kv_heads=4)
    out = tmp_path / "dump"
    args = _args(out, 0)
    _observe(args, plan, compile_s=0.0, prefetched=None, plan_kwargs={})
    assert not out.exists()  # iteration 1
    args.curr_iteration = 1
    _observe(args, plan, compile_s=0.0, prefetched=None, plan_kwargs={"layout": "balanced"})
    assert json.loads((out / "plan.json").read_text())["iteration"] == 2
    assert sorted(p.name for p in out.glob("rank*.txt")) == sorted(f"rank{r}-{ph}.txt" for r in range(plan.inter_size)
                                                                     for ph in ("fwd", "bwd"))
    assert f"wrote the plan of iteration 2 to {out}" in capsys.readouterr().out
    (out / "plan.json").unlink()
    _observe(args, plan, compile_s=0.0, prefetched=None, plan_kwargs={})  # (a second micro-batch of iteration 2)
    assert not (out / "plan.json").exists()


def test_a_folder_that_cannot_be_written_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = compile_plan([0, 300, 1024], 2, 2, num_heads=8, num_kv_heads=4)
    blocked = tmp_path / "a-file"
    blocked.write_text("x")  # where the folder's parent should be
    _observe(_args(blocked / "dump", 1), plan, compile_s=0.0, prefetched=None, plan_kwargs={})
    err = capsys.readouterr().err
    assert f"--hsap-dump-plan: could not write the plan of iteration 2 to {blocked / 'dump'}" in err
    assert "training goes on" in err
