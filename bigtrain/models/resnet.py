"""ResNet 18/34/50/101/152 in plain torch (torchvision's architecture and parameter names).

torchvision is not a dependency (its wheels here are CUDA-only and huge), so the network
is written out here; the state-dict names match torchvision's so its checkpoints load.
ResNet-50 is "v1.5": the stride sits on the bottleneck's 3x3 conv. ResNet-50 with 1000
classes has 25,557,032 parameters, as the reference.

Initial weights follow torchvision (Kaiming-normal convs, BatchNorm 1/0, the default Linear
init) through `init_module`, applied per module by `bigtrain.models.init` seeded by the
module's name, so the plain module, ZeRO-3 and the pipeline stages start equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.models.losses import classification_loss
from bigtrain.models.family import DataFacts, Family
from bigtrain.models.spec import LayerDef, ModelSpec

EXPANSION = {"basic": 1, "bottleneck": 4}


@dataclass(frozen=True)
class ResNetConfig:
    """Shape of a ResNet; every field is also a `build("resnet", ...)` override key."""

    block: str | None = None  # "basic" (18/34) or "bottleneck" (50+)
    layers: tuple[int, ...] | None = None  # blocks per stage, four stages
    num_classes: int = 1000
    cifar_stem: bool = False  # 3x3 stride-1 stem conv and no max-pool, for 32x32 images
    image_size: int | None = None  # side of the square input; default 32 with cifar_stem, else 224
    width: int = 64  # channels after the stem; stage i uses width * 2**i (times 4 for bottleneck outputs)

    def __post_init__(self) -> None:
        if self.block is None or self.layers is None:
            raise ValueError("resnet size 'custom' needs overrides block ('basic'|'bottleneck') and layers "
                             "(four ints), e.g. block='basic', layers=(2, 2, 2, 2)")
        if self.block not in EXPANSION:
            raise ValueError(f"resnet block={self.block!r}: use 'basic' or 'bottleneck'")
        object.__setattr__(self, "layers", tuple(int(n) for n in self.layers))
        if len(self.layers) != 4 or min(self.layers) < 1:
            raise ValueError(f"resnet layers={self.layers}: give four positive block counts, e.g. (3, 4, 6, 3)")
        if self.image_size is None:
            object.__setattr__(self, "image_size", 32 if self.cifar_stem else 224)
        for name in ("num_classes", "image_size", "width"):
            if getattr(self, name) < 1:
                raise ValueError(f"resnet {name}={getattr(self, name)}: must be a positive integer")


def init_module(module: nn.Module) -> None:
    """torchvision's init for one module (its own parameters and BatchNorm statistics)."""
    if isinstance(module, nn.Conv2d):
        nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    elif isinstance(module, nn.BatchNorm2d):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
        module.reset_running_stats()
    elif isinstance(module, nn.Linear):
        module.reset_parameters()


def _conv(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)


