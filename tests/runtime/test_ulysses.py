"""Ulysses all-to-all: exactness against a hand-made head split, autograd, GQA replication.

References are computed here in the parent process from the whole global tensors: the
sequence→heads exchange moves values without arithmetic, so the comparison is exact; attention
references are float64 dense document-causal masks written below.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_hsap.errors import ConfigError
from megatron_hsap.runtime.ulysses import (
    a2a_bytes,
    check_heads_for_intra,
    expand_kv_for_intra,
    kv_heads_for_intra,
    sum_kv_grad_for_intra,
    ulysses_bytes,
    valid_intra_sizes,
)

EXACT = dict(rtol=0.0, atol=0.0)


def _to_numpy(*tensors: torch.Tensor) -> tuple:
    """Return values from ranks as numpy: a tensor pickled in a rank where Megatron was imported
    (by an earlier case in the same pool) references ``megatron.core.safe_globals``, which would
    make this process import Megatron just to unpickle it."""
    return tuple(t.detach().numpy() for t in tensors)


def _from_numpy(results: list[tuple]) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(torch.from_numpy(a) for a in r) for r in results]

# --------------------------------------------------------------------------- single process


def test_valid_intra_sizes_mha_and_gqa():
    assert valid_intra_sizes(8) == [1, 2, 4, 8]
    assert valid_intra_sizes(8, 2) == [1, 2, 4, 8]  # 4 and 8 replicate the 2 kv heads
    # 3 and 6 divide 12 but would hand a rank q heads of two different kv groups.
    assert valid_intra_sizes(12, 4) == [1, 2, 4, 12]
    assert valid_intra_sizes(6, 1) == [1, 2, 3, 6]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "intra", "listed"),
    [(8, 8, 3, "[1, 2, 4, 8]"), (12, 4, 6, "[1, 2, 4, 12]"), (8, 2, 16, "[1, 2, 4, 8]")],
)
def test_check_heads_lists_valid_sizes(heads, kv_heads, intra, listed):
    with pytest.raises(ConfigError, match=re.escape(f"valid intra sizes: {listed}")):
        check_heads_for_intra(heads, kv_heads, intra)


def test_kv_heads_for_intra():
    assert kv_heads_for_intra(8, 2) == 8  # split, no replication
    assert kv_heads_for_intra(2, 4) == 4  # each kv head twice
    assert kv_heads_for_intra(1, 8) == 8
    with pytest.raises(ConfigError, match=r"divisors \[1, 2, 4\] or multiples of 4"):
        kv_heads_for_intra(4, 6)


@st.composite
def _gqa_shapes(draw):
    hkv = draw(st.sampled_from([1, 2, 3, 4, 8]))
    heads = hkv * draw(st.sampled_from([1, 2, 3, 4]))
    intra = draw(st.sampled_from(valid_intra_sizes(heads, hkv)))
    return heads, hkv, intra


@given(_gqa_shapes())
def test_expand_kv_keeps_standard_gqa_grouping(shape):
    heads, hkv, intra = shape
    t, d = 3, 2
    # kv head g carries the value g everywhere, so we can read back which head a slot holds.
    k = torch.arange(hkv, dtype=torch.float64).view(1, hkv, 1).expand(t, hkv, d).clone()
    kx = expand_kv_for_intra(k, intra)
    hx = kv_heads_for_intra(hkv, intra)
    assert kx.shape == (t, hx, d)
    hq_local, hkv_local = heads // intra, hx // intra
    for j in range(intra):  # rank j's q heads after the split, with the local GQA rule
        for m in range(hq_local):
            q_head = j * hq_local + m
            local_kv = j * hkv_local + m // (hq_local // hkv_local)
            assert kx[0, local_kv, 0].item() == q_head // (heads // hkv)  # standard GQA: q g·G+m -> g


def test_expand_kv_backward_sums_copies():
    k = torch.randint(-9, 9, (5, 2, 3), dtype=torch.float64, requires_grad=True)
    g = torch.randint(-9, 9, (5, 8, 3), dtype=torch.float64)
    expand_kv_for_intra(k, 8).backward(g)
    # Integer-valued float64: sums are exact in any order.
    expected = g[:, 0:4].sum(1, keepdim=True), g[:, 4:8].sum(1, keepdim=True)
    torch.testing.assert_close(k.grad, torch.cat(expected, dim=1), **EXACT)
    torch.testing.assert_close(sum_kv_grad_for_intra(g, 2), k.grad, **EXACT)


def test_a2a_bytes_counts_what_leaves_the_rank():
    t, h, d, p = 1024, 32, 128, 4
    x = torch.empty(t, h, d, dtype=torch.bfloat16)
    kept = x.numel() // p  # the chunk addressed to the rank itself never moves
    assert a2a_bytes(t, h, d, p, dtype_bytes=2) == (x.numel() - kept) * x.element_size()
    assert a2a_bytes(t, h, d, 1) == 0
    got = ulysses_bytes(t, 32, 8, 128, 8, dtype_bytes=2)  # kv replicated 8 -> 8 heads: no change
    per = t * 128 * 2 * 7 // 8
    assert got["fwd"] == per * (32 + 8 + 8 + 32) == got["bwd"]
    rep = ulysses_bytes(t, 8, 1, 128, 4, dtype_bytes=2)  # 1 kv head replicated to 4 for the exchange
    assert rep["fwd"] == t * 128 * 2 * 3 // 4 * (8 + 4 + 4 + 8)


# --------------------------------------------------------------------------- multi-rank cases


def _intra_group(intra: int):
    """Contiguous blocks of ``intra`` ranks (every rank creates every block, same order)."""
    import torch.distributed as dist

    from tests.distributed import cached_group

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, intra):
        group = cached_group(tuple(range(start, start + intra)))
        if start <= rank < start + intra:
            mine = group
    return mine


def _case_exchange(x_global: torch.Tensor, w_heads: list[torch.Tensor], intra: int):
    """seq_to_heads / heads_to_seq on this rank's rows; forward values and input gradients."""
    import torch.distributed as dist

    from megatron_hsap.runtime.ulysses import heads_to_seq, seq_to_heads

    rank, world = dist.get_rank(), dist.get_world_size()
    group = _intra_group(intra)
    t = x_global.shape[0] // world
    # A non-contiguous input (transposed storage) must work too.
    x = x_global[rank * t : (rank + 1) * t].transpose(0, 1).contiguous().transpose(0, 1)
    x.requires_grad_(True)
    y = seq_to_heads(x, group)
    back = heads_to_seq(y, group)
    (y * w_heads[rank]).sum().backward()
    # The inverse direction on its own: gradient of heads_to_seq is seq_to_heads.
    yy = y.detach().clone().requires_grad_(True)
    (heads_to_seq(yy, group) * x_global[rank * t : (rank + 1) * t]).sum().backward()
    return _to_numpy(y, back, x.grad, yy.grad)


