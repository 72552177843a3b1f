"""``megatron-hsap train-tiny``: argument refusals (fast) and a short real run (slow)."""

from __future__ import annotations

import pytest

from megatron_hsap.megatron.train_tiny import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--context-parallel-impl", "ring"], "megatron-hsap pretrain-cpu --reference"),
        (["--world-size", "6", "--intra-size", "2", "--inter-size", "2"], "multiple"),
        (["--steps", "0"], "--steps"),
        (["--intra-size", "4", "--inter-size", "1", "--num-query-groups", "3", "--num-attention-heads", "6",
          "--hidden-size", "48"], "--num-attention-heads 6 is not divisible by --intra-size 4"),
    ],
)
def test_refuses_what_it_cannot_run(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # an argparse error
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_short_run_with_data_parallel_matches_cp1(tmp_path, capfd: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    # 4 ranks = DP 2 × CP 1x2; the command itself compares every step with the CP=1 run.
    argv = ["--world-size", "4", "--intra-size", "1", "--inter-size", "2", "--steps", "3", "--seq-length", "96",
            "--micro-batch-size", "1", "--no-progress", "--data-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capfd.readouterr().out  # fd-level: the per-step lines come from the spawned rank 0
    assert "DP 2 × CP 1x2" in out and "(OK," in out
    assert "plans priced with link nvlink: the CP group TP 1 × P_intra 1 × P_inter 2 = 2 GPUs" in out
    assert out.count("[1x2] step") == 3 and out.count("[1x1] step") == 3


@pytest.mark.slow
@pytest.mark.parametrize(("flatten", "prefix"), [("auto", "[2x2 as 1x4] step"), ("never", "[2x2] step")])
def test_2x2_run_flattened_or_not_matches_cp1(tmp_path, capfd: pytest.CaptureFixture[str], flatten: str, prefix: str) -> None:  # noqa: ANN001
    # the default flattens these small packed batches to pure SAP over the 4 ranks (plan/flatten.py);
    # --flatten never keeps the 2x2 all-to-all; either way every step matches the CP=1 run
    argv = ["--world-size", "4", "--intra-size", "2", "--inter-size", "2", "--steps", "2", "--seq-length", "256",
            "--micro-batch-size", "2", "--no-progress", "--data-dir", str(tmp_path), "--flatten", flatten]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "(OK," in out and out.count(prefix) == 2, out[-2000:]
