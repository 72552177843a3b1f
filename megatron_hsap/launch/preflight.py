"""What the launcher checks before it launches, beyond the config's own validation.

* **Untested features.** :data:`FEATURES` is the one list of settings a config can turn on that
  the test suite does not run (the suite runs on CPU: Megatron's real ``pretrain()`` loop with
  DP, TP, PP + virtual PP, sequence parallelism, the distributed optimizer, Megatron-FSDP training,
  full/selective recompute and ``torch_dist`` checkpoint save/resume count as tested; see
  docs/enable.md). A config that uses one must
  acknowledge it in a top-level ``untested:`` list; a missing or stale entry is refused
  (:func:`check_untested`), and the launcher prints the list with every dry run and launch.
* **Data to fill in.** Example configs ship a real-data ``data:`` block whose paths are
  placeholders (``"<fill in: ...>"``, :data:`PLACEHOLDER`); a launch refuses them, and at launch
  time also dataset prefixes and tokenizer files that do not exist (:func:`data_problems`). Dry
  runs only warn, so a laptop can show the torchrun lines of a config it cannot run.

Pure Python (no torch): the sbatch scripts run it on the login node and on every node.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass

from megatron_hsap.argtypes import flag_value
from megatron_hsap.errors import ConfigError
from megatron_hsap.launch.config import CPImpl, DataConfig, LaunchConfig, Sharding

__all__ = [
    "Feature", "FEATURES", "PLACEHOLDER", "GPU_ONLY", "is_placeholder", "untested_features",
    "check_untested", "data_problems", "placeholder_keys", "untested_notice",
]

PLACEHOLDER = "<fill in"  # a value starting with this is a path the user still has to give

# Every GPU job runs these, and no test can (the suite is CPU-only); printed, never acknowledged.
# (bf16 / fp16 training itself runs in Megatron's loop on CPU: tests/megatron/test_pretrain_cpu_precision.py.)
GPU_ONLY = ("Transformer Engine layer spec", "flash-attn / TE kernels (bf16 on the GPU)", "NCCL")


def _flag(cfg: LaunchConfig, *prefixes: str) -> bool:
    return any(a.startswith(prefixes) for a in cfg.megatron_args)


def _flag_value(cfg: LaunchConfig, flag: str) -> str | None:
    return flag_value(cfg.megatron_args, flag)


def _megatron_fsdp(cfg: LaunchConfig) -> bool:
    return cfg.parallel.sharding.megatron_fsdp or _flag(cfg, "--use-megatron-fsdp")


def _zero3(cfg: LaunchConfig) -> bool:
    """Megatron-FSDP sharding parameters too (ZeRO-3): the config's sharding, or the flags (Megatron's
    default ``--data-parallel-sharding-strategy`` is ``optim_grads_params``, megatron-core 0.19.2)."""
    return cfg.parallel.sharding is Sharding.OPTIM_GRADS_PARAMS or (
        _flag(cfg, "--use-megatron-fsdp")
        and (_flag_value(cfg, "--data-parallel-sharding-strategy") or "optim_grads_params") == "optim_grads_params")


@dataclass(frozen=True, slots=True)
class _Spec:
    summary: str
    used: Callable[[LaunchConfig], bool]


class Feature(str, enum.Enum):
    """A setting the test suite does not run (the value is the name used in ``untested:``)."""

    FSDP_CHECKPOINT = "fsdp_checkpoint"
    RING_CP = "ring_cp"
    CUDA_GRAPHS = "cuda_graphs"
    FP8 = "fp8"
    CKPT_FORMAT = "ckpt_format"
    TORCH_FSDP2 = "torch_fsdp2"
    FSDP_TP_SP = "fsdp_tp_sp"

    @property
    def summary(self) -> str:
        return FEATURES[self].summary


FEATURES: dict[Feature, _Spec] = {
    Feature.FSDP_CHECKPOINT: _Spec(
        "Megatron-FSDP checkpoints (training.save / training.load, --save / --load, with parallel.sharding "
        "optim_grads / optim_grads_params or --use-megatron-fsdp: the fsdp_dtensor format). On CPU gloo ranks "
        "megatron-core 0.19.2's own save hangs in a collective at 4 ranks with or without HSAP (ranks whose "
        "shards hold different optimizer keys enter different collectives: NVIDIA/Megatron-LM issue 4910, "
        "open; PR 6573 adds a check that raises instead)",
        lambda c: _megatron_fsdp(c) and bool(c.training.save or c.training.load or _flag(c, "--save", "--load"))),
    Feature.RING_CP: _Spec(
        "Megatron's Transformer Engine ring at CP > 1 (cp_impl: ring; the suite runs ring at CP 1 only)",
        lambda c: c.parallel.cp_impl is CPImpl.RING and c.context_size > 1),
    Feature.CUDA_GRAPHS: _Spec(
        "CUDA graphs (--cuda-graph-*, --enable-cuda-graph, --external-cuda-graph; under hsap only the MLP and "
        "MoE modules, megatron/cuda_graphs.py: a graph capturing HSAP's layers is refused)",
        lambda c: _flag(c, "--cuda-graph", "--enable-cuda-graph", "--external-cuda-graph")),
    Feature.FP8: _Spec("fp8 training (--fp8-*)", lambda c: _flag(c, "--fp8")),
    Feature.CKPT_FORMAT: _Spec(
        "a checkpoint format other than torch_dist (--ckpt-format; Megatron-FSDP's fsdp_dtensor is "
        "part of fsdp_checkpoint)",
        lambda c: (_flag_value(c, "--ckpt-format") or "torch_dist") not in ("torch_dist", "fsdp_dtensor")),
    Feature.TORCH_FSDP2: _Spec(
        "torch FSDP2 (--use-torch-fsdp2): Megatron's wrapper expects its parameters on a CUDA device, so the "
        "CPU suite cannot run it",
        lambda c: _flag(c, "--use-torch-fsdp2")),
    Feature.FSDP_TP_SP: _Spec(
        "Megatron-FSDP ZeRO-3 (optim_grads_params) with tensor and sequence parallelism: on 8 CPU gloo ranks it "
        "crashed once in six runs with a native heap error (malloc(): unaligned fastbin chunk detected; cause not "
        "found), so the suite does not claim it",
        lambda c: _zero3(c) and c.parallel.tensor > 1 and (c.parallel.sequence_parallel or _flag(c, "--sequence-parallel"))),
}


# former features the suite runs now: an ``untested:`` list naming one is told to drop it
NOW_TESTED = {
    "megatron_fsdp": "Megatron-FSDP training runs in Megatron's pretrain() loop on CPU (ZeRO-3 with the GPT-30B "
    "configs' layer, bf16, overlapped reduce and gather, full recompute; ZeRO-2 over DP 2 × CP 2×2; "
    "tests/megatron/test_pretrain_cpu_precision.py); its checkpoints are `fsdp_checkpoint`",
    "sequence_parallel": "sequence parallelism runs in Megatron's pretrain() loop on CPU (TP 2 × CP 2×2, "
    "tests/megatron/test_pretrain_cpu.py)",
    "sft": "Megatron's SFT data (--sft) runs in Megatron's pretrain() loop on CPU: its SFTDataset's packed "
    "conversations (under HSAP not padded for CP) under CP 2×2 and under PP 3 × CP 1×2, whose middle stage plans from its own "
    "batches (tests/megatron/test_sft_pretrain_cpu.py, pretrain-cpu --sft)",
}


def untested_features(cfg: LaunchConfig) -> list[Feature]:
    """The untested features ``cfg`` turns on, in :class:`Feature` order."""
    return [f for f in Feature if FEATURES[f].used(cfg)]


def check_untested(cfg: LaunchConfig) -> list[Feature]:
    """The untested features of ``cfg``; raises :class:`ConfigError` unless its ``untested:`` list
    names exactly those (an unlisted feature would run unannounced, a stale entry would cry wolf)."""
    used = untested_features(cfg)
    listed = [Feature(name) for name in cfg.untested]
    missing = [f for f in used if f not in listed]
    if missing:
        detail = "; ".join(f"{f.value}: {f.summary}" for f in missing)
        raise ConfigError(
            f"untested: the config uses what the test suite does not run ({detail}); acknowledge it with "
            f"a top-level `untested: [{', '.join(f.value for f in used)}]` or change those settings")
    stale = [f for f in listed if f not in used]
    if stale:
        raise ConfigError(f"untested: {[f.value for f in stale]} listed but not used by the config; "
                          "remove them")
    return used


def untested_notice(cfg: LaunchConfig) -> str:
    """One line for validate, dry runs and launches."""
    used = untested_features(cfg)
    what = "; ".join(f"{f.value} ({f.summary})" for f in used) if used else "nothing"
    return f"untested by the (CPU) test suite: {what}; GPU-only paths never run in tests: {', '.join(GPU_ONLY)}"


def placeholder_keys(cfg: LaunchConfig) -> list[str]:
    """The ``data.*`` keys still holding a ``<fill in ...>`` placeholder (none with mock data)."""
    d = cfg.data
    if d.mock:
        return []
    keys = ["data.data_path"] if any(is_placeholder(p) for p in d.data_path) else []
    return keys + [f"data.{k}" for k in ("tokenizer_model", "vocab_file", "merge_file") if is_placeholder(getattr(d, k))]


def is_placeholder(value: str | None) -> bool:
    return bool(value) and value.strip().lower().startswith(PLACEHOLDER)


def _dataset_prefixes(d: DataConfig) -> list[str]:
    """Megatron's ``--data-path`` is ``PREFIX...`` or ``WEIGHT PREFIX WEIGHT PREFIX...``."""
    out = []
    for item in d.data_path:
        try:
            float(item)
        except ValueError:
            out.append(item)
    return out


