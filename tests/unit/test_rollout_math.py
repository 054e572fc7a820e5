"""The math of online RL (bigtrain/rollout/advantages.py, losses.py) against implementations written here from
the papers and TRL 1.16's code (always), and against TRL's own functions where trl is installed (the [test]
extra): GRPOTrainer._compute_loss and RLOOTrainer._compute_loss called on a stand-in trainer, TRL's nanstd, and
DistillationTrainer's divergence against DeepSpeed's generalized_jsd_loss.

Each would catch: a wrong group statistic (population std for Bessel's, NaN rows counted), a None-scored
completion given a non-zero advantage, a clip bound or sign flipped, the sequence-level ratio taken unnormalised,
a loss type aggregated over the wrong normaliser (dapo over the micro-batch's tokens instead of the step's, over
accumulated micro-batches and ranks), the k3/k1 KL confused, and the distillation direction reversed."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from bigtrain.rollout.advantages import (combine_rewards, group_advantages, kl_penalised_rewards, nanstd,
                                         rloo_advantages)
from bigtrain.objectives.loss_types import CLIPPED, LOSS_TYPES, STEP_TOKENS, aggregate
from bigtrain.rollout.losses import (OWN_TERMS, GRPOLoss, clip_sums, distill_share, grpo_terms, k3_kl, loss_sums,
                                     masked_sum, rloo_terms, token_entropy, token_logps)

NAN = float("nan")


# --- advantages ------------------------------------------------------------------------------------------------

def paper_group_advantages(rewards: list[float], size: int, scale: str) -> list[float]:
    """GRPO (Shao et al. 2024) with TRL's choices: a group's mean and sample std over its scorable answers; an
    unscorable answer (None) gets 0; eps 1e-4."""
    scorable = [r for r in rewards if not math.isnan(r)]
    batch_std = statistics.stdev(scorable) if len(scorable) > 1 else NAN
    out = []
    for g in range(0, len(rewards), size):
        group = [r for r in rewards[g:g + size] if not math.isnan(r)]
        mean = statistics.fmean(group) if group else NAN
        std = batch_std if scale == "batch" else (statistics.stdev(group) if len(group) > 1 else NAN)
        for r in rewards[g:g + size]:
            a = r - mean if scale == "none" else (r - mean) / (std + 1e-4)
            out.append(0.0 if math.isnan(a) else a)
    return out


REWARDS = [1.0, 0.0, 0.5, NAN, 2.0, 2.0, 2.0, 2.0, -1.0, NAN, NAN, 3.0, 0.25, 0.75, 1.0, 0.0]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_the_paper(scale):
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    advantages, std_zero = group_advantages(rewards, 4, scale)
    assert advantages.tolist() == pytest.approx(paper_group_advantages(REWARDS, 4, scale), abs=1e-12)
    assert advantages[3] == 0 and advantages[9] == 0  # None everywhere: no signal
    if scale != "batch":  # the group of four 2.0s: zero std, and zero advantage
        assert std_zero.tolist()[4:8] == [True] * 4 and std_zero.float().mean() == 0.25
        assert advantages[4:8].abs().max() == 0


def test_group_of_one_and_whole_groups():
    advantages, std_zero = group_advantages(torch.tensor([1.0, 2.0]), 1, "group")
    assert advantages.tolist() == [0.0, 0.0] and std_zero.all()
    with pytest.raises(ValueError, match="num_generations=4"):
        group_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.ones(4), 2, "mean")


def test_combined_rewards_weigh_and_skip_none():
    per_function = torch.tensor([[1.0, NAN], [NAN, NAN], [0.5, 2.0]])
    rewards = combine_rewards(per_function, torch.tensor([1.0, 0.5]))
    assert rewards[0] == 1.0 and math.isnan(rewards[1]) and rewards[2] == 1.5  # one None among two: it counts 0


def test_nanstd_is_trls():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    values = torch.tensor([[1.0, 2.0, NAN, 4.0], [NAN, NAN, NAN, 1.0]])
    assert torch.allclose(nanstd(values, dim=1), trl_utils.nanstd(values, dim=1), equal_nan=True)
    assert torch.allclose(nanstd(values), trl_utils.nanstd(values), equal_nan=True)


def paper_rloo(rewards: list[float], size: int) -> list[float]:
    """RLOO (Ahmadian et al. 2024): r_i minus the mean of the other scorable rewards of its group."""
    out = []
    for g in range(0, len(rewards), size):
        group = rewards[g:g + size]
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i and not math.isnan(x)]
            out.append(0.0 if math.isnan(r) or not others else r - statistics.fmean(others))
    return out


def test_rloo_leave_one_out_and_its_kl_penalty():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    advantages, std_zero = rloo_advantages(rewards, 4)
    assert advantages.tolist() == pytest.approx(paper_rloo(REWARDS, 4), abs=1e-12)
    assert std_zero.tolist() == [False, True, False, False]
    normalised, _ = rloo_advantages(rewards, 4, normalize=True)
    raw = torch.tensor(paper_rloo(REWARDS, 4), dtype=torch.float64)
    raw[[3, 9, 10]] = NAN  # TRL normalises over the scorable answers only, then zeroes the rest
    expected = torch.nan_to_num((raw - raw.nanmean()) / (nanstd(raw) + 1e-4))
    assert torch.allclose(normalised, expected)
    old, ref = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # k1 per token: old - ref = 0.5, -1.0 (the third is padding): the reward loses beta x (-0.5)
    assert kl_penalised_rewards(torch.tensor([2.0]), old, ref, mask, 0.05).item() == pytest.approx(2.025)


# --- the GRPO loss against TRL's _compute_loss ---------------------------------------------------------------

B, T, V = 6, 5, 11


def batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    for row, length in enumerate([5, 3, 1, 4, 5, 2]):
        mask[row, length:] = 0
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    # the old policy's near the policy's: ratios on both sides of the clip, of delta, of cispo's cap
    old = token_logps(logits, ids) + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    return {"logits": logits, "ids": ids, "mask": mask.double(),
            "advantages": torch.randn(B, generator=g, dtype=torch.float64), "old": old,
            "ref": torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3}


def trl_grpo_self(loss: GRPOLoss, logps, entropies, *, processes: int = 1, accumulation: int = 1):
    """A stand-in GRPOTrainer: what _compute_loss reads (TRL's names for each GRPOLoss setting), the model's forward
    replaced by fixed log-probs, one process (or `processes` holding the same micro-batch)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    def reduce(x, reduction):
        return x * processes if reduction == "sum" else x  # every rank holds the same micro-batch here
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
        top_entropy_quantile=loss.top_entropy_quantile, off_policy_mask_threshold=loss.off_policy_mask_threshold,
        importance_sampling_level=loss.importance_sampling_level, beta=loss.beta,
        args=SimpleNamespace(**asdict(loss), steps_per_generation=accumulation),
        loss_type=loss.loss_type, epsilon_low=loss.epsilon, epsilon_high=loss.high, use_vllm=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=accumulation,
        max_completion_length=T, accelerator=SimpleNamespace(num_processes=processes, reduce=reduce,
                                                             gather=lambda x: x,
                                                             pad_across_processes=lambda x, **k: x),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask, get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)})
    fake.get_high_entropy_mask = lambda *a: GRPOTrainer.get_high_entropy_mask(fake, *a)
    return fake


