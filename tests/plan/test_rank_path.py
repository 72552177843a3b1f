"""plan/rank_path.py: the per-rank longest path of a phase, against hand-computed timelines.

Reference: the timelines below, worked by hand from the program order every rank runs
(``Post(k) · Compute(k) · Wait(k) · Merge(k)``, plan/codegen.py): a rank that exchanges nothing
with a slow rank runs ahead of it (a per-stage max over ranks would not), a transfer starts when
both ends have posted, and the merges of received results come after the wait."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsap.plan.rank_path import pairs_of, path_finish, path_seconds, round_seconds, stack


def _peers(n: int, size: int, pairs: dict[int, list[tuple[int, int]]]) -> np.ndarray:
    rows = [(k, a, b) for k, ps in pairs.items() for a, b in ps]
    k, a, b = (np.array([r[i] for r in rows], dtype=np.int64) for i in range(3)) if rows else (np.zeros(0, dtype=np.int64),) * 3
    return pairs_of(k, a, b, size)


def test_independent_ranks_run_ahead() -> None:
    # ranks 0 and 1 alternate slow/fast stages and never exchange: each ends at its own sum (3 s),
    # where a per-stage max over ranks would charge 2 + 2 = 4 s
    comp = np.array([[2.0, 1.0], [1.0, 2.0]])
    t = path_seconds(comp, None, np.zeros((2, 2)), _peers(2, 2, {}), latency=0.5)
    assert t == 3.0  # why: sums of small integers are exact in floats


def test_transfer_waits_for_the_later_post_and_the_busier_end() -> None:
    # round 1: rank 0 (posts at 2 s) sends to rank 1 (posts at 1 s); rank 1 also receives from rank 2
    # (posts at 1 s) so its port is busier: x = (1 s + 1 s) of bytes; latency 0.25 s.
    comp = np.array([[2.0, 0.5], [1.0, 0.5], [1.0, 0.5]])
    xfer = np.array([[0.0, 1.0], [0.0, 2.0], [0.0, 1.0]])
    peers = _peers(2, 3, {1: [(0, 1), (2, 1)]})
    # rank 1: pair (0, 1) starts max(2, 1) + 0.25 and takes max(1, 2) = 2 s -> 4.25; pair (2, 1) 1 + 0.25 + 2 = 3.25
    # rank 0: its own pair ends at 4.25 (after its 2.5 s compute); rank 2: 3.25. Phase: 4.25
    assert path_seconds(comp, None, xfer, peers, 0.25) == pytest.approx(4.25, rel=1e-15)  # why: a few float adds
    # merges after the wait: rank 1 merges 0.5 s after 4.25
    after = np.zeros((3, 2))
    after[1, 1] = 0.5
    assert path_seconds(comp, after, xfer, peers, 0.25) == pytest.approx(4.75, rel=1e-15)  # why: as above


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
        comp, after, xfer = rng.random((size, 4)), rng.random((size, 4)), rng.random((size, 4))
        src, dst = rng.integers(0, size, 12), rng.integers(0, size, 12)
        parts.append((comp, after, xfer, pairs_of(rng.integers(0, 4, 12), src, dst, size)))
    t = path_finish(*stack(parts), 0.1)
    assert t[:3].tolist() == path_finish(*parts[0], 0.1).tolist()  # why: the same float operations per rank
    assert t[3:].tolist() == path_finish(*parts[1], 0.1).tolist()


def test_pairs_are_both_directions_once_without_self_pairs() -> None:
    p = pairs_of(np.array([0, 0, 1, 1]), np.array([2, 2, 1, 0]), np.array([0, 0, 1, 1]), 3)
    assert p.tolist() == [[0, 0, 2], [0, 2, 0], [1, 0, 1], [1, 1, 0]]
