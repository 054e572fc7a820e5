"""On-policy distillation (objective.kind=distill): the student (the policy) samples completions through the same
round as GRPO (online.py), a frozen teacher scores every token of them, and the loss is the generalized
Jensen-Shannon divergence between the two next-token distributions on the completion's tokens, as TRL 1.16's
DistillationTrainer (and GKD, Agarwal et al. 2024) computes it, through DeepSpeed's
`runtime.rollout.opsd.generalized_jsd_loss` (bigtrain.rollout.losses.distill_share).

    objective.beta   0: forward KL(teacher || student); 1: reverse KL(student || teacher), TRL's default; 0.5 the JSD
    objective.lmbda  the share of steps on the student's own completions (TRL's DistillationTrainer: 1, always; GKD:
                     0.5); the other steps train on the records' answers (`completion` of prompt-completion records,
                     text or assistant messages), cut to objective.max_completion_length

Which steps sample is drawn from (train.seed, the step's number) alone: the same on every rank (at ZeRO-3 every
rank must generate together), and the same after a resume (the steps taken are in the checkpoint).

The teacher is a Hugging Face directory (objective.teacher) built beside the policy as a frozen model
(`FrozenModel("teacher")`: partitioned like the policy under ZeRO-3). It must share the student's tokenizer (the
two distributions are compared token id by token id): a teacher whose tokenizer, or whose output width, differs is
one line naming both, before the first round.

A step's loss is the divergence summed over every completion token of the step, on every rank, divided by their
count (TRL's num_items_in_batch); an evaluation round (held-out prompts, sampled from the evaluation stream) gives
its token mean. Metrics: entropy (the student's), teacher_agreement (the share of completion tokens where the
student's likeliest token is the teacher's), on_policy (1 for a sampled step, 0 for one on the records' answers),
completions/*, and time/generation|teacher|policy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bigtrain.fields import doc
from bigtrain.objectives.base import FineTuning, FrozenModel, Metrics, Needs, Policy
from bigtrain.objectives.generation_settings import GROUP_DOC, GenerationSettings
from bigtrain.objectives.online import OnlineObjective
from bigtrain.objectives.round_pieces import Piece, StepState, add_sums

if TYPE_CHECKING:
    import torch

TEACHER = FrozenModel("teacher")


@dataclass(kw_only=True)
class DistillSettings(GenerationSettings):
    num_generations: int = doc(1, GROUP_DOC)
    teacher: str | None = doc(None, "distill: the teacher's Hugging Face directory (its model and the student's "
                                    "tokenizer), held frozen beside the student and partitioned like it under "
                                    "ZeRO-3.")
    beta: float = doc(1.0, "distill: the generalized Jensen-Shannon divergence's interpolation: 0 forward KL "
                           "(teacher || student), 1 reverse KL (student || teacher), 0.5 the JSD.")
    lmbda: float = doc(1.0, "distill: the share of steps trained on the student's own completions; the others "
                            "train on the records' answers (their 'completion'). 1: TRL's DistillationTrainer "
                            "(always on-policy); GKD's default is 0.5.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.teacher is None:
            raise ValueError("objective.teacher: on-policy distillation needs a teacher: set objective.teacher=DIR "
                             "(a Hugging Face model directory that shares the student's tokenizer)")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"objective.beta={self.beta}: distillation's beta must be in [0, 1] (0 forward KL, 1 "
                             "reverse KL)")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"objective.lmbda={self.lmbda}: must be in [0, 1] (the share of on-policy steps)")


class Distill(OnlineObjective):
    Settings = DistillSettings
    fine_tuning = FineTuning(lr=1e-6)  # TRL's DistillationConfig; with LoRA 1e-5 (TRL's PEFT guide)
    summary = ("on-policy distillation: the student's completions scored token by token by a frozen teacher, the "
               "generalized Jensen-Shannon divergence (TRL's DistillationTrainer, GKD)")

    @classmethod
    def declare(cls, settings: Any) -> Needs:
        return cls.online_needs(settings, False, (TEACHER,))

    def __init__(self, kind: str, settings: Any = None, reference: str = "none"):
        super().__init__(kind, settings, reference)
        self.checked = False  # the teacher's tokenizer against the student's, once
        self.on_policy = True  # this round's completions are the student's own
        self.renderer: Any = None  # the records' answers as tokens (off-policy steps)

    # -- the round -------------------------------------------------------------------------------------------------

    def round(self, policy: Policy, batch: dict, pieces: int, rng: Any, shuffle: bool = False) -> list[Piece]:
        if not self.checked:
            check_teacher(policy, policy.frozen(TEACHER.setting).directory)
            self.checked = True
        evaluation = rng is self.eval_rng
        self.on_policy = evaluation or sampled_step(policy.seed, self.steps_done, self.settings.lmbda)
        return super().round(policy, batch, pieces, rng, shuffle)

    def completions(self, policy: Policy, batch: dict, rng: Any) -> Any:
        if self.on_policy:
            return super().completions(policy, batch, rng)
        return self.record_answers(policy, batch)

    def record_answers(self, policy: Policy, batch: dict) -> Any:
        """The records' own answers after their prompts as served (left-padded, cut as the data cut them), each
        repeated num_generations times as a group of samples would be; an answer longer than
        max_completion_length cut (marked truncated)."""
        import torch

        from bigtrain.data.prompts import PromptRenderer
        from bigtrain.rollout.generate import Rollout
        if self.renderer is None:
            self.renderer = PromptRenderer(policy.tokenizer)
        width, n = self.settings.max_completion_length, self.group
        answers = []
        for record in batch["records"]:
            try:
                ids, mask = self.renderer.answer(record)
            except ValueError as e:
                raise ValueError(f"objective.lmbda={self.settings.lmbda} trains {1 - self.settings.lmbda:.0%} of "
                                 f"the steps on the records' answers: {e}; or set objective.lmbda=1 (on-policy "
                                 "only)") from None
            answers.append((ids[:width], mask[:width], len(ids) > width))
        longest = max(1, max(len(ids) for ids, _, _ in answers))
        pad = policy.tokenizer.pad_token_id if policy.tokenizer.pad_token_id is not None else \
            policy.tokenizer.eos_token_id
        ids = torch.full((len(answers), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(answers), longest), dtype=torch.long)
        for row, (tokens, trained, _) in enumerate(answers):
            ids[row, :len(tokens)], mask[row, :len(tokens)] = torch.tensor(tokens), torch.tensor(trained)
        cut = torch.tensor([c for _, _, c in answers])
        device = batch["prompt_ids"].device
        return Rollout(batch["prompt_ids"].repeat_interleave(n, 0), batch["prompt_mask"].repeat_interleave(n, 0),
                       ids.repeat_interleave(n, 0).to(device), mask.repeat_interleave(n, 0).to(device),
                       cut.repeat_interleave(n, 0).to(device))

    def score_round(self, policy: Policy, batch: dict, rollout: Any, pieces: list[Piece]) -> Metrics:
        """No rewards: the teacher scores each token in the loss. The round's table and whether it sampled."""
        texts = policy.tokenizer.batch_decode(rollout.completion_lists(), skip_special_tokens=True)
        records = [r for r in batch["records"] for _ in range(self.group)]
        self.table = [{"prompt": p if isinstance(p, str) else (p[-1].get("content", "") if p else ""),
                       "completion": t, "on_policy": self.on_policy}
                      for p, t in zip((r.get("prompt") for r in records), texts)]
        return {"on_policy": float(self.on_policy)}

    # -- the loss --------------------------------------------------------------------------------------------------

    def piece_loss(self, policy: Policy, piece: Piece, step: StepState) -> torch.Tensor:
        from bigtrain.rollout.losses import distill_share
        student, teacher, mask = self.logits(policy, piece, step)
        return distill_share(student, teacher, mask, beta=self.settings.beta, temperature=self.settings.temperature,
                             step_tokens=step.step_tokens)

    def logits(self, policy: Policy, piece: Piece,
               step: StepState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The student's logits on the piece's completion (with their graph), the teacher's (without; its seconds
        kept as time/teacher), the mask; the entropy and agreement metrics added to the step's."""
        import torch

        from bigtrain.objectives.round_pieces import Clock
        from bigtrain.rollout.losses import masked_sum, token_entropy
        clock = Clock(policy.device)
        with torch.no_grad():
            teacher = policy.frozen(TEACHER.setting).completion_logits(*piece.rows)
        self.teacher_s += clock.lap()
        student = policy.completion_logits(*piece.rows)
        if teacher.shape[-1] != student.shape[-1]:
            raise ValueError(f"objective.teacher={policy.frozen(TEACHER.setting).directory}: its output has "
                             f"{teacher.shape[-1]} token scores and the student's {student.shape[-1]}: distillation "
                             "compares them token id by token id; give a teacher with the student's vocabulary")
        mask = piece.completion_mask
        agree = (student.detach().argmax(-1) == teacher.argmax(-1)).to(torch.float32)
        add_sums(step, {"entropy": masked_sum(token_entropy(student, self.settings.temperature), mask),
                        "teacher_agreement": masked_sum(agree, mask)})
        return student, teacher, mask

    def begin_step(self, policy: Policy, micro: list[Piece]) -> StepState:
        self.teacher_s = 0.0
        return super().begin_step(policy, micro)

    def end_step(self, policy: Policy, step: StepState) -> Metrics:
        metrics = super().end_step(policy, step)
        for part in ("reference", "rewards"):  # distillation has neither
            metrics.pop(f"time/{part}", None)
        metrics["time/teacher"] = self.teacher_s
        metrics["time/policy"] -= self.teacher_s
        return metrics

    def eval_loss(self, policy: Policy, item: dict) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """The divergence's token mean on a round of held-out prompts (sampled from the evaluation stream), weighed
        by its tokens in the evaluation's mean over batches and ranks."""
        import torch

        from bigtrain.objectives.round_pieces import reduce_sums_local
        from bigtrain.rollout.losses import distill_share
        self.streams(policy)
        saved = self.times, self.table, self.round_metrics, self.on_policy
        with torch.no_grad():
            self.times = {}
            (piece,) = self.round(policy, item, 1, self.eval_rng)
            step = StepState(piece.completion_mask.sum().to(torch.float64), 1, 0.0)
            self.teacher_s = 0.0
            student, teacher, mask = self.logits(policy, piece, step)
            loss = distill_share(student, teacher, mask, beta=self.settings.beta,
                                 temperature=self.settings.temperature, step_tokens=step.step_tokens)
        metrics = {**self.round_metrics, **reduce_sums_local(step.sums)}
        self.times, self.table, self.round_metrics, self.on_policy = saved
        weight = mask.sum().to(torch.float64)
        return loss, weight, {k: torch.as_tensor(v, dtype=torch.float64, device=loss.device)
                              for k, v in metrics.items()}

    def flops_factor(self) -> float:
        """The policy's 6N a token, and generation's forward (2N, a third) on the share of steps that sample; the
        teacher's forward (2 x its parameters a token) is not counted, as a reward model's is not."""
        return 1.0 + self.settings.lmbda / 3


def sampled_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step `step` (0-based) trains on the student's own completions: a draw from (seed, step)
    alone, so every rank and a resumed run decide alike."""
    if lmbda >= 1.0:
        return True
    import numpy as np
    return bool(np.random.default_rng([seed, step, 0x6B64]).random() < lmbda)


def check_teacher(policy: Policy, directory: Any) -> None:
    """One line when the teacher's tokenizer is not the student's (its directory's, where it has one: the vocabulary,
    token by token)."""
    from transformers import AutoTokenizer
    student = policy.tokenizer
    try:
        teacher = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError):
        return  # a directory without a tokenizer: its output width is checked at the first loss
    if teacher.get_vocab() != student.get_vocab():
        raise ValueError(f"objective.teacher={directory}: the teacher's tokenizer ({_describe(teacher)}) is not the "
                         f"student's ({_describe(student)}): distillation compares the two models' next-token "
                         "distributions token id by token id, so they need one tokenizer; give a teacher trained "
                         "with the student's tokenizer")


def _describe(tokenizer: Any) -> str:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return f"{name}, {len(tokenizer)} tokens"
