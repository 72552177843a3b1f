"""Flattening (``plan/flatten.py``): inside one node ``compile_plan`` may plan a batch as pure SAP over
all ``P`` CP ranks (``1 × P``) or as one all-to-all over them (``P × 1``). Checked against the
simulator (an independent, event-by-event execution): the plan ``flatten="auto"`` keeps
simulates no slower than every topology it chose among, on batches where each one-level topology
wins and where the configured one does; and the option's rules (never across nodes under "auto",
heads that do not split, the flattened options, validation, caching)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan import compile_plan
from megatron_hsap.plan.workloads import pack_batches

MHA = dict(num_heads=32, num_kv_heads=32, head_dim=128, hardware="a100")  # LLaMA-2-7B, Table 4


def _simulated(cu, intra: int, inter: int, flatten: str) -> tuple[float, bool]:
    """(fwd + bwd simulated seconds, flattened) of HSAP's plan on 8 A100s of one node."""
    from megatron_hsap.sim.config import sim_hardware
    from megatron_hsap.sim.methods import full_shape, run_method

    run = run_method("hsap", cu, hw=sim_hardware("a100"), intra=intra, inter=inter, shape=full_shape(32, 32),
                     plan_options={"flatten": flatten})
    return run.seconds, run.extra["flattened"]


@pytest.mark.parametrize(("workload", "flattens"), [("fineweb", True), ("slimpajama", False)])
def test_auto_keeps_the_topology_that_simulates_faster(workload, flattens):
    # fineweb 64K: documents of at most ~3K tokens, each whole on one of 8 ranks, no all-to-all;
    # slimpajama 64K: 19K-token documents, which Ulysses at 8x1 serves better than P2P
    cu = pack_batches(workload, 65536, 1, 0)[0]
    auto = compile_plan(cu, 1, 8, **MHA)  # flatten="auto", the default
    hsap = compile_plan(cu, 1, 8, flatten="never", **MHA)
    assert hsap.intra_size == 8 and hsap.options.flattened_from is None
    assert (auto.options.flattened_from is not None) is flattens
    t_auto, flat = _simulated(cu, 8, 1, "auto")
    t_hsap, _ = _simulated(cu, 8, 1, "never")
    t_flat, _ = _simulated(cu, 8, 1, "always")
    assert flat is flattens
    assert t_auto == min(t_hsap, t_flat), (t_auto, t_hsap, t_flat)
    if flattens:
        assert t_flat < 0.6 * t_hsap, "short documents stay whole: most of the all-to-all's time is saved"


@pytest.mark.parametrize(("workload", "configured", "kept"), [
    ("full", (1, 8), (8, 1)),  # one 16K document: SAP's merges and small blocks against one all-to-all
    ("full", (2, 4), (8, 1)),
    ("fineweb", (2, 4), (1, 8)),  # short documents: each whole on one GPU, no all-to-all
    ("fineweb", (1, 8), (1, 8)),  # the configured topology is the fastest
])
def test_auto_keeps_the_fastest_of_three_topologies_in_simulation(workload, configured, kept):
    cu = pack_batches(workload, 16384, 1, 0)[0]
    intra, inter = configured
    auto = compile_plan(cu, inter, intra, **MHA)
    assert (auto.intra_size, auto.inter_size) == kept
    assert auto.options.flattened_from == (None if kept == configured else configured)
    # the three plans simulated, each on its own topology (the fastest wins by more than 3%)
    times = {}
    for flatten, topo in (("never", configured), ("always", (1, 8)), ("all-to-all", (8, 1))):
        t, _ = _simulated(cu, intra, inter, flatten)
        times[topo] = min(t, times.get(topo, float("inf")))
    t_auto, _ = _simulated(cu, intra, inter, "auto")
    assert t_auto == times[kept] and all(t_auto <= t for t in times.values()), times
    assert sorted(times.values())[1] > 1.03 * t_auto, times


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(0, 1500), min_size=1, max_size=8), topo=st.sampled_from([(1, 4), (2, 2), (4, 1), (1, 8), (2, 4)]),
       kv=st.sampled_from([1, 2, 8]))
