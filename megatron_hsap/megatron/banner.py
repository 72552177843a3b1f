"""HSAP's start-up lines in Megatron's log (rank 0; docs/enable.md §5): topology, layout, prices, link,
kernels, receive pool, the warning for batches without document boundaries, and a note on per-rank
MoE token dropping."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["print_banner"]


def print_banner(hsap: Any, args: Any, *, link: str | None, plan_kwargs: Callable[[Any], dict[str, Any]]) -> None:
    """Start-up lines (rank 0): HSAP is on, with what topology, layout, prices, kernels and pool;
    a warning when batches carry no document boundaries, a note when MoE drops tokens per rank. ``link``: the CP group's measured link
    (None: not measured); ``plan_kwargs(args)``: the run's ``compile_plan`` options."""
    import torch.distributed as dist

    from megatron_hsap.megatron.hardware import run_hardware

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    hw = run_hardware(args)
    print(f"[megatron-hsap] HSAP context parallelism on: topology {hsap.intra_size}x{hsap.inter_size} "
          f"(intra×inter), layout {hsap.layout}, planner priced for {hw.name} ({hw.source}), "
          f"{hw.gpus_per_node} GPUs per node", flush=True)
    from megatron_hsap.argtypes import link_line  # the one link rule's statement (docs/design.md §4)

    line = link_line(intra=hsap.intra_size, inter=hsap.inter_size, tp=args.tensor_model_parallel_size,
                     gpus_per_node=hw.gpus_per_node, measured=link)
    print(f"[megatron-hsap] plans priced with {line}", flush=True)
    print(f"[megatron-hsap] attention kernels: {_kernel_backend()}; receive pool: "
          f"{_pool_text(args, plan_kwargs)}", flush=True)
    if not (getattr(args, "sft", False) or getattr(args, "dataloader_inter_document_masking", False)):
        print("[megatron-hsap] WARNING: no --dataloader-inter-document-masking (or --sft): batches carry no "
              "document boundaries, so HSAP treats every sample as ONE document (attention crosses the "
              "packed documents' boundaries). Pass --dataloader-inter-document-masking for packed data.",
              flush=True)
    if getattr(args, "moe_expert_capacity_factor", None) is not None:
        # (measured: 8.0e-4 apart from CP=1 after 6 steps at factor 1.0; README's MoE row)
        print("[megatron-hsap] note: --moe-expert-capacity-factor drops tokens per rank, among the rank's own "
              "tokens: HSAP's layout gives each CP rank other tokens than CP=1 (or Megatron's ring CP) does, so "
              "other tokens are dropped and the losses differ from those runs'", flush=True)
    if float(getattr(args, "hidden_dropout", 0.0) or 0.0) > 0:
        # (measured: 7.9e-4 apart from CP=1 after 6 steps at 0.1; attention dropout alone: equal, runtime/dropout.py)
        print("[megatron-hsap] note: --hidden-dropout draws its masks over each rank's own tokens (Megatron's "
              "dropout on the rank's shard): HSAP's layout gives each CP rank other tokens than CP=1 (or Megatron's "
              "ring CP) does, so other masks are drawn and the losses differ from those runs'", flush=True)


def _kernel_backend() -> str:
    """The attention kernel backend HSAP will use on this rank's device (``HSAP_KERNEL`` honoured)."""
    import sys

    import torch

    from megatron_hsap.runtime.kernels import resolve_backend

    standin = sys.modules.get("megatron_hsap.megatron.cpu.device")  # CPU demo: tensors live on the CPU
    on_gpu = torch.cuda.is_available() and not (standin is not None and standin.installed())
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    try:
        return f"{resolve_backend(None, device)} on {device}"
    except Exception as exc:  # noqa: BLE001 - the banner reports; the first attention call raises
        return f"none available on {device} ({exc})"


def _pool_text(args: Any, plan_kwargs: Callable[[Any], dict[str, Any]]) -> str:
    if getattr(args, "hsap_pool_bytes", None):
        return f"{args.hsap_pool_bytes / 2**20:.1f} MiB per rank (--hsap-pool-bytes)"
    from megatron_hsap.plan import compile_plan

    kwargs = plan_kwargs(args)
    tokens = int(args.seq_length) * int(args.micro_batch_size)
    hsap = args.hsap
    plan = compile_plan([0, tokens], hsap.inter_size, intra_size=hsap.intra_size,  # the configured topology's pool
                        **{**{k: v for k, v in kwargs.items() if k not in ("layout", "layout_fallback")}, "flatten": "never"})
    return (f"{plan.stats().pool_capacity_bytes / 2**20:.1f} MiB per rank (default: 4 inter chunks of q/k/v "
            f"rows at {tokens} tokens per micro-batch; --hsap-pool-bytes to set)")
