"""The CPU attention benchmark: its executed baselines are exact, and ``--quick`` runs end to end.

The baselines must compute the same attention as HSAP (a baseline that drops work would look
fast): TE-style THD ring, all-gather KV and a2a+p2p are checked against the float64 reference of
``tests/reference.py`` at fp32 tolerance (1e-5 × max(1, |ref|max): fp32 kernels, a few hundred keys),
and their counted bytes against the planner's baseline pricing / the ring's closed form.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_hsap.baselines.flat import price_baseline
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import A100, LinkClass
from tests.reference import reference_packed

H, HKV, D = 4, 2, 8
REPO = Path(__file__).resolve().parents[2]


def _case_baseline(method: str, cu: list[int], tensors: dict, topology: tuple[int, int]) -> dict:
    """One forward + backward of a baseline on this rank's rows (padding rows: zero inputs and
    zero upstream gradient, as padding carries no loss)."""
    import torch.distributed as dist

    from megatron_hsap.bench.allgather_baseline import AllGatherKVAttention, contiguous_indices
    from megatron_hsap.bench.ring_baseline import A2AP2PAttention, RingAttention, ZigzagLayout
    from tests.runtime.cases import make_groups

    rank, world = dist.get_rank(), dist.get_world_size()
    g = {n: torch.from_numpy(a) for n, a in tensors.items()}
    total = cu[-1]
    if method == "allgather":
        idx = torch.from_numpy(contiguous_indices(cu, world, rank))
        impl = AllGatherKVAttention(cu, None, "cpu")
    else:
        intra, inter = topology
        layout = ZigzagLayout.build(cu, inter, intra)
        idx = torch.from_numpy(layout.local_token_indices(rank))
        groups = make_groups(intra, inter)
        impl = RingAttention(layout, None, "cpu") if method == "ring" else A2AP2PAttention(layout, *groups, "cpu")
    real = (idx >= 0) & (idx < total)
    rows = {n: torch.zeros((len(idx), *x.shape[1:])) for n, x in g.items()}
    for n in rows:
        rows[n][real] = g[n][idx[real]]
    scale = D**-0.5
    if method == "a2a_p2p":
        out, saved = impl.forward(rows["q"], rows["k"], rows["v"], scale)
        dq, dk, dv = impl.backward(rows["do"], saved, scale)
        stats = impl.ring.stats
    else:
        out, lse = impl.forward(rows["q"], rows["k"], rows["v"], scale)
        dq, dk, dv = impl.backward(rows["do"], rows["q"], rows["k"], rows["v"], out, lse, scale)
        stats = impl.stats
    sent = sum(s.bytes_sent for s in stats.values())
    return {"idx": idx.numpy(), "real": real.numpy(), "sent": sent,
            **{n: x.float().numpy() for n, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}}  # fmt: skip


@pytest.mark.parametrize(
    ("method", "topology"), [("ring", (1, 4)), ("allgather", (1, 4)), ("a2a_p2p", (2, 2)), ("a2a_p2p", (4, 1))]
)
def test_baselines_match_reference(gloo_pool, method, topology):
    gen = torch.Generator().manual_seed(7)
    pool = gloo_pool(4)
    for cu in ([0, 3, 3, 40, 41, 101], [0, 128], [0, 17, 30, 30, 64, 99, 130]):
        total = cu[-1]
        tensors = {"q": torch.randn(total, H, D, generator=gen), "k": torch.randn(total, HKV, D, generator=gen),
                   "v": torch.randn(total, HKV, D, generator=gen), "do": torch.randn(total, H, D, generator=gen)}  # fmt: skip
        results = pool.run(_case_baseline, method, cu, {n: x.numpy() for n, x in tensors.items()}, topology)
        leaves = [tensors[n].double().requires_grad_(True) for n in ("q", "k", "v")]
        ref, _ = reference_packed(*leaves, cu, D**-0.5)
        ref.backward(tensors["do"].double())
        want = {"out": ref.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
        for name, w in want.items():
            got = torch.full_like(w, float("nan"))
            for r in results:
                keep = torch.from_numpy(r["real"])
                got[torch.from_numpy(r["idx"])[keep]] = torch.from_numpy(r[name])[keep].double()
            err = float((got - w).abs().max())
            assert err <= 1e-5 * max(1.0, float(w.abs().max())), (method, cu, name, err)
        shape = HeadShape(num_heads=H, num_kv_heads=HKV, head_dim=D, head_dim_v=D, dtype_bytes=4)
        if method != "a2a_p2p":  # counted bytes == the planner's pricing of the same schedule
            priced = price_baseline("te_thd_ring" if method == "ring" else "allgather_kv", cu, world=4, shape=shape,
                                    hardware=A100, link=LinkClass.NVLINK)  # fmt: skip
            assert [r["sent"] for r in results] == [int(x) for x in priced.bytes_sent]


def test_quick_benchmark_runs_and_writes_csv(tmp_path):
    out = tmp_path / "cpu_attention.csv"  # --out is a folder; the CSV has a fixed name inside it
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_hsap.bench.cpu_attention", "--quick", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| sap | 1x4 |" in proc.stdout and "| te_thd_ring | 1x4 |" in proc.stdout
    assert "SAP bytes / ring bytes" in proc.stdout
    assert "[bench] 4 ranks: plans priced with link nvlink" in proc.stdout
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["source", "workload", "T", "P_intra", "P_inter", "link", "heads", "seed", "method",
                             "metric", "value", "unit"]  # fmt: skip
    methods = {r["method"] for r in rows}
    assert {"sap", "hsap", "ulysses", "te_thd_ring", "allgather_kv", "te_a2a_p2p"} <= methods
    assert all(float(r["value"]) >= 0 for r in rows)
    np.testing.assert_array_equal(sorted({r["metric"] for r in rows if r["method"] == "sap"})[:3],
                                  ["bytes_inter_per_rank_max", "bytes_inter_total", "bytes_intra_per_rank_max"])  # fmt: skip


def test_quick_keeps_the_options_given_and_refuses_two_destinations(capsys) -> None:
    from megatron_hsap.bench import cpu_attention

    a = cpu_attention.parse_args(["--quick", "--workloads", "sharegpt", "--repeats", "3"])
    assert (a.worlds, a.workloads, a.tokens, a.repeats, a.warmup, a.sweep_worlds) == ([4], ["sharegpt"], [2048], 3, 0, [4])
    for argv, says in ((["--quick", "--workloads", "xyz"], "argument --workloads: invalid choice: 'xyz'"),
                       (["--out", "d", "--csv", "f.csv"], "--out DIR and --csv FILE both say where the CSV goes")):
        with pytest.raises(SystemExit) as info:
            cpu_attention.parse_args(argv)
        assert info.value.code == 2 and says in capsys.readouterr().err
