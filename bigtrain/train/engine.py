"""A thin wrapper over `deepspeed.initialize` that hides pipeline vs. plain engines from the loop."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from bigtrain.ds.runtime import resolve_compile
from bigtrain.models.losses import correct_counts, target_count
from bigtrain.models.spec import ModelSpec, call_module, output_logits, pipeline_inputs
from bigtrain.config.run_config import LoraConfig
from bigtrain.parallel import build_module, to_pipeline_module
from bigtrain.parallel.lora import LoraCounts, apply_lora, check_lora
from bigtrain.parallel.split import ModelSplit, Topology
from bigtrain.parallel.tiling import apply_checkpointing, apply_tiling
from bigtrain.train import fast_path


@dataclass(frozen=True)
class EngineOptions:
    pipeline_stages: int = 1
    partition_method: str = "parameters"
    activation_checkpointing: bool = False
    checkpoint_every_n_layers: int = 1
    seed: int = 1234
    compile: bool | str = False  # train.compile: False | True | "auto" | "deepcompile" (bigtrain.train.fast_path)
    loss_impl: str = "plain"  # train.loss_impl: "plain" | "chunked" | "auto"
    lora: LoraConfig | None = None  # the run's lora section: r > 0 trains adapters on a frozen base
    packed: bool = False  # data.packing: several examples per row (sequence parallelism then keeps them apart)
    token_weighted: bool = False  # chat/instruction data: a step's loss is the mean over all its trained tokens
    tiled_mlp: bool | str = False  # activation_checkpointing.tiled_mlp: True | False | "auto" (parallel.tiling)
    offload_hidden_states: bool | str = False  # activation_checkpointing.offload_hidden_states (the same module)


class Engine:
    """One training step / one eval step, the same way for a plain module and for pipeline stages."""

    def __init__(self, spec: ModelSpec, ds_config: dict, options: EngineOptions):
        self.spec = spec
        self.is_pipeline = options.pipeline_stages > 1
        # DeepSpeed's pipeline engine takes the micro-batches' losses itself: there each one's mean counts alike
        self.token_weighted = options.token_weighted and not self.is_pipeline
        self.router_loss: torch.Tensor | None = None  # the last step's, for mixtures of experts
        from bigtrain.models.hf_common import router_aux_coef
        self.router_coef = router_aux_coef(getattr(spec, "config", None)) or 0.0
        zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
        check_lora(spec, options.lora, options.pipeline_stages)  # before a large model is built
        self.lora: LoraCounts | None = None
        self.tiled_mlps = 0  # MLPs computed in sequence tiles (ALST's TiledMLP)
        if self.is_pipeline:
            model = to_pipeline_module(
                spec, options.pipeline_stages, partition_method=options.partition_method,
                activation_checkpoint_interval=options.checkpoint_every_n_layers if options.activation_checkpointing else 0,
                seed=options.seed)
        self.split = None if self.is_pipeline else ModelSplit.for_job(
            spec, Topology.of(ds_config, torch.distributed.get_world_size()), torch.distributed.get_rank())
        if not self.is_pipeline:
            model = build_module(spec, ds_config if zero3 else None, seed=options.seed, mpu=self.split.mpu)
            # the adapters first: the optimizer below gets only what still trains
            self.lora = apply_lora(model, spec, options.lora, options.seed, options.activation_checkpointing)
            self.split.attach(model, spec, ds_config["train_micro_batch_size_per_gpu"], packed=options.packed)
            self.tiled_mlps = apply_tiling(model, spec, options.tiled_mlp, self.split.topology.sequence)
            if options.activation_checkpointing:  # with ALST's offload of the hidden states where it resolves on
                apply_checkpointing(spec, model, options.checkpoint_every_n_layers, ds_config,
                                    options.offload_hidden_states, self.split.topology.sequence)
        compile_mode, loss_impl = self._fast_path(spec, None if self.is_pipeline else model, ds_config, options)
        params = [p for p in model.parameters() if p.requires_grad]
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(  # ds_config: what resolve returned
            model=model, model_parameters=params, config=ds_config, mpu=self.split.mpu if self.split else None)
        start_schedule(self.scheduler)
        self.device = get_accelerator().current_device_name()
        self.float_dtype = _float_dtype(ds_config)
        if loss_impl == "chunked" and zero3:
            fast_path.register_head_for_zero3(self.ds, model)
        fast_path.compile_engine(self.ds, compile_mode)

    def _fast_path(self, spec: ModelSpec, model: torch.nn.Module | None, ds_config: dict,
                   options: EngineOptions) -> tuple[str, str]:
        """Resolve train.compile / train.loss_impl for this device; put the loss inside the module's forward
        when either is on (the loop then calls `module(inputs, loss_labels=labels)`)."""
        device_name = get_accelerator().device_name()
        stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        compile_mode = resolve_compile(options.compile, device_name, options.pipeline_stages, stage)
        loss_impl = "plain" if model is None else fast_path.resolve_loss_impl(options.loss_impl, device_name, spec,
                                                                                model)
        if self.split is not None and self.split.topology.model_split > 1:
            # The split model's head and loss are DeepSpeed's and bigtrain.parallel's: neither lever has been
            # proven equal to one process there.
            explicit = [f"train.{k}={v}" for k, v in (("compile", options.compile), ("loss_impl", options.loss_impl))
                        if v not in ("auto", False, "plain")]
            if explicit:
                raise ValueError(f"{', '.join(explicit)} with tensor or sequence parallelism: not supported; set "
                                 "it to auto (or false / plain)")
            compile_mode, loss_impl = "off", "plain"
        self.loss_in_forward = model is not None and (compile_mode != "off" or loss_impl == "chunked")
        self.fast_path = {"compile": compile_mode, "loss_impl": loss_impl}
        if self.loss_in_forward:
            fast_path.install_loss_forward(model, fast_path.loss_function(spec, loss_impl))
        return compile_mode, loss_impl

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

    def train_step(self, batches: Iterator[dict]) -> torch.Tensor:
        """One optimizer step over `grad_accum` micro-batches. Returns this rank's mean loss as a
        scalar on the device, not yet read (`distributed.reduce_step` averages it over the ranks)."""
        if not self.ds.module.training:  # module.train() walks every submodule: only after eval
            self.ds.train()
        if self.is_pipeline:  # train_batch already averages over data-parallel ranks, on every stage
            return self.ds.train_batch(self._pipe_iter(batches))
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        router = None  # a mixture of experts' load-balancing loss (part of the loss), reported on its own
        micro = [self._inputs(next(batches)) for _ in range(self.grad_accum)]
        scale = self._token_scale([labels for _, labels in micro]) if self.token_weighted else None
        for inputs, labels in micro:
            with same_batch_in_tensor_group():
                if self.split.sequence_parallel:
                    inputs, targets = self.split.shard(inputs, labels)
                    output = call_module(self.ds, inputs)
                    loss = self.split.loss(output_logits(output), targets, scale)
                    if getattr(output, "aux_loss", None) is not None:  # a mixture of experts' router loss
                        loss = loss + self.router_coef * output.aux_loss
                        router = output.aux_loss.detach() + (0 if router is None else router)
                elif self.loss_in_forward:
                    loss = self._weigh(fast_path.call_with_loss(self.ds, inputs, labels), labels, scale)
                else:
                    output = call_module(self.ds, inputs)
                    aux = getattr(output, "aux_loss", None)
                    loss = self._weigh(self.spec.loss(output, labels), labels, scale,
                                       None if aux is None else self.router_coef * aux)
                    if aux is not None:
                        router = aux.detach() + (0 if router is None else router)
            self.ds.backward(loss)
            self.ds.step()
            total += loss.detach()  # stays on the device: no host sync per micro-batch
        self.router_loss = None if router is None else router / self.grad_accum
        return total / self.grad_accum

    def _token_scale(self, labels: list[torch.Tensor]) -> torch.Tensor:
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
        return self.grad_accum * world * self.split.topology.sequence / count[0].clamp(min=1)

    @staticmethod
    def _weigh(mean: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | None,
               router: torch.Tensor | None = None) -> torch.Tensor:
        """A micro-batch's mean token loss (plus `router`, a mixture of experts' router term, already in it) as
        its share of the step's token mean; unchanged without `scale`. The router term keeps its weight."""
        if scale is None:
            return mean
        weight = (target_count(labels) * scale).to(mean.dtype)  # exactly 1 when every micro-batch counts alike
        if router is None:
            return mean * weight
        return (mean - router) * weight + router

    @torch.no_grad()
    def eval_loss(self, batches: list[dict]) -> float:
        """Mean loss over `batches` (the same count on every rank), averaged over data-parallel ranks (weighing
        each batch by its trained tokens for token-weighted data).
        Classifiers (`spec.eval_metric == "accuracy"`) also set `last_eval_accuracy`: correct
        predictions over all ranks' samples."""
        self.ds.eval()
        accuracy = self.spec.eval_metric == "accuracy"
        counts = torch.zeros(2, dtype=torch.float64, device=self.device)  # correct, predictions
        if self.is_pipeline:  # eval_batch averages over data-parallel ranks and broadcasts to all stages
            it = self._pipe_iter(iter(batches))
            losses = []
            for batch in batches:
                out = self.ds.eval_batch(it, num_micro_batches=1, return_logits=accuracy)
                loss, logits = out if accuracy else (out, None)
                losses.append(float(loss.item()))
                if logits is not None and self.ds.is_last_stage():  # the last stage holds the logits
                    counts += correct_counts(logits, self._inputs(batch)[1])
            result = sum(losses) / max(len(losses), 1)
        else:
            sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss x weight, weight
            one = torch.ones((), dtype=torch.float64, device=self.device)
            for batch in batches:
                inputs, labels = self._inputs(batch)
                # token-weighted data: each batch weighs by its trained tokens, as in training
                weight = target_count(labels).to(torch.float64) if self.token_weighted else one
                if self.loss_in_forward and not accuracy:  # chunked: no full logits in eval either
                    loss = fast_path.call_with_loss(self.ds, inputs, labels)
                else:
                    output = call_module(self.ds, inputs)
                    loss = self.spec.loss(output, labels)
                    if accuracy:
                        counts += correct_counts(output_logits(output), labels)
                sums += torch.stack([loss.detach().to(torch.float64) * weight, weight])
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(sums)
            result = float(sums[0] / sums[1]) if sums[1] else float("nan")
        if accuracy:
            torch.distributed.all_reduce(counts)
            self.last_eval_accuracy = float(counts[0] / counts[1]) if counts[1] else float("nan")
        return result

    def _inputs(self, batch: dict) -> tuple[Any, torch.Tensor]:
        inputs, labels = self.spec.batch_to_inputs(batch)
        return self._to_device(inputs), labels.to(self.device)

    def _pipe_iter(self, batches: Iterator[dict]) -> Iterator[tuple]:
        for batch in batches:
            inputs, labels = self._inputs(batch)
            yield pipeline_inputs(inputs), labels

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            value = value.to(self.device)
            return value.to(self.float_dtype) if value.is_floating_point() else value
        if isinstance(value, (tuple, list)):
            return type(value)(self._to_device(v) for v in value)
        if isinstance(value, dict):
            return {k: self._to_device(v) for k, v in value.items()}
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


def _float_dtype(ds_config: dict) -> torch.dtype:
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"):  # "bfloat16": DeepSpeed's old name
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32
