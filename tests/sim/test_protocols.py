"""MagiAttention's protocol, the hybrid-CP stages, the zigzag all-gather schedule and the tuner."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsap.baselines.flat import price_baseline
from megatron_hsap.baselines.registry import REGISTRY, hybrid_group_sizes
from megatron_hsap.plan.hardware import A100, LinkClass
from megatron_hsap.sim import tune as tune_mod
from megatron_hsap.sim.collectives import hybrid_stages
from megatron_hsap.sim.config import sim_hardware
from megatron_hsap.sim.methods import METHODS, full_shape, run_method
from megatron_hsap.sim.protocols import magi_batches, magi_histogram


def test_histogram_is_the_published_file() -> None:
    lengths, counts = magi_histogram()
    assert len(lengths) == 14 and lengths[0] == 5 and lengths[-1] == (131073 + 196608) // 2
    published = [30254, 391188, 699596, 1377757, 3794735, 3316785, 2106566, 988525, 410002, 173574, 115007, 18428,
                 22513, 18284]  # the "number" column, as printed in the source file
    assert counts.tolist() == published


@pytest.mark.parametrize("T", [65536, 524288])
def test_magi_batches_pack_and_split_like_magiattention(T: int) -> None:
    a, b = magi_batches(T, 4, seed=3), magi_batches(T, 4, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))  # seeded
    assert not all(np.array_equal(x, y) for x, y in zip(a, magi_batches(T, 4, seed=4)))
    for cu in a:
        lengths = np.diff(cu)
        assert cu[0] == 0 and cu[-1] == T and (lengths > 0).all()
        assert lengths.max() <= T // 4  # longer documents were split into T/4 chunks, never truncated
    # chunks of exactly T/4 occur: the long bins (up to 160K tokens) are split, not dropped
    assert any((np.diff(cu) == T // 4).any() for cu in magi_batches(T, 8, seed=0))


def test_hybrid_stages_respect_capacity_and_place_every_sample() -> None:
    lengths = np.array([30000, 9000, 8192, 5000, 3000, 3000, 2500, 100, 8193])
    P = 8
    stages = hybrid_stages(lengths, P)
    placed = sorted(n for st in stages for n, _, _ in st)
    assert placed == sorted(lengths.tolist())
    sizes = dict(zip(lengths.tolist(), hybrid_group_sizes(lengths.tolist(), P, 8192)))
    assert sizes[30000] == 4 and sizes[9000] == 2 and sizes[8192] == 1 and sizes[100] == 1
    for st in stages:
        load = np.zeros(P)
        for n, first, g in st:
            assert g == sizes[n] and first % g == 0 and first + g <= P
            load[first : first + g] += -(-n // g)
        assert load.max() <= 8192


def test_zigzag_allgather_simulated_work_matches_flat_price() -> None:
    cu = np.array([0, 5000, 5100, 20000, 32768])
    hw = sim_hardware("a100")
    shape = full_shape(8, 8)
    run = run_method("allgather_kv_zigzag", cu, hw=hw, intra=1, inter=4, shape=shape)
    flat = price_baseline("allgather_kv_zigzag", cu, world=4, shape=shape, hardware=A100, link=LinkClass.NVLINK)
    sim_flops = np.array([sum(s.flops for s in prog if hasattr(s, "flops")) for prog in run.fwd.workload.programs])
    np.testing.assert_allclose(sim_flops / shape.fwd_flops_per_pair, flat.work, rtol=1e-12)


def test_registry_records_point_at_real_things() -> None:
    from megatron_hsap.baselines.flat import BASELINES
    from megatron_hsap.baselines.hierarchical import HIERARCHICAL

    for b in REGISTRY.values():
        assert b.source and "/" in b.source
        assert b.flat is None or b.flat in BASELINES + HIERARCHICAL
        assert b.simulated is None or b.simulated in METHODS, b.name
        assert b.cpu is None or b.cpu.startswith("megatron_hsap.bench.")
    assert not REGISTRY["distflashattn"].document_aware and not REGISTRY["blind_ring"].document_aware


def test_tuner_picks_one_topology_by_mean_not_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 0 is fastest at 1x8, batch 1 at 8x1; the mean (not a per-batch oracle) decides."""
    import megatron_hsap.sim.methods as methods

    times = {(0, 1): 1.0, (1, 1): 9.0, (0, 8): 3.0, (1, 8): 4.0, (0, 2): 5.0, (1, 2): 5.0, (0, 4): 6.0, (1, 4): 6.0}

    class Fake:
        def __init__(self, s: float) -> None:
            self.seconds = s

    def fake(method, cu, *, hw, intra, inter, shape, **_):  # noqa: ANN001, ANN202
        return Fake(times[(int(cu[-1]) - 1, intra)])

    monkeypatch.setattr(methods, "run_method", fake)
    t = tune_mod.tune_topology("hsap", [np.array([0, 1]), np.array([0, 2])], hw=sim_hardware("h100"), P=8, shape=full_shape(32, 8))
    assert t.topology == "8x1" and t.mean_s["1x8"] == 5.0
    assert t.flag == "--hierarchical-context-parallel-sizes 8 1"


def test_tuner_ties_go_to_the_topology_the_batches_ran_on(monkeypatch) -> None:  # noqa: ANN001
    # plan/flatten.py: every configured topology of one node runs the same plans, here all as 4x2:
    # the times tie, and the tuner names the topology they ran on, not the first tried
    import megatron_hsap.sim.methods as methods
    import megatron_hsap.sim.tune as tune_mod
    from megatron_hsap.sim.config import sim_hardware
    from megatron_hsap.sim.methods import full_shape

    class Fake:
        def __init__(self, ran_as: str) -> None:
            self.seconds, self.extra = 2.0, {"ran_as": ran_as}

    def fake(method, cu, *, hw, intra, inter, shape, **_):  # noqa: ANN001, ANN202
        return Fake("4x2")

    monkeypatch.setattr(methods, "run_method", fake)
    t = tune_mod.tune_topology("hsap", [np.array([0, 1]), np.array([0, 2])], hw=sim_hardware("h100"), P=8, shape=full_shape(32, 8))
    assert t.topology == "4x2" and set(t.mean_s.values()) == {2.0}, t


