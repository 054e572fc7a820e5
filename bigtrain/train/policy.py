"""The stepper's side of the objective seam: `PolicyModel` is the `bigtrain.objectives.base.Policy` an objective is
handed, over the assembled DeepSpeed engine (`bigtrain.train.assemble`). It owns how the model's own loss is
computed (plain from the logits, inside the module's forward when compiled or chunked, over a sequence-parallel
group's slices; a mixture of experts' router term added), the token weighting of chat data, answer
log-probabilities, and the frozen models beside the policy. The objective sees none of the engine's parts.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bigtrain.models.losses import answer_logps, correct_counts, target_count
from bigtrain.models.spec import ModelSpec, call_module, output_logits
from bigtrain.objectives.base import Metrics
from bigtrain.train import fast_path


class PolicyModel:
    """What an objective may ask of the model it trains (see `bigtrain.objectives.base.Policy`)."""

    def __init__(self, parts: Any, spec: ModelSpec, device: str, float_dtype: torch.dtype, token_weighted: bool,
                 tokenizer: Any = None, seed: int = 0):
        from bigtrain.models.hf_common import router_aux_coef
        self.ds, self.split, self.loss_in_forward = parts.ds, parts.split, parts.loss_in_forward
        self.reference, self.frozen_models = parts.reference, parts.frozen
        self.spec, self.device, self.float_dtype = spec, device, float_dtype
        self.token_weighted, self.tokenizer, self.seed = token_weighted, tokenizer, seed
        self.router_coef = router_aux_coef(getattr(spec, "config", None)) or 0.0
        self.gather: bool | None = None  # generation's ZeRO-3 rule, decided at the start (every rank alike)

    def inputs(self, rows: dict) -> tuple[Any, torch.Tensor]:
        inputs, labels = self.spec.batch_to_inputs(rows)
        return self.to_device(inputs), labels.to(self.device)

    def to_device(self, value: Any) -> Any:
        return to_device(value, self.device, self.float_dtype)

    def logits(self, inputs: Any) -> torch.Tensor:
        return output_logits(call_module(self.ds, inputs))

    def sequence_slice(self, inputs: Any, labels: torch.Tensor) -> tuple[Any, torch.Tensor]:
        if self.split is None or not self.split.sequence_parallel:
            return inputs, labels
        inputs, targets = self.split.shard(inputs, labels)
        return inputs, F.pad(targets, (1, 0), value=-100)  # lm_targets of these are `targets` themselves

    def forward_with_loss(self, inputs: Any, labels: torch.Tensor,
                          scale: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
        metrics: Metrics = {}
        split = self.split
        if split is not None and split.sequence_parallel and self.loss_in_forward:
            # the chunked loss over this rank's slice (`sequence_slice`): no [tokens, vocabulary] logits (ALST's
            # tiled logits)
            loss = split.share(fast_path.call_with_loss(self.ds, inputs, labels, "sum"), labels[..., 1:], scale)
        elif split is not None and split.sequence_parallel:
            output = call_module(self.ds, inputs)
            loss = split.loss(output_logits(output), labels[..., 1:], scale)
            if getattr(output, "aux_loss", None) is not None:  # a mixture of experts' router loss
                loss = loss + self.router_coef * output.aux_loss
                metrics["router_aux_loss"] = output.aux_loss.detach()
        elif self.loss_in_forward:
            loss = weigh(fast_path.call_with_loss(self.ds, inputs, labels), labels, scale)
        else:
            output = call_module(self.ds, inputs)
            aux = getattr(output, "aux_loss", None)
            loss = weigh(self.spec.loss(output, labels), labels, scale, None if aux is None else self.router_coef * aux)
            if aux is not None:
                metrics["router_aux_loss"] = aux.detach()
        return loss, metrics

    def eval_with_loss(self, inputs: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """Token-weighted data: each batch weighs by its trained tokens, as in training. Classifiers also count
        correct predictions (`correct` / `predictions`: the stepper sums them into an accuracy)."""
        weight = (target_count(labels).to(torch.float64) if self.token_weighted
                  else torch.ones((), dtype=torch.float64, device=self.device))
        metrics: Metrics = {}
        accuracy = self.spec.eval_metric == "accuracy"
        if self.loss_in_forward and not accuracy:  # chunked: no full logits in eval either
            loss = fast_path.call_with_loss(self.ds, inputs, labels)
        else:
            output = call_module(self.ds, inputs)
            loss = self.spec.loss(output, labels)
            if accuracy:
                correct, seen = correct_counts(output_logits(output), labels)
                metrics.update(correct=correct, predictions=seen)
        return loss, weight, metrics

    def token_scale(self, labels: list[torch.Tensor]) -> torch.Tensor | None:
        """For a step whose loss is the mean over all its trained tokens (as transformers' Trainer does with
        `num_items_in_batch`): the factor that turns a micro-batch's summed token loss into its share of that
        mean. DeepSpeed divides gradients by the accumulation steps and by the ranks that hold different tokens
        (world / tensor; where it sums a sequence group's gradients instead, the group's share says so:
        `ModelSplit.sequence_summed`); the step's tokens are the count over all ranks / tensor, the ranks of a
        tensor group each counting the same samples (a sequence group's ranks count their own slices:
        `sequence_slice`). Without it each micro-batch's mean weighs alike: one of short answers as much as one of
        long ones, and another grouping of the same samples trains differently."""
        if not self.token_weighted:
            return None
        count = torch.stack([target_count(t) for t in labels]).sum().to(torch.float64).reshape(1)
        world = 1
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(count)
            world = torch.distributed.get_world_size()
        return self.ds.gradient_accumulation_steps() * world / count[0].clamp(min=1)

    def answer_logps(self, inputs: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return answer_logps(self.logits(inputs), labels)

    def reference_logps(self, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        assert self.reference is not None, "the objective was built without a reference (objective.reference)"
        return self.reference.logps(self.ds, inputs, labels)

    def completion_logits(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                          completion_mask: torch.Tensor, pixels: Any = None) -> torch.Tensor:
        from bigtrain.rollout.forward import completion_logits
        return completion_logits(self.ds, prompt_ids, prompt_mask, completion_ids, completion_mask, pixels)

    def reference_completion_logits(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                                    completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                                    pixels: Any = None) -> torch.Tensor:
        assert self.reference is not None, "the objective was built without a reference (objective.reference)"
        rows = (prompt_ids, prompt_mask, completion_ids, completion_mask) + (() if pixels is None else (pixels,))
        return self.reference.completion_logits_beside(self.ds, *rows)

    def frozen(self, setting: str) -> Any:
        assert setting in self.frozen_models, f"no frozen model was built for objective.{setting}"
        return self.frozen_models[setting]

    def choose_gather(self, setting: str | bool) -> str:
        """objective.ds3_gather_for_generation decided for this run (auto: where the weights fit one device, a
        collective at ZeRO-3; every rank calls it), and the start line's words for it ('' below ZeRO-3)."""
        from bigtrain.rollout.generate import gather_choice
        self.gather, said = gather_choice(self.ds, setting)
        return said

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Any, rng: Any, *,
                 gather: bool | None = None, logps: bool = False, pixels: Any = None) -> Any:
        """One generation round on the engine's own module (`bigtrain.rollout.generate`: every rank calls it together;
        eval mode for the round; `gather` the ZeRO-3 weights once instead of at every decode step; None: as
        `choose_gather` decided auto, at the first round if nothing asked before)."""
        from bigtrain.rollout.generate import generate
        if gather is None:
            if self.gather is None:
                self.choose_gather("auto")
            gather = self.gather
        return generate(self.ds, self.tokenizer, prompt_ids, prompt_mask, sampling, rng, gather=gather, logps=logps,
                        pixels=pixels)

    def stop_ids(self) -> list[int]:
        """The ids a completion ends at (`bigtrain.rollout.generate.stop_ids`)."""
        from bigtrain.rollout.generate import stop_ids
        return stop_ids(getattr(self.ds, "module", self.ds), self.tokenizer)

def weigh(mean: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | None,
          router: torch.Tensor | None = None) -> torch.Tensor:
    """A micro-batch's mean token loss (plus `router`, a mixture of experts' router term, already in it) as
    its share of the step's token mean; unchanged without `scale`. The router term keeps its weight."""
    if scale is None:
        return mean
    weight = (target_count(labels) * scale).to(mean.dtype)  # exactly 1 when every micro-batch counts alike
    if router is None:
        return mean * weight
    return (mean - router) * weight + router


def to_device(value: Any, device: str, float_dtype: torch.dtype | None = None) -> Any:
    """A batch's tensors (in dicts, tuples, lists) on `device`; floating ones (images) in `float_dtype` if given."""
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(float_dtype) if float_dtype is not None and value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device, float_dtype) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device, float_dtype) for k, v in value.items()}
    return value
