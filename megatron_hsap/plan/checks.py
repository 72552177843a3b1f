"""The positive-integer check every layer uses for sizes and counts, and the divisors that error
messages list as valid sizes (pure Python).

One definition: the planner's options and head shape, the runtime's group sizes and the launcher's
topology all call :func:`positive_int`, so they accept and refuse the same values with the same
message. (``megatron_hsap.argtypes.positive_int`` is a different thing: an argparse type that
parses command-line text.)
"""

from __future__ import annotations

from numbers import Integral

from megatron_hsap.errors import ConfigError

__all__ = ["divisors", "positive_int"]


def positive_int(name: str, value: object) -> int:
    """``int(value)`` if ``value`` is an integer ≥ 1 (a Python or numpy integer, not a bool);
    :class:`ConfigError` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, Integral) or int(value) < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` ≥ 1, ascending (the valid group sizes an error lists)."""
    return [d for d in range(1, n + 1) if n % d == 0]
