"""HSAP's own per-iteration metrics in Megatron's logs, and the plan dump of one iteration.

Every training micro-batch adds its plan's figures (:meth:`HSAPMetrics.add`); when Megatron moves to
the next iteration (``args.curr_iteration``) the previous one is flushed: to Megatron's TensorBoard
and W&B writers when they are enabled (``hsap/<name>`` scalars at Megatron's iteration number), and
as one ``[megatron-hsap] iteration N | ...`` line on rank 0 every ``--log-interval`` iterations.
The plan figures are the same on every CP rank (one plan per batch); compile time and prefetch
hits are this rank's. ``--hsap-dump-plan ITER DIR`` writes the first micro-batch's plan of iteration
``ITER``: every inter rank's forward and backward program, a JSON of the plan's inputs and figures,
and the ``megatron-hsap plan`` command that redraws its picture.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from megatron_hsap.plan import Plan

__all__ = ["IterationMetrics", "HSAPMetrics", "process_metrics", "dump_plan"]


@dataclass
class IterationMetrics:
    """Sums over one iteration's training micro-batches (``micro_batches`` of them)."""

    micro_batches: int = 0
    layouts: dict[str, int] = field(default_factory=dict)
    imbalance_max: float = 0.0
    imbalance_sum: float = 0.0
    estimated_fwd_s: float = 0.0
    estimated_bwd_s: float = 0.0
    compile_s: float = 0.0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    # where each plan compiled: "worker process" (--hsap-plan-process), "prefetch thread", "training thread"
    compiled_in: dict[str, int] = field(default_factory=dict)
    pool_use_max: float = 0.0
    bytes_sent_max: int = 0  # per rank, summed over micro-batches
    documents: int = 0
    tokens: int = 0
    flattened: int = 0  # micro-batches whose plan ran on a one-level topology of the CP group (plan/flatten.py)

    def add(self, plan: "Plan", *, compile_s: float, prefetched: bool | None, compiled_in: str = "training thread") -> None:
        stats = plan.stats()
        self.compiled_in[compiled_in] = self.compiled_in.get(compiled_in, 0) + 1
        self.micro_batches += 1
        self.layouts[str(stats.layout)] = self.layouts.get(str(stats.layout), 0) + 1
        self.imbalance_max = max(self.imbalance_max, float(stats.imbalance))
        self.imbalance_sum += float(stats.imbalance)
        self.estimated_fwd_s += float(stats.fwd_time_s)
        self.estimated_bwd_s += float(stats.bwd_time_s)
        self.compile_s += compile_s
        if prefetched is not None:
            self.prefetch_hits += int(prefetched)
            self.prefetch_misses += int(not prefetched)
        self.pool_use_max = max(self.pool_use_max, float(stats.pool_use))
        self.bytes_sent_max += int(max(stats.bytes_sent_per_rank))
        self.documents += int(stats.num_docs)
        self.tokens += int(stats.num_tokens)
        self.flattened += int(stats.flattened_from is not None)

    def scalars(self) -> dict[str, float]:
        """The figures written to TensorBoard / W&B (``hsap/<name>``)."""
        n = max(1, self.micro_batches)
        return {
            "imbalance_max": self.imbalance_max,
            "imbalance_mean": self.imbalance_sum / n,
            "estimated_attention_ms": 1e3 * (self.estimated_fwd_s + self.estimated_bwd_s),
            "compile_ms": 1e3 * self.compile_s,
            "prefetch_hit_rate": self.prefetch_hits / max(1, self.prefetch_hits + self.prefetch_misses),
            "pool_use_max": self.pool_use_max,
            "bytes_sent_per_rank_max_mb": self.bytes_sent_max / 2**20,
            "balanced_layout_fraction": self.layouts.get("balanced", 0) / n,
            "documents": float(self.documents),
            "flattened_fraction": self.flattened / n,
        }

    def line(self, iteration: int) -> str:
        layouts = ", ".join(f"{name} {count}" for name, count in sorted(self.layouts.items()))
        s = self.scalars()
        return (
            f"[megatron-hsap] iteration {iteration} | micro-batches {self.micro_batches} | layout {layouts} | "
            f"imbalance max {s['imbalance_max']:.3f} mean {s['imbalance_mean']:.3f} | "
            f"estimated attention fwd+bwd {_duration(self.estimated_fwd_s + self.estimated_bwd_s)} | "
            f"compile {s['compile_ms']:.1f} ms | prefetch hits {self.prefetch_hits}/"
            f"{self.prefetch_hits + self.prefetch_misses} | compiled in "
            f"{', '.join(f'{where} {n}' for where, n in sorted(self.compiled_in.items()))} | pool use max {s['pool_use_max']:.2f} | "
            f"sent per rank max {_size(self.bytes_sent_max)} | documents {self.documents} | "
            f"flattened {self.flattened}/{self.micro_batches}"
        )


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class HSAPMetrics:
    """Accumulates micro-batches per Megatron iteration and flushes each finished iteration."""

    def __init__(self, *, log_interval: int, writers: Callable[[], tuple[Any, Any]],
                 is_logging_rank: bool, echo: Callable[[str], None] = print) -> None:
        self._log_interval = max(1, int(log_interval))
        self._writers = writers
        self._logging = is_logging_rank
        self._echo = echo
        self._iteration: int | None = None
        self._current = IterationMetrics()

    def add(self, iteration: int, plan: "Plan", *, compile_s: float, prefetched: bool | None,
            compiled_in: str = "training thread") -> None:
        """One training micro-batch of Megatron's ``iteration`` (``args.curr_iteration``, 0-based)."""
        if self._iteration is not None and iteration != self._iteration:
            self.flush()
        self._iteration = iteration
        self._current.add(plan, compile_s=compile_s, prefetched=prefetched, compiled_in=compiled_in)

    def flush(self) -> IterationMetrics | None:
        """Write the pending iteration (Megatron logs iterations 1-based: ``curr_iteration + 1``)."""
        if self._iteration is None or self._current.micro_batches == 0:
            return None
        done, number = self._current, self._iteration + 1
        self._current, self._iteration = IterationMetrics(), None
        tensorboard, wandb = self._writers()
        scalars = {f"hsap/{k}": v for k, v in done.scalars().items()}
        if tensorboard is not None:
            for name, value in scalars.items():
                tensorboard.add_scalar(name, value, number)
        if wandb is not None:
            wandb.log(scalars, number)
        if self._logging and number % self._log_interval == 0:
            self._echo(done.line(number))
        return done


