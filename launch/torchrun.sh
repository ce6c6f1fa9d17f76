#!/usr/bin/env bash
# Start a megarl SPMD program with torchrun on one node, or on each node of a multi-node job.
#
#   launch/torchrun.sh [CONFIG.yaml] [key=value ...]
#
# Environment (defaults in brackets):
#   NPROC_PER_NODE  processes on this node [GPUs this process may use: CUDA_VISIBLE_DEVICES's
#                   entries when it is set, else nvidia-smi's; with none, trainer.nproc_per_node's 2]
#   NNODES          nodes in the job [1]
#   NODE_RANK       this node's index [0]
#   MASTER_ADDR     address of node 0 [127.0.0.1; loopback for single-node runs]
#   MASTER_PORT     rendezvous port on node 0 [29500]
#   MEGARL_MODULE   program to run [megarl.entrypoints.train_lm]
#   DRY_RUN=1       print the torchrun command and every rank's layout coordinates; start nothing
set -euo pipefail

# nvidia-smi lists every GPU of the node, whatever CUDA_VISIBLE_DEVICES hides
default_nproc=0
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
  IFS=',' read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
  for device in "${visible[@]}"; do
    case "$device" in -*) break ;; *[![:space:]]*) default_nproc=$((default_nproc + 1)) ;; esac  # CUDA stops at -1
  done
elif command -v nvidia-smi >/dev/null 2>&1; then
  default_nproc="$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)"
fi
if [ "$default_nproc" -eq 0 ]; then default_nproc=2; fi
nproc="${NPROC_PER_NODE:-$default_nproc}"
nnodes="${NNODES:-1}"
node_rank="${NODE_RANK:-0}"
master_addr="${MASTER_ADDR:-127.0.0.1}"
master_port="${MASTER_PORT:-29500}"
module="${MEGARL_MODULE:-megarl.entrypoints.train_lm}"

# the allocator's expandable_segments added to the user's own setting, as megarl gives its Ray
# workers (megarl.runtime.memory.allocator_env): memory freed by an offload is not left fragmented
alloc_var=PYTORCH_CUDA_ALLOC_CONF
if [ -n "${PYTORCH_ALLOC_CONF:-}" ]; then alloc_var=PYTORCH_ALLOC_CONF; fi
alloc="${!alloc_var:-}"
case "$alloc" in
  *expandable_segments*) ;;
  "") alloc="expandable_segments:True" ;;
  *) alloc="$alloc,expandable_segments:True" ;;
esac

cmd=(env "$alloc_var=$alloc" torchrun
  --nproc-per-node "$nproc"
  --nnodes "$nnodes"
  --node-rank "$node_rank"
  --master-addr "$master_addr"
  --master-port "$master_port"
  -m "$module" "$@")

if [ "${DRY_RUN:-0}" = "1" ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exec "${MEGARL_PYTHON:-python}" -m megarl.cli layout "$@" --world-size=$((nproc * nnodes))
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${cmd[@]}"
