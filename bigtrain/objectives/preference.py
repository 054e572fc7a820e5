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

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from bigtrain.fields import doc
from bigtrain.objectives.base import (LIVE_REFERENCES, REFERENCES, FineTuning, Metrics, Needs, Objective, Policy,
                                      check_positive)

if TYPE_CHECKING:
    import torch

# Why objectives on two rows a sample (KTO's and the reward model's too) cannot run with a mode.
NOT_BUILT = ("not supported (a pair objective reads log-probabilities of two answers from the logits; neither lever "
             "is built for it)")
PAIR_REFUSALS = {
    "pipeline": "a pair objective needs the chosen and rejected answers' log-probabilities in one place, which "
                "pipeline stages do not give",
    "tensor": "not supported", "sequence": "not supported",
    "packing": "pairs are compared answer with answer, one pair per row pair",
    "auto_micro_batch": "the probe sizes one-example rows",
    "compile": NOT_BUILT, "chunked_loss": NOT_BUILT}
# The policy against a dropout-free reference (its adapters' dropout too), as TRL does.
PAIRS = Needs(layout="pairs", rows_per_sample=2, dropout=False, refuses=PAIR_REFUSALS)


@dataclass(kw_only=True)
class PreferenceSettings:
    beta: float = doc(0.1, "dpo/ipo: the KL strength beta (ipo's tau); orpo: the odds-ratio weight (lambda); "
                      "simpo: the reward scale beta.")
    label_smoothing: float = doc(0.0, "dpo: conservative DPO (cDPO), the assumed share of flipped pairs, in [0, 0.5).")
    simpo_gamma: float = doc(0.5, "simpo: the target reward margin gamma.")

    def __post_init__(self) -> None:
        check_positive(self, "beta", note=" (TRL's default is 0.1)")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"objective.label_smoothing={self.label_smoothing}: must be in [0, 0.5) (cDPO's share "
                             "of flipped pairs; 0 is plain DPO)")


class PreferenceLoss(Objective):
    needs = PAIRS
    fine_tuning = FineTuning(lr=1e-6)  # TRL's DPOConfig (its loss_type ipo too), ORPOConfig, CPOConfig (SimPO)
    Settings = PreferenceSettings
    samples = "pairs"

    def inputs(self, policy: Policy, batch: dict) -> Any:
        """(inputs, labels, the reference's log-probabilities of the rows when the data carries them
        (objective.reference=precomputed), else None)."""
        from bigtrain.data.pairs import flat_pairs
        table = batch.get("reference_logps")
        inputs, labels = policy.inputs(flat_pairs({k: v for k, v in batch.items() if k != "reference_logps"}))
        ref = None if table is None else table.transpose(0, 1).reshape(-1).to(policy.device)  # like flat_pairs
        return inputs, labels, ref

    def step_batches(self, micro_batches: int) -> int:
        """A step's pairs grouped by length but for orpo, whose NLL term is a token mean over each micro-batch's
        chosen answers (the others average a loss per pair over equal micro-batches)."""
        return 1 if self.kind == "orpo" else micro_batches

    def micro_loss(self, policy: Policy, item: Any, step: Any) -> tuple[torch.Tensor, Metrics]:
        inputs, labels, ref = item
        if ref is None and self.reference in LIVE_REFERENCES:  # first: its logits are gone before the policy's graph
            ref = policy.reference_logps(inputs, labels)
        from bigtrain.models.losses import answer_logit_sums, answer_logps
        logits = policy.logits(inputs)
        logps, counts = answer_logps(logits, labels)
        return pair_loss(self.kind, self.settings, logps, counts, ref, answer_logit_sums(logits, labels))


class DPO(PreferenceLoss):
    needs = replace(PAIRS, references=REFERENCES)
    summary = "pairs against a frozen reference, -log sigmoid(beta z)"


class IPO(PreferenceLoss):
    needs = replace(PAIRS, references=REFERENCES)
    summary = "pairs against a frozen reference, (z - 1 / (2 beta))^2"


class ORPO(PreferenceLoss):
    summary = "pairs, the chosen answer's NLL and an odds-ratio term, no reference"


class SimPO(PreferenceLoss):
    summary = "pairs, a margin between mean log-probabilities, no reference"


def pair_loss(kind: str, cfg: PreferenceSettings, logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None,
              logit_sums: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """The mean loss of `kind` over the pairs of one micro-batch (rows: the n chosen, then the n rejected) and its
    metrics; `logit_sums` (`bigtrain.models.losses.answer_logit_sums`) adds logits/chosen and logits/rejected."""
    import torch
    import torch.nn.functional as F
    n = logps.shape[0] // 2
    pc, pr = logps[:n], logps[n:]
    nc, nr = counts[:n].clamp(min=1).to(logps.dtype), counts[n:].clamp(min=1).to(logps.dtype)
    beta, smooth = cfg.beta, cfg.label_smoothing
    extra: Metrics = {}
    if kind in ("dpo", "ipo"):
        assert ref is not None, f"{kind} needs the reference's log-probabilities"
        rc, rr = ref[:n], ref[n:]
        if kind == "ipo":  # TRL averages IPO's log-probabilities over each answer's tokens
            pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
        z = (pc - rc) - (pr - rr)
        if kind == "dpo":
            losses = -(1 - smooth) * F.logsigmoid(beta * z) - smooth * F.logsigmoid(-beta * z)
        else:
            losses = (z - 1 / (2 * beta)) ** 2
        chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    else:
        ac, ar = pc / nc, pr / nr  # mean token log-probabilities
        if kind == "orpo":
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
