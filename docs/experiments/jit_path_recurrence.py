"""What-if measurement behind README's compile-time paragraph (issue 14): a numba JIT of the
planner's path recurrence (``plan/rank_path.path_seconds_py``) alone, timed against the Python loop
(README gives its instruction count: 5.7% fewer per 64K / P_inter 8 compile). Not shipped code:
the planner is patched for the duration of one measurement, and numba is not a dependency of this
repository.

The JIT follows ``path_seconds_py`` operation by operation (each port's transfers sorted by start
for its drain and by bytes for its shared sums; byte sums are whole numbers, so any order of ties
gives the same floats), so the plans must come out identical: the script compares every plan's
hash with and without the patch before it reports a time. The patched entry point still takes
``path_seconds_py``'s Python lists and converts them (a shipped version would take the arrays
its callers already hold).

Measured on this repository's 2-core VM on 2026-12-06 (numba 0.68.1, numpy 2.5.5, Python 3.13;
each of the 5 batches compiled 5 times with and 5 times without the JIT, alternating compile by
compile, least of each; median over the batches): 74.5 vs 78.1 ms (-4.5%) and 75.8 vs 80.9 ms
(-6.2%) in two runs, plans identical. One call: 90 µs in Python, 16 µs in the JIT (49 µs with the
list conversion). (Two whole runs timed one after the other had shown -20%: the VM's drift, which
is why the script alternates.) So compiling the recurrence alone saves about its share of a
compile net of the conversion; the 20 ms budget needs staging and pricing compiled as a whole.

    pip install numba   # into a scratch environment with numpy (the planner needs nothing else)
    PYTHONPATH=. python docs/experiments/jit_path_recurrence.py   # about a minute
"""

from __future__ import annotations

import statistics
import time

import numba
import numpy as np

import megatron_hsap.plan.estimate as estimate
from megatron_hsap.plan import clear_plan_cache, compile_plan
from megatron_hsap.plan.workloads import pack_batches

INF = np.inf


@numba.njit(cache=True)
def _port(xs, starts, vs, b, out):  # noqa: ANN001, ANN202 - rank_path._port_done, one port's transfers xs
    m = xs.shape[0]
    if m == 1:
        x = xs[0]
        out[x] = starts[x] + vs[x] / b
        return
    st = np.empty(m)
    for i in range(m):
        st[i] = starts[xs[i]]
    o = np.argsort(st, kind="mergesort")  # drain: by start, the bytes from each one on
    tail, best = 0.0, -INF
    for i in range(m - 1, -1, -1):
        x = xs[o[i]]
        tail += vs[x]
        v = starts[x] + tail / b
        if v > best:
            best = v
    vv = np.empty(m)
    for i in range(m):
        vv[i] = vs[xs[i]]
    o2 = np.argsort(vv, kind="mergesort")  # shared: by bytes
    upto = 0.0
    for n_i in range(m):
        x = xs[o2[n_i]]
        v = vs[x]
        upto += v
        sh = starts[x] + (upto + (m - 1 - n_i) * v) / b
        out[x] = sh if sh < best else best


