"""The plan-quality benchmark and the ``megatron-hsap plan`` command: a smoke run of each, checking
what they write (CSV columns and rows, markdown table, PNGs, JSON) against the planner itself."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from megatron_hsap.bench import plan_cli, plan_quality
from megatron_hsap.plan import compile_plan


def test_quick_run_writes_csv_table_and_plots(tmp_path: Path, capsys) -> None:
    code = plan_quality.main(["--quick", "--workloads", "fineweb", "full", "--tokens", "16384", "--inter-size", "4",
                              "--heads", "gqa", "--seeds", "2", "--jobs", "1", "--out", str(tmp_path),
                              "--no-compile-times"])
    assert code == 0
    rows = list(csv.DictReader((tmp_path / "plan_quality.csv").open()))
    assert rows and tuple(rows[0]) == plan_quality.COLUMNS
    hsap = [r for r in rows if r["method"] == "hsap"]
    assert {r["workload"] for r in hsap} == {"fineweb", "full"}
    assert {r["seed"] for r in hsap if r["workload"] == "fineweb"} == {"0", "1"}
    assert {r["seed"] for r in hsap if r["workload"] == "full"} == {"0"}  # one deterministic batch
    assert {r["link"] for r in rows} == {"nvlink"} and {r["heads"] for r in rows} == {"32/8"}
    metrics = {r["metric"] for r in hsap}
    assert {"imbalance", "bytes", "bytes_over_necessary", "estimated_time", "efficiency", "compute_efficiency",
            "pool_use", "best_baseline_over_hsap"} <= metrics
    methods = {r["method"] for r in rows}
    assert {"te_thd_ring", "allgather_kv", "ulysses", "distflashattn"} <= methods
    # the CSV's figures are the planner's own
    eff = next(float(r["value"]) for r in hsap if r["workload"] == "full" and r["metric"] == "efficiency")
    plan = compile_plan([0, 16384], 4, num_heads=32, num_kv_heads=8, head_dim=128, layout="contiguous",
                        flatten="never")  # the benchmark measures SAP alone, on the layout it names
    assert eff == pytest.approx(plan.stats().efficiency, rel=1e-12)
    for r in hsap:
        if r["metric"] == "efficiency":
            assert 0.0 < float(r["value"]) <= 1.0 + 1e-9
    table = (tmp_path / "plan_quality.md").read_text()
    assert "| fineweb | 16K | 4 | nvlink | 32/8 |" in table and "| full | 16K | 4 | nvlink | 32/8 |" in table
    assert table in capsys.readouterr().out
    for name in ("plan_quality_efficiency.png", "plan_quality_speedup.png", "plan_quality_imbalance.png"):
        assert (tmp_path / name).stat().st_size > 1000
    # the side-by-side layout table: balanced figures are the forced balanced plan's own, and what
    # layout="balanced" keeps is what compile_plan's default ships (the faster estimate, but for the
    # owner-computes margin: a plan moving work must beat the other layout's owner-computes by 0.1%)
    assert "### Layouts: contiguous (paper) vs balanced" in table and "| fineweb | 16K | 4 | nvlink | 32/8 |" in table
    value = {(r["workload"], r["seed"], r["method"], r["metric"]): float(r["value"]) for r in rows}
    from megatron_hsap.plan.workloads import pack_batches

    cu = pack_batches("fineweb", 16384, 2, 0)[1]
    forced = compile_plan(cu, 4, num_heads=32, num_kv_heads=8, head_dim=128, layout="balanced", layout_fallback=False)
    assert value[("fineweb", "1", "hsap-balanced", "estimated_time")] == pytest.approx(forced.stats().estimated_time_s, rel=1e-12)
    assert value[("fineweb", "1", "hsap-balanced", "owner_imbalance")] == pytest.approx(forced.stats().owner_imbalance, rel=1e-12)
    from megatron_hsap.plan.plan import _LAYOUT_OWNER_MARGIN

    for seed in ("0", "1"):
        both = (value[("fineweb", seed, "hsap", "estimated_time")], value[("fineweb", seed, "hsap-balanced", "estimated_time")])
        shipped = compile_plan(pack_batches("fineweb", 16384, 2, 0)[int(seed)], 4, num_heads=32, num_kv_heads=8,
                               head_dim=128, flatten="never")
        assert value[("fineweb", seed, "hsap-kept", "estimated_time")] == shipped.stats().estimated_time_s
        assert value[("fineweb", seed, "hsap-kept", "estimated_time")] in both
        assert value[("fineweb", seed, "hsap-kept", "kept_over_contiguous")] <= 1.0 + _LAYOUT_OWNER_MARGIN


def test_grid_follows_design_link_rule() -> None:
    pts = plan_quality.grid(False, 10, 5, ["fineweb", "full"], [1 << 20], [8, 16, 64], ["mha"])
    assert {p.link for p in pts if p.P <= 8} == {"nvlink"} and {p.link for p in pts if p.P > 8} == {"ib"}
    assert all(len(p.seeds) == (1 if p.workload == "full" else 5 if p.P == 64 else 10) for p in pts)
    # forced InfiniBand at every P (HSAP's inter group spans nodes); forced NVLink only inside a node
    both = plan_quality.grid(False, 2, 2, ["fineweb"], [1 << 16], [8, 16], ["gqa"], ("auto", "ib", "nvlink"))
    assert sorted((p.P, p.link) for p in both) == [(8, "ib"), (8, "nvlink"), (16, "ib")]


def test_plan_cli_sample(capsys) -> None:
    assert plan_cli.main(["--sample", "--max-lines", "0"]) == 0
    out = capsys.readouterr().out
    for token in ("batch: T=32768", "create $send-op", "create $recv-op", "compute stage", "imbalance", "verified in"):
        assert token in out, token
    assert "--max-lines" not in out  # the whole program printed


def test_plan_cli_json_and_plot(tmp_path: Path, capsys) -> None:
    png = tmp_path / "fig3.png"
    assert plan_cli.main(["--cu-seqlens", "0,3000,9000,16384", "--inter-size", "4", "--kv-heads", "8", "--rank", "2",
                          "--phase", "bwd", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rank"] == 2 and out["phase"] == "bwd" and out["verification"].startswith("verified")
    assert out["stats"]["inter_size"] == 4 and "inter rank 2/4, bwd" in out["program"]
    assert png.stat().st_size > 1000


def test_plan_cli_bad_batch_names_the_problem(capsys) -> None:
    assert plan_cli.main(["--cu-seqlens", "0,10,5", "--inter-size", "2"]) == 1
    assert "non-decreasing" in capsys.readouterr().err


def test_sample_is_figure3_like() -> None:
    cu = plan_cli.sample_cu_seqlens(64)
    plan = compile_plan(cu, 8, num_heads=4, head_dim=8, layout="contiguous")  # the paper's Figure 3 layout
    spans = {}
    for u in plan.work_units:
        spans.setdefault(u.doc, set()).update((u.q_owner, u.kv_owner))
    assert len(cu) - 1 == 6
    assert spans[0] == {0, 1, 2, 3} and spans[1] == {3, 4, 5}


def test_compile_times_only_writes_its_own_files_and_the_readme_region(tmp_path: Path, monkeypatch) -> None:
    """``--compile-times-only`` writes ``compile_times.csv`` / ``.md`` (never a grid's
    ``plan_quality.*``, which its default ``--out results`` would have overwritten), and the
    README region renders that CSV with each budget's verdict from the measured median."""
    from megatron_hsap.sim.report import render

    rows = []
    for (T, P), med in zip(plan_quality.COMPILE_BUDGETS, (0.0404, 0.257)):
        base = (plan_quality.SOURCE + "_compile", "fineweb", T, 1, P, "nvlink", "32/8", -1, "hsap-kept")
        rows += [base + (m, v, "s") for m, v in (("compile_time_median", med), ("compile_time_single_median", 1.5 * med),
                                                 ("compile_time_max", 2 * med),
                                                 ("compile_cpu_time_median", med), ("cache_hit_time_median", 1e-5))]
    monkeypatch.setattr(plan_quality, "compile_times", lambda *a, **k: rows)
    (tmp_path / "plan_quality.md").write_text("a grid's table\n")
    assert plan_quality.main(["--compile-times-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "plan_quality.md").read_text() == "a grid's table\n" and not (tmp_path / "plan_quality.csv").exists()
    got = list(csv.DictReader((tmp_path / "compile_times.csv").open()))
    assert len(got) == len(rows) and tuple(got[0]) == plan_quality.COLUMNS
    table = render("compile_times", tmp_path)
    assert table + "\n" == (tmp_path / "compile_times.md").read_text()
    assert "| 64K | 8 | 40.4 | 60.6 / 80.8 | 40.4 | 0.010 | 20 (MISSED) |" in table
    assert "| 1M | 64 | 257.0 | 385.5 / 514.0 | 257.0 | 0.010 | 200 (MISSED) |" in table


@pytest.mark.parametrize(("flatten", "topology"), [("all-to-all", "8x1"), ("always", "1x8")])
def test_plan_cli_names_a_flattened_plan(capsys, flatten, topology) -> None:
    assert plan_cli.main(["--sample", "--intra-size", "2", "--inter-size", "4", "--flatten", flatten, "--max-lines", "1"]) == 0
    head = capsys.readouterr().out.splitlines()
    line = next(x for x in head if x.startswith("batch:"))
    assert f"topology {topology} (intra×inter, flattened from 2x4: plan/flatten.py)" in line
    assert plan_cli.main(["--sample", "--intra-size", "2", "--inter-size", "4", "--flatten", "never", "--max-lines", "1"]) == 0
    assert "topology 2x4 (intra×inter), chunk" in capsys.readouterr().out


def test_quick_narrows_only_what_was_not_given() -> None:
    # --quick's small grid: fineweb + full, T ≤ 64K, P 4 and 16, 2 seeds — an option given wins
    pts = plan_quality.grid(True, 10, 5, plan_quality.WORKLOADS, plan_quality.TOKENS, plan_quality.INTER, ["gqa"])
    assert {p.workload for p in pts} == {"fineweb", "full"} and {p.T for p in pts} == {16384, 65536}
    assert {p.P for p in pts} == {4, 16} and max(len(p.seeds) for p in pts) == 2
    given = plan_quality.grid(True, 5, 5, ["slimpajama"], [16384, 262144], [8], ["gqa"],
                              keep={"seeds", "workloads", "tokens", "inter_size"})
    assert [(p.workload, p.T, p.P, len(p.seeds)) for p in given] == [("slimpajama", 16384, 8, 5), ("slimpajama", 262144, 8, 5)]


@pytest.mark.parametrize(("argv", "says"), [
    (["--compile-times-only", "--tokens", "1024"], "--compile-times-only measures its own points (64K/P 8, 1024K/P 64); "
                                                   "it does not read --tokens"),
    (["--compile-times-only", "--inter", "4", "--jobs", "1"], "it does not read --inter-size, --jobs"),
    (["--tokens", "4", "--inter-size", "8"], "no grid point: every --inter-size [8] is above every --tokens [4]"),
    (["--links", "nvlink", "--inter-size", "16"], "no grid point: --links nvlink needs a P_inter ≤ 8"),
])
def test_plan_quality_refuses_options_it_would_ignore_and_empty_grids(argv, says, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(plan_quality, "compile_times", lambda *a, **k: pytest.fail("measured before refusing"))
    with pytest.raises(SystemExit) as info:
        plan_quality.main([*argv, "--out", str(tmp_path)])
    assert info.value.code == 2 and says in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
