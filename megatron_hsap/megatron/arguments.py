"""Command-line flags for Megatron-LM: ``--context-parallel-impl {ring,hsap}`` and the HSAP sizes.

``add_hsap_args(parser)`` is an ``extra_args_provider`` for ``megatron.training.arguments.
parse_and_validate_args``; ``validate_hsap_args(args)`` runs after Megatron's own validation and
refuses (``ConfigError``) every setting HSAP cannot honour, naming the flag to change;
``check_before_megatron(args)`` runs the few of those rules Megatron asserts without a message
before Megatron's validation does (``pretrain_hooks.run_pretrain``).

Topology reuses Megatron's ``--hierarchical-context-parallel-sizes P_intra P_inter`` (level 0 =
contiguous blocks of CP ranks = intra/NVLink, level 1 = strided = inter/InfiniBand, docs/design.md §1), so
``initialize_hsap`` can reuse the groups Megatron builds from it. Without it, P_intra is the
largest divisor of the CP size whose intra group (× TP) fits in one node of ``LOCAL_WORLD_SIZE``
GPUs and splits the heads evenly; the choice is printed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.cuda_graphs import cuda_graph_problem, namespace_cuda_graphs
from megatron_hsap.plan.costs import DEFAULT_GRAD_WIRE_DTYPE, GRAD_WIRE_DTYPES
from megatron_hsap.plan.hardware import HARDWARE
from megatron_hsap.plan.checks import divisors
from megatron_hsap.plan.options import FLATTEN, FORCED_FLATTEN, intra_fits_heads

__all__ = ["HSAPArgs", "add_hsap_args", "check_before_megatron", "drop_hsap_flags", "validate_hsap_args", "IMPLS"]

IMPLS = ("ring", "hsap")
SPEC_MODULE = "megatron_hsap.megatron.spec"
SPEC_NAME = "hsap_layer_spec"  # a callable: Megatron calls it with the run's GPTModelConfig
HYBRID_SPEC_NAME = "HSAP_HYBRID_STACK_SPEC"  # a ModuleSpec: HybridModelBuilder does not call --spec
HYBRID_REFUSED = {"D": "DSA ('D')"}


@dataclass(frozen=True, slots=True, kw_only=True)
class HSAPArgs:
    """The validated HSAP settings of a Megatron run."""

    intra_size: int
    inter_size: int
    layout: str = "balanced"
    layout_fallback: bool = True
    pool_bytes: int | None = None
    node_check: str = "error"
    derived_sizes: bool = False  # True when P_intra × P_inter were chosen, not given

    @property
    def cp_size(self) -> int:
        return self.intra_size * self.inter_size


def _has_option(parser: argparse.ArgumentParser, option: str) -> bool:
    return any(option in action.option_strings for action in parser._actions)


def add_hsap_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add HSAP's flags to a Megatron (or plain) argparse parser; returns the parser.

    Idempotent: the patched Megatron-LM adds them in ``parse_args`` and an entry point's
    ``extra_args_provider`` may add them again."""
    if _has_option(parser, "--hsap-layout"):
        return parser
    group = parser.add_argument_group(title="HSAP context parallelism (megatron-hsap)")
    if not _has_option(parser, "--context-parallel-impl"):  # present when patches/ is applied
        group.add_argument(
            "--context-parallel-impl", choices=IMPLS, default="ring",
            help="ring: Megatron/Transformer Engine context parallelism (default). hsap: hierarchical "
            "sequence-aware CP for packed batches (megatron-hsap); sizes from "
            "--hierarchical-context-parallel-sizes P_intra P_inter.",
        )
    if not _has_option(parser, "--hierarchical-context-parallel-sizes"):
        # Megatron's parser has it already; a plain parser (tests, tools) gets the same flag.
        group.add_argument(
            "--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
            help="HSAP: P_intra P_inter (intra = GPUs of one node, inter = nodes); product = CP size.",
        )
    if not _has_option(parser, "--context-parallel-size"):
        group.add_argument("--context-parallel-size", type=int, default=1)
    group.add_argument(
        "--hsap-layout", choices=("contiguous", "balanced"), default="balanced",
        help="HSAP token layout: balanced (default; document-aware: documents kept whole or split "
        "head-tail so every rank has equal tokens and near-equal work) or contiguous (the paper's chunks).",
    )
    group.add_argument(
        "--hsap-layout-fallback", action=argparse.BooleanOptionalAction, default=True,
        help="With --hsap-layout balanced: also compile the contiguous plan and keep it on batches where "
        "it is estimated faster (default; about twice the compile time). --no-hsap-layout-fallback "
        "always uses the balanced layout.",
    )
    group.add_argument(
        "--hsap-plan-prefetch", action=argparse.BooleanOptionalAction, default=True,
        help="Read one micro-batch ahead and compile its HSAP plan on a background thread while the "
        "current one runs (default); --no-hsap-plan-prefetch compiles each plan when its batch is taken.",
    )
    group.add_argument(
        "--hsap-plan-process", action=argparse.BooleanOptionalAction, default=None,
        help="With --hsap-plan-prefetch: compile the plans in one child process per rank (default on), off "
        "the training process's GIL, which a compiling thread holds against every op the training "
        "thread dispatches (megatron_hsap/megatron/plan_worker.py); --no-hsap-plan-process compiles "
        "them on the prefetch thread.",
    )
    group.add_argument(
        "--hsap-pool-bytes", type=int, default=None,
        help="HSAP receive-buffer pool per rank in bytes (default: 4 inter chunks of q/k/v rows).",
    )
    group.add_argument(
        "--hsap-head-chunks", type=int, default=None,
        help="Head chunks the intra all-to-all is pipelined over (the all-to-all of chunk k+1 runs while "
        "SAP computes chunk k; default: the planner chooses per batch by its estimate). Must divide the q "
        "and kv heads each intra rank holds.",
    )
    group.add_argument(
        "--hsap-flatten", choices=FLATTEN, default="auto",
        help="Also plan each batch on a one-level topology of the same CP ranks, pure SAP (1 x P, no "
        "all-to-all) or one all-to-all (P x 1, Ulysses), and keep the plan estimated fastest: auto (default; "
        "only when the CP group sits inside one node), always (1 x P), all-to-all (P x 1), or never. Packed "
        "short documents then stay whole on one GPU instead of crossing the all-to-all, and a long document "
        "skips SAP's merges (plan/flatten.py); about twice the compile time at P_intra > 1 inside one node.",
    )
    group.add_argument(
        "--hsap-grad-wire-dtype", choices=GRAD_WIRE_DTYPES, default=DEFAULT_GRAD_WIRE_DTYPE,
        help="Dtype the partial gradients dq, dk, dv travel in between inter ranks: activation (default; "
        "bf16/fp16: the GPU kernels return them in that dtype, so the values are the same at half the "
        "bytes of fp32) or fp32. Accumulation stays fp32 either way.",
    )
    group.add_argument(
        "--hsap-hardware", choices=sorted(HARDWARE), default=None,
        help="Hardware constants the HSAP planner prices plans with (default: from the GPU's name, "
        "A100 when unknown; printed at start-up).",
    )
    group.add_argument(
        "--hsap-gpus-per-node", type=int, default=None,
        help="GPUs per node for the planner's link choice (default: LOCAL_WORLD_SIZE from the launcher).",
    )
    group.add_argument(
        "--hsap-metrics", action=argparse.BooleanOptionalAction, default=True,
        help="Per-iteration HSAP figures (layout, imbalance, estimated attention time, compile ms, prefetch "
        "hits, pool use, bytes per rank) in Megatron's TensorBoard/W&B writers and a log line every "
        "--log-interval iterations (default on).",
    )
    group.add_argument(
        "--hsap-dump-plan", nargs=2, metavar=("ITER", "DIR"), default=None,
        help="Write the plan of iteration ITER's first micro-batch to DIR: every inter rank's fwd/bwd "
        "program, plan.json (inputs, figures, verification) and plot.sh (redraws its picture). A DIR that "
        "cannot be written is reported on stderr and training goes on.",
    )
    group.add_argument(
        "--hsap-node-check", choices=("error", "warn", "off"), default="error",
        help="What to do when an HSAP intra group spans hosts (all-to-all over the network).",
    )
    return parser


