"""A tiny megatron-core GPT with a full / sliding-window layer pattern trains identically under
HSAP CP and at CP=1 (issue 15 item 5).

Layer pattern: ``window_size=(8, 0)``, ``window_attn_skip_freq=2`` — megatron-core's rule
(``is_layer_window_attention``) makes layer 1 windowed and layer 2 full. Reference (one rank): the
float64 per-document attention of ``tests/megatron/gpt_reference.py`` with the same per-layer
window rule; HSAP (2×2 gloo ranks): one plan per distinct window, all on the full plan's layout
(``shared_layout.compile_on_layout``), the batch sharded once. Same tolerance and reasoning as
``test_gpt_equivalence.py`` (fp32 model, float64 reference attention: 1e-5 relative over 5 steps).
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed import get_pool
from tests.megatron import test_gpt_equivalence as eq

WINDOWED = {"window_size": (8, 0), "window_attn_skip_freq": 2}


def run_reference_windowed(batches, overrides):
    """Pool case (1 rank): the CP=1 reference under the same layer pattern."""
    from megatron_hsap.megatron.train_tiny import train_step
    from tests.megatron.gpt_reference import reference_inputs, reference_layer_spec

    config = eq._setup(1, overrides=overrides)
    model, opt = eq._model(config, reference_layer_spec())
    out = []
    for batch in batches:
        inputs, real, loss_tokens = reference_inputs(batch)
        r = train_step(model, opt, inputs, num_loss_tokens=loss_tokens, grad_group=None, real_tokens=real)
        out.append({"loss": r.loss, "grad_norm": r.grad_norm})
    return out


@functools.lru_cache(maxsize=2)
def _reference(windowed: bool):
    batches = eq._batches()
    return batches, get_pool(1).run(run_reference_windowed, batches, WINDOWED if windowed else None, timeout=600)[0]


def test_windowed_reference_differs_from_full():
    """The window must change the losses (else equality below could not tell it was applied)."""
    _, full = _reference(False)
    _, win = _reference(True)
    # at least 10x the equality tolerance on some step (the first is near-uniform attention)
    assert max(abs(w["loss"] - f["loss"]) / abs(f["loss"]) for w, f in zip(win, full)) > 10 * eq.RTOL
    assert max(abs(w["grad_norm"] - f["grad_norm"]) / f["grad_norm"] for w, f in zip(win, full)) > 10 * eq.RTOL


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_gpt_full_and_windowed_layers_match_cp1(layout):
    batches, ref = _reference(True)
    results = get_pool(4).run(eq.run_hsap, 2, 2, batches, 1, WINDOWED, layout, timeout=600)
    for rank_result in results[1:]:
        assert rank_result == results[0]
    for step, (got, want) in enumerate(zip(results[0], ref)):
        assert got["loss"] == pytest.approx(want["loss"], rel=eq.RTOL), f"step {step} loss"
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=eq.RTOL), f"step {step} grad norm"
        assert got["layout"] == layout


def test_plan_for_batch_compiles_every_layers_window_on_one_layout(monkeypatch):
    from types import SimpleNamespace

    import torch

    from megatron_hsap.megatron.batch import plan_for_batch
    from megatron_hsap.megatron.windows import layer_window, model_windows
    from megatron_hsap.plan import clear_plan_cache
    from megatron_hsap.plan import shared_layout

    config = SimpleNamespace(num_layers=4, window_size=(16, 0), window_attn_skip_freq=[1, 0, 1, 1])
    assert [layer_window(config, n) for n in range(1, 5)] == [(16, 0), None, (16, 0), (16, 0)]
    assert model_windows(config) == ((16, 0), None)
    clear_plan_cache()
    compiled = []
    real = shared_layout.compile_on_layout
    monkeypatch.setattr(shared_layout, "compile_on_layout", lambda base, w: compiled.append(w) or real(base, w))
    batch = {"tokens": torch.zeros(256, dtype=torch.long), "cu_seqlens": torch.tensor([0, 50, 51, 200, 256])}
    plan = plan_for_batch(batch, plan_kwargs=dict(inter_size=2, intra_size=2, num_heads=4, num_kv_heads=2, head_dim=8),
                          windows=model_windows(config))
    assert plan.options.window_size is None
    assert compiled == [(16, 0), None]  # every distinct window of the model, on this plan
    windowed = shared_layout.compile_on_layout(plan, (16, 0))  # what the windowed layers' core attention asks for
    assert windowed.layout is plan.layout and windowed.options.window_size == (16, 0)
    from megatron_hsap.plan import plan as plan_module

    monkeypatch.setattr(plan_module, "_compile_on", lambda *a: pytest.fail("the prefetched plan must be cached"))
    assert shared_layout.compile_on_layout(plan, (16, 0)) is windowed
