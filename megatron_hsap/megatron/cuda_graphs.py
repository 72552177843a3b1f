"""Megatron's CUDA graph flags under ``--context-parallel-impl hsap``: the one rule of which
captures HSAP refuses, read from a parsed namespace (``arguments.check_before_megatron``) or from
command-line tokens (a launch config's ``megatron_args``, ``launch/loader.check_passthrough``).

A graph replays the batch it captured; HSAP's attention and scan layers run a program compiled
per packed batch (``runtime/capture.py`` says why that replays wrong attention, silently). So
whatever captures one is refused: ``--cuda-graph-impl full_iteration`` (the whole step),
``local`` / ``transformer_engine`` without ``--cuda-graph-modules`` (whole layers, Megatron's
default scope, or the deprecated ``full``), and the modules ``attn`` (``_forward_attention``: core
attention inside) and ``mamba`` (HSAP's Mamba layers reorder tokens by the plan). The MLP and MoE
modules run no plan: their shapes are the rank's token count, fixed by ``--seq-length`` as under
ring CP, so they may be captured (Megatron 0.19.2's ``CudaGraphModule``; not run on a GPU by this
project: launch configs list them as ``untested: [cuda_graphs]``). The deprecated spellings
(``--enable-cuda-graph``, ``--external-cuda-graph``, ``--cuda-graph-scope``) are read as Megatron's
``validate_args`` maps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_hsap.argtypes import flag_names, flag_occurrences, flag_value

__all__ = ["GRAPHABLE_MODULES", "cuda_graph_problem", "namespace_cuda_graphs", "argv_cuda_graphs"]

# Megatron's CudaGraphModule names whose captured regions run no HSAP plan
GRAPHABLE_MODULES = ("mlp", "moe", "moe_router", "moe_preprocess")
_REFUSED_MODULES = {"attn": "attention (HSAP's core attention runs inside it)",
                    "mamba": "Mamba layers (HSAP reorders their tokens by the batch's plan)"}
_INFERENCE_ONLY = "full_iteration_inference"  # (an inference scope: training ignores it)


def cuda_graph_problem(impl: str, modules: Sequence[str]) -> str | None:
    """Why ``--cuda-graph-impl impl`` with ``--cuda-graph-modules modules`` (Megatron's names, as
    given: ``full`` and ``full_iteration`` included) would capture an HSAP layer, or None."""
    modules = [m for m in modules if m != _INFERENCE_ONLY]
    if "full_iteration" in modules:  # (validate_args moves the deprecated module to the impl)
        impl = "full_iteration"
    if impl in (None, "", "none"):
        return None
    fix = (f"capture only modules without attention: --cuda-graph-modules {' '.join(GRAPHABLE_MODULES[:2])} (any of "
           f"{', '.join(GRAPHABLE_MODULES)}), or drop the CUDA graph flags")
    why = "HSAP runs a P2P program compiled per packed batch, and a graph replays the captured batch's on every later one"
    if impl == "full_iteration":
        return f"--cuda-graph-impl full_iteration captures the whole training step, HSAP's attention with it ({why}); {fix}"
    if not modules or "full" in modules:
        return (f"--cuda-graph-impl {impl} without --cuda-graph-modules captures whole transformer layers, "
                f"HSAP's attention with them ({why}); {fix}")
    bad = [m for m in modules if m in _REFUSED_MODULES]
    if bad:
        what = "; ".join(f"{m}: {_REFUSED_MODULES[m]}" for m in bad)
        return f"--cuda-graph-modules {' '.join(bad)} would capture HSAP layers ({what}; {why}); {fix}"
    return None


def namespace_cuda_graphs(args: Any) -> tuple[str, list[str]]:
    """``(impl, modules)`` of a parsed Megatron namespace, before or after its ``validate_args``
    (which turns the deprecated flags into ``cuda_graph_impl`` and ``CudaGraphModule`` values)."""
    impl = getattr(args, "cuda_graph_impl", None) or "none"
    if getattr(args, "enable_cuda_graph", False):
        impl = "local"
    if getattr(args, "external_cuda_graph", False):
        impl = "transformer_engine"
    given = getattr(args, "cuda_graph_scope_deprecated", None) or getattr(args, "cuda_graph_modules", None) or []
    given = [given] if isinstance(given, str) else list(given)
    return impl, [getattr(m, "name", str(m)) for m in given]


def argv_cuda_graphs(argv: Sequence[str]) -> tuple[str, list[str]]:
    """``(impl, modules)`` of Megatron command-line tokens (either spelling, ``--flag V`` or
    ``--flag=V``; the last occurrence wins, as in argparse)."""
    argv = list(argv)
    impl = flag_value(argv, "--cuda-graph-impl") or "none"
    names = flag_names(argv)
    if "--enable-cuda-graph" in names:
        impl = "local"
    if "--external-cuda-graph" in names:
        impl = "transformer_engine"
    # the deprecated --cuda-graph-scope sets the same modules: one flag, whose last occurrence wins
    old = "--cuda-graph-scope"
    tokens = ["--cuda-graph-modules" + a[len(old):] if a.split("=", 1)[0] == old else a for a in argv]
    given = flag_occurrences(tokens, "--cuda-graph-modules")
    return impl, given[-1] if given else []
