"""The frozen models beside the policy: the reference an objective compares with (`objective.reference`), and the
frozen models it declares (`bigtrain.objectives.base.FrozenModel`: a reward model, a teacher). `build_reference`
and `build_frozen_models` are the only places they are made.

- adapters_off: the policy itself with its LoRA adapters switched off: the base, with no second copy (TRL and
  LLaMA-Factory do this for peft models).
- copy: a second model built from the same directory and seed as the policy's start, frozen, in its own
  `deepspeed.initialize` engine without an optimizer, partitioned like the policy at ZeRO-3 (offloaded where the
  policy's parameters are) and whole on each rank below (DeepSpeed-Chat's and OpenRLHF's reference). A declared
  frozen model is the same engine around the model of its own directory.
- precomputed: none while training; the data carries the copy's numbers (`bigtrain.train.reference_logps`, which
  builds that copy before the policy and frees it).

Both live references give the log-probabilities of the same answers, so the same losses.
"""
from __future__ import annotations

import contextlib
import copy as copying
from typing import Any, Iterator

import torch

from bigtrain.models.losses import answer_logps
from bigtrain.models.spec import ModelSpec, call_module, output_logits

DROPPED = ("optimizer", "scheduler", "gradient_clipping", "tensor_parallel", "compile")


class Reference:
    def logps(self, policy: Any, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """Each row's summed answer log-probability; `policy`: the policy's DeepSpeed engine."""
        raise NotImplementedError

    def completion_logits_beside(self, policy: Any, *rows: torch.Tensor) -> torch.Tensor:
        """The logits that predict each completion token (`bigtrain.rollout.forward.completion_logits`'s rows:
        prompt ids and mask, completion ids and mask), without a graph; `policy`: the policy's DeepSpeed engine."""
        raise NotImplementedError


class AdaptersOff(Reference):
    @torch.no_grad()
    def logps(self, policy: Any, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        with adapters_disabled(policy.module):
            return answer_logps(output_logits(call_module(policy, inputs)), labels)[0]

    @torch.no_grad()
    def completion_logits_beside(self, policy: Any, *rows: torch.Tensor) -> torch.Tensor:
        from bigtrain.rollout.forward import completion_logits
        with adapters_disabled(policy.module):
            return completion_logits(policy, *rows)


class FrozenCopy(Reference):
    """`spec`'s model, frozen, in its own forward-only engine partitioned like the policy."""

    def __init__(self, spec: ModelSpec, ds_config: dict, seed: int, directory: str | None = None):
        import deepspeed

        from bigtrain.parallel import build_module
        self.directory = directory  # a declared frozen model's (None: the policy's own start)
        config = reference_config(ds_config)
        zero3 = config["zero_optimization"]["stage"] == 3
        module = build_module(spec, config if zero3 else None, seed=seed)
        for param in module.parameters():
            param.requires_grad_(False)
        self.ds, *_ = deepspeed.initialize(model=module, config=config)
        self.ds.eval()

    @torch.no_grad()
    def logits(self, inputs: Any) -> torch.Tensor:
        return output_logits(call_module(self.ds, inputs))

    def logps(self, policy: Any, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        return answer_logps(self.logits(inputs), labels)[0]

    @torch.no_grad()
    def completion_logits(self, *rows: torch.Tensor) -> torch.Tensor:
        from bigtrain.rollout.forward import completion_logits
        return completion_logits(self.ds, *rows)

    def completion_logits_beside(self, policy: Any, *rows: torch.Tensor) -> torch.Tensor:
        return self.completion_logits(*rows)


def build_reference(kind: str, spec: ModelSpec, ds_config: dict, seed: int) -> Reference | None:
    """The reference of the resolved `objective.reference`: None for none and precomputed (the data carries its
    numbers)."""
    if kind == "adapters_off":
        return AdaptersOff()
    if kind == "copy":
        return FrozenCopy(spec, ds_config, seed)
    assert kind in ("none", "precomputed"), kind
    return None


def build_frozen_models(declared: tuple, settings: Any, spec: ModelSpec, ds_config: dict,
                        seed: int) -> dict[str, FrozenCopy]:
    """Each frozen model an objective declares (`FrozenModel`: the setting naming its directory, its head), built
    from its directory as the policy's directory is (its data's sequence length), in a forward-only engine
    partitioned like the policy. A setting left None holds no model."""
    from bigtrain.models.hf_dir import frozen_model_problem
    from bigtrain.models.registry import build_directory
    built = {}
    for frozen in declared:
        directory = frozen.directory(settings)
        if directory is not None:
            if problem := frozen_model_problem(directory, frozen.setting, frozen.head):
                raise ValueError(problem)
            with transformers_zero3_off():  # its shape is read on the meta device (bigtrain.models.hf_common)
                model = build_directory(directory, spec.seq_len, frozen.head, f"objective.{frozen.setting}")
            built[frozen.setting] = FrozenCopy(model, ds_config, seed, directory)
    return built


@contextlib.contextmanager
def transformers_zero3_off() -> Iterator[None]:
    """transformers' `is_deepspeed_zero3_enabled()` False inside, as it was after. A ZeRO-3 policy built before
    leaves it on (its HfDeepSpeedConfig lives with the module), and then the meta-device build of a sequence
    classifier (a reward model) initialises its inner model's weights through ZeRO-3's gathers, which meta tensors
    cannot take; FrozenCopy builds the real one under zero.Init itself."""
    from transformers.integrations import deepspeed as hf_deepspeed
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def reference_config(ds_config: dict) -> dict:
    """The policy's DeepSpeed dict for an engine that only runs forward passes: no optimizer or scheduler, ZeRO-3
    (with its parameter offload) where the policy partitions its parameters, else stage 0."""
    config = {k: copying.deepcopy(v) for k, v in ds_config.items() if k not in DROPPED}
    zero = config.get("zero_optimization") or {}
    if zero.get("stage", 0) == 3:
        config["zero_optimization"] = {k: v for k, v in zero.items() if k != "offload_optimizer"}
    else:
        config["zero_optimization"] = {"stage": 0}
    for monitor in ("tensorboard", "csv_monitor", "wandb", "comet"):
        config.pop(monitor, None)
    return config


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module) -> Iterator[None]:
    """peft's adapter layers in `module` switched off for the duration (the base weights alone)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    assert layers, "objective.reference=adapters_off on a model without LoRA adapters"
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
