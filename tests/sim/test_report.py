"""README regions generated from the committed results/*.csv, and the region rewriter."""

from __future__ import annotations

from pathlib import Path

from megatron_hsap.sim.report import REGIONS, update_readme

ROOT = Path(__file__).resolve().parents[2]


def test_readme_regions_match_committed_csvs() -> None:
    """Fails when README tables are stale: run `megatron-hsap report` after regenerating results/."""
    text = (ROOT / "README.md").read_text()
    for name in REGIONS:
        assert f"<!-- report:{name} -->" in text, f"README lacks the {name} region"
    assert update_readme(text, ROOT / "results") == text


def test_only_region_bodies_change(tmp_path: Path) -> None:
    (tmp_path / "calibrate.csv").write_text(
        "source,workload,T,P_intra,P_inter,link,heads,seed,method,metric,value,unit\n"
        "sim,magiattention,65536,1,8,nvlink,64/8,mean,ulysses,fwd_tflops_per_gpu,300,TFLOP/s\n"
        "paper:magiattention,magiattention,65536,1,8,nvlink,64/8,-,ulysses,fwd_tflops_per_gpu,250,TFLOP/s\n")
    text = ("before\n<!-- report:calibration -->\nold body\n<!-- /report -->\nmiddle\n"
            "<!-- report:unknown_region -->\nkept\n<!-- /report -->\nafter\n")
    new = update_readme(text, tmp_path)
    assert new.startswith("before\n<!-- report:calibration -->\n") and new.endswith(
        "middle\n<!-- report:unknown_region -->\nkept\n<!-- /report -->\nafter\n")
    assert "old body" not in new and "| 8 | ulysses | fwd | 250 | 300 | +20% | yes |" in new
    assert update_readme(new, tmp_path) == new  # idempotent
    # a missing CSV says how to make it instead of failing
    assert "megatron-hsap simulate magi" in update_readme("<!-- report:magi -->\n<!-- /report -->\n", tmp_path)
