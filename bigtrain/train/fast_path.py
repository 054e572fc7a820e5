"""Two levers of the training step, chosen per device: `torch.compile` of the model with its loss, and
the chunked causal-LM loss (`bigtrain.models.chunked_loss`).

Both need the loss inside the module's forward: compiled, the loss is then in the same graph as the
model (inductor may fuse the fp32 cast and log-softmax with the head's output instead of writing a
full fp32 copy), and chunked, the head weight is used where ZeRO-3 has gathered it. The module gets a `loss_labels` keyword:
`module(inputs, loss_labels=labels)` returns the scalar loss; any other call (generation, export,
evaluation by hand) runs the module's own forward unchanged and uncompiled, and its state dict keeps
its names.

Defaults (`train.compile: auto`, `train.loss_impl: auto`): on on GPUs (compile at ZeRO 0-2: at ZeRO-3,
DeepSpeed's per-module hooks break the graph at every layer, and DeepCompile is DeepSpeed's route
there), off on CPUs. Neither has a measured GPU effect yet (docs/benchmarks.md, "GPU levers"); on
the 2-core CPU host a cold inductor compile of GPT-2 tiny costs ~45 s of CPU per rank, more than a
short run trains.
"""
from __future__ import annotations

import logging
import types
from typing import Any, Callable

import torch
from torch import nn

from bigtrain.models.spec import ModelSpec

log = logging.getLogger("bigtrain")
LossFn = Callable[[nn.Module, tuple, dict, torch.Tensor], torch.Tensor]


def resolve_loss_impl(setting: str, device_name: str, spec: ModelSpec, module: nn.Module | None, tensor: int = 1,
                      allowed: bool = True) -> str:
    """`train.loss_impl` -> "plain" | "chunked" for this module (None: a pipeline, whose last stage computes the
    plain loss), `tensor`-way tensor parallelism, and an objective that `allowed` it or not (`Needs.allows`; one
    that refuses it refuses an explicit setting in the run config). The one copy of these rules: the builder asks
    them of the module it built, `bigtrain estimate` and the launcher's memory check of the meta-device module
    they count."""
    if setting == "plain" or not allowed:
        return "plain"
    if tensor > 1:  # AutoTP's head and loss are DeepSpeed's: the chunked loss has not been proven equal there
        if setting == "chunked":
            raise ValueError("train.loss_impl=chunked with tensor parallelism: not supported; set it to auto (or "
                             "plain)")
        return "plain"
    reason = chunked_unsupported(spec, module)
    if setting == "chunked":
        if reason:
            raise ValueError(f"train.loss_impl=chunked: {reason}; use train.loss_impl=plain (or auto)")
        return "chunked"
    return "chunked" if reason is None and device_name != "cpu" else "plain"


def chunked_unsupported(spec: ModelSpec, module: nn.Module | None) -> str | None:
    """Why the chunked causal-LM loss cannot stand in for this spec's loss, or None when it can."""
    from bigtrain.models.chunked_loss import unsupported_reason
    from bigtrain.models.losses import causal_lm_loss
    if module is None:
        return "pipeline stages compute the plain loss on the last stage"
    if spec.modality != "text" or spec.pipeline_loss is not causal_lm_loss:
        return f"{spec.family} is not trained with the causal-LM loss"
    from bigtrain.models.hf_common import router_aux_coef
    if router_aux_coef(getattr(module, "config", None)) is not None:
        return "a mixture of experts adds its router's load-balancing loss, which the chunked loss leaves out"
    return unsupported_reason(module)


def loss_function(spec: ModelSpec, impl: str) -> LossFn:
    """(module, args, kwargs, labels) -> loss, run inside the module's forward."""
    if impl == "chunked":
        from bigtrain.models.chunked_loss import causal_lm_hidden_loss

        def chunked(module: nn.Module, args: tuple, kwargs: dict, labels: torch.Tensor) -> torch.Tensor:
            reduction = kwargs.pop("loss_reduction", "mean")  # sum: a sequence-parallel rank's share
            return causal_lm_hidden_loss(module, args, kwargs, labels, reduction=reduction)
        return chunked

    def plain(module: nn.Module, args: tuple, kwargs: dict, labels: torch.Tensor) -> torch.Tensor:
        return spec.loss(module.forward_without_loss(*args, **kwargs), labels)
    return plain


def install_loss_forward(module: nn.Module, loss: LossFn) -> None:
    """Give `module` (this instance only) a forward that returns `loss(...)` when called with
    `loss_labels=`; without it, the module's own forward (kept as `forward_without_loss`)."""
    own_forward = module.forward
    module.forward_without_loss = own_forward
    # Calls without labels (generation, which changes shapes every token) stay eager when the module is compiled.
    eager_forward = torch.compiler.disable(own_forward)

    def forward(self: nn.Module, *args: Any, loss_labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if loss_labels is None:
            return eager_forward(*args, **kwargs)
        return loss(self, args, kwargs, loss_labels)

    module.forward = types.MethodType(forward, module)


def compile_engine(ds_engine: Any, mode: str) -> None:
    """DeepSpeed's `engine.compile()`: torch.compile of the module (loss included) with the accelerator's
    backend (inductor), or DeepCompile's passes when the config switched it on."""
    if mode == "off":
        return
    if mode == "torch" and ds_engine.zero_optimization_stage() == 3:
        keep_zero3_hooks_eager(ds_engine.module)
    from deepspeed.accelerator import get_accelerator
    ds_engine.compile()
    log.info("compiled the model and its loss (%s, backend %s)", mode,
             "DeepCompile" if mode == "deepcompile" else get_accelerator().get_compile_backend())


def keep_zero3_hooks_eager(module: nn.Module) -> int:
    """Run DeepSpeed's ZeRO-3 module hooks outside dynamo (graph breaks, no retracing).

    Traced, the same hook code meets a new module type at every layer kind and dynamo recompiles it until
    its recompile limit (8), then runs it eagerly anyway: minutes of compilation on a CPU for GPT-2 tiny.
    Returns the number of hooks wrapped."""
    wrapped = 0
    for sub in module.modules():
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks, sub._backward_pre_hooks, sub._backward_hooks):
            for key, fn in list(hooks.items()):
                if getattr(fn, "__module__", "").startswith("deepspeed.") and not hasattr(fn, "_torchdynamo_disable"):
                    hooks[key] = torch.compiler.disable(fn)
                    wrapped += 1
    return wrapped


def call_with_loss(ds_engine: Any, inputs: Any, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The loss of `inputs` computed inside the (DeepSpeed-wrapped) module's forward (`reduction="sum"`: the summed
    token losses, which only the chunked loss gives)."""
    extra = {"loss_reduction": "sum"} if reduction == "sum" else {}
    if isinstance(inputs, dict):
        return ds_engine(**inputs, loss_labels=labels, **extra)
    return ds_engine(inputs, loss_labels=labels, **extra)


def register_head_for_zero3(ds_engine: Any, module: nn.Module) -> None:
    """Under ZeRO-3 the root module's forward reads the output head's weight outside the head's own
    forward: tell DeepSpeed to gather it for the root module (its documented external-parameter API)."""
    import deepspeed
    head = module.get_output_embeddings()
    deepspeed.zero.register_external_parameter(module, head.weight)
    if head.bias is not None:
        deepspeed.zero.register_external_parameter(module, head.bias)
