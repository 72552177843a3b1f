"""README's "A small program" runs as printed: the call in its text compiles, every line of the
listing (the elided ``...`` aside) is in ``plan.dump(1)`` in the same order, and both ranks compute
the pair count the text gives."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_hsap.plan import compile_plan

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _section() -> str:
    start = README.index("### A small program")
    return README[start:README.index("\n| instruction |", start)]


def test_the_small_program_is_what_compile_plan_prints() -> None:
    text = _section()
    # the call the text names, run here
    assert re.search(r"`compile_plan\(\[0, 4096\], 2,\s*layout=\"contiguous\", flatten=\"never\"\)`", text)
    plan = compile_plan([0, 4096], 2, layout="contiguous", flatten="never")
    listing = text[text.index("```\n") + 4:text.index("\n```", text.index("```\n") + 4)]
    shown = [line for line in listing.splitlines() if line.strip() != "..."]
    dump = plan.dump(1).splitlines()
    at = 0
    for line in shown:
        assert line in dump[at:], f"README line not in plan.dump(1) after line {at}: {line!r}"
        at = dump.index(line, at) + 1
    pairs = int(re.search(r"both compute ([0-9,]+) pairs", text).group(1).replace(",", ""))
    assert tuple(plan.stats().work_per_rank) == (pairs, pairs)
