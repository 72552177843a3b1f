"""The GPU check's dry run (CPU): every section but the CUDA calls, with asserted outputs.

``bash scripts/gpu_check.sh --dry-run`` runs the kernel and executor checks with the ``cpu``
backend in float32, the multi-rank check as 2 gloo processes, and the calibration from a
synthetic clock of a known kernel model. Here: the script exits 0, every row passed, the fit
recovers the known model, and the YAML it wrote loads into the simulator (``--config``) and the
planner. Plus the calibration helpers on their own (block work against a brute-force count).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_hsap.bench import gpu_calibration as gc

ROOT = Path(__file__).resolve().parents[2]


# What the GPU box lacks: the check must not import any of it (blocked in the run below, in
# the spawned ranks too, through a sitecustomize on PYTHONPATH).
_NOT_ON_THE_GPU_BOX = ("pytest", "hypothesis", "yaml", "megatron", "matplotlib", "einops", "tqdm")
_BLOCKER = f"""
import sys
class _NotOnTheGpuBox:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {_NOT_ON_THE_GPU_BOX!r}:
            raise ImportError(f"{{name}} is not installed on the GPU box")
sys.meta_path.insert(0, _NotOnTheGpuBox())
"""


def test_dry_run_script_passes_and_its_yaml_loads(tmp_path):
    out = tmp_path / "results"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_BLOCKER)
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 failed" in proc.stdout and "DRY RUN" in proc.stdout
    assert "no PyYAML here" in proc.stdout  # the blocker was active: the GPU box's path ran
    for name in ("checks.csv", "calibration.csv", "calibration.yaml", "ranks.csv", "environment.json", "summary.txt",
                 "summary.md"):  # fmt: skip
        assert (out / name).is_file(), name
    rows = list(csv.DictReader((out / "checks.csv").open()))
    sections = {r["section"] for r in rows}
    assert sections == {"kernels", "executor", "merge", "multirank", "calibrate", "ranks"}, sections
    assert all(r["passed"] == "True" for r in rows), [r for r in rows if r["passed"] != "True"]
    assert sum(r["section"] == "kernels" for r in rows) >= 9  # MHA/GQA/MQA/MLA × masks + large logits
    dropout = [r["name"] for r in rows if "dropout" in r["name"]]  # gpu_check_dropout: kernel redraw, mean; plan redraw
    assert sum("(redraw" in n for n in dropout) == 2 and sum("(mean of" in n for n in dropout) == 1, dropout
    clip = [r for r in rows if "max logits for qk-clip" in r["name"]]  # gpu_check_max_logits: values, cost
    assert len(clip) == 2 and float(clip[0]["error"]) <= 1e-4 and clip[1]["detail"].startswith("ok: forward"), clip
    captured = [r for r in rows if r["name"] == "1x1 plan captured in a CUDA graph (refused)"]  # gpu_check_capture
    assert len(captured) == 1 and captured[0]["detail"].startswith("ok: no CUDA device"), captured
    if importlib.util.find_spec("triton") is not None:  # the fused merge under Triton's interpreter
        merged = [r for r in rows if r["section"] == "merge" and r["error"] not in ("", "nan")]
        assert len(merged) == 7 and all(float(r["error"]) <= float(r["tol"]) for r in merged), merged

    # The YAML loads into the simulator (PyYAML, here) exactly as written and into the planner.
    from megatron_hsap.plan import compile_plan
    from megatron_hsap.plan.hardware import HARDWARE
    from megatron_hsap.sim import config as sim_config

    name, fields = gc.read_calibration(out / "calibration.yaml")
    try:
        sim_config.load_overrides(out / "calibration.yaml")
        kernel = sim_config.sim_hardware(name).kernel
        assert kernel.fwd_peak == fields["attn_fwd_peak"] and kernel.curve.launch_s == fields["launch_s"]
        assert kernel.cta_s == fields["cta_s"] > 0
        # the fitted curve prices kernels: the tile model (on by default) would ignore half_rate_tokens
        assert kernel.tile == 0 and kernel.curve.half_rate_tokens == fields["half_rate_tokens"]
        assert float(kernel.efficiency(1000, 1000)) == 1000.0 / (1000.0 + fields["half_rate_tokens"])
        assert abs(fields["attn_fwd_peak"] / 4.0e10 - 1) < 0.05  # the dry run's synthetic truth
    finally:
        sim_config.reset_overrides()
    registered = gc.register_planner_hardware(out / "calibration.yaml", "dry-calibrated")
    try:
        plan = compile_plan([0, 100, 300], 2, 1, num_heads=4, head_dim=16, hardware=registered)
        assert plan.stats().hardware == registered
        assert HARDWARE[registered].kernel.half_rate_tokens == fields["half_rate_tokens"]
    finally:
        HARDWARE.pop(registered, None)
    table = (out / "summary.md").read_text().splitlines()
    assert table[0].startswith("GPU check on cpu (dry run)") and table[2].startswith("| section |")
    assert len(table) == 4 + len(rows)  # one markdown row per check
    ranks = list(csv.DictReader((out / "ranks.csv").open()))
    assert len(ranks) == 4 and all(float(r["measured_s"]) > 0 for r in ranks)


def test_block_work_counts_unmasked_pairs():
    for nq in range(1, 9):
        for nk in range(1, 9):
            i, j = np.meshgrid(np.arange(nq), np.arange(nk), indexing="ij")
            assert gc.block_work(nq, nk, True) == int((j <= i + nk - nq).sum()), (nq, nk)
            assert gc.block_work(nq, nk, False) == nq * nk


def test_fit_recovers_a_model_and_rejects_nonsense():
    """The GPU grid timed by a known model (H100-like, CTA cost included) fits back to it."""
    truth = gc.Calibration(attn_fwd_peak=3e14, attn_bwd_peak=2e14, half_rate_tokens=500.0, launch_s=1e-5,
                           cta_s=2e-8, max_rel_error=0, median_rel_error=0)  # fmt: skip
    rows = []
    for phase, causal, blocks in gc.grid([128, 512, 2048, 8192], 32768):
        flops = gc.call_flops(blocks, causal, 32, 128, 128, phase)
        rows.append(gc.Measurement(phase=phase, causal=causal, blocks=blocks, heads=32, flops=sum(flops),
                                   seconds=truth.call_seconds(phase, blocks, flops, 32)))  # fmt: skip
    assert sum(len(set(r.blocks)) > 1 for r in rows) == 4  # the ragged backward calls
    cal = gc.fit(rows)
    for name in ("attn_fwd_peak", "attn_bwd_peak", "half_rate_tokens", "cta_s"):
        assert abs(getattr(cal, name) / getattr(truth, name) - 1) < 0.03, (name, getattr(cal, name))
    assert cal.max_rel_error < 0.01
    with pytest.raises(Exception, match="forward and backward"):
        gc.fit([r for r in rows if r.phase == "fwd"])


def test_read_calibration_refuses_other_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hardware:\n  h100:\n    attn_fwd_peak: 1.0\n")  # the other fields missing
    with pytest.raises(Exception, match="expected hardware"):
        gc.read_calibration(bad)


# ----------------------------------------------------------------------------- scripts/install_gpu.sh
def _gpu_pins() -> list[str]:
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    extras = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                  and any(getattr(t, "id", None) == "EXTRAS_REQUIRE" for t in n.targets))  # fmt: skip
    return ast.literal_eval(extras)["gpu"]


def _commands(stdout: str) -> list[list[str]]:
    import shlex

    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def _install(*args, python=sys.executable):
    return subprocess.run(["bash", str(ROOT / "scripts/install_gpu.sh"), "--dry-run", *args],
                          env={**os.environ, "PYTHON": python}, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_install_gpu_dry_run_prints_the_no_isolation_steps():
    pins = _gpu_pins()
    assert any(p.startswith("flash-attn") for p in pins) and any(p.startswith("transformer-engine") for p in pins)
    assert all(any(op in p for op in ("==", ">=", "<")) for p in pins), f"unpinned gpu requirement in {pins}"
    proc = _install()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commands = _commands(proc.stdout)
    assert len(commands) == 2 and {"ninja", "psutil", "setuptools>=64"} <= set(commands[0])
    assert commands[1][-3:] == ["--no-build-isolation", "-e", f"{ROOT}[gpu]"]  # one pip call: setup.py's pins
    assert f"gpu extra pins: {' '.join(pins)}" in proc.stdout
    assert "backend cpu        available" in proc.stdout and "nothing was installed" in proc.stdout

    only_fa = _install("--no-te", "--wheel", "/wheels/flash_attn-2.8.3-cp313-linux_x86_64.whl")
    assert only_fa.returncode == 0, only_fa.stderr
    commands = _commands(only_fa.stdout)
    assert commands[1][-2:] == ["--no-deps", "/wheels/flash_attn-2.8.3-cp313-linux_x86_64.whl"]
    fa_pin = next(p for p in pins if p.startswith("flash-attn"))
    assert commands[3][-2:] == ["--no-build-isolation", fa_pin]  # copy-pastable: the shell quoting round-trips
    assert not any("transformer-engine" in " ".join(c) for c in commands)


def test_install_gpu_refuses_an_environment_without_pip_or_torch(tmp_path):
    bare = tmp_path / "python-bare"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')  # no site-packages: no pip, no torch
    bare.chmod(0o755)
    proc = _install(python=str(bare))
    assert proc.returncode != 0 and "install_gpu.sh: error:" in proc.stderr, proc.stdout + proc.stderr
    assert "+ " not in proc.stdout  # nothing is run after a failed precondition
    assert subprocess.run(["bash", str(ROOT / "scripts/install_gpu.sh"), "--bogus"], capture_output=True,
                          text=True).returncode != 0  # fmt: skip


def test_sections_past_the_budget_fail_instead_of_being_dropped(tmp_path):
    from megatron_hsap.bench.gpu_check import run_check

    rows, summary = run_check(tmp_path / "r", dry_run=True, only=("executor", "calibrate"), budget_s=-1.0)
    assert [(r.section, r.passed) for r in rows] == [("executor", False)] * 5 + [("calibrate", False)]
    assert all("budget" in r.detail for r in rows) and "0 passed, 6 failed" in summary.read_text()
    with pytest.raises(SystemExit, match="unknown sections"):
        run_check(tmp_path / "s", dry_run=True, only=("kernel",))
