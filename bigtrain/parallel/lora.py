"""LoRA adapters (peft) put on a plain module from outside the model: the family knows nothing of them.

`apply_lora` runs where the engine builds the module, before `deepspeed.initialize`. peft's
`inject_adapter_in_model` swaps each target layer for a LoRA layer in place, so the module keeps its class
(`LlamaForCausalLM`, ...) and everything bigtrain does with it (loss, activation checkpointing, the sample's
`generate`) still works; the base weights are frozen, and the engine gives the optimizer only what still needs
a gradient, so optimizer states (and ZeRO's gradient partitions) exist for the adapters alone.

Under ZeRO-3 the base was built inside `zero.Init` and is partitioned already, as the HF Trainer's is when it
calls `get_peft_model` after `from_pretrained`: peft reads each layer's real shape from `in_features` /
`ds_shape`, and the adapters it creates are ordinary tensors that `deepspeed.initialize` partitions in turn
(DeepSpeed converts every parameter zero.Init did not see). They are drawn under their own seed, so every rank
and every ZeRO stage starts from the same adapters.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigtrain.config.run_config import LoraConfig
from bigtrain.models.spec import ModelSpec

log = logging.getLogger("bigtrain")
ADAPTER = "default"  # peft's adapter name; its tensors are `<layer>.lora_A.default.weight`
ALL_LINEAR = "all-linear"
_SEED_OFFSET = 0x10A  # the adapters' seed differs from the base weights' (same run seed)


@dataclass(frozen=True)
class LoraCounts:
    """What `apply_lora` did: adapted layers and trainable vs all parameters (whole shapes under ZeRO-3)."""

    r: int
    layers: int
    trainable: int
    total: int
    frozen_matmul: int  # frozen parameters that take part in a matmul (not embedding lookups)

    @property
    def line(self) -> str:
        share = 100.0 * self.trainable / max(self.total, 1)
        return (f"LoRA r={self.r} on {self.layers} layers: {self.trainable:,} trainable parameters ({share:.2f}% of "
                f"{self.total / 1e6:.2f}M); the base weights are frozen")


def enabled(cfg: LoraConfig | None) -> bool:
    return cfg is not None and cfg.r > 0


def check_lora(spec: ModelSpec, cfg: LoraConfig | None, pipeline_stages: int = 1) -> None:
    """ValueError (one line) for a model LoRA is not offered for, before anything is built."""
    if not enabled(cfg):
        return
    if pipeline_stages > 1:
        raise ValueError(f"lora.r={cfg.r} with pipeline.stages={pipeline_stages}: the adapters go on the plain "
                         "module; set pipeline.stages=1 (ZeRO-3 partitions the frozen base instead)")
    if spec.modality not in ("text", "vision") or spec.hf_class is None:
        raise ValueError(f"lora.r={cfg.r}: LoRA is offered for decoders (gpt2, llama, hf causal-LM directories) and "
                         f"vision-language models, not for {spec.family} {spec.modality} models; train every weight "
                         "with lora.r=0")
    if cfg.vision_tower and spec.modality != "vision":
        raise ValueError("lora.vision_tower=true: the model has no vision tower (it is not a vision-language model); "
                         "leave it false")


def peft_config(cfg: LoraConfig, model: nn.Module, vision_language: bool = False) -> Any:
    """peft's LoraConfig for the run's `lora` section. GPT-2's Conv1D layers store their weights transposed
    (fan_in_fan_out); peft would flip that itself with a warning, and the adapter directory must record it. A
    `vision_language` model's adapters go on its language model's layers (and its tower's with lora.vision_tower),
    named in full: peft's all-linear would adapt the tower and the projector too."""
    from peft import LoraConfig as PeftLoraConfig
    conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
    targets = cfg.targets if cfg.targets == ALL_LINEAR else list(cfg.targets)
    if vision_language:
        from bigtrain.models.vlm import lora_targets
        targets = lora_targets(model, targets, cfg.vision_tower)
    return PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                          bias="none", task_type="CAUSAL_LM", fan_in_fan_out=conv1d)


