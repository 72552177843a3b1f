"""``megatron-hsap simulate <cmd> --quick`` for every command, the CSV schema, the validation."""

from __future__ import annotations

import csv

import pytest

from megatron_hsap.sim.cli import COMMANDS, main
from megatron_hsap.sim.results import COLUMNS, Row, read_csv, write_csv
from megatron_hsap.sim.validate import RFA_PUBLISHED, ring_flash_attention_check

# docs/design.md §4's result columns, copied by hand.
DESIGN_COLUMNS = ["source", "workload", "T", "P_intra", "P_inter", "link", "heads", "seed", "method", "metric", "value", "unit"]


def test_csv_schema_roundtrip(tmp_path) -> None:
    assert list(COLUMNS) == DESIGN_COLUMNS
    row = Row("sim", "fineweb", 65536, 2, 4, "nvlink", "32/8", 0, "hsap", "time", 1.5, "ms")
    path = write_csv(tmp_path / "x.csv", [row])
    back = read_csv(path)
    assert list(back[0]) == DESIGN_COLUMNS
    assert back[0]["value"] == "1.5" and back[0]["P_inter"] == "4"


@pytest.mark.parametrize("what", COMMANDS)
def test_quick_command_writes_results(what: str, tmp_path, capsys) -> None:
    assert main([what, "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "###" in out  # the markdown table was printed
    md = tmp_path / f"{what}.md"
    assert md.exists() and md.read_text().strip()
    with (tmp_path / f"{what}.csv").open(newline="") as f:
        reader = csv.reader(f)
        assert next(reader) == DESIGN_COLUMNS
        rows = list(reader)
    if what != "gantt":
        assert rows, f"{what} wrote no result rows"
        assert {r[0] for r in rows} >= {"sim"}
    if what in ("table2", "table3", "table4", "magi", "gantt"):
        assert (tmp_path / f"{what}.png").stat().st_size > 1000


def test_ring_flash_attention_validation_within_15_percent() -> None:
    checks = {c.method: c for c in ring_flash_attention_check()}
    assert set(checks) == set(RFA_PUBLISHED)
    for c in checks.values():
        assert c.ok, c


def test_bad_arguments(tmp_path) -> None:
    with pytest.raises(SystemExit):
        main(["nonsense"])
    with pytest.raises(SystemExit) as exc:  # an argparse error (exit 2) before anything runs
        main(["validate", "--seeds", "0", "--out", str(tmp_path)])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:  # an unknown workload too (it ran the command's setup before)
        main(["magi", "--quick", "--workload", "no-such-data", "--out", str(tmp_path)])
    assert exc.value.code == 2
