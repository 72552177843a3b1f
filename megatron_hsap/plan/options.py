"""``PlanOptions``: everything besides ``cu_seqlens`` a plan depends on (its cache key), and the
kv-head rule of the intra all-to-all."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from numbers import Integral

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.hardware import HARDWARE, LinkClass, link_class_for
from megatron_hsap.plan.checks import divisors, positive_int
from megatron_hsap.plan.costs import DEFAULT_GRAD_WIRE_DTYPE, GRAD_WIRE_DTYPES
from megatron_hsap.plan.window import normalize_window, window_left

__all__ = ["PlanOptions", "kv_heads_per_rank", "kv_heads_exchanged", "intra_fits_heads", "valid_intra_sizes", "valid_head_chunks", "kv_head_chunks", "check_head_chunks", "validated_options", "DEFAULT_POOL_CHUNKS", "DEFAULT_POOL_MIN", "LAYOUTS", "FLATTEN", "FORCED_FLATTEN", "inter_rank_nodes", "link_of"]

LAYOUTS = ("contiguous", "balanced")
FLATTEN = ("never", "auto", "always", "all-to-all")  # PlanOptions.flatten (plan/flatten.py)
FORCED_FLATTEN = ("always", "all-to-all")  # every batch on the one-level topology (no head_chunks: it pins the configured one)

DEFAULT_POOL_CHUNKS = 4  # pool = 4 × one inter chunk × local heads × (d_qk + d_v) × bytes (docs/design.md §2.1)
DEFAULT_POOL_MIN = 1 << 20  # ... and at least 1 MiB: tiny chunks still need a few 256-byte-aligned slots


def intra_fits_heads(num_heads: int, num_kv_heads: int, intra_size: int) -> bool:
    """The intra all-to-all's head rule: ``P_intra`` divides the q heads and divides (kv heads
    split) or is a multiple of (kv heads replicated) the kv heads; anything else would hand some
    rank q heads of two kv groups. (That the kv heads divide the q heads is GQA's own rule.)"""
    return num_heads % intra_size == 0 and (num_kv_heads % intra_size == 0 or intra_size % num_kv_heads == 0)


def valid_intra_sizes(num_heads: int, num_kv_heads: int | None = None) -> list[int]:
    """Intra sizes the all-to-all can run with (``kv_heads_per_rank`` accepts): none when the kv
    heads do not divide the q heads."""
    hkv = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % hkv:
        return []
    return [p for p in divisors(num_heads) if intra_fits_heads(num_heads, hkv, p)]


def kv_heads_exchanged(num_heads: int, num_kv_heads: int, intra_size: int) -> int:
    """kv heads the intra all-to-all moves (its kv tensors' head count on the sequence side):
    ``P_intra ×`` ``kv_heads_per_rank`` — ``Hkv`` when ``P | Hkv``, ``P`` when ``Hkv | P`` (the
    replicated copies travel)."""
    return kv_heads_per_rank(num_heads, num_kv_heads, intra_size) * intra_size


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, intra_size: int) -> int:
    """kv heads each intra rank holds after the all-to-all (replicated when P_intra > Hkv)."""
    if num_heads % intra_size:
        raise ConfigError(f"num_heads={num_heads} is not divisible by intra_size={intra_size}; valid intra sizes: {divisors(num_heads)}")
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if num_kv_heads % intra_size == 0:
        return num_kv_heads // intra_size
    if intra_size % num_kv_heads == 0:
        return 1  # each kv head replicated intra_size / Hkv times
    raise ConfigError(
        f"num_kv_heads={num_kv_heads} and intra_size={intra_size}: one must divide the other "
        f"(kv heads cannot be split or replicated evenly); valid intra sizes: {valid_intra_sizes(num_heads, num_kv_heads)}"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """Everything besides ``cu_seqlens`` that a plan depends on (its cache key)."""

    inter_size: int
    intra_size: int = 1
    num_heads: int = 32
    num_kv_heads: int | None = None
    head_dim: int = 128
    head_dim_v: int | None = None
    dtype_bytes: int = 2
    pad_multiple: int = 1
    layout: str = "balanced"
    layout_fallback: bool = True  # "balanced": keep the contiguous plan when it is estimated faster
    pool_bytes: int | None = None
    link: str | None = None  # "nvlink" | "ib"; default from the CP world size (docs/design.md §4)
    tp_size: int = 1
    gpus_per_node: int = 8
    hardware: str = "a100"
    allow_helpers: bool = True  # move bands of local blocks to a third rank when it pays
    placement: str = "auto"  # "auto" (lowest estimated time), "owner-computes" or "min-traffic"
    window_size: tuple[int, int] | None = None  # sliding window (left, 0), flash-attn's convention; None: full causal
    head_chunks: int | None = None  # intra all-to-all pipelined in this many head chunks; None: the estimate's choice (plan/chunks.py)
    # "activation" (default) or "fp32": the dtype partial dq / dk / dv travel in (plan/costs.py
    # GRAD_WIRES); accumulation stays fp32 either way
    grad_wire_dtype: str = DEFAULT_GRAD_WIRE_DTYPE
    # also plan the batch on a one-level topology of the same CP ranks, pure SAP (1 x P) or one
    # all-to-all (P x 1), and keep the plan estimated fastest (plan/flatten.py): "auto" (when the CP
    # group sits inside one node), "always" (1 x P), "all-to-all" (P x 1) or "never"
    flatten: str = "auto"
    # set on a flattened plan's options (compile_plan fills it): the (P_intra, P_inter) of the HSAP
    # groups the one-level plan runs on, over their CP group
    flattened_from: tuple[int, int] | None = None

    @property
    def window(self) -> int:
        """The window's ``left`` as one int (-1: none; ``plan/window.py``)."""
        return window_left(self.window_size)

    def validate(self) -> "PlanOptions":
        for name in ("inter_size", "intra_size", "num_heads", "head_dim", "dtype_bytes", "pad_multiple", "tp_size", "gpus_per_node"):
            positive_int(name, getattr(self, name))
        for name in ("num_kv_heads", "head_dim_v", "pool_bytes"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.dtype_bytes not in (1, 2, 4):
            raise ConfigError(f"dtype_bytes={self.dtype_bytes} is not an activation size; use 2 (bf16/fp16), 4 (fp32) or 1 (fp8 pricing)")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout={self.layout!r} is unknown; use 'contiguous' or 'balanced'")
        if not isinstance(self.layout_fallback, bool):
            raise ConfigError(f"layout_fallback={self.layout_fallback!r} must be True or False")
        if self.link not in (None, "nvlink", "ib"):
            raise ConfigError(f"link={self.link!r} is unknown; use 'nvlink', 'ib' or None (derived from the CP size)")
        if self.placement not in ("auto", "owner-computes", "min-traffic"):
            raise ConfigError(f"placement={self.placement!r} is unknown; use 'auto', 'owner-computes' or 'min-traffic'")
        if normalize_window(self.window_size) != self.window_size:
            raise ConfigError(f"window_size={self.window_size!r}: pass it through compile_plan (normalised to None or (left, 0))")
        if self.grad_wire_dtype not in GRAD_WIRE_DTYPES:
            raise ConfigError(f"grad_wire_dtype={self.grad_wire_dtype!r} is unknown; use one of {list(GRAD_WIRE_DTYPES)}")
        if self.hardware not in HARDWARE:
            raise ConfigError(f"hardware={self.hardware!r} is unknown; choose one of {sorted(HARDWARE)}")
        if self.flatten not in FLATTEN:
            raise ConfigError(f"flatten={self.flatten!r} is unknown; use one of {list(FLATTEN)}")
        if self.flattened_from is not None:
            f = self.flattened_from
            p = self.intra_size * self.inter_size
            if (not isinstance(f, tuple) or len(f) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in f)
                    or 1 not in (self.intra_size, self.inter_size) or f[0] * f[1] != p or f == (self.intra_size, self.inter_size)):
                raise ConfigError(
                    f"flattened_from={f!r} with intra_size={self.intra_size}, inter_size={self.inter_size}: it names the "
                    "(P_intra, P_inter) groups a one-level 1 x P or P x 1 plan of the same P ranks runs on; "
                    "compile_plan sets it (flatten=...)"
                )
        check_head_chunks(self)
        return self


def link_of(opts: PlanOptions) -> LinkClass:
    """The inter group's link class: given, or derived from the CP world size (docs/design.md §4)."""
    if opts.link:
        return LinkClass(opts.link)
    return link_class_for(opts.tp_size * opts.intra_size * opts.inter_size, opts.gpus_per_node)


def inter_rank_nodes(opts: PlanOptions, link: LinkClass) -> tuple[int, ...]:
    """Node of each inter rank ``i`` of inter group 0 (CP rank ``i·P_intra``, TP ranks innermost)
    under a network link class, for pricing which P2P pairs share a node (NVLink, in parallel
    with the NIC: ``CostRates.node``); ``()`` under NVLink or when they all share one node (every
    pair at one rate)."""
    if link is not LinkClass.INFINIBAND:
        return ()
    node = tuple((i * opts.intra_size * opts.tp_size) // opts.gpus_per_node for i in range(opts.inter_size))
    return node if len(set(node)) > 1 else ()


def validated_options(inter_size, intra_size, num_heads, num_kv_heads, head_dim, head_dim_v, dtype_bytes,
                      extra: dict) -> PlanOptions:
    """Validated options, cached by value AND type (``inter_size=True`` must not hit the entry of
    ``inter_size=1``); unhashable values (``pool_bytes=[1]``) skip the cache and fail validation."""
    args = (inter_size, intra_size, num_heads, num_kv_heads, head_dim, head_dim_v, dtype_bytes)
    if "window_size" in extra:  # (-1, -1), [64, 0] and (64, -1) name the same plans as None / (64, 0)
        extra = {**extra, "window_size": normalize_window(extra["window_size"])}
        if extra["window_size"] is None:
            del extra["window_size"]
    typed_extra = tuple((k, type(v).__name__, v) for k, v in sorted(extra.items(), key=lambda kv: kv[0]))
    try:
        hash((args, typed_extra))
    except TypeError:
        return _options.__wrapped__(*args, typed_extra)
    return _options(*args, typed_extra)


@functools.lru_cache(maxsize=256, typed=True)
def _options(inter_size, intra_size, num_heads, num_kv_heads, head_dim, head_dim_v, dtype_bytes, extra) -> PlanOptions:
    known = set(PlanOptions.__dataclass_fields__)
    unknown = [k for k, _, _ in extra if k not in known]
    if unknown:
        raise ConfigError(f"unknown compile_plan option(s) {unknown}; known: {sorted(known - {'inter_size'})}")
    return PlanOptions(inter_size=inter_size, intra_size=intra_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, head_dim_v=head_dim_v, dtype_bytes=dtype_bytes,
                       **{k: v for k, _, v in extra}).validate()


def valid_head_chunks(local_heads: int, local_kv_heads: int) -> tuple[int, ...]:
    """Chunk counts ``C`` that split ``local_heads`` q and ``local_kv_heads`` kv heads into equal
    chunks, none straddling two kv groups: ``C | h`` and either ``C | hkv`` (every chunk its own kv heads) or
    ``hkv | C`` (each kv head shared by ``C/hkv`` consecutive q chunks; needs ``hkv | h``). The
    rule: ``plan/chunks.py``'s module docstring."""
    h, hkv = local_heads, local_kv_heads
    return tuple(c for c in divisors(h) if hkv % c == 0 or (c % hkv == 0 and h % hkv == 0))


def kv_head_chunks(chunks: int, local_kv_heads: int) -> int:
    """kv chunks ``Ckv`` under ``chunks`` q head chunks: ``min(C, hkv)`` for a valid count (``C``
    when ``C | hkv``; ``hkv`` when ``hkv | C``, kv chunk ``c·Ckv // C`` serving q chunk ``c``)."""
    return math.gcd(chunks, local_kv_heads)


def check_head_chunks(opts: PlanOptions) -> None:
    """Raise :class:`ConfigError` naming the value unless ``opts.head_chunks`` is None or a valid count."""
    c = opts.head_chunks
    if c is None:
        return
    if isinstance(c, bool) or not isinstance(c, Integral) or c < 1:
        raise ConfigError(f"head_chunks={c!r} must be None (the planner chooses) or an int >= 1")
    if opts.flatten in FORCED_FLATTEN:  # (the flattened plan's own options leave it None: flat_options)
        raise ConfigError(
            f"head_chunks={c} pins the {opts.intra_size}x{opts.inter_size} plan's all-to-all, but flatten="
            f"{opts.flatten!r} plans every batch on a one-level topology instead (plan/flatten.py), whose head chunks "
            "the planner chooses; leave head_chunks unset, or use flatten='auto' (a pinned count keeps the configured "
            "topology) or 'never'")
    if c == 1:
        return
    p = opts.intra_size
    if p == 1:
        raise ConfigError(
            f"head_chunks={c} pipelines the intra all-to-all, but the plan has intra_size=1 (pure SAP, no "
            "all-to-all); use head_chunks=None or 1"
        )
    hkv = kv_heads_per_rank(opts.num_heads, opts.num_kv_heads or opts.num_heads, p)
    valid = valid_head_chunks(opts.num_heads // p, hkv)
    if c not in valid:
        raise ConfigError(
            f"head_chunks={c} cannot split the {opts.num_heads // p} q heads and {hkv} kv heads each intra rank "
            f"holds (num_heads={opts.num_heads}, num_kv_heads={opts.num_kv_heads or opts.num_heads}, "
            f"intra_size={p}) into equal chunks (C must divide the q heads and either divide the kv heads or be a "
            "multiple of them, q chunks then sharing a kv head); "
            f"valid head_chunks: {list(valid)} (or None)"
        )
