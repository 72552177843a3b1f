# shellcheck shell=bash
# Shared by scripts/slurm/*.sbatch: NCCL defaults, node-list expansion, the pre-launch topology
# check, and either a dry run (print every node's torchrun line) or the srun + torchrun launch.
# The sbatch script sets HSAP_REPO, sources this file and calls: hsap_main DEFAULT_CONFIG "$@".

HSAP_REPO=${HSAP_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}

hsap_usage() {
  cat <<USAGE
usage: sbatch ${0##*/} [--dry-run] [CONFIG] [-- EXTRA_MEGATRON_ARGS...]
       SLURM_JOB_NODELIST='node[01-08]' SLURM_NNODES=8 bash ${0##*/} --dry-run [CONFIG]

CONFIG defaults to ${HSAP_DEFAULT_CONFIG:-the scenario config}. --dry-run prints the
exported NCCL settings and one fully resolved torchrun line per node without launching; outside
SLURM give SLURM_JOB_NODELIST (and optionally SLURM_NNODES, SLURM_JOB_ID).
Environment: HSAP_PYTHON (the training environment's python, which imports megatron_hsap;
default \${HSAP_VENV:-\$HSAP_REPO/.venv}/bin/python when present, else python3), HSAP_TORCHRUN (default: the
torchrun next to HSAP_PYTHON, else HSAP_PYTHON -m torch.distributed.run; the dry run prints
which), MEGATRON_LM (Megatron-LM checkout), MASTER_PORT, HSAP_REPO, and every NCCL_* default
in scripts/slurm/common.sh.
USAGE
}

# NCCL and runtime defaults. Each one is only set when unset: export your own before sbatch.
hsap_nccl_defaults() {
  # InfiniBand adapters NCCL may use for inter-node traffic (HSAP's inter groups). "mlx5" matches
  # every ConnectX port; pin the GPU rails when storage NICs share the prefix, e.g. on DGX A100
  # NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_6,mlx5_7,mlx5_8,mlx5_9.
  export NCCL_IB_HCA="${NCCL_IB_HCA:-mlx5}"
  # Interface for NCCL's bootstrap and socket fallback (not the IB data path): exclude loopback
  # and docker bridges; name yours (e.g. ib0, enp226s0) if the first match is unroutable.
  export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker}"
  # NVLink SHARP (NVSwitch gen 3, H100/H200 HGX) accelerates all-reduce/all-gather, not the intra
  # all-to-all and P2P HSAP runs, and reserves GPU memory per communicator: off for memory-bound
  # long-sequence runs (A100 has none). Set 1 when data-parallel all-reduce dominates.
  export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
  # QP timeout 4.096 µs × 2^22 ≈ 17 s: ride out fabric congestion instead of failing the job.
  export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
  # CUDA_DEVICE_MAX_CONNECTIONS is not set here: Megatron needs 1 with TP/CP > 1 but refuses 1
  # with Megatron-FSDP, so the launcher sets it from the config's parallel.sharding.
  # Tear the job down on an NCCL error or timeout instead of hanging.
  export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  # CPU threads per rank (data loading, host-side planning); torchrun would otherwise force 1.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
}

HSAP_ENV_VARS=(NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_NVLS_ENABLE NCCL_IB_TIMEOUT
  TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG OMP_NUM_THREADS PYTHONPATH
  MEGATRON_LM)

# The node list for the launcher: scontrol's expansion when available, else the raw SLURM
# expression (node[01-08]), which the launcher expands itself (dry runs, tests).
hsap_nodes() {
  if command -v scontrol >/dev/null 2>&1; then
    local hosts=()
    mapfile -t hosts < <(scontrol show hostnames "$1")
    if ((${#hosts[@]} == 0)); then
      echo "error: scontrol show hostnames '$1' named no host" >&2
      return 1
    fi
    (IFS=,; echo "${hosts[*]}")
  else
    echo "$1"
  fi
}

hsap_main() {
  local default_config=$1
  shift
  HSAP_DEFAULT_CONFIG=$default_config
  # The training environment: HSAP_PYTHON, else the venv scripts/setup.sh made (HSAP_VENV or .venv).
  if [[ -z ${HSAP_PYTHON:-} ]]; then
    local venv=${HSAP_VENV:-$HSAP_REPO/.venv}
    HSAP_PYTHON=python3
    if [[ -x $venv/bin/python ]]; then HSAP_PYTHON=$venv/bin/python; fi
  fi
  local dry_run=0 config="" extra=()
  while (($#)); do
    case $1 in
      --dry-run) dry_run=1 ;;
      -h | --help) hsap_usage; return 0 ;;
      --) shift; extra=("$@"); break ;;
      -*) echo "error: unknown option $1 (see --help)" >&2; return 2 ;;
      *)
        if [[ -n $config ]]; then
          echo "error: one config file only (got $config and $1)" >&2
          return 2
        fi
        config=$1
        ;;
    esac
    shift
  done
  config=${config:-$default_config}
  if [[ ! -f $config && -f $HSAP_REPO/$config ]]; then
    config=$HSAP_REPO/$config
  fi
  if [[ ! -f $config ]]; then
    echo "error: config file $config not found" >&2
    return 2
  fi
  if [[ -z ${SLURM_JOB_NODELIST:-} ]]; then
    echo "error: SLURM_JOB_NODELIST is not set: submit with sbatch, or give SLURM_JOB_NODELIST" \
      "(e.g. 'node[01-08]') and SLURM_NNODES for a --dry-run outside SLURM" >&2
    return 2
  fi
  export PYTHONPATH="$HSAP_REPO${PYTHONPATH:+:$PYTHONPATH}"

  local nodes master_port
  nodes=$(hsap_nodes "$SLURM_JOB_NODELIST") || return 2
  master_port=${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}
  hsap_nccl_defaults

  # The launcher checks the config against the allocation (nodes, GPUs per node) and the rank map
  # torchrun will produce (node-major) before anything starts: intra groups inside one node,
  # inter groups matching parallel.inter_link. It prints that map and every node's torchrun line.
  # torchrun: $HSAP_TORCHRUN, else the one of HSAP_PYTHON's environment (resolved by the launcher)
  local launch=("$config" --nodes "$nodes" --master-port "$master_port" --repo "$HSAP_REPO")
  if [[ -n ${HSAP_TORCHRUN:-} ]]; then launch+=(--torchrun "$HSAP_TORCHRUN"); fi
  if [[ -n ${SLURM_NNODES:-} ]]; then launch+=(--nnodes "$SLURM_NNODES"); fi
  if [[ -n ${MASTER_ADDR:-} ]]; then launch+=(--master-addr "$MASTER_ADDR"); fi
  if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then launch+=(--gpus-on-node "$SLURM_GPUS_ON_NODE"); fi
  local var
  for var in "${HSAP_ENV_VARS[@]}"; do
    if [[ -n ${!var:-} ]]; then
      printf 'export %s=%s\n' "$var" "${!var@Q}"
    fi
  done
  # The training script imports Megatron-LM's pretrain_gpt (pretrain_hybrid for a hybrid layer
  # pattern): from $MEGATRON_LM or the directory the job runs in (a checkout at core_v0.19.0).
  if ((!dry_run)) && [[ -z ${MEGATRON_LM:-} && ! -f pretrain_gpt.py ]]; then
    echo "error: export MEGATRON_LM=/path/to/Megatron-LM (core_v0.19.0) or submit from that" \
      "checkout: scripts/pretrain_gpt_hsap.py and pretrain_hybrid_hsap.py run its pretrain_gpt.py" \
      "and pretrain_hybrid.py" >&2
    return 2
  fi
  # A real launch refuses here, once, what every node's exec would refuse (placeholder or missing
  # data, no torchrun); a dry run only warns.
  local strict=()
  if ((!dry_run)); then strict=(--for-launch); fi
  "$HSAP_PYTHON" -m megatron_hsap.launch resolve "${launch[@]}" --all-nodes "${strict[@]}" -- "${extra[@]}" ||
    return 2
  if ((dry_run)); then
    return 0
  fi
  # One task per node of the allocation; each re-checks and execs its torchrun line, node rank
  # from $SLURM_NODEID (the node's position in the node list, as printed above). srun does not
  # inherit --cpus-per-task from sbatch, so pass it on: torchrun's ranks need those cores.
  local cpus=()
  if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    cpus=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
  fi
  srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${cpus[@]}" \
    "$HSAP_PYTHON" -m megatron_hsap.launch exec "${launch[@]}" -- "${extra[@]}"
}
