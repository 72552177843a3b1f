"""plan/rank_path.py: the per-rank longest path of a phase, against hand-computed timelines.

Reference: the timelines below, worked by hand from the program order every rank runs
(``Post(k) · Compute(k) · Wait(k) · Merge(k)``, plan/codegen.py): a rank that exchanges nothing
with a slow rank runs ahead of it (a per-stage max over ranks would not), a transfer starts when
both ends have posted, a port carries its transfers as they start and shares itself among them
(a short one ends first), and the merges of received results come after the wait. (The same case against the simulator: tests/sim/test_estimate_accuracy.py.)"""

from __future__ import annotations

import numpy as np

from megatron_hsap.plan.rank_path import flows_of, pairs_of, path_finish, path_seconds, path_seconds_py, round_seconds, stack


def _flows(size: int, sends: list[tuple[int, int, int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """``flows_of`` of ``(round, src, dst, bytes)`` sends over link 0."""
    k, src, dst, v = (np.array([x[i] for x in sends]) for i in range(4)) if sends else (np.zeros(0),) * 4
    return flows_of(k, src, dst, np.zeros(len(k), dtype=np.int64), v, size)


def test_independent_ranks_run_ahead() -> None:
    # ranks 0 and 1 alternate slow/fast stages and never exchange: each ends at its own sum (3 s),
    # where a per-stage max over ranks would charge 2 + 2 = 4 s
    comp = np.array([[2.0, 1.0], [1.0, 2.0]])
    t = path_seconds(comp, None, *_flows(2, []), (1.0, 0.0), latency=0.5)
    assert t == 3.0  # why: sums of small integers are exact in floats


def test_transfer_starts_at_the_later_post_and_a_port_drains_its_transfers_as_they_start() -> None:
    # round 1: rank 0 (posts at 2 s) sends 1 s of bytes to rank 1 (posts at 1 s); rank 2 (posts at
    # 1 s) sends rank 1 another 1 s; latency 0.25 s, 1 byte/s.
    comp = np.array([[2.0, 0.5], [1.0, 0.5], [1.0, 0.5]])
    flows = _flows(3, [(1, 0, 1, 1.0), (1, 2, 1, 1.0)])
    # rank 1's receive port: 2 → 1 starts at 1.25, 0 → 1 at max(2, 1) + 0.25 = 2.25: it drains at
    # max(1.25 + 2, 2.25 + 1) = 3.25 (not 2.25 + 2: the first transfer is done when the second
    # starts). Rank 0 ends at 3.25 too (its compute ends at 2.5); rank 2 waits for rank 1's port
    # (3.25, an upper bound: the simulator ends its transfer at 2.25). Phase: 3.25
    t = path_finish(comp, None, *flows, (1.0, 0.0), 0.25)
    assert t.tolist() == [3.25, 3.25, 3.25]  # why: a few float adds of binary fractions, exact
    # merges after the wait: rank 1 merges 0.5 s after 3.25
    after = np.zeros((3, 2))
    after[1, 1] = 0.5
    assert path_seconds(comp, after, *flows, (1.0, 0.0), 0.25) == 3.75  # why: as above
    assert path_seconds_py(comp.tolist(), after.tolist(), flows[0].tolist(), flows[1].tolist(), (1.0, 0.0), 0.25) == 3.75


def test_a_short_transfer_at_a_busy_port_ends_before_the_port_drains() -> None:
    # rank 0 sends 1 byte to rank 1 and 9 bytes to rank 2 at once (1 byte/s, no latency): its send
    # port drains at 10 s, but the two share it (max-min fair, sim/engine.py) and the short one is
    # done at 2 s (1 byte at 1/2 byte/s). So rank 1 ends at 2 s, not 10; ranks 0 and 2 at 10 s.
    # Rank 3 then receives 4 bytes from rank 1 in round 1: from 2 s to 6 s.
    comp = np.zeros((4, 2))
    flows = _flows(4, [(0, 0, 1, 1.0), (0, 0, 2, 9.0), (1, 1, 3, 4.0)])
    t = path_finish(comp, None, *flows, (1.0, 0.0), 0.0)
    assert t.tolist() == [10.0, 6.0, 10.0, 6.0]  # why: sums of small integers, exact
    assert path_seconds_py(comp.tolist(), None, flows[0].tolist(), flows[1].tolist(), (1.0, 0.0), 0.0) == 10.0


def test_flows_sum_a_rounds_sends_per_pair_and_link() -> None:
    f, v = flows_of(np.array([1, 0, 1, 1, 0]), np.array([2, 1, 2, 0, 1]), np.array([0, 1, 0, 2, 0]), np.array([0, 0, 0, 1, 0]),
                    np.array([3.0, 5.0, 4.0, 6.0, 0.0]), 3)
    # the self-send and the empty send are dropped; the two 2 → 0 sends of round 1 add up
    assert f.tolist() == [[1, 2, 0, 0], [1, 0, 2, 1]] and v.tolist() == [7.0, 6.0]


def test_round_seconds_takes_the_busier_port_and_the_slower_class() -> None:
    sent = np.array([[[100.0]], [[0.0]]])  # [network, NVLink] x 1 rank x 1 round
    recv = np.array([[[50.0]], [[1000.0]]])
    # network max(100, 50) / 10 = 10 s; NVLink 1000 / 200 = 5 s
    assert round_seconds(sent, recv, 10.0, 200.0).tolist() == [[10.0]]
    assert round_seconds(sent[0], recv[0], 10.0).tolist() == [[10.0]]


def test_stacked_phases_price_like_each_alone() -> None:
    # two independent problems priced in one pass give each one's own finish times
    rng = np.random.default_rng(7)
    parts = []
    for size in (3, 5):
        comp, after = rng.random((size, 4)), rng.random((size, 4))
        src, dst = rng.integers(0, size, 12), rng.integers(0, size, 12)
        parts.append((comp, after, *flows_of(rng.integers(0, 4, 12), src, dst, rng.integers(0, 2, 12), rng.integers(1, 9, 12) * 1.0, size)))
    t = path_finish(*stack(parts), (3.0, 7.0), 0.1)
    assert t[:3].tolist() == path_finish(*parts[0], (3.0, 7.0), 0.1).tolist()  # why: the same float operations per rank
    assert t[3:].tolist() == path_finish(*parts[1], (3.0, 7.0), 0.1).tolist()
    py = path_seconds_py(*(x.tolist() for x in parts[1]), (3.0, 7.0), 0.1)
    assert py == float(t[3:].max())  # why: the loop form makes the same operations on the same values


def test_pairs_are_both_directions_once_without_self_pairs() -> None:
    p = pairs_of(np.array([0, 0, 1, 1]), np.array([2, 2, 1, 0]), np.array([0, 0, 1, 1]), 3)
    assert p.tolist() == [[0, 0, 2], [0, 2, 0], [1, 0, 1], [1, 1, 0]]


def test_a_lone_network_transfer_runs_at_nccls_per_peer_channels() -> None:
    # NDR H100 (NIC 48 GB/s): NCCL drives one network peer with 2 channels of 14 GB/s up to 32
    # ranks (plan/hardware.net_flow_bw), 1 from 33. Round 0, latency 0, nothing computes.
    from megatron_hsap.plan.hardware import H100, LinkClass

    assert H100.net_flow_bw(8) == 28e9 and H100.net_flow_bw(64) == 14e9  # why: 2 × 14e9 and 14e9, exact
    assert H100.flow_bandwidth(LinkClass.NVLINK, 64) == float("inf") and H100.flow_bandwidth(LinkClass.INFINIBAND, 8) == 28e9
    comp = np.zeros((3, 1))
    bws = (48e9, 370e9)
    # one flow 0 → 1 of 28 GB at P_inter 8: 28e9 / 28e9 = 1 s (the port alone would say 0.583 s)
    one = _flows(3, [(0, 0, 1, 28e9)])
    assert path_finish(comp, None, *one, bws, 0.0, H100.net_flow_bw(8)).tolist() == [1.0, 1.0, 0.0]  # why: exact quotients
    assert path_finish(comp, None, *one, bws, 0.0).tolist() == [28 / 48, 28 / 48, 0.0]  # why: the same division, uncapped
    # P_inter 64: one channel, 14 GB in 1 s
    half = _flows(3, [(0, 0, 1, 14e9)])
    assert path_finish(comp, None, *half, bws, 0.0, H100.net_flow_bw(64)).tolist() == [1.0, 1.0, 0.0]  # why: as above
    # two flows from rank 0 to two peers, 24 GB each: each alone would take 24/28 s, but rank 0's
    # send port carries 48 GB at 48 GB/s: port-bound, 1 s for both
    two = _flows(3, [(0, 0, 1, 24e9), (0, 0, 2, 24e9)])
    assert path_finish(comp, None, *two, bws, 0.0, 28e9).tolist() == [1.0, 1.0, 1.0]  # why: 48e9 / 48e9, exact
    # link 1 (NVLink between inter ranks on one node) is never capped: 37 GB at 370 GB/s
    nvl = flows_of(np.array([0]), np.array([0]), np.array([1]), np.array([1]), np.array([37e9]), 3)
    assert path_finish(comp, None, *nvl, bws, 0.0, 28e9).tolist() == [0.1, 0.1, 0.0]  # why: one division, as uncapped
    for flows in (one, half, two, nvl):  # the loop form: the same float operations
        for cap in (28e9, 14e9, float("inf")):
            assert path_seconds_py(comp.tolist(), None, flows[0].tolist(), flows[1].tolist(), bws, 1e-5, cap) == path_seconds(
                comp, None, *flows, bws, 1e-5, cap)


def test_capped_paths_equal_their_loop_form_and_never_undercut_the_uncapped() -> None:
    # random problems on both link classes, latencies and merges: path_finish and path_seconds_py
    # agree bit for bit with a cap and without, and a cap only lengthens a path; byte counts of 1-8
    # tie at most ports, and round 0's transfers all start together (the loop form's tie handling)
    rng = np.random.default_rng(11)
    for trial in range(200):
        size, n, m = int(rng.integers(2, 7)), int(rng.integers(1, 5)), int(rng.integers(1, 30))
        comp, after = rng.random((size, n)), (rng.random((size, n)) if trial % 2 else None)
        flows = flows_of(rng.integers(0, n, m), rng.integers(0, size, m), rng.integers(0, size, m), rng.integers(0, 2, m),
                         rng.integers(1, 9, m) * 1.0, size)
        bws, cap = (3.0, 7.0), float(rng.choice([1.0, 2.0, 2.5, 3.0, np.inf]))
        t = path_finish(comp, after, *flows, bws, 0.1, cap)
        py = path_seconds_py(comp.tolist(), None if after is None else after.tolist(), flows[0].tolist(), flows[1].tolist(), bws, 0.1, cap)
        assert py == float(t.max(initial=0.0))  # why: the same operations on the same values
        assert (t >= path_finish(comp, after, *flows, bws, 0.1)).all()
