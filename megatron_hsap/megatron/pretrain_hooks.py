"""Megatron-LM ``pretrain()`` with ``--context-parallel-impl hsap``: the one wiring every entry point uses.

:func:`run_pretrain` is Megatron-LM's ``pretrain_gpt.py`` main (tag ``core_v0.19.0``) with HSAP's
hooks: ``scripts/pretrain_gpt_hsap.py`` calls it with ``pretrain_gpt``'s dataset provider, forward
step and loss function, ``megatron-hsap pretrain-cpu`` with the CPU corpus's
(:mod:`megatron_hsap.megatron.cpu.loop`). :func:`hsap_entry_points` turns a dataset provider and loss
function into HSAP's: ``initialize_hsap`` once on every rank after Megatron's initialisation, and a
``forward_step`` whose batches are sharded by :func:`~megatron_hsap.megatron.batch.
get_batch_on_this_cp_rank` (plan in ``packed_seq_params``, no attention mask). Imports
``megatron.training`` lazily: importing this module needs neither CUDA nor Megatron-LM.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from typing import Any, Callable, Iterator

from megatron_hsap.megatron.host_batches import RecordingReader, read_direct, replaying
from megatron_hsap.megatron.loss import evaluation_report, micro_batch_mean

__all__ = ["run_pretrain", "hsap_get_batch", "make_forward_step", "with_hsap_init", "hsap_entry_points",
           "hsap_extra_args_provider"]


@functools.lru_cache(maxsize=1)
def _core_config() -> Any:
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    return core_transformer_config_from_args(get_args())


def plan_flags(args: Any) -> dict[str, Any]:
    """``compile_plan`` options the ``--hsap-*`` flags set (the model's shape, hardware and link
    come from elsewhere): layout and fallback, pool, head chunks, flattening, the gradients' wire
    dtype (left out at their defaults, so default runs compile the plans they always did)."""
    kwargs: dict[str, Any] = {"layout": getattr(args, "hsap_layout", "balanced")}
    if kwargs["layout"] == "balanced":
        kwargs["layout_fallback"] = getattr(args, "hsap_layout_fallback", True)
    if getattr(args, "hsap_pool_bytes", None) is not None:
        kwargs["pool_bytes"] = args.hsap_pool_bytes
    if getattr(args, "hsap_head_chunks", None) is not None:
        kwargs["head_chunks"] = args.hsap_head_chunks
    if getattr(args, "hsap_flatten", "auto") != "auto":
        kwargs["flatten"] = args.hsap_flatten
    from megatron_hsap.plan.costs import DEFAULT_GRAD_WIRE_DTYPE

    if getattr(args, "hsap_grad_wire_dtype", DEFAULT_GRAD_WIRE_DTYPE) != DEFAULT_GRAD_WIRE_DTYPE:
        kwargs["grad_wire_dtype"] = args.hsap_grad_wire_dtype
    return kwargs


def _plan_kwargs(args: Any) -> dict[str, Any]:
    from megatron_hsap.megatron.batch import plan_kwargs_from_config
    from megatron_hsap.megatron.hardware import run_hardware

    kwargs = {**plan_kwargs_from_config(_core_config()), **plan_flags(args)}
    hardware = run_hardware(args)
    kwargs.update(hardware=hardware.name, gpus_per_node=hardware.gpus_per_node)
    link = _measured_link()
    if link is not None:  # the hostnames say where the CP group runs: price that, not the count rule
        kwargs["link"] = link
    return kwargs


def _measured_link() -> str | None:
    """The CP group's link from the hostnames ``initialize_hsap`` exchanged (None before it ran or
    with ``--hsap-node-check off``). Every rank of a CP group sees the same hosts, so they agree."""
    from megatron_hsap.megatron.parallel_state import get_hsap_groups, is_hsap_initialized

    return get_hsap_groups().cp_link if is_hsap_initialized() else None


def _feeds_stats(vp_stage: int | None) -> bool:
    """Whether this forward step is the one that counts its micro-batch on this rank.

    Megatron sums the statistics over the world and divides by TP·CP·PP, so every rank counts each
    micro-batch exactly once: with virtual pipelining, at its first model chunk, except on the last
    pipeline stage (its last chunk reads the batch; its earlier chunks may not have it)."""
    from megatron.core import parallel_state as mpu

    if vp_stage is None:
        return True
    vp = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    last_only = mpu.is_pipeline_last_stage(ignore_virtual=True) and not mpu.is_pipeline_first_stage(ignore_virtual=True)
    return vp_stage == (vp - 1 if last_only else 0)


def _feed_seqlen_stats(cu_seqlens: Any) -> None:
    """Megatron's TFLOP/s line counts packed batches by document: Σ L and Σ L² of the real lengths.

    Every rank of the DP group counts each micro-batch once with the same lengths (Megatron divides
    its world all-reduce by TP·CP·PP): call it where :func:`_feeds_stats` says so."""
    import numpy as np
    import torch
    from megatron.training.training import update_seqlen_stats_from_cu_seqlens

    update_seqlen_stats_from_cu_seqlens(torch.from_numpy(np.asarray(cu_seqlens, dtype=np.int64)).to(torch.int32))


def _observe(args: Any, plan: Any, *, compile_s: float, prefetched: bool | None, plan_kwargs: dict[str, Any],
             compiled_in: str = "training thread") -> None:
    """Per-iteration metrics and ``--hsap-dump-plan`` for one training micro-batch."""
    iteration = int(getattr(args, "curr_iteration", 0) or 0)
    from megatron_hsap.megatron.metrics import process_metrics

    metrics = process_metrics(args) if getattr(args, "hsap_metrics", True) else None
    dump = getattr(args, "hsap_dump_plan", None)
    if dump and int(dump[0]) == iteration + 1 and not getattr(args, "_hsap_dumped", False):
        import torch.distributed as dist

        args._hsap_dumped = True
        if not dist.is_initialized() or dist.get_rank() == 0:
            from megatron_hsap.megatron.metrics import dump_plan

            try:
                out = dump_plan(plan, dump[1], iteration=iteration + 1, plan_kwargs=plan_kwargs)
            except OSError as err:  # a diagnostic: raising here would leave the other ranks in a collective
                print(f"[megatron-hsap] --hsap-dump-plan: could not write the plan of iteration {iteration + 1} "
                      f"to {dump[1]} ({err}); training goes on", file=sys.stderr, flush=True)
            else:
                print(f"[megatron-hsap] wrote the plan of iteration {iteration + 1} to {out} "
                      f"(picture: bash {out / 'plot.sh'})", flush=True)
    if metrics is not None:
        metrics.add(iteration, plan, compile_s=compile_s, prefetched=prefetched, compiled_in=compiled_in)


_WORKER = "plan-worker"  # the ``prefetchers`` key of the rank's PlanWorker (a vp_stage is an int or None)


def hsap_get_batch(data_iterator: Iterator[dict[str, Any]] | None, vp_stage: int | None = None, *,
                   prefetchers: dict[Any, Any] | None = None, training: bool = True) -> dict[str, Any]:
    """This rank's HSAP share of the next micro-batch: tokens, labels, loss mask, position ids
    (``[1, t_local]`` on the device) and ``packed_seq_params`` with the plan.

    ``prefetchers`` (one dict per ``forward_step``): with ``--hsap-plan-prefetch`` (default) the next
    training micro-batch is read ahead and its plan compiled while this one runs
    (``megatron/prefetch.py``), in the rank's plan worker process (``--hsap-plan-process``, default:
    ``megatron/plan_worker.py``, kept under the key ``_WORKER``) or on the prefetch thread.
    Prefetchers are keyed by ``vp_stage`` — the same on every TP rank, where Megatron passes
    ``None`` iterators to TP ranks ≠ 0 — and used in training only:
    evaluation and step replays read the iterator directly, in the same order on every rank.
    """
    import numpy as np
    import torch
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    from megatron_hsap.errors import ConfigError
    from megatron_hsap.megatron.batch import get_batch_on_this_cp_rank, pack_micro_batch, plan_for_batch, plan_request
    from megatron_hsap.megatron.plan_worker import PlanWorker
    from megatron_hsap.megatron.prefetch import PlanPrefetcher

    args = get_args()
    has_cu = bool(getattr(args, "sft", False) or getattr(args, "dataloader_inter_document_masking", False))
    plan_kwargs = _plan_kwargs(args)
    device = torch.cuda.current_device()
    if data_iterator is None and not is_first_or_last_pipeline_stage(vp_stage):
        if has_cu:
            raise ConfigError(
                "a middle pipeline stage needs each batch's cu_seqlens to compile the HSAP plan, but it "
                "has no data iterator; with packed documents and PP > 1 use --sft (Megatron builds the "
                "dataset on every stage) or PP = 1"
            )
        # Unpacked pretraining: every sample is one document, so the plan needs no data (and is cached).
        packed = pack_micro_batch({"tokens": torch.zeros(args.micro_batch_size, args.seq_length, dtype=torch.long)})
        if training and _feeds_stats(vp_stage):  # evaluation batches are not part of the iteration's FLOPs
            _feed_seqlen_stats(packed.cu_seqlens)
        return get_batch_on_this_cp_rank(packed, config=_core_config(), plan_kwargs=plan_kwargs, device=device)

    prefetched: bool | None = None
    if prefetchers is None or not training or replaying() or not getattr(args, "hsap_plan_prefetch", True):
        packed = read_direct(data_iterator)
        if packed is None:
            raise StopIteration
        start = time.perf_counter()
        plan = plan_for_batch(packed, config=_core_config(), plan_kwargs=plan_kwargs)
        compile_s, where = time.perf_counter() - start, "training thread"
    else:
        entry = prefetchers.get(vp_stage)
        if entry is None:
            reader = RecordingReader(data_iterator)
            worker = prefetchers.get(_WORKER)
            if worker is None:  # one plan worker process per rank, shared by the virtual-pipeline stages
                worker = prefetchers[_WORKER] = PlanWorker(enabled=getattr(args, "hsap_plan_process", None) is not False)  # None: not given, on

            def compile_in_worker(item: Any, worker: PlanWorker = worker) -> tuple[Any, float, str]:
                # on the prefetch thread, which waits on the worker's pipe without the GIL
                got = worker.compile(plan_request(item[1], config=_core_config(), plan_kwargs=plan_kwargs))
                return got.plan, got.seconds, "worker process" if got.in_worker else "prefetch thread"

            entry = prefetchers[vp_stage] = (reader, PlanPrefetcher(reader.read, compile_in_worker))
        reader, prefetcher = entry
        (raw, packed), (plan, compile_s, where) = next(prefetcher)
        prefetched = prefetcher.last_ready
        reader.consumed(raw)
    if training and _feeds_stats(vp_stage):  # once per micro-batch and rank; evaluation is not counted
        _feed_seqlen_stats(np.asarray(packed.cu_seqlens))
        _observe(args, plan, compile_s=compile_s, prefetched=prefetched, plan_kwargs=plan_kwargs, compiled_in=where)
    return get_batch_on_this_cp_rank(packed, plan=plan, config=_core_config(), device=device)


def make_forward_step(loss_func: Callable[..., Any]) -> Callable[..., Any]:
    """``pretrain_gpt.forward_step`` with HSAP batch sharding; the model and ``loss_func`` are Megatron's."""

    prefetchers: dict[Any, Any] = {}  # one plan prefetcher per virtual-pipeline stage (training only)

    def hsap_forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> Any:
        from megatron.core.utils import get_attr_wrapped_model
        from megatron.training import get_args, get_timers

        from megatron_hsap.megatron.spec import check_model_attention

        timers = get_timers()
        timers("batch-generator", log_level=2).start()
        batch = hsap_get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"),
                               prefetchers=prefetchers, training=bool(model.training))
        timers("batch-generator").stop()
        check_model_attention(model)  # once per model chunk: every attention layer HSAP's (MTP's too)
        inputs = (batch["tokens"], batch["position_ids"], None)
        kwargs = dict(labels=batch["labels"], loss_mask=batch["loss_mask"], packed_seq_params=batch["packed_seq_params"])
        # loss_func returns (Σ loss·mask, local loss tokens); --calculate-per-token-loss makes
        # Megatron divide by the tokens summed over DP×CP: every real token counted once. Megatron's
        # default (each micro-batch's mean) needs the micro-batch's count instead (megatron/loss.py)
        args = get_args()
        loss = functools.partial(loss_func, batch["loss_mask"], model=model)
        if not getattr(args, "calculate_per_token_loss", False):
            from megatron.core import parallel_state

            loss = functools.partial(micro_batch_mean, loss, batch["num_loss_tokens"],
                                     parallel_state.get_context_parallel_world_size())
        if return_schedule_plan:
            # --overlap-moe-expert-parallel-comm (training only): Megatron's combined 1F1B schedule runs
            # this chunk's layers from a plan of fine-grained callables; HSAP's batch rides in packed_seq_params
            return model.build_schedule_plan(*inputs, **kwargs), loss
        output = model(*inputs, **kwargs)
        if not model.training and getattr(args, "sft", False):
            loss = functools.partial(evaluation_report, loss)
        return output, loss

    return hsap_forward_step


