"""`objective.kind: lm`: the model's own loss, the way pretraining and supervised fine-tuning train.

For a causal LM the next-token cross-entropy: computed from the logits (plain), inside the module's forward
(chunked or compiled, `bigtrain.train.fast_path`), or over a sequence-parallel group's slices
(`bigtrain.parallel.split`); a mixture of experts adds its router's load-balancing term (reported on its own as
`router_aux_loss`). On chat and instruction data a step is the mean over all its answer tokens (token-weighted).
For a classifier its cross-entropy (and accuracy in evaluation, by the stepper).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bigtrain.models.losses import target_count
from bigtrain.models.spec import call_module, output_logits
from bigtrain.objectives.base import Metrics, Objective


class ModelLoss(Objective):
    kind = "lm"
    metric_names = ("router_aux_loss",)

    def begin_step(self, engine: Any, micro: list[Any]) -> torch.Tensor | None:
        return token_scale(engine, [labels for _, labels in micro]) if engine.token_weighted else None

    def micro_loss(self, engine: Any, item: Any, scale: torch.Tensor | None) -> tuple[torch.Tensor, Metrics]:
        inputs, labels = item
        metrics: Metrics = {}
        split = engine.split
        if split is not None and split.sequence_parallel and engine.loss_in_forward:
            # the chunked loss over this rank's slice: no [tokens, vocabulary] logits (ALST's tiled logits)
            inputs, targets = split.shard(inputs, labels)
            labels_before = F.pad(targets, (1, 0), value=-100)  # lm_targets of these are `targets` themselves
            loss = split.share(engine.forward_with_loss(inputs, labels_before, reduction="sum"), targets, scale)
        elif split is not None and split.sequence_parallel:
            inputs, targets = split.shard(inputs, labels)
            output = call_module(engine.ds, inputs)
            loss = split.loss(output_logits(output), targets, scale)
            if getattr(output, "aux_loss", None) is not None:  # a mixture of experts' router loss
                loss = loss + engine.router_coef * output.aux_loss
                metrics["router_aux_loss"] = output.aux_loss.detach()
        elif engine.loss_in_forward:
            loss = weigh(engine.forward_with_loss(inputs, labels), labels, scale)
        else:
            output = call_module(engine.ds, inputs)
            aux = getattr(output, "aux_loss", None)
            loss = weigh(engine.spec.loss(output, labels), labels, scale,
                         None if aux is None else engine.router_coef * aux)
            if aux is not None:
                metrics["router_aux_loss"] = aux.detach()
        return loss, metrics

    def eval_loss(self, engine: Any, item: Any) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """Token-weighted data: each batch weighs by its trained tokens, as in training. Classifiers also count
        correct predictions (`correct` / `predictions`: the stepper sums them into an accuracy)."""
        from bigtrain.models.losses import correct_counts
        inputs, labels = item
        weight = (target_count(labels).to(torch.float64) if engine.token_weighted
                  else torch.ones((), dtype=torch.float64, device=engine.device))
        metrics: Metrics = {}
        accuracy = engine.spec.eval_metric == "accuracy"
        if engine.loss_in_forward and not accuracy:  # chunked: no full logits in eval either
            loss = engine.forward_with_loss(inputs, labels)
        else:
            output = call_module(engine.ds, inputs)
            loss = engine.spec.loss(output, labels)
            if accuracy:
                correct, seen = correct_counts(output_logits(output), labels)
                metrics.update(correct=correct, predictions=seen)
        return loss, weight, metrics


def token_scale(engine: Any, labels: list[torch.Tensor]) -> torch.Tensor:
    """For a step whose loss is the mean over all its trained tokens (as transformers' Trainer does with
    `num_items_in_batch`): the factor that turns a micro-batch's summed token loss into its share of that
    mean. DeepSpeed divides gradients by the accumulation steps and by the ranks that hold different tokens
    (world / tensor); the step's tokens are the count over all ranks / (tensor x sequence), the ranks of one
    group each counting the same samples. Without it each micro-batch's mean weighs alike: one of short
    answers as much as one of long ones, and another grouping of the same samples trains differently."""
    count = torch.stack([target_count(t) for t in labels]).sum().to(torch.float64).reshape(1)
    world = 1
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(count)
        world = torch.distributed.get_world_size()
    return engine.grad_accum * world * engine.split.topology.sequence / count[0].clamp(min=1)


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
