"""Module-level cases the gloo pool runs on every rank (pickled by reference), and their helpers.

A *spec* is a plain dict (pickled to the ranks): ``cu`` (global cu_seqlens), ``intra``, ``inter``,
``heads``, ``kv_heads``, ``dim``, ``dim_v``, ``dtype`` ("float32" | "bfloat16"), ``grad_wire``
(None or the plan's ``grad_wire_dtype``), ``pool_bytes`` (None: the plan's default), ``groups``
("explicit" | "initialize" | "default" | "levels": the plan's own one-level groups), ``flatten`` (None or the plan's ``flatten``) and the global
tensors ``q``, ``k``, ``v``, ``do`` as float32 numpy arrays over the padded batch ``[T', ...]``
(bf16 values are exact in float32). Results go back as numpy too: a tensor pickled in a rank
where Megatron was imported by an earlier case would make the test process import Megatron.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_groups(intra: int, inter: int) -> tuple[Any, Any]:
    """This rank's (intra, inter) gloo groups for ``intra × inter`` over the world, built with
    ``cached_group`` in the same order on every rank (None for a size-1 side)."""
    import torch.distributed as dist

    from tests.distributed import cached_group

    rank = dist.get_rank()
    mine_intra = mine_inter = None
    if intra > 1:
        for i in range(inter):
            g = cached_group(tuple(range(i * intra, (i + 1) * intra)))
            if rank // intra == i:
                mine_intra = g
    if inter > 1:
        for j in range(intra):
            g = cached_group(tuple(range(j, intra * inter, intra)))
            if rank % intra == j:
                mine_inter = g
    return mine_intra, mine_inter


def compile_for(spec: dict) -> Any:
    from megatron_hsap.plan import compile_plan

    return compile_plan(
        spec["cu"], spec["inter"], spec["intra"], num_heads=spec["heads"], num_kv_heads=spec["kv_heads"],
        head_dim=spec["dim"], head_dim_v=spec["dim_v"], dtype_bytes=torch.tensor([], dtype=DTYPES[spec["dtype"]]).element_size(),
        **({"pool_bytes": spec["pool_bytes"]} if spec.get("pool_bytes") else {}),
        **({"window_size": tuple(spec["window"])} if spec.get("window") else {}),
        **({"head_chunks": spec["head_chunks"]} if spec.get("head_chunks") else {}),  # runtime/hsap.py pipelining
        **({"grad_wire_dtype": spec["grad_wire"]} if spec.get("grad_wire") else {}),
        **({"placement": spec["placement"]} if spec.get("placement") else {}),  # e.g. q sent to its kv's rank
        # "balanced" is forced (no fallback to contiguous), so the permuted layout is what runs
        layout=spec.get("layout", "contiguous"), **({"layout_fallback": False} if spec.get("layout") == "balanced" else {}),
        # the topology under test (plan/flatten.py may plan a batch as 1 x P: test_flatten.py)
        flatten=spec.get("flatten") or "never",
    )  # fmt: skip


def rank_inputs(spec: dict, plan: Any, rank: int) -> tuple[torch.Tensor, ...]:
    """``(idx, q, k, v, do)``: this rank's rows of the spec's global tensors (its local token indices
    under ``plan``, layout order) in the spec's dtype; q, k and v are leaves that need gradients."""
    idx = torch.from_numpy(plan.local_token_indices(rank))
    q, k, v, do = (torch.from_numpy(spec[n])[idx].to(DTYPES[spec["dtype"]]) for n in ("q", "k", "v", "do"))
    return (idx, *(x.requires_grad_(True) for x in (q, k, v)), do)


