"""docs/enable.md against the code: every flag it names exists (Megatron's parser, HSAP's, torchrun's,
the launcher's), its minimal flag set passes Megatron's ``validate_args`` and HSAP's
``validate_hsap_args`` as printed, and its loss-comparison snippet computes the right figure."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "enable.md").read_text()
README = (ROOT / "README.md").read_text()

# Flags of other tools the page shows in their commands: git clone, srun, and the sbatch scripts'
# own --dry-run (scripts/slurm/common.sh, checked below).
OTHER_TOOLS = {"--branch", "--ntasks-per-node", "--dry-run"}


# a small model the minimal flag set is validated with
MODEL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "16", "--seq-length", "4096",
         "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--global-batch-size", "16",
         "--transformer-impl", "local"]


def _minimal_flags() -> tuple[list[str], list[str]]:
    """The minimal-flags block as words: ``(torchrun and its flags, the flags after the script)``."""
    text = re.sub(r"<your usual[^>]*>", "", _block("minimal-flags").replace("\\\n", " "))
    words = shlex.split(text.split("\n", 1)[1])  # drop the `cd` line
    script = next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt_hsap.py"))
    return words[:script], words[script + 1:]


def _block(name: str, lang: str = "bash") -> str:
    m = re.search(rf"<!-- {name}:begin -->\n```{lang}\n(.*?)```\n<!-- {name}:end -->", DOC, re.S)
    assert m, f"docs/enable.md lost its {name} block"
    return m.group(1)


@pytest.fixture(scope="module")
def megatron_parser() -> argparse.ArgumentParser:
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron_hsap.megatron.arguments import add_hsap_args

    return add_hsap_args(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def _options(parser: argparse.ArgumentParser) -> set[str]:
    out = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _options(sub)
    return out


def test_every_flag_on_the_page_exists(megatron_parser: argparse.ArgumentParser) -> None:
    from torch.distributed.run import get_args_parser

    from megatron_hsap.bench.memory_report import main as _memory_main  # noqa: F401 - imports its parser
    from megatron_hsap.launch.__main__ import _parser as launch_parser

    from megatron_hsap.megatron.cpu.command import build_parser as pretrain_cpu_parser

    known = (_options(megatron_parser) | _options(get_args_parser()) | _options(launch_parser())
             | _options(pretrain_cpu_parser()) | OTHER_TOOLS)
    known |= {"--config", "--gpu-mem-gib"}  # megatron-hsap memory (checked below)
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w*-])", DOC))
    assert len(flags) > 40  # the page is about flags: this guards the regex itself
    assert sorted(flags - known) == []
    memory = subprocess.run([sys.executable, "-m", "megatron_hsap", "memory", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert "--config" in memory.stdout and "--gpu-mem-gib" in memory.stdout
    assert "--dry-run)" in (ROOT / "scripts" / "slurm" / "common.sh").read_text()


def test_minimal_flag_set_is_accepted_as_printed(megatron_parser: argparse.ArgumentParser,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The block's HSAP flags plus a small model: Megatron's own validation and HSAP's accept them,
    and HSAP gets the printed topology; the optional flags (per-token loss, attention dropout) may go."""
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron_hsap.megatron.arguments import validate_hsap_args

    torchrun, hsap = _minimal_flags()
    assert torchrun[0].endswith("/.venv/bin/torchrun")  # the environment's torchrun, not a bare name
    model = MODEL + ["--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
                     "--vocab-size", "1000"]
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 8)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's rule for CP > 1

    def validate(argv: list[str]):
        args = megatron_parser.parse_args(argv)
        args.rank, args.world_size = 0, 16
        arguments.validate_args(args, {})
        return args, validate_hsap_args(args)

    args, got = validate(model + hsap)
    assert (got.intra_size, got.inter_size) == (8, 2) and args.context_parallel_size == 16
    assert args.dataloader_inter_document_masking and args.reset_position_ids and args.eod_mask_loss
    assert not args.create_attention_mask_in_dataloader
    # not in the block: Megatron's default attention dropout (0.1) runs under HSAP (runtime/dropout.py)
    assert "--attention-dropout" not in hsap and args.attention_dropout == 0.1
    # optional, as the table says: Megatron's default normalisation is handled (megatron/loss.py)
    i = hsap.index("--calculate-per-token-loss")
    args, got = validate(model + hsap[:i] + hsap[i + 1:])
    assert not args.calculate_per_token_loss and (got.intra_size, got.inter_size) == (8, 2)
    # The parity reference: plain Megatron at CP 1 with a dense per-document causal mask.
    reference = shlex.split(_block("parity-reference").replace("\\\n", " "))
    args, got = validate(model + reference)
    assert got is None and args.context_parallel_size == 1 and args.context_parallel_impl == "ring"
    assert args.reset_attention_mask and args.create_attention_mask_in_dataloader and args.reset_position_ids


