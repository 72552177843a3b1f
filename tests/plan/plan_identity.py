"""Plan identity across planner changes: the check every compile-time speed-up must pass.

Compiles the benchmark batches (Table 2, Table 4, MagiAttention: ``sim.estimate_accuracy.cases``),
the compile-budget batches (fineweb 64K / P 8 and 1M / P 64, both layout modes), the plan-quality
grid (2 seeds), the 1,024-GPU scale batches, three one-document batches and 35 windowed batches
with one source tree, and records per plan its hash (``fingerprint.plan_hash``), chosen time,
layout, placement, head chunks and estimated layer time (``Plan.layer_time``), plus the work it
took (code generations and stagings: a speed-up must not make any plan do more) and its CPU
seconds. Compare two trees' files:

    git worktree add /tmp/base <old commit>
    python -m tests.plan.plan_identity record /tmp/base /tmp/old.json [--sets bench budget ...]
    python -m tests.plan.plan_identity record . /tmp/new.json
    python -m tests.plan.plan_identity compare /tmp/old.json /tmp/new.json

About 3 minutes per tree with 2 jobs on 2 cores (``--jobs``). The regression fixtures
(``tests.plan.plan_regression_cases --check``) are the quick check; this is the wide one.

A change meant to change plans (a planner rule, not a speed-up) is judged by the same two files:
``compare`` also prints, per set, how the estimated layer time moved (``quality``: plans better
and worse by more than 0.5%, the geometric mean of new / old over every plan of the set, the
worst ratios) — the estimate is within ~1% of the simulator on the benchmark batches
(``sim/estimate_accuracy.py``), so simulate what it flags before shipping.

``--sets fuzz`` (not in the default sets; about 10 minutes per tree and job) adds 300 random
``compile_plan`` inputs (``--fuzz-seed``; batches of 64 to 262K tokens and 1 to 100 documents,
P_inter 1-64, P_intra 1-8, MHA / GQA / MQA / MLA, fp32, windows, pools, flatten modes, layouts,
placements, padding, head chunks): each plan is also checked (``Plan.verify``, pool peaks within
the pool, every document's pairs computed once); an error must be an ``HSAPError``, and a compile
past 40 s of CPU is recorded as a timeout, which ``compare`` leaves out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

SETS = ("bench", "budget", "grid", "scale", "onedoc", "window", "fuzz")
DEFAULT_SETS = SETS[:-1]
_FUZZ_CASES = 300
_FUZZ_CPU_S = 40.0  # a fuzz compile past this much CPU is cut (one-level SAP over 256+ ranks takes minutes)


def fuzz_case(rng) -> tuple[list[int], int, int, dict]:
    """One random ``(cu_seqlens, inter, intra, options)``."""
    T = rng.choice([1024, 4096, 16384, 65536, 131072, 262144])
    if rng.random() < 0.3:
        T = rng.randrange(64, 70000)
    ndoc = rng.choice([1, 1, 2, 3, 5, 10, 30, 100])
    cu = [0] + (sorted(rng.sample(range(1, T), min(ndoc - 1, T - 1))) if ndoc > 1 else []) + [T]
    if rng.random() < 0.1:  # an empty document
        i = rng.randrange(len(cu))
        cu.insert(i, cu[i])
    inter = rng.choice([1, 2, 3, 4, 5, 8, 8, 12, 16, 16, 32, 64])
    intra = rng.choice([1, 1, 2, 4, 8])
    heads = rng.choice([(32, 8), (32, 32), (64, 8), (16, 16), (8, 1), (128, 128)])
    kw: dict = dict(num_heads=heads[0], num_kv_heads=heads[1], head_dim=rng.choice([64, 128, 128]))
    for p, key, choices in ((0.15, "mla", None), (0.2, "dtype_bytes", [4]), (0.5, "hardware", ["a100", "h100", "h100-fa3"]),
                            (0.3, "link", ["nvlink", "ib"]), (0.2, "grad_wire_dtype", ["fp32", "activation"]),
                            (0.3, "window_size", [(w, 0) for w in (0, 1, 16, 128, 1000, 4096)]),
                            (0.15, "pool_bytes", [64 << 10, 1 << 20, 4 << 20, 32 << 20]),
                            (0.4, "flatten", ["never", "always", "all-to-all", "auto"]), (0.2, "layout", ["contiguous", "balanced"]),
                            (0.1, "placement", ["owner-computes", "min-traffic"]), (0.1, "pad_multiple", [2, 4]),
                            (0.1, "head_chunks", [1, 2, 4]), (0.1, "layout_fallback", [False])):
        if rng.random() < p:
            if key == "mla":
                kw.update(head_dim=192, head_dim_v=128)
            else:
                kw[key] = rng.choice(choices)
    return cu, inter, intra, kw


def jobs(sets: tuple[str, ...], fuzz_seed: int = 21) -> list[tuple[str, list[int], int, dict]]:
    """``(name, cu_seqlens, inter_size, compile_plan options)`` of every plan of ``sets``."""
    from megatron_hsap.bench.plan_quality import HEADS, INTER, TOKENS, WORKLOADS, grid
    from megatron_hsap.plan.workloads import pack_batches
    from megatron_hsap.sim.estimate_accuracy import cases
    from megatron_hsap.sim.methods import full_shape

    out = []
    gqa = dict(num_heads=32, num_kv_heads=8, head_dim=128)
    if "bench" in sets:
        for c in cases("all", 3, 64):
            sh = full_shape(*c.heads)
            hw = c.hardware if c.hardware in ("a100", "h100", "h100-fa3") else "a100"  # as sim.methods.hsap_plan
            out.append((f"bench {c.table} {c.label}", list(c.cu), c.inter,
                        dict(intra_size=c.intra, num_heads=sh.num_heads, num_kv_heads=sh.num_kv_heads, head_dim=sh.head_dim,
                             dtype_bytes=sh.dtype_bytes, hardware=hw, **dict(c.options))))
    if "budget" in sets:
        for T, P in ((64 * 1024, 8), (1 << 20, 64)):
            for b, cu in enumerate(pack_batches("fineweb", T, 6, 12345)[:5]):
                for layout in ("contiguous", "balanced"):
                    out.append((f"budget {T} {P} b{b} {layout}", [int(x) for x in cu], P, dict(gqa, hardware="a100", layout=layout)))
    if "grid" in sets:
        for pt in grid(False, 2, 1, WORKLOADS, TOKENS, INTER, list(HEADS)):
            hq, hkv = HEADS[pt.heads]
            for s in pt.seeds:
                cu = pack_batches(pt.workload, pt.T, 1, s)[0]
                out.append((f"grid {pt.workload} {pt.T} {pt.P} {pt.heads} {pt.link} s{s}", [int(x) for x in cu], pt.P,
                            dict(num_heads=hq, num_kv_heads=hkv, head_dim=128, hardware="a100", link=pt.link)))
    big = dict(intra_size=8, num_heads=64, num_kv_heads=8, head_dim=128)
    if "scale" in sets:
        for T in (1 << 20, 2 << 20, 4 << 20):
            cu = [int(x) for x in pack_batches("slimpajama", T, 1, 0)[0]]
            for name, o in (("contiguous", {"layout": "contiguous"}), ("balanced", {"layout_fallback": False}), ("kept", {})):
                out.append((f"scale {T} {name}", cu, 128, dict(big, hardware="h100-fa3", **o)))
    if "onedoc" in sets:
        for T, P in ((1 << 20, 128), (1 << 20, 64), (1 << 18, 64)):
            out.append((f"onedoc {T} {P}", [0, T], P, dict(big, hardware="h100", flatten="never")))
    if "window" in sets:
        for wl in ("fineweb", "slimpajama", "full"):
            for T, P, w in ((65536, 8, 4096), (65536, 8, 128), (262144, 16, 4096), (1 << 20, 64, 4096), (16384, 4, 512)):
                for s, cu in enumerate(pack_batches(wl, T, 1 if wl == "full" else 3, 7)):
                    out.append((f"window {wl} {T} {P} w{w} s{s}", [int(x) for x in cu], P,
                                dict(gqa, hardware="h100", window_size=(w, 0))))
    if "fuzz" in sets:
        import random

        rng = random.Random(fuzz_seed)
        for n in range(_FUZZ_CASES):
            cu, inter, intra, kw = fuzz_case(rng)
            out.append((f"fuzz {fuzz_seed}:{n}", cu, inter, dict(kw, intra_size=intra)))
    return out


_COUNTS = [0, 0]  # code generations and stagings of the plan being compiled (per worker process)


def _count_work() -> None:
    """Wrap ``generate`` and ``_stage`` to count calls (once per worker)."""
    import megatron_hsap.plan.candidates as candidates
    import megatron_hsap.plan.schedule as schedule

    gen, stage = candidates.generate, schedule._stage

    def counted_gen(*a, **k):
        _COUNTS[0] += 1
        return gen(*a, **k)

    def counted_stage(*a, **k):
        _COUNTS[1] += 1
        return stage(*a, **k)

    candidates.generate, schedule._stage = counted_gen, counted_stage


def _check(p, cu: list[int], kw: dict) -> None:
    """A fuzz plan's checks: it verifies, its pool peaks fit, and every pair is computed once."""
    from megatron_hsap.plan.window import doc_pairs

    p.verify()
    for ph in (p.chosen.fwd, p.chosen.bwd):
        peak = max(ph.pool_peak, default=0)
        assert peak <= p.pool_capacity, ("pool", peak, p.pool_capacity)
    left = kw["window_size"][0] if kw.get("window_size") else -1
    pad = p.padded_tokens - cu[-1]  # (the padding is one document of its own)
    want = sum(doc_pairs(b - a, left) for a, b in zip(cu, cu[1:]) if b > a) + (doc_pairs(pad, left) if pad > 0 else 0)
    assert sum(u.work for u in p.chosen.units) == want, "work"


