"""sim/breakdown.py's loss table: the measured cause of each point where HSAP loses.

References: the simulated makespans themselves (the terms of a run sum to its forward + backward
seconds exactly) and hand-made term dictionaries for the table's arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsap.plan.hardware import LinkClass
from megatron_hsap.sim.breakdown import TERMS, LossTable, run_terms
from megatron_hsap.sim.config import sim_hardware
from megatron_hsap.sim.methods import full_shape, run_method


@pytest.mark.parametrize("method", ["hsap", "te_a2a", "distflashattn"])
def test_run_terms_sum_to_the_simulated_fwd_plus_bwd(method: str) -> None:
    hw = sim_hardware("a100")
    shape = full_shape(16, 16)
    cu = np.array([0, 3000, 5000, 8192])
    run = run_method(method, cu, hw=hw, intra=1, inter=4, shape=shape)
    terms = run_terms(run, cu, shape, hw, 4, hw.latency(LinkClass.NVLINK))
    assert set(terms) == set(TERMS)
    assert sum(terms.values()) == pytest.approx(run.fwd.seconds + run.bwd.seconds, rel=1e-9)
    assert terms["ideal"] > 0


def _terms(**over: float) -> dict[str, float]:
    return {k: over.get(k, 0.0) for k in TERMS}


def test_loss_rows_are_mean_deltas_in_ms_and_name_the_largest() -> None:
    t = LossTable()
    key = ("full", 8, "32K")
    t.add(key, "te_a2a", _terms(ideal=1.0, merges=0.004, all_to_all=0.0), _terms(ideal=1.0, all_to_all=0.003))
    t.add(key, "te_a2a", _terms(ideal=1.0, merges=0.002, kernel_efficiency=0.001), _terms(ideal=1.0, all_to_all=0.001))
    t.close(key, "te_a2a", "TE a2a", 0.9)
    assert len(t.rows) == 1
    row = t.rows[0]
    assert row[:5] == ["full", 8, "32K", "TE a2a", "0.90×"]
    got = dict(zip(TERMS, row[5:-1]))
    assert got["merges"] == pytest.approx(3.0)  # ms: mean of 4 and 2
    assert got["all_to_all"] == pytest.approx(-2.0)
    assert got["kernel_efficiency"] == pytest.approx(0.5)
    assert got["ideal"] == 0.0
    assert row[-1] == "merges"
    md = "\n".join(t.markdown(["workload", "SP", "T"]))
    assert "| full | 8 | 32K | TE a2a | 0.90× |" in md and md.count("\n|") >= 2


def test_points_hsap_wins_leave_no_row() -> None:
    t = LossTable()
    t.add(("p",), "r", _terms(merges=1.0), _terms())
    t.close(("p",), "r", "R", 1.02)
    t.close(("q",), "r", "R", 0.5)  # nothing measured for q: no row
    assert t.rows == [] and t.markdown(["point"]) == []