@pytest.mark.parametrize(
    ("world", "intra"),
    [(2, 2), (4, 2), (4, 4), (2, 1), pytest.param(8, 8, marks=pytest.mark.slow), pytest.param(8, 2, marks=pytest.mark.slow)],
)
def test_exchange_is_the_hand_split(gloo_pool, world, intra):
    t, h, d = 3, 8, 5
    gen = torch.Generator().manual_seed(world * 10 + intra)
    # Integer-valued float64: the loss gradients below are exact whatever the summation order.
    x = torch.randint(-99, 99, (world * t, h, d), generator=gen).double()
    hp = h // intra
    w = [torch.randint(-99, 99, (intra * t, hp, d), generator=gen).double() for _ in range(world)]
    results = _from_numpy(gloo_pool(world).run(_case_exchange, x, w, intra))

    grad_x = torch.empty_like(x)
    for rank, (y, back, gx, gy) in enumerate(results):
        i, j = divmod(rank, intra)
        chunk = slice(i * intra * t, (i + 1) * intra * t)  # inter chunk i = all rows of node i
        heads = slice(j * hp, (j + 1) * hp)
        torch.testing.assert_close(y, x[chunk, heads], **EXACT)  # no arithmetic: exact
        torch.testing.assert_close(back, x[rank * t : (rank + 1) * t], **EXACT)
        grad_x[chunk, heads] = w[rank]  # d(Σ y·w)/dx: w scattered back to where y came from
        torch.testing.assert_close(gy, x[chunk, heads], **EXACT)
    for rank, (_, _, gx, _) in enumerate(results):
        torch.testing.assert_close(gx, grad_x[rank * t : (rank + 1) * t], **EXACT)


