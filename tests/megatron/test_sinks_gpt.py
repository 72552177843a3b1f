"""A tiny megatron-core GPT with attention sinks (``softmax_type`` learnable / off-by-one) trains
identically under HSAP CP and at CP=1.

Reference (one rank): megatron-core's local GPT spec with a float64 dense-mask core attention
that appends the sink column to the scores (``tests/runtime/test_sinks.reference_with_sinks``,
written independently of HSAP's merge-side correction) and owns megatron-core's
``softmax_offset`` parameter, created exactly as ``DotProductAttention`` creates it (same name,
shape ``[np]``, ``config.init_method``) so both runs start from the same weights. HSAP: the HSAP
spec, HSAP batch sharding, manual gradient all-reduce over the data×context group — which is
what sums the CP ranks' sink-gradient contributions (HSAP reduces nothing).

Tolerance 1e-5 relative on per-step losses and gradient norms over 5 Adam steps (fp32 model,
float64 reference: only fp32 summation order differs, see test_gpt_equivalence). The sinks'
gradients at the first step must match to 1e-5 of the largest, and the learnable sinks after 5
steps to 0.5% of one Adam step (their gradients are tiny, and Adam turns each into a ~lr step, so
fp32 noise grows over steps: ``check_equal_to_cp1``).

The helpers here (``run_model``, ``ReferenceCoreAttention``) also serve the MLA and HybridModel tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.distributed import get_pool

RTOL = 1e-5


def _batches() -> list[dict[str, torch.Tensor]]:
    from tests.megatron.test_gpt_equivalence import _batches as gpt_batches

    return gpt_batches()


# --------------------------------------------------------------------------- the reference


def _reference_core_attention_cls() -> type:
    from megatron.core.transformer.module import MegatronModule

    from tests.runtime.test_sinks import reference_with_sinks

    class ReferenceCoreAttention(MegatronModule):
        """Float64 per-document attention with a sink column; megatron-core's core-attention
        interface (``k_channels`` / ``v_channels`` as MLA passes them) and its ``softmax_offset``."""

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     k_channels: int | None = None, v_channels: int | None = None,
                     cp_comm_type: str | None = None, pg_collection: Any = None) -> None:  # fmt: skip
            super().__init__(config=config)
            self.scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5
            heads = config.num_attention_heads // config.tensor_model_parallel_size
            self.heads = heads
            kind = config.softmax_type
            if kind == "learnable":  # as megatron-core's DotProductAttention
                self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
                if config.perform_initialization:
                    self.softmax_offset = config.init_method(self.softmax_offset)
            elif kind == "off-by-one":
                self.softmax_offset = torch.zeros(heads, dtype=config.params_dtype)
            else:
                self.softmax_offset = None

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:  # fmt: skip
            """q ``[t, np, hn]``, k/v ``[t, ng, hn]`` (THD) → ``[t, np·hv]``."""
            cu = packed_seq_params.cu_seqlens_q.tolist()
            sinks = self.softmax_offset
            if sinks is None:  # no sink: a -inf sink column has probability exactly 0
                sinks = torch.full((self.heads,), float("-inf"))
            out, _ = reference_with_sinks(query, key, value, cu, self.scale, sinks)
            return out.to(query.dtype).reshape(query.shape[0], -1)

    return ReferenceCoreAttention


def reference_gpt_spec(mla: bool = False) -> Any:
    """megatron-core's local GPT layer spec (MLA's with ``mla``) with the reference core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", multi_latent_attention=mla)
    attn = spec.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=_reference_core_attention_cls()))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))


def reference_hybrid_spec() -> Any:
    """HSAP's local hybrid stack spec before the swap (megatron-core modules) with the reference core attention."""
    from megatron_hsap.megatron.spec import _local_hybrid_stack_spec

    base = _local_hybrid_stack_spec()
    subs = base.submodules
    changes = {}
    for name in ("attention_layer", "mla_layer"):
        layer = getattr(subs, name)
        attn = layer.submodules.self_attention
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=_reference_core_attention_cls()))
        changes[name] = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attn))
    return dataclasses.replace(base, submodules=dataclasses.replace(subs, **changes))


# --------------------------------------------------------------------------- runs (pool cases)