def with_hsap_init(provider: Any, hsap: Any) -> Any:
    """Run ``initialize_hsap`` once, on every rank, right after Megatron's initialisation.

    Megatron calls a dataset provider marked ``is_distributed`` on every rank before training,
    after ``initialize_model_parallel`` — the one point where a world collective is safe. The
    wrapper keeps the provider's signature (Megatron checks it for ``vp_stage``).
    """
    from megatron_hsap.megatron.banner import print_banner
    from megatron_hsap.megatron.parallel_state import initialize_hsap, is_hsap_initialized

    @functools.wraps(provider)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        if not is_hsap_initialized():  # groups get the job's timeout (runtime.groups.job_timeout)
            initialize_hsap(intra_size=hsap.intra_size, inter_size=hsap.inter_size, node_check=hsap.node_check)
            print_banner(hsap, get_args(), link=_measured_link(), plan_kwargs=_plan_kwargs)
        with sft_data_as_cp1(get_args()):
            return provider(*args, **kwargs)

    wrapped.is_distributed = True  # type: ignore[attr-defined]
    return wrapped


@contextlib.contextmanager
def sft_data_as_cp1(args: Any) -> Iterator[None]:
    """With ``--sft``, ``args.context_parallel_size`` reads 1 inside the block: the dataset provider
    then builds the SFT data a CP=1 run builds. Megatron's ``SFTDataset`` pads each conversation to
    a multiple of 2·CP (``sft_dataset.py``: ring's zigzag split of every sequence needs it); HSAP
    splits any length, so those pad tokens were computed for nothing (up to 2·CP − 1 per
    conversation) and pushed later conversations out of the pack: the data depended on the CP size.
    The dataset config's ``context_parallel_size`` has no other reader (megatron-core 0.19.2;
    Megatron-LM core_v0.19.0's ``core_gpt_dataset_config_from_args`` copies it from ``args``)."""
    cp = getattr(args, "context_parallel_size", 1)
    if not getattr(args, "sft", False) or cp == 1:
        yield
        return
    args.context_parallel_size = 1
    try:
        yield
    finally:
        args.context_parallel_size = cp


