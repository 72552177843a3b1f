"""``megatron-hsap train-tiny``: a small megatron-core GPT trained with HSAP on CPU gloo ranks.

    megatron-hsap train-tiny --world-size 4 --context-parallel-impl hsap --intra-size 2 --inter-size 2

Spawns ``world_size`` ranks (data-parallel × context-parallel, ``DP = world / (P_intra·P_inter)``),
builds a megatron-core ``GPTModel`` (RoPE, GQA, fp32, local spec with HSAP's attention), and trains
it with ``torch.optim.AdamW`` on packed batches from megatron-core's ``GPTDataset`` over the Python
standard library's sources (:mod:`megatron_hsap.megatron.data`). Gradients are all-reduced by hand
over the data×context group (Megatron's DDP and optimizer are CUDA-only); the loss is the sum over
DP×CP ranks of ``Σ loss_mask·loss`` divided by the global number of loss tokens. At the end the same
run repeats at CP=1 (same DP, same batches, same initial weights) and the per-step losses are
compared. Uses the CPU shims (:mod:`megatron_hsap.megatron.cpu_shims`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = ["TinyRun", "StepResult", "tiny_config", "build_tiny_gpt", "train_step", "run_training", "main"]

# fp32 everywhere; CP changes only the order of sums (attention merges, gradient all-reduce):
# per-step losses agree to ~1e-6 relative. Above this the command reports a failure.
_COMPARE_RTOL = 1e-4


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyRun:
    """Options of one tiny training run."""

    world_size: int = 4
    intra_size: int = 2
    inter_size: int = 2
    steps: int = 20
    seq_length: int = 512
    micro_batch_size: int = 2
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    lr: float = 3e-3
    seed: int = 1234
    layout: str = "balanced"
    flatten: str = "auto"  # plan/flatten.py: "never" keeps the P_intra x P_inter topology on every batch
    plan_prefetch: bool = True
    plan_process: bool = True  # prefetched plans compiled in a plan worker process (megatron/plan_worker.py)
    data_dir: str | None = None
    progress: bool = True

    @property
    def cp_size(self) -> int:
        return self.intra_size * self.inter_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size


@dataclass(frozen=True, slots=True)
class StepResult:
    """One optimizer step as every rank sees it (after the all-reduces)."""

    loss: float
    grad_norm: float
    loss_tokens: int  # global denominator: Σ loss_mask over the DP×CP batch
    counted_tokens: int  # Σ over ranks of the loss tokens each rank holds (must equal loss_tokens)
    real_tokens: int
    seconds: float


def tiny_config(run: TinyRun, *, context_parallel_size: int | None = None) -> Any:
    """The ``TransformerConfig``: RoPE (from GPTModel), GQA, fp32, CPU initialisation, no dropout."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=run.num_layers,
        hidden_size=run.hidden_size,
        ffn_hidden_size=4 * run.hidden_size,
        num_attention_heads=run.num_heads,
        num_query_groups=run.num_kv_heads,
        context_parallel_size=context_parallel_size if context_parallel_size is not None else run.cp_size,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def build_tiny_gpt(config: Any, layer_spec: Any, *, seed: int, vocab_size: int, max_sequence_length: int) -> Any:
    """A ``GPTModel`` with RoPE whose initial weights depend only on ``seed`` (not on CP)."""
    import torch
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)  # CPU initialisation draws from the global generator
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=True,
    )


