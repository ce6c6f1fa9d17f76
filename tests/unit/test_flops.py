"""Model FLOPs against hand arithmetic for a tiny dense and a tiny MoE config, and against the
parameter shapes of the planner's model description for every shipped config (MLA included)."""

from pathlib import Path

import pytest

from megarl.hybrid import ModelSpec
from megarl.models.flops import forward_flops, gpu_peak_tflops
from megarl.models.hf_config import megatron_args_from_hf


def test_dense_by_hand():
    # tiny-llama: hidden 64, 4 heads of 16, 2 query groups, SwiGLU 128, 4 layers, vocab 256
    f = forward_flops(megatron_args_from_hf("configs/models/tiny-llama.json"))
    qkv, proj, mlp = 64 * (4 + 2 * 2) * 16, 64 * 64, 3 * 64 * 128
    assert f.per_token == 2 * 4 * (qkv + proj + mlp) == 294_912
    assert f.attention == 4 * 4 * 64 == 1024  # 4 s h per layer-token, h = 4 heads x 16
    assert f.lm_head == 2 * 64 * 256 and f.value_head == 2 * 64
    assert f.forward([10, 3]) == 13 * (294_912 + 32_768) + (100 + 9) * 1024
    assert f.forward([10], value_head=True) == 10 * (294_912 + 128) + 100 * 1024


def test_moe_counts_router_and_top_k_experts():
    # tiny-qwen3-moe: 4 MoE layers, 4 experts of SwiGLU 32, top-2, no shared expert
    f = forward_flops(megatron_args_from_hf("configs/models/tiny-qwen3-moe.json"))
    attn = 64 * (4 + 2 * 2) * 16 + 64 * 64
    router, experts = 64 * 4, 2 * 3 * 64 * 32
    assert f.per_token == 2 * 4 * (attn + router + experts) == 198_656


@pytest.mark.parametrize("config", sorted(str(p) for p in Path("configs/models").rglob("*.json")))
def test_per_token_is_twice_the_weights_a_token_meets(config):
    args = megatron_args_from_hf(config)
    model = ModelSpec.from_args(args, vocab_multiple=1)
    topk = args.config_kwargs.get("moe_router_topk", 0)
    weights = sum(t.numel * (topk / model.num_experts if t.expert is not None else 1) for t in model.tensors
                  if len(t.shape) == 2 and t.stage != "first")
    if args.tie_word_embeddings:
        weights += args.vocab_size * args.config_kwargs["hidden_size"]
    f = forward_flops(args)
    assert f.per_token + f.lm_head == pytest.approx(2 * weights, rel=1e-12)


def test_gpu_peak():
    assert gpu_peak_tflops(None, "NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops(None, "NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops(None, "NVIDIA B200") == 2250.0
    assert gpu_peak_tflops(None, "Tesla T4") is None and gpu_peak_tflops(None, None) is None
    assert gpu_peak_tflops(400.0, None) == 400.0
    with pytest.raises(ValueError, match="logging.gpu_peak_tflops"):
        gpu_peak_tflops(0.0, "NVIDIA H100")


def test_gated_delta_nets_cost_linear_in_the_sequence():
    """tiny-qwen3-next: layers 0 and 2 are delta nets (no s² attention term; their convolution of
    kernel 4 over 2·32 + 64 channels and the delta rule on 4 heads of 16 × 16 per token), 1 and 3
    gated attention (4 heads of 16)."""
    f = forward_flops(megatron_args_from_hf("configs/models/tiny-qwen3-next.json"))
    assert f.attention == 2 * 4 * 4 * 16
    assert f.recurrence == 2 * (2 * (2 * 32 + 64) * 4 + 6 * 4 * 16 * 16)
    assert f.forward([10]) - f.forward([10]) == 0 and f.forward([20]) - 2 * f.forward([10]) == 200 * f.attention
