"""Training objectives: what a micro-batch's loss and metrics are, and a declaration of what each needs of a run.
The stepper (bigtrain.train.engine) calls an objective's methods and knows none by name; nothing outside this
package names an objective kind but `OBJECTIVES`, the one table of kinds below (tests/unit/test_objective_seam.py
checks).

    lm        the model's own loss: next-token cross-entropy (plain, chunked, sequence-parallel, token-weighted,
              a mixture of experts' router term), a classifier's cross-entropy        (causal_lm.py)
    dpo, ipo  pairs of answers against a frozen reference                               (preference.py)
    orpo, simpo  pairs of answers, no reference                                         (preference.py)
    kto       unpaired answers marked desirable or not, against a reference             (kto.py)
    reward    a scalar head on pairs: -log sigmoid(r_chosen - r_rejected)               (reward.py)
    grpo, rloo  online RL: completions sampled and scored by rewards                    (grpo.py on online.py)
    distill   on-policy distillation: the student's completions against a teacher's     (distill.py on online.py)
              next-token distributions, the generalized JSD

What an objective is (base.py):
- `needs` (`Needs`): the data layout it reads, rows per sample, the reference kinds it allows, whether it generates,
  the frozen models it holds beside the policy (`FrozenModel`: a reward model, a teacher), its head, dropout, the
  least micro-batch, and each mode it refuses (compile, chunked loss, packing, pipeline, tensor, sequence,
  micro-batch probe) with why. `declare(settings)` returns them, where the settings decide (a KL term on or off).
  Read by the config rules (bigtrain.config.objective, bigtrain.config.run_config), hence lint; by `bigtrain
  estimate` and the launcher's memory check (rows, the reference, the frozen models, the chunked loss); by the
  builder (bigtrain.train.assemble: dropout, compile and chunked loss, the reference and frozen models) and the job
  (the data layout, the head, FLOPs). `bigtrain estimate` counts an objective that generates by its
  `completion_tokens` (a round's KV cache) and `gathers_weights` (the whole weights on the device at ZeRO-3).
- `fine_tuning` (`FineTuning`): the peak learning rate it trains a pretrained model at when the run sets none (TRL's
  trainer's default for it: lm 2e-5 (SFTConfig), dpo/ipo/orpo/simpo/kto 1e-6, reward 1e-4), with LoRA adapters
  (`lora_lr`; default 10x, TRL's PEFT guide), its weight decay (0) and warm-up steps (1). One line, e.g.
  `fine_tuning = FineTuning(lr=1e-6)  # TRL's GRPOConfig`. Read by bigtrain.config.defaults, which fills
  optimizer.lr, optimizer.weight_decay and schedule.warmup_steps left unset for a run from model.pretrained (from
  random weights: pretraining's 6e-4, 0.1, 20, whatever the objective); the start line says which it chose and why;
  docs/fine-tuning.md holds the table, and tests/unit/test_defaults.py holds each kind to the TRL config it names.
- `Settings`: a keyword-only dataclass of its own hyper-parameters, each field `bigtrain.fields.doc(default, text)`.
  The run config's `objective` section is every objective's settings side by side (`--set objective.beta=0.2`,
  `objective: {kind: dpo, beta: 0.2}`); a name several objectives share is one field (their texts joined; where
  their defaults differ its default is None: each objective's own).
- `flops_factor()`: its FLOPs per token against the policy's 6N (a live reference's forward adds a third).
- The per-step methods, given a `Policy` (`bigtrain.train.policy.PolicyModel`): `inputs` (a batch on the device),
  `begin_step` (what the step's micro-batches share), `micro_loss`, `eval_loss`. A Policy gives the model's own
  loss (`forward_with_loss`), logits, answer log-probabilities, a reference's, a frozen model's logits
  (`frozen(setting)`), the tokenizer, and `generate` (a round of completions for left-padded prompts, through
  bigtrain.rollout.generate).

Objective modules are imported by the run config, which loads without torch: they import torch inside the
functions that compute.

Adding an objective (its file here, its data format if new, a line in OBJECTIVES; nothing in train/, config/,
estimate/ or launch/):
1. `objectives/NAME.py`: a subclass of `Objective` with `needs`, `fine_tuning`, `Settings` (fields documented with
   `doc`, checked in `__post_init__` with one-line ValueErrors naming objective.FIELD), `summary`, `samples`, and
   `micro_loss` (plus `inputs`, `begin_step`, `eval_loss` where the defaults do not fit).
2. A new data layout: its rows in bigtrain/data (the format, a bundle whose `layout` names it) and a line in
   `bigtrain.data.dataset.LAYOUTS`.
3. The kind in `OBJECTIVES`. The run config then takes it and its settings (YAML, `--set objective.FIELD=...`, the
   docs test's key check), its rules refuse what it declares, and the job, builder and estimates follow its needs.
4. Its row in docs/fine-tuning.md's table of defaults, and the TRL config it follows in
   tests/unit/test_defaults.py's `TRL_CONFIGS`.

Online RL on this seam (online.py, grpo.py), with the hooks any objective may use:
- `fine_tuning = FineTuning(lr=1e-6)` (TRL's GRPOConfig and RLOOConfig; with LoRA 1e-5, TRL's PEFT guide);
  `declare(settings)`: `Needs(layout="prompts", generates=True, samples_per_record=num_generations (every rank's
  micro_batch x grad_accum holds whole groups: `batch_problem`), completion_tokens=max_completion_length (the data
  leaves a prompt data.seq_len minus it), frozen_models=(FrozenModel("reward_model", head="scalar"),),
  references only when beta > 0, refuses={...})`.
- `data_batch(micro, accumulation)`: the records a step reads (micro x accumulation / num_generations prompts;
  `eval_data_batch(micro)` a held-out batch's: micro / num_generations_eval);
  `read_step(policy, batches, n)`: the step's micro-batches, made by the objective (one batch of prompts, a round of
  `policy.generate`, the reference's and old policy's log-probabilities through `policy.completion_logits` /
  `reference_completion_logits`, the rewards and advantages), or the round it holds (num_iterations: no data read).
- `micro_loss` returns a share of the step's loss times accumulation x ranks (DeepSpeed divides by both);
  `end_step(policy, step)` gives the whole step's metrics (TRL's names; `time/generation|reference|rewards|policy`,
  which the summary adds up as `time_split`); `sample_table()` the rows rank 0 writes to OUT/samples.jsonl and the
  trackers at each log step; `state_dict()` / `load_state_dict()` each rank's own state (its SampleRNG streams, the
  held round), saved in the rank's RNG file of each checkpoint and given back on a resume at the same world size.
On-policy distillation (distill.py): an `OnlineObjective` with `frozen_models=(FrozenModel("teacher"),)`, no
rewards (`score_round` sets no advantages), `completions` from the records' answers on the steps objective.lmbda
leaves off-policy, and a `piece_loss` that is the generalized JSD between `policy.completion_logits` and
`policy.frozen("teacher").completion_logits` on the completion (bigtrain.rollout.losses.distill_share:
DeepSpeed's generalized_jsd_loss).
"""
from __future__ import annotations

