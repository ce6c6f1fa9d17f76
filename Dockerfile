# megarl for GPU clusters: SGLang's published image (CUDA toolkit, torch, NCCL, SGLang) plus
# megatron-core, Transformer Engine and NVIDIA apex built against that image's torch.
#   docker build -t megarl .
#   docker run --gpus all --ipc=host --rm megarl megarl train-lm configs/lm_demo.yaml
#   docker run --gpus all --ipc=host --rm megarl benchmarks/gpu/check_rollout.sh
#
# Tag pairing (change them together):
#   SGLANG_IMAGE lmsysorg/sglang:v0.5.6.post2-cu129-amd64
#     -> sglang 0.5.6.post2, which pins torch==2.9.1 (+cu129 in that image), transformers==4.57.1,
#        on CUDA toolkit 12.9.1 and Python 3.12 (SGLang's docker/Dockerfile);
#   MEGATRON_CORE_VERSION 0.16.1: requirements/constraints-cpu.txt, inside setup.py's range;
#   TE_VERSION 2.11.0: megatron-core 0.16.1's own dev extra asks for transformer-engine >=2.9,<2.12;
#     its torch extension is compiled here against torch 2.9.1 (--no-build-isolation);
#   APEX_REF: NVIDIA apex (github, not PyPI's unrelated "apex"), CUDA extensions compiled here;
#     apex checks that nvcc (12.9) matches torch.version.cuda (12.9), which this pairing satisfies.
# The image is the devel variant (nvcc, cuDNN headers), not "-runtime": TE and apex compile.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.6.post2-cu129-amd64
FROM ${SGLANG_IMAGE}

ARG MEGATRON_CORE_VERSION=0.16.1
ARG TE_VERSION=2.11.0
ARG APEX_REF=10417aceddd7d5d05d7cbf7b0fc2daad1105f8b4
# apex is optional for megarl (Transformer Engine supplies the fused Adam and multi-tensor kernels
# megatron-core looks for first); WITH_APEX=0 skips its long compile.
ARG WITH_APEX=1
# Compute capabilities to compile for (A100, H100/H200, B200): docker build sees no GPU to ask.
ARG CUDA_ARCHS="80;90;100"
ARG MAX_JOBS=8

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1 \
    MLFLOW_DISABLE_TELEMETRY=true

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/megarl

# What SGLang pinned stays as it is: every later pip call takes these exact versions as
# constraints, so a conflicting requirement fails the build instead of replacing torch.
RUN python -m pip freeze \
    | grep -iE '^(torch|torchvision|torchaudio|triton|sglang|sgl[-_]kernel|flashinfer|transformers|nvidia-)[^=@ ]*==' \
    > /opt/megarl/base-constraints.txt \
 && grep -iqE '^torch==' /opt/megarl/base-constraints.txt

# megatron-core's wheel first, then Transformer Engine: its [pytorch] part is an sdist whose CUDA
# extension must link against the installed torch, hence no build isolation.
RUN python -m pip install -c /opt/megarl/base-constraints.txt "megatron-core==${MEGATRON_CORE_VERSION}" \
 && NVTE_CUDA_ARCHS="${CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
    python -m pip install --no-build-isolation -c /opt/megarl/base-constraints.txt \
        "transformer_engine[pytorch]==${TE_VERSION}"

# NVIDIA apex with its C++ and CUDA extensions (amp_C, fused_layer_norm_cuda, fused Adam). Older
# apex reads --cpp_ext/--cuda_ext from the build options, newer apex from APEX_CPP_EXT/APEX_CUDA_EXT.
RUN if [ "${WITH_APEX}" = "1" ]; then \
      TORCH_CUDA_ARCH_LIST="$(echo "${CUDA_ARCHS}" | sed -E 's/([0-9]+)([0-9])/\1.\2/g')" \
      MAX_JOBS="${MAX_JOBS}" NVCC_APPEND_FLAGS="--threads 4" APEX_CPP_EXT=1 APEX_CUDA_EXT=1 \
      python -m pip install -v --no-build-isolation -c /opt/megarl/base-constraints.txt \
          --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" \
          "apex @ git+https://github.com/NVIDIA/apex.git@${APEX_REF}"; \
    fi

COPY setup.py README.md ./
COPY megarl ./megarl
# megarl itself; then fail the build if any package SGLang pinned was changed by what came after.
RUN python -m pip install -c /opt/megarl/base-constraints.txt -e . \
 && python -m pip freeze > /tmp/after.txt \
 && if grep -vxFf /tmp/after.txt /opt/megarl/base-constraints.txt; then \
      echo "the lines above (SGLang's pins) were replaced" >&2; exit 1; \
    fi \
 && python -c "import importlib.metadata as m, megatron.core, torch; \
assert megatron.core.__version__ == '${MEGATRON_CORE_VERSION}', megatron.core.__version__; \
print('megarl image: torch', torch.__version__, 'megatron-core', megatron.core.__version__, \
'transformer-engine', m.version('transformer_engine'), 'sglang', m.version('sglang'))" \
 && rm /tmp/after.txt
COPY configs ./configs
COPY launch ./launch
COPY checkpoint_tools ./checkpoint_tools
COPY benchmarks ./benchmarks
COPY tests ./tests
