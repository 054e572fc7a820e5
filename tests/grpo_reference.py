"""A plain one-process GRPO / RLOO loop written from TRL 1.16's formulas with torch and transformers only (no
bigtrain), for the tests to hold bigtrain's online RL to: "a plain one-process GRPO loop from TRL's formulas on the
same model, prompts and seed rises about as far in the same number of steps", and, with the completions fixed
(generation bypassed), per-step losses equal within 1e-5.

    history = train(model, tokenizer, records, REWARDS, Config())

One step, as GRPOTrainer with its defaults (steps_per_generation = gradient accumulation, so a generation batch is
one optimizer step): `prompts_per_step` prompts, `num_generations` completions each (transformers' generate,
sampled at `temperature`, stopping at the end-of-text, the model in eval mode); the reward functions called with
TRL's keywords, weighted, None -> NaN; advantages against the group's mean (/ std + 1e-4 unless scale_rewards is
none; RLOO: the leave-one-out mean, after a k1 KL penalty with beta); then `num_iterations` optimizer steps on that
batch, each over `micro_batches` accumulated micro-batches: the clipped surrogate (token or sequence ratio), + beta
k3 KL times the ratio (GRPO, TRL's use_bias_correction_kl), aggregated by loss_type (dapo: over the whole batch's tokens), AdamW, gradients clipped at 1.0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class Config:
    steps: int = 50  # the defaults: what tests/rl_task.py's task rises with (0.11 -> 0.93 of 1.5 here, ~5 s)
    prompts_per_step: int = 16
    num_generations: int = 8
    max_completion_length: int = 4
    temperature: float = 1.0
    lr: float = 3e-3
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"  # grpo | dr_grpo | dapo | bnpo
    scale_rewards: str = "group"  # group | batch | none
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True  # TRL's default: the k3 KL times the importance ratio
    num_iterations: int = 1
    micro_batches: int = 1
    algorithm: str = "grpo"  # grpo | rloo
    mask_truncated_completions: bool = False
    seed: int = 0


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    count = (~torch.isnan(x)).sum(dim=dim)
    var = torch.nansum((x - mean) ** 2, dim=dim) / (count - 1)
    return torch.sqrt(var)


def per_token_logps(model: Any, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float):
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits[:, prompt_ids.shape[1] - 1:-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # bf16 up, fp64 kept
    return torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def advantages_of(rewards: torch.Tensor, cfg: Config) -> torch.Tensor:
    """rewards [N] (NaN: unscorable) -> advantages [N]."""
    g = rewards.view(-1, cfg.num_generations)
    if cfg.algorithm == "rloo":
        scorable = (~torch.isnan(g)).sum(1, keepdim=True)
        adv = rewards - ((torch.nansum(g, 1, keepdim=True) - g) / (scorable - 1)).view(-1)
        return torch.nan_to_num(adv, nan=0.0)
    mean = torch.nanmean(g, 1).repeat_interleave(cfg.num_generations)
    std = nanstd(rewards).expand_as(rewards) if cfg.scale_rewards == "batch" else \
        nanstd(g, 1).repeat_interleave(cfg.num_generations)
    adv = rewards - mean
    if cfg.scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def micro_loss(logps, old, adv, mask, ref, cfg: Config, total_tokens: float) -> torch.Tensor:
    """One micro-batch's loss as TRL backpropagates it (already divided for accumulation)."""
    hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    if cfg.algorithm == "rloo":
        ratio = torch.exp((logps * mask).sum(1) - (old * mask).sum(1))
        seq = -torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.epsilon, 1 + hi) * adv)
        return seq.mean() / cfg.micro_batches
    log_ratio = logps - old
    if cfg.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    a = adv.unsqueeze(1)
    loss = -torch.min(ratio * a, torch.clamp(ratio, 1 - cfg.epsilon, 1 + hi) * a)
    if cfg.beta:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        loss = loss + cfg.beta * (kl * ratio if cfg.use_bias_correction_kl else kl)
    if cfg.loss_type == "grpo":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / cfg.micro_batches
    if cfg.loss_type == "bnpo":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0) / cfg.micro_batches
    if cfg.loss_type == "dr_grpo":
        return (loss * mask).sum() / (loss.shape[0] * cfg.max_completion_length) / cfg.micro_batches
    assert cfg.loss_type == "dapo", cfg.loss_type
    return (loss * mask).sum() / max(total_tokens, 1.0)


