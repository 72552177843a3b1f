"""Document-length distributions and packed micro-batches (``shared/workloads.md``).

Names (exactly as in code and result files): ``fineweb``, ``fineweb-edu``, ``slimpajama``
(a mixture), ``ultrachat``, ``sharegpt`` (empirical: 17,545 real ShareGPT conversations tokenized
with the Llama-3 tokenizer, vendored in ``data/``) and ``full`` (one document filling the batch).
Lognormal fits use ``mu = ln(mean) - sigma**2 / 2`` so that the *mean* is the published one;
sampled lengths are rounded and clipped to >= 1.

Packing follows Megatron's GPT dataset: documents are drawn in order and concatenated into one
stream; micro-batch ``k`` is tokens ``[k*T, (k+1)*T)`` of it, so a document longer than what is
left is cut and its tail starts the next micro-batch (a document longer than ``T`` spans several).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_hsap.errors import ConfigError

__all__ = [
    "WORKLOADS",
    "LognormalPart",
    "sample_lengths",
    "mean_length",
    "pack_batches",
    "sharegpt_lengths",
]

WORKLOADS = ("fineweb", "fineweb-edu", "slimpajama", "ultrachat", "sharegpt", "full")

SHAREGPT_FILE = Path(__file__).parent / "data" / "sharegpt_llama3_token_lengths.txt"

# Documents drawn per call of the generator while packing. Fixed, so the stream for one seed does
# not depend on how many batches are asked for (batch k is the same for any num_batches > k).
_DRAW_BLOCK = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class LognormalPart:
    """One lognormal component: ``mean`` tokens, shape ``sigma``, ``share`` of the documents."""

    mean: float
    sigma: float
    share: float = 1.0
    source: str = ""

    @property
    def mu(self) -> float:
        return math.log(self.mean) - self.sigma**2 / 2


# workloads.md, "Document-length distributions". SlimPajama shares are per document; as published
# they sum to 1.008 and are normalised when sampling (mean ≈ 1,136 tokens, "~1,140" in the table).
_LOGNORMAL: dict[str, tuple[LognormalPart, ...]] = {
    "fineweb": (LognormalPart(mean=673, sigma=1.05, source="FineWeb sample-10BT"),),
    "fineweb-edu": (LognormalPart(mean=1034, sigma=0.95, source="FineWeb-Edu sample-10BT"),),
    "slimpajama": (
        LognormalPart(mean=480, sigma=0.95, share=0.54, source="C4"),
        LognormalPart(mean=2000, sigma=1.1, share=0.34, source="CommonCrawl"),
        LognormalPart(mean=700, sigma=1.28, share=0.05, source="Wikipedia"),
        LognormalPart(mean=650, sigma=1.0, share=0.05, source="StackExchange"),
        LognormalPart(mean=2000, sigma=1.4, share=0.025, source="GitHub"),
        LognormalPart(mean=17000, sigma=0.6, share=0.0026, source="ArXiv"),
        LognormalPart(mean=110000, sigma=0.6, share=0.0004, source="Books"),
    ),
    "ultrachat": (LognormalPart(mean=1400, sigma=0.6, source="UltraChat-200k train_sft (estimate)"),),
}


def _check_name(name: str) -> str:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return name


@functools.lru_cache(maxsize=1)
def sharegpt_lengths() -> np.ndarray:
    """The 17,545 ShareGPT conversation lengths (Llama-3 tokens), int64 ``[17545]``, read-only."""
    try:
        text = SHAREGPT_FILE.read_text()
    except OSError as exc:
        raise ConfigError(
            f"cannot read {SHAREGPT_FILE} ({exc}); reinstall megatron-hsap so its package data is present"
        ) from exc
    lengths = np.array(text.split(), dtype=np.int64)
    if lengths.size == 0 or (lengths < 1).any():
        raise ConfigError(f"{SHAREGPT_FILE} must hold one positive integer per line")
    lengths.setflags(write=False)
    return lengths


def mean_length(name: str) -> float:
    """Mean document length of a distribution (before rounding); ``full`` has none (it is ``T``)."""
    _check_name(name)
    if name == "sharegpt":
        return float(sharegpt_lengths().mean())
    if name == "full":
        raise ConfigError("workload 'full' is one document of T tokens; its mean is the batch size T")
    parts = _LOGNORMAL[name]
    return sum(p.share * p.mean for p in parts) / sum(p.share for p in parts)


def sample_lengths(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``n`` document lengths (int64 ``[n]``, every entry >= 1) from workload ``name``.

    ``full`` has no length distribution (its one document is as long as the batch): use
    ``pack_batches``.
    """
    _check_name(name)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ConfigError(f"n must be an integer >= 0, got {n!r}")
    if name == "full":
        raise ConfigError("workload 'full' is one document filling the batch; use pack_batches('full', T, ...)")
    if name == "sharegpt":
        data = sharegpt_lengths()
        return data[rng.integers(0, data.size, size=int(n))].astype(np.int64)
    parts = _LOGNORMAL[name]
    if len(parts) == 1:
        mu = np.float64(parts[0].mu)
        sigma = np.float64(parts[0].sigma)
    else:
        shares = np.array([p.share for p in parts], dtype=np.float64)
        pick = rng.choice(len(parts), size=int(n), p=shares / shares.sum())
        mu = np.array([p.mu for p in parts])[pick]
        sigma = np.array([p.sigma for p in parts])[pick]
    raw = rng.lognormal(mean=mu, sigma=sigma, size=int(n))
    return np.maximum(np.rint(raw), 1).astype(np.int64)


