"""The one prepared GPU check: ``bash scripts/gpu_check.sh [--out DIR] [--dry-run]``.

Needs PyTorch and numpy only (no pytest, hypothesis, PyYAML or megatron-core); flash-attn and
Transformer Engine are checked when they import. Runs from a plain copy of the tree
(``PYTHONPATH=.``) in a few minutes on one GPU (budget: 4 minutes on an H200). Sections:

1. ``kernels``   every available CUDA backend (flash_attn, te, torch_cuda) against the CPU
                 float64 reference (``cpu`` backend): edge packings (empty documents, 1×1,
                 lq < lk, lq > lk, documents with no key), MHA/GQA/MQA, MLA head sizes
                 (192/128), bf16 and fp16, large logits; forward (out, lse) and backward.
2. ``executor``  one-rank plans through ``hsap_attn_func`` on the device vs the reference; the
                 executor's merge and accumulation pattern (split-kv partials, ``merge_into`` in
                 fp32, partial gradients against the final out/lse) per backend, large logits
                 included, and the receive pool on the device
                 (:mod:`~megatron_hsap.bench.gpu_check_split_kv`); attention dropout per backend and
                 through a plan (:mod:`~megatron_hsap.bench.gpu_check_dropout`); qk-clip's max
                 logits and their cost (:mod:`~megatron_hsap.bench.gpu_check_max_logits`); a CUDA graph
                 capture of a plan refused (:mod:`~megatron_hsap.bench.gpu_check_capture`).
3. ``merge``     the fused Triton LSE merge (:mod:`~megatron_hsap.bench.gpu_check_merge`) against the
                 eager merge and float64, and its HBM bytes per element (priced 10) vs the eager
                 path's (priced 18) at the measured copy bandwidth (``merge.csv``).
4. ``multirank`` when >= 2 GPUs are visible: a 1×P plan over NCCL (one process per GPU) vs the
                 reference; skipped (and said so) with one GPU.
5. ``calibrate`` kernel time by block shape (fwd/bwd × causal/rectangle × q×kv grid, plus
                 ragged backward calls), fitted to the simulator's kernel model (:mod:`~megatron_hsap.bench.gpu_calibration`) and
                 written as ``calibration.yaml`` for ``megatron-hsap simulate --config`` and
                 ``gpu_calibration.register_planner_hardware``.
6. ``ranks``     per inter rank of a P-rank plan: its kernel calls timed on this GPU vs the
                 calibrated model's prediction of the same calls, beside the planned work.

``--only kernels,calibrate`` runs some sections (``ranks`` runs inside ``calibrate``);
``--budget-s`` (default 240 on a GPU, none on the dry run) starts no section later than that
(such a section is reported as failed). Everything goes to one folder (``checks.csv``, ``merge.csv``,
``calibration.csv``, ``calibration.yaml``, ``ranks.csv``, ``environment.json``, ``summary.txt``
and ``summary.md``, the table for the README) and the summary table is printed. Exit status 1
when any check failed.

``--dry-run`` (CPU) runs every section with the ``cpu`` backend in float32 at small sizes, the
multi-rank section as 2 gloo processes, and times with a synthetic clock drawn from a known
kernel model: the fit must recover that model, the YAML must load into the simulator (when
PyYAML is there) and the planner, and the per-rank comparison must come out at 1.0 — asserted.
Tolerances (relative to max(1, |ref|max)): float32 1e-5 (as tests/runtime/test_kernels.py);
bf16 2e-2 (inputs exact, outputs rounded to bf16 = 2^-9, P·V in bf16 on the GPU); fp16 5e-3
(2^-11 rounding, same kernels).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_hsap.runtime import kernels

__all__ = ["main", "run_check", "CheckRow"]

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
LENS_Q = [5, 0, 1, 17, 9, 3, 64]  # equal, no queries, 1×1, lq < lk, lq > lk, no keys, a block
LENS_K = [5, 3, 1, 30, 4, 0, 64]


@dataclass(frozen=True, slots=True)
class CheckRow:
    section: str
    name: str
    passed: bool
    error: float  # scaled max error (nan where not a numeric comparison)
    tol: float
    detail: str = ""


class _Ctx:
    def __init__(self, out: Path, dry: bool, device: torch.device) -> None:
        self.out, self.dry, self.device = out, dry, device
        self.rows: list[CheckRow] = []

    def add(self, section: str, name: str, error: float, tol: float, detail: str = "") -> None:
        ok = bool(error <= tol) if not math.isnan(error) else detail.startswith("ok")
        self.rows.append(CheckRow(section, name, ok, error, tol, detail))

    def fail(self, section: str, name: str, exc: BaseException) -> None:
        self.rows.append(CheckRow(section, name, False, math.nan, math.nan, f"{type(exc).__name__}: {exc}"[:300]))


def _cu(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=device)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, |want|max), -inf positions required to agree (else inf)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        return math.inf
    fin = torch.isfinite(want)
    if not fin.any():
        return 0.0
    return float((got[fin] - want[fin]).abs().max()) / max(1.0, float(want[fin].abs().max()))


# ----------------------------------------------------------------------------- 1. kernels
def _kernel_cases(dry: bool) -> list[dict[str, Any]]:
    d, dv = (16, 16) if dry else (128, 128)
    mla = (24, 16) if dry else (192, 128)  # MLA: d_qk 192, d_v 128 (dry: small, d % 8 != 0)
    cases = []
    for causal in (True, False):
        tag = "causal" if causal else "rect"
        cases += [
            dict(name=f"mha {tag}", h=8, hkv=8, d=d, dv=dv, causal=causal, mag=1.0),
            dict(name=f"gqa4 {tag}", h=8, hkv=2, d=d, dv=dv, causal=causal, mag=1.0),
            dict(name=f"mqa {tag}", h=8, hkv=1, d=d, dv=dv, causal=causal, mag=1.0),
            dict(name=f"mla {tag}", h=4, hkv=4, d=mla[0], dv=mla[1], causal=causal, mag=1.0),
        ]
    cases.append(dict(name="large logits causal", h=4, hkv=2, d=d, dv=dv, causal=True, mag=8.0))
    return cases


def _reference(q, k, v, dout, cu_q, cu_k, mq, mk, causal, scale):
    """CPU float64 forward and backward of the (already rounded) inputs: the ``cpu`` backend."""
    args = dict(cu_seqlens_q=cu_q.cpu(), cu_seqlens_k=cu_k.cpu(), max_seqlen_q=mq, max_seqlen_k=mk,
                causal=causal, softmax_scale=scale, backend="cpu")  # fmt: skip
    q, k, v, dout = (x.detach().double().cpu() for x in (q, k, v, dout))
    out, lse = kernels.attn_forward(q, k, v, **args)
    grads = kernels.attn_backward(dout, q, k, v, out, lse, **args)
    return out, lse, grads


def check_kernels(ctx: _Ctx) -> None:
    backends = ["cpu"] if ctx.dry else [b for b in kernels.available_backends(ctx.device) if b != "cpu"]
    dtypes = [torch.float32] if ctx.dry else [torch.bfloat16, torch.float16]
    if not backends:
        ctx.add("kernels", "backends", math.nan, math.nan, "FAILED: no CUDA backend available")
    gen = torch.Generator().manual_seed(0)
    for case in _kernel_cases(ctx.dry):
        tq, tk = sum(LENS_Q), sum(LENS_K)
        base = [torch.randn(tq, case["h"], case["d"], generator=gen) * case["mag"],
                torch.randn(tk, case["hkv"], case["d"], generator=gen),
                torch.randn(tk, case["hkv"], case["dv"], generator=gen),
                torch.randn(tq, case["h"], case["dv"], generator=gen)]  # fmt: skip
        scale = case["d"] ** -0.5
        for dtype in dtypes:
            q, k, v, dout = (x.to(dtype) for x in base)
            cu_q, cu_k = _cu(LENS_Q, ctx.device), _cu(LENS_K, ctx.device)
            ref = _reference(q, k, v, dout, cu_q, cu_k, max(LENS_Q), max(LENS_K), case["causal"], scale)
            for backend in backends:
                name = f"{backend} {str(dtype).removeprefix('torch.')} {case['name']}"
                try:
                    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(LENS_Q),
                                max_seqlen_k=max(LENS_K), causal=case["causal"], softmax_scale=scale,
                                backend=backend)  # fmt: skip
                    dq_, dk_, dv_, do_ = (x.to(ctx.device) for x in (q, k, v, dout))
                    out, lse = kernels.attn_forward(dq_, dk_, dv_, **args)
                    grads = kernels.attn_backward(do_, dq_, dk_, dv_, out, lse, **args)
                    errors = [_err(out, ref[0]), _err(lse, ref[1])] + [_err(g, r) for g, r in zip(grads, ref[2])]
                    worst = max(errors)
                    ctx.add("kernels", name, worst, TOL[dtype],
                            "out/lse/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errors))  # fmt: skip
                except Exception as exc:  # report and go on: one broken backend must not hide the rest
                    ctx.fail("kernels", name, exc)


# ----------------------------------------------------------------------------- 2. executor
def _packed_reference(q, k, v, do, cu: list[int], scale: float):
    t = torch.tensor(cu, dtype=torch.int32)
    m = max(b - a for a, b in zip(cu, cu[1:]))
    return _reference(q, k, v, do, t, t, m, m, True, scale)


def check_executor(ctx: _Ctx) -> None:
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.runtime import hsap_attn_func

    dtype = torch.float32 if ctx.dry else torch.bfloat16
    d = 16 if ctx.dry else 128
    packings = [[0, 1, 2, 40, 41, 300], [0, 256], [0, 7, 7, 100, 101, 160]] if ctx.dry else \
               [[0, 1, 2, 40, 300, 301, 1024], [0, 4096], [0, 7, 7, 1000, 1001, 3000, 4096]]  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for cu in packings:
        for h, hkv in ((8, 8), (8, 2)):
            name = f"1x1 plan {len(cu) - 1} docs T={cu[-1]} heads {h}/{hkv}"
            try:
                plan = compile_plan(cu, 1, 1, num_heads=h, num_kv_heads=hkv, head_dim=d,
                                    dtype_bytes=torch.tensor([], dtype=dtype).element_size())  # fmt: skip
                t = plan.padded_tokens
                base = [torch.randn(t, h, d, generator=gen), torch.randn(t, hkv, d, generator=gen),
                        torch.randn(t, hkv, d, generator=gen), torch.randn(t, h, d, generator=gen)]  # fmt: skip
                q, k, v, do = (x.to(dtype) for x in base)
                leaves = [x.to(ctx.device).requires_grad_(True) for x in (q, k, v)]
                out = hsap_attn_func(*leaves, plan)
                out.backward(do.to(ctx.device))
                full_cu = list(cu) + ([t] if t > cu[-1] else [])
                ref = _packed_reference(q, k, v, do, full_cu, d**-0.5)
                errors = [_err(out, ref[0])] + [_err(x.grad, r) for x, r in zip(leaves, ref[2])]
                ctx.add("executor", name, max(errors), TOL[dtype], "out/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errors))
            except Exception as exc:
                ctx.fail("executor", name, exc)


# ----------------------------------------------------------------------------- 3. multi-rank
_MR_CU = [0, 1, 50, 51, 200, 333, 512]


def _rank_main(rank: int, world: int, backend: str, store_path: str, out_file: str, dtype_name: str) -> None:
    """One process of the multi-rank check (module level: spawned by reference)."""
    import torch.distributed as dist

    from megatron_hsap.plan import compile_plan
    from megatron_hsap.runtime import hsap_attn_func
    from megatron_hsap.runtime.rendezvous import init_local_process_group

    # a file store, not a probed free TCP port: another process could take the port between the
    # probe and rank 0's bind (a CI run saw rank 1 abort in gloo), and nothing listens beyond loopback
    init_local_process_group(rank, world, store_path, timeout_s=120, backend=backend)
    try:
        torch.set_num_threads(1)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dtype = getattr(torch, dtype_name)
        h, hkv, d = 8, 2, 64
        plan = compile_plan(_MR_CU, world, 1, num_heads=h, num_kv_heads=hkv, head_dim=d, flatten="never",  # SAP's P2P
                            dtype_bytes=torch.tensor([], dtype=dtype).element_size())  # fmt: skip
        gen = torch.Generator().manual_seed(7)  # the same global tensors on every rank
        t = plan.padded_tokens
        full = [torch.randn(t, h, d, generator=gen).to(dtype), torch.randn(t, hkv, d, generator=gen).to(dtype),
                torch.randn(t, hkv, d, generator=gen).to(dtype), torch.randn(t, h, d, generator=gen).to(dtype)]  # fmt: skip
        idx = torch.from_numpy(plan.local_token_indices(rank))
        leaves = [x[idx].to(device).requires_grad_(True) for x in full[:3]]
        out = hsap_attn_func(*leaves, plan)
        out.backward(full[3][idx].to(device))
        mine = {"idx": idx.numpy(), "out": out.detach().float().cpu().numpy(),
                **{n: x.grad.float().cpu().numpy() for n, x in zip(("dq", "dk", "dv"), leaves)}}  # fmt: skip
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank == 0:
            full_cu = list(_MR_CU) + ([t] if t > _MR_CU[-1] else [])
            ref = _packed_reference(*full[:3], full[3], full_cu, d**-0.5)
            want = {"out": ref[0], "dq": ref[2][0], "dk": ref[2][1], "dv": ref[2][2]}
            errors = {}
            for name, w in want.items():
                got = torch.full(w.shape, float("nan"), dtype=torch.float64)
                for r in gathered:
                    got[torch.from_numpy(r["idx"])] = torch.from_numpy(r[name]).double()
                errors[name] = _err(got, w) if not torch.isnan(got).any() else math.inf
            Path(out_file).write_text(json.dumps(errors))
        # no rank closes its pairs before every gather landed: a gloo rank that destroys the group
        # with its gather_object send still in flight aborts (SIGABRT, rank 1, in a CI run beside
        # other jobs: rank 0 was still receiving)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done: the errors are on disk (rank 0) and the group is closed. Leave without the interpreter's
    # and C++ runtime's teardown: a fresh-clone CI run (2026-12-04) saw a rank abort here with
    # "terminate called without an active exception" (SIGABRT, rank 1), the message of a joinable
    # C++ thread object destroyed at exit (an exception inside gloo reads "terminate called after
    # throwing ..."), which failed a check whose ranks had all finished. Only the success path
    # skips the teardown: an exception above still propagates to the parent as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_multirank(ctx: _Ctx) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ctx.dry:
        world, backend, dtype = 2, "gloo", torch.float32
    elif gpus >= 2:
        world, backend, dtype = min(gpus, 8), "nccl", torch.bfloat16
    else:
        ctx.add("multirank", "NCCL exactness", math.nan, math.nan, f"ok: skipped, {gpus} GPU visible (needs >= 2)")
        return
    name = f"1x{world} plan over {backend} {str(dtype).removeprefix('torch.')}"
    out_file = ctx.out / "multirank.json"
    from megatron_hsap.runtime.rendezvous import new_local_store, remove_local_store

    store_path = new_local_store("hsap-gpu-check-")
    try:
        import torch.multiprocessing as mp

        procs = mp.start_processes(_rank_main, args=(world, backend, store_path, str(out_file),
                                   str(dtype).removeprefix("torch.")), nprocs=world, join=False,
                                   start_method="spawn")  # fmt: skip
        deadline = time.monotonic() + 300  # a hang guard (NCCL or gloo stuck), not a speed check
        while not procs.join(timeout=5):
            if time.monotonic() > deadline:
                for p in procs.processes:
                    p.kill()
                raise TimeoutError("multi-rank check did not finish in 300 s (a hang: see the ranks' output)")
        errors = json.loads(out_file.read_text())
        ctx.add("multirank", name, max(errors.values()), TOL[dtype], " ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    except Exception as exc:
        ctx.fail("multirank", name, exc)
    finally:
        remove_local_store(store_path)


# ----------------------------------------------------------------------------- driver
def _environment(ctx: _Ctx) -> dict[str, Any]:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "dry_run": ctx.dry, "host": platform.node()}  # fmt: skip
    if ctx.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(ctx.device)
        env["sm"] = "%d%d" % torch.cuda.get_device_capability(ctx.device)
        env["gpus_visible"] = torch.cuda.device_count()
        env["cudnn"] = torch.backends.cudnn.version()
    from importlib import metadata

    for dist_name in ("flash-attn", "transformer-engine", "transformer-engine-torch", "megatron-core"):
        try:
            env[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            env[dist_name] = "not installed"
    env["backends"] = kernels.available_backends(ctx.device)
    return env


def _summary(ctx: _Ctx, env: dict[str, Any], seconds: float) -> str:
    lines = [f"megatron-hsap GPU check{' (DRY RUN, CPU)' if ctx.dry else ''}: {env.get('gpu', 'cpu')}, torch "
             f"{env['torch']}, CUDA {env['cuda']}, {env['date']}, {seconds:.0f} s"]  # fmt: skip
    lines.append(f"{'section':<10} {'check':<44} {'result':<6} {'error':>9} {'tol':>8}  detail")
    for r in ctx.rows:
        err = "" if math.isnan(r.error) else f"{r.error:9.2e}"
        tol = "" if math.isnan(r.tol) else f"{r.tol:8.2g}"
        lines.append(f"{r.section:<10} {r.name[:44]:<44} {'ok' if r.passed else 'FAIL':<6} {err:>9} {tol:>8}  {r.detail}")
    failed = sum(not r.passed for r in ctx.rows)
    lines.append(f"{len(ctx.rows) - failed} passed, {failed} failed")
    return "\n".join(lines)


def _summary_markdown(ctx: _Ctx, env: dict[str, Any]) -> str:
    """The same table as markdown, with the GPU, versions and date: for the README's "Running on
    GPUs" section."""
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "cuda", "cudnn", "flash-attn", "transformer-engine") if k in env)
    lines = [f"GPU check on {env.get('gpu', 'cpu (dry run)')} (SM {env.get('sm', '-')}), {versions}, {env['date'][:10]}:", "",
             "| section | check | result | error | tolerance | detail |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in ctx.rows:
        err = "" if math.isnan(r.error) else f"{r.error:.2e}"
        tol = "" if math.isnan(r.tol) else f"{r.tol:.2g}"
        lines.append(f"| {r.section} | {r.name} | {'ok' if r.passed else 'FAIL'} | {err} | {tol} | {r.detail.replace('|', '/')} |")
    return "\n".join(lines)


SECTIONS = ("kernels", "executor", "merge", "multirank", "calibrate")  # calibrate includes the per-rank comparison


def run_check(out: Path, *, dry_run: bool, hardware: str | None = None, only: tuple[str, ...] = SECTIONS,
              budget_s: float | None = None) -> tuple[list[CheckRow], Path]:  # fmt: skip
    """Run the ``only`` sections in order, write the result folder, return the rows and the
    summary path. A section that would start past ``budget_s`` (default: 240 s on a GPU, none on
    the dry run, whose duration depends on a shared CPU) is not run and counts as failed (the
    check did not complete), so a slow machine cannot pass by running less."""
    t0 = time.monotonic()
    if budget_s is None:
        budget_s = math.inf if dry_run else 240.0
    unknown = set(only) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"gpu_check: unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible; use --dry-run on a CPU machine")
    device = torch.device("cpu") if dry_run else torch.device("cuda", torch.cuda.current_device())
    out.mkdir(parents=True, exist_ok=True)
    ctx = _Ctx(out, dry_run, device)
    env = _environment(ctx)
    (out / "environment.json").write_text(json.dumps(env, indent=1, default=str) + "\n")

    def timed_calibration(ctx: _Ctx) -> None:
        from megatron_hsap.bench.gpu_check_timing import calibrate, check_ranks, hardware_name

        backend = "cpu" if dry_run else kernels.resolve_backend(None, device)
        hw = hardware_name(ctx.device, hardware)
        header = [f"megatron-hsap kernel calibration ({'dry run: synthetic timings' if dry_run else 'measured'}): "
                  f"{env.get('gpu', 'cpu')}, backend {backend}, torch {env['torch']}, {env['date']}"]  # fmt: skip
        try:
            cal = calibrate(ctx, backend, hw, header)
            check_ranks(ctx, cal, backend, hw)
        except Exception as exc:
            ctx.fail("calibrate", "calibration / per-rank comparison", exc)

    from megatron_hsap.bench.gpu_check_capture import check_capture
    from megatron_hsap.bench.gpu_check_dropout import check_dropout
    from megatron_hsap.bench.gpu_check_max_logits import check_max_logits
    from megatron_hsap.bench.gpu_check_merge import check_fused_merge
    from megatron_hsap.bench.gpu_check_split_kv import check_split_kv

    runs = {"kernels": [check_kernels], "executor": [check_executor, check_split_kv, check_dropout, check_max_logits, check_capture],
            "merge": [check_fused_merge],
            "multirank": [check_multirank],
            "calibrate": [timed_calibration]}  # fmt: skip
    for name in only:
        for section in runs[name]:
            if time.monotonic() - t0 > budget_s:
                ctx.add(name, f"{section.__name__} not run", math.nan, math.nan,
                        f"FAILED: past the {budget_s:g} s budget (rerun with --only {name})")  # fmt: skip
                continue
            t = time.monotonic()
            section(ctx)
            print(f"gpu_check: {section.__name__} {time.monotonic() - t:.1f} s", file=sys.stderr)
    if not ctx.rows:
        ctx.add("check", "nothing ran", math.nan, math.nan, "FAILED: no section selected")
    with open(out / "checks.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(ctx.rows[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in ctx.rows)
    summary = _summary(ctx, env, time.monotonic() - t0)
    (out / "summary.txt").write_text(summary + "\n")
    (out / "summary.md").write_text(_summary_markdown(ctx, env) + "\n")
    return ctx.rows, out / "summary.txt"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=None, help="result folder (default gpu_check_results/<UTC time>)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: every section but the CUDA calls (synthetic timings)")
    ap.add_argument("--hardware", default=None, help="constant set the calibration overrides (default: from the GPU name)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections (default: all of {','.join(SECTIONS)})")
    ap.add_argument("--budget-s", type=float, default=None, help="start no section after this many seconds (default 240; none with --dry-run)")
    args = ap.parse_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or Path("gpu_check_results") / (stamp + ("-dry" if args.dry_run else ""))
    if args.dry_run:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    rows, summary = run_check(out, dry_run=args.dry_run, hardware=args.hardware, only=only, budget_s=args.budget_s)
    print(summary.read_text(), end="")
    print(f"results: {out}")
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
