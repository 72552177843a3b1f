"""The one module that lists and reads megatron-hsap's environment variables.

Environment variables are for debugging and quick overrides only; real configuration goes
through config dataclasses. Read them with :func:`read_env` when an object is *constructed*
(executor, attention module), never inside a forward/backward: a hot path must not consult
``os.environ``, and a value that changes mid-run must not change behaviour mid-step.

======================  =========  ==========================================================
variable                default    meaning
======================  =========  ==========================================================
``HSAP_ATTN_BACKEND``   (auto)     attention kernel backend: ``flash_attn``, ``te``,
                                   ``torch_cuda`` or ``cpu``; an explicit argument wins
``HSAP_P2P_TIMEOUT_S``  ``300``    deadline (s, ≤ one week) of every HSAP collective: P2P rounds,
                                   the plan handshake, warm-up, Ulysses all-to-all, debug checks
``HSAP_DEBUG``          ``0``      ``1``/``true``: extra (slow, syncing) consistency checks
``HSAP_FUSED_MERGE``    ``1``      ``0``: LSE merges on CUDA run the eager torch kernels instead
                                   of the one-launch Triton kernel (``runtime/fused_merge.py``), and
                                   so does qk-clip's max-logit pass (``runtime/fused_max_logits.py``)
======================  =========  ==========================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_hsap.errors import ConfigError

__all__ = ["ENV_VARS", "EnvVar", "EnvSettings", "read_env", "MAX_TIMEOUT_S"]

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # one week: beyond it timedelta / std::chrono conversions overflow


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One documented environment variable."""

    name: str
    default: str | None
    help: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "HSAP_ATTN_BACKEND",
        None,
        "attention kernel backend (flash_attn | te | torch_cuda | cpu); unset = auto",
    ),
    EnvVar("HSAP_P2P_TIMEOUT_S", "300", "seconds a P2P round may wait before failing"),
    EnvVar("HSAP_DEBUG", "0", "1/true enables slow consistency checks (host syncs)"),
    EnvVar("HSAP_FUSED_MERGE", "1", "0 runs CUDA LSE merges (and qk-clip's max logits) eagerly instead of the fused Triton kernels"),
)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True, slots=True)
class EnvSettings:
    """A snapshot of the environment variables, parsed and validated.

    ``attn_backend`` is the raw lower-cased name (``None`` when unset); the kernel module
    checks it against the backends it knows, so the error can list what is available.
    """

    attn_backend: str | None = None
    p2p_timeout_s: float = 300.0
    debug: bool = False
    fused_merge: bool = True  # HSAP_FUSED_MERGE (the kernel still needs CUDA and Triton)


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: set it to 1 or 0 (or unset it)")


def read_env(environ: Mapping[str, str] | None = None) -> EnvSettings:
    """Parse every ``HSAP_*`` variable from ``environ`` (default ``os.environ``).

    Call this at construction time and keep the result. Raises ``ConfigError`` naming the
    variable when a value cannot be parsed.
    """
    env = os.environ if environ is None else environ

    backend_raw = env.get("HSAP_ATTN_BACKEND", "").strip().lower()
    backend = backend_raw or None

    timeout_raw = env.get("HSAP_P2P_TIMEOUT_S", "300")
    try:
        timeout = float(timeout_raw)
    except ValueError:
        raise ConfigError(
            f"HSAP_P2P_TIMEOUT_S={timeout_raw!r} is not a number of seconds: "
            "set it to a positive number, e.g. 300"
        ) from None
    if not 0 < timeout <= MAX_TIMEOUT_S:  # also rejects nan and inf
        raise ConfigError(
            f"HSAP_P2P_TIMEOUT_S={timeout_raw!r} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}] "
            "(one week; larger values overflow the transport's clock), e.g. 300"
        )

    debug = _parse_bool("HSAP_DEBUG", env.get("HSAP_DEBUG", "0"))
    fused_merge = _parse_bool("HSAP_FUSED_MERGE", env.get("HSAP_FUSED_MERGE", "1"))
    return EnvSettings(attn_backend=backend, p2p_timeout_s=timeout, debug=debug, fused_merge=fused_merge)
