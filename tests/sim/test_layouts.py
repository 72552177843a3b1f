"""``simulate layouts``: contiguous vs balanced token layout over InfiniBand (issue 8)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsap.plan.plan import compile_plan
from megatron_hsap.plan.workloads import pack_batches
from megatron_hsap.sim.layouts import compare_layouts, ib_hardware, layouts
from megatron_hsap.sim.results import read_csv

QUICK_POINTS = [("fineweb", 8), ("fineweb", 16), ("full", 8), ("full", 16)]  # a100, 64K, seed 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory):  # noqa: ANN201
    out = tmp_path_factory.mktemp("layouts")
    report = layouts(out, quick=True)
    return report, read_csv(out / "layouts.csv")


def _value(rows: list[dict[str, str]], wl: str, P: int, method: str, metric: str) -> str:
    hits = [r["value"] for r in rows if (r["workload"], int(r["P_inter"]), r["method"], r["metric"]) == (wl, P, method, metric)]
    assert len(hits) == 1, (wl, P, method, metric, hits)
    return hits[0]


def test_quick_run_columns_and_rows(quick) -> None:
    report, rows = quick
    for col in ("contig. owner imb.", "contig. plan imb.", "balanced plan imb.", "contig. ms", "balanced ms",
                "balanced / contig.", "estimate B / C", "kept / contig.", "target ≤ 0.8×"):
        assert f"| {col} |" in report.markdown, col
    assert "**Target**" in report.markdown and "points" in report.markdown
    assert {r["link"] for r in rows} == {"ib-a100"} and {r["source"] for r in rows} == {"sim"}
    for wl, P in QUICK_POINTS:
        for method in ("hsap-contiguous", "hsap-balanced"):
            for metric in ("time", "fwd_time", "bwd_time", "owner_imbalance", "plan_imbalance", "planner_estimate"):
                assert float(_value(rows, wl, P, method, metric)) > 0
        c, b = (float(_value(rows, wl, P, m, "time")) for m in ("hsap-contiguous", "hsap-balanced"))
        ratio = float(_value(rows, wl, P, "hsap-balanced", "balanced_over_contiguous"))
        assert ratio == pytest.approx(b / c, rel=1e-9)  # the CSV rounds nothing; only float formatting
        kept = float(_value(rows, wl, P, "hsap-kept", "kept_over_contiguous"))
        assert kept in (pytest.approx(1.0), pytest.approx(ratio))


@pytest.mark.parametrize("wl,P", QUICK_POINTS)
def test_kept_is_what_compile_plan_ships(quick, wl: str, P: int) -> None:
    """The derived "kept" plan is the one ``compile_plan(layout="balanced")`` (with its fallback)
    returns, compiled here directly, and its time is that plan's simulated time."""
    _, rows = quick
    cu = pack_batches(wl, 65536, 1, 0)[0]
    shipped = compile_plan(cu, P, num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, hardware="a100",
                           link="ib", gpus_per_node=1, layout="balanced").stats()
    assert _value(rows, wl, P, "hsap-kept", "kept_layout") == shipped.layout
    est = float(_value(rows, wl, P, f"hsap-{shipped.layout}", "planner_estimate"))
    assert est == pytest.approx(shipped.estimated_time_s * 1e3, rel=1e-12)  # same plan, same estimate
    kept = float(_value(rows, wl, P, "hsap-kept", "kept_over_contiguous"))
    own = float(_value(rows, wl, P, f"hsap-{shipped.layout}", "time")) / float(_value(rows, wl, P, "hsap-contiguous", "time"))
    assert kept == pytest.approx(own, rel=1e-12)


def _owner_imbalance(cu: np.ndarray, tokens_per_rank: list[np.ndarray]) -> float:
    """Independent reference: a token's owner-computes work is its position in its document + 1
    (its q row against itself and every earlier key of the document)."""
    T = int(cu[-1])
    ids = np.arange(T)
    doc = np.searchsorted(cu, ids, side="right") - 1
    work = ids - cu[doc] + 1
    per_rank = np.array([work[t[t < T]].sum() for t in tokens_per_rank], dtype=np.float64)
    return float(per_rank.max() / per_rank.mean())


def test_one_long_document_balanced_layout_wins_over_ib() -> None:
    """A 32K-token document followed by 128 documents of 256 at P_inter 8 over InfiniBand: the
    contiguous layout leaves the document's last chunk ~3.4× the mean work, and moving that work
    over IB costs more than it saves at 8K tokens per rank; the balanced layout splits the
    document head–tail and wins in simulation."""
    cu = np.concatenate([[0, 32768], 32768 + 256 * np.arange(1, 129)]).astype(np.int64)
    hw = ib_hardware("a100")
    pair = compare_layouts(cu, hw=hw, inter=8)
    c, b = pair.contiguous, pair.balanced
    assert not c.error and not b.error, (c.error, b.error)
    assert (c.layout, b.layout) == ("contiguous", "balanced")
    kw = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, hardware="a100", link="ib", gpus_per_node=1)
    plans = {name: compile_plan(cu, 8, **kw, **opts) for name, opts in
             (("contiguous", {"layout": "contiguous"}), ("balanced", {"layout": "balanced", "layout_fallback": False}))}
    ref = {name: _owner_imbalance(cu, [np.asarray(p.local_token_indices(r)) for r in range(8)]) for name, p in plans.items()}
    assert c.owner_imbalance == pytest.approx(ref["contiguous"], rel=1e-9)  # integer work sums, float division only
    assert b.owner_imbalance == pytest.approx(ref["balanced"], rel=1e-9)
    assert ref["contiguous"] > 3.0 and ref["balanced"] < 1.1 < ref["contiguous"]
    assert all(len(plans["balanced"].local_token_indices(r)) == 8192 for r in range(8))  # equal tokens per rank
    assert b.seconds < 0.8 * c.seconds, (b.seconds, c.seconds)  # simulated: 36.7 vs 55.8 ms (0.66×)
    assert pair.kept is b


def test_failing_plan_is_reported_in_its_cell(tmp_path, monkeypatch) -> None:
    from megatron_hsap.errors import PlanError
    from megatron_hsap.sim import layouts as mod

    real = mod.run_method

    def flaky(*args, plan_options=None, **kwargs):  # noqa: ANN001, ANN202
        if (plan_options or {}).get("layout") == "balanced":
            raise PlanError("injected failure")
        return real(*args, plan_options=plan_options, **kwargs)

    monkeypatch.setattr(mod, "run_method", flaky)
    report = layouts(tmp_path, quick=True, workload="fineweb")
    assert "- error: A100 fineweb 64K P=8: balanced: PlanError: injected failure" in report.markdown
    assert "| failed |" in report.markdown and "MISSED" in report.markdown  # counted as a miss, not hidden
    rows = read_csv(tmp_path / "layouts.csv")
    assert _value(rows, "fineweb", 8, "hsap-balanced", "error").startswith("PlanError")
    assert float(_value(rows, "fineweb", 8, "hsap-contiguous", "time")) > 0
