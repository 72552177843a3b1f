"""CUDA graph capture: refused around every HSAP layer (docs/enable.md "CUDA graphs").

HSAP compiles a host-side program per packed batch (the plan: which blocks each rank computes,
what it sends and receives in each P2P round, how the tokens are permuted), and its layers run
that program from Python. A CUDA graph records the kernels and NCCL calls of the batch it was
captured on and replays exactly those on every later batch: new q/k/v would be sent, received
and merged by the captured batch's program — wrong attention for any other document boundaries,
with nothing to report it. (Megatron's own graphs keep ``PackedSeqParams``' tensors as static
buffers refilled at each replay, but a plan is a host object: ``megatron-core``'s
``cuda_graphs.tree_map`` freezes it with the capture.) So a layer that runs a plan refuses to be
captured; Megatron's argument check (``megatron/arguments.py``: ``cuda_graph_problem``) refuses
the flags that would capture one, before any collective, and this check catches every other
capturer (Transformer Engine's ``make_graphed_callables``, ``torch.compile(mode="reduce-overhead")``,
a user's ``torch.cuda.graph``) at its first captured call — every rank of the group captures the
same layer, so every rank raises it before its first collective.
"""

from __future__ import annotations

import torch

from megatron_hsap.errors import ConfigError

__all__ = ["refuse_graph_capture"]


def refuse_graph_capture(device: torch.device, what: str) -> None:
    """Raise :class:`ConfigError` when the current stream of ``device`` (the layer's tensors') is
    capturing a CUDA graph (``what``: the layer, for the message). No synchronisation: a query of
    the stream's capture state."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ConfigError(
            f"{what} is being captured into a CUDA graph: HSAP runs a P2P program compiled per packed batch "
            "(its plan) from the host, and a graph would replay the captured batch's program on every later "
            "batch (wrong attention, silently). Capture only modules without attention or scan layers (Megatron: "
            "--cuda-graph-impl local|transformer_engine with --cuda-graph-modules from mlp, moe, moe_router, "
            "moe_preprocess), or run this layer eagerly"
        )
