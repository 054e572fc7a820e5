"""Preference objectives on pairs of answers (TRL's formulas, names and defaults).

With log pi(y) the summed log-probability of an answer's tokens under the policy, log ref(y) under the frozen
reference, and z = [log pi(c) - log ref(c)] - [log pi(r) - log ref(r)] for the chosen c and the rejected r:

    dpo    -(1 - e) log sigmoid(beta z) - e log sigmoid(-beta z)           (e: label_smoothing, cDPO)
    ipo    (z' - 1 / (2 beta))^2, z' from log-probabilities averaged over each answer's tokens (TRL's IPO)
    orpo   NLL(chosen) - beta log sigmoid(log-odds(c) - log-odds(r)), log-odds(y) = a - log(1 - e^a) with a the
           mean token log-probability; no reference
    simpo  -(1 - e) log sigmoid(beta (a_c - a_r) - gamma) - e log sigmoid(-(...)); no reference

The log line and summary.json carry TRL's metrics: rewards/chosen and rewards/rejected (beta times the answer's
log-ratio to the reference; for orpo and simpo beta times its mean token log-probability), rewards/accuracies
(the share of pairs whose chosen reward is higher), rewards/margins, logps/chosen, logps/rejected (summed), and
logits/chosen, logits/rejected (the next-token logits' mean over the vocabulary, averaged over the answers' tokens).
At the first step the policy equals the reference, z = 0, and DPO's loss is exactly ln 2.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bigtrain.config.run_config import ObjectiveConfig
from bigtrain.data.pairs import flat_pairs
from bigtrain.models.losses import lm_targets
from bigtrain.models.spec import call_module, output_logits
from bigtrain.objectives.base import Metrics, Objective

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


class PreferenceLoss(Objective):
    pairs = True
    metric_names = (*REWARD_METRICS, "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected")

    def __init__(self, cfg: ObjectiveConfig):
        self.kind, self.cfg = cfg.kind, cfg
        self.uses_reference = cfg.kind in ("dpo", "ipo")

    def inputs(self, engine: Any, batch: dict) -> Any:
        """(inputs, labels, the reference's log-probabilities of the rows when the data carries them
        (objective.reference=precomputed), else None)."""
        table = batch.get("reference_logps")
        rows = flat_pairs({k: v for k, v in batch.items() if k != "reference_logps"})
        inputs, labels = engine.spec.batch_to_inputs(rows)
        ref = None if table is None else table.transpose(0, 1).reshape(-1).to(engine.device)  # like flat_pairs
        return engine.to_device(inputs), labels.to(engine.device), ref

    def micro_loss(self, engine: Any, item: Any, step: Any) -> tuple[torch.Tensor, Metrics]:
        inputs, labels, ref = item
        if ref is None and self.uses_reference:  # first: its logits are gone before the policy's graph is built
            ref = engine.reference_logps(inputs, labels)
        logits = output_logits(call_module(engine.ds, inputs))
        logps, counts = answer_logps(logits, labels)
        return pair_loss(self.cfg, logps, counts, ref, answer_logit_sums(logits, labels))

    def flops_factor(self) -> float:
        """Both answers train (2 rows); a reference model adds their forward passes (a third of training's FLOPs
        each), a precomputed one none."""
        live = self.uses_reference and self.reference != "precomputed"
        return 2.0 * (1 + 1 / 3) if live else 2.0


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its answer tokens (labels not -100, predicted from what precedes
    them) and their count, from fp32 logits."""
    targets = lm_targets(labels, logits.shape[-2])
    token_logps = -F.cross_entropy(logits.float().flatten(0, -2), targets.reshape(-1), ignore_index=-100,
                                   reduction="none").view(targets.shape)
    mask = targets != -100
    return (token_logps * mask).sum(-1), mask.sum(-1)


@torch.no_grad()
def answer_logit_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row: the sum over its answer tokens of the next-token logits' mean over the vocabulary (TRL's
    logits/chosen and logits/rejected divide it by the tokens' count), without an fp32 copy of the logits."""
    targets = lm_targets(labels, logits.shape[-2])
    return (logits.detach().mean(-1, dtype=torch.float32) * (targets != -100)).sum(-1)


def pair_loss(cfg: ObjectiveConfig, logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None,
              logit_sums: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """The mean loss over the pairs of one micro-batch (rows: the n chosen, then the n rejected) and its metrics;
    `logit_sums` (`answer_logit_sums`) adds logits/chosen and logits/rejected."""
    n = logps.shape[0] // 2
    pc, pr = logps[:n], logps[n:]
    nc, nr = counts[:n].clamp(min=1).to(logps.dtype), counts[n:].clamp(min=1).to(logps.dtype)
    beta, smooth = cfg.beta, cfg.label_smoothing
    extra: Metrics = {}
    if cfg.kind in ("dpo", "ipo"):
        assert ref is not None, f"{cfg.kind} needs the reference's log-probabilities"
        rc, rr = ref[:n], ref[n:]
        if cfg.kind == "ipo":  # TRL averages IPO's log-probabilities over each answer's tokens
            pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
        z = (pc - rc) - (pr - rr)
        if cfg.kind == "dpo":
            losses = -(1 - smooth) * F.logsigmoid(beta * z) - smooth * F.logsigmoid(-beta * z)
        else:
            losses = (z - 1 / (2 * beta)) ** 2
        chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    else:
        ac, ar = pc / nc, pr / nr  # mean token log-probabilities
        if cfg.kind == "orpo":
            log_odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
            ratio = F.logsigmoid(log_odds)
            nll = -pc.sum() / nc.sum()  # the chosen answers' token-mean cross-entropy (TRL: over the batch)
            losses = nll - beta * ratio
            extra = {"nll_loss": nll.detach(), "log_odds_ratio": ratio.mean().detach()}
        else:  # simpo
            margin = beta * (ac - ar) - cfg.simpo_gamma
            losses = -(1 - smooth) * F.logsigmoid(margin) - smooth * F.logsigmoid(-margin)
        chosen, rejected = beta * ac, beta * ar
    metrics = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
               "rewards/accuracies": (chosen > rejected).float().mean(), "rewards/margins": (chosen - rejected).mean(),
               "logps/chosen": logps[:n].mean(), "logps/rejected": logps[n:].mean(), **extra}
    if logit_sums is not None:  # over the side's answer tokens in the micro-batch, as TRL counts them
        metrics["logits/chosen"] = logit_sums[:n].sum() / counts[:n].sum().clamp(min=1)
        metrics["logits/rejected"] = logit_sums[n:].sum() / counts[n:].sum().clamp(min=1)
    return losses.mean(), {k: v.detach().to(torch.float64) for k, v in metrics.items()}
