"""The gated delta net (Qwen3-Next, Qwen3.5) as megarl runs it: Megatron's ``GatedDeltaNet``
(its parameters, tensor-parallel split and dist-checkpoint keys unchanged) with a forward that
also takes packed sequences, left padding and a decode state.

Megatron 0.16's forward refuses packed sequences and inference and ignores the attention mask;
its recurrence needs the ``fla`` GPU kernels. Here:

* **Packed sequences** (``packed_seq_params``): the convolution and the recurrence restart at
  every sequence bound (``cu_seqlens_q``).
* **Padding**: a padded token's projections are zeroed, as transformers zeroes its input
  (``apply_mask_to_padding_states``), so left padding leaves the state at zero. Which tokens are
  real is read from Megatron's attention mask (True = blocked) on its last query row, which is
  a real token wherever megarl passes a mask (the native rollout left-pads its prompts); the
  trainer passes no mask (right padding cannot reach an earlier token).
* **Decoding**: with an inference context that carries ``linear_states`` (the native rollout's
  decode context) the layer keeps, per row, its convolution's last ``kernel - 1`` inputs and
  the recurrent state [heads, key dim, value dim], and a one-token step continues them.
* **The recurrence**: :func:`gated_delta_rule`, a torch loop over tokens in fp32, where ``fla``
  is absent (always on CPU); with ``fla`` installed (GPU), its ``chunk_gated_delta_rule`` runs
  (``cu_seqlens`` for packed rows). The GPU path is unverified here (no GPU).

Context parallelism is refused by name (:func:`megarl.models.builder.check_layout`): Megatron
has no context-parallel gated delta net either.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (transformers' and fla's ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, token by token in fp32. ``q``/``k`` [b, s, h, dk] (l2-normalised),
    ``v`` [b, s, h, dv], ``g`` (log decay) and ``beta`` [b, s, h]; ``initial_state`` [b, h, dk, dv].
    Per token: S ← S·exp(g); S ← S + k ⊗ β(v − Sᵀk); o = Sᵀ(q/√dk). Returns (o [b, s, h, dv] in
    ``v``'s dtype, the final state [b, h, dk, dv] in fp32)."""
    b, s, h, dk = k.shape
    dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = q * dk ** -0.5
    state = (torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device)
             if initial_state is None else initial_state.float())
    out = []
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t].unsqueeze(-1)  # [b, h, dk, 1]
        recalled = (state * k_t).sum(-2)  # Sᵀk: [b, h, dv]
        delta = (v[:, t] - recalled) * beta[:, t].unsqueeze(-1)
        state = state + k_t * delta.unsqueeze(-2)
        out.append((state * q[:, t].unsqueeze(-1)).sum(-2))
    return torch.stack(out, dim=1).to(dtype), state


def _fla_rule():
    """fla's chunked kernel where Megatron found it (GPU installs with the ``fla`` package)."""
    from megatron.core.ssm import gated_delta_net as megatron_gdn

    return megatron_gdn.chunk_gated_delta_rule if megatron_gdn.HAVE_FLA and torch.cuda.is_available() else None


def real_tokens(attention_mask: Optional[torch.Tensor], s: int) -> Optional[torch.Tensor]:
    """[b, s] True on real tokens, from a Megatron mask [b, 1, sq, sk] (True = blocked) whose
    last query row is a real token (see the module's docstring); None without a mask."""
    if attention_mask is None:
        return None
    return ~attention_mask[:, 0, -1, -s:]