def hsap_entry_points(args: Any, datasets_provider: Any, loss_func: Callable[..., Any]) -> tuple[Any, Any]:
    """``(datasets_provider, forward_step)`` for ``pretrain()`` under ``--context-parallel-impl hsap``.

    Validates the arguments (sets ``args.spec`` to the HSAP layer spec when none was given; call it
    before building the model config) and raises ``ConfigError`` for ``ring``.
    """
    from megatron_hsap.errors import ConfigError
    from megatron_hsap.megatron.arguments import validate_hsap_args

    hsap = getattr(args, "hsap", None) or validate_hsap_args(args)
    if hsap is None:
        raise ConfigError("hsap_entry_points is for --context-parallel-impl hsap")
    args.hsap = hsap
    if getattr(args, "mtp_num_layers", None):  # before the model is built: MTP's shift, weights and attention
        from megatron_hsap.megatron import mtp

        mtp.install()
    return with_hsap_init(datasets_provider, hsap), make_forward_step(loss_func)


def hsap_extra_args_provider(extra: Callable[[Any], Any] | None = None) -> Callable[[Any], Any]:
    """An ``extra_args_provider``: Megatron's ModelOpt arguments (when installed), ``extra``'s, HSAP's."""
    from megatron_hsap.megatron.arguments import add_hsap_args

    def provider(parser: Any) -> Any:
        try:
            from megatron.post_training.arguments import add_modelopt_args

            parser = add_modelopt_args(parser)
        except ImportError:
            pass
        if extra is not None:
            parser = extra(parser)
        return add_hsap_args(parser)

    return provider


