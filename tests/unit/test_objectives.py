"""Preference objectives: each formula against one written here from the papers / TRL, per pair in
plain float64 Python; DPO through a real one-rank engine against a plain PyTorch loop, its first loss ln 2, and
the LoRA reference (adapters off) against a frozen copy."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from bigtrain.config.load import load_run_config
from bigtrain.models.losses import answer_logps
from bigtrain.objectives.kto import KTOSettings
from bigtrain.objectives.preference import PreferenceSettings, pair_loss
from bigtrain.objectives.reward import reward_loss

SEQ, VOCAB, PAIRS = 24, 128, 4


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def by_hand(kind: str, pc, pr, rc, rr, nc, nr, beta=0.1, smooth=0.0, gamma=0.5) -> tuple[float, list[float]]:
    """(mean loss, chosen rewards) pair by pair, from the formulas (DPO, cDPO, IPO, ORPO, SimPO)."""
    losses, rewards = [], []
    for i in range(len(pc)):
        if kind == "dpo":
            z = (pc[i] - rc[i]) - (pr[i] - rr[i])
            losses.append(-(1 - smooth) * logsig(beta * z) - smooth * logsig(-beta * z))
            rewards.append(beta * (pc[i] - rc[i]))
        elif kind == "ipo":
            z = (pc[i] / nc[i] - rc[i] / nc[i]) - (pr[i] / nr[i] - rr[i] / nr[i])
            losses.append((z - 1 / (2 * beta)) ** 2)
            rewards.append(beta * (pc[i] - rc[i]) / nc[i])
        elif kind == "orpo":
            a, b = pc[i] / nc[i], pr[i] / nr[i]
            odds = (a - math.log(1 - math.exp(a))) - (b - math.log(1 - math.exp(b)))
            losses.append(-beta * logsig(odds))
            rewards.append(beta * a)
        else:  # simpo
            m = beta * (pc[i] / nc[i] - pr[i] / nr[i]) - gamma
            losses.append(-(1 - smooth) * logsig(m) - smooth * logsig(-m))
            rewards.append(beta * pc[i] / nc[i])
    mean = sum(losses) / len(losses)
    if kind == "orpo":  # plus the chosen answers' token-mean NLL over the batch
        mean += -sum(pc) / sum(nc)
    return mean, rewards


@pytest.mark.parametrize("kind,smooth", [("dpo", 0.0), ("dpo", 0.2), ("ipo", 0.0), ("orpo", 0.0), ("simpo", 0.0),
                                         ("simpo", 0.1)])
def test_each_pair_objective_is_its_formula(kind, smooth):
    rng = random.Random(kind + str(smooth))
    n = 6
    counts = [rng.randint(3, 20) for _ in range(2 * n)]
    logps = [-rng.uniform(0.3, 3.0) * c for c in counts]  # a mean token log-probability below 0, as it must be
    ref = [lp + rng.uniform(-2, 2) for lp in logps]
    cfg = PreferenceSettings(beta=0.3, label_smoothing=smooth, simpo_gamma=0.7)
    loss, metrics = pair_loss(kind, cfg, torch.tensor(logps, dtype=torch.float64), torch.tensor(counts),
                              torch.tensor(ref, dtype=torch.float64) if kind in ("dpo", "ipo") else None)
    want, chosen = by_hand(kind, logps[:n], logps[n:], ref[:n], ref[n:], counts[:n], counts[n:], beta=0.3,
                           smooth=smooth, gamma=0.7)
    assert float(loss) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert float(metrics["rewards/chosen"]) == pytest.approx(sum(chosen) / n, rel=1e-9)
    margins = float(metrics["rewards/margins"])
    assert margins == pytest.approx(float(metrics["rewards/chosen"] - metrics["rewards/rejected"]), abs=1e-12)
    assert float(metrics["logps/chosen"]) == pytest.approx(sum(logps[:n]) / n)


def test_dpo_is_ln2_when_policy_equals_reference_and_rewards_rank_pairs():
    logps = torch.tensor([-5.0, -7.0, -6.0, -4.0], dtype=torch.float64)
    loss, metrics = pair_loss("dpo", PreferenceSettings(), logps, torch.tensor([5, 5, 5, 5]), logps.clone())
    assert float(loss) == pytest.approx(math.log(2), abs=1e-15)
    assert float(metrics["rewards/accuracies"]) == 0.0  # equal rewards rank no pair right
    better = logps + torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)  # chosen answers more likely
    _, metrics = pair_loss("dpo", PreferenceSettings(), better, torch.tensor([5] * 4), logps)
    assert float(metrics["rewards/accuracies"]) == 1.0 and float(metrics["rewards/margins"]) == pytest.approx(0.1)


def test_the_reward_loss_is_bradley_terry_with_trls_metrics():
    rewards = torch.tensor([2.0, -1.0, 0.5, 0.0, 1.0, -2.0])  # chosen 2, -1, 0.5; rejected 0, 1, -2
    loss, metrics = reward_loss(rewards)
    want = sum(-logsig(c - r) for c, r in ((2.0, 0.0), (-1.0, 1.0), (0.5, -2.0))) / 3
    assert float(loss) == pytest.approx(want, rel=1e-6)
    # TRL's RewardTrainer's names: accuracy, margin, and min / mean / max over both sides' rewards
    assert set(metrics) == {"accuracy", "margin", "min_reward", "mean_reward", "max_reward"}
    assert float(metrics["accuracy"]) == pytest.approx(2 / 3)
    assert float(metrics["margin"]) == pytest.approx((2 - 2 + 2.5) / 3)
    assert [float(metrics[k]) for k in ("min_reward", "mean_reward", "max_reward")] == pytest.approx([-2, 0.5 / 6, 2])


def test_dpo_logits_metrics_are_the_answer_tokens_mean_logit_as_trl_counts_them():
    """TRL's logits/chosen: the next-token logits' mean over the vocabulary, averaged over every chosen answer token
    of the batch (token-weighted, not per row)."""
    from bigtrain.models.losses import answer_logit_sums
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11)  # rows: 2 chosen, then 2 rejected
    labels = torch.full((4, 6), -100)
    answers = {0: (2, 3, 4), 1: (5,), 2: (1, 2), 3: (3, 4, 5)}  # label positions; position t - 1 predicts them
    for row, where in answers.items():
        labels[row, list(where)] = 1
    logps, counts = answer_logps(logits, labels)
    _, metrics = pair_loss("dpo", PreferenceSettings(), logps, counts, logps.clone(), answer_logit_sums(logits, labels))

    def by_hand(rows: tuple[int, ...]) -> float:
        values = [float(logits[r, t - 1].mean()) for r in rows for t in answers[r]]
        return sum(values) / len(values)

    assert float(metrics["logits/chosen"]) == pytest.approx(by_hand((0, 1)), abs=1e-6)
    assert float(metrics["logits/rejected"]) == pytest.approx(by_hand((2, 3)), abs=1e-6)
    assert answer_logit_sums(logits.bfloat16(), labels).dtype == torch.float32  # bf16 logits averaged in fp32


def test_answer_logps_sum_only_the_answer_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    labels = torch.tensor([[-100, -100, 3, 4, 5, -100], [-100, 7, -100, -100, -100, -100]])
    logps, counts = answer_logps(logits, labels)
    log_probs = logits.log_softmax(-1)
    # position t predicts labels[t + 1]
    want = [sum(float(log_probs[0, t - 1, labels[0, t]]) for t in (2, 3, 4)), float(log_probs[1, 0, 7])]
    assert counts.tolist() == [3, 1]
    assert logps.tolist() == pytest.approx(want, abs=1e-5)


# --- through a real one-rank engine --------------------------------------------------------------------------

def pair_batch(seed: int) -> dict[str, torch.Tensor]:
    """PAIRS pairs [n, 2, SEQ]: a shared prompt, then different answers (labels -100 but on the answers)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (PAIRS, 2, SEQ), generator=g)
    ids[:, 1, :8] = ids[:, 0, :8]
    labels = torch.full_like(ids, -100)
    labels[:, :, 8:8 + 10] = ids[:, :, 8:8 + 10]
    return {"input_ids": ids, "labels": labels}


