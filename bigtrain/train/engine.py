"""The stepper: one training step and one evaluation over a DeepSpeed engine (`bigtrain.train.assemble` builds
it), the same way for a plain module and for pipeline stages. Every step goes through the objective
(`bigtrain.objectives`), which the stepper knows by its methods alone and hands a `PolicyModel`
(`bigtrain.train.policy`), never the engine: on a plain module the objective's loss of each micro-batch is
stepped; on pipeline stages the objective turns each batch into the model's inputs and the last stage computes the
model's own loss (an objective that refuses pipelines, `Needs.refuses`, never gets here: the run config refuses it).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from deepspeed.accelerator import get_accelerator

from bigtrain.distributed.world import sum_over_ranks
from bigtrain.models.losses import correct_counts
from bigtrain.models.spec import ModelSpec, pipeline_inputs
from bigtrain.objectives import Objective, default_objective
from bigtrain.train.assemble import EngineOptions, assemble
from bigtrain.train.policy import PolicyModel

__all__ = ["Engine", "EngineOptions"]


class Engine:
    """One training step / one eval step over the assembled DeepSpeed engine."""

    def __init__(self, spec: ModelSpec, ds_config: dict, options: EngineOptions, objective: Objective | None = None,
                 tokenizer: Any = None):
        self.spec = spec
        self.objective = objective or default_objective()
        self.is_pipeline = options.pipeline_stages > 1
        self.step_metrics: dict[str, torch.Tensor] = {}  # the last step's, averaged over its micro-batches
        parts = assemble(spec, ds_config, options, self.objective)
        self.ds, self.optimizer, self.scheduler = parts.ds, parts.optimizer, parts.scheduler
        self.split, self.lora = parts.split, parts.lora
        start_schedule(self.scheduler)
        self.device = get_accelerator().current_device_name()
        # DeepSpeed's pipeline engine takes the micro-batches' losses itself: there each one's mean counts alike
        self.policy = PolicyModel(parts, spec, self.device, float_dtype_of(ds_config),
                                  token_weighted=options.token_weighted and not self.is_pipeline, tokenizer=tokenizer,
                                  seed=options.seed)

    # -- topology -------------------------------------------------------------------------------

    @property
    def dp_rank(self) -> int:
        """This rank's data shard: every rank of a tensor or sequence group reads the same samples."""
        if self.is_pipeline:
            return self.ds.mpu.get_data_parallel_rank()
        return self.split.data_rank

    @property
    def dp_size(self) -> int:
        if self.is_pipeline:
            return self.ds.mpu.get_data_parallel_world_size()
        return self.split.data_size

    @property
    def micro_batch(self) -> int:
        return self.ds.train_micro_batch_size_per_gpu()

    @property
    def grad_accum(self) -> int:
        return self.ds.gradient_accumulation_steps()

    @property
    def data_batch(self) -> int:
        """Records per batch the training data serves (the objective's: a micro-batch's samples by default)."""
        return self.objective.data_batch(self.micro_batch, self.grad_accum)

    @property
    def step_batches(self) -> int:
        """The data's batches of one step whose rows it may regroup by length (the objective's say; 1: none)."""
        return self.objective.step_batches(self.grad_accum)

    @property
    def eval_data_batch(self) -> int:
        """Records per held-out batch."""
        return self.objective.eval_data_batch(self.micro_batch)

    def lr(self) -> float:
        """The learning rate the next optimizer step applies."""
        return float(self.optimizer.param_groups[0]["lr"])

    def weights_finite(self) -> bool:
        """Whether every weight is finite on every rank (a collective; each rank looks at what it holds:
        its ZeRO-3 partition, its pipeline stage)."""
        finite = True
        for param in self.ds.module.parameters():
            held = getattr(param, "ds_tensor", None)
            held = param.data if held is None else held
            if held.numel() and not bool(torch.isfinite(held).all()):
                finite = False
                break
        flag = torch.tensor([1.0 if finite else 0.0], device=self.device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    # -- steps ---------------------------------------------------------------------------------

    def train_step(self, batches: Iterator[dict]) -> torch.Tensor:
        """One optimizer step over `grad_accum` micro-batches. Returns this rank's mean loss as a scalar on the
        device, not yet read; the objective's metrics of the step are in `step_metrics` (`reduce_step` averages
        both over the ranks in one collective)."""
        if not self.ds.module.training:  # module.train() walks every submodule: only after eval
            self.ds.train()
        if self.is_pipeline:  # train_batch already averages over data-parallel ranks, on every stage
            loss = self.ds.train_batch(self._pipeline_items(batches))
            self.step_metrics = self._grad_norm_metric(None)
            return loss
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, torch.Tensor] = {}
        micro = self.objective.read_step(self.policy, batches, self.grad_accum)
        assert len(micro) == self.grad_accum, (len(micro), self.grad_accum)  # DeepSpeed steps at the last one
        shared = self.objective.begin_step(self.policy, micro)
        own_norm = None
        for i, item in enumerate(micro):
            with same_batch_in_tensor_group():
                loss, metrics = self.objective.micro_loss(self.policy, item, shared)
            self.ds.backward(loss)
            if i == len(micro) - 1:
                own_norm = self._unreported_grad_norm()
            self.ds.step()
            total += loss.detach()  # stays on the device: no host sync per micro-batch
            for name, value in metrics.items():
                sums[name] = value.to(torch.float64) + sums.get(name, 0)
        self.step_metrics = {name: value / self.grad_accum for name, value in sums.items()}
        self.step_metrics.update(self.objective.end_step(self.policy, shared))
        self.step_metrics.update(self._grad_norm_metric(own_norm))
        return total / self.grad_accum

    def _unreported_grad_norm(self) -> torch.Tensor | None:
        """The gradient norm of a step whose optimizer DeepSpeed does not ask for one (ZeRO-0 without mixed
        precision clips with a norm it drops), measured after the step's last backward, before the step clips:
        the gradients are whole and averaged over the data-parallel ranks by then."""
        if self.ds.zero_optimization_stage() > 0 or self.ds.bfloat16_enabled() or self.ds.fp16_enabled():
            return None
        from deepspeed.runtime.utils import get_global_norm_of_tensors
        grads = [p.grad for p in self.ds.module.parameters() if p.grad is not None]
        return get_global_norm_of_tensors(grads, mpu=self.ds.mpu) if grads else None

    def _grad_norm_metric(self, own: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """{"grad_norm": the step's gradient norm before clipping} (the HF Trainer's and TRL's metric), where known."""
        norm = self.ds.get_global_grad_norm()
        norm = own if norm is None else norm
        if norm is None:
            return {}
        return {"grad_norm": torch.as_tensor(norm, dtype=torch.float64, device=self.device).reshape(())}

    @torch.no_grad()
    def eval_loss(self, batches: list[dict]) -> float:
        """Mean loss over `batches` (the same count on every rank), averaged over data-parallel ranks, each batch
        weighed as the objective says (its trained tokens for token-weighted data). The objective's metrics go to
        `last_eval_metrics`; classifiers also set `last_eval_accuracy`: correct predictions over all ranks'
        samples."""
        self.ds.eval()
        if self.is_pipeline:
            return self._pipeline_eval(batches)
        sums: dict[str, Any] = {"loss x weight": 0.0, "weight": 0.0}
        metric_sums: dict[str, Any] = {}
        for batch in batches:
            loss, weight, metrics = self.objective.eval_loss(self.policy, self.objective.inputs(self.policy, batch))
            sums["loss x weight"] += loss.detach().to(torch.float64) * weight
            sums["weight"] += weight
            for name, value in metrics.items():
                metric_sums[name] = value.to(torch.float64) + metric_sums.get(name, 0)
        total = sum_over_ranks({**metric_sums, **sums}, self.device)
        if "predictions" in total:  # a classifier's counts
            seen = total.pop("predictions")
            self.last_eval_accuracy = total.pop("correct") / seen if seen else float("nan")
        loss_x_weight, weight = total.pop("loss x weight"), total.pop("weight")
        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.last_eval_metrics = {n: v / (ranks * max(len(batches), 1)) for n, v in total.items()}
        return loss_x_weight / weight if weight else float("nan")

    def _pipeline_eval(self, batches: list[dict]) -> float:
        """eval_batch averages over data-parallel ranks and broadcasts to all stages; the last stage holds the
        logits (a classifier's accuracy)."""
        accuracy = self.spec.eval_metric == "accuracy"
        counts = torch.zeros(2, dtype=torch.float64, device=self.device)  # correct, predictions
        it = self._pipeline_items(iter(batches))
        losses = []
        for batch in batches:
            out = self.ds.eval_batch(it, num_micro_batches=1, return_logits=accuracy)
            loss, logits = out if accuracy else (out, None)
            losses.append(float(loss.item()))
            if logits is not None and self.ds.is_last_stage():
                counts += correct_counts(logits, self.objective.inputs(self.policy, batch)[1])
        if accuracy:
            torch.distributed.all_reduce(counts)
            self.last_eval_accuracy = float(counts[0] / counts[1]) if counts[1] else float("nan")
        self.last_eval_metrics = {}
        return sum(losses) / max(len(losses), 1)

    def _pipeline_items(self, batches: Iterator[dict]) -> Iterator[tuple]:
        """The objective's inputs of each batch, in the pipeline's form (pulled as the schedule asks)."""
        for batch in batches:
            inputs, labels = self.objective.inputs(self.policy, batch)
            yield pipeline_inputs(inputs), labels

    # -- parameters ---------------------------------------------------------------------------

    def module(self) -> torch.nn.Module:
        return self.ds.module


@contextlib.contextmanager
def same_batch_in_tensor_group() -> Iterator[None]:
    """DeepSpeed checks that the ranks of a tensor-parallel group got the same first batch, with an assertion
    deep in a forward hook; a data pipeline that feeds them different samples gets one line instead."""
    try:
        yield
    except AssertionError as err:
        if "Data inconsistency within the TP group" not in str(err):
            raise
        raise ValueError("the ranks of a tensor-parallel group were given different batches: every rank of a "
                         "parallel.tensor group must read the same samples (bigtrain shards data over the "
                         "data-parallel ranks only); a custom data pipeline must do the same") from None


def start_schedule(scheduler: Any) -> None:
    """Set the optimizer's rate to the schedule's first one before step 1, and after a resume to the one the
    restored schedule is at.

    DeepSpeed's schedulers (WarmupLR, WarmupCosineLR, ...) start at iteration -1, where WarmupCosineLR gives a
    rate of 0, and the engine steps them after each optimizer step: step 1 would apply no update at all. One
    step here puts iteration 0's rate in place, so step k trains at iteration k-1's rate, as the schedule
    promises; the checkpointed iteration is then the next step's, and `step(last_batch_iteration)` after a
    load sets exactly that rate again (the rate itself is not in every checkpoint: universal ones drop it)."""
    iteration = getattr(scheduler, "last_batch_iteration", None)
    if iteration is None:
        return
    scheduler.step(0 if iteration < 0 else iteration)


def float_dtype_of(ds_config: dict) -> torch.dtype:
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"):  # "bfloat16": DeepSpeed's old name
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32