def _use_prebuilt_dataset_helpers() -> None:
    """Megatron's start-up runs ``make`` in ``megatron/core/datasets`` to build its C++ index helpers;
    the megatron-core wheel ships them prebuilt (``helpers_cpp*.so``) but no Makefile, so ``make``
    fails and Megatron exits. When there is no Makefile and the prebuilt module imports, use it."""
    import os

    from megatron.core.datasets import utils as dataset_utils

    folder = os.path.dirname(os.path.abspath(dataset_utils.__file__))
    if os.path.exists(os.path.join(folder, "Makefile")):
        return  # a Megatron-LM checkout: let Megatron build them as usual
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # neither: Megatron's own error explains it

    def compile_helpers() -> None:
        """The wheel's prebuilt helpers are already importable (see ``_use_prebuilt_dataset_helpers``)."""

    dataset_utils.compile_helpers = compile_helpers


def run_pretrain(datasets_provider: Any, forward_step: Callable[..., Any], loss_func: Callable[..., Any], *,
                 get_embedding_ranks: Callable[..., Any] | None = None,
                 extra_args_provider: Callable[[Any], Any] | None = None,
                 args_defaults: dict[str, Any] | None = None, store: Any = None,
                 program_start: float | None = None, hybrid: bool | None = None) -> None:
    """Megatron's ``pretrain()`` for a GPT or hybrid model, with HSAP when ``--context-parallel-impl hsap``.

    The order is ``pretrain_gpt.py``'s (``core_v0.19.0``): start-up timestamps, in-process restart
    wrapper, argument parsing and validation (HSAP's flags included), ModelOpt, then for ``hsap`` the
    HSAP spec, batch hook and group initialisation, then the model config and ``pretrain``.
    ``forward_step`` / ``loss_func`` are the ``ring`` path's (``pretrain_gpt``'s); for ``hsap`` the
    forward step is HSAP's around ``loss_func``. ``store`` (a ``torch.distributed.Store``) overrides
    the in-process-restart store (the CPU command passes a loopback one). ``hybrid``: the model
    ``pretrain_hybrid.py`` builds (True: a HybridModel, a layer pattern required) or
    ``pretrain_gpt.py``'s (False: a GPTModel, no pattern allowed); None (the CPU provider, which
    serves both): a HybridModel exactly when a pattern is given.
    """
    main_entry = time.time()
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain, set_startup_timestamps
    from megatron.training.argument_utils import gpt_config_from_args, hybrid_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args, parse_args

    from megatron_hsap.megatron.arguments import check_before_megatron

    provider = hsap_extra_args_provider(extra_args_provider)
    # Megatron's validate_args asserts some rules HSAP's flags depend on without a message (the
    # hierarchical sizes' product): parse once more (no side effects) and check them first
    check_before_megatron(parse_args(provider))
    set_startup_timestamps(program_start=program_start if program_start is not None else main_entry,
                           main_entry=main_entry)
    datasets_provider.is_distributed = True
    _use_prebuilt_dataset_helpers()
    run, restart_store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    args = parse_and_validate_args(extra_args_provider=provider,
                                   args_defaults=args_defaults or {"tokenizer_type": "GPT2BPETokenizer"})
    has_pattern = getattr(args, "hybrid_layer_pattern", None) is not None  # (after Megatron's legacy-flag conversion)
    if hybrid is not None and hybrid != has_pattern:  # the checkout's other script (flags a --yaml-cfg gave)
        from megatron_hsap.megatron.megatron_lm import GPT, HYBRID, check_entry

        check_entry(HYBRID if hybrid else GPT, ["--hybrid-layer-pattern"] if has_pattern else [])
    hybrid = has_pattern
    try:
        from megatron.post_training.utils import maybe_enable_modelopt
    except ImportError:  # Megatron-LM's post_training package is not in the megatron-core wheel
        maybe_enable_modelopt = None
    if maybe_enable_modelopt is not None:
        maybe_enable_modelopt(args)
    if getattr(args, "context_parallel_impl", "ring") == "hsap":  # validates, sets args.spec
        if getattr(args, "modelopt_enabled", False):
            from megatron_hsap.errors import ConfigError

            raise ConfigError("ModelOpt builds its own layer spec, which has no HSAP attention: "
                              "drop the ModelOpt flags or use --context-parallel-impl ring")
        datasets_provider, forward_step = hsap_entry_points(args, datasets_provider, loss_func)
    # --hybrid-layer-pattern: a HybridModel built by Megatron's HybridModelBuilder, as Megatron-LM's
    # pretrain_hybrid.py does (core_v0.19.0); otherwise a GPTModel, as pretrain_gpt.py
    model_cfg = hybrid_config_from_args(args) if hybrid else gpt_config_from_args(args)
    run(
        pretrain_cfg_container_from_args(args, model_cfg),
        datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        store=store if store is not None else restart_store,
        get_embedding_ranks=get_embedding_ranks,
    )
    _shut_down()


def _shut_down() -> None:
    """Destroy the process groups while the interpreter is alive (HSAP's metrics flush at exit).

    Megatron's ``pretrain`` returns with its groups live; left to interpreter finalisation, gloo's
    worker threads can still own work objects whose tensors need the GIL, and the rank dies with
    ``terminate called without an active exception`` (SIGABRT) after a finished run (pytorch/pytorch
    PR 179291 describes it; PyTorch's docs ask every trainer to call ``destroy_process_group``).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