def data_problems(cfg: LaunchConfig, *, check_files: bool) -> list[str]:
    """What keeps ``cfg``'s ``data:`` block from a real run: placeholders still to fill in, and with
    ``check_files`` dataset prefixes (``PREFIX.bin``/``.idx``; with ``--sft`` the jsonl files
    themselves) and tokenizer files that do not exist on this host. Each entry names the key to change."""
    d = cfg.data
    if d.mock:
        return []
    keys = placeholder_keys(cfg)
    if keys:
        return [f"{', '.join(keys)}: still the example's \"<fill in: ...>\" placeholder; give your indexed "
                "dataset prefix and tokenizer files (or start with a mock-data smoke config: configs/smoke/)"]
    if not check_files:
        return []
    problems = []
    sft = "--sft" in cfg.megatron_args  # Megatron's SFTDataset reads each path as a jsonl file, not a prefix
    for prefix in _dataset_prefixes(d):
        if sft:
            if not os.path.isfile(prefix):
                problems.append(f"data.data_path: {prefix} not found on this host; with --sft give the jsonl file of "
                                "conversations (Megatron's SFTDataset: one {\"messages\": [...]} per line)")
            continue
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            problems.append(f"data.data_path: {prefix}{'/'.join(missing)} not found on this host; give the "
                            "prefix of a Megatron indexed dataset (tools/preprocess_data.py writes "
                            "PREFIX.bin and PREFIX.idx)")
    for key in ("vocab_file", "merge_file"):
        path = getattr(d, key)
        if path and not os.path.isfile(path):
            problems.append(f"data.{key}: {path} not found on this host")
    model = d.tokenizer_model
    if model and model.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(model)):
        problems.append(f"data.tokenizer_model: {model} not found on this host")
    return problems