def _grad_norm(model: Any, tp_group: Any) -> float:
    """Global gradient 2-norm: tensor-parallel shards summed over ``tp_group``, duplicates once."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    sq = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None and (tp == 1 or param_is_not_tensor_parallel_duplicate(p)):
            sq += p.grad.double().pow(2).sum()
    if tp > 1:
        dist.all_reduce(sq, group=tp_group)
    return float(sq.sqrt().item())


def train_step(model: Any, optimizer: Any, inputs: dict[str, Any], *, num_loss_tokens: int, grad_group: Any,
               real_tokens: int, tp_group: Any = None) -> StepResult:
    """Forward, backward, gradient all-reduce (sum over ``grad_group``), optimizer step.

    ``inputs``: ``tokens``, ``position_ids``, ``labels``, ``loss_mask`` (``[1, t]``) and
    ``packed_seq_params`` for this rank. Each rank backpropagates ``Σ loss_mask·loss / N`` with the
    *global* ``N = num_loss_tokens``, so the summed gradients are those of the global mean loss.
    ``grad_group`` is the data×context group; ``tp_group`` only enters the reported grad norm.
    """
    import torch
    import torch.distributed as dist

    start = time.perf_counter()
    losses = model(
        inputs["tokens"], inputs["position_ids"], None,
        labels=inputs["labels"], packed_seq_params=inputs["packed_seq_params"],
    )  # [1, t] per-token cross entropy
    mask = inputs["loss_mask"].to(losses.dtype)
    local = (losses * mask).sum() / num_loss_tokens
    local.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    stats = torch.tensor([local.item(), float(mask.sum().item())], dtype=torch.float64)
    if grad_group is not None and dist.get_world_size(grad_group) > 1:
        dist.all_reduce(flat, group=grad_group)
        dist.all_reduce(stats, group=grad_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    grad_norm = _grad_norm(model, tp_group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=float(stats[0]), grad_norm=grad_norm, loss_tokens=int(num_loss_tokens),
        counted_tokens=int(round(float(stats[1]))), real_tokens=int(real_tokens),
        seconds=time.perf_counter() - start,
    )


def _sum_over(group: Any, *values: int) -> list[int]:
    """Host integers summed over ``group`` (one all-reduce): the DP-global token counts."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return [int(x) for x in t.tolist()]


def _rank_main(rank: int, run: TinyRun, store: str, corpus: Any, queue: Any) -> None:
    """One spawned rank: init gloo + Megatron + HSAP, train, report (rank 0) through ``queue``."""
    os.environ.update(OMP_NUM_THREADS="1")
    _quiet_megatron()
    import torch
    import torch.distributed as dist

    from megatron_hsap.runtime.rendezvous import init_local_process_group

    torch.set_num_threads(1)
    init_local_process_group(rank, run.world_size, store)  # file store + loopback gloo: nothing listens outside
    try:
        from megatron.core import parallel_state as mpu

        from megatron_hsap.megatron import cpu_shims
        from megatron_hsap.megatron.batch import get_batch_on_this_cp_rank, plan_kwargs_from_config, plan_request
        from megatron_hsap.megatron.data import ByteTokenizer, build_gpt_dataset, micro_batch
        from megatron_hsap.megatron.parallel_state import destroy_hsap, initialize_hsap
        from megatron_hsap.megatron.plan_worker import PlanWorker
        from megatron_hsap.megatron.prefetch import PlanPrefetcher
        from megatron_hsap.megatron.spec import hsap_layer_spec

        cpu_shims.install()
        mpu.initialize_model_parallel(context_parallel_size=run.cp_size)
        initialize_hsap(intra_size=run.intra_size, inter_size=run.inter_size, node_check="off")
        config = tiny_config(run)
        tokens_per_micro_batch = run.seq_length * run.micro_batch_size
        model = build_tiny_gpt(config, hsap_layer_spec(config, use_te=False), seed=run.seed,
                               vocab_size=ByteTokenizer().vocab_size, max_sequence_length=tokens_per_micro_batch)
        optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr, betas=(0.9, 0.95), weight_decay=0.0)
        dataset = build_gpt_dataset(corpus, seq_length=run.seq_length,
                                    num_samples=run.steps * run.dp_size * run.micro_batch_size, seed=run.seed)
        dp_rank = mpu.get_data_parallel_rank()
        dp_group = mpu.get_data_parallel_group()
        grad_group = mpu.get_data_parallel_group(with_context_parallel=True)
        plan_kwargs = {**plan_kwargs_from_config(config), "layout": run.layout, "flatten": run.flatten}
        results: list[StepResult] = []
        bar = _progress(run, rank)
        steps = iter(range(run.steps))

        def read() -> dict[str, Any] | None:
            step = next(steps, None)
            if step is None:
                return None
            return micro_batch(dataset, (step * run.dp_size + dp_rank) * run.micro_batch_size, run.micro_batch_size)

        worker = PlanWorker(enabled=run.plan_prefetch and run.plan_process)
        prefetcher = PlanPrefetcher(read, lambda b: worker.compile(plan_request(b, plan_kwargs=plan_kwargs))[0],
                                    enabled=run.plan_prefetch)
        for step, (batch, plan) in enumerate(prefetcher):  # the next plan compiles while this step trains
            sharded = get_batch_on_this_cp_rank(batch, plan=plan, pad_token_id=ByteTokenizer.PAD)
            n_global, real = _sum_over(dp_group, sharded["num_loss_tokens"], sharded["num_tokens"])
            result = train_step(model, optimizer, sharded, num_loss_tokens=n_global, grad_group=grad_group,
                                real_tokens=real)
            results.append(result)
            if rank == 0:
                rate = result.real_tokens / result.seconds
                # a plan flattened to one level over the CP group (plan/flatten.py) says so
                flat = f" as {plan.intra_size}x{plan.inter_size}" if plan.options.flattened_from is not None else ""
                line = (f"[{run.intra_size}x{run.inter_size}{flat}] step {step + 1:3d}/{run.steps}  loss {result.loss:.6f}  "
                        f"grad-norm {result.grad_norm:.4f}  tokens/s {rate:,.0f}")
                if bar is None:
                    print(line, flush=True)
                else:
                    bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{rate:,.0f}")
                    bar.write(line, file=sys.stdout)
                    bar.update(1)
        prefetcher.close()
        worker.close()
        if bar is not None:
            bar.close()
        if rank == 0:
            queue.put(("ok", [asdict(r) for r in results]))
        destroy_hsap()
        mpu.destroy_model_parallel()
    except BaseException as exc:  # noqa: BLE001 - the parent prints it and exits non-zero
        import traceback

        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    finally:
        dist.destroy_process_group()