def _check_head_chunks(args: Any, intra: int, heads: int, kv_heads: int) -> None:
    """``--hsap-head-chunks`` against the heads each intra rank holds (plan/chunks.py's one rule)."""
    chunks = getattr(args, "hsap_head_chunks", None)
    if chunks is None:
        return
    from megatron_hsap.plan.chunks import valid_head_chunks
    from megatron_hsap.plan.options import kv_heads_per_rank

    _refuse(chunks < 1, f"--hsap-head-chunks {chunks}: must be >= 1 (or leave it out: the planner chooses)")
    flatten = getattr(args, "hsap_flatten", "auto")
    _refuse(flatten in FORCED_FLATTEN, f"--hsap-head-chunks {chunks} pins the configured all-to-all (P_intra={intra}), but "
            f"--hsap-flatten {flatten} plans every batch on a one-level topology instead, whose head chunks the planner "
            "chooses; drop one of the two (--hsap-flatten auto keeps the configured topology when the count is pinned)")
    _refuse(intra == 1 and chunks > 1, f"--hsap-head-chunks {chunks}: P_intra is 1 (pure SAP, no all-to-all to "
            "pipeline); leave it out or pass 1")
    if intra > 1 and heads % intra == 0:
        local_kv = kv_heads_per_rank(heads, kv_heads, intra)
        valid = valid_head_chunks(heads // intra, local_kv)
        _refuse(chunks not in valid, f"--hsap-head-chunks {chunks}: each intra rank holds {heads // intra} q and "
                f"{local_kv} kv heads; valid counts: {list(valid)}")


def _given_sizes(sizes: Any, cp: int) -> tuple[int, int]:
    """``--hierarchical-context-parallel-sizes`` as given: two levels whose product is the CP size."""
    if len(sizes) != 2:
        raise ConfigError(
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: HSAP needs exactly two "
            "levels, P_intra P_inter (GPUs per node in the CP group, then nodes)"
        )
    intra, inter = int(sizes[0]), int(sizes[1])
    if intra < 1 or inter < 1 or intra * inter != cp:
        raise ConfigError(
            f"--hierarchical-context-parallel-sizes {intra} {inter}: the product must equal "
            f"--context-parallel-size {cp}"
        )
    return intra, inter


def _sizes(args: Any, cp: int, tp: int, heads: int, kv_heads: int) -> tuple[int, int, bool]:
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    if sizes:
        return (*_given_sizes(sizes, cp), False)
    if cp == 1:
        return 1, 1, False
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not local:
        raise ConfigError(
            f"--context-parallel-impl hsap with --context-parallel-size {cp} needs "
            "--hierarchical-context-parallel-sizes P_intra P_inter (LOCAL_WORLD_SIZE is unset, so the "
            "GPUs per node are unknown)"
        )
    fits = [d for d in divisors(cp) if tp * d <= int(local) and intra_fits_heads(heads, kv_heads, d)]
    intra = max(fits) if fits else 1
    if int(os.environ.get("RANK", "0")) == 0:  # arguments are parsed on every rank
        print(
            f"[megatron-hsap] --hierarchical-context-parallel-sizes not given: using P_intra={intra} "
            f"P_inter={cp // intra} (TP={tp}, {local} GPUs per node); pass the flag to choose",
            flush=True,
        )
    return intra, cp // intra, True


def _seq_aux_loss_coeff(args: Any) -> float:
    """The coefficient Megatron's router gives ``seq_aux_loss`` (its ``get_aux_loss_coeff``: the type
    and the coefficient as one value each, or as lists by position); 0 when it is not used."""
    types = getattr(args, "moe_router_load_balancing_type", None)
    coeffs = getattr(args, "moe_aux_loss_coeff", 0.0)
    types = [types] if isinstance(types, str) else list(types or [])
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs]
    if "seq_aux_loss" not in types or not coeffs:
        return 0.0
    k = types.index("seq_aux_loss")
    return float(coeffs[k] if k < len(coeffs) else coeffs[0])


