"""The actor: the policy's log-probs and its update (policy loss + KL to the reference +
entropy bonus), over a :class:`MegatronEngine`.

Input tensors, [rows, seq], right-padded: ``tokens``, ``labels`` (next tokens), ``position_ids``,
``loss_mask`` (1 on response tokens), ``old_log_probs``, ``ref_log_probs``, ``advantages``. The
old log-probs stay fixed over all the mini-batches and epochs of one update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from megarl.algorithms.correction import rollout_correction_weights
from megarl.algorithms.kl import LOG_RATIO_BOUND, clamp_log_ratio
from megarl.algorithms.losses import POLICY_LOSSES, entropy_bonus, kl_loss, loss_denominators
from megarl.algorithms.masked import masked_mean, select_valid
from megarl.config.schema import AggMode, RolloutCorrection
from megarl.engines.batching import Tensors
from megarl.engines.megatron_engine import MegatronEngine, MicroBatching, MiniBatches
from megarl.metrics import Metric, Reduce
from megarl.protocol import Dispatch, verb


@dataclass
class ActorLossConfig:
    """The actor's objective."""

    policy_loss: str = "ppo"
    """A POLICY_LOSSES name: ``ppo`` or ``gspo``."""
    agg_mode: AggMode = AggMode.token_mean
    """Loss aggregation over the global batch (see megarl.algorithms.losses.aggregate)."""
    clip_low: float = 0.2
    """Lower clip range of the ratio."""
    clip_high: float = 0.2
    """Upper clip range (raise it for DAPO's clip-higher)."""
    dual_clip_c: Optional[float] = None
    """Dual-clip bound for negative advantages (> 1), null = off."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss term."""
    kl_estimator: str = "k3"
    """KL estimator: k1, k2 or k3."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    positive_nll_coef: float = 0.0
    """Weight of VAPO's LM loss on positive samples (the batch's ``nll_weights``)."""
    max_len: Optional[int] = None
    """Generation budget, needed by ``seq-mean-token-sum-norm``."""
    temperature: float = 1.0
    """Sampling temperature the log-probs are computed at."""
    rollout_correction: RolloutCorrection = RolloutCorrection.none
    """Importance weights pi_old / pi_rollout in the policy loss (megarl.algorithms.correction)."""
    rollout_correction_threshold: float = 2.0
    rollout_correction_threshold_low: float = 0.5
    """Their bound C (> 1): truncation (TIS) or masking (MIS) above it."""


class Actor:
    """The policy model in its training layout."""

    def __init__(self, engine: MegatronEngine, loss: ActorLossConfig):
        self.engine = engine
        self.cfg = loss

    @verb(Dispatch.DP, output="old_log_probs")
    def compute_log_prob(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching) -> torch.Tensor:
        return self.engine.forward_log_probs(batch, lengths, how, self.cfg.temperature)["log_probs"]

    def _loss(self, logp: torch.Tensor, entropy: torch.Tensor, t: Tensors):
        cfg, mask = self.cfg, t["loss_mask"]
        tokens, seqs = loss_denominators(mask)
        # Sums here; Megatron divides by the count summed over micro-batches and DP ranks.
        count = tokens if cfg.agg_mode == AggMode.token_mean else seqs
        norm = dict(global_tokens=1, global_seqs=1, max_len=cfg.max_len)
        weights, correction = None, {}
        if "rollout_log_probs" in t:  # the train-inference mismatch, logged at any mode
            weights, correction = rollout_correction_weights(
                t["old_log_probs"], t["rollout_log_probs"], mask, cfg.rollout_correction,
                cfg.rollout_correction_threshold, cfg.rollout_correction_threshold_low)
        elif cfg.rollout_correction != RolloutCorrection.none:
            raise ValueError(f"rollout_correction='{cfg.rollout_correction}' needs the batch's rollout_log_probs")
        loss, means = POLICY_LOSSES.get(cfg.policy_loss)(
            logp, t["old_log_probs"], t["advantages"], mask, agg_mode=cfg.agg_mode,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip_c=cfg.dual_clip_c, weights=weights, **norm)
        metrics = {k: Metric(v) for k, v in means.items()}
        correction = {f"rollout_correction/{k}": m for k, m in correction.items()}
        metrics |= {k: m for k, m in correction.items() if m.reduce is Reduce.MEAN}
        if cfg.positive_nll_coef:  # sum_t w_t * -log p_t; the engine divides by the step's count
            nll = -select_valid(logp, mask).mul(select_valid(t["nll_weights"], mask)).sum()
            loss = loss + cfg.positive_nll_coef * nll
            metrics["positive_nll"] = Metric(nll.detach() / count.clamp(min=1))
        if cfg.kl_coef:
            kl = kl_loss(logp, t["ref_log_probs"], mask, cfg.kl_estimator, cfg.agg_mode, **norm)
            loss = loss + cfg.kl_coef * kl
            metrics["kl"] = Metric(kl.detach() / count.clamp(min=1))
        # Logged at any coefficient (the engine computes it with the log-probs); detached at 0 so
        # the backward skips its term.
        entropy_term = entropy_bonus(entropy if cfg.entropy_coef else entropy.detach(), mask, cfg.agg_mode, **norm)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy_term
        metrics["entropy"] = Metric(entropy_term.detach() / count.clamp(min=1))
        # metrics are micro-batch means; weight them by the count so the engine can average
        metrics = {k: Metric(m.value * count) for k, m in metrics.items()}
        extrema = {k: m for k, m in correction.items() if m.reduce is not Reduce.MEAN}  # not weighted
        return loss, count, metrics | extrema | self._ratio_extras(logp.detach(), t, count)

    def _ratio_extras(self, logp: torch.Tensor, t: Tensors, count: torch.Tensor) -> Dict[str, Metric]:
        """Token-level ratio extrema (``ratio_max``/``ratio_min``: the engine reduces them with
        max/min) and, for ppo, which side of the clip removed a token's gradient: ``clip_frac_high``
        (A > 0, ratio > 1 + clip_high), ``clip_frac_low`` (A < 0, ratio < 1 - clip_low); their
        sum is ``clip_frac``. Count-weighted like the other metrics."""
        cfg, mask = self.cfg, t["loss_mask"]
        valid = mask.bool()
        ratio = torch.exp(clamp_log_ratio(torch.where(valid, logp - t["old_log_probs"], 0.0)))  # [n, s]
        extras = {"ratio_max": Metric(torch.where(valid, ratio, 0.0).max(), Reduce.MAX),
                  "ratio_min": Metric(torch.where(valid, ratio, math.exp(LOG_RATIO_BOUND)).min(), Reduce.MIN)}
        if cfg.policy_loss == "ppo":
            advantages = t["advantages"]
            high = (advantages > 0) & (ratio > 1 + cfg.clip_high)
            low = (advantages < 0) & (ratio < 1 - cfg.clip_low)
            extras["clip_frac_high"] = Metric(masked_mean(high.to(ratio.dtype), mask) * count)
            extras["clip_frac_low"] = Metric(masked_mean(low.to(ratio.dtype), mask) * count)
        return extras

    @verb(Dispatch.DP, optimizer_steps=True)
    def update(self, batch: Tensors, lengths: torch.Tensor, how: MicroBatching,
               mini: Optional[MiniBatches] = None) -> Dict[str, float]:
        """Optimizer steps over ``batch`` (this DP rank's rows), one per mini-batch and epoch."""
        return self.engine.update(batch, lengths, self._loss, how, self.cfg.temperature, mini)
