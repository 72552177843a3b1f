"""A validated ``LaunchConfig`` → the training script's arguments, its environment, and the
torchrun line of each node.

Flags are those of megatron-core 0.19.2's ``megatron/training/arguments.py`` plus the HSAP
wrapper's (``megatron_hsap.megatron.arguments.add_hsap_args``): the HSAP topology travels in
Megatron's own ``--hierarchical-context-parallel-sizes P_intra P_inter``. The slow test
``tests/launch/test_configs.py::test_megatron_accepts_every_config`` runs Megatron's
``validate_args`` and the backend's ``validate_hsap_args`` on every config's arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megatron_hsap.errors import ConfigError
from megatron_hsap.launch.config import (
    Activation,
    CPImpl,
    LaunchConfig,
    PositionEmbedding,
    Recompute,
    Sharding,
)
from megatron_hsap.launch.torchrun import resolve_torchrun

__all__ = ["to_megatron_args", "launch_env", "torchrun_argv"]


def _fmt(x: float) -> str:
    return repr(x) if isinstance(x, float) else str(x)


def to_megatron_args(cfg: LaunchConfig, extra: Sequence[str] = ()) -> list[str]:
    """The training entry point's arguments (Megatron's flags + the HSAP wrapper's flags)."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.training, cfg.data
    a = [
        "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.ffn_size), "--num-attention-heads", str(m.num_attention_heads),
        "--kv-channels", str(m.head_dim), "--seq-length", str(t.seq_length),
        "--max-position-embeddings", str(t.seq_length),
        "--position-embedding-type", m.position_embedding.value,
        "--normalization", m.normalization.value, "--init-method-std", _fmt(m.init_method_std),
        "--attention-dropout", _fmt(m.attention_dropout), "--hidden-dropout", _fmt(m.hidden_dropout),
        "--make-vocab-size-divisible-by", str(m.make_vocab_size_divisible_by),
    ]
    if m.num_kv_heads != m.num_attention_heads:
        a += ["--group-query-attention", "--num-query-groups", str(m.num_kv_heads)]
    if m.position_embedding is PositionEmbedding.ROPE:
        a += ["--rotary-base", str(m.rotary_base)]
    if m.activation is Activation.SWIGLU:
        a.append("--swiglu")
    if m.untie_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    if not m.add_bias_linear:
        a.append("--disable-bias-linear")
    a += [
        "--tensor-model-parallel-size", str(p.tensor), "--pipeline-model-parallel-size", str(p.pipeline),
        "--context-parallel-size", str(p.context_size),
        "--context-parallel-impl", p.cp_impl.value,
    ]
    if p.cp_impl is CPImpl.HSAP:
        # Megatron's own flag carries the HSAP topology (level 0 = intra, level 1 = inter); the
        # backend reuses the groups Megatron builds from it.
        a += ["--hierarchical-context-parallel-sizes", str(p.hsap_intra_size), str(p.hsap_inter_size)]
        if p.hsap_layout is not None:
            a += ["--hsap-layout", p.hsap_layout.value]
        if p.hsap_pool_bytes is not None:
            a += ["--hsap-pool-bytes", str(p.hsap_pool_bytes)]
    else:
        a += ["--cp-comm-type", "p2p"]
    if p.sequence_parallel:
        a.append("--sequence-parallel")
    if p.sharding is Sharding.OPTIM:
        a.append("--use-distributed-optimizer")
    elif p.sharding.megatron_fsdp:
        # Megatron-FSDP's validate_args insists on its own checkpoint format
        a += ["--use-distributed-optimizer", "--use-megatron-fsdp",
              "--data-parallel-sharding-strategy", p.sharding.value, "--ckpt-format", "fsdp_dtensor"]
    a += [
        "--micro-batch-size", str(t.micro_batch_size), "--global-batch-size", str(cfg.global_batch_size),
        "--bf16", "--train-iters", str(t.train_iters), "--lr", _fmt(t.lr), "--min-lr", _fmt(t.min_lr),
        "--lr-decay-style", t.lr_decay_style, "--lr-warmup-iters", str(t.lr_warmup_iters),
        "--weight-decay", _fmt(t.weight_decay), "--clip-grad", _fmt(t.clip_grad),
        "--adam-beta1", _fmt(t.adam_beta1), "--adam-beta2", _fmt(t.adam_beta2), "--seed", str(t.seed),
        "--log-interval", str(t.log_interval), "--eval-iters", str(t.eval_iters),
    ]
    if t.per_token_loss:
        a.append("--calculate-per-token-loss")
    if t.recompute is not Recompute.NONE:
        a += ["--recompute-granularity", t.recompute.value]
    if t.recompute is Recompute.FULL:
        a += ["--recompute-method", t.recompute_method.value, "--recompute-num-layers", str(t.recompute_num_layers)]
    for flag, value in (("--save", t.save), ("--load", t.load), ("--save-interval", t.save_interval)):
        if value is not None:
            a += [flag, str(value)]
    a += ["--tokenizer-type", d.tokenizer_type, "--vocab-size", str(m.vocab_size)]
    for flag, value in (("--tokenizer-model", d.tokenizer_model), ("--vocab-file", d.vocab_file),
                        ("--merge-file", d.merge_file)):
        if value:
            a += [flag, value]
    if d.mock:
        a.append("--mock-data")
    else:
        a += ["--data-path", *d.data_path]
    if d.split:
        a += ["--split", d.split]
    if d.inter_document_masking:
        a.append("--dataloader-inter-document-masking")
    if d.reset_position_ids:
        a.append("--reset-position-ids")
    if d.eod_mask_loss:
        a.append("--eod-mask-loss")
    # a [b, 1, s, s] mask is 2^38 bytes at 512K tokens; packed attention never needs it
    a.append("--no-create-attention-mask-in-dataloader")
    return a + list(cfg.megatron_args) + list(extra)