def optimize(model, optimizer, batch: dict, rewards: torch.Tensor, cfg: Config, ref_model=None) -> list[float]:
    """The optimizer steps of one generation batch (completions given): the loss of each step (summed over its
    micro-batches). `batch`: prompt_ids, prompt_mask (left-padded), completion_ids, completion_mask, and optionally
    TRL's tool_mask (0 on the tools' results: attended to, out of the loss and its token counts)."""
    p, pm, c, cm = (batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"))
    lm = cm * batch["tool_mask"] if "tool_mask" in batch else cm  # TRL's completion_mask * tool_mask
    with torch.no_grad():
        old = per_token_logps(model, p, pm, c, cm, cfg.temperature)
        ref = per_token_logps(ref_model, p, pm, c, cm, cfg.temperature) if ref_model is not None else None
    if cfg.algorithm == "rloo" and cfg.beta:
        rewards = rewards - cfg.beta * ((old - ref) * lm).sum(1)
    adv = advantages_of(rewards, cfg)
    total = float(lm.sum())
    chunks = torch.arange(len(c)).chunk(cfg.micro_batches)
    losses = []
    for _ in range(cfg.num_iterations):
        optimizer.zero_grad()
        step = 0.0
        for rows in chunks:
            logps = per_token_logps(model, p[rows], pm[rows], c[rows], cm[rows], cfg.temperature)
            loss = micro_loss(logps, old[rows], adv[rows], lm[rows], None if ref is None else ref[rows], cfg, total)
            loss.backward()
            step += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(step)
    return losses


def generate(model, tokenizer, prompts: list[str], cfg: Config) -> dict:
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    p, pm = enc["input_ids"].repeat_interleave(cfg.num_generations, 0), \
        enc["attention_mask"].repeat_interleave(cfg.num_generations, 0)
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=p, attention_mask=pm, do_sample=True, temperature=cfg.temperature, top_k=0,
                             top_p=1.0, max_new_tokens=cfg.max_completion_length,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.train()
    c = out[:, p.shape[1]:]
    is_eos = c == tokenizer.eos_token_id
    first = torch.where(is_eos.any(1), is_eos.long().argmax(1), torch.full((len(c),), c.shape[1]))
    cm = (torch.arange(c.shape[1]).unsqueeze(0) <= first.unsqueeze(1)).long()
    truncated = ~is_eos.any(1)
    if cfg.mask_truncated_completions:
        cm = cm * (~truncated).long().unsqueeze(1)
    return {"prompt_ids": p, "prompt_mask": pm, "completion_ids": c.masked_fill(cm == 0, tokenizer.pad_token_id),
            "completion_mask": cm, "truncated": truncated}


def score(funcs: list[Callable], weights: list[float], prompts, completions, completion_ids, records) -> torch.Tensor:
    columns = {k: [r[k] for r in records] for k in records[0] if k != "prompt"}
    table = torch.tensor([[math.nan if v is None else float(v) for v in f(prompts=prompts, completions=completions,
                                                                          completion_ids=completion_ids, **columns)]
                          for f in funcs]).T
    rewards = (table * torch.tensor(weights)).nansum(1)
    rewards[torch.isnan(table).all(1)] = math.nan
    return rewards


def train(model, tokenizer, records: list[dict], funcs: list[Callable], cfg: Config,
          weights: list[float] | None = None, ref_model=None) -> list[dict]:
    """`cfg.steps` GRPO steps over `records` (taken in order, wrapping); per step its mean reward and losses."""
    torch.manual_seed(cfg.seed)
    weights = weights or [1.0] * len(funcs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    history = []
    for step in range(cfg.steps):
        chosen = [records[(step * cfg.prompts_per_step + i) % len(records)] for i in range(cfg.prompts_per_step)]
        batch = generate(model, tokenizer, [r["prompt"] for r in chosen], cfg)
        n = cfg.num_generations
        # scored whole, as TRL scores them (mask_truncated_completions masks a cut one's tokens from the loss only)
        ids = [row.tolist() if cut else row[m.bool()].tolist()
               for row, m, cut in zip(batch["completion_ids"], batch["completion_mask"], batch["truncated"])]
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        rows = [r for r in chosen for _ in range(n)]
        rewards = score(funcs, weights, [r["prompt"] for r in rows], texts, ids, rows)
        losses = optimize(model, optimizer, batch, rewards, cfg, ref_model)
        history.append({"reward": float(torch.nanmean(rewards)), "losses": losses,
                        "mean_length": float(batch["completion_mask"].sum(1).float().mean())})
    return history


def mean_reward(history: list[dict], first: int, last: int) -> float:
    return sum(h["reward"] for h in history[first:last]) / (last - first)

