"""Driver-side RL step logic with a scripted rollout (no model): DAPO dynamic sampling refills
the step, ReMax draws a greedy baseline, overlong shaping, batch layout, advantages."""

from __future__ import annotations

import pytest
import torch

from megarl.config import AlgorithmConfig
from megarl.data.datasets import PromptRecord
from megarl.data.tokenizer import DigitTokenizer
from megarl.protocol import Columns
from megarl.rollout import Response
from megarl.algorithms.presets import resolve
from megarl.trainer.steps import (PromptStream, Scorer, accurate_groups, advantages, make_batch, overlong_penalty,
                                  sample_step, sampling_metrics, varied_groups)

TOK = DigitTokenizer()


class ScriptedRollout:
    """Answers prompt "k=" with the digits of k: all samples equal (one reward per group) when
    k is even, alternating right/wrong when odd; greedy calls are recorded."""

    def __init__(self):
        self.calls = []
        self.version = -1  # the weights' policy version, stamped on each response

    def generate(self, prompts, sampling):
        self.calls.append(sampling)
        out = []
        for p, ids in enumerate(prompts):
            k = int(TOK.decode(ids)[:-1])
            for s in range(sampling.n):
                right = k % 2 == 0 or s % 2 == 0 or sampling.greedy
                text = str(k) if right else "9" * len(str(k))
                out.append(Response(p, s, TOK.encode(text) + [TOK.eos_token_id], [-0.5] * (len(text) + 1), "stop",
                                    self.version))
        return out


def stream(n=40, step=1):
    records = [PromptRecord(f"{k}=", str(k), f"t:{k}") for k in range(11, 11 + n * step, step)]
    return PromptStream(records, TOK, seed=0, max_prompt_tokens=16)


def algo(**kw):
    return AlgorithmConfig(**{"reward_fn": "exact_match", "samples_per_prompt": 4, "max_new_tokens": 4, **kw})


def test_dynamic_sampling_refills_the_step():
    a = algo(name="dapo", dynamic_sampling=True, max_sampling_rounds=6)
    rollout = ScriptedRollout()
    sampled = sample_step(rollout, stream(), Scorer(a, TOK), a, prompts_per_step=8, seed=0, eos_token_ids=[2])
    assert len(sampled.records) == 8 and len(sampled.responses) == 32  # the configured size
    assert sampled.rounds > 1 and sampled.dropped_groups > 0
    index = torch.tensor([r.prompt_index for r in sampled.responses])
    assert varied_groups(sampled.scores, index).all()  # only groups with a signal were kept


def test_without_dynamic_sampling_one_round():
    a = algo(name="grpo")
    sampled = sample_step(ScriptedRollout(), stream(), Scorer(a, TOK), a, prompts_per_step=8, seed=0, eos_token_ids=[2])
    assert sampled.rounds == 1 and len(sampled.responses) == 32


def test_accurate_groups_equal_the_mean_accuracy_in_bounds():
    """PRIME's filter: a group's verifier rewards clamped to [0, 1], their mean within the bounds
    (inclusive), against a float64 loop over random rewards outside [0, 1] too."""
    gen = torch.Generator().manual_seed(0)
    group = torch.arange(12).repeat_interleave(8)
    raw = torch.rand(96, generator=gen, dtype=torch.float64) * 0.8 + torch.linspace(-0.6, 0.9, 12)[group]
    raw[:8] = 0.2  # a group exactly at the lower bound
    got = accurate_groups(raw.float(), group, 0.2, 0.8)
    want = [0.2 - 1e-6 <= sum(min(max(x, 0.0), 1.0) for x in raw[g * 8:(g + 1) * 8].tolist()) / 8 <= 0.8 + 1e-6
            for g in range(12)]
    assert got.tolist() == want and got[0] and 0 < sum(want) < 12


def test_prime_accuracy_filter_oversamples_and_trains_the_groups_in_bounds_first():
    """oversample_factor x prompts drawn in one round; groups of mean accuracy in [0.2, 0.8] (the
    odd prompts: half right) trained first, in drawn order; the even ones (all right) left out."""
    a = resolve(algo(name="prime"))
    assert a.filter_accuracy and a.oversample_factor == 4.0  # the preset's (verl-recipe's prime)
    drawn = [r.prompt for r in stream().next(17)]  # the stream's order (shuffled by its seed)
    odd = [p for p in drawn[:16] if int(p[:-1]) % 2]
    prompts = stream()
    sampled = sample_step(ScriptedRollout(), prompts, Scorer(a, TOK), a, prompts_per_step=4, seed=0, eos_token_ids=[2])
    assert [r.prompt for r in sampled.records] == odd[:4]
    assert sampled.rounds == 1 and sampled.dropped_groups == 12 and len(sampled.responses) == 16
    assert sampling_metrics(sampled)["sampling/accuracy_kept_frac"] == len(odd) / 16
    assert prompts.next(1)[0].prompt == drawn[16]  # the stream moved on by the 16 drawn
    # none in bounds: the step is filled with the drawn groups in their order
    a = resolve(algo(name="prime", accuracy_lower_bound=0.6, oversample_factor=1.5))
    sampled = sample_step(ScriptedRollout(), stream(), Scorer(a, TOK), a, prompts_per_step=4, seed=0, eos_token_ids=[2])
    assert [r.prompt for r in sampled.records] == drawn[:4] and sampled.dropped_groups == 2
    assert sampled.kept_frac == 0.0
    assert "sampling/accuracy_kept_frac" not in sampling_metrics(sample_step(
        ScriptedRollout(), stream(), Scorer(algo(name="grpo"), TOK), resolve(algo(name="grpo")), prompts_per_step=4,
        seed=0, eos_token_ids=[2]))
    with pytest.raises(ValueError, match="accuracy_lower_bound=0.9 must be <= algorithm.accuracy_upper_bound=0.8"):
        resolve(algo(name="prime", accuracy_lower_bound=0.9))