_PROCESS: list[HSAPMetrics] = []  # this process's HSAPMetrics (one training loop per process)


def process_metrics(args: Any) -> HSAPMetrics:
    """This process's :class:`HSAPMetrics`, made on first use from Megatron's ``args`` (rank 0
    logs; Megatron's TensorBoard / W&B writers) and flushed at interpreter exit, since the last
    iteration has no successor to flush it."""
    if not _PROCESS:
        import atexit

        import torch.distributed as dist
        from megatron.training import get_tensorboard_writer, get_wandb_writer

        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        metrics = HSAPMetrics(log_interval=getattr(args, "log_interval", 1) or 1, is_logging_rank=rank0,
                              writers=lambda: (get_tensorboard_writer(), get_wandb_writer()),
                              echo=lambda line: print(line, flush=True))
        atexit.register(metrics.flush)
        _PROCESS.append(metrics)
    return _PROCESS[0]


def dump_plan(plan: "Plan", out_dir: str | os.PathLike[str], *, iteration: int,
              plan_kwargs: dict[str, Any]) -> Path:
    """Write ``plan``'s programs (every inter rank, fwd and bwd), its inputs and figures as JSON, and
    the command that redraws its picture; returns the folder."""
    from megatron_hsap.plan.ir import Phase

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(plan.inter_size):
        for phase in (Phase.FWD, Phase.BWD):
            (out / f"rank{rank}-{phase.value}.txt").write_text(plan.dump(rank, phase=phase) + "\n")
    cu = [int(v) for v in plan.batch.cu_seqlens]
    stats = {k: (v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v))
             for k, v in plan.stats().as_dict().items()}
    doc = {"iteration": iteration, "cu_seqlens": cu, "plan_kwargs": {k: v for k, v in plan_kwargs.items()
                                                                      if isinstance(v, (int, float, str, bool, type(None)))},
           "stats": stats, "verified": _verified(plan)}
    (out / "plan.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    o = plan.options
    # a flattened plan (plan/flatten.py) is reproduced from its groups' topology
    intra, inter = o.flattened_from or (plan.intra_size, plan.inter_size)
    command = (f"{shlex.quote(sys.executable)} -m megatron_hsap plan --cu-seqlens {','.join(map(str, cu))} --inter-size {inter} "
               f"--intra-size {intra} {_flatten_flag(plan)}--heads {o.num_heads} --kv-heads {o.num_kv_heads or o.num_heads} "
               f"--head-dim {o.head_dim} --dtype-bytes {o.dtype_bytes} --layout {plan.layout.name} "
               f"--tp {o.tp_size} --gpus-per-node {o.gpus_per_node} "
               f"--plot {shlex.quote(str(out / 'plan.png'))}")
    (out / "plot.sh").write_text("#!/usr/bin/env bash\n# the Figure-3 picture of this plan\n" + command + "\n")
    return out


def _flatten_flag(plan: "Plan") -> str:
    """The plan CLI's ``--flatten`` that reproduces a flattened plan (plan/flatten.py) from its groups."""
    if plan.options.flattened_from is None:
        return ""
    return "--flatten always " if plan.intra_size == 1 else "--flatten all-to-all "


def _verified(plan: "Plan") -> str:
    try:
        plan.verify()
    except Exception as exc:  # noqa: BLE001 - the dump records whatever the verifier says
        return f"failed: {exc}"
    return "ok"