from typing import Any

from bigtrain.objectives.base import (HEADS, LIVE_REFERENCES, MODES, REFERENCES, FineTuning, FrozenModel, Needs,
                                      NoSettings, Objective, Policy)
from bigtrain.objectives.causal_lm import ModelLoss
from bigtrain.objectives.distill import Distill
from bigtrain.objectives.grpo import GRPO, RLOO
from bigtrain.objectives.kto import KTOLoss
from bigtrain.objectives.preference import DPO, IPO, ORPO, SimPO
from bigtrain.objectives.reward import RewardLoss

# The one table of kinds (objective.kind -> its objective); the first is the run config's default.
OBJECTIVES: dict[str, type[Objective]] = {
    "lm": ModelLoss, "dpo": DPO, "ipo": IPO, "orpo": ORPO, "simpo": SimPO, "kto": KTOLoss, "reward": RewardLoss,
    "grpo": GRPO, "rloo": RLOO, "distill": Distill}


def objective_class(kind: str) -> type[Objective]:
    if kind not in OBJECTIVES:
        raise ValueError(f"objective.kind={kind!r}: allowed values are {', '.join(OBJECTIVES)}")
    return OBJECTIVES[kind]


def default_objective() -> Objective:
    """The run config's default objective (the table's first), for engines built without one."""
    kind = next(iter(OBJECTIVES))
    return OBJECTIVES[kind](kind)