@contextlib.contextmanager
def cpu_current_device() -> Iterator[None]:
    """MLA's rotary modules (RoPE and YaRN) put their tables on ``torch.cuda.current_device()``
    whatever ``use_cpu_initialization`` says; on these CPU-only ranks that device is the CPU."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


MLA_FIELDS = dict(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8,
                  qk_pos_emb_head_dim=4, v_head_dim=6, num_query_groups=4, rope_type="rope")  # fmt: skip


def _config(cp: int, overrides: dict[str, Any]) -> Any:
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from tests.megatron.test_gpt_equivalence import _setup

    config = _setup(cp)
    overrides = dict(overrides)
    if overrides.pop("mla", False):
        base = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
        base.pop("kv_channels", None)  # derived from hidden size; MLA's head sizes are its own
        config = MLATransformerConfig(**{**base, **MLA_FIELDS, **overrides})
        return config
    return dataclasses.replace(config, **overrides)


def _build(config: Any, spec: Any, model: str, pattern: str | None) -> tuple[Any, Any]:
    from megatron_hsap.megatron.data import ByteTokenizer
    from tests.megatron.test_gpt_equivalence import RUN, SEQ_LENGTH, MICRO_BATCH, _model

    if model == "gpt":
        return _model(config, spec)
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    torch.manual_seed(RUN["seed"])
    net = HybridModel(config=config, hybrid_stack_spec=spec, vocab_size=ByteTokenizer().vocab_size,
                      max_sequence_length=SEQ_LENGTH * MICRO_BATCH, hybrid_layer_pattern=pattern,
                      position_embedding_type="rope", share_embeddings_and_output_weights=True)  # fmt: skip
    return net, torch.optim.Adam(net.parameters(), lr=RUN["lr"])


def _sink_params(model: Any) -> list[torch.nn.Parameter]:
    """The model's learnable sinks (megatron-core's ``softmax_offset`` parameters), in order."""
    return [p for n, p in model.named_parameters() if n.endswith("softmax_offset")]


def _sinks(model: Any) -> list[list[float]]:
    return [p.detach().double().tolist() for p in _sink_params(model)]


def _record_sink_grads(net: Any, opt: Any) -> list[list[list[float]]]:
    """Per optimizer step, each sink parameter's gradient as the optimizer sees it (after the CP
    all-reduce): ``opt.step`` wrapped to copy them first."""
    sinks = _sink_params(net)
    out: list[list[list[float]]] = []
    step = opt.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        out.append([p.grad.detach().double().tolist() for p in sinks if p.grad is not None])
        return step(*args, **kwargs)

    opt.step = recording_step
    return out


def run_model(topology: tuple[int, int] | None, batches: list[dict[str, torch.Tensor]], overrides: dict[str, Any],
              model: str = "gpt", pattern: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Pool case: 5 training steps of a tiny GPT / HybridModel; ``topology`` None = the CP=1
    reference (float64 core attention, Megatron's RoPE), else HSAP over ``intra × inter`` ranks.
    Returns per-step losses and grad norms, the final sink values and the parameter names."""
    with cpu_current_device(), local_final_norm():
        return _run_model(topology, batches, overrides, model, pattern)


@contextlib.contextmanager
def local_final_norm() -> Iterator[None]:
    """megatron-core 0.19.2's ``HybridStack`` builds its final norm as ``TENorm`` whatever the spec
    ("Hybrid always uses TransformerEngine"); without TE (CPU) both runs use megatron-core's
    ``WrappedTorchNorm`` with the same arguments instead."""
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = hybrid_block.TENorm
    hybrid_block.TENorm = WrappedTorchNorm
    try:
        yield
    finally:
        hybrid_block.TENorm = original


def _run_model(topology: tuple[int, int] | None, batches: list[dict[str, torch.Tensor]], overrides: dict[str, Any],
               model: str, pattern: str | None) -> dict[str, Any]:  # fmt: skip
    from megatron.core import parallel_state as mpu

    from megatron_hsap.megatron.train_tiny import train_step

    mla = bool(overrides.get("mla"))
    if topology is None:
        from tests.megatron.gpt_reference import reference_inputs

        config = _config(1, overrides)
        spec = reference_gpt_spec(mla) if model == "gpt" else reference_hybrid_spec()
        net, opt = _build(config, spec, model, pattern)
        grads = _record_sink_grads(net, opt)
        steps = []
        for batch in batches:
            inputs, real, loss_tokens = reference_inputs(batch)
            r = train_step(net, opt, inputs, num_loss_tokens=loss_tokens, grad_group=None, real_tokens=real)
            steps.append((r.loss, r.grad_norm))
        return {"steps": steps, "sinks": _sinks(net), "sink_grads": grads, "names": sorted(n for n, _ in net.named_parameters())}

    from megatron_hsap.megatron.batch import get_batch_on_this_cp_rank, plan_for_batch, plan_kwargs_from_config
    from megatron_hsap.megatron.data import ByteTokenizer
    from megatron_hsap.megatron.parallel_state import destroy_hsap, initialize_hsap
    from megatron_hsap.megatron.spec import hsap_hybrid_stack_spec, hsap_layer_spec

    intra, inter = topology
    config = _config(intra * inter, overrides)
    initialize_hsap(intra_size=intra, inter_size=inter, node_check="off")
    try:
        spec = hsap_layer_spec(config, use_te=False) if model == "gpt" else hsap_hybrid_stack_spec(use_te=False)
        net, opt = _build(config, spec, model, pattern)
        grads = _record_sink_grads(net, opt)
        kwargs = {**plan_kwargs_from_config(config), "layout": "contiguous"}
        steps = []
        for batch in batches:
            plan = plan_for_batch(batch, plan_kwargs=kwargs)
            sharded = get_batch_on_this_cp_rank(batch, plan=plan, pad_token_id=ByteTokenizer.PAD)
            r = train_step(net, opt, sharded, num_loss_tokens=sharded["num_loss_tokens"],
                           grad_group=mpu.get_data_parallel_group(with_context_parallel=True),
                           real_tokens=sharded["num_tokens"])  # fmt: skip
            steps.append((r.loss, r.grad_norm))
        return {"steps": steps, "sinks": _sinks(net), "sink_grads": grads, "names": sorted(n for n, _ in net.named_parameters())}
    finally:
        destroy_hsap()