def dpo_engine(reference: str, lora: int, accum: int = 1):
    from bigtrain.ds.resolve import resolve
    from bigtrain.models import build
    from bigtrain.objectives import build_objective
    from bigtrain.train.engine import Engine, EngineOptions
    sets = ["model.family=llama", "model.size=tiny", "precision=fp32", "zero.stage=1", "optimizer.lr=0.01",
            f"batch.micro_batch={PAIRS // accum}", f"batch.global_batch={PAIRS}", "schedule.kind=constant",
            "optimizer.torch_adam=true", "objective.kind=dpo", f"objective.reference={reference}",
            f"lora.r={lora}"]
    run = load_run_config(None, sets)
    spec = build("llama", "tiny", vocab_size=VOCAB, seq_len=SEQ)
    objective = build_objective(run.objective, lora=lora > 0)
    engine = Engine(spec, resolve(run, None, 1).ds_config, EngineOptions(seed=1, lora=run.lora), objective)
    return spec, run, engine


def engine_losses(engine, steps: int = 3, accum: int = 1, rates: list | None = None) -> list[float]:
    """Per-step losses; `rates` gets the learning rate each step trained at (the schedule warms up)."""
    batches = []
    for step in range(steps):
        batch = pair_batch(step)
        batches += [{k: v[i::accum] for k, v in batch.items()} for i in range(accum)]
    it = iter(batches)
    losses = []
    for _ in range(steps):
        if rates is not None:
            rates.append(engine.lr())
        losses.append(float(engine.train_step(it)))
    return losses