def test_auto_keeps_the_least_layer_time_of_the_topologies_it_compiles(lens, topo, kv):
    cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
    if cu[-1] == 0:
        cu[-1] = 1
    intra, inter = topo
    kw = dict(num_heads=8, num_kv_heads=kv, head_dim=64, hardware="a100")
    auto = compile_plan(cu, inter, intra, **kw)
    cands = [compile_plan(cu, inter, intra, flatten=f, **kw) for f in ("never", "always", "all-to-all")]
    assert auto.hash in {c.hash for c in cands}, "auto keeps one of the plans it compiled"
    assert all(auto.layer_time <= c.layer_time * (1 + 1e-9) for c in cands)


def test_all_to_all_flattening_needs_heads_that_split():
    cu = pack_batches("full", 16384, 1, 0)[0]
    # 12 q heads cannot split over 8 ranks: "auto" compares 1x8 with 2x4 only; forced, it is an error
    kw = dict(num_heads=12, num_kv_heads=4, head_dim=128, hardware="a100")
    plan = compile_plan(cu, 4, 2, **kw)
    assert (plan.intra_size, plan.inter_size) in ((2, 4), (1, 8))
    with pytest.raises(ConfigError, match="num_heads=12 is not divisible by intra_size=8"):
        compile_plan(cu, 4, 2, flatten="all-to-all", **kw)
    # P_inter 1: nothing to flatten this way
    assert compile_plan(cu, 1, 8, flatten="all-to-all", **MHA).options.flattened_from is None


def test_flattened_plan_options_and_layout():
    cu = pack_batches("ultrachat", 32768, 1, 1)[0]
    for intra, inter in ((2, 4), (4, 2), (8, 1)):
        # a pinned head-chunk count would pin the configured all-to-all the forced flattening replaces (it was dropped)
        for flatten in ("always", "all-to-all"):
            with pytest.raises(ConfigError, match=f"head_chunks=2 pins the {intra}x{inter} plan's all-to-all, but flatten='{flatten}'"):
                compile_plan(cu, inter, intra, flatten=flatten, head_chunks=2, **MHA)
        plan = compile_plan(cu, inter, intra, flatten="always", **MHA)
        o = plan.options
        assert (o.intra_size, o.inter_size, o.flattened_from, o.head_chunks, o.flatten) == (1, 8, (intra, inter), None, "never")
        assert plan.head_chunks == 1 and plan.stats().flattened_from == (intra, inter)
        plan.verify()
        ids = np.concatenate([plan.local_token_indices(c) for c in range(8)])
        assert np.array_equal(np.sort(ids), np.arange(plan.padded_tokens)), "every token on exactly one CP rank"
    for intra, inter in ((1, 8), (2, 4), (4, 2)):
        plan = compile_plan(cu, inter, intra, flatten="all-to-all", **MHA)
        o = plan.options
        assert (o.intra_size, o.inter_size, o.flattened_from, o.flatten) == (8, 1, (intra, inter), "never")
        assert plan.chosen.fwd.messages == plan.chosen.bwd.messages == () and plan.stats().flattened_from == (intra, inter)
        plan.verify()
        ids = np.concatenate([plan.local_token_indices(c) for c in range(8)])
        assert np.array_equal(np.sort(ids), np.arange(plan.padded_tokens)), "every token on exactly one CP rank"


