"""The peers' benchmark protocols as they published them: batches, shapes and FLOP conventions.

MagiAttention (SandAI-org/MagiAttention ``exps/dist_attn/run_benchmark.py`` with
``exps/dist_attn/benchmark/utils.py`` ``DatasetSampler`` and ``benchmark/metric.py``):

* lengths: its binned histogram ``benchmark/datasets/default/doc_length_distribution.csv``
  (shipped as ``megatron_hsap/plan/data/magiattention_doc_length_distribution.csv``); every
  document of a bin has the bin's midpoint ``(left + right) // 2`` (``load_binned_distribution_len``);
* chunking: a document longer than ``chunk_len = T · 0.25`` becomes ``⌊l / chunk_len⌋`` chunks of
  ``chunk_len`` plus its tail (split, never truncated); all pieces are shuffled;
* packing: pieces fill packs of ``T = 8K × GPUs`` tokens in order; a piece that does not fit is
  cut and its rest starts the next pack (``pack_with_shuffle``);
* shape: GQA 64 q heads : 8 kv heads, head dim 128, bf16, H100, FA3-class kernels;
* FLOPs: ``4 · area · H_q · d`` forward (area = unmasked (q, k) pairs), backward 2.5× that
  (``calculate_attn_flops``) — the same convention as ``sim.methods.useful_flops``.

The whole histogram (13.4M documents) is flattened and shuffled there; drawing documents i.i.d.
with the bins' weights is the same distribution. Not modelled: the ``split_alignment`` rounding
of lengths for its native group-collective backend (a few tokens per document).
"""

from __future__ import annotations

import csv
from functools import lru_cache
from importlib import resources

import numpy as np

from megatron_hsap.plan.costs import HeadShape

__all__ = ["MAGI_TOKENS_PER_GPU", "MAGI_CHUNK_RATIO", "MAGI_GPUS", "magi_shape", "magi_histogram", "magi_batches",
           "MAGI_DATA", "MAGI_SOURCE"]

MAGI_TOKENS_PER_GPU = 8192
MAGI_CHUNK_RATIO = 0.25
MAGI_GPUS = (8, 64)
MAGI_DATA = "magiattention_doc_length_distribution.csv"
MAGI_SOURCE = "SandAI-org/MagiAttention exps/dist_attn/benchmark/datasets/default/doc_length_distribution.csv"


def magi_shape() -> HeadShape:
    """GQA 64:8, head dim 128, bf16 (MagiAttention's benchmark_conf.py)."""
    return HeadShape(num_heads=64, num_kv_heads=8, head_dim=128, head_dim_v=128, dtype_bytes=2)


@lru_cache(maxsize=1)
def magi_histogram() -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, counts)``: bin midpoints and document counts of the shipped histogram (int64)."""
    text = resources.files("megatron_hsap.plan").joinpath("data", MAGI_DATA).read_text()
    rows = list(csv.reader(text.splitlines()))[1:]
    lengths, counts = [], []
    for rng, num, *_ in rows:
        left, right = rng.strip("[]").split(",")
        lengths.append((int(left) + int(right)) // 2)
        counts.append(int(num))
    return np.array(lengths, dtype=np.int64), np.array(counts, dtype=np.int64)


def magi_batches(T: int, n: int, seed: int, chunk_ratio: float = MAGI_CHUNK_RATIO) -> list[np.ndarray]:
    """``n`` packed batches of ``T`` tokens (global ``cu_seqlens``, int64) by MagiAttention's
    rule (module docstring); seeded and reproducible."""
    lengths, counts = magi_histogram()
    rng = np.random.default_rng(seed)
    chunk = int(T * chunk_ratio)
    mean = float((lengths * counts).sum() / counts.sum())
    need = int(n * T / mean * 1.5) + 64  # documents for ~1.5× the tokens of n packs
    while True:
        docs = rng.choice(lengths, size=need, p=counts / counts.sum())
        full = docs // chunk
        pieces = np.concatenate([np.full(int(full.sum()), chunk, dtype=np.int64), (docs % chunk)[docs % chunk > 0]])
        rng.shuffle(pieces)
        if pieces.sum() >= n * T:
            break
        need *= 2
    out, cur, tail, i = [], [], 0, 0
    while len(out) < n:
        left = T
        cur = [tail] if tail else []
        left -= tail
        tail = 0
        while left > 0:
            p = int(pieces[i])
            i += 1
            if p <= left:
                cur.append(p)
                left -= p
            else:
                cur.append(left)
                tail = p - left
                left = 0
        out.append(np.concatenate(([0], np.cumsum(cur))).astype(np.int64))
    return out
