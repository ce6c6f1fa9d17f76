"""The typed configuration tree of megarl: one dataclass per component, composed into MegarlConfig.

Every field documents its unit, default and interactions. YAML files and ``key=value`` overrides
are checked against this tree by :mod:`megarl.config.loader`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class ModelConfig:
    """Which network to build and how to build it."""

    hf_config: str = "configs/models/tiny-llama.json"
    """Path to a Hugging Face ``config.json`` (or its directory); its ``model_type`` picks the architecture."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary up to a multiple of this (tokens); the padded size must divide by every tp used."""
    params_dtype: str = "auto"
    """``float32``, ``bfloat16``, ``float16`` or ``auto`` (bf16 with CUDA, fp32 on CPU)."""
    transformer_impl: str = "auto"
    """``transformer_engine``, ``local`` or ``auto`` (TE when it and CUDA are present, else local + SDPA)."""
    recompute_granularity: Optional[str] = None
    """Activation recompute: null, ``selective`` or ``full``."""
    moe_token_dispatcher: str = "alltoall"
    """MoE token dispatcher: ``alltoall`` or ``allgather``."""
    moe_aux_loss_coeff: Optional[float] = None
    """Load-balancing loss weight; null takes the HF config's ``router_aux_loss_coef`` (0 when absent)."""


@dataclass
class ParallelConfig:
    """A training layout (Megatron rank order tp-cp-ep-dp-pp). ``dp=0`` derives dp from the world size."""

    tp: int = 1
    """Tensor-parallel size; must divide attention heads, query groups and FFN width."""
    pp: int = 1
    """Pipeline-parallel size; must divide the number of layers (times vpp)."""
    dp: int = 0
    """Data-parallel size; 0 = world_size / (tp*pp*cp)."""
    ep: int = 1
    """Expert-parallel size (MoE); must divide the number of experts and tp*cp*dp/etp."""
    etp: Optional[int] = None
    """Expert-tensor-parallel size (MoE); null = tp (Megatron's default); must divide the expert FFN width."""
    cp: int = 1
    """Context-parallel size (sequence split across ranks)."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B); null = none; needs pp > 1."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism when tp > 1 (required for MoE with tp > 1)."""


@dataclass
class RolloutLayoutConfig:
    """The generation layout of the actor's weights (3D-HybridEngine target)."""

    tp: int = 1
    """Generation tensor-parallel size t_g; t_g*p_g must divide actor tp*pp."""
    pp: int = 1
    """Generation pipeline-parallel size p_g."""
    ep: int = 1
    """Generation expert-parallel size e_g (MoE)."""


@dataclass
class LayoutsConfig:
    """One parallel layout per model role."""

    actor: ParallelConfig = field(default_factory=ParallelConfig)
    critic: ParallelConfig = field(default_factory=ParallelConfig)
    reference: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutLayoutConfig = field(default_factory=RolloutLayoutConfig)


@dataclass
class OptimizerConfig:
    """Adam(W) with Megatron's (distributed) optimizer and an LR schedule."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    lr_warmup_steps: int = 0
    """Linear warmup, in optimizer steps."""
    lr_decay_style: str = "constant"
    """``constant``, ``linear`` or ``cosine``."""


@dataclass
class DataConfig:
    """Batches: sizes are in sequences unless stated."""

    train_files: List[str] = field(default_factory=list)
    """Prompt datasets (jsonl or parquet); empty = the built-in task."""
    prompt_key: str = "prompt"
    """Record field holding the prompt."""
    num_digits: int = 6
    """Built-in reverse-the-digits task: digits per problem (sequences are 2*num_digits+1 tokens)."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all data-parallel ranks; must divide by dp*micro_batch_size."""
    micro_batch_size: int = 2
    """Sequences per micro-batch on one data-parallel rank."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm (filled in by the trainer issue; defaults describe GRPO)."""

    name: str = "grpo"
    """``grpo``, ``ppo``, ``dapo``, ``rloo``, ``reinforce_pp`` or ``remax``."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference term."""
    samples_per_prompt: int = 4
    """Responses sampled per prompt (GRPO group size)."""


@dataclass
class TrainerConfig:
    """The outer loop."""

    train_steps: int = 60
    """Optimizer steps to run."""
    nproc_per_node: int = 2
    """Processes a local launch starts (``megarl train-lm`` spawns torchrun with this many)."""
    seed: int = 1234
    """Seed of model init, data and sampling."""
    log_interval: int = 10
    """Print metrics every this many steps."""
    run_dir: str = "runs/latest"
    """Where logs, metrics and checkpoints go."""


@dataclass
class LoggingConfig:
    """Where metrics go."""

    mlflow: bool = False
    """Log to MLflow."""
    mlflow_tracking_uri: Optional[str] = None
    """null = a sqlite store inside trainer.run_dir."""
    experiment: str = "megarl"
    """MLflow experiment name."""
    progress_bar: bool = True
    """Show a console progress bar."""


@dataclass
class MegarlConfig:
    """The whole tree."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: LayoutsConfig = field(default_factory=LayoutsConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
