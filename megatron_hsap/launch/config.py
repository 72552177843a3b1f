"""Launch configuration: one YAML file → validated frozen dataclasses (``arguments.py`` turns
them into Megatron's argument list and the torchrun line).

A config file has the sections ``model``, ``parallel``, ``cluster``, ``training``, ``data`` and an
optional ``megatron_args`` list passed through verbatim. ``extends: other.yaml`` (relative to the
file) deep-merges a base file first, so the Table 4 matrix is twelve five-line files over one base.
Every check raises ``ConfigError`` naming the key to change (``parallel.hsap_intra_size: ...``).

Rank layout (Megatron's default order ``tp-cp-ep-dp-pp``): global rank
``= tp + TP·(cp + CP·(dp + DP·pp))``, so CP ranks are spaced by TP and an HSAP intra group covers
``TP × P_intra`` consecutive GPUs — hence TP × P_intra must divide the GPUs per node.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.megatron_lm import GPT, SCRIPTS  # (imports nothing of megatron-core or torch)
from megatron_hsap.plan.checks import divisors, positive_int

__all__ = [
    "Activation", "CPImpl", "HSAPLayout", "InterLink", "Normalization", "PositionEmbedding", "Recompute",
    "RecomputeMethod", "Sharding", "ModelConfig", "ParallelConfig", "ClusterConfig",
    "TrainingConfig", "DataConfig", "LaunchConfig", "load_config", "config_from_dict",
    "parse_tokens", "DEFAULT_ENTRY",
]

DEFAULT_ENTRY = SCRIPTS[GPT]  # a hybrid layer pattern in megatron_args: SCRIPTS[HYBRID] (loader.default_entry)


class Activation(str, enum.Enum):
    GELU = "gelu"
    SWIGLU = "swiglu"


class Normalization(str, enum.Enum):
    LAYERNORM = "LayerNorm"
    RMSNORM = "RMSNorm"


class PositionEmbedding(str, enum.Enum):
    ROPE = "rope"
    LEARNED = "learned_absolute"


class Recompute(str, enum.Enum):
    """Activation recomputation (Korthikanti et al. 2022): none, the attention core, whole layers."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class RecomputeMethod(str, enum.Enum):
    UNIFORM = "uniform"
    BLOCK = "block"


class Sharding(str, enum.Enum):
    """Model-state sharding over the data×context-parallel group (Megatron's names)."""

    NONE = "none"  # plain DDP: every rank holds params, grads and Adam state
    OPTIM = "optim"  # --use-distributed-optimizer (ZeRO-1)
    OPTIM_GRADS = "optim_grads"  # Megatron-FSDP, ZeRO-2
    OPTIM_GRADS_PARAMS = "optim_grads_params"  # Megatron-FSDP, ZeRO-3

    @property
    def megatron_fsdp(self) -> bool:
        """Whether this sharding runs Megatron-FSDP (gradients sharded too), not Megatron's DDP."""
        return self in (Sharding.OPTIM_GRADS, Sharding.OPTIM_GRADS_PARAMS)


class InterLink(str, enum.Enum):
    """The network the config expects the inter (P2P) groups to cross; checked against the map."""

    AUTO = "auto"
    IB = "ib"
    NVLINK = "nvlink"


class CPImpl(str, enum.Enum):
    HSAP = "hsap"
    RING = "ring"  # Megatron's Transformer Engine p2p ring: the baseline


class HSAPLayout(str, enum.Enum):
    CONTIGUOUS = "contiguous"  # the paper's: inter chunk i on node i
    BALANCED = "balanced"


_K = 1024


