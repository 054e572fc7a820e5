"""The model builder: a model spec and the resolved DeepSpeed dict in, a DeepSpeed engine out (with the reference
and the frozen models the objective declares). The stepper (`bigtrain.train.engine`) then only steps.

What wraps a plain module, and in which order, is `parallelize` (torchtitan's parallelize_fn): one function, each
wrapper in the module named for it. What it changes is this module's own instances, or (AutoEP's registry lookups)
undone when `deepspeed.initialize` returns, so that a reference, reward model or teacher built beside it runs as
built. One exception is DeepSpeed's design: Ulysses replaces transformers' sdpa attention for the whole process,
which is why the run config refuses sequence parallelism with a frozen model beside the policy.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass, field
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from bigtrain.config.run_config import LoraConfig
from bigtrain.ds.runtime import resolve_compile
from bigtrain.models.spec import ModelSpec
from bigtrain.objectives import Needs, Objective
from bigtrain.parallel import build_module, to_pipeline_module
from bigtrain.parallel.checkpointing import apply_checkpointing
from bigtrain.parallel.experts import output_capture_lookups
from bigtrain.parallel.lora import LoraCounts, apply_lora, check_lora
from bigtrain.parallel.split import ModelSplit, Topology
from bigtrain.parallel.tiling import apply_tiling
from bigtrain.train import fast_path
from bigtrain.train.reference import Reference, build_frozen_models, build_reference


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
    offload_hidden_states: bool | str = False  # activation_checkpointing.offload_hidden_states (parallel.checkpointing)


@dataclass
class Assembled:
    """What the stepper works with."""

    ds: Any  # the DeepSpeed engine (PipelineEngine for pipeline stages)
    optimizer: Any
    scheduler: Any
    split: ModelSplit | None  # None for pipeline stages
    lora: LoraCounts | None = None
    loss_in_forward: bool = False  # the module computes its loss itself: `module(inputs, loss_labels=labels)`
    reference: Reference | None = None
    frozen: dict[str, Any] = field(default_factory=dict)  # the objective's frozen models, by their setting


def assemble(spec: ModelSpec, ds_config: dict, options: EngineOptions, objective: Objective) -> Assembled:
    needs = objective.declare(objective.settings)
    check_lora(spec, options.lora, options.pipeline_stages)  # before a large model is built
    if options.pipeline_stages > 1:
        parts = pipeline_engine(spec, ds_config, options)
    else:
        split = ModelSplit.for_job(spec, Topology.of(ds_config, torch.distributed.get_world_size()),
                                   torch.distributed.get_rank())
        zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
        model = build_module(spec, ds_config if zero3 else None, seed=options.seed, mpu=split.mpu)
        parts = parallelize(model, spec, ds_config, options, split, needs)
    parts.reference = build_reference(objective.reference, spec, ds_config, options.seed)
    parts.frozen = build_frozen_models(needs.frozen_models, objective.settings, spec, ds_config, options.seed)
    return parts


def parallelize(model: torch.nn.Module, spec: ModelSpec, ds_config: dict, options: EngineOptions,
                split: ModelSplit, needs: Needs) -> Assembled:
    """Everything that wraps a plain module (built, partitioned from birth under ZeRO-3), in order:

    1. LoRA adapters (parallel/lora.py), first: the optimizer gets only what still trains;
    2. dropout off where the objective compares forward passes (its `Needs`; the adapters' dropout too);
    3. the tensor / sequence split (parallel/split.py): Ulysses around the attention here; AutoTP's groups were made
       before the module was built (zero.Init needs them) and DeepSpeed shards its layers in `initialize`;
    4. ALST's tiled MLP (parallel/tiling.py);
    5. activation checkpointing, with the hidden states kept in host memory where that resolves on
       (parallel/checkpointing.py);
    6. the loss inside the module's forward, when compiled or chunked (train/fast_path.py);
    7. `deepspeed.initialize` (AutoEP converts the experts inside it, parallel/experts.py), then torch.compile of the
       engine (train/fast_path.py)."""
    lora = apply_lora(model, spec, options.lora, options.seed, options.activation_checkpointing)
    if not needs.dropout:
        disable_dropout(model)
    split.attach(model, spec, ds_config["train_micro_batch_size_per_gpu"], packed=options.packed)
    apply_tiling(model, spec, options.tiled_mlp, split.topology.sequence)
    if options.activation_checkpointing:
        apply_checkpointing(spec, model, options.checkpoint_every_n_layers, ds_config, options.offload_hidden_states,
                            split.topology.sequence)
    compile_mode, loss_impl = resolve_levers(spec, model, ds_config, options, split, needs)
    loss_in_forward = compile_mode != "off" or loss_impl == "chunked"
    if loss_in_forward:
        fast_path.install_loss_forward(model, fast_path.loss_function(spec, loss_impl))
    params = [p for p in model.parameters() if p.requires_grad]
    with output_capture_lookups() if split.topology.expert > 1 else contextlib.nullcontext():
        muon_compiled_at_first_use()
        ds, optimizer, _, scheduler = deepspeed.initialize(  # ds_config: what resolve returned
            model=model, model_parameters=params, config=ds_config, mpu=split.mpu)
    if split.sequence_parallel:  # each rank's loss share is scaled for how the engine reduces the group's gradients
        assert (ds.sequence_parallel_size > 1) == split.sequence_summed, (ds.sequence_parallel_size, split.topology)
    if loss_impl == "chunked" and ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        fast_path.register_head_for_zero3(ds, model)
    fast_path.compile_engine(ds, compile_mode)
    return Assembled(ds, optimizer, scheduler, split, lora, loss_in_forward)


def muon_compiled_at_first_use() -> None:
    """Import DeepSpeed's Muon module with each of its torch.compile decorations deferred to the kernel's first call.

    DeepSpeed imports the module wherever it asks whether the optimizer is Muon (the ZeRO optimizers' set-up and
    every gradient reduction, the bf16 optimizer, `is_zero_supported_optimizer`), and its kernels are decorated with
    torch.compile, whose decoration imports torch's inductor: 1-2 CPU seconds of every ZeRO job's start that only a
    Muon run uses (a fifth of a small one-process job's: `bigtrain bench --trl`). Deferred, a Muon run compiles each
    kernel when it first runs it, the others never."""
    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return
    from deepspeed.runtime import compiler
    eager = compiler.compile

    def deferred() -> Any:
        def decorate(fn: Any) -> Any:
            compiled = None

            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                nonlocal compiled
                if compiled is None:
                    compiled = eager()(fn)
                return compiled(*args, **kwargs)
            return call
        return decorate

    compiler.compile = deferred
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    finally:
        compiler.compile = eager


def pipeline_engine(spec: ModelSpec, ds_config: dict, options: EngineOptions) -> Assembled:
    """This rank's pipeline stage, its blocks checkpointed by DeepSpeed's schedule, in DeepSpeed's pipeline engine
    (eager: the run config refuses train.compile with pipeline stages, whose last stage computes the plain loss)."""
    model = to_pipeline_module(
        spec, options.pipeline_stages, partition_method=options.partition_method,
        activation_checkpoint_interval=options.checkpoint_every_n_layers if options.activation_checkpointing else 0,
        seed=options.seed)
    ds, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config)
    return Assembled(ds, optimizer, scheduler, None)


def resolve_levers(spec: ModelSpec, model: torch.nn.Module, ds_config: dict, options: EngineOptions,
                   split: ModelSplit, needs: Needs) -> tuple[str, str]:
    """train.compile and train.loss_impl for this device, module, split and objective: (compile mode, loss)."""
    device_name = get_accelerator().device_name()
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    topology = split.topology
    loss_impl = fast_path.resolve_loss_impl(options.loss_impl, device_name, spec, model, topology.tensor,
                                            needs.allows("chunked_loss"))
    compile_mode = resolve_compile(options.compile, device_name, 1, stage) if needs.allows("compile") else "off"
    if topology.tensor > 1 or topology.sequence > 1:
        # AutoTP's head and loss are DeepSpeed's, and Ulysses' all-to-all runs outside a compiled graph: neither has
        # been proven equal to one process compiled (the chunked loss has with Ulysses: tests/dist/test_parallel_modes)
        if options.compile not in ("auto", False):
            axis = "tensor" if topology.tensor > 1 else "sequence"
            raise ValueError(f"train.compile={options.compile} with {axis} parallelism: not supported; set it to auto "
                             "(or false)")
        compile_mode = "off"
    return compile_mode, loss_impl


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