class _Timeout(Exception):
    pass


def _cut_off(*_) -> None:
    raise _Timeout()


def _one(job: tuple[str, list[int], int, dict]) -> tuple[str, list]:
    import signal

    from megatron_hsap.errors import HSAPError
    from megatron_hsap.plan.fingerprint import plan_hash
    from megatron_hsap.plan.plan import clear_plan_cache, compile_plan

    name, cu, P, kw = job
    fuzz = name.startswith("fuzz ")
    _COUNTS[:] = [0, 0]
    clear_plan_cache()
    t0 = time.process_time()
    if fuzz:
        signal.signal(signal.SIGVTALRM, _cut_off)
        signal.setitimer(signal.ITIMER_VIRTUAL, _FUZZ_CPU_S)
    try:
        p = compile_plan(cu, P, **kw)
        got = [str(plan_hash(p)), repr(p.chosen.time), p.layout.name, p.chosen.name, p.head_chunks, repr(p.layer_time)]
        if fuzz:
            _check(p, cu, kw)
    except _Timeout:
        got = ["timeout"]
    except Exception as e:  # recorded: an error must stay the same error (a fuzz error must be an HSAPError)
        got = [("" if not fuzz or isinstance(e, HSAPError) else "NOT AN HSAPError ") + f"{type(e).__name__}: {str(e)[:200]}"]
    finally:
        if fuzz:
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
    return name, got + [list(_COUNTS), time.process_time() - t0]