def test_tuner_strikes_off_a_topology_only_for_its_pool_and_says_why(monkeypatch) -> None:  # noqa: ANN001
    # a plan that does not fit the pool removes its topology (named in the error when none is left);
    # any other error is not the topology's: it propagates instead of striking every topology off
    import megatron_hsap.sim.methods as methods
    import megatron_hsap.sim.tune as tune_mod
    from megatron_hsap.errors import ConfigError, HSAPError, PoolSizeError
    from megatron_hsap.sim.config import sim_hardware
    from megatron_hsap.sim.methods import full_shape

    class Fake:
        def __init__(self, s: float) -> None:
            self.seconds = s

    def pool(method, cu, *, hw, intra, inter, shape, **_):  # noqa: ANN001, ANN202
        if intra in (1, 2):
            raise PoolSizeError(f"pool too small at {intra}")
        return Fake(float(intra))

    monkeypatch.setattr(methods, "run_method", pool)
    batches = [np.array([0, 1]), np.array([0, 2])]
    t = tune_mod.tune_topology("hsap", batches, hw=sim_hardware("h100"), P=8, shape=full_shape(32, 8))
    assert t.topology == "4x2" and np.isnan(t.mean_s["1x8"]) and np.isnan(t.mean_s["2x4"]), t

    monkeypatch.setattr(methods, "run_method", lambda *a, **k: (_ for _ in ()).throw(PoolSizeError("pool too small")))
    with pytest.raises(HSAPError, match=r"no valid topology for P=8 with 32/8 heads \(1x8: batch 0: pool too small"):
        tune_mod.tune_topology("hsap", batches, hw=sim_hardware("h100"), P=8, shape=full_shape(32, 8))

    monkeypatch.setattr(methods, "run_method", lambda *a, **k: (_ for _ in ()).throw(ConfigError("layout 'zig'")))
    with pytest.raises(ConfigError, match="layout 'zig'"):
        tune_mod.tune_topology("hsap", batches, hw=sim_hardware("h100"), P=8, shape=full_shape(32, 8))


@pytest.mark.parametrize(("argv", "says"), [
    (["--layout", "zig"], ("argument --layout: invalid choice: 'zig'", "balanced")),
    (["--workload", "xyz"], ("argument --workload: invalid choice: 'xyz'", "magiattention")),
    (["--method", "ring"], ("argument --method: invalid choice: 'ring'", "hsap", "te_a2a_p2p")),
    (["--hardware", "b200"], ("argument --hardware: invalid choice: 'b200'", "h100-fa3")),
])
def test_tune_refuses_unknown_names_before_simulating(argv, says, monkeypatch, capsys) -> None:  # noqa: ANN001
    import megatron_hsap.sim.tune as tune_mod

    monkeypatch.setattr(tune_mod, "tune_topology", lambda *a, **k: pytest.fail("simulated before refusing"))
    with pytest.raises(SystemExit) as info:
        tune_mod.main(argv)
    err = capsys.readouterr().err.splitlines()[-1]  # (how argparse quotes the choices varies by Python version)
    assert info.value.code == 2 and all(x in err for x in says), err


@pytest.mark.parametrize("intra,inter", [(1, 16), (2, 8), (4, 4), (8, 2)])
def test_double_ring_computes_what_the_single_ring_computes(intra: int, inter: int) -> None:
    """LoongTrain's double ring visits every KV owner once: per-rank kernel FLOPs equal the
    single zigzag ring's (TE a2a+p2p) at the same topology; only the transfers differ. Document
    lengths are multiples of 2P = 32, so TE's padding (computed) and LoongTrain's real tokens agree."""
    from megatron_hsap.sim.double_ring import window_size

    cu = np.array([0, 3008, 3104, 19968, 65536])
    hw = sim_hardware("h100")
    shape = full_shape(32, 8)
    dr = run_method("loongtrain", cu, hw=hw, intra=intra, inter=inter, shape=shape)
    ring = run_method("te_a2a_p2p", cu, hw=hw, intra=intra, inter=inter, shape=shape)

    def flops(run):  # noqa: ANN001, ANN202
        return [sum(getattr(s, "flops", 0.0) for s in prog) for prog in run.fwd.workload.programs]

    np.testing.assert_allclose(flops(dr), flops(ring), rtol=1e-12)
    w = window_size(inter, intra, 8)
    outer = [t for t in dr.fwd.workload.transfers if t.label == "kv outer"]
    inner = [t for t in dr.fwd.workload.transfers if t.label == "kv inner"]
    assert len(outer) == inter * (inter // w - 1) and len(inner) == inter * (inter // w) * (w - 1)


def test_tune_command_prints_the_megatron_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert tune_mod.main(["--gpus", "4", "--tokens-per-gpu", "2048", "--samples", "1", "--heads", "8/8",
                          "--hardware", "a100", "--workload", "fineweb"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    chosen = [line for line in out if "<- chosen" in line]
    assert len(chosen) == 1 and out[-1] == "--hierarchical-context-parallel-sizes {} {}".format(
        *chosen[0].split(":")[0].strip().split("x"))
    assert tune_mod.main(["--heads", "64"]) == 2 and "--heads" in capsys.readouterr().err