def _quiet_megatron() -> None:
    """Silence megatron-core's import-time notices (no TE/Apex, GPTModel deprecation) in this demo."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"


def _progress(run: TinyRun, rank: int) -> Any:
    if rank != 0 or not run.progress:
        return None
    from tqdm import tqdm

    # disable=None: a live bar on a terminal, none in logs (the per-step lines are printed anyway).
    return tqdm(total=run.steps, desc=f"train-tiny {run.intra_size}x{run.inter_size} (DP={run.dp_size})",
                unit="step", file=sys.stderr, dynamic_ncols=True, disable=None)


def run_training(run: TinyRun) -> list[StepResult]:
    """Spawn ``run.world_size`` gloo ranks, train, return rank 0's per-step results."""
    import torch.multiprocessing as mp

    from megatron_hsap.megatron.data import build_stdlib_corpus

    corpus = build_stdlib_corpus(run.data_dir)  # once, in the parent: ranks only read it
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    from megatron_hsap.runtime.rendezvous import new_local_store

    store = new_local_store(prefix="hsap-train-tiny-")  # one file store for all ranks of this run
    procs = [ctx.Process(target=_rank_main, args=(r, run, store, corpus, queue), daemon=False)
             for r in range(run.world_size)]
    for p in procs:
        p.start()
    try:
        status, payload = _wait_result(queue, procs)
    except BaseException:
        _stop(procs)
        raise
    if status != "ok":
        _stop(procs)  # the other ranks may wait in a collective forever
        raise RuntimeError(f"train-tiny failed on a rank:\n{payload}")
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"train-tiny: ranks exited with codes {bad}")
    return [StepResult(**r) for r in payload]


def _wait_result(queue: Any, procs: list[Any]) -> tuple[str, Any]:
    """First message from the ranks; fails fast if a rank dies without reporting."""
    import queue as queue_mod

    while True:
        try:
            return queue.get(timeout=1.0)
        except queue_mod.Empty:
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
                return "error", f"ranks exited with codes {codes} before reporting"


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)


