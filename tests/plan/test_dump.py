"""plan/dump.py: the printed program names every instruction of the IR — one ``post``/``wait``
line per Post/Wait, one ``create`` line per Send/Recv, one ``compute`` line per compute item (same
stage, q, kv and kind, in program order), one merge / accumulate line per Merge / Accumulate —
with consecutive line numbers and rounds numbered within the phase (docs/design.md §2.1 instruction set).

Reference: the Program's instruction tuple, walked here."""

from __future__ import annotations

import re

from tests.configured import compile_plan  # the configured topology (flatten="never")
from megatron_hsap.plan.ir import Accumulate, Compute, Merge, Phase, Post, Recv, Send, Wait

PLAN = compile_plan([0, 50, 130, 131, 250, 256], 4, num_heads=4, num_kv_heads=2, head_dim=16,
                    layout="contiguous", pool_bytes=4096)


def test_dump_names_every_instruction() -> None:
    kinds_seen = set()
    for phase in Phase:
        for rank in range(PLAN.inter_size):
            prog = PLAN.program(rank, phase)
            text = PLAN.dump(rank, phase)
            head, *lines = text.splitlines()
            assert head.startswith(f"# SAP program: inter rank {rank}/4, {phase.value}")
            nums = [int(line.split(":", 1)[0]) for line in lines]
            assert nums == list(range(len(lines)))
            body = [line.split(":", 1)[1].strip() for line in lines]
            count = lambda pat: sum(1 for b in body if re.match(pat, b))
            posts = [i for i in prog.instrs if isinstance(i, Post)]
            ops = [op for p in posts for op in p.round.ops]
            items = [(c.stage, it) for c in prog.instrs if isinstance(c, Compute) for it in c.items]
            merges = [i for i in prog.instrs if isinstance(i, Merge)]
            accs = [i for i in prog.instrs if isinstance(i, Accumulate)]
            assert count(r"post round \d+ \{") == len(posts)
            assert count(r"wait round \d+") == sum(isinstance(i, Wait) for i in prog.instrs) == len(posts)
            assert count(r"create \$send-op") == sum(isinstance(o, Send) for o in ops)
            assert count(r"create \$recv-op") == sum(isinstance(o, Recv) for o in ops)
            assert count(r"copy-o\[.*# merge with lse") == len(merges)
            assert count(r"copy-d(q|kv)\[.*# \+= fp32") == len(accs)
            computes = [b for b in body if b.startswith("compute stage")]
            assert computes == [f"compute stage {s}: q{it.q} kv{it.kv} {'causal' if it.causal else 'full'}"
                                for s, it in items]
            rounds = [int(m.group(1)) for b in body if (m := re.match(r"post round (\d+)", b))]
            assert rounds == [p.round.index - PLAN.round_base[phase] for p in posts]
            assert all(0 <= r < getattr(PLAN.stats(), "rounds_" + phase.value) for r in rounds)
            kinds_seen |= {type(i).__name__ for i in prog.instrs} | {type(o).__name__ for o in ops}
    assert kinds_seen == {"Post", "Wait", "Compute", "Send", "Recv", "Merge", "Accumulate"}  # all exercised
