"""plan/hardware.py: the link class is NVLink exactly when the whole CP group fits one node,
``bandwidth``/``latency`` return the figures of the link asked for, GPU product names map to
their constant set (unknown ones to None), and the kernel curve rises monotonically from
1/(1 + half_rate) towards 1 (docs/design.md §4).

Reference: the constants as written in the module's table, and the curve's closed form."""

from __future__ import annotations

from megatron_hsap.plan.hardware import HARDWARE, KernelCurve, LinkClass, hardware_for_device, link_class_for


def test_link_class_by_node_size() -> None:
    assert [link_class_for(n) for n in (1, 8, 9, 64)] == [LinkClass.NVLINK, LinkClass.NVLINK, LinkClass.INFINIBAND, LinkClass.INFINIBAND]
    assert link_class_for(4, gpus_per_node=4) is LinkClass.NVLINK and link_class_for(5, gpus_per_node=4) is LinkClass.INFINIBAND


def test_bandwidth_and_latency_pick_the_link() -> None:
    for hw in HARDWARE.values():
        assert (hw.bandwidth(LinkClass.NVLINK), hw.latency(LinkClass.NVLINK)) == (hw.nvlink_bw, hw.nvlink_latency)
        assert (hw.bandwidth(LinkClass.INFINIBAND), hw.latency(LinkClass.INFINIBAND)) == (hw.ib_bw, hw.ib_latency)
        assert hw.nvlink_bw > hw.ib_bw > 0 and hw.attn_fwd_flops > 0 and hw.attn_bwd_flops > 0
    assert set(HARDWARE) == {"a100", "h100", "h100-fa3", "h200"}


def test_device_names() -> None:
    assert hardware_for_device("NVIDIA H200") == "h200"
    assert hardware_for_device("NVIDIA H100 80GB HBM3") == "h100"
    assert hardware_for_device("NVIDIA H800") == "h100"
    assert hardware_for_device("NVIDIA A100-SXM4-80GB") == "a100"
    assert hardware_for_device("Tesla V100") is None


def test_kernel_curve_closed_form_and_monotone() -> None:
    k = KernelCurve(half_rate_tokens=390.0)
    assert k.efficiency(390, 10_000) == 0.5  # exact: n / (n + n)
    assert k.efficiency(0, 5) == 1 / 391  # an empty side counts as one token
    effs = [k.efficiency(n, n) for n in (1, 16, 512, 1024, 16384)]
    assert effs == sorted(effs) and effs[-1] < 1.0


def test_one_kernel_model_for_planner_and_simulator() -> None:
    # issue 14 item 2: the planner's Hardware carries the very kernel model the simulator runs
    from megatron_hsap.sim.config import KernelModel as SimKernelModel, sim_hardware
    from megatron_hsap.plan.hardware import KernelModel

    assert SimKernelModel is KernelModel
    for name in ("a100", "h100", "h100-fa3"):
        sim = sim_hardware(name)
        assert sim.kernel == HARDWARE[name].kernel and sim.hbm_bw == HARDWARE[name].hbm_bw
        assert sim.a2a_efficiency == HARDWARE[name].a2a_efficiency and sim.overlap_slowdown == HARDWARE[name].overlap_slowdown


def test_min_block_rows_from_the_tile_model() -> None:
    k = HARDWARE["a100"].kernel
    n = k.min_block_rows()
    # a row tile is paid whole: n rows against 1K keys run at n/128 of one full tile's efficiency
    full = float(k.efficiency(128, 1024))
    assert float(k.efficiency(n, 1024)) >= 0.9 * full > float(k.efficiency(n - 1, 1024))
    assert n == 116  # ⌈0.9 × 128⌉
    from dataclasses import replace

    assert replace(k, tile=0).min_block_rows() == 16  # the saturating curve has no tiles


def test_a2a_bandwidth_derates_nvlink_only() -> None:
    hw = HARDWARE["h100"]
    assert hw.a2a_bandwidth(LinkClass.NVLINK) == hw.nvlink_bw * hw.a2a_efficiency
    assert hw.a2a_bandwidth(LinkClass.INFINIBAND) == hw.ib_bw
    assert hw.a2a_copy_time(hw.hbm_bw) == 4.0  # four passes over the tensor through HBM
