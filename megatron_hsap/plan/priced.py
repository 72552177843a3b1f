"""One layout's candidates, staged and priced on demand (``plan.py``'s layout search).

Staging and pricing a layout's placements is most of a compile, and the layout choice often
needs only a lower bound of a layout's price (``bounds.price_floor``) to decide: at 1M tokens on
P_inter 64 the contiguous layout's floor is twice the balanced plan's time, so it is never staged.
``PricedLayout`` therefore holds the inputs and a staging function, and runs the staging the first
time an exact price is asked for, then keeps the result."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_hsap.plan.bounds import placement_floor

if TYPE_CHECKING:
    from megatron_hsap.plan.costs import HeadShape
    from megatron_hsap.plan.hardware import LinkClass
    from megatron_hsap.plan.layout import Batch, Layout
    from megatron_hsap.plan.options import PlanOptions
    from megatron_hsap.plan.placement import CostRates, Placement
    from megatron_hsap.plan.schedule import BlocksByRank, StagedBlocks
    from megatron_hsap.plan.units import WorkUnit

    Prices = dict[str, tuple[float, BlocksByRank, StagedBlocks]]


class PricedLayout:
    """A lazy, memoising holder of one layout's priced candidates, not a value: it changes state
    once, when ``exact()`` first runs the staging (so it is a plain class, compared by identity).

    Before: ``pending`` is true, ``floor`` is the least ``price_floor`` of the placements, and
    ``priced`` / ``price`` may not be read. After: ``priced`` maps each staged placement to
    ``(price, split, staging)``, ``price`` is its least price (seconds; the explored candidates'
    built prices, the others' staged prices, at or below the built time of the same staging by
    up to ~17%: ``plan._LAYOUT_PRUNE``) and ``floor`` equals it. Readers must copy ``priced`` before changing it
    (``plan._build_on``: ``price`` must not move)."""

    __slots__ = ("layout", "batch", "shape", "opts", "link", "capacity", "rates", "latency", "pieces", "units",
                 "placements", "_stage", "_priced", "_deferred")

    def __init__(self, layout: Layout, batch: Batch, shape: HeadShape, opts: PlanOptions, link: LinkClass,
                 capacity: int, rates: CostRates, latency: float, pieces: tuple, units: tuple[WorkUnit, ...],
                 placements: dict[str, Placement], stage: Callable[[dict[str, Placement]], tuple[Prices, float | None]]) -> None:
        self.layout, self.batch, self.shape, self.opts, self.link = layout, batch, shape, opts, link
        self.capacity, self.rates, self.latency = capacity, rates, latency
        self.pieces, self.units = pieces, units
        self.placements = placements  # the candidates ``stage`` prices (and ``floor`` bounds)
        self._stage = stage
        self._priced: Prices | None = None
        self._deferred: float | None = None

    @property
    def pending(self) -> bool:
        """Whether the staging has not run yet."""
        return self._priced is None

    def exact(self) -> PricedLayout:
        """This layout's candidates staged and priced (the first call runs ``stage``; later ones
        return at once)."""
        if self._priced is None:
            self._priced, self._deferred = self._stage(self.placements)
        return self

    @property
    def owner_deferred(self) -> float | None:
        """Owner-computes' floor when its every-shape search was left to code generation
        (``candidates._explore``; its entry in ``priced`` is then its quick price), else None."""
        assert self._priced is not None, "a layout not staged yet (call exact())"
        return self._deferred

    def release(self) -> None:
        """Drop the staging memos of this layout's splits once its compile is done. A staging
        keeps its split's memo dict (``StagedBlocks.memo``), which holds the staging: a reference
        cycle per staging, so without this every block of every staging tried (~4,000 objects at
        64K, ~10^4 at 1M) waited for a cyclic collection, which then ran inside the next compile.
        Prices stay readable."""
        for _, split, _ in (self._priced or {}).values():
            split.orders.clear()

    @property
    def priced(self) -> Prices:
        assert self._priced is not None, "prices of a layout not staged yet (call exact())"
        return self._priced

    @property
    def price(self) -> float:
        assert self._priced is not None, "price of a layout not staged yet (call exact())"
        # inf: no placement stages within ``schedule.stage_cap`` under this pool (the layout loses)
        return min((v[0] for v in self._priced.values()), default=float("inf"))

    @property
    def floor(self) -> float:
        """A lower bound of ``exact().price``: before staging, the least ``bounds.price_floor``
        of the placements (the price is one placement's staged price); after, the price."""
        if self._priced is not None:
            return self.price
        return min(placement_floor(pl, self.rates) for pl in self.placements.values())