def trl_inputs(b: dict, *, old: bool, beta: float, num_items: float) -> dict:
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": b["ids"], "completion_mask": b["mask"], "advantages": b["advantages"],
              "num_items_in_batch": torch.tensor(num_items, dtype=torch.float64)}
    if old:
        inputs["old_per_token_logps"] = b["old"]
    if beta:
        inputs["ref_per_token_logps"] = b["ref"]
    return inputs


def ours(b: dict, loss: GRPOLoss, old: bool, logits: torch.Tensor):
    logps = token_logps(logits, b["ids"])
    terms = grpo_terms(logps, b["old"] if old else None, b["advantages"], b["mask"], loss,
                       ref_logps=b["ref"] if loss.beta else None, entropies=token_entropy(logits))
    share = aggregate(terms.per_token, b["mask"], loss.loss_type, step_micro_batches=1, step_tokens=b["mask"].sum(),
                      max_completion_length=T)
    return share, terms, logps


def held_to_trl(b: dict, loss: GRPOLoss, old: bool) -> tuple[dict, torch.Tensor]:
    """Our share of the step's loss and its gradient (on the logits) against TRL's _compute_loss on the same
    log-probs, and our metrics against the ones it logs; TRL's metrics and our gradient."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    case = f"{loss} old={old}"
    mine_logits = b["logits"].clone().requires_grad_()
    share, terms, _ = ours(b, loss, old, mine_logits)
    share.backward()
    theirs_logits = b["logits"].clone().requires_grad_()
    fake = trl_grpo_self(loss, token_logps(theirs_logits, b["ids"]), token_entropy(theirs_logits))
    trl_loss = grpo.GRPOTrainer._compute_loss(fake, None, trl_inputs(b, old=old, beta=loss.beta,
                                                                     num_items=float(b["mask"].sum())))
    trl_loss.backward()
    assert share.item() == pytest.approx(trl_loss.item(), rel=1e-12, abs=1e-14), case
    assert torch.allclose(mine_logits.grad, theirs_logits.grad, rtol=1e-10, atol=1e-14), case
    metrics = {k: v[0] for k, v in fake._metrics["train"].items()}
    sums = loss_sums(terms, b["advantages"], b["mask"], loss)
    sums["entropy"] = masked_sum(token_entropy(mine_logits), b["mask"])
    if loss.beta:
        sums["kl"] = masked_sum(terms.kl, b["mask"])
    assert set(metrics) - set(sums) <= {"clip_ratio/low_min", "clip_ratio/high_max"}, case  # (not reported here)
    for name, (total, count) in sums.items():
        assert (total / count).item() == pytest.approx(metrics[name], rel=1e-9, abs=1e-12), f"{name}: {case}"
    return metrics, mine_logits.grad


def loss_of(loss_type: str, level: str = "token", beta: float = 0.04, **settings) -> GRPOLoss:
    # cispo caps the ratio at epsilon_high itself (TRL suggests 5.0): 1.1 caps some of these ratios, not all
    return GRPOLoss(loss_type=loss_type, epsilon=0.2, epsilon_high=1.1 if loss_type == "cispo" else 0.28,
                    importance_sampling_level=level, beta=beta, **settings)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_gradient_and_metrics_equal_trls(loss_type):
    """Each loss type x token / sequence ratio x on- / off-policy x beta 0 / > 0 (with and without the KL's bias
    correction)."""
    assert set(CLIPPED) | set(OWN_TERMS) == set(LOSS_TYPES)
    b = batch()
    for level in ("token", "sequence"):
        for old in (False, True):
            for beta, bias in ((0.0, True), (0.04, True), (0.04, False)):
                metrics, _ = held_to_trl(b, loss_of(loss_type, level, beta, use_bias_correction_kl=bias), old)
                if old and loss_type in CLIPPED:  # the ratios differ from 1 enough that the clip holds some tokens
                    assert metrics["clip_ratio/region_mean"] > 0
                if old and loss_type == "cispo" and level == "token":  # the cap holds some weights, not all
                    assert 0 < metrics["cispo_clip_ratio"] < 1


# TRL's settings beside the loss type, each where it applies, off-policy (on-policy the off-policy mask keeps all)
SETTINGS = {"delta": dict(delta=1.05), "off_policy": dict(off_policy_mask_threshold=0.02),
            "entropy": dict(top_entropy_quantile=0.4),
            "sapo": dict(sapo_temperature_pos=2.0, sapo_temperature_neg=0.5),
            "vespo": dict(vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=1.5)}
APPLIES = {"delta": CLIPPED, "sapo": ("sapo",), "vespo": ("vespo",)}


@pytest.mark.parametrize("setting", SETTINGS)
def test_grpo_settings_equal_trls_and_change_the_step(setting):
    b = batch()
    for loss_type in APPLIES.get(setting, LOSS_TYPES):
        for level in ("token", "sequence"):
            _, grad = held_to_trl(b, loss_of(loss_type, level, **SETTINGS[setting]), old=True)
            logits = b["logits"].clone().requires_grad_()
            ours(b, loss_of(loss_type, level), True, logits)[0].backward()
            assert not torch.allclose(grad, logits.grad, rtol=1e-6, atol=1e-9), f"{setting} changed nothing for " \
                f"{loss_type} at {level} level: the test is blind to it"


def test_the_entropy_quantile_is_over_every_ranks_tokens(monkeypatch):
    """top_entropy_quantile's threshold is the quantile of every rank's completion tokens of the micro-batch, as
    TRL gathers them: rank 0's mask with rank 1 holding more tokens of higher entropy (its side of the two
    all_gathers played here: its token count, then its entropies padded to the longest)."""
    from bigtrain.rollout.loss_weights import high_entropy_mask
    mine = torch.tensor([[0.2, 0.5, 0.8, 7.0], [0.95, 7.0, 7.0, 7.0]], dtype=torch.float64)  # 7.0: padding
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    theirs = torch.linspace(0.6, 1.6, 12)

    def all_gather(parts, tensor):
        parts[0].copy_(tensor)
        parts[1].copy_(torch.tensor([theirs.numel()]) if tensor.dtype == torch.long else
                       torch.cat([theirs, torch.zeros(len(tensor) - theirs.numel())]))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    got = high_entropy_mask(mine, mask, 0.3)
    assert got.tolist() == [[False, False, True, False], [True, False, False, False]]  # quantile 0.79: 0.8, 0.95
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    two_ranks = SimpleNamespace(accelerator=SimpleNamespace(
        pad_across_processes=lambda x, dim, pad_index: torch.cat([x, torch.full((12 - len(x),), pad_index)]),
        gather=lambda x: torch.cat([x, theirs])))
    assert torch.equal(got, trl.GRPOTrainer.get_high_entropy_mask(two_ranks, mine, mask, 0.3))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert high_entropy_mask(mine, mask, 0.3)[0].tolist() == [False, True, True, False]  # rank 0's own: 0.47


def paper_grpo_token_loss(b: dict) -> float:
    """GRPO's objective token by token (Shao et al. 2024, eq. 3, with DAPO's token-level sum / tokens and
    asymmetric clip, the KL weighted by the ratio as DeepSeek-V3.2 has it), from plain Python floats."""
    total, tokens = 0.0, 0
    logps = token_logps(b["logits"], b["ids"]).tolist()
    for i in range(B):
        a = float(b["advantages"][i])
        for t in range(T):
            if not b["mask"][i, t]:
                continue
            rho = math.exp(logps[i][t] - float(b["old"][i, t]))
            ref_minus = float(b["ref"][i, t]) - logps[i][t]
            kl = math.exp(ref_minus) - ref_minus - 1  # k3, times rho (DeepSeek-V3.2's bias correction)
            total += -min(rho * a, min(max(rho, 0.8), 1.28) * a) + 0.04 * kl * rho
            tokens += 1
    return total / tokens


def test_dapo_loss_equals_the_paper_formula():
    b = batch(1)
    share, _, _ = ours(b, GRPOLoss(epsilon_high=0.28, beta=0.04), True, b["logits"])
    assert share.item() == pytest.approx(paper_grpo_token_loss(b), rel=1e-12)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_shares_over_accumulated_micro_batches_and_ranks(loss_type):
    """A step of 2 ranks x 2 accumulated micro-batches: each share equals TRL's per-micro-batch loss / ranks (DDP
    averages over them; TRL divides by the accumulation itself, or for dapo, cispo and vespo by num_items_in_batch
    over the step), so the shares add up to TRL's step. For those three the sum is the token mean of the whole step;
    the per-micro-batch token mean (what bnpo does) would weigh a micro-batch of short answers as much as one of
    long ones."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    b = batch(2)
    loss = loss_of(loss_type, beta=0.0)
    share_sum, bnpo_sum = 0.0, 0.0
    step_tokens = b["mask"].sum()
    parts = [slice(0, 1), slice(1, 3), slice(3, 4), slice(4, 6)]  # (rank 0: micro 0, 1), (rank 1: micro 0, 1)
    logps = token_logps(b["logits"], b["ids"])
    whole = grpo_terms(logps, b["old"], b["advantages"], b["mask"], loss)
    for part in parts:
        terms = grpo_terms(logps[part], b["old"][part], b["advantages"][part], b["mask"][part], loss)
        share = aggregate(terms.per_token, b["mask"][part], loss_type, step_micro_batches=4,
                          step_tokens=step_tokens, max_completion_length=T)
        share_sum += share.item()
        bnpo_sum += aggregate(terms.per_token, b["mask"][part], "bnpo", step_micro_batches=4).item()
        sub = {k: v[part] for k, v in b.items()}
        fake = trl_grpo_self(loss, logps[part], token_entropy(b["logits"][part]), processes=2, accumulation=2)
        inputs = trl_inputs(sub, old=True, beta=0.0, num_items=float(step_tokens))
        inputs = {k: v[:len(sub["ids"])] if k.startswith(("prompt", "completion")) else v for k, v in inputs.items()}
        trl_loss = grpo.GRPOTrainer._compute_loss(fake, None, inputs)
        assert share.item() == pytest.approx(trl_loss.item() / 2, rel=1e-12)  # DDP averages over the 2 ranks
    if loss_type in STEP_TOKENS:
        assert share_sum == pytest.approx(((whole.per_token * b["mask"]).sum() / step_tokens).item(), rel=1e-12)
        assert abs(bnpo_sum - share_sum) > 1e-3  # the micro-batches' lengths differ: the normaliser matters