def _impl(text: str) -> str:
    """argparse type of ``--context-parallel-impl``: only ``hsap`` runs here; ``ring`` is refused
    with the command that runs Megatron's own attention on CPU."""
    if text == "hsap":
        return text
    if text == "ring":
        raise argparse.ArgumentTypeError(
            "'ring' does not run in train-tiny (its CP=1 comparison at the end is the reference); for "
            "Megatron's own local attention on CPU run: megatron-hsap pretrain-cpu --reference")
    raise argparse.ArgumentTypeError(f"{text!r}: train-tiny runs hsap only")


def _parser() -> argparse.ArgumentParser:
    from megatron_hsap.argtypes import (HelpFormatter, add_topology_args, nonnegative_int, output_dir, positive_float,
                                        positive_int)
    from megatron_hsap.plan.options import FLATTEN

    p = argparse.ArgumentParser(prog="megatron-hsap train-tiny", description=__doc__.split("\n\n")[0] +
                                " About a minute for 4 ranks and 20 steps, plus the CP=1 comparison.",
                                formatter_class=HelpFormatter)
    p.add_argument("--world-size", type=positive_int, default=4, help="gloo ranks = DP × P_intra × P_inter")
    p.add_argument("--context-parallel-impl", type=_impl, default="hsap", metavar="{hsap}",
                   help="the CP backend (ring: use megatron-hsap pretrain-cpu --reference)")
    add_topology_args(p, intra=2, inter=2, old=False)
    p.add_argument("--steps", type=positive_int, default=20, help="optimizer steps")
    p.add_argument("--seq-length", type=positive_int, default=512, help="tokens per sample")
    p.add_argument("--micro-batch-size", type=positive_int, default=2, help="samples packed into one micro-batch")
    p.add_argument("--num-layers", type=positive_int, default=2, help="transformer layers")
    p.add_argument("--hidden-size", type=positive_int, default=64, help="model width")
    p.add_argument("--num-attention-heads", type=positive_int, default=4, help="q heads")
    p.add_argument("--num-query-groups", type=positive_int, default=2, help="kv heads (GQA)")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=nonnegative_int, default=1234, help="initial weights and data order")
    p.add_argument("--layout", choices=("contiguous", "balanced"), default="balanced",
                   help="HSAP token layout (balanced: document-aware, kept only where estimated faster)")
    p.add_argument("--flatten", choices=FLATTEN, default="auto",
                   help="inside one node: run a batch as pure SAP over all CP ranks (1 x P) or as one all-to-all over "
                        "them (P x 1) when estimated faster (auto), always 1 x P, always P x 1 (all-to-all), or never "
                        "(the configured topology on every batch); plan/flatten.py")
    p.add_argument("--no-plan-prefetch", action="store_true", help="compile each plan when its batch is taken")
    p.add_argument("--no-plan-process", action="store_true",
                   help="compile the prefetched plans on the prefetch thread, not in a plan worker process per rank")
    p.add_argument("--data-dir", type=output_dir, default=None, help="where the indexed dataset is written (default: ~/.cache/megatron-hsap/data)")
    p.add_argument("--no-compare", action="store_true", help="skip the CP=1 comparison run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def check_run(run: TinyRun) -> None:
    """Refuse in the parent, before any rank is spawned, what a rank would fail on: the world
    against the topology, the heads against P_intra (the one rule of ``plan.options``), the width
    against the heads. Raises ``ConfigError`` naming the flag to change."""
    from megatron_hsap.errors import ConfigError
    from megatron_hsap.plan.options import kv_heads_per_rank

    cp = run.intra_size * run.inter_size
    if run.world_size % cp:
        raise ConfigError(f"--world-size {run.world_size} must be a positive multiple of --intra-size × --inter-size "
                          f"= {run.intra_size} × {run.inter_size} = {cp}")
    if run.hidden_size % run.num_heads:
        raise ConfigError(f"--hidden-size {run.hidden_size} must be a multiple of --num-attention-heads {run.num_heads}")
    try:
        kv_heads_per_rank(run.num_heads, run.num_kv_heads, run.intra_size)
    except ConfigError as exc:
        text = (str(exc).replace("num_heads=", "--num-attention-heads ").replace("num_kv_heads=", "--num-query-groups ")
                .replace("intra_size=", "--intra-size "))
        raise ConfigError(text) from None


def _parse(argv: list[str] | None) -> tuple[TinyRun, bool]:
    a = _parser().parse_args(argv)
    run = TinyRun(
        world_size=a.world_size, intra_size=a.intra_size, inter_size=a.inter_size, steps=a.steps,
        seq_length=a.seq_length, micro_batch_size=a.micro_batch_size, num_layers=a.num_layers,
        hidden_size=a.hidden_size, num_heads=a.num_attention_heads, num_kv_heads=a.num_query_groups,
        lr=a.lr, seed=a.seed, layout=a.layout, flatten=a.flatten, plan_prefetch=not a.no_plan_prefetch,
        plan_process=not a.no_plan_process, data_dir=None if a.data_dir is None else str(a.data_dir),
        progress=not a.no_progress,
    )
    check_run(run)
    return run, not a.no_compare


def compare(hsap: list[StepResult], reference: list[StepResult]) -> float:
    """Largest per-step relative loss difference."""
    return max(abs(a.loss - b.loss) / max(abs(b.loss), 1e-30) for a, b in zip(hsap, reference))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-hsap train-tiny``; returns the exit code."""
    from megatron_hsap.errors import HSAPError

    _quiet_megatron()
    try:
        run, do_compare = _parse(argv)
    except HSAPError as exc:
        print(f"megatron-hsap train-tiny: {exc}", file=sys.stderr)
        return 2
    print(
        f"train-tiny: GPT {run.num_layers} layers, hidden {run.hidden_size}, {run.num_heads} heads / "
        f"{run.num_kv_heads} kv heads, RoPE, fp32; {run.world_size} ranks = DP {run.dp_size} × CP "
        f"{run.intra_size}x{run.inter_size} (intra×inter); {run.micro_batch_size}×{run.seq_length} "
        f"tokens per micro-batch, {run.steps} steps",
        flush=True,
    )
    from megatron_hsap.argtypes import link_line

    # the link the plans are priced with (plan_kwargs_from_config: TP 1, the default 8 GPUs per node)
    print(f"train-tiny: plans priced with {link_line(intra=run.intra_size, inter=run.inter_size)}", flush=True)
    hsap = run_training(run)
    total_tokens = sum(r.real_tokens for r in hsap)
    total_time = sum(r.seconds for r in hsap)
    print(f"HSAP {run.intra_size}x{run.inter_size}: final loss {hsap[-1].loss:.6f} (first {hsap[0].loss:.6f}); "
          f"{total_tokens / total_time:,.0f} tokens/s overall", flush=True)
    for r in hsap:
        if r.counted_tokens != r.loss_tokens:
            print(f"loss tokens counted {r.counted_tokens} != {r.loss_tokens}", file=sys.stderr)
            return 1
    if not do_compare:
        return 0
    ref_run = replace(run, world_size=run.dp_size, intra_size=1, inter_size=1)
    print(f"reference: the same run at CP=1 ({ref_run.world_size} rank(s))", flush=True)
    ref = run_training(ref_run)
    print(f"{'step':>4}  {'loss HSAP':>12}  {'loss CP=1':>12}  {'rel diff':>9}  {'grad-norm rel diff':>18}")
    for i, (a, b) in enumerate(zip(hsap, ref)):
        gn = abs(a.grad_norm - b.grad_norm) / max(b.grad_norm, 1e-30)
        print(f"{i + 1:4d}  {a.loss:12.6f}  {b.loss:12.6f}  {abs(a.loss - b.loss) / abs(b.loss):9.2e}  {gn:18.2e}")
    worst = compare(hsap, ref)
    ok = worst <= _COMPARE_RTOL and math.isfinite(worst)
    print(f"max relative loss difference per step vs CP=1: {worst:.2e} ({'OK' if ok else 'MISMATCH'}, "
          f"tolerance {_COMPARE_RTOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