def test_remax_greedy_baseline():
    a = algo(name="remax")
    rollout = ScriptedRollout()
    sampled = sample_step(rollout, stream(), Scorer(a, TOK), a, prompts_per_step=4, seed=0, eos_token_ids=[2])
    assert rollout.calls[-1].greedy and rollout.calls[-1].n == 1
    assert torch.equal(sampled.baseline, torch.ones(16))  # the scripted greedy answer is right
    batch = make_batch(sampled, TOK.pad_token_id, 0)
    batch |= advantages(batch, a)
    mask = batch.loss_mask.bool()
    expected = (batch.scores - 1.0).unsqueeze(-1).expand_as(mask)[mask]
    assert torch.allclose(batch.advantages[mask], expected)


def test_batch_layout():
    a = algo(name="grpo")
    sampled = sample_step(ScriptedRollout(), stream(), Scorer(a, TOK), a, prompts_per_step=2, seed=0, eos_token_ids=[2])
    batch = make_batch(sampled, TOK.pad_token_id, 3)
    assert batch.policy_version == 3 and batch.tokens.shape[1] % 8 == 0
    r = sampled.responses[0]
    prompt = sampled.prompt_ids[0]
    row = batch.labels[0]
    start = len(prompt) - 1
    assert row[start:start + r.length].tolist() == r.token_ids  # the mask covers exactly the response
    assert batch.loss_mask[0].nonzero().flatten().tolist() == list(range(start, start + r.length))
    assert torch.equal(batch.rollout_log_probs[0][start:start + r.length], torch.tensor(r.log_probs))


def test_overlong_penalty():
    got = overlong_penalty(torch.tensor([4, 12, 14, 16]), max_new=16, buffer=4, factor=1.0)
    assert got.tolist() == [0.0, 0.0, -0.5, -1.0]


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo"])
def test_advantages_are_zero_off_the_response(name):
    a = algo(name=name)
    odd = stream(step=2)  # every group has right and wrong samples
    sampled = sample_step(ScriptedRollout(), odd, Scorer(a, TOK), a, prompts_per_step=4, seed=0, eos_token_ids=[2])
    batch = make_batch(sampled, TOK.pad_token_id, 0)
    adv = advantages(batch, a)["advantages"]
    assert torch.all(adv[batch.loss_mask == 0] == 0) and adv.abs().sum() > 0


def kl_batch(name, **kw):
    """A scored batch of ``name`` with old and reference log-probs that differ per row."""
    a = algo(name=name, **kw)
    odd = stream(step=2)
    sampled = sample_step(ScriptedRollout(), odd, Scorer(a, TOK), a, prompts_per_step=4, seed=0, eos_token_ids=[2])
    batch = make_batch(sampled, TOK.pad_token_id, 0)
    g = torch.Generator().manual_seed(0)
    shape = batch.loss_mask.shape
    batch |= Columns({"old_log_probs": -torch.rand(shape, generator=g), "ref_log_probs": -torch.rand(shape, generator=g)})
    if name == "remax":
        batch |= Columns({"baseline_scores": torch.ones(len(batch))})
    return batch


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "rloo", "reinforce_pp_baseline", "remax"])
def test_kl_in_reward_reaches_outcome_estimators(name):
    """Each outcome estimator scores a sequence by its token rewards' sum, KL penalty included:
    the advantages equal the estimator applied to score - kl_coef * sum_t KL_t, and kl_coef moves them."""
    from megarl.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, KL_ESTIMATORS
    from megarl.algorithms.presets import PRESETS

    batch = kl_batch(name)
    mask = batch.loss_mask
    kl = KL_ESTIMATORS.get("k1")(batch.old_log_probs, batch.ref_log_probs)
    off = advantages(batch, algo(name=name, kl_coef=0.5, kl_estimator="k1", kl_in_reward=False))["advantages"]
    got = {}
    for coef in (0.1, 0.5):
        out = advantages(batch, algo(name=name, kl_coef=coef, kl_estimator="k1", kl_in_reward=True))
        penalty = (coef * kl * mask).sum(-1)
        assert torch.allclose(out["kl_penalty"], penalty, atol=1e-6)
        inputs = AdvantageInputs(response_mask=mask, scores=batch.scores - penalty, index=batch.index,
                                 baseline_scores=batch.baseline_scores)
        expected, _ = ADVANTAGE_ESTIMATORS.get(PRESETS.get(name).estimator)(inputs)
        assert torch.allclose(out["advantages"], expected, atol=1e-5)
        got[coef] = out["advantages"]
    assert (got[0.1] - got[0.5]).abs().max() > 1e-3  # kl_coef changes the advantages
    assert (got[0.5] - off).abs().max() > 1e-3