def _check_mamba_heads(args: argparse.Namespace, cp: int) -> None:
    """Megatron's Mamba CP splits each TP rank's heads and groups over the CP ranks
    (``ssm/mamba_context_parallel.py``, asserted when the model builds): say so before any collective."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    head_dim = int(getattr(args, "mamba_head_dim", None) or 64)
    hidden = getattr(args, "hidden_size", None)
    heads = getattr(args, "mamba_num_heads", None) or (2 * int(hidden) // head_dim if hidden else 0)  # (MambaMixer's expand 2)
    groups = int(getattr(args, "mamba_num_groups", None) or 8)
    _refuse(bool(heads) and heads % (tp * cp) != 0, f"--hybrid-layer-pattern with Mamba layers: their {heads} heads (--mamba-num-heads, else "
            f"2 x hidden / --mamba-head-dim) must split over TP {tp} x CP {cp} (Megatron's Mamba CP gives each CP rank "
            "whole heads); change --mamba-num-heads or the CP size")  # fmt: skip
    local = groups // tp if groups % tp == 0 else 0
    _refuse(not local or (cp % local if local < cp else local % cp) != 0,
            f"--mamba-num-groups {groups}: Megatron's Mamba CP needs the groups per TP rank ({groups}/{tp}) and the CP size "
            f"({cp}) to divide one another; change --mamba-num-groups")
    _refuse(getattr(args, "use_mamba_mem_eff_path", True) is False,
            "HSAP's Mamba layers train through megatron-core's memory-efficient Mamba path (the other takes no packed "
            "sequences): drop --disable-mamba-mem-eff-path")


def _check_gdn_heads(args: argparse.Namespace, cp: int, what: str = "--hybrid-layer-pattern with gated delta net layers") -> None:
    """Megatron's gated delta net CP gives each CP rank whole key and value heads of its TP rank
    (``ssm/gated_delta_net``, asserted when the model builds): say so before any collective
    (``what``: the flag that asks for the layers)."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    for flag, default in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32)):
        heads = int(getattr(args, flag, None) or default)
        _refuse(heads % (tp * cp) != 0, f"{what}: --{flag.replace('_', '-')} "
                f"{heads} must split over TP {tp} x CP {cp} (Megatron's gated delta net CP gives each CP rank whole heads)")
    _refuse(not getattr(args, "swiglu", False), f"{what}: megatron-core "
            "convolves their q / k / v with the model's activation and asserts it is silu: pass --swiglu")


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise ConfigError(message)


