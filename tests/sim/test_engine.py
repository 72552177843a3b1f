"""The event engine against timelines computed by hand.

Toy network: NVLink 1 byte/s with 0.5 s per operation, InfiniBand 0.25 byte/s with 1 s; ranks
0-1 share a node, 2-3 another, so times below are plain arithmetic on those numbers.
"""

from __future__ import annotations

import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.hardware import LinkClass
from megatron_hsap.sim.engine import Busy, Collective, PostTag, TaggedTransfer, WaitTag, Workload, simulate

NV, IB = LinkClass.NVLINK, LinkClass.INFINIBAND
BW = {NV: 1.0, IB: 0.25}
LAT = {NV: 0.5, IB: 1.0}


def link(a: int, b: int) -> LinkClass:
    return NV if a // 2 == b // 2 else IB


def run(programs: list[list], transfers: list[TaggedTransfer]):
    return simulate(Workload(programs, transfers), link=link, bandwidth=BW.__getitem__, latency=LAT.__getitem__)


EXACT = dict(rel=1e-9, abs=1e-9)  # event times are sums of a few floats


def test_round_overlaps_compute() -> None:
    # Both ranks post round 0 at t=0: 4 bytes over NVLink take 0.5 + 4 = 4.5 s. Rank 0 computes
    # 3 s (communication exposed for 1.5 s), rank 1 computes 6 s (fully hidden).
    progs = [
        [PostTag(0), Busy(3.0), WaitTag(0)],
        [PostTag(0), Busy(6.0), WaitTag(0)],
    ]
    tl = run(progs, [TaggedTransfer(0, 1, 4.0, 0)])
    assert tl.finish[0] == pytest.approx(4.5, **EXACT)
    assert tl.finish[1] == pytest.approx(6.0, **EXACT)
    assert tl.busy("wait")[0] == pytest.approx(1.5, **EXACT)
    assert tl.busy("wait")[1] == 0.0


def test_latency_bound_rounds() -> None:
    # Ten back-to-back rounds of 1e-6 bytes each over InfiniBand: each costs the 1 s latency
    # (+ 4e-6 s of transfer), nothing to overlap.
    n = 10
    progs = [[x for k in range(n) for x in (PostTag(k), WaitTag(k))] for _ in range(4)]
    transfers = [TaggedTransfer(0, 2, 1e-6, k) for k in range(n)] + [TaggedTransfer(3, 1, 1e-6, k) for k in range(n)]
    tl = run(progs, transfers)
    assert tl.finish[0] == pytest.approx(n * (1.0 + 4e-6), rel=1e-6)
    assert tl.finish[3] == pytest.approx(n * (1.0 + 4e-6), rel=1e-6)


def test_pairwise_wait_depends_on_peer_post() -> None:
    # Rank 1 posts only after 5 s of compute: rank 0's transfer starts at 5 + 0.5, ends at 7.5.
    # Ranks 2 and 3 run their own round at t=0 over NVLink and are not held up by 0/1.
    progs = [
        [PostTag(0), WaitTag(0)],
        [Busy(5.0), PostTag(0), WaitTag(0)],
        [PostTag(0), WaitTag(0)],
        [PostTag(0), WaitTag(0)],
    ]
    tl = run(progs, [TaggedTransfer(0, 1, 2.0, 0), TaggedTransfer(2, 3, 2.0, 0)])
    assert tl.finish[0] == pytest.approx(7.5, **EXACT)
    assert tl.finish[1] == pytest.approx(7.5, **EXACT)
    assert tl.finish[2] == pytest.approx(2.5, **EXACT)
    assert tl.busy("wait")[0] == pytest.approx(7.5, **EXACT)


def test_wait_only_covers_own_transfers() -> None:
    # One round, three transfers: 0 -> 1 (1 byte) and 1 -> 0 (8 bytes) inside node 0, 2 -> 3
    # (1 byte) inside node 1. Ranks 0 and 1 both wait for the 8-byte one; 2 and 3 do not.
    progs = [[PostTag(0), WaitTag(0)] for _ in range(4)]
    tl = run(progs, [TaggedTransfer(0, 1, 1.0, 0), TaggedTransfer(1, 0, 8.0, 0), TaggedTransfer(2, 3, 1.0, 0)])
    assert tl.finish[0] == pytest.approx(8.5, **EXACT)
    assert tl.finish[1] == pytest.approx(8.5, **EXACT)
    assert tl.finish[2] == pytest.approx(1.5, **EXACT)


def test_ports_full_duplex_and_shared() -> None:
    # Opposite directions between two ranks do not share a port: 0.5 + 2 s each.
    tl = run([[PostTag(0), WaitTag(0)] for _ in range(2)], [TaggedTransfer(0, 1, 2.0, 0), TaggedTransfer(1, 0, 2.0, 0)])
    assert tl.finish.tolist() == pytest.approx([2.5, 2.5], **EXACT)
    # 2 -> 1 and 3 -> 1 cross nodes and share rank 1's 0.25 B/s InfiniBand receive port
    # (0.125 each: 1 + 8 s); 0 -> 1 over NVLink uses another port (0.5 + 2 s).
    tl3 = run([[PostTag(0), WaitTag(0)] for _ in range(4)], [TaggedTransfer(0, 1, 2.0, 0), TaggedTransfer(2, 1, 1.0, 0), TaggedTransfer(3, 1, 1.0, 0)])
    assert tl3.finish.tolist() == pytest.approx([2.5, 9.0, 9.0, 9.0], **EXACT)


