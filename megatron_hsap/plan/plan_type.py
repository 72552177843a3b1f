"""The ``Plan`` data type (docs/design.md §2.1, §3): one compiled SAP plan of a packed micro-batch,
its chosen candidate (``ChosenCandidate``) and the named records of its compute units and
messages. The candidate search that builds a ``Plan`` is ``plan/plan.py`` (``compile_plan``).

Layering inside ``plan/`` (asserted by ``tests/plan/test_no_import_cycle.py``): this module imports
only the IR and what the IR's pieces are made of (``ir``, ``codegen``, ``costs``, ``estimate``,
``hardware``, ``layout``, ``options``, ``units``), never the search. The functions over a plan —
``verify.verify_plan``, ``dump.dump_program``, ``stats.plan_stats`` / ``peak_bytes``,
``fingerprint.plan_hash``, ``chunks.resolve_head_chunks`` — name ``Plan`` only for type checking,
so the thin methods below that import them lazily close no circle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.codegen import Message, PhaseCode
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.estimate import PhaseTime
from megatron_hsap.plan.hardware import Hardware, LinkClass
from megatron_hsap.plan.ir import Compute, Phase, Program, TokenRange, Unit
from megatron_hsap.plan.layout import Batch, Layout
from megatron_hsap.plan.options import PlanOptions
from megatron_hsap.plan.units import Piece, WorkUnit

if TYPE_CHECKING:
    from megatron_hsap.plan.stats import PlanStats

__all__ = ["ChosenCandidate", "ComputeUnitRecord", "MessageRecord", "Plan"]


@dataclass(frozen=True, slots=True)
class ChosenCandidate:
    """The placement ``compile_plan`` kept, staged and turned into programs, with its exact
    estimated times (docs/design.md §4).

    ``name``: the placement (``"owner-computes"``, ``"min-traffic"``, ``"region-distflash"``, or a
    start ``+rebalanced@β`` rebalanced under traffic budget β (``rebalanced``, not ``balanced``: that word names
    the token layout); ``plan/placement.py``, ``plan/rebalance.py``).
    ``units``: the placed and staged blocks, in program order. ``fwd`` / ``bwd``: each phase's
    programs, messages and pool peaks (``plan/codegen.py``). ``fwd_time`` / ``bwd_time``: each
    phase's estimate. ``budget``: the per-stage remote pool budget in bytes it was staged under
    (halved on every pool-overflow retry).
    """

    name: str
    units: tuple[Unit, ...]
    fwd: PhaseCode
    bwd: PhaseCode
    fwd_time: PhaseTime
    bwd_time: PhaseTime
    budget: float

    @property
    def time(self) -> float:
        """Estimated forward + backward seconds."""
        return self.fwd_time.total + self.bwd_time.total


class ComputeUnitRecord(NamedTuple):
    """One forward block of ``Plan.compute_units()`` (a tuple in this order for older callers)."""

    inter_rank: int
    stage: int
    q: TokenRange
    kv: TokenRange
    causal: bool


class MessageRecord(NamedTuple):
    """One message of ``Plan.messages()``: ``round`` numbers backward rounds after the forward
    ones; ``tensor`` is the wire's name (``Wire.value``)."""

    round: int
    src: int
    dst: int
    tensor: str
    tokens: TokenRange


