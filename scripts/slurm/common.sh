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
Environment: HSAP_PYTHON (a python that imports megatron_hsap, default python3), HSAP_TORCHRUN
(default torchrun), MEGATRON_LM (Megatron-LM checkout), MASTER_PORT, HSAP_REPO, and
every NCCL_* default in scripts/slurm/common.sh.
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
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
}

HSAP_ENV_VARS=(NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_NVLS_ENABLE NCCL_IB_TIMEOUT
  TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG OMP_NUM_THREADS PYTHONPATH
  MEGATRON_LM)

# One hostname per line: scontrol when available, else the launcher's expander (node[01-08]).
hsap_hostnames() {
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$1"
  else
    "$HSAP_PYTHON" -m megatron_hsap.launch hostnames "$1"
  fi
}

hsap_main() {
  local default_config=$1
  shift
  HSAP_DEFAULT_CONFIG=$default_config
  HSAP_PYTHON=${HSAP_PYTHON:-python3}
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

  local hostlist nodes=()
  hostlist=$(hsap_hostnames "$SLURM_JOB_NODELIST") || return 2
  mapfile -t nodes <<<"$hostlist"
  local nnodes=${SLURM_NNODES:-${#nodes[@]}}
  if ((nnodes != ${#nodes[@]})); then
    echo "error: SLURM_NNODES=$nnodes but SLURM_JOB_NODELIST names ${#nodes[@]} host(s)" >&2
    return 2
  fi
  local nodes_csv master_addr master_port
  nodes_csv=$(IFS=,; echo "${nodes[*]}")
  master_addr=${MASTER_ADDR:-${nodes[0]}}
  master_port=${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}
  hsap_nccl_defaults

  # Before any GPU is touched: the config must match the allocation, and the rank map torchrun
  # will produce (node-major) must keep intra groups in one node and match parallel.inter_link.
  local topo gpus_flag=()
  if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
    gpus_flag=(--gpus-on-node "$SLURM_GPUS_ON_NODE")
  fi
  topo=$("$HSAP_PYTHON" -m megatron_hsap.launch topology "$config" --nodes "$nodes_csv" "${gpus_flag[@]}") || return 2
  local line
  while IFS= read -r line; do
    printf '# %s\n' "$line"
  done <<<"$topo"

  local launch=("$config" --nodes "$nodes_csv" --nnodes "$nnodes" --master-addr "$master_addr"
    --master-port "$master_port" --repo "$HSAP_REPO" --torchrun "${HSAP_TORCHRUN:-torchrun}")
  if ((dry_run)); then
    local var
    for var in "${HSAP_ENV_VARS[@]}"; do
      if [[ -n ${!var:-} ]]; then
        printf 'export %s=%s\n' "$var" "${!var@Q}"
      fi
    done
    "$HSAP_PYTHON" -m megatron_hsap.launch resolve "${launch[@]}" --all-nodes -- "${extra[@]}"
    return
  fi
  # The training script imports Megatron-LM's pretrain_gpt: from $MEGATRON_LM or the directory
  # the job runs in (a Megatron-LM checkout at core_v0.19.0).
  if [[ -z ${MEGATRON_LM:-} && ! -f pretrain_gpt.py ]]; then
    echo "error: export MEGATRON_LM=/path/to/Megatron-LM (core_v0.19.0) or submit from that" \
      "checkout: scripts/pretrain_gpt_hsap.py runs its pretrain_gpt" >&2
    return 2
  fi
  # One task per node; each execs torchrun with its node rank ($SLURM_NODEID). srun does not
  # inherit --cpus-per-task from sbatch, so pass it on: torchrun's ranks need those cores.
  local cpus=()
  if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    cpus=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
  fi
  srun --nodes="$nnodes" --ntasks-per-node=1 --kill-on-bad-exit=1 "${cpus[@]}" \
    "$HSAP_PYTHON" -m megatron_hsap.launch exec "${launch[@]}" -- "${extra[@]}"
}