def test_loss_comparison_snippet(tmp_path: Path) -> None:
    def log(losses: dict[int, float]) -> str:  # Megatron's training_log format
        return "".join(f" [2026-12-01 10:00:00] iteration {i:8d}/{50:8d} | consumed samples: {i:12d} | "
                       f"lm loss: {v:.6E} | loss scale: 1.0 | grad norm: 1.234 |\n" for i, v in losses.items())

    (tmp_path / "hsap.log").write_text("arguments ...\n" + log({1: 10.5, 2: 10.25, 3: 9.9}))
    (tmp_path / "ring_cp1.log").write_text(log({1: 10.5, 2: 10.0, 3: 9.9, 4: 9.8}))
    out = subprocess.run(["bash", "-c", _block("loss-compare")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"3 iterations, largest relative loss difference {0.25 / 10.0:.2e}"


def test_readme_links_the_page_first_and_names_hsap_torchrun() -> None:
    first_link = re.search(r"\]\(([^)]+)\)", README)
    assert first_link and first_link.group(1) == "docs/enable.md"
    install = README[README.index("**1. Install**"):README.index("**2. Pick a config**")]
    assert "HSAP_TORCHRUN" in install


def test_start_up_lines_quoted_on_the_page_are_the_code_s() -> None:
    hooks = (ROOT / "megatron_hsap" / "megatron" / "banner.py").read_text()
    args = (ROOT / "megatron_hsap" / "megatron" / "arguments.py").read_text()
    assert "[megatron-hsap] HSAP context parallelism on: topology 8x2 (intra×inter), layout balanced," in DOC
    assert '"[megatron-hsap] HSAP context parallelism on: topology {hsap.intra_size}x{hsap.inter_size} "' in hooks
    assert '"(intra×inter), layout {hsap.layout}, planner priced for {hw.name} ({hw.source}), "' in hooks
    assert "[megatron-hsap] --hierarchical-context-parallel-sizes not given: using P_intra=8 P_inter=2" in DOC
    assert '[megatron-hsap] --hierarchical-context-parallel-sizes not given: using P_intra={intra} ' in args


def test_path_2_text_matches_the_patch() -> None:
    """Whether the patch gives Megatron's parser the --hsap-* flags decides what section 2 says."""
    patch = (ROOT / "patches" / "megatron-lm-core_v0.19.0-context-parallel-impl.patch").read_text()
    path2 = DOC[DOC.index("### Path 2"):DOC.index("### What the SLURM launcher adds")]
    adds_hsap_flags = "add_hsap_args" in patch
    assert ("do not exist on this path" not in path2) == adds_hsap_flags, (
        "docs/enable.md section 2, Path 2: say whether the patch adds HSAP's --hsap-* flags "
        f"(it {'does' if adds_hsap_flags else 'does not'}), and the table title 'Path 1 only'")
    assert ("Path 1 only" not in DOC) == adds_hsap_flags
    for script in ("pretrain_gpt.py", "pretrain_hybrid.py"):  # the scripts the page says it patches
        assert f"+++ b/{script}" in patch and f"`{script}`" in path2, script
        hunk = patch[patch.index(f"+++ b/{script}"):]
        assert "hsap_entry_points(" in hunk.split("\ndiff --git")[0], script


def test_the_untested_names_on_the_page_are_preflight_s() -> None:
    from megatron_hsap.launch.preflight import Feature

    bullet = DOC[DOC.index("- **Untested features**"):DOC.index("## 4.")]
    listed = re.findall(r"`([a-z_0-9]+)`", bullet[bullet.index("Not tested, to be listed"):])
    assert [n for n in listed if n in {f.value for f in Feature}] == [f.value for f in Feature]


def test_the_metrics_line_on_the_page_has_the_code_s_fields() -> None:
    """Section 5's example line, numbers and names aside, is what ``IterationMetrics.line`` prints."""
    from megatron_hsap.megatron.metrics import HSAPMetrics
    from megatron_hsap.plan import compile_plan

    shown = _block("metrics-line", "text").strip()
    lines: list[str] = []
    metrics = HSAPMetrics(log_interval=1, writers=lambda: (None, None), is_logging_rank=True, echo=lines.append)
    metrics.add(3, compile_plan([0, 300, 700, 1024], 2, intra_size=2, num_heads=4, num_kv_heads=2, head_dim=16),
                compile_s=0.04, prefetched=True, compiled_in="worker process")
    metrics.flush()

    def shape(line: str) -> str:
        line = re.sub(r"layout ([a-z]+ \d+(, )?)+", "layout L", line)
        return re.sub(r"\d+(\.\d+)?(e[+-]\d+)? ?(GiB|MiB|KiB|B|ms|us|ns|s)?\b", "N", line)

    assert [shape(x) for x in lines] == [shape(shown)]


def test_the_start_up_lines_quoted_in_section_5_are_the_code_s() -> None:
    hooks = (ROOT / "megatron_hsap" / "megatron" / "banner.py").read_text()
    section = DOC[DOC.index("## 5."):DOC.index("## 6.")]
    assert "`[megatron-hsap] attention kernels: flash_attn on cuda:0; receive pool: " in section
    assert 'print(f"[megatron-hsap] attention kernels: {_kernel_backend()}; receive pool: "' in hooks
    assert "(default: 4 inter chunks of q/k/v rows at 32768 tokens per micro-batch; --hsap-pool-bytes to set)" in section
    assert '(default: 4 inter chunks of q/k/v "\n            f"rows at {tokens} tokens per micro-batch; --hsap-pool-bytes to set)"' in hooks
    warning = ("[megatron-hsap] WARNING: no --dataloader-inter-document-masking (or --sft): batches carry no document "
               "boundaries, so HSAP treats every sample as ONE document")
    assert warning in section
    assert warning.replace("carry no document ", 'carry no "\n              "document ') in hooks
    note = ("[megatron-hsap] note: --moe-expert-capacity-factor drops tokens per rank, among the rank's own "
            "tokens: HSAP's layout gives each CP rank other tokens than CP=1")
    assert note in section and note.replace("own tokens", 'own "\n              "tokens') in hooks
    note = ("[megatron-hsap] note: --hidden-dropout draws its masks over each rank's own tokens (Megatron's "
            "dropout on the rank's shard): HSAP's layout")
    assert note in section and note.replace("(Megatron's ", '(Megatron\'s "\n              "') in hooks
    from megatron_hsap.megatron.arguments import add_hsap_args

    hsap_flags = sorted(_options(add_hsap_args(argparse.ArgumentParser())) - {"-h", "--help"})
    table = DOC[DOC.index("HSAP's own flags"):DOC.index("<!-- refused:begin -->")]
    # every flag of HSAP's parser is in the page's table (or is one of Megatron's own, given by the patch)
    missing = [f for f in hsap_flags if f.startswith("--hsap") and not re.search(rf"`{re.escape(f)}[` ]", table)]
    assert missing == []


# docs/enable.md's "Refused" paragraph, case by case: flags added to the minimal set, and the text
# of the flag the error must name. A model config field without a flag is set on args directly.
REFUSED = {
    "look-ahead window": (["--window-size", "(128,16)"], "--window-size"),
    "--hybrid-context-parallel": ([], "--hybrid-context-parallel"),
    "--softmax-type": ([], "--softmax-type"),
    "--position-embedding-type": (["--position-embedding-type", "mrope"], "--position-embedding-type"),
    "MLA without --no-rope-fusion": (["--multi-latent-attention", "--rope-type", "rope"], "--no-rope-fusion"),
    "--mla-down-proj-fusion": (["--multi-latent-attention", "--no-rope-fusion", "--mla-down-proj-fusion"], "--mla-down-proj-fusion"),
    "--micro-batch-size": (["--pipeline-model-parallel-size", "2", "--num-layers", "4"], "--micro-batch-size"),
    "--attention-backend local": (["--attention-backend", "local"], "--attention-backend local"),
    "--hybrid-layer-pattern": ([], "--hybrid-layer-pattern"),
    "--spec": (["--spec", "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"], "--spec"),
    "fp8_dot_product_attention": ([], "fp8_dot_product_attention"),
    "fused_single_qkv_rope": ([], "fused_single_qkv_rope"),
    "--cp-comm-type": (["--cp-comm-type", "a2a"], "--cp-comm-type a2a"),
    "--context-parallel-size": (["--hierarchical-context-parallel-sizes", "4", "2"], "--context-parallel-size 16"),
    "--hsap-layout": (["--hsap-layout", "contiguous"], "--hsap-layout contiguous: HSAP's flags, but --context-parallel-impl is ring"),
    "--reset-attention-mask": (["--reset-attention-mask"], "--reset-attention-mask asks for per-document attention"),
}
# (minimal flags the page gives that a case takes away)
_DROPPED = {"--reset-attention-mask": ("--dataloader-inter-document-masking",)}
# set after parsing (flags Megatron's parser or validation would reject first, or config fields)
_SET_AFTER = {"--hybrid-context-parallel": ("hybrid_context_parallel", True), "--softmax-type": ("softmax_type", "gelu"),
              "--hybrid-layer-pattern": ("hybrid_layer_pattern", "*D*-"),
              "--micro-batch-size": ("micro_batch_size", 2),
              "fp8_dot_product_attention": ("fp8_dot_product_attention", True),
              "fused_single_qkv_rope": ("fused_single_qkv_rope", True),
              "--hsap-layout": ("context_parallel_impl", "ring")}
SUPPORTED = {
    "causal window": ["--window-size", "(128,0)"],
    "windows on every other layer": ["--window-size", "(128,0)", "--window-attn-skip-freq", "2"],
    "off-by-one sinks": ["--softmax-type", "off-by-one"],
    "learnable sinks": ["--softmax-type", "learnable"],
    "MLA with YaRN": ["--multi-latent-attention", "--no-rope-fusion", "--rope-type", "yarn"],
    "MLA with RoPE": ["--multi-latent-attention", "--no-rope-fusion", "--rope-type", "rope"],
    "multi-token prediction": ["--mtp-num-layers", "2"],
    "multi-token prediction in a HybridModel": ["--mtp-num-layers", "1", "--hybrid-layer-pattern", "*-*-/*-"],
    "Mamba layers": ["--hybrid-layer-pattern", "M*M-", "--mamba-head-dim", "32"],  # 16 heads over CP 16
    "gated delta net layers": ["--hybrid-layer-pattern", "G*G-", "--swiglu"],  # 16 key / 32 value heads over CP 16
    "qk-clip": ["--qk-clip"],
    "max attention logit logging": ["--log-max-attention-logit"],
}


def _hsap_args(megatron_parser: argparse.ArgumentParser, extra: list[str], set_after: tuple | None = None):
    from megatron_hsap.megatron.arguments import validate_hsap_args

    drop = next((d for flag, d in _DROPPED.items() if flag in extra), ())
    args = megatron_parser.parse_args(MODEL + [f for f in _minimal_flags()[1] if f not in drop] + extra)
    if set_after:
        setattr(args, *set_after)
    return validate_hsap_args(args)  # HSAP's own checks (Megatron's validate_args may refuse some first)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_each_refusal_on_the_page_is_refused(megatron_parser: argparse.ArgumentParser, case: str) -> None:
    from megatron_hsap.errors import ConfigError

    extra, named = REFUSED[case]
    with pytest.raises(ConfigError, match=re.escape(named)):
        _hsap_args(megatron_parser, extra, _SET_AFTER.get(case))


def test_the_refused_paragraph_names_every_case() -> None:
    para = DOC[DOC.index("<!-- refused:begin -->"):DOC.index("<!-- refused:end -->")]
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*|[a-z_0-9]+_[a-z_0-9]+)`", para))
    tested = {named_ for _, named_ in REFUSED.values()} | {k for k in REFUSED if k.startswith("--")}
    tested = {t.split()[0] for t in tested}
    # the page's other names there qualify a case (`--multi-latent-attention` without ..., PP with ...) or are accepted values
    qualifiers = {"--pipeline-model-parallel-size", "--no-rope-fusion", "--multi-latent-attention", "learned_absolute",
                  "--dataloader-inter-document-masking", "cu_seqlens"}
    assert sorted(named - tested - qualifiers) == []


@pytest.mark.parametrize("case", sorted(SUPPORTED))
def test_what_the_page_calls_supported_is_accepted(megatron_parser: argparse.ArgumentParser, case: str) -> None:
    got = _hsap_args(megatron_parser, SUPPORTED[case])
    assert (got.intra_size, got.inter_size) == (8, 2)
