"""One exception hierarchy for the whole package.

Every message says what is wrong *and* what to change. Subclasses let callers catch one
family (a bad batch vs. a bad configuration vs. a runtime failure) without parsing text.
"""

from __future__ import annotations

__all__ = [
    "HSAPError",
    "BatchError",
    "ConfigError",
    "PoolSizeError",
    "PlanError",
    "RuntimeMismatchError",
    "CommunicationError",
]


class HSAPError(Exception):
    """Base class of every error megatron-hsap raises on purpose."""


class BatchError(HSAPError, ValueError):
    """The batch description (``cu_seqlens``, token counts, tensor shapes) is invalid."""


class ConfigError(HSAPError, ValueError):
    """Sizes or options cannot be honoured (group sizes, head counts, capacities)."""


class PoolSizeError(ConfigError):
    """An explicit receive pool (``pool_bytes``) too small for a batch's plan."""


class PlanError(HSAPError):
    """A compiled plan violates an invariant (raised by ``Plan.verify``)."""


class RuntimeMismatchError(HSAPError):
    """Tensors, groups or ranks do not match the plan they are executed with."""


class CommunicationError(HSAPError, RuntimeError):
    """A P2P round or collective failed or timed out."""
