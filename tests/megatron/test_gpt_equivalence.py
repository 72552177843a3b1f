"""A megatron-core GPT (RoPE, GQA, fp32) trains identically under HSAP CP and at CP=1.

Reference (one rank): megatron-core's local spec with an independent float64 per-document
attention written in the tests (``gpt_reference``), Megatron's own THD RoPE and batch flattening.
HSAP (2 or 4 gloo ranks): the HSAP spec, HSAP batch sharding, RoPE by position, manual gradient
all-reduce. Same initial weights (CPU initialisation from one seed), same packed batches from
megatron-core's GPTDataset over standard-library sources, ``torch.optim.Adam``.

Tolerance 1e-5 relative for per-step losses and gradient norms over 5 optimizer steps: the model
is fp32 and the reference attention float64; only the order of fp32 sums differs (attention
merges across ranks, the gradient all-reduce), which moves losses by ~1e-7 relative.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.distributed import get_pool

# why 1e-5: the runs are fp32 and differ only in summation order (LSE merges across CP ranks,
# the grad all-reduce over more ranks): ~1e-7 relative per reduction, compounding over the
# steps' optimizer updates (`megatron-hsap pretrain-cpu --compare` measures 2.3e-7 over 4 steps); a wrong mask or a
# lost document changes the very first loss, not its last digits
RTOL = 1e-5
STEPS = 5
SEQ_LENGTH, MICRO_BATCH = 95, 2  # T = 190: not a multiple of 4, so CP=4 pads two tokens
RUN = dict(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, lr=1e-2, seed=4321)


def _batches() -> list[dict[str, torch.Tensor]]:
    from megatron_hsap.megatron.data import build_gpt_dataset, build_stdlib_corpus, micro_batch

    # Short documents (<= 160 bytes of real source) so every micro-batch packs several of them and
    # documents straddle the CP ranks' chunk boundaries.
    corpus = build_stdlib_corpus(max_source_bytes=400_000, min_doc_bytes=16, max_doc_bytes=160)
    dataset = build_gpt_dataset(corpus, seq_length=SEQ_LENGTH, num_samples=STEPS * MICRO_BATCH, seed=7)
    return [micro_batch(dataset, 100 + step * MICRO_BATCH, MICRO_BATCH) for step in range(STEPS)]


def _setup(cp: int, tp: int = 1, overrides: dict[str, Any] | None = None) -> Any:
    import dataclasses

    from megatron.core import parallel_state as mpu

    from megatron_hsap.megatron import cpu_shims
    from megatron_hsap.megatron.train_tiny import TinyRun, tiny_config

    cpu_shims.install()
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    run = TinyRun(world_size=cp * tp, intra_size=1, inter_size=cp, seq_length=SEQ_LENGTH,
                  micro_batch_size=MICRO_BATCH, **RUN)
    config = tiny_config(run, context_parallel_size=cp)
    return dataclasses.replace(config, tensor_model_parallel_size=tp, **(overrides or {}))


def _model(config: Any, spec: Any) -> tuple[Any, Any]:
    from megatron_hsap.megatron.data import ByteTokenizer
    from megatron_hsap.megatron.train_tiny import build_tiny_gpt

    model = build_tiny_gpt(config, spec, seed=RUN["seed"], vocab_size=ByteTokenizer().vocab_size,
                           max_sequence_length=SEQ_LENGTH * MICRO_BATCH)
    return model, torch.optim.Adam(model.parameters(), lr=RUN["lr"])


def run_reference(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Pool case (1 rank): the CP=1 reference run."""
    from megatron_hsap.megatron.train_tiny import train_step
    from tests.megatron.gpt_reference import reference_inputs, reference_layer_spec

    config = _setup(1)
    model, opt = _model(config, reference_layer_spec())
    out = []
    for batch in batches:
        inputs, real, loss_tokens = reference_inputs(batch)
        r = train_step(model, opt, inputs, num_loss_tokens=loss_tokens, grad_group=None, real_tokens=real)
        out.append({"loss": r.loss, "grad_norm": r.grad_norm, "loss_tokens": loss_tokens, "real": real})
    return out