def rank_results(idx: torch.Tensor, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """This rank's rows, output and q/k/v gradients as float numpy arrays (what ``gather`` reads)."""
    return {"idx": idx.numpy(), "out": out.detach().float().numpy(), "dq": q.grad.float().numpy(),
            "dk": k.grad.float().numpy(), "dv": v.grad.float().numpy()}  # fmt: skip


def run_one(spec: dict) -> dict:
    """One spec on this rank (inside a pool worker): its plan compiled, forward and backward run on
    the spec's groups; returns this rank's outputs, gradients and byte counts for the parent to
    compare with the reference."""
    import torch.distributed as dist

    from megatron_hsap.runtime import hsap_attn_func
    from megatron_hsap.runtime.executor import receive_pool
    from megatron_hsap.runtime.hsap import runner_for

    rank = dist.get_rank()
    plan = compile_for(spec)
    idx, q, k, v, do = rank_inputs(spec, plan, rank)
    mode = spec.get("groups", "explicit")
    from tests.distributed import cached_group

    if mode == "explicit":
        intra, inter = make_groups(spec["intra"], spec["inter"])
        kwargs = {"intra_group": intra, "inter_group": inter}
        if plan.options.flattened_from is not None and not spec.get("one_group"):  # a one-level plan runs on the CP group
            kwargs["cp_group"] = cached_group(tuple(range(plan.cp_size)))
    elif mode == "levels":  # the groups the plan runs on, as HSAPGroups.levels_for names them: a
        # flattened plan's one level is the CP group (intra at P x 1, inter at 1 x P), no cp_group=
        cp = cached_group(tuple(range(plan.cp_size)))
        kwargs = {"intra_group": cp, "inter_group": None} if plan.inter_size == 1 else {"intra_group": None, "inter_group": cp}
    else:  # "initialize": initialize_hsap's groups; "default": the world for a 1×P / P×1 plan
        kwargs = {}
    if mode == "initialize":
        from megatron_hsap.megatron.parallel_state import destroy_hsap, initialize_hsap

        initialize_hsap(spec["intra"], spec["inter"])
    try:
        # the runner (and its executor) is cached per plan: a case of another module may have run
        # this plan on this worker before, so its counts start here
        runner_for(plan, device=q.device, **kwargs).reset_stats()
        out = hsap_attn_func(q, k, v, plan, softmax_scale=spec.get("scale"), **kwargs)
        out.backward(do)
        runner = runner_for(plan, device=q.device, **kwargs)
    finally:
        if mode == "initialize":
            destroy_hsap()
    ex = runner.executor
    stats = {ph.value: st.as_dict() for ph, st in ex.stats.items()}
    runner_a2a = dict(runner.a2a_bytes_sent)
    runner.reset_stats()
    return {
        **rank_results(idx, out, q, k, v),
        "stats": stats,
        "expected": {"fwd": ex.expected_bytes("fwd"), "bwd": ex.expected_bytes("bwd")},
        "a2a": runner_a2a,
        "inter_rank": ex.rank,
        "pool_numel": int(receive_pool(1, "cpu").numel()),
    }


def run_cases(specs: list[dict]) -> list[dict]:
    """Run every spec in order on every rank; one pool round-trip for many packings."""
    return [run_one(spec) for spec in specs]


# --------------------------------------------------------------------------- parent side


def build_spec(cu: list[int], *, intra: int = 1, inter: int, heads: int = 8, kv_heads: int = 8, dim: int = 8,
               dim_v: int | None = None, dtype: str = "float32", seed: int = 0, pool_bytes: int | None = None,
               groups: str = "explicit", large_logits: bool = False, layout: str = "contiguous",
               window: tuple[int, int] | None = None, grad_wire: str | None = None, flatten: str | None = None,
               one_group: bool = False) -> dict:  # fmt: skip
    """A spec with seeded global tensors over the padded batch (see the module docstring).

    ``large_logits``: small integers in q and k except a first component of 2500 in q and 4 in k,
    with ``softmax_scale = 1``: every logit is an exact fp32 integer near 1e4 (naive ``exp``
    overflows even in float64)."""
    spec = dict(cu=[int(x) for x in cu], intra=intra, inter=inter, heads=heads, kv_heads=kv_heads, dim=dim,
                dim_v=dim_v or dim, dtype=dtype, pool_bytes=pool_bytes, groups=groups, layout=layout, window=window,
                grad_wire=grad_wire, flatten=flatten, one_group=one_group,
                scale=1.0 if large_logits else None,
                # fp32 LSE near 1e4 resolves 2^-10 ≈ 1e-3: merge weights exp(lse_a - lse) and the
                # backward's P = exp(s - lse) inherit it (a single GPU kernel has the same error)
                tolerance=5e-3 if large_logits else TOLERANCE[dtype])  # fmt: skip
    padded = compile_for(spec).padded_tokens
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q": (heads, dim), "k": (kv_heads, dim), "v": (kv_heads, spec["dim_v"]), "do": (heads, spec["dim_v"])}
    for name, (h, d) in shapes.items():
        x = torch.randn(padded, h, d, generator=gen, dtype=torch.float64)
        if large_logits and name in ("q", "k"):
            x = torch.randint(-2, 3, (padded, h, d), generator=gen).double()
            x[..., 0] = 2500.0 if name == "q" else 4.0  # q·k = 1e4 + a small integer
        spec[name] = x.to(DTYPES[dtype]).float().numpy()  # values exactly representable in `dtype`
    return spec


def reference(spec: dict) -> dict[str, torch.Tensor]:
    """Float64 dense-mask reference (tests/reference.py) of the whole padded batch, with gradients."""
    from tests.reference import reference_packed

    padded = spec["q"].shape[0]
    cu = list(spec["cu"]) + ([padded] if padded > spec["cu"][-1] else [])  # padding: one extra document
    q, k, v = (torch.from_numpy(spec[n]).double().requires_grad_(True) for n in ("q", "k", "v"))
    window = spec.get("window")
    out, _ = reference_packed(q, k, v, cu, spec["scale"] or spec["dim"] ** -0.5, window[0] if window else None)
    out.backward(torch.from_numpy(spec["do"]).double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def gather(results: list[dict], name: str, padded: int) -> torch.Tensor:
    """Scatter every rank's local rows of ``name`` back to global order (each token exactly once)."""
    first = results[0][name]
    full = torch.full((padded, *first.shape[1:]), float("nan"), dtype=torch.float64)
    seen = torch.zeros(padded, dtype=torch.long)
    for r in results:
        idx = torch.from_numpy(r["idx"])
        full[idx] = torch.from_numpy(r[name]).double()
        seen[idx] += 1
    assert (seen == 1).all(), f"layout does not hold every token exactly once: counts {seen.tolist()}"
    return full


# fp32: kernels accumulate in fp32 over at most a few hundred keys; 1e-5 of the largest value
# bounds that rounding with margin. bf16: inputs are exact, outputs and gradients are rounded to
# bf16 once (2^-8 relative) after fp32 accumulation; 2e-2 of the largest value covers it.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def check_against_reference(spec: dict, results: list[dict]) -> dict[str, float]:
    """Assert out, dq, dk, dv match the float64 reference; return the max errors (scaled)."""
    ref = reference(spec)
    padded = spec["q"].shape[0]
    errors = {}
    for name in ("out", "dq", "dk", "dv"):
        got = gather(results, name, padded)
        want = ref[name]
        scale = max(1.0, float(want.abs().max())) if spec["dtype"] == "float32" else float(want.abs().max())
        err = float((got - want).abs().max()) / scale
        errors[name] = err
        assert err <= spec["tolerance"], (
            f"{name}: max error {err:.3g} (relative to {scale:.3g}) > {spec['tolerance']} for "
            f"{spec['intra']}x{spec['inter']} cu={spec['cu']} heads={spec['heads']}/{spec['kv_heads']} {spec['dtype']}"
        )
    return errors


def check_bytes(spec: dict, results: list[dict]) -> None:
    """Bytes the executors sent equal the plan's prediction exactly, per rank and phase (all head
    chunks together: ``plan/chunks.chunked_p2p_bytes``; with every chunk on its own kv heads, the
    programs' bytes); the intra all-to-all bytes equal Ulysses' volume over the same intra group."""
    from megatron_hsap.plan.chunks import chunked_p2p_bytes, kv_head_chunks
    from megatron_hsap.runtime.ulysses import ulysses_bytes

    plan = compile_for(spec)
    per_rank = plan.stats().bytes_sent_per_rank
    chunked = chunked_p2p_bytes(plan)
    shared = plan.intra_size > 1 and kv_head_chunks(plan.head_chunks, plan.shape.num_kv_heads) < plan.head_chunks
    for r in results:
        for phase in ("fwd", "bwd"):
            st = r["stats"][phase]
            sent, recv = (int(x[r["inter_rank"]]) for x in chunked[phase])
            assert (st["bytes_sent"], st["bytes_recv"]) == (sent, recv), (phase, st, sent, recv)
            if not shared:  # one pass of the programs' bytes, however many chunks
                assert (sent, recv) == tuple(r["expected"][phase]), (phase, sent, recv, r["expected"])
        total = r["stats"]["fwd"]["bytes_sent"] + r["stats"]["bwd"]["bytes_sent"]
        if not shared:
            assert total == per_rank[r["inter_rank"]], (total, per_rank, r["inter_rank"])
        if plan.intra_size > 1:  # (a 1 x P flattened plan has no all-to-all, a P x 1 one spans the CP group: plan/flatten.py)
            want = ulysses_bytes(plan.local_tokens, spec["heads"], spec["kv_heads"], spec["dim"], plan.intra_size,
                                 head_dim_v=spec["dim_v"], dtype_bytes=plan.options.dtype_bytes)  # fmt: skip
            assert r["a2a"] == {"fwd": want["fwd"], "bwd": want["bwd"]}, (r["a2a"], want)
        else:
            assert r["a2a"] == {"fwd": 0, "bwd": 0}


# --------------------------------------------------------------------------- packings


def topology_packings(intra: int, inter: int, layout: str = "contiguous") -> list[tuple[list[int], dict]]:
    """``(cu, build_spec keywords)`` of every special packing over ``intra × inter`` (32 tokens a
    rank), head shapes cycled through GQA, MLA's d_qk ≠ d_v and MHA (MHA where the intra size does
    not split a shape's heads) with ``sinks`` on every third (for the caller's spec), then a
    causal window of 5 (the suites of ``test_dropout`` and ``test_max_logits``)."""
    world = intra * inter
    total = 32 * world
    shapes = (dict(heads=8, kv_heads=2, dim=8), dict(heads=4, kv_heads=4, dim=12, dim_v=8), dict(heads=8, kv_heads=8, dim=8))
    out = []
    for n, cu in enumerate(special_packings(total, world).values()):
        heads = dict(shapes[n % len(shapes)])
        if heads["heads"] % intra or (heads["kv_heads"] % intra and intra % heads["kv_heads"]):
            heads = dict(shapes[2])
        out.append((cu, dict(intra=intra, inter=inter, seed=n, layout=layout, sinks=n % 3 == 1, **heads)))
    out.append(([0, 7, total // 2 + 3, total], dict(intra=intra, inter=inter, seed=50, window=(5, 0), layout=layout)))
    return out


def special_packings(total: int, parts: int) -> dict[str, list[int]]:
    """The named edge cases of the issue for a batch of ``total`` tokens over ``parts`` chunks."""
    chunk = total // parts
    return {
        "one_document": [0, total],
        "all_length_1": list(range(total + 1)),
        "chunk_edges": sorted({0, total, *range(chunk, total, chunk), chunk // 2}),
        "1_token_at_chunk_edge": [0, chunk - 1, chunk, chunk + 1, total] if parts > 1 else [0, 1, total],
        "empty_documents": [0, 0, 3, 3, 3, chunk + 2, total, total],
        "T_not_divisible": [0, 5, chunk + 3, total - 3],  # T' = total: 3 padding tokens
        "long_and_short": [0, 1, 2, total - 2, total - 1, total],
    }


def random_packing(total: int, rng: "np.random.Generator") -> list[int]:
    """Document lengths from a heavy-tailed mix (many short, some spanning chunks); sometimes
    empty documents and a total not divisible by the ranks."""
    lengths = []
    while sum(lengths) < total:
        kind = rng.random()
        if kind < 0.1:
            lengths.append(0)
        elif kind < 0.5:
            lengths.append(int(rng.integers(1, 8)))
        else:
            lengths.append(int(rng.lognormal(np.log(total / 6), 1.0)) + 1)
    cu = np.concatenate(([0], np.cumsum(lengths)))
    cu = np.minimum(cu, total)
    if rng.random() < 0.3:  # a ragged end: T not a multiple of P
        cu = np.minimum(cu, total - int(rng.integers(1, 5)))
    return [int(x) for x in cu]


# --------------------------------------------------------------------------- degenerate topologies


def run_degenerate(spec: dict) -> dict:
    """``hsap_attn_func`` on a ``P×1`` or ``1×P`` plan next to the method it degenerates to, on
    the same rank and inputs: hand-written Ulysses (all-to-all, ONE varlen call over the whole
    batch, all-to-all back) or ``SAPAttention`` with a freshly built executor."""
    import torch.distributed as dist

    from megatron_hsap.runtime import attn_backward, attn_forward, hsap_attn_func
    from megatron_hsap.runtime.executor import Executor
    from megatron_hsap.runtime.sap import SAPAttention
    from megatron_hsap.runtime.ulysses import expand_kv_for_intra, heads_to_seq, seq_to_heads, sum_kv_grad_for_intra

    rank = dist.get_rank()
    plan = compile_for(spec)
    dtype = DTYPES[spec["dtype"]]
    idx = torch.from_numpy(plan.local_token_indices(rank))
    q, k, v, do = (torch.from_numpy(spec[n])[idx].to(dtype) for n in ("q", "k", "v", "do"))
    intra, inter = make_groups(spec["intra"], spec["inter"])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = hsap_attn_func(*leaves, plan, intra_group=intra, inter_group=inter)
    out.backward(do)
    got = [out.detach()] + [x.grad for x in leaves]
    scale = spec["dim"] ** -0.5
    if spec["inter"] == 1:  # pure Ulysses by hand
        p = spec["intra"]
        qh = seq_to_heads(q, intra)
        kh, vh = (seq_to_heads(expand_kv_for_intra(x, p), intra) for x in (k, v))
        cu_list = list(spec["cu"]) + ([plan.padded_tokens] if plan.padded_tokens > spec["cu"][-1] else [])
        lengths = [b - a for a, b in zip(cu_list[:-1], cu_list[1:]) if b > a]
        cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                  causal=True, softmax_scale=scale)  # fmt: skip
        oh, lse = attn_forward(qh, kh, vh, **kw)
        doh = seq_to_heads(do, intra)
        delta = (doh.float() * oh.float()).sum(-1)
        dq, dk, dv = attn_backward(doh, qh, kh, vh, oh, lse, delta=delta, **kw)
        want = [heads_to_seq(oh, intra), heads_to_seq(dq.to(dtype), intra)]
        want += [sum_kv_grad_for_intra(heads_to_seq(g.to(dtype), intra).float(), x.shape[1]).to(dtype)
                 for g, x in ((dk, k), (dv, v))]  # fmt: skip
    else:  # pure SAP through the autograd Function with a fresh executor
        ex = Executor(plan, inter, "cpu")
        leaves2 = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out2 = SAPAttention.apply(*leaves2, ex, scale)
        out2.backward(do)
        want = [out2.detach()] + [x.grad for x in leaves2]
    return {"max_abs_diff": [float((a.float() - b.float()).abs().max()) for a, b in zip(got, want)]}