def test_sequence_ratio_is_length_normalised_and_k3_is_nonnegative():
    b = batch(3)
    logps = token_logps(b["logits"], b["ids"])
    terms = grpo_terms(logps, b["old"], b["advantages"], b["mask"], GRPOLoss(importance_sampling_level="sequence"))
    row = 1  # three tokens
    expected = math.exp(sum(float(logps[row, t] - b["old"][row, t]) for t in range(3)) / 3)
    assert terms.ratio[row, 0].item() == pytest.approx(expected, rel=1e-12)
    assert (k3_kl(logps, b["ref"]) >= 0).all()
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_terms(logps, None, b["advantages"], b["mask"], GRPOLoss(importance_sampling_level="seq"))


# --- RLOO -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("old", [False, True])
def test_rloo_loss_equals_trls(old):
    """RLOOTrainer._compute_loss on the same log-probs, on-policy (the old sequence log-prob is the policy's own
    value: TRL computes it every round) and off. RLOO's beta lives in its advantages (the k1 penalty above)."""
    rloo = pytest.importorskip("trl.trainer.rloo_trainer")
    b = batch(4)
    seq = (token_logps(b["logits"], b["ids"]) * b["mask"]).sum(1)
    old_seq = (b["old"] * b["mask"]).sum(1) if old else seq
    mine_logits = b["logits"].clone().requires_grad_()
    per_seq, ratio = rloo_terms(token_logps(mine_logits, b["ids"]), old_seq, b["advantages"], b["mask"],
                                epsilon_high=0.28)
    share = per_seq.mean() / 2  # 2 accumulated micro-batches: TRL's loss is divided by them by the HF Trainer
    share.backward()
    theirs_logits = b["logits"].clone().requires_grad_()
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (token_logps(theirs_logits, b["ids"]),
                                                            token_entropy(theirs_logits), None),
        epsilon_low=0.2, epsilon_high=0.28, aux_loss_enabled=False, model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(reduce=lambda x, reduction: x, gather=lambda x: x),
        _metrics={"train": defaultdict(list)})
    inputs = trl_inputs(b, old=False, beta=0.0, num_items=0.0)
    inputs["old_logps"] = old_seq
    loss = rloo.RLOOTrainer._compute_loss(fake, None, inputs) / 2
    loss.backward()
    assert share.item() == pytest.approx(loss.item(), rel=1e-12)
    assert torch.allclose(mine_logits.grad, theirs_logits.grad, rtol=1e-10, atol=1e-14)
    metrics = {k: v[0] for k, v in fake._metrics["train"].items()}
    for name, (total, count) in clip_sums(ratio, b["advantages"], b["mask"], 0.2, 0.28).items():
        assert (total / count).item() == pytest.approx(metrics[name])
    assert (metrics["clip_ratio/region_mean"] > 0) == old  # off-policy the clip holds some sequences


