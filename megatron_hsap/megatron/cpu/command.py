"""``megatron-hsap pretrain-cpu``: Megatron's own ``pretrain()`` loop with HSAP on CPU gloo ranks.

    megatron-hsap pretrain-cpu --world-size 4 --intra-size 2 --inter-size 2 --steps 6
    megatron-hsap pretrain-cpu --world-size 4 --tp 2 --intra-size 1 --inter-size 2 -- --use-distributed-optimizer
    megatron-hsap pretrain-cpu --world-size 4 --intra-size 2 --inter-size 2 --sft --compare

Spawns one process per rank (``python -m megatron_hsap.megatron.cpu.rank``) with Megatron's own
flags: a small GPT (RoPE, GQA, SwiGLU, RMSNorm, fp32, CPU initialisation), Megatron's fusions off by
its own flags, gloo pinned to loopback, a file-store rendezvous. Every flag after ``--`` goes to
Megatron unchanged (``--use-distributed-optimizer``, ``--save DIR``, ``--qk-layernorm``,
``--num-experts 2`` ...). The last rank's output — Megatron's own log lines, incl. its
``validation loss`` lines — is printed; every rank's log is kept under ``--out``.
``--reference`` runs the same job at CP=1, TP=1 (same pipeline stages, at most 2) with Megatron's
local attention and the dataloader's per-document causal mask (the loss to compare HSAP against). Where that attention
cannot compute the model (``reference.no_local_reference``: MLA, sliding windows) ``--reference`` is refused
and ``--compare`` compares with the same loop at CP=1 under HSAP instead (one rank: no sharding, no
P2P; its attention is checked against float64 references by ``tests/megatron/test_mla.py`` and
``tests/megatron/test_gpt_window.py``). ``--sft`` trains on Megatron's SFT data (its
``SFTDataset`` over conversations made from the CPU corpus, ``megatron/cpu/sft.py``); its reference
masks each batch by the batch's ``cu_seqlens`` (HSAP builds the SFT data as CP=1 does:
``pretrain_hooks.sft_data_as_cp1``).
``--megatron-lm DIR`` runs a Megatron-LM checkout's own ``pretrain_gpt.py`` — ``pretrain_hybrid.py``
given a hybrid layer pattern — (its provider, forward step and loss, through
``megatron_lm.run_megatron_lm``: what ``scripts/pretrain_gpt_hsap.py`` / ``pretrain_hybrid_hsap.py``
run on a cluster) instead of this command's copies, on the CPU corpus or the data flags given after ``--``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from megatron_hsap.argtypes import flag_names
from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.cpu.reference import compare_losses, hybrid_pattern, no_local_reference, reference_of

__all__ = ["CPURun", "CPUResult", "compare_losses", "megatron_flags", "no_local_reference", "reference_of", "run", "parse_log", "parse_mtp_losses", "rank_env", "main"]

_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")
_VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.Ee+-]+)")
_ITER_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*")
_MTP = re.compile(r"mtp_(\d+) loss: ([0-9.Ee+-]+)")
# After training Megatron evaluates once more on the validation and the test split.
_VALID_END = re.compile(r"validation loss at iteration \d+ on (validation|test) set \| lm loss value: ([0-9.Ee+-]+)")

# Megatron's flags that choose the documents pretrain_gpt's provider reads (``--megatron-lm``:
# without one of them, the CPU corpus is its --data-path), and its tokenizer's
_DATA_SOURCES = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path",
                 "--per-split-data-args-path", "--mock-data")
_TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file")
# Megatron's data and tokenizer flags that pretrain_gpt's provider reads and the CPU provider does
# not (``loop.cpu_datasets_provider``: its corpus, --mock-data or --sft, a byte tokenizer)
_DATA_NOT_READ = (*(f for f in _DATA_SOURCES if f != "--mock-data"), "--per-dataset-sequences-path", "--fim-data",
                  *_TOKENIZER_FLAGS, "--sft-tokenizer-prompt-format")


# The two model families of the shipped configs, at CPU size (hidden 64, 4 heads of 16; kv groups
# as below, MHA when they equal the heads).
_HEADS = 4
_MODELS = {
    "llama": dict(groups=2, tied=False, flags=("--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear")),
    "gpt": dict(groups=4, tied=True, flags=("--normalization", "LayerNorm")),  # GeLU and biases: Megatron's defaults
}


@dataclass(frozen=True, slots=True, kw_only=True)
class CPURun:
    """One CPU run of Megatron's loop (sizes, steps, and Megatron flags passed through)."""

    world_size: int = 4
    tp: int = 1
    pp: int = 1
    vp: int | None = None  # layers per virtual pipeline stage (Megatron's --num-layers-per-virtual-pipeline-stage)
    intra_size: int = 2
    inter_size: int = 2
    reference: bool = False  # CP=1 TP=1 with Megatron's local attention and the dataloader's mask
    packed: bool = True  # documents as they come (cu_seqlens); False: every sample one document
    # Megatron's SFT data (--sft: SFTDataset packing conversations, megatron/cpu/sft.py) instead of the GPT corpus
    sft: bool = False
    steps: int = 6
    micro_batch_size: int = 2
    global_batch_size: int | None = None  # default: micro-batch × DP (one micro-batch per step)
    seq_length: int = 256
    num_layers: int = 2
    eval_interval: int = 3
    eval_iters: int = 2
    seed: int = 1234
    tie_embeddings: bool = False  # one word-embedding matrix for input and output (Megatron's default)
    # --calculate-per-token-loss (the global per-token mean); False: Megatron's default, each
    # micro-batch's mean loss (megatron/loss.py)
    per_token_loss: bool = True
    # "llama": RMSNorm, SwiGLU, no biases, GQA 4/2, untied; "gpt": the GPT-30B configs' layer
    # (LayerNorm, GeLU, biases, MHA 4/4, tied embeddings)
    model: str = "llama"
    extra: tuple[str, ...] = ()
    # a Megatron-LM checkout: run its pretrain_gpt.py's (pretrain_hybrid.py's, given a hybrid layer pattern)
    # provider, forward step and loss (``megatron_lm.run_megatron_lm``, as scripts/pretrain_*_hsap.py do)
    # instead of the CPU copies
    megatron_lm: str | None = None
    vocab_multiple: int = 1  # --make-vocab-size-divisible-by (a TP=1 reference: the run's × its TP)
    log_dir: str | None = None
    timeout_s: float = 900.0

    @property
    def cp_size(self) -> int:
        return 1 if self.reference else self.intra_size * self.inter_size

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp_size)

    def check(self) -> None:
        """Refuse bad sizes before any process is spawned."""
        for name in ("world_size", "tp", "pp", "intra_size", "inter_size", "steps", "micro_batch_size",
                     "seq_length", "num_layers", "eval_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "eval_iters" else 1):
                raise ConfigError(f"--{name.replace('_', '-')} {value!r}: must be a positive integer")
        if self.vp is not None and self.pp < 2:
            # (Megatron ignores it when the layers make one virtual stage, and asserts otherwise)
            raise ConfigError(f"--vp {self.vp} interleaves pipeline stages: it needs --pp 2 or more")
        if self.reference and self.tp != 1:
            raise ConfigError("--reference runs at TP=1, CP=1: drop --tp")
        if self.reference and (why := no_local_reference(self)):
            raise ConfigError(f"--reference cannot run this model: {'; '.join(why)}. Use --compare, which then "
                              "compares with the same loop at CP=1 under HSAP")
        model = self.tp * self.pp * self.cp_size
        if self.world_size % model:
            raise ConfigError(f"--world-size {self.world_size} is not a multiple of TP×PP×CP = {model}")
        if self.world_size > 8:
            raise ConfigError(f"--world-size {self.world_size}: at most 8 CPU ranks on one machine")
        if self.model not in _MODELS:
            raise ConfigError(f"--model {self.model!r}: one of {', '.join(_MODELS)}")
        if self.sft and not self.packed:
            raise ConfigError("--sft packs conversations with their cu_seqlens: drop --no-packed")
        if self.megatron_lm is not None:
            self._check_megatron_lm()
        unread = sorted(flag_names(self.extra) & set(_DATA_NOT_READ))
        if unread and self.megatron_lm is None:  # (passed to Megatron, which parses them, and ignored by the CPU provider)
            raise ConfigError(f"{', '.join(unread)} after --: pretrain-cpu trains on its own CPU corpus (or "
                              "Megatron's --mock-data, or --sft's conversations) with a byte tokenizer, so these "
                              "would be ignored; add --megatron-lm DIR (Megatron-LM's pretrain_gpt.py reads them) or "
                              "run scripts/pretrain_gpt_hsap.py for your own data")
        if "--sft" in self.extra:
            raise ConfigError("--sft after --: give it to pretrain-cpu (before --), which then builds Megatron's SFT "
                              "dataset over CPU conversations and leaves out the flags SFTDataset refuses")
        if not self.reference:
            self._check_heads()

    def _check_megatron_lm(self) -> None:
        from megatron_hsap.megatron.megatron_lm import entry_for, megatron_lm_root

        megatron_lm_root(self.megatron_lm, entry_for(self.extra))  # (ConfigError: no pretrain_gpt.py / pretrain_hybrid.py there)
        if self.sft or "--sft" in self.extra:
            raise ConfigError("--sft with --megatron-lm: Megatron-LM's SFT path builds its tokenizer from your "
                              "Hugging Face model (--tokenizer-type SFTTokenizer); pretrain-cpu --sft without "
                              "--megatron-lm runs Megatron's SFTDataset over CPU conversations")

    def _check_heads(self) -> None:
        """The model's 4 heads / kv groups split by TP, then by P_intra (``plan.options``' rule)."""
        from megatron_hsap.plan.options import kv_heads_per_rank

        heads, groups = _HEADS, _MODELS[self.model]["groups"]  # megatron_flags' model
        if groups % self.tp:
            raise ConfigError(f"--tp {self.tp}: the model's {heads} heads and {groups} kv groups split over TP 1 or 2")
        try:
            kv_heads_per_rank(heads // self.tp, groups // self.tp, self.intra_size)
        except ConfigError as exc:
            raise ConfigError(f"--intra-size {self.intra_size} with --tp {self.tp} ({heads // self.tp} heads, "
                              f"{groups // self.tp} kv heads per TP rank): {exc}") from None


@dataclass(frozen=True, slots=True)
class CPUResult:
    """Losses Megatron logged (``lm loss`` per iteration; validation losses by iteration), the logs."""

    returncode: int
    losses: dict[int, float]
    validation: dict[int, float]
    final_validation: float | None
    final_test: float | None
    log_dir: str
    output: str = field(repr=False)
    mtp_losses: dict[int, dict[int, float]] = field(default_factory=dict)  # {depth: {iteration: loss}}


def megatron_flags(run: CPURun) -> list[str]:
    """Megatron's command line for ``run`` (model, parallelism, data, fusions off, gloo)."""
    from megatron_hsap.megatron.cpu.device import FUSION_OFF_FLAGS

    gbs = run.global_batch_size or run.micro_batch_size * run.dp_size
    # Megatron refuses GQA with multi-latent attention (MLA has one latent kv per head)
    style = _MODELS[run.model]
    gqa = [] if "--multi-latent-attention" in run.extra or style["groups"] == _HEADS else \
        ["--group-query-attention", "--num-query-groups", str(style["groups"])]
    tied = run.tie_embeddings or style["tied"]
    flags = [
        "--num-layers", str(run.num_layers), "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", str(_HEADS), *gqa,
        "--seq-length", str(run.seq_length), "--max-position-embeddings", str(run.seq_length),
        "--position-embedding-type", "rope", *style["flags"],
        *([] if tied else ["--untie-embeddings-and-output-weights"]),
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--init-method-std", "0.02",
        "--micro-batch-size", str(run.micro_batch_size), "--global-batch-size", str(gbs),
        "--train-iters", str(run.steps), "--eval-interval", str(run.eval_interval),
        "--eval-iters", str(run.eval_iters), "--log-interval", "1",
        "--lr", "3e-3", "--min-lr", "3e-3", "--lr-decay-style", "constant", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--seed", str(run.seed),
        *_tokenizer_flags(run), "--make-vocab-size-divisible-by", str(run.vocab_multiple),
        "--split", "90,5,5", "--num-workers", "0", *(["--calculate-per-token-loss"] if run.per_token_loss else []),
        # (SFTDataset gives each conversation its positions and asserts the reset off)
        *([] if run.sft else ["--reset-position-ids"]), *(["--sft"] if run.sft else []),
        "--use-cpu-initialization", "--distributed-backend", "gloo", "--distributed-timeout-minutes", "10",
        "--tensor-model-parallel-size", str(run.tp), "--pipeline-model-parallel-size", str(run.pp),
        "--log-throughput",
        *FUSION_OFF_FLAGS,
    ]
    if run.vp is not None:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(run.vp)]
    if run.reference:
        flags += ["--context-parallel-impl", "ring"]
        if run.sft:  # SFTDataset makes no mask (it asserts): reference_forward_step's from cu_seqlens
            flags.append("--no-create-attention-mask-in-dataloader")
        elif run.packed:  # the dataloader's per-document causal mask; unpacked, a sample is one document
            flags.append("--reset-attention-mask")
        if hybrid_pattern(run.extra) and "--spec" not in run.extra:
            # megatron-core's default hybrid stack is built from TE modules: its local twin (CPU ranks)
            flags += ["--spec", "megatron_hsap.megatron.cpu.reference_spec", "REFERENCE_HYBRID_STACK_SPEC"]
    else:
        flags += [
            "--context-parallel-impl", "hsap", "--context-parallel-size", str(run.cp_size),
            "--hierarchical-context-parallel-sizes", str(run.intra_size), str(run.inter_size),
            "--no-create-attention-mask-in-dataloader",
        ]
        if run.packed and not run.sft:  # (--sft batches carry cu_seqlens: pretrain_gpt's has_cu_seqlens)
            flags.append("--dataloader-inter-document-masking")
    return flags + list(run.extra)


def _tokenizer_flags(run: CPURun) -> list[str]:
    """The model's vocabulary: 258 for the CPU provider's byte tokenizer (bytes, EOD 256, PAD 257).
    ``--megatron-lm`` builds Megatron's ``NullTokenizer`` from the flags, whose EOD is the last id:
    257 ids over the CPU corpus (EOD 256, the corpus's), 4,097 over ``--mock-data`` (its documents,
    under 4,096 tokens, count up from 1: EOD never inside one); none when the run gives a tokenizer."""
    if run.megatron_lm is None:
        return ["--tokenizer-type", "NullTokenizer", "--vocab-size", "258"]
    given = flag_names(run.extra)
    if given & set(_TOKENIZER_FLAGS):
        return []
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", "4097" if "--mock-data" in given else "257"]


def corpus_data_flags(run: CPURun) -> list[str]:
    """``--megatron-lm`` without a data source after ``--``: ``--data-path`` of the CPU corpus (built
    once), the documents the CPU provider reads; else nothing."""
    if run.megatron_lm is None or flag_names(run.extra) & set(_DATA_SOURCES):
        return []
    from megatron_hsap.megatron.data import build_stdlib_corpus

    return ["--data-path", build_stdlib_corpus(min_doc_bytes=24, max_doc_bytes=160).prefix]


def parse_log(text: str) -> tuple[dict[int, float], dict[int, float], dict[str, float]]:
    """``(lm loss by iteration, validation lm loss by iteration, {"validation"|"test": final lm loss})``
    from Megatron's log."""
    losses = {int(i): float(v) for i, v in _ITER.findall(text)}
    validation = {int(i): float(v) for i, v in _VALID.findall(text)}
    final = {split: float(v) for split, v in _VALID_END.findall(text)}
    return losses, validation, final


def parse_mtp_losses(text: str) -> dict[int, dict[int, float]]:
    """Multi-token prediction's logged losses (``--mtp-num-layers``): ``{depth: {iteration: loss}}``."""
    out: dict[int, dict[int, float]] = {}
    for line in _ITER_LINE.finditer(text):
        for depth, value in _MTP.findall(line.group(0)):
            out.setdefault(int(depth), {})[int(line.group(1))] = float(value)
    return out


MEGATRON_LM_ENV = "HSAP_CPU_MEGATRON_LM"  # ``--megatron-lm``: the checkout whose scripts the ranks run

# Megatron's FSDP implementations refuse CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron/training/arguments.py);
# everything else wants 1 (the ordering TP/SP overlap relies on). No stream exists on CPU either way.
_FSDP_FLAGS = ("--use-megatron-fsdp", "--use-torch-fsdp2")


def rank_env(rank: int, world: int, store: str, record_dir: str | None = None, *, fsdp: bool = False,
             megatron_lm: str | None = None) -> dict[str, str]:
    """The environment of CPU rank ``rank`` of ``world`` (gloo on loopback only, rendezvous at
    ``store``, one thread, no GPU); ``record_dir``: where the rank records its losses and parameters;
    ``fsdp``: Megatron-FSDP's ``CUDA_DEVICE_MAX_CONNECTIONS``; ``megatron_lm``: the checkout whose
    scripts the rank runs."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="0", HSAP_CPU_STORE=store,
        GLOO_SOCKET_IFNAME="lo",  # gloo's pair sockets on loopback only
        CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",  # a native crash (SIGSEGV, SIGABRT) leaves every thread's Python stack in the log
        CUDA_DEVICE_MAX_CONNECTIONS="8" if fsdp else "1",
        # Megatron writes its dataset index cache and may probe a GPU; keep both quiet and local.
        TORCH_CPP_LOG_LEVEL=env.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
    )
    if record_dir is not None:  # what tests read (megatron/cpu/record.py)
        env["HSAP_CPU_RECORD"] = record_dir
    env.pop(MEGATRON_LM_ENV, None)
    if megatron_lm is not None:
        env[MEGATRON_LM_ENV] = megatron_lm
    return env


def run(opts: CPURun, *, echo: bool = False, record_dir: str | None = None) -> CPUResult:
    """Spawn the ranks, wait for them (bounded by ``timeout_s``), parse the last rank's log.

    ``record_dir``: the ranks write parameters, FLOP statistics and losses there (tests)."""
    opts.check()
    log_dir = Path(opts.log_dir or tempfile.mkdtemp(prefix="hsap-pretrain-cpu-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    store = str(log_dir / "store")
    if os.path.exists(store):
        os.remove(store)
    flags = megatron_flags(opts)
    flags += corpus_data_flags(opts)
    if not any(f == "--data-cache-path" for f in flags):
        flags += ["--data-cache-path", str(log_dir / "index-cache")]
    cmd = [sys.executable, "-m", "megatron_hsap.megatron.cpu.rank", *flags]
    procs, files = [], []
    fsdp = any(f in _FSDP_FLAGS for f in opts.extra)
    for rank in range(opts.world_size):
        out = open(log_dir / f"rank{rank}.log", "w")
        files.append(out)
        env = rank_env(rank, opts.world_size, store, record_dir, fsdp=fsdp, megatron_lm=opts.megatron_lm)
        procs.append(subprocess.Popen(cmd, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    codes = _wait(procs, opts.timeout_s)
    for f in files:
        f.close()
    last = (log_dir / f"rank{opts.world_size - 1}.log").read_text(errors="replace")
    text = last
    if opts.world_size > 1:  # HSAP's own lines (start-up, per-iteration metrics) come from rank 0
        ours = [line for line in (log_dir / "rank0.log").read_text(errors="replace").splitlines()
                if line.startswith("[megatron-hsap]")]
        text = "\n".join(ours) + "\n" + last
    if any(codes):
        bad = next(r for r, c in enumerate(codes) if c)
        text = last + f"\n--- rank {bad} (exit {codes[bad]}) ---\n" + (log_dir / f"rank{bad}.log").read_text(errors="replace")[-6000:]
    if echo:
        sys.stdout.write(text)
    losses, validation, final = parse_log(last)
    return CPUResult(returncode=max(codes, key=abs), losses=losses, validation=validation,
                     final_validation=final.get("validation"), final_test=final.get("test"),
                     log_dir=str(log_dir), output=text, mtp_losses=parse_mtp_losses(last))


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """Wait for every rank; when one fails or time runs out, stop the rest (no orphan hangs)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes]
        failed = any(c not in (None, 0) for c in codes)
        if failed or time.monotonic() > deadline:
            time.sleep(2.0 if failed else 0.0)  # let the failing rank's peers print their errors
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return [int(p.wait()) if p.returncode is None else int(p.returncode) for p in procs]
        time.sleep(0.2)


