"""Windowed peers (``baselines/windowed.py``) and ``window_quality --peers`` (issue 15 item 6).

References are brute force over token indices (sets of (row, key) pairs and of key tokens), never
the closed forms under test.
"""

from __future__ import annotations

import csv
import itertools

import numpy as np
import pytest

from megatron_hsap.baselines.flat import price_baseline
from megatron_hsap.baselines.windowed import banded_row_pairs, magi_dispatch, price_windowed
from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.hardware import HARDWARE, LinkClass
from megatron_hsap.plan.ir import Wire

SHAPE = HeadShape(num_heads=8, num_kv_heads=2, head_dim=16, head_dim_v=16, dtype_bytes=2)
HW = HARDWARE["a100"]
BATCHES = [[0, 37], [0, 5, 5, 40, 41, 64], [0, 13, 29, 30, 90, 100, 128], [0, 1, 2, 3, 70]]


def _kw(P: int, window) -> dict:
    return dict(world=P, window_size=window, shape=SHAPE, hardware=HW, link=LinkClass.NVLINK)


def _brute_keys(cu: list[int], left: int) -> list[list[int]]:
    """For every token i: the keys it attends to (own document, causal, within ``left``)."""
    out = []
    for s, e in zip(cu[:-1], cu[1:]):
        for i in range(s, e):
            lo = s if left < 0 else max(s, i - left)
            out.append(list(range(lo, i + 1)))
    return out