def _hsap_actions() -> dict[str, argparse.Action]:
    """HSAP's own flags (``--hsap-*``, ``--no-hsap-*``) → their argparse actions (``add_hsap_args``)."""
    parser = add_hsap_args(argparse.ArgumentParser(allow_abbrev=False))
    return {o: a for o, a in parser._option_string_actions.items() if o.startswith(("--hsap-", "--no-hsap-"))}


def _spelled(action: argparse.Action, value: Any) -> str:
    """How a command line gives ``value`` to ``action``'s flag."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return action.option_strings[0 if value else 1]
    shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    return f"{action.option_strings[0]} {shown}"


def drop_hsap_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` without HSAP's own flags and their values (the same command line for a ``ring`` run)."""
    actions = _hsap_actions()
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        act = actions.get(a.split("=", 1)[0])
        if act is None:
            out.append(a)
        elif "=" not in a:
            skip = act.nargs if isinstance(act.nargs, int) else 1
    return out


def check_before_megatron(args: Any) -> None:
    """The HSAP rules Megatron's own ``validate_args`` checks first with a bare ``assert`` (no
    message), checked on the parsed namespace before it runs (``pretrain_hooks.run_pretrain``):
    the hierarchical sizes (two levels whose product is ``--context-parallel-size``), and
    ``--cp-comm-type`` (Transformer Engine's CP algorithm; Megatron asserts hierarchical sizes for
    ``a2a+p2p``, and HSAP would ignore it silently), and CUDA graphs that would capture an HSAP layer
    (``cuda_graphs.cuda_graph_problem``). Under ``ring``: HSAP's own flags set to
    anything but their defaults (the ring would ignore them: the impl flag was forgotten). Raises
    :class:`ConfigError` naming the flag; ``validate_hsap_args`` runs it too."""
    if getattr(args, "context_parallel_impl", "ring") != "hsap":
        given = sorted({_spelled(a, v) for a in _hsap_actions().values()
                        if (v := getattr(args, a.dest, a.default)) != a.default})
        _refuse(bool(given), f"{', '.join(given)}: HSAP's flags, but --context-parallel-impl is ring (the default), "
                "which ignores them; add --context-parallel-impl hsap, or drop them")
        return
    sizes = getattr(args, "hierarchical_context_parallel_sizes", None)
    if sizes:
        _given_sizes(sizes, int(getattr(args, "context_parallel_size", 1) or 1))
    comm = getattr(args, "cp_comm_type", None) or ["p2p"]
    comm = [comm] if isinstance(comm, str) else list(comm)
    _refuse(any(c != "p2p" for c in comm),
            f"--cp-comm-type {' '.join(comm)} selects Transformer Engine's context-parallel algorithm, which "
            "--context-parallel-impl hsap replaces (its all-to-all / P2P split is --hierarchical-context-parallel-sizes "
            "P_intra P_inter): drop --cp-comm-type")
    graphs = cuda_graph_problem(*namespace_cuda_graphs(args))  # (a graph would replay one batch's plan)
    _refuse(graphs is not None, str(graphs))