@numba.njit(cache=True)
def _path(comp, after, has_after, flows, nbytes, bw0, bw1, latency, flow_bw):  # noqa: ANN001, ANN202, PLR0913
    size, n = comp.shape
    capped = flow_bw < INF
    t = np.zeros(size)
    j, m = 0, flows.shape[0]
    starts, d0, d1 = np.empty(m), np.empty(m), np.empty(m)
    okey, ikey = np.empty(m, np.int64), np.empty(m, np.int64)
    for k in range(n):
        end = np.empty(size)
        for r in range(size):
            end[r] = t[r] + comp[r, k]
        while j < m and flows[j, 0] < k:
            j += 1
        i = j
        while j < m and flows[j, 0] == k:
            j += 1
        if j > i:
            cnt = j - i
            for x in range(cnt):
                src, dst, c = flows[i + x, 1], flows[i + x, 2], flows[i + x, 3]
                ts, td = t[src], t[dst]
                starts[x] = (ts if ts > td else td) + latency
                okey[x], ikey[x] = src * 2 + c, dst * 2 + c
            vs = nbytes[i:j]
            for side in range(2):  # each transfer's out port (src, link), then its in port (dst, link)
                keys = okey[:cnt] if side == 0 else ikey[:cnt]
                out = d0 if side == 0 else d1
                o = np.argsort(keys, kind="mergesort")
                a = 0
                while a < cnt:
                    e = a
                    while e < cnt and keys[o[e]] == keys[o[a]]:
                        e += 1
                    _port(o[a:e], starts, vs, bw0 if (keys[o[a]] & 1) == 0 else bw1, out)
                    a = e
            for x in range(cnt):
                src, dst, c = flows[i + x, 1], flows[i + x, 2], flows[i + x, 3]
                f, g = d0[x], d1[x]
                if g > f:
                    f = g
                if capped and c == 0:
                    ov = starts[x] + vs[x] / flow_bw
                    if ov > f:
                        f = ov
                if f > end[src]:
                    end[src] = f
                if f > end[dst]:
                    end[dst] = f
        if has_after:
            for r in range(size):
                end[r] = end[r] + after[r, k]
        t = end
    best = 0.0
    for r in range(size):
        if t[r] > best:
            best = t[r]
    return best


def path_seconds_jit(comp, after, flows, nbytes, bws, latency, flow_bw=INF):  # noqa: ANN001, ANN201, PLR0913
    """``rank_path.path_seconds_py``'s arguments and number, through the JIT."""
    has = after is not None
    return _path(np.asarray(comp, dtype=np.float64).reshape(len(comp), -1),
                 np.asarray(after, dtype=np.float64) if has else np.zeros((1, 1)), has,
                 np.asarray(flows, dtype=np.int64).reshape(-1, 4), np.asarray(nbytes, dtype=np.float64),
                 float(bws[0]), float(bws[1] if bws[1] > 0 else bws[0]), float(latency), float(flow_bw))


KW = dict(num_heads=32, num_kv_heads=8, head_dim=128, hardware="h100")


def _compile_ms(cu, path) -> tuple[float, int]:  # noqa: ANN001
    """One fresh compile of ``cu`` with ``path`` as the recurrence: CPU ms and the plan's hash."""
    estimate.path_seconds_py = path
    clear_plan_cache()
    t0 = time.process_time()
    plan = compile_plan(cu, 8, layout="balanced", **KW)
    return (time.process_time() - t0) * 1e3, plan.hash


def main(reps: int = 5) -> None:
    batches = pack_batches("fineweb", 64 * 1024, 6, 12345)
    original = estimate.path_seconds_py
    try:
        for path in (path_seconds_jit, original):  # warm-up (numba compiles on its first call)
            _compile_ms(batches[-1], path)
        # A/B per compile, alternating, each batch's least of ``reps``: this VM's speed drifts by up
        # to 1.5x between runs, so the two variants share every moment of the measurement
        least = {"jit": [], "python": []}
        for cu in batches[:5]:
            got: dict[str, list[float]] = {"jit": [], "python": []}
            hashes = set()
            for _ in range(reps):
                for name, path in (("jit", path_seconds_jit), ("python", original)):
                    ms, h = _compile_ms(cu, path)
                    got[name].append(ms)
                    hashes.add(h)
            assert len(hashes) == 1, "the JIT changed a plan"
            for name in got:
                least[name].append(min(got[name]))
        jit, base = statistics.median(least["jit"]), statistics.median(least["python"])
        print(f"fineweb 64K / P_inter 8, median of 5 batches' least of {reps}: path recurrence JIT {jit:.1f} ms, "
              f"Python {base:.1f} ms ({(jit / base - 1) * 100:+.1f}%), plans identical")
        print("per batch (jit / python):", [f"{a:.1f}/{b:.1f}" for a, b in zip(least["jit"], least["python"])])
    finally:
        estimate.path_seconds_py = original


if __name__ == "__main__":
    main()