def build_parser(prog: str = "megatron-hsap pretrain-cpu") -> argparse.ArgumentParser:
    from megatron_hsap.argtypes import HelpFormatter, add_renamed, add_topology_args, nonnegative_int, output_dir, positive_int

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                epilog="Flags after `--` go to Megatron unchanged. About 1 GB of memory and "
                                "~10 s of imports per rank; a 4-rank 6-step run takes about a minute.")
    p.add_argument("--world-size", type=positive_int, default=4, help="gloo ranks = TP × PP × CP × DP (at most 8)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size")
    p.add_argument("--vp", type=positive_int, default=None, help="layers per virtual pipeline stage (default: none)")
    add_topology_args(p, intra=2, inter=2, old=False)
    p.add_argument("--steps", type=positive_int, default=6, help="training iterations")
    p.add_argument("--micro-batch-size", type=positive_int, default=2, help="samples per micro-batch")
    p.add_argument("--seq-length", type=positive_int, default=256, help="tokens per sample")
    p.add_argument("--num-layers", type=positive_int, default=2, help="transformer layers")
    p.add_argument("--eval-interval", type=positive_int, default=3, help="iterations between validation passes")
    p.add_argument("--eval-iters", type=nonnegative_int, default=2, help="validation iterations per pass")
    p.add_argument("--no-packed", dest="packed", action="store_false",
                   help="every sample one document (no --dataloader-inter-document-masking); needed with "
                   "pipeline stages that read no data (PP > 2, or virtual pipelining)")
    p.add_argument("--sft", action="store_true",
                   help="Megatron's SFT data (--sft): its SFTDataset packs conversations made from the CPU corpus "
                   "(system and user turns loss-masked; under HSAP no conversation padded to 2·CP), built on "
                   "every pipeline stage; megatron_hsap/megatron/cpu/sft.py")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="share the input embedding with the output layer (Megatron's default; --model llama unties "
                   "them otherwise, as Llama-style models do; --model gpt always ties). At PP > 1 the first and "
                   "last stage then all-reduce its gradient over Megatron's embedding group")
    p.add_argument("--no-per-token-loss", dest="per_token_loss", action="store_false",
                   help="leave out --calculate-per-token-loss: Megatron's default normalisation, each micro-batch's "
                   "mean loss (HSAP hands Megatron the micro-batch's loss-token count: megatron_hsap/megatron/loss.py)")
    p.add_argument("--model", choices=sorted(_MODELS), default="llama",
                   help="llama: RMSNorm, SwiGLU, no biases, GQA 4/2, untied embeddings; gpt: the GPT-30B configs' "
                   "layer — LayerNorm, GeLU, biases, MHA 4/4, tied embeddings")
    p.add_argument("--reference", action="store_true",
                   help="CP=1, TP=1 (PP ≤ 2 kept) with Megatron's local attention and the dataloader's document mask")
    p.add_argument("--compare", action="store_true",
                   help="also run --reference (or, for a model its attention cannot compute — MLA, windows — "
                   "the same loop at CP=1 under HSAP) and print the largest per-step relative loss difference (with --mtp-num-layers, each "
                   "depth's logged MTP loss too)")
    p.add_argument("--megatron-lm", metavar="DIR", default=None,
                   help="a Megatron-LM checkout (core_v0.19.0): the ranks run its pretrain_gpt.py (pretrain_hybrid.py "
                   "given --hybrid-layer-pattern) — dataset provider, forward step, loss — through the function "
                   "scripts/pretrain_gpt_hsap.py / pretrain_hybrid_hsap.py run, instead of this "
                   "command's copies; data and tokenizer flags after -- then reach it (default: the CPU corpus "
                   "as --data-path with Megatron's NullTokenizer)")
    add_renamed(p, "--out", "--log-dir", type=output_dir, default=None, metavar="DIR", dest="out",
                help="output folder: every rank's log, the dataset index cache (default: a temporary folder)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    ns = build_parser().parse_args(argv)
    opts = CPURun(world_size=ns.world_size, tp=ns.tp, pp=ns.pp, vp=ns.vp, intra_size=ns.intra_size,
                  inter_size=ns.inter_size, reference=ns.reference, packed=ns.packed, sft=ns.sft, steps=ns.steps,
                  micro_batch_size=ns.micro_batch_size, seq_length=ns.seq_length, num_layers=ns.num_layers,
                  eval_interval=ns.eval_interval, eval_iters=ns.eval_iters, tie_embeddings=ns.tie_embeddings,
                  per_token_loss=ns.per_token_loss,
                  model=ns.model, extra=tuple(extra), megatron_lm=ns.megatron_lm,
                  log_dir=None if ns.out is None else str(ns.out))
    try:  # every refusal before a rank is spawned, the reference's too
        if ns.compare and ns.reference:
            raise ConfigError("--compare compares a run with --reference; with --reference it would compare the "
                              "reference with itself: give one")
        opts.check()
        ref_opts, ref_name = reference_of(opts) if ns.compare else (opts, "")
        ref_opts.check()
    except ConfigError as exc:
        print(f"megatron-hsap pretrain-cpu: error: {exc}", file=sys.stderr)
        return 2
    result = run(opts, echo=True)
    print(f"[pretrain-cpu] exit {result.returncode}; {len(result.losses)} steps logged; logs in {result.log_dir}")
    if result.returncode or not ns.compare:
        return 1 if result.returncode else 0
    ref = run(replace(ref_opts, log_dir=str(Path(result.log_dir) / "reference")))
    if ref.returncode:
        sys.stdout.write(ref.output[-4000:])
        return 1
    print(f"[pretrain-cpu] reference ({ref_name}) losses: {[ref.losses[i] for i in sorted(ref.losses)]}")
    worst, why = compare_losses(result.losses, ref.losses)
    if why:
        print(f"[pretrain-cpu] error: {why}")
        return 1
    print(f"[pretrain-cpu] largest per-step relative loss difference vs the reference: {worst:.2e}")
    for depth, losses in sorted(result.mtp_losses.items()):  # --mtp-num-layers: each depth's logged loss too
        worst, why = compare_losses(losses, ref.mtp_losses.get(depth, {}))
        if why:
            print(f"[pretrain-cpu] error: mtp_{depth} loss: {why}")
            return 1
        print(f"[pretrain-cpu] largest per-step relative mtp_{depth} loss difference vs the reference: {worst:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