def plain_dpo_losses(spec, run, rates: list[float]) -> list[float]:
    """DPO as a careful user writes it in plain PyTorch: the same initial weights, a frozen copy as the reference,
    torch's AdamW, DeepSpeed's default clipping at 1.0, the loss from log_softmax + gather."""
    import copy
    policy = spec.build(seed=1)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = run.optimizer
    optimizer = torch.optim.AdamW(policy.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                  weight_decay=opt.weight_decay)

    def seq_logps(model, ids, labels):
        logp = model(input_ids=ids).logits[:, :-1].log_softmax(-1)
        target = labels[:, 1:]
        mask = target != -100
        picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (picked * mask).sum(-1)

    out = []
    for step, rate in enumerate(rates):
        for group in optimizer.param_groups:
            group["lr"] = rate
        batch = pair_batch(step)
        ids = torch.cat([batch["input_ids"][:, 0], batch["input_ids"][:, 1]])
        labels = torch.cat([batch["labels"][:, 0], batch["labels"][:, 1]])
        with torch.no_grad():
            ref = seq_logps(reference, ids, labels)
        pol = seq_logps(policy, ids, labels)
        z = (pol[:PAIRS] - ref[:PAIRS]) - (pol[PAIRS:] - ref[PAIRS:])
        loss = -F.logsigmoid(0.1 * z).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        out.append(float(loss.detach()))
    return out


def test_dpo_on_an_engine_equals_a_plain_loop_and_starts_at_ln2(one_rank_group):
    spec, run, engine = dpo_engine("copy", lora=0)
    rates: list[float] = []
    got = engine_losses(engine, rates=rates)
    assert got[0] == pytest.approx(math.log(2), abs=1e-6)
    assert got == pytest.approx(plain_dpo_losses(spec, run, rates), rel=1e-5)
    assert got[-1] < got[0]  # it learns
    assert set(engine.step_metrics) == {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                                        "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected",
                                        "grad_norm"}
    assert math.isfinite(float(engine.step_metrics["grad_norm"])) and float(engine.step_metrics["grad_norm"]) > 0


def test_the_lora_reference_with_adapters_off_equals_a_frozen_copy_of_the_base(one_rank_group):
    _, _, off = dpo_engine("adapters_off", lora=4)
    first = engine_losses(off)
    _, _, copy = dpo_engine("copy", lora=4)
    assert first[0] == pytest.approx(math.log(2), abs=1e-6)
    assert engine_losses(copy) == pytest.approx(first, abs=1e-6)
    assert first[-1] != pytest.approx(first[0], abs=1e-5)  # the adapters trained: the policy moved off the base


def test_accumulated_micro_batches_give_the_whole_batchs_loss(one_rank_group):
    _, _, whole = dpo_engine("copy", lora=0)
    _, _, split = dpo_engine("copy", lora=0, accum=2)
    assert engine_losses(split, accum=2) == pytest.approx(engine_losses(whole), rel=1e-5)


# --- what cannot run: one line each ---------------------------------------------------------------------------

