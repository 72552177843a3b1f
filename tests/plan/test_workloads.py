"""Length distributions and packing against shared/workloads.md (numbers copied here by hand)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan import workloads
from megatron_hsap.plan.workloads import WORKLOADS, pack_batches, sample_lengths, sharegpt_lengths

SHARED_FILE = Path(__file__).resolve().parents[3] / "shared" / "workloads" / "sharegpt_llama3_token_lengths.txt"

# workloads.md's table: (mean, [(share, mean, sigma), ...]) — the test's own copy of the fits.
TABLE = {
    "fineweb": (673, [(1.0, 673, 1.05)]),
    "fineweb-edu": (1034, [(1.0, 1034, 0.95)]),
    "slimpajama": (
        1140,
        [
            (0.54, 480, 0.95),
            (0.34, 2000, 1.1),
            (0.05, 700, 1.28),
            (0.05, 650, 1.0),
            (0.025, 2000, 1.4),
            (0.0026, 17000, 0.6),
            (0.0004, 110000, 0.6),
        ],
    ),
    "ultrachat": (1400, [(1.0, 1400, 0.6)]),
}
# "~1,140" and "~1,400" are rounded in the table; 673 and 1,034 are totals / documents.
TABLE_ROUNDING = {"fineweb": 1.0, "fineweb-edu": 1.0, "slimpajama": 0.01 * 1140, "ultrachat": 0.01 * 1400}


def _mixture_sd(parts: list[tuple[float, float, float]]) -> float:
    """Standard deviation of a lognormal mixture: E[x²] = Σ w·mean²·exp(σ²)."""
    w = np.array([p[0] for p in parts]) / sum(p[0] for p in parts)
    m = np.array([p[1] for p in parts], dtype=np.float64)
    s = np.array([p[2] for p in parts])
    ex = (w * m).sum()
    return math.sqrt((w * m * m * np.exp(s * s)).sum() - ex**2)


def test_names_are_the_documented_ones() -> None:
    assert WORKLOADS == ("fineweb", "fineweb-edu", "slimpajama", "ultrachat", "sharegpt", "full")


@pytest.mark.parametrize("name", list(TABLE))
def test_lognormal_means_match_table(name: str) -> None:
    n = 200_000
    x = sample_lengths(name, n, np.random.default_rng(1))
    assert x.dtype == np.int64 and x.shape == (n,) and x.min() >= 1
    target, parts = TABLE[name]
    # 5 standard errors of the mean (from the table's own fit) plus the table's rounding
    tol = 5 * _mixture_sd(parts) / math.sqrt(n) + TABLE_ROUNDING[name]
    assert abs(x.mean() - target) < tol, (x.mean(), target, tol)


def test_fineweb_median_and_tail() -> None:
    x = sample_lengths("fineweb", 200_000, np.random.default_rng(2))
    # workloads.md: median ~388, p99 ~4.5k; 3% covers the sampling error of those quantiles
    assert abs(np.median(x) - 388) < 0.03 * 388
    assert abs(np.percentile(x, 99) - 4500) < 0.05 * 4500


def test_sharegpt_file_loads() -> None:
    data = sharegpt_lengths()
    assert data.shape == (17_545,)
    assert abs(data.mean() - 1428) < 1.0  # the table rounds the mean to a token
    assert np.median(data) == 1627 and data.max() == 161_288


@pytest.mark.skipif(not SHARED_FILE.exists(), reason="shared/ is not beside the checkout")
def test_vendored_sharegpt_matches_shared_copy() -> None:
    vendored = workloads.SHAREGPT_FILE.read_text().split()
    assert vendored == SHARED_FILE.read_text().split()


def test_sharegpt_samples_mean() -> None:
    data = sharegpt_lengths()
    n = 200_000
    x = sample_lengths("sharegpt", n, np.random.default_rng(3))
    assert set(np.unique(x)) <= set(np.unique(data))
    assert abs(x.mean() - data.mean()) < 5 * data.std() / math.sqrt(n)  # 5 standard errors


def test_full_has_no_length_distribution() -> None:
    with pytest.raises(ConfigError, match="pack_batches"):
        sample_lengths("full", 3, np.random.default_rng(0))


def test_unknown_workload_is_refused() -> None:
    with pytest.raises(ConfigError, match="fineweb"):
        pack_batches("c4", 1024, 1, 0)


@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("T", [1, 1000, 8192, 65536])
def test_packing_invariants(name: str, T: int) -> None:
    batches = pack_batches(name, T, 4, seed=7)
    assert len(batches) == 4
    for cu in batches:
        assert cu.dtype == np.int64
        assert cu[0] == 0 and cu[-1] == T
        assert (np.diff(cu) > 0).all()  # packing never emits empty documents


@pytest.mark.parametrize("name", WORKLOADS[:-1])
def test_packing_is_seeded(name: str) -> None:
    a = pack_batches(name, 16384, 3, seed=11)
    b = pack_batches(name, 16384, 3, seed=11)
    c = pack_batches(name, 16384, 3, seed=12)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    # batch k does not depend on how many batches were asked for
    longer = pack_batches(name, 16384, 5, seed=11)
    assert all(np.array_equal(x, y) for x, y in zip(a, longer[:3]))


def test_tails_carry_over(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = np.array([5, 12, 3, 30, 7, 4], dtype=np.int64)

    def fake(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.resize(stream, n)

    monkeypatch.setattr(workloads, "sample_lengths", fake)
    got = [cu.tolist() for cu in pack_batches("fineweb", 10, 7, seed=0)]
    # stream ends at 5, 17, 20, 50, 57, 61, 66, ...: the 12 is cut 5|7, the 30 spans three batches
    assert got == [[0, 5, 10], [0, 7, 10], [0, 10], [0, 10], [0, 10], [0, 7, 10], [0, 1, 6, 10]]


def test_documents_longer_than_the_batch_span_whole_batches() -> None:
    # SlimPajama at 8K: ArXiv (mean 17K) and Books (110K) documents fill whole micro-batches
    batches = pack_batches("slimpajama", 8192, 300, seed=0)
    assert any(cu.tolist() == [0, 8192] for cu in batches)


def test_max_doc_fraction_caps_documents() -> None:
    T = 8192
    for cu in pack_batches("slimpajama", T, 50, seed=0, max_doc_fraction=0.25):
        assert np.diff(cu).max() <= T // 4
    full = pack_batches("full", T, 2, seed=0, max_doc_fraction=0.25)
    assert [cu.tolist() for cu in full] == [[0, 2048, 4096, 6144, 8192]] * 2
    with pytest.raises(ConfigError, match="max_doc_fraction"):
        pack_batches("fineweb", T, 1, 0, max_doc_fraction=0.0)


def test_full_is_one_document() -> None:
    assert [cu.tolist() for cu in pack_batches("full", 65536, 3, seed=5)] == [[0, 65536]] * 3


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="T"):
        pack_batches("fineweb", 0, 1, 0)
    with pytest.raises(ConfigError, match="num_batches"):
        pack_batches("fineweb", 10, -1, 0)
    assert pack_batches("fineweb", 10, 0, 0) == []