def _doc_causal_mask(cu_seqlens: list[int], rows: int) -> torch.Tensor:
    """[rows, rows] True where (q, k) may attend: same document and k ≤ q."""
    doc = torch.zeros(rows, dtype=torch.long)
    for n, (a, b) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        doc[a:b] = n
    pos = torch.arange(rows)
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def _dense_attention(q, k, v, mask, kv_of_head):
    """Float64 dense masked softmax attention; q head h reads kv head ``kv_of_head[h]``."""
    scale = q.shape[-1] ** -0.5
    outs = []
    for h in range(q.shape[1]):
        s = (q[:, h] @ k[:, kv_of_head[h]].T) * scale
        s = s.masked_fill(~mask, float("-inf"))
        outs.append(torch.softmax(s, dim=-1) @ v[:, kv_of_head[h]])
    return torch.stack(outs, dim=1)


def _case_ulysses_attention(q_g, k_g, v_g, do_g, cu_seqlens):
    """Pure Ulysses over the world: a2a, local dense attention on this rank's heads, a2a back."""
    import torch.distributed as dist

    from megatron_hsap.runtime.ulysses import expand_kv_for_intra, heads_to_seq, seq_to_heads

    rank, world = dist.get_rank(), dist.get_world_size()
    group = _intra_group(world)
    t = q_g.shape[0] // world
    rows = slice(rank * t, (rank + 1) * t)
    q, k, v = (x[rows].clone().requires_grad_(True) for x in (q_g, k_g, v_g))
    qh = seq_to_heads(q, group)
    kh = seq_to_heads(expand_kv_for_intra(k, world), group)
    vh = seq_to_heads(expand_kv_for_intra(v, world), group)
    group_size = qh.shape[1] // kh.shape[1]  # q heads per kv head on this rank
    kv_of_head = [m // group_size for m in range(qh.shape[1])]
    oh = _dense_attention(qh, kh, vh, _doc_causal_mask(cu_seqlens, qh.shape[0]), kv_of_head)
    out = heads_to_seq(oh, group)
    (out * do_g[rows]).sum().backward()
    return _to_numpy(out, q.grad, k.grad, v.grad)


def _random_cu_seqlens(total: int, gen: torch.Generator) -> list[int]:
    cuts = sorted(torch.randint(0, total + 1, (4,), generator=gen).tolist())
    return [0, *cuts, total]  # repeated cuts make empty documents, which are legal


@pytest.mark.parametrize(
    ("world", "kv_heads"),
    [
        (2, 8), (2, 2), (2, 1), (4, 8), (4, 2), (4, 1),
        pytest.param(8, 8, marks=pytest.mark.slow),
        pytest.param(8, 2, marks=pytest.mark.slow),
        pytest.param(8, 1, marks=pytest.mark.slow),
    ],
)
def test_ulysses_attention_matches_dense_reference(gloo_pool, world, kv_heads):
    heads, d, t = 8, 4, 5
    total = world * t
    gen = torch.Generator().manual_seed(100 * world + kv_heads)
    q = torch.randn(total, heads, d, generator=gen, dtype=torch.float64)
    k = torch.randn(total, kv_heads, d, generator=gen, dtype=torch.float64)
    v = torch.randn(total, kv_heads, d, generator=gen, dtype=torch.float64)
    do = torch.randn(total, heads, d, generator=gen, dtype=torch.float64)
    cu = _random_cu_seqlens(total, gen)
    results = _from_numpy(gloo_pool(world).run(_case_ulysses_attention, q, k, v, do, cu))

    ref_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
    kv_of_head = [h // (heads // kv_heads) for h in range(heads)]  # standard GQA grouping
    ref = _dense_attention(*ref_in, _doc_causal_mask(cu, total), kv_of_head)
    ref.backward(do)
    got = [torch.cat([r[n] for r in results]) for n in range(4)]
    # float64 with the same per-head math; only the order of the GQA gradient sums differs.
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[0], ref.detach(), **tol)
    for g, x in zip(got[1:], ref_in):
        torch.testing.assert_close(g, x.grad, **tol)


def _case_bad_heads(intra: int) -> str:
    import torch.distributed as dist

    from megatron_hsap.runtime.ulysses import seq_to_heads

    group = _intra_group(intra)
    calls = []
    real = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **kw: calls.append(a)  # must never be reached
    try:
        seq_to_heads(torch.zeros(2, 6, 3), group)
    except ConfigError as exc:
        return f"{exc} | collectives issued: {len(calls)}"
    finally:
        dist.all_to_all_single = real
    return "no error"


def test_heads_not_divisible_raise_before_exchange(gloo_pool):
    pool = gloo_pool(4)
    for message in pool.run(_case_bad_heads, 4):
        assert "valid intra sizes (P_intra): [1, 2, 3, 6]" in message
        assert message.endswith("collectives issued: 0")
