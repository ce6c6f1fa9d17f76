"""A stand-in for Transformer Engine's FusedAdam (transformer_engine/pytorch/optimizers/fused_adam.py)
on CPU, for checkpoint save and resume: what megatron-core builds when TE is installed.

It keeps TE's bookkeeping, which differs from torch's Adam: the per-parameter state holds only
``exp_avg`` and ``exp_avg_sq`` (``master_param`` with master weights, which megarl does not ask
for), and the step count lives in each param group (``group["step"]``, an int, incremented by
``step()`` in groups with parameters). ``state_dict()`` and ``load_state_dict()`` read and write
each state key through TE's dtype map, so a key TE does not know (torch Adam's per-parameter
``step``) raises ``KeyError`` as TE's does.

The update is TE's ``multi_tensor_adam`` kernel (transformer_engine/common/multi_tensor/adam.cu,
``AdamFunctor``) with the options megatron-core passes without a precision-aware optimizer (fp32
states, bias correction, ``adam_w_mode``): its operations in its order in fp32, the bias corrections
computed in double from the float betas and rounded to float, as its host code does. The GPU
compiler may contract multiply-adds, so this is TE's formula, not its bits on a GPU; the checkpoint
test compares the stand-in with itself.

:func:`installed` makes megatron-core build it as it would build TE's (the module globals its
optimizer factory and distributed optimizer read at import).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

STATE_DTYPES = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master_param": torch.float32}


class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False, set_grad_none=None):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        unmodelled = {"capturable": capturable, "master_weights": master_weights,
                      "use_decoupled_grad": use_decoupled_grad, "store_param_remainders": store_param_remainders,
                      "low-precision states": (exp_avg_dtype, exp_avg_sq_dtype) != (torch.float32, torch.float32)}
        if any(unmodelled.values()):
            raise NotImplementedError(f"the FusedAdam stand-in models TE's FusedAdam as megatron-core builds it "
                                      f"for megarl; not {[k for k, v in unmodelled.items() if v]}")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.name_to_dtype_map = dict(STATE_DTYPES)

    # ---------------------------------------------------------------- TE's state bookkeeping

    def get_unscaled_state(self, param, state_name):
        dtype = self.name_to_dtype_map[state_name]  # KeyError for a key TE does not keep, as TE's
        assert self.state[param][state_name].dtype == dtype
        return self.state[param][state_name]

    def set_scaled_state(self, param, state_name, unscaled_state):
        assert unscaled_state.dtype == torch.float32
        state = self.state[param]
        if state_name not in state:
            self._initialize_state(param, state_name, zero_buffer=False)
        state[state_name].copy_(unscaled_state)

    def _initialize_state(self, param, state_name, zero_buffer: bool):
        data = torch.empty_like(param, dtype=self.name_to_dtype_map[state_name])
        if zero_buffer:
            data.zero_()
        self.state[param][state_name] = data

    def initialize_state(self, param, store_param_remainders=False):
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)

    def state_dict(self):
        """torch's, with every state key read through TE's dtype map (TE casts non-fp32 states)."""
        state_dict = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_id = dict(zip(ids, params))
        for k, v in state_dict["state"].items():
            if k in by_id:
                state_dict["state"][k] = {name: self.get_unscaled_state(by_id[k], name) for name in v}
        return state_dict

    def load_state_dict(self, state_dict):
        """torch's (the param groups, their ``step`` among them), then each state key set again
        through TE's dtype map."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_id = dict(zip(ids, params))
        for k, v in state_dict["state"].items():
            if k in by_id:
                param = by_id[k]
                self.state[param] = {}
                for name in v:
                    if v[name] is not None:
                        self.set_scaled_state(param, name, v[name].float())

    # ---------------------------------------------------------------- the update

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1
            f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731  (the kernel's float arguments)
            beta1, beta2 = (float(f32(b)) for b in group["betas"])
            if group["bias_correction"]:  # host code: 1 - std::pow(float beta, int step), in double, to float
                correction1, correction2 = f32(1 - beta1 ** group["step"]), f32(1 - beta2 ** group["step"])
            else:
                correction1, correction2 = f32(1.0), f32(1.0)
            b1, b2, eps, lr, decay = f32(beta1), f32(beta2), f32(group["eps"]), f32(group["lr"]), f32(group["weight_decay"])
            one = f32(1.0)
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p)
                if p.grad is None:
                    continue
                g, r_p = p.grad.float(), p.float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if self.adam_w_mode == 0:  # L2
                    g = g + decay * r_p
                m.copy_(b1 * m + (one - b1) * g)
                v.copy_(b2 * v + (one - b2) * g * g)
                denom = torch.sqrt(v / correction2) + eps
                update = (m / correction1) / denom
                if self.adam_w_mode == 1:
                    update = update + decay * r_p
                p.copy_(r_p - lr * update)
        return loss


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """megatron-core builds :class:`FusedAdam` as it builds TE's when TE is importable: its optimizer
    factory's ``Adam`` (with ``adam_w_mode``) and the distributed optimizer's TE flags (the step in
    the param groups). Optimizers built inside keep the stand-in."""
    from unittest import mock

    from megatron.core import optimizer as factory
    from megatron.core.optimizer import distrib_optimizer

    with mock.patch.object(factory, "Adam", FusedAdam), mock.patch.object(factory, "USING_PYTORCH_OPTIMIZER", False), \
            mock.patch.object(distrib_optimizer, "Adam", FusedAdam), \
            mock.patch.object(distrib_optimizer, "HAVE_APEX_OR_TE", True), \
            mock.patch.object(distrib_optimizer, "USING_TE_OPTIMIZER", True):
        yield