def test_auto_never_flattens_across_nodes():
    cu = pack_batches("fineweb", 65536, 1, 0)[0]
    # the same batch that flattens inside one node: with an InfiniBand inter group, or 16 CP ranks
    # on 8-GPU nodes, the configured topology stays
    assert compile_plan(cu, 1, 8, flatten="auto", **MHA).options.flattened_from == (8, 1)
    assert compile_plan(cu, 4, 2, flatten="auto", link="ib", **MHA).options.flattened_from is None
    assert compile_plan(cu, 2, 8, flatten="auto", **MHA).options.flattened_from is None
    assert compile_plan(cu, 2, 8, flatten="always", **MHA).options.flattened_from == (8, 2)  # asked for
    assert compile_plan(cu, 8, 1, flatten="always", **MHA).options.flattened_from is None  # P_intra 1: nothing to flatten
    # a forced head-chunk count pins the all-to-all: "auto" keeps the configured topology
    assert compile_plan(cu, 1, 8, head_chunks=2, **MHA).options.flattened_from is None


def test_windowed_flattened_plan_keeps_its_window():
    cu = pack_batches("fineweb", 65536, 1, 2)[0]
    plan = compile_plan(cu, 1, 8, flatten="always", window_size=(1024, 0), **MHA)
    assert plan.options.window_size == (1024, 0) and plan.options.flattened_from == (8, 1)
    full = compile_plan(cu, 1, 8, flatten="always", **MHA)
    assert plan.chosen.time <= full.chosen.time  # the window only removes work


def test_flatten_cache_and_validation():
    cu = [0, 100, 900, 1024]
    a = compile_plan(cu, 2, 2, num_heads=8, head_dim=16, flatten="always")
    assert compile_plan(cu, 2, 2, num_heads=8, head_dim=16, flatten="always") is a
    assert compile_plan(cu, 2, 2, num_heads=8, head_dim=16, flatten="never").options.flattened_from is None
    with pytest.raises(ConfigError, match="flatten='sometimes' is unknown"):
        compile_plan(cu, 2, 2, num_heads=8, head_dim=16, flatten="sometimes")
    with pytest.raises(ConfigError, match="flattened_from"):
        compile_plan(cu, 4, 1, num_heads=8, head_dim=16, flattened_from=(2, 3))
    with pytest.raises(ConfigError, match="flattened_from"):  # a two-level plan is never a flattened one
        compile_plan(cu, 2, 2, num_heads=8, head_dim=16, flattened_from=(1, 4))
    with pytest.raises(ConfigError, match="flattened_from"):  # nor flattened from itself
        compile_plan(cu, 1, 4, num_heads=8, head_dim=16, flattened_from=(4, 1))
    b = compile_plan(cu, 2, 2, num_heads=8, head_dim=16, flatten="all-to-all")
    assert b is compile_plan(cu, 2, 2, num_heads=8, head_dim=16, flatten="all-to-all") and b.hash != a.hash


def test_flattened_plan_hash_names_its_groups():
    # the same 1 x 4 programs compiled directly and flattened from 2x2 run on different groups
    cu = [0, 100, 900, 1024]
    flat = compile_plan(cu, 2, 2, num_heads=8, head_dim=16, flatten="always")
    plain = compile_plan(cu, 4, 1, num_heads=8, head_dim=16)
    assert flat.chosen.fwd.programs == plain.chosen.fwd.programs
    assert flat.hash != plain.hash
    # the knob itself is not hashed: a plan "auto" kept as configured hashes as "never"'s
    kept = compile_plan(cu, 2, 2, num_heads=8, head_dim=16, flatten="auto", link="ib")
    never = compile_plan(cu, 2, 2, num_heads=8, head_dim=16, flatten="never", link="ib")
    assert kept.options.flattened_from is None and kept.hash == never.hash


