"""``pretrain-cpu --megatron-lm DIR``: the ranks run a Megatron-LM checkout's ``pretrain_gpt.py`` —
``pretrain_hybrid.py`` given a hybrid layer pattern — through ``megatron_lm.run_megatron_lm``, the
function ``scripts/pretrain_gpt_hsap.py`` / ``scripts/pretrain_hybrid_hsap.py`` run.

CI has no Megatron-LM checkout (the megatron-core wheel and sdist ship ``megatron/training`` but not
``pretrain_gpt.py``), so the end-to-end test runs a stand-in checkout written here, whose
``pretrain_gpt.py`` (and ``pretrain_hybrid.py``) hands over this project's CPU provider, forward step and loss: it checks the
plumbing (the checkout's module is the one the ranks import and run, under HSAP and as the
``--compare`` reference), not Megatron-LM's code. Against the real checkout (tag core_v0.19.0) the
same command was run by hand: docs/enable.md §4 records the figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_hsap.errors import ConfigError
from megatron_hsap.megatron.cpu.command import CPURun, corpus_data_flags, main, megatron_flags, reference_of
from megatron_hsap.megatron.megatron_lm import GPT, HYBRID, SCRIPTS, check_entry, entry_for
from tests.megatron.test_pretrain_cpu import BASE, _run, _same_losses, root  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = '''"""A stand-in for Megatron-LM's pretrain_gpt.py (tests/megatron/test_megatron_lm.py)."""
import os
from megatron_hsap.megatron.cpu.loop import cpu_datasets_provider as train_valid_test_datasets_provider
from megatron_hsap.megatron.cpu.loop import cpu_loss_func as loss_func
from megatron_hsap.megatron.cpu.loop import reference_forward_step as forward_step