class Block(nn.Module):
    """A residual block: basic (two 3x3 convs) or bottleneck (1x1, 3x3 with the stride, 1x1)."""

    def __init__(self, kind: str, c_in: int, channels: int, stride: int) -> None:
        super().__init__()
        c_out = channels * EXPANSION[kind]
        self.kind = kind
        if kind == "basic":
            self.conv1, self.bn1 = _conv(c_in, channels, 3, stride), nn.BatchNorm2d(channels)
            self.conv2, self.bn2 = _conv(channels, channels, 3), nn.BatchNorm2d(channels)
        else:
            self.conv1, self.bn1 = _conv(c_in, channels, 1), nn.BatchNorm2d(channels)
            self.conv2, self.bn2 = _conv(channels, channels, 3, stride), nn.BatchNorm2d(channels)
            self.conv3, self.bn3 = _conv(channels, c_out, 1), nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(_conv(c_in, c_out, 1, stride), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.kind == "bottleneck":
            out = self.bn3(self.conv3(F.relu(out)))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


def _block_plan(cfg: ResNetConfig) -> list[list[tuple[int, int, int]]]:
    """(c_in, channels, stride) of every block, per stage."""
    plan, c_in = [], cfg.width
    for stage, count in enumerate(cfg.layers):
        channels = cfg.width * 2**stage
        stage_plan = []
        for i in range(count):
            stage_plan.append((c_in, channels, 2 if stage > 0 and i == 0 else 1))
            c_in = channels * EXPANSION[cfg.block]
        plan.append(stage_plan)
    return plan


def _features(cfg: ResNetConfig) -> int:
    return cfg.width * 8 * EXPANSION[cfg.block]


class Stem(nn.Module):
    """conv1 + bn1 + relu (+ max-pool unless CIFAR-style): the first pipeline layer."""

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        kernel, stride = (3, 1) if cfg.cifar_stem else (7, 2)
        self.conv1 = nn.Conv2d(3, cfg.width, kernel, stride=stride, padding=kernel // 2, bias=False)
        self.bn1 = nn.BatchNorm2d(cfg.width)
        self.pool = not cfg.cifar_stem

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        return F.max_pool2d(x, 3, 2, 1) if self.pool else x


class Head(nn.Module):
    """Global average pool + the classifier: the last pipeline layer."""

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(_features(cfg), cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet(nn.Module):
    """The plain module, with torchvision's parameter names (conv1, bn1, layer1..4, fc)."""

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        stem = Stem(cfg)
        self.conv1, self.bn1, self.pool = stem.conv1, stem.bn1, stem.pool
        for stage, blocks in enumerate(_block_plan(cfg), start=1):
            setattr(self, f"layer{stage}", nn.Sequential(*(Block(cfg.block, *b) for b in blocks)))
        self.fc = Head(cfg).fc

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(pixel_values)))
        x = F.max_pool2d(x, 3, 2, 1) if self.pool else x
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _convs(cfg: ResNetConfig) -> list[tuple[int, int, int, int]]:
    """(c_in, c_out, kernel, output side) of every conv, walking the network's shapes."""
    side = cfg.image_size
    if cfg.cifar_stem:
        convs = [(3, cfg.width, 3, side)]
    else:
        side = (side - 1) // 2 + 1  # 7x7 stride 2, padding 3
        convs = [(3, cfg.width, 7, side)]
        side = (side - 1) // 2 + 1  # 3x3 max-pool stride 2, padding 1
    for stage in _block_plan(cfg):
        for c_in, ch, stride in stage:
            out_side = (side - 1) // stride + 1  # same for the 3x3 (pad 1) and 1x1 (pad 0) convs
            c_out = ch * EXPANSION[cfg.block]
            if cfg.block == "basic":
                convs += [(c_in, ch, 3, out_side), (ch, ch, 3, out_side)]
            else:
                convs += [(c_in, ch, 1, side), (ch, ch, 3, out_side), (ch, c_out, 1, out_side)]
            if stride != 1 or c_in != c_out:
                convs.append((c_in, c_out, 1, out_side))
            side = out_side
    return convs


def num_params(cfg: ResNetConfig) -> int:
    """Conv weights + BatchNorm weight/bias (one BN per conv) + the classifier."""
    convs = _convs(cfg)
    conv_and_bn = sum(ci * co * k * k + 2 * co for ci, co, k, _ in convs)
    return conv_and_bn + _features(cfg) * cfg.num_classes + cfg.num_classes


def flops_per_sample(cfg: ResNetConfig) -> float:
    """Training FLOPs per image: 3x the forward, a multiply-add counted as 2 FLOPs.

    Counts convolutions and the classifier (what dominates and what FLOP counters count);
    BatchNorm, ReLU, pooling and additions are left out. The backward is taken as twice
    the forward (input and weight gradients), the usual convention; strictly the first
    conv needs no input gradient, so this overcounts by its forward (1% for ResNet-50).
    """
    forward = sum(2 * ci * co * k * k * side * side for ci, co, k, side in _convs(cfg))
    forward += 2 * _features(cfg) * cfg.num_classes
    return 3.0 * forward


def layer_defs(cfg: ResNetConfig) -> list[LayerDef]:
    """Stem, every residual block, head: run in sequence they equal `ResNet`."""
    defs = [LayerDef(Stem, (cfg,), param_map={"conv1.": "conv1.", "bn1.": "bn1."})]
    for stage, blocks in enumerate(_block_plan(cfg), start=1):
        for i, b in enumerate(blocks):
            defs.append(LayerDef(Block, (cfg.block, *b), param_map={"": f"layer{stage}.{i}."}, checkpointable=True))
    defs.append(LayerDef(Head, (cfg,), param_map={"fc.": "fc."}))
    return defs


def image_batch(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """{"pixel_values": [B,3,H,W], "labels": [B]} -> (pixel_values, labels)."""
    if "pixel_values" not in batch or "labels" not in batch:
        raise ValueError(f"resnet batches need keys 'pixel_values' and 'labels'; got {sorted(batch)}")
    return batch["pixel_values"], batch["labels"]


def _blocks(module: ResNet) -> list[tuple[nn.Module, str]]:
    stages = [getattr(module, f"layer{s}") for s in range(1, 5)]
    return [(stage, str(i)) for stage in stages for i in range(len(stage))]


def make_spec(size: str, settings: dict[str, Any]) -> ModelSpec:
    """ResNet spec from merged settings (see `ResNetConfig`)."""
    cfg = ResNetConfig(**settings)
    return ModelSpec(
        family="resnet", size=size, config=cfg,
        construct=lambda: ResNet(cfg), init_module=init_module, eval_metric="accuracy",
        layers=lambda: layer_defs(cfg),
        loss=classification_loss, pipeline_loss=classification_loss,
        batch_to_inputs=image_batch,
        num_params=num_params(cfg), flops_per_sample=flops_per_sample(cfg),
        modality="image", checkpoint_blocks=_blocks,
        image_size=cfg.image_size, num_classes=cfg.num_classes,
    )


def data_overrides(family: Family, size: str, facts: DataFacts, pretrained: str | None) -> dict[str, Any]:
    return {"num_classes": facts.num_classes}


FAMILY = Family(
    name="resnet",
    settings_cls=ResNetConfig,
    sizes={
        "tiny": {"block": "basic", "layers": (1, 1, 1, 1), "width": 16, "cifar_stem": True, "num_classes": 10},
        "18": {"block": "basic", "layers": (2, 2, 2, 2)},
        "34": {"block": "basic", "layers": (3, 4, 6, 3)},
        "50": {"block": "bottleneck", "layers": (3, 4, 6, 3)},
        "101": {"block": "bottleneck", "layers": (3, 4, 23, 3)},
        "152": {"block": "bottleneck", "layers": (3, 8, 36, 3)},
    },
    make=make_spec,
    modality=lambda overrides: "image",
    derive=data_overrides,
)
