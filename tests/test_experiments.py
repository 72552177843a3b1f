"""``docs/experiments/``: the what-if scripts behind README's measured explanations still run, and
what they measure with is right — the spanning-token share against a per-token count, the
simulator patch undone afterwards (a leaked patch would change every later simulation)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _share_by_token(cu: np.ndarray, ranks: int) -> np.ndarray:
    """Each token asks: does my document have a token on another rank?"""
    region = int(cu[-1]) // ranks
    doc = np.searchsorted(cu, np.arange(cu[-1]), side="right") - 1
    rank = np.arange(cu[-1]) // region
    first, last = rank[cu[:-1]], rank[cu[1:] - 1]
    spans = first[doc] != last[doc]
    return np.array([spans[rank == r].mean() for r in range(ranks)])


@pytest.mark.parametrize("cu", [[0, 8, 16, 24, 32], [0, 3, 13, 14, 32], [0, 32], [0, 1, 2, 30, 31, 32], [0, 7, 9, 20, 25, 32]])
def test_spanning_share_counts_tokens(cu: list[int]) -> None:
    mod = _load("magi_what_ifs")
    got = mod.spanning_share(np.array(cu), 4)
    np.testing.assert_array_equal(got, _share_by_token(np.array(cu), 4))


def test_eight_gpu_what_if_runs_and_restores_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    import megatron_hsap.sim.hsap as sim_hsap

    before = sim_hsap.a2a_calls
    mod = _load("magi_what_ifs")
    mod.eight_gpus(1)
    assert sim_hsap.a2a_calls is before
    out = capsys.readouterr().out
    rows = {line[:34].strip(): line[34:] for line in out.splitlines() if "% of the ideal" in line}
    assert len(rows) == 6
    # on this batch some rank's tokens all span ranks, so the largest share is 1: no change
    assert "largest 1.00-1.00" in out
    assert rows["home, largest share"] == rows["chunks 8 (shipped)"]


def test_patched_checkout_runs_get_pretrain_cpus_flags_and_ring_drops_hsaps(tmp_path: Path) -> None:
    """``patched_checkout_cpu.py`` (docs/enable.md Path 2): the HSAP run gets ``pretrain-cpu``'s flags
    with HSAP's CP; the ring reference the same model at CP=1 under ring (no HSAP CP flag left, or
    Megatron would run its own CP with them); ``--no-documents`` drops only the document boundaries."""
    mod = _load("patched_checkout_cpu")
    script = str(tmp_path / "pretrain_hybrid.py")
    extra = ("--hybrid-layer-pattern", "M-M-")
    hsap = mod.flags(script, world_size=4, intra_size=2, inter_size=2, extra=extra)
    ring = mod.flags(script, ring=True, extra=extra)
    assert hsap[hsap.index("--context-parallel-impl") + 1] == "hsap"
    assert hsap[hsap.index("--hierarchical-context-parallel-sizes") + 1:][:2] == ["2", "2"]
    assert ring[ring.index("--context-parallel-impl") + 1] == "ring"
    assert not {"--context-parallel-size", "--hierarchical-context-parallel-sizes"} & set(ring)
    assert hsap[-4:-2] == list(extra) and hsap[-2] == "--data-path" and "--dataloader-inter-document-masking" in ring
    plain = [f for f in ring if f != "--dataloader-inter-document-masking"]
    assert mod.flags(script, ring=True, no_documents=True, extra=extra) == plain