def pack_batches(
    name: str,
    T: int,
    num_batches: int,
    seed: int,
    *,
    max_doc_fraction: float | None = None,
) -> list[np.ndarray]:
    """Pack ``num_batches`` micro-batches of ``T`` tokens from workload ``name``.

    Returns one global ``cu_seqlens`` per batch: int64 ``[n_docs + 1]``, starting at 0, ending at
    ``T``, non-decreasing. Documents are drawn in order from ``np.random.default_rng(seed)``; a
    document that does not fit is cut and its tail opens the next batch (Megatron GPT dataset).
    ``max_doc_fraction`` (e.g. 0.25, MagiAttention's protocol) first truncates every document to
    at most ``floor(T * max_doc_fraction)`` tokens (the rest of it is dropped). ``full`` gives
    ``[0, T]`` (or, with ``max_doc_fraction``, back-to-back documents of the capped length).
    """
    _check_name(name)
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
        raise ConfigError(f"T (tokens per micro-batch) must be an integer >= 1, got {T!r}")
    if isinstance(num_batches, bool) or not isinstance(num_batches, (int, np.integer)) or num_batches < 0:
        raise ConfigError(f"num_batches must be an integer >= 0, got {num_batches!r}")
    T = int(T)
    cap = T
    if max_doc_fraction is not None:
        if not 0.0 < float(max_doc_fraction) <= 1.0:
            raise ConfigError(f"max_doc_fraction must be in (0, 1], got {max_doc_fraction!r}")
        cap = max(1, int(math.floor(T * float(max_doc_fraction))))
    total = T * int(num_batches)
    if name == "full":
        ends = np.arange(cap, total + cap, cap, dtype=np.int64)
    else:
        rng = np.random.default_rng(seed)
        blocks: list[np.ndarray] = []
        drawn = 0
        while drawn < total:
            block = sample_lengths(name, _DRAW_BLOCK, rng)
            if max_doc_fraction is not None:
                block = np.minimum(block, cap)
            blocks.append(block)
            drawn += int(block.sum())
        ends = np.cumsum(np.concatenate(blocks)) if blocks else np.zeros(0, dtype=np.int64)
    out = []
    for k in range(int(num_batches)):
        lo, hi = k * T, (k + 1) * T
        # document ends strictly inside (lo, hi) are this batch's inner boundaries
        inner = ends[np.searchsorted(ends, lo, side="right") : np.searchsorted(ends, hi, side="left")]
        out.append(np.concatenate(([0], inner - lo, [T])).astype(np.int64))
    return out
