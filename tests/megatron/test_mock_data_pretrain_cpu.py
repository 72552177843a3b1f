"""Megatron's mock data (``--mock-data``: what the smoke configs, ``configs/smoke/``, train on) in
Megatron's own ``pretrain()`` loop: megatron-core's ``MockGPTDataset`` (synthetic documents of 1–4,095
tokens, packed by ``GPTDataset.__getitem__`` with their ``cu_seqlens``) under HSAP 2×2 against the
CP=1 local-attention reference reading the same documents. Same harness and tolerance as
test_pretrain_cpu; slow (two real training runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron.test_pretrain_cpu import BASE, _reference, _run, _same_losses, root  # noqa: F401

pytestmark = pytest.mark.timeout(1800)

MOCK = ("--mock-data",)


@pytest.mark.slow
def test_mock_data_in_megatrons_loop_equals_cp1_local_attention(root) -> None:  # noqa: F811
    hsap = _run(root, world_size=4, intra_size=2, inter_size=2, **BASE, extra=MOCK)
    ref = _reference(root, extra=MOCK)
    _same_losses(hsap.losses, ref.losses)
    _same_losses(hsap.validation, ref.validation)
    log = (Path(hsap.log_dir) / "rank0.log").read_text()
    assert "building train, validation, and test datasets (Megatron's mock data)" in log
    assert "megatron-hsap CPU corpus" not in log  # (the flag was ignored before: the corpus trained)
    # documents end inside samples too: some iteration's plan sees more than its 2 samples
    docs = [int(line.rsplit("documents ", 1)[1].split()[0]) for line in log.splitlines() if "| documents " in line]
    assert len(docs) == BASE["steps"] and max(docs) > 2, docs
    corpus = _run(root, world_size=1, reference=True, **BASE)
    assert abs(corpus.losses[1] - ref.losses[1]) > 100 * 1e-5 * ref.losses[1]  # other data than the corpus
