#!/usr/bin/env bash
# GPU check of the rollout engines: native (always) and SGLang (when importable).
#
#   benchmarks/gpu/check_rollout.sh [DIR_WITH_MEGATRON_CORE_WHEEL]
#
# Installs megatron-core from a carried wheel when it is missing (no registry needed), then runs
# check_rollout.py on every GPU of this machine: log-prob parity of each engine with the
# trainer and generated tokens/s. Exits non-zero when a check fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! python -c "import megatron.core" 2>/dev/null; then
    wheel_dir="${1:-wheels}"
    python -m pip install --no-deps --no-index --find-links "$wheel_dir" megatron-core
fi
nproc="${NPROC:-1}"
PYTHONPATH="$PWD" python -m torch.distributed.run --standalone --nproc-per-node "$nproc" benchmarks/gpu/check_rollout.py
