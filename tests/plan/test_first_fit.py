"""Receive-pool slot allocation (``plan/codegen.py`` ``_first_fit``, docs/design.md §2.1 step 4).

Property: every request gets the LOWEST 256-byte-aligned offset at which it overlaps no slot whose
closed lifetime meets its own, requests taken by (start, larger first, key) — checked against a
brute-force reference that tries every candidate offset (0 and each live slot's end) — and no two
slots live at the same time overlap. The allocator's shortcuts (pruning once per start time, the
widest-gap test) must not change one offset.
"""

from __future__ import annotations

import random

import pytest

from megatron_hsap.plan.codegen import ALIGN, PoolOverflow, _first_fit


def _reference(requests: list[tuple[int, int, int, int]], capacity: int) -> tuple[dict[int, int], int]:
    placed: list[tuple[int, int, int, int]] = []  # (t0, t1, offset, end)
    out: dict[int, int] = {}
    peak = 0
    for t0, t1, nbytes, key in sorted(requests, key=lambda r: (r[0], -r[2], r[3])):
        size = -(-nbytes // ALIGN) * ALIGN
        live = [(o, e) for a, b, o, e in placed if b >= t0 and a <= t1]
        for off in sorted({0, *(e for _, e in live)}):
            if all(off + size <= o or off >= e for o, e in live):
                break
        if off + size > capacity:
            raise PoolOverflow("reference")
        placed.append((t0, t1, off, off + size))
        out[key] = off
        peak = max(peak, off + size)
    return out, peak


def _requests(rng: random.Random, n: int) -> list[tuple[int, int, int, int]]:
    out = []
    for key in range(n):
        k = rng.randrange(0, 12)
        t1 = 2 * k + rng.choice((1, 3))  # a received result lives [2k, 2k+1]; an input [2k, 2k+3]
        out.append((2 * k, t1, rng.choice((1, 100, ALIGN, 3 * ALIGN + 7, rng.randrange(1, 40_000))), key))
    return out


@pytest.mark.parametrize("seed", range(60))
def test_first_fit_is_the_lowest_fitting_offset(seed: int) -> None:
    rng = random.Random(seed)
    reqs = _requests(rng, rng.randrange(1, 120))
    slots, peak = _first_fit(reqs, 1 << 40)
    want, want_peak = _reference(reqs, 1 << 40)
    assert {k: s.offset for k, s in slots.items()} == want
    assert peak == want_peak
    by_key = {r[3]: r for r in reqs}
    for a in slots:
        for b in slots:
            if a < b and by_key[a][0] <= by_key[b][1] and by_key[b][0] <= by_key[a][1]:
                sa, sb = slots[a], slots[b]
                assert sa.offset + sa.nbytes <= sb.offset or sb.offset + sb.nbytes <= sa.offset


def test_first_fit_overflow_matches_reference() -> None:
    rng = random.Random(7)
    reqs = _requests(rng, 200)
    _, peak = _reference(reqs, 1 << 40)
    _first_fit(reqs, peak)  # exactly the peak fits
    with pytest.raises(PoolOverflow):
        _first_fit(reqs, peak - 1)
