"""One record per baseline: what it is, where it comes from, when it runs, and how each tool runs it.

A ``Baseline`` names the method's *availability rule* (one function, used by the flat pricing,
the simulator and the tables alike), its *flat price* (``baselines.hierarchical.price``, the
planner's flat constants: ``baselines.flat`` for the flat groups, ``baselines.hierarchical`` for
the all-to-all × ring and per-sample methods; used by ``plan-quality``), its *simulated schedule* (the name ``sim.methods.run_method``
takes) and its *CPU-executed implementation* (``module:Class`` under ``megatron_hsap.bench``)
where one exists. Each is modelled as its real implementation behaves; ``source`` names the
repository and file it was read from (docs/design.md §4, "Baselines priced on the same batch").

``document_aware``: the method skips cross-document pairs (it takes ``cu_seqlens``). Headline
comparisons use the best *document-aware* baseline; DistFlashAttn and the "packing" ring are
document-blind and are labelled so in every table.

The records point at schedules and implementations by name (strings) so that this module
imports neither the simulator nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_hsap.errors import ConfigError
from megatron_hsap.plan.checks import divisors
from megatron_hsap.plan.costs import HeadShape
from megatron_hsap.plan.options import intra_fits_heads, kv_heads_per_rank

__all__ = ["Baseline", "REGISTRY", "get", "unavailable", "heads_split_ok", "split_heads", "usp_degree", "hybrid_group_sizes", "DOCUMENT_AWARE"]


def heads_split_ok(shape: HeadShape, u: int) -> bool:
    """An all-to-all over ``u`` ranks can split these heads: ``u | H`` and kv heads split or
    replicate evenly (``u | Hkv`` or ``Hkv | u``)."""
    return intra_fits_heads(shape.num_heads, shape.num_kv_heads, u)  # the planner's rule (plan/options.py)


def split_heads(shape: HeadShape, u: int) -> HeadShape:
    """Heads one rank computes after an all-to-all over ``u`` ranks: ``H/u`` q heads and
    ``Hkv/u`` kv heads, or one replicated kv head when ``u`` does not divide ``Hkv``."""
    hkv = kv_heads_per_rank(shape.num_heads, shape.num_kv_heads, u)  # (ConfigError where u cannot split them)
    return HeadShape(num_heads=shape.num_heads // u, num_kv_heads=hkv, head_dim=shape.head_dim,
                     head_dim_v=shape.head_dim_v, dtype_bytes=shape.dtype_bytes)


def usp_degree(P: int, shape: HeadShape, gpus_per_node: int = 8) -> int:
    """USP's all-to-all degree: the largest ``u | P`` inside one node that splits the heads
    (MagiAttention ``exps/dist_attn/run_benchmark.py``: Ulysses ``min(W, 8)``, ring ``W / 8``)."""
    return max(u for u in divisors(P) if u <= gpus_per_node and heads_split_ok(shape, u))


def _ulysses(intra: int, inter: int, shape: HeadShape) -> str | None:
    P = intra * inter
    if P > shape.num_heads:
        return "n/a (P > H)"
    if not heads_split_ok(shape, P):
        return "n/a (heads not divisible by P)"
    return None


def _a2a_intra(intra: int, inter: int, shape: HeadShape) -> str | None:
    if not heads_split_ok(shape, intra):
        return f"n/a (heads not divisible by P_intra={intra})"
    return None


def _te_a2a(intra: int, inter: int, shape: HeadShape) -> str | None:
    # TE's AttnFuncWithCPAndQKVOA2A asserts heads and kv heads divisible by the a2a group size
    if shape.num_heads % intra or shape.num_kv_heads % intra:
        return f"n/a (TE a2a needs heads and kv heads divisible by P_intra={intra})"
    return None


def _even(intra: int, inter: int, shape: HeadShape) -> str | None:
    P = intra * inter
    return "n/a (odd P)" if P > 1 and P % 2 else None


def _always(intra: int, inter: int, shape: HeadShape) -> str | None:
    return None


def hybrid_group_sizes(lengths: "list[int] | object", P: int, max_tokens_per_rank: int) -> list[int]:
    """Megatron hybrid / dynamic CP: each sample's CP group size, the next power of two of
    ``length / max_tokens_per_rank``, at most P (Megatron-LM ``megatron/core/pipeline_parallel/
    hybrid_cp_schedule.py`` ``BalancedCPScheduler.gpus_needed``, as MagiAttention's benchmark
    overrides it in ``exps/dist_attn/baselines/hybrid_dcp.py``)."""
    out = []
    for n in lengths:  # type: ignore[union-attr]
        n = int(n)
        g = 1
        while g < P and n > g * max_tokens_per_rank:
            g *= 2
        out.append(min(g, P))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Baseline:
    """One baseline method (see the module docstring)."""

    name: str
    label: str
    source: str
    document_aware: bool
    hierarchical: bool  # has an intra × inter topology to tune (all-to-all inside, ring across)
    availability: Callable[[int, int, HeadShape], str | None]
    flat: str | None  # method key of baselines.hierarchical.price, or None (no flat price)
    simulated: str | None  # method name of sim.methods.run_method
    cpu: str | None  # "module:Class" of a CPU-executed implementation
    note: str = ""


_RECORDS = (
    Baseline(name="te_thd_ring", label="TE THD ring (p2p)", document_aware=True, hierarchical=False,
             source="NVIDIA/TransformerEngine transformer_engine/pytorch/attention/dot_product_attention/"
                    "context_parallel.py (AttnFuncWithCPAndKVP2P, THD)",
             availability=_always, flat="te_thd_ring", simulated="te_thd_ring",
             cpu="megatron_hsap.bench.ring_baseline:RingAttention",
             note="every document padded to a multiple of 2P and the padding computed (FA2 path)"),
    Baseline(name="te_thd_ring_nopad", label="TE THD ring, pad skipped", document_aware=True, hierarchical=False,
             source="NVIDIA/TransformerEngine context_parallel.py (AttnFuncWithCPAndKVP2P, pad_between_seqs=True, cuDNN/FA3)",
             availability=_always, flat="te_thd_ring_nopad", simulated="te_thd_ring_nopad", cpu=None,
             note="same ring and bytes; the kernel skips the per-document padding"),
    Baseline(name="te_a2a", label="TE a2a (Ulysses)", document_aware=True, hierarchical=False,
             source="NVIDIA/TransformerEngine context_parallel.py (AttnFuncWithCPAndQKVOA2A)",
             availability=lambda i, j, s: _te_a2a(i * j, 1, s), flat="te_a2a", simulated="te_a2a", cpu=None,
             note="documents padded to 2P (THD dual-chunk layout), an all-to-all per tensor to a head split with "
                  "each reorder overlapped with the next tensor's all-to-all, whole documents per rank; needs P | H and P | Hkv"),
    Baseline(name="te_a2a_p2p", label="TE a2a+p2p", document_aware=True, hierarchical=True,
             source="NVIDIA/TransformerEngine context_parallel.py (cp_comm_type 'a2a+p2p': QKVOA2A inside, KVP2P across)",
             availability=_te_a2a, flat="te_a2a_p2p", simulated="te_a2a_p2p",
             cpu="megatron_hsap.bench.ring_baseline:A2AP2PAttention"),
    Baseline(name="allgather_kv", label="all-gather KV, contiguous (ring-flash-attn llama3)", document_aware=True,
             hierarchical=False,
             source="zhuzilin/ring-flash-attention ring_flash_attn/llama3_flash_attn_varlen.py",
             availability=_always, flat="allgather_kv", simulated="allgather_kv",
             cpu="megatron_hsap.bench.allgather_baseline:AllGatherKVAttention",
             note="contiguous layout, unbalanced (the paper's variant; not a fair headline)"),
    Baseline(name="allgather_kv_zigzag", label="all-gather KV, per-document zigzag", document_aware=True,
             hierarchical=False,
             source="SandAI-org/MagiAttention exps/dist_attn/baselines/ring_attn.py (ring_allgather: TERingAGAttnFunc/"
                    "FA3RingAGAttnFunc); TE context_parallel.py AttnFuncWithCPAndKVAllGather; Llama 3 CP",
             availability=_always, flat="allgather_kv_zigzag", simulated="allgather_kv_zigzag", cpu=None),
    Baseline(name="ulysses", label="Ulysses", document_aware=True, hierarchical=False,
             source="microsoft/DeepSpeed deepspeed/sequence/layer.py (DistributedAttention); "
                    "SandAI-org/MagiAttention exps/dist_attn/baselines/ulysess.py",
             availability=_ulysses, flat="ulysses", simulated="ulysses", cpu=None),
    Baseline(name="usp", label="USP (Ulysses × ring)", document_aware=True, hierarchical=True,
             source="feifeibear/long-context-attention yunchang/hybrid/attn_layer.py (LongContextAttention); "
                    "SandAI-org/MagiAttention exps/dist_attn/baselines/usp.py",
             availability=_a2a_intra, flat="usp", simulated="usp", cpu=None),
    Baseline(name="loongtrain", label="LoongTrain 2D (head × double ring)", document_aware=True, hierarchical=True,
             source="SandAI-org/MagiAttention exps/dist_attn/baselines/loongtrain.py (InternLM/InternEvo's 2D attention)",
             availability=_a2a_intra, flat="loongtrain", simulated="loongtrain", cpu=None,
             note="modelled as USP whose ring runs as windows of one node (inner NVLink ring, outer ring across nodes)"),
    Baseline(name="hybrid_cp", label="Megatron hybrid / dynamic CP", document_aware=True, hierarchical=False,
             source="NVIDIA/Megatron-LM megatron/core/pipeline_parallel/hybrid_cp_schedule.py (BalancedCPScheduler, "
                    "PR #2282); SandAI-org/MagiAttention exps/dist_attn/baselines/hybrid_dcp.py",
             availability=_always, flat="hybrid_cp", simulated="hybrid_cp", cpu=None,
             note="per-sample CP group size (power of two, 8K tokens per rank); groups run one after another"),
    Baseline(name="distflashattn", label="DistFlashAttn (document-blind)", document_aware=False, hierarchical=False,
             source="RulinShao/LightSeq lightseq/lightseq_async_attn.py",
             availability=_even, flat="distflashattn", simulated="distflashattn", cpu=None,
             note="computes the packed batch as one causal sequence (cross-document pairs too)"),
    Baseline(name="blind_ring", label="packing (document-blind a2a+p2p)", document_aware=False, hierarchical=True,
             source="NVIDIA/Megatron-LM + TE a2a+p2p on the packed batch without cu_seqlens (the paper's Table 4 'packing')",
             availability=_a2a_intra, flat=None, simulated="blind_ring", cpu=None),
)

REGISTRY: dict[str, Baseline] = {b.name: b for b in _RECORDS}
DOCUMENT_AWARE = tuple(b.name for b in _RECORDS if b.document_aware)


def get(name: str) -> Baseline:
    """The record of ``name``; ``ConfigError`` naming the choices otherwise."""
    if name not in REGISTRY:
        raise ConfigError(f"unknown baseline {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def unavailable(name: str, *, intra: int, inter: int, shape: HeadShape) -> str | None:
    """Why baseline ``name`` cannot run at ``intra × inter`` with ``shape``, or None."""
    return get(name).availability(intra, inter, shape)
