"""A rank's program in the paper's instruction syntax (Table 1), one numbered line per instruction.

Mapping from the IR (``megatron_hsap.plan.ir``) to Table 1, with token ranges and pool slots added
(the paper's buffers are ``$local`` — the rank's own tensors and accumulators —, ``$comm[off:+n]``
— a slot of the receive pool — and ``$comp`` — the kernel's operands):

* ``Post(round)``  → ``post round r {`` … ``}``: one ``batch_isend_irecv`` holding the lines
  ``create $send-op $X[a:b) %dst`` and ``create $recv-op $X[a:b) %src -> $pool[off:+n]``;
* ``Compute``      → per item ``copy-q``/``copy-kv`` (``$local`` or ``$comm`` → ``$comp``), then
  ``compute q[a:b) kv[c:d) causal|full``, then ``copy-o`` (``$comp`` → ``$local`` merges into the
  accumulators; ``$comp`` → ``$comm`` parks a partial result for its owner);
* ``Wait(r)``      → ``wait round r``;
* ``Merge``        → ``copy-o $comm $local`` (the LSE merge of a received partial output);
* ``Accumulate``   → ``copy-dq|dkv $comm $local`` (adds a received partial gradient into the fp32 accumulators).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_hsap.plan.ir import PHASE_WIRES, Accumulate, Compute, Merge, Phase, Post, Send, Slot, Wait, Wire

if TYPE_CHECKING:
    from megatron_hsap.plan.plan_type import Plan

__all__ = ["dump_program", "format_program"]


def _buf(slot: Slot | None) -> str:
    return "$local" if slot is None else _slot(slot)


def _slot(slot: Slot) -> str:
    return f"$comm[{slot.offset}:+{slot.nbytes}]"


def format_program(program, *, round_base: int = 0, limit: int | None = None) -> str:
    """Render one ``Program`` (see the module docstring); ``limit`` truncates long listings."""
    lines: list[str] = []
    n = 0

    def emit(text: str, indent: int = 0) -> None:
        nonlocal n
        lines.append(f"{n:4d}: {'    ' * indent}{text}")
        n += 1

    phase = program.phase
    for ins in program.instrs:
        if isinstance(ins, Post):
            emit(f"post round {ins.round.index - round_base} {{")
            for op in ins.round.ops:
                if isinstance(op, Send):
                    src = "" if op.src is None else f" <- {_slot(op.src)}"
                    emit(f"create $send-op ${op.wire.value}{op.tokens} %{op.peer}{src}", 1)
                else:
                    emit(f"create $recv-op ${op.wire.value}{op.tokens} %{op.peer} -> {_slot(op.dst)}", 1)
            emit("}")
        elif isinstance(ins, Wait):
            emit(f"wait round {ins.index - round_base}")
        elif isinstance(ins, Compute):
            for it in ins.items:
                for w in PHASE_WIRES[phase].inputs:
                    rows = it.kv if w is Wire.KV else it.q
                    emit(f"copy-{w.value}{rows} {_buf(it.src(w))} $comp")
                kind = "causal" if it.causal else "full"
                if it.kernel_window != (-1, -1):  # partly outside the sliding window: a banded call
                    kind += " window{}".format(it.kernel_window)
                emit(f"compute stage {ins.stage}: q{it.q} kv{it.kv} {kind}")
                for w, slot in it.dsts:
                    if w is Wire.LSE:
                        continue  # travels with o
                    rows = it.kv if w is Wire.DKV else it.q
                    emit(f"copy-{w.value}{rows} $comp {_buf(slot)}")
        elif isinstance(ins, Merge):
            emit(f"copy-o{ins.tokens} {_slot(ins.o)} $local  # merge with lse {_slot(ins.lse)}")
        elif isinstance(ins, Accumulate):
            emit(f"copy-{ins.wire.value}{ins.tokens} {_slot(ins.src)} $local  # += fp32")
        if limit is not None and n >= limit:
            lines.append(f"      ... ({len(program.instrs)} instructions in all)")
            break
    return "\n".join(lines)


def dump_program(plan: "Plan", rank: int, phase: Phase) -> str:
    """Header plus ``format_program`` of inter rank ``rank``'s ``phase`` program."""
    prog = plan.program(rank, phase)
    base = plan.round_base[Phase(phase)]
    s = plan.stats()
    head = (
        f"# SAP program: inter rank {rank}/{plan.inter_size}, {Phase(phase).value}, placement {s.placement}, "
        f"{s.rounds_fwd if Phase(phase) is Phase.FWD else s.rounds_bwd} rounds, pool {plan.pool_capacity} bytes"
    )
    return head + "\n" + format_program(prog, round_base=base)