def _init(tree: str) -> None:
    if sys.path[0] != tree:
        sys.path.insert(0, tree)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"


def _init_worker(tree: str) -> None:
    _init(tree)
    _count_work()  # (in the workers only: forked from the parent, they would otherwise count twice)


def record(tree: str, out: str, sets: tuple[str, ...], n_jobs: int, fuzz_seed: int = 21) -> None:
    """Compile every plan of ``sets`` with the package in ``tree``; write ``{name: [...]}`` to ``out``."""
    tree = os.path.abspath(tree)
    _init(tree)
    todo = jobs(sets, fuzz_seed)
    print(f"{len(todo)} plans from {tree}", flush=True)
    t0 = time.time()
    with ProcessPoolExecutor(n_jobs, initializer=_init_worker, initargs=(tree,)) as ex:
        got = dict(ex.map(_one, todo, chunksize=1))
    with open(out, "w") as f:
        json.dump(got, f, indent=0)
    print(f"wrote {out} in {time.time() - t0:.0f} s")


def compare(old_path: str, new_path: str) -> int:
    """Print the plans that differ and the work per set; exit status 1 when any plan differs."""
    with open(old_path) as f:
        old = json.load(f)
    with open(new_path) as f:
        new = json.load(f)
    cut = [k for k in old if k in new and "timeout" in (old[k][0], new[k][0])]  # (fuzz: past its CPU cap)
    differ = [k for k in old if k not in cut and (k not in new or old[k][:-2] != new[k][:-2])]
    bad = [k for k in new if "NOT AN HSAPError" in new[k][0] or new[k][0].startswith("AssertionError")]
    print(f"{len(old)} plans, {len(differ)} differ" + (f", {len(cut)} past the fuzz CPU cap in one tree (not compared)" if cut else ""))
    for k in bad[:20]:
        print(f"  FAILED {k}: {new[k][0]}")
    for k in differ[:20]:
        print(f"  {k}: {old[k][:-2]} -> {new[k][:-2] if k in new else 'missing'}")
    for s in SETS:
        ks = [k for k in old if k.startswith(s + " ") and k in new and k not in cut]
        if ks:
            g = [sum(d[k][-2][i] for k in ks) for d in (old, new) for i in (0, 1)]
            cpu = [sum(d[k][-1] for k in ks) for d in (old, new)]
            print(f"{s}: {len(ks)} plans, generate {g[0]} -> {g[2]}, stagings {g[1]} -> {g[3]}, cpu {cpu[0]:.1f} -> {cpu[1]:.1f} s")
    for line in quality(old, new, cut):
        print(line)
    more = [k for k in old if k in new and k not in cut and any(b > a for a, b in zip(old[k][-2], new[k][-2]))]
    print(f"plans doing more work: {len(more)}", *(f"\n  {k}: {old[k][-2]} -> {new[k][-2]}" for k in more[:10]))
    return 1 if differ or bad else 0