def _gdn_class():
    from megatron.core.ssm import gated_delta_net as megatron_gdn

    class GatedDeltaNet(megatron_gdn.GatedDeltaNet):
        """Megatron's layer with megarl's forward (see the module's docstring)."""

        def __init__(self, *args, **kwargs):
            saved = megatron_gdn.HAVE_FLA
            megatron_gdn.HAVE_FLA = True  # its constructor needs fla only for the forward replaced here
            try:
                super().__init__(*args, **kwargs)
            finally:
                megatron_gdn.HAVE_FLA = saved

        def reset_parameters(self):
            """Megatron's initialisation forks the model-parallel RNG, which a converter's model
            (built to be loaded, no seed set) does not have: there it draws from the default one."""
            from megatron.core.tensor_parallel import get_cuda_rng_tracker
            from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME

            if _MODEL_PARALLEL_RNG_TRACKER_NAME in get_cuda_rng_tracker().get_states():
                return super().reset_parameters()
            tracker = get_cuda_rng_tracker()
            fork, tracker.fork = tracker.fork, lambda *a, **k: contextlib.nullcontext()
            try:
                super().reset_parameters()
            finally:
                tracker.fork = fork

        def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                    attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                    inference_params=None, **kwargs):
            context = inference_context if inference_context is not None else inference_params
            mixed, _ = self.in_proj(hidden_states)  # [s, b, local projections] (sequence gathered)
            s, b = mixed.shape[:2]
            real = real_tokens(attention_mask, s)
            if real is not None:
                mixed = mixed.masked_fill(~real.t().unsqueeze(-1), 0)
            mixed = mixed.transpose(0, 1)  # [b, s, ...]
            tp = self.tp_size
            qkv, z, beta, alpha = torch.split(
                mixed, [(2 * self.qk_dim + self.v_dim) // tp, self.v_dim // tp,
                        self.num_value_heads // tp, self.num_value_heads // tp], dim=-1)
            states = None
            if context is not None:
                states = getattr(context, "linear_states", None)
                if states is None:
                    raise NotImplementedError("the gated delta net decodes only with megarl's native rollout "
                                              "(its decode context keeps the recurrent state)")
            if packed_seq_params is not None:
                if b != 1 or context is not None:
                    raise ValueError("packed sequences come as one row, without an inference context")
                cu = packed_seq_params.cu_seqlens_q_padded
                cu = (packed_seq_params.cu_seqlens_q if cu is None else cu).tolist()
                pieces = [self._mix(qkv[:, lo:hi], beta[:, lo:hi], alpha[:, lo:hi], None)[0]
                          for lo, hi in zip(cu[:-1], cu[1:]) if hi > lo]
                core = torch.cat(pieces, dim=1)
            else:
                previous = None
                if states is not None and context.sequence_len_offset > 0:
                    previous = states[self.layer_number]
                core, final = self._mix(qkv, beta, alpha, previous)
                if states is not None:
                    states[self.layer_number] = final
            out = self._apply_gated_norm(core, z.reshape(b, s, -1, self.value_head_dim))
            out = out.reshape(b, s, -1).transpose(0, 1).contiguous()
            return self.out_proj(out)

        def _mix(self, qkv, beta, alpha, previous):
            """Convolution and recurrence of one run of tokens [b, s, ...], continuing
            ``previous`` (convolution inputs [b, channels, kernel - 1], recurrent state)."""
            b, s = qkv.shape[:2]
            x = qkv.transpose(1, 2)  # [b, channels, s]
            width = self.conv_kernel_dim - 1
            before = x.new_zeros(b, x.shape[1], width) if previous is None else previous[0].to(x.dtype)
            x = torch.cat([before, x], dim=-1)
            conv_state = x[..., -width:].clone()
            x = F.conv1d(x, self.conv1d.weight, self.conv1d.bias, groups=x.shape[1])
            x = self.act_fn(x).transpose(1, 2)  # [b, s, channels]
            tp = self.tp_size
            query, key, value = torch.split(x, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
            query = l2_normalize(query.reshape(b, s, -1, self.key_head_dim).float())
            key = l2_normalize(key.reshape(b, s, -1, self.key_head_dim).float())
            value = value.reshape(b, s, -1, self.value_head_dim)
            repeat = self.num_value_heads // self.num_key_heads
            if repeat > 1:
                query = query.repeat_interleave(repeat, dim=2)
                key = key.repeat_interleave(repeat, dim=2)
            g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)
            beta = beta.sigmoid()
            initial = None if previous is None else previous[1]
            fla = _fla_rule()
            if fla is not None:
                core, state = fla(query.to(value.dtype), key.to(value.dtype), value, g=g, beta=beta,
                                  initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=False)
            else:
                core, state = gated_delta_rule(query, key, value, g, beta, initial)
            return core, (conv_state, state)

        def _apply_gated_norm(self, x, gate):
            """transformers' gated RMSNorm: norm(x) (the weight as the config's norms take it),
            times silu(gate) in fp32, cast back."""
            dtype = x.dtype
            y = self.out_norm(x.reshape(-1, x.shape[-1]))
            y = y * self.act_fn(gate.reshape(-1, gate.shape[-1]).float())
            return y.to(dtype)

    return GatedDeltaNet


_CLASS = None


def gated_delta_net_class():
    """megarl's ``GatedDeltaNet`` (built on first use: importing Megatron's module is lazy)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _gdn_class()
    return _CLASS


def keep_rows(states: dict, index: torch.Tensor) -> None:
    """Keep only rows ``index`` of every layer's decode state (finished rows leave the batch)."""
    for layer, (conv, recurrent) in list(states.items()):
        states[layer] = (conv.index_select(0, index), recurrent.index_select(0, index))
