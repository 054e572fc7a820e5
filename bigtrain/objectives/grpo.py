"""`objective.kind: grpo` and `rloo`: online RL on the policy's own completions, scored by rewards a user names, as
TRL 1.16's GRPOTrainer and RLOOTrainer compute it (their names, defaults and metrics; the math is
bigtrain.rollout's, the step online.py's).

    grpo   advantage = (reward - its group's mean) / (std + 1e-4) (objective.scale_rewards: group | batch | none);
           per token -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta k3 KL to the reference
           (times rho: use_bias_correction_kl), rho per token or per sequence (importance_sampling_level),
           aggregated by loss_type (grpo | dr_grpo | dapo | bnpo | luspo; cispo, sapo and vespo weigh the token
           otherwise: bigtrain.rollout.losses.grpo_terms); delta, off_policy_mask_threshold and
           top_entropy_quantile as TRL has them; beta 0 (TRL's default) builds no reference
    rloo   advantage = reward - beta x its summed k1 KL (old policy vs reference) - the mean of the other
           completions of its prompt (optionally normalised over the batch); per sequence -min(rho A,
           clip(rho) A) with rho = exp(sum log pi - sum log pi_old); beta 0.05

Rewards (objective.rewards, objective.reward_model; bigtrain.rollout.rewards): each function is called on this
rank's completions with TRL's keywords (prompts, completions, completion_ids, every other column of the records),
the scores of all ranks gathered (a few floats) so that a group's and the batch's statistics are the global
batch's; a completion every function scores None gets advantage 0; what they log (log_metric, log_extra) goes to
the step's metrics and the sample table. The reward model is the frozen model beside
the policy (partitioned like it under ZeRO-3), reading the text re-tokenized with its own tokenizer.

Metrics: reward, reward_std, rewards/<function>/mean|std, frac_reward_zero_std, completions/mean_length|
min_length|max_length|clipped_ratio, entropy, kl (beta > 0), clip_ratio/low_mean|high_mean|region_mean (the
clipped loss types; cispo_clip_ratio, vespo/phi_seq_mean), and time/generation|reference|rewards|policy; a table
of this rank's prompts, completions, rewards and advantages at every log step (OUT/samples.jsonl).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from bigtrain.fields import doc
from bigtrain.objectives.base import FineTuning, FrozenModel, Metrics, Needs, Policy
from bigtrain.objectives.generation_settings import GROUP_DOC, GenerationSettings
from bigtrain.objectives.online import OnlineObjective, rank_here
from bigtrain.objectives.round_pieces import Piece, StepState, add_sums, gather_rows

if TYPE_CHECKING:
    import torch

REWARD_MODEL = FrozenModel("reward_model", head="scalar")


@dataclass(kw_only=True)
class RewardSettings(GenerationSettings):
    """What scores the completions, and the clipped update (GRPO's and RLOO's shared settings)."""

    num_iterations: int = doc(1, "grpo/rloo: optimizer steps over one round of completions (mu); train.steps "
                                 "counts optimizer steps.")
    num_generations_eval: int | None = doc(None, "grpo/rloo: completions per prompt in an evaluation's rounds (fewer "
                                                 "to save time: a held-out batch then holds more prompts); None: "
                                                 "num_generations.")
    epsilon: float = doc(0.2, "grpo/rloo: the clip of the importance ratio below 1.")
    epsilon_high: float | None = doc(None, "grpo/rloo: the clip above 1 (None: epsilon; DAPO suggests 0.28).")
    generation_batch_size: int | None = doc(
        None, "grpo/rloo: completions sampled in one round over all ranks (TRL's): more than batch.global_batch makes "
        "a round serve several optimizer steps (fewer, fuller generation passes; its rows shuffled, each step on its "
        "share, the policy's log-probabilities kept from before the round's first update); None: one step's. Or "
        "give objective.steps_per_generation.")
    steps_per_generation: int | None = doc(
        None, "grpo/rloo: micro-batches of one round on each rank (TRL's), a multiple of batch.grad_accum; None: "
        "batch.grad_accum (a round per optimizer step).")
    mask_truncated_completions: bool = doc(False, "grpo/rloo: completions cut by max_completion_length are left out "
                                                  "of the loss (DAPO's overlong filtering).")
    rewards: str | list[str] | None = doc(None, "grpo/rloo: the reward functions: path/to/file.py:function, "
                                                "package.module:function, accuracy, format[=REGEX], "
                                                "length[=MAX[,CACHE]] (one, or a list).")
    reward_weights: list[float] | None = doc(None, "grpo/rloo: one weight per reward (objective.rewards, then "
                                                   "objective.reward_model); None: 1.0 each.")
    reward_model: str | None = doc(None, "grpo/rloo: a reward model directory (what objective.kind=reward "
                                         "exports), scored at each completion's last token, held frozen beside "
                                         "the policy and partitioned like it under ZeRO-3.")

    def __post_init__(self) -> None:
        super().__post_init__()
        from bigtrain.objectives.base import check_positive
        check_positive(self, "num_iterations", "epsilon")
        for name in ("generation_batch_size", "steps_per_generation"):
            if getattr(self, name) is not None:
                check_positive(self, name)
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError("objective.generation_batch_size and objective.steps_per_generation both set: give one "
                             "(TRL refuses both too); the other follows from batch.micro_batch x ranks")
        if self.num_generations < 2:  # TRL refuses it too: one completion per prompt has no group to compare with
            raise ValueError(f"objective.num_generations={self.num_generations}: grpo and rloo score each completion "
                             "against the others of its prompt, so every advantage would be 0 and nothing would "
                             "train; give 2 or more (TRL's default is 8)")
        if self.num_generations_eval is not None and not self.num_generations_eval >= 1:
            raise ValueError(f"objective.num_generations_eval={self.num_generations_eval}: must be >= 1 (completions "
                             "per prompt in evaluation), or null (num_generations)")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ValueError(f"objective.epsilon_high={self.epsilon_high}: must be > 0 (or null: epsilon)")
        if not self.beta >= 0:
            raise ValueError(f"objective.beta={self.beta}: must be >= 0 (0: no KL term, no reference model)")
        if isinstance(self.rewards, str):
            self.rewards = [self.rewards]
        given = len(self.rewards or []) + (self.reward_model is not None)
        if not given and self.environment is None:  # an environment's get_reward may be the reward (its load says)
            raise ValueError("objective.rewards: online RL needs a reward: a function (objective.rewards=[path/to/"
                             "file.py:function], package.module:function, accuracy, format, length), "
                             "objective.reward_model=DIR, or an objective.environment with a get_reward method")
        if self.reward_weights is not None and len(self.reward_weights) != given:
            raise ValueError(f"objective.reward_weights has {len(self.reward_weights)} weights for {given} rewards "
                             "(objective.rewards, then objective.reward_model): give one weight per reward")


@dataclass(kw_only=True)
class GRPOSettings(RewardSettings):
    beta: float = doc(0.0, "grpo: the k3 KL term's weight (0: no reference model); rloo: the k1 KL penalty on "
                           "the rewards.")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = doc(
        "dapo", "grpo: the per-token loss and how it adds up: grpo (each sequence's mean, averaged), dr_grpo (sum / "
        "(sequences x max_completion_length)), dapo (sum / the step's tokens), bnpo (each micro-batch's token "
        "mean), cispo (the ratio capped at epsilon_high as a weight on log pi; dapo's sum), sapo (a soft gate "
        "instead of the clip; grpo's mean), luspo (each sequence's sum, averaged), vespo (VESPO's gamma weight of "
        "the sequence ratio on log pi; dapo's sum).")
    scale_rewards: Literal["group", "batch", "none"] = doc(
        "group", "grpo: advantages divided by the std of the group's rewards, of the batch's, or not at all.")
    importance_sampling_level: Literal["token", "sequence"] = doc(
        "token", "grpo: the importance ratio per token, or per sequence (GSPO: the mean of its log-ratios).")
    use_bias_correction_kl: bool = doc(True, "grpo: the k3 KL term multiplied by the importance ratio (DeepSeek-V3.2's "
                                             "unbiased reverse-KL gradient); it changes the gradient with beta > 0 "
                                             "even on-policy, where the ratio is 1 in value only.")
    delta: float | None = doc(None, "grpo: the clipped loss types' two-sided clip (INTELLECT-2): the ratio also "
                                    "capped at delta (> 1; suggested above 1 + epsilon); None: off.")
    sapo_temperature_pos: float = doc(1.0, "grpo, loss_type=sapo: the gate's temperature for positive advantages.")
    sapo_temperature_neg: float = doc(1.05, "grpo, loss_type=sapo: the gate's temperature for the others.")
    vespo_k_pos: float = doc(2.0, "grpo, loss_type=vespo: the weight's power for advantages >= 0 (how fast it falls "
                                  "for ratios below 1).")
    vespo_lambda_pos: float = doc(3.0, "grpo, loss_type=vespo: the weight's decay for advantages >= 0 (how fast it "
                                       "falls for ratios above 1).")
    vespo_k_neg: float = doc(3.0, "grpo, loss_type=vespo: the weight's power for negative advantages.")
    vespo_lambda_neg: float = doc(2.0, "grpo, loss_type=vespo: the weight's decay for negative advantages.")
    off_policy_mask_threshold: float | None = doc(
        None, "grpo: a sequence with a negative advantage whose mean per-token KL to the policy that sampled it is "
              "above this is left out of the loss (DeepSeek-V3.2; e.g. 0.5; needs num_iterations > 1); None: off.")
    top_entropy_quantile: float = doc(1.0, "grpo: only the tokens in this top share by entropy (over every rank's "
                                           "micro-batch) train the policy term (Beyond the 80/20 Rule suggests "
                                           "0.2); 1.0: all.")

    def __post_init__(self) -> None:
        super().__post_init__()
        from bigtrain.objectives.loss_types import check_loss_settings
        check_loss_settings(self)


@dataclass(kw_only=True)
class RLOOSettings(RewardSettings):
    num_generations: int = doc(2, GROUP_DOC)
    beta: float = doc(0.05, "grpo: the k3 KL term's weight (0: no reference model); rloo: the k1 KL penalty on "
                            "the rewards.")
    normalize_advantages: bool = doc(False, "rloo: advantages normalised to mean 0, std 1 over the batch.")


class RewardedObjective(OnlineObjective):
    """Rewards and advantages of a round (GRPO's and RLOO's); the subclass says how advantages and the loss are
    made."""

    fine_tuning = FineTuning(lr=1e-6)  # TRL's GRPOConfig and RLOOConfig; with LoRA 1e-5 (TRL's PEFT guide for GRPO)

    def __init__(self, kind: str, settings: Any = None, reference: str = "none"):
        super().__init__(kind, settings, reference)
        from bigtrain.rollout.rewards import RewardFunction, load_rewards
        s = self.settings
        self.functions = load_rewards(s.rewards or [], None, max_completion_length=s.max_completion_length,
                                      load_model=_reward_model_elsewhere) if s.rewards else []
        self.weights = s.reward_weights
        # the environments' get_reward, after objective.rewards and objective.reward_model, each of weight 1 (TRL's)
        self.environment_rewards = [RewardFunction(name, fn, 1.0, spec) for name, fn, spec in
                                    (self.agent.toolbox.reward_functions() if self.agent else [])]
        if not self.functions and s.reward_model is None and not self.environment_rewards:
            raise ValueError(f"objective.environment={s.environment!r} has no get_reward method and objective.rewards "
                             "is empty: online RL needs a reward; give the environment a get_reward() or name reward "
                             "functions in objective.rewards")

    @classmethod
    def declare(cls, settings: Any) -> Needs:
        return cls.online_needs(settings, settings.beta > 0, (REWARD_MODEL,))

    def score_round(self, policy: Policy, batch: dict, rollout: Any, pieces: list[Piece]) -> Metrics:
        import torch

        from bigtrain.rollout.metrics import logged_metrics, reward_metrics
        from bigtrain.rollout.rewards import RewardFunction, score
        if self.settings.reward_model is not None and len(self.functions) == len(self.settings.rewards or []):
            self.functions.append(RewardFunction(*_reward_model(policy)))
        n = self.group
        records = [r for r in batch["records"] for _ in range(n)]
        ids = rollout.completion_lists()
        texts = policy.tokenizer.batch_decode(ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if isinstance(r.get("prompt"), list) else t
                       for t, r in zip(texts, records)]
        prompts = [r.get("prompt") for r in records]
        conversations, extra_kwargs = getattr(rollout, "conversations", None), {}
        if conversations:  # with tools: each completion's messages (calls and results), its prompt as generated from
            completions, prompts = conversations, rollout.prompts
            if any(e is not None for e in rollout.environments):
                extra_kwargs["environments"] = rollout.environments
        functions = self.functions + self.environment_rewards
        scores = score(functions, prompts, completions, ids, records, step=self.steps_done, extra=extra_kwargs)
        local = scores.per_function.to(policy.device)
        penalty = self.penalty(pieces)
        table = gather_rows(torch.cat([local, penalty.unsqueeze(1)], 1), policy.device)
        weights = torch.tensor((self.weights or [1.0] * len(self.functions)) + [1.0] * len(self.environment_rewards),
                               dtype=table.dtype, device=table.device)
        advantages, std_zero, extra = self.advantages(table[:, :-1], weights, table[:, -1])
        mine = advantages.view(-1, local.shape[0])[rank_here()]
        for piece in pieces:  # in the rollout's order, as the rows were scored
            piece.advantages = mine[piece.index.to(mine.device)]
        names = [f.name for f in functions]
        self.table = [{**{column: values[i] for column, values in scores.extra.items()},
                       "prompt": p if isinstance(p, str) else p[-1].get("content", ""), "completion": t,
                       "reward": float(torch.nansum(row * weights.cpu())), "advantage": float(a),
                       **{f"rewards/{name}": float(v) for name, v in zip(names, row)},
                       **({"conversation": c} if conversations else {})}
                      for i, (p, t, row, a, c) in enumerate(zip(prompts, texts, local.cpu(), mine.cpu(),
                                                                completions))]
        return {**logged_metrics(scores.metrics, policy.device),
                **reward_metrics(table[:, :-1], names, weights, std_zero), **extra}

    def penalty(self, pieces: list[Piece]) -> torch.Tensor:
        """Per completion (in the rollout's order), what the rewards are penalised by before the advantages (RLOO's
        KL); 0 by default."""
        import torch
        return torch.zeros(sum(p.completion_ids.shape[0] for p in pieces), device=pieces[0].completion_ids.device)

    def advantages(self, scores: torch.Tensor, weights: torch.Tensor,
                   penalty: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """[N, F] scores of the global batch (NaN: None), the weights, the penalties -> (advantages [N],
        whether each group's rewards were alike, extra metrics)."""
        raise NotImplementedError

    def logps(self, policy: Policy, piece: Piece, step: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's log-probabilities of the piece's tokens (with their graph) and its entropies per token
        (without; their mean is the entropy metric)."""
        from bigtrain.rollout.losses import masked_sum, token_entropy, token_logps
        logits = policy.completion_logits(*piece.rows)
        temperature = self.settings.temperature
        entropies = token_entropy(logits, temperature)
        add_sums(step, {"entropy": masked_sum(entropies, piece.completion_mask)})
        return token_logps(logits, piece.completion_ids, temperature), entropies


class GRPO(RewardedObjective):
    Settings = GRPOSettings
    summary = ("online RL: completions sampled and scored by your rewards, group-relative advantages, the clipped "
               "surrogate (TRL's GRPO)")

    @property
    def uses_old_logps(self) -> bool:  # the ratio is 1 in value while each round trains one step
        return self.iterations > 1 or self.steps_per_round > 1

    @property
    def uses_reference(self) -> bool:
        return self.settings.beta > 0

    @property
    def regroups(self) -> bool:  # bnpo's token mean and the entropy quantile are each micro-batch's own
        return self.settings.loss_type != "bnpo" and self.settings.top_entropy_quantile == 1.0

    def advantages(self, scores: torch.Tensor, weights: torch.Tensor,
                   penalty: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        from bigtrain.rollout.advantages import combine_rewards, group_advantages
        advantages, std_zero = group_advantages(combine_rewards(scores, weights), self.group,
                                                self.settings.scale_rewards)
        return advantages, std_zero, {}

    def piece_loss(self, policy: Policy, piece: Piece, step: StepState) -> torch.Tensor:
        from bigtrain.objectives.loss_types import aggregate
        from bigtrain.rollout.losses import GRPOLoss, grpo_terms, loss_sums, masked_sum
        s, mask, loss = self.settings, piece.completion_mask, GRPOLoss.of(self.settings)
        logps, entropies = self.logps(policy, piece, step)
        terms = grpo_terms(logps, piece.old_logps, piece.advantages, mask, loss, ref_logps=piece.ref_logps,
                           entropies=entropies)
        add_sums(step, loss_sums(terms, piece.advantages, mask, loss))
        if terms.kl is not None:
            add_sums(step, {"kl": masked_sum(terms.kl, mask)})
        return aggregate(terms.per_token, mask, s.loss_type, step_micro_batches=step.micro_batches,
                         step_tokens=step.step_tokens, max_completion_length=s.max_completion_length)


class RLOO(RewardedObjective):
    Settings = RLOOSettings
    summary = ("online RL: completions scored by your rewards less a KL penalty, leave-one-out advantages, a "
               "clipped sequence ratio (TRL's RLOO)")
    uses_old_logps = True  # the sequence ratio and the KL penalty read them

    @property
    def uses_reference(self) -> bool:
        return self.settings.beta > 0

    def penalty(self, pieces: list[Piece]) -> torch.Tensor:
        """Each completion's summed k1 KL (log pi_old - log pi_ref per token); its token mean is the kl metric."""
        import torch

        from bigtrain.rollout.metrics import reduce_sums
        if not self.uses_reference:
            return super().penalty(pieces)
        per_piece = torch.cat([((p.old_logps - p.ref_logps) * p.completion_mask).sum(-1) for p in pieces])
        kl = torch.empty_like(per_piece)
        kl[torch.cat([p.index for p in pieces]).to(kl.device)] = per_piece  # the rollout's order
        tokens = sum(p.completion_mask.sum() for p in pieces).to(kl.dtype)
        self.kl_metric = reduce_sums({"kl": (kl.sum(), tokens)})
        return kl

    def advantages(self, scores: torch.Tensor, weights: torch.Tensor,
                   penalty: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        from bigtrain.rollout.advantages import combine_rewards, rloo_advantages
        rewards = combine_rewards(scores, weights) - self.settings.beta * penalty
        advantages, std_zero = rloo_advantages(rewards, self.group, self.settings.normalize_advantages)
        extra = dict(self.kl_metric) if self.uses_reference else {}
        return advantages, std_zero.repeat_interleave(self.group), extra

    def piece_loss(self, policy: Policy, piece: Piece, step: StepState) -> torch.Tensor:
        from bigtrain.rollout.losses import clip_sums, rloo_terms
        s, mask = self.settings, piece.completion_mask
        logps, _ = self.logps(policy, piece, step)
        per_sequence, ratio = rloo_terms(logps, (piece.old_logps * mask).sum(-1), piece.advantages, mask,
                                         epsilon_low=s.epsilon, epsilon_high=s.epsilon_high)
        add_sums(step, clip_sums(ratio, piece.advantages, mask, s.epsilon, s.epsilon_high))
        return per_sequence.mean() / step.micro_batches


def _reward_model(policy: Policy) -> tuple[str, Any, float, str]:
    """(name, function, weight, spec) of objective.reward_model: the frozen model beside the policy, with the
    tokenizer of its own directory."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from bigtrain.rollout.reward_model import RewardModel
    frozen = policy.frozen(REWARD_MODEL.setting)
    try:
        tokenizer = AutoTokenizer.from_pretrained(frozen.directory)
    except (OSError, ValueError) as e:
        raise ValueError(f"objective.reward_model={frozen.directory}: no tokenizer there ({str(e).splitlines()[0]}); "
                         "a reward model directory holds its tokenizer (objective.kind=reward exports one)") from None
    name = Path(frozen.directory).name
    return name, RewardModel(frozen.ds, tokenizer, name), 1.0, str(frozen.directory)


def _reward_model_elsewhere(directory: Any) -> Any:
    raise ValueError(f"objective.rewards {str(directory)!r} is a model directory: give it as "
                     f"objective.reward_model={directory} (held frozen beside the policy, partitioned like it under "
                     "ZeRO-3)")