@dataclass(frozen=True, eq=False)
class Plan:
    """A compiled SAP plan for one packed micro-batch. Immutable; share it freely."""

    options: PlanOptions
    batch: Batch
    layout: Layout
    shape: HeadShape
    hardware: Hardware
    link: LinkClass
    pool_capacity: int
    pieces: tuple[Piece, ...]
    work_units: tuple[WorkUnit, ...]
    chosen: ChosenCandidate
    alternatives: dict[str, float] = field(default_factory=dict)  # candidate name -> estimated time
    owner_time: float = 0.0  # owner-computes' estimate: exact when it was built, else its last staged price

    # --- sizes -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens

    @property
    def padded_tokens(self) -> int:
        return self.batch.padded_tokens

    @property
    def inter_size(self) -> int:
        return self.options.inter_size

    @property
    def intra_size(self) -> int:
        return self.options.intra_size

    @property
    def cp_size(self) -> int:
        return self.options.inter_size * self.options.intra_size

    @property
    def chunk_tokens(self) -> int:
        """Tokens per inter rank (after the intra all-to-all)."""
        return self.layout.chunk_tokens

    @property
    def local_tokens(self) -> int:
        """Tokens per CP rank before the intra all-to-all."""
        return self.layout.chunk_tokens // self.options.intra_size

    # --- programs ------------------------------------------------------------------------
    @property
    def fwd_programs(self) -> tuple[Program, ...]:
        return self.chosen.fwd.programs

    @property
    def bwd_programs(self) -> tuple[Program, ...]:
        return self.chosen.bwd.programs

    @functools.cached_property
    def head_chunks(self) -> int:
        """Head chunks pipelining the intra all-to-all (``options.head_chunks`` or the estimate's; ``plan/chunks.py``)."""
        from megatron_hsap.plan.chunks import resolve_head_chunks

        return resolve_head_chunks(self)

    @functools.cached_property
    def head_chunk_choice(self) -> tuple[int, float]:
        """The estimate's head-chunk count and its layer estimate (``chunks.choose_head_chunks_timed``),
        computed once per plan: ``head_chunks`` and ``layer_time`` both read it."""
        from megatron_hsap.plan.chunks import choose_head_chunks_timed

        return choose_head_chunks_timed(self)

    @functools.cached_property
    def layer_time(self) -> float:
        """Estimated seconds of the whole HSAP layer at ``head_chunks`` (``chunks.layer_estimate``:
        SAP, plus the intra all-to-all pipelined with it when ``P_intra > 1``)."""
        from megatron_hsap.plan.chunks import layer_estimate

        return layer_estimate(self)

    def renamed(self, layout: Layout) -> "Plan":
        """This plan under ``layout``, another name for the same segments (``plan.py``: layouts that
        hold the same tokens on every rank are built once), its estimates carried over: they read
        the units and options, never the layout's name (``hash`` is not carried: it covers the name)."""
        if (layout.segments, layout.chunk_tokens, layout.intra_size) != (self.layout.segments, self.layout.chunk_tokens, self.layout.intra_size):
            raise ConfigError(f"layout {layout.name!r} holds other tokens than {self.layout.name!r}: Plan.renamed only renames")
        out = replace(self, layout=layout)
        for name in ("head_chunks", "head_chunk_choice", "layer_time"):
            if name in self.__dict__:  # computed (functools.cached_property keeps it in the instance dict)
                out.__dict__[name] = self.__dict__[name]
        return out

    @functools.cached_property
    def hash(self) -> int:
        """128-bit identity of the programs (``plan/fingerprint.py``): equal on every node that
        compiled the same inputs; the runtime's pre-round handshake compares it."""
        from megatron_hsap.plan.fingerprint import plan_hash

        return plan_hash(self)

    def program(self, inter_rank: int, phase: Phase | str) -> Program:
        if isinstance(inter_rank, bool) or not isinstance(inter_rank, Integral) or not 0 <= inter_rank < self.inter_size:
            raise ConfigError(
                f"inter rank {inter_rank!r} is out of range: this plan has inter ranks 0..{self.inter_size - 1} "
                f"(inter_size={self.inter_size})"
            )
        phase = Phase(phase)
        progs = self.fwd_programs if phase is Phase.FWD else self.bwd_programs
        return progs[inter_rank]

    def units(self) -> tuple[Unit, ...]:
        """Placed and staged blocks (identical in forward and backward)."""
        return self.chosen.units

    def local_token_indices(self, cp_rank: int) -> np.ndarray:
        """Global token ids (int64) CP rank ``cp_rank = i·P_intra + j`` holds, in local order.
        Ids ≥ ``num_tokens`` are padding (batch sharding fills them with a pad token)."""
        return self.layout.local_token_indices(cp_rank)

    def compute_units(self) -> list[ComputeUnitRecord]:
        """Forward blocks as ``(inter_rank, stage, q, kv, causal)`` records, in program order."""
        out = []
        for prog in self.fwd_programs:
            for ins in prog.instrs:
                if isinstance(ins, Compute):
                    out.extend(ComputeUnitRecord(prog.rank, ins.stage, it.q, it.kv, it.causal) for it in ins.items)
        return out

    def messages(self) -> list[MessageRecord]:
        """``(round, src, dst, tensor, tokens)`` records (inter ranks): forward rounds first, then
        backward rounds in the same numbering."""
        fwd = [MessageRecord(m.round, m.src, m.dst, m.wire.value, m.tokens) for m in self.chosen.fwd.messages]
        base = self.chosen.fwd.rounds
        bwd = [MessageRecord(base + m.round, m.src, m.dst, m.wire.value, m.tokens) for m in self.chosen.bwd.messages]
        return fwd + bwd

    def raw_messages(self, phase: Phase | str) -> tuple[Message, ...]:
        return (self.chosen.fwd if Phase(phase) is Phase.FWD else self.chosen.bwd).messages

    @property
    def round_base(self) -> dict[Phase, int]:
        return {Phase.FWD: 0, Phase.BWD: self.chosen.fwd.rounds}

    # --- quality: thin calls of the functions over a plan (module docstring) --------------
    def verify(self) -> None:
        """Prove the plan correct by symbolic execution (``plan/verify.py``); raises ``PlanError`` on any violation."""
        from megatron_hsap.plan.verify import verify_plan

        verify_plan(self)

    def dump(self, rank: int, phase: Phase | str = Phase.FWD) -> str:
        """The rank's instruction list in the paper's syntax (Table 1; ``plan/dump.py``)."""
        from megatron_hsap.plan.dump import dump_program

        return dump_program(self, rank, Phase(phase))

    def stats(self) -> "PlanStats":
        """Quality figures (``plan/stats.py``; ``.as_dict()`` for JSON)."""
        from megatron_hsap.plan.stats import plan_stats

        return plan_stats(self)

    def peak_bytes(self, *, num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
                   head_dim_v: int | None = None, dtype_bytes: int | None = None) -> dict[str, int]:
        """Bytes HSAP holds per CP rank beyond the layer's q/k/v/o (``plan/stats.py``)."""
        from megatron_hsap.plan.stats import peak_bytes

        return peak_bytes(self, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          head_dim_v=head_dim_v, dtype_bytes=dtype_bytes)