def validate_hsap_args(args: Any) -> HSAPArgs | None:
    """Check a parsed Megatron namespace for ``--context-parallel-impl hsap``.

    Returns None for ``ring``; otherwise an :class:`HSAPArgs`, after setting ``args.spec`` to the HSAP
    layer spec when no ``--spec`` was given. Raises :class:`ConfigError` naming the flag to change.
    """
    impl = getattr(args, "context_parallel_impl", "ring")
    if impl not in IMPLS:
        raise ConfigError(f"--context-parallel-impl {impl!r}: choose one of {', '.join(IMPLS)}")
    check_before_megatron(args)
    if impl == "ring":
        return None
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    heads_total = getattr(args, "num_attention_heads", None)
    heads = (heads_total // tp) if heads_total else 1
    groups_total = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else heads_total
    kv_heads = max(1, (groups_total or heads_total or tp) // tp)
    intra, inter, derived = _sizes(args, cp, tp, heads, kv_heads)
    if heads_total:
        _refuse(heads_total % tp != 0, f"--num-attention-heads {heads_total} is not divisible by --tensor-model-parallel-size {tp}")
        _refuse(
            not intra_fits_heads(heads, kv_heads, intra),
            f"P_intra={intra} must divide the {heads} attention heads per TP rank, and divide or be a "
            f"multiple of the {kv_heads} kv heads per TP rank; valid P_intra: "
            f"{[d for d in divisors(cp) if intra_fits_heads(heads, kv_heads, d)]}",
        )
    _check_head_chunks(args, intra, heads, heads if getattr(args, "multi_latent_attention", False) else kv_heads)

    # attention dropout runs under HSAP (runtime/dropout.py; its [0, 1) range is Megatron's own check)
    # either loss normalisation: megatron/loss.py gives Megatron the micro-batch's token count
    from megatron_hsap.megatron.windows import megatron_window

    megatron_window(getattr(args, "window_size", None))  # sliding windows are planned (plan/window.py); causal ones only
    if getattr(args, "multi_latent_attention", False):  # megatron/mla.py: RoPE of the decoupled part by position
        rope_type = getattr(args, "rope_type", None) or "yarn"  # MLATransformerConfig's default
        _refuse(rope_type not in ("rope", "yarn"), f"--rope-type {rope_type}: HSAP's MLA supports rope and yarn")
        _refuse(bool(getattr(args, "apply_rope_fusion", False)),
                "--multi-latent-attention: Transformer Engine's fused MLA RoPE assumes the zigzag CP layout; "
                "HSAP applies it by position: pass --no-rope-fusion")
        _refuse(bool(getattr(args, "mla_down_proj_fusion", False)),
                "--mla-down-proj-fusion swaps in FusedMLASelfAttention (RoPE by Megatron's layout); drop it with HSAP")
    # Megatron's experimental attention variants: gated delta net layers (a GPT block's every few
    # layers, Qwen3-Next's; a hybrid model's 'G' layers) are HSAP's; DSA, and Megatron-LM main's gdn2
    # (its HybridBlock then builds its own GatedDeltaNet2 for 'G' layers, whatever the stack spec
    # says) read Megatron's token layout
    variant = getattr(args, "experimental_attention_variant", None)
    _refuse(variant not in (None, "gated_delta_net"),
            f"--experimental-attention-variant {variant}: not supported by HSAP (its layers' context parallelism assumes "
            "Megatron's token layout); HSAP runs gated_delta_net (or a hybrid model's 'G' layers), or use "
            "--context-parallel-impl ring")
    if variant == "gated_delta_net" and not (getattr(args, "hybrid_layer_pattern", None)
                                             or getattr(args, "hybrid_override_pattern", None)):
        _check_gdn_heads(args, cp, "--experimental-attention-variant gated_delta_net")
    _refuse(bool(getattr(args, "hybrid_context_parallel", False)),
            "--hybrid-context-parallel and --context-parallel-impl hsap are alternatives; pick one")
    pos = getattr(args, "position_embedding_type", "rope")
    _refuse(pos not in ("rope", "yarn", "learned_absolute", "none"),
            f"--position-embedding-type {pos}: HSAP supports rope, yarn, learned_absolute and none")
    softmax_type = getattr(args, "softmax_type", "vanilla") or "vanilla"  # sinks: merged once per row (runtime/merge.py)
    _refuse(softmax_type not in ("vanilla", "off-by-one", "learnable"),
            f"--softmax-type {softmax_type}: HSAP supports vanilla, off-by-one and learnable")
    # Config fields without a flag in 0.19.2 (a YAML config or a wrapper may set them).
    _refuse(bool(getattr(args, "fp8_dot_product_attention", False)),
            "fp8_dot_product_attention (TransformerConfig) is not supported by HSAP: set it False")
    _refuse(bool(getattr(args, "fused_single_qkv_rope", False)),
            "fused_single_qkv_rope (TransformerConfig) applies RoPE by row; HSAP applies it by position: set it False")
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    mbs = int(getattr(args, "micro_batch_size", 1) or 1)
    _refuse(
        pp > 1 and mbs > 1 and not getattr(args, "variable_seq_lengths", False),
        f"--pipeline-model-parallel-size {pp} with --micro-batch-size {mbs}: HSAP activations are "
        "packed [t, 1, h], not [s/cp, mbs, h]; use --micro-batch-size 1",
    )
    seq_aux = _seq_aux_loss_coeff(args)
    _refuse(
        bool(getattr(args, "num_experts", None)) and seq_aux > 0 and mbs > 1,
        f"--moe-router-load-balancing-type seq_aux_loss (coefficient {seq_aux:g}) with --micro-batch-size {mbs}: "
        "Megatron's router balances each sample of its [s, b] input, and HSAP packs a micro-batch's samples "
        "into one sequence [t, 1, h], so the loss would balance the micro-batch as one sample; use "
        "--micro-batch-size 1 (longer packed samples), or aux_loss / global_aux_loss",
    )
    spec = list(getattr(args, "spec", None) or [])
    if spec and spec[0] != SPEC_MODULE:
        raise ConfigError(
            f"--spec {' '.join(spec)}: --context-parallel-impl hsap needs the HSAP layer spec "
            f"(--spec {SPEC_MODULE} {SPEC_NAME}) or no --spec"
        )
    pattern = getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None)
    if pattern:  # HybridModel: Megatron's HybridModelBuilder takes the stack spec object itself
        bad = sorted(set(pattern) & set(HYBRID_REFUSED))
        _refuse(bool(bad), f"--hybrid-layer-pattern {pattern}: {', '.join(HYBRID_REFUSED[b] for b in bad)} layers "
                "are not supported by HSAP (their CP assumes Megatron's token layout); use attention '*', MLA '+', "
                "Mamba 'M', gated delta net 'G', MLP '-' and MoE 'E' layers, or --context-parallel-impl ring")  # fmt: skip
        if "M" in pattern:
            _check_mamba_heads(args, cp)
        if "G" in pattern:
            _check_gdn_heads(args, cp)
        args.spec = [SPEC_MODULE, HYBRID_SPEC_NAME]
    else:
        # The module-level specs were built without the run's config (QK norm, MoE ... would be lost):
        # always hand Megatron the callable it calls with the config.
        args.spec = [SPEC_MODULE, SPEC_NAME]
    if getattr(args, "attention_backend", None) is not None and str(getattr(args.attention_backend, "name", args.attention_backend)) == "local":
        raise ConfigError("--attention-backend local makes Megatron replace the spec's core attention with its own "
                          "DotProductAttention; with --context-parallel-impl hsap use --attention-backend auto")
    # Megatron's per-document mask flag: HSAP takes the boundaries from cu_seqlens only, so without
    # them it would attend across the documents this flag asks to separate (a ring run's habit)
    _refuse(bool(getattr(args, "reset_attention_mask", False))
            and not (getattr(args, "dataloader_inter_document_masking", False) or getattr(args, "sft", False)),
            "--reset-attention-mask asks for per-document attention, which HSAP reads from each batch's cu_seqlens, "
            "not from a dense mask: pass --dataloader-inter-document-masking (and drop --reset-attention-mask)")
    # (None: not given; on by default) with every plan compiled on the training thread there is no
    # prefetched plan for a worker process to compile: the flag would be dropped silently
    _refuse(getattr(args, "hsap_plan_process", None) is True and getattr(args, "hsap_plan_prefetch", True) is False,
            "--hsap-plan-process compiles the prefetched plans in a worker process, but --no-hsap-plan-prefetch "
            "compiles every plan on the training thread when its batch is taken: drop one of them")
    if getattr(args, "hsap_plan_process", None) is None:
        args.hsap_plan_process = True
    if getattr(args, "sft", False):  # (SFTDataset's bare asserts, raised per rank while the datasets build)
        off = [flag for flag, on in (
            ("--reset-position-ids (drop it)", getattr(args, "reset_position_ids", False)),
            ("--reset-attention-mask (drop it)", getattr(args, "reset_attention_mask", False)),
            # Megatron's default, turned off only by --dataloader-inter-document-masking
            ("--create-attention-mask-in-dataloader (Megatron's default: pass --no-create-attention-mask-in-dataloader)",
             getattr(args, "create_attention_mask_in_dataloader", False)
             and not getattr(args, "dataloader_inter_document_masking", False))) if on]
        _refuse(bool(off), f"--sft: Megatron's SFTDataset asserts these off: {'; '.join(off)} (each conversation has "
                "its own positions; HSAP reads the conversations from each batch's cu_seqlens; "
                "megatron/training/datasets/sft_dataset.py)")
    pool = getattr(args, "hsap_pool_bytes", None)  # (0 was read as "unset" by plan_flags)
    _refuse(pool is not None and pool < 1, f"--hsap-pool-bytes {pool}: must be >= 1 (or leave it out: 4 inter "
            "chunks of q/k/v rows per rank)")
    # the flags' own rules (resolve_hardware's), checked now rather than at the first batch
    from megatron_hsap.megatron.hardware import resolve_hardware

    resolve_hardware(flag=getattr(args, "hsap_hardware", None), device_name=None,
                     flag_gpus=getattr(args, "hsap_gpus_per_node", None), local_world_size=None)
    dump = getattr(args, "hsap_dump_plan", None)
    if dump:
        _refuse(not str(dump[0]).isdigit() or int(dump[0]) < 1,
                f"--hsap-dump-plan {dump[0]} {dump[1]}: ITER must be an iteration number >= 1")
    return HSAPArgs(
        intra_size=intra,
        inter_size=inter,
        layout=getattr(args, "hsap_layout", "balanced"),
        layout_fallback=getattr(args, "hsap_layout_fallback", True),
        pool_bytes=getattr(args, "hsap_pool_bytes", None),
        node_check=getattr(args, "hsap_node_check", "error"),
        derived_sizes=derived,
    )
