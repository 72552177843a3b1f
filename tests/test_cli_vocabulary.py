"""One CLI vocabulary across every ``megatron-hsap`` command (issue 19 item 6): the right ``prog``,
every default in ``--help``, ``--intra-size`` / ``--inter-size`` for the topology (old spellings
warn and still work), ``--out DIR`` a folder, argument checks before any rank is spawned, the
link of docs/design.md §4's rule printed, ``plan`` naming the layout it kept.

Parsers are captured where each command builds them (``ArgumentParser.parse_args`` patched to
hand the parser back), so the tests see exactly what the commands parse with.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

import pytest

from megatron_hsap import cli
from megatron_hsap.plan.hardware import link_class_for
from megatron_hsap.plan.workloads import pack_batches
from tests.configured import compile_plan  # the configured topology (flatten="never")

ROOT = Path(__file__).resolve().parents[1]


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(name: str, monkeypatch: pytest.MonkeyPatch, argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser ``megatron-hsap <name>`` builds, taken at its ``parse_args`` call."""

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Captured(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(_Captured) as got:
            cli.main([name, *(argv or [])])
    return got.value.parser


def _parse(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    return _parser_of(name, monkeypatch).parse_args(argv)


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser and its subcommands' parsers (``launch validate|resolve|...``)."""
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _parsers(sub)
    return out


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_command_help_has_its_prog_and_every_default(name: str, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([name, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: megatron-hsap {name}"), text[:120]
    assert "python -m" not in text.splitlines()[0]
    checked = 0
    for parser in _parsers(_parser_of(name, monkeypatch)):
        assert parser.prog.startswith(f"megatron-hsap {name}"), parser.prog
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or action.nargs == 0:
                continue  # positionals, hidden aliases, on/off flags
            assert action.help, f"{parser.prog} {action.option_strings[0]} has no help line"
            shown = formatter._expand_help(action)
            assert "default" in shown.lower(), f"{parser.prog} {action.option_strings[0]}: {shown!r}"
            if action.default not in (None, argparse.SUPPRESS) and "%(default)" not in action.help \
                    and "default" not in action.help.lower():
                assert f"(default: {action.default})" in shown  # the real value, not a paraphrase
            checked += 1
    assert checked >= 1


def test_help_shows_the_values_themselves(capsys: pytest.CaptureFixture[str]) -> None:
    for name, want in (("plan", "(default: 8)"), ("bench", "(default: results)"), ("train-tiny", "(default: 1234)")):
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        assert want in re.sub(r"\s+", " ", capsys.readouterr().out), name


@pytest.mark.parametrize(
    ("name", "argv", "intra", "inter"),
    [
        ("plan", [], 2, 4),
        ("simulate", ["gantt"], 2, 4),
        ("train-tiny", [], 2, 4),
        ("pretrain-cpu", [], 2, 4),
        ("plan-quality", [], None, [4, 16]),
    ],
)
def test_topology_flags_are_the_same_everywhere(name: str, argv: list[str], intra: int | None, inter: object,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["--inter-size", *(map(str, inter) if isinstance(inter, list) else [str(inter)])]
    if intra is not None:
        flags += ["--intra-size", str(intra)]
    ns = _parse(name, argv + flags, monkeypatch)
    assert ns.inter_size == inter
    if intra is not None:
        assert ns.intra_size == intra


@pytest.mark.parametrize(
    ("name", "old", "dest", "value"),
    [
        ("plan", ["--inter", "4"], "inter_size", 4),
        ("plan", ["--intra", "2"], "intra_size", 2),
        ("plan-quality", ["--inter", "4", "16"], "inter_size", [4, 16]),
        ("simulate", ["gantt", "--topology", "2x4"], "topology", "2x4"),
        ("pretrain-cpu", ["--log-dir", "/tmp/hsap-logs"], "out", Path("/tmp/hsap-logs")),
    ],
)
def test_old_spellings_still_work_and_say_so_once(name: str, old: list[str], dest: str, value: object,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    ns = _parse(name, old, monkeypatch)
    assert getattr(ns, dest) == value
    err = capsys.readouterr().err.strip().splitlines()
    flag = next(w for w in old if w.startswith("--"))
    assert len(err) == 1 and f"note: {flag} is deprecated, use --" in err[0], err


def test_old_plan_flags_compile_the_same_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hsap.bench import plan_cli

    base = ["--cu-seqlens", "0,3000,9000,16384", "--heads", "8", "--json", "--no-verify"]
    assert plan_cli.main(base + ["--inter", "4", "--intra", "2"]) == 0
    old = capsys.readouterr()
    assert plan_cli.main(base + ["--inter-size", "4", "--intra-size", "2"]) == 0
    new = capsys.readouterr()
    assert "deprecated" not in new.err and old.err.count("deprecated") == 2
    a, b = json.loads(old.out), json.loads(new.out)
    a.pop("compile_s"), b.pop("compile_s")
    assert a == b and a["stats"]["inter_size"] == 4 and a["stats"]["intra_size"] == 2


def test_simulate_topology_is_refused_where_it_would_be_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hsap.sim.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["table2", "--quick", "--inter-size", "4"])
    assert exc.value.code == 2 and "gantt" in capsys.readouterr().err


def test_bench_out_is_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hsap.bench import cpu_attention

    args = cpu_attention.parse_args(["--out", str(tmp_path / "run")])
    assert cpu_attention.csv_path(args) == tmp_path / "run" / "cpu_attention.csv"
    single = cpu_attention.parse_args(["--csv", str(tmp_path / "one.csv")])
    assert cpu_attention.csv_path(single) == tmp_path / "one.csv"
    for bad, says in ((str(tmp_path / "x.csv"), "use --csv FILE"), (str(single.csv), None)):
        if says is None:
            Path(bad).write_text("a file\n")
            says = "--out takes a folder"
        with pytest.raises(SystemExit) as exc:
            cpu_attention.parse_args(["--out", bad])
        assert exc.value.code == 2 and says in capsys.readouterr().err
    # main writes the CSV inside the folder (no rank run: the world runner measures nothing)
    monkeypatch.setattr(cpu_attention, "_run_world", lambda world, a: ([], None))
    assert cpu_attention.main(["--quick", "--out", str(tmp_path / "run")]) == 1  # nothing measured
    with (tmp_path / "run" / "cpu_attention.csv").open() as f:
        assert next(csv.reader(f)) == list(cpu_attention.CSV_COLUMNS)
    assert "[bench] 4 ranks: plans priced with link nvlink" in capsys.readouterr().out


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Any process start (multiprocessing or subprocess) is recorded and refused."""
    import multiprocessing.process
    import subprocess

    started: list[str] = []

    def refuse(*args: object, **kwargs: object) -> None:
        started.append(repr(args)[:80])
        raise AssertionError("a process was started")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    return started


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--world-size", "8", "--intra-size", "8", "--inter-size", "1"], "--num-attention-heads 4 is not divisible by --intra-size 8"),
        (["--world-size", "8", "--intra-size", "4", "--inter-size", "1", "--num-query-groups", "3",
          "--num-attention-heads", "12", "--hidden-size", "48"], "--num-query-groups 3 and --intra-size 4"),
        (["--world-size", "6", "--intra-size", "2", "--inter-size", "2"], "--world-size 6 must be a positive multiple"),
        (["--hidden-size", "66"], "--hidden-size 66 must be a multiple of --num-attention-heads 4"),
    ],
)
def test_train_tiny_refuses_in_the_parent(argv: list[str], says: str, no_spawn: list[str],
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hsap.megatron import train_tiny

    monkeypatch.setattr(train_tiny, "run_training", lambda run: no_spawn.append("run_training") or [])
    assert train_tiny.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert no_spawn == []


def test_train_tiny_has_no_ring_choice(no_spawn: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hsap.megatron import train_tiny

    with pytest.raises(SystemExit) as exc:
        train_tiny.main(["--context-parallel-impl", "ring"])
    assert exc.value.code == 2 and "megatron-hsap pretrain-cpu --reference" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_tiny.main(["--help"])
    assert "{hsap}" in capsys.readouterr().out and no_spawn == []


def test_pretrain_cpu_refuses_heads_against_intra_in_the_parent(no_spawn: list[str],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hsap.megatron.cpu import command

    assert command.main(["--world-size", "8", "--tp", "2", "--intra-size", "4", "--inter-size", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--intra-size 4 with --tp 2" in err[0] and "valid intra sizes: [1, 2]" in err[0], err
    assert no_spawn == []


@pytest.mark.parametrize(("argv", "size"), [(["--inter-size", "4"], 4), (["--intra-size", "2", "--inter-size", "8"], 16),
                                            (["--tp", "2", "--inter-size", "4"], 8), (["--tp", "4", "--inter-size", "4"], 16)])
def test_plan_prints_the_rule_s_link_and_prices_with_it(argv: list[str], size: int, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hsap.bench import plan_cli

    base = ["--workload", "fineweb", "--tokens", "16384", "--heads", "16", "--no-verify"]
    want = link_class_for(size, 8).value
    assert plan_cli.main(base + argv + ["--max-lines", "1"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("link "))
    assert line.startswith(f"link {want}: the CP group") and f"= {size} GPUs" in line
    assert plan_cli.main(base + argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["link"] == doc["stats"]["link"] == want  # what was priced, not only what was printed


@pytest.mark.parametrize("cu", [[0, 4096, 8192, 12288, 16384], [0, 16384], [0, 1000, 9000, 16384]])
def test_plan_prints_the_layout_it_kept(cu: list[int], capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hsap.bench import plan_cli

    kept = compile_plan(cu, 4, num_heads=32, head_dim=128).layout.name  # the planner's own verdict
    assert plan_cli.main(["--cu-seqlens", ",".join(map(str, cu)), "--inter-size", "4", "--no-verify", "--max-lines", "1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("layout "))
    assert line.startswith(f"layout {kept} (")
    assert ("requested balanced" in line) == (kept == "contiguous")


def test_equal_documents_keep_the_contiguous_layout_and_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hsap.bench import plan_cli

    # one document per rank: the paper's layout is already balanced, so the fallback keeps it
    assert compile_plan([0, 4096, 8192, 12288, 16384], 4).layout.name == "contiguous"
    assert plan_cli.main(["--cu-seqlens", "0,4096,8192,12288,16384", "--inter-size", "4", "--no-verify"]) == 0
    assert "layout contiguous (requested balanced; the contiguous plan was estimated at least as fast" in capsys.readouterr().out


def test_launch_prints_the_same_rule_s_link(capsys: pytest.CaptureFixture[str]) -> None:
    configs = {"gpt30b_64gpu_128k.yaml": "ib", "llama2_7b_8gpu_2x4_16k.yaml": "nvlink"}
    assert cli.main(["launch", "validate", *(str(ROOT / "configs" / c) for c in configs)]) == 0
    lines = [x.strip() for x in capsys.readouterr().out.splitlines() if x.strip().startswith("link ")]
    assert [x.split(":")[0] for x in lines] == [f"link {v}" for v in configs.values()]
    assert "= 64 GPUs spans more than one 8-GPU node" in lines[0] and "= 8 GPUs fits in one 8-GPU node" in lines[1]


def test_docs_use_the_new_spellings() -> None:
    """No README/docs command line uses a deprecated flag, and no page claims every inter group
    runs over InfiniBand (the link follows the CP group's size)."""
    old = re.compile(r"(?<![\w-])--(inter|intra|topology|log-dir)(?![\w-])")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        bad = [m.group(0) for m in old.finditer(text)]
        assert bad == [], f"{path.name}: {bad}"
        assert "every HSAP inter group runs" not in text and "as in every HSAP deployment" not in text, path.name


def test_link_line_states_the_rule_the_measured_link_or_the_forced_one() -> None:
    from megatron_hsap.argtypes import link_line

    assert link_line(intra=2, inter=2).startswith("link nvlink: the CP group TP 1 × P_intra 2 × P_inter 2 = 4 GPUs fits")
    assert link_line(intra=8, inter=2).startswith("link ib:")
    # hostnames beat the count rule, and the line says when the two disagree
    assert link_line(intra=2, inter=2, measured="ib") == (
        "link ib: the CP group's 4 ranks run across hosts (hostnames); the 8-GPUs-per-node rule would have given nvlink")
    assert link_line(intra=2, inter=2, tp=2, measured="nvlink") == "link nvlink: the CP group's 4 ranks run on one host (hostnames)"
    assert link_line(intra=2, inter=2, measured="ib", forced="nvlink").startswith("link nvlink (forced by --link")


def test_plan_forces_or_reports_the_head_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hsap.bench import plan_cli

    base = ["--workload", "fineweb", "--tokens", "16384", "--heads", "16", "--intra-size", "2", "--inter-size", "2",
            "--flatten", "never", "--no-verify", "--json"]
    assert plan_cli.main(base + ["--head-chunks", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["head_chunks"] == 4
    chosen = compile_plan(pack_batches("fineweb", 16384, 1, 0)[0], 2, 2, num_heads=16, head_dim=128).head_chunks
    assert plan_cli.main(base) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["head_chunks"] == chosen  # the planner's own choice
    assert plan_cli.main(base[:-1] + ["--kv-heads", "2", "--head-chunks", "3"]) == 1  # 8 q and 1 kv head per intra rank
    assert "valid head_chunks: [1, 2, 4, 8]" in capsys.readouterr().err


def test_flag_value_reads_both_spellings_and_the_last_occurrence() -> None:
    import argparse

    from megatron_hsap.argtypes import flag_value

    args = ["--window-size", "64,0", "--expert-model-parallel-size=4", "--window-size", "8,0", "--last"]
    assert flag_value(args, "--window-size") == "8,0"  # argparse keeps the last, so Megatron does
    assert flag_value(args, "--expert-model-parallel-size") == "4"
    assert flag_value(["--ep=2", "--ep", "4", "--ep=8"], "--ep") == "8"  # mixed spellings: still the last
    # the independent reference: the parser Megatron builds (argparse, allow_abbrev=False)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--window-size")
    parser.add_argument("--expert-model-parallel-size")
    parser.add_argument("--last", action="store_true")
    ns = parser.parse_args(args)
    assert (ns.window_size, ns.expert_model_parallel_size) == (flag_value(args, "--window-size"),
                                                               flag_value(args, "--expert-model-parallel-size"))
    assert flag_value(args, "--expert-model") is None  # a prefix is not the flag
    assert flag_value(args, "--last") is None and flag_value((), "--x") is None  # no value after it


def test_flag_occurrences_read_many_valued_flags_as_argparse_does() -> None:
    import argparse

    from megatron_hsap.argtypes import flag_occurrences

    args = ["--sizes", "2", "4", "--bf16", "--sizes=8", "--modules", "mlp", "attn"]
    assert flag_occurrences(args, "--sizes") == [["2", "4"], ["8"]]  # each occurrence, in order
    assert flag_occurrences(args, "--modules") == [["mlp", "attn"]]  # (up to the next flag, or the end)
    assert flag_occurrences(args, "--absent") == []
    # the independent reference: argparse keeps the last occurrence of an nargs="+" flag
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--sizes", nargs="+")
    parser.add_argument("--modules", nargs="+")
    parser.add_argument("--bf16", action="store_true")
    ns = parser.parse_args(args)
    assert (ns.sizes, ns.modules) == (flag_occurrences(args, "--sizes")[-1], flag_occurrences(args, "--modules")[-1])
