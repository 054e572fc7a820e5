"""The stepper: one training step and one evaluation over a DeepSpeed engine (`bigtrain.train.assemble` builds
it), the same way for a plain module and for pipeline stages. What a micro-batch's loss and metrics are is the
objective's (`bigtrain.objectives`); the stepper knows no objective by name.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from deepspeed.accelerator import get_accelerator

from bigtrain.models.losses import correct_counts
from bigtrain.models.spec import ModelSpec, pipeline_inputs
from bigtrain.objectives import Objective
from bigtrain.objectives.causal_lm import ModelLoss
from bigtrain.train import fast_path
from bigtrain.train.assemble import EngineOptions, assemble

__all__ = ["Engine", "EngineOptions"]


class Engine:
    """One training step / one eval step over the assembled DeepSpeed engine."""

    def __init__(self, spec: ModelSpec, ds_config: dict, options: EngineOptions, objective: Objective | None = None):
        self.spec = spec
        self.objective = objective or ModelLoss()
        self.is_pipeline = options.pipeline_stages > 1
        if self.is_pipeline and self.objective.kind != "lm":
            raise ValueError(f"objective.kind={self.objective.kind} with pipeline stages: set pipeline.stages=1")
        # DeepSpeed's pipeline engine takes the micro-batches' losses itself: there each one's mean counts alike
        self.token_weighted = options.token_weighted and not self.is_pipeline and self.objective.kind == "lm"
        self.step_metrics: dict[str, torch.Tensor] = {}  # the last step's, averaged over its micro-batches
        from bigtrain.models.hf_common import router_aux_coef
        self.router_coef = router_aux_coef(getattr(spec, "config", None)) or 0.0
        parts = assemble(spec, ds_config, options, self.objective)
        self.ds, self.optimizer, self.scheduler = parts.ds, parts.optimizer, parts.scheduler
        self.split, self.lora, self.reference = parts.split, parts.lora, parts.reference
        self.tiled_mlps = parts.tiled_mlps
        self.loss_in_forward, self.fast_path = parts.loss_in_forward, parts.fast_path
        start_schedule(self.scheduler)
        self.device = get_accelerator().current_device_name()
        self.float_dtype = float_dtype_of(ds_config)

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

    @property
    def router_loss(self) -> torch.Tensor | None:
        """The last step's mixture-of-experts load-balancing loss (part of the loss), when the model has one."""
        return self.step_metrics.get("router_aux_loss")

    def train_step(self, batches: Iterator[dict]) -> torch.Tensor:
        """One optimizer step over `grad_accum` micro-batches. Returns this rank's mean loss as a scalar on the
        device, not yet read; the objective's metrics of the step are in `step_metrics` (`reduce_step` averages
        both over the ranks in one collective)."""
        if not self.ds.module.training:  # module.train() walks every submodule: only after eval
            self.ds.train()
        if self.is_pipeline:  # train_batch already averages over data-parallel ranks, on every stage
            self.step_metrics = {}
            return self.ds.train_batch(self._pipe_iter(batches))
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, torch.Tensor] = {}
        micro = [self.objective.inputs(self, next(batches)) for _ in range(self.grad_accum)]
        shared = self.objective.begin_step(self, micro)
        for item in micro:
            with same_batch_in_tensor_group():
                loss, metrics = self.objective.micro_loss(self, item, shared)
            self.ds.backward(loss)
            self.ds.step()
            total += loss.detach()  # stays on the device: no host sync per micro-batch
            for name, value in metrics.items():
                sums[name] = value.to(torch.float64) + sums.get(name, 0)
        self.step_metrics = {name: value / self.grad_accum for name, value in sums.items()}
        return total / self.grad_accum

    def forward_with_loss(self, inputs: Any, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The loss computed inside the module's forward (compiled or chunked: `bigtrain.train.fast_path`)."""
        return fast_path.call_with_loss(self.ds, inputs, labels, reduction)

    def reference_logps(self, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """The frozen reference's summed log-probability of each row's answer (objective.reference)."""
        assert self.reference is not None, f"objective.kind={self.objective.kind} was built without a reference"
        return self.reference.logps(self.ds, inputs, labels)

    @torch.no_grad()
    def eval_loss(self, batches: list[dict]) -> float:
        """Mean loss over `batches` (the same count on every rank), averaged over data-parallel ranks, each batch
        weighed as the objective says (its trained tokens for token-weighted data). The objective's metrics go to
        `last_eval_metrics`; classifiers also set `last_eval_accuracy`: correct predictions over all ranks'
        samples."""
        self.ds.eval()
        if self.is_pipeline:
            return self._pipeline_eval(batches)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss x weight, weight
        metric_sums: dict[str, torch.Tensor] = {}
        for batch in batches:
            loss, weight, metrics = self.objective.eval_loss(self, self.objective.inputs(self, batch))
            sums += torch.stack([loss.detach().to(torch.float64) * weight, weight])
            for name, value in metrics.items():
                metric_sums[name] = value.to(torch.float64) + metric_sums.get(name, 0)
        names = sorted(metric_sums)
        packed = torch.cat([sums, torch.stack([metric_sums[n] for n in names]) if names else sums[:0]])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(packed)
        total = dict(zip(names, packed[2:].tolist()))
        if "predictions" in total:  # a classifier's counts
            seen = total.pop("predictions")
            self.last_eval_accuracy = total.pop("correct") / seen if seen else float("nan")
        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.last_eval_metrics = {n: v / (ranks * max(len(batches), 1)) for n, v in total.items()}
        return float(packed[0] / packed[1]) if packed[1] else float("nan")

    def _pipeline_eval(self, batches: list[dict]) -> float:
        """eval_batch averages over data-parallel ranks and broadcasts to all stages; the last stage holds the
        logits (a classifier's accuracy)."""
        accuracy = self.spec.eval_metric == "accuracy"
        counts = torch.zeros(2, dtype=torch.float64, device=self.device)  # correct, predictions
        it = self._pipe_iter(iter(batches))
        losses = []
        for batch in batches:
            out = self.ds.eval_batch(it, num_micro_batches=1, return_logits=accuracy)
            loss, logits = out if accuracy else (out, None)
            losses.append(float(loss.item()))
            if logits is not None and self.ds.is_last_stage():
                counts += correct_counts(logits, self._inputs(batch)[1])
        if accuracy:
            torch.distributed.all_reduce(counts)
            self.last_eval_accuracy = float(counts[0] / counts[1]) if counts[1] else float("nan")
        self.last_eval_metrics = {}
        return sum(losses) / max(len(losses), 1)

    def _inputs(self, batch: dict) -> tuple[Any, torch.Tensor]:
        inputs, labels = self.spec.batch_to_inputs(batch)
        return self.to_device(inputs), labels.to(self.device)

    def _pipe_iter(self, batches: Iterator[dict]) -> Iterator[tuple]:
        for batch in batches:
            inputs, labels = self._inputs(batch)
            yield pipeline_inputs(inputs), labels

    def to_device(self, value: Any) -> Any:
        """A batch's inputs on this rank's device; floating inputs (images) in the engine's dtype."""
        if isinstance(value, torch.Tensor):
            value = value.to(self.device)
            return value.to(self.float_dtype) if value.is_floating_point() else value
        if isinstance(value, (tuple, list)):
            return type(value)(self.to_device(v) for v in value)
        if isinstance(value, dict):
            return {k: self.to_device(v) for k, v in value.items()}
        return value

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
