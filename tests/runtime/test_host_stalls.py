"""No host stalls on the GPU path (issue 16 item 3), tested through its logic units on CPU.

* the watchdog keeps the deadline of device-waited rounds: it fires a ``CommunicationError``
  naming the round when a peer never posts (gloo, ``device_wait=True``: the host does not wait),
  sleeps until deadlines instead of polling (its wake-ups are counted), drops rounds that completed;
* a plan's kernel-call metadata is uploaded once (one packed copy for both phases), not per call;
* batch sharding of a host batch reads no device tensor (``.item()``/``.cpu()``/``.tolist()``/
  ``.numpy()`` counted, on the data-less ``meta`` device where any read would fail) and moves its
  tensors with one non-blocking copy;
* the plan handshake runs once per plan, before the plan's first round;
* ``kept_layout`` gives the same layout for estimates a few ulps apart.

No wall-clock asserts: deadlines are configured (1 s), every ``pool.run`` has a 30 s case timeout,
and what is checked are counts, orders and messages.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from megatron_hsap.errors import CommunicationError
from megatron_hsap.plan.balanced import kept_layout
from megatron_hsap.plan.ir import Phase
from megatron_hsap.runtime import watchdog as watchdog_mod
from megatron_hsap.runtime.watchdog import Watchdog
from tests.configured import compile_plan  # the configured topology (flatten="never")

CASE_TIMEOUT = 30.0


# --------------------------------------------------------------------------- rank-side cases


def case_peer_never_posts() -> dict:
    """Rank 0 device-waits a round whose peer (rank 1) never posts; what its watchdog reports."""
    import torch.distributed as dist

    from megatron_hsap.runtime.p2p import P2PChannel, Transfer

    rank = dist.get_rank()
    group = dist.new_group([0, 1], backend="gloo")  # fresh: the abandoned recv dies with it
    if rank == 1:
        time.sleep(3.0)  # alive past rank 0's deadline, and never posts
        return {}
    fired: list[tuple[str, object]] = []
    dog = Watchdog(on_fire=lambda err, g: fired.append((str(err), g)))
    chan = P2PChannel(group, timeout_s=1.0, phase="fwd", device_wait=True, watchdog=dog)
    chan.post(7, [Transfer(False, torch.zeros(4), 1, "kv[0:4) k rows"), Transfer(False, torch.zeros(4), 1, "kv[0:4) v rows")],
              stage="stage 3")  # fmt: skip
    chan.wait(7)  # returns at once: the round is the watchdog's now
    in_flight_after_wait = chan.in_flight
    err = dog.wait_fired(20.0)
    raised = None
    try:
        chan.post(8, [])  # the next channel call raises the fired error on this thread
    except CommunicationError as exc:
        raised = str(exc)
    again = "no error"
    try:
        chan.close()
    except CommunicationError as exc:  # pragma: no cover - must not raise twice
        again = str(exc)
    return {
        "fired": str(err) if err is not None else None, "raised": raised, "again": again,
        "on_fire": len(fired), "on_fire_group": fired[0][1] is group if fired else None,
        "in_flight_after_wait": in_flight_after_wait, "device_waits": chan.device_waits,
        "wakeups": dog.wakeups, "filed": dog.rounds_filed,
    }  # fmt: skip


def case_handshake_then_rounds(cu: list[int]) -> dict:
    """Indices each P2P post carried, in order, over two forwards and a backward of one plan;
    the metadata uploads the executor made; whether the hash existed before the first round."""
    import torch.distributed as dist

    from megatron_hsap.plan import clear_plan_cache
    from megatron_hsap.runtime import p2p
    from megatron_hsap.runtime.executor import Executor
    from megatron_hsap.runtime.handshake import forget_agreements, handshake_count
    from megatron_hsap.runtime.upload import upload_count

    clear_plan_cache()
    forget_agreements()
    group = dist.new_group([0, 1], backend="gloo")
    plan = compile_plan(cu, 2, 1, num_heads=2, head_dim=4, dtype_bytes=4)
    before = upload_count()
    ex = Executor(plan, group, "cpu")
    uploads = upload_count() - before
    hashed_at_build = "hash" in plan.__dict__
    posted: list[int] = []
    original = p2p.P2PChannel.post

    def recording(self: Any, index: int, transfers: Any, **kw: Any) -> None:
        posted.append(index)
        return original(self, index, transfers, **kw)

    p2p.P2PChannel.post = recording  # type: ignore[method-assign]
    try:
        exchanges = handshake_count()
        t = plan.chunk_tokens
        gen = torch.Generator().manual_seed(dist.get_rank())
        q, k, v = (torch.randn(t, 2, 4, generator=gen) for _ in range(3))
        for _ in range(2):
            out, lse = ex.forward(q, k, v, 0.5)
        ex.backward(torch.randn_like(out), q, k, v, out, lse, 0.5)
        exchanges = handshake_count() - exchanges
    finally:
        p2p.P2PChannel.post = original  # type: ignore[method-assign]
    return {"posted": posted, "uploads": uploads, "hashed_at_build": hashed_at_build, "exchanges": exchanges,
            "control": list(p2p.CONTROL_ROUNDS), "rounds": ex.stats[Phase.FWD].rounds + ex.stats[Phase.BWD].rounds}  # fmt: skip


def case_batch_function_agrees(args: tuple[list[int], str]) -> dict:
    """Handshake exchanges made by batch sharding under HSAP groups (2×2), then by the attention
    (``flatten``: the 2x2 topology's plan, or one flattened to 1 x 4 on the CP group)."""
    cu, flatten = args
    import torch.distributed as dist

    from megatron_hsap.megatron.batch import get_batch_on_this_cp_rank
    from megatron_hsap.megatron.parallel_state import destroy_hsap, initialize_hsap
    from megatron_hsap.runtime import hsap_attn_func
    from megatron_hsap.runtime.handshake import forget_agreements, handshake_count

    forget_agreements()
    initialize_hsap(intra_size=2, inter_size=2, node_check="off")
    try:
        n0 = handshake_count()
        got = get_batch_on_this_cp_rank({"tokens": torch.arange(cu[-1]).unsqueeze(0), "cu_seqlens": torch.tensor(cu)},
                                        plan_kwargs=dict(num_heads=4, num_kv_heads=2, head_dim=8, dtype_bytes=4, flatten=flatten))  # fmt: skip
        assert (got["plan"].options.flattened_from is not None) is (flatten == "always")
        n1 = handshake_count()
        t = got["tokens"].shape[1]
        gen = torch.Generator().manual_seed(dist.get_rank())
        q = torch.randn(t, 4, 8, generator=gen, requires_grad=True)
        k, v = (torch.randn(t, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
        hsap_attn_func(q, k, v, got["plan"]).sum().backward()
        n2 = handshake_count()
    finally:
        destroy_hsap()
    return {"in_batch_function": n1 - n0, "in_attention": n2 - n1}


# --------------------------------------------------------------------------- the watchdog


def test_watchdog_fires_naming_the_round_when_the_peer_never_posts(gloo_pool):
    got = gloo_pool(2).run(case_peer_never_posts, timeout=CASE_TIMEOUT)[0]
    msg = got["fired"]
    assert msg is not None, "the watchdog never fired"
    assert msg.startswith("P2P round 7 (fwd stage 3) on group rank 0: recv from peer 1 (group rank), tensor kv[0:4) k rows, "), msg
    assert "did not complete within 1 s (device-waited; watchdog)" in msg and "still outstanding: recv from peer 1 kv[0:4) v rows" in msg
    assert got["raised"] == msg  # surfaced on the training thread by the next channel call ...
    assert got["again"] == "no error"  # ... once
    assert got["on_fire"] == 1 and got["on_fire_group"] is True  # the abort hook got the round's group
    assert got["in_flight_after_wait"] is None and got["device_waits"] == 1 and got["filed"] == 1
    # it slept until the deadline (a sleep(1e-4) poll would wake thousands of times in 1 s)
    assert 1 <= got["wakeups"] <= 3, got


class _Work:
    """A stand-in for a torch.distributed work: completed or not, and how often it was asked."""

    def __init__(self, done: bool) -> None:
        self.done, self.queries = done, 0

    def is_completed(self) -> bool:
        self.queries += 1
        return self.done


class _Clock:
    """A fake clock the test advances by hand: no assertion depends on the machine's load."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_watchdog_drops_completed_rounds_and_fires_only_late_ones():
    fired: list[str] = []
    clock = _Clock()
    dog = Watchdog(on_fire=lambda err, g: fired.append(str(err)), clock=clock, thread=False)
    done, late = _Work(True), _Work(False)
    dog.watch([done], clock.now + 2.0, lambda: CommunicationError("round 1 late"))
    dog.watch([late], clock.now + 4.0, lambda: CommunicationError("round 2 late"))
    dog.check()  # nothing fired yet: check is a no-op (nor does watch query the works)
    assert dog.fire_due() == 0 and done.queries == 0 and late.queries == 0  # nothing due yet
    clock.now += 2.5
    assert dog.fire_due() == 1 and fired == [] and dog.pending == 1  # round 1 completed: dropped
    assert done.queries == 1 and late.queries == 0
    dog.check()  # still nothing to raise
    clock.now += 2.0
    assert dog.fire_due() == 1
    assert fired == ["round 2 late"] and str(dog.wait_fired(0.0)) == "round 2 late"
    assert dog.pending == 0 and done.queries == 1 and late.queries == 1  # each asked once, at its deadline
    with pytest.raises(CommunicationError, match="round 2 late"):
        dog.check()
    dog.check()  # reported once
    assert dog.fire_due() == 0 and fired == ["round 2 late"]


def test_watchdog_thread_fires_on_the_injected_clock():
    # the thread path with a clock already past the deadline: it fires without sleeping on it
    fired: list[str] = []
    clock = _Clock()
    dog = Watchdog(on_fire=lambda err, g: fired.append(str(err)), clock=clock)
    dog.watch([_Work(False)], clock.now - 1.0, lambda: CommunicationError("overdue"))
    assert str(dog.wait_fired(60.0)) == "overdue" and fired == ["overdue"]


def test_watchdog_prunes_completed_rounds_when_many_are_filed(monkeypatch):
    monkeypatch.setattr(watchdog_mod, "_PRUNE_AT", 8)
    clock = _Clock()
    dog = Watchdog(on_fire=lambda err, g: None, clock=clock, thread=False)
    works = [_Work(True) for _ in range(50)]
    for w in works:
        dog.watch([w], clock.now + 3600.0, lambda: CommunicationError("never"))
    assert dog.pending <= 8 and dog.rounds_filed == 50
    assert all(w.queries <= 1 for w in works[:-1]) and works[-1].queries == 0  # pruning asks each once
    left = dog.pending
    clock.now += 3601.0
    assert dog.fire_due() == left and dog.pending == 0  # the survivors are checked at their deadline


def test_watchdog_thread_sleeps_while_nothing_is_due():
    clock = _Clock()
    dog = Watchdog(on_fire=lambda err, g: None, clock=clock)  # the thread sleeps an hour on it
    far = clock.now + 3600.0
    for _ in range(20):
        dog.watch([_Work(True)], far, lambda: CommunicationError("never"))
    assert dog.wakeups == 0  # filing rounds with later deadlines never wakes the thread


# --------------------------------------------------------------------------- plan metadata and the handshake


def test_plan_metadata_is_uploaded_once_and_matches_the_items():
    from megatron_hsap.runtime.executor import executor_for
    from megatron_hsap.runtime.prepared import ComputeCalls
    from megatron_hsap.runtime.upload import upload_count

    cu = [0, 3, 3, 10, 11, 20, 26, 40]
    plan = compile_plan(cu, 1, 1, num_heads=2, head_dim=4, dtype_bytes=4)
    before = upload_count()
    ex = executor_for(plan, None, "cpu", backend="cpu")
    assert executor_for(plan, None, "cpu", backend="cpu") is ex
    assert upload_count() - before == 1  # both phases, every call: one packed upload, once per plan
    calls = [c for prep in (ex._fwd, ex._bwd) for step in prep.steps if isinstance(step, ComputeCalls) for c in step.calls]
    assert calls
    storages = {c.cu_q.untyped_storage().data_ptr() for c in calls} | {c.cu_k.untyped_storage().data_ptr() for c in calls}
    assert len(storages) == 1  # views of one buffer
    for c in calls:  # against the items themselves
        assert c.cu_q.dtype == torch.int32 and c.cu_q.tolist() == [0, *np.cumsum([len(it.q) for it in c.items])]
        assert c.cu_k.tolist() == [0, *np.cumsum([len(it.kv) for it in c.items])]
        assert c.max_q == max(len(it.q) for it in c.items) and c.max_k == max(len(it.kv) for it in c.items)


def test_handshake_runs_once_per_plan_before_its_first_round(gloo_pool):
    cu = [0, 30, 37]  # the long document spans both ranks: its kv must travel
    for got in gloo_pool(2).run(case_handshake_then_rounds, cu, timeout=CASE_TIMEOUT):
        control = got["control"]
        assert got["hashed_at_build"] and got["uploads"] == 1 and got["exchanges"] == 1
        posted = got["posted"]
        assert posted[0] == control[0] and posted.count(control[0]) == 1, posted  # first, and only once
        assert not any(i in control for i in posted[1:])
        assert got["rounds"] > 0 and len(posted) - 1 == got["rounds"]  # then exactly the plan's rounds


@pytest.mark.parametrize(("flatten", "exchanges"), [("never", 2), ("always", 1)])
def test_batch_sharding_runs_the_handshake_so_the_attention_waits_on_none(gloo_pool, flatten, exchanges):
    results = gloo_pool(4).run(case_batch_function_agrees, ([0, 9, 30, 41], flatten), timeout=120)
    # one exchange per group (inter, then intra; a flattened plan: the CP group it runs on) in the
    # batch function; none left for the layer
    assert results == [{"in_batch_function": exchanges, "in_attention": 0}] * 4, results


# --------------------------------------------------------------------------- batch sharding


def test_batch_sharding_of_a_host_batch_never_reads_the_device(monkeypatch):
    from megatron_hsap.megatron.batch import get_batch_on_this_cp_rank
    from megatron_hsap.runtime.upload import upload_count

    cu = [0, 7, 9, 30, 33]
    plan = compile_plan(cu, 2, 1, num_heads=2, head_dim=4, dtype_bytes=4)
    gen = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, 100, (1, 33), generator=gen), "labels": torch.randint(0, 100, (1, 33), generator=gen),
             "loss_mask": (torch.rand(1, 33, generator=gen) > 0.3).float(), "cu_seqlens": torch.tensor(cu)}  # fmt: skip
    host = [get_batch_on_this_cp_rank(batch, plan=plan, cp_rank=r, check_group=False) for r in range(2)]

    reads: list[str] = []
    blocking: list[str] = []

    def counting(name: str) -> Any:
        original = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.device.type != "cpu":
                reads.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("item", "cpu", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    original_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        target = next((a for a in args if isinstance(a, (str, torch.device))), kwargs.get("device"))
        if target is not None and torch.device(target).type != "cpu" and self.device.type == "cpu" and not kwargs.get("non_blocking"):
            blocking.append(f"{tuple(self.shape)} {self.dtype}")
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    for r in range(2):
        before = upload_count()
        dev = get_batch_on_this_cp_rank(batch, plan=plan, cp_rank=r, check_group=False, device="meta")
        assert upload_count() - before == 1  # tokens, labels, loss mask, positions, cu_seqlens: one copy
        assert reads == [] and blocking == [], (reads, blocking)
        ref = host[r]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert dev[key].device.type == "meta" and dev[key].shape == ref[key].shape and dev[key].dtype == ref[key].dtype
        p_dev, p_ref = dev["packed_seq_params"], ref["packed_seq_params"]
        assert p_dev.cu_seqlens_q.dtype == p_ref.cu_seqlens_q.dtype and p_dev.hsap_position_ids.device.type == "meta"
        assert dev["num_loss_tokens"] == ref["num_loss_tokens"] == int(batch["loss_mask"].sum())

    # the host results themselves, against an independent gather
    ids = [plan.local_token_indices(r) for r in range(2)]
    for r in range(2):
        real = ids[r] < 33
        want = np.where(real, batch["tokens"][0].numpy()[np.where(real, ids[r], 0)], 0)
        assert host[r]["tokens"][0].numpy().tolist() == want.tolist()


# --------------------------------------------------------------------------- the layout fallback


def test_kept_layout_is_the_same_for_estimates_a_few_ulps_apart():
    rng = np.random.default_rng(0)
    cases = [(1.0, 1.0, 0.5), (1.01, 0.9, 1.0), (2e-3, 2e-3, 1e-3), (0.37, 0.37, 0.2)]  # ties and the 1% edge
    for _ in range(300):
        bound = float(10 ** rng.uniform(-4, 0))
        c = bound * float(rng.uniform(1.0, 1.3))
        cases.append((c, c * float(rng.choice([1.0, rng.uniform(0.9, 1.1)])), bound))
    for c, b, bound in cases:
        want = kept_layout(c, b, bound)
        for step in (np.inf, -np.inf):
            nudged = [float(np.nextafter(np.nextafter(x, step), step)) for x in (c, b, bound)]  # two ulps
            assert kept_layout(*nudged) == want, (c, b, bound, step)
            assert kept_layout(c, nudged[1], bound) == want and kept_layout(nudged[0], b, bound) == want
        assert kept_layout(c, None, bound) in ("contiguous", "balanced")
    # and the rule itself: faster contiguous kept, ties and faster balanced give balanced
    assert kept_layout(1.0, 0.99, 0.5) == "balanced" and kept_layout(1.0, 1.01, 0.5) == "contiguous"
    assert kept_layout(1.0, 1.0, 0.5) == "balanced" and kept_layout(1.005, 2.0, 1.0) == "contiguous"
