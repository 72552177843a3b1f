"""Packed batches from megatron-core's GPTDataset over standard-library sources."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_hsap.megatron.batch import pack_micro_batch
from megatron_hsap.megatron.data import ByteTokenizer, build_gpt_dataset, build_stdlib_corpus, micro_batch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - fixture
    return build_stdlib_corpus(tmp_path_factory.mktemp("corpus"), max_source_bytes=300_000)


def test_corpus_is_real_text_split_into_documents(corpus) -> None:  # noqa: ANN001
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(corpus.prefix)
    assert corpus.num_documents == len(ds) > 50
    lengths = ds.sequence_lengths
    assert lengths.min() >= 2 and lengths.max() <= 1024 + 1  # min_doc_bytes .. max_doc_bytes + EOD
    text = ByteTokenizer().detokenize(ds[0])
    assert ds[0][-1] == ByteTokenizer.EOD
    import sysconfig

    first = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[0]
    assert first.read_text(encoding="utf-8").startswith(text)  # the first module's opening block, verbatim
    again = build_stdlib_corpus(Path(corpus.prefix).parent, max_source_bytes=300_000)
    assert again.prefix == corpus.prefix  # idempotent: written once


def test_gpt_dataset_samples_carry_document_boundaries(corpus, tmp_path: Path) -> None:  # noqa: ANN001
    s = 128
    dataset = build_gpt_dataset(corpus, seq_length=s, num_samples=16, cache_dir=tmp_path)
    batch = micro_batch(dataset, 0, 4)
    assert batch["tokens"].shape == (4, s) and batch["cu_seqlens"].shape == (4, s + 1)
    packed = pack_micro_batch(batch)
    cu = packed.cu_seqlens
    assert cu[0] == 0 and cu[-1] == 4 * s and (np.diff(cu) > 0).all()
    # Megatron's per-document positions agree with the boundaries batch sharding derives.
    flat_pos = batch["position_ids"].reshape(-1).numpy()
    starts = cu[:-1]
    assert (flat_pos[starts] == 0).all()
    assert torch.equal(packed.tokens, batch["tokens"].reshape(-1))
    # Labels are the next tokens of the same stream (GPTDataset's add_extra_token_to_sequence).
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
