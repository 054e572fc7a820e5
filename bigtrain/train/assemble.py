"""The model builder: a model spec and the resolved DeepSpeed dict in, a DeepSpeed engine out (and the frozen
reference an objective compares with). The stepper (`bigtrain.train.engine`) then only steps.

In order: the plain module (partitioned from birth under ZeRO-3) or the pipeline stages; LoRA adapters (so the
optimizer gets only what trains); the tensor / sequence split; activation checkpointing; the fast path
(torch.compile, the chunked loss: the loss moves inside the module's forward); `deepspeed.initialize`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from bigtrain.config.run_config import LoraConfig
from bigtrain.ds.runtime import resolve_compile
from bigtrain.models.spec import ModelSpec
from bigtrain.objectives import Objective
from bigtrain.parallel import build_module, to_pipeline_module
from bigtrain.parallel.lora import LoraCounts, apply_lora, check_lora
from bigtrain.parallel.split import ModelSplit, Topology
from bigtrain.parallel.tiling import apply_checkpointing, apply_tiling
from bigtrain.train import fast_path
from bigtrain.train.reference import Reference, build_reference


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


@dataclass
class Assembled:
    """What the stepper works with."""

    ds: Any  # the DeepSpeed engine (PipelineEngine for pipeline stages)
    optimizer: Any
    scheduler: Any
    split: ModelSplit | None  # None for pipeline stages
    lora: LoraCounts | None
    tiled_mlps: int  # MLPs computed in sequence tiles (ALST's TiledMLP)
    loss_in_forward: bool  # the module computes its loss itself: `module(inputs, loss_labels=labels)`
    fast_path: dict
    reference: Reference | None


def assemble(spec: ModelSpec, ds_config: dict, options: EngineOptions, objective: Objective) -> Assembled:
    pipeline = options.pipeline_stages > 1
    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    check_lora(spec, options.lora, options.pipeline_stages)  # before a large model is built
    lora, split, tiled_mlps = None, None, 0
    if pipeline:
        model = to_pipeline_module(
            spec, options.pipeline_stages, partition_method=options.partition_method,
            activation_checkpoint_interval=options.checkpoint_every_n_layers if options.activation_checkpointing else 0,
            seed=options.seed)
    else:
        split = ModelSplit.for_job(spec, Topology.of(ds_config, torch.distributed.get_world_size()),
                                   torch.distributed.get_rank())
        model = build_module(spec, ds_config if zero3 else None, seed=options.seed, mpu=split.mpu)
        # the adapters first: the optimizer below gets only what still trains
        lora = apply_lora(model, spec, options.lora, options.seed, options.activation_checkpointing)
        if objective.pairs:  # the policy (its adapters' dropout too) against a dropout-free reference, as TRL does
            disable_dropout(model)
        split.attach(model, spec, ds_config["train_micro_batch_size_per_gpu"], packed=options.packed)
        tiled_mlps = apply_tiling(model, spec, options.tiled_mlp, split.topology.sequence)
        if options.activation_checkpointing:  # with ALST's offload of the hidden states where it resolves on
            apply_checkpointing(spec, model, options.checkpoint_every_n_layers, ds_config,
                                options.offload_hidden_states, split.topology.sequence)
    compile_mode, loss_impl = _fast_path(spec, None if pipeline else model, ds_config, options, split, objective)
    loss_in_forward = not pipeline and (compile_mode != "off" or loss_impl == "chunked")
    if loss_in_forward:
        fast_path.install_loss_forward(model, fast_path.loss_function(spec, loss_impl))
    params = [p for p in model.parameters() if p.requires_grad]
    ds, optimizer, _, scheduler = deepspeed.initialize(  # ds_config: what resolve returned
        model=model, model_parameters=params, config=ds_config, mpu=split.mpu if split else None)
    if loss_impl == "chunked" and zero3:
        fast_path.register_head_for_zero3(ds, model)
    fast_path.compile_engine(ds, compile_mode)
    reference = build_reference(objective.reference, spec, ds_config, options.seed) \
        if objective.reference in ("adapters_off", "copy") else None  # precomputed: the data carries its numbers
    return Assembled(ds, optimizer, scheduler, split, lora, tiled_mlps, loss_in_forward,
                     {"compile": compile_mode, "loss_impl": loss_impl}, reference)


def _fast_path(spec: ModelSpec, model: torch.nn.Module | None, ds_config: dict, options: EngineOptions,
               split: ModelSplit | None, objective: Objective) -> tuple[str, str]:
    """Resolve train.compile / train.loss_impl for this device and objective."""
    device_name = get_accelerator().device_name()
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    explicit = [f"train.{k}={v}" for k, v in (("compile", options.compile), ("loss_impl", options.loss_impl))
                if v not in ("auto", False, "plain")]
    if objective.kind != "lm":
        # A pair objective reads log-probabilities of two answers from the logits; neither lever is built for it.
        if explicit:
            raise ValueError(f"{', '.join(explicit)} with objective.kind={objective.kind}: not supported; set it to "
                             "auto (or false / plain)")
        return "off", "plain"
    compile_mode = resolve_compile(options.compile, device_name, options.pipeline_stages, stage)
    loss_impl = "plain" if model is None else fast_path.resolve_loss_impl(options.loss_impl, device_name, spec, model)
    if split is not None and split.topology.tensor > 1:
        # AutoTP's head and loss are DeepSpeed's: neither lever has been proven equal to one process there.
        if explicit:
            raise ValueError(f"{', '.join(explicit)} with tensor parallelism: not supported; set it to auto (or "
                             "false / plain)")
        return "off", "plain"
    if split is not None and split.topology.sequence > 1:
        # Ulysses' all-to-all runs outside a compiled graph; the chunked loss runs on each rank's slice (proven
        # equal to one process: tests/dist/test_parallel_modes.py)
        if options.compile not in ("auto", False):
            raise ValueError(f"train.compile={options.compile} with sequence parallelism: not supported; set it to "
                             "auto (or false)")
        return "off", loss_impl
    return compile_mode, loss_impl


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
