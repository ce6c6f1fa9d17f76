"""Driver-side RL step logic with a scripted rollout (no model): DAPO dynamic sampling refills
the step, ReMax draws a greedy baseline, overlong shaping, batch layout, advantages."""

from __future__ import annotations

import pytest
import torch

from megarl.config import AlgorithmConfig
from megarl.data.datasets import PromptRecord
from megarl.data.tokenizer import DigitTokenizer
from megarl.rollout import Response
from megarl.trainer.steps import (PromptStream, Scorer, advantages, make_batch, overlong_penalty, sample_step,
                                  varied_groups)

TOK = DigitTokenizer()


class ScriptedRollout:
    """Answers prompt "k=" with the digits of k: all samples equal (one reward per group) when
    k is even, alternating right/wrong when odd; greedy calls are recorded."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append(sampling)
        out = []
        for p, ids in enumerate(prompts):
            k = int(TOK.decode(ids)[:-1])
            for s in range(sampling.n):
                right = k % 2 == 0 or s % 2 == 0 or sampling.greedy
                text = str(k) if right else "9" * len(str(k))
                out.append(Response(p, s, TOK.encode(text) + [TOK.eos_token_id], [-0.5] * (len(text) + 1), "stop"))
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


def test_remax_greedy_baseline():
    a = algo(name="remax")
    rollout = ScriptedRollout()
    sampled = sample_step(rollout, stream(), Scorer(a, TOK), a, prompts_per_step=4, seed=0, eos_token_ids=[2])
    assert rollout.calls[-1].greedy and rollout.calls[-1].n == 1
    assert torch.equal(sampled.baseline, torch.ones(16))  # the scripted greedy answer is right
    batch = make_batch(sampled, TOK.pad_token_id, 0)
    batch |= advantages(batch, a)
    mask = batch["loss_mask"].bool()
    expected = (batch["scores"] - 1.0).unsqueeze(-1).expand_as(mask)[mask]
    assert torch.allclose(batch["advantages"][mask], expected)


def test_batch_layout():
    a = algo(name="grpo")
    sampled = sample_step(ScriptedRollout(), stream(), Scorer(a, TOK), a, prompts_per_step=2, seed=0, eos_token_ids=[2])
    batch = make_batch(sampled, TOK.pad_token_id, 3)
    assert batch.policy_version == 3 and batch["tokens"].shape[1] % 8 == 0
    r = sampled.responses[0]
    prompt = sampled.prompt_ids[0]
    row = batch["labels"][0]
    start = len(prompt) - 1
    assert row[start:start + r.length].tolist() == r.token_ids  # the mask covers exactly the response
    assert batch["loss_mask"][0].nonzero().flatten().tolist() == list(range(start, start + r.length))
    assert torch.equal(batch["rollout_log_probs"][0][start:start + r.length], torch.tensor(r.log_probs))


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
    assert torch.all(adv[batch["loss_mask"] == 0] == 0) and adv.abs().sum() > 0