def inject(model: nn.Module, cfg: LoraConfig, seed: int, vision_language: bool = False) -> Any:
    """Put adapters on `model` in place (seeded, the base frozen); returns the peft config that peft completed
    (the `all-linear` shorthand resolved to layer names). ValueError (one line) when no layer matches."""
    from peft import inject_adapter_in_model
    config = peft_config(cfg, model, vision_language)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + _SEED_OFFSET)
        try:
            inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        except ValueError as err:
            names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                            if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
            raise ValueError(f"lora.targets={cfg.targets}: {str(err).splitlines()[0]} (the model's linear layers "
                             f"are named {', '.join(names)})") from None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "base_layer"):  # peft swapped the head for an adapter layer
        raise ValueError(f"lora.targets={cfg.targets}: names the output head; LoRA here adapts the decoder's "
                         "layers only (a tied head is the embedding too): leave it out")
    return config


def apply_lora(model: nn.Module, spec: ModelSpec, cfg: LoraConfig | None, seed: int,
               checkpointing: bool = False) -> LoraCounts | None:
    """Adapters on the built module (any ZeRO stage; partitioned under ZeRO-3), the base frozen; None when
    lora.r is 0. `checkpointing`: activation checkpointing will wrap the blocks."""
    if not enabled(cfg):
        return None
    check_lora(spec, cfg)
    inject(model, cfg, seed, vision_language=spec.modality == "vision")
    if checkpointing:
        # The frozen embedding's output needs no gradient, so a checkpointed block would see no input that
        # does and take the non-reentrant checkpoint, whose recompute meets ZeRO-3's re-partitioned weights
        # (empty); with the embedding's output marked, blocks take the reentrant one (the HF Trainer and TRL do
        # the same for adapters under gradient checkpointing).
        model.enable_input_require_grads()
    from peft.tuners.tuners_utils import BaseTunerLayer
    layers = sum(isinstance(m, BaseTunerLayer) for m in model.modules())
    sizes = {name: (getattr(p, "ds_numel", None) or p.numel(), p.requires_grad) for name, p in model.named_parameters()}
    assert all(grad == (".lora_" in name) for name, (_, grad) in sizes.items()), "only the adapters train"
    trainable = sum(n for n, grad in sizes.values() if grad)
    head = getattr(model.get_output_embeddings(), "weight", None) if hasattr(model, "get_output_embeddings") else None
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is not head}
    frozen_matmul = sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters()
                        if not p.requires_grad and id(p) not in lookups)
    return LoraCounts(cfg.r, layers, trainable, sum(n for n, _ in sizes.values()), frozen_matmul)


def training_flops(spec: ModelSpec, counts: LoraCounts) -> float:
    """Training FLOPs per sample of a LoRA step, for TFLOP/s and MFU: a frozen matmul weight costs 4 per token (its
    forward and the gradient of its input) instead of 6 (no weight gradient), and each adapter parameter 6."""
    return spec.flops_per_sample + spec.tokens_per_sample * (6.0 * counts.trainable - 2.0 * counts.frozen_matmul)


def saved_lora(run_config: dict | None) -> LoraConfig | None:
    """The `lora` section a checkpoint's run trained with (None: every weight trained)."""
    section = (run_config or {}).get("lora") or {}
    cfg = LoraConfig(**section) if section else None
    return cfg if enabled(cfg) else None


def check_same_lora(tag_dir: Path, run_config: dict | None, cfg: LoraConfig | None) -> None:
    """--resume with other adapters than the checkpoint's: DeepSpeed would fail on the parameter names."""
    saved = saved_lora(run_config)
    wanted = cfg if enabled(cfg) else None
    if _shape(saved) != _shape(wanted):
        raise ValueError(f"--resume: {tag_dir} trained {_describe(saved)}, this job asks for "
                         f"{_describe(wanted)}: resume with the lora settings it was trained with, or start a new "
                         "run with another --out")


def _shape(cfg: LoraConfig | None) -> tuple | None:
    """What decides the checkpoint's tensors and their meaning (dropout does not)."""
    return None if cfg is None else (cfg.r, cfg.alpha, str(cfg.targets), cfg.vision_tower)


def _describe(cfg: LoraConfig | None) -> str:
    return "every weight (no LoRA, lora.r=0)" if cfg is None else \
        f"LoRA adapters (lora.r={cfg.r}, lora.alpha={cfg.alpha:g}, lora.targets={cfg.targets})"