@pytest.mark.parametrize("sets,says", [
    (["objective.kind=dpo", "data.packing=true"], "data.packing=false"),
    (["objective.kind=dpo", "pipeline.stages=2"], "set pipeline.stages=1"),
    (["objective.kind=simpo", "parallel.tensor=2", "model.family=llama"], "not supported"),
    (["objective.kind=dpo", "objective.reference=adapters_off"], "no adapters to switch off"),
    (["objective.kind=dpo", "objective.reference=none"], "compares with a reference model"),
    (["objective.kind=orpo", "objective.reference=copy"], "uses no reference model"),
    (["objective.kind=simpo", "objective.reference=precomputed"], "uses no reference model"),
    (["objective.kind=kto", "objective.reference=precomputed"], "use objective.reference=copy"),
    (["objective.kind=kto", "batch.micro_batch=1"], "batch.micro_batch to 2 or more"),
    (["objective.kind=dpo", "objective.label_smoothing=0.5"], "must be in [0, 0.5)"),
    (["objective.kind=dpo", "batch.micro_batch=auto", "batch.global_batch=8"], "give batch.micro_batch as a number"),
])
def test_a_combination_a_pair_objective_cannot_run_is_one_line(sets, says):
    with pytest.raises(ValueError) as err:
        load_run_config(None, sets)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_reward_head_needs_a_family_that_has_one():
    """The objective's head (`Needs.head`) is one of the overrides the one `model_overrides` decides: a one-label
    classifier read at the end-of-text the pair rows are padded with; refused in one line for a family without."""
    from bigtrain.models.registry import DataFacts, model_overrides
    facts = DataFacts(seq_len=64, pad_token_id=7)
    with pytest.raises(ValueError, match="objective.kind=reward puts a scalar head on the model: .*--model hf"):
        model_overrides("gpt2", "tiny", facts, None, {}, "cpu", head="scalar", asked_by="objective.kind=reward")
    hf = model_overrides("hf", "custom", facts, None, {}, "cpu", head="scalar")
    assert {k: hf[k] for k in ("task", "num_classes", "pad_token_id")} == {"task": "classify", "num_classes": 1,
                                                                             "pad_token_id": 7}
    assert "task" not in model_overrides("hf", "custom", facts, None, {}, "cpu")
    assert load_run_config(None, ["objective.kind=reward"]).objective.declared.head == "scalar"
    assert load_run_config(None, ["objective.kind=dpo"]).objective.declared.head == "own"


def test_kto_is_its_formula_with_the_kl_estimate():
    from bigtrain.objectives.kto import kto_loss
    rng = random.Random(3)
    logps = [-rng.uniform(5, 30) for _ in range(6)]
    ref = [lp + rng.uniform(-2, 2) for lp in logps]
    good = [True, False, True, True, False, False]
    cfg = KTOSettings(beta=0.2, desirable_weight=1.5, undesirable_weight=0.7)
    kl = 0.3
    loss, metrics = kto_loss(cfg, torch.tensor(logps, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                             torch.tensor(good), torch.tensor(kl, dtype=torch.float64))

    def sig(x):
        return 1 / (1 + math.exp(-x))
    want = [1.5 * (1 - sig(0.2 * ((p - r) - kl))) if g else 0.7 * (1 - sig(0.2 * (kl - (p - r))))
            for p, r, g in zip(logps, ref, good)]
    assert float(loss) == pytest.approx(sum(want) / 6, rel=1e-9)
    chosen = [0.2 * (p - r) for p, r, g in zip(logps, ref, good) if g]
    assert float(metrics["rewards/chosen"]) == pytest.approx(sum(chosen) / 3) and float(metrics["kl"]) == kl
    # the policy as the reference, no KL: every answer's loss is 1 - sigmoid(0) = 0.5, whatever its label
    same, _ = kto_loss(KTOSettings(), torch.tensor(logps), torch.tensor(logps), torch.tensor(good),
                       torch.tensor(0.0))
    assert float(same) == pytest.approx(0.5)


def test_the_estimate_counts_a_frozen_reference_and_a_pairs_two_rows():
    """objective.reference=copy adds the copy's weights (partitioned at ZeRO-3, whole below), adapters_off nothing;
    a pair doubles the activations (both answers go through the model)."""
    from dataclasses import replace

    from bigtrain.estimate.memory_model import Setup, estimate
    from bigtrain.estimate.shape import shape_from_spec
    from bigtrain.models import build
    shape = shape_from_spec(build("llama", "tiny", vocab_size=VOCAB, seq_len=SEQ), "fp32")
    for stage, share in ((1, 1), (3, 2)):
        plain = Setup(world_size=2, zero_stage=stage, precision="fp32", micro_batch=2)
        lm, dpo = estimate(shape, plain), estimate(shape, replace(plain, rows_per_sample=2, reference="copy"))
        persistent = shape.persistent_params(plain.param_persistence_threshold) if stage == 3 else 0
        assert dpo.reference == pytest.approx(4 * shape.num_params / share + 4 * persistent)
        assert dpo.activations == pytest.approx(2 * lm.activations) and dpo.params == lm.params
        assert dpo.device_peak > lm.device_peak + dpo.reference - 1
        off = estimate(shape, replace(plain, rows_per_sample=2, reference="adapters_off"))
        assert off.reference == 0