def resolve_reference(needs: Needs, setting: str, lora: bool) -> str:
    """objective.reference as training builds it: none for an objective without one; auto = the policy with its
    adapters off under LoRA (no second copy), else a frozen copy."""
    if not needs.references:
        return "none"
    if setting == "auto":
        return "adapters_off" if lora and "adapters_off" in needs.references else "copy"
    return setting


def build_objective(cfg: Any, lora: bool = False) -> Objective:
    """The run's objective from its run-config section (`bigtrain.config.objective.ObjectiveConfig`: kind,
    reference, the kind's settings), its reference resolved."""
    cls = objective_class(cfg.kind)
    return cls(cfg.kind, cfg.settings, resolve_reference(cls.declare(cfg.settings), cfg.reference, lora))


def batch_problem(kind: str, needs: Needs, per_rank: tuple[int, int] | None = None, seq_len: int | None = None,
                  ds_config: dict | None = None, fixes: list[str] | None = None) -> str | None:
    """One line when the batch cannot hold whole records of `kind` (`Needs.samples_per_record`: each rank's
    `per_rank` (micro-batch, accumulation), or the triple of a resolved `ds_config`, must hold a multiple of it), or
    when its completions leave a prompt no room in `seq_len` (`Needs.completion_tokens`); None when they can.
    `fixes`: settings checked to hold (`bigtrain.ds.groups`), named instead of the rule."""
    group, why = needs.samples_per_record, needs.refuses.get("samples_per_record", "")
    if seq_len is not None and needs.completion_tokens and seq_len <= needs.completion_tokens:
        return (f"data.seq_len={seq_len} with objective.kind={kind}: {needs.refuses.get('completion_tokens', '')} "
                f"take {needs.completion_tokens} tokens, which leaves a prompt no room; make data.seq_len longer "
                f"than {needs.completion_tokens} (room for the prompts) or the completions shorter")
    if ds_config is not None:
        per_rank = (ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"])
    if group < 2 or per_rank is None or (per_rank[0] * per_rank[1]) % group == 0:
        return None
    micro, accum = per_rank
    batch = f"each rank's micro_batch x grad_accum = {micro} x {accum} = {micro * accum} samples"
    if ds_config is not None:
        ranks = ds_config["train_batch_size"] // (micro * accum)
        batch = (f"this job's train_batch_size {ds_config['train_batch_size']} = micro {micro} x accum {accum} x "
                 f"data-parallel {ranks} gives each rank {micro * accum} samples, which")
    fix = (f"set {', or '.join(fixes)}" if fixes else
           f"set batch.micro_batch or batch.grad_accum so that micro_batch x grad_accum is a multiple of {group}")
    return f"objective.kind={kind}: {why}, but {batch} is not a multiple of {group}; {fix}"


def data_problem(kind: str, needs: Needs, layout: str, plain_text: bool) -> str | None:
    """One line when the data's layout is not the one `kind` reads (None when it is): what it reads, what the data
    is, and the kinds that train on such data."""
    if layout == needs.layout:
        return None
    from bigtrain.data.dataset import LAYOUTS
    have = "plain text" if layout == "rows" and plain_text else LAYOUTS[layout][0]
    fits = [k for k, cls in OBJECTIVES.items() if cls.needs.layout == layout]
    return (f"objective.kind={kind} trains on {LAYOUTS[needs.layout][1]}, and this data is {have}: give such "
            f"records, or objective.kind={fits[0]} for this data ({', '.join(fits)})")


__all__ = ["HEADS", "LIVE_REFERENCES", "MODES", "OBJECTIVES", "REFERENCES", "FineTuning", "FrozenModel", "Needs",
           "NoSettings", "Objective", "Policy", "batch_problem", "build_objective", "data_problem", "default_objective",
           "objective_class", "resolve_reference"]
