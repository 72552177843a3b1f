"""Result rows in the CSV schema of docs/design.md §4, markdown tables, and writing them to disk."""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["COLUMNS", "Row", "write_csv", "read_csv", "markdown_table", "size_label", "Report", "flattened_cell"]

COLUMNS = ("source", "workload", "T", "P_intra", "P_inter", "link", "heads", "seed", "method", "metric", "value", "unit")


@dataclass(frozen=True, slots=True)
class Row:
    """One metric of one run. ``source``: ``sim`` (this simulator) or ``paper:<where>`` for
    published figures carried along for comparison; ``heads``: ``"H/Hkv"``."""

    source: str
    workload: str
    T: int
    P_intra: int
    P_inter: int
    link: str
    heads: str
    seed: int | str
    method: str
    metric: str
    value: float | str
    unit: str


def write_csv(path: str | Path, rows: Iterable[Row]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    return path


def read_csv(path: str | Path) -> list[dict[str, str]]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def size_label(T: int) -> str:
    """A batch size in tokens as the tables print it: ``1M`` when a whole number of Mi-tokens, else ``64K``."""
    return f"{T >> 20}M" if T % (1 << 20) == 0 else f"{T >> 10}K"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    def fmt(x: object) -> str:
        if isinstance(x, float):
            return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.2f}" if abs(x) >= 1 else f"{x:.3f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


@dataclass(slots=True)
class Report:
    """What one reproduction produced: its rows, its markdown and the files written."""

    name: str
    rows: list[Row]
    markdown: str
    files: list[Path]

    def write(self, out_dir: str | Path) -> "Report":
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.files.insert(0, write_csv(out / f"{self.name}.csv", self.rows))
        md = out / f"{self.name}.md"
        md.write_text(self.markdown + "\n")
        self.files.insert(1, md)
        return self


def flattened_cell(ran_as: list[str], n_seeds: int) -> str:
    """The "HSAP flattened" cell: how many of the point's batches ran flattened, and as which
    one-level topology (plan/flatten.py), e.g. ``"10/10: 3 as 1x8, 7 as 8x1"``."""
    if not ran_as:
        return f"0/{n_seeds}"
    return f"{len(ran_as)}/{n_seeds}: " + ", ".join(f"{ran_as.count(t)} as {t}" for t in sorted(set(ran_as)))