# --- on-policy distillation -----------------------------------------------------------------------------------

def paper_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """Generalized JSD (Agarwal et al. 2024, eq. 1) per position: beta KL(p_T || M) + (1 - beta) KL(p_S || M),
    M = beta p_T + (1 - beta) p_S; beta 0 -> KL(p_T || p_S), 1 -> KL(p_S || p_T)."""
    p_s = torch.softmax(student.double() / temperature, -1)
    p_t = torch.softmax(teacher.double() / temperature, -1)
    if beta == 0:
        return (p_t * (p_t.log() - p_s.log())).sum(-1)
    if beta == 1:
        return (p_s * (p_s.log() - p_t.log())).sum(-1)
    m = beta * p_t + (1 - beta) * p_s
    return beta * (p_t * (p_t.log() - m.log())).sum(-1) + (1 - beta) * (p_s * (p_s.log() - m.log())).sum(-1)


@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (1.0, 1.0), (0.5, 0.7), (0.1, 2.0)])
def test_distillation_equals_deepspeed_trl_and_the_paper(beta, temperature):
    from deepspeed.runtime.rollout.opsd import generalized_jsd_loss
    g = torch.Generator().manual_seed(5)
    hidden_s, hidden_t = torch.randn(3, 7, 16, generator=g), torch.randn(3, 7, 16, generator=g)
    head_s, head_t = torch.randn(50, 16, generator=g) * 0.5, torch.randn(50, 16, generator=g) * 0.5
    student, teacher = hidden_s @ head_s.T, hidden_t @ head_t.T
    mask = torch.ones(3, 7)
    mask[0, 4:], mask[2, 1:] = 0, 0
    tokens = mask.sum()
    share = distill_share(student, teacher, mask, beta=beta, temperature=temperature, step_tokens=tokens * 2)
    deepspeed = generalized_jsd_loss(student, teacher, mask.bool(), beta=beta, temperature=temperature)
    paper = (paper_jsd(student, teacher, beta, temperature) * mask).sum() / tokens
    assert (2 * share).item() == pytest.approx(deepspeed.loss.item(), abs=1e-6)  # the step holds 2 x these tokens
    assert deepspeed.loss.item() == pytest.approx(paper.item(), abs=1e-6)
    distill = pytest.importorskip("trl.trainer.distillation_trainer")
    trl_loss, _, valid = distill._chunked_divergence_loss(hidden_s, hidden_t, head_s, head_t, mask, beta,
                                                          temperature=temperature)
    assert int(valid) == int(tokens)
    assert deepspeed.loss.item() == pytest.approx(trl_loss.item(), abs=1e-6)
