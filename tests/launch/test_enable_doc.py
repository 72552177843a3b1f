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


def _block(name: str) -> str:
    m = re.search(rf"<!-- {name}:begin -->\n```bash\n(.*?)```\n<!-- {name}:end -->", DOC, re.S)
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
    and HSAP gets the printed topology. Without any one of the required flags, one of them refuses."""
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron_hsap.errors import ConfigError
    from megatron_hsap.megatron.arguments import validate_hsap_args

    text = _block("minimal-flags").replace("\\\n", " ")
    text = re.sub(r"<your usual[^>]*>", "", text)
    words = shlex.split(text.split("\n", 1)[1])  # drop the `cd` line
    script = next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt_hsap.py"))
    torchrun, hsap = words[:script], words[script + 1:]
    assert torchrun[0].endswith("/.venv/bin/torchrun")  # the environment's torchrun, not a bare name
    model = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "16",
             "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
             "--global-batch-size", "16", "--train-iters", "1", "--lr", "1e-4", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--transformer-impl", "local"]
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
    for required in ("--calculate-per-token-loss", "--attention-dropout"):
        i = hsap.index(required)
        without = hsap[:i] + hsap[i + (2 if required == "--attention-dropout" else 1):]
        with pytest.raises(ConfigError, match=required):
            validate(model + without)
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
    hooks = (ROOT / "megatron_hsap" / "megatron" / "pretrain_hooks.py").read_text()
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


def test_the_untested_names_on_the_page_are_preflight_s() -> None:
    from megatron_hsap.launch.preflight import Feature

    bullet = DOC[DOC.index("- **Untested features**"):DOC.index("## 4.")]
    listed = re.findall(r"`([a-z_0-9]+)`", bullet[bullet.index("Not tested, to be listed"):])
    assert [n for n in listed if n in {f.value for f in Feature}] == [f.value for f in Feature]