print(f"[stand-in pretrain_gpt] imported from {os.path.dirname(os.path.abspath(__file__))}", flush=True)
'''


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("Megatron-LM")
    (path / "pretrain_gpt.py").write_text(STAND_IN)
    (path / "pretrain_hybrid.py").write_text(STAND_IN.replace("pretrain_gpt", "pretrain_hybrid"))
    return path


def _flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def replace_extra(run: CPURun, *extra: str) -> CPURun:
    return replace(run, extra=tuple(extra))


def test_checkout_runs_megatrons_nulltokenizer_over_the_cpu_corpus(checkout: Path) -> None:
    run = CPURun(megatron_lm=str(checkout))
    run.check()
    flags = megatron_flags(run)
    # NullTokenizer's EOD is its last id: 257 ids make it the corpus's EOD (256)
    assert (_flag(flags, "--tokenizer-type"), _flag(flags, "--vocab-size")) == ("NullTokenizer", "257")
    data = corpus_data_flags(run)
    assert data[0] == "--data-path" and Path(data[1] + ".bin").is_file() and Path(data[1] + ".idx").is_file()
    # mock documents count up from 1 to under 4,096: EOD (the last id) never inside one
    mock = replace_extra(run, "--mock-data")
    assert _flag(megatron_flags(mock), "--vocab-size") == "4097" and corpus_data_flags(mock) == []
    # the run's own data and tokenizer reach the checkout's provider: nothing of ours added
    own = replace_extra(run, "--data-path", "/d/x_text_document", "--tokenizer-type=HuggingFaceTokenizer")
    own.check()
    assert corpus_data_flags(own) == [] and "NullTokenizer" not in megatron_flags(own)[:-4]
    # flags that shape the data but name none (FIM over it, per-dataset sequence counts): still the corpus
    for shaping in ("--fim-data", "--per-dataset-sequences-path=/d/seq.json"):
        assert corpus_data_flags(replace_extra(run, shaping))[0] == "--data-path", shaping
    # without a checkout: the byte tokenizer's 258 ids, and no data flag (the CPU provider reads its corpus)
    plain = CPURun()
    assert _flag(megatron_flags(plain), "--vocab-size") == "258" and corpus_data_flags(plain) == []


def test_reference_pads_the_vocabulary_as_the_tp_run_does() -> None:
    """Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by × TP: 257 ids are
    258 rows at TP 2 and 257 at TP 1, so a TP=1 reference initialised other embeddings (found with
    the real pretrain_gpt.py at TP 2: 0.15 apart; equal once the reference pads as the run does)."""
    run = CPURun(world_size=8, tp=2, intra_size=2, inter_size=2, megatron_lm="/x")
    ref, _ = reference_of(run)
    assert (ref.tp, ref.vocab_multiple) == (1, 2)
    assert _flag(megatron_flags(ref), "--make-vocab-size-divisible-by") == "2"
    assert _flag(megatron_flags(run), "--make-vocab-size-divisible-by") == "1"


@pytest.mark.parametrize(("change", "match"), [
    (dict(megatron_lm="/nonexistent/Megatron-LM"), r"no pretrain_gpt.py in /nonexistent/Megatron-LM: give a Megatron-LM checkout"),
    (dict(sft=True), r"--sft with --megatron-lm: Megatron-LM's SFT path builds its tokenizer"),
    (dict(extra=("--sft",)), r"--sft with --megatron-lm"),
])
def test_bad_checkouts_are_refused_before_spawning(checkout: Path, change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CPURun(**{"megatron_lm": str(checkout), **change}).check()


@pytest.mark.parametrize(("argv", "entry"), [
    ((), GPT),
    (("--num-layers", "2", "--hybrid-layer-pattern", "M*M-"), HYBRID),
    (("--hybrid-layer-pattern=G*G-",), HYBRID),
    (("--hybrid-override-pattern", "M*"), HYBRID),  # (deprecated: validate_args turns it into the first)
    (("--mtp-num-layers", "1", "--mtp-hybrid-override-pattern", "*-"), HYBRID),
    (("--spec", "x", "--hybrid-layer-patterns", "M"), GPT),  # (not a flag of Megatron's: argparse's business)
])
def test_the_entry_script_follows_the_hybrid_layer_pattern(argv: tuple[str, ...], entry: str) -> None:
    assert entry_for(argv) == entry
    check_entry(entry, argv)  # (its own flags: accepted)
    other = GPT if entry == HYBRID else HYBRID
    with pytest.raises(ConfigError, match=(r"Megatron-LM trains hybrid models with pretrain_hybrid.py .* run "
                                           r"scripts/pretrain_hybrid_hsap.py" if other == GPT else
                                           r"pretrain_hybrid.py builds a HybridModel from --hybrid-layer-pattern, "
                                           r"and none was given")):
        check_entry(other, argv)


def test_a_hybrid_pattern_needs_the_checkouts_pretrain_hybrid(tmp_path: Path) -> None:
    (tmp_path / "pretrain_gpt.py").write_text(STAND_IN)
    CPURun(megatron_lm=str(tmp_path)).check()
    with pytest.raises(ConfigError, match=rf"no pretrain_hybrid.py in {tmp_path}: give a Megatron-LM checkout"):
        CPURun(megatron_lm=str(tmp_path), extra=("--hybrid-layer-pattern", "*-*-")).check()


@pytest.mark.parametrize(("script", "argv", "message"), [
    ("pretrain_hybrid_hsap.py", (), "pretrain_hybrid_hsap.py: no pretrain_hybrid.py in {path}"),
    ("pretrain_gpt_hsap.py", ("--hybrid-layer-pattern", "M*"),
     "pretrain_gpt_hsap.py: --hybrid-layer-pattern: Megatron-LM trains hybrid models with pretrain_hybrid.py"),
    ("pretrain_hybrid_hsap.py", ("--num-layers", "2"), "pretrain_hybrid_hsap.py: pretrain_hybrid.py builds a "
     "HybridModel from --hybrid-layer-pattern, and none was given"),
])
def test_the_cluster_scripts_refuse_the_other_scripts_flags(tmp_path: Path, script: str, argv: tuple[str, ...],
                                                           message: str) -> None:
    """Before anything runs: one line naming the script and what to change (the checkout here has
    ``pretrain_gpt.py`` and, but for the first case, ``pretrain_hybrid.py``)."""
    (tmp_path / "pretrain_gpt.py").write_text(STAND_IN)
    if argv:
        (tmp_path / "pretrain_hybrid.py").write_text(STAND_IN)
    env = {**os.environ, "MEGATRON_LM": str(tmp_path)}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *argv], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and message.format(path=tmp_path) in out.stderr, out.stderr
    assert "stand-in" not in out.stdout  # (nothing of the checkout imported)


def test_command_refuses_a_folder_without_pretrain_gpt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--megatron-lm", str(tmp_path), "--compare"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-hsap pretrain-cpu: error: no pretrain_gpt.py in ") and "[pretrain-cpu] exit" not in err


def test_the_cluster_script_names_a_missing_checkout(tmp_path: Path) -> None:
    env = {**os.environ, "MEGATRON_LM": str(tmp_path)}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain_gpt_hsap.py")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and f"pretrain_gpt_hsap.py: no pretrain_gpt.py in {tmp_path}" in out.stderr, out.stderr


@pytest.mark.slow
def test_ranks_run_the_checkouts_pretrain_gpt_under_hsap_and_as_the_reference(root: Path, checkout: Path) -> None:  # noqa: F811
    """The stand-in hands over the CPU loop's own functions, so the run must equal ``pretrain-cpu``
    without a checkout step for step, and its reference (TP=1 local attention, the checkout's forward
    step) must equal the CPU reference; every rank imports the checkout's module."""
    tokenizer = ("--tokenizer-type", "NullTokenizer", "--vocab-size", "258")  # (the CPU provider's byte tokenizer)
    kw = dict(world_size=4, intra_size=2, inter_size=2, **BASE)
    got = _run(root, megatron_lm=str(checkout), extra=tokenizer, **kw)
    want = _run(root, **kw)
    assert got.losses == want.losses and got.validation == want.validation
    for rank in range(4):
        log = (Path(got.log_dir) / f"rank{rank}.log").read_text()
        assert f"[stand-in pretrain_gpt] imported from {checkout}" in log, rank
    assert "[stand-in pretrain_gpt]" not in (Path(want.log_dir) / "rank0.log").read_text()
    ref_opts, name = reference_of(CPURun(megatron_lm=str(checkout), extra=tokenizer, **kw))
    assert name == "CP=1, local attention" and ref_opts.megatron_lm == str(checkout)
    ref = _run(root, **{k: getattr(ref_opts, k) for k in ("world_size", "reference", "megatron_lm", "extra", "steps",
                                                            "eval_interval", "eval_iters", "micro_batch_size",
                                                            "global_batch_size", "tp")})
    _same_losses(got.losses, ref.losses)
    assert "[stand-in pretrain_gpt]" in (Path(ref.log_dir) / "rank0.log").read_text()


@pytest.mark.slow
def test_ranks_run_the_checkouts_pretrain_hybrid_for_a_hybrid_pattern(root: Path, checkout: Path) -> None:  # noqa: F811
    """Given ``--hybrid-layer-pattern`` every rank imports the checkout's ``pretrain_hybrid.py`` (not
    its ``pretrain_gpt.py``), and the run equals ``pretrain-cpu``'s own hybrid run step for step."""
    extra = ("--tokenizer-type", "NullTokenizer", "--vocab-size", "258", "--hybrid-layer-pattern", "*-*-")
    kw = dict(world_size=4, intra_size=2, inter_size=2, **BASE)
    got = _run(root, megatron_lm=str(checkout), extra=extra, **kw)
    want = _run(root, extra=extra[4:], **kw)
    assert got.losses == want.losses and got.validation == want.validation
    for rank in range(4):
        log = (Path(got.log_dir) / f"rank{rank}.log").read_text()
        assert f"[stand-in pretrain_hybrid] imported from {checkout}" in log, rank
        assert "[stand-in pretrain_gpt]" not in log, rank


def test_attention_errors_for_unsharded_batches_name_both_wrapper_scripts() -> None:
    # attention runs in GPT and hybrid models alike: the error points to the wrapper of each
    from megatron_hsap.megatron import core_attention, mla, rotary

    for module in (core_attention, mla, rotary):
        assert all(script in module._NOT_SHARDED for script in SCRIPTS.values()), module.__name__