def test_max_min_gives_leftover_to_unconstrained_flow() -> None:
    # One 8-GPU node. Rank 0 sends 1 byte to each of 1, 2, 3 (its port: 1/3 B/s each) and rank
    # 4 sends 2 bytes to 3. Rank 3's receive port has 2/3 left for the 4 -> 3 flow (max-min),
    # so everything ends at 0.5 + 3 s; equal shares (1/2 on rank 3's port) would end it at 4 s.
    flat = lambda a, b: NV  # noqa: E731
    progs = [[PostTag(0), WaitTag(0)] for _ in range(5)]
    transfers = [TaggedTransfer(0, 1, 1.0, 0), TaggedTransfer(0, 2, 1.0, 0), TaggedTransfer(0, 3, 1.0, 0), TaggedTransfer(4, 3, 2.0, 0)]
    tl = simulate(Workload(progs, transfers), link=flat, bandwidth=BW.__getitem__, latency=LAT.__getitem__)
    assert tl.finish[4] == pytest.approx(3.5, **EXACT)
    assert tl.finish[3] == pytest.approx(3.5, **EXACT)


def test_rounds_in_sequence() -> None:
    # Round 1 is posted only after round 0 completes: 0.5 + 1, then 0.5 + 3.
    progs = [[PostTag(0), WaitTag(0), PostTag(1), WaitTag(1)], [PostTag(0), WaitTag(0), PostTag(1), WaitTag(1)]]
    tl = run(progs, [TaggedTransfer(0, 1, 1.0, 0), TaggedTransfer(0, 1, 3.0, 1)])
    assert tl.finish[0] == pytest.approx(0.5 + 1.0 + 0.5 + 3.0, **EXACT)


def test_collective_leaves_together() -> None:
    progs = [[Busy(1.0), Collective(7, 2.0)], [Busy(3.0), Collective(7, 2.0)]]
    tl = run(progs, [])
    assert tl.finish.tolist() == pytest.approx([5.0, 5.0], **EXACT)
    assert tl.busy("sync")[0] == pytest.approx(2.0, **EXACT)


def test_deadlock_and_unposted_transfer_raise() -> None:
    with pytest.raises(ConfigError, match="must post tag"):
        run([[PostTag(0), WaitTag(0)], [WaitTag(1)]], [TaggedTransfer(0, 1, 1.0, 0)])
    with pytest.raises(ConfigError, match="deadlocked"):
        # rank 0 enters the collective before posting round 0; rank 1 waits on round 0 first
        run([[Collective(1, 0.0), PostTag(0), WaitTag(0)], [PostTag(0), WaitTag(0), Collective(1, 0.0)]], [TaggedTransfer(0, 1, 1.0, 0)])


def test_breakdown_terms_by_hand() -> None:
    # Rank 0 computes 5 s then sends 2 bytes to rank 1 (ready at 5, on the wire 5.5..7.5);
    # rank 1 computes 1 s, waits from 1 to 7.5, then merges 0.1 s: it is the critical rank.
    # Terms for rank 1 with ideal = 2 s: kernel efficiency 3 − 2, imbalance (1 − 3) + 4 s spent
    # waiting for rank 0 to post, latency 0.5, bytes in flight 2, merges 0.1 — summing to 7.6.
    from types import SimpleNamespace

    from megatron_hsap.sim.breakdown import phase_breakdown
    from megatron_hsap.sim.methods import PhaseRun

    progs = [[Busy(5.0), PostTag(0), WaitTag(0)], [Busy(1.0), PostTag(0), WaitTag(0), Busy(0.1, "merge")]]
    work = Workload(progs, [TaggedTransfer(0, 1, 2.0, 0)])
    tl = simulate(work, link=link, bandwidth=BW.__getitem__, latency=LAT.__getitem__)
    run = SimpleNamespace(fwd=PhaseRun(tl, work, [0, 1]))
    terms = phase_breakdown(run, "fwd", ideal_s=2.0, latency_s=0.5)
    assert terms == pytest.approx({"ideal": 2.0, "kernel_efficiency": 1.0, "imbalance": 2.0, "merges": 0.1,
                                   "all_to_all": 0.0, "latency": 0.5, "exposed_communication": 2.0}, **EXACT)
    assert sum(terms.values()) == pytest.approx(tl.makespan, **EXACT)


def test_side_stream_runs_beside_compute_and_slows_what_it_overlaps() -> None:
    from megatron_hsap.sim.engine import Join, Launch

    # Launch a (4 s) at 0; 1 s of compute; Launch b (4 s) queues behind a: [4, 8]; a 10 s kernel
    # from 1 overlaps a for 3 s and b for 4 s -> 10 + 0.5 × 7 = 13.5 s, ends at 14.5; b is done.
    tl = run([[Launch(0, 4.0), Busy(1.0), Launch(1, 4.0), Busy(10.0, overlap_slowdown=0.5), Join(1)]], [])
    assert tl.makespan == pytest.approx(14.5, **EXACT)
    side = [(s.start, s.end) for s in tl.spans if s.kind == "a2a_overlapped"]
    assert side == [(0.0, 4.0), (4.0, 8.0)]
    # joining before the side stream is done exposes the rest as an "a2a" span
    tl = run([[Launch(0, 4.0), Busy(1.0), Join(0), Busy(1.0)]], [])
    assert tl.makespan == pytest.approx(5.0, **EXACT)
    assert [(s.start, s.end) for s in tl.spans if s.kind == "a2a"] == [(1.0, 4.0)]
    with pytest.raises(ConfigError, match="before launching"):
        run([[Join(3)]], [])