def test_kl_in_reward_for_token_estimators_stays_per_token():
    """reinforce_pp reads the token rewards: its return at the first response token is the sum of
    the rewards from there on, the per-token penalties included; its preset puts the KL there."""
    batch = kl_batch("reinforce_pp")
    a = algo(name="reinforce_pp", kl_coef=0.2, kl_estimator="k1")  # kl_in_reward: null -> the preset's (true)
    out = advantages(batch, a)
    mask = batch.loss_mask
    kl = batch.old_log_probs - batch.ref_log_probs
    first = mask.argmax(-1)
    rows = torch.arange(len(batch))
    assert torch.allclose(out["returns"][rows, first], batch.scores - (0.2 * kl * mask).sum(-1), atol=1e-5)


def test_presets_resolve_defaults_and_refuse_by_field():
    from megarl.algorithms.presets import PRESETS, resolve

    assert resolve(algo(name="gspo")).policy_loss == "gspo"
    assert resolve(algo(name="gspo", policy_loss="ppo")).policy_loss == "ppo"  # the user's choice wins
    assert resolve(algo(name="grpo")).policy_loss == "ppo" and resolve(algo(name="grpo")).kl_in_reward is False
    assert resolve(algo(name="reinforce_pp")).kl_in_reward is True
    assert resolve(resolve(algo(name="ppo"))) == resolve(algo(name="ppo"))
    assert {n for n in PRESETS.names() if PRESETS.get(n).critic} == {"ppo", "vapo"}
    for kw, field in [({"name": "sac"}, "algorithm.name='sac' must be one of"),
                      ({"samples_per_prompt": 1}, "algorithm.samples_per_prompt=1: grpo compares"),
                      ({"agg_mode": "sum"}, "algorithm.agg_mode='sum'"),
                      ({"kl_estimator": "k4"}, "algorithm.kl_estimator='k4'"),
                      ({"kl_coef": -1.0}, "algorithm.kl_coef=-1.0 must be >= 0"),
                      ({"policy_loss": "trpo", "ppo_epochs": 0}, "policy_loss='trpo'.*ppo_epochs=0")]:
        with pytest.raises(ValueError, match=field):
            resolve(algo(**{"name": "grpo", **kw}))


def test_a_roles_non_finite_output_is_named_with_its_step():
    """train_on stops at the first role whose log-probs or values hold NaN or inf on a response
    token, naming the step, the role and the rows (padding positions do not count)."""
    import contextlib

    from megarl.errors import NonFiniteOutput
    from megarl.trainer.steps import Sampled, train_on

    responses = [Response(0, 0, [7, 8, 2], [-0.1, -0.2, -0.3], "stop"), Response(1, 0, [9], [-0.4], "length")]
    sampled = Sampled(records=[None, None], prompt_ids=[[1, 5], [1, 5, 6, 6]], responses=responses,
                      scores=torch.tensor([1.0, 0.25]), raw_scores=torch.tensor([1.0, 0.5]))

    class Role:
        def __init__(self, column, poison=None):
            self.column, self.poison = column, poison

        def compute_log_prob(self, batch):
            values = batch.rollout_log_probs.clone()
            if self.poison is not None:
                values[self.poison] = float("nan")
            return Columns({self.column: values})

        def update(self, batch):
            return {}

    class Log:
        phase = staticmethod(lambda name: contextlib.nullcontext())

    class Roles:
        critic = prm = None

    algo = AlgorithmConfig()
    clean = make_batch(sampled, pad_id=0, policy_version=6)
    pad = (~clean.loss_mask.bool()).nonzero()[0].tolist()  # a padding position: not counted
    roles = Roles()
    roles.actor, roles.reference = Role("old_log_probs", poison=tuple(pad)), Role("ref_log_probs")
    train_on(make_batch(sampled, pad_id=0, policy_version=6), roles, algo, Log(), step=7)  # finite where it counts
    row1 = clean.loss_mask[1].nonzero()[0].item()
    roles.reference = Role("ref_log_probs", poison=(1, row1))
    with pytest.raises(NonFiniteOutput, match=r"step 7: the reference's log-probs hold NaN or inf on 1 response "
                                              r"token\(s\) of 1 row\(s\) \(first rows \[1\]\)"):
        train_on(make_batch(sampled, pad_id=0, policy_version=6), roles, algo, Log(), step=7)
