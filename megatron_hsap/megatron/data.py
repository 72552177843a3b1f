"""Packed micro-batches from megatron-core's own data pipeline, built from text available offline.

Corpus: the Python standard library's ``*.py`` sources (real text every Python install has), one
document per top-level block (module prelude, ``def``, ``class``), tokenized byte-wise
(:class:`ByteTokenizer`: bytes 0–255, ``EOD`` 256, ``PAD`` 257). Documents go into a megatron-core
``IndexedDataset`` (``.bin``/``.idx``); samples come from ``GPTDataset`` with
``inter_document_masking=True``, so every sample carries its documents' ``cu_seqlens`` — exactly the
packed batches Megatron-LM feeds THD attention with ``--dataloader-inter-document-masking``.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_hsap.errors import ConfigError

__all__ = ["ByteTokenizer", "CorpusInfo", "build_stdlib_corpus", "build_gpt_dataset", "micro_batch", "default_cache_dir",
           "source_documents", "stdlib_sources"]

_SPLIT_AT = re.compile(rb"^(?=(?:async\s+def|def|class)\s|@)", re.MULTILINE)


class ByteTokenizer:
    """Byte-level tokenizer with the attributes megatron-core's GPT dataset reads."""

    EOD = 256
    PAD = 257

    def __init__(self) -> None:
        self.vocab_size = 258
        self.eod = self.EOD
        self.eos = self.EOD
        self.pad = self.PAD
        self.special_tokens_dict = {"eod_token": self.EOD, "pad_token": self.PAD}
        # megatron-core hashes this into the dataset cache key.
        self.unique_identifiers = {"class": "megatron_hsap.ByteTokenizer", "vocab_size": self.vocab_size}

    def tokenize(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return list(data)

    def detokenize(self, ids: Any) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class CorpusInfo:
    """Where an indexed dataset lies and what it holds."""

    prefix: str  # path prefix of ``.bin``/``.idx``
    num_documents: int
    num_tokens: int
    source: str


def default_cache_dir() -> Path:
    root = os.environ.get("HSAP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "megatron-hsap")
    return Path(root)


def stdlib_sources(max_bytes: int) -> list[Path]:
    """This Python's top-level standard-library modules, in name order, until ``max_bytes``: the
    demo corpora's text (``build_stdlib_corpus``; ``cpu/sft.py``'s conversations)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(lib.glob("*.py")):  # top level only: deterministic and quick to read
        size = path.stat().st_size
        if size == 0:
            continue
        files.append(path)
        total += size
        if total >= max_bytes:
            break
    if not files:
        raise ConfigError(f"no Python sources found under {lib}; pass another corpus")
    return files


def source_documents(data: bytes, min_bytes: int, max_bytes: int) -> Iterator[bytes]:
    """Split one source file at top-level blocks; glue tiny blocks onto the next, cut huge ones."""
    starts = [m.start() for m in _SPLIT_AT.finditer(data)]
    bounds = sorted(set([0, *starts, len(data)]))
    pending = b""
    for a, b in zip(bounds[:-1], bounds[1:]):
        pending += data[a:b]
        if len(pending) < min_bytes:
            continue
        for cut in range(0, len(pending), max_bytes):
            yield pending[cut : cut + max_bytes]
        pending = b""
    if pending.strip():
        yield pending


def build_stdlib_corpus(out_dir: str | os.PathLike[str] | None = None, *, max_source_bytes: int = 2_000_000,
                        min_doc_bytes: int = 48, max_doc_bytes: int = 1024) -> CorpusInfo:
    """Write (once) an indexed dataset of standard-library source documents; returns its prefix.

    Idempotent and safe to call from several processes: files are written under temporary names
    and renamed into place; the name hashes the Python version and every option.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    files = stdlib_sources(max_source_bytes)
    key = hashlib.sha256(
        repr((sys.version, [f.name for f in files], min_doc_bytes, max_doc_bytes)).encode()
    ).hexdigest()[:12]
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / "data"
    out.mkdir(parents=True, exist_ok=True)
    prefix = str(out / f"stdlib-bytes-{key}")
    source = f"{len(files)} stdlib modules of Python {sys.version.split()[0]}"
    tokens = docs = 0
    if not (os.path.exists(get_bin_path(prefix)) and os.path.exists(get_idx_path(prefix))):
        tmp = tempfile.mkdtemp(dir=out, prefix=".build-")
        tmp_prefix = os.path.join(tmp, "corpus")
        builder = IndexedDatasetBuilder(get_bin_path(tmp_prefix), dtype=np.uint16)
        for path in files:
            for doc in source_documents(path.read_bytes(), min_doc_bytes, max_doc_bytes):
                ids = np.frombuffer(doc, dtype=np.uint8).astype(np.uint16)
                ids = np.append(ids, np.uint16(ByteTokenizer.EOD))
                builder.add_document(ids, [ids.size])
        builder.finalize(get_idx_path(tmp_prefix))
        os.replace(get_bin_path(tmp_prefix), get_bin_path(prefix))
        os.replace(get_idx_path(tmp_prefix), get_idx_path(prefix))
        os.rmdir(tmp)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix, mmap=True)
    docs = len(ds)
    tokens = int(ds.sequence_lengths.sum())
    return CorpusInfo(prefix=prefix, num_documents=docs, num_tokens=tokens, source=source)


def build_gpt_dataset(corpus: CorpusInfo, *, seq_length: int, num_samples: int, seed: int = 1234,
                      cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """megatron-core ``GPTDataset`` over ``corpus`` with document boundaries (``cu_seqlens``).

    Call on every rank when ``torch.distributed`` is initialised (megatron-core builds the sample
    index on rank 0 and the others read its cache). Each sample: ``tokens``/``labels``/
    ``loss_mask``/``position_ids`` ``[seq_length]`` and ``cu_seqlens`` ``[seq_length + 1]``
    (right-padded with ``seq_length``).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cache = Path(cache_dir) if cache_dir is not None else Path(corpus.prefix).parent / "index-cache"
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([corpus.prefix], None),
        split="100,0,0",
        path_to_cache=str(cache),
        tokenizer=ByteTokenizer(),
        reset_position_ids=True,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        inter_document_masking=True,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None], lambda: True, config).build()
    return train


def micro_batch(dataset: Any, start: int, size: int) -> dict[str, torch.Tensor]:
    """Samples ``[start, start + size)`` collated: ``[b, s]`` tensors and ``cu_seqlens`` ``[b, s+1]``."""
    samples = [dataset[(start + i) % len(dataset)] for i in range(size)]
    keys = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens")
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in keys}
