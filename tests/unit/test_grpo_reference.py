"""The plain GRPO / RLOO loop the integration will be held to (tests/grpo_reference.py: torch + transformers only)
and its toy task (tests/rl_task.py):

- it learns: on "say the digit" a tiny random Llama's mean reward rises from ~0.1 to ~0.9-1.3 (of 1.5) in 50 steps
  of 16 prompts x 8 completions (measured here on seeds 0, 1, 2: 0.11 -> 0.93, 0.13 -> 1.31, 0.12 -> 0.95; ~5 s
  a run on this 2-core CPU under load);
- with the completions fixed (generation bypassed), its per-step losses equal those assembled from
  bigtrain.rollout's functions (advantages, grpo_terms / rloo_terms, aggregate over accumulated micro-batches)
  within 1e-9 in fp64 over 3 steps, for every loss type, beta > 0 against a reference model (the KL with and
  without TRL's bias correction), two iterations with the clip active, sequence-level ratios, batch / no reward
  scaling and RLOO: two implementations written apart from TRL's code agree, so the loop is a fair judge and the
  rollout math assembles into TRL's step."""
from __future__ import annotations

import copy

import pytest
import torch

import grpo_reference as ref
from rl_task import REWARDS, make_model, make_tokenizer, records

from bigtrain.rollout.advantages import group_advantages, kl_penalised_rewards, rloo_advantages
from bigtrain.rollout.forward import completion_logits
from bigtrain.objectives.loss_types import aggregate
from bigtrain.rollout.losses import GRPOLoss, clip_sums, global_count, grpo_terms, rloo_terms, token_logps


def test_the_plain_loop_learns_the_toy_task():
    torch.set_num_threads(1)
    history = ref.train(make_model(0), make_tokenizer(), records(200), REWARDS, ref.Config(seed=0))
    first, last = ref.mean_reward(history, 0, 5), ref.mean_reward(history, 45, 50)
    assert first < 0.3 and last > first + 0.5, (first, last)


def fixed_batches(cfg: ref.Config, count: int = 3) -> list[tuple[dict, torch.Tensor]]:
    """Generation batches recorded once from the initial model: (tensors, rewards) each."""
    tok, model = make_tokenizer(), make_model(0)
    data = records(64)
    out = []
    for k in range(count):
        torch.manual_seed(100 + k)
        chosen = data[k * 4:(k + 1) * 4]
        batch = ref.generate(model, tok, [r["prompt"] for r in chosen], cfg)
        ids = [row[m.bool()].tolist() for row, m in zip(batch["completion_ids"], batch["completion_mask"])]
        rows = [r for r in chosen for _ in range(cfg.num_generations)]
        rewards = ref.score(REWARDS, [1.0, 1.0], [r["prompt"] for r in rows],
                            tok.batch_decode(ids, skip_special_tokens=True), ids, rows)
        rewards[::5] += torch.linspace(-0.3, 0.3, len(rewards[::5]))  # no group scored all alike
        out.append((batch, rewards))
    return out


def rollout_losses(model, optimizer, batch: dict, rewards: torch.Tensor, cfg: ref.Config, ref_model) -> tuple[
        list[float], float]:
    """The same optimizer steps assembled from bigtrain.rollout; also the share of tokens the clip held."""
    p, pm, c, cm = (batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"))

    def logps_of(m, rows):
        return token_logps(completion_logits(m, p[rows], pm[rows], c[rows], cm[rows]), c[rows], cfg.temperature)

    every = torch.arange(len(c))
    with torch.no_grad():
        old = logps_of(model, every)
        ref_logps = logps_of(ref_model, every) if ref_model is not None else None
    if cfg.algorithm == "rloo":
        adv, _ = rloo_advantages(kl_penalised_rewards(rewards, old, ref_logps, cm, cfg.beta), cfg.num_generations)
    else:
        adv, _ = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)
    chunks = every.chunk(cfg.micro_batches)
    step_tokens = global_count([cm[rows] for rows in chunks])
    losses, clipped, counted = [], 0.0, 0.0
    for _ in range(cfg.num_iterations):
        optimizer.zero_grad()
        total = 0.0
        for rows in chunks:
            logps = logps_of(model, rows)
            if cfg.algorithm == "rloo":
                per_seq, ratio = rloo_terms(logps, (old[rows] * cm[rows]).sum(1), adv[rows], cm[rows],
                                            epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high)
                share = per_seq.mean() / cfg.micro_batches
            else:
                loss = GRPOLoss(loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                                importance_sampling_level=cfg.importance_sampling_level, beta=cfg.beta,
                                use_bias_correction_kl=cfg.use_bias_correction_kl)
                terms = grpo_terms(logps, old[rows], adv[rows], cm[rows], loss,
                                   ref_logps=None if ref_logps is None else ref_logps[rows])
                ratio = terms.ratio
                share = aggregate(terms.per_token, cm[rows], cfg.loss_type, step_micro_batches=cfg.micro_batches,
                                  step_tokens=step_tokens, max_completion_length=cfg.max_completion_length)
            held, count = clip_sums(ratio, adv[rows], cm[rows], cfg.epsilon, cfg.epsilon_high)["clip_ratio/region_mean"]
            clipped, counted = clipped + float(held), counted + float(count)
            share.backward()
            total += share.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(total)
    return losses, clipped / counted


CASES = {
    "dapo": {}, "grpo": {"loss_type": "grpo"}, "bnpo": {"loss_type": "bnpo"}, "dr_grpo": {"loss_type": "dr_grpo"},
    "beta": {"beta": 0.04}, "beta_plain_kl": {"beta": 0.04, "use_bias_correction_kl": False},
    "clipped": {"num_iterations": 2, "epsilon": 0.02, "epsilon_high": 0.03, "lr": 3e-2, "loss_type": "grpo"},
    "sequence": {"importance_sampling_level": "sequence", "loss_type": "grpo", "num_iterations": 2, "lr": 3e-2},
    "batch_scale": {"scale_rewards": "batch"}, "no_scale": {"scale_rewards": "none", "loss_type": "bnpo"},
    "rloo": {"algorithm": "rloo", "beta": 0.05, "num_iterations": 2, "epsilon": 0.02, "lr": 3e-2},
}


@pytest.mark.parametrize("case", CASES)
def test_fixed_completions_give_the_same_losses(case):
    torch.set_num_threads(1)
    cfg = ref.Config(**{"num_generations": 4, "micro_batches": 2, "lr": 1e-2, **CASES[case]})
    batches = fixed_batches(cfg)
    # fp64: Adam turns rounding differences in near-zero gradients into whole steps of lr; compared are formulas
    start = make_model(0).double()
    ref_model = make_model(7).double() if cfg.beta else None  # another model as the reference: a KL that is not ~0
    plain, ours = copy.deepcopy(start), copy.deepcopy(start)
    plain_opt, ours_opt = (torch.optim.AdamW(m.parameters(), lr=cfg.lr) for m in (plain, ours))
    clip_seen = 0.0
    for batch, rewards in batches:
        expected = ref.optimize(plain, plain_opt, batch, rewards.clone(), cfg, ref_model)
        got, clip = rollout_losses(ours, ours_opt, batch, rewards.clone(), cfg, ref_model)
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12), case
        clip_seen = max(clip_seen, clip)
    if cfg.num_iterations > 1:
        assert clip_seen > 0, "the second iteration's ratios stayed inside the clip: the test would not see it"