def launch_env(cfg: LaunchConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """Environment variables the config needs on every node, given the current ``environ``.

    Megatron's ``validate_args`` asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP or CP > 1 (one
    CUDA work queue keeps communication kernels in issue order, before Blackwell) but refuses ``1``
    with Megatron-FSDP, so the value follows ``parallel.sharding``.
    """
    p = cfg.parallel
    current = environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if p.sharding.megatron_fsdp:
        if current == "1":
            raise ConfigError(
                f"parallel.sharding: {p.sharding.value} (Megatron-FSDP) needs CUDA_DEVICE_MAX_CONNECTIONS "
                "unset or > 1, but the environment sets 1; unset it")
        return {}
    if p.tensor > 1 or p.context_size > 1:
        if current not in (None, "1"):
            raise ConfigError(
                f"CUDA_DEVICE_MAX_CONNECTIONS={current} in the environment, but TP/CP > 1 needs 1 "
                f"(parallel.sharding {p.sharding.value}); unset it")
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def torchrun_argv(cfg: LaunchConfig, *, node_rank: int, master_addr: str, master_port: int,
                  nnodes: int | None = None, entry: str | None = None,
                  torchrun: Sequence[str] | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The fully resolved ``torchrun`` command of one node (static rendezvous on ``master_addr``).

    ``torchrun`` is the command prefix (default: :func:`~megatron_hsap.launch.torchrun.
    resolve_torchrun` for this interpreter: the environment's own torchrun, never a bare name).
    Node-major ranks: node ``n`` runs global ranks ``[n·G, (n+1)·G)`` with ``G`` GPUs per node,
    the placement the topology check assumes.
    """
    nnodes = cfg.cluster.nnodes if nnodes is None else nnodes
    if nnodes != cfg.cluster.nnodes:
        raise ConfigError(
            f"cluster.nnodes: the config is for {cfg.cluster.nnodes} node(s) but the job has {nnodes}; "
            "submit with --nodes matching the config or pick the config for this allocation")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"node rank {node_rank} is outside [0, {nnodes})")
    if torchrun is None:
        torchrun = resolve_torchrun().argv
    elif isinstance(torchrun, str):
        torchrun = [torchrun]
    return [
        *torchrun, f"--nnodes={nnodes}", f"--nproc-per-node={cfg.cluster.gpus_per_node}",
        f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}",
        entry or cfg.entry, *to_megatron_args(cfg, extra),
    ]
