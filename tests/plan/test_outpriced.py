"""A layout's pool-overflow retries stop once it is outpriced (plan/candidates.py ``_choose``'s
``give_up``, raised as ``Outpriced``; plan/plan.py's bars): fake builds and prices, counts only.
The same plan with and without the bar on a real batch: tests/plan/test_plan_search.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import megatron_hsap.plan.candidates as candidates


def _overflowing_choose(monkeypatch: pytest.MonkeyPatch, prices: list[float], give_up: float,
                        owner_floor: float | None = None) -> dict[str, object]:
    """``_choose`` with min-traffic alone priced 1.0 and every build of it overflowing, restaged at
    ``prices`` in turn; with ``owner_floor``, owner-computes quick-priced 1.5 with its search
    deferred at that floor (searched, it prices and builds at 1.3). Returns the calls made, and
    ``price`` (the price ``Outpriced`` names) or ``best`` / ``owner_time`` when a plan was chosen."""
    calls: dict[str, object] = {"min-traffic": 0, "owner-computes": 0, "search": 0}

    def fake_build(name, split, st, budget, *rest):
        calls[name] += 1
        if name == "owner-computes":
            return SimpleNamespace(name=name, time=1.3), float("nan"), st, budget
        return None, prices[calls[name] - 1], st, budget * candidates._OVERFLOW_STEP

    def fake_search(priced, name, *rest):
        calls["search"] += 1
        priced[name] = (1.3, None, "oc searched")
        return 1.3

    monkeypatch.setattr(candidates, "_build_or_halve", fake_build)
    monkeypatch.setattr(candidates, "_explore_one", fake_search)
    monkeypatch.setattr(candidates, "built_price", lambda st, *rest: {"mt": 1.0, "oc": 1.5, "oc searched": 1.3}[st])
    priced = {"min-traffic": (1.0, None, "mt")}
    if owner_floor is not None:
        priced["owner-computes"] = (1.5, None, "oc")
    try:
        calls["best"], _, calls["owner_time"] = candidates._choose(priced, 4, None, 1 << 30, None, 0.0, float(1 << 28),
                                                                   owner_floor, give_up)
    except candidates.Outpriced as out:
        calls["price"] = out.price
    return calls


def test_overflow_retries_stop_once_the_layout_is_priced_past_the_other_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # restaged at 1.02, 1.04, 1.08, 1.2: the bar 1.05 stops it after the third build, priced 1.08
    calls = _overflowing_choose(monkeypatch, [1.02, 1.04, 1.08, 1.2], give_up=1.05)
    assert calls["min-traffic"] == 3 and calls["price"] == 1.08
    # an equal price is not past the bar: it is built once more
    calls = _overflowing_choose(monkeypatch, [1.02, 1.05, 1.08, 1.2], give_up=1.05)
    assert calls["min-traffic"] == 3 and calls["price"] == 1.08


def test_a_deferred_owner_search_under_the_bar_runs_before_the_layout_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # the mover restages past the bar (1.4) while owner-computes' floor (1.2) is under it: owner-computes
    # is searched and built (1.3, under the bar), so nothing is outpriced
    calls = _overflowing_choose(monkeypatch, [1.45], give_up=1.4, owner_floor=1.2)
    assert "price" not in calls and calls["best"].name == "owner-computes" and calls["owner_time"] == 1.3
    assert (calls["min-traffic"], calls["owner-computes"], calls["search"]) == (1, 1, 1)
    # with its floor over the mover's price (so over the bar too), the layout gives up without searching it
    calls = _overflowing_choose(monkeypatch, [1.45], give_up=1.4, owner_floor=1.48)
    assert calls["search"] == 0 and calls["min-traffic"] == 1 and calls["price"] == 1.45