def test_banded_row_pairs_equals_brute_force() -> None:
    for n, left in itertools.product(range(0, 12), (-1, 0, 1, 3, 11, 50)):
        want = sum(min(i, left if left >= 0 else i) + 1 for i in range(n))
        assert banded_row_pairs(np.array([n]), left)[0] == want, (n, left)


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("left", [0, 1, 4, 9, 1000])
def test_te_allgather_swa_computes_each_ranks_zigzag_band_and_moves_the_full_gathers(P: int, left: int) -> None:
    for cu in BATCHES:
        cost = price_windowed("te_allgather_swa", cu, **_kw(P, (left, 0)))
        want = np.zeros(P)
        for s, e in zip(cu[:-1], cu[1:]):
            n = e - s
            c = -(-n // (2 * P))
            for r in range(P):
                rows = [i for i in range(n) if r * c <= i < (r + 1) * c or (2 * P - 1 - r) * c <= i < (2 * P - r) * c]
                want[r] += sum(min(i, left) + 1 for i in rows)
        assert np.array_equal(cost.work, want), (cu, P, left)
        full = price_baseline("allgather_kv_zigzag", cu, world=P, shape=SHAPE, hardware=HW, link=LinkClass.NVLINK)
        assert np.array_equal(cost.bytes_sent, full.bytes_sent) and np.array_equal(cost.bytes_recv, full.bytes_recv)
        if left >= max(np.diff(cu)):  # the window covers every document: the full-causal all-gather's time
            assert cost.time == pytest.approx(full.time, rel=1e-12)
        else:
            assert cost.time < full.time


def test_te_a2a_swa_is_te_a2a_bytes_with_banded_compute() -> None:
    from megatron_hsap.baselines.hierarchical import price

    cu = BATCHES[2]
    full = price("te_a2a", cu, intra=1, inter=2, shape=SHAPE, hardware=HW, link=LinkClass.NVLINK)
    wide = price_windowed("te_a2a_swa", cu, **_kw(2, (10_000, 0)))
    assert wide.time == pytest.approx(full.time, rel=1e-12) and np.array_equal(wide.bytes_sent, full.bytes_sent)
    narrow = price_windowed("te_a2a_swa", cu, **_kw(2, (3, 0)))
    total = sum(len(k) for k in _brute_keys(cu, 3))
    # documents of ≤ 60 tokens fit one 128 × 128 tile: the band saves pairs, not kernel time
    assert np.allclose(narrow.work, total / 2) and narrow.time == pytest.approx(full.time, rel=1e-12)
    long_full = price("te_a2a", [0, 4096], intra=1, inter=2, shape=SHAPE, hardware=HW, link=LinkClass.NVLINK)
    long_band = price_windowed("te_a2a_swa", [0, 4096], **_kw(2, (255, 0)))
    # one 4096-token document, one call per phase on H/P = 4 heads, A100's FA2 tile model (128 ×
    # 128 tiles, 0.8 tile of prologue per row tile): 32 row tiles, each visiting 4097/2/128 + 0.5
    # key tiles causal and (256·257/2 + 3840·256)/4096/128 + 0.5 with the window of 256 keys; the
    # all-to-alls and the launch are the same in both
    k = HW.kernel
    causal_tiles = 32 * (4097 / 2 / 128 + 0.5 + 0.8)
    band_tiles = 32 * ((256 * 257 / 2 + 3840 * 256) / 4096 / 128 + 0.5 + 0.8)
    for got_full, got_band, fpp, peak in ((long_full.fwd_time, long_band.fwd_time, SHAPE.fwd_flops_per_pair, k.fwd_peak),
                                          (long_full.bwd_time, long_band.bwd_time, SHAPE.bwd_flops_per_pair, k.bwd_peak)):
        want = (causal_tiles - band_tiles) * 128 * 128 * fpp / 2 / peak
        assert got_full - got_band == pytest.approx(want, rel=1e-9)
    assert price_windowed("te_a2a_swa", cu, **_kw(4, (3, 0))) is None  # 2 kv heads: TE's a2a needs P | Hkv


@pytest.mark.parametrize("P, chunk", [(2, 8), (3, 5), (4, 4)])
@pytest.mark.parametrize("left", [-1, 0, 2, 7, 30])
def test_magi_dispatch_areas_and_remote_keys_equal_brute_force(P: int, chunk: int, left: int) -> None:
    for cu in BATCHES:
        d = magi_dispatch(cu, P, left, chunk)
        n_chunks = -(-cu[-1] // (chunk * P)) * P
        assert len(d.owner) == n_chunks
        assert np.bincount(d.owner, minlength=P).max() <= -(-n_chunks // P)  # the min-heap's room rule
        keys = _brute_keys(cu, left)
        owner_of = lambda t: int(d.owner[t // chunk])  # noqa: E731
        area = np.zeros(P)
        remote = [set() for _ in range(P)]
        for i, ks in enumerate(keys):
            r = owner_of(i)
            area[r] += len(ks)
            remote[r].update(k for k in ks if owner_of(k) != r)
        assert np.array_equal(d.area, area), (cu, P, left)
        assert [len(s) for s in remote] == d.remote.tolist()
        served = np.zeros(P)
        for s in remote:
            for k in s:
                served[owner_of(k)] += 1
        assert np.array_equal(d.served, served)


def test_magi_swa_bytes_follow_the_remote_keys() -> None:
    cu = [0, 300, 1000, 1024]
    cost = price_windowed("magi_swa", cu, chunk_size=64, **_kw(4, (50, 0)))
    d = magi_dispatch(cu, 4, 50, 64)
    kv, dkv = SHAPE.token_bytes(Wire.KV), 4 * SHAPE.num_kv_heads * (SHAPE.head_dim + SHAPE.head_dim_v)  # dkv fp32
    assert np.array_equal(cost.bytes_recv, d.remote * kv * 2 + d.served * dkv)  # kv twice (fwd, bwd) + fp32 dkv back
    wide = price_windowed("magi_swa", cu, chunk_size=64, **_kw(4, (2000, 0)))
    full = price_windowed("magi_swa", cu, chunk_size=64, **_kw(4, None))
    assert np.array_equal(wide.bytes_recv, full.bytes_recv) and wide.time == full.time
    assert cost.bytes_recv.sum() < full.bytes_recv.sum()  # the window cuts what is fetched


def test_price_windowed_refuses_bad_input() -> None:
    with pytest.raises(ConfigError, match="right=2 would attend to later keys"):
        price_windowed("magi_swa", [0, 10], **_kw(2, (4, 2)))
    with pytest.raises(ConfigError, match="unknown windowed peer"):
        price_windowed("te_p2p_swa", [0, 10], **_kw(2, (4, 0)))
    with pytest.raises(ConfigError, match="chunk_size"):
        price_windowed("magi_swa", [0, 10], chunk_size=0, **_kw(2, (4, 0)))


def test_measure_peers_rows_and_readme_table(tmp_path) -> None:
    from megatron_hsap.bench.window_quality import COLUMNS, measure_peers, peers_markdown

    rows = measure_peers(256, 1, points=((4096, 2),), workloads=("full",), simulate=True)
    methods = {r[8] for r in rows}
    assert methods == {"hsap-full", "hsap-window", "te_allgather_swa", "te_a2a_swa", "magi_swa",
                       "te_allgather_full", "te_a2a_full", "magi_full"}
    get = {(r[6], r[8], r[9]): r[10] for r in rows}
    for heads in ("32/32", "32/8"):
        # one 4K document, window 256: every method's windowed figure is below its full-causal one
        assert get[(heads, "hsap-window", "estimated_time")] < get[(heads, "hsap-full", "estimated_time")]
        assert get[(heads, "magi_swa", "bytes_per_rank")] < get[(heads, "magi_full", "bytes_per_rank")]
        assert get[(heads, "te_allgather_swa", "bytes_per_rank")] == get[(heads, "te_allgather_full", "bytes_per_rank")]
        assert get[(heads, "hsap-window", "simulated_time")] > 0
    path = tmp_path / "windows_peers.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(rows)
    table = peers_markdown(path)
    assert table == peers_markdown(rows)  # the CSV's strings give the same table
    lines = table.strip().splitlines()
    assert len(lines) == 4 and lines[2].startswith("| full | 4K, 2 | 32/32 |")
    ratio = get[("32/32", "te_allgather_swa", "estimated_time")] / get[("32/32", "hsap-window", "estimated_time")]
    assert f"{ratio:.2f}," in lines[2]


@pytest.mark.parametrize("P, chunk", [(2, 8), (3, 5), (4, 4)])
@pytest.mark.parametrize("left", [-1, 0, 2, 7, 30])
def test_magi_blocks_equal_brute_force(P: int, chunk: int, left: int) -> None:
    """Each rank's host / remote ffa blocks: per (chunk, document) piece of its q rows, the rows
    that see a key of that side, the distinct such keys and the pairs, by sets of key tokens."""
    from megatron_hsap.baselines.windowed import magi_blocks

    for cu in BATCHES:
        d = magi_dispatch(cu, P, left, chunk)
        keys = _brute_keys(cu, left)
        doc = np.searchsorted(cu, np.arange(cu[-1]), side="right") - 1
        got = magi_blocks(cu, d, left)
        for r in range(P):
            pieces: dict[tuple[int, int], list[int]] = {}
            for i in range(cu[-1]):
                if d.owner[i // chunk] == r:
                    pieces.setdefault((i // chunk, int(doc[i])), []).append(i)
            want = [[], [], [], [], [], []]
            for rows in pieces.values():
                for side in (0, 1):  # host: keys rank r holds; remote: keys of other ranks
                    mine = [[k for k in keys[i] if (d.owner[k // chunk] == r) == (side == 0)] for i in rows]
                    want[3 * side].append(sum(1 for m in mine if m))
                    want[3 * side + 1].append(len(set().union(*map(set, mine))))
                    want[3 * side + 2].append(sum(len(m) for m in mine))
            for g, w in zip(got[r], want):
                assert g.tolist() == w, (cu, P, left, r)


def test_magi_swa_stages_by_hand(unit_merge_bytes) -> None:
    """Two ranks, 8-token chunks, one 32-token document, window of 7 keys, KERNEL_TOY (4 × 4 tiles,
    half a tile of prologue per row tile, 1 s launches, 1 B/s and 0.5 s per transfer, kernels
    1.5× slower beside one, 2 s per dk+dv row summed)."""
    from tests.baselines.test_flat import KERNEL_TOY, ONE

    cu = [0, 32]
    d = magi_dispatch(cu, 2, 7, 8)
    # areas 36, 64, 64, 64: chunk 1 -> rank 0, chunk 2 -> rank 1, chunk 3 -> rank 0 (tie), chunk 0 -> rank 1
    assert d.owner.tolist() == [1, 0, 1, 0]
    # rank 0 (rows 8..15, 24..31) fetches rank 1's keys 1..7 and 17..23 (14), serves 9..15 (7)
    assert d.remote.tolist() == [14.0, 7.0] and d.served.tolist() == [7.0, 14.0]
    cost = price_windowed("magi_swa", cu, world=2, window_size=(7, 0), shape=ONE, hardware=KERNEL_TOY,
                          link=LinkClass.NVLINK, chunk_size=8)
    # host blocks (a chunk's 8 rows × its own 8 keys, 36 pairs): 2 row tiles × (1.625 + 0.5) × 16 = 68 s;
    # remote blocks (7 rows × 7 fetched keys, 28 pairs): 2 × (1.5 + 0.5) × 16 = 64 s. Rank 0: two
    # of each; rank 1: two host blocks, one remote (chunk 0 sees only its own keys). One launch per call.
    host = [2 * 68 + 1, 2 * 68 + 1]
    remote = [2 * 64 + 1, 64 + 1]
    fetch = [14 * 2, 14 * 2]  # max(sent, received) tokens × 2 B of k + v (1 B each)
    reduce = [14 * 8, 14 * 8]  # fp32 dk + dv: 8 B per token
    summed = [7 * 2, 14 * 2]  # the rows a rank serves, summed into its dk/dv
    fwd = max(max((host[r] - 1) * 1.5 + 1, fetch[r]) + 0.5 + remote[r] for r in (0, 1))
    bwd = max(max((host[r] - 1) * 1.5 + 1, fetch[r]) + 0.5 + remote[r] + reduce[r] + 0.5 + summed[r] for r in (0, 1))
    assert (fwd, bwd) == (334.5, 461.0)
    assert cost.fwd_time == pytest.approx(fwd, rel=1e-12)
    assert cost.bwd_time == pytest.approx(bwd, rel=1e-12)


@pytest.mark.parametrize("method", ["te_allgather_swa", "te_a2a_swa", "magi_swa"])
def test_windowed_peers_never_below_perfect_kernels(method: str) -> None:
    """The kernel-model price of each windowed peer is at least the same schedule's with perfect
    kernels (every block at the model's peak, no launch, merge bytes or slowdown); bytes equal."""
    from tests.baselines.test_hierarchical import _perfect
    from megatron_hsap.plan.workloads import pack_batches

    for cu in (pack_batches("fineweb", 32768, 1, 0)[0], [0, 32768]):
        for shape in (SHAPE, HeadShape(num_heads=32, num_kv_heads=8, head_dim=128, head_dim_v=128, dtype_bytes=2)):
            kw = dict(world=2, window_size=(4096, 0), shape=shape, link=LinkClass.NVLINK)  # 2 | Hkv (TE a2a)
            got = price_windowed(method, cu, hardware=HW, **kw)
            low = price_windowed(method, cu, hardware=_perfect(HW), **kw)
            assert got.fwd_time > low.fwd_time and got.bwd_time > low.bwd_time, (method, shape)
            np.testing.assert_array_equal(got.bytes_sent, low.bytes_sent)