def run_hsap(intra: int, inter: int, batches: list[dict[str, torch.Tensor]], tp: int = 1,
             overrides: dict[str, Any] | None = None, layout: str = "contiguous") -> list[dict[str, float]]:
    """Pool case (tp·intra·inter ranks): the same training under HSAP (Megatron's TP inside)."""
    from megatron.core import parallel_state as mpu

    from megatron_hsap.megatron.batch import get_batch_on_this_cp_rank, plan_kwargs_from_config, plan_request
    from megatron_hsap.megatron.data import ByteTokenizer
    from megatron_hsap.megatron.parallel_state import destroy_hsap, initialize_hsap
    from megatron_hsap.megatron.plan_worker import PlanWorker
    from megatron_hsap.megatron.prefetch import PlanPrefetcher
    from megatron_hsap.megatron.spec import hsap_layer_spec
    from megatron_hsap.megatron.train_tiny import train_step

    config = _setup(intra * inter, tp, overrides)
    initialize_hsap(intra_size=intra, inter_size=inter, node_check="off")
    try:
        model, opt = _model(config, hsap_layer_spec(config, use_te=False))
        out = []
        # "balanced" without the fallback: the permuted layout must be what trains; its plans come
        # from the prefetcher (compiled one batch ahead, in this rank's plan worker process), as in training
        extra = {"layout": layout, **({"layout_fallback": False} if layout == "balanced" else {})}
        kwargs = {**plan_kwargs_from_config(config), **extra}
        source = iter(batches)
        worker = PlanWorker(enabled=layout == "balanced")
        prefetch = PlanPrefetcher(lambda: next(source, None), lambda b: worker.compile(plan_request(b, plan_kwargs=kwargs))[0],
                                  enabled=layout == "balanced")
        for batch, plan in prefetch:
            sharded = get_batch_on_this_cp_rank(batch, plan=plan, pad_token_id=ByteTokenizer.PAD)
            r = train_step(model, opt, sharded, num_loss_tokens=sharded["num_loss_tokens"],
                           grad_group=mpu.get_data_parallel_group(with_context_parallel=True),  # DP=1: CP
                           tp_group=mpu.get_tensor_model_parallel_group(), real_tokens=sharded["num_tokens"])
            out.append({"loss": r.loss, "grad_norm": r.grad_norm, "loss_tokens": r.loss_tokens,
                        "counted": r.counted_tokens, "padded": sharded["plan"].padded_tokens,
                        "layout": sharded["plan"].layout.name})
        prefetch.close()
        assert worker.in_process == (layout != "balanced")  # the worker served every plan
        worker.close()
        return out
    finally:
        destroy_hsap()


@functools.lru_cache(maxsize=1)
def _shared() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, float]]]:
    batches = _batches()
    return batches, get_pool(1).run(run_reference, batches, timeout=600)[0]


def _check(intra: int, inter: int, tp: int = 1, overrides: dict[str, Any] | None = None,
           layout: str = "contiguous") -> None:
    batches, ref = _shared()
    results = get_pool(tp * intra * inter).run(run_hsap, intra, inter, batches, tp, overrides, layout, timeout=600)
    for rank_result in results[1:]:
        assert rank_result == results[0], "every rank must see the same all-reduced loss and grad norm"
    for step, (got, want, batch) in enumerate(zip(results[0], ref, batches)):
        real = int(batch["tokens"].numel())
        assert want["loss_tokens"] == want["real"] == real  # reference: every real token is a loss token
        assert got["loss_tokens"] == real, f"step {step}: denominator {got['loss_tokens']} != {real} real tokens"
        assert got["counted"] == real, f"step {step}: CP ranks hold {got['counted']} loss tokens, expected {real} (each once)"
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), f"step {step} loss"
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL), f"step {step} grad norm"
        assert got["layout"] == layout
    if intra * inter == 4:
        assert results[0][0]["padded"] == SEQ_LENGTH * MICRO_BATCH + 2  # the padding path was exercised


def test_gpt_hsap_2x2_matches_cp1() -> None:
    _check(2, 2)


def test_gpt_hsap_balanced_layout_matches_cp1() -> None:
    """Tokens permuted per batch (documents kept whole or split head–tail): labels, loss mask and
    RoPE positions must travel with them."""
    _check(2, 2, layout="balanced")


@pytest.mark.slow
def test_gpt_hsap_balanced_layout_1x4_matches_cp1() -> None:
    _check(1, 4, layout="balanced")


@pytest.mark.slow
@pytest.mark.parametrize(("intra", "inter"), [(1, 2), (2, 1)])
def test_gpt_hsap_cp2_matches_cp1(intra: int, inter: int) -> None:
    _check(intra, inter)


@pytest.mark.slow
def test_gpt_hsap_with_tensor_parallel_matches_cp1() -> None:
    _check(2, 1, tp=2)  # TP=2 × CP 2x1: 4 ranks, each TP rank with 2 of the 4 heads


@pytest.mark.slow
@pytest.mark.parametrize(
    "recompute",
    [
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    ],
    ids=["full", "selective-core-attn"],
)
def test_gpt_hsap_with_activation_recompute_matches_cp1(recompute: dict[str, Any]) -> None:
    _check(1, 2, overrides=recompute)