def parse_tokens(value: object, key: str = "value") -> int:
    """``131072``, ``"128K"`` or ``"1M"`` → tokens (K = 2**10, M = 2**20, as in docs/design.md §1)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", value)
        if m:
            return int(m.group(1)) * {"": 1, "k": _K, "m": _K * _K}[m.group(2).lower()]
    raise ConfigError(f"{key}: expected a token count like 131072 or '128K', got {value!r}")


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    num_query_groups: int | None = None  # kv heads; None = num_attention_heads (MHA)
    ffn_hidden_size: int | None = None  # None = 4·hidden (gelu) as Megatron does
    kv_channels: int | None = None  # head dim; None = hidden / heads
    make_vocab_size_divisible_by: int = 128
    activation: Activation = Activation.GELU
    normalization: Normalization = Normalization.LAYERNORM
    position_embedding: PositionEmbedding = PositionEmbedding.ROPE
    rotary_base: int = 10000
    untie_embeddings: bool = False
    add_bias_linear: bool = True
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        _require_positive(self, "model", ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                                  "num_query_groups", "ffn_hidden_size", "kv_channels",
                                  "make_vocab_size_divisible_by", "rotary_base"))
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.kv_channels: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}; set kv_channels (the head size)")
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_query_groups: {self.num_kv_heads} does not divide num_attention_heads "
                f"{self.num_attention_heads} (GQA shares each kv head by the same number of q heads)")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")

    @property
    def num_kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def padded_vocab(self, tensor: int = 1) -> int:
        """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by × TP``."""
        m = self.make_vocab_size_divisible_by * tensor
        return -(-self.vocab_size // m) * m

    def layer_parameters(self) -> int:
        """Parameters of one transformer layer (Megatron GPT layout, biases if add_bias_linear)."""
        h, a, g, d, f = self.hidden_size, self.num_attention_heads, self.num_kv_heads, self.head_dim, self.ffn_size
        norm = 2 * h if self.normalization is Normalization.LAYERNORM else h
        bias = 1 if self.add_bias_linear else 0
        qkv = h * (a + 2 * g) * d + bias * (a + 2 * g) * d
        proj = a * d * h + bias * h
        fc1_out = 2 * f if self.activation is Activation.SWIGLU else f
        mlp = h * fc1_out + bias * fc1_out + f * h + bias * h
        return 2 * norm + qkv + proj + mlp

    def embedding_parameters(self, max_positions: int = 0, tensor: int = 1) -> int:
        """Input embedding (+ learned positions) + final norm + untied output layer."""
        h, v = self.hidden_size, self.padded_vocab(tensor)
        pos = max_positions * h if self.position_embedding is PositionEmbedding.LEARNED else 0
        norm = 2 * h if self.normalization is Normalization.LAYERNORM else h
        return v * h + pos + norm + (v * h if self.untie_embeddings else 0)

    def num_parameters(self, max_positions: int = 0) -> int:
        return self.num_layers * self.layer_parameters() + self.embedding_parameters(max_positions)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    data: int | None = None  # None = whatever the world size leaves
    context: int | None = None  # None = hsap_intra_size × hsap_inter_size
    hsap_intra_size: int = 1
    hsap_inter_size: int = 1
    cp_impl: CPImpl = CPImpl.HSAP
    hsap_layout: HSAPLayout | None = None  # --hsap-layout; None = the backend's default (balanced)
    hsap_pool_bytes: int | None = None  # --hsap-pool-bytes; None = 4 inter chunks (docs/design.md §2.1)
    sequence_parallel: bool = False
    sharding: Sharding = Sharding.OPTIM
    inter_link: InterLink = InterLink.AUTO

    def __post_init__(self) -> None:
        _require_positive(self, "parallel", ("tensor", "pipeline", "data", "context", "hsap_intra_size",
                                     "hsap_inter_size", "hsap_pool_bytes"))
        cp = self.hsap_intra_size * self.hsap_inter_size
        if self.context is not None and self.context != cp:
            raise ConfigError(
                f"parallel.context: {self.context} but hsap_intra_size × hsap_inter_size = "
                f"{self.hsap_intra_size} × {self.hsap_inter_size} = {cp}; drop `context` or make "
                "the product match")
        if self.sequence_parallel and self.tensor == 1:
            raise ConfigError("parallel.sequence_parallel needs tensor > 1 (Megatron turns it off at TP 1)")

    @property
    def context_size(self) -> int:
        return self.hsap_intra_size * self.hsap_inter_size


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    nnodes: int
    gpus_per_node: int = 8
    gpu: str = "a100-sxm4-40gb"
    gpu_mem_gib: float = 40.0
    hardware: str = "a100"  # key of megatron_hsap.plan.hardware.HARDWARE (planner cost model)

    def __post_init__(self) -> None:
        _require_positive(self, "cluster", ("nnodes", "gpus_per_node"))
        if self.gpu_mem_gib <= 0:
            raise ConfigError(f"cluster.gpu_mem_gib must be positive, got {self.gpu_mem_gib}")
        from megatron_hsap.plan.hardware import HARDWARE

        if self.hardware not in HARDWARE:
            raise ConfigError(f"cluster.hardware: {self.hardware!r} is unknown; use one of {sorted(HARDWARE)}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingConfig:
    seq_length: int
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None = micro_batch_size × data-parallel size
    train_iters: int = 20
    lr: float = 1.0e-4
    min_lr: float = 1.0e-5
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 0
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    seed: int = 1234
    # --calculate-per-token-loss, for either CP impl (the same training under both); false: Megatron's
    # default per-micro-batch mean, which HSAP also computes exactly (megatron/loss.py)
    per_token_loss: bool = True
    recompute: Recompute = Recompute.SELECTIVE
    recompute_method: RecomputeMethod = RecomputeMethod.UNIFORM
    recompute_num_layers: int = 1
    log_interval: int = 1
    eval_iters: int = 0
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None

    def __post_init__(self) -> None:
        _require_positive(self, "training", ("seq_length", "micro_batch_size", "global_batch_size",
                                     "train_iters", "recompute_num_layers", "log_interval",
                                     "save_interval"))


# Megatron's text tokenizers (megatron-core 0.19.2 megatron/core/tokenizers/utils/build_tokenizer.py)
# and the files each one reads.
_TOKENIZER_NEEDS: dict[str, tuple[str, ...]] = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "SFTTokenizer": ("tokenizer_model",),  # --sft's conversations (a HuggingFace tokenizer with a chat template)
    "NullTokenizer": (),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class DataConfig:
    """Megatron's data flags. ``mock: true`` (Megatron's ``--mock-data``, synthetic tokens) is for
    smoke runs only and must be asked for; real runs give indexed-dataset prefixes in ``data_path``
    (``PREFIX`` of ``PREFIX.bin``/``PREFIX.idx``, or Megatron's ``WEIGHT PREFIX ...`` blend) and the
    tokenizer the data was made with. Values starting ``<fill in`` are placeholders the launcher
    refuses (``preflight.data_problems``)."""

    mock: bool = False
    data_path: tuple[str, ...] = ()
    split: str | None = None
    tokenizer_type: str = "NullTokenizer"
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    inter_document_masking: bool = True  # cu_seqlens per document: attention stays inside documents
    reset_position_ids: bool = True  # packed documents: positions restart at every EOD
    eod_mask_loss: bool = True

    def __post_init__(self) -> None:
        if not self.mock and not self.data_path:
            raise ConfigError("data.data_path: empty while data.mock is false; give the indexed "
                              "dataset prefixes (PREFIX of PREFIX.bin/.idx) or, for a smoke run, set mock: true")
        if self.mock and self.data_path:
            raise ConfigError("data.mock: true would ignore data.data_path; drop data_path (smoke run on "
                              "synthetic tokens) or set mock: false (real data)")
        if self.tokenizer_type not in _TOKENIZER_NEEDS:
            raise ConfigError(f"data.tokenizer_type: {self.tokenizer_type!r} is not one of Megatron's "
                              f"tokenizers {sorted(_TOKENIZER_NEEDS)}")
        if not self.mock:
            missing = [k for k in _TOKENIZER_NEEDS[self.tokenizer_type] if not getattr(self, k)]
            if missing:
                raise ConfigError(f"data.{missing[0]}: tokenizer_type {self.tokenizer_type} needs "
                                  f"{' and '.join('data.' + k for k in missing)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    """One validated launch: model, parallel sizes, cluster, training and data settings."""

    name: str
    model: ModelConfig
    parallel: ParallelConfig
    cluster: ClusterConfig
    training: TrainingConfig
    data: DataConfig = field(default_factory=DataConfig)
    megatron_args: tuple[str, ...] = ()
    entry: str = DEFAULT_ENTRY
    untested: tuple[str, ...] = ()  # acknowledged untested features (launch/preflight.py checks them)
    source: str | None = None  # the file it was loaded from (for messages)

    def __post_init__(self) -> None:
        _validate_launch(self)

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def context_size(self) -> int:
        return self.parallel.context_size

    @property
    def data_size(self) -> int:
        p = self.parallel
        return self.world_size // (p.tensor * p.pipeline * p.context_size)

    @property
    def global_batch_size(self) -> int:
        return self.training.global_batch_size or self.training.micro_batch_size * self.data_size

    def summary(self) -> str:
        p = self.parallel
        c = self.cluster
        return (f"{self.name}: {self.world_size} GPUs ({c.nnodes} node(s) × {c.gpus_per_node}), "
                f"TP {p.tensor} PP {p.pipeline} DP {self.data_size} CP {self.context_size} "
                f"[{p.cp_impl.value} {p.hsap_intra_size}x{p.hsap_inter_size} intra×inter], "
                f"seq {self.training.seq_length}, recompute {self.training.recompute.value}")


def _require_positive(obj: object, section: str, names: Sequence[str]) -> None:
    """Each of ``names`` unset (None) or an integer ≥ 1 (``plan/checks.positive_int``)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None:
            positive_int(f"{section}.{name}", value)


def _validate_launch(cfg: LaunchConfig) -> None:
    m, p, c, t = cfg.model, cfg.parallel, cfg.cluster, cfg.training
    world, cp = c.world_size, p.context_size
    denom = p.tensor * p.pipeline * cp
    if world % denom:
        raise ConfigError(
            f"parallel: tensor × pipeline × context = {p.tensor} × {p.pipeline} × {cp} = {denom} does "
            f"not divide the world size cluster.nnodes × cluster.gpus_per_node = {world}")
    if p.data is not None and p.data * denom != world:
        raise ConfigError(
            f"parallel.data: TP × PP × DP × CP = {p.tensor} × {p.pipeline} × {p.data} × {cp} = "
            f"{p.data * denom} but the world size is {world}; set data to {world // denom} or drop it")
    # Heads: Megatron splits q heads and kv groups over TP; HSAP's intra all-to-all splits the
    # per-TP-rank heads over P_intra and replicates kv heads when P_intra > kv heads.
    if m.num_attention_heads % p.tensor:
        raise ConfigError(f"parallel.tensor: {p.tensor} does not divide model.num_attention_heads "
                          f"{m.num_attention_heads}")
    if m.num_kv_heads % p.tensor:
        raise ConfigError(f"parallel.tensor: {p.tensor} does not divide model.num_query_groups "
                          f"{m.num_kv_heads} (Megatron splits kv groups over TP)")
    if m.num_layers % p.pipeline:
        raise ConfigError(f"parallel.pipeline: {p.pipeline} does not divide model.num_layers {m.num_layers}")
    if p.cp_impl is CPImpl.HSAP:
        from megatron_hsap.plan.plan import kv_heads_per_rank  # the planner's own rule

        intra = p.hsap_intra_size
        try:  # q heads per TP rank split over P_intra; kv heads split or replicated
            kv_heads_per_rank(m.num_attention_heads // p.tensor, m.num_kv_heads // p.tensor, intra)
        except ConfigError as exc:
            raise ConfigError(f"parallel.hsap_intra_size: {intra} with heads per TP rank: {exc}") from None
        if c.gpus_per_node % (p.tensor * intra):
            valid = [q for q in divisors(cp) if c.gpus_per_node % (p.tensor * q) == 0]
            raise ConfigError(
                f"parallel.hsap_intra_size: tensor × hsap_intra_size = {p.tensor} × {intra} does not "
                f"divide cluster.gpus_per_node {c.gpus_per_node}; CP ranks are spaced by TP, so an "
                f"intra (all-to-all) group spans TP × P_intra GPUs and must sit in one node. "
                f"Valid hsap_intra_size for CP {cp}: {valid}")
    # Megatron's validate_args asserts seq_length % (2·CP) == 0 for any CP > 1; sequence
    # parallelism further splits each CP rank's tokens over TP. HSAP itself pads only the end of
    # the micro-batch, so packed batches shorter than seq_length are fine at run time.
    multiple = (2 * cp if cp > 1 else 1) * (p.tensor if p.sequence_parallel else 1)
    if t.seq_length % multiple:
        lo = t.seq_length // multiple * multiple
        raise ConfigError(
            f"training.seq_length: {t.seq_length} is not a multiple of {multiple} (2 × CP"
            f"{' × TP with sequence_parallel' if p.sequence_parallel else ''}), which Megatron's "
            f"argument check requires; use {lo or multiple} or {lo + multiple}")
    if t.recompute is Recompute.FULL:
        per_stage = m.num_layers // p.pipeline
        if t.recompute_num_layers > per_stage:
            raise ConfigError(f"training.recompute_num_layers: {t.recompute_num_layers} exceeds the "
                              f"{per_stage} layers per pipeline stage")
    gbs = cfg.global_batch_size
    if gbs % (t.micro_batch_size * cfg.data_size):
        raise ConfigError(
            f"training.global_batch_size: {gbs} is not a multiple of micro_batch_size × DP = "
            f"{t.micro_batch_size} × {cfg.data_size}")
    if m.position_embedding is PositionEmbedding.LEARNED and t.seq_length > 65536:
        raise ConfigError(
            f"model.position_embedding: learned_absolute at seq_length {t.seq_length} adds "
            f"{t.seq_length * m.hidden_size / 1e9:.1f}B parameters; use rope")
    from megatron_hsap.launch.loader import check_passthrough  # (loader imports this module)

    check_passthrough(cfg)


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> LaunchConfig:
    """Read a YAML config (following ``extends``), apply ``overrides`` and validate it
    (implemented in ``loader.py``)."""
    from megatron_hsap.launch.loader import load_config as load

    return load(path, overrides)


def config_from_dict(data: Mapping[str, Any], *, source: str | None = None) -> LaunchConfig:
    """Build a ``LaunchConfig`` from plain data (what ``yaml.safe_load`` returns)."""
    from megatron_hsap.launch.loader import config_from_dict as build

    return build(data, source=source)
