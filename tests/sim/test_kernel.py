"""The kernel model (tiles by block shape) and the constants file against workloads.md's
published figures and hand-counted tiles."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.sim import config
from megatron_hsap.sim.config import load_overrides, reset_overrides, sim_hardware

# workloads.md figures, copied here by hand (TFLOP/s).
A100_FWD_8K, A100_BWD_8K = 205e12, 174e12
FA3_FWD_16K, FA3_BWD_16K = 632e12, 561e12  # midpoint of 616-648; 561


@pytest.fixture(autouse=True)
def _clean_overrides():
    yield
    reset_overrides()


def _causal(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.array([float(n)])
    return a, a, a * (a + 1) / 2


def test_rates_at_reference_shapes_are_the_measured_ones() -> None:
    # the published figures are causal single-document benchmarks: the peaks are set so that the
    # tile model gives exactly them there
    a100 = sim_hardware("a100").kernel
    nq, nk, pr = _causal(8192)
    assert float(a100.rate(nq, nk, "fwd", pairs=pr)[0]) == pytest.approx(A100_FWD_8K, rel=1e-12)
    assert float(a100.rate(nq, nk, "bwd", pairs=pr)[0]) == pytest.approx(A100_BWD_8K, rel=1e-12)
    fa3 = sim_hardware("h100-fa3").kernel
    nq, nk, pr = _causal(16384)
    assert float(fa3.rate(nq, nk, "fwd", pairs=pr)[0]) == pytest.approx(FA3_FWD_16K, rel=1e-12)
    assert float(fa3.rate(nq, nk, "bwd", pairs=pr)[0]) == pytest.approx(FA3_BWD_16K, rel=1e-12)


def test_short_documents_run_below_peak_as_published() -> None:
    # workloads.md: FA2 causal forward at 512 tokens ~57% of its 16K rate, at 1K ~78%. The tile
    # model (0.8 tile of prologue/epilogue per row tile, its one parameter) gives 61% and 75%.
    k = sim_hardware("h100").kernel
    at16k = float(k.rate(*_causal(16384)[:2], "fwd", pairs=_causal(16384)[2])[0])
    assert float(k.rate(*_causal(512)[:2], "fwd", pairs=_causal(512)[2])[0]) / at16k == pytest.approx(0.57, abs=0.05)
    assert float(k.rate(*_causal(1024)[:2], "fwd", pairs=_causal(1024)[2])[0]) / at16k == pytest.approx(0.78, abs=0.05)


def test_tiles_counted_by_hand() -> None:
    # 16 q rows against 1000 keys (a zigzag chunk against its prefix), full block: 1 row tile,
    # min(1000/128 + 1/2, ⌈1000/128⌉) = 8 key tiles + 0.8 overhead -> 16 000 / (8.8 · 128²)
    k = sim_hardware("h100").kernel
    eff = float(k.efficiency(np.array([16.0]), np.array([1000.0]), np.array([16000.0]))[0])
    assert eff == pytest.approx(16000 / ((8 + 0.8) * 128 * 128), rel=1e-12)
    # FA3's forward packs the 8 q heads of a kv head: 128 rows fill the tile (8x the efficiency);
    # its backward does not pack
    fa3 = sim_hardware("h100-fa3").kernel
    packed = float(fa3.efficiency(np.array([16.0]), np.array([1000.0]), np.array([16000.0]), "fwd", 8)[0])
    assert packed == pytest.approx(8 * eff, rel=1e-12)
    assert float(fa3.efficiency(np.array([16.0]), np.array([1000.0]), np.array([16000.0]), "bwd", 8)[0]) == pytest.approx(eff, rel=1e-12)


def test_efficiency_grows_with_the_block_and_stays_below_one() -> None:
    k = sim_hardware("a100").kernel
    n = np.array([1, 16, 128, 1024, 8192, 65536], dtype=np.float64)
    eff = k.efficiency(n, n, n * (n + 1) / 2)
    assert np.all(np.diff(eff) > 0) and eff[-1] < 1.0


def test_fa3_backward_pays_fp32_dkv_atomics_per_q_head() -> None:
    from megatron_hsap.plan.costs import HeadShape

    hw = sim_hardware("h100-fa3")
    gqa = HeadShape(num_heads=8, num_kv_heads=1, head_dim=128, head_dim_v=128, dtype_bytes=2)
    # kv blocks of 300 and 100 keys: 3 + 1 tiles, 8 q heads, 128 keys × 256 × 4 B, read + write
    t = hw.kernel.gqa_accum_time(np.array([300.0, 100.0]), gqa, "bwd", hw.hbm_bw)
    assert t == pytest.approx(4 * 8 * 128 * 256 * 4 * 2 / hw.hbm_bw, rel=1e-12)
    assert hw.kernel.gqa_accum_time(np.array([300.0]), gqa, "fwd", hw.hbm_bw) == 0.0
    mha = HeadShape(num_heads=8, num_kv_heads=8, head_dim=128, head_dim_v=128, dtype_bytes=2)
    assert hw.kernel.gqa_accum_time(np.array([300.0]), mha, "bwd", hw.hbm_bw) == 0.0


def test_call_time_adds_one_launch() -> None:
    k = sim_hardware("a100").kernel
    nq = np.array([1000.0, 2000.0])
    flops = np.array([1e9, 3e9])
    expected = 1e9 / float(k.rate(1000, 1000, "fwd")) + 3e9 / float(k.rate(2000, 2000, "fwd"))
    assert k.blocks_time(nq, nq, flops, "fwd") == pytest.approx(expected, rel=1e-12)
    assert k.call_time(nq, nq, flops, "fwd") - k.blocks_time(nq, nq, flops, "fwd") == pytest.approx(k.curve.launch_s, rel=1e-9)


def test_yaml_overrides(tmp_path) -> None:
    f = tmp_path / "sim.yaml"
    f.write_text("hardware:\n  a100:\n    ib_bw: 50.0e9\n    p2p_channels: 8\nmerge_bytes:\n  hsap:\n    fwd: 18\n")
    load_overrides(f)
    assert sim_hardware("a100").ib_bw == 50e9
    # NCCL's p2p constants live in plan/hardware.py and are overridable like any other field
    assert (sim_hardware("a100").p2p_channels, sim_hardware("a100").p2p_channel_net_bw) == (8, 14e9)
    assert config.merge_bytes("hsap", "fwd") == 18.0  # the eager merge's bytes, over the fused 10
    bad = tmp_path / "bad.yaml"
    bad.write_text("hardware:\n  a100:\n    nic_speed: 1\n")
    with pytest.raises(ConfigError, match="no fields"):
        load_overrides(bad)
    with pytest.raises(ConfigError, match="unknown hardware"):
        sim_hardware("tpu")
