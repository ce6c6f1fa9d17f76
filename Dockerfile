# megarl for GPU clusters: NGC PyTorch (CUDA, NCCL, Transformer Engine, NVIDIA apex) + SGLang.
#   docker build -t megarl .
#   docker run --gpus all --ipc=host --rm megarl megarl train-lm configs/lm_demo.yaml
# NGC releases pair a PyTorch/TE/apex set; pick one whose torch satisfies SGLang's pin.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    MLFLOW_DISABLE_TELEMETRY=true

WORKDIR /opt/megarl
COPY setup.py README.md ./
COPY megarl ./megarl
# The base image's torch, Transformer Engine and apex stay: pip must not replace them.
RUN pip freeze | grep -iE '^(torch|transformer[-_]engine|apex|flash[-_]attn)' > /tmp/keep.txt \
 && pip install -c /tmp/keep.txt -e ".[sglang]" \
 && python -c "import megatron.core, transformer_engine, sglang; print('megarl image ok')"
COPY configs ./configs
COPY launch ./launch
COPY checkpoint_tools ./checkpoint_tools
COPY benchmarks ./benchmarks
COPY tests ./tests
