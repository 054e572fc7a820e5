"""What a benchmark job trains: a workload (model, data, batch, precision) under a strategy
(ZeRO stage, offload, activation checkpointing, pipeline), by one runner (bigtrain or a baseline).

A case turns into the run-config overrides bigtrain gets; the baselines get the same model
(built from `spec_kwargs`), the same synthetic data and the same DeepSpeed config.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bigtrain.config.rules import Layout, check_layout

RUNNERS = ("bigtrain", "deepspeed", "ddp", "nanogpt")
OFFLOADS = ("none", "optimizer", "all")  # all = optimizer and parameters (ZeRO-3 only)
PROMPTS_FILE = "prompts.jsonl"  # an online-RL case's data, in its job's folder (bench/online.py writes it)


@dataclass(frozen=True)
class Workload:
    """A model with its data shape, batch and precision: the part that every strategy shares."""

    name: str
    family: str  # a family that trains on text or images (synthetic data: tokens or pictures)
    size: str = "custom"
    overrides: dict = field(default_factory=dict)  # model.overrides (shape)
    seq_len: int = 256  # gpt2 tokens per sample
    vocab_size: int = 50257  # gpt2: the real GPT-2 vocabulary, so the output head has its real cost
    image_size: int = 32  # resnet
    num_classes: int = 10  # resnet
    micro_batch: int = 4
    precision: str = "bf16"
    # text models: rows padded to a multiple of this. Stated for every runner: bigtrain pads to 64 by default
    # on a GPU (models.registry.model_overrides), and the baselines must build the same model.
    vocab_multiple: int = 1

    def __post_init__(self) -> None:
        if self.modality not in ("text", "image"):
            raise ValueError(f"bench workload {self.name}: family {self.family!r} trains on {self.modality} data; "
                             "the bench feeds synthetic tokens or images")

    @property
    def modality(self) -> str:
        from bigtrain.models.registry import modality
        return modality(self.family, self.overrides)

    def spec_kwargs(self) -> dict[str, Any]:
        """`models.build(family, size, **spec_kwargs)`: the model bigtrain builds for this workload (the data's
        shape decided as the runner decides it, the padding stated)."""
        from bigtrain.models.registry import DataFacts, model_overrides
        facts = DataFacts(seq_len=self.seq_len, vocab_size=self.vocab_size, num_classes=self.num_classes)
        return model_overrides(self.family, self.size, facts, None, self.model_overrides(), "cpu")

    def model_overrides(self) -> dict[str, Any]:
        """model.overrides for bigtrain: the shape, and for an image model the image side its FLOPs count uses."""
        if self.modality == "image":
            return {"image_size": self.image_size, **self.overrides}
        from dataclasses import fields
        from bigtrain.models.registry import family
        if "vocab_multiple" not in {f.name for f in fields(family(self.family).settings_cls)}:
            return dict(self.overrides)  # a family that never pads (Llama's vocabulary is a multiple of 64)
        return {"vocab_multiple": self.vocab_multiple, **self.overrides}


@dataclass(frozen=True)
class Strategy:
    """How the work is split: ZeRO stage, CPU offload, activation checkpointing, pipeline stages."""

    zero: int = 1
    offload: str = "none"
    checkpointing: bool = False
    pipeline: int = 1

    def __post_init__(self) -> None:
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload {self.offload!r}: use one of {', '.join(OFFLOADS)}")
        check_layout(Layout(self.zero, "cpu" if self.offload != "none" else "none",
                            "cpu" if self.offload == "all" else "none", self.pipeline))

    @property
    def label(self) -> str:
        parts = [f"pp{self.pipeline}"] if self.pipeline > 1 else []
        parts.append(f"z{self.zero}")
        if self.offload != "none":
            parts.append("off-opt" if self.offload == "optimizer" else "off-opt+param")
        if self.checkpointing:
            parts.append("ac")
        return " ".join(parts)


@dataclass(frozen=True)
class Case:
    """One job: a workload under a strategy, run by `runner` for `steps` optimizer steps."""

    workload: Workload
    strategy: Strategy
    runner: str = "bigtrain"
    steps: int = 22
    group: str = "sweep"  # which table it belongs to: sweep | ratio | efficiency | settings
    setting: str = ""  # a named change to the ranks' environment (settings group), e.g. "no core binding"
    env: tuple[tuple[str, str], ...] = ()  # that change: variables set for this job only
    sets: tuple[tuple[str, str], ...] = ()  # run-config overrides on top of the strategy's, e.g. ZeRO-3 tuning
    ds_sets: tuple[tuple[str, Any], ...] = ()  # DeepSpeed-config keys (dotted) set after generation, for every runner
    base: str = ""  # lever rows: the workload whose bigtrain defaults this row is compared with (default: its own)
    prompts: int = 0  # online RL: this many prompt records (bench/online.py), written into the job's folder as its data

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner {self.runner!r}: use one of {', '.join(RUNNERS)}")

    @property
    def name(self) -> str:
        return f"{self.workload.name} {self.strategy.label} {self.runner}" + (f" {self.setting}" if self.setting else "")

    @property
    def slug(self) -> str:
        return "-".join(re.sub(r"[^\w.-]+", " ", self.name.replace("+", "_")).split())

    def run_overrides(self, folder: Path | None = None) -> list[str]:
        """`--set` overrides for bigtrain/run.py (the baselines read the same run config); a case with `prompts`
        reads them from `folder` (the job's)."""
        w, s = self.workload, self.strategy
        sets = {
            "model.family": w.family, "model.size": w.size, "data.source": "synthetic", "precision": w.precision,
            "train.steps": self.steps, "batch.micro_batch": w.micro_batch, "zero.stage": s.zero,
            "activation_checkpointing.enabled": str(s.checkpointing).lower(), "pipeline.stages": s.pipeline,
            # A benchmark times training steps only: no evaluation, no sample, plain log lines.
            "train.eval_interval": 0, "train.eval_batches": 0, "train.sample_tokens": 0,
            "logging.progress_bar": "false", "checkpoint.at_end": "false",
        }
        if s.pipeline > 1:  # as many samples per step as the data-parallel runs: micro x 2 micro-batches
            sets["batch.grad_accum"] = 2
        if s.offload != "none":
            sets["offload.optimizer"] = "cpu"
        if s.offload == "all":
            sets["offload.param"] = "cpu"
        if w.modality == "text":
            sets.update({"data.seq_len": w.seq_len, "data.vocab_size": w.vocab_size})
        else:
            sets.update({"data.image_size": w.image_size, "data.num_classes": w.num_classes})
        for key, value in w.model_overrides().items():
            sets[f"model.overrides.{key}"] = _yaml(value)
        if self.prompts:
            sets["data.source"] = str(Path(folder or ".") / PROMPTS_FILE)
        sets.update(self.sets)
        return [f"{k}={v}" for k, v in sets.items()]


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value)