_LAYER = 5  # a record's estimated layer time (repr); older records end before it
_QUALITY_BAND = 0.005  # a plan counts as better or worse past this relative change of its layer time


def quality(old: dict, new: dict, cut: list[str] = ()) -> list[str]:
    """Per set, how the estimated layer time moved from ``old`` to ``new`` (records of ``record``;
    plans that failed or lack a layer time in either are left out): ``quality SET: N plans, B
    better / W worse by > 0.5%, geometric mean new/old G, worst R (name), ...``."""
    def layer(rec: list) -> float | None:
        return float(rec[_LAYER]) if len(rec) > _LAYER + 2 else None

    out = []
    for s in SETS:
        ratios = []
        for k in old:
            if not k.startswith(s + " ") or k not in new or k in cut:
                continue
            a, b = layer(old[k]), layer(new[k])
            if a and b is not None:
                ratios.append((b / a, k))
        if not ratios:
            continue
        better = sum(r < 1 - _QUALITY_BAND for r, _ in ratios)
        worse = sorted(((r, k) for r, k in ratios if r > 1 + _QUALITY_BAND), reverse=True)
        gm = math.exp(sum(math.log(r) for r, _ in ratios) / len(ratios))
        tail = "".join(f", {r:.4f} ({k})" for r, k in worse[:3])
        out.append(f"quality {s}: {len(ratios)} plan{'s' if len(ratios) != 1 else ''}, {better} better / {len(worse)} worse by > {_QUALITY_BAND:.1%}, "
                   f"geometric mean new/old {gm:.4f}" + (f"; worst{tail[1:]}" if worse else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="compile every plan with one tree")
    rec.add_argument("tree", help="a checkout (its megatron_hsap package is imported)")
    rec.add_argument("out", help="JSON file to write")
    rec.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS), choices=SETS)
    rec.add_argument("--jobs", type=int, default=2)
    rec.add_argument("--fuzz-seed", type=int, default=21)
    cmp_ = sub.add_parser("compare", help="compare two recorded files")
    cmp_.add_argument("old")
    cmp_.add_argument("new")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args.tree, args.out, tuple(args.sets), args.jobs, args.fuzz_seed)
        return 0
    return compare(args.old, args.new)


if __name__ == "__main__":
    sys.exit(main())
