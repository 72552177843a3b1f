"""Memory planner: parameter counts, Korthikanti's activation formulas, monotonicity, the Figure 5
comparison and the command line. Uses the pool formula (``use_plan=False``) except where the
planner itself is the subject, so the tests stay fast and independent of compile times."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_hsap.bench.memory import (
    GIB,
    Layout,
    MemoryOptions,
    Method,
    best_max_seq_length,
    candidate_layouts,
    config_layout,
    estimate,
    formula_pool_bytes,
    layer_activation_bytes,
    plan_pool,
)
from megatron_hsap.bench.memory_report import main
from megatron_hsap.launch import load_config
from megatron_hsap.launch.config import Recompute

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "configs" / "gpt30b_64gpu_128k.yaml"
FAST = MemoryOptions(use_plan=False)


def test_gpt30b_has_about_30b_parameters() -> None:
    n = load_config(GPT).model.num_parameters()
    assert abs(n - 30e9) / 30e9 < 0.05, n  # 29.31B: 64 × (12h² + 13h) + 50304·h
    assert n == 64 * (12 * 6144**2 + 13 * 6144) + 50304 * 6144 + 2 * 6144


def _ring_gpt(dropout: float) -> object:
    # Korthikanti's setting: GPT with dropout; the ring baseline accepts attention dropout.
    return load_config(GPT, {"model": {"attention_dropout": dropout, "hidden_dropout": dropout},
                             "parallel": {"cp_impl": "ring"}})


@pytest.mark.parametrize(("t", "sp"), [(1, False), (8, True), (8, False)])
def test_activation_bytes_match_korthikanti(t: int, sp: bool) -> None:
    """Table 2 of Korthikanti et al. 2022, exactly: sbh(34 + 5as/h) without parallelism,
    sbh(34/t + 5as/(ht)) with TP + SP, sbh(10 + 24/t + 5as/(ht)) with TP alone; selective
    recompute drops the 5as/h term, full recompute keeps 2sbh (/t with SP)."""
    cfg = _ring_gpt(0.1)
    s, b, h, a = 4096, 1, 6144, 64
    kw = dict(tensor=t, sequence_parallel=sp, micro_batch=b)
    none = layer_activation_bytes(cfg, s, recompute=Recompute.NONE, flash=False, **kw)
    sel = layer_activation_bytes(cfg, s, recompute=Recompute.SELECTIVE, flash=False, **kw)
    full = layer_activation_bytes(cfg, s, recompute=Recompute.FULL, **kw)
    core = 5 * a * s / (h * t)
    base = 34 / t if sp else 10 + 24 / t
    assert none == pytest.approx(s * b * h * (base + core), rel=1e-12)  # float reference of int math
    assert sel == pytest.approx(s * b * h * base, rel=1e-12)
    assert full == pytest.approx(2 * s * b * h / (t if sp else 1), rel=1e-12)
    # Flash kernels never store the s×s scores: only the fp32 LSE (4a bytes per token) remains.
    flash = layer_activation_bytes(cfg, s, recompute=Recompute.NONE, **kw)
    assert flash == pytest.approx(s * b * h * base + 4 * a * s * b / t, rel=1e-12)


def test_memory_grows_with_sequence_length() -> None:
    cfg = load_config(GPT)
    pool = plan_pool(cfg, FAST)
    for method in Method:
        for lay in candidate_layouts(cfg, method)[0]:
            totals = [estimate(cfg, lay, k * lay.granule(), FAST, pool).total for k in (1, 2, 3, 8, 64, 512)]
            assert all(x < y for x, y in zip(totals, totals[1:])), (lay, totals)


def test_figure5_hsap_fits_longer_than_te_ring() -> None:
    """Same GPUs, sharding and recompute, each method's best layout. The TE ring's KV-P2P forward
    keeps every received KV chunk and every per-step output and LSE until the layer's forward ends
    (P × (kv + o + lse) on the last rank: TransformerEngine context_parallel.py, d0067d0d), while
    HSAP's receive pool holds 4 inter chunks of its H/P_intra heads — 4/P of the KV the ring keeps
    — plus fp32 accumulators of the local rows. For P ≥ 8 that is less, so HSAP fits longer."""
    cfg = load_config(GPT)
    pool = plan_pool(cfg, FAST)
    for gib in (40.0, 80.0):
        _, hsap, _ = best_max_seq_length(cfg, Method.HSAP, gib, FAST, pool)
        _, ring, _ = best_max_seq_length(cfg, Method.TE_RING, gib, FAST, pool)
        assert hsap > ring > 0, (gib, hsap, ring)
    # 128K at the config's own layout (TP 1, 8×8) fits the paper's 40 GB GPUs with room to spare.
    lay = config_layout(cfg)
    assert estimate(cfg, lay, cfg.training.seq_length, FAST, pool).fits(40.0, FAST.reserve_gib)


def test_figure5_ulysses_versus_hsap() -> None:
    """Ulysses needs no receive pool and no fp32 merges, so where its head cap does not bind it
    fits at least as long as HSAP: GPT-30B's 64 heads allow degree 64 = all 64 GPUs, and HSAP
    stays within 10% of it (the pool + accumulators are a few GiB at ~1M tokens). Past the cap —
    the same model on 128 GPUs, P > heads — Ulysses must put the rest into data parallelism, each
    GPU holds twice the tokens, and HSAP fits longer (the paper's Figure 5 / Table 3 argument)."""
    cfg = load_config(GPT)
    pool = plan_pool(cfg, FAST)
    _, hsap, _ = best_max_seq_length(cfg, Method.HSAP, 40.0, FAST, pool)
    lay, uly, note = best_max_seq_length(cfg, Method.ULYSSES, 40.0, FAST, pool)
    assert lay is not None and lay.data == 1 and not note
    assert 0.9 * uly <= hsap <= uly
    big = load_config(GPT, {"cluster": {"nnodes": 16}, "training": {"global_batch_size": 2}})
    pool = plan_pool(big, FAST)
    _, hsap, _ = best_max_seq_length(big, Method.HSAP, 40.0, FAST, pool)
    lay, uly, note = best_max_seq_length(big, Method.ULYSSES, 40.0, FAST, pool)
    assert lay.data == 2 and "Ulysses degree" in note
    assert hsap > 1.5 * uly


def test_te_ring_pays_for_document_padding_hsap_does_not() -> None:
    cfg = load_config(GPT)
    pool = plan_pool(cfg, FAST)
    seq = cfg.training.seq_length
    ring = Layout(method=Method.TE_RING, tensor=1, context=64)
    docs = MemoryOptions(use_plan=False, mean_doc_tokens=1000)  # ~131 documents, each padded to 128
    assert estimate(cfg, ring, seq, docs, pool).total > estimate(cfg, ring, seq, FAST, pool).total
    hsap = config_layout(cfg)
    assert estimate(cfg, hsap, seq, docs, pool).total == estimate(cfg, hsap, seq, FAST, pool).total


def test_pool_comes_from_the_planner_when_present() -> None:
    plan_mod = pytest.importorskip("megatron_hsap.plan")
    cfg = load_config(ROOT / "configs" / "llama2_7b_8gpu_2x4_16k.yaml")
    lay = config_layout(cfg)
    seq = cfg.training.seq_length
    # The planner's default capacity is docs/design.md §2.1's formula (called directly so that a planner
    # failure shows its own traceback).
    plan = plan_mod.compile_plan([0, seq], inter_size=4, intra_size=2, num_heads=32, head_dim=128)
    assert plan.stats().pool_capacity_bytes == formula_pool_bytes(cfg, seq, lay)
    pool_bytes, source = plan_pool(cfg, MemoryOptions())(seq, lay)
    assert source.startswith("compile_plan") and pool_bytes == formula_pool_bytes(cfg, seq, lay)


def test_cli_prints_the_tables_and_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "fig5.png"
    rc = main(["--config", str(GPT), "--gpu-mem-gib", "40", "80", "--no-plan", "--plot", str(png),
               "--seq-lengths", "128K", "512K", "1M"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| **total** |" in out and "| 40 GiB GPU (usable 38) | fits |" in out
    for title in ("| HSAP |", "| TE ring (Megatron CP) |", "| Ulysses |", "| 512K |", "| 1M |"):
        assert title in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.startswith("megatron-hsap memory: error: config file ")


def test_cli_says_when_no_sequence_fits_and_refuses_a_plot_it_cannot_write(tmp_path: Path, capsys) -> None:
    # the longest fitting length per GPU size, or that none fits — never "up to OOM"
    assert main(["--config", str(GPT), "--gpu-mem-gib", "1", "80", "--no-plan", "--seq-lengths", "128K"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "fits no sequence on 1 GiB (not even its shortest, " in last and ", up to " in last and " on 80 GiB." in last
    (tmp_path / "f").write_text("a file\n")
    with pytest.raises(SystemExit) as info:  # before any estimate (it failed at the very end)
        main(["--config", str(GPT), "--plot", str(tmp_path / "f" / "x.png")])
    assert info.value.code == 2 and f"{tmp_path / 'f'} is a file" in capsys.readouterr().err


def test_breakdown_totals_add_up() -> None:
    cfg = load_config(GPT)
    b = estimate(cfg, config_layout(cfg), cfg.training.seq_length, FAST)
    parts = b.params + b.grads + b.optimizer + b.activations + b.recompute_working + b.attention + b.logits
    assert b.total == parts and 5 * GIB < b.total < 38 * GIB