@functools.lru_cache(maxsize=8)
def _reference(key: tuple) -> dict[str, Any]:
    overrides, model, pattern = dict(key[0]), key[1], key[2]
    return get_pool(1).run(run_model, None, _batches(), overrides, model, pattern, timeout=600)[0]


def check_equal_to_cp1(topology: tuple[int, int], overrides: dict[str, Any], model: str = "gpt",
                       pattern: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Run HSAP on ``topology`` and the CP=1 reference; assert equal losses, grad norms, sinks, names."""
    ref = _reference((tuple(sorted(overrides.items())), model, pattern))
    world = topology[0] * topology[1]
    results = get_pool(world).run(run_model, topology, _batches(), overrides, model, pattern, timeout=600)
    for r in results[1:]:
        assert r == results[0], "every rank must see the same all-reduced loss, grad norm and sinks"
    got = results[0]
    assert got["names"] == ref["names"], "HSAP must keep megatron-core's parameter names (checkpoints load unchanged)"
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got["steps"], ref["steps"])):
        assert loss == pytest.approx(want_loss, rel=RTOL), f"step {step} loss"
        assert norm == pytest.approx(want_norm, rel=RTOL), f"step {step} grad norm"
    assert len(got["sinks"]) == len(ref["sinks"]) and len(got["sink_grads"]) == len(ref["sink_grads"])
    if ref["sinks"]:
        from tests.megatron.test_gpt_equivalence import RUN

        # The exact check: the sinks' gradients at the first step, from the same weights on both
        # sides (rel. to the largest: 2.6e-7 on Python 3.12's corpus, 1.5e-7 on 3.13's, MLA 1x4).
        # Later steps are Adam's: the sinks' gradients are 1e-6-1e-4 and Adam turns each into a
        # ~lr step, so fp32 summation noise grows step by step (3.12's corpus: 9e-4 of the largest
        # gradient at step 3; HSAP at CP=1, fp32, ends 1.0e-6 from the float64 reference, 1x4
        # 4.8e-6) — after 5 steps the sinks are held to 0.5% of one Adam step (lr 1e-2): a sign
        # or a missing rank's contribution moves a sink by ~lr per step.
        first, want = got["sink_grads"][0], ref["sink_grads"][0]
        scale = max(abs(x) for row in want for x in row)
        assert scale > 0 and len(first) == len(want)
        for a, b in zip(first, want):
            assert a == pytest.approx(b, rel=0, abs=RTOL * scale), "the sinks' gradients at the first step"
        for a, b in zip(got["sinks"], ref["sinks"]):
            assert a == pytest.approx(b, rel=0, abs=5e-3 * RUN["lr"]), "learnable sinks after 5 steps"
    return got


# --------------------------------------------------------------------------- tests


def test_gpt_learnable_sinks_2x2_matches_cp1() -> None:
    got = check_equal_to_cp1((2, 2), {"softmax_type": "learnable"})
    assert len(got["sinks"]) == 2 and all(len(s) == 4 for s in got["sinks"])  # one [np] per layer
    assert any("core_attention.softmax_offset" in n for n in got["names"])


@pytest.mark.slow
def test_gpt_off_by_one_1x4_matches_cp1() -> None:
    got = check_equal_to_cp1((1, 4), {"softmax_type": "off-by-one"})
    assert got["sinks"] == []  # a fixed zero logit, not a parameter (as megatron-core)


@pytest.mark.slow
def test_gpt_learnable_sinks_4x1_matches_cp1() -> None:
    check_equal_to_cp1((4, 1), {"softmax_type": "learnable"})  # pure Ulysses: each rank its head slice


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one", "vanilla"])
def test_arguments_accept_softmax_types(softmax_type: str) -> None:
    from megatron_hsap.megatron.arguments import validate_hsap_args
    from tests.megatron.test_arguments import GOOD, _parse

    assert validate_hsap_args(_parse(GOOD + ["--softmax-type", softmax_type])) is not None
