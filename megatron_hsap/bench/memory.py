"""Per-GPU memory planner: ``megatron-hsap memory --config X [--gpu-mem-gib 40 80] [--plot p.png]``.

Estimates the peak bytes per GPU of one training step and the longest sequence that fits for
HSAP, Megatron's Transformer Engine ring (``cp_comm_type p2p``) and Ulysses — the paper's
Figure 5 comparison. Every method gets the same model, GPUs, model-state sharding and recompute
setting from the config, and its own best layout (TP size, HSAP intra×inter, Ulysses degree;
context-parallel size ≥ 2). Lengths are searched in multiples of 1024 and of Megatron's 2·CP.

Formulas (bytes; s tokens per GPU, b micro-batch, h hidden, a heads, g kv heads, d head size,
f ffn size, V padded vocab, t TP, L layers per pipeline stage):
* Parameters Ψ per GPU = (L·layer + V·h [+ V·h untied]) / t. Mixed-precision Adam: bf16 params
  2Ψ, fp32 main grads 4Ψ, fp32 main params + two moments 12Ψ; the distributed optimizer divides
  the 12Ψ by N = DP×CP (Megatron shards over the data×context group), Megatron-FSDP
  ``optim_grads`` also the grads, ``optim_grads_params`` everything (plus two unsharded layers
  of bf16 weights and one of fp32 grads in flight).
* Activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation"): with no
  recompute sbh(34 + 5as/h), with TP and sequence parallelism sbh(34/t + 5as/(ht)), with TP alone
  sbh(10 + 24/t + 5as/(ht)); selective recompute drops the 5as/h attention-core term (34sbh);
  full recompute keeps the layer input 2sbh (/t with SP) and rebuilds one recompute chunk at a
  time. The 34 is summed from its parts here so that SwiGLU, GQA and dropout 0 are exact:
  replicated 4h (two norms) + 2h (QKV input) + 2h (fc1 input) + 2h (dropout masks), split
  2ad (q) + 4gd (k, v) + 2ad (proj input) + 4f gelu / 6f swiglu. Every CP method here runs
  flash-style kernels, so the 5as/h score term is replaced by the fp32 LSE, 4a per token.
  Output: 2sbh (final norm) + 2sbh (output layer input) + 4sbV/t fp32 logits kept by the loss
  + 2sbV/t bf16 logits in flight.
* Attention method buffers (one layer at a time, on top of the above):
  HSAP — the receive pool: ``parallel.hsap_pool_bytes`` if set, else for the config's own layout
  ``compile_plan(...).stats().pool_capacity_bytes`` (compiled once on the shortest valid
  length, scaled per inter-chunk token) and for the other layouts, or without the planner, its
  default 4 × inter chunk tokens × H/(t·P_intra) × (d_qk + d_v) × 2 bytes;
  the intra all-to-all buffers (received q, kv, o and their contiguous send copies; kv heads
  replicated when P_intra > kv heads) and fp32 merge/gradient accumulators.
  TE ring — ``AttnFuncWithCPAndKVP2P.forward`` (TransformerEngine
  ``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``, commit
  d0067d0d, Aug 2026) keeps every received KV chunk (``p2p_comm_buffers``) and every per-step
  output and LSE until the layer's forward ends: P × (kv + o + lse) on the last rank; backward
  double-buffers kv and dkv. THD pads every document to a multiple of 2P (``--mean-doc-tokens``;
  Figure 5 is one dense document per sequence, so none).
  Ulysses — the all-to-all buffers; degree ≤ heads per TP rank and dividing them.
  All methods: the flash backward's fp32 dq accumulator. A fixed reserve (CUDA context, NCCL,
  fragmentation; ``--reserve-gib``) is subtracted from the GPU's memory.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.checks import divisors
from megatron_hsap.launch.config import (
    Activation,
    CPImpl,
    LaunchConfig,
    Recompute,
    RecomputeMethod,
    Sharding,
)

__all__ = ["Method", "Layout", "MemoryOptions", "MemoryBreakdown", "layer_activation_bytes",
           "estimate", "candidate_layouts", "config_layout", "max_seq_length", "best_max_seq_length",
           "best_peak", "formula_pool_bytes", "plan_pool"]  # the command: memory_report.main

GIB = 2**30
BF16, FP32 = 2, 4
DEFAULT_RESERVE_GIB = 2.0  # CUDA context ≈0.5–0.8 GiB, NCCL communicators and buffers, fragmentation


class Method(str, enum.Enum):
    HSAP = "hsap"
    TE_RING = "te-ring"
    ULYSSES = "ulysses"

    @property
    def title(self) -> str:
        return {"hsap": "HSAP", "te-ring": "TE ring (Megatron CP)", "ulysses": "Ulysses"}[self.value]


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """How one method spreads the model and the sequence over the GPUs."""

    method: Method
    tensor: int
    context: int  # sequence-parallel degree of the method (CP / Ulysses degree)
    data: int = 1
    pipeline: int = 1
    intra: int = 1  # HSAP only: P_intra × P_inter = context
    inter: int = 1

    @property
    def sequence_parallel(self) -> bool:
        return self.tensor > 1

    def label(self) -> str:
        if self.method is Method.HSAP:
            core = f"{self.intra}x{self.inter}"
        else:
            core = f"{'SP' if self.method is Method.ULYSSES else 'CP'}{self.context}"
        return f"TP{self.tensor} {core}" + (f" DP{self.data}" if self.data > 1 else "")

    def granule(self) -> int:
        """Sequence lengths are multiples of this (Megatron: 2·CP; SP: × TP) and of 1024."""
        need = (2 * self.context if self.context > 1 else 1) * (self.tensor if self.sequence_parallel else 1)
        return math.lcm(1024, need)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryOptions:
    reserve_gib: float = DEFAULT_RESERVE_GIB
    use_plan: bool = True  # take the HSAP pool from compile_plan when the planner is importable
    mean_doc_tokens: int | None = None  # TE ring padding; None = one document per sequence
    flash: bool = True  # False: Korthikanti's unfused 5as/h score term (for checking the formula)

    def __post_init__(self) -> None:
        if not (isinstance(self.reserve_gib, (int, float)) and 0 <= self.reserve_gib < float("inf")):
            raise ConfigError(f"reserve_gib={self.reserve_gib!r} must be a finite number of GiB >= 0")
        if self.mean_doc_tokens is not None and (isinstance(self.mean_doc_tokens, bool)
                                                 or not isinstance(self.mean_doc_tokens, int) or self.mean_doc_tokens < 1):
            raise ConfigError(f"mean_doc_tokens={self.mean_doc_tokens!r} must be an integer >= 1 (or None: one document)")


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    layout: Layout
    seq_length: int
    params: int
    grads: int
    optimizer: int
    activations: int  # stored for backward, all layers of the stage, in-flight micro-batches
    recompute_working: int  # one recompute chunk rebuilt during backward
    attention: int  # the CP method's own buffers
    logits: int
    pool_source: str = ""

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations + self.recompute_working
                + self.attention + self.logits)

    def fits(self, gpu_mem_gib: float, reserve_gib: float) -> bool:
        return self.total <= (gpu_mem_gib - reserve_gib) * GIB


def layer_activation_bytes(cfg: LaunchConfig, s: int, *, tensor: int, sequence_parallel: bool,
                           recompute: Recompute, flash: bool = True, micro_batch: int = 1) -> int:
    """Bytes one layer stores for backward for ``s`` tokens on this GPU (Korthikanti et al.)."""
    m = cfg.model
    h, a, g, d, f = m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.head_dim, m.ffn_size
    sb, t = s * micro_batch, tensor
    masks = 2 * h if m.hidden_dropout > 0 else 0
    replicated = 4 * h + 2 * h + 2 * h + masks
    split = 2 * a * d + 4 * g * d + 2 * a * d + (6 * f if m.activation is Activation.SWIGLU else 4 * f)
    if flash:
        core = FP32 * a  # fp32 LSE per token and head
    else:  # softmax output, dropout mask, dropout output over the keys this GPU's queries see
        core = (5 if m.attention_dropout > 0 else 2) * a * s
    if recompute is Recompute.SELECTIVE:
        core = 0
    if recompute is Recompute.FULL:
        return sb * 2 * h // (t if sequence_parallel else 1)
    return sb * replicated // (t if sequence_parallel else 1) + sb * (split + core) // t


def _params_per_gpu(cfg: LaunchConfig, lay: Layout) -> tuple[int, int]:
    """(Ψ on the heaviest pipeline stage per TP rank, one layer's parameters per TP rank)."""
    m = cfg.model
    layer = m.layer_parameters() // lay.tensor
    vocab = m.padded_vocab(lay.tensor) * m.hidden_size // lay.tensor
    heads = vocab * (2 if m.untie_embeddings and lay.pipeline == 1 else 1)
    return m.num_layers // lay.pipeline * layer + heads, layer


def _model_states(cfg: LaunchConfig, lay: Layout) -> tuple[int, int, int]:
    psi, layer = _params_per_gpu(cfg, lay)
    n = lay.data * lay.context  # Megatron shards over the data-parallel group with CP
    sharding = cfg.parallel.sharding
    params, grads, opt = BF16 * psi, FP32 * psi, 3 * FP32 * psi
    if sharding is not Sharding.NONE:
        opt //= n
    if sharding.megatron_fsdp:
        grads //= n
    if sharding is Sharding.OPTIM_GRADS_PARAMS:  # + two gathered layers and one unsharded grad
        params = params // n + 2 * BF16 * layer + FP32 * layer
    return params, grads, opt


def _padded_tokens(seq: int, lay: Layout, opts: MemoryOptions) -> int:
    if lay.method is not Method.TE_RING or lay.context == 1:
        return seq
    docs = 1 if not opts.mean_doc_tokens else math.ceil(seq / opts.mean_doc_tokens)
    step = 2 * lay.context
    if docs == 1:
        return -(-seq // step) * step
    return seq + docs * (step - 1) // 2  # expected pad per document: uniform remainder


PoolFn = Callable[[int, Layout], tuple[int, str]]


def formula_pool_bytes(cfg: LaunchConfig, seq: int, lay: Layout) -> int:
    """``parallel.hsap_pool_bytes`` when set (a fixed capacity), else the docs/design.md §2.1 default:
    4 × inter chunk tokens × local heads × (d_qk + d_v) × 2 bytes."""
    if lay.inter == 1:
        return 0  # no P2P, no receive pool
    if cfg.parallel.hsap_pool_bytes is not None:
        return cfg.parallel.hsap_pool_bytes
    heads = cfg.model.num_attention_heads // lay.tensor // lay.intra
    return 4 * (seq // lay.inter) * heads * 2 * cfg.model.head_dim * BF16


def plan_pool(cfg: LaunchConfig, opts: MemoryOptions) -> PoolFn:
    """Pool bytes of the config's own layout from ``compile_plan`` — compiled once, on the
    shortest valid sequence, and scaled per inter-chunk token since the pool is a fixed multiple
    of one chunk — and from the formula for the other layouts of the comparison (compiling a
    plan per layout and length would take minutes) or when the planner is unavailable."""
    cache: dict[Layout, tuple[float | None, str] | None] = {}
    own = config_layout(cfg)

    def pool(seq: int, lay: Layout) -> tuple[int, str]:
        if lay.inter == 1:
            return 0, "no P2P (P_inter 1)"
        if cfg.parallel.hsap_pool_bytes is not None:
            return cfg.parallel.hsap_pool_bytes, "parallel.hsap_pool_bytes"
        if lay not in cache:
            cache[lay] = _calibrate(cfg, lay) if opts.use_plan and lay == own else None
        cal = cache[lay]
        if cal is None or cal[0] is None:
            note = cal[1] if cal else "formula (docs/design.md §2.1 default)"
            return formula_pool_bytes(cfg, seq, lay), note
        per_token, note = cal
        return int(per_token * (seq // lay.inter)), note

    return pool


def _calibrate(cfg: LaunchConfig, lay: Layout) -> tuple[float | None, str] | None:
    m = cfg.model
    ref = lay.granule()
    try:
        from megatron_hsap.plan import compile_plan

        plan = compile_plan([0, ref], inter_size=lay.inter, intra_size=lay.intra,
                            num_heads=m.num_attention_heads // lay.tensor,
                            num_kv_heads=m.num_kv_heads // lay.tensor, head_dim=m.head_dim,
                            dtype_bytes=BF16, pad_multiple=lay.tensor if lay.sequence_parallel else 1,
                            tp_size=lay.tensor, gpus_per_node=cfg.cluster.gpus_per_node,
                            hardware=cfg.cluster.hardware, flatten="never")  # the configured topology's pool
        capacity = int(plan.stats().pool_capacity_bytes)
    except ImportError:
        return None
    except (AttributeError, KeyError, TypeError) as exc:  # a planner API this file does not know
        return None, f"formula (compile_plan unusable: {type(exc).__name__}: {exc})"
    return capacity / (ref // lay.inter), "compile_plan stats().pool_capacity_bytes"


def _attention_bytes(cfg: LaunchConfig, seq: int, s: int, lay: Layout, pool: PoolFn) -> tuple[int, str]:
    m = cfg.model
    a, g, d = m.num_attention_heads // lay.tensor, m.num_kv_heads // lay.tensor, m.head_dim
    q = o = s * a * d * BF16
    kv = s * g * 2 * d * BF16
    dq_accum = s * a * d * FP32  # flash backward's fp32 dq accumulator, every method
    if lay.method is Method.TE_RING:
        if lay.context == 1:
            return dq_accum, ""
        p = lay.context
        forward = p * (kv + o + s * a * FP32)  # all received KV chunks + per-step out and LSE
        backward = 2 * 2 * kv + q  # (kv, dkv) send and receive buffers + dq buffer
        return max(forward, backward) + dq_accum, ""
    group = lay.intra if lay.method is Method.HSAP else lay.context
    kv_rep = s * max(g, group) * 2 * d * BF16  # kv heads replicated up to the group size
    a2a = 2 * (q + kv_rep + o) if group > 1 else 0  # received copies + contiguous send copies
    if lay.method is Method.ULYSSES:
        return a2a + dq_accum, ""
    pool_bytes, note = pool(seq, lay)
    acc = 0
    if lay.inter > 1:  # fp32 merges of partial outputs, fp32 partial dq/dkv (docs/design.md §2.2)
        acc = max(s * a * (d + 1) * FP32, s * (a * d + max(g, lay.intra) * 2 * d) * FP32)
    return a2a + pool_bytes + acc + dq_accum, note


def estimate(cfg: LaunchConfig, lay: Layout, seq: int, opts: MemoryOptions = MemoryOptions(),
             pool: PoolFn | None = None) -> MemoryBreakdown:
    """Peak bytes per GPU of one training step of ``cfg`` laid out as ``lay`` at ``seq`` tokens."""
    pool = pool or plan_pool(cfg, opts)
    t, mb, m, tr = lay.tensor, cfg.training.micro_batch_size, cfg.model, cfg.training
    padded = _padded_tokens(seq, lay, opts)
    s = padded // lay.context  # tokens this GPU holds
    layers = m.num_layers // lay.pipeline
    sp = lay.sequence_parallel

    def per_layer(rc: Recompute) -> int:
        return layer_activation_bytes(cfg, s, tensor=t, sequence_parallel=sp, recompute=rc,
                                      flash=opts.flash, micro_batch=mb)

    full_layer = per_layer(Recompute.NONE)
    if tr.recompute is Recompute.FULL:
        n = tr.recompute_num_layers
        if tr.recompute_method is RecomputeMethod.UNIFORM:
            stored, working = math.ceil(layers / n) * per_layer(Recompute.FULL), n * full_layer
        else:  # block: the first n layers recompute, the rest keep everything
            stored = n * per_layer(Recompute.FULL) + (layers - n) * full_layer
            working = full_layer
    else:
        stored, working = layers * per_layer(tr.recompute), 0
    h = m.hidden_size
    stored += s * mb * (4 * h + (h if m.hidden_dropout > 0 else 0)) // (t if sp else 1)
    micro_batches = max(1, cfg.global_batch_size // (mb * lay.data))
    stored *= min(lay.pipeline, micro_batches)  # 1F1B: stage 0 holds PP micro-batches
    vocab = m.padded_vocab(t)
    logits = s * mb * vocab // t * (FP32 + BF16)
    attention, note = _attention_bytes(cfg, seq, s * mb, lay, pool)
    params, grads, opt = _model_states(cfg, lay)
    return MemoryBreakdown(layout=lay, seq_length=seq, params=params, grads=grads, optimizer=opt,
                           activations=stored, recompute_working=working, attention=attention,
                           logits=logits, pool_source=note)


def config_layout(cfg: LaunchConfig) -> Layout:
    p = cfg.parallel
    method = Method.HSAP if p.cp_impl is CPImpl.HSAP else Method.TE_RING
    return Layout(method=method, tensor=p.tensor, context=p.context_size, data=cfg.data_size,
                  pipeline=p.pipeline, intra=p.hsap_intra_size, inter=p.hsap_inter_size)


def candidate_layouts(cfg: LaunchConfig, method: Method) -> tuple[list[Layout], str]:
    """Every layout of ``method`` on the config's GPUs with a context-parallel size ≥ 2 (DP 1
    unless Ulysses is capped by heads), and a note when the Ulysses head cap binds."""
    m, c, pp = cfg.model, cfg.cluster, cfg.parallel.pipeline
    world = cfg.world_size
    out: list[Layout] = []
    why = ""
    for t in divisors(c.gpus_per_node):
        if m.num_attention_heads % t or m.num_kv_heads % t or world % (t * pp):
            continue
        cp, a, g = world // (t * pp), m.num_attention_heads // t, m.num_kv_heads // t
        if cp < 2:
            continue  # pure TP is no context-parallel method; compare the methods themselves
        if method is Method.TE_RING:
            out.append(Layout(method=method, tensor=t, context=cp, pipeline=pp))
        elif method is Method.HSAP:
            for intra in divisors(cp):
                if c.gpus_per_node % (t * intra) or not _heads_split(a, g, intra):
                    continue
                out.append(Layout(method=method, tensor=t, context=cp, pipeline=pp, intra=intra,
                                  inter=cp // intra))
        else:
            degrees = [q for q in divisors(cp) if _heads_split(a, g, q)]
            best = max(degrees)
            if best < cp:
                why = f"Ulysses degree ≤ heads per TP rank: {best} < {cp} GPUs at TP {t}"
            out.append(Layout(method=method, tensor=t, context=best, data=cp // best, pipeline=pp))
    return out, why


def _heads_split(heads: int, kv_heads: int, group: int) -> bool:
    """The planner's all-to-all rule: q heads split evenly, kv heads split or replicated."""
    from megatron_hsap.plan.options import valid_intra_sizes

    return group in valid_intra_sizes(heads, kv_heads)


def max_seq_length(cfg: LaunchConfig, lay: Layout, gpu_mem_gib: float, opts: MemoryOptions = MemoryOptions(),
                   pool: PoolFn | None = None, limit: int = 2**31) -> int:
    """Longest multiple of ``lay.granule()`` whose estimate fits (0 if none). Memory grows with
    the sequence length in every term, so a doubling search and a bisection find it."""
    pool = pool or plan_pool(cfg, opts)
    step = lay.granule()

    def fits(k: int) -> bool:
        return estimate(cfg, lay, k * step, opts, pool).fits(gpu_mem_gib, opts.reserve_gib)

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * step <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def best_max_seq_length(cfg: LaunchConfig, method: Method, gpu_mem_gib: float,
                        opts: MemoryOptions = MemoryOptions(), pool: PoolFn | None = None
                        ) -> tuple[Layout | None, int, str]:
    """The method's best layout, its longest fitting sequence, and a note (cap or reason)."""
    pool = pool or plan_pool(cfg, opts)
    layouts, why = candidate_layouts(cfg, method)
    if not layouts:
        return None, 0, "no valid layout (heads vs TP / intra sizes)"
    scored = [(max_seq_length(cfg, lay, gpu_mem_gib, opts, pool), lay) for lay in layouts]
    best, lay = max(scored, key=lambda x: (x[0], -x[1].tensor))
    return lay, best, why if lay.data > 1 else ""


def best_peak(cfg: LaunchConfig, method: Method, seq: int, opts: MemoryOptions, pool: PoolFn
               ) -> MemoryBreakdown | None:
    layouts, _ = candidate_layouts(cfg, method)
    options = [estimate(cfg, lay, seq, opts, pool) for lay in layouts if seq % lay.granule() == 0]
    return min(options, key=lambda b: b.total) if options else None


# --------------------------------------------------------------------------- output