def test_simulator_runs_a_flattened_plan_only_on_its_topology():
    from megatron_hsap.sim.cluster import Cluster
    from megatron_hsap.sim.config import sim_hardware
    from megatron_hsap.sim.hsap import hsap_workload

    plan = compile_plan([0, 100, 900, 1024], 2, 2, num_heads=8, head_dim=16, flatten="always")
    with pytest.raises(ConfigError, match=r"Cluster\(intra_size=1, inter_size=4\)"):
        hsap_workload(plan, Cluster(hw=sim_hardware("a100"), intra_size=2, inter_size=2), "fwd")
    _, ranks = hsap_workload(plan, Cluster(hw=sim_hardware("a100"), intra_size=1, inter_size=4), "fwd")
    assert list(ranks) == [0, 1, 2, 3]
    plan = compile_plan([0, 100, 900, 1024], 4, 1, num_heads=8, head_dim=16, flatten="all-to-all")
    with pytest.raises(ConfigError, match=r"Cluster\(intra_size=4, inter_size=1\)"):
        hsap_workload(plan, Cluster(hw=sim_hardware("a100"), intra_size=1, inter_size=4), "fwd")
    hsap_workload(plan, Cluster(hw=sim_hardware("a100"), intra_size=4, inter_size=1), "fwd")


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(0, 3000), min_size=1, max_size=10), p=st.sampled_from([2, 4, 8]),
       heads=st.sampled_from([(8, 8), (8, 2), (16, 1), (32, 8)]), mla=st.booleans(), fp32=st.booleans(),
       hardware=st.sampled_from(["a100", "h100"]), window=st.sampled_from([None, (64, 0)]))
def test_the_all_to_all_floor_bounds_every_one_all_to_all_plan(lens, p, heads, mla, fp32, hardware, window):
    """``chunks.a2a_layer_floor`` (the all-to-alls alone, from the options) is never above the
    layer time the estimate gives the ``P × 1`` plan (``flatten="all-to-all"``), whatever the chunk
    count it chose; ``compile_plan`` skips that plan on it (``flatten.a2a_cannot_win``)."""
    from megatron_hsap.plan.chunks import a2a_layer_floor
    from megatron_hsap.plan.hardware import HARDWARE

    cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
    if cu[-1] == 0:
        cu[-1] = 1
    kw = dict(num_heads=heads[0], num_kv_heads=heads[1], head_dim=192 if mla else 64, head_dim_v=128 if mla else None,
              dtype_bytes=4 if fp32 else 2, hardware=hardware, window_size=window)
    plan = compile_plan(cu, p, 1, flatten="all-to-all", **kw)
    assert (plan.intra_size, plan.inter_size) == (p, 1)
    floor = a2a_layer_floor(plan.options, plan.shape, plan.local_tokens, HARDWARE[hardware])
    assert 0 < floor <= plan.layer_time * (1 + 1e-12)


def test_auto_skips_the_all_to_all_plan_its_floor_rules_out(monkeypatch):
    """On the compile-budget batches (fineweb 64K over 8 ranks of one node) the ``8 × 1`` plan's
    all-to-alls alone (2.34 ms, H100) already exceed the SAP plan's layer time, so ``flatten="auto"``
    does not compile it — and keeps the plan it kept when it did (``flatten="never"``)."""
    import megatron_hsap.plan.plan as plan_mod
    from megatron_hsap.plan.chunks import a2a_layer_floor
    from megatron_hsap.plan.hardware import HARDWARE

    kw = dict(num_heads=32, num_kv_heads=8, head_dim=128, hardware="h100")
    compiled = []
    inner = plan_mod._compile_windowed
    monkeypatch.setattr(plan_mod, "_compile_windowed", lambda cu, o: compiled.append((o.intra_size, o.inter_size)) or inner(cu, o))
    for cu in pack_batches("fineweb", 65536, 2, 12345):
        compiled.clear()
        auto = compile_plan(cu, 8, **kw)
        assert compiled == [(1, 8)], "only the configured 1 x 8 plan is compiled"
        a2a = compile_plan(cu, 8, flatten="all-to-all", **kw)
        floor = a2a_layer_floor(a2a.options, a2a.shape, a2a.local_tokens, HARDWARE["h100"])
        assert auto.layer_time < floor <= a2a.layer_time
        assert auto.hash == compile_plan(cu, 8, flatten="never", **kw).hash
